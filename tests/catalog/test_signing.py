"""Signed entries without a gateway: the tag, what it binds, where the key comes from, and
:func:`open_manifest` checking the name before the signature (the remote group has the
two machines against the real gateway: tests/remote/test_remote_signing.py)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest
from catalog.catalog_suite import Entry

from kvstore.catalog.base import open_manifest
from kvstore.catalog.signing import (
    ENV_KEY,
    ENV_KEY_FILE,
    Signer,
    SigningKeyError,
    UnsignedManifestError,
    signing_key,
)
from kvstore.errors import DigestMismatchError, ManifestError

KEY = b"k" * 32
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
        "another key": Signer(b"j" * 32, STORE).tag(raw),
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
    assert signing_key(b"x" * 16) == b"x" * 16
    monkeypatch.setenv(ENV_KEY, "s" * 20)
    assert signing_key() == b"s" * 20
    assert signing_key("") is None  # an explicit "" turns it off
    f = tmp_path / "key"
    f.write_bytes(b"0123456789abcdef0123\n")  # `openssl rand -hex N > key` ends in a newline
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
    assert "k" * 16 not in repr(s) and "k" * 16 not in str(s)
    with pytest.raises(UnsignedManifestError) as e:
        s.check(entry.records.manifest, None, "here")
    assert "k" * 16 not in str(e.value)


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
    assert not Signer(b"o" * 32, STORE).check_priority(entry.digest, 2, tag)  # another key
    assert not s.check_priority(entry.digest, 2, None)
    assert tag != s.tag(entry.records.manifest)  # never a manifest's tag
