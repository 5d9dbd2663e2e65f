"""Where each tensor's bytes go: token blocks, window blocks and state blocks.

Token block *i* holds rows ``[i*T, (i+1)*T)`` of every token-axis tensor, each
as the row-major bytes of its slice, concatenated in manifest order. Window
block *i* does the same for the window tensors (a sliding-window layer in token
order, holding tokens ``[window_start, n)``): the rows of absolute tokens
``[i*T, (i+1)*T)`` that each holds. The other tensors are concatenated into a
state stream cut into fixed-size blocks. The same arithmetic serves writing
(which memory runs form a block) and reading (which file ranges fill a
restored array).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..errors import ManifestError
from ..schema import DTYPES, Manifest, TensorSpec

#: MLX dtype name -> safetensors code.
SAFETENSORS_DTYPES = {d.name: d.safetensors for d in DTYPES.values() if d.safetensors}
#: mlx-bun's dtype name -> the dtype.
MLX_BUN_DTYPES = {d.mlx_bun: d for d in DTYPES.values() if d.mlx_bun}

# What a restore can rebuild: mx.load's safetensors reader has no float64 and
# safetensors no complex64, so a cache of either would save and never restore.
RESTORABLE_DTYPES = frozenset(DTYPES) - {"float64", "complex64"}


def dtype_name(dt: mx.Dtype) -> str:
    return str(dt).removeprefix("mlx.core.")


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class Geometry:
    """A tensor seen as ``outer`` runs of ``rows`` rows of ``row_bytes`` each.

    For a token tensor the rows are the token axis; a state tensor is one run.
    """

    outer: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.outer * self.rows * self.row_bytes


def geometry(shape: Sequence[int], dtype: str, axis: int | None) -> Geometry:
    size = itemsize(dtype)
    if axis is None:
        return Geometry(1, 1, math.prod(shape) * size)
    return Geometry(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]) * size)


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)


def n_token_blocks(n_tokens: int, block_tokens: int) -> int:
    return -(-n_tokens // block_tokens)


def block_rows(b: int, n_tokens: int, block_tokens: int) -> int:
    """Rows of token block ``b`` of an entry of ``n_tokens`` tokens."""
    return min(n_tokens - b * block_tokens, block_tokens)


def in_token_blocks(spec: TensorSpec) -> bool:
    """Whether the tensor's rows are tokens ``[0, n)`` stored in the token blocks."""
    return spec.token_axis is not None and spec.window_start is None


def in_window_blocks(spec: TensorSpec) -> bool:
    """Whether the tensor's rows are tokens ``[window_start, n)`` stored in the window blocks."""
    return spec.window_start is not None


def token_row_bytes(specs: Sequence[TensorSpec]) -> int:
    """The bytes one token adds to a token block: every token tensor's share of a row.

    A window tensor's rows go to the window blocks, not here.
    """
    total = 0
    for s in specs:
        if in_token_blocks(s):
            g = geometry(s.shape, s.dtype, s.token_axis)
            total += g.outer * g.row_bytes
    return total


def window_first_block(specs: Sequence[TensorSpec], T: int) -> int:
    """The absolute token block that the first window block holds (0 without window tensors)."""
    starts = [s.window_start for s in specs if s.window_start is not None]
    return min(starts) // T if starts else 0


def window_rows(start: int, b: int, n_tokens: int, T: int) -> tuple[int, int]:
    """Rows ``[a, z)`` (counted from ``start``) that a window tensor has in absolute block ``b``."""
    a = max(b * T, start)
    z = min((b + 1) * T, n_tokens)
    return (a - start, z - start) if z > a else (0, 0)


def window_block_sizes(specs: Sequence[TensorSpec], n_tokens: int, T: int) -> list[int]:
    """Expected sizes of an entry's window blocks (none without window tensors)."""
    window = [s for s in specs if in_window_blocks(s)]
    if not window:
        return []
    out = []
    for b in range(window_first_block(window, T), n_token_blocks(n_tokens, T)):
        total = 0
        for s in window:
            assert s.window_start is not None and s.token_axis is not None
            g = geometry(s.shape, s.dtype, s.token_axis)
            a, z = window_rows(s.window_start, b, n_tokens, T)
            total += g.outer * (z - a) * g.row_bytes
        out.append(total)
    return out


def check_window_specs(specs: Sequence[TensorSpec], n_tokens: int) -> None:
    """A :class:`ManifestError` unless every window tensor holds tokens ``[start, n)``."""
    for s in specs:
        if s.window_start is None:
            continue
        if s.token_axis is None or s.state_offset is not None or s.token_axis >= len(s.shape):
            raise ManifestError(f"window tensor {list(s.shape)} has no token axis of its own")
        if not s.window_start < n_tokens or s.shape[s.token_axis] != n_tokens - s.window_start:
            raise ManifestError(
                f"window tensor {list(s.shape)} from token {s.window_start} does not hold "
                f"tokens [{s.window_start}, {n_tokens})"
            )


def state_block_sizes(state_bytes: int, block_bytes: int) -> list[int]:
    full, rest = divmod(state_bytes, block_bytes)
    return [block_bytes] * full + ([rest] if rest else [])


def manifest_block_sizes(
    specs: Sequence[TensorSpec], n_tokens: int, T: int, state_bytes: int, state_block: int
) -> tuple[list[int], list[int]]:
    """Expected sizes of an entry's token blocks and state blocks."""
    tok: list[int] = []
    if any(in_token_blocks(s) for s in specs):
        row = token_row_bytes(specs)  # a block's size is its rows times this
        tok = [block_rows(b, n_tokens, T) * row for b in range(n_token_blocks(n_tokens, T))]
    return tok, state_block_sizes(state_bytes, state_block)


def manifest_blocks(m: Manifest) -> dict[bytes, int]:
    """The distinct blocks of a manifest with the size its tensors give each.

    A :class:`ManifestError` when the digest lists and the tensor specs disagree.
    """
    specs = m.tensor_specs()
    check_window_specs(specs, m.n_tokens)
    tok, state = manifest_block_sizes(
        specs, m.n_tokens, m.block_tokens, m.state_bytes, m.state_block_bytes
    )
    win = window_block_sizes(specs, m.n_tokens, m.block_tokens)
    if (len(tok), len(win), len(state)) != (
        len(m.token_blocks), len(m.window_blocks), len(m.state_blocks)
    ):
        raise ManifestError(
            f"manifest lists {len(m.token_blocks)}+{len(m.window_blocks)}+{len(m.state_blocks)} "
            f"token+window+state blocks, its tensors need {len(tok)}+{len(win)}+{len(state)}"
        )
    out: dict[bytes, int] = {}
    salt = len(m.block_salt)  # each file ends with it (docs/FORMAT.md §3, "Salted blocks")
    for d, size in zip(m.all_blocks(), (*tok, *win, *state), strict=True):
        size += salt
        if out.setdefault(bytes(d), size) != size:
            raise ManifestError(f"block {bytes(d).hex()} listed with two sizes")
    return out
