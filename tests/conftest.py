"""Fixtures of the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
