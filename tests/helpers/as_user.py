"""Run store operations as another OS user: ``python as_user.py <json>``.

Started as root, it first does every kind of operation once on a throwaway root (so
each module kvstore imports lazily is loaded while the interpreter's own files can
still be read: they may live where other users cannot), then drops to the given
uid, gid and groups with the given umask, and runs the operations of its argument
in order. Prints one JSON line: the result of each operation.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.kv import make_cache, matches, open_store, tokens_for  # noqa: E402
from kvstore.cli.main import main as cli_main  # noqa: E402


def _try(fn: Any) -> str:
    """'ok', or the errno name of the OSError ``fn`` raised."""
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, type(e).__name__)


def run(op: dict[str, Any]) -> Any:
    root = op.get("root", "")
    kind = op["op"]
    if kind == "cli":
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli_main(op["args"])
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}
    if kind == "save":
        toks = tokens_for(op["seed"], op["n"], op.get("shared", 0))
        with open_store(root) as s:
            info = s.save(toks, make_cache(toks))
        return {"id": info.id, "new_bytes": info.new_bytes, "created": info.created}
    if kind == "restore":
        toks = tokens_for(op["seed"], op["n"], op.get("shared", 0))
        with open_store(root) as s:
            cache, length = s.restore(toks)
        return {"length": length, "exact": cache is not None and matches(cache, toks, length)}
    if kind == "delete":
        with open_store(root) as s:
            return {"deleted": s.delete(op["id"])}
    if kind == "compact":
        with open_store(root) as s:
            r = s.compact(grace=0.0)
        return {"freed_blocks": r.freed_blocks}
    if kind == "link":  # put a symlink in a file's place, as a member of its group can
        p = Path(op["path"])
        p.unlink(missing_ok=True)
        p.symlink_to(op["target"])
        return "ok"
    if kind == "chmod":
        os.chmod(op["path"], int(op["mode"], 8))
        return "ok"
    if kind == "peek":  # what another user's root lets this one do
        p = Path(root)
        return {
            "list": _try(lambda: os.listdir(p)),
            "list_blocks": _try(lambda: os.listdir(p / "blocks")),
            "read_index": _try(lambda: (p / "index" / "data.mdb").read_bytes()),
            "open": _try(lambda: open_store(root, create=False).close()),
        }
    raise ValueError(f"unknown op {kind!r}")


def warm() -> None:
    """Every operation once, as root, on a root of its own (then removed)."""
    d = tempfile.mkdtemp()
    try:
        r = str(Path(d) / "r")
        a = run({"op": "save", "root": r, "seed": 1, "n": 40})
        run({"op": "restore", "root": r, "seed": 1, "n": 40})
        run({"op": "delete", "root": r, "id": a["id"]})
        run({"op": "compact", "root": r})
        run({"op": "peek", "root": r})
        run({"op": "cli", "args": ["--root", str(Path(d) / "c"), "init", "--json"]})
        run({"op": "cli", "args": ["--root", r, "verify", "--json"]})
    finally:
        shutil.rmtree(d)


def main() -> None:
    a = json.loads(sys.argv[1])
    warm()
    os.setgroups(a["groups"])
    os.setgid(a["gid"])
    os.setuid(a["uid"])
    os.umask(a["umask"])
    print(json.dumps([run(op) for op in a["ops"]]))


if __name__ == "__main__":
    main()
