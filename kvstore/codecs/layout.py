"""Where each tensor's bytes go: token blocks and state blocks.

Token block *i* holds rows ``[i*T, (i+1)*T)`` of every token-axis tensor, each
as the row-major bytes of its slice, concatenated in manifest order. The other
tensors are concatenated into a state stream cut into fixed-size blocks. The
same arithmetic serves writing (which memory runs form a block) and reading
(which file ranges fill a restored array).
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


def token_row_bytes(specs: Sequence[TensorSpec]) -> int:
    """The bytes one token adds to a token block: every token tensor's share of a row."""
    total = 0
    for s in specs:
        if s.token_axis is not None:
            g = geometry(s.shape, s.dtype, s.token_axis)
            total += g.outer * g.row_bytes
    return total


def state_block_sizes(state_bytes: int, block_bytes: int) -> list[int]:
    full, rest = divmod(state_bytes, block_bytes)
    return [block_bytes] * full + ([rest] if rest else [])


def manifest_block_sizes(
    specs: Sequence[TensorSpec], n_tokens: int, T: int, state_bytes: int, state_block: int
) -> tuple[list[int], list[int]]:
    """Expected sizes of an entry's token blocks and state blocks."""
    tok: list[int] = []
    if any(s.token_axis is not None for s in specs):
        row = token_row_bytes(specs)  # a block's size is its rows times this
        tok = [block_rows(b, n_tokens, T) * row for b in range(n_token_blocks(n_tokens, T))]
    return tok, state_block_sizes(state_bytes, state_block)


def manifest_blocks(m: Manifest) -> dict[bytes, int]:
    """The distinct blocks of a manifest with the size its tensors give each.

    A :class:`ManifestError` when the digest lists and the tensor specs disagree.
    """
    tok, state = manifest_block_sizes(
        m.tensor_specs(), m.n_tokens, m.block_tokens, m.state_bytes, m.state_block_bytes
    )
    if len(tok) != len(m.token_blocks) or len(state) != len(m.state_blocks):
        raise ManifestError(
            f"manifest lists {len(m.token_blocks)}+{len(m.state_blocks)} blocks, "
            f"its tensors need {len(tok)}+{len(state)}"
        )
    out: dict[bytes, int] = {}
    for d, size in zip((*m.token_blocks, *m.state_blocks), (*tok, *state), strict=True):
        if out.setdefault(bytes(d), size) != size:
            raise ManifestError(f"block {bytes(d).hex()} listed with two sizes")
    return out
