"""JSON exactly as JavaScript's ``JSON.stringify`` writes it (mlx-bun's headers).

mlx-bun's header hash covers the header's bytes, so writing a file back byte
for byte needs the same spelling: no spaces, non-ASCII kept, lone surrogates
escaped, and numbers in ECMAScript's ``Number.prototype.toString`` form
(``1e21``, ``1e-7``, ``100`` — never ``1e+16`` or ``100.0``). :class:`RawJSON`
splices already-encoded text (attachment metadata, foreign layer fields)
verbatim.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["RawJSON", "dumps", "loads"]

_SURROGATE = re.compile("[\ud800-\udfff]")


class RawJSON:
    """Pre-encoded JSON text, written as is."""

    __slots__ = ("text",)

    def __init__(self, text: bytes | str) -> None:
        self.text = text.decode() if isinstance(text, bytes) else text


def _number(x: float) -> str:
    if not math.isfinite(x):
        return "null"  # what JSON.stringify does with NaN and Infinity
    if x == 0:
        return "0"
    r = repr(x)
    sign = "-" if r.startswith("-") else ""
    digits, _, exp = r.lstrip("-").partition("e")
    e = int(exp) if exp else 0
    whole, _, frac = digits.partition(".")
    frac = frac.rstrip("0") if frac != "0" else ""
    s = (whole + frac).lstrip("0")
    # value = 0.s * 10**n, with s the shortest round-trip digits (ECMAScript's k, n)
    n = len(whole) + e if whole != "0" else e - (len(frac) - len(frac.lstrip("0")))
    s = s.rstrip("0") or "0"
    k = len(s)
    if k <= n <= 21:
        out = s + "0" * (n - k)
    elif 0 < n <= 21:
        out = s[:n] + "." + s[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * (-n) + s
    else:
        mant = s[0] + ("." + s[1:] if k > 1 else "")
        out = f"{mant}e{'+' if n - 1 >= 0 else '-'}{abs(n - 1)}"
    return sign + out


def _string(s: str) -> str:
    out = json.dumps(s, ensure_ascii=False)
    if _SURROGATE.search(s):
        out = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", out)
    return out


def _encode(obj: Any, out: list[str]) -> None:
    if isinstance(obj, RawJSON):
        out.append(obj.text)
    elif obj is None:
        out.append("null")
    elif obj is True:
        out.append("true")
    elif obj is False:
        out.append("false")
    elif isinstance(obj, int):
        out.append(str(obj))
    elif isinstance(obj, float):
        out.append(_number(obj))
    elif isinstance(obj, str):
        out.append(_string(obj))
    elif isinstance(obj, dict):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            if i:
                out.append(",")
            out.append(_string(str(k)))
            out.append(":")
            _encode(v, out)
        out.append("}")
    elif isinstance(obj, list | tuple):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(",")
            _encode(v, out)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def dumps(obj: Any) -> bytes:
    """UTF-8 JSON text as ``JSON.stringify(obj)`` would produce it."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode("utf-8", "surrogatepass")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # JSON.parse rejects NaN and Infinity


def loads(data: bytes | str) -> Any:
    """Parse JSON as mlx-bun's ``JSON.parse(new TextDecoder().decode(body))`` does.

    Object key order is kept; duplicate keys keep the last, as in JS. Bytes are
    UTF-8 (a leading BOM is dropped, as TextDecoder does; other encodings that
    :func:`json.loads` would detect are not JSON to mlx-bun), and the literals
    ``NaN``/``Infinity`` that Python accepts are rejected. Every failure,
    nesting too deep included, is a :class:`ValueError`.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        text = bytes(data).decode("utf-8")  # UnicodeDecodeError is a ValueError
    else:
        text = data
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
