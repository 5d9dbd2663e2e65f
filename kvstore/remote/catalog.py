"""The remote tier's catalog: entries by chain key as objects of a bucket.

An entry is its manifest object, a marker under each chain key ``c_k`` it reaches
(``markers/<c_k>/<entry>.<n>.<t|x>``: empty objects, so a LIST of one depth shows the
entries that reach it) and its exact marker (``exact/<key>/<entry>.<t|x>``, put last: the
entry is complete). A lookup is :func:`~kvstore.catalog.find.find` over depth probes
that each LIST one depth; the entries found are judged against their manifests. The
entry's priority travels as the manifest object's metadata (``x-amz-meta-priority``),
which older readers ignore. The order of the puts and the GC lease are
docs/FORMAT.md's ("The remote tier").

With a signing key (:class:`~kvstore.catalog.signing.Signer`), every manifest this catalog
puts carries its tag in the same PUT (``x-amz-meta-kvstore-sig``), and every manifest it
reads must carry a right one: a refused manifest (an
:class:`~kvstore.catalog.signing.UnsignedManifestError`) is never judged, returned or
cached, and is logged and reported (``on_refused``) once per entry. A refusal stands for
``REFUSED_FOR`` seconds: lookups in that time do not fetch the manifest again (a bucket
seeded with unsigned entries costs one GET each, not one per lookup); after it the
manifest is read again, since a machine with the key may have signed it meanwhile.

Markers are unsigned hints for finding a manifest (their names say an entry, its length,
whether it trims, the depth or exact key it is listed under). Before a lookup uses an
entry a marker names, what the marker says is checked against the manifest (the signed
one, with a key): its namespace is the query's (``c_0``), its tokens are the query's up
to the depth (or, for an exact marker, all of them), its length and its trimmability
are the manifest's own. A marker the manifest contradicts is a **lie**: refused, logged
and reported (``on_refused``) once per marker object, never judged again, and never a
failure of the remote (the entry it names is not refused for it: a genuine entry named
by a forged marker is still found by its own markers). With a key, an entry's priority is the
one its own signature (``kvstore-prio-sig``, :meth:`Signer.tag_priority`) vouches for,
else the signed manifest's cache type: never the unsigned ``priority`` metadata alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec

from .._crash import crash_point
from ..blocks import Digest
from ..catalog import keys as P
from ..catalog.base import Catalog, Ensure, open_manifest
from ..catalog.find import DepthReader, Match
from ..catalog.records import PRIORITY_NAMES, Records, priority_of, records_of, trimmable
from ..catalog.signing import Signer, UnsignedManifestError
from ..errors import DigestMismatchError, KVStoreError, ManifestError
from ..schema import MAX_MANIFEST_BYTES, Manifest
from .errors import RemoteNotFoundError, RemoteTooLargeError
from .layout import (
    EXACT,
    MANIFESTS,
    Marker,
    access_key,
    exact_dir,
    exact_marker,
    manifest_key,
    marker_dir,
    marker_key,
    parse_exact,
    parse_marker,
)
from .s3 import S3Client, run_all

SCAN = 4  # manifests a lookup reads at its deepest depth
LISTED = 16  # markers one probe lists
CACHED = 512  # manifests kept decoded
PRIORITY_META = "priority"  # the manifest object's metadata key: the entry's priority
SIG_META = "kvstore-sig"  # the manifest object's metadata key: its signature (signed entries)
PRIO_SIG_META = "kvstore-prio-sig"  # the metadata key of the priority's signature
REFUSED_LOGGED = 4096  # refused entries remembered (each is logged once)
REFUSED_FOR = 60.0  # seconds a refusal stands before the manifest is read again
LIES_KEPT = 4096  # lying marker objects remembered (each is logged and reported once)
EXACT_LISTED = 8  # exact markers one exact probe lists
#: The priority a manifest object's metadata names (-1 for a checkpoint); any other value,
#: or none (an older kvstore pushed it), leaves the manifest's cache type to say it.
_PRIORITY_META_VALUES = {str(p): p for p in PRIORITY_NAMES}
_log = logging.getLogger("kvstore")


@dataclass(frozen=True)
class _Cached:
    raw: bytes
    manifest: Manifest
    priority: int  # the object's metadata's (with a key: signed), else the cache type's
    trimmable: bool  # the manifest's own: every layer can serve a shorter prefix
    root_key: bytes  # c_0 of its namespace, codec, block size and hash


class RemoteReader(DepthReader):
    """One lookup's view of the bucket: the markers listed so far, by depth."""

    first_depth = 1  # entries shorter than a block have their exact marker only
    walk = 2  # the deepest depth reached and the one above it: a LIST and GETs each

    def __init__(self, catalog: RemoteCatalog) -> None:
        self.catalog = catalog
        self._seen: dict[int, list[Marker]] = {}

    def _markers(self, k: int, chain_key: bytes) -> list[Marker]:
        if k not in self._seen:
            self._seen[k] = self.catalog.markers(chain_key)
        return self._seen[k]

    def reaches(self, k: int, chain_key: bytes) -> bool:
        return bool(self._markers(k, chain_key))

    def best_at(self, tk: P.TokenKeys, k: int) -> Match | None:
        hit = self.catalog.judge(self._markers(k, tk.chain[k]), tk, k)
        # refused entries and lying markers hide nothing: judge the depth above them
        while hit is None and k > self.first_depth and self.catalog.all_refused(
                self._markers(k, tk.chain[k]), tk.chain[k]):
            k -= 1
            hit = self.catalog.judge(self._markers(k, tk.chain[k]), tk, k)
        return hit

    def exact_later(self, tk: P.TokenKeys) -> Callable[[], Match | None]:
        fut = self.catalog.pool.submit(self.catalog.exact_entry, tk.exact_key(),
                                       tk.chain[0], tk.le)
        n_q = len(tk)

        def result() -> Match | None:
            hit = fut.result()
            if hit is None:
                return None
            return Match(Digest(hit[0]), n_q, True, hit[1], n_q, where=self.catalog.name)

        return result


