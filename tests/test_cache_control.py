"""Cache breakpoints (issue 34, item 4): a chat request's ``cache_control`` marks, as
OpenRouter-style clients send them through the ``openai`` SDK, become entries of exactly the
marked prefix, pinned in memory and in the root for their TTL; mlx-lm's template never sees
the marks. Tiny random-weight models, built locally."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from factories import prefix_cache
from helpers.kv import common_prefix
from helpers.serving import server_process

import kvstore
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.cache_control import pin_type, take_breakpoints
from kvstore.tiny import make_tiny_model, sample_text

openai = pytest.importorskip("openai")

SYSTEM = sample_text(300, seed=21)
QUESTIONS = ["What is the river?", "Who opened the shop?", "What did the sailors do?"]
MARK = {"type": "ephemeral"}


@contextmanager
def serve(model: Path, root: Path, log: Path) -> Iterator[tuple[int, Any]]:
    with server_process("kvstore.serve", ["--root", str(root), "--model", str(model),
                                          "--min-tokens", "16"], log,
                        client_timeout=300) as (port, client):
        yield port, client


def marked(question: str) -> list[dict[str, Any]]:
    return [{"role": "system",
             "content": [{"type": "text", "text": SYSTEM, "cache_control": MARK}]},
            {"role": "user", "content": question}]


def plain(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def ask(client: Any, messages: list[dict[str, Any]]) -> tuple[int, int]:
    r = client.chat.completions.create(model="default_model", messages=messages,
                                       max_tokens=3, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def pinned_entries(root: Path) -> dict[int, tuple[str, int]]:
    """n_tokens -> (priority, pin_ttl ms) of the root's pinned entries."""
    with kvstore.Store.open(root, create=False) as store:
        names = {e.id: (e.n_tokens, e.priority) for e in store.entries()}
        with store.local.index.read() as txn:
            return {names[d.hex()][0]: (names[d.hex()][1], rec.pin_ttl)
                    for d, rec in store.local.index.iter_entries(txn) if rec.pin_ttl}


@pytest.mark.parametrize("kind", ["llama", "lfm2", pytest.param("qwen3_5",
                                                                marks=pytest.mark.slow)])
def test_a_breakpoint_on_the_system_block_is_an_entry_of_exactly_its_length(
    tmp_path: Path, kind: str
) -> None:
    """The system block's mark makes an entry that ends exactly where the system message
    ends in the prompt (for lfm2 and qwen3_5, whose cache cannot be trimmed, a checkpoint at
    that token, far from any multiple of the checkpoint interval), priority system, pinned
    for 5 minutes; the next question reuses it from memory, and after a restart from the
    root alone. The template never saw the mark: the prompt is the unmarked one's."""
    model = make_tiny_model(tmp_path / "model", kind)
    _, tok = mlx_lm.load(str(model))
    prompts = [tok.apply_chat_template(plain(q), add_generation_prompt=True) for q in QUESTIONS]
    system_only = tok.apply_chat_template(plain("")[:1], add_generation_prompt=False)
    at = common_prefix(system_only, prompts[0])
    assert 200 < at < common_prefix(prompts[0], prompts[1]) + 1 and at % 256 != 0
    root = tmp_path / "root"
    with serve(model, root, tmp_path / "a.log") as (_, client):
        first = ask(client, marked(QUESTIONS[0]))
        second = ask(client, marked(QUESTIONS[1]))
    assert first == (len(prompts[0]), 0)
    assert second[0] == len(prompts[1]) and second[1] >= at
    assert pinned_entries(root) == {at: ("system", 300_000)}
    with serve(model, root, tmp_path / "b.log") as (_, client):  # nothing in memory
        third = ask(client, marked(QUESTIONS[2]))
    shared = max(common_prefix(prompts[2], p) for p in prompts[:2])
    assert third[0] == len(prompts[2])
    if kind == "llama":
        assert third[1] == shared
    else:  # the pin, or mlx-lm's own system segment's end (a few tokens on, into the user
        assert at <= third[1] < shared  # header), which the root also holds



def test_marks_are_checked_and_taken_out_of_the_body() -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": "b"}]},
            {"role": "user", "content": [{"type": "text", "text": "c"}]}],
        "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": MARK}],
        "cache_control": MARK,
    }
    got = take_breakpoints(body)
    assert [(b.ttl, b.message, b.part, b.tool) for b in got] == [
        (3600.0, 0, 0, None), (300.0, None, None, 0), (300.0, 1, 0, None)]
    assert "cache_control" not in json.dumps(body)
    with pytest.raises(ValueError, match=r"ttl must be \"5m\" or \"1h\", not '2h'"):
        take_breakpoints({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                            "ttl": "2h"}}]}]})
    five = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": MARK} for i in range(5)]}]}
    with pytest.raises(ValueError, match="A maximum of 4 blocks with cache_control may be "
                                         "provided. Found 5."):
        take_breakpoints(five)


def test_a_bad_mark_is_a_400_answer(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    with serve(model, tmp_path / "root", tmp_path / "a.log") as (port, _):
        body = {"model": "default_model", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi",
                                          "cache_control": {"type": "persistent"}}]}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400
        assert json.loads(e.value.read()) == {"error": "messages[0].content[0]: cache_control "
                                              "must be {\"type\": \"ephemeral\"} (optionally "
                                              "with \"ttl\": \"5m\" or \"1h\")"}


