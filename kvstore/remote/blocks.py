"""Blocks as objects of a bucket: :class:`S3BlockStore`, the remote tier's block store."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future

from ..blocks.base import BlockStat, BlockStore, Buffer
from ..blocks.hashing import Digest, check_digest, new_hasher
from ..errors import BlockNotFoundError, CorruptBlockError
from .errors import RemoteNotFoundError, RemoteTooLargeError
from .s3 import S3Client, run_all

AHEAD = 32  # blocks a get_many downloads ahead of its caller


class S3BlockStore(BlockStore):
    """Blocks as objects ``<prefix>blocks/ab/<hex>``, the same bytes as the local files.

    ``put`` is a put-if-absent (``If-None-Match: *``) and skips a block that is
    there. It does not freshen an existing block's age: an object store can only
    change LastModified by rewriting the object. The remote tier does not need
    it: a writer's manifest is uploaded, and the GC lease read, before the writer
    checks which blocks exist (docs/FORMAT.md, "The remote tier").
    """

    def __init__(self, client: S3Client, prefix: str, algo: str, *, read_only: bool = False,
                 pool: Executor | None = None) -> None:
        new_hasher(algo)  # validates the name
        self.client = client
        self.prefix = prefix
        self.algo = algo
        self.read_only = read_only
        self.durable = True  # an acknowledged PUT is stored
        self._pool = pool
        self._dir = f"{prefix}blocks/"

    def key(self, digest: bytes) -> str:
        """The object key of ``digest``; the digest is validated before the key is built."""
        hx = check_digest(digest).hex()
        return f"{self._dir}{hx[:2]}/{hx}"

    def url(self, digest: bytes) -> str:
        return f"s3://{self.client.bucket}/{self.key(digest)}"

    where = url

    def where_all(self) -> str:
        return f"s3://{self.client.bucket}/{self._dir}"

    def _put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        key = self.key(digest)
        return self.client.put(key, b"".join(pieces), if_absent=True)

    def get(self, digest: bytes, *, verify: bool = True, max_bytes: int | None = None) -> bytes:
        """The block's bytes (``max_bytes``: an object larger than that is a
        CorruptBlockError, not read)."""
        key = self.key(digest)
        try:
            data = self.client.get(key, max_bytes=max_bytes)
        except RemoteNotFoundError as e:
            raise BlockNotFoundError(f"{self.url(digest)}: no such block") from e
        except RemoteTooLargeError as e:
            raise CorruptBlockError(self.url(digest), f"at most {e.limit} bytes",
                                    f"{e.size} bytes (not read)", digest=digest.hex()) from None
        if verify:
            self.check(digest, data)
        return data

    def exists(self, digest: bytes) -> bool:
        return self.client.head(self.key(digest)) is not None

    def get_many(self, digests: Sequence[bytes], sizes: Mapping[bytes, int] | None = None
                 ) -> Iterator[tuple[bytes, bytes]]:
        """Each block, verified, in order, downloaded on the remote's request threads at most
        ``AHEAD`` ahead of the one the caller takes (so memory holds no more than those);
        one larger than ``sizes`` gives it is refused unread (CorruptBlockError)."""
        limit = {} if sizes is None else sizes
        if self._pool is None:
            for d in digests:
                yield d, self.get(d, max_bytes=limit.get(d))
            return
        pool = self._pool
        ahead: deque[Future[bytes]] = deque()
        todo = iter(digests)
        try:
            for d in digests:
                while len(ahead) < AHEAD and (nxt := next(todo, None)) is not None:
                    ahead.append(pool.submit(self.get, nxt, max_bytes=limit.get(nxt)))
                yield d, ahead.popleft().result()
        finally:
            for f in ahead:
                f.cancel()

    def _delete(self, digest: bytes) -> bool:
        key = self.key(digest)
        if self.client.head(key) is None:
            return False
        self.client.delete(key)
        return True

    def delete_many(self, digests: Sequence[bytes]) -> list[bytes]:
        """Delete many blocks: a HEAD each (on the pool), then batched DELETEs of those
        there; the blocks that were there (one deleted meanwhile is skipped)."""
        self.check_writable()
        keys = [self.key(d) for d in digests]
        there = [self.client.head(k) is not None for k in keys] if self._pool is None else \
            run_all(self._pool, lambda k: self.client.head(k) is not None, keys)
        self.client.delete_many([k for k, t in zip(keys, there, strict=True) if t])
        return [d for d, t in zip(digests, there, strict=True) if t]

    def iter(self) -> Iterator[Digest]:
        for d, _ in self.iter_stats():
            yield d

    def iter_stats(self) -> Iterator[tuple[Digest, BlockStat]]:
        """Every block with its size and mtime, from LIST alone (no HEAD per block)."""
        n = len(self._dir) + 3
        for o in self.client.list(self._dir):
            hx = o.key[n:]
            if len(o.key) != n + 64 or o.key[n - 3 : n - 1] != hx[:2]:
                continue  # not a block object: ignored, as the local store ignores strays
            try:
                d = Digest(bytes.fromhex(hx))
            except ValueError:
                continue
            if d.hex() == hx:
                yield d, BlockStat(o.size, o.mtime)

    def stat(self, digest: bytes) -> BlockStat | None:
        info = self.client.head(self.key(digest))
        return None if info is None else BlockStat(info.size, info.mtime)
