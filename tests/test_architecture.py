"""The package's shape (issue 13, docs/ARCHITECTURE.md): every ``import`` in ``kvstore/``,
at module level, inside functions and under ``TYPE_CHECKING`` alike, is walked; the
tiers depend one way, without a circle; one owner per seam. The
imports of ``tools/`` are walked too: a private name (``_x``) is imported only from
inside the package that holds it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvstore"
TOOLS = PKG.parent / "tools"

#: What each tier may import of kvstore (docs/ARCHITECTURE.md).
#: A module of a tier may always import its own tier.
BASE = {"kvstore.errors", "kvstore._wyhash", "kvstore._vio", "kvstore._crash"}
TIERS: dict[str, set[str]] = {
    "kvstore.errors": set(),
    "kvstore._vio": {"kvstore.errors"},
    "kvstore._crash": set(),
    "kvstore.schema": BASE,
    "kvstore.blocks": BASE,
    "kvstore.index": BASE,
    "kvstore.codecs": BASE | {"kvstore.schema"},
    "kvstore.formats": BASE | {"kvstore.schema", "kvstore.codecs"},
    "kvstore.catalog": BASE | {"kvstore.schema", "kvstore.blocks", "kvstore.codecs"},
    "kvstore.remote": BASE | {"kvstore.schema", "kvstore.blocks", "kvstore.codecs",
                              "kvstore.catalog"},
    "kvstore.store": BASE
    | {"kvstore.schema", "kvstore.blocks", "kvstore.index", "kvstore.codecs", "kvstore.formats",
       "kvstore.catalog", "kvstore.remote"},
}
#: Above the store (cli/, mlx_lm/, bench/, the top-level modules): anything but the index,
#: which only the store composes. The integrations never import the command line.
TOP_FORBIDDEN = {"kvstore.index"}
INTEGRATION_FORBIDDEN = {"kvstore.cli"}

#: Modules that open files, and which files; no other module opens one (so the block
#: files of a root are opened by blocks/ alone).
OPENS_FILES = {
    "kvstore.blocks": "block files and the root's block directories",
    "kvstore.index": "the LMDB environment",
    "kvstore.formats": "mlx-bun v3/v4/v5 files the user names",
    "kvstore.store.local.filesystem": "/proc/mounts, to name the root's filesystem",
    "kvstore.mlx_lm.gguf": "the GGUF file it converts and the model directory it writes",
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
    for t in sorted(TIERS, key=len, reverse=True):
        if name == t or name.startswith(t + "."):
            return t
    return "top"


def _owner(name: str, table: dict[str, str] | set[str]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in table)


def test_the_walk_sees_every_kind_of_import() -> None:
    got = {t for t, _ in _imports("kvstore.store.store")}
    assert "kvstore.store.upkeep.gc" in got and "kvstore.blocks" in got  # relative, from-imports
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


def _tier_errors(name: str, target: str) -> str | None:
    """Why module ``name`` may not import ``target``, or None."""
    tier = _tier(name)
    if not target.startswith("kvstore") or _package(target) == _package(name):
        return None
    if target == "kvstore":
        return None if tier == "top" else "imports the kvstore package itself"
    if tier in TIERS:
        if _tier(target) == tier or _owner(target, TIERS[tier]):
            return None
        return f"({tier}) imports {target}"
    if _owner(target, TOP_FORBIDDEN):
        return f"imports {target}: only the store composes the index"
    if name.startswith("kvstore.mlx_lm") and _owner(target, INTEGRATION_FORBIDDEN):
        return f"imports {target}: an integration never needs the CLI"
    return None


def test_the_tier_check_can_fail() -> None:
    assert _tier_errors("kvstore.blocks.local", "kvstore.store.store")
    assert _tier_errors("kvstore.codecs.base", "kvstore.formats.v3")
    assert _tier_errors("kvstore.cli.main", "kvstore.index")
    assert _tier_errors("kvstore.mlx_lm.serve", "kvstore.cli.render")
    assert _tier_errors("kvstore.store.upkeep.gc", "kvstore")
    assert _tier_errors("kvstore.store.upkeep.gc", "kvstore.blocks") is None


def test_each_tier_imports_only_the_tiers_below() -> None:
    bad = [f"{m}:{line} {why}" for m in sorted(MODULES) for t, line in _imports(m)
           if (why := _tier_errors(m, t))]
    assert not bad, "\n".join(bad)


#: The store's parts, lowest first (docs/ARCHITECTURE.md): a part imports only itself and the
#: parts before it; the facade (``store.py``, ``tiers.py``, ``maintenance.py``, ``views.py``
#: and the rest of ``kvstore.store``) may import them all.
STORE_PARTS = ["kvstore.store.errors", "kvstore.store.local", "kvstore.store.upkeep",
               "kvstore.store.data"]


def _store_part(name: str) -> int:
    for i, part in enumerate(STORE_PARTS):
        if name == part or name.startswith(part + "."):
            return i
    return len(STORE_PARTS)


def test_the_store_part_check_can_fail() -> None:
    assert _store_part("kvstore.store.local.root") < _store_part("kvstore.store.data.saving")
    assert _store_part("kvstore.store.tiers") == len(STORE_PARTS)


def test_the_store_parts_depend_one_way() -> None:
    bad = [f"{m}:{line} imports {t}" for m in sorted(MODULES) if m.startswith("kvstore.store.")
           for t, line in _imports(m)
           if t.startswith("kvstore.store.") and _store_part(t) > _store_part(m)]
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
NOT_FILE_OPENS = ("Store.open", "kvstore.Store.open", "Index.open", "blocks.open")
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
    assert _private_error("kvstore.store.data.reader", "kvstore.codecs._pieces")
    assert _private_error("kvstore.bench.limits", "kvstore.blocks.local._write_all")
    assert _private_error("tools.probe", "kvstore.bench.limits._balanced")
    assert _private_error("tools.probe", "kvstore._vio.pwritev_all")
    assert _private_error("kvstore.formats.v3", "kvstore.formats._v3json") is None
    assert _private_error("kvstore.blocks.local", "kvstore._vio.pwritev_all") is None
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
