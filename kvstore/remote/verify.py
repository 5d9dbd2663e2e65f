"""Checking the remote, and repairing it: ``kvstore remote verify [--read-data] [--repair]``.

Without ``read_data`` the structure is checked from listings and manifests: every
manifest matches its name and decodes, every block a finished entry needs is there
with the size its manifest gives it, every marker names a manifest. An entry is
visible once any marker names it (markers are put after its blocks); a manifest
without its exact marker is an unfinished push, reported but not a problem. ``read_data``
downloads every block and checks its digest. A block whose size is not the one a
manifest gives it is downloaded and hashed in either case: when its bytes hash to its
name it is good and that manifest lies (``lying``); else it is corrupt. ``repair``
(under the GC lease, as it deletes) drops each entry that is bad, lies about a block's
size, or needs a missing or corrupt block (its markers first, then its manifest), the
markers that name no manifest, and the corrupt blocks; never a good block, nor another
entry because of a lying one. The repair is a plan (:func:`plan_repair`, as the
root's): its report is ``--repair --dry-run``'s, and its execution removes what it planned
through ``RemoteCatalog.remove_many`` and ``S3BlockStore.delete_many``, once, counting only
what was still there.
The remote keeps no cut-back entries: a machine that had the entry can push a
shorter one again.

With the signing key, a manifest not signed with it is ``refused``: listed (the remote is
not sound), and neither checked nor repaired: what it says about blocks (their sizes, that
they are missing) drives no deletion, and it and its markers are not dropped.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..blocks.base import BlockStat
from ..catalog.base import Plan
from ..catalog.signing import UnsignedManifestError
from ..codecs.layout import manifest_blocks
from ..errors import BlockNotFoundError, CorruptBlockError, KVStoreError
from ..schema import Manifest
from .errors import RemoteLeaseError
from .layout import EXACT, MANIFESTS, MARKERS, entry_of_key
from .tier import RemoteTier


@dataclass
class RemoteVerifyReport:
    url: str
    read_data: bool
    repair: bool
    dry_run: bool
    entries: int = 0  # finished entries (their exact marker is there)
    manifests: int = 0
    blocks: int = 0
    markers: int = 0
    blocks_read: int = 0
    bad_manifests: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # manifests not signed with our key
    missing: dict[str, list[str]] = field(default_factory=dict)  # visible entry -> blocks gone
    corrupt: list[str] = field(default_factory=list)
    wrong_size: list[str] = field(default_factory=list)  # good blocks a manifest misstates
    lying: dict[str, list[str]] = field(default_factory=dict)  # manifest -> those blocks
    dangling: int = 0
    incomplete: list[str] = field(default_factory=list)  # manifests whose push did not finish
    dropped: list[str] = field(default_factory=list)
    deleted_blocks: int = 0
    deleted_markers: int = 0

    @property
    def sound(self) -> bool:
        return not (self.bad_manifests or self.refused or self.missing or self.corrupt
                    or self.lying or self.dangling)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["sound"] = self.sound
        return out


def verify(remote: RemoteTier, *, read_data: bool, repair: bool, dry_run: bool
           ) -> RemoteVerifyReport:
    """Check the remote; with ``repair`` plan its repair (:func:`plan_repair`): ``dry_run``
    reports the plan, else it is executed."""
    if not repair:
        rep = RemoteVerifyReport(str(remote.url), read_data, repair, dry_run)
        _check(remote, rep)
        return rep
    plan = plan_repair(remote, read_data=read_data, lease=not dry_run)
    return plan.report() if dry_run else plan.execute()


@dataclass
class RemoteRepairPlan(Plan[RemoteVerifyReport]):
    """What a repair of the remote will delete, found under the GC lease (``leased``) or, for
    a dry run, without it. :meth:`report` is the dry run; :meth:`execute` removes exactly
    the planned entries (:meth:`RemoteCatalog.remove_many`), dangling markers and corrupt
    blocks (:meth:`S3BlockStore.delete_many`), then lets the lease go; what others removed
    meanwhile is skipped and not counted. A plan not executed lets it go with
    :meth:`release`."""

    remote: RemoteTier
    leased: bool
    found: RemoteVerifyReport  # the check, and what the repair would do
    drop: list[bytes]  # entries: bad, lying, or needing a missing or corrupt block
    dangling: list[bytes]  # entries that have markers and no manifest
    marks: dict[bytes, list[str]]  # the marker objects listed for each of them
    corrupt: list[bytes]  # blocks whose bytes do not hash to their name

    def report(self) -> RemoteVerifyReport:
        return dataclasses.replace(self.found, dry_run=True)

    def _execute(self) -> RemoteVerifyReport:
        if not self.leased:
            raise RemoteLeaseError("a plan made without the lease cannot be executed",
                                   bucket=self.remote.url.bucket, key=self.remote.lease.key)
        try:
            cat, check = self.remote.catalog, self.remote.lease.check
            dropped = cat.remove_many(self.drop, listed=self.marks, check=check)
            gone = cat.remove_many(self.dangling, listed=self.marks, check=check)
            check()
            deleted = self.remote.blocks.delete_many(self.corrupt)
        finally:
            self.release()
        rep = dataclasses.replace(self.found, dry_run=False)
        _done(rep, dropped, gone, self.marks, deleted)
        return rep

    def release(self) -> None:
        if self.leased:
            self.remote.lease.release()


def plan_repair(remote: RemoteTier, *, read_data: bool, lease: bool = True
                ) -> RemoteRepairPlan:
    """Check the remote and plan its repair (the module's docstring says what it drops).
    With ``lease`` (a plan to execute) the GC lease is taken before anything is listed, and
    held by the plan."""
    rep = RemoteVerifyReport(str(remote.url), read_data, True, not lease)
    if lease:
        remote.lease.take()
    try:
        marks, users = _check(remote, rep)
        bad_blocks = {bytes.fromhex(h) for h in rep.corrupt}  # never one that hashes right
        drop = {bytes.fromhex(h) for h in (*rep.bad_manifests, *rep.missing, *rep.lying)}
        drop |= {d for d, bs in users.items() if bs & bad_blocks}
        have = set(users) | {bytes.fromhex(h) for h in (*rep.bad_manifests, *rep.refused)}
        dangling = sorted(d for d in marks if d not in have)
        plan = RemoteRepairPlan(remote, lease, rep, sorted(drop), dangling,
                                {d: marks[d] for d in (*drop, *dangling) if d in marks},
                                sorted(bad_blocks))
    except BaseException:
        if lease:
            remote.lease.release()
        raise
    _done(rep, plan.drop, plan.dangling, plan.marks, plan.corrupt)
    return plan


def _done(rep: RemoteVerifyReport, dropped: list[bytes], dangling: list[bytes],
          marks: dict[bytes, list[str]], blocks: list[bytes]) -> None:
    """Fill in what a repair drops (or dropped): the entries, their listed markers and the
    dangling ones, the corrupt blocks."""
    rep.dropped = sorted(d.hex() for d in dropped)
    rep.deleted_blocks = len(blocks)
    rep.deleted_markers = sum(len(marks.get(d, ())) for d in (*dropped, *dangling))


def _check(remote: RemoteTier, rep: RemoteVerifyReport
           ) -> tuple[dict[bytes, list[str]], dict[bytes, set[bytes]]]:
    p, c = remote.prefix, remote.client
    marks: dict[bytes, list[str]] = defaultdict(list)
    done: set[bytes] = set()  # entries whose exact marker is there: the push finished
    for o in [*c.list(p + MARKERS), *c.list(p + EXACT)]:
        d = entry_of_key(o.key)
        if d is not None:
            marks[d].append(o.key)
            rep.markers += 1
            if o.key.startswith(p + EXACT):
                done.add(d)
    blocks: dict[bytes, BlockStat] = dict(remote.blocks.iter_stats())
    listed = [d for o in c.list(p + MANIFESTS) if (d := entry_of_key(o.key)) is not None]
    rep.blocks, rep.manifests = len(blocks), len(listed)

    def load(d: bytes) -> tuple[bytes, Manifest | None, dict[bytes, int] | None]:
        try:
            _, m = remote.manifest(d)
            return d, m, manifest_blocks(m)
        except UnsignedManifestError:
            return d, None, None
        except (KVStoreError, ValueError):
            return d, None, {}

    users: dict[bytes, set[bytes]] = {}
    claims: dict[bytes, dict[bytes, int]] = defaultdict(dict)  # block -> manifest -> size
    for d, m, sizes in remote.map(load, listed):
        if sizes is None:
            rep.refused.append(d.hex())
            continue
        if m is None:
            rep.bad_manifests.append(d.hex())
            continue
        users[d] = set(sizes)
        gone = [b for b in sizes if b not in blocks]
        for b, sz in sizes.items():
            if b in blocks and blocks[b].size != sz:
                claims[b][d] = sz
        if d not in done:
            rep.incomplete.append(d.hex())
        if gone and d in marks:  # visible (a marker names it) yet missing a block
            rep.missing[d.hex()] = [b.hex() for b in gone]
    rep.entries = len(done & set(users))
    have = set(listed)
    rep.dangling = sum(len(ks) for d, ks in marks.items() if d not in have)
    def check(b: bytes) -> str | None:
        try:
            remote.blocks.get(b, verify=True)
        except CorruptBlockError:
            return b.hex()
        except BlockNotFoundError:
            return None  # swept meanwhile
        return None

    read = list(blocks) if rep.read_data else list(claims)  # a size in doubt: read it
    bad = remote.map(check, read)
    rep.blocks_read = len(read)
    rep.corrupt = sorted(h for h in bad if h is not None)
    for b in sorted(claims):
        if b.hex() in rep.corrupt:
            continue  # its bytes are wrong: the entries that need it go with it
        rep.wrong_size.append(b.hex())
        for d in claims[b]:
            rep.lying.setdefault(d.hex(), []).append(b.hex())
    return marks, users
