"""Agents share what they can (issue 34, item 7): two conversations with the same system
prompt, interleaved turn by turn through one ``kvstore serve`` whose LRU holds one entry and
whose disk budget holds about two conversations, reuse the system prompt from each other and
never lose their own working set to the other: every turn reuses its whole previous prompt.
A tiny random-weight llama, built locally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm
from helpers.kv import common_prefix
from helpers.serving import server_process

import kvstore
from kvstore.tiny import make_tiny_model, sample_text

SYSTEM = sample_text(900, seed=7)  # about 1,200 tokens: 600 KiB of this model's KV
TURNS = 4


def _turn(client: Any, tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    """One turn: (its prompt's tokens, the cached tokens the server reported)."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    r = client.chat.completions.create(model="default_model", messages=messages,
                                       max_tokens=8, temperature=0)
    messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    d = r.usage.prompt_tokens_details
    assert r.usage.prompt_tokens == len(prompt)
    return prompt, (d.cached_tokens or 0) if d else 0


def test_two_interleaved_agents_keep_their_own_prefix_and_share_the_system_prompt(
    tmp_path: Path
) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    _, tok = mlx_lm.load(str(model))
    system_end = len(tok.apply_chat_template([{"role": "system", "content": SYSTEM}]))
    root = tmp_path / "root"
    budget = 2 << 20
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": SYSTEM}]
                                         for _ in range(2)]
    got: list[list[tuple[list[int], int]]] = [[], []]
    with server_process("kvstore.serve", ["--root", str(root), "--model", str(model),
                                          "--min-tokens", "32", "--prompt-cache-size", "1",
                                          "--max-bytes", str(budget)],
                        tmp_path / "serve.log", client_timeout=300) as (_, client):
        for turn in range(TURNS):
            for a in (0, 1):
                convs[a].append({"role": "user",
                                 "content": sample_text(60, seed=1000 * a + turn)})
                got[a].append(_turn(client, tok, convs[a]))
    log = (tmp_path / "serve.log").read_text()
    assert got[0][0][1] == 0
    assert got[1][0][1] >= system_end - 8  # agent 1's first request: agent 0's system prompt
    for a in (0, 1):  # each turn: all it shares with its previous prompt (the reply after
        for turn in range(1, TURNS):  # it is rendered anew), or more
            shared = common_prefix(got[a][turn - 1][0], got[a][turn][0])
            assert got[a][turn][1] >= shared > len(got[a][turn - 1][0]) - 8, (
                a, turn, [[(len(p), c) for p, c in g] for g in got], log[-3000:])
    with kvstore.Store.open(root, create=False) as store:
        assert store.stats().physical_bytes <= budget
