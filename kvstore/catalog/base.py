"""The two interfaces a tier is made of, and the plan its garbage collection makes.

A tier holds blocks (a :class:`~kvstore.blocks.BlockStore`: bytes by digest) and a
:class:`Catalog` (entries by chain key: probe a depth, find an exact key, read a
manifest, commit an entry's records, remove one, list them). A local root implements
both with LMDB and files; the remote bucket with marker objects and block objects.
:class:`Tier` puts the two together and copies an entry in from another tier's blocks,
which is how a hit in a lower tier is written back and a save is written behind.
Every catalog passes the shared suite in ``tests/catalog/catalog_suite.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..blocks import BlockStore, hash_bytes
from ..errors import DigestMismatchError, ManifestError, ReadOnlyStoreError
from ..schema import Manifest, decode_manifest
from .find import DepthReader
from .records import Records
from .signing import Signer

R = TypeVar("R")
#: Called by a commit with blocks the catalog cannot vouch for, before the entry is
#: visible: it must leave each of them in the tier's block store (or raise, and the
#: commit is abandoned).
Ensure = Callable[[Sequence[bytes]], None]


def open_manifest(raw: bytes, digest: bytes, *, algo: str | None = None,
                  where: str = "", signer: Signer | None = None,
                  tag: str | None = None) -> Manifest:
    """The one place a manifest read from a tier passes: its bytes checked against its name
    (``algo``: for a tier that does not vouch for them, a
    :class:`~kvstore.errors.DigestMismatchError` naming ``where``), then, for a reader with
    the signing key (``signer``), the ``tag`` stored beside it (an
    :class:`~.signing.UnsignedManifestError`, before a byte of it is decoded), then decoded
    and validated (:func:`kvstore.schema.decode_manifest`, a ManifestError)."""
    where = where or f"manifest {digest.hex()}"
    if algo is not None:
        got = hash_bytes(algo, raw)
        if got != digest:
            raise DigestMismatchError(where, digest.hex(), got.hex())
    if signer is not None:
        signer.check(raw, tag, where)
    return decode_manifest(raw)


def check_size(rec: Records, block: bytes, size: int, where: str) -> None:
    """A block of ``size`` bytes whose bytes hash to its name is good: when the entry's
    manifest gives it another size, the manifest lies. A :class:`ManifestError` naming
    both refuses the entry; the block stays (docs/FORMAT.md, "Trust")."""
    want = rec.blocks.get(block)
    if want is not None and want != size:
        raise ManifestError(
            f"manifest {rec.digest.hex()} gives block {block.hex()} {want} bytes; {where} "
            f"holds {size} that hash to its name: the entry is refused, the block kept")


class Catalog(abc.ABC):
    """Entries by chain key: what one tier knows of the entries it holds."""

    name: str = ""  # the tier's name, as a Match's ``where`` says it
    read_only: bool = False
    #: The hash each manifest read is checked against its name with; None for a catalog
    #: whose manifests only its own commits wrote (a root's index).
    check_names: str | None = None

    # --- lookups ------------------------------------------------------------------

    @abc.abstractmethod
    def reader(self) -> AbstractContextManager[DepthReader]:
        """One lookup's view: probe a depth, judge its entries (:func:`~.find.find`)."""

    @abc.abstractmethod
    def exact(self, exact_key: bytes) -> bytes | None:
        """The entry whose tokens (and namespace) the exact key names, or None."""

    # --- entries ------------------------------------------------------------------

    @abc.abstractmethod
    def manifest_bytes(self, digest: bytes) -> bytes | None:
        """The encoded manifest of an entry as stored, or None when there is none."""

    @abc.abstractmethod
    def where(self, digest: bytes) -> str:
        """Where an entry's manifest is kept (a path, a URL), for messages."""

    def manifest(self, digest: bytes) -> tuple[bytes, Manifest] | None:
        """An entry's manifest, encoded and decoded, through :func:`open_manifest`."""
        raw = self.manifest_bytes(digest)
        if raw is None:
            return None
        return raw, open_manifest(raw, digest, algo=self.check_names, where=self.where(digest))

    def trusts(self, digest: bytes) -> bool:
        """Whether this catalog's readers would use the entry it holds: for a catalog that
        checks signatures, whether its manifest is signed with the key."""
        return True

    @abc.abstractmethod
    def records(self, digest: bytes) -> Records | None:
        """The entry's records as this tier keeps them (its priority, its last access)."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[bytes]:
        """Every entry's digest."""

    # --- writes: ``read_only`` is checked here, once --------------------------------

    def check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"the {self.name or 'catalog'} is open read-only")

    def commit(self, rec: Records, ensure: Ensure) -> bool:
        """Record an entry (its manifest, keys and bookkeeping); False when it is there
        already (the same manifest, or another entry of the same exact key).

        The entry becomes visible only once every block it needs is in the tier:
        ``ensure`` is called with those the catalog cannot vouch for, first."""
        self.check_writable()
        return self._commit(rec, ensure)

    def remove(self, digest: bytes) -> bool:
        """Remove an entry (it stops matching first); False when it was not there."""
        self.check_writable()
        return self._remove(digest)

    def remove_many(self, digests: Sequence[bytes]) -> list[bytes]:
        """Remove many entries (in batched requests where the catalog can), each as
        :meth:`remove` does; those that were there (one removed meanwhile is skipped)."""
        self.check_writable()
        return [d for d in digests if self._remove(d)]

    @abc.abstractmethod
    def _commit(self, rec: Records, ensure: Ensure) -> bool: ...

    @abc.abstractmethod
    def _remove(self, digest: bytes) -> bool: ...


