"""The real coding agents' tests: marked ``agents``, left out of the default run; CI
installs the pinned clients and runs them as their own step (``pytest -m agents``)."""

from __future__ import annotations

from pathlib import Path

import clients
import pytest


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """The pinned clients' commands, installed into the cache first when they are not
    (a missing Node.js or npm fails the tests: they are what these tests are for)."""
    try:
        return clients.install()
    except clients.InstallError as e:
        pytest.fail(f"the coding agents are not installed: {e}")
