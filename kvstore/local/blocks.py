"""Content-addressed block files under ``<root>/blocks/ab/<64 hex>``.

Blocks are immutable: a block that exists is never rewritten (new blocks are
linked into place, which fails rather than replaces). Writes go to ``tmp/``
on the same filesystem, are fsynced when the root is durable, then linked
into place; the fan-out directories are fsynced once per batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .._vio import full_fsync, pwritev_all
from ..blocks import base
from ..blocks.hashing import Digest, check_digest, new_hasher
from ..blocks.pools import io_pool
from ..errors import (
    BlockNotFoundError,
    CorruptBlockError,
    RootPermissionError,
    StoreFullError,
    UnsafeRootError,
)

Buffer = bytes | memoryview
_counter = itertools.count()
# Block files are opened without following a symlink and without blocking on a FIFO;
# what is opened is then checked to be a regular file (see LocalBlockStore.open).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for errors and reports)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now (Linux; a hint only).

    The device then works while the caller hashes and copies the next blocks,
    and the fsync that follows mostly finds the data already on its way.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class LocalBlockStore(base.BlockStore):
    """Block files by digest under ``<root>/blocks/ab/<hex>``; knows nothing of tokens or caches."""

    def __init__(
        self, root: Path, algo: str, *, durable: bool = True, read_only: bool = False,
        file_mode: int = 0o600, dir_mode: int = 0o700,
    ) -> None:
        self.root = root
        self.algo = algo
        self.durable = durable
        self.read_only = read_only
        # the root's modes (kvstore.local.modes): private by default; bits for the
        # group (a shared root) are set again after the umask took them away
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self._group_bits = bool((file_mode | dir_mode) & 0o070)
        self.blocks_dir = root / "blocks"
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        self._blocks = str(self.blocks_dir)

    # --- paths -----------------------------------------------------------

    def path(self, digest: bytes) -> Path:
        """The file of ``digest``; the digest is validated before the path is built."""
        return Path(self._path(digest))

    def _path(self, digest: bytes) -> str:
        # a str, not a Path: the hot paths build one per block per save
        hx = check_digest(digest).hex()
        return f"{self._blocks}/{hx[:2]}/{hx}"

    def where(self, digest: bytes) -> str:
        return self._path(digest)

    def exists(self, digest: bytes) -> bool:
        """Whether the block is a regular file (a symlink or a FIFO in its place is not)."""
        try:
            return stat.S_ISREG(os.lstat(self._path(digest)).st_mode)
        except FileNotFoundError:
            return False

    def size(self, digest: bytes) -> int | None:
        """The block file's size (of the name itself: a symlink is not followed)."""
        try:
            return os.lstat(self._path(digest)).st_size
        except FileNotFoundError:
            return None

    def freshen(self, digest: bytes) -> bool:
        """Touch an existing block's mtime (so a grace period spares it); False if missing.

        Only a regular file is freshened (and so reused by a save): a symlink is
        never followed to touch the file it points at.
        """
        self.check_writable()
        path = self._path(digest)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return False
            os.utime(path, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    # --- writes ----------------------------------------------------------

    def where_all(self) -> str:
        return str(self.root)

    def stage(self, pieces: Sequence[Buffer], *, sync: bool = False) -> base.Staged:
        """Write ``pieces`` to a new temp file in ``tmp/``.

        With ``sync`` the file is fsynced before this returns. Without it, on a
        durable root, the file's writeback is started without waiting for it, so a
        caller writing many blocks can fsync them together afterwards
        (:meth:`sync_staged`).
        """
        self.check_writable()
        name = f"{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}.tmp"
        tmp = self.tmp_dir / name
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
            try:
                if self._group_bits:
                    os.fchmod(fd, self.file_mode)
                views = [memoryview(p) for p in pieces]
                pwritev_all(fd, views, 0)
                if sync:
                    full_fsync(fd)
                elif self.durable:
                    _start_writeback(fd)
            finally:
                os.close(fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"{self.root}: no space left writing a block") from e
            raise
        return base.Staged(path=str(tmp), size=sum(v.nbytes for v in views))

    def sync_staged(self, staged: base.Staged) -> None:
        """fsync a temp file staged without ``sync``."""
        fd = os.open(staged.path, _OPEN_FLAGS)
        try:
            full_fsync(fd)
        finally:
            os.close(fd)

    def publish(self, staged: base.Staged, digest: bytes) -> bool:
        """Link a temp file into place as ``digest``; never replaces an existing block.

        True when this call created the block; the temp file is removed either way.
        """
        self.check_writable()
        tmp = staged.path
        final = self._path(digest)
        try:
            try:
                os.link(tmp, final)
            except FileNotFoundError:  # the first block of its fan-out directory
                self._mkdir(os.path.dirname(final))
                os.link(tmp, final)
            created = True
        except FileExistsError:
            created = False
            if not self.exists(digest) and self.quarantine(digest) is not None:
                # a symlink, FIFO or directory held the name: moved aside, ours goes in
                try:
                    os.link(tmp, final)
                    created = True
                except FileExistsError:
                    pass
        finally:
            self.discard(staged)
        return created

    def _mkdir(self, path: str) -> None:
        """A directory of the root with the root's mode (an existing one is left alone)."""
        try:
            os.mkdir(path, self.dir_mode)
        except FileExistsError:
            return
        except FileNotFoundError:  # blocks/ itself (a bare block store, as in tests)
            self._mkdir(os.path.dirname(path))
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, self.dir_mode)
        if self._group_bits:  # through a descriptor: never chmod what a link points at
            fd = open_real_dir(Path(path))
            try:
                os.fchmod(fd, self.dir_mode)
            finally:
                os.close(fd)

    def discard(self, staged: base.Staged) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged.path)

    def sync_published(self, digests: Iterable[bytes]) -> None:
        """fsync the fan-out directories of these blocks, so their names survive a crash
        (nothing when the root is not durable)."""
        if not self.durable:
            return
        for d in sorted({os.path.dirname(self._path(d)) for d in digests}):
            fd = open_real_dir(Path(d))
            try:
                full_fsync(fd)
            finally:
                os.close(fd)

    def put_many(self, blocks: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        """Store the blocks not stored yet, as they come: each written to a temp file (its
        writeback started, its bytes then let go), then, on a durable root, all fsynced
        together on the I/O threads, linked into place and their directories fsynced once."""
        self.check_writable()
        out: list[bool] = []
        staged: dict[int, tuple[bytes, base.Staged]] = {}
        created: list[bytes] = []
        try:
            for d, pieces in blocks:
                if not self.exists(d):
                    staged[len(out)] = (d, self.stage(pieces))
                out.append(False)
            if self.durable:
                list(io_pool().map(lambda x: self.sync_staged(x[1]), staged.values()))
            for i in list(staged):
                d, st = staged.pop(i)
                out[i] = self.publish(st, d)
                if out[i]:
                    created.append(d)
        finally:
            for _, st in staged.values():
                self.discard(st)
        self.sync_published(created)
        return out

    def _put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        """Store one block unless it exists; True when it was written now."""
        if self.exists(digest):
            return False
        created = self.publish(self.stage(pieces, sync=self.durable), digest)
        self.sync_published([digest])
        return created

    # --- reads -----------------------------------------------------------

    def open(self, digest: bytes, size: int | None = None) -> int:
        """A read-only fd of the block (the caller closes it).

        The name must be a regular file (of ``size`` bytes, when given): a
        symlink is not followed, a FIFO is not waited on, and either, like a
        directory or a file of the wrong size, is a :class:`CorruptBlockError`.
        A missing file is a :class:`BlockNotFoundError`.
        """
        path = self._path(digest)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise BlockNotFoundError(f"block {digest.hex()} is missing") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptBlockError(path, "a regular file", "a symbolic link",
                                        digest=digest.hex()) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptBlockError(path, "a regular file", file_kind(st.st_mode),
                                        digest=digest.hex())
            if size is not None and st.st_size != size:
                raise CorruptBlockError(path, f"{size} bytes", f"{st.st_size} bytes",
                                        digest=digest.hex())
        except BaseException:
            os.close(fd)
            raise
        return fd

    def get(self, digest: bytes, *, verify: bool = True) -> bytes:
        """The block's bytes, checked against its digest when ``verify``."""
        data = b"".join(self._chunks(digest))
        if verify:
            self.check(digest, data)
        return data

    def hash_stored(self, digest: bytes) -> bytes:
        return self.hash_file(digest)  # streamed from the file, never read whole

    def hash_file(self, digest: bytes) -> bytes:
        """The digest of the block file's current bytes (a regular file, opened as by open)."""
        h = new_hasher(self.algo)
        for chunk in self._chunks(digest):
            h.update(chunk)
        return h.digest()

    def _chunks(self, digest: bytes) -> Iterator[bytes]:
        """The block file's bytes in 4 MiB reads (a regular file, opened as by open)."""
        fd = self.open(digest)
        try:
            pos = 0
            while chunk := os.pread(fd, 1 << 22, pos):
                yield chunk
                pos += len(chunk)
        finally:
            os.close(fd)

    def inspect(self, digest: bytes, size: int, *, read_data: bool) -> tuple[str, str, int]:
        """``(state, what is wrong, bytes hashed)`` of one block file; state is 'ok',
        'missing', 'corrupt' (not a regular file, the wrong size, or with ``read_data``
        bytes that do not hash to ``digest``) or 'sized': a file whose bytes hash to
        ``digest`` but that is not of ``size`` bytes. Such a block is good: the size is
        the claim of a manifest, and that manifest is the bad party (docs/FORMAT.md,
        "Trust"), so a file of another size is always hashed before it is called corrupt.
        """
        try:
            st = os.lstat(self._path(digest))
        except FileNotFoundError:
            return "missing", "no file", 0
        if not stat.S_ISREG(st.st_mode):
            return "corrupt", file_kind(st.st_mode), 0
        if st.st_size != size:
            return self._misstated(digest, st.st_size, size)
        if not read_data:
            return "ok", "", 0
        try:
            got = self.hash_file(digest)
        except BlockNotFoundError:
            return "missing", "no file", 0
        except CorruptBlockError as e:
            return "corrupt", e.actual, 0
        if got != digest:
            return "corrupt", f"bytes hashing to {got.hex()}", st.st_size
        return "ok", "", st.st_size

    # --- deletion and listing ----------------------------------------------

    def _delete(self, digest: bytes) -> bool:
        """Unlink the block; False when it was already gone.

        A directory in a block's place is moved to ``quarantine/`` instead
        (unlink cannot remove it, and GC must not stop at it).
        """
        try:
            self.path(digest).unlink()
            return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            return self.quarantine(digest) is not None
        except PermissionError:
            raise denied(os.path.dirname(self._path(digest)), "remove a block") from None

    def quarantine(self, digest: bytes) -> str | None:
        """Move a (corrupt) block aside into ``quarantine/``; None when it was gone.

        The move goes through a descriptor of ``quarantine/`` opened without
        following a symlink, so it can never land outside the root. The name is
        moved, never what a symlink points at; a directory or a FIFO moves like a
        file. A block already in quarantine is replaced (a directory there is
        given a numbered name beside it).
        """
        self.check_writable()
        self._mkdir(str(self.quarantine_dir))
        dfd = open_real_dir(self.quarantine_dir)
        name = digest.hex()
        try:
            for i in range(100):
                try:
                    os.replace(self._path(digest), name, dst_dir_fd=dfd)
                    return str(self.quarantine_dir / name)
                except FileNotFoundError:
                    return None
                except PermissionError:
                    raise denied(os.path.dirname(self._path(digest)),
                                 "move a block to quarantine/") from None
                except OSError as e:  # a directory on one side of the rename, not both
                    if e.errno not in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    name = f"{digest.hex()}.{i + 1}"
        finally:
            os.close(dfd)
        return None

    def quarantined(self) -> int:
        """How many names ``quarantine/`` holds (blocks moved aside as corrupt)."""
        try:
            with os.scandir(self.quarantine_dir) as it:
                return sum(1 for _ in it)
        except (FileNotFoundError, NotADirectoryError):
            return 0

    def stat(self, digest: bytes) -> base.BlockStat | None:
        try:
            st = os.lstat(self._path(digest))  # a link's own age, never its target's
        except FileNotFoundError:
            return None
        return base.BlockStat(st.st_size, st.st_mtime)

    def iter(self) -> Iterator[Digest]:
        return iter(self)

    def __iter__(self) -> Iterator[Digest]:
        """Every block file's digest (names that are not digests are skipped).

        Symlinked fan-out directories are not followed (the root's check at open
        refuses them; one made later is skipped here).
        """
        try:
            dfd = open_real_dir(self.blocks_dir)
        except FileNotFoundError:
            return
        try:
            with os.scandir(dfd) as it:
                fans = sorted(e.name for e in it if len(e.name) == 2
                              and e.is_dir(follow_symlinks=False))
            for fan in fans:
                try:
                    ffd = os.open(fan, _DIR_FLAGS, dir_fd=dfd)
                except OSError:  # gone, or swapped for a symlink since the listing
                    continue
                try:
                    with os.scandir(ffd) as it:
                        names = [e.name for e in it
                                 if len(e.name) == 64 and e.name.startswith(fan)]
                finally:
                    os.close(ffd)
                for name in names:
                    try:
                        yield check_digest(bytes.fromhex(name))
                    except ValueError:
                        continue
        finally:
            os.close(dfd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def denied(directory: str | Path, what: str) -> RootPermissionError:
    """The error of a change refused in one of the root's directories: which directory,
    whose it is, its mode, and the fix (a shared root's directories are 2770: a member's
    umask or a hand-made directory can leave one without the group's write bit)."""
    try:
        st = os.stat(directory)
    except OSError as e:
        return RootPermissionError(f"{directory}: cannot {what}: {e.strerror or e}")
    import grp
    import pwd

    def name(get: Callable[[int], object], n: int) -> str:
        try:
            return str(get(n)[0])  # type: ignore[index]
        except KeyError:
            return str(n)

    owner, group = name(pwd.getpwuid, st.st_uid), name(grp.getgrgid, st.st_gid)
    me = name(pwd.getpwuid, os.geteuid())
    mode = stat.S_IMODE(st.st_mode)
    fix = (f"chmod 2770 {directory}" if mode & stat.S_ISGID else f"chmod u+rwx {directory}")
    return RootPermissionError(
        f"{directory}: cannot {what}: the directory is {owner}'s (group {group}), mode "
        f"{mode:04o}, which {me} cannot write; its owner or an administrator fixes it: {fix}")


def open_real_dir(path: Path) -> int:
    """An fd of the directory ``path``, refusing a symlink in its place (UnsafeRootError)."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeRootError(
                f"{path} is a symlink or not a directory; kvstore never follows a root's "
                "own directories out of the root"
            ) from None
        raise
