"""The cache root on disk, the local tier: its layout, its fixed settings, opening it, and
copying an entry into it from another tier."""

from __future__ import annotations

import logging
import os
import shlex
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import platformdirs

from ..blocks import ALGORITHMS, BlockStat, BlockStore
from ..catalog.base import Copied, Tier, check_size
from ..catalog.records import Records
from ..catalog.settings import DEFAULT_BLOCK_TOKENS, DEFAULT_STATE_BLOCK, TierSettings
from ..errors import KVStoreError, NotAStoreError, RootSettingsError, UnsafeRootError
from ..index import Index, Totals, now_ms
from .blocks import LocalBlockStore
from .catalog import LocalCatalog
from .filesystem import check_filesystem
from .modes import (
    PRIVATE,
    RootModes,
    check_index_files,
    fix_file,
    group_id,
    group_name,
    make_dir,
    make_root_dir,
    modes_of,
    shared_modes,
)

_LAYOUT = ("index", "blocks", "tmp", "quarantine")
# the `model fetch` of earlier versions put its model cache in <user cache>/kvstore/models,
# inside the default root: a root may hold such a folder (kvstore.models names the marker)
_LEGACY_MODELS = "models"
_CONVERTED = ".kvstore-converted"
_log = logging.getLogger("kvstore")
_settings_dec = msgspec.msgpack.Decoder(TierSettings)


@dataclass
class Lacking:
    """The blocks of an entry a root lacks (:meth:`Root.lacking`), their bytes as its
    manifest gives them, and how many it holds already."""

    digests: list[bytes] = field(default_factory=list)
    size: int = 0
    present: int = 0


