"""Helpers of the CLI tests: run ``python -m kvstore``, fill real roots via the Store API.

Every command runs in a subprocess (a fresh process pays ~1 s for importing
mlx), so read-only commands are run in parallel batches against shared roots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore import Namespace, Store

T = 16  # block_tokens of every test root
MODEL = "tiny/llama"
NS_DEFAULT = Namespace(model_id=MODEL, config_fingerprint="cfg", tokenizer_hash="tok")
NS_OTHER = Namespace(model_id=MODEL, config_fingerprint="cfg", tokenizer_hash="tok", ns="other")
NS_GEMMA = Namespace(model_id="tiny/gemma", ns="default")


@dataclass(frozen=True)
class Result:
    """What one ``kvstore`` run printed and returned."""

    args: tuple[str, ...]
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    """Run ``python -m kvstore ARGS`` with no KVSTORE_ROOT unless ``env`` sets one."""
    full = dict(os.environ)
    full.pop("KVSTORE_ROOT", None)
    full.update(env or {})
    argv = tuple(str(a) for a in args)
    p = subprocess.run([sys.executable, "-m", "kvstore", *argv], capture_output=True,
                       text=True, env=full, timeout=120)
    return Result(argv, p.returncode, p.stdout, p.stderr)


def run_many(argsets: Sequence[Sequence[str | Path]]) -> dict[tuple[str, ...], Result]:
    """Run independent read-only commands in parallel; results keyed by their args."""
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as ex:
        results = list(ex.map(lambda a: run(*a), argsets))
    return {r.args: r for r in results}


def assert_user_error(r: Result, *needles: str) -> None:
    """Exit 2, one ``kvstore: error:`` line on stderr, no traceback, nothing on stdout."""
    assert r.code == 2, r
    assert r.out == "", r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("kvstore: error: "), r.err
    assert "Traceback" not in r.err
    for n in needles:
        assert n in lines[0], (n, lines[0])


_BASE: list[mx.array] = []


def kv_cache(n_tokens: int, *, layers: int = 2, salt: int = 0) -> list[Any]:
    """Random fp16 KVCaches (B1 H2 D8) whose first rows are the same for every call.

    Two caches of the same ``salt`` agree on their common prefix, as a causal
    model's would, so entries share their leading token blocks.
    """
    if not _BASE:
        mx.random.seed(7)
        _BASE.extend(mx.random.normal((1, 2, 512, 8)).astype(mx.float16) for _ in range(8))
    out = []
    for layer in range(layers):
        c = KVCache()
        k = _BASE[(2 * layer + salt) % 8][:, :, :n_tokens]
        v = _BASE[(2 * layer + 1 + salt) % 8][:, :, :n_tokens]
        c.update_and_fetch(k, v)
        out.append(c)
    return out


@dataclass
class Root:
    """A populated root and the ids of what was saved in it."""

    path: Path
    ids: dict[str, str] = field(default_factory=dict)


def populate(path: Path) -> Root:
    """Six entries: a shared 32-token system prompt under three branches, two namespaces."""
    root = Root(path)
    system = list(range(1000, 1032))
    with Store.open(path, block_tokens=T, durable=False) as s:
        for name, n, ns, meta in (
            ("a40", 40, NS_DEFAULT, {"purpose": "chat"}),
            ("a64", 64, NS_DEFAULT, {}),
            ("a70", 70, NS_DEFAULT, {}),
            ("a90", 90, NS_DEFAULT, {}),
            ("o48", 48, NS_OTHER, {}),
        ):
            tokens = system + list(range(n - len(system)))
            root.ids[name] = s.save(tokens, kv_cache(n), namespace=ns, metadata=meta,
                                    priority="system" if name == "a40" else "assistant").id
        root.ids["g20"] = s.save(list(range(20)), kv_cache(20, layers=1, salt=3),
                                 namespace=NS_GEMMA).id
    return root


def run_here(*args: str | Path) -> Result:
    """Run the command line in this process (fast; for variants of a command's output)."""
    import contextlib
    import io

    from kvstore.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = tuple(str(a) for a in args)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Result(argv, code, out.getvalue(), err.getvalue())
