"""One codec per cache kind; importing this package registers them all."""

from . import mlxlm as _mlxlm  # noqa: F401  (registers the mlx-lm codecs)
from . import raw as _raw  # noqa: F401
from .base import (
    AttachmentData,
    Codec,
    Snapshot,
    TensorData,
    codec_for_cache,
    codec_for_record,
    leaf,
    register,
    snapshot,
    step_capacity,
    stored_snapshot,
)
from .raw import RawCache

__all__ = [
    "AttachmentData",
    "Codec",
    "RawCache",
    "Snapshot",
    "TensorData",
    "codec_for_cache",
    "codec_for_record",
    "leaf",
    "register",
    "snapshot",
    "step_capacity",
    "stored_snapshot",
]
