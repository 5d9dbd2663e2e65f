"""``kvstore tree``: entries merged into prefix trees of shared leading token blocks.

Pure, like :mod:`.render` (the manifests come in, lines and JSON-ready dicts go out).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .render import format_bytes, ns_json, ns_label, plural, short_id

if TYPE_CHECKING:
    from ..schema import Manifest, Namespace
    from ..store import Entry

__all__ = ["Branch", "NamespaceTree", "build_forest", "render_forest"]


@dataclass
class Branch:
    """A run of token blocks shared by the same entries, and where they part."""

    start_block: int
    start_token: int
    blocks: int = 0
    tokens: int = 0
    nbytes: int = 0
    entries: list[str] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)  # entries whose tokens end with this run
    children: list[Branch] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"start_block": self.start_block, "blocks": self.blocks,
                "start_token": self.start_token, "tokens": self.tokens, "bytes": self.nbytes,
                "entries": self.entries, "ends": self.ends,
                "children": [c.to_json() for c in self.children]}


@dataclass
class NamespaceTree:
    """One namespace's entries as a tree of shared leading token blocks."""

    namespace: Namespace
    entries: int
    referenced_bytes: int  # token-block bytes summed over entries
    stored_bytes: int  # token-block bytes of the distinct blocks in the tree
    n_tokens: dict[str, int]
    ends: list[str]  # entries without token blocks
    branches: list[Branch]
    checkpoints: list[str] = field(default_factory=list)  # entries saved part-way, by prefill

    def to_json(self) -> dict[str, Any]:
        return {"namespace": ns_json(self.namespace), "entries": self.entries,
                "referenced_bytes": self.referenced_bytes, "stored_bytes": self.stored_bytes,
                "saved_bytes": self.referenced_bytes - self.stored_bytes,
                "n_tokens": self.n_tokens, "ends": self.ends,
                "branches": [b.to_json() for b in self.branches],
                "checkpoints": self.checkpoints}


class _Node:
    __slots__ = ("children", "entries", "ends", "rows", "size")

    def __init__(self, rows: int = 0, size: int = 0) -> None:
        self.children: dict[bytes, _Node] = {}
        self.entries: list[str] = []
        self.ends: list[str] = []
        self.rows = rows
        self.size = size


def _compress(node: _Node, block: int, token: int) -> Branch:
    b = Branch(start_block=block, start_token=token, entries=list(node.entries))
    while True:
        b.blocks += 1
        b.tokens += node.rows
        b.nbytes += node.size
        if len(node.children) != 1 or node.ends:
            break
        node = next(iter(node.children.values()))
    b.ends = list(node.ends)
    b.children = _branches(node, block + b.blocks, token + b.tokens)
    return b


def _branches(node: _Node, block: int, token: int) -> list[Branch]:
    kids = sorted(node.children.values(), key=lambda n: (-len(n.entries), n.entries[0]))
    return [_compress(k, block, token) for k in kids]


def build_forest(items: Iterable[tuple[Entry, Manifest]]) -> list[NamespaceTree]:
    """Group entries by namespace and merge their token-block lists into prefix trees.

    ``items`` is each entry with its manifest, in id order (as :meth:`Store.entries`
    lists them), consumed as it comes: what is kept is one node per distinct token
    block, not the manifests (a root of 100k entries, issue 29).
    """
    from ..codecs.layout import manifest_block_sizes
    from ..schema import iter_tensor_specs

    trees: dict[Namespace, _Tree] = {}
    for e, m in items:
        t = trees.get(e.namespace)
        if t is None:
            t = trees[e.namespace] = _Tree()
        specs = iter_tensor_specs(m.layers) + [t for a in m.attachments for t in a.tensors]
        sizes, _ = manifest_block_sizes(specs, m.n_tokens, m.block_tokens, m.state_bytes,
                                        m.state_block_bytes)
        t.n_tokens[e.id] = e.n_tokens
        if e.priority == "checkpoint":
            t.checkpoints.append(e.id)
        node = t.top
        for b, d in enumerate(m.token_blocks):
            child = node.children.get(d)
            if child is None:
                rows = min(m.n_tokens - b * m.block_tokens, m.block_tokens)
                size = sizes[b] + len(m.block_salt) if b < len(sizes) else 0
                child = node.children[d] = _Node(rows, size)
                t.stored += child.size
            t.referenced += child.size
            child.entries.append(e.id)
            node = child
        node.ends.append(e.id)
    return [NamespaceTree(ns, len(t.n_tokens), t.referenced, t.stored, t.n_tokens,
                          list(t.top.ends), _branches(t.top, 0, 0), t.checkpoints)
            for ns, t in sorted(trees.items(), key=lambda kv: ns_label(kv[0]))]


