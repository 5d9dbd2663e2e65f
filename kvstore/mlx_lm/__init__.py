"""The mlx-lm integration: model fingerprints, PersistentPromptCache, and the server."""

from .prompt_cache import (
    PersistentPromptCache,
    PersistStats,
    fingerprint_model,
    fingerprint_model_dir,
    namespace_for_path,
)

__all__ = [
    "PersistStats",
    "PersistentPromptCache",
    "fingerprint_model",
    "fingerprint_model_dir",
    "namespace_for_path",
]
