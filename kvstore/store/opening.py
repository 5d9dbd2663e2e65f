"""Opening a store: the root (made with ``create``), its settings, the tiers below it
(``Store.open``, which is :func:`open_store`), and the options a store is built with
(:class:`StoreOptions`).

A store is built whole: its options, its counters and the remote's refusal callback are
given to the constructors (``Store``, ``Tiers``, ``Remote``); nothing is set on a built
store (tests/test_architecture.py checks that no module assigns to a store's parts).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

from ..local import Root, default_root, has_root, now_ms
from ..local.gc import DEFAULT_GRACE
from ..schema import Namespace
from .counters import StoreCounters
from .retry import PushRetry
from .tiers import Tiers

if TYPE_CHECKING:
    from ..remote import Remote


@dataclass(frozen=True)
class StoreOptions:
    """What a :class:`~kvstore.store.Store` is built with, fixed for its life
    (``Store.open``'s options of the same names say what each does): the default
    ``namespace``, ``verify_reads``, ``read_only`` (the root's, as opened), ``push`` (saves
    written behind to the remote), the byte budget ``max_bytes`` with the ``gc_grace`` its
    evictions honour, the ``remote_deadline``, ``push_retry`` (how a failed push is tried
    again), and ``clock``: the time pins are judged by (ms since the epoch; a test gives
    its own)."""

    namespace: Namespace | None = None
    verify_reads: bool = True
    read_only: bool = False
    push: bool = True
    max_bytes: int | None = None
    gc_grace: float = DEFAULT_GRACE
    remote_deadline: float | None = None
    push_retry: PushRetry = PushRetry()
    clock: Callable[[], int] = now_ms

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.remote_deadline is not None and not self.remote_deadline > 0:  # NaN too
            raise ValueError(f"remote_deadline must be > 0, got {self.remote_deadline}")


class Opened(Protocol):
    """What opening needs of the store class it makes (:class:`~kvstore.store.Store`)."""

    tiers: Tiers

    def __init__(self, local: Root, options: StoreOptions = ..., *,
                 remote: Remote | None = None, counters: StoreCounters | None = None
                 ) -> None: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=Opened)


class OpenOptions(TypedDict, total=False):
    """The keyword options of :func:`open_store` (``Store.open``), for the type checker
    (tests/test_store.py checks that they are the function's own)."""

    namespace: Namespace | None
    hash: str | None
    block_tokens: int | None
    state_block_bytes: int | None
    durable: bool
    create: bool
    verify_reads: bool
    map_size: int | None
    max_bytes: int | None
    gc_grace: float | None
    read_only: bool | None
    remote: str | None
    remote_timeout: float | None
    push: bool
    shared_group: str | int | None
    signing_key: bytes | str | None
    remote_deadline: float | None


def open_store(
    cls: type[S],
    root: str | os.PathLike[str] | None = None,
    *,
    namespace: Namespace | None = None,
    hash: str | None = None,
    block_tokens: int | None = None,
    state_block_bytes: int | None = None,
    durable: bool = True,
    create: bool = True,
    verify_reads: bool = True,
    map_size: int | None = None,
    max_bytes: int | None = None,
    gc_grace: float | None = None,
    read_only: bool | None = None,
    remote: str | None = None,
    remote_timeout: float | None = None,
    push: bool = True,
    shared_group: str | int | None = None,
    signing_key: bytes | str | None = None,
    remote_deadline: float | None = None,
) -> S:
    """Open (and, with ``create``, make) the root.

    ``hash`` and ``block_tokens`` are fixed when a root is created; passing
    other values for an existing root is a :class:`RootSettingsError`.
    With ``max_bytes`` every save that takes the live bytes over it evicts
    least-recently-used entries until they fit (see :mod:`kvstore.local.gc`);
    ``gc_grace`` (default 600 s) is the grace that eviction honours.

    ``verify_reads`` (the default) checks every block a restore, load or
    export reads against its digest, over the bytes read; ``False`` skips
    the hashing for raw speed, and a block damaged on disk is then returned
    as cache data (sizes and file types are still checked). See the README.

    ``remote`` (default ``$KVSTORE_REMOTE``; ``""`` for none) is an
    ``s3://BUCKET/PREFIX`` that this root shares with others: lookups consult it,
    restores pull from it, and saves are queued for upload (``push=False``: only
    :meth:`push` uploads). ``remote_timeout`` (default 5 s,
    ``kvstore.remote.DEFAULT_TIMEOUT``) bounds each request and each lookup.
    ``remote_deadline`` (seconds; None: no deadline) bounds a lookup and the pull of what
    it found on the remote together: a hit not pulled by then is not used, and its pull
    goes on in the background (``Tiers.deadline``; ``kvstore serve`` sets one). The
    remote tier's modules (and boto3) are imported only for a store that has one.

    A new root is private to its owner (directories 0700, files 0600, whatever the
    umask); ``shared_group`` (a group name or gid) creates it shared with that group
    instead: setgid directories of that group, group-writable files, nothing for
    others. Every later writer keeps the root's modes; see
    :mod:`kvstore.local.modes`.

    ``signing_key`` (default ``$KVSTORE_SIGNING_KEY``, or the file
    ``$KVSTORE_SIGNING_KEY_FILE`` names; ``""`` for none; at least 16 bytes) signs every
    manifest this store puts on the remote, and makes it refuse every remote manifest not
    signed with it (counted in ``counters.remote_refused``; docs/FORMAT.md, "Signed
    entries"). It is never written to the root or the bucket.
    """
    options = StoreOptions(namespace=namespace, verify_reads=verify_reads, push=push,
                           max_bytes=max_bytes,
                           gc_grace=DEFAULT_GRACE if gc_grace is None else gc_grace,
                           remote_deadline=remote_deadline)  # checked before the root is made
    path = Path(root) if root is not None else default_root()
    url = os.environ.get("KVSTORE_REMOTE", "") if remote is None else remote
    counters = StoreCounters()  # the store's, and the remote reports its refusals there
    rem = None
    if url:
        from ..remote import DEFAULT_TIMEOUT, Remote

        rem = Remote(url, timeout=DEFAULT_TIMEOUT if remote_timeout is None
                     else remote_timeout, signing_key=signing_key,
                     on_refused=lambda _digest: counters.add(remote_refused=1))
    try:
        if rem is not None and create and not has_root(path) and hash is None \
                and block_tokens is None:  # a new root takes the remote's settings
            theirs = rem.read_settings(none_if_unreachable=True)
            if theirs is not None:
                hash, block_tokens = theirs.hash, theirs.block_tokens
                state_block_bytes = state_block_bytes or theirs.state_block_bytes
        local = Root.open(path, hash=hash, block_tokens=block_tokens,
                          state_block_bytes=state_block_bytes, durable=durable,
                          create=create, map_size=map_size, read_only=read_only,
                          shared_group=shared_group)
    except BaseException:
        if rem is not None:
            rem.close()
        raise
    ro, settings = local.read_only, local.settings
    store = cls(local, replace(options, read_only=ro), remote=rem, counters=counters)
    if rem is not None:
        try:
            rem.attach(settings, create=create and not ro)
        except BaseException as e:
            from ..remote.errors import RemoteUnavailableError

            if not isinstance(e, RemoteUnavailableError):
                store.close()
                raise
            # works locally; the remote's settings are checked at its first use
            store.tiers.later(rem, lambda: rem.attach(settings, create=True), e)
    return store


__all__ = ["OpenOptions", "StoreOptions", "open_store"]
