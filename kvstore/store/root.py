"""The cache root on disk: its layout, its fixed settings, and opening it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import platformdirs

from ..blocks import ALGORITHMS
from ..errors import NotAStoreError, RootSettingsError
from ..index import Index, now_ms
from ._fs import check_filesystem

ROOT_FORMAT = 1
DEFAULT_BLOCK_TOKENS = 256
DEFAULT_STATE_BLOCK = 4 << 20
_LAYOUT = ("index", "blocks", "tmp", "quarantine")


class RootSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Fixed when a root is created; opening it with others is an error."""

    format: int = ROOT_FORMAT
    hash: str
    block_tokens: int
    state_block_bytes: int
    created_at: int


_settings_dec = msgspec.msgpack.Decoder(RootSettings)


def default_root() -> Path:
    """``$KVSTORE_ROOT``, else the user cache dir."""
    env = os.environ.get("KVSTORE_ROOT")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("kvstore", appauthor=False))


def open_root(
    path: Path,
    *,
    hash: str | None,
    block_tokens: int | None,
    state_block_bytes: int | None,
    durable: bool,
    create: bool,
    map_size: int | None,
) -> tuple[Index, RootSettings]:
    """Open (and, with ``create``, make) the root at ``path``: its index and settings.

    A directory that holds anything but a root's own folders is never taken over.
    """
    if hash is not None and hash not in ALGORITHMS:
        raise RootSettingsError(f"unknown hash {hash!r}; choose from {', '.join(ALGORITHMS)}")
    if block_tokens is not None and block_tokens <= 0:
        raise RootSettingsError(f"block_tokens must be positive, got {block_tokens}")
    idx_dir = path / "index"
    fresh = not (idx_dir / "data.mdb").exists()
    if fresh:
        if not create:
            raise NotAStoreError(f"{path} is not a kvstore root (no index/); run kvstore init")
        if path.exists() and not path.is_dir():
            raise NotAStoreError(f"{path} is not a directory")
        if path.is_dir() and any(
            p.name not in _LAYOUT for p in path.iterdir()
        ):
            raise NotAStoreError(f"{path} is not a kvstore root and is not empty")
    if create:
        for sub in ("index", "blocks", "tmp"):
            (path / sub).mkdir(parents=True, exist_ok=True)
    check_filesystem(path)
    kwargs: dict[str, Any] = {"durable": durable}
    if map_size is not None:
        kwargs["map_size"] = map_size
    index = Index(idx_dir, **kwargs)
    raw = index.get_meta(b"settings")
    if raw is None:
        settings = RootSettings(
            hash=hash or "blake3",
            block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
            state_block_bytes=state_block_bytes or DEFAULT_STATE_BLOCK,
            created_at=now_ms(),
        )
        index.put_meta(b"settings", msgspec.msgpack.encode(settings))
    else:
        settings = _settings_dec.decode(raw)
        for name, want, have in (
            ("hash", hash, settings.hash),
            ("block_tokens", block_tokens, settings.block_tokens),
            ("state_block_bytes", state_block_bytes, settings.state_block_bytes),
        ):
            if want is not None and want != have:
                index.close()
                raise RootSettingsError(f"{path} was created with {name}={have!r}, not {want!r}")
    return index, settings