class RemoteCatalog(Catalog):
    """The entries of a bucket prefix (thread-safe)."""

    name = "remote"

    def __init__(self, client: S3Client, prefix: str, algo: str, pool: Executor, *,
                 url: str = "", read_only: bool = False, signer: Signer | None = None
                 ) -> None:
        self.client = client
        self.signer = signer  # with a key: manifests are signed, and only signed ones read
        self.prefix = prefix
        self.check_names = algo  # a bucket is anyone's to write: every manifest is checked
        self.read_only = read_only
        self.url = url or f"s3://{client.bucket}/{prefix}"
        self.pool = pool  # the remote's request threads
        self._cache: OrderedDict[bytes, _Cached] = OrderedDict()
        self._lock = threading.Lock()
        #: Called with an entry whose manifest a commit found there already (the remote
        #: tier records an access, so a compaction that starts later sees it in use).
        self.on_reused: Callable[[bytes], None] | None = None
        #: Called once per entry whose manifest a reader with the key refused.
        self.on_refused: Callable[[bytes], None] | None = None
        #: The clock a refusal's ``REFUSED_FOR`` is timed by (seconds, monotonic).
        self.clock: Callable[[], float] = time.monotonic
        #: Refused entries: when each was last refused (by ``clock``), and why.
        self._refused: OrderedDict[bytes, tuple[float, UnsignedManifestError]] = OrderedDict()
        #: Marker objects (their keys) whose manifest contradicts them: lies, never used.
        self._lies: OrderedDict[str, None] = OrderedDict()
        #: Manifests being read now: the one read each thread asking for them waits on.
        self._fetching: dict[bytes, Future[_Cached | None]] = {}

    # --- helpers --------------------------------------------------------------------

    # --- lookups --------------------------------------------------------------------

    @contextmanager
    def reader(self) -> Iterator[RemoteReader]:
        yield RemoteReader(self)

    def markers(self, chain_key: bytes) -> list[Marker]:
        """The entries that reach the depth of ``chain_key`` (at most ``LISTED``)."""
        listed = self.client.list(marker_dir(self.prefix, chain_key), limit=LISTED)
        return [m for o in listed if (m := parse_marker(o.key)) is not None]

    def exact_entry(self, exact_key: bytes, root_key: bytes | None = None,
                    tokens: bytes | None = None) -> tuple[bytes, bool] | None:
        """``(entry, trimmable)`` of the complete entry the exact key names, or None (with a
        signing key: the first whose manifest is signed).

        ``root_key`` and ``tokens`` (``c_0`` and the u32 LE tokens the exact key was made
        of): the entry's manifest must say the same namespace, the same tokens and the
        trimmability its marker says; an exact marker it contradicts is a lie
        (:meth:`_lie`), skipped."""
        for o in self.client.list(exact_dir(self.prefix, exact_key), limit=EXACT_LISTED):
            got = parse_exact(o.key)
            if got is None or self.lied(o.key):
                continue
            if tokens is None and self.signer is None:
                return got
            try:
                cached = self._get(got[0])
            except (ManifestError, DigestMismatchError):
                continue
            if cached is None:
                continue
            if tokens is not None and root_key is not None:
                why = _contradiction(cached, root_key, len(tokens) // 4, got[1])
                if why is None and cached.manifest.tokens != tokens:
                    why = "the entry's tokens are not the ones its exact key names"
                if why is not None:
                    self._lie(o.key, got[0], why)
                    continue
            return got
        return None

    def all_refused(self, markers: list[Marker], chain_key: bytes | None = None) -> bool:
        """Whether every entry the markers name was refused, or (``chain_key``: the depth
        they were listed under) its marker found lying."""
        with self._lock:
            return bool(markers) and all(
                m.entry in self._refused or (chain_key is not None and marker_key(
                    self.prefix, chain_key, m.entry, m.n_tokens, m.trimmable) in self._lies)
                for m in markers)

    def lied(self, key: str) -> bool:
        """Whether the marker object ``key`` was found lying."""
        with self._lock:
            return key in self._lies

    def _lie(self, key: str, entry: bytes, why: str) -> None:
        """Remember a marker object the manifest it names contradicts; log and report it
        the first time (as a refusal: ``on_refused`` with the entry it names)."""
        with self._lock:
            if key in self._lies:
                return
            self._lies[key] = None
            while len(self._lies) > LIES_KEPT:
                self._lies.popitem(last=False)
        _log.warning("kvstore: %s%s: refused, the marker lies: %s (manifest %s)", self.url,
                     key.removeprefix(self.prefix), why, entry.hex())
        if self.on_refused is not None:
            self.on_refused(entry)

    def trusts(self, digest: bytes) -> bool:
        return self.signer is None or self.usable(digest)

    def usable(self, digest: bytes) -> bool:
        """Whether the entry's manifest is there and passes :func:`open_manifest`."""
        try:
            return self._get(digest) is not None
        except (ManifestError, DigestMismatchError):
            return False

    def exact(self, exact_key: bytes) -> bytes | None:
        got = self.exact_entry(exact_key)
        return None if got is None else got[0]

    def judge(self, markers: list[Marker], tk: P.TokenKeys, k: int) -> Match | None:
        """The best of the entries ``markers`` (listed at depth ``k`` of the query) name for
        the query, from their manifests (read in parallel, at most ``SCAN`` of each kind).

        Each marker is checked against its manifest first: the entry's namespace is the
        query's, its tokens are the query's for the ``k`` blocks the marker stands under,
        and its length and trimmability are the ones the marker's name says. A marker the
        manifest contradicts is a lie (:meth:`_lie`): its entry is not judged for it."""
        n_q, T = len(tk), tk.block_tokens
        trim = sorted((m for m in markers if m.trimmable), key=lambda m: -m.n_tokens)
        whole = sorted((m for m in markers if not m.trimmable and m.n_tokens <= n_q),
                       key=lambda m: -m.n_tokens)
        cands = (trim[:SCAN] + whole[:SCAN])[: 2 * SCAN]

        def one(m: Marker) -> Match | None:
            key = marker_key(self.prefix, tk.chain[k], m.entry, m.n_tokens, m.trimmable)
            if self.lied(key):
                return None
            try:
                got = self._get(m.entry)
            except (RemoteNotFoundError, ManifestError, DigestMismatchError):
                return None  # evicted meanwhile, or bad: verify reports it
            if got is None:
                return None
            man = got.manifest
            lcp = P.common_tokens(man.tokens, tk.le)
            why = _contradiction(got, tk.chain[0], m.n_tokens, m.trimmable)
            if why is None and min(lcp, man.n_tokens) < k * T:
                why = (f"it lists the entry under block {k} of the query, whose first "
                       f"{k * T} tokens the entry does not hold")
            if why is not None:
                self._lie(key, m.entry, why)
                return None
            if got.trimmable:
                length = min(lcp, man.n_tokens, n_q)
            elif lcp >= man.n_tokens:
                length = man.n_tokens
            else:
                return None
            exact = length == n_q == man.n_tokens
            return (Match(Digest(m.entry), length, exact, got.trimmable, man.n_tokens,
                          where=self.name) if length else None)

        hits = [h for h in run_all(self.pool, one, cands) if h is not None]
        return max(hits, key=lambda h: (h.length, h.exact), default=None)

    # --- entries --------------------------------------------------------------------

    def where(self, digest: bytes) -> str:
        return f"{self.url}{MANIFESTS}{digest.hex()}"

    def manifest_bytes(self, digest: bytes) -> bytes | None:
        """The manifest object's bytes; one larger than any manifest (MAX_MANIFEST_BYTES) is
        a ManifestError, refused before its body is read."""
        got = self._read(digest)
        return None if got is None else got[0]

    def _read(self, digest: bytes) -> tuple[bytes, dict[str, str]] | None:
        key = manifest_key(self.prefix, digest)
        try:
            return self.client.get_with_metadata(key, max_bytes=MAX_MANIFEST_BYTES)
        except RemoteNotFoundError:
            return None
        except RemoteTooLargeError as e:
            raise ManifestError(f"{self.where(digest)}: an object of {e.size} bytes, not a "
                                f"manifest (at most {MAX_MANIFEST_BYTES}): not read") from None

    def _get(self, digest: bytes) -> _Cached | None:
        """The manifest (checked and decoded) and the priority its object carries; cached.
        Threads that ask for one manifest at once share one GET (a lookup's exact probe and
        its bisection often name the same entry)."""
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit
            no = self._refused.get(digest)
            if no is not None and self.clock() - no[0] < REFUSED_FOR:
                raise UnsignedManifestError(no[1].where, no[1].why)  # refused a moment ago
            fetching = self._fetching.get(digest)
            mine = fetching is None
            if fetching is None:
                fetching = self._fetching[digest] = Future()
        if not mine:
            return fetching.result()  # what the thread that reads it gets, error or not
        try:
            got = self._fetch(digest)
        except BaseException as e:
            fetching.set_exception(e)
            raise
        else:
            fetching.set_result(got)
            return got
        finally:
            with self._lock:
                del self._fetching[digest]

    def _fetch(self, digest: bytes) -> _Cached | None:
        read = self._read(digest)
        if read is None:
            return None
        raw, meta = read
        try:
            m = open_manifest(raw, digest, algo=self.check_names, where=self.where(digest),
                              signer=self.signer, tag=meta.get(SIG_META))
        except UnsignedManifestError as e:
            self._refuse(digest, e)
            raise
        kept = _PRIORITY_META_VALUES.get(meta.get(PRIORITY_META, ""))
        if self.signer is not None:  # unsigned metadata steers nothing a keyed reader does:
            kept = self._signed_priority(digest, kept, meta.get(PRIO_SIG_META))
        got = _Cached(raw, m, priority_of(m) if kept is None else kept, trimmable(m.layers),
                      P.root_key(m.namespace, m.codec, m.block_tokens, m.hash))
        with self._lock:
            self._refused.pop(digest, None)  # signed since it was refused
            self._cache[digest] = got
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return got

    def _signed_priority(self, digest: bytes, said: int | None, tag: str | None
                         ) -> int | None:
        """The priority the priority's tag vouches for (the one the metadata says first, then
        the others: a priority rewritten beside a copied tag is still found), or None."""
        assert self.signer is not None
        if not tag:
            return None
        for p in ([] if said is None else [said]) + [p for p in PRIORITY_NAMES if p != said]:
            if self.signer.check_priority(digest, p, tag):
                return p
        return None

    def manifest(self, digest: bytes) -> tuple[bytes, Manifest] | None:
        got = self._get(digest)
        return None if got is None else (got.raw, got.manifest)

    def ranked(self, digest: bytes) -> tuple[Manifest, int] | None:
        """The entry's manifest and priority (its object's metadata, else its manifest's
        cache type: :func:`priority_of`), from one read; None when the manifest is gone."""
        got = self._get(digest)
        return None if got is None else (got.manifest, got.priority)

    def records(self, digest: bytes) -> Records | None:
        got = self._get(digest)
        if got is None:
            return None
        return records_of(got.manifest, got.raw, digest, priority=got.priority)

    def _refuse(self, digest: bytes, e: UnsignedManifestError) -> None:
        """Remember a refused entry; log and report it the first time this catalog
        refuses it."""
        with self._lock:
            known = digest in self._refused
            self._refused[digest] = (self.clock(), e)
            self._refused.move_to_end(digest)
            if known:
                return
            while len(self._refused) > REFUSED_LOGGED:
                self._refused.popitem(last=False)
        _log.warning("kvstore: %s", e)
        if self.on_refused is not None:
            self.on_refused(digest)

    def forget(self, digest: bytes) -> None:
        """Drop a cached manifest and a refusal of it (its entry was removed, or this
        machine signed it)."""
        with self._lock:
            self._cache.pop(digest, None)
            self._refused.pop(digest, None)

    def complete(self) -> dict[bytes, bool]:
        """Every entry whose exact marker is there (a finished push): digest -> trimmable."""
        out: dict[bytes, bool] = {}
        for o in self.client.list(self.prefix + EXACT):
            got = parse_exact(o.key)
            if got is not None:
                out[got[0]] = got[1]
        return out

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self.complete()))

    # --- writes ---------------------------------------------------------------------

    def has_manifest(self, digest: bytes) -> bool:
        return self.client.head(manifest_key(self.prefix, digest)) is not None

    def put_manifest(self, rec: Records) -> bool:
        """Put the entry's manifest (its priority, and with a key its signature, in the
        object's metadata); False when it was there.

        With a key, a manifest there already but not signed with it (pushed before the key
        was set, or by a machine without it) is put again, signed: its name is its digest,
        so the bytes are the same and a reader meanwhile reads the same entry."""
        key = manifest_key(self.prefix, rec.digest)
        meta = {PRIORITY_META: str(rec.priority)}
        if self.signer is not None:
            meta[SIG_META] = self.signer.tag(rec.manifest)
            meta[PRIO_SIG_META] = self.signer.tag_priority(rec.digest, rec.priority)
        if self.client.put(key, rec.manifest, metadata=meta):
            return True
        if self.signer is None:
            return False
        try:
            raw, there = self.client.get_with_metadata(key)
        except RemoteNotFoundError:
            raw, there = b"", {}
        if raw != rec.manifest or any(there.get(k) != meta[k] for k in meta):
            self.client.put(key, rec.manifest, if_absent=False, metadata=meta)
            self.forget(rec.digest)
        return False

    def _commit(self, rec: Records, ensure: Ensure) -> bool:
        """The manifest first, then (``ensure``) the blocks, then a marker per depth, the
        exact marker last: the entry is visible only when everything it needs is there.

        An entry whose exact key is taken (this one, pushed before, or another of the same
        tokens; with a signing key, one whose manifest is signed) is not pushed again. Two
        machines pushing the same tokens at once may both publish: a lookup then finds
        either, never a wrong one.
        """
        if self.exact_entry(rec.exact_key, rec.chain[0], rec.tokens) is not None:
            return False
        if not self.put_manifest(rec) and self.on_reused is not None:
            self.on_reused(rec.digest)
        crash_point("push_after_manifest")
        ensure(list(rec.blocks))
        crash_point("push_before_markers")
        run_all(self.pool, lambda ck: self.client.put(
            marker_key(self.prefix, ck, rec.digest, rec.n_tokens, rec.trimmable), b""),
            rec.depth_keys)
        crash_point("push_before_exact")
        return self.client.put(exact_marker(self.prefix, rec.exact_key, rec.digest,
                                            rec.trimmable), b"")

    def marker_keys(self, rec: Records) -> list[str]:
        """Every marker object of an entry: its depth markers, then its exact marker."""
        return [marker_key(self.prefix, ck, rec.digest, rec.n_tokens, rec.trimmable)
                for ck in rec.depth_keys] + [
            exact_marker(self.prefix, rec.exact_key, rec.digest, rec.trimmable)]

    def remove_many(self, digests: Sequence[bytes], *,
                    listed: Mapping[bytes, Sequence[str]] | None = None,
                    check: Callable[[], None] | None = None) -> list[bytes]:
        """Remove many entries with batched DELETEs: every entry's markers first (they stop
        matching), then the manifests. The markers are those each manifest names and, for
        an entry whose manifest is bad or gone (a dangling marker), those a listing found
        (``listed``: entry -> its marker objects as listed). ``check`` is called before
        the first DELETE (the GC lease's check). Returns the entries that were there (a
        manifest, or for one without, a marker): one removed meanwhile is skipped."""
        self.check_writable()
        todo = list(dict.fromkeys(digests))

        def look(d: bytes) -> tuple[bool, list[str]]:
            keys = list((listed or {}).get(d, ()))
            there = self.has_manifest(d)
            if there:
                try:
                    rec = self.records(d)
                except (KVStoreError, ValueError):
                    rec = None  # a bad manifest: its listed markers are all there is
                if rec is not None:
                    keys += self.marker_keys(rec)
            elif keys:
                there = self.client.head(keys[0]) is not None
            return there, keys

        got = run_all(self.pool, look, todo)
        if check is not None:
            check()
        self.client.delete_many(sorted({k for _, ks in got for k in ks}))
        self.client.delete_many([manifest_key(self.prefix, d) for d in todo])
        for d in todo:
            self.forget(d)
        return [d for d, (there, _) in zip(todo, got, strict=True) if there]

    def replace_access(self, merged: Mapping[str, int], read: Sequence[str]) -> None:
        """Replace the access objects ``read`` (as the remote tier listed them) by one object
        of the ``merged`` times (entry hex -> ms since the epoch), put first."""
        self.check_writable()
        if merged:
            self.client.put(access_key(self.prefix), msgspec.msgpack.encode(dict(merged)))
        self.client.delete_many(list(read))

    def _remove(self, digest: bytes) -> bool:
        """The entry's markers first (it stops matching), then its manifest."""
        rec = self.records(digest)
        if rec is None:
            return False
        self.client.delete_many(self.marker_keys(rec))
        self.client.delete(manifest_key(self.prefix, digest))
        self.forget(digest)
        return True


def _contradiction(got: _Cached, root_key: bytes, n_tokens: int, trim: bool) -> str | None:
    """What a marker's name says (the namespace of the chain it is under, the entry's
    length, whether it trims) that the entry's manifest contradicts, or None."""
    m = got.manifest
    if got.root_key != root_key:
        return ("the entry is of another namespace (model, tokenizer, tenant), codec or "
                "block size than the chain it is listed under")
    if m.n_tokens != n_tokens:
        return f"it says {n_tokens} tokens, the manifest {m.n_tokens}"
    if got.trimmable != trim:
        return ("it says the entry serves shorter prefixes; the manifest's layers do not"
                if trim else "it says the entry does not trim; the manifest's layers do")
    return None


__all__ = ["RemoteCatalog", "RemoteReader"]
