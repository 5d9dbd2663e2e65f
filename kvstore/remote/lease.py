"""The remote compactor's lease: one object, ``gc/lease``, taken with a put-if-absent.

Its body names a token, an owner and an expiry (epoch seconds). The holder
deletes only while its lease has more than ``margin`` seconds left by its own
clock and re-reads the lease before every batch of deletes; anyone else treats a
lease as gone only ``margin`` seconds (the holder's, written in the body) after its
expiry. ``margin`` covers the
clock skew between machines plus one delete request in flight (docs/FORMAT.md).
"""

from __future__ import annotations

import math
import os
import socket
import time
import uuid
from dataclasses import dataclass

import msgspec

from .errors import RemoteError, RemoteLeaseError, RemoteNotFoundError, RemoteTooLargeError
from .layout import LEASE
from .s3 import S3Client

DEFAULT_LEASE = 300.0  # seconds a compaction may hold the lease
DEFAULT_MARGIN = 30.0  # clock skew + one request in flight
MAX_LEASE = 86400.0  # the longest lease kvstore takes: a body that claims longer is a lie
MAX_MARGIN = 3600.0
MAX_TEXT = 256  # characters of a lease's token and owner
MAX_BODY = 4096  # bytes of a lease object


class LeaseBody(msgspec.Struct, frozen=True):
    token: str
    owner: str
    expires: float  # epoch seconds, by the holder's clock
    margin: float = DEFAULT_MARGIN  # the holder's: it stops deleting this long before expiry


#: What a lease body that cannot be read, or that no kvstore wrote, counts as: expired.
UNREADABLE = LeaseBody("?", "unreadable lease", 0.0, 0.0)


def sane(body: LeaseBody, now: float | None = None) -> bool:
    """Whether ``body`` is a lease some kvstore could have written: finite times, an expiry
    at most ``MAX_LEASE`` plus the margin ahead of this clock, a margin of at most
    ``MAX_MARGIN``, short names. Anyone who can write the bucket can write the lease: one
    that claims to last for ages (``expires: 1e308``) would hold every push back."""
    now = time.time() if now is None else now
    return (math.isfinite(body.expires) and math.isfinite(body.margin)
            and 0.0 <= body.margin <= MAX_MARGIN
            and body.expires <= now + MAX_LEASE + MAX_MARGIN
            and len(body.token) <= MAX_TEXT and len(body.owner) <= MAX_TEXT)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(LeaseBody)


@dataclass
class Lease:
    """Reading, taking, checking and releasing ``<prefix>gc/lease``."""

    client: S3Client
    prefix: str
    duration: float = DEFAULT_LEASE
    margin: float = DEFAULT_MARGIN
    held: LeaseBody | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.duration <= MAX_LEASE:
            raise ValueError(f"a lease lasts 0 to {MAX_LEASE:.0f} s, not {self.duration}")
        if not 0.0 <= self.margin <= MAX_MARGIN:
            raise ValueError(f"a lease margin is 0 to {MAX_MARGIN:.0f} s, not {self.margin}")

    @property
    def key(self) -> str:
        return self.prefix + LEASE

    def read(self) -> LeaseBody | None:
        """The lease on the remote now, or None; an unreadable body counts as expired."""
        try:
            raw = self.client.get(self.key, max_bytes=MAX_BODY)
        except RemoteNotFoundError:
            return None
        except RemoteTooLargeError:
            return UNREADABLE
        try:
            body = _dec.decode(raw)
        except msgspec.DecodeError:
            return UNREADABLE
        return body if sane(body) else UNREADABLE

    def stale(self, body: LeaseBody, now: float | None = None) -> bool:
        """Whether others may treat ``body`` as gone: its holder's margin past its expiry."""
        return (time.time() if now is None else now) > body.expires + body.margin

    def take(self) -> LeaseBody:
        """Take the lease (a stale one is taken over); RemoteLeaseError when it is held."""
        body = LeaseBody(uuid.uuid4().hex, f"{socket.gethostname()}:{os.getpid()}",
                         time.time() + self.duration, self.margin)
        for _ in range(2):
            if self.client.put(self.key, _enc.encode(body), if_absent=True):
                self.held = body
                self.check()  # a takeover racing ours: whoever's body is there holds it
                return body
            cur = self.read()
            if cur is not None and not self.stale(cur):
                left = cur.expires - time.time()
                raise RemoteLeaseError(
                    f"another compaction holds the lease ({cur.owner}, {left:.0f} s left)",
                    bucket=self.client.bucket, key=self.key,
                )
            if cur is not None:
                self.client.delete(self.key)  # stale: its holder stopped deleting long ago
        raise RemoteLeaseError("could not take the lease (contended)",
                               bucket=self.client.bucket, key=self.key)

    def check(self) -> None:
        """Before a batch of deletes: still ours, with more than ``margin`` left."""
        if self.held is None:
            raise RemoteLeaseError("no lease held", bucket=self.client.bucket, key=self.key)
        cur = self.read()
        if cur is None or cur.token != self.held.token:
            raise RemoteLeaseError("the lease was lost (taken over or removed)",
                                   bucket=self.client.bucket, key=self.key)
        if time.time() > self.held.expires - self.margin:
            raise RemoteLeaseError(
                f"the lease runs out (held {self.duration:.0f} s): stopping before its margin",
                bucket=self.client.bucket, key=self.key,
            )

    def release(self) -> None:
        """Delete the lease if it is still ours (a second release does nothing)."""
        held, self.held = self.held, None
        if held is None:
            return
        try:
            cur = self.read()
            if cur is not None and cur.token == held.token:
                self.client.delete(self.key)
        except RemoteError:
            pass  # it expires on its own

    def wait_past(self, token: str, max_wait: float) -> bool:
        """Wait until the lease ``token`` is over: gone, stale, or another one in its place
        (taken after it was released). True then, False after ``max_wait`` seconds."""
        deadline = time.monotonic() + max_wait
        pause = 0.02
        while True:
            cur = self.read()
            if cur is None or cur.token != token or self.stale(cur):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)
