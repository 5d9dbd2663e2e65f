"""Sizes as people write them (``10G``, ``500MiB``): shared by the CLI and ``kvstore serve``.

Pure and import-free, so an integration can parse a ``--max-bytes`` without the CLI.
"""

from __future__ import annotations

import math
import re

from .errors import KVStoreError

__all__ = ["MIN_BARE_BUDGET", "SizeError", "parse_budget", "parse_size"]


class SizeError(KVStoreError, ValueError):
    """A byte count that cannot be parsed (``10G``, ``500MiB``…)."""


# Every unit is binary, as in ``kvstore serve --max-bytes``: 1G = 1GB = 1GiB = 2**30.
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE = re.compile(r"(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[KMGTP]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``10G``, ``500MiB``, ``1.5GB``, ``4k`` or plain ``1048576`` into bytes.

    Units are binary and case-insensitive; ``B``/``iB`` suffixes are optional.
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise SizeError(
            f"cannot parse {text!r} as a size (examples: 10G, 500MiB, 1.5GB, 1048576)"
        )
    value = float(m["num"]) * _UNITS[m["unit"].upper()]
    if not math.isfinite(value):
        raise SizeError(f"size {text!r} is too large")
    return int(value)


MIN_BARE_BUDGET = 1 << 20  # a budget written without a unit must be at least this


def parse_budget(text: str) -> int:
    """A byte budget (``--max-bytes``): :func:`parse_size`, except that a bare number below
    1 MiB (other than 0) is refused. ``--max-bytes 20`` is 20 MiB or 20 GiB with the unit
    forgotten, and as 20 bytes it would evict every entry; ``20B`` says bytes are meant.
    """
    n = parse_size(text)
    m = _SIZE.fullmatch(text.strip())
    bare = m is not None and not m["unit"] and not text.strip().upper().endswith("B")
    if bare and 0 < n < MIN_BARE_BUDGET:
        num = text.strip()
        raise SizeError(
            f"{num} has no unit: {n} bytes would evict nearly every entry; did you mean "
            f"{num}M or {num}G? (write {num}B if you mean bytes)"
        )
    return n
