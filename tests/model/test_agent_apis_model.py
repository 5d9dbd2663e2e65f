"""The agent APIs of ``kvstore serve`` on the real model (SmolLM2), through the official
``anthropic`` and ``openai`` SDKs, streaming and not: replies parse, usage adds up to the
prompt, and a conversation's second turn reads its first from the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

SYSTEM = ("You are a concise assistant for a software project. The project stores the "
          "key/value cache of language models on disk so that a long prompt is computed "
          "once and restored later. Answer in one short sentence. ") * 4


@pytest.fixture(scope="module")
def port(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("agents")
    with server_process("kvstore.serve", ["--root", str(tmp / "root"), "--min-tokens", "32",
                                          "--model", str(smollm2_dir)], tmp / "serve.log",
                        client_timeout=300) as (p, _):
        yield p


def _sum(u: Any) -> int:
    return int(u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens)


def test_messages_on_smollm2_streaming_and_not(port: int) -> None:
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                            max_retries=0, timeout=300)
    turn = [{"role": "user", "content": "What does the project store?"}]
    n = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=turn).input_tokens
    first = c.messages.create(model="smollm2", max_tokens=16, system=SYSTEM, messages=turn)
    assert first.content and first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and _sum(first.usage) == n
    follow = [*turn, {"role": "assistant", "content": first.content[0].text},
              {"role": "user", "content": "And why?"}]
    m = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=follow).input_tokens
    with c.messages.stream(model="smollm2", max_tokens=16, system=SYSTEM,
                           messages=follow) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and text == final.content[0].text and _sum(final.usage) == m
    assert final.usage.cache_read_input_tokens >= n - 1  # the first turn's prompt, reused


def test_responses_on_smollm2_streaming_and_not(port: int) -> None:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                      max_retries=0, timeout=300)
    first = c.responses.create(model="smollm2", instructions=SYSTEM,
                               input="What does the project store?", max_output_tokens=16)
    assert first.output_text and first.usage.output_tokens <= 16
    with c.responses.stream(model="smollm2", instructions=SYSTEM, input="And why?",
                            previous_response_id=first.id, max_output_tokens=16) as s:
        events = list(s)
    done = events[-1]
    assert done.type in ("response.completed", "response.incomplete")
    resp = done.response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == resp.output[0].content[0].text
    assert resp.usage.input_tokens > first.usage.input_tokens
    assert resp.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
