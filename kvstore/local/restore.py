"""Reading an entry back: open its blocks in one read transaction, restore the arrays,
and deal with a block that reads bad (quarantine it, cut back or drop the entries
that need it, name it in a :class:`CorruptBlockError`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..blocks import BlockCheck, BlockStore
from ..catalog.base import open_manifest
from ..codecs import AttachmentData, codec_for_record
from ..codecs.layout import (
    in_token_blocks,
    manifest_block_sizes,
    n_token_blocks,
    window_block_sizes,
)
from ..codecs.staging import Copier, cuda_copier
from ..errors import (
    CacheMismatchError,
    CorruptBlockError,
    EntryNotFoundError,
    KVStoreError,
    ManifestError,
)
from ..schema import Layer, ListLayer, Manifest, iter_tensor_specs
from . import gcpause, reader
from .reader import Want, load_arrays, plan_runs
from .repair import plan_for_blocks
from .root import Root
from .staged import load_staged

_log = logging.getLogger("kvstore")

#: The copy step of a restore onto a GPU: where MLX's default device is a CUDA GPU, the
#: card's copy engines from pinned staging memory (:mod:`kvstore.local.staged`); None (the
#: arrays are filled in place, on the host) elsewhere. Tests put a host copier here.
copier_for_restore: Callable[[], Copier | None] = cuda_copier


def read_entry(
    root: Root, digest: bytes, length: int | None, verify: bool
) -> tuple[Manifest, list[Any], list[AttachmentData]]:
    """Read an entry (its first ``length`` tokens); a bad block is dealt with here.

    A block found bad is re-checked under the writer lock; if it reads right
    by then (another process replaced it) the read is tried once more.
    """
    for _ in range(2):
        try:
            return _read_once(root, digest, length, verify)
        except _BadBlocks as e:
            if _repair_bad(root, digest, e.bad):
                d = min(e.bad)
                raise CorruptBlockError(
                    root.blocks.where(d), f"block {d.hex()}", e.bad[d][0], digest=d.hex()
                ) from None
    return _read_once(root, digest, length, verify)

def _read_once(
    root: Root, digest: bytes, length: int | None, verify: bool
) -> tuple[Manifest, list[Any], list[AttachmentData]]:
    """Resolve an entry and open the blocks of its first ``length`` tokens (the first
    window of them: :class:`_BlockFiles`) in one read transaction, then restore."""
    files: _BlockFiles | None = None
    try:
        with root.index.read() as txn:
            raw = root.index.get_manifest(digest, txn)
            if raw is None:
                raise EntryNotFoundError(f"no entry {digest.hex()}")
            m = open_manifest(raw, digest)
            length = m.n_tokens if length is None else length
            if not 0 < length <= m.n_tokens:
                raise CacheMismatchError(f"cannot restore {length} of {m.n_tokens} tokens")
            specs = m.tensor_specs()
            tok_sizes, state_sizes = manifest_block_sizes(
                specs, m.n_tokens, m.block_tokens, m.state_bytes, m.state_block_bytes
            )
            win_sizes = window_block_sizes(specs, m.n_tokens, m.block_tokens)
            n_read = n_token_blocks(length, m.block_tokens) if m.token_blocks else 0
            salt = len(m.block_salt)  # after each block's tensors: in its size and digest
            needed = [(d, size + salt) for d, size in
                      zip(m.token_blocks[:n_read], tok_sizes[:n_read], strict=True)]
            needed += [(d, size + salt) for d, size in zip(m.window_blocks, win_sizes,
                                                           strict=True)]
            needed += [(d, size + salt) for d, size in zip(m.state_blocks, state_sizes,
                                                           strict=True)]
            files = _BlockFiles(root.blocks, needed)
            files.open_window(0, reader.FD_WINDOW)
            files.raise_failure()
        check = BlockCheck(root.settings.hash, needed, hashing=verify, tail=m.block_salt)
        with gcpause.paused():  # thousands of short-lived views and reads: kvstore.local.gcpause
            cache, atts = _materialize(m, length, n_read, files, check)
        files.raise_failure()
        bad = check.bad()
        if bad:
            sizes = dict(needed)
            raise _BadBlocks({d: (why, sizes[d]) for d, why in bad.items()})
    finally:
        if files is not None:
            files.close()
    return m, cache, atts


class _BlockFiles:
    """The descriptors of one read's blocks (``needed``: (digest, size) per slot), open
    a window of slots at a time, so an entry of any size holds at most
    ``reader.FD_WINDOW`` of them (importing mlx-lm sets the soft file limit to 2048).

    Opening never raises inside the load (an exception there would keep the stream
    alive through its traceback): the first block that cannot be opened is kept as
    ``failure`` (a missing file a :class:`BlockNotFoundError`, a wrong one
    :class:`_BadBlocks`, else the ``OSError``), no later window is opened, and
    :meth:`raise_failure` raises it once the load is over.
    """

    def __init__(self, blocks: BlockStore, needed: Sequence[tuple[bytes, int]]) -> None:
        self._blocks = blocks
        self._needed = needed
        self._fds: dict[bytes, int] = {}
        self._range = (0, 0)  # the slots whose files self._fds holds
        self.failure: Exception | None = None

    def open_window(self, lo: int, hi: int) -> dict[int, int]:
        """A descriptor per slot in ``[lo, hi)`` that opened (the window before is closed)."""
        hi = min(hi, len(self._needed))
        if self._range != (lo, hi):
            self.close()
            self._range = (lo, hi)
            for d, size in self._needed[lo:hi]:
                if self.failure is not None:
                    break
                if d in self._fds:
                    continue
                try:
                    self._fds[d] = self._blocks.open(d, size)
                except CorruptBlockError as e:
                    self.failure = _BadBlocks({d: (e.actual, size)})
                except (KVStoreError, OSError) as e:
                    self.failure = e.with_traceback(None)
        return {i: self._fds[d] for i in range(lo, hi) if (d := self._needed[i][0]) in self._fds}

    @contextmanager
    def window(self, lo: int, hi: int) -> Iterator[dict[int, int]]:
        try:
            yield self.open_window(lo, hi)
        finally:
            self.close()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        fds, self._fds, self._range = self._fds, {}, (0, 0)
        for fd in fds.values():
            os.close(fd)


def _repair_bad(root: Root, digest: bytes, bad: dict[bytes, tuple[str, int]]) -> bool:
    """Quarantine the blocks a read found bad and cut back or drop the entries that
    need them (a plan, executed in one write transaction; one warning); False when every block now
    reads right (it was replaced meanwhile: read again).

    A block that is not of the size the manifest of ``digest`` gives it but whose bytes
    hash to its name is good: that manifest lies, so that entry alone is dropped (the
    block and every other entry that shares it stay) and a :class:`ManifestError` says
    so."""
    sized: dict[bytes, str] = {}
    try:
        confirmed: dict[bytes, str] = {}
        gone: set[bytes] = set()
        for d, (why, size) in bad.items():
            state, now, _ = root.blocks.inspect(d, size, read_data=True)
            if state == "corrupt":
                confirmed[d] = now or why
            elif state == "missing":
                gone.add(d)
            elif state == "sized":
                sized[d] = now
        if sized:
            root.catalog.remove(digest)
        if not confirmed and not gone and not sized:
            return False
        with root.index.read() as txn:
            plan = plan_for_blocks(root, txn, confirmed, gone)
        done = plan.execute()
    except (KVStoreError, OSError) as e:
        names = ", ".join(f"{d.hex()} ({why})" for d, (why, _) in sorted(bad.items()))
        _log.warning("kvstore: corrupt block %s could not be quarantined: %s", names, e)
        return True
    if not done.empty():
        _log.warning("%s", done.summary())
    if sized:
        d = min(sized)
        msg = (f"{root.catalog.where(digest)} lies: block {d.hex()} is {sized[d]}; the "
               "entry is dropped, the block kept")
        _log.warning("kvstore: %s", msg)
        raise ManifestError(msg)
    return True

def _materialize(
    m: Manifest, length: int, n_read: int, files: _BlockFiles, check: BlockCheck
) -> tuple[list[Any], list[AttachmentData]]:
    wants: list[Want] = []
    for layer in _leaves(m.layers):
        codec = codec_for_record(layer)
        for spec in layer.tensors:
            cap = codec.token_capacity(layer, length) if in_token_blocks(spec) else None
            wants.append(Want(spec, cap))
    for a in m.attachments:
        wants.extend(Want(t) for t in a.tensors)
    shapes, plans = plan_runs(
        wants,
        n_tokens=m.n_tokens,
        length=length,
        block_tokens=m.block_tokens,
        token_blocks=n_read,
        window_blocks=len(m.window_blocks),
        state_blocks=len(m.state_blocks),
        state_block=m.state_block_bytes,
    )
    copier = copier_for_restore()
    if copier is not None:
        arrays = load_staged(shapes, plans, check, files, copier)
    else:
        arrays = load_arrays(shapes, plans, check, files)
    out: list[Any] = []
    pos = 0
    for layer in m.layers:
        count = len(iter_tensor_specs((layer,)))
        codec = codec_for_record(layer)
        drop = m.n_tokens - length
        out.append(codec.load(layer, arrays[pos : pos + count], length, drop=drop))
        pos += count
    atts = []
    for a in m.attachments:
        atts.append(
            AttachmentData(a.schema, a.metadata, tuple(arrays[pos : pos + len(a.tensors)]))
        )
        pos += len(a.tensors)
    return out, atts


class _BadBlocks(Exception):
    """Blocks a read found bad: digest -> (what is wrong, expected size)."""

    def __init__(self, bad: dict[bytes, tuple[str, int]]) -> None:
        super().__init__(", ".join(d.hex() for d in bad))
        self.bad = bad


def _leaves(layers: tuple[Layer, ...]) -> Iterator[Layer]:
    for layer in layers:
        if isinstance(layer, ListLayer):
            yield from _leaves(layer.children)
        else:
            yield layer
