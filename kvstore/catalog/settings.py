"""The settings every tier of one store shares: fixed when a tier is created, checked when
another tier is put beside it (a root and its remote must cut and name blocks alike)."""

from __future__ import annotations

import msgspec

SETTINGS_FORMAT = 1
DEFAULT_BLOCK_TOKENS = 256
DEFAULT_STATE_BLOCK = 4 << 20


class TierSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Fixed when a tier is created: a local root keeps them msgpack-encoded in its index, a
    remote as the JSON object ``kvstore.json``; opening either with others is an error."""

    format: int = SETTINGS_FORMAT
    hash: str
    block_tokens: int
    state_block_bytes: int
    created_at: int

    def differences(self, other: TierSettings, *, mine: str = "local",
                    theirs: str = "remote") -> list[str]:
        """What ``other`` cuts or names differently, as ``name: <mine> a vs <theirs> b``."""
        pairs = (("hash", self.hash, other.hash),
                 ("block_tokens", self.block_tokens, other.block_tokens),
                 ("state_block_bytes", self.state_block_bytes, other.state_block_bytes))
        return [f"{n}: {mine} {a} vs {theirs} {b}" for n, a, b in pairs if a != b]


__all__ = ["DEFAULT_BLOCK_TOKENS", "DEFAULT_STATE_BLOCK", "SETTINGS_FORMAT", "TierSettings"]
