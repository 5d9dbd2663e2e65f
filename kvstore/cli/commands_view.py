"""Looking at what a root holds: ``ls``, ``show`` and ``tree``."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import render as H
from ._util import UserError, common, emit, json_option, ns_matches, open_store
from .tree import build_forest, render_forest

if TYPE_CHECKING:
    from ..schema import Manifest
    from ..store import Entry, Store

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
    items: list[Entry] = []
    uniq: dict[str, int] = {}
    ckpt: dict[str, dict[str, Any]] = {}  # a checkpoint's fields (checkpoint_info)
    with open_store() as store:
        # one pass in id order (the manifests' order in the index), the manifests read a
        # batch at a time: what is kept of an entry is its record and its unique bytes (and
        # a checkpoint's few fields), never its manifest (a root of 100k entries, issue 29)
        for batch in _batched(e for e in store.entries() if ns_matches(e.namespace, namespace)):
            uniq.update(store.views.unique_bytes_of([e.id for e in batch]))
            cids = [e.id for e in batch if e.priority == "checkpoint"]
            if cids:
                ms = store.views.manifests(cids)
                for e in batch:
                    info = H.checkpoint_info(e, ms.get(e.id))
                    if info is not None:
                        ckpt[e.id] = info
            items += batch
    items.sort(key=_SORTS[sort_key], reverse=not reverse)
    if as_json:
        _ls_json(str(store.root), items, uniq, ckpt)
    elif not items:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
    else:
        _ls_table(items, uniq, ckpt)


_BATCH = 1000  # manifests read at a time
_LS_HEADERS = ("ID", "NAMESPACE", "TOKENS", "SIZE", "UNIQUE", "LAST ACCESS", "HITS", "PRIORITY")
_LS_RIGHT = (2, 3, 4, 6)


def _batched(items: Iterable[Entry]) -> Iterator[list[Entry]]:
    it = iter(items)
    while batch := list(itertools.islice(it, _BATCH)):
        yield batch


def _ls_json(root: str, items: list[Entry], uniq: dict[str, int],
             ckpt: dict[str, dict[str, Any]]) -> None:
    """``{"root": ..., "entries": [...]}`` as :func:`emit` writes it, an entry at a time."""
    head = json.dumps({"root": root, "entries": []}, indent=2)
    if not items:
        click.echo(head)
        return
    cut = head.rindex("[]")
    sep = head[:cut] + "["
    for e in items:
        d = H.entry_json(e, uniq.get(e.id, 0))
        if e.id in ckpt:
            d["checkpoint"] = ckpt[e.id]
        item = json.dumps(d, indent=2)
        click.echo(sep + "\n" + "\n".join("    " + line for line in item.splitlines()),
                   nl=False)
        sep = ","
    click.echo("\n  ]" + head[cut + 2 :])


def _ls_table(items: list[Entry], uniq: dict[str, int], ckpt: dict[str, dict[str, Any]]
              ) -> None:
    """:func:`render.table` of the entries, printed a row at a time; a CHECKPOINT column
    when checkpoints are listed."""
    headers: tuple[str, ...] = _LS_HEADERS + (("CHECKPOINT",) if ckpt else ())

    def cells(e: Entry) -> tuple[str, ...]:
        row: tuple[str, ...] = (
            H.short_id(e.id), H.ns_label(e.namespace), H.format_count(e.n_tokens),
            H.format_bytes(e.logical_bytes), H.format_bytes(uniq.get(e.id, 0)),
            H.format_age(e.last_access), str(e.hits), e.priority)
        if ckpt:
            info = ckpt.get(e.id)
            row += (H.checkpoint_text(info) if info else "",)
        return row

    widths = [len(h) for h in headers]
    for e in items:
        for i, c in enumerate(cells(e)):
            widths[i] = max(widths[i], len(c))
    click.echo(H.table_line(headers, widths, _LS_RIGHT))
    for e in items:
        click.echo(H.table_line(cells(e), widths, _LS_RIGHT))


@click.command()
@click.argument("entry")
@click.option("--tokens", "all_tokens", is_flag=True, help="Print every token, not the first 16.")
@click.option("--text", "as_text", is_flag=True,
              help="Also print the tokens as text, decoded by the model's tokenizer (found in "
                   "the model cache or the Hugging Face cache by the entry's model and "
                   "tokenizer hash, or given with --model).")
@click.option("--model", "model_dir", metavar="DIR", default=None,
              type=click.Path(path_type=Path, file_okay=False),
              help="With --text: the model directory whose tokenizer decodes the tokens.")
@json_option
@common
def show(entry: str, all_tokens: bool, as_text: bool, model_dir: Path | None,
         as_json: bool) -> None:
    """Show one entry's manifest.

    ENTRY is a full id or a unique prefix of one (at least 4 hex chars).
    """
    from ..catalog import keys as P

    if model_dir is not None and not as_text:
        raise UserError("--model is for --text (the tokenizer that decodes the tokens)")
    with open_store() as store:
        eid = store.resolve(entry)
        m = store.manifest(eid)
        rec = next((e for e in store.entries() if e.id == eid), None)
        uniq = store.views.unique_bytes({eid: m})[eid]
        refs = store.views.block_refs(m.all_blocks())
    tokens = list(P.tokens_from_le(m.tokens))
    text = decoded(m.namespace, tokens, model_dir) if as_text else None
    if as_json:
        out = H.manifest_json(eid, m, tokens, rec, uniq, refs)
        if text is not None:
            out["text"] = {"tokenizer": str(text[0]), "text": text[1]}
        emit(out)
    else:
        lines = H.manifest_lines(eid, m, tokens, rec, uniq, refs, all_tokens=all_tokens)
        if text is not None:
            at = next(i for i, line in enumerate(lines) if line.startswith("tokens ")) + 1
            lines[at:at] = H.text_lines(text[0], text[1])
        click.echo("\n".join(lines))


def tokenizer_dirs(model_id: str) -> Iterator[Path]:
    """Where a model named ``model_id`` may be on this machine: ``kvstore model fetch``'s
    model cache (a directory of that name) and the Hugging Face cache (a repo of that id)."""
    from ..models import models_dir

    if model_id and "/" not in model_id and model_id not in (".", ".."):
        yield models_dir() / model_id
    try:
        from huggingface_hub import snapshot_download

        yield Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a repo id, or not in the cache
        return


def decoded(ns: Any, tokens: list[int], model_dir: Path | None) -> tuple[Path, str]:
    """``(the model directory, the text)`` of ``tokens``, decoded by the tokenizer of the
    entry's model: ``model_dir``, else the first directory :func:`tokenizer_dirs` finds whose
    tokenizer hash is the namespace's. A UserError when there is none or it does not fit."""
    from ..mlx_lm.fingerprint import fingerprint_model_dir

    def fits(d: Path) -> bool:
        try:
            return bool(ns.tokenizer_hash) and fingerprint_model_dir(d)[1] == ns.tokenizer_hash
        except OSError:
            return False

    if model_dir is not None:
        if not (model_dir / "tokenizer.json").is_file():
            raise UserError(f"--model {model_dir}: no tokenizer.json there")
        if ns.tokenizer_hash and not fits(model_dir):
            raise UserError(f"--model {model_dir}: its tokenizer is not the one this entry was "
                            f"saved with (model {ns.model_id})")
        found: Path | None = model_dir
    else:
        found = next((d for d in tokenizer_dirs(ns.model_id)
                      if (d / "tokenizer.json").is_file() and fits(d)), None)
    if found is None:
        raise UserError(f"--text: the tokenizer of model {ns.model_id!r} is not on this machine "
                        "(not in the model cache nor the Hugging Face cache); --model DIR names "
                        "its directory")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(found / "tokenizer.json"))
    return found, str(tok.decode(tokens, skip_special_tokens=False))


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
        entries = (e for e in store.entries() if ns_matches(e.namespace, namespace))
        forest = build_forest(_with_manifests(store, entries))
    if as_json:
        emit({"root": str(store.root), "namespaces": [t.to_json() for t in forest]})
    elif not forest:
        click.echo("no entries" + (f" in namespace {namespace!r}" if namespace else ""))
    else:
        click.echo(render_forest(forest, ascii_only=not _can_draw()))


def _with_manifests(store: Store, entries: Iterable[Entry]) -> Iterator[tuple[Entry, Manifest]]:
    """Each entry with its manifest, the manifests read ``_BATCH`` at a time."""
    for batch in _batched(entries):
        ms = store.views.manifests([x.id for x in batch])
        yield from ((x, ms[x.id]) for x in batch if x.id in ms)


def _can_draw() -> bool:
    try:
        "└─│├●◆".encode(sys.stdout.encoding or "ascii")
        return True
    except (UnicodeEncodeError, LookupError):
        return False
