"""Repair as a plan, then its execution: what to do about blocks that went bad.

One planner serves ``verify --repair`` (and ``--dry-run``, which prints the
plan a real run would execute, so the two cannot disagree) and a verified read
that finds a block whose bytes do not match its name.

A bad block is moved to ``quarantine/``. Each entry that needs it is cut back
to the blocks before it when it can serve a shorter prefix: a trimmable entry
whose first bad block is token block *k* >= 1 becomes a new, shorter entry of
its first *k* blocks, with its own manifest, refcounts and prefix keys, unless
an entry for that prefix is already stored. Any other entry that needs a bad
block is dropped. Everything happens in one write transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...catalog.base import open_manifest
from ...catalog.records import cut_manifest, encoded, records_of
from ...errors import KVStoreError
from ...index import SavePlan
from ...schema import Manifest
from ..local.catalog import save_plan
from ..local.root import Root


class _Blocks(msgspec.Struct):
    """The digest lists of a manifest; decoding only these skips the rest."""

    token_blocks: tuple[bytes, ...] = ()
    state_blocks: tuple[bytes, ...] = ()
    window_blocks: tuple[bytes, ...] = ()


_blocks_dec = msgspec.msgpack.Decoder(_Blocks)


@dataclass(frozen=True)
class Cut:
    """An entry cut back to its intact first blocks: a new manifest replaces it."""

    entry: bytes
    to: bytes
    n_tokens: int
    save: SavePlan = field(repr=False, compare=False)


@dataclass
class RepairPlan:
    """What a repair does; :meth:`execute` does exactly that, nothing else."""

    quarantine: dict[bytes, str] = field(default_factory=dict)  # block -> what is wrong
    gone: set[bytes] = field(default_factory=set)  # needed blocks with no file at all
    cut: list[Cut] = field(default_factory=list)
    drop: list[bytes] = field(default_factory=list)
    undecodable: list[bytes] = field(default_factory=list)  # manifests removed as they are
    # verify only: recount refs, keys, records and totals from the manifests
    rebuild: dict[str, int] = field(default_factory=dict)
    orphans: list[bytes] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.quarantine or self.cut or self.drop or self.undecodable
                    or any(self.rebuild.values()) or self.orphans)

    def as_dict(self) -> dict[str, Any]:
        return {
            "quarantine": sorted(b.hex() for b in self.quarantine),
            "why": {b.hex(): why for b, why in sorted(self.quarantine.items())},
            "cut": [{"entry": c.entry.hex(), "to": c.to.hex(), "n_tokens": c.n_tokens}
                    for c in self.cut],
            "drop": [d.hex() for d in self.drop],
            "undecodable": [d.hex() for d in self.undecodable],
            **{k: v for k, v in sorted(self.rebuild.items())},
            "orphans": len(self.orphans),
        }

    def summary(self) -> str:
        """One line for the log: the blocks, what they were, and what became of the entries."""
        blocks = ", ".join(f"{b.hex()} ({why})" for b, why in sorted(self.quarantine.items()))
        fate = [f"{c.entry.hex()} cut back to {c.n_tokens} tokens (now {c.to.hex()})"
                for c in self.cut] + [f"{d.hex()} dropped" for d in self.drop]
        return (f"kvstore: corrupt block {blocks} moved to quarantine/; entries that needed it: "
                + (", ".join(fate) if fate else "none"))

    def execute(self, root: Root, txn: Any) -> list[bytes]:
        """Do the plan inside the write transaction ``txn``; returns the blocks moved aside.

        Cuts are added before the entries they replace are removed, so the blocks
        they keep never pass through refcount zero.
        """
        idx = root.index
        for c in self.cut:
            idx.add_entry(txn, c.save)
        for d in [*self.drop, *(c.entry for c in self.cut)]:
            root.catalog.remove_in(txn, d)
        for d in self.undecodable:
            idx.delete_records(txn, d)
        moved: list[bytes] = []
        for b in sorted({*self.quarantine, *self.gone}):
            ref = idx.get_ref(b, txn)
            if ref is not None and ref.refcount == 0:
                idx.drop_ref(txn, b)
            if b in self.quarantine and root.blocks.quarantine(b) is not None:
                moved.append(b)
        return moved


def plan_for_blocks(
    root: Root,
    txn: Any,
    bad: dict[bytes, str],
    gone: Iterable[bytes] = (),
    *,
    skip: Iterable[bytes] = (),
) -> RepairPlan:
    """The plan for blocks found bad (``bad``: digest -> what is wrong) or missing (``gone``).

    Finds every manifest that references one of them (decoding only the digest
    lists), and cuts back or drops each. ``skip``: manifests already planned
    for otherwise (undecodable ones).
    """
    plan = RepairPlan(quarantine=dict(bad), gone=set(gone) - set(bad))
    hit = set(bad) | plan.gone
    if not hit:
        return plan
    idx = root.index
    skipped = set(skip)
    users: list[bytes] = []
    for d, v in idx.iter_manifests(txn):
        if d in skipped:
            continue
        try:
            b = _blocks_dec.decode(v)
        except (msgspec.DecodeError, RecursionError):  # layers nested past any cache
            continue  # verify reports it as a bad manifest
        if hit.intersection((*b.token_blocks, *b.window_blocks, *b.state_blocks)):
            users.append(d)
    removed = set(users)
    taken: set[bytes] = set()
    for d in sorted(users):
        raw = idx.get_manifest(d, txn)
        try:
            m = open_manifest(raw or b"", d)
            cut = _cut(root, txn, d, m, hit, removed, taken)
        except (KVStoreError, ValueError):
            cut = None
        if cut is None:
            plan.drop.append(d)
        else:
            plan.cut.append(cut)
            taken.add(cut.save.exact_key)
    return plan


def _cut(
    root: Root,
    txn: Any,
    digest: bytes,
    m: Manifest,
    bad: set[bytes],
    removed: set[bytes],
    taken: set[bytes],
) -> Cut | None:
    """The entry ``m`` cut back to the token blocks before its first bad one, if it can be."""
    if bad.intersection((*m.state_blocks, *m.window_blocks)):
        return None
    k = next((i for i, b in enumerate(m.token_blocks) if b in bad), 0)
    short = cut_manifest(m, k)
    if short is None:
        return None
    n = short.n_tokens
    idx = root.index
    raw, to = encoded(short)
    old = idx.get_entry(digest, txn)
    if old is None:
        rec = records_of(short, raw, to, last_access=short.created_at)
    else:  # the cut keeps the entry's own bookkeeping
        rec = records_of(short, raw, to, priority=old.priority, last_access=old.last_access,
                         hits=old.hits, pulled_unsigned=old.pulled_unsigned)
    save = save_plan(rec, lambda ds: None)  # its blocks are the entry's own, referenced
    have = idx.find_exact(save.exact_key, txn)
    if save.exact_key in taken or (
        have is not None and have not in removed and idx.get_manifest(have, txn) is not None
    ):
        return None  # that prefix is stored already: it serves
    if idx.get_manifest(to, txn) is not None:
        return None
    return Cut(digest, to, n, save)

