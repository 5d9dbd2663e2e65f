"""Shared pieces of the command line: options, errors, output, store access."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from . import render as H

if TYPE_CHECKING:
    from ..schema import Manifest, Namespace
    from ..store import Store

F = TypeVar("F", bound=Callable[..., Any])

# compact's default grace, in seconds: kvstore.gc.DEFAULT_GRACE (not imported, so that
# `kvstore --help` does not load the store)
DEFAULT_GRACE = 600.0


class UserError(Exception):
    """A mistake of the caller: one line on stderr, exit status 2."""


class Unavailable(UserError):
    """A subcommand whose backend is not part of this build."""


@dataclasses.dataclass
class Options:
    """Options shared by every command (given before or after the subcommand)."""

    root: Path | None = None
    quiet: bool = False
    debug: bool = False

    def resolved_root(self) -> Path:
        from ..store import default_root

        return self.root if self.root is not None else default_root()


# --- shared options ---------------------------------------------------------------


def _set(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value:  # a subcommand's own flag overrides, an absent one does not reset
            setattr(ctx.ensure_object(Options), name, value)

    return callback


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                            callback=_set("debug"), help="Show the full traceback of an error.")


def common(f: F) -> F:
    """``--root``, ``--quiet`` and ``--debug``, accepted by the group and every command."""
    f = debug_option(f)
    f = click.option("-q", "--quiet", is_flag=True, expose_value=False, callback=_set("quiet"),
                     help="No progress bars or chatter; errors still go to stderr.")(f)
    f = click.option("--root", type=click.Path(path_type=Path), expose_value=False,
                     callback=_set("root"), metavar="DIR",
                     help="Cache root (default: $KVSTORE_ROOT, else the user cache dir).")(f)
    return f


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON object (schema in docs/CLI.md).")


class ByteSize(click.ParamType):  # type: ignore[type-arg]
    """A byte count such as ``10G``, ``500MiB``, ``1.5GB`` or ``1048576``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return H.parse_size(str(value))
        except H.SizeError as e:
            self.fail(str(e), param, ctx)


def opts() -> Options:
    return click.get_current_context().ensure_object(Options)


def emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


@contextmanager
def open_store(create: bool = False, **kwargs: Any) -> Iterator[Store]:
    from ..store import Store

    with Store.open(opts().resolved_root(), create=create, **kwargs) as store:
        yield store


def method(store: Store, name: str, command: str) -> Callable[..., Any]:
    """``store.<name>``, or a clear Unavailable error when this build's Store lacks it."""
    fn = getattr(store, name, None)
    if not callable(fn):
        raise Unavailable(f"'kvstore {command}' is not available in this version "
                          f"(Store.{name} is missing)")
    return fn  # type: ignore[no-any-return]


def backend(module: str, attr: str, command: str) -> Callable[..., Any]:
    """``module.attr``, or a clear Unavailable error when it is not part of this build."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise
        raise Unavailable(f"'kvstore {command}' is not available in this version "
                          f"({module} is missing)") from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise Unavailable(f"'kvstore {command}' is not available in this version "
                          f"({module}.{attr} is missing)")
    return fn  # type: ignore[no-any-return]


def progress_enabled() -> bool:
    """Bars only for a person watching: both streams a terminal and no --quiet."""
    if opts().quiet or not (sys.stdout.isatty() and sys.stderr.isatty()):
        return False
    return importlib.util.find_spec("tqdm") is not None


@contextmanager
def progress(total: int | None, desc: str, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr (or a no-op); yields ``advance(n)``."""
    if not progress_enabled():
        yield lambda n: None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr,
               unit_scale=unit == "B", dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def call_with_progress(fn: Callable[..., Any], desc: str, **kwargs: Any) -> Any:
    """Call a backend, giving it a progress callback when its signature takes one."""
    params = inspect.signature(fn).parameters
    if "progress" not in params:
        return fn(**kwargs)
    with progress(None, desc) as advance:
        return fn(progress=advance if progress_enabled() else None, **kwargs)





# --- namespaces and entries -----------------------------------------------------------




def ns_matches(ns: Namespace, wanted: str | None) -> bool:
    """``MODEL`` matches every ns of a model, ``MODEL/NS`` one (model ids may hold ``/``)."""
    return wanted is None or wanted in (ns.model_id, H.ns_label(ns))


def manifests(store: Store, ids: Sequence[str]) -> dict[str, Manifest]:
    from ..schema import decode_manifest

    out: dict[str, Manifest] = {}
    with store.index.read() as txn:
        for i in ids:
            raw = store.index.get_manifest(bytes.fromhex(i), txn)
            if raw is not None:
                out[i] = decode_manifest(raw)
    return out


def unique_bytes(store: Store, ms: dict[str, Manifest]) -> dict[str, int]:
    """Bytes of the blocks only this entry references (refcount 1)."""
    out: dict[str, int] = {}
    with store.index.read() as txn:
        for i, m in ms.items():
            total = 0
            for d in dict.fromkeys((*m.token_blocks, *m.state_blocks)):
                ref = store.index.get_ref(d, txn)
                if ref is not None and ref.refcount == 1:
                    total += ref.size
            out[i] = total
    return out



def resolve_all(store: Store, ids: Sequence[str]) -> list[str]:
    """Full ids for every argument, before anything is changed."""
    return list(dict.fromkeys(store.resolve(i) for i in ids))
