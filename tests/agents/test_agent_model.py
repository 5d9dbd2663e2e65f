"""The scripted agent model answers the same tokens at every size: its shape changes what a
prefill costs (``tools/bench_agents.py`` uses a larger one), never what it says. In the
default suite: it needs mlx-lm, not the clients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_model import _END, _START, REPLY, TOOL_WORD, Shape, call_text, make_agent_model

from kvstore.tiny import sample_text

TOOL, ARGS = "Read", {"file_path": "/work/repo/README.md"}
TOOLS = [{"type": "function", "function": {
    "name": TOOL, "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}}}}]


def _answers(d: Path) -> tuple[dict[str, list[int]], dict[str, int], dict[str, object]]:
    """What the model at ``d`` generates, greedily, for the three prompts of a session with
    a tool round trip (a system prompt long enough for several prefill chunks), the ids of
    the scripted tokens, and its config."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(str(d))
    system = sample_text(600, seed=3)
    call = {"id": "c1", "type": "function",
            "function": {"name": TOOL, "arguments": json.dumps(ARGS)}}
    conversations = {
        "reply": [{"role": "system", "content": system},
                  {"role": "user", "content": "What is this project?"}],
        "tool": [{"role": "system", "content": system},
                 {"role": "user", "content": f"Read the README. {TOOL_WORD}"}],
        "result": [{"role": "system", "content": system},
                   {"role": "user", "content": f"Read the README. {TOOL_WORD}"},
                   {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "content": "# demo\n"}],
    }
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out: dict[str, list[int]] = {}
    for name, messages in conversations.items():
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        assert len(prompt) > 600, len(prompt)  # three chunks of 256
        got: list[int] = []
        for token, _ in generate_step(mx.array(prompt), model,
                                      max_tokens=8, prefill_step_size=256):
            got.append(int(token))
            if got[-1] == end:
                break
        out[name] = got
    ids = {t: tok.convert_tokens_to_ids(t) for t in (REPLY, _START, _END, "<|im_end|>")}
    ids["call"] = tok.convert_tokens_to_ids(call_text(TOOL, ARGS))
    config = json.loads((d / "config.json").read_text())
    return out, ids, config


def test_a_larger_shape_answers_the_same_scripted_tokens(tmp_path: Path) -> None:
    small = make_agent_model(tmp_path / "small", TOOL, ARGS)
    shape = Shape(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96)
    large = make_agent_model(tmp_path / "large", TOOL, ARGS, shape)
    a, ids, small_config = _answers(small)
    b, large_ids, config = _answers(large)

    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (3, 64, 4, 2, 96)
    assert (small_config["num_hidden_layers"], small_config["hidden_size"]) == (1, 32)
    assert large_ids == ids
    end = ids["<|im_end|>"]
    want = {"reply": [ids[REPLY], end],
            "tool": [ids[_START], ids["call"], ids[_END], end],
            "result": [ids[REPLY], end]}
    assert a == want
    assert b == want


def test_the_weights_of_a_larger_shape_are_that_shape(tmp_path: Path) -> None:
    import mlx.core as mx

    d = make_agent_model(tmp_path / "m", TOOL, ARGS, Shape.parse("2x64x2x1"))
    w = mx.load(str(d / "model.safetensors"))
    assert w["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # 1 KV head of 32
    assert w["model.layers.1.mlp.up_proj.weight"].shape == (128, 64)
    assert "model.layers.2.self_attn.q_proj.weight" not in w
    # the layers add nothing: the answers are the embedding's at every size
    assert not mx.any(w["model.layers.0.self_attn.o_proj.weight"]).item()
    assert not mx.any(w["model.layers.1.mlp.down_proj.weight"]).item()


def test_shape_parse() -> None:
    assert Shape.parse("2x64x2x1") == Shape(2, 64, 2, 1, 128)
    assert Shape.parse("3X96x4x2x200") == Shape(3, 96, 4, 2, 200)
    assert Shape() == Shape(1, 32, 2, 1, 64)  # the tests' model, as it was
    assert str(Shape()) == "1 layer, hidden 32, 2 heads of 16, 1 KV head, MLP 64"
    assert str(Shape(2, 64, 1, 1, 128)) == "2 layers, hidden 64, 1 head of 64, 1 KV head, MLP 128"
    for bad, says in [("2x64x2", "LAYERSxHIDDEN"), ("2x64xtwox1", "LAYERSxHIDDEN"),
                      ("0x64x2x1", "at least 1"), ("2x64x3x1", "multiple"),
                      ("2x64x4x3", "multiple"), ("1x4x2x1", "at least 5")]:
        with pytest.raises(ValueError, match=says):
            Shape.parse(bad)
