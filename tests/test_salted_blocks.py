"""A tenant's blocks are its own (issue 36, item 5): every block of a salted tenant's
entry ends with a salt of its namespace, so its name differs from every other tenant's
for the same KV, and a tenant that stores another's prompt writes every byte again (the
bytes written and ``/metrics`` do not say the prompt was there). Entries without a salt
are unchanged: format 5, blocks named by their bytes, shared.

The server end to end (what ``/metrics`` shows tenant B) is in tests/test_tenants.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers.kv import NS, T, hybrid_cache, make_cache, matches, tokens_for

import kvstore
from kvstore.blocks import hash_bytes
from kvstore.schema import SALT_KEY, Namespace
from kvstore.store.tenants import block_salt, tenant_namespace

TAGS = ("a" * 32, "b" * 32, "c" * 32)


def _open(root: Path, ns: Namespace) -> kvstore.Store:
    return kvstore.Store.open(root, namespace=ns, block_tokens=T, durable=False)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "blocks").rglob("*") if p.is_file()}


def _same(a: list[Any], b: list[Any]) -> bool:
    """Every array of two restored caches bit-equal."""
    from mlx.utils import tree_flatten

    for x, y in zip(a, b, strict=True):
        fx, fy = tree_flatten(x.state), tree_flatten(y.state)
        if len(fx) != len(fy):
            return False
        for (_, u), (_, v) in zip(fx, fy, strict=True):
            if not isinstance(u, mx.array):
                if u != v:
                    return False
            elif (u.dtype != v.dtype or u.shape != v.shape
                  or not mx.array_equal(u, v).item()):
                return False
    return True


@pytest.mark.parametrize("kind", ["kv", "hybrid"])
def test_tenants_storing_one_prompt_share_no_block(tmp_path: Path, kind: str) -> None:
    toks = tokens_for(1, 40)
    cache = make_cache if kind == "kv" else hybrid_cache
    root = tmp_path / "root"
    with _open(root, NS) as s:
        plain = s.save(toks, cache(toks))
        m = s.manifest(plain.id)
        assert m.format == 5 and SALT_KEY not in m.metadata and m.block_salt == b""
        plain_bytes = plain.new_bytes
        plain_blocks = set(m.block_digests())
    seen = set(plain_blocks)
    for tag in TAGS:
        ns = tenant_namespace(NS, tag)
        salt = block_salt(ns)
        with _open(root, ns) as s:
            info = s.save(toks, cache(toks))
            m = s.manifest(info.id)
            assert m.format == 6 and m.metadata[SALT_KEY] == salt.hex() and len(salt) == 32
            blocks = set(m.block_digests())
            assert not blocks & seen  # no block of another tenant's, or of no tenant's
            seen |= blocks
            # every byte written again: the tenant's bytes, plus its salt per block
            assert info.new_bytes == plain_bytes + 32 * len(blocks)
            got, n = s.restore(toks)
            assert n == len(toks) and got is not None
            if kind == "kv":
                assert matches(got, toks, n)
        with _open(root, NS) as s:
            ref, _ = s.restore(toks)
        assert ref is not None and _same(got, ref)  # bit-equal to the unsalted entry's
    files = _files(root)
    for name, data in files.items():  # each file hashes, whole, to its name
        assert hash_bytes("blake3", data).hex() == name
    for tag in TAGS:
        salt = block_salt(tenant_namespace(NS, tag))
        with _open(root, tenant_namespace(NS, tag)) as s:
            e = next(iter(s.entries(namespace=tenant_namespace(NS, tag))))
            for d in s.manifest(e.id).block_digests():
                assert files[d.hex()].endswith(salt)
    with _open(root, NS) as s:
        rep = s.verify(read_data=True)
        assert rep.sound and rep.corrupt_blocks == [] and rep.size_drift == []
        fixed = s.verify(read_data=True, repair=True)
        assert fixed.quarantined == [] and fixed.dropped_entries == []
    r = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(root), "verify",
                        "--read-data"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_salted_entry_exports_and_imports_as_its_tensors(tmp_path: Path) -> None:
    """The file holds the tensors (the salt is the store's, not the file's); imported
    elsewhere it is the same tenant's again, with the same salt, and restores bit-exact."""
    toks = tokens_for(2, 40)
    ns = tenant_namespace(NS, TAGS[0])
    with _open(tmp_path / "root", ns) as s:
        info = s.save(toks, make_cache(toks), metadata={"who": "alpha"})
        out = s.export(info.id, tmp_path / "a.safetensors")
    assert SALT_KEY.encode() not in out.read_bytes()
    with _open(tmp_path / "other", ns) as s:
        e = s.import_file(out)
        m = s.manifest(e.id)
        assert m.format == 6 and m.block_salt == block_salt(ns) and m.metadata["who"] == "alpha"
        got, n = s.restore(toks)
        assert n == len(toks) and matches(got, toks, n)


def test_the_salt_is_the_stores_own_metadata(tmp_path: Path) -> None:
    toks = tokens_for(3, 40)
    with _open(tmp_path / "root", NS) as s, pytest.raises(ValueError) as e:
        s.save(toks, make_cache(toks), metadata={SALT_KEY: "00" * 32})
    assert str(e.value) == f"metadata key {SALT_KEY!r} is the store's own"


def test_a_salted_block_damaged_on_disk_is_caught(tmp_path: Path) -> None:
    toks = tokens_for(4, 40)
    ns = tenant_namespace(NS, TAGS[1])
    root = tmp_path / "root"
    with _open(root, ns) as s:
        info = s.save(toks, make_cache(toks))
        d = s.manifest(info.id).token_blocks[0].hex()
    f = root / "blocks" / d[:2] / d
    data = bytearray(f.read_bytes())
    data[0] ^= 1  # a byte of KV
    os.chmod(f, 0o600)
    f.write_bytes(bytes(data))
    with _open(root, ns) as s:
        got, n = s.restore(toks)  # a miss: the block moved aside, its entry dropped
        assert (got, n) == (None, 0)
    assert (root / "quarantine" / d).read_bytes() == bytes(data)