@dataclass
class Copied:
    """What copying one entry into a tier did: whether its records were committed now,
    the blocks (and bytes) it copied and the blocks the tier had already."""

    created: bool = False
    blocks: int = 0
    bytes: int = 0
    present: int = 0


@dataclass
class PushStats:
    """What pushes did: entries published, blocks and bytes uploaded, blocks already there.

    ``failed``: entries whose upload failed (kept, retried by the next push);
    ``shed``: saves not queued because the queue was full; ``pending``: still queued
    when a push timed out. While serving, a failed upload is tried again after a pause
    (``retried``: the tries so scheduled) a bounded number of times, then given up
    (``given_up``: entries, kept for the next push). ``pulled_unsigned``: entries this
    root pulled without the signing key that a signing tier was not given (a keyed push
    signs them only when told to: ``Store.push(sign_pulled=True)``).
    """

    entries: int = 0
    blocks: int = 0
    bytes: int = 0
    present: int = 0
    failed: int = 0
    shed: int = 0
    pending: int = 0
    retried: int = 0
    given_up: int = 0
    pulled_unsigned: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: PushStats) -> None:
        for f in ("entries", "blocks", "bytes", "present", "failed", "shed", "pending",
                  "retried", "given_up", "pulled_unsigned"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.errors.extend(other.errors)

    def as_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in
                ("entries", "blocks", "bytes", "present", "failed", "shed", "pending",
                 "retried", "given_up", "pulled_unsigned", "errors")}


class Tier(abc.ABC):
    """A catalog and a block store that hold entries together; one of a store's tiers."""

    name: str
    catalog: Catalog
    blocks: BlockStore
    #: Seconds a lookup or a request may take (None: the tier answers inline, on this
    #: machine); a store leaves a tier that failed alone for a while.
    timeout: float | None = None

    @property
    def signed(self) -> bool:
        """Whether the tier signs what it takes and gives out only what is signed (a remote
        with a signing key); what a tier that is not signed gives out is vouched for by
        nobody (:attr:`Records.pulled_unsigned <.records.Records.pulled_unsigned>`)."""
        return False

    @abc.abstractmethod
    def take(self, rec: Records, source: BlockStore) -> Copied:
        """Copy an entry in: the blocks this tier lacks (from ``source``, verified), then its
        records, so that it is visible here only whole. A hit in a lower tier is written
        back this way, and a save written behind."""

    def note_access(self, digest: bytes) -> None:
        """An entry of this tier was used (written back above, restored)."""
        return None  # a tier that orders its evictions by use records it

    def flush(self) -> None:
        """Write what the tier keeps in memory for a while (its access records)."""
        return None

    def close(self) -> object:
        """Release what the tier holds open (connections, threads); a tier may say what
        closing it did (a store's ``Tiers``: what it pushed)."""
        return None


class Plan(abc.ABC, Generic[R]):
    """Destructive work as a plan, then its execution (restic's ``PlanPrune``, ``Execute``).

    A planner reads and returns a plan; :meth:`report` says what executing it would do
    (the dry run); :meth:`execute` does exactly that, re-checking each step against what
    others did meanwhile, and nothing else. A plan is executed once: what changed since
    it was made is a new plan, which the caller asks for.
    """

    _executed = False

    @abc.abstractmethod
    def report(self) -> R:
        """What executing the plan would do."""

    def execute(self) -> R:
        """Do the plan; what was done."""
        if self._executed:
            raise RuntimeError("a plan is executed once: make a new plan")
        self._executed = True
        return self._execute()

    @abc.abstractmethod
    def _execute(self) -> R: ...


__all__ = ["Catalog", "Copied", "Ensure", "Plan", "PushStats", "Tier", "check_size",
           "open_manifest"]
