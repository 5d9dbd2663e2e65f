"""Child processes of the crash and concurrency tests: ``python worker.py <cmd> <json args>``.

Each command prints one JSON line on success. A crash point (``KVSTORE_CRASH_AT``)
SIGKILLs the process where it names, so the parent sees a return code of -9.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.kv import make_cache, matches, open_store, tokens_for  # noqa: E402


def cmd_save(a: dict[str, Any]) -> dict[str, Any]:
    with open_store(a["root"]) as s:
        toks = tokens_for(a["seed"], a["n"], a.get("shared", 0))
        if "start_at" in a:  # line several processes up on one instant
            time.sleep(max(0.0, a["start_at"] - time.time()))
        info = s.save(toks, make_cache(toks))
        return {"id": info.id, "new_bytes": info.new_bytes}


def cmd_delete(a: dict[str, Any]) -> dict[str, Any]:
    with open_store(a["root"]) as s:
        return {"deleted": s.delete(a["id"])}


def cmd_compact(a: dict[str, Any]) -> dict[str, Any]:
    with open_store(a["root"]) as s:
        r = s.compact(max_bytes=a.get("max_bytes"), grace=a.get("grace", 0.0))
        return {"evicted": len(r.evicted), "freed": r.freed_blocks}


def cmd_loop_compact(a: dict[str, Any]) -> dict[str, Any]:
    """compact(grace=0) in a loop until ``until``."""
    n = 0
    with open_store(a["root"]) as s:
        while time.time() < a["until"]:
            s.compact(max_bytes=a.get("max_bytes"), grace=0.0)
            n += 1
    return {"passes": n}


def cmd_reader(a: dict[str, Any]) -> dict[str, Any]:
    """Restore the given seeds for ``seconds`` once ready; every hit must be bit-exact.

    Prints ``ready`` when the store is open, so the parent's race starts only then
    (importing MLX can take seconds on a loaded machine).
    """
    hits = misses = bad = 0
    with open_store(a["root"]) as s:
        print("ready", flush=True)
        until = time.time() + a["seconds"]
        while time.time() < until:
            for seed in a["seeds"]:
                toks = tokens_for(seed, a["n"], a.get("shared", 0))
                cache, length = s.restore(toks)
                if cache is None:
                    misses += 1
                elif matches(cache, toks, length):
                    hits += 1
                else:
                    bad += 1
    return {"hits": hits, "misses": misses, "violations": bad}


def cmd_soak(a: dict[str, Any]) -> dict[str, Any]:
    """Save, restore, delete and compact (grace 0) at random on a small budget."""
    rng = random.Random(a["worker"])
    stats = {
        "saves": 0,
        "hits": 0,
        "misses": 0,
        "violations": 0,
        "deletes": 0,
        "compacts": 0,
        "errors": 0,
    }
    seeds = list(range(a["seeds"]))
    with open_store(a["root"], max_bytes=a["budget"], gc_grace=0.0) as s:
        # each worker runs ``seconds`` from its own start: on a loaded machine the imports
        # of seven processes can take longer than a deadline shared from the parent's clock
        until = time.time() + a["seconds"]
        while time.time() < until:
            seed = rng.choice(seeds)
            toks = tokens_for(seed, 40 + (seed * 37) % 200, shared=rng.choice((0, 48, 96)))
            op = rng.random()
            try:
                if op < 0.35:
                    s.save(toks, make_cache(toks))
                    stats["saves"] += 1
                elif op < 0.8:
                    query = toks + [rng.randrange(1, 30000) for _ in range(rng.randrange(0, 20))]
                    cache, length = s.restore(query)
                    if cache is None:
                        stats["misses"] += 1
                    elif matches(cache, query, length):
                        stats["hits"] += 1
                    else:
                        stats["violations"] += 1
                elif op < 0.9:
                    m = s.lookup(toks)
                    if m is not None:
                        s.delete(m.entry_id)
                        stats["deletes"] += 1
                else:
                    s.compact(max_bytes=a["budget"], grace=0.0)
                    stats["compacts"] += 1
            except Exception as e:  # noqa: BLE001 - the parent counts and shows them
                stats["errors"] += 1
                print(f"worker {a['worker']}: {type(e).__name__}: {e}", file=sys.stderr)
    return stats


def cmd_remote_save(a: dict[str, Any]) -> dict[str, Any]:
    """Save the seeds' token lists in a root with a remote, then push (bounded)."""
    from kvstore.remote import PushStats

    ids = []
    st = PushStats()
    with open_store(a["root"], remote=a["remote"]) as s:
        for seed in a["seeds"]:
            toks = tokens_for(seed, a["n"], a.get("shared", 0))
            ids.append(s.save(toks, make_cache(toks)).id)
            if a.get("push_each"):
                st.add(s.push(a.get("timeout", 120.0)))
        st.add(s.push(a.get("timeout", 120.0)))
    return {"ids": ids, **st.as_dict()}


def cmd_remote_compact(a: dict[str, Any]) -> dict[str, Any]:
    """Compact the remote (grace 0) once, or in a loop until ``until``; a short lease."""
    from kvstore.remote import Remote
    from kvstore.remote.errors import RemoteLeaseError

    r = Remote(a["remote"], lease_seconds=a.get("lease", 20.0), lease_margin=a.get("margin", 2.0))
    passes = evicted = deleted = held = 0
    last: dict[str, Any] = {}
    try:
        while True:
            try:
                rep = r.compact(max_bytes=a.get("max_bytes"), grace=0.0)
                passes += 1
                evicted += len(rep.evicted)
                deleted += rep.blocks_deleted
                last = {"entries": rep.entries, "live": rep.live_bytes, "blocks": rep.blocks}
            except RemoteLeaseError:
                held += 1
            if time.time() >= a.get("until", 0):
                break
    finally:
        r.close()
    return {"passes": passes, "evicted": evicted, "deleted": deleted, "lease_held": held,
            "last": last}


COMMANDS = {
    "save": cmd_save,
    "delete": cmd_delete,
    "compact": cmd_compact,
    "loop-compact": cmd_loop_compact,
    "reader": cmd_reader,
    "soak": cmd_soak,
    "remote-save": cmd_remote_save,
    "remote-compact": cmd_remote_compact,
}

if __name__ == "__main__":
    out = COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(out), flush=True)
