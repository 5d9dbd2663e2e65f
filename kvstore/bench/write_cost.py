"""The model group's write cost: a 6-turn chat through ``kvstore serve`` on a real model.

``kvstore serve`` runs as users run it (a subprocess on 127.0.0.1, mlx-lm's own server and
its segment and reply snapshots), once with the default write-behind (a snapshot that adds
no whole token block waits and is replaced by its conversation's next one) and once with
``--defer-seconds 0`` (every snapshot written at once, as before issue 28). Each run gets
the bench's conversation (the system prompt and `TURNS`, the whole history per request,
greedy replies of `REPLY_TOKENS`) in a fresh root, and is stopped with SIGTERM, which
writes what waits. Bytes written are the root's block bytes afterwards (a fresh root
where nothing is evicted: every block file was written once); the unique KV bytes are the
logical bytes of the final conversation's entry (each of its tokens once). The figures are
deterministic: greedy decoding, the same tokens every run.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..store import Store
from .common import Row
from .servers import server

Log = Callable[[str], None]
MODES: dict[str, list[str]] = {"deferred (default)": [],
                               "every snapshot at once": ["--defer-seconds", "0"]}


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read()))


def serve_chat(model_dir: Path, root: Path, extra: list[str], system: str,
               turns: tuple[str, ...], reply_tokens: int, log_file: Path) -> list[dict[str, int]]:
    """Run the conversation through a fresh ``kvstore serve`` on ``root``; each turn's usage."""
    args = ["--root", str(root), "--model", str(model_dir), "--min-tokens", "32",
            "--log-level", "INFO", *extra]
    usage = []
    with server("kvstore.serve", args, log_file) as port:
        history = [{"role": "system", "content": system}]
        for user in turns:
            history.append({"role": "user", "content": user})
            r = _post(port, {"messages": history, "max_tokens": reply_tokens,
                             "temperature": 0.0})
            history.append({"role": "assistant",
                            "content": r["choices"][0]["message"]["content"]})
            u = r["usage"]
            usage.append({"prompt": int(u["prompt_tokens"]), "cached": int(
                (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)})
    return usage


def write_cost_rows(root: Path, model_dir: Path, label: str, system: str,
                    turns: tuple[str, ...], reply_tokens: int, log: Log) -> list[Row]:
    """Bytes written per request and against the final conversation's KV bytes, with the
    default write-behind and with every snapshot written at once."""
    got: dict[str, dict[str, float]] = {}
    root.mkdir(parents=True, exist_ok=True)
    log(f"[model] {label}: write cost of a {len(turns)}-turn chat through kvstore serve")
    for mode, args in MODES.items():
        where = root / mode.split()[0]
        usage = serve_chat(model_dir, where, args, system, turns, reply_tokens,
                           root / f"{mode.split()[0]}.log")
        with Store.open(where, create=False) as store:
            st = store.stats()
            final = max(store.entries(), key=lambda e: e.n_tokens)
            life = store.usage().lifetime
        cached = sum(u["cached"] for u in usage)
        assert life.reused_tokens == cached, (life, usage)  # the root counts what serve said
        got[mode] = {"written": float(st.physical_bytes), "unique": float(final.logical_bytes),
                     "final_tokens": float(final.n_tokens), "entries": float(st.entries),
                     "cached": float(cached), "prompt": float(sum(u["prompt"] for u in usage))}
        log(f"  {mode}: {st.physical_bytes / 2**20:.1f} MiB written in {st.entries} entries, "
            f"{st.physical_bytes / len(turns) / 2**20:.2f} MiB per request; the final "
            f"conversation ({final.n_tokens} tokens) is {final.logical_bytes / 2**20:.1f} MiB: "
            f"{st.physical_bytes / final.logical_bytes:.2f}x")
    after, before = got["deferred (default)"], got["every snapshot at once"]
    n = float(len(turns))
    extra = {"turns": n, "reply_tokens": float(reply_tokens),
             "unique_kv_bytes": after["unique"], "final_tokens": after["final_tokens"],
             "written_after": after["written"], "written_before": before["written"],
             "ratio_after": after["written"] / after["unique"],
             "ratio_before": before["written"] / before["unique"],
             "entries_after": after["entries"], "entries_before": before["entries"],
             "cached_tokens_after": after["cached"], "cached_tokens_before": before["cached"]}
    name = f"{len(turns)}-turn chat through kvstore serve"
    return [
        Row("model", f"{name}, bytes written vs the final conversation's KV bytes ({label})",
            "B", after["written"], after["unique"],
            "the final conversation's own KV bytes (each token once)", "fraction",
            extra=dict(extra)),
        Row("model", f"{name}, bytes written per request ({label})", "B", after["written"] / n,
            before["written"] / n, "every snapshot written at once (--defer-seconds 0)",
            "fraction", extra=dict(extra)),
    ]
