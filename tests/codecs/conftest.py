"""Shared fixtures: the mlx-bun test vectors the suite carries in tests/data/."""

from __future__ import annotations

from pathlib import Path

import pytest

VECTORS = Path(__file__).resolve().parents[1] / "data"
SAMPLES = VECTORS / "mlx-bun-v3"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    if not VECTORS.is_dir():
        # Without them these tests would check nothing: a failure, not a skip.
        pytest.fail(f"test vectors not found at {VECTORS}")
    return VECTORS


@pytest.fixture(scope="session")
def samples_dir(vectors_dir: Path) -> Path:
    return vectors_dir / "mlx-bun-v3"
