"""The cache root on disk, the local tier: its layout, its fixed settings, opening it, and
copying an entry into it from another tier."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import platformdirs

from ...blocks import ALGORITHMS, BlockStat, BlockStore, LocalBlockStore
from ...catalog.base import Copied, Tier
from ...catalog.records import Records
from ...catalog.settings import DEFAULT_BLOCK_TOKENS, DEFAULT_STATE_BLOCK, TierSettings
from ...errors import NotAStoreError, RootSettingsError, UnsafeRootError
from ...index import Index, now_ms
from .catalog import LocalCatalog
from .filesystem import check_filesystem

_LAYOUT = ("index", "blocks", "tmp", "quarantine")
# kvstore 0.1.0's `model fetch` put its model cache in <user cache>/kvstore/models, inside
# the default root: a root may hold such a folder (kvstore.mlx_lm.gguf names the marker)
_LEGACY_MODELS = "models"
_CONVERTED = ".kvstore-converted"
_log = logging.getLogger("kvstore")
_settings_dec = msgspec.msgpack.Decoder(TierSettings)


class Root(Tier):
    """The local tier, an open root: its path, settings, LMDB catalog and block files. What
    gc, verify and repair work on (never the Store)."""

    name = "local"

    def __init__(self, path: Path, settings: TierSettings, index: Index,
                 blocks: LocalBlockStore) -> None:
        self.path = path
        self.settings = settings
        self.index = index
        self.blocks: LocalBlockStore = blocks
        self.catalog: LocalCatalog = LocalCatalog(index)

    def block_files(self) -> Iterator[tuple[bytes, BlockStat]]:
        """Every block file with its size and age (a file gone meanwhile is skipped)."""
        return self.blocks.iter_stats()

    def take(self, rec: Records, source: BlockStore) -> Copied:
        """Copy an entry in from another tier: the blocks this root lacks, downloaded and
        verified before the commit (never inside its write transaction), then the records;
        a block a local GC took meanwhile is fetched again in the commit."""
        need = list(rec.blocks)
        missing = [d for d in need if not self.blocks.exists(d)]
        got = Copied(present=len(need) - len(missing))

        def fetched() -> Iterator[tuple[bytes, list[bytes]]]:  # one block in memory at a time
            for d, data in source.get_many(missing):
                got.blocks += 1
                got.bytes += len(data)
                yield d, [data]

        self.blocks.put_many(fetched())

        def ensure(digests: Sequence[bytes]) -> None:
            again = [d for d in digests if not self.blocks.exists(d)]
            self.blocks.put_many((d, [data]) for d, data in source.get_many(again))

        got.created = self.catalog.commit(rec, ensure)
        return got


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
) -> tuple[Index, TierSettings, bool]:
    """Open (and, with ``create``, make) the root at ``path``: its index, settings and
    whether it is open read-only.

    A directory that holds anything but a root's own folders is never taken over.
    ``read_only=None`` opens read-only when the root cannot be written (a
    read-only mount, another user's root), with one notice; a read-only root is
    never created.
    """
    if hash is not None and hash not in ALGORITHMS:
        raise RootSettingsError(f"unknown hash {hash!r}; choose from {', '.join(ALGORITHMS)}")
    if block_tokens is not None and block_tokens <= 0:
        raise RootSettingsError(f"block_tokens must be positive, got {block_tokens}")
    idx_dir = path / "index"
    check_layout(path)
    fresh = not (idx_dir / "data.mdb").exists()
    if fresh:
        if not create or read_only:
            raise NotAStoreError(f"{path} is not a kvstore root (no index/); run kvstore init")
        if path.exists() and not path.is_dir():
            raise NotAStoreError(f"{path} is not a directory")
        if path.is_dir() and _foreign(path):
            raise NotAStoreError(f"{path} is not a kvstore root and is not empty")
    elif read_only is None and not root_writable(path):
        read_only = True
        _log.warning("kvstore: %s is not writable; opened read-only (no saves, deletes, "
                     "compaction or repair)", path)
    read_only = bool(read_only)
    if create and not read_only:
        for sub in ("index", "blocks", "tmp"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        check_layout(path)  # what mkdir found in place
    check_filesystem(path)
    kwargs: dict[str, Any] = {"durable": durable, "readonly": read_only}
    if map_size is not None:
        kwargs["map_size"] = map_size
    index = Index(idx_dir, **kwargs)
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
