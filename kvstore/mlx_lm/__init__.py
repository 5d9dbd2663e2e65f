"""The mlx-lm integration: model fingerprints, PersistentPromptCache, and the server."""

from .fingerprint import fingerprint_model, fingerprint_model_dir, namespace_for_path
from .prompt_cache import PersistentPromptCache, PersistStats

__all__ = [
    "PersistStats",
    "PersistentPromptCache",
    "fingerprint_model",
    "fingerprint_model_dir",
    "namespace_for_path",
]
