"""Token handling and the chained token-prefix keys of the index.

``c_0 = H(namespace, codec provider, block_tokens, hash algo)`` and
``c_k = H(c_{k-1} || tokens[(k-1)T : kT] as u32 LE)``. Under each ``c_k`` the
index keeps one value per entry with at least ``kT`` tokens: the entry's next
tokens (up to ``TAIL`` of them, big-endian ``t+1`` so byte order is token order,
then a zero terminator), a flags byte and the manifest digest. Sorted values
let a lookup find the trimmable entry sharing the longest extension in one seek.

A non-trimmable entry (SSM state, a wrapped ring) serves only its exact length,
so it is listed under ``state_key(c_{n//T})``; a lookup that finds that key
tests each length within the block against the exact keys. It also leaves its
digest under ``reach_key(c_k)`` for every ``k <= n//T``, so that, with the
trimmable values, "some entry holds the first k blocks of the query" is
monotone in ``k`` and a lookup finds its deepest candidate block by bisection.
"""

from __future__ import annotations

import array
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import msgspec

from ..blocks import hash_bytes
from ..blocks.hashing import chain_hashes
from ..errors import InvalidTokensError
from ..schema import Namespace

TAIL = 96  # tokens kept in a prefix value: 96*4 + 4 + 1 + 32 < LMDB's 511-byte dup limit
TERM = b"\0\0\0\0"
FLAG_TRIMMABLE = 1
MAX_TOKEN = 2**32 - 2


def as_tokens(tokens: Any) -> array.array[int]:
    """Validate tokens (non-negative ints) into a packed u32 array.

    Every check runs at C speed (a 32k-token query costs well under 1 ms; a list of
    Python ints about 1 ms more, for the check that none is a bool).
    """
    import numpy as np  # here, not at import: the commands that never see tokens skip it

    if isinstance(tokens, array.array) and tokens.typecode == "I":
        arr = tokens
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        arr = _from_numpy(tokens)
    else:
        packed = hasattr(tokens, "tolist")  # mx.array / numpy: no bool after tolist but of bools
        if packed:
            dtype = str(getattr(tokens, "dtype", ""))
            if "bool" in dtype:
                raise InvalidTokensError(f"tokens must be ints, not {dtype} (bools are not tokens)")
            tokens = tokens.tolist()
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            kind = type(tokens).__name__
            raise InvalidTokensError(f"tokens must be a sequence of ints, got {kind}")
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        try:
            arr = array.array("I", tokens)
        except OverflowError:
            bad = next(t for t in tokens if not (isinstance(t, int) and 0 <= t <= MAX_TOKEN))
            raise InvalidTokensError(
                f"token {bad!r} is not a non-negative int below 2**32-1"
            ) from None
        except TypeError:
            bad = next(t for t in tokens if not isinstance(t, int) and not hasattr(t, "__index__"))
            raise InvalidTokensError(f"token {bad!r} is not an int") from None
        # array("I") takes True as 1: a bool is a mistake (a mask?), never a token id
        if not packed and any(map(operator.is_, map(type, tokens), repeat(bool))):
            bad = next(t for t in tokens if type(t) is bool)
            raise InvalidTokensError(f"token {bad!r} is a bool, not a token id")
    if not arr:
        raise InvalidTokensError("tokens must not be empty")
    if arr.itemsize != 4:  # pragma: no cover - every platform kvstore runs on
        raise InvalidTokensError("unsigned int is not 32-bit here")
    top = int(np.frombuffer(arr, dtype=np.uint32).max())  # array's own max() boxes each item
    if top > MAX_TOKEN:
        raise InvalidTokensError(f"token {top} is too large (max {MAX_TOKEN})")
    return arr


def _from_numpy(tokens: Any) -> array.array[int]:
    """A 1-d integer numpy array, checked and packed without boxing each token."""
    import numpy as np

    if tokens.size and tokens.dtype.kind == "i" and int(tokens.min()) < 0:
        bad = int(tokens[np.argmax(tokens < 0)])
        raise InvalidTokensError(f"token {bad!r} is not a non-negative int below 2**32-1")
    if tokens.size and int(tokens.max()) > MAX_TOKEN:
        raise InvalidTokensError(f"token {int(tokens.max())} is too large (max {MAX_TOKEN})")
    arr = array.array("I")
    arr.frombytes(tokens.astype(np.uint32, copy=False).tobytes())
    return arr


def tokens_le(arr: array.array[int]) -> bytes:
    """u32 little-endian bytes of the tokens."""
    if sys.byteorder == "little":
        return arr.tobytes()
    swapped = array.array("I", arr)
    swapped.byteswap()
    return swapped.tobytes()


