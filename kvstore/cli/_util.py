"""Shared pieces of the command line: options, errors, output, store access."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .._human import SizeError, parse_budget, parse_size
from . import render as H

if TYPE_CHECKING:
    from ..schema import Namespace
    from ..store import Store

F = TypeVar("F", bound=Callable[..., Any])


class _GraceDefault:
    """compact's ``--grace`` default, kvstore.local.gc.DEFAULT_GRACE, read when click needs
    it (to run compact, or to show ``[default: …]``): importing the store when the command
    line is built would load mlx for every ``kvstore --help``."""

    def __call__(self) -> float:
        from ..local.gc import DEFAULT_GRACE

        return DEFAULT_GRACE

    def __str__(self) -> str:
        return str(self())


grace_default = _GraceDefault()


class UserError(Exception):
    """A mistake of the caller: one line on stderr, exit status 2."""


@dataclasses.dataclass
class Options:
    """Options shared by every command (given before or after the subcommand)."""

    root: Path | None = None
    remote: str | None = None
    quiet: bool = False
    debug: bool = False

    def resolved_root(self) -> Path:
        from ..store import default_root

        return self.root if self.root is not None else default_root()

    def command(self, args: str, *, remote: bool = False) -> str:
        """``kvstore ARGS`` as a hint spells it: with the ``--root`` (and, for a command that
        uses the remote, the ``--remote``) this run was given, so it acts where this one did."""
        words = ["kvstore", args]
        if self.root is not None:
            words.append(f"--root {shlex.quote(str(self.root))}")
        if remote and self.remote:
            words.append(f"--remote {shlex.quote(self.remote)}")
        return " ".join(words)


def cmd(args: str, *, remote: bool = False) -> str:
    """:meth:`Options.command` of this run."""
    return opts().command(args, remote=remote)


# --- shared options ---------------------------------------------------------------


def _set(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value:  # a subcommand's own flag overrides, an absent one does not reset
            setattr(ctx.ensure_object(Options), name, value)

    return callback


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True,
                            callback=_set("debug"), help="Show the full traceback of an error.")


def no_root(f: F) -> F:
    """``--quiet`` and ``--debug`` alone: for the commands that touch no root (``inspect``,
    ``model fetch``), whose help must not offer a ``--root`` that would do nothing."""
    f = debug_option(f)
    return click.option("-q", "--quiet", is_flag=True, expose_value=False,
                        callback=_set("quiet"),
                        help="No progress bars or chatter; errors still go to stderr.")(f)


#: The commands that act on the remote tier: they alone take ``--remote`` (``bench`` has an
#: option of its own of that name, and takes the group's too).
REMOTE_COMMANDS = ("push", "pull", "remote", "serve", "bench")


def common(f: F) -> F:
    """``--root``, ``--quiet`` and ``--debug``, accepted by the group and by every command
    that works on a root."""
    f = no_root(f)
    return click.option("--root", type=click.Path(path_type=Path), expose_value=False,
                        callback=_set("root"), metavar="DIR",
                        help="Cache root (default: $KVSTORE_ROOT, else the user cache "
                             "dir).")(f)


def with_remote(f: F) -> F:
    """:func:`common` and ``--remote``: for the group and the commands that act on the
    remote tier (:data:`REMOTE_COMMANDS`); elsewhere it would do nothing, so it is not
    offered."""
    f = common(f)
    return click.option("--remote", expose_value=False, callback=_set("remote"),
                        metavar="URL",
                        help="The shared remote tier, s3://BUCKET/PREFIX (default: "
                             "$KVSTORE_REMOTE); taken by push, pull, remote, serve and "
                             "bench.")(f)


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON object (schema in docs/CLI.md).")


class ByteSize(click.ParamType):  # type: ignore[type-arg]
    """A byte count such as ``10G``, ``500MiB``, ``1.5GB`` or ``1048576``; with ``budget``,
    a bare number below 1 MiB is refused as a forgotten unit (:func:`parse_budget`)."""

    name = "size"

    def __init__(self, *, budget: bool = False) -> None:
        self.budget = budget

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return (parse_budget if self.budget else parse_size)(str(value))
        except SizeError as e:
            self.fail(str(e), param, ctx)


def opts() -> Options:
    return click.get_current_context().ensure_object(Options)


def emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


class _NoReadOnlyNotice(logging.Filter):
    """Drops the store's "opened read-only" notice: a command that must write says it in its
    one error line instead (a user error is one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "opened read-only" not in record.getMessage()


@contextmanager
def open_store(create: bool = False, *, writes: str | None = None,
               **kwargs: Any) -> Iterator[Store]:
    """The root, open; ``writes`` (what the command is about to do) makes a root that can
    only be read one ``kvstore: error:`` line, before anything is done."""
    from ..store import Store

    kwargs.setdefault("remote", "")  # the commands that use the remote pass it
    quiet = _NoReadOnlyNotice()
    log = logging.getLogger("kvstore")
    if writes is not None:
        log.addFilter(quiet)
    try:
        store = Store.open(opts().resolved_root(), create=create, **kwargs)
    finally:
        log.removeFilter(quiet)
    with store:
        if writes is not None and store.read_only:
            raise UserError(f"{store.root} is read-only here (a read-only filesystem, or "
                            f"another user's root): cannot {writes}")
        yield store


def remote_url() -> str:
    """``--remote``, else ``$KVSTORE_REMOTE``; a UserError when neither names one."""
    url = opts().remote or os.environ.get("KVSTORE_REMOTE", "")
    if not url:
        raise UserError("no remote: give --remote s3://BUCKET/PREFIX or set KVSTORE_REMOTE")
    return url


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


@contextmanager
def phase_progress(units: dict[str, str]) -> Iterator[Callable[[str, int, int], None]]:
    """tqdm bars on stderr (or a no-op) for a store call's ``progress(phase, done, total)``:
    one bar per phase, in the unit ``units`` gives it (``B`` shows sizes)."""
    if not progress_enabled():
        yield lambda phase, done, total: None
        return
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(phase: str, done: int, total: int) -> None:
        bar = bars.get(phase)
        if bar is None:
            unit = units.get(phase, "it")
            bar = bars[phase] = tqdm(total=total, desc=phase, unit=unit, leave=False,
                                     file=sys.stderr, unit_scale=unit == "B",
                                     dynamic_ncols=True)
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        for bar in bars.values():
            bar.close()


# --- namespaces and entries -----------------------------------------------------------


def ns_matches(ns: Namespace, wanted: str | None) -> bool:
    """``MODEL`` matches every ns of a model, ``MODEL/NS`` one (model ids may hold ``/``)."""
    return wanted is None or wanted in (ns.model_id, H.ns_label(ns))


def resolve_all(store: Store, ids: Sequence[str]) -> list[str]:
    """Full ids for every argument, before anything is changed."""
    return list(dict.fromkeys(store.resolve(i) for i in ids))


def oserror_line(e: OSError) -> str:
    """An OSError in one line: ``FILE: reason`` when it names its file."""
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)
