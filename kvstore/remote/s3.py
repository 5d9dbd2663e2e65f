"""S3-compatible object storage: the client of one bucket (the remote tier's only way to it).

The endpoint, the credentials and the region come from the standard AWS
configuration, read by botocore exactly as the AWS CLI reads them
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, ``AWS_PROFILE`` and ``~/.aws/config``); nothing here is
kvstore-specific. Every request has a connect and a read timeout and bounded
retries with jittered exponential backoff (botocore's ``standard`` mode); a
failure is a typed :class:`~kvstore.errors.RemoteError` naming the bucket, the
key and the HTTP status.

boto3 was chosen over obstore by measurement (``tools/bench_s3_client.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from .errors import (
    RemoteAuthError,
    RemoteError,
    RemoteNotFoundError,
    RemoteTooLargeError,
    RemoteUnavailableError,
    RemoteURLError,
)

__all__ = [
    "ObjectInfo",
    "S3Client",
    "S3URL",
    "parse_s3_url",
    "run_all",
]
_T = TypeVar("_T")
_R = TypeVar("_R")

DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_ATTEMPTS = 4  # the first try and three retries
DEFAULT_POOL = 32

_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
}
_MISSING_CODES = {"NoSuchKey", "NotFound", "404"}


@dataclass(frozen=True)
class S3URL:
    """``s3://BUCKET/PREFIX``: ``prefix`` is "" or ends with one "/"."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_s3_url(url: str) -> S3URL:
    """Parse ``s3://BUCKET[/PREFIX]``; anything else is a RemoteURLError."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise RemoteURLError(f"not an s3:// URL: {url!r} (expected s3://BUCKET/PREFIX)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket or "?" in url or "#" in url:
        raise RemoteURLError(f"not an s3:// URL: {url!r} (expected s3://BUCKET/PREFIX)")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise RemoteURLError(f"{url!r}: the prefix may not contain '.' or '..'")
    return S3URL(bucket, "".join(p + "/" for p in parts))


class ObjectInfo(NamedTuple):
    """One listed object: its full key, size and last-modified time (epoch seconds)."""

    key: str
    size: int
    mtime: float


def run_all(pool: Executor, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
    """``fn`` over ``items`` on ``pool``'s threads, in order; every call is waited for and
    the first error is raised."""
    futs = [pool.submit(fn, x) for x in items]
    out: list[_R] = []
    err: BaseException | None = None
    for f in futs:
        try:
            out.append(f.result())
        except BaseException as e:  # noqa: BLE001 - the first error wins, all are waited
            err = err or e
    if err is not None:
        raise err
    return out


def _status(err: Any) -> int | None:
    meta = getattr(err, "response", {}).get("ResponseMetadata", {})
    code = meta.get("HTTPStatusCode")
    return int(code) if code is not None else None


def _code(err: Any) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


class S3Client:
    """A thread-safe client of one bucket: small, typed operations over boto3.

    ``config`` overrides botocore ``Config`` fields (``max_pool_connections``,
    ``connect_timeout``, ``read_timeout``, ``retries``). Response and request
    checksums are computed only when required: the blocks carry their own
    digests, and older gateways (Ceph before 18) reject the chunked checksum
    trailers that newer botocore sends by default.
    """

    def __init__(
        self,
        bucket: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        attempts: int = DEFAULT_ATTEMPTS,
        max_pool_connections: int = DEFAULT_POOL,
        profile: str | None = None,
    ) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as e:
            raise RemoteError(f"the remote tier needs boto3 ({e.name} is missing): "
                              "pip install 'kvstore[remote]'", bucket=bucket) from None

        self.bucket = bucket
        self._exc = botocore.exceptions
        cfg = botocore.config.Config(
            max_pool_connections=max_pool_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": attempts, "mode": "standard"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(profile_name=profile)
        self._s3 = session.client("s3", config=cfg)
        self.endpoint = str(self._s3.meta.endpoint_url)

    # --- errors ------------------------------------------------------------

    def _error(self, err: BaseException, key: str, action: str) -> RemoteError:
        """The typed error for a botocore failure of ``action`` on ``key``."""
        exc = self._exc
        if isinstance(err, exc.ClientError):
            code, status = _code(err), _status(err)
            msg = f"{action} failed: {code or 'error'}"
            if code == "NoSuchBucket" or (status == 404 and not key):
                return RemoteNotFoundError(
                    f"{action} failed: the bucket does not exist", bucket=self.bucket,
                    key=key, status=status,
                )
            if code in _AUTH_CODES or status == 403:
                return RemoteAuthError(
                    f"{action} failed: credentials refused ({code or 'Forbidden'})",
                    bucket=self.bucket, key=key, status=status,
                )
            if code in _MISSING_CODES or status == 404:
                return RemoteNotFoundError(msg, bucket=self.bucket, key=key, status=status)
            if status is not None and (status >= 500 or status in (408, 429)):
                return RemoteUnavailableError(msg, bucket=self.bucket, key=key, status=status)
            return RemoteError(msg, bucket=self.bucket, key=key, status=status)
        if isinstance(err, exc.NoCredentialsError | exc.PartialCredentialsError):
            return RemoteAuthError(
                f"{action} failed: no AWS credentials found ({err})", bucket=self.bucket, key=key
            )
        if isinstance(err, exc.BotoCoreError | OSError):
            return RemoteUnavailableError(
                f"{action} failed: {self.endpoint} unreachable ({type(err).__name__}: {err})",
                bucket=self.bucket, key=key,
            )
        return RemoteError(f"{action} failed: {err}", bucket=self.bucket, key=key)

    def _call(self, action: str, key: str, fn: Any, **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:
            if isinstance(e, self._exc.ClientError | self._exc.BotoCoreError | OSError):
                raise self._error(e, key, action) from e
            raise

    # --- operations --------------------------------------------------------

    def check_bucket(self) -> None:
        """HEAD the bucket: RemoteNotFoundError, RemoteAuthError or RemoteUnavailableError."""
        self._call("HEAD bucket", "", self._s3.head_bucket)

    def put(self, key: str, body: bytes, *, if_absent: bool = True,
            metadata: dict[str, str] | None = None) -> bool:
        """PUT ``body`` (with user ``metadata``, ``x-amz-meta-*``); with ``if_absent``
        (``If-None-Match: *``) False when the key exists."""
        kw: dict[str, Any] = {"Key": key, "Body": body}
        if if_absent:
            kw["IfNoneMatch"] = "*"
        if metadata:
            kw["Metadata"] = metadata
        for attempt in range(DEFAULT_ATTEMPTS):
            try:
                self._s3.put_object(Bucket=self.bucket, **kw)
                return True
            except self._exc.ClientError as e:
                status = _status(e)
                if if_absent and (status == 412 or _code(e) == "PreconditionFailed"):
                    return False
                # 409: another conditional PUT of this key is in flight; its outcome decides
                if if_absent and status == 409 and attempt + 1 < DEFAULT_ATTEMPTS:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise self._error(e, key, "PUT") from e
            except (self._exc.BotoCoreError, OSError) as e:
                raise self._error(e, key, "PUT") from e
        raise RemoteError("PUT failed: conflicting writers", bucket=self.bucket, key=key)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """GET the whole object; RemoteNotFoundError when it is missing (``max_bytes``: as
        :meth:`get_with_metadata`)."""
        return self.get_with_metadata(key, max_bytes=max_bytes)[0]

    def get_with_metadata(self, key: str, *, max_bytes: int | None = None
                          ) -> tuple[bytes, dict[str, str]]:
        """GET the whole object and its user metadata; RemoteNotFoundError when missing.

        ``max_bytes``: an object larger than that is a :class:`RemoteTooLargeError`, raised
        from the response's length before its body is read (the connection is dropped, and
        at most ``max_bytes + 1`` bytes are ever read): whoever can write the bucket can put
        a 200 MB object where a small one belongs."""
        r = self._call("GET", key, self._s3.get_object, Key=key)
        body_stream = r["Body"]
        try:
            size = int(r.get("ContentLength") or 0)
            if max_bytes is not None and size > max_bytes:
                raise self._too_large(key, size, max_bytes)
            body = bytes(body_stream.read() if max_bytes is None
                         else body_stream.read(max_bytes + 1))
            if max_bytes is not None and len(body) > max_bytes:
                raise self._too_large(key, len(body), max_bytes)
        except (self._exc.BotoCoreError, OSError) as e:
            if isinstance(e, RemoteTooLargeError):
                body_stream.close()
                raise
            raise self._error(e, key, "GET") from e
        return body, {str(k): str(v) for k, v in (r.get("Metadata") or {}).items()}

    def _too_large(self, key: str, size: int, limit: int) -> RemoteTooLargeError:
        return RemoteTooLargeError(f"an object of {size} bytes, at most {limit} expected: not "
                                   "read", size=size, limit=limit, bucket=self.bucket, key=key)

    def head(self, key: str) -> ObjectInfo | None:
        """HEAD: the object's size and mtime, or None when it is missing."""
        try:
            r = self._s3.head_object(Bucket=self.bucket, Key=key)
        except self._exc.ClientError as e:
            if _status(e) == 404:
                return None
            raise self._error(e, key, "HEAD") from e
        except (self._exc.BotoCoreError, OSError) as e:
            raise self._error(e, key, "HEAD") from e
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        """DELETE (idempotent: a missing key is no error)."""
        self._call("DELETE", key, self._s3.delete_object, Key=key)

    def delete_many(self, keys: Sequence[str]) -> None:
        """Delete up to 1000 keys per request; any per-key failure is a RemoteError.

        Only the block store and the catalog delete a remote's objects by key
        (tests/test_architecture.py checks it)."""
        self._delete_keys(keys)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (a scratch prefix of its own, as the bench's
        runs use, never a remote's entries one by one); how many there were."""
        keys = [o.key for o in self.list(prefix)]
        self._delete_keys(keys)
        return len(keys)

    def _delete_keys(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            r = self._call(
                "DELETE (batch)", batch[0]["Key"], self._s3.delete_objects,
                Delete={"Objects": batch, "Quiet": True},
            )
            errs = r.get("Errors") or []
            if errs:
                e = errs[0]
                raise RemoteError(
                    f"DELETE failed: {e.get('Code')} ({len(errs)} keys)",
                    bucket=self.bucket, key=str(e.get("Key", "")),
                )

    def list(self, prefix: str, *, start_after: str = "", limit: int | None = None
             ) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` in key order (one LIST request per 1000)."""
        kw: dict[str, Any] = {"Prefix": prefix}
        if start_after:
            kw["StartAfter"] = start_after
        if limit is not None:
            kw["MaxKeys"] = min(limit, 1000)
        seen = 0
        while True:
            r = self._call("LIST", prefix, self._s3.list_objects_v2, **kw)
            for o in r.get("Contents") or []:
                yield ObjectInfo(str(o["Key"]), int(o["Size"]), o["LastModified"].timestamp())
                seen += 1
                if limit is not None and seen >= limit:
                    return
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return
            kw["ContinuationToken"] = token
            kw.pop("StartAfter", None)

    def close(self) -> None:
        self._s3.close()
