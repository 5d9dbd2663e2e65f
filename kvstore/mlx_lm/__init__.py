"""The mlx-lm integration: model fingerprints, PersistentPromptCache, and the server."""

from .fingerprint import fingerprint_model, fingerprint_model_dir, namespace_for_path
from .prefill import Prefilled, needs_checkpoints, prefill
from .prompt_cache import PersistentPromptCache, PersistStats

__all__ = [
    "PersistStats",
    "PersistentPromptCache",
    "Prefilled",
    "needs_checkpoints",
    "prefill",
    "fingerprint_model",
    "fingerprint_model_dir",
    "namespace_for_path",
]