def tokens_from_le(data: bytes) -> array.array[int]:
    arr = array.array("I")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def encode_tail(tokens: Sequence[int]) -> bytes:
    """Tokens as big-endian ``t+1`` (sorts like the token sequence)."""
    arr = array.array("I", (t + 1 for t in tokens))
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


def decode_tail(data: bytes) -> list[int]:
    arr = array.array("I")
    arr.frombytes(data)
    if sys.byteorder == "little":
        arr.byteswap()
    return [t - 1 for t in arr]


def prefix_value(tail: Sequence[int], trimmable: bool, digest: bytes) -> bytes:
    return encode_tail(tail[:TAIL]) + TERM + bytes([FLAG_TRIMMABLE if trimmable else 0]) + digest


def split_value(v: bytes) -> tuple[list[int], bool, bytes]:
    """(tail tokens, trimmable, manifest digest) of a prefix value."""
    return decode_tail(v[:-37]), bool(v[-33] & FLAG_TRIMMABLE), v[-32:]


def root_key(ns: Namespace, codec: str, block_tokens: int, algo: str) -> bytes:
    """``c_0``: different namespaces, codecs or settings never share a chain."""
    fields = [
        "kvstore-prefix/1",
        ns.model_id,
        ns.config_fingerprint,
        ns.tokenizer_hash,
        ns.ns,
        codec,
        block_tokens,
        algo,
    ]
    return hash_bytes(algo, msgspec.msgpack.encode(fields))


def chain(c0: bytes, tok_le: bytes, block_tokens: int, algo: str, depth: int) -> list[bytes]:
    """``[c_0, …, c_depth]`` for the u32-LE token bytes."""
    return chain_hashes(algo, c0, memoryview(tok_le), 4 * block_tokens, depth)


def exact_key(c_k: bytes, tail_le: bytes | memoryview, algo: str) -> bytes:
    """The exact key of an entry of ``n`` tokens: ``H("exact" || c_{n//T} || rest)``.

    ``rest`` is the u32-LE bytes of the tokens after the last full block, so a
    lookup can test every length within one block with one short hash each.
    """
    return hash_bytes(algo, b"exact", c_k, tail_le)


def exact_key_for(
    keys: list[bytes], tok_le: bytes | memoryview, n: int, T: int, algo: str
) -> bytes:
    """The exact key of the first ``n`` tokens, given the chain ``keys`` (len > n // T)."""
    k = n // T
    return exact_key(keys[k], memoryview(tok_le)[4 * k * T : 4 * n], algo)


def state_key(c_k: bytes) -> bytes:
    """The key under which non-trimmable entries ending in block ``k`` are listed.

    ``c_k`` plus one byte: distinct from every 32-byte chain key, and free to
    derive at each depth of a lookup.
    """
    return c_k + b"s"


def reach_key(c_k: bytes) -> bytes:
    """The key under which non-trimmable entries reaching block ``k`` leave their digest."""
    return c_k + b"r"


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two token strings share, 4 bytes a token in one encoding
    (u32 little-endian, or the prefix values' big-endian ``t+1``).

    Equal strings cost one compare; a short difference is found by bisection over byte
    compares, a long one with numpy.
    """
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:
        return n
    if n > 256:
        import numpy as np  # here: a process that never compares long token strings skips it

        x = np.frombuffer(a, dtype=np.uint32, count=n)
        y = np.frombuffer(b, dtype=np.uint32, count=n)
        return int(np.flatnonzero(x != y)[0])
    lo, hi = 0, n  # the first lo tokens match, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class TokenKeys:
    """A query's (or an entry's) tokens in every form the index needs, built once a call:
    the tokens, their u32 LE bytes and the chain ``c_0 .. c_{n//T}``."""

    tokens: array.array[int]
    le: bytes
    chain: list[bytes]
    block_tokens: int
    algo: str

    @classmethod
    def of(cls, tokens: Any, c0: bytes, block_tokens: int, algo: str) -> TokenKeys:
        toks = as_tokens(tokens)
        le = tokens_le(toks)
        return cls(toks, le, chain(c0, le, block_tokens, algo, len(toks) // block_tokens),
                   block_tokens, algo)

    def __len__(self) -> int:
        return len(self.tokens)

    def exact_key(self, n: int | None = None) -> bytes:
        """The exact key of the first ``n`` tokens (default: all of them)."""
        n = len(self.tokens) if n is None else n
        return exact_key_for(self.chain, self.le, n, self.block_tokens, self.algo)
