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