def test_a_pin_outlives_an_lru_flood_in_memory_until_its_ttl(tmp_path: Path) -> None:
    """Memory only (nothing reaches the root: min_tokens): a pinned system prefix survives
    twenty system prompts through an LRU of two; 300 s after its last use it is an ordinary
    entry of the LRU, and the next flood evicts it."""
    now = [0.0]
    store = kvstore.Store.open(tmp_path / "root", block_tokens=16, durable=False)
    pc = PersistentPromptCache(store, max_size=2, min_tokens=1 << 30, clock=lambda: now[0])
    key = "tiny"
    system = list(range(1, 65))

    def cache(tokens: list[int]) -> list[Any]:
        return [prefix_cache(tokens, mx.float16, heads=2, dim=8)]

    def flood(seed: int) -> None:
        for i in range(20):
            toks = [seed * 1000 + i * 50 + j for j in range(1, 41)]
            pc.fetch_nearest_cache(key, toks)
            pc.insert_cache(key, toks, cache(toks), cache_type="system")

    pc.insert_cache(key, system, cache(system), cache_type=pin_type(300, "system"))
    flood(1)
    now[0] = 299.0
    got, rest = pc.fetch_nearest_cache(key, [*system, 7, 8])
    assert got is not None and rest == [7, 8] and got[0].offset == 64  # and a use
    now[0] = 299.0 + 299.0
    flood(2)
    got, rest = pc.fetch_nearest_cache(key, [*system, 9, 10])
    assert got is not None and rest == [9, 10]
    now[0] = 299.0 + 299.0 + 301.0
    flood(3)
    got, rest = pc.fetch_nearest_cache(key, [*system, 11, 12])
    assert got is None and rest == [*system, 11, 12]
    pc.close()
    store.close()


def test_pins_in_memory_are_bounded_by_half_the_lru(tmp_path: Path) -> None:
    store = kvstore.Store.open(tmp_path / "root", block_tokens=16, durable=False)
    pc = PersistentPromptCache(store, max_size=4, min_tokens=1 << 30, clock=lambda: 0.0)
    prefixes = [[k * 100 + j for j in range(1, 33)] for k in range(1, 6)]
    for p in prefixes:
        pc.insert_cache("tiny", p, [prefix_cache(p, mx.float16, heads=2, dim=8)],
                        cache_type=pin_type(3600, "system"))
    assert len(pc._pins) == 2  # half of 4; the other three went to the LRU, oldest first
    assert [p.tokens for p in pc._pins.values()] == prefixes[-2:]
    assert len(pc) == 5
    pc.close()
    store.close()


def test_a_top_level_mark_pins_the_conversation_up_to_its_last_message(tmp_path: Path) -> None:
    """The SDK's automatic caching (``cache_control`` at the top of the body): the entry
    ends where the last message ends, before the generation prompt; priority user."""
    model = make_tiny_model(tmp_path / "model", "llama")
    _, tok = mlx_lm.load(str(model))
    messages = plain(QUESTIONS[0])
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    at = common_prefix(tok.apply_chat_template(messages, add_generation_prompt=False), prompt)
    assert 300 < at < len(prompt)
    root = tmp_path / "root"
    with serve(model, root, tmp_path / "a.log") as (_, client):
        r = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=3, temperature=0,
                                           extra_body={"cache_control": MARK})
        assert r.usage.prompt_tokens == len(prompt)
    assert pinned_entries(root) == {at: ("user", 300_000)}


@pytest.mark.slow
def test_a_messages_breakpoint_is_pinned_as_a_chat_one_is(tmp_path: Path) -> None:
    """The Anthropic SDK's ``cache_control`` on a system block, through ``/v1/messages``
    (the adapter carries it to the chat body, the breakpoint hook takes it out): an entry
    that ends exactly where the system message ends, pinned for its ``ttl`` of an hour;
    the next request reads it back (``cache_read_input_tokens``), and the three usage
    figures add up to the prompt."""
    anthropic = pytest.importorskip("anthropic")
    model = make_tiny_model(tmp_path / "model", "llama")
    _, tok = mlx_lm.load(str(model))
    system_only = tok.apply_chat_template(plain("")[:1], add_generation_prompt=False)
    prompt = tok.apply_chat_template(plain(QUESTIONS[0]), add_generation_prompt=True)
    at = common_prefix(system_only, prompt)
    root = tmp_path / "root"
    system = [{"type": "text", "text": SYSTEM,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    with serve(model, root, tmp_path / "a.log") as (port, _):
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                                     max_retries=0, timeout=300)
        usage = [client.messages.create(model="default_model", max_tokens=3, system=system,
                                        messages=[{"role": "user", "content": q}]).usage
                 for q in QUESTIONS[:2]]
    assert pinned_entries(root) == {at: ("system", 3_600_000)}
    for u in usage:
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > at
    assert usage[0].cache_read_input_tokens == 0 and usage[1].cache_read_input_tokens >= at
