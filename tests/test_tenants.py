"""Tenants of one ``kvstore serve`` (issue 30, item 3): a request's ``cache_salt`` keeps its
entries apart, in memory and on disk, and is never written in plain text. Driven by the
official ``openai`` client (``extra_body``) on a tiny random-weight model."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import free_port, server_process

from kvstore import KVStoreError, Namespace, Store
from kvstore.mlx_lm.tenants import check_salt
from kvstore.store.tenants import SALT_KEY_ENV, salt_tag, tenant_key, tenant_namespace
from kvstore.tiny import make_tiny_model, sample_text

openai = pytest.importorskip("openai")

# salts a grep of the root would find if they were written as they are
SALT_A = "tenant-alpha-3f9c1e7b"
SALT_B = "tenant-bravo-8d2a6c40"
SALT_C = "tenant-charlie-51e0b9aa"


@contextmanager
def _server(model: Path, root: Path, log: Path, *more: str) -> Iterator[Any]:
    env = {k: v for k, v in os.environ.items() if k != SALT_KEY_ENV}
    with server_process("kvstore.serve", ["--root", str(root), "--min-tokens", "16",
                                          "--defer-seconds", "0", "--model", str(model),
                                          *more],
                        log, env=env) as (_, client):
        yield client


def _figures(port: int) -> dict[str, float]:
    """``kvstore_written_bytes_total`` and the root's physical bytes, from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvstore_written_bytes_total":
                out["written"] = s.value
            if s.name == "kvstore_root_bytes" and s.labels == {"kind": "physical"}:
                out["physical"] = s.value
    return out


@pytest.mark.slow
def test_a_tenant_learns_nothing_of_what_another_stored(tmp_path: Path) -> None:
    """Issue 36, item 5: tenant B sends the prompt tenant A stored, under its own salt.
    Its blocks are its own (salted), so the server writes every byte of them again: the
    bytes written and the root's bytes move as for a prompt nobody sent (they stayed at
    0 B when blocks were shared across tenants)."""
    model = make_tiny_model(tmp_path / "model", "llama")
    mport = free_port()
    system, q = sample_text(400, seed=21), "What did I just say?"
    with _server(model, tmp_path / "root", tmp_path / "serve.log",
                 "--metrics-port", str(mport)) as client:
        f0 = _figures(mport)
        assert _ask(client, system, q, SALT_A) == 0
        f1 = _wait_written(mport, f0["written"])
        assert _ask(client, system, q, SALT_B) == 0
        f2 = _wait_written(mport, f1["written"])
        fresh = sample_text(400, seed=22)  # text nobody sent, for comparison
        assert _ask(client, fresh, q, SALT_C) == 0
        f3 = _wait_written(mport, f2["written"])
    a, b, new = (f1["written"] - f0["written"], f2["written"] - f1["written"],
                 f3["written"] - f2["written"])
    assert a > 100_000 and b == a and abs(new - a) <= a // 10, (a, b, new)
    assert f2["physical"] - f1["physical"] == f1["physical"] - f0["physical"]


def _wait_written(port: int, before: float) -> dict[str, float]:
    """The figures once a save after ``before`` is written (saves are in the background)."""
    deadline = time.monotonic() + 60
    while True:
        f = _figures(port)
        if f["written"] > before or time.monotonic() > deadline:
            time.sleep(0.5)  # the save's last blocks
            return _figures(port)
        time.sleep(0.1)


