"""The package's shape (issue 13, docs/ARCHITECTURE.md): every ``import`` in ``kvstore/``,
at module level, inside functions and under ``TYPE_CHECKING`` alike, is walked; the
tiers depend one way, without a circle; one owner per seam. The
imports of ``tools/`` are walked too: a private name (``_x``) is imported only from
inside the package that holds it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvstore"
TOOLS = PKG.parent / "tools"

#: What each part of kvstore may import of kvstore: the "May import (of kvstore)" column of
#: docs/ARCHITECTURE.md's table, word for word (test_the_doc_states_these_lists checks it).
#: A name ending in ``/`` is a package and every module in it; any other name is that module
#: alone (for a package, its ``__init__``: ``store`` is the names ``kvstore.store`` exports,
#: not its modules); ``kvstore`` is ``import kvstore``. A part may always import itself.
TIERS: dict[str, set[str]] = {
    "kvstore.errors": set(),
    "kvstore._vio": {"errors"},
    "kvstore._crash": set(),
    "kvstore._wyhash": set(),
    "kvstore.schema": {"errors"},
    "kvstore.blocks": {"errors"},
    "kvstore.codecs": {"errors", "schema"},
    "kvstore.formats": {"errors", "_vio", "_wyhash", "schema", "codecs/"},
    "kvstore.catalog": {"errors", "schema", "blocks/", "codecs/"},
    # the LMDB index, a top-level package of the design card, imported by the local tier alone
    "kvstore.index": {"errors"},
    # the local tier, one package
    "kvstore.local": {"errors", "_vio", "_crash", "schema", "blocks/", "codecs/", "catalog/",
                      "index/"},
    "kvstore.remote": {"errors", "_crash", "schema", "blocks/", "codecs/", "catalog/"},
    "kvstore.store": {"errors", "_crash", "schema", "blocks/", "codecs/", "formats/",
                      "catalog/", "remote/", "local", "local.gc", "local.restore",
                      "local.saving", "local.sweep", "local.verify", "local.views"},
    # the agent APIs' adapters (wire types and conversions) and the prefix-stability rules,
    # knowing nothing of mlx-lm
    "kvstore.serving": {"errors"},
    "kvstore.mlx_lm": {"kvstore", "errors", "_crash", "_human", "schema", "codecs/",
                       "formats.errors", "models", "serving/", "store", "store.tenants",
                       "store.tiers", "store.usage"},
    # kvstore serve: the engine, the protocol layer, HTTP and the command (issue 43)
    "kvstore.server": {"kvstore", "_human", "mlx_lm/", "serving/", "store.tenants",
                       "store.tiers"},
    "kvstore.cli": {"kvstore", "errors", "_human", "schema", "codecs.layout", "catalog.keys",
                    "formats.errors", "formats.v3", "remote", "store", "store.usage",
                    "local.gc", "local.modes", "mlx_lm/", "server/", "bench/", "demo",
                    "models"},
    "kvstore.bench": {"kvstore", "errors", "_vio", "schema", "blocks/", "codecs/",
                      "catalog.settings", "remote", "remote.s3", "store", "local",
                      "local.filesystem", "local.staged", "local.writer", "mlx_lm/", "demo",
                      "tiny"},
    "kvstore._human": {"errors"},
    # the model cache: the models kvstore fetches and where they are, without MLX
    "kvstore.models": {"errors"},
    "kvstore.tiny": set(),
    "kvstore.demo": {"kvstore", "errors", "mlx_lm/", "tiny"},
    "kvstore.serve": {"server/"},
    "kvstore.__main__": {"cli/"},
    "kvstore": {"errors", "schema", "formats.errors", "formats.v3", "formats.v5file", "store"},
}
#: What a part may import outside kvstore and the standard library (a part not named here:
#: anything).
THIRD_PARTY: dict[str, set[str]] = {"kvstore.serving": {"msgspec"}}
DOC = PKG.parent / "docs" / "ARCHITECTURE.md"

#: Modules that open files, and which files; no other module opens one (so the block
#: files of a root are opened by blocks/ alone).
OPENS_FILES = {
    "kvstore.local.blocks": "block files and the root's block directories",
    "kvstore.index": "the LMDB environment, its write gate's lock file, /proc/locks",
    "kvstore.local.modes": "the index's files, without following a link, to fchmod",
    "kvstore.formats": "mlx-bun v3/v4/v5 files the user names",
    "kvstore.local.filesystem": "/proc/mounts, to name the root's filesystem",
    "kvstore.mlx_lm.gguf": "the GGUF file it converts and the model directory it writes",
    "kvstore.models": "a converted model directory's marker",
    "kvstore.mlx_lm.prompt_cache": "the model's own files, for its fingerprint",
    "kvstore.mlx_lm.fingerprint": "the model's own files, for its fingerprint",
    "kvstore.cli": "/dev/null, for a child's stdin",
    "kvstore.bench": "the raw files it measures the machine's limits on, its JSON report",
    "kvstore.tiny": "the tiny model's config, beside its weights",
    "kvstore.catalog.signing": "the signing key's file ($KVSTORE_SIGNING_KEY_FILE)",
    "kvstore.codecs.warm": "/proc/meminfo, for the memory available (issue 37)",
}
#: Vectored I/O (``os.preadv``/``os.pwritev``) is written once.
VECTORED_IO = {"kvstore._vio", "kvstore.bench"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    for p in PKG.glob("*.pyi"):  # compiled extensions (their stubs name them)
        out[f"kvstore.{p.stem}"] = p
    return out


MODULES = _modules()


def _is_pkg(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import statement of module ``name``."""
    path = MODULES[name]
    if path.suffix != ".py":
        return
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if _is_pkg(name) else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            yield from ((s, node.lineno) for s in subs)
            if len(subs) < len(node.names):
                yield mod, node.lineno


