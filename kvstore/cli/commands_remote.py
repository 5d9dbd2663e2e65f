"""The shared remote tier: ``push``, ``pull`` and ``remote init|ls|stats|verify|compact``
(git's ``remote`` is the model). The remote is ``--remote URL``, else ``$KVSTORE_REMOTE``;
endpoint and credentials come from the standard AWS configuration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from . import render as H
from ._util import (
    ByteSize,
    UserError,
    cmd,
    emit,
    json_option,
    open_store,
    opts,
    remote_url,
    with_remote,
)

__all__ = ["pull", "push", "remote_group"]


@contextmanager
def _remote() -> Iterator[Any]:
    from ..remote import Remote

    r = Remote(remote_url())
    try:
        r.client.check_bucket()
        _ = r.settings  # "not a kvstore remote yet" before anything else
        yield r
    finally:
        r.close()


def _say(line: str) -> None:
    if not opts().quiet:
        click.echo(line)


@click.command()
@click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="S",
              help="Give up waiting after S seconds (default: wait until done).")
@click.option("--sign-pulled", is_flag=True,
              help="With a signing key, also sign the entries this root pulled without "
                   "it (by default they are not pushed: nothing checked who wrote them).")
@json_option
@with_remote
def push(timeout: float | None, sign_pulled: bool, as_json: bool) -> None:
    """Upload every local entry the remote lacks (blocks it has are not sent again)."""
    with open_store(remote=remote_url(), push=False) as store:
        st = store.push(timeout, everything=True, sign_pulled=sign_pulled)
        url = str(store.remote)
    if as_json:
        emit({"remote": url, **st.as_dict()})
    else:
        _say(f"pushed {H.plural(st.entries, 'entry', 'entries')} to {url}: "
             f"{H.plural(st.blocks, 'block')} ({H.format_bytes(st.bytes)}) uploaded, "
             f"{st.present} already there")
        for e in st.errors[:5]:
            click.echo(f"  failed: {e}", err=True)
        if st.pulled_unsigned:
            _say(f"not signed: {H.plural(st.pulled_unsigned, 'entry', 'entries')} this root "
                 f"pulled without the signing key (--sign-pulled signs them)")
    if st.failed or st.pending:
        raise UserError(f"{st.failed + st.pending} entries not pushed "
                        f"(run '{cmd('push', remote=True)}' again)")


@click.command()
@click.argument("entries", nargs=-1, metavar="[ENTRY]...")
@json_option
@with_remote
def pull(entries: tuple[str, ...], as_json: bool) -> None:
    """Download remote entries (all, or the ENTRY ids or prefixes given) into this root."""
    with open_store(create=True, writes="pull entries", remote=remote_url(),
                    push=False) as store:
        rep = store.pull(list(entries) or None)
    got = rep.pulled
    if as_json:
        emit({"pulled": [{"id": p.digest.hex(), "n_tokens": p.n_tokens, "blocks": p.blocks,
                          "bytes": p.bytes} for p in got], "failed": rep.failed})
    else:
        for p in got:
            _say(f"{p.digest.hex()[:12]}  {p.n_tokens} tokens  {H.plural(p.blocks, 'block')} "
                 f"({H.format_bytes(p.bytes)}) downloaded")
        _say(f"pulled {H.plural(len(got), 'entry', 'entries')}")
        for i, why in rep.failed.items():
            click.echo(f"  not pulled: {i[:12]}: {why}", err=True)
    if rep.failed:
        raise UserError(f"{H.plural(len(rep.failed), 'entry', 'entries')} could not be pulled")


@click.group("remote", context_settings={"help_option_names": ["-h", "--help"]})
@with_remote
def remote_group() -> None:
    """The shared remote tier: init, ls, stats, verify, compact."""


@remote_group.command("init")
@json_option
@with_remote
def remote_init(as_json: bool) -> None:
    """Record this root's settings (hash, block size) on the remote, if it has none yet."""
    from ..remote import Remote

    url = remote_url()
    with open_store(create=True) as store:
        s = store.local.settings
    r = Remote(url)
    try:
        got, created = r.init(s)  # the root's settings, as the remote's
    finally:
        r.close()
    diff = s.differences(got)
    if as_json:
        emit({"remote": str(r.url), "created": created, "hash": got.hash,
              "block_tokens": got.block_tokens, "state_block_bytes": got.state_block_bytes,
              "matches_root": not diff})
    else:
        what = "Initialised" if created else "Already a kvstore remote:"
        _say(f"{what} {r.url} ({got.hash}, {got.block_tokens} tokens per block)")
    if diff:
        raise UserError(f"{r.url} has other settings than {store.root}: {'; '.join(diff)}")


