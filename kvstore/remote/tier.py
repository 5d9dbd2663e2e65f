"""The remote tier: one bucket (``s3://BUCKET/PREFIX``) that many local roots share.

:class:`Remote` speaks the protocol of docs/FORMAT.md ("The remote tier") and knows
nothing of a local root: the store hands it :class:`~.layout.Publication` records to
publish and the chain keys of a query to look up, and commits what it downloads.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import msgspec

from .._crash import crash_point
from ..blocks.hashing import hash_bytes
from ..blocks.s3 import S3BlockStore, S3Client, parse_s3_url
from ..codecs.layout import manifest_blocks
from ..errors import (
    ManifestError,
    RemoteError,
    RemoteLeaseError,
    RemoteNotFoundError,
    RootSettingsError,
)
from ..schema import Manifest, decode_manifest
from .layout import (
    ACCESS,
    BLOCKS,
    EXACT,
    MANIFESTS,
    MARKERS,
    SETTINGS,
    Marker,
    Publication,
    PushStats,
    RemoteSettings,
    entry_of_key,
    exact_dir,
    exact_marker,
    manifest_key,
    marker_dir,
    marker_key,
    parse_exact,
    parse_marker,
)
from .lease import DEFAULT_LEASE, DEFAULT_MARGIN, Lease

_log = logging.getLogger("kvstore")
_T = TypeVar("_T")
_R = TypeVar("_R")

DEFAULT_TIMEOUT = 5.0  # seconds: each request's connect and read timeout, and a lookup's bound
DEFAULT_WORKERS = 16  # requests in flight at once
SCAN = 4  # manifests a lookup reads at its deepest depth
LISTED = 16  # markers one probe lists
_settings_enc = msgspec.json.Encoder()
_settings_dec = msgspec.json.Decoder(RemoteSettings)


class RemoteHit(NamedTuple):
    """The longest usable prefix of a query the remote holds."""

    digest: bytes
    length: int
    exact: bool
    trimmable: bool
    n_tokens: int


@dataclass(frozen=True)
class RemoteEntry:
    """An entry of the remote as ``kvstore remote ls`` shows it."""

    id: str
    n_tokens: int
    model_id: str
    namespace: str
    bytes: int
    mtime: float
    complete: bool  # its exact marker is there: a finished push


@dataclass(frozen=True)
class RemoteStats:
    url: str
    endpoint: str
    entries: int
    manifests: int
    blocks: int
    block_bytes: int
    markers: int
    access_objects: int
    lease: str | None  # "owner, N s left" while a compaction holds it

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading u32 tokens two LE token strings share."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    import numpy as np  # here: a process that never compares remote tokens skips it

    x = np.frombuffer(a, dtype=np.uint32, count=n)
    y = np.frombuffer(b, dtype=np.uint32, count=n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class RemoteTier:
    """A bucket prefix holding blocks, manifests and markers; thread-safe (the requests;
    compaction and verification are :class:`kvstore.remote.Remote`'s).

    ``timeout`` bounds every request (connect and read, two tries) and each lookup.
    Endpoint and credentials come from the standard AWS configuration.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        workers: int = DEFAULT_WORKERS,
        lease_seconds: float = DEFAULT_LEASE,
        lease_margin: float = DEFAULT_MARGIN,
        profile: str | None = None,
    ) -> None:
        self.url = parse_s3_url(url)
        self.prefix = self.url.prefix
        self.timeout = timeout
        self.client = S3Client(self.url.bucket, connect_timeout=timeout, read_timeout=timeout,
                               attempts=2, max_pool_connections=workers + 8,
                               profile=profile)
        self.lease = Lease(self.client, self.prefix, lease_seconds, lease_margin)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-remote")
        self._settings: RemoteSettings | None = None
        self._blocks: S3BlockStore | None = None
        self._manifests: OrderedDict[bytes, tuple[bytes, Manifest]] = OrderedDict()
        self._lock = threading.Lock()
        self._access: dict[bytes, int] = {}

    def __str__(self) -> str:
        return str(self.url)

    # --- settings ------------------------------------------------------------------

    def read_settings(self) -> RemoteSettings | None:
        """The bucket's settings object, or None when the remote is not initialised."""
        try:
            raw = self.client.get(self.prefix + SETTINGS)
        except RemoteNotFoundError as e:
            if "bucket does not exist" in str(e):
                raise
            return None
        try:
            return _settings_dec.decode(raw)
        except msgspec.DecodeError as e:
            raise RootSettingsError(f"{self.url}{SETTINGS} is not a kvstore settings object: {e}"
                                    ) from None

    def init(self, settings: RemoteSettings) -> tuple[RemoteSettings, bool]:
        """Put the settings object if absent; returns what the remote holds and whether
        this call created it."""
        self.client.check_bucket()
        created = self.client.put(self.prefix + SETTINGS, _settings_enc.encode(settings))
        got = self.read_settings()
        if got is None:  # pragma: no cover - a put that succeeded and a get that misses
            raise RemoteError("settings object vanished", bucket=self.url.bucket, key=SETTINGS)
        return got, created

    def attach(self, local: RemoteSettings, *, create: bool) -> RemoteSettings:
        """Check the bucket and its settings against a local root's (init it with ``create``)."""
        self.client.check_bucket()
        got = self.read_settings()
        if got is None:
            if not create:
                raise RemoteNotFoundError(
                    f"{self.url} is not a kvstore remote yet: run `kvstore remote init`",
                    bucket=self.url.bucket, key=self.prefix + SETTINGS,
                )
            got, _ = self.init(local)
        diff = got.differences(local.hash, local.block_tokens, local.state_block_bytes)
        if diff:
            raise RootSettingsError(
                f"{self.url} was created with other settings than this root ({'; '.join(diff)})"
            )
        self._settings = got
        self._blocks = S3BlockStore(self.client, self.prefix, got.hash)
        return got

    @property
    def settings(self) -> RemoteSettings:
        if self._settings is None:
            got = self.read_settings()
            if got is None:
                raise RemoteNotFoundError(
                    f"{self.url} is not a kvstore remote yet: run `kvstore remote init`",
                    bucket=self.url.bucket, key=self.prefix + SETTINGS,
                )
            self._settings = got
            self._blocks = S3BlockStore(self.client, self.prefix, got.hash)
        return self._settings

    @property
    def blocks(self) -> S3BlockStore:
        if self._blocks is None:
            _ = self.settings
        assert self._blocks is not None
        return self._blocks

    # --- helpers ---------------------------------------------------------------------

    def map(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``fn`` over ``items`` on the request threads; the first error is raised."""
        futs = [self._pool.submit(fn, x) for x in items]
        out: list[_R] = []
        err: BaseException | None = None
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:  # noqa: BLE001 - the first error wins, all are waited
                err = err or e
        if err is not None:
            raise err
        return out

    def submit(self, fn: Callable[..., _R], *args: Any) -> Any:
        return self._pool.submit(fn, *args)

    def manifest(self, digest: bytes) -> tuple[bytes, Manifest]:
        """An entry's manifest, checked against its name; ManifestError when it does not match."""
        with self._lock:
            hit = self._manifests.get(digest)
            if hit is not None:
                self._manifests.move_to_end(digest)
                return hit
        raw = self.client.get(manifest_key(self.prefix, digest))
        if hash_bytes(self.settings.hash, raw) != digest:
            raise ManifestError(f"{self.url}{MANIFESTS}{digest.hex()}: bytes do not match its name")
        m = decode_manifest(raw)
        with self._lock:
            self._manifests[digest] = (raw, m)
            while len(self._manifests) > 512:
                self._manifests.popitem(last=False)
        return raw, m

    def forget(self, digest: bytes) -> None:
        with self._lock:
            self._manifests.pop(digest, None)

    def get_blocks(self, digests: Sequence[bytes]) -> dict[bytes, bytes]:
        """The blocks' bytes, downloaded in parallel, each checked against its digest
        (:class:`~kvstore.errors.CorruptBlockError`, :class:`BlockNotFoundError`)."""
        blocks = self.blocks
        return dict(zip(digests, self.map(blocks.get, digests), strict=True))

    # --- publishing ----------------------------------------------------------------

    def publish(
        self, pub: Publication, read_block: Callable[[bytes], bytes], *, max_wait: float
    ) -> PushStats:
        """Publish one entry: its manifest, then (no lease held) its missing blocks, then
        its markers, the exact one last. ``max_wait``: how long a compaction's lease may
        hold the blocks back (RemoteLeaseError after that)."""
        st = PushStats()
        mkey = manifest_key(self.prefix, pub.digest)
        if not self.client.put(mkey, pub.manifest):
            self.note_access(pub.digest)
            self.flush_access()  # a compaction that starts later must see it as used
        crash_point("push_after_manifest")
        deadline = time.monotonic() + max_wait
        while True:  # the lease, read after our manifest is there (docs/FORMAT.md)
            cur = self.lease.read()
            if cur is None or self.lease.stale(cur):
                break  # any compaction that starts later lists our manifest
            if not self.lease.wait_past(cur.token, max(0.0, deadline - time.monotonic())):
                raise RemoteLeaseError(
                    f"a compaction ({cur.owner}) held the lease past {max_wait:.0f} s",
                    bucket=self.url.bucket, key=self.lease.key,
                )
            # that compaction is over; any later one took its lease after our put...
            if self.client.head(mkey) is not None:
                break
            self.client.put(mkey, pub.manifest)  # ...unless it evicted our manifest: again
        blocks = self.blocks
        digests = list(pub.blocks)
        there = self.map(lambda d: self.client.head(blocks.key(d)) is not None, digests)
        missing = [d for d, ok in zip(digests, there, strict=True) if not ok]
        st.present = len(digests) - len(missing)

        def upload(d: bytes) -> int:
            data = read_block(d)
            wrote = blocks.put(d, [data])
            crash_point("push_after_block")
            return len(data) if wrote else -1

        for n in self.map(upload, missing):
            if n >= 0:
                st.blocks += 1
                st.bytes += n
            else:
                st.present += 1  # another machine put it meanwhile
        crash_point("push_before_markers")
        self.map(lambda ck: self.client.put(
            marker_key(self.prefix, ck, pub.digest, pub.n_tokens, pub.trimmable), b""),
            pub.depth_keys)
        crash_point("push_before_exact")
        self.client.put(exact_marker(self.prefix, pub.exact_key, pub.digest, pub.trimmable), b"")
        st.entries = 1
        return st

    def complete_entries(self) -> dict[bytes, bool]:
        """Every entry whose exact marker is there (a finished push): digest -> trimmable."""
        out: dict[bytes, bool] = {}
        for o in self.client.list(self.prefix + EXACT):
            got = parse_exact(o.key)
            if got is not None:
                out[got[0]] = got[1]
        return out

    # --- lookup ----------------------------------------------------------------------

    def _markers(self, chain_key: bytes) -> list[Marker]:
        listed = self.client.list(marker_dir(self.prefix, chain_key), limit=LISTED)
        return [m for o in listed if (m := parse_marker(o.key)) is not None]

    def _exact(self, exact_key: bytes) -> tuple[bytes, bool] | None:
        for o in self.client.list(exact_dir(self.prefix, exact_key), limit=4):
            got = parse_exact(o.key)
            if got is not None:
                return got
        return None

    def find(self, chain: Sequence[bytes], q_le: bytes, exact_key: bytes, floor: int = 0
             ) -> RemoteHit | None:
        """The remote's longest usable prefix of the query, if longer than ``floor`` tokens.

        ``chain`` is ``c_0 .. c_Q`` (``Q`` full blocks of the query). Costs one LIST for
        the exact key (in parallel) and, when the query holds a full block, one LIST per
        step of a bisection over depths ``max(1, floor // T) .. Q``, then at most
        ``SCAN`` manifest GETs (in parallel) at the deepest depth found.
        """
        n_q = len(q_le) // 4
        exact = self.submit(self._exact, exact_key)
        T = self.settings.block_tokens
        best: RemoteHit | None = None
        Q = len(chain) - 1
        if Q >= 1:
            seen: dict[int, list[Marker]] = {}

            def probe(k: int) -> list[Marker]:
                if k not in seen:
                    seen[k] = self._markers(chain[k])
                return seen[k]

            lo = max(1, floor // T)
            if lo <= Q and probe(lo):
                a, b = lo, Q
                while a < b:
                    mid = (a + b + 1) // 2
                    if probe(mid):
                        a = mid
                    else:
                        b = mid - 1
                for k in range(a, max(lo, a - 1) - 1, -1):
                    best = self._best(probe(k), q_le, n_q)
                    if best is not None:
                        break
        hit = exact.result()
        if hit is not None and (best is None or not best.exact):
            best = RemoteHit(hit[0], n_q, True, hit[1], n_q)
        return best if best is not None and best.length > floor else None

    def _best(self, markers: list[Marker], q_le: bytes, n_q: int) -> RemoteHit | None:
        trim = sorted((m for m in markers if m.trimmable), key=lambda m: -m.n_tokens)
        whole = sorted((m for m in markers if not m.trimmable and m.n_tokens <= n_q),
                       key=lambda m: -m.n_tokens)
        cands = (trim[:SCAN] + whole[:SCAN])[: 2 * SCAN]

        def judge(m: Marker) -> RemoteHit | None:
            try:
                _, man = self.manifest(m.entry)
            except (RemoteNotFoundError, ManifestError):
                return None  # evicted meanwhile, or bad: verify reports it
            lcp = common_tokens(man.tokens, q_le)
            if m.trimmable:
                length = min(lcp, man.n_tokens, n_q)
            elif lcp >= man.n_tokens:
                length = man.n_tokens
            else:
                return None
            exact = length == n_q == man.n_tokens
            return RemoteHit(m.entry, length, exact, m.trimmable, man.n_tokens) if length else None

        hits = [h for h in self.map(judge, cands) if h is not None]
        return max(hits, key=lambda h: (h.length, h.exact), default=None)

    # --- access times ----------------------------------------------------------------

    def note_access(self, digest: bytes) -> None:
        with self._lock:
            self._access[digest] = int(time.time() * 1000)

    def flush_access(self) -> None:
        """Write the access times noted since the last flush as one new object."""
        with self._lock:
            batch, self._access = self._access, {}
        if not batch:
            return
        body = msgspec.msgpack.encode({d.hex(): t for d, t in batch.items()})
        key = f"{self.prefix}{ACCESS}{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"
        try:
            self.client.put(key, body)
        except RemoteError as e:
            _log.warning("kvstore: access times not written to %s: %s", self.url, e)

    def read_access(self) -> tuple[dict[bytes, float], list[str]]:
        """The latest access time (epoch seconds) of each entry, and the objects read."""
        keys = [o.key for o in self.client.list(self.prefix + ACCESS)]
        out: dict[bytes, float] = {}

        def get(k: str) -> dict[str, int]:
            try:
                return dict(msgspec.msgpack.decode(self.client.get(k)))
            except (RemoteNotFoundError, msgspec.DecodeError, TypeError, ValueError):
                return {}

        for batch in self.map(get, keys):
            for hx, t in batch.items():
                try:
                    d = bytes.fromhex(hx)
                except (TypeError, ValueError):
                    continue
                out[d] = max(out.get(d, 0.0), float(t) / 1000)
        return out, keys

    # --- listing ---------------------------------------------------------------------

    def entries(self) -> list[RemoteEntry]:
        """Every manifest on the remote, with its tokens, model and size (one GET each)."""
        done = self.complete_entries()
        listed = [(o, d) for o in self.client.list(self.prefix + MANIFESTS)
                  if (d := entry_of_key(o.key)) is not None]

        def one(item: tuple[Any, bytes]) -> RemoteEntry | None:
            o, d = item
            try:
                _, m = self.manifest(d)
            except (RemoteNotFoundError, ManifestError):
                return None
            size = sum(manifest_blocks(m).values())
            return RemoteEntry(d.hex(), m.n_tokens, m.namespace.model_id, m.namespace.ns,
                               size, o.mtime, d in done)

        return [e for e in self.map(one, listed) if e is not None]

    def stats(self) -> RemoteStats:
        counts = {BLOCKS: [0, 0], MANIFESTS: [0, 0], MARKERS: [0, 0], EXACT: [0, 0],
                  ACCESS: [0, 0]}

        def count(kind: str) -> None:
            for o in self.client.list(self.prefix + kind):
                counts[kind][0] += 1
                counts[kind][1] += o.size

        self.map(count, list(counts))
        cur = self.lease.read()
        lease = None if cur is None else f"{cur.owner}, {cur.expires - time.time():.0f} s left"
        return RemoteStats(str(self.url), self.client.endpoint, counts[EXACT][0],
                           counts[MANIFESTS][0], counts[BLOCKS][0], counts[BLOCKS][1],
                           counts[MARKERS][0], counts[ACCESS][0], lease)

    def close(self) -> None:
        self.flush_access()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
