"""A reason for every miss (issue 34 item 6, issue 38 item 7): where a prompt parted from
the deepest stored sequence (the token, the message, its role and block, the tokens of
that message before it), from the memory tier and from the store alike; a partial hit
shorter than what the store shares says ``shallow``; excerpts only when asked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers.observers import Seen
from mlx_lm.models.cache import ArraysCache, KVCache

import kvstore
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.partings import MessageMap
from kvstore.mlx_lm.prefill import checkpoint_type
from kvstore.mlx_lm.requests import RequestContext

KEY = ("model", None, None)
MODEL = nn.Linear(4, 4)  # one fingerprint for every cache here

# --- placing a token among the messages ---------------------------------------------


def _render(tools: list[str]) -> Any:
    """A toy template over characters (one token a character): the tools first, in the
    system message, then ``<role>content[reasoning]{calls}</>`` per message."""

    def render(msgs: list[dict[str, Any]], with_tools: bool) -> list[int]:
        out = ""
        for i, m in enumerate(msgs):
            out += f"<{m['role']}>"
            if i == 0 and with_tools and tools:
                out += "T:" + ",".join(tools) + ";"
            out += m.get("reasoning_content", "") + (m.get("content") or "")
            out += "".join("{" + c["function"]["arguments"] + "}"
                           for c in m.get("tool_calls") or [])
            out += "</>"
        return [ord(c) for c in out]

    return render


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "list files"},
    {"role": "assistant", "reasoning_content": "think", "content": "ok",
     "tool_calls": [{"function": {"name": "ls", "arguments": "dir"}}]},
    {"role": "tool", "content": "a.py b.py"},
]


def _prompt(render: Any) -> list[int]:
    return render(MESSAGES, True) + [ord(c) for c in "<assistant>"]


def test_a_position_is_placed_in_its_message_role_and_block() -> None:
    render = _render(["read", "write"])
    prompt = _prompt(render)
    text = "".join(map(chr, prompt))
    mm = MessageMap(MESSAGES, render, has_tools=True)

    def at(needle: str, offset: int = 0) -> tuple[int, str, str, int]:
        return mm.locate(prompt, text.index(needle) + offset)

    start_user = text.index("<user>")
    assert at("brief") == (0, "system", "text", text.index("brief"))
    assert at("write") == (0, "system", "tools", text.index("write"))
    assert at("files") == (1, "user", "text", text.index("files") - start_user)
    a0 = text.index("<assistant>")
    assert at("think", 2) == (2, "assistant", "thinking", text.index("think") + 2 - a0)
    assert at("{dir}", 1) == (2, "assistant", "tool_use", text.index("{dir}") + 1 - a0)
    t0 = text.index("<tool>")
    assert at("b.py") == (3, "tool", "tool_result", text.index("b.py") - t0)
    end = len(render(MESSAGES, True))
    assert mm.locate(prompt, end + 3) == (4, "assistant", "generation_prompt", 3)


def test_placing_renders_about_log2_messages_prefixes() -> None:
    inner = _render([])
    calls: list[int] = []

    def render(msgs: list[dict[str, Any]], with_tools: bool) -> list[int]:
        calls.append(len(msgs))
        return list(inner(msgs, with_tools))

    messages = [{"role": "user" if i % 2 else "assistant", "content": f"m{i:03d}"}
                for i in range(256)]
    prompt = inner(messages, True)
    mm = MessageMap(messages, render, has_tools=False)
    text = "".join(map(chr, prompt))
    assert mm.locate(prompt, text.index("m200") + 2)[0] == 200
    assert len(calls) <= 9  # log2(256) + 1, not 200


# --- the prompt cache: shared tokens, the parting, excerpts, shallow --------------------


def _kv(tokens: list[int]) -> list[Any]:
    c = KVCache()
    t = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
    k = mx.broadcast_to(t, (1, 2, len(tokens), 8))
    c.update_and_fetch(k, -k)
    mx.eval(c.keys, c.values)
    return [c]


def _hybrid(tokens: list[int]) -> list[Any]:
    kv = _kv(tokens)[0]
    ssm = ArraysCache(1)
    ssm[0] = mx.full((1, 3, 4), float(tokens[-1]))
    mx.eval(ssm[0])
    return [kv, ssm]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False, block_tokens=256) as s:
        yield s


def _cache(store: kvstore.Store) -> tuple[PersistentPromptCache, Seen]:
    pc = PersistentPromptCache(store, min_tokens=16)
    pc.register_model(KEY, MODEL, model_id="parting")
    seen = Seen()
    pc.observers.append(seen)
    return pc, seen


def _context(where: tuple[int, str, str, int], *, excerpts: bool = False
             ) -> tuple[RequestContext, list[tuple[int, int]]]:
    asked: list[tuple[int, int]] = []

    def locate(prompt: Sequence[int], position: int) -> tuple[int, str, str, int]:
        asked.append((len(prompt), position))
        return where

    decode = (lambda toks: " ".join(f"t{t}" for t in toks)) if excerpts else None
    return RequestContext(rewrites={"sorted-tool-schemas": 2}, locate=locate,
                          decode=decode), asked


def test_the_parting_from_the_memory_tier_and_from_the_store(store: kvstore.Store) -> None:
    first = list(range(1, 701))
    second = first[:300] + list(range(5000, 5400))  # parts at token 300
    pc, seen = _cache(store)
    pc.fetch_nearest_cache(KEY, first)
    pc.insert_cache(KEY, first, _kv(first))
    assert pc.drain(30)
    ctx, asked = _context((3, "tool", "tool_result", 41))
    pc.set_request(ctx)
    _, rest = pc.fetch_nearest_cache(KEY, second)
    assert len(second) - len(rest) == 300  # trimmed to the parting
    rec = seen.opened[-1]
    assert (rec.shared, rec.rewrites) == (300, {"sorted-tool-schemas": 2})
    # placed among the messages only once the request is answered: it renders the chat
    # template, which no request's first token waits for
    assert rec.parting is not None and (rec.parting.position, rec.parting.message) == (300, None)
    assert asked == []
    rec.placed()  # what its reply does (PersistentPromptCache._finished; the log line
    assert rec.parting is not None  # through serve: tests/test_serve_partings.py)
    assert (rec.parting.position, rec.parting.message, rec.parting.role, rec.parting.block,
            rec.parting.matched) == (300, 3, "tool", "tool_result", 41)
    assert (rec.parting.ours, rec.parting.theirs) == (None, None)  # not asked: no excerpt
    assert asked == [(700, 300)]
    fields = dict(kv.split("=", 1) for kv in rec.line().split(" ")[2:])
    assert {k: fields[k] for k in ("rewrites", "shared", "part", "part_msg", "part_role",
                                   "part_block", "part_matched")} == {
        "rewrites": "sorted-tool-schemas:2", "shared": "300", "part": "300", "part_msg": "3",
        "part_role": "tool", "part_block": "tool_result", "part_matched": "41"}
    assert "part_ours" not in fields and "part_theirs" not in fields
    # a restarted server: the store alone knows it, to the token (not by 256-token blocks)
    cold, seen2 = _cache(store)
    ctx, _ = _context((3, "tool", "tool_result", 41), excerpts=True)
    cold.set_request(ctx)
    cold.fetch_nearest_cache(KEY, second)
    rec = seen2.opened[-1]
    rec.placed()  # as its reply would
    assert rec.shared == 300 and rec.parting is not None and rec.parting.position == 300
    assert rec.parting.ours == " ".join(f"t{t}" for t in range(5000, 5016))[:40]
    assert rec.parting.theirs == " ".join(f"t{t}" for t in range(301, 317))[:40]
    assert 'part_ours="t5000 t5001' in rec.line()
    # a prompt that only extends what is stored did not part: no parting, the tokens shared
    cold.set_request(_context((0, "-", "-", 0))[0])
    cold.fetch_nearest_cache(KEY, first + [9, 9, 9])
    rec = seen2.opened[-1]
    assert (rec.shared, rec.parting) == (700, None)
    _, rest = pc.fetch_nearest_cache(KEY, first)  # all of it, from memory
    rec = seen.opened[-1]
    assert (rec.reused_tokens, rec.shared, rec.parting) == (700, 700, None)
    pc.close()
    cold.close()


def test_a_partial_hit_shorter_than_the_store_shares_says_shallow(
        store: kvstore.Store) -> None:
    """Issue 38 item 7: a hybrid's checkpoint at 1,024 tokens serves a prompt that parts
    from the stored 2,000 at 1,900; the store shares 1,792 tokens by whole blocks and 1,900
    exactly: the request says ``shallow`` and where it parted (it said ``miss=-``)."""
    first = list(range(1, 2001))
    second = first[:1900] + list(range(7000, 7100))
    pc, _ = _cache(store)
    pc.insert_cache(KEY, first[:1024], _hybrid(first[:1024]),
                    cache_type=checkpoint_type("c0ffee0123456789", 2000, 1024))
    pc.insert_cache(KEY, first, _hybrid(first))
    assert pc.drain(30)
    pc.close()
    cold, seen = _cache(store)
    _, rest = cold.fetch_nearest_cache(KEY, second)
    rec = seen.opened[-1]
    assert len(second) - len(rest) == rec.reused_tokens == 1024
    assert rec.tier == "local"
    assert rec.miss == "shallow"
    assert rec.shared == 1900 and rec.parting is not None and rec.parting.position == 1900
    assert rec.parting.message is None  # no messages known: a text completion's
    cold.close()


def test_the_text_renders_place_a_token_as_the_token_renders_do(tmp_path: Path) -> None:
    """``locator`` bisects over the template's text (decoding the prompt's tokens to find
    the parting's character); it places every token as the bisection over tokenized
    renders does, for a real tokenizer and a template that renders tools."""
    from mlx_lm.server import process_message_content
    from mlx_lm.tokenizer_utils import load

    from kvstore.bench.agent_cases import AGENT_TEMPLATE, openai_chat_body, session
    from kvstore.mlx_lm.partings import locator
    from kvstore.serving.rules import names, rewrite
    from kvstore.tiny import make_tiny_model

    tok = load(make_tiny_model(tmp_path / "model", "llama"))
    tok._tokenizer.chat_template = AGENT_TEMPLATE
    body, _ = rewrite(openai_chat_body(session(turns=4, subagent_at=0)[-1]), names())
    msgs, tools = body["messages"], body["tools"]
    process_message_content(msgs)
    prompt = list(tok.apply_chat_template(msgs, tools=tools, tokenize=True,
                                          add_generation_prompt=True))

    def tokens(m: list[dict[str, Any]], with_tools: bool) -> list[int]:
        return list(tok.apply_chat_template(m, tools=tools if with_tools else None,
                                            tokenize=True, add_generation_prompt=False))

    by_tokens = MessageMap(msgs, tokens, has_tools=True)
    by_text = locator(tok, msgs, tools, {})
    places = set()
    for p in [0, 1, 17, *range(40, len(prompt), 97), len(prompt) - 2, len(prompt) - 1]:
        got = by_text(prompt, p)
        assert got == by_tokens.locate(prompt, p), p
        places.add(got[1:3])
    assert places == {("system", "text"), ("system", "tools"), ("user", "text"),
                      ("assistant", "text"),  # its header, before the calls start
                      ("assistant", "tool_use"), ("tool", "tool_result"),
                      ("assistant", "generation_prompt")}
