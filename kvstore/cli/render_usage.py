"""``kvstore stats``: the requests the root served, by the tier that gave their tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import render as H

if TYPE_CHECKING:
    from ..store.usage import Counts, Usage

TIER_LABELS = (("memory", "from memory"), ("local", "from local"), ("remote", "from remote"))


def saved_text(c: Counts) -> str:
    """``93.1% (114,900 of 123,456 prompt tokens)``, or that nothing was recorded."""
    share = c.tokens_saved_share
    if share is None:
        return "no requests recorded"
    return (f"{share:.1%} ({H.format_count(c.reused_tokens)} of "
            f"{H.plural(c.prompt_tokens, 'prompt token')})")


def lookups_text(lookups: int, hits: int, requests: int) -> str:
    """``16 lookups, 3 loaded an entry (18.8%)``: the root's own lookups and loads, and,
    when they are not one per request, why (a request that the memory tier answers in full
    looks nothing up; a restore whose entry went bad looks again)."""
    if not lookups:
        return "none recorded"
    text = (f"{H.plural(lookups, 'lookup')}, {H.format_count(hits)} loaded an entry "
            f"({hits / lookups:.1%})")
    if requests and lookups < requests:
        text += (f", for {H.plural(requests, 'request')}: a request that memory answered in "
                 "full looked nothing up in the root")
    elif requests and lookups > requests:
        text += (f", for {H.plural(requests, 'request')}: a restore whose entry went bad "
                 "looks again, and a lookup of the Python API alone is no request")
    return text


def _reasons(why: dict[str, int]) -> str:
    return ", ".join(f"{k} {H.format_count(v)}" for k, v in sorted(why.items()) if v) or "-"


def _column(c: Counts) -> list[str]:
    return [
        H.format_count(c.requests),
        *(f"{H.plural(getattr(c, f'{t}_requests'), 'request')}, "
          f"{H.plural(getattr(c, f'{t}_tokens'), 'token')}" for t, _ in TIER_LABELS),
        H.plural(c.computed_tokens, "token"),
        H.plural(c.misses, "request") + " reused nothing",
        _reasons(c.miss_reasons),
        _reasons(c.partial_reasons),
    ]


def usage_lines(u: Usage) -> list[str]:
    """The requests block of ``kvstore stats``: the root's lifetime, and since the last reset
    when there was one (the share of tokens saved is the headline above it, not here)."""
    labels = ["requests", *(label for _, label in TIER_LABELS),
              "computed", "missed", "miss reasons", "reused less"]
    life = u.lifetime
    head = [f"lifetime (since {H.format_time(life.since)})" if life.since else "lifetime"]
    cols = [_column(life)]
    if u.reset_at:
        head.append(f"since reset ({H.format_age(u.reset_at)})")
        cols.append(_column(u.since_reset))
    lw = max(len(x) for x in labels)
    widths = [max(len(h), *(len(v) for v in col)) for h, col in zip(head, cols, strict=True)]

    def row(first: str, values: list[str]) -> str:
        cells = [v.ljust(w) for v, w in zip(values, widths, strict=True)]
        return ("  " + first.ljust(lw) + "  " + "  ".join(cells)).rstrip()

    lines = [row("requests", head)]
    lines += [row(label, [col[i] for col in cols]) for i, label in enumerate(labels)
              if label != "reused less" or any(col[i] != "-" for col in cols)]
    lines[0] = lines[0][2:]  # the block's title starts in the first column
    return lines
