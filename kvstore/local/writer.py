"""From snapshots to blocks: tensor specs, block pieces, digests, new block files.

Bytes leave MLX without a copy: each evaluated row-major array is viewed as a
memoryview and sliced into the runs that make up each block; hashing and the
writes of new blocks run on worker threads (both release the GIL).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import TypeVar

import mlx.core as mx
import msgspec

from .._crash import crash_point
from ..blocks import BlockStore, Digest, new_hasher
from ..blocks.base import Staged
from ..blocks.pools import io_pool
from ..codecs import Snapshot, TensorData
from ..codecs.forksafe import mlx_guard
from ..codecs.layout import (
    RESTORABLE_DTYPES,
    block_rows,
    dtype_name,
    geometry,
    n_token_blocks,
    window_first_block,
    window_rows,
)
from ..codecs.pieces import cut
from ..errors import CacheMismatchError, UnsupportedDtypeError
from ..schema import Layer, ListLayer, TensorSpec

Pieces = list[memoryview]
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass
class BlockSet:
    """The blocks of one save, in order, with their pieces and digests."""

    token_pieces: list[Pieces] = field(default_factory=list)
    state_pieces: list[Pieces] = field(default_factory=list)
    token_digests: list[Digest] = field(default_factory=list)
    state_digests: list[Digest] = field(default_factory=list)
    state_bytes: int = 0
    window_pieces: list[Pieces] = field(default_factory=list)
    window_digests: list[Digest] = field(default_factory=list)

    def by_digest(self) -> dict[bytes, Pieces]:
        out: dict[bytes, Pieces] = {}
        for digests, pieces in (
            (self.token_digests, self.token_pieces),
            (self.window_digests, self.window_pieces),
            (self.state_digests, self.state_pieces),
        ):
            for d, p in zip(digests, pieces, strict=True):
                out.setdefault(d, p)
        return out


def _view(td: TensorData) -> tuple[mx.array, memoryview]:
    arr = td.array
    mv = memoryview(arr)  # type: ignore[arg-type]
    if not mv.c_contiguous:  # rare: a transposed or sliced view; one copy
        mlx_guard()
        arr = mx.contiguous(arr)
        mx.eval(arr)
        mv = memoryview(arr)  # type: ignore[arg-type]
    return arr, mv.cast("B")


def _runs(td: TensorData, arr: mx.array, mv: memoryview, start: int, stop: int) -> Pieces:
    """Memory runs holding rows ``[start, stop)`` of ``td`` along its axis."""
    if td.length is None and not td.token:
        return [mv]
    g = geometry(tuple(arr.shape), dtype_name(arr.dtype), td.axis)
    full_run = g.rows * g.row_bytes
    a, b = start * g.row_bytes, stop * g.row_bytes
    if a == 0 and b == full_run:
        return [mv]
    return [mv[o * full_run + a : o * full_run + b] for o in range(g.outer)]


def place(
    snaps: Sequence[Snapshot], n_tokens: int, block_tokens: int, state_block: int
) -> tuple[tuple[Layer, ...], BlockSet]:
    """Evaluate the arrays, give every tensor its spec, and cut the blocks."""
    tds = [td for s in snaps for td in s.tensors]
    if not tds:
        raise CacheMismatchError("the cache holds no tensors")
    for i, td in enumerate(tds):
        _check_tensor(i, td)
    mlx_guard()
    mx.eval(*[td.array for td in tds])
    views = [_view(td) for td in tds]
    specs: list[TensorSpec] = []
    state_runs: Pieces = []
    offset = 0
    for i, (td, (arr, mv)) in enumerate(zip(tds, views, strict=True)):
        shape = td.shape
        if td.token:
            first = td.window_start or 0
            if td.length != n_tokens - first or not 0 <= first < n_tokens:
                held = f"{td.length} tokens" + (f" from token {first}" if first else "")
                raise CacheMismatchError(
                    f"tensor {i} holds {held} but {n_tokens} tokens were given"
                )
            specs.append(TensorSpec(shape=shape, dtype=dtype_name(arr.dtype), token_axis=td.axis,
                                    window_start=td.window_start))
        else:
            rows = td.length if td.length is not None else 0
            runs = _runs(td, arr, mv, 0, rows) if td.length is not None else [mv]
            specs.append(TensorSpec(shape=shape, dtype=dtype_name(arr.dtype), state_offset=offset))
            state_runs.extend(runs)
            offset += sum(len(r) for r in runs)
    out = BlockSet(state_bytes=offset)
    token = [(td, arr, mv) for td, (arr, mv) in zip(tds, views, strict=True)
             if td.token and td.window_start is None]
    window = [(td, arr, mv) for td, (arr, mv) in zip(tds, views, strict=True)
              if td.token and td.window_start is not None]
    if window:
        specs_w = [sp for sp in specs if sp.window_start is not None]
        for b in range(window_first_block(specs_w, block_tokens),
                       n_token_blocks(n_tokens, block_tokens)):
            run: Pieces = []
            for td, arr, mv in window:
                assert td.window_start is not None
                a, z = window_rows(td.window_start, b, n_tokens, block_tokens)
                if z > a:
                    run.extend(_runs(td, arr, mv, a, z))
            out.window_pieces.append(run)
    if token:
        for b in range(n_token_blocks(n_tokens, block_tokens)):
            start = b * block_tokens
            stop = start + block_rows(b, n_tokens, block_tokens)
            pieces: Pieces = []
            for td, arr, mv in token:
                pieces.extend(_runs(td, arr, mv, start, stop))
            out.token_pieces.append(pieces)
    out.state_pieces = cut(state_runs, state_block)
    layers = _assign(tuple(s.record for s in snaps), iter(specs))
    return layers, out


def _check_tensor(i: int, td: TensorData) -> None:
    """Refuse, before anything is evaluated or written, a tensor no restore could rebuild."""
    dtype = dtype_name(td.array.dtype)
    if dtype not in RESTORABLE_DTYPES:
        raise UnsupportedDtypeError(
            f"tensor {i} of the cache is {dtype}, which kvstore cannot restore; "
            f"supported: {', '.join(sorted(RESTORABLE_DTYPES))}"
        )
    if (td.token or td.length is not None) and not 0 <= td.axis < td.array.ndim:
        raise CacheMismatchError(
            f"tensor {i} of shape {tuple(td.array.shape)} has no axis {td.axis} to cut tokens on"
        )
    if 0 in td.shape:
        raise CacheMismatchError(f"tensor {i} has a zero-size shape {td.shape}: nothing to store")


def _assign(layers: tuple[Layer, ...], specs: Iterator[TensorSpec]) -> tuple[Layer, ...]:
    """Replace each leaf's specs, depth-first, with the placed ones."""
    out: list[Layer] = []
    for layer in layers:
        if isinstance(layer, ListLayer):
            out.append(msgspec.structs.replace(layer, children=_assign(layer.children, specs)))
        else:
            placed = tuple(next(specs) for _ in layer.tensors)
            out.append(msgspec.structs.replace(layer, tensors=placed))
    return tuple(out)


