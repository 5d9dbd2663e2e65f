"""The one dtype table (codecs.layout.DTYPES) agrees with MLX, and each format's view of it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstore.codecs.layout import (
    DTYPES,
    MLX_BUN_DTYPES,
    RESTORABLE_DTYPES,
    SAFETENSORS_DTYPES,
    itemsize,
)
from kvstore.formats._v3io import dtype_of


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_each_dtype_is_mlx_s_own(name: str) -> None:
    dt = mx.bool_ if name == "bool" else getattr(mx, name)
    assert str(dt).removeprefix("mlx.core.") == name
    assert itemsize(name) == dt.size


def test_the_formats_views() -> None:
    assert set(SAFETENSORS_DTYPES) == set(DTYPES) - {"complex64"}
    assert SAFETENSORS_DTYPES["bfloat16"] == "BF16" and SAFETENSORS_DTYPES["bool"] == "BOOL"
    assert set(MLX_BUN_DTYPES) == set(DTYPES) - {"complex64"}
    assert all(d.mlx_bun == d.name for d in MLX_BUN_DTYPES.values())
    assert RESTORABLE_DTYPES == set(DTYPES) - {"float64", "complex64"}


def test_mlx_bun_refuses_what_it_cannot_name() -> None:
    assert dtype_of(mx.zeros((1,), dtype=mx.bfloat16)) == "bfloat16"
    with pytest.raises(TypeError, match="complex64 cannot be stored"):
        dtype_of(mx.zeros((1,), dtype=mx.complex64))