def _ask(client: Any, system: str, user: str, salt: str | None) -> int:
    """One chat request; the ``cached_tokens`` the server reported for it."""
    extra = {"cache_salt": salt} if salt is not None else None
    r = client.chat.completions.create(
        model="default_model", temperature=0.0, max_tokens=4, extra_body=extra,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    details = r.usage.prompt_tokens_details
    return int((details.cached_tokens or 0) if details else 0)


def _complete(client: Any, prompt: str, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    r = client.completions.create(model="default_model", prompt=prompt, temperature=0.0,
                                  max_tokens=4, extra_body=extra)
    details = getattr(r.usage, "prompt_tokens_details", None)
    return int((details.cached_tokens or 0) if details else 0)


def _files_holding(root: Path, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for n in files:
            p = Path(dirpath) / n
            if needle in p.read_bytes():
                hits.append(str(p.relative_to(root)))
    return hits


def test_salted_tenants_of_one_server_never_share_entries(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    root = tmp_path / "root"
    system = sample_text(300, seed=11)
    q = "Which planet is closest to the sun?"
    with _server(model, root, tmp_path / "first.log") as client:
        assert _ask(client, system, q, SALT_A) == 0
        hit_a = _ask(client, system, q, SALT_A)  # the same tenant: its memory tier
        assert hit_a > 0
        assert _ask(client, system, q, SALT_B) == 0  # another salt: nothing of A's
        assert _ask(client, system, q, None) == 0  # no salt: nothing of either
        assert _ask(client, system, q, SALT_B) == hit_a
        assert _ask(client, system, q, None) == hit_a
        # both tenants at once, the same prompts, new to both and in the same order: with
        # the same history each gets the same reuse (the chat template's opening, its own),
        # and never the other's prefill (mlx-lm never batches two salts together)
        got: dict[str, list[int]] = {SALT_A: [], SALT_B: []}
        prompts = [f"Round {i}. {sample_text(200, seed=40 + i)}" for i in range(3)]

        def tenant(salt: str) -> None:
            for p in prompts:
                got[salt].append(_ask(client, p, q, salt))

        threads = [threading.Thread(target=tenant, args=(s,)) for s in (SALT_A, SALT_B)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(got[SALT_A]) == len(got[SALT_B]) == 3
        assert got[SALT_A] == got[SALT_B] and max(got[SALT_A]) < 20, got
        assert _ask(client, prompts[1], q, SALT_B) > 200  # now its own: a hit
        # the completions endpoint honours it too
        text = sample_text(250, seed=77)
        assert _complete(client, text, SALT_A) == 0
        assert _complete(client, text, SALT_C) == 0
        assert _complete(client, text, SALT_A) > 0
    # a new server: the memory tier is gone, every hit now comes from the root
    with _server(model, root, tmp_path / "second.log") as client:
        assert _ask(client, system, q, SALT_C) == 0
        assert _ask(client, system, q, SALT_A) > 0
        assert _ask(client, system, q, SALT_B) > 0
        assert _ask(client, system, q, None) > 0
    with Store.open(root, create=False) as s:
        key = tenant_key(s)
        spaces = {e.namespace.ns for e in s.entries()}
    assert spaces == {"default", *(f"default#tenant-{salt_tag(key, x)}"
                                   for x in (SALT_A, SALT_B, SALT_C))}
    # no salt in plain text anywhere in the root (the index, the blocks, anything)
    for salt in (SALT_A, SALT_B, SALT_C):
        assert _files_holding(root, salt.encode()) == []
    assert _files_holding(root, b"default#tenant-")  # the grep does see the namespaces


def test_a_bad_cache_salt_is_a_400_answer(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    with _server(model, tmp_path / "root", tmp_path / "serve.log") as client:
        for bad in ("", 7, ["a"], "x" * 4097):
            with pytest.raises(openai.BadRequestError) as e:
                _ask(client, "You are terse.", "Hi", bad)  # type: ignore[arg-type]
            assert e.value.response.json() == {
                "error": "cache_salt must be a non-empty string of at most 4096 bytes"}
        assert _ask(client, "You are terse.", "Hi", "ok") == 0  # the server still answers
        # `null` is no salt (docs/CLI.md): it shares the unsalted requests' entries, and
        # not a salted one's
        system = sample_text(200, seed=5)
        assert _ask(client, system, "Hi", None) == 0
        unsalted = _ask(client, system, "Hi", None)
        assert unsalted > 0

        def null_salt() -> int:
            r = client.chat.completions.create(
                model="default_model", temperature=0.0, max_tokens=4,
                extra_body={"cache_salt": None},
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": "Hi"}])
            return int(r.usage.prompt_tokens_details.cached_tokens or 0)

        assert null_salt() == unsalted
        assert _ask(client, system, "Hi", SALT_C) == 0


def test_salt_tags_are_keyed_and_namespaces_distinct(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    key1, key2 = b"k" * 32, b"j" * 32
    a, b = salt_tag(key1, SALT_A), salt_tag(key1, SALT_B)
    assert len(a) == 32 and a != b and salt_tag(key2, SALT_A) != a
    assert salt_tag(key1, SALT_A) == a  # the same key and salt: the same tenant
    with pytest.raises(KVStoreError, match="cache_salt must be 1 to 4096 bytes, got 0"):
        salt_tag(key1, "")
    assert check_salt(None) is None and check_salt("s") == "s"
    for bad in ("", 3, None.__class__, "é" * 2049):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            check_salt(bad)
    # the root keeps one key, made once; $KVSTORE_SALT_KEY overrides it
    with Store.open(tmp_path / "r") as s:
        k = tenant_key(s)
        assert len(k) == 32 and tenant_key(s) == k
    with Store.open(tmp_path / "r") as s:
        assert tenant_key(s) == k
    monkeypatch.setenv(SALT_KEY_ENV, "shared secret")
    with Store.open(tmp_path / "r") as s:
        assert tenant_key(s) == b"shared secret"
    base = Namespace(model_id="m", config_fingerprint="c", tokenizer_hash="t", ns="team")
    assert tenant_namespace(base, a) == Namespace(model_id="m", config_fingerprint="c",
                                                  tokenizer_hash="t", ns=f"team#tenant-{a}")