@remote_group.command("ls")
@json_option
@with_remote
def remote_ls(as_json: bool) -> None:
    """List the remote's entries (newest first; with a signing key, the signed ones)."""
    skipped: list[str] = []
    refused: list[str] = []
    with _remote() as r:
        rows = sorted(r.entries(skipped, refused=refused), key=lambda e: -e.mtime)
    skipped.sort()
    if as_json:
        emit({"remote": str(r.url), "entries": [e.__dict__ for e in rows],
              "skipped": skipped, "refused": refused})
        return
    for e in rows:
        flag = "" if e.complete else "  (push not finished)"
        click.echo(f"{e.id[:12]}  {e.n_tokens:>7} tokens  {H.format_bytes(e.bytes):>9}  "
                   f"{e.model_id}/{e.namespace}{flag}")
    _say(f"{H.plural(len(rows), 'entry', 'entries')} on {r.url}")
    if skipped:
        click.echo(f"skipped {H.plural(len(skipped), 'bad manifest')} "
                   f"('{cmd('remote verify', remote=True)}' says why): "
                   f"{', '.join(h[:12] for h in skipped)}", err=True)
    if refused:
        click.echo(f"refused {H.plural(len(refused), 'manifest')} not signed with the signing "
                   f"key: {', '.join(h[:12] for h in refused)}", err=True)


@remote_group.command("stats")
@json_option
@with_remote
def remote_stats(as_json: bool) -> None:
    """Objects and bytes on the remote, and who holds the GC lease."""
    with _remote() as r:
        st = r.stats()
    if as_json:
        emit(st.as_dict())
        return
    click.echo(f"remote     {st.url} ({st.endpoint})")
    click.echo(f"entries    {st.entries} ({st.manifests} manifests)")
    click.echo(f"blocks     {st.blocks} ({H.format_bytes(st.block_bytes)})")
    click.echo(f"markers    {st.markers}")
    click.echo(f"access     {st.access_objects} objects")
    click.echo(f"gc lease   {st.lease or 'free'}")
    if st.refused is not None:
        click.echo(f"refused    {st.refused} manifests not signed with the signing key")


@remote_group.command("verify")
@click.option("--read-data", is_flag=True, help="Download every block and check its digest.")
@click.option("--repair", is_flag=True, help="Drop bad entries, dangling markers, bad blocks.")
@click.option("--dry-run", is_flag=True, help="With --repair: say what it would do.")
@json_option
@with_remote
def remote_verify(read_data: bool, repair: bool, dry_run: bool, as_json: bool) -> None:
    """Check the remote: manifests, blocks and markers.

    Exits 1 on a problem (0 when the remote is sound, or with --repair when the repair
    left it sound).
    """
    if dry_run and not repair:
        raise UserError("--dry-run goes with --repair (verify alone changes nothing)")
    after = None
    with _remote() as r:
        rep = r.verify(read_data=read_data, repair=repair, dry_run=dry_run)
        if repair and not dry_run and not rep.sound:  # what the repair left: checked again
            after = r.verify(read_data=False, repair=False, dry_run=False)
    if as_json:
        emit({**rep.as_dict(), "sound_after_repair": None if after is None else after.sound})
    else:
        _print_verify(rep)
        if after is not None and after.sound:
            click.echo("ok: the repair left the remote sound (checked again: "
                       f"{H.plural(after.entries, 'entry', 'entries')}, "
                       f"{H.plural(after.blocks, 'block')}, "
                       f"{H.plural(after.markers, 'marker')})")
        elif after is not None:
            click.echo("after the repair:")
            _print_verify(after)
            click.echo(f"kvstore: remote verify --repair left problems on {after.url}",
                       err=True)
    if not (rep.sound or (after is not None and after.sound)):
        click.get_current_context().exit(1)


