"""Model fingerprints: the store namespace of an mlx-lm model (directory or object).

The fingerprint covers the model's config and weights (and an adapter's and a draft
model's), so two models never exchange caches and a changed model never gets a stale one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from kvstore import Namespace

__all__ = ["fingerprint_model", "fingerprint_model_dir", "namespace_for_path"]

_SAMPLE_WINDOWS = 16
_SAMPLE_BYTES = 4096
_WHOLE_FILE_BYTES = 1 << 20
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",
)


def _digest_file(h: Any, path: Path) -> None:
    """Feed a cheap but change-sensitive digest of `path` into `h`.

    Small files are hashed whole. For a large safetensors file the header (names,
    shapes, dtypes, offsets) is hashed whole, plus the size and evenly spaced
    windows of the data, so a changed checkpoint is caught without reading GBs.
    """
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            h.update(f.read())
            return
        start = 0
        if path.suffix == ".safetensors":
            n = int.from_bytes(f.read(8), "little")
            if 0 < n < size:
                h.update(f.read(n))
                start = 8 + n
        span = max(1, size - start - _SAMPLE_BYTES)
        for i in range(_SAMPLE_WINDOWS):
            f.seek(start + span * i // (_SAMPLE_WINDOWS - 1))
            h.update(f.read(_SAMPLE_BYTES))


def fingerprint_model_dir(path: str | Path) -> tuple[str, str]:
    """Return ``(config_fingerprint, tokenizer_hash)`` of an mlx-lm model or adapter dir.

    The config fingerprint covers ``config.json`` / ``adapter_config.json`` and a
    digest of every ``*.safetensors`` file; the tokenizer hash covers the
    tokenizer files (empty when there are none, as for an adapter).
    """
    root = Path(path)
    h = hashlib.sha256(b"kvstore-model-v1\0")
    found = False
    for name in ("config.json", "adapter_config.json"):
        if (root / name).is_file():
            _digest_file(h, root / name)
            found = True
    weights = sorted(root.glob("*.safetensors"))
    for w in weights:
        _digest_file(h, w)
    if not found and not weights:
        raise FileNotFoundError(f"{root}: no config.json, adapter_config.json or *.safetensors")
    t = hashlib.sha256(b"kvstore-tokenizer-v1\0")
    tok_found = False
    for name in _TOKENIZER_FILES:
        if (root / name).is_file():
            _digest_file(t, root / name)
            tok_found = True
    return h.hexdigest(), t.hexdigest() if tok_found else ""


def fingerprint_model(model: Any) -> str:
    """Fingerprint a loaded model: parameter names, shapes, dtypes and a sample of values."""
    h = hashlib.sha256(b"kvstore-params-v1\0")
    params = dict(tree_flatten(model.parameters()))
    samples = []
    for name in sorted(params):
        p = params[name]
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        flat = p.reshape(-1)
        samples.append(flat[:: max(1, flat.size // 64)][:64].astype(mx.float32))
    if samples:
        values = mx.concatenate(samples)
        mx.eval(values)
        h.update(memoryview(values).tobytes())  # type: ignore[arg-type]
    return h.hexdigest()


def _local_dir(path: Any) -> Path | None:
    """`path` as a local directory, or the offline HF-cache snapshot of a repo id."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        return None
    p = Path(path)
    if p.is_dir():
        return p
    try:
        from mlx_lm.utils import hf_repo_to_path

        cached = Path(hf_repo_to_path(str(path)))  # type: ignore[no-untyped-call]
    except Exception:  # not a repo id, or not in the local HF cache: no network here
        return None
    return cached if cached.is_dir() else None


def namespace_for_path(
    model_path: str | Path,
    adapter_path: str | Path | None = None,
    draft_model_path: str | Path | None = None,
    *,
    ns: str = "default",
) -> Namespace:
    """The store namespace of a model directory (plus optional adapter and draft model)."""
    model_dir = _local_dir(model_path)
    if model_dir is None:
        raise FileNotFoundError(f"{model_path}: not a local model directory")
    config_fp, tok_hash = fingerprint_model_dir(model_dir)
    parts = [config_fp]
    for extra, label in ((adapter_path, "adapter"), (draft_model_path, "draft")):
        if extra is None:
            continue
        extra_dir = _local_dir(extra)
        if extra_dir is None:
            raise FileNotFoundError(f"{extra}: not a local {label} directory")
        parts.append(f"{label}:{fingerprint_model_dir(extra_dir)[0]}")
    if len(parts) > 1:
        config_fp = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return Namespace(
        model_id=Path(str(model_path)).name or str(model_path),
        config_fingerprint=config_fp,
        tokenizer_hash=tok_hash,
        ns=ns,
    )
