"""Issue 27, item 15: the commands that only read or tidy the index never import mlx-lm.

mlx-lm pulls in transformers (about a second on a 2-core machine): ``import kvstore``,
``Store.open`` and ``stats``, ``ls``, ``show``, ``tree``, ``rm``, ``verify`` and
``compact`` need no cache class, so a fresh process running them must leave ``mlx_lm``
(and ``transformers``) out of ``sys.modules``; nor do they need the remote tier (a store
without one) or the mlx-bun file formats. How fast that makes them is a row of
``kvstore bench`` (the ``startup`` group), not a timed test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore import Namespace, Store

_CHECK = textwrap.dedent("""
    import json, sys
    root = sys.argv[1]
    import kvstore
    from kvstore import Store
    with Store.open(root) as store:
        ids = [e.id for e in store.entries()]
    HEAVY = ("mlx_lm", "transformers", "kvstore.remote", "boto3", "kvstore.formats.v3")
    loaded = {"open": sorted(m for m in HEAVY if m in sys.modules)}
    from kvstore.cli import main
    for args in (["stats"], ["ls"], ["show", ids[0]], ["tree"], ["verify", "--read-data"],
                 ["rm", ids[1]], ["compact", "--grace", "0"]):
        code = main(["--root", root, "-q", *args])
        loaded[args[0]] = [code, sorted(m for m in HEAVY if m in sys.modules)]
    print(json.dumps(loaded))
""")


def _root(path: Path) -> Path:
    ns = Namespace(model_id="m")
    with Store.open(path, namespace=ns, block_tokens=16) as store:
        for salt in range(3):
            c = KVCache()
            kv = mx.full((1, 2, 40, 8), float(salt), dtype=mx.float16)
            c.update_and_fetch(kv, kv)
            store.save(list(range(salt, salt + 40)), [c])
    return path


def test_reading_commands_never_import_mlx_lm(tmp_path: Path) -> None:
    root = _root(tmp_path / "root")
    p = subprocess.run([sys.executable, "-P", "-c", _CHECK, str(root)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    assert loaded.pop("open") == []
    assert loaded == {cmd: [0, []] for cmd in
                      ("stats", "ls", "show", "tree", "verify", "rm", "compact")}


def test_a_restore_still_loads_mlx_lm_classes(tmp_path: Path) -> None:
    """The other half: a fresh process that restores gets mlx-lm's own KVCache back."""
    root = _root(tmp_path / "root")
    code = textwrap.dedent("""
        import sys
        from kvstore import Namespace, Store
        assert "mlx_lm" not in sys.modules
        with Store.open(sys.argv[1], namespace=Namespace(model_id="m")) as store:
            cache, n = store.restore(list(range(1, 41)))
        c = cache[0]
        print(type(c).__module__, type(c).__name__, n, c.keys[0, 0, 0, 0].item())
    """)
    p = subprocess.run([sys.executable, "-P", "-c", code, str(root)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["mlx_lm.models.cache", "KVCache", "40", "1.0"]


def test_inspect_and_the_file_commands_help_never_import_mlx_lm(tmp_path: Path) -> None:
    """Issue 38, item 17: ``inspect`` planned a file's layers with mlx-lm's classes (only
    for their ``step``), so it loaded mlx-lm and transformers (seconds); ``import`` and
    ``export`` build mlx-lm cache objects and still do, but not for ``--help``."""
    root = _root(tmp_path / "root")
    with Store.open(root) as store:
        store.export(next(iter(store.entries())).id, tmp_path / "one.v3")
    code = textwrap.dedent("""
        import json, sys
        from kvstore.cli import main
        loaded = {}
        for args in (["inspect", sys.argv[1]], ["inspect", "--help"], ["import", "--help"],
                     ["export", "--help"]):
            try:
                code = main(["-q", *args])
            except SystemExit as e:
                code = e.code
            label = " ".join(args).replace(sys.argv[1], "FILE")
            loaded[label] = [code, sorted(m for m in ("mlx_lm", "transformers")
                                          if m in sys.modules)]
        print(json.dumps(loaded))
    """)
    p = subprocess.run([sys.executable, "-P", "-c", code, str(tmp_path / "one.v3")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "inspect FILE": [0, []], "inspect --help": [0, []], "import --help": [0, []],
        "export --help": [0, []]}
