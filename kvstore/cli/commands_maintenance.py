"""Looking after a root: ``init``, ``stats``, ``rm``, ``compact`` and ``verify``."""

from __future__ import annotations

import dataclasses
import shlex
import time
from typing import Any

import click

from . import render as H
from . import render_usage as U
from ._util import (
    ByteSize,
    UserError,
    cmd,
    common,
    emit,
    grace_default,
    json_option,
    open_store,
    opts,
    phase_progress,
    resolve_all,
)

__all__ = ["compact", "init", "rm", "stats", "verify"]


@click.command()
@click.option("--hash", "algo", type=click.Choice(["blake3", "sha256"]), default=None,
              help="Block digest algorithm (default blake3); fixed when the root is created.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="Tokens per token block (default 256); fixed when the root is created.")
@click.option("--shared-group", metavar="GROUP", default=None,
              help="Share the new root with GROUP (setgid directories, group-writable files, "
                   "nothing for others); without it a root is private to its owner.")
@json_option
@common
def init(algo: str | None, block_tokens: int | None, shared_group: str | None,
         as_json: bool) -> None:
    """Create a cache root.

    A new root is private to its owner (directories 0700, files 0600); with
    --shared-group every member of GROUP can save to it, restore from it and compact it.
    On an existing root, checks that --hash, --block-tokens and --shared-group match it.
    """
    from ..local.modes import group_name, modes_of

    root = opts().resolved_root()
    existed = (root / "index" / "data.mdb").exists()
    with open_store(create=True, hash=algo, block_tokens=block_tokens,
                    shared_group=shared_group) as store:
        s = store.local.settings
    modes = modes_of(root)
    group = group_name(modes.group) if modes.group is not None else None
    if as_json:
        emit({"root": str(root), "created": not existed, "hash": s.hash,
              "block_tokens": s.block_tokens, "state_block_bytes": s.state_block_bytes,
              "shared_group": group})
    elif not opts().quiet:
        what = "kvstore root already exists at" if existed else "Created kvstore root at"
        who = f", shared with group {group}" if group else ""
        click.echo(f"{what} {root} ({s.hash}, {s.block_tokens} tokens per block{who})")


@click.command()
@click.option("--reset", is_flag=True,
              help="After showing them, start the since-reset request counts anew.")
@json_option
@common
def stats(reset: bool, as_json: bool) -> None:
    """Show sizes, dedup ratio, budget and the tokens the cache saved.

    Entries (and how many are checkpoints), blocks, logical vs stored bytes, the dedup
    ratio, the byte budget (when one is recorded), unreferenced blocks awaiting compact,
    and the requests served from this root (kvstore serve, PersistentPromptCache,
    Store.restore): the share of their prompt tokens reused, by the tier that gave them
    (memory, this root, the remote), over the root's lifetime and since the last --reset.
    """
    from ..local.gc import DEFAULT_GRACE

    with open_store() as store:
        st = store.stats()
        s = store.local.settings
        zero = store.views.unreferenced_blocks()
        tmp = store.temp_files()
        usage = store.reset_usage() if reset else store.usage()
        ckpts = [e.id for e in store.entries() if e.priority == "checkpoint"]
        ckpt_unique = sum(store.views.unique_bytes(store.views.manifests(ckpts)).values())
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
        "tmp_files": tmp.files, "tmp_bytes": tmp.bytes,
        "tmp_abandoned_files": tmp.abandoned_files, "tmp_abandoned_bytes": tmp.abandoned_bytes,
        "budget_bytes": None,  # a root records no budget: one is given per process
        "hit_rate": st.hits / st.lookups if st.lookups else None,
        "checkpoints": len(ckpts), "checkpoint_unique_bytes": ckpt_unique,
        "requests": usage.to_dict(),
        "reset": reset,
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
        *([("checkpoints", f"{H.format_count(len(ckpts))} of them, "
                           f"{H.format_bytes(ckpt_unique)} in blocks only they hold "
                           "(compact thins them first)")] if ckpts else []),
        ("blocks", H.format_count(st.blocks)),
        ("logical size", f"{H.format_bytes(st.logical_bytes)} (the entries stored separately)"),
        ("stored size", H.format_bytes(st.physical_bytes)),
        ("dedup", f"{H.format_ratio(st.dedup_ratio)} (saves "
                  f"{H.format_bytes(max(st.logical_bytes - st.physical_bytes, 0))})"),
    ]
    if zero:
        rows.append(("unreferenced", _unreferenced_text(zero, held, held_until, DEFAULT_GRACE)))
    if tmp.files:
        rows.append(("temp files", _tmp_text(tmp)))
    saved = U.saved_text(usage.lifetime)
    if usage.reset_at:  # the requests block's columns: the share of each, said here once
        saved += (f"; since the reset ({H.format_age(usage.reset_at)}): "
                  f"{U.saved_text(usage.since_reset)}")
    rows.append(("tokens saved", saved))
    rows.append(("store lookups", U.lookups_text(st.lookups, st.hits, usage.lifetime.requests)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if usage.lifetime.requests:
        lines += ["", *U.usage_lines(usage)]
    if reset:
        lines += ["", "the since-reset request counts start now"]
    click.echo("\n".join(lines))


def _tmp_text(tmp: Any) -> str:
    """``tmp/``: writes in progress, and what writers that are gone left behind."""
    def files(n: int, size: int) -> str:
        return f"{H.plural(n, 'file')}, {H.format_bytes(size)}"

    live = tmp.files - tmp.abandoned_files
    parts = []
    if tmp.abandoned_files:
        parts.append(f"{files(tmp.abandoned_files, tmp.abandoned_bytes)} left by writers that "
                     f"are gone (an interrupted save): '{cmd('compact')}' removes them")
    if live:
        parts.append(f"{files(live, tmp.bytes - tmp.abandoned_bytes)} being written")
    return "; ".join(parts)


def _unreferenced_text(zero: list[tuple[int, int]], held: list[tuple[int, int]],
                       held_until: int | None, grace: float) -> str:
    """What compact frees now and what only ``--grace 0`` would: never a promise it breaks."""
    def blocks(items: list[tuple[int, int]]) -> str:
        return f"{H.plural(len(items), 'block')}, {H.format_bytes(sum(z for z, _ in items))}"

    if held_until is None:
        return f"{blocks(zero)} (freed by '{cmd('compact')}')"
    keep = H.grace_hold(grace, held_until, cmd("compact --grace 0"))
    if len(held) == len(zero):
        return f"{blocks(zero)}, {keep}"
    due = len(zero) - len(held)
    due_bytes = sum(z for z, _ in zero) - sum(z for z, _ in held)
    return (f"{blocks(zero)}: {H.plural(due, 'block')}, {H.format_bytes(due_bytes)} freed by "
            f"'{cmd('compact')}'; {blocks(held)} {keep}")


@click.command()
@click.argument("entries", nargs=-1, required=True, metavar="ENTRY...")
@json_option
@common
def rm(entries: tuple[str, ...], as_json: bool) -> None:
    """Remove entries by id or unique prefix.

    Every ENTRY is checked before anything is removed. Blocks no longer referenced
    are deleted by 'kvstore compact' after the grace period.
    """
    with open_store(writes="remove entries") as store:
        ids = resolve_all(store, entries)  # every id checked before anything is removed
        ms = store.views.manifests(ids)
        uniq = store.views.unique_bytes(ms)
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
                   f"'{cmd('compact')}' deletes them after the grace period")


@click.command()
@click.option("--max-bytes", type=ByteSize(budget=True), default=None, metavar="SIZE",
              help="Evict least recently used entries until the root fits (e.g. 10G, 500MiB).")
@click.option("--namespace-max-bytes", type=ByteSize(budget=True), default=None, metavar="SIZE",
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
    with open_store(writes=None if dry_run else "compact") as store, \
            phase_progress({"evict": "entry", "sweep": "file"}) as bar:
        report = store.compact(max_bytes=max_bytes, namespace_max_bytes=namespace_max_bytes,
                               grace=grace, dry_run=dry_run, progress=bar)
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
                              + H.grace_hold(grace, data["held_until"], cmd("compact --grace 0")))
        once = data["physical_after"] - data["held_bytes"]
        budget = "" if max_bytes is None else (
            f", within --max-bytes {H.format_bytes(max_bytes)}" if once <= max_bytes
            else f", still over --max-bytes {H.format_bytes(max_bytes)}")
        shown["on_disk_then"] = f"{H.format_bytes(once)} once they are freed{budget}"
    if dry_run:
        click.echo("dry run: nothing was changed; compact would do this:")
    if max_bytes is None and namespace_max_bytes is None:
        click.echo("\n".join(_unbudgeted_lines(data, shown.get("held_back"), grace, dry_run)))
        return
    lines = H.render_report(shown, skip_empty=True)
    click.echo("\n".join(lines) if lines else "nothing to do")


def _unbudgeted_lines(data: dict[str, Any], held_back: str | None, grace: float,
                      dry_run: bool) -> list[str]:
    """What a compact without a budget did: no eviction (and how to give a budget), what it
    swept (blocks past the grace, orphan block files, stale temp files) or that there was
    nothing to sweep, and what the root holds now."""
    lines = [f"no budget given, so no entry {'would be' if dry_run else 'was'} evicted "
             f"('{cmd('compact --max-bytes SIZE')}', e.g. 10G, evicts the least recently "
             "used entries until the root fits)"]
    swept = [f"{H.plural(n, what)} ({H.format_bytes(size)})" for n, size, what in (
        (data["freed_blocks"], data["freed_bytes"], "unreferenced block"),
        (data["orphans_removed"], data["orphan_bytes"], "orphan block file"),
        (data["tmp_removed"], data["tmp_bytes"], "stale temp file")) if n]
    if swept:
        lines.append(f"{'would sweep' if dry_run else 'swept'} {', '.join(swept)}")
    else:
        lines.append(f"nothing to sweep: no block unreferenced for over {grace:g} s (the "
                     "grace), no orphan block file, no stale temp file")
    if held_back is not None:
        lines.append(f"unreferenced: {held_back}")
    before, after = data["physical_before"], data["physical_after"]
    if after == before:
        lines.append(f"on disk: {H.format_bytes(after)}")
    elif dry_run:
        lines.append(f"on disk: {H.format_bytes(before)}, {H.format_bytes(after)} after")
    else:
        lines.append(f"on disk: {H.format_bytes(after)}, {H.format_bytes(before)} before")
    return lines


@click.command()
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
    contents are not read. Exits 1 when a problem is found (0 when the store is sound,
    or with --repair when the repair left it sound).
    """
    if dry_run and not repair:
        raise UserError("--dry-run goes with --repair (verify alone changes nothing)")
    after = None
    with open_store(writes="repair" if repair and not dry_run else None) as store, \
            phase_progress({"blocks": "B"}) as bar:
        report = store.verify(read_data=read_data, repair=repair, dry_run=dry_run,
                              progress=bar)
        if repair and not dry_run and not report.sound:  # what the repair left: checked again
            after = store.verify(read_data=False, repair=False, dry_run=False)
        tmp = store.temp_files()
    from ..local.modes import world_readable

    exposed = world_readable(store.root)
    data = H.report_dict(report)
    sound = report.sound
    repaired_sound = None if after is None else after.sound
    if as_json:
        emit({"root": str(store.root), "sound": sound, "dry_run": dry_run, "report": data,
              "sound_after_repair": repaired_sound,
              "tmp_abandoned_files": tmp.abandoned_files,
              "tmp_abandoned_bytes": tmp.abandoned_bytes, "world_readable": exposed})
    else:
        _print_verify(data, sound, repair=repair, dry_run=dry_run, root=str(store.root),
                      after=None if after is None else (after.sound, H.report_dict(after)))
        if tmp.abandoned_files and not opts().quiet:  # not a fault of the store: a note
            click.echo(f"note: tmp/ holds {H.plural(tmp.abandoned_files, 'file')} "
                       f"({H.format_bytes(tmp.abandoned_bytes)}) left by writers that are "
                       f"gone (an interrupted save); '{cmd('compact')}' removes them")
        if exposed and not opts().quiet:  # an old root's modes: a note, never a chmod
            click.echo(f"note: any user of this machine can read {' and '.join(exposed)} "
                       "(the stored prompts' tokens and KV); "
                       f"'chmod -R go-rwx {shlex.quote(str(store.root))}' makes "
                       "the root private (see the README's Trust and security)")
    if not (sound or repaired_sound):
        click.get_current_context().exit(1)


_VERIFY_SKIP = ("entries", "blocks", "bytes_hashed", "data_read", "dry_run", "repaired",
                "quarantined", "dropped_entries", "cut_entries", "orphans_removed", "plan")


def _print_verify(data: dict[str, Any], sound: bool, *, repair: bool, dry_run: bool,
                  root: str, after: tuple[bool, dict[str, Any]] | None = None) -> None:
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
        how = (f"'{cmd('verify --read-data --repair')}' also repairs what that finds" if repair
               else f"'{cmd('verify --read-data')}' hashes every block")
        click.echo(f"note: block contents were not read (only presence, type and size); {how}")
    if repair and not dry_run:
        if not actions:
            if not quiet:
                click.echo("nothing needed repair")
        else:
            click.echo("repair did this:")
    if actions and (dry_run or repair):
        click.echo("\n".join(f"  {line}" for line in actions))
    if after is not None:  # a repair of a store found unsound: what it left, checked again
        left_sound, left = after
        if left_sound:
            click.echo(f"ok: the repair left the store sound (checked again: "
                       f"{H.plural(left['entries'], 'entry', 'entries')}, "
                       f"{H.plural(left['blocks'], 'block')})")
            return
        click.echo("after the repair:")
        click.echo("\n".join(H.render_report(left, skip_empty=True, skip=_VERIFY_SKIP)))
        click.echo(f"kvstore: verify --repair left problems in {root}", err=True)
        return
    if not sound:
        # the repair must see what this run saw: a corrupt block is only found by reading it
        again = cmd("verify --read-data --repair") if data.get("data_read") \
            else cmd("verify --repair")
        hint = "" if repair else f"; '{again}' can fix it"
        click.echo(f"kvstore: verify found problems in {root}{hint}", err=True)
