"""Fixtures of the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from helpers.composed import Opened


@pytest.fixture(autouse=True)
def _no_fetched_models(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """An empty model cache, so a real model fetched earlier never slows the default suite
    (``kvstore demo`` picked smollm2 when it was cached, before issue 27). tests/model/
    overrides this."""
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path_factory.getbasetemp() / "no-models"))
    monkeypatch.delenv("KVSTORE_REMOTE", raising=False)  # tests name their remote themselves
    yield


@pytest.fixture
def opened() -> Iterator[Opened]:
    """The roots and composed tiers a test opens (tests/helpers/composed.py), closed at its
    end."""
    from helpers.composed import Opened

    o = Opened()
    try:
        yield o
    finally:
        o.close()