class Root(Tier):
    """The local tier, an open root: its path, settings, LMDB catalog and block files. What
    gc, verify and repair work on (never the Store)."""

    name = "local"

    def __init__(self, path: Path, settings: TierSettings, index: Index,
                 blocks: LocalBlockStore, *, name: str = "local") -> None:
        self.path = path
        self.settings = settings
        self.index = index
        self.blocks: LocalBlockStore = blocks
        #: "local" for a store's own root; another name for a root below it (a tier of
        #: :class:`~kvstore.store.tiers.Tiers`, whose matches say which tier holds them)
        self.name = name
        self.catalog: LocalCatalog = LocalCatalog(index, name=name)

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        hash: str | None = None,
        block_tokens: int | None = None,
        state_block_bytes: int | None = None,
        durable: bool = True,
        create: bool = True,
        map_size: int | None = None,
        read_only: bool | None = None,
        shared_group: str | int | None = None,
        name: str = "local",
    ) -> Root:
        """The root at ``path``, opened whole (made first with ``create``; see
        :func:`open_root` for the settings, modes and read-only rules): its index, its
        block files with the root's modes, its catalog migrated when it can be written."""
        index, settings, ro = open_root(path, hash=hash, block_tokens=block_tokens,
                                        state_block_bytes=state_block_bytes, durable=durable,
                                        create=create, map_size=map_size,
                                        read_only=read_only, shared_group=shared_group)
        try:
            modes = modes_of(path)
            root = cls(path, settings, index,
                       LocalBlockStore(path, settings.hash, durable=durable, read_only=ro,
                                       file_mode=modes.files, dir_mode=modes.dirs),
                       name=name)
            root.catalog.migrate(writable=not ro)
        except BaseException:
            index.close()
            raise
        return root

    @property
    def read_only(self) -> bool:
        """Whether the root was opened read-only (no saves, deletes, compaction, repair)."""
        return self.blocks.read_only

    def close(self) -> None:
        """Close the index (a second close does nothing)."""
        self.index.close()

    # --- the root's own records, beside its entries -------------------------------

    def meta(self, key: bytes) -> bytes | None:
        """The root's record named ``key`` (settings, usage counts, a tenant key), or None."""
        return self.index.get_meta(key)

    def meta_if_absent(self, key: bytes, value: bytes) -> bytes:
        """Write ``value`` under ``key`` unless a record is there; the record that is (one
        transaction: of two processes, both get the first one's)."""
        return self.index.put_meta_if_absent(key, value)

    def update_meta(self, key: bytes, update: Callable[[bytes | None], bytes]) -> bytes:
        """Replace the record ``key`` by ``update(old)`` in one write transaction; the new
        value."""
        with self.index.write() as txn:
            new = update(self.index.get_meta(key, txn))
            self.index.put_meta(key, new, txn)
        return new

    def record_access(self, hits: dict[bytes, int], *, lookups: int, found: int) -> None:
        """Stamp the entries served (``hits``: digest to the times it was served) with the
        time now, and add the lookup counts."""
        self.index.record_access(hits, lookups=lookups, found=found)

    def totals(self) -> Totals:
        """Entries, blocks and bytes, as the index counts them."""
        return self.index.totals()

    def block_files(self) -> Iterator[tuple[bytes, BlockStat]]:
        """Every block file with its size and age (a file gone meanwhile is skipped)."""
        return self.blocks.iter_stats()

    def lacking(self, rec: Records) -> Lacking:
        """The blocks of ``rec`` this root lacks, each block inspected once (what
        :meth:`take` copies; a caller sizes its wait on it). A block here whose size is
        not the one the manifest gives it refuses the entry with a ManifestError."""
        out = Lacking()
        for d in rec.blocks:
            state, _, size = self.blocks.inspect(d, rec.blocks[d], read_data=False)
            if state == "sized":
                check_size(rec, d, size, self.blocks.where(d))
            if state == "missing":
                out.digests.append(d)
                out.size += rec.blocks[d]
            else:
                out.present += 1
        return out

    def take(self, rec: Records, source: BlockStore, lacking: Lacking | None = None) -> Copied:
        """Copy an entry in from another tier: the blocks this root lacks (``lacking``, as
        :meth:`lacking` found them; None: found now), downloaded and verified before the
        commit (never inside its write transaction), then the records; a block a local GC
        took meanwhile is fetched again in the commit.

        A block whose size is not the one the manifest gives it (a download, or a file
        here, that hashes to its name) refuses the entry with a ManifestError (the block
        is good, the manifest lies). An entry that is not committed leaves none of the
        blocks it wrote behind: they are unlinked while no entry references them."""
        if lacking is None:
            lacking = self.lacking(rec)
        got = Copied(present=lacking.present)
        wrote: list[bytes] = []

        def ensure(digests: Sequence[bytes]) -> None:
            again = [d for d in digests if not self.blocks.exists(d)]
            self.copy_blocks(source, again, rec.blocks, rec=rec, wrote=wrote)

        since = now_ms()
        try:
            copied = self.copy_blocks(source, lacking.digests, rec.blocks, rec=rec, wrote=wrote)
            got.blocks, got.bytes = copied.blocks, copied.bytes
            got.created = self.catalog.commit(rec, ensure)
        except BaseException:
            self._unlink_unreferenced(wrote, since)
            raise
        return got

    def copy_blocks(self, source: BlockStore, digests: Sequence[bytes],
                    sizes: Mapping[bytes, int] | None = None, *, rec: Records | None = None,
                    wrote: list[bytes] | None = None) -> Copied:
        """Write blocks of ``source`` into this root: each read verified (``get_many``: one
        larger than ``sizes`` gives it is refused unread) and written as it comes, one in
        memory at a time; with ``rec``, one whose size is not the one its manifest gives
        refuses the entry (a ManifestError). The one way blocks of another tier come in:
        :meth:`take` (a pull) and a read of a block only a tier below holds
        (:class:`~kvstore.store.composed.ComposedBlocks`). ``wrote``: each block is added
        before it is written (a failed take unlinks them). The blocks (and bytes) read."""
        got = Copied()

        def fetched() -> Iterator[tuple[bytes, list[bytes]]]:
            for d, data in source.get_many(digests, sizes):
                if rec is not None:
                    check_size(rec, d, len(data), source.where(d))
                if wrote is not None:
                    wrote.append(d)
                got.blocks += 1
                got.bytes += len(data)
                yield d, [data]

        self.blocks.put_many(fetched())
        return got

    def _unlink_unreferenced(self, digests: Sequence[bytes], since: int) -> None:
        """Unlink the blocks a failed copy wrote that no entry references (a save that
        found one of them freshens it, or its commit writes it again)."""
        try:
            with self.index.write() as txn:
                for d in digests:
                    st = self.blocks.stat(d)
                    if self.index.get_ref(d, txn) is None and st is not None and \
                            st.mtime * 1000 >= since - 1000:
                        self.blocks.delete(d)
        except (KVStoreError, OSError) as e:
            _log.warning("kvstore: blocks of an entry not copied left for compact: %s", e)