def _import_nodes(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _edges() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _tier(name: str) -> str:
    """The part of the table module ``name`` belongs to."""
    if name == "kvstore":
        return name
    for t in sorted(TIERS, key=len, reverse=True):
        if t != "kvstore" and (name == t or name.startswith(t + ".")):
            return t
    raise AssertionError(f"{name} is in no part of docs/ARCHITECTURE.md's table")


def _owner(name: str, table: dict[str, str] | set[str]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in table)


def test_the_walk_sees_every_kind_of_import() -> None:
    got = {t for t, _ in _imports("kvstore.store.store")}
    assert "kvstore.local.gc" in got and "kvstore.blocks" in got  # relative, from-imports
    assert "kvstore.formats.bunhash" in MODULES and "kvstore._wyhash" in MODULES
    lazy = {t for t, _ in _imports("kvstore.cli.main")}
    assert "click" in lazy


def test_no_import_circle() -> None:
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    detail = [
        f"{c}: " + "; ".join(f"{v} -> {sorted(edges[v] & set(c))}" for v in c) for c in circles
    ]
    assert not circles, "\n".join(detail)


def _package(name: str) -> str:
    """``kvstore.cli`` for ``kvstore.cli.main``; a top-level module is its own package."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def _allows(allowed: set[str], target: str) -> bool:
    """Whether a part whose list is ``allowed`` may import ``target`` (a module's name)."""
    for a in allowed:
        full = "kvstore" if a == "kvstore" else "kvstore." + a.rstrip("/")
        if target == full or (a.endswith("/") and target.startswith(full + ".")):
            return True
    return False


def _tier_errors(name: str, target: str, table: dict[str, set[str]] | None = None) -> str | None:
    """Why module ``name`` may not import ``target``, or None (``table``: TIERS)."""
    table = TIERS if table is None else table
    if not (target == "kvstore" or target.startswith("kvstore.")):
        return None
    tier = _tier(name)
    if target != "kvstore" and target != tier and _tier(target) == tier:
        return None
    if target == tier or _allows(table[tier], target):
        return None
    return f"({tier}) imports {target}, which its row of docs/ARCHITECTURE.md does not allow"


def test_nothing_imports_mlx_lms_server() -> None:
    """Issue 43: ``kvstore serve`` is a server of its own; mlx-lm is a library to it, and
    nothing of ``mlx_lm.server`` (a demonstration server whose internals change in each
    release) is imported, at module level, in a function or for typing."""
    found = [(m, line) for m in MODULES for t, line in _imports(m)
             if t == "mlx_lm.server" or t.startswith("mlx_lm.server.")]
    assert found == []


def test_the_mlx_lm_server_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from mlx_lm.server import APIHandler\n")
    assert [n for n in _import_nodes(bad) if getattr(n, "module", "") == "mlx_lm.server"]


def test_the_tier_check_can_fail() -> None:
    assert _tier_errors("kvstore.local.blocks", "kvstore.store.store")
    assert _tier_errors("kvstore.local.root", "kvstore.store.errors")
    assert _tier_errors("kvstore.codecs.base", "kvstore.formats.v3")
    assert _tier_errors("kvstore.cli.main", "kvstore.index")
    assert _tier_errors("kvstore.cli.main", "kvstore.index.lmdb_index")
    assert _tier_errors("kvstore.store.store", "kvstore.index")
    assert _tier_errors("kvstore.store.tiers", "kvstore.local.catalog")
    assert _tier_errors("kvstore.store.tiers", "kvstore.local") is None
    assert _tier_errors("kvstore.local.gc", "kvstore.index") is None  # its own part
    assert _tier_errors("kvstore.mlx_lm.metrics", "kvstore.cli.render")
    assert _tier_errors("kvstore.server.app", "kvstore.cli.render")
    assert _tier_errors("kvstore.serving.chat", "kvstore.server.app")
    assert _tier_errors("kvstore.local.gc", "kvstore")
    assert _tier_errors("kvstore.local.gc", "kvstore.blocks") is None
    # above the store: a module the row names, not its siblings; a package's own names
    assert _tier_errors("kvstore.mlx_lm.metrics", "kvstore.store.usage") is None
    assert _tier_errors("kvstore.mlx_lm.metrics", "kvstore.local.gc")
    assert _tier_errors("kvstore.mlx_lm.metrics", "kvstore.store") is None
    assert _tier_errors("kvstore.mlx_lm.metrics", "kvstore.store.store")
    assert _tier_errors("kvstore.demo", "kvstore.cli.main")
    assert _tier_errors("kvstore.serve", "kvstore.store")
    assert _tier_errors("kvstore.tiny", "kvstore")
    assert _tier_errors("kvstore.bench.limits", "kvstore.local.writer") is None
    assert _tier_errors("kvstore.bench.limits", "kvstore.local.reader")
    # a list changed in the table is a list changed in the check
    changed = {**TIERS, "kvstore.demo": {"kvstore", "tiny"}}
    assert _tier_errors("kvstore.demo", "kvstore.mlx_lm.prompt_cache", changed)
    assert _tier_errors("kvstore.demo", "kvstore.mlx_lm.prompt_cache") is None


def _doc_table(text: str) -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's table: each part's name -> the backticked names of its "May
    import (of kvstore)" cell before any ``;`` (what follows is prose: "never `cli`")."""
    rows: dict[str, set[str]] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("| Part | Owns | May import (of kvstore) |"):
            break
    next(lines, None)  # the |---| row
    for line in lines:
        if not line.startswith("|"):
            break
        cells = line.strip().strip("|").split("|")
        part = re.match(r"\s*`([^`]+)`", cells[0])
        assert part, f"a row of the table names no part: {line[:80]}"
        name = part.group(1).removesuffix(".py").rstrip("/")
        key = "kvstore" if name == "__init__" else f"kvstore.{name}"
        rows[key] = set(re.findall(r"`([^`]+)`", cells[-1].split(";")[0]))
    return rows


def test_the_doc_states_these_lists() -> None:
    doc = _doc_table(DOC.read_text(encoding="utf-8"))
    assert doc == TIERS, "\n".join(
        f"{k}: doc {sorted(doc.get(k, ()))} vs test {sorted(TIERS.get(k, ()))}"
        for k in sorted(set(doc) | set(TIERS)) if doc.get(k) != TIERS.get(k))


def test_the_doc_check_can_fail() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert _doc_table(text)["kvstore.serving"] == {"errors"}
    assert _doc_table(text)["kvstore"] == TIERS["kvstore"]
    row = next(ln for ln in text.splitlines() if ln.startswith("| `demo.py` |"))
    changed = _doc_table(text.replace(row, row.replace("`mlx_lm/`, ", "")))
    assert changed["kvstore.demo"] == {"kvstore", "errors", "tiny"} != TIERS["kvstore.demo"]


def test_every_module_is_in_a_part_of_the_table() -> None:
    for m in MODULES:
        _tier(m)  # raises for a module no row of the table holds


def test_each_tier_imports_only_the_tiers_below() -> None:
    bad = [f"{m}:{line} {why}" for m in sorted(MODULES) for t, line in _imports(m)
           if (why := _tier_errors(m, t))]
    assert not bad, "\n".join(bad)


#: The local tier's parts, lowest first (docs/ARCHITECTURE.md): a part imports only itself
#: and the parts before it; the rest of ``kvstore.local`` (the data path, the upkeep, the
#: views) may import them all.
LOCAL_PARTS = ["kvstore.local.errors", "kvstore.local.blocks",
               "kvstore.local.filesystem", "kvstore.local.modes", "kvstore.local.catalog",
               "kvstore.local.root"]


def _local_part(name: str) -> int:
    for i, part in enumerate(LOCAL_PARTS):
        if name == part or name.startswith(part + "."):
            return i
    return len(LOCAL_PARTS)


def test_the_local_part_check_can_fail() -> None:
    assert _local_part("kvstore.local.blocks") < _local_part("kvstore.local.catalog")
    assert _local_part("kvstore.local.root") < _local_part("kvstore.local.saving")
    assert _local_part("kvstore.local.gc") == len(LOCAL_PARTS)


def test_the_local_parts_depend_one_way() -> None:
    bad = [f"{m}:{line} imports {t}" for m in sorted(MODULES) if m.startswith("kvstore.local.")
           for t, line in _imports(m)
           if t.startswith("kvstore.local.") and _local_part(t) > _local_part(m)]
    assert not bad, "\n".join(bad)


def _index_users(edges: dict[str, set[str]]) -> list[str]:
    """The modules outside ``kvstore.local`` (and the index itself) that import the index
    (``edges``: module -> the modules it imports)."""
    return sorted(m for m, ts in edges.items()
                  if _package(m) not in ("kvstore.local", "kvstore.index")
                  and any(t == "kvstore.index" or t.startswith("kvstore.index.")
                          for t in ts))


def test_nothing_outside_the_local_tier_imports_its_index() -> None:
    """Issues 35 and 45: the LMDB index is the top-level package ``kvstore/index/`` (the
    design card's layout), and only the local tier imports it: everything else reaches it
    through the local tier's catalog and root, whose package exports the index's record
    types (``EntryRecord``, ``now_ms``), never ``Index``."""
    assert MODULES["kvstore.index"] == PKG / "index" / "__init__.py"
    assert not any(m.startswith("kvstore.local.index") for m in MODULES)
    assert _index_users({m: {t for t, _ in _imports(m)} for m in MODULES}) == []
    assert _index_users({"kvstore.store.store": {"kvstore.index.lmdb_index"},
                         "kvstore.cli.main": {"kvstore.index"},
                         "kvstore.index.lmdb_index": {"kvstore.index.records"},
                         "kvstore.local.root": {"kvstore.index"}}) == ["kvstore.cli.main",
                                                                       "kvstore.store.store"]
    import kvstore.local

    assert "Index" not in kvstore.local.__all__ and not hasattr(kvstore.local, "Index")


def test_tiers_import_only_the_libraries_they_may() -> None:
    import sys

    bad = [f"{m}:{line} imports {t}" for m in sorted(MODULES) for t, line in _imports(m)
           if (allowed := THIRD_PARTY.get(_tier(m))) is not None
           and not t.startswith("kvstore") and t.split(".")[0] not in sys.stdlib_module_names
           and t.split(".")[0] not in allowed and t != "__future__"]
    assert not bad, "\n".join(bad)


def test_lmdb_is_imported_by_the_index_alone() -> None:
    bad = [f"{m}:{line}" for m in MODULES for t, line in _imports(m)
           if t.split(".")[0] == "lmdb" and not m.startswith("kvstore.index")]
    assert not bad, bad


def _calls(name: str) -> Iterator[tuple[str, int]]:
    """Dotted names of the calls in module ``name`` (``os.open``, ``open``, ``x.open``)."""
    path = MODULES[name]
    if path.suffix != ".py":
        return
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                yield f.id, node.lineno
            elif isinstance(f, ast.Attribute):
                names = [f.attr]
                v = f.value
                while isinstance(v, ast.Attribute):
                    names.append(v.attr)
                    v = v.value
                names.append(v.id if isinstance(v, ast.Name) else "?")
                yield ".".join(reversed(names)), node.lineno


#: ``X.open(...)`` calls that open no file (or ask the owner to open one).
NOT_FILE_OPENS = ("Store.open", "kvstore.Store.open", "Root.open", "Index.open", "blocks.open")
FILE_CALLS = ("open", "os.open", "io.open", "os.fdopen", "tempfile.mkstemp",
              "tempfile.NamedTemporaryFile")
FILE_METHODS = (".open", ".read_bytes", ".write_bytes", ".read_text", ".write_text")


def _opens_a_file(call: str) -> bool:
    if call.endswith(NOT_FILE_OPENS):
        return False
    return call in FILE_CALLS or call.endswith(FILE_METHODS)


def test_the_open_check_can_fail() -> None:
    assert _opens_a_file("os.open") and _opens_a_file("open") and _opens_a_file("path.open")
    assert _opens_a_file("self.root.read_bytes")
    assert not _opens_a_file("self.blocks.open") and not _opens_a_file("Store.open")


def test_files_are_opened_by_their_owners_alone() -> None:
    bad = [f"{m}:{line} calls {call}" for m in sorted(MODULES) if not _owner(m, OPENS_FILES)
           for call, line in _calls(m) if _opens_a_file(call)]
    assert not bad, "\n".join(bad)


def test_vectored_io_is_written_once() -> None:
    bad = [f"{m}:{line} calls {c}" for m in MODULES if not _owner(m, VECTORED_IO)
           for c, line in _calls(m) if c in ("os.preadv", "os.pwritev")]
    assert not bad, bad


#: The modules of ``tools/`` (developer scripts), walked for their imports of kvstore.
TOOL_MODULES = {f"tools.{p.stem}": p for p in sorted(TOOLS.glob("*.py"))}


def _imported_names(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every dotted name module ``name`` imports: ``a.b`` for ``import a.b``, ``a.b.c``
    for ``from a.b import c`` (relative imports resolved)."""
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
            continue
        mod = node.module or ""
        if node.level:
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        for a in node.names:
            yield f"{mod}.{a.name}", node.lineno


def _private_error(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target`` (a dotted name), or None.

    A name starting with ``_`` (not a dunder) is private to the package that holds it:
    ``kvstore._vio`` to ``kvstore``, ``kvstore.codecs._pieces`` to ``kvstore.codecs``,
    ``kvstore.bench.limits._balanced`` to ``kvstore.bench``.
    """
    parts = target.split(".")
    if parts[0] != "kvstore":
        return None
    for i, part in enumerate(parts):
        if not part.startswith("_") or (part.startswith("__") and part.endswith("__")):
            continue
        owner = ".".join(parts[:i])
        pkg = owner if owner in MODULES and _is_pkg(owner) else owner.rsplit(".", 1)[0]
        if importer != pkg and not importer.startswith(pkg + "."):
            return f"imports {target}, private to {pkg}"
    return None


def test_the_private_check_can_fail() -> None:
    assert _private_error("kvstore.local.reader", "kvstore.codecs._pieces")
    assert _private_error("kvstore.bench.limits", "kvstore.local.blocks._write_all")
    assert _private_error("tools.probe", "kvstore.bench.limits._balanced")
    assert _private_error("tools.probe", "kvstore._vio.pwritev_all")
    assert _private_error("kvstore.formats.v3", "kvstore.formats._v3json") is None
    assert _private_error("kvstore.local.blocks", "kvstore._vio.pwritev_all") is None
    assert _private_error("kvstore.bench.remote_cases", "kvstore.bench.io_cases._label") is None


def test_tools_are_walked() -> None:
    assert "tools.fast_root" in TOOL_MODULES
    got = {t for t, _ in _imported_names("tools.fast_root", TOOL_MODULES["tools.fast_root"])}
    assert "kvstore.Store" in got


def test_private_names_are_imported_from_inside_their_package_only() -> None:
    walked = {**{m: p for m, p in MODULES.items() if p.suffix == ".py"}, **TOOL_MODULES}
    bad = [f"{m}:{line} {why}" for m, p in sorted(walked.items())
           for t, line in _imported_names(m, p) if (why := _private_error(m, t))]
    assert not bad, "\n".join(bad)


#: The modules that delete a remote's objects by key (``client.delete_many``): the block store
#: and the catalog. Every other deletion goes through them (``S3BlockStore.delete_many``,
#: ``RemoteCatalog.remove_many``), as the remote's repair and compaction plans do.
RAW_DELETERS = {"kvstore.remote.blocks", "kvstore.remote.catalog"}


def _raw_delete(call: str) -> bool:
    """Whether a call deletes objects by key: ``delete_many`` on anything but a block store
    (``x.blocks.delete_many``)."""
    parts = call.split(".")
    return parts[-1] == "delete_many" and (len(parts) < 2 or parts[-2] != "blocks")


def test_the_raw_delete_check_can_fail() -> None:
    assert _raw_delete("remote.client.delete_many") and _raw_delete("c.delete_many")
    assert _raw_delete("self.client.delete_many") and _raw_delete("delete_many")
    assert not _raw_delete("remote.blocks.delete_many")
    assert not _raw_delete("remote.catalog.remove_many")
    bad = [c for c, _ in _calls("kvstore.remote.catalog") if _raw_delete(c)]
    assert bad, "the walk sees the catalog's own client.delete_many"


def test_only_the_block_store_and_the_catalog_delete_remote_objects_by_key() -> None:
    bad = [f"{m}:{line} calls {call}" for m in sorted(MODULES) if m not in RAW_DELETERS
           for call, line in _calls(m) if _raw_delete(call)]
    assert not bad, "\n".join(bad)


def test_every_module_of_the_tiers_below_the_top_is_named_in_the_architecture() -> None:
    """Issue 38, item 20: docs/ARCHITECTURE.md left out ``catalog/signing.py``. Each module
    of the packages whose row lists its modules is named there (by its file name)."""
    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(repo))
               for pkg in ("catalog", "remote", "store", "blocks", "local", "codecs")
               for p in sorted((repo / "kvstore" / pkg).rglob("*.py"))
               if p.name != "__init__.py" and f"{p.name}`" not in doc]
    assert missing == []


#: Stores are built whole (issue 35): the names a store and its parts go by. An assignment
#: (``=``, ``+=``, an annotated one with a value, ``setattr``/``delattr``) to an attribute of
#: something reached through one of them (``store.max_bytes``, ``x.store.tiers.deadline``,
#: ``self.tiers.counters``) is refused in every module of ``kvstore/`` and ``tools/``, the
#: store's own package included: what a part needs is given to its constructor
#: (``StoreOptions``, ``Tiers(..., deadline=, counters=)``, ``Remote(..., on_refused=)``).
STORE_PARTS_NAMES = {"store", "tiers", "local", "remote", "catalog", "blocks", "root", "index",
                     "settings", "maintenance", "served", "views", "health"}
#: The classes of a store and its parts: an attribute of a name bound to a call of one (in
#: the same function: ``rem = Remote(url)``, then ``rem.on_refused = ...``) is assigned to
#: only inside the package that defines the class.
STORE_CLASSES = {"Store", "Tiers", "Health", "Root", "Index", "LocalCatalog", "LocalBlockStore",
                 "Maintenance", "Served", "IndexViews", "Remote", "RemoteTier", "RemoteCatalog",
                 "S3BlockStore"}
#: (module, what it assigns) -> why it may.
STORE_ASSIGNMENTS_ALLOWED = {
    ("tools.fast_root", "setattr(index.write)"): "a developer tool that fills a fresh root for "
    "a benchmark batches its commits by swapping one index instance's write, then removes it",
    ("tools.fast_root", "delattr(index.write)"): "the same swap, undone",
}


def _defining_packages() -> dict[str, set[str]]:
    """Each class of STORE_CLASSES -> the packages (``kvstore.store``) that define it."""
    out: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        if p.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name in STORE_CLASSES:
                out.setdefault(node.name, set()).add(_package(m))
    return out


def _chain(node: ast.expr) -> list[str]:
    """The names an expression goes through: ``['x', 'store', 'tiers']`` for
    ``x.store.tiers``, through subscripts and calls (``x.tier('a')[0]``: x, tier)."""
    out: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            if isinstance(node, ast.Name):
                out.append(node.id)
            return out[::-1]


def _flat(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for e in target.elts:
            yield from _flat(e)
    elif isinstance(target, ast.Starred):
        yield from _flat(target.value)
    else:
        yield target


def _store_assignments(module: str, source: str,
                       defined: dict[str, set[str]] | None = None) -> list[tuple[int, str]]:
    """(line, what) for each assignment of module ``module`` (its ``source``) to an attribute
    of a store or of a store's part (STORE_PARTS_NAMES, STORE_CLASSES); ``defined``: where
    each class is defined (:func:`_defining_packages`)."""
    defined = _defining_packages() if defined is None else defined
    pkg = _package(module) if module.startswith("kvstore") else module.split(".")[0]
    tree = ast.parse(source)
    bound: dict[ast.AST, dict[str, str]] = {}  # function -> name -> the class it was made of
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
            names: dict[str, str] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    made = _chain(node.value.func)
                    if made and made[-1] in STORE_CLASSES:
                        for t in node.targets:
                            names.update({e.id: made[-1] for e in _flat(t)
                                          if isinstance(e, ast.Name)})
            bound[fn] = names
    out: list[tuple[int, str]] = []

    def check(fn: ast.AST, line: int, owner: ast.expr, attr: str, how: str) -> None:
        chain = _chain(owner)
        made = bound.get(fn, {}).get(chain[0]) if len(chain) == 1 else None
        if STORE_PARTS_NAMES & set(chain) or (made and pkg not in defined.get(made, ())):
            what = ".".join([*chain, attr])
            out.append((line, f"{how}({what})" if how else what))

    def visit(fn: ast.AST, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else fn
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = [e for t in child.targets for e in _flat(t)]
            elif isinstance(child, ast.AugAssign) or (isinstance(child, ast.AnnAssign)
                                                      and child.value is not None):
                targets = [child.target]
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                  and child.func.id in ("setattr", "delattr") and len(child.args) >= 2):
                name = child.args[1]
                attr = name.value if isinstance(name, ast.Constant) else "?"
                check(fn, child.lineno, child.args[0], str(attr), child.func.id)
            for t in targets:
                if isinstance(t, ast.Attribute):
                    check(fn, child.lineno, t.value, t.attr, "")
            visit(inner, child)

    visit(tree, tree)
    return out


def test_the_store_assignment_check_can_fail() -> None:
    defined = _defining_packages()
    assert defined["Store"] == {"kvstore.store"} and defined["Remote"] == {"kvstore.remote"}
    today = ("def open_store(cls, rem):\n"
             "    store = cls(local)\n"
             "    store.max_bytes = max_bytes\n"
             "    store.tiers.deadline = remote_deadline\n"
             "    store.gc_grace += 1\n"
             "    rem = Remote(url)\n"
             "    rem.on_refused = lambda d: None\n"
             "class Store:\n"
             "    def __init__(self):\n"
             "        self.tiers = Tiers(local)\n"
             "        self.tiers.counters = self.counters\n"
             "        self.clock: int = 0\n"
             "def cache(store):\n"
             "    x.store.tiers.deadline, y = 1, 2\n"
             "    setattr(store.local, 'index', None)\n"
             "    t: float = 0\n"
             "    self.store.blocks.quarantined()\n")
    got = _store_assignments("kvstore.store.opening", today, defined)
    assert got == [(3, "store.max_bytes"), (4, "store.tiers.deadline"),
                   (5, "store.gc_grace"), (7, "rem.on_refused"), (11, "self.tiers.counters"),
                   (14, "x.store.tiers.deadline"), (15, "setattr(store.local.index)")], got
    # the package that defines a class sets up what it builds; a mlx_lm module may not
    assert _store_assignments("kvstore.remote.tier", today, defined)[3:4] == [
        (11, "self.tiers.counters")]
    assert _store_assignments("kvstore.mlx_lm.prompt_cache",
                              "def f(store):\n    store.tiers.deadline = 2.0\n", defined
                              ) == [(2, "store.tiers.deadline")]
    assert _store_assignments("kvstore.mlx_lm.prompt_cache",
                              "def f(store):\n    self.store = store\n    self.deadline = 1\n",
                              defined) == []


def test_nothing_assigns_to_a_store_or_its_parts_after_construction() -> None:
    """Issue 35: stores are built whole; no module of kvstore/ or tools/ sets an attribute of
    a store or of one of its parts (STORE_ASSIGNMENTS_ALLOWED names the exceptions, and
    why)."""
    defined = _defining_packages()
    walked = {**{m: p for m, p in MODULES.items() if p.suffix == ".py"}, **TOOL_MODULES}
    bad = [f"{m}:{line} assigns {what}" for m, p in sorted(walked.items())
           for line, what in _store_assignments(m, p.read_text(encoding="utf-8"), defined)
           if (m, what) not in STORE_ASSIGNMENTS_ALLOWED]
    assert not bad, "\n".join(bad)
