"""The converted SmolLM2-135M-Instruct: right answers, low perplexity, a faithful tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvstore.mlx_lm.gguf import fetch_model

SENTENCE = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, "
    "and Berlin is the capital of Germany."
)
# measured: 14.3 with rope_traditional true; 35.2 with it false (the GGUF's Q/K layout).
# Issue 27 converts to bfloat16 (the Q4_1 weights dequantized): 14.09 here, against
# 14.30 for the float32-scaled Q4_1 conversion it replaced and 14.12 for Q4_1 with
# bfloat16 scales. The bound allows 5% over the float32 conversion (bfloat16 rounds
# each weight to 8 bits of mantissa, far below Q4's own error) and still fails the rope
# mistake by a factor of two.
PPL_BOUND = 15.0

pytestmark = pytest.mark.model


def test_greedy_answer(smollm2: tuple[Any, Any]) -> None:
    import mlx_lm

    model, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    text = mlx_lm.generate(model, tok, prompt, max_tokens=10)
    assert "Paris" in text, text


def test_perplexity_of_a_fixed_sentence(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    ids = mx.array([tok.encode(SENTENCE)])
    logits = model(ids[:, :-1])
    ppl = mx.exp(nn.losses.cross_entropy(logits[0], ids[0, 1:]).mean()).item()
    assert 1.0 < ppl < PPL_BOUND, ppl


def test_tokenizer_round_trip_with_special_tokens(smollm2: tuple[Any, Any]) -> None:
    _, tok = smollm2
    text = "<|im_start|>user\nHi there, 12345 café ünïcode  spaces\t<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids and ids[-1] == 0  # each special token is one id
    assert [ids[i] for i in range(len(ids)) if ids[i] in (0, 1, 2)] == [1, 2, 0]
    assert tok.decode(ids) == text
    assert tok.encode("12345")[:5] == [tok.encode(d)[0] for d in "12345"]  # digits split


def test_chat_template_renders(smollm2: tuple[Any, Any]) -> None:
    _, tok = smollm2
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.eos_token == "<|im_end|>" and 2 in tok.eos_token_ids


def test_config_and_cache(smollm2_dir: Path) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["rope_traditional"] is True and cfg["num_hidden_layers"] == 30
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    # issue 27: bfloat16, as mlx-community ships it (the Q4_1 weights dequantized), so the
    # KV cache is bfloat16: 30 layers x 3 KV heads x 64 x (K, V) x 2 bytes = 23040 B a token
    assert "quantization" not in cfg and cfg["torch_dtype"] == "bfloat16"
    weights = mx.load(str(smollm2_dir / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"mlx.core.bfloat16"}
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    said: list[str] = []
    assert fetch_model("smollm2", log=said.append) == smollm2_dir
    assert said == []  # cached: nothing downloaded, nothing converted


def test_the_kv_cache_is_bfloat16(smollm2: tuple[Any, Any]) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = smollm2
    cache = make_prompt_cache(model)
    model(mx.array([tok.encode(SENTENCE)]), cache=cache)
    n = len(tok.encode(SENTENCE))
    assert all(c.keys.dtype == mx.bfloat16 for c in cache)
    per_token = sum(c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes for c in cache) // n
    assert per_token == 23040


def test_cli_fetch_prints_the_cached_directory(smollm2_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "model", "fetch", "smollm2"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(smollm2_dir) and "downloading" not in done.stderr
