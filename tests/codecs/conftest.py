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
        # The vectors ship in shared/ beside the checkout; without them these
        # tests would check nothing, so their absence is a failure, not a skip.
        pytest.fail(f"test vectors not found at {VECTORS} (shared/ must sit beside the repo)")
    return VECTORS


@pytest.fixture(scope="session")
def samples_dir(vectors_dir: Path) -> Path:
    return vectors_dir / "mlx-bun-v3"