_INLINE_BYTES = 1 << 20  # below this a save hashes and writes on the caller's thread


def _map(fn: Callable[[_T], _R], items: Sequence[_T], nbytes: int) -> list[_R | BaseException]:
    """``fn`` over ``items``, on the I/O threads when it pays; an error is returned in place.

    Every call has finished when this returns (a caller cleaning up after a
    failure must not race a write still running); inline, the first error
    stops the rest, which are then left out.
    """
    if len(items) > 1 and nbytes >= _INLINE_BYTES:
        try:
            futures = [io_pool().submit(fn, x) for x in items]
        except RuntimeError:  # the interpreter is shutting down (a save from atexit)
            pass
        else:
            wait(futures)
            return [f.exception() or f.result() for f in futures]
    out: list[_R | BaseException] = []
    for x in items:
        try:
            out.append(fn(x))
        except Exception as e:
            out.append(e)
            break
    return out


def _first_error(results: Sequence[object]) -> BaseException | None:
    return next((r for r in results if isinstance(r, BaseException)), None)


def write_blocks(store: BlockStore, bs: BlockSet, known: Sequence[bytes] = ()) -> int:
    """Hash every block, write the missing ones, publish them; returns new bytes.

    Existing blocks are not rewritten, only freshened (so an orphan grace
    period spares them until this save commits its references). New blocks are
    staged first (a local root: temp files, each starting its writeback at
    once), synced together when the store is durable, then published: one batch
    of flushes the device serves in parallel, not a write-then-wait per block.
    ``known`` are digests the caller vouches for, for the first token blocks (a
    reused prefix): those are neither hashed nor written. When anything fails (a
    full disk) the staged blocks are discarded before the error is raised; blocks
    already published stay, as orphans that compact removes after the grace
    (another save may be using them by then).
    """
    all_pieces = bs.token_pieces[len(known) :] + bs.window_pieces + bs.state_pieces
    nbytes = sum(len(p) for pieces in all_pieces for p in pieces)

    def task(pieces: Pieces) -> tuple[Digest, Staged | None]:
        h = new_hasher(store.algo)
        for p in pieces:
            h.update(p)
        d = Digest(h.digest())
        if store.freshen(d):
            return d, None
        return d, store.stage(pieces)

    outcomes = _map(task, all_pieces, nbytes)
    done = [r for r in outcomes if not isinstance(r, BaseException)]
    pending = {id(st): st for _, st in done if st is not None}  # staged, not yet published
    try:
        error = _first_error(outcomes)
        if error is not None:
            raise error
        results = [r for r in outcomes if not isinstance(r, BaseException)]
        n_tok = len(bs.token_pieces) - len(known)
        n_win = n_tok + len(bs.window_pieces)
        bs.token_digests = [Digest(d) for d in known] + [d for d, _ in results[:n_tok]]
        bs.window_digests = [d for d, _ in results[n_tok:n_win]]
        bs.state_digests = [d for d, _ in results[n_win:]]
        fresh = [st for _, st in results if st is not None]
        if store.durable and fresh:
            error = _first_error(_map(store.sync_staged, fresh, nbytes))
            if error is not None:
                raise error
        created: list[bytes] = []
        new_bytes = 0
        for (d, st), pieces in zip(results, all_pieces, strict=True):
            if st is None:
                continue
            pending.pop(id(st))  # publish drops it, whatever happens
            if store.publish(st, d):
                new_bytes += sum(len(p) for p in pieces)
                created.append(d)
                crash_point("after_block_write")
        store.sync_published(created)
    finally:
        for st in pending.values():
            store.discard(st)
    return new_bytes
