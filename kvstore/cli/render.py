"""What the CLI shows a person: sizes, ages, tables, reports, manifests, file headers.

Everything here is pure (no I/O, no store, no mlx at import time): it turns
numbers, manifests and file headers into lines and JSON-ready dicts, so the
output can be tested without a root and ``kvstore --help`` does not pay for it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from .._human import SizeError, parse_size

if TYPE_CHECKING:
    from ..schema import Layer, Manifest, Namespace
    from ..store import Entry

__all__ = [
    "SizeError",
    "checkpoint_info",
    "checkpoint_text",
    "entry_json",
    "format_age",
    "format_bytes",
    "format_count",
    "format_ratio",
    "format_time",
    "format_until",
    "grace_hold",
    "header_lines",
    "manifest_json",
    "manifest_lines",
    "ns_json",
    "ns_label",
    "parse_size",
    "plural",
    "render_report",
    "report_dict",
    "short_id",
    "table",
]

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """``1.2 GiB``, ``512 B``, ``15.0 KiB``: three significant figures, binary units."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _BINARY:
        if value < 1024 or unit == _BINARY[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            digits = 1 if value < 100 else 0
            return f"{sign}{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_count(n: int) -> str:
    """An integer with thousands separators: ``12,345``."""
    return f"{n:,}"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 entry``, ``3 entries``, ``2 blocks`` (``words`` overrides the plural)."""
    if words is None:
        words = word[:-1] + "ies" if word.endswith("y") else word + "s"
    return f"{format_count(n)} {word if n == 1 else words}"


def format_ratio(x: float) -> str:
    """A dedup ratio: ``2.37x``."""
    return f"{x:.2f}x"


def format_age(ms: int, now_ms: int | None = None) -> str:
    """How long ago a millisecond timestamp was: ``just now``, ``3 min ago``, ``2 days ago``."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    s = (now - ms) / 1000
    if s < 0:
        return "in the future"
    if s < 10:
        return "just now"
    for limit, size, unit in (
        (60, 1, "s"),
        (3600, 60, "min"),
        (86400, 3600, "h"),
        (86400 * 60, 86400, "day"),
        (86400 * 730, 86400 * 30.44, "month"),
        (math.inf, 86400 * 365.25, "year"),
    ):
        if s < limit:
            k = int(s // size)
            if unit in ("s", "min", "h"):
                return f"{k} {unit} ago"
            return f"{k} {unit}{'' if k == 1 else 's'} ago"
    raise AssertionError("unreachable")  # pragma: no cover


def format_time(ms: int) -> str:
    """A millisecond timestamp as local ``YYYY-MM-DD HH:MM:SS``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def grace_hold(grace: float, until_ms: int, now: str = "kvstore compact --grace 0") -> str:
    """Why unreferenced blocks stay, and when they go: the words of compact and stats
    (``now``: the command that frees them now, as the hint spells it)."""
    return (f"kept by the {grace:g} s grace until {format_time(until_ms)} "
            f"({format_until(until_ms)}; a compact after that frees them; "
            f"'{now}' frees them now)")


def format_until(ms: int, now_ms: int | None = None) -> str:
    """How far ahead a millisecond timestamp is: ``in 40 s``, ``in 10 min``, ``now``."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    s = (ms - now) / 1000
    if s <= 0:
        return "now"
    if s < 60:
        return f"in {s:.0f} s"
    if s < 3600:
        return f"in {s / 60:.0f} min"
    if s < 86400:
        return f"in {s / 3600:.1f} h"
    return f"in {s / 86400:.1f} days"


def short_id(entry_id: str, n: int = 12) -> str:
    """The first ``n`` hex chars of an id (what ``kvstore show`` accepts back)."""
    return entry_id[:n]


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()
) -> str:
    """Rows in aligned columns under a header; columns in ``right`` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    return "\n".join([table_line(headers, widths, right),
                      *(table_line(r, widths, right) for r in rows)])


def table_line(cells: Sequence[str], widths: Sequence[int], right: Sequence[int] = ()) -> str:
    """One row of :func:`table` in columns of these ``widths`` (a table printed as it goes)."""
    out = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
    return "  ".join(out).rstrip()


# --- reports, namespaces, entries, manifests -------------------------------------

def report_dict(report: Any) -> dict[str, Any]:
    """A backend's dataclass report (or dict) as a JSON-ready dict."""
    if is_dataclass(report) and not isinstance(report, type):
        out: dict[str, Any] = {}
        for f in fields(report):
            v = getattr(report, f.name)
            # a plan (verify --repair) says itself what it holds; the rest is plain data
            out[f.name] = v.as_dict() if hasattr(v, "as_dict") else _plain(v)
        return out
    if isinstance(report, dict):
        return report
    raise TypeError(f"expected a dataclass report, got {type(report).__name__}")


_REBUILD_WORDS = {
    "refcounts": "fix {} refcount records",
    "dangling_keys": "remove {} keys that name no manifest",
    "entry_records": "rebuild {} missing entry records",
    "totals": "fix {} running totals",
    "dangling_refs": "remove {} zero-refcount records whose file is gone",
    "orphans": "remove {} orphan block files",
}


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """A repair plan (``RepairReport.as_dict()``, its report) in words, one action a line."""
    why = plan.get("why", {})
    out = [f"quarantine block {b} ({why.get(b, 'corrupt')})" for b in plan.get("quarantine", [])]
    out += [f"cut back entry {c['entry']} to its first {plural(c['n_tokens'], 'token')} "
            f"(new entry {c['to']})" for c in plan.get("cut", [])]
    out += [f"drop entry {d}" for d in plan.get("drop", [])]
    out += [f"drop undecodable manifest {d}" for d in plan.get("undecodable", [])]
    out += [w.format(plan[k]) for k, w in _REBUILD_WORDS.items() if plan.get(k)]
    return out


def _plain(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _is_bytes_field(name: str) -> bool:
    return "bytes" in name or name.startswith(("physical", "live"))


def render_report(data: dict[str, Any], indent: str = "", *, skip_empty: bool = False,
                  skip: Sequence[str] = ()) -> list[str]:
    """A dataclass report as aligned ``field  value`` lines (sizes for byte fields).

    With ``skip_empty``, fields that are 0, empty, False or None are left out.
    """
    items = [(k, v) for k, v in data.items() if k not in skip
             and not (skip_empty and (v is None or v is False or v == 0 or v == [] or v == {}))]
    width = max((len(k) for k, _ in items), default=0)
    lines: list[str] = []
    for k, v in items:
        label = k.replace("_", " ").ljust(width)
        if isinstance(v, bool):
            lines.append(f"{indent}{label}  {'yes' if v else 'no'}")
        elif isinstance(v, int) and _is_bytes_field(k):
            lines.append(f"{indent}{label}  {format_bytes(v)}")
        elif isinstance(v, float):
            lines.append(f"{indent}{label}  {v:.3g}")
        elif isinstance(v, (list, tuple)):
            lines.append(f"{indent}{label}  {len(v)}")
            lines.extend(f"{indent}  - {brief(x)}" for x in v[:20])
            if len(v) > 20:
                lines.append(f"{indent}  … and {len(v) - 20} more")
        elif isinstance(v, dict):
            lines.append(f"{indent}{label}")
            lines.extend(render_report(v, indent + "  "))
        else:
            lines.append(f"{indent}{label}  {v}")
    return lines


def brief(x: Any) -> str:
    """One list item of a report: ids shortened, tuples joined."""
    if isinstance(x, (list, tuple)):
        return " ".join(brief(v) for v in x)
    if isinstance(x, dict):
        return ", ".join(f"{k}={brief(v)}" for k, v in x.items())
    if isinstance(x, str) and len(x) == 64:
        return short_id(x)
    return str(x)


def ns_label(ns: Namespace) -> str:
    """``model/ns``: what ``--namespace`` accepts back."""
    return f"{ns.model_id}/{ns.ns}"


def ns_json(ns: Namespace) -> dict[str, str]:
    return {"model_id": ns.model_id, "config_fingerprint": ns.config_fingerprint,
            "tokenizer_hash": ns.tokenizer_hash, "ns": ns.ns}


def entry_json(e: Entry, unique: int | None = None, m: Manifest | None = None
               ) -> dict[str, Any]:
    """An entry's fields; a checkpoint's (given its manifest ``m``) add ``checkpoint``, a
    pinned one's (a cache breakpoint's) ``pin``."""
    d: dict[str, Any] = {"id": e.id, "namespace": ns_json(e.namespace), "n_tokens": e.n_tokens,
                         "logical_bytes": e.logical_bytes}
    if unique is not None:
        d["unique_bytes"] = unique
    d.update(created_at=e.created_at, last_access=e.last_access, hits=e.hits,
             priority=e.priority)
    info = checkpoint_info(e, m)
    if info is not None:
        d["checkpoint"] = info
    if e.pin_ttl:
        d["pin"] = {"ttl": e.pin_ttl / 1000, "until": e.last_access + e.pin_ttl}
    return d


def checkpoint_info(e: Entry | None, m: Manifest | None) -> dict[str, Any] | None:
    """What a checkpoint is: its depth, its conversation (the prompt whose prefill saved
    it), that prompt's length and the interval; None for any other entry."""
    if e is None or e.priority != "checkpoint":
        return None
    meta = m.metadata if m is not None else {}

    def number(key: str) -> int | None:
        v = meta.get(key, "")
        return int(v) if v.isdigit() else None

    return {"depth": e.n_tokens, "conversation": meta.get("conversation") or None,
            "prompt_tokens": number("prompt_tokens"), "every": number("checkpoint_every")}


def checkpoint_text(info: dict[str, Any]) -> str:
    """``token 3,072 of 3,743 · conversation 3fa2c1d0e5b7a9f1`` (what is known of it)."""
    depth = f"token {format_count(info['depth'])}"
    if info["prompt_tokens"] is not None:
        depth += f" of {format_count(info['prompt_tokens'])}"
    conv = info["conversation"]
    return depth + (f" · conversation {conv}" if conv else "")


def layer_kind(layer: Layer) -> str:
    return str(type(layer).__struct_config__.tag)


def layer_fields(layer: Layer) -> dict[str, Any]:
    import msgspec

    d = msgspec.structs.asdict(layer)
    for k in ("tensors", "children"):
        d.pop(k, None)
    for k, v in list(d.items()):
        if isinstance(v, bytes):
            if v in (b"", b"{}"):
                del d[k]
            else:
                d[k] = json_value(v)
        elif isinstance(v, tuple):
            d[k] = list(v)
    return d


def json_value(b: bytes) -> Any:
    try:
        return json.loads(b)
    except ValueError:
        return b.hex()


def json_text(b: bytes) -> str:
    return json.dumps(json_value(b)) if b else "{}"


def layer_lines(layer: Layer, lead: str) -> list[str]:
    from ..schema import ListLayer

    fields = " ".join(f"{k}={json.dumps(v) if not isinstance(v, int) else v}"
                      for k, v in layer_fields(layer).items())
    out = [f"{lead}{layer_kind(layer):<9}{fields}".rstrip()]
    pad = " " * (len(lead) + 2)
    for j, t in enumerate(layer.tensors):
        where = (f"state @{t.state_offset}" if t.token_axis is None
                 else f"token axis {t.token_axis}" if t.window_start is None
                 else f"token axis {t.token_axis}, tokens from {t.window_start}")
        out.append(f"{pad}t{j}  {t.dtype:<8} {str(list(t.shape)):<18} {where}")
    if isinstance(layer, ListLayer):
        for j, child in enumerate(layer.children):
            out.extend(layer_lines(child, f"{pad}{j:>3}  "))
    return out


def grouped_layer_lines(layers: Sequence[Layer]) -> list[str]:
    """The layers, a run of identical ones (the same kind, fields and tensors) once, under
    the range of their indices: ``  0-29  kv  offset=40``."""
    runs: list[tuple[int, int, list[str]]] = []  # (first, last, lines without the lead)
    for i, layer in enumerate(layers):
        body = layer_lines(layer, "")
        if runs and runs[-1][2] == body:
            runs[-1] = (runs[-1][0], i, body)
        else:
            runs.append((i, i, body))
    labels = [f"{a}" if a == b else f"{a}-{b}" for a, b, _ in runs]
    width = max([3, *map(len, labels)])
    out: list[str] = []
    for (a, _, _), label in zip(runs, labels, strict=True):
        out.extend(layer_lines(layers[a], f"  {label:>{width}}  "))
    return out


def text_lines(model_dir: Any, text: str) -> list[str]:
    """``show --text``: the tokens as text, each line indented, under the tokenizer's origin."""
    return [f"text        decoded by the tokenizer in {model_dir}",
            *(f"  {line}".rstrip() for line in text.split("\n"))]


def layer_json(layer: Layer) -> dict[str, Any]:
    from ..schema import ListLayer

    d: dict[str, Any] = {"kind": layer_kind(layer), **layer_fields(layer)}
    d["tensors"] = [{"shape": list(t.shape), "dtype": t.dtype, "token_axis": t.token_axis,
                     "state_offset": t.state_offset,
                     **({"window_start": t.window_start} if t.window_start is not None else {})}
                    for t in layer.tensors]
    if isinstance(layer, ListLayer):
        d["children"] = [layer_json(c) for c in layer.children]
    return d


def manifest_json(eid: str, m: Manifest, tokens: list[int], rec: Entry | None, uniq: int,
                   refs: dict[bytes, tuple[int, int]]) -> dict[str, Any]:
    """``kvstore show --json``; ``refs`` maps a block to ``(size, refcount)`` (Store.block_refs)."""
    def blocks(ds: tuple[bytes, ...]) -> list[dict[str, Any]]:
        return [{"digest": d.hex(), "bytes": refs[d][0] if d in refs else None,
                 "refcount": refs[d][1] if d in refs else 0} for d in ds]

    return {
        "id": eid, "format": m.format, "namespace": ns_json(m.namespace), "codec": m.codec,
        "hash": m.hash, "block_tokens": m.block_tokens, "state_block_bytes": m.state_block_bytes,
        "created_at": m.created_at, "n_tokens": m.n_tokens, "tokens": tokens,
        "layers": [layer_json(layer) for layer in m.layers],
        "token_blocks": blocks(m.token_blocks), "state_blocks": blocks(m.state_blocks),
        **({"window_blocks": blocks(m.window_blocks)} if m.window_blocks else {}),
        "state_bytes": m.state_bytes,
        "attachments": [{"schema": a.schema, "metadata": json_value(a.metadata),
                         "tensors": [{"shape": list(t.shape), "dtype": t.dtype,
                                      "state_offset": t.state_offset} for t in a.tensors]}
                        for a in m.attachments],
        "metadata": dict(m.metadata),
        "entry": entry_json(rec, uniq, m) if rec is not None else None,
    }


def _tokens_line(tokens: Sequence[int], all_tokens: bool) -> str:
    shown = list(tokens) if all_tokens else list(tokens[:16])
    more = "" if len(shown) == len(tokens) else f" … (+{len(tokens) - len(shown)})"
    return f"{format_count(len(tokens))}: {' '.join(map(str, shown))}{more}"


def manifest_lines(eid: str, m: Manifest, tokens: Sequence[int], rec: Entry | None, uniq: int,
                   refs: dict[bytes, tuple[int, int]], *, all_tokens: bool = False) -> list[str]:
    """``kvstore show``: one entry's manifest, readable."""
    ns = m.namespace
    lines = [f"entry       {eid}",
             f"namespace   {ns_label(ns)}",
             f"  model     {ns.model_id}",
             f"  config    {ns.config_fingerprint or '-'}",
             f"  tokenizer {ns.tokenizer_hash or '-'}",
             f"codec       {m.codec}, {m.hash}, {m.block_tokens} tokens per block",
             f"created     {format_time(m.created_at)} ({format_age(m.created_at)})"]
    if rec is not None:
        lines.append(f"used        {format_age(rec.last_access)}, {plural(rec.hits, 'hit')}, "
                     f"priority {rec.priority}")
        info = checkpoint_info(rec, m)
        if info is not None:
            every = f", one every {format_count(info['every'])}" if info["every"] else ""
            lines.append(f"checkpoint  {checkpoint_text(info)}{every} (thinned first by "
                         "compact)")
        lines.append(f"size        {format_bytes(rec.logical_bytes)}, "
                     f"{format_bytes(uniq)} unique to this entry")
    lines.append(f"tokens      {_tokens_line(tokens, all_tokens)}")
    lines.append(f"layers      {len(m.layers)}")
    lines.extend(grouped_layer_lines(m.layers))
    for a in m.attachments:
        lines.append(f"attachment  {a.schema} {json_text(a.metadata)}")
        lines.extend(f"         t{j}  {t.dtype} {list(t.shape)}" for j, t in enumerate(a.tensors))
    named = [("token blocks", m.token_blocks), ("state blocks", m.state_blocks)]
    if m.window_blocks:
        named.insert(1, ("window blocks", m.window_blocks))
    for name, blocks in named:
        lines.append(f"{name} {len(blocks)}")
        for j, d in enumerate(blocks):
            ref = refs.get(d)  # (size, refcount); None for a block without a record
            size = format_bytes(ref[0]) if ref else "missing"
            shared = f"shared by {ref[1]}" if ref and ref[1] > 1 else "unique"
            lines.append(f"  {j:>3}  {d.hex()[:16]}  {size:>10}  {shared}")
    if m.metadata:
        lines.append("metadata")
        width = max(len(k) for k in m.metadata)
        lines.extend(f"  {k.ljust(width)}  {v}" for k, v in sorted(m.metadata.items()))
    return lines


def _file_tensor(t: dict[str, Any]) -> str:
    where = (plural(len(t["blocks"]), "block") if isinstance(t.get("blocks"), list)
             else f"@{t.get('off', '?')}")
    size = format_bytes(t["bytes"]) if isinstance(t.get("bytes"), int) else "?"
    return f"{str(t.get('dtype', '?')):<8} {str(t.get('shape', '?')):<18} {size:>10}  {where}"


def header_lines(info: Any, *, all_tokens: bool = False) -> list[str]:
    """``kvstore inspect``: a v3/v4/v5 file's prefix and header (a formats.v3.HeaderInfo)."""
    h: dict[str, Any] = info.header
    raw_tokens = h.get("tokens")
    tokens: list[int] = raw_tokens if isinstance(raw_tokens, list) else []
    lines = [f"file        {info.path} ({format_bytes(info.file_size)})",
             f"format      mlx-bun formatVersion {info.format_version}, header "
             f"{format_bytes(info.header_len)}, data at {info.data_start}, "
             f"header hash {info.header_hash_hex}",
             f"model       {h.get('modelId', '-')}",
             f"  config    {h.get('configFingerprint') or '-'}",
             f"  tokenizer {h.get('tokenizerHash') or '-'}",
             f"  ns        {h.get('ns', '-')}",
             f"codec       {h.get('codecProvider', '-')}"]
    if isinstance(h.get("createdAt"), int):
        lines.append(f"created     {format_time(h['createdAt'])} ({format_age(h['createdAt'])})")
    lines.append(f"tokens      {_tokens_line(tokens, all_tokens)}")
    raw_caches = h.get("caches")
    caches: list[dict[str, Any]] = raw_caches if isinstance(raw_caches, list) else []
    lines.append(f"layers      {len(caches)}")
    total = count = 0
    for i, c in enumerate(caches):
        fields = " ".join(f"{k}={json.dumps(v)}" for k, v in c.items()
                          if k not in ("kind", "tensors"))
        lines.append(f"  {i:>3}  {str(c.get('kind', '?')):<9}{fields}".rstrip())
        for j, t in enumerate(c.get("tensors") or ()):
            lines.append(f"         t{j}  {_file_tensor(t)}")
            total += t.get("bytes", 0) if isinstance(t.get("bytes"), int) else 0
            count += 1
    for a in h.get("attachments") or ():
        lines.append(f"attachment  {a.get('schema', '?')} {json.dumps(a.get('metadata', {}))}")
        for j, t in enumerate(a.get("tensors") or ()):
            lines.append(f"         t{j}  {_file_tensor(t)}")
            total += t.get("bytes", 0) if isinstance(t.get("bytes"), int) else 0
            count += 1
    lines.append(f"tensor data {format_bytes(total)} in {plural(count, 'tensor')}")
    return lines
