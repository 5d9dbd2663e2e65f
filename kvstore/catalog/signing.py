"""Signed entries: an HMAC-SHA256 tag over a manifest's exact bytes and the store it
belongs to, with a key that lives outside the tier (docs/FORMAT.md, "Signed entries").

A tier that anyone with write access can fill (a bucket) carries the tag beside each
manifest; a reader with the key (:class:`Signer`) trusts a manifest only when its tag
is there and right. The key comes from ``Store.open(signing_key=...)``, else
``$KVSTORE_SIGNING_KEY`` (the key's text), else ``$KVSTORE_SIGNING_KEY_FILE`` (a file
holding it): :func:`signing_key`. It is never written to a root or a bucket.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat

from ..errors import KVStoreError, ManifestError

ENV_KEY = "KVSTORE_SIGNING_KEY"
ENV_KEY_FILE = "KVSTORE_SIGNING_KEY_FILE"
MIN_KEY_BYTES = 16
#: A key file is read up to this many bytes (a key is a line; more is not a key file).
MAX_KEY_FILE_BYTES = 4096
#: A key with fewer distinct byte values than this is a pattern, not a key: all one
#: byte, ``abab...``; 16 random hex digits have fewer with a chance below 1e-8.
MIN_DISTINCT_BYTES = 4
_HINT = "(e.g. `openssl rand -hex 32`)"
_log = logging.getLogger(__name__)
SCHEME = "hmac-sha256-v1"  # the tag's value is ``<SCHEME>:<64 hex>``
_DOMAIN = b"kvstore manifest " + SCHEME.encode()
_PRIO_DOMAIN = b"kvstore priority " + SCHEME.encode()


class SigningKeyError(KVStoreError, ValueError):
    """The signing key given (or named by the environment) cannot be used."""


class UnsignedManifestError(ManifestError):
    """A reader with the signing key refused a manifest: it carries no tag, or a tag the key
    did not make over these bytes for this store. ``where`` it was read, ``why`` refused."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: refused, {why} (this reader has the signing key)")
        self.where = where
        self.why = why

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.where, self.why))


def _key_bytes(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(f"{what} is {len(key)} bytes: a signing key needs at least "
                              f"{MIN_KEY_BYTES} {_HINT}")
    if not key.strip():
        raise SigningKeyError(f"{what} is only whitespace: not a signing key {_HINT}")
    distinct = len(set(key))
    if distinct < MIN_DISTINCT_BYTES:
        raise SigningKeyError(f"{what} has {distinct} distinct byte value"
                              f"{'' if distinct == 1 else 's'}: too little entropy for a "
                              f"signing key, which needs at least {MIN_DISTINCT_BYTES} {_HINT}")
    return key


def _read_key_file(path: str) -> bytes:
    """The bytes of the key file ``path``: a regular file (a FIFO or a device is refused
    without blocking on it), that neither its group nor others can write (they could choose
    the key: refused) nor others read (a warning, as ssh gives), at most
    ``MAX_KEY_FILE_BYTES`` long."""
    where = f"${ENV_KEY_FILE}: {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SigningKeyError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SigningKeyError(f"{where} is not a regular file: a key file must be one")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            who = "others" if mode & 0o002 else "its group"
            raise SigningKeyError(f"{where} is mode {mode:04o}: {who} can write it, and so "
                                  f"choose the key; refused (chmod 600 {path})")
        if mode & 0o004:
            _log.warning("kvstore: %s is mode %04o: others can read the signing key "
                         "(chmod 600 %s)", where, mode, path)
        raw = b""
        while len(raw) <= MAX_KEY_FILE_BYTES:
            chunk = os.read(fd, MAX_KEY_FILE_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    except OSError as e:
        raise SigningKeyError(f"{where}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise SigningKeyError(f"{where} is over {MAX_KEY_FILE_BYTES} bytes: a key file holds "
                              "one key")
    return raw


def signing_key(value: bytes | str | None = None) -> bytes | None:
    """The key to sign and check manifests with: ``value`` (``""``: none), else the
    environment's (``$KVSTORE_SIGNING_KEY``'s text, or the bytes of the file
    ``$KVSTORE_SIGNING_KEY_FILE`` names, one trailing newline dropped: :func:`_read_key_file`
    says which files are refused), else None. A key shorter than ``MIN_KEY_BYTES``, only
    whitespace, or of fewer than ``MIN_DISTINCT_BYTES`` distinct bytes is refused."""
    if value is not None:
        return _key_bytes(value, "the signing key") if value else None
    text, path = os.environ.get(ENV_KEY, ""), os.environ.get(ENV_KEY_FILE, "")
    if text and path:
        raise SigningKeyError(f"both ${ENV_KEY} and ${ENV_KEY_FILE} are set: set one")
    if text:
        return _key_bytes(text, f"${ENV_KEY}")
    if not path:
        return None
    raw = _read_key_file(path)
    if raw.endswith(b"\n"):
        raw = raw[:-1].removesuffix(b"\r")
    return _key_bytes(raw, f"the key file {path}")


class Signer:
    """Tags and checks manifests of one store: the tag is HMAC-SHA256 with the key over a
    domain string, the ``store`` (what names the store: its URL and settings) and the
    manifest's exact bytes, so a tag made for one store does not verify in another."""

    def __init__(self, key: bytes, store: str) -> None:
        self._key = _key_bytes(key, "the signing key")
        self.store = store
        self._head = _DOMAIN + b"\0" + store.encode() + b"\0"

    def __repr__(self) -> str:  # never the key
        return f"Signer(store={self.store!r})"

    def tag(self, raw: bytes) -> str:
        """The tag of a manifest's bytes, as stored beside it."""
        mac = hmac.new(self._key, self._head, hashlib.sha256)
        mac.update(raw)
        return f"{SCHEME}:{mac.hexdigest()}"

    def tag_priority(self, digest: bytes, priority: int) -> str:
        """The tag of an entry's priority (kept beside its manifest's, in the object's
        metadata): HMAC-SHA256 over its own domain string, the store, the entry's digest and
        the priority, so it vouches for this priority of this entry in this store only."""
        mac = hmac.new(self._key, _PRIO_DOMAIN + b"\0" + self.store.encode() + b"\0",
                       hashlib.sha256)
        mac.update(digest + b"\0" + str(int(priority)).encode())
        return f"{SCHEME}:{mac.hexdigest()}"

    def check_priority(self, digest: bytes, priority: int, tag: str | None) -> bool:
        """Whether ``tag`` is this key's over the entry's ``priority``."""
        return bool(tag) and hmac.compare_digest(
            str(tag).encode(), self.tag_priority(digest, priority).encode())

    def check(self, raw: bytes, tag: str | None, where: str) -> None:
        """Nothing when ``tag`` is this key's over ``raw``; else an UnsignedManifestError."""
        if not tag:
            raise UnsignedManifestError(where, "it is not signed")
        if not hmac.compare_digest(tag.encode(), self.tag(raw).encode()):
            raise UnsignedManifestError(where, "its signature is not this key's")


__all__ = ["ENV_KEY", "ENV_KEY_FILE", "Signer", "SigningKeyError", "UnsignedManifestError",
           "signing_key"]
