"""The GGUF converter's parts that need no download (the real model is tests/model/)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from kvstore.formats.errors import FileFormatError
from kvstore.mlx_lm.gguf import ModelFetchError, cached_model, convert_gguf, fetch_model, mlx_name


def test_tensor_names() -> None:
    assert mlx_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert mlx_name("blk.0.ffn_down.scales") == "model.layers.0.mlp.down_proj.scales"
    assert mlx_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert mlx_name("token_embd.biases") == "model.embed_tokens.biases"
    assert mlx_name("output_norm.weight") == "model.norm.weight"
    assert mlx_name("output.weight") == "lm_head.weight"
    assert mlx_name("blk.0.ffn_gate_exps.weight") is None


def _tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A 1-layer llama GGUF with float weights and a byte-level vocabulary of 4 tokens."""
    d, ff, v = 64, 128, 4
    w = {"token_embd.weight": mx.random.normal((v, d)), "output_norm.weight": mx.ones((d,))}
    for part, shape in (("attn_q", (d, d)), ("attn_k", (d // 2, d)), ("attn_v", (d // 2, d)),
                        ("attn_output", (d, d)), ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)),
                        ("ffn_down", (d, ff))):
        w[f"blk.0.{part}.weight"] = mx.random.normal(shape) * 0.02
    for part in ("attn_norm", "ffn_norm"):
        w[f"blk.0.{part}.weight"] = mx.ones((d,))
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch,
        "llama.embedding_length": u32(d), "llama.block_count": u32(1),
        "llama.feed_forward_length": u32(ff), "llama.attention.head_count": u32(2),
        "llama.attention.head_count_kv": u32(1),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<|end|>", "a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": mx.array([3, 1, 1, 1], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(0),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    mx.save_gguf(str(path), w, meta)
    return path


def test_convert_a_tiny_llama(tmp_path: Path) -> None:
    import mlx_lm

    out = convert_gguf(_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "model")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_traditional"] is True and cfg["tie_word_embeddings"] is True
    assert "quantization" not in cfg and cfg["eos_token_id"] == 0
    model, tok = mlx_lm.load(str(out))[:2]
    assert tok.encode("abab<|end|>") == [3, 3, 0]
    assert tok.decode([3, 1, 0]) == "aba<|end|>"
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 4)


def test_convert_stores_bfloat16_as_mlx_community_does(tmp_path: Path) -> None:
    """Issue 27, item 6: the weights, the activations and so the KV cache are bfloat16."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    out = convert_gguf(_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = mx.load(str(out / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"mlx.core.bfloat16"}
    model = mlx_lm.load(str(out))[0]
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert cache[0].keys.dtype == mx.bfloat16 and cache[0].values.dtype == mx.bfloat16


def test_quantized_weights_are_dequantized_exactly() -> None:
    """The GGUF's Q4/Q8 weights become the float32 values MLX's own dequantize gives (the
    file then rounds them to the model's dtype); scales and biases go, other tensors stay."""
    from kvstore.mlx_lm.gguf import _dequantized

    w4, w8 = mx.random.normal((64, 64)), mx.random.normal((32, 64))
    q4, s4, b4 = mx.quantize(w4, group_size=32, bits=4)
    q8, s8, b8 = mx.quantize(w8, group_size=32, bits=8)
    norm = mx.ones((64,))
    weights = {"a.weight": q4, "a.scales": s4.astype(mx.float16), "a.biases": b4.astype(mx.float16),
               "e.weight": q8, "e.scales": s8, "e.biases": b8, "n.weight": norm}
    out = _dequantized(weights)
    assert sorted(out) == ["a.weight", "e.weight", "n.weight"]
    want4 = mx.dequantize(q4, s4.astype(mx.float16).astype(mx.float32),
                          b4.astype(mx.float16).astype(mx.float32), group_size=32, bits=4)
    assert out["a.weight"].dtype == mx.float32 and mx.array_equal(out["a.weight"], want4).item()
    want8 = mx.dequantize(q8, s8, b8, group_size=32, bits=8)
    assert mx.array_equal(out["e.weight"], want8).item()
    assert out["n.weight"] is norm


def test_convert_refuses_other_architectures_and_files(tmp_path: Path) -> None:
    with pytest.raises(FileFormatError, match="architecture 'gemma'"):
        convert_gguf(_tiny_gguf(tmp_path / "g.gguf", arch="gemma"), tmp_path / "m")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(FileFormatError, match="junk.gguf"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_unknown_model_and_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path))
    assert cached_model("smollm2") is None
    with pytest.raises(ModelFetchError, match="unknown model 'gpt5'; known: smollm2"):
        fetch_model("gpt5")


def test_the_conversion_shows_a_bar_on_a_terminal_only(tmp_path: Path) -> None:
    """Issue 38, item 18: a bar of the tensors converted, on a terminal (a real pty here);
    a pipe or a file gets nothing."""
    import os

    from kvstore.mlx_lm.gguf import terminal

    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    master, slave = os.openpty()
    r, w = os.pipe()
    with os.fdopen(slave, "w") as tty, os.fdopen(w, "w") as pipe:
        assert terminal(tty) is tty and terminal(pipe) is None and terminal(None) is None
        convert_gguf(gguf, tmp_path / "shown", progress=terminal(tty))
        tty.flush()
        shown = os.read(master, 1 << 16).decode()
        convert_gguf(gguf, tmp_path / "quiet", progress=terminal(pipe))
    os.close(master)
    with os.fdopen(r) as rest:
        assert rest.read() == ""
    # 11 tensors: the embedding, the final norm and 9 of the one block
    assert "converting: 100%" in shown and "11/11" in shown, shown
    assert (tmp_path / "shown" / "model.safetensors").read_bytes() == (
        tmp_path / "quiet" / "model.safetensors").read_bytes()
