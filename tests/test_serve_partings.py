"""Issue 34 items 5 and 6 through ``kvstore serve`` and the official ``openai`` client: the
rules' counts and the parting of a request in its log line and in ``/metrics``, to the
token, message, role and block; excerpts only with ``--log-excerpts``."""

from __future__ import annotations

import copy
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process
from prometheus_client.parser import text_string_to_metric_families

from kvstore.bench.agent_cases import AGENT_TEMPLATE, BILLING
from kvstore.tiny import make_tiny_model

pytest.importorskip("openai")


def _messages(result: str, cch: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": BILLING.format(cch) + "\nYou are a careful agent. " * 8},
        {"role": "user", "content": "Which files mention the cache?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "grep", "arguments": '{"path": ".", "pattern": "cache"}'}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": "The search found " + result + " in the module that keeps the blocks."},
    ]


# keys in sorted order already: only the billing rule fires
TOOLS = [{"function": {"description": "Search files.", "name": "grep",
                       "parameters": {"properties": {"pattern": {"type": "string"}},
                                      "type": "object"}},
          "type": "function"}]


def _lines(log: Path) -> list[dict[str, str]]:
    out = []
    for line in log.read_text().splitlines():
        if m := re.search(r"kvstore request (.*)$", line):
            out.append({k: v.strip('"') for k, v in
                        re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', m.group(1))})
    return out


def _tokens(model: Path, messages: list[dict[str, Any]], *, head: int | None = None,
            generation: bool = True) -> list[int]:
    """The prompt as mlx-lm renders it (its message processing, the same template)."""
    from mlx_lm.server import process_message_content
    from mlx_lm.tokenizer_utils import load

    tok = load(model)
    tok._tokenizer.chat_template = AGENT_TEMPLATE
    msgs = copy.deepcopy(messages)
    process_message_content(msgs)
    msgs[0]["content"] = msgs[0]["content"].split("\n", 1)[1]  # the rule's work
    msgs = msgs if head is None else msgs[:head]
    return list(tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True,
                                        add_generation_prompt=generation))


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.slow
@pytest.mark.parametrize("excerpts", [False, True])
def test_a_parting_is_placed_to_the_token_message_role_and_block(
        tmp_path: Path, excerpts: bool) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    log = tmp_path / "serve.log"
    first, second = _messages("three matches", "0a1b2"), _messages("no match", "93fe1")
    args = ["--root", str(tmp_path / "root"), "--model", str(model), "--min-tokens", "16",
            "--chat-template", AGENT_TEMPLATE, "--log-level", "INFO", "--metrics-on-api-port",
            *(["--log-excerpts"] if excerpts else [])]
    with server_process("kvstore.serve", args, log) as (port, client):
        for messages in (first, second):
            client.chat.completions.create(model="default_model", messages=messages,
                                           tools=TOOLS, max_tokens=1, temperature=0.0)
        # a request is counted once its reply is in the cache, a moment after the answer
        deadline = time.monotonic() + 30
        m = _metrics(port)
        while not any(n == "kvstore_partings_total" and v for (n, _), v in m.items()) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
            m = _metrics(port)
    a, b = _tokens(model, first), _tokens(model, second)
    part = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    tool_starts = len(_tokens(model, second, head=3, generation=False))
    one, two = _lines(log)
    assert one["rewrites"] == "claude-billing-header:1" and one["part"] == "-"
    assert two["rewrites"] == "claude-billing-header:1"
    assert int(two["prompt"]) == len(b) and int(two["reused"]) == part
    assert (two["shared"], two["part"], two["part_msg"], two["part_role"],
            two["part_block"], two["part_matched"]) == (
        str(part), str(part), "3", "tool", "tool_result", str(part - tool_starts))
    if excerpts:
        assert two["part_ours"].lstrip().startswith("no match in the module")
        assert two["part_theirs"].lstrip().startswith("three matches in the module")
        assert len(two["part_ours"]) <= 40 and len(two["part_theirs"]) <= 40
    else:
        assert "part_ours" not in two and "part_theirs" not in two
        assert "no match" not in log.read_text() and "three matches" not in log.read_text()
    assert m[("kvstore_partings_total", (("block", "tool_result"), ("role", "tool")))] == 1
    assert sum(v for (n, _), v in m.items() if n == "kvstore_partings_total") == 1
    assert m[("kvstore_rewrites_total", (("rule", "claude-billing-header"),))] == 2
    assert m[("kvstore_rewrites_total", (("rule", "sorted-tool-arguments"),))] == 0
    assert m[("kvstore_rewrites_total", (("rule", "sorted-tool-schemas"),))] == 0
