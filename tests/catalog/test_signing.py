"""Signed entries without a gateway: the tag, what it binds, where the key comes from, and
:func:`open_manifest` checking the name before the signature (the remote group has the
two machines against the real gateway: tests/remote/test_remote_signing.py)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from pathlib import Path

import pytest
from catalog.catalog_suite import Entry

from kvstore.catalog.base import open_manifest
from kvstore.catalog.signing import (
    ENV_KEY,
    ENV_KEY_FILE,
    MAX_KEY_FILE_BYTES,
    Signer,
    SigningKeyError,
    UnsignedManifestError,
    signing_key,
)
from kvstore.errors import DigestMismatchError, ManifestError

KEY = b"team-signing-key-0123456789abcdef"
STORE = "s3://b/team/ hash=blake3 block_tokens=4 state_block_bytes=4194304 created_at=1"


@pytest.fixture
def entry() -> Entry:
    return Entry(list(range(1, 11)))


def test_the_tag_is_hmac_sha256_over_the_store_and_the_exact_bytes(entry: Entry) -> None:
    raw = entry.records.manifest
    tag = Signer(KEY, STORE).tag(raw)
    want = hmac.new(KEY, b"kvstore manifest hmac-sha256-v1\0" + STORE.encode() + b"\0" + raw,
                    hashlib.sha256).hexdigest()
    assert tag == f"hmac-sha256-v1:{want}"
    m = open_manifest(raw, entry.digest, algo="blake3", signer=Signer(KEY, STORE), tag=tag)
    assert m == entry.manifest


@pytest.mark.parametrize("why", ["no tag", "another key", "another store", "another entry",
                                 "truncated tag", "not hex"])
def test_a_reader_with_the_key_refuses(entry: Entry, why: str) -> None:
    raw = entry.records.manifest
    other = Entry(list(range(1, 12))).records.manifest
    tag = {
        "no tag": None,
        "another key": Signer(b"someone-elses-key-0123456789abcd", STORE).tag(raw),
        "another store": Signer(KEY, STORE.replace("team/", "other/")).tag(raw),
        "another entry": Signer(KEY, STORE).tag(other),
        "truncated tag": Signer(KEY, STORE).tag(raw)[:-2],
        "not hex": "hmac-sha256-v1:" + "zé" * 32,
    }[why]
    with pytest.raises(UnsignedManifestError) as e:
        open_manifest(raw, entry.digest, algo="blake3", signer=Signer(KEY, STORE), tag=tag,
                      where="s3://b/team/manifests/x")
    assert isinstance(e.value, ManifestError)  # every reader that skips a bad one skips it
    assert e.value.where == "s3://b/team/manifests/x"
    assert e.value.why == ("it is not signed" if why == "no tag"
                           else "its signature is not this key's")


def test_a_reader_without_the_key_reads_a_signed_manifest(entry: Entry) -> None:
    raw = entry.records.manifest
    assert open_manifest(raw, entry.digest, algo="blake3") == entry.manifest


def test_tampered_bytes_under_the_old_name_fail_the_name_first(entry: Entry) -> None:
    raw = bytearray(entry.records.manifest)
    tag = Signer(KEY, STORE).tag(bytes(raw))
    raw[-1] ^= 1
    with pytest.raises(DigestMismatchError):
        open_manifest(bytes(raw), entry.digest, algo="blake3", signer=Signer(KEY, STORE),
                      tag=tag)


def test_the_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    assert signing_key() is None
    assert signing_key(b"0123456789abcdef") == b"0123456789abcdef"
    monkeypatch.setenv(ENV_KEY, "s3cret-s3cret-s3cret")
    assert signing_key() == b"s3cret-s3cret-s3cret"
    assert signing_key("") is None  # an explicit "" turns it off
    f = tmp_path / "key"
    f.write_bytes(b"0123456789abcdef0123\n")
    f.chmod(0o600)  # `openssl rand -hex N > key` ends in a newline
    monkeypatch.setenv(ENV_KEY_FILE, str(f))
    with pytest.raises(SigningKeyError, match="both"):
        signing_key()
    monkeypatch.delenv(ENV_KEY)
    assert signing_key() == b"0123456789abcdef0123"
    f.write_bytes(b"short\n")
    with pytest.raises(SigningKeyError, match=r"key file .* is 5 bytes: .* at least 16"):
        signing_key()
    monkeypatch.setenv(ENV_KEY_FILE, str(tmp_path / "absent"))
    with pytest.raises(SigningKeyError, match="cannot read"):
        signing_key()
    with pytest.raises(SigningKeyError, match="at least 16"):
        signing_key("too short")


def test_the_key_never_shows(entry: Entry) -> None:
    s = Signer(KEY, STORE)
    assert KEY.decode() not in repr(s) and KEY.decode() not in str(s)
    with pytest.raises(UnsignedManifestError) as e:
        s.check(entry.records.manifest, None, "here")
    assert KEY.decode() not in str(e.value)


def test_the_priority_tag_binds_the_store_the_entry_and_the_priority(entry: Entry) -> None:
    """The priority's own tag (kvstore-prio-sig): HMAC-SHA256 over its domain, the store,
    the entry's digest and the priority; it vouches for that priority of that entry in that
    store only."""
    s = Signer(KEY, STORE)
    tag = s.tag_priority(entry.digest, 2)
    want = hmac.new(KEY, b"kvstore priority hmac-sha256-v1\0" + STORE.encode() + b"\0"
                    + entry.digest + b"\0" + b"2", hashlib.sha256).hexdigest()
    assert tag == f"hmac-sha256-v1:{want}"
    assert s.check_priority(entry.digest, 2, tag)
    assert not s.check_priority(entry.digest, -1, tag)  # another priority
    assert not s.check_priority(b"\0" * 32, 2, tag)  # another entry
    assert not Signer(KEY, STORE + "x").check_priority(entry.digest, 2, tag)  # another store
    assert not Signer(bytes(range(32)), STORE).check_priority(entry.digest, 2, tag)  # another key
    assert not s.check_priority(entry.digest, 2, None)
    assert tag != s.tag(entry.records.manifest)  # never a manifest's tag


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    return monkeypatch


def _key_file(tmp_path: Path, data: bytes, mode: int) -> Path:
    f = tmp_path / "key"
    f.write_bytes(data)
    f.chmod(mode)
    return f


@pytest.mark.parametrize(("mode", "who"), [(0o666, "others"), (0o602, "others"),
                                           (0o620, "its group")], ids=["666", "602", "620"])
def test_a_key_file_others_can_write_is_refused(tmp_path: Path, key_env: pytest.MonkeyPatch,
                                                mode: int, who: str) -> None:
    f = _key_file(tmp_path, KEY + b"\n", mode)
    key_env.setenv(ENV_KEY_FILE, str(f))
    with pytest.raises(SigningKeyError) as e:
        signing_key()
    assert str(e.value) == (f"${ENV_KEY_FILE}: {f} is mode {mode:04o}: {who} can write it, "
                            f"and so choose the key; refused (chmod 600 {f})")


def test_a_key_file_others_can_read_is_used_with_a_warning(
        tmp_path: Path, key_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    f = _key_file(tmp_path, KEY + b"\n", 0o644)
    key_env.setenv(ENV_KEY_FILE, str(f))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert signing_key() == KEY
    assert [r.getMessage() for r in caplog.records] == [
        f"kvstore: ${ENV_KEY_FILE}: {f} is mode 0644: others can read the signing key "
        f"(chmod 600 {f})"]
    caplog.clear()
    f.chmod(0o640)  # its group may read it: a team's key
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert signing_key() == KEY
    assert caplog.records == []


def test_a_fifo_is_refused_without_blocking(tmp_path: Path,
                                            key_env: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)  # nobody ever writes it: a read would wait forever
    key_env.setenv(ENV_KEY_FILE, str(fifo))
    got: list[BaseException] = []

    def read() -> None:
        try:
            signing_key()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO as the key file blocked"
    assert len(got) == 1 and isinstance(got[0], SigningKeyError)
    assert str(got[0]) == (f"${ENV_KEY_FILE}: {fifo} is not a regular file: a key file "
                           "must be one")


def test_a_device_is_refused_unread(key_env: pytest.MonkeyPatch) -> None:
    key_env.setenv(ENV_KEY_FILE, "/dev/zero")  # endless bytes
    with pytest.raises(SigningKeyError) as e:
        signing_key()
    assert str(e.value) == (f"${ENV_KEY_FILE}: /dev/zero is not a regular file: a key file "
                            "must be one")


def test_a_key_file_is_read_to_a_bound(tmp_path: Path, key_env: pytest.MonkeyPatch) -> None:
    f = _key_file(tmp_path, os.urandom(MAX_KEY_FILE_BYTES), 0o600)
    key_env.setenv(ENV_KEY_FILE, str(f))
    assert len(signing_key() or b"") >= MAX_KEY_FILE_BYTES - 2  # at the bound: a key
    with f.open("ab") as out:
        out.write(b"x" * (1 << 20))
    with pytest.raises(SigningKeyError) as e:
        signing_key()
    assert str(e.value) == (f"${ENV_KEY_FILE}: {f} is over {MAX_KEY_FILE_BYTES} bytes: a key "
                            "file holds one key")


@pytest.mark.parametrize(("key", "why"), [
    (b" " * 16, "is only whitespace: not a signing key"),
    (b" \t\r\x0b\x0c" * 4, "is only whitespace: not a signing key"),
    (b"k" * 32, "has 1 distinct byte value: too little entropy for a signing key, which "
                "needs at least 4"),
    (b"\0" * 64, "has 1 distinct byte value: too little entropy for a signing key, which "
                 "needs at least 4"),
    (b"abc" * 8, "has 3 distinct byte values: too little entropy for a signing key, which "
                 "needs at least 4"),
])
def test_a_key_without_entropy_is_refused(tmp_path: Path, key_env: pytest.MonkeyPatch,
                                          key: bytes, why: str) -> None:
    hint = "(e.g. `openssl rand -hex 32`)"
    f = _key_file(tmp_path, key + b"\n", 0o600)
    key_env.setenv(ENV_KEY_FILE, str(f))
    with pytest.raises(SigningKeyError) as e:
        signing_key()
    assert str(e.value) == f"the key file {f} {why} {hint}"
    key_env.delenv(ENV_KEY_FILE)
    if b"\0" not in key:  # an environment variable cannot hold one
        key_env.setenv(ENV_KEY, key.decode())
        with pytest.raises(SigningKeyError) as e:
            signing_key()
        assert str(e.value) == f"${ENV_KEY} {why} {hint}"
    with pytest.raises(SigningKeyError) as e:
        Signer(key, STORE)
    assert str(e.value) == f"the signing key {why} {hint}"
