"""Fixtures of the CLI tests: populated roots, one per module and one per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import Root, populate


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Root:
    """A populated root that tests of this module must not change."""
    return populate(tmp_path_factory.mktemp("shared") / "root")


@pytest.fixture
def fresh_root(tmp_path: Path) -> Root:
    """A populated root of this test's own, free to change."""
    return populate(tmp_path / "root")