class _Tree:
    __slots__ = ("checkpoints", "n_tokens", "referenced", "stored", "top")

    def __init__(self) -> None:
        self.top = _Node()
        self.referenced = self.stored = 0
        self.n_tokens: dict[str, int] = {}
        self.checkpoints: list[str] = []  # entries saved part-way, by prefill


def _branch_text(b: Branch, n_tokens: dict[str, int], checkpoints: set[str]) -> str:
    head = (f"tokens {b.start_token}–{b.start_token + b.tokens} · {plural(b.blocks, 'block')} · "
            f"{format_bytes(b.nbytes)}")
    if len(b.entries) == 1:
        e = b.entries[0]
        what = ", checkpoint" if e in checkpoints else ""
        return f"{head} · {short_id(e)} ({plural(n_tokens[e], 'token')}{what})"
    return f"{head} · shared by {len(b.entries)} entries"


def render_forest(forest: Sequence[NamespaceTree], *, ascii_only: bool = False) -> str:
    """``kvstore tree``: one tree per namespace, a line per shared run of blocks."""
    tee, last, bar = ("|-- ", "`-- ", "|   ") if ascii_only else ("├─ ", "└─ ", "│  ")
    blank = " " * len(bar)
    lines: list[str] = []

    def walk(items: list[tuple[str, Branch | None]], pad: str, n_tokens: dict[str, int],
             checkpoints: set[str]) -> None:
        for i, (eid, b) in enumerate(items):
            end = i == len(items) - 1
            if b is None:
                if eid in checkpoints:  # a state saved part-way through a prefill
                    lines.append(f"{pad}{last if end else tee}◆ {short_id(eid)} "
                                 f"({plural(n_tokens[eid], 'token')}) checkpoint")
                else:
                    lines.append(f"{pad}{last if end else tee}● {short_id(eid)} "
                                 f"({plural(n_tokens[eid], 'token')}) ends here")
                continue
            lines.append(f"{pad}{last if end else tee}{_branch_text(b, n_tokens, checkpoints)}")
            if len(b.entries) > 1:
                walk([(e, None) for e in b.ends] + [("", c) for c in b.children],
                     pad + (blank if end else bar), n_tokens, checkpoints)

    for t in forest:
        if lines:
            lines.append("")
        saved = t.referenced_bytes - t.stored_bytes
        ckpt = f" ({plural(len(t.checkpoints), 'checkpoint')})" if t.checkpoints else ""
        lines.append(f"{ns_label(t.namespace)}  {plural(t.entries, 'entry', 'entries')}{ckpt} · "
                     f"token blocks {format_bytes(t.referenced_bytes)} referenced, "
                     f"{format_bytes(t.stored_bytes)} stored (saves {format_bytes(saved)})")
        walk([(e, None) for e in t.ends] + [("", b) for b in t.branches], "", t.n_tokens,
             set(t.checkpoints))
    text = "\n".join(lines)
    if ascii_only:
        text = (text.replace("–", "-").replace("·", "-").replace("●", "*")
                .replace("◆", "+"))
    return text
