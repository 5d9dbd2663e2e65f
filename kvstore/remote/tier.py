"""The remote tier: one bucket (``s3://BUCKET/PREFIX``) that many local roots share.

:class:`RemoteTier` is a :class:`~kvstore.catalog.base.Tier`: blocks as objects
(:class:`~.blocks.S3BlockStore`) and a catalog of manifests and markers
(:class:`~.catalog.RemoteCatalog`), plus the bucket's settings, the GC lease and the
access records. It speaks the protocol of docs/FORMAT.md ("The remote tier") and knows
nothing of a local root: a store copies entries in with :meth:`RemoteTier.take` and
looks them up through the catalog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from .._crash import crash_point
from ..blocks import BlockStore
from ..catalog import signing
from ..catalog.base import Copied, Tier, check_size
from ..catalog.records import Records
from ..catalog.settings import TierSettings
from ..catalog.signing import Signer, UnsignedManifestError
from ..codecs.layout import manifest_blocks
from ..errors import DigestMismatchError, ManifestError, RootSettingsError
from ..schema import Manifest
from .blocks import S3BlockStore
from .catalog import RemoteCatalog
from .errors import (
    RemoteError,
    RemoteLeaseError,
    RemoteNotFoundError,
    RemoteTooLargeError,
    RemoteUnavailableError,
)
from .layout import (
    ACCESS,
    BLOCKS,
    EXACT,
    MANIFESTS,
    MARKERS,
    SETTINGS,
    access_key,
    entry_of_key,
    hex32,
)
from .lease import DEFAULT_LEASE, DEFAULT_MARGIN, Lease
from .s3 import S3Client, parse_s3_url, run_all

_log = logging.getLogger("kvstore")
_T = TypeVar("_T")
_R = TypeVar("_R")

DEFAULT_TIMEOUT = 5.0  # seconds: each request's connect and read timeout, and a lookup's bound
DEFAULT_WORKERS = 16  # requests in flight at once
MAX_SETTINGS_BYTES = 64 << 10
MAX_ACCESS_BYTES = 64 << 20  # one access object (a record is about 80 bytes)
ACCESS_AHEAD = 86400.0  # seconds past this clock an access time may be (skew): later is a lie
_settings_enc = msgspec.json.Encoder()
_settings_dec = msgspec.json.Decoder(TierSettings)


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
    refused: int | None = None  # manifests a reader with the signing key refused (None: no key)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class RemoteTier(Tier):
    """A bucket prefix holding blocks, manifests and markers; thread-safe (the requests;
    compaction and verification are :class:`kvstore.remote.Remote`'s).

    ``timeout`` bounds every request (connect and read, two tries) and each lookup.
    Endpoint and credentials come from the standard AWS configuration. ``signing_key``
    (None: the environment's, :func:`~kvstore.catalog.signing.signing_key`; ``""``: none)
    signs every manifest put and refuses every manifest read that is not signed with it;
    ``on_refused`` (given at construction) is called once per entry refused.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        workers: int = DEFAULT_WORKERS,
        lease_seconds: float = DEFAULT_LEASE,
        lease_margin: float = DEFAULT_MARGIN,
        profile: str | None = None,
        signing_key: bytes | str | None = None,
        on_refused: Callable[[bytes], None] | None = None,
    ) -> None:
        self.url = parse_s3_url(url)
        self._key = signing.signing_key(signing_key)
        self.on_refused = on_refused
        self.prefix = self.url.prefix
        self.timeout = timeout
        self.client = S3Client(self.url.bucket, connect_timeout=timeout, read_timeout=timeout,
                               attempts=2, max_pool_connections=workers + 8,
                               profile=profile)
        self.lease = Lease(self.client, self.prefix, lease_seconds, lease_margin)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-remote")
        self._settings: TierSettings | None = None
        self._blocks: S3BlockStore | None = None
        self._catalog: RemoteCatalog | None = None
        self._lock = threading.Lock()
        self._access: dict[bytes, int] = {}

    def __str__(self) -> str:
        return str(self.url)

    # --- settings ------------------------------------------------------------------

    def read_settings(self, *, none_if_unreachable: bool = False) -> TierSettings | None:
        """The bucket's settings object, or None when the remote is not initialised (or,
        with ``none_if_unreachable``, cannot be reached)."""
        try:
            raw = self.client.get(self.prefix + SETTINGS, max_bytes=MAX_SETTINGS_BYTES)
        except RemoteTooLargeError as e:
            raise RootSettingsError(f"{self.url}{SETTINGS} is not a kvstore settings object: "
                                    f"{e.size} bytes") from None
        except RemoteNotFoundError as e:
            if "bucket does not exist" in str(e):
                raise
            return None
        except RemoteUnavailableError:
            if not none_if_unreachable:
                raise
            return None
        try:
            return _settings_dec.decode(raw)
        except msgspec.DecodeError as e:
            raise RootSettingsError(f"{self.url}{SETTINGS} is not a kvstore settings object: {e}"
                                    ) from None

    def init(self, settings: TierSettings) -> tuple[TierSettings, bool]:
        """Put the settings object if absent; returns what the remote holds and whether
        this call created it."""
        self.client.check_bucket()
        created = self.client.put(self.prefix + SETTINGS, _settings_enc.encode(settings))
        got = self.read_settings()
        if got is None:  # pragma: no cover - a put that succeeded and a get that misses
            raise RemoteError("settings object vanished", bucket=self.url.bucket, key=SETTINGS)
        return got, created

    def attach(self, local: TierSettings, *, create: bool) -> TierSettings:
        """Check the bucket and its settings against a local root's (init it with ``create``)."""
        self.client.check_bucket()
        got = self.read_settings()
        if got is None:
            if not create:
                raise self._not_initialised()
            got, _ = self.init(local)
        diff = local.differences(got)
        if diff:
            raise RootSettingsError(
                f"{self.url} was created with other settings than this root ({'; '.join(diff)})"
            )
        self._adopt(got)
        return got

    def _not_initialised(self) -> RemoteNotFoundError:
        return RemoteNotFoundError(
            f"{self.url} is not a kvstore remote yet: run `kvstore remote init`",
            bucket=self.url.bucket, key=self.prefix + SETTINGS,
        )

    def _adopt(self, settings: TierSettings) -> None:
        self._settings = settings
        self._blocks = S3BlockStore(self.client, self.prefix, settings.hash, pool=self._pool)
        signer = None if self._key is None else Signer(self._key, _store_id(self.url, settings))
        cat = RemoteCatalog(self.client, self.prefix, settings.hash, self._pool,
                            url=str(self.url), signer=signer)
        cat.on_reused = self._reused
        cat.on_refused = self._refused
        self._catalog = cat

    @property
    def signed(self) -> bool:
        """Whether this tier signs its manifests and reads only signed ones."""
        return self._key is not None

    def _refused(self, digest: bytes) -> None:
        if self.on_refused is not None:
            self.on_refused(digest)

    @property
    def settings(self) -> TierSettings:
        if self._settings is None:
            got = self.read_settings()
            if got is None:
                raise self._not_initialised()
            self._adopt(got)
        assert self._settings is not None
        return self._settings

    @property
    def blocks(self) -> S3BlockStore:  # type: ignore[override]
        _ = self.settings
        assert self._blocks is not None
        return self._blocks

    @property
    def catalog(self) -> RemoteCatalog:  # type: ignore[override]
        _ = self.settings
        assert self._catalog is not None
        return self._catalog

    # --- helpers ---------------------------------------------------------------------

    def map(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``fn`` over ``items`` on the request threads; the first error is raised."""
        return run_all(self._pool, fn, items)

    def manifest(self, digest: bytes) -> tuple[bytes, Manifest]:
        """An entry's manifest, checked against its name (DigestMismatchError) and decoded
        (ManifestError); RemoteNotFoundError when there is none."""
        got = self.catalog.manifest(digest)
        if got is None:
            raise RemoteNotFoundError("no such manifest", bucket=self.url.bucket,
                                      key=f"{self.prefix}{MANIFESTS}{digest.hex()}")
        return got

    def forget(self, digest: bytes) -> None:
        self.catalog.forget(digest)

    # --- copying an entry in (a push) ----------------------------------------------------

    def take(self, rec: Records, source: BlockStore) -> Copied:
        """Publish one entry: its manifest, then (no lease held, docs/FORMAT.md) the blocks
        the bucket lacks, read from ``source`` and verified, then its markers, the exact
        one last. A compaction's lease may hold the blocks back for the lease's duration
        plus its margin (RemoteLeaseError after that)."""
        got = Copied()
        max_wait = self.lease.duration + self.lease.margin

        def ensure(digests: Sequence[bytes]) -> None:
            self._past_the_lease(rec, max_wait)
            blocks = self.blocks
            there = self.map(blocks.exists, digests)
            missing = [d for d, ok in zip(digests, there, strict=True) if not ok]
            got.present = len(digests) - len(missing)

            def upload(d: bytes) -> int:
                data = source.get(d, verify=True)
                check_size(rec, d, len(data), source.where(d))
                wrote = blocks.put(d, [data])
                crash_point("push_after_block")
                return len(data) if wrote else -1

            for n in self.map(upload, missing):
                if n >= 0:
                    got.blocks += 1
                    got.bytes += n
                else:
                    got.present += 1  # another machine put it meanwhile

        got.created = self.catalog.commit(rec, ensure)
        return got

    def _past_the_lease(self, rec: Records, max_wait: float) -> None:
        """Read the lease after our manifest is there; wait out a compaction that holds it
        (and put our manifest again if that compaction evicted it)."""
        deadline = time.monotonic() + max_wait
        while True:
            cur = self.lease.read()
            if cur is None or self.lease.stale(cur):
                return  # any compaction that starts later lists our manifest
            if not self.lease.wait_past(cur.token, max(0.0, deadline - time.monotonic())):
                raise RemoteLeaseError(
                    f"a compaction ({cur.owner}) held the lease past {max_wait:.0f} s",
                    bucket=self.url.bucket, key=self.lease.key,
                )
            # that compaction is over; any later one took its lease after our put...
            if self.catalog.has_manifest(rec.digest):
                return
            self.catalog.put_manifest(rec)  # ...unless it evicted our manifest: again

    def _reused(self, digest: bytes) -> None:
        """A push found its manifest there: a compaction that starts later must see it used."""
        self.note_access(digest)
        self.flush_access()

    def complete_entries(self) -> dict[bytes, bool]:
        """Every entry whose exact marker is there (a finished push): digest -> trimmable."""
        return self.catalog.complete()

    # --- access times ----------------------------------------------------------------

    def note_access(self, digest: bytes) -> None:
        with self._lock:
            self._access[digest] = int(time.time() * 1000)

    def flush(self) -> None:
        self.flush_access()

    def flush_access(self) -> None:
        """Write the access times noted since the last flush as one new object."""
        with self._lock:
            batch, self._access = self._access, {}
        if not batch:
            return
        body = msgspec.msgpack.encode({d.hex(): t for d, t in batch.items()})
        key = access_key(self.prefix)
        try:
            self.client.put(key, body)
        except RemoteError as e:
            _log.warning("kvstore: access times not written to %s: %s", self.url, e)

    def read_access(self) -> tuple[dict[bytes, float], list[str], int]:
        """The latest access time (epoch seconds) of each entry, the objects read, and how
        many records (or whole objects) could not be parsed and were ignored.

        Anyone who can write the bucket writes these: a record is an entry's hex name and
        an int of ms since the epoch, no later than a day ahead of this clock; anything
        else (``inf``, ``1e300``, a string, a list, an object that is no map) is ignored
        and counted, so it can neither stop a compaction nor reach the merged record."""
        keys = [o.key for o in self.client.list(self.prefix + ACCESS)]
        out: dict[bytes, float] = {}
        ignored = 0
        latest = int((time.time() + ACCESS_AHEAD) * 1000)

        def get(k: str) -> Any:
            try:
                return msgspec.msgpack.decode(self.client.get(k, max_bytes=MAX_ACCESS_BYTES))
            except RemoteNotFoundError:
                return {}  # merged and deleted by another compaction meanwhile
            except (RemoteTooLargeError, msgspec.DecodeError, RecursionError):
                return None

        for batch in self.map(get, keys):
            if not isinstance(batch, dict):
                ignored += 1
                continue
            for hx, t in batch.items():
                d = hex32(hx)
                if d is None or type(t) is not int or not 0 <= t <= latest:
                    ignored += 1
                    continue
                out[d] = max(out.get(d, 0.0), t / 1000)
        if ignored:
            _log.warning("kvstore: %d access records on %s could not be parsed: ignored",
                         ignored, self.url)
        return out, keys, ignored

    # --- listing ---------------------------------------------------------------------

    def entries(self, skipped: list[str] | None = None, *,
                refused: list[str] | None = None) -> list[RemoteEntry]:
        """Every manifest on the remote, with its tokens, model and size (one GET each);
        those that cannot be read (bad, lying, too large: ``remote verify`` says why) are
        left out, their ids appended to ``skipped``; those a reader with the signing key
        refuses are left out too, their ids appended to ``refused``."""
        done = self.complete_entries()
        listed = [(o, d) for o in self.client.list(self.prefix + MANIFESTS)
                  if (d := entry_of_key(o.key)) is not None]

        def one(item: tuple[Any, bytes]) -> RemoteEntry | None:
            o, d = item
            try:
                _, m = self.manifest(d)
            except UnsignedManifestError:
                if refused is not None:
                    refused.append(d.hex())
                return None
            except RemoteNotFoundError:
                return None
            except (ManifestError, DigestMismatchError):
                if skipped is not None:
                    skipped.append(d.hex())
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
        lease = None if cur is None else (
            f"{cur.owner}, expired" if self.lease.stale(cur)
            else f"{cur.owner}, {cur.expires - time.time():.0f} s left")
        refused: list[str] | None = None
        if self.signed:  # reading every manifest is what tells the signed ones
            refused = []
            self.entries(refused=refused)
        return RemoteStats(str(self.url), self.client.endpoint, counts[EXACT][0],
                           counts[MANIFESTS][0], counts[BLOCKS][0], counts[BLOCKS][1],
                           counts[MARKERS][0], counts[ACCESS][0], lease,
                           None if refused is None else len(refused))

    def close(self) -> None:
        self.flush_access()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _store_id(url: object, settings: TierSettings) -> str:
    """What a signature binds a manifest to: the bucket and prefix, and the settings object
    (``created_at`` included: a prefix emptied and initialised again is another store)."""
    return (f"{url} hash={settings.hash} block_tokens={settings.block_tokens} "
            f"state_block_bytes={settings.state_block_bytes} created_at={settings.created_at}")
