"""Looking at what a root holds: ``ls``, ``show`` and ``tree``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from . import render as H
from ._util import common, emit, json_option, ns_matches, open_store
from .tree import build_forest, render_forest

__all__ = ["ls_", "show", "tree"]


_SORTS: dict[str, Callable[[Any], Any]] = {
    "last-access": lambda e: e.last_access,
    "size": lambda e: e.logical_bytes,
    "tokens": lambda e: e.n_tokens,
    "hits": lambda e: e.hits,
    "created": lambda e: e.created_at,
}


@click.command(name="ls")
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
    no other entry references), last access, hits and eviction priority; when checkpoints
    are listed, what each one is (its depth in the prompt whose prefill saved it, and that
    prompt, its conversation).
    """
    with open_store() as store:
        items = [e for e in store.entries() if ns_matches(e.namespace, namespace)]
        items.sort(key=_SORTS[sort_key], reverse=not reverse)
        ms = store.views.manifests([e.id for e in items])
        uniq = store.views.unique_bytes(ms)
    if as_json:
        emit({"root": str(store.root),
              "entries": [H.entry_json(e, uniq.get(e.id, 0), ms.get(e.id)) for e in items]})
        return
    if not items:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
        return
    headers: tuple[str, ...] = ("ID", "NAMESPACE", "TOKENS", "SIZE", "UNIQUE", "LAST ACCESS",
                                "HITS", "PRIORITY")
    rows: list[tuple[str, ...]] = [
        (H.short_id(e.id), H.ns_label(e.namespace), H.format_count(e.n_tokens),
         H.format_bytes(e.logical_bytes), H.format_bytes(uniq.get(e.id, 0)),
         H.format_age(e.last_access), str(e.hits), e.priority) for e in items]
    infos = [H.checkpoint_info(e, ms.get(e.id)) for e in items]
    if any(infos):
        headers += ("CHECKPOINT",)
        rows = [(*row, H.checkpoint_text(i) if i else "") for row, i in zip(rows, infos,
                                                                              strict=True)]
    click.echo(H.table(headers, rows, right=(2, 3, 4, 6)))


@click.command()
@click.argument("entry")
@click.option("--tokens", "all_tokens", is_flag=True, help="Print every token, not the first 16.")
@json_option
@common
def show(entry: str, all_tokens: bool, as_json: bool) -> None:
    """Show one entry's manifest.

    ENTRY is a full id or a unique prefix of one (at least 4 hex chars).
    """
    from ..catalog import keys as P

    with open_store() as store:
        eid = store.resolve(entry)
        m = store.manifest(eid)
        rec = next((e for e in store.entries() if e.id == eid), None)
        uniq = store.views.unique_bytes({eid: m})[eid]
        refs = store.views.block_refs(m.all_blocks())
    tokens = list(P.tokens_from_le(m.tokens))
    if as_json:
        emit(H.manifest_json(eid, m, tokens, rec, uniq, refs))
    else:
        click.echo("\n".join(H.manifest_lines(eid, m, tokens, rec, uniq, refs,
                                              all_tokens=all_tokens)))


@click.command()
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
        forest = build_forest(entries, store.views.manifests([e.id for e in entries]))
    if as_json:
        emit({"root": str(store.root), "namespaces": [t.to_json() for t in forest]})
    elif not forest:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
    else:
        click.echo(render_forest(forest, ascii_only=not _can_draw()))


def _can_draw() -> bool:
    try:
        "└─│├●◆".encode(sys.stdout.encoding or "ascii")
        return True
    except (UnicodeEncodeError, LookupError):
        return False