def _print_verify(rep: Any) -> None:
    checked = (f"{H.plural(rep.entries, 'entry', 'entries')}, {H.plural(rep.blocks, 'block')}, "
               f"{H.plural(rep.markers, 'marker')}")
    if rep.sound:
        _say(f"ok: the remote is sound (checked {checked})")
    else:
        click.echo(f"problems on {rep.url} (checked {checked}):")
        for name, items in (("bad manifests", rep.bad_manifests),
                            ("refused manifests (not signed with the signing key; kept)",
                             rep.refused), ("corrupt blocks", rep.corrupt),
                            ("manifests that misstate a block's size", list(rep.lying)),
                            ("good blocks a manifest misstates (kept)", rep.wrong_size)):
            if items:
                click.echo(f"  {name}: {', '.join(h[:12] for h in items)}")
        for e, bs in rep.missing.items():
            click.echo(f"  entry {e[:12]} misses {H.plural(len(bs), 'block')}")
        if rep.dangling:
            click.echo(f"  {H.plural(rep.dangling, 'marker')} naming no manifest")
    if rep.incomplete:
        _say(f"note: {H.plural(len(rep.incomplete), 'push', 'pushes')} not finished "
             f"(in progress, or stopped: '{cmd('push', remote=True)}' completes them)")
    if not rep.read_data:
        _say("note: block contents were not read; "
             f"'{cmd('remote verify --read-data', remote=True)}' "
             "downloads and hashes every block")
    if rep.repair:
        did = "would drop" if rep.dry_run else "dropped"
        if rep.dropped or rep.deleted_blocks or rep.deleted_markers:
            click.echo(f"repair {did} {H.plural(len(rep.dropped), 'entry', 'entries')}, "
                       f"{H.plural(rep.deleted_blocks, 'block')}, "
                       f"{H.plural(rep.deleted_markers, 'marker')}")
        else:
            _say("nothing needed repair")


@remote_group.command("compact")
@click.option("--max-bytes", type=ByteSize(budget=True), default=None, metavar="SIZE",
              help="Evict least-recently-used entries until the blocks fit (e.g. 50G).")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="S",
              help="Keep unreferenced blocks younger than S seconds (default 3600).")
@click.option("--dry-run", is_flag=True, help="Say what would go; delete nothing.")
@json_option
@with_remote
def remote_compact(max_bytes: int | None, grace: float | None, dry_run: bool,
                   as_json: bool) -> None:
    """Evict from the remote to a budget and delete blocks no entry references."""
    with _remote() as r:
        rep = r.compact(max_bytes=max_bytes, grace=grace, dry_run=dry_run)
    if as_json:
        emit(rep.as_dict())
        return
    verb = "would free" if dry_run else "freed"
    _say(f"{verb} {H.plural(rep.blocks_deleted, 'block')} ({H.format_bytes(rep.bytes_deleted)}),"
         f" evicted {H.plural(len(rep.evicted), 'entry', 'entries')} of {rep.entries}; "
         f"{H.format_bytes(rep.live_bytes)} live"
         + (f"; {rep.young} unreferenced blocks kept within the grace" if rep.young else ""))
    if rep.refused:
        click.echo(f"refused {H.plural(len(rep.refused), 'manifest')} not signed with the "
                   "signing key: kept, with the blocks they name, and counted in no budget",
                   err=True)
    if rep.bad_manifests:
        click.echo(f"skipped {H.plural(len(rep.bad_manifests), 'bad manifest')} (kept; "
                   f"'{cmd('remote verify --repair', remote=True)}' drops them): "
                   + ", ".join(h[:12] for h in rep.bad_manifests[:5]), err=True)
    if rep.access_ignored:
        click.echo(f"ignored {H.plural(rep.access_ignored, 'access record')} that could not "
                   "be parsed", err=True)