def default_root() -> Path:
    """``$KVSTORE_ROOT``, else the user cache dir."""
    env = os.environ.get("KVSTORE_ROOT")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("kvstore", appauthor=False))


def _real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory of its own (not a symlink); False when absent.

    Anything else in a root directory's place is an :class:`UnsafeRootError`:
    a sweep or a repair through a symlink would reach files outside the root.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRootError(
            f"{path} is a symlink; a root's own directories must be real directories inside "
            "it (kvstore never follows them out of the root)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRootError(f"{path} is not a directory")
    return True


def check_layout(path: Path) -> None:
    """Check that ``index/``, ``blocks/``, ``tmp/``, ``quarantine/`` and every fan-out
    directory of ``blocks/`` that exists is a real directory, not a symlink.

    The root itself may be reached through a symlink (``~/.cache/kvstore -> /data``).
    """
    for sub in _LAYOUT:
        _real_dir(path / sub)
    blocks = path / "blocks"
    if not blocks.is_dir():
        return
    with os.scandir(blocks) as it:
        for e in it:
            if e.is_symlink():
                raise UnsafeRootError(
                    f"{e.path} is a symlink; a root's block directories must be real "
                    "directories inside it (kvstore never follows them out of the root)"
                )


def legacy_models(path: Path) -> bool:
    """Whether ``path`` is kvstore 0.1.0's model cache: only ``wheels/``, converted model
    directories (with their marker) and the hidden temp folders of a conversion."""
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        for e in path.iterdir():
            if e.name.startswith("."):
                continue  # a conversion's temp dir (".gguf-…", ".<model>.…")
            if e.name == "wheels" and e.is_dir() and not e.is_symlink():
                continue
            if e.is_dir() and not e.is_symlink() and (e / _CONVERTED).is_file():
                continue
            return False
    except OSError:
        return False
    return True


def _foreign(path: Path) -> list[str]:
    """What a directory about to become a root holds that is not a root's own."""
    return [p.name for p in path.iterdir()
            if p.name not in _LAYOUT and not (p.name == _LEGACY_MODELS and legacy_models(p))]


def root_writable(path: Path) -> bool:
    """Whether this process can write the root's index (False on a read-only mount)."""
    idx = path / "index"
    return all(os.access(p, os.W_OK) for p in (idx, idx / "data.mdb"))


def has_root(path: Path) -> bool:
    """Whether ``path`` holds a root already (its index)."""
    return (path / "index" / "data.mdb").exists()


def open_root(
    path: Path,
    *,
    hash: str | None,
    block_tokens: int | None,
    state_block_bytes: int | None,
    durable: bool,
    create: bool,
    map_size: int | None,
    read_only: bool | None = None,
    shared_group: str | int | None = None,
) -> tuple[Index, TierSettings, bool]:
    """Open (and, with ``create``, make) the root at ``path``: its index, settings and
    whether it is open read-only.

    A directory that holds anything but a root's own folders is never taken over.
    ``read_only=None`` opens read-only when the root cannot be written (a
    read-only mount, another user's root), with one notice; a read-only root is
    never created. A new root is private to its owner, or with ``shared_group``
    shared with that group (see :mod:`kvstore.local.modes`); an existing root
    keeps its modes, and naming a group it is not shared with is a
    :class:`RootSettingsError`.
    """
    if hash is not None and hash not in ALGORITHMS:
        raise RootSettingsError(f"unknown hash {hash!r}; choose from {', '.join(ALGORITHMS)}")
    if block_tokens is not None and block_tokens <= 0:
        raise RootSettingsError(f"block_tokens must be positive, got {block_tokens}")
    idx_dir = path / "index"
    if path.exists() and not path.is_dir():  # before any hint to create a root there
        raise NotAStoreError(f"{path} is a file, not a directory: a kvstore root is a directory")
    check_layout(path)
    fresh = not (idx_dir / "data.mdb").exists()
    if fresh:
        if not create or read_only:
            raise NotAStoreError(f"{path} is not a kvstore root (no index/)", command="init")
        if path.is_dir() and _foreign(path):
            raise NotAStoreError(f"{path} is not a kvstore root and is not empty")
    elif read_only is None and not root_writable(path):
        read_only = True
        _log.warning("kvstore: %s is not writable; opened read-only (no saves, deletes, "
                     "compaction or repair)", path)
    read_only = bool(read_only)
    asked = PRIVATE if shared_group is None else shared_modes(group_id(shared_group))
    if create and not read_only:
        if fresh:
            make_root_dir(path, asked)
        for sub in ("index", "blocks", "tmp"):  # an existing root's, with its own modes
            make_dir(path / sub, asked if fresh else modes_of(path))
        check_layout(path)  # what mkdir found in place
    modes = modes_of(path)
    if shared_group is not None and modes != asked:
        raise RootSettingsError(_not_shared(path, modes, asked))
    check_filesystem(path)
    kwargs: dict[str, Any] = {"durable": durable, "readonly": read_only, "mode": modes.files}
    if map_size is not None:
        kwargs["map_size"] = map_size
    # LMDB opens both files by name, following links: a member of a shared root could put
    # a link to another member's file there. Checked before, and again once opened (a link
    # put in place meanwhile is refused, the environment closed unused)
    check_index_files(idx_dir, modes)
    index = Index(idx_dir, **kwargs)
    try:
        check_index_files(idx_dir, modes)
        for name in ("data.mdb", "lock.mdb"):  # LMDB made them less what the umask took
            fix_file(idx_dir / name, modes)
    except BaseException:
        index.close()
        raise
    try:
        raw = index.get_meta(b"settings")
        if raw is None:
            if read_only:
                raise NotAStoreError(f"{path} has no settings yet (a root being created?)")
            proposed = TierSettings(
                hash=hash or "blake3",
                block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
                state_block_bytes=state_block_bytes or DEFAULT_STATE_BLOCK,
                created_at=now_ms(),
            )
            # one transaction: of two processes creating this root at once, the
            # second reads the first's settings and is checked against them below
            raw = index.put_meta_if_absent(b"settings", msgspec.msgpack.encode(proposed))
        settings = _settings_dec.decode(raw)
        for name, want, have in (
            ("hash", hash, settings.hash),
            ("block_tokens", block_tokens, settings.block_tokens),
            ("state_block_bytes", state_block_bytes, settings.state_block_bytes),
        ):
            if want is not None and want != have:
                raise RootSettingsError(f"{path} was created with {name}={have!r}, not {want!r}")
    except BaseException:
        index.close()
        raise
    return index, settings, read_only


def _not_shared(path: Path, have: RootModes, want: RootModes) -> str:
    """Why an existing root cannot be opened as shared with ``want``'s group."""
    assert want.group is not None
    g = group_name(want.group)
    if have.group is not None:
        return f"{path} is shared with group {group_name(have.group)}, not {g}"
    root = shlex.quote(str(path))
    return (f"{path} is a private root (created before --shared-group, or without it); "
            f"kvstore never changes an existing root's modes. To share it with {g}, as its "
            f"owner: chgrp -R {g} {root} && chmod -R g+rwX,o-rwx {root} && "
            f"find {root} -type d -exec chmod g+s {{}} +")
