"""Shared fixtures: the mlx-bun test vectors beside the repo checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

# <repo>/tests/codecs/conftest.py -> parents[2] is the repo; shared/ is its sibling.
VECTORS = Path(__file__).resolve().parents[2] / ".." / "shared" / "vectors"
SAMPLES = VECTORS / "mlx-bun-v3"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    if not VECTORS.is_dir():
        pytest.skip(f"test vectors not found at {VECTORS}")
    return VECTORS


@pytest.fixture(scope="session")
def samples_dir(vectors_dir: Path) -> Path:
    return vectors_dir / "mlx-bun-v3"
