"""Tiny random-weight mlx-lm models, built locally for tests and the demo.

`make_tiny_model` writes a complete mlx-lm model directory (config, safetensors
weights, a byte-level BPE tokenizer trained here on a small built-in text, and a
ChatML chat template) that ``mlx_lm.load`` opens offline. The weights come from
mlx-lm's own model classes, so the caches they make are the real cache classes:

- ``llama``: every layer a ``KVCache``;
- ``gemma3_text``: sliding-window layers with ``RotatingKVCache`` and a global
  ``KVCache`` layer;
- ``lfm2``: a hybrid of short-convolution layers (``ArraysCache``) and
  attention layers (``KVCache``);
- ``qwen3_5``: Qwen3.5's hybrid of Gated DeltaNet layers (``ArraysCache``: conv
  and recurrent state) and attention layers (``KVCache``);
- ``nemotron_h``: Mamba-2 layers (``ArraysCache``) and attention layers;
- ``falcon_h1``: every layer a ``CacheList`` of a Mamba-2 ``ArraysCache`` and a
  ``KVCache`` side by side.

Everything is deterministic in ``seed``: the same arguments give byte-identical
files.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["KINDS", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "make_tiny_model", "sample_text"]

KINDS = ("llama", "gemma3_text", "lfm2", "qwen3_5", "nemotron_h", "falcon_h1")

#: Special tokens of the tiny tokenizer; ``<|im_end|>`` is the end of a turn (EOS).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

#: A ChatML template, as many real checkpoints ship it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The cache keeps the keys and values of every token a model has already read, so
the next request that starts with the same words does not have to read them again.
A long system prompt is shared by many sessions: the first session pays for it and
every later one restores it from disk in a fraction of the time.
The river ran past the old mill, and the miller's daughter counted the sacks of
grain that the farmers brought in from the fields before the autumn rain.
In the morning the market square filled with carts of apples, pears and cabbages,
and the baker opened his shop while the bells of the church rang seven times.
A good engineer reads the code before changing it, writes a test that fails, makes
it pass, and leaves the module a little clearer than she found it.
Travellers on the northern road spoke of snow in the mountain passes, of wolves in
the forest, and of an inn where the soup was hot and the beds were dry.
The library was quiet except for the turning of pages and the scratch of a pen; a
student copied a table of numbers and checked each line twice.
When the wind changed, the sailors reefed the mainsail, lashed the barrels to the
deck, and steered the ship towards the lights of the harbour.
Questions and answers: what is the capital of France? Paris. How many days are in
a week? Seven. Which planet is closest to the sun? Mercury. What colour is the sky?
Blue, on a clear day, and grey when it rains.
The user asked the assistant to summarise the report, to list the three main risks,
and to suggest a plan for the next quarter with clear owners and dates.
Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 100 1000, plus + minus - times * equals
=, a path like data/models/tiny, a version like 1.2.3, and an email like a@b.c.
"""


def sample_text(n_words: int, *, seed: int = 0) -> str:
    """Return about `n_words` words of English drawn from the built-in text (deterministic)."""
    sentences = [s.strip() for s in _CORPUS.replace("\n", " ").split(". ") if s.strip()]
    rng = random.Random(seed)
    out: list[str] = []
    count = 0
    while count < n_words:
        s = rng.choice(sentences).rstrip(".") + "."
        out.append(s)
        count += len(s.split())
    return " ".join(out)


def _corpus_lines() -> Iterator[str]:
    yield from _CORPUS.splitlines()
    for seed in range(8):
        yield sample_text(200, seed=seed)


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the built-in text, save it as HF expects; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    special = {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": None,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        **{k: v for k, v in special.items() if v is not None},
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(
        path / "special_tokens_map.json", {k: v for k, v in special.items() if v is not None}
    )
    return int(tok.get_vocab_size())


def _config(
    kind: str, vocab_size: int, eos_id: int, hidden: int, layers: int, sliding_window: int
) -> dict[str, Any]:
    heads = max(2, hidden // 32)
    common: dict[str, Any] = {
        "model_type": kind,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "max_position_embeddings": 1 << 16,
        "eos_token_id": eos_id,
        "bos_token_id": 1,
    }
    if kind == "llama":
        return {
            **common,
            "intermediate_size": 2 * hidden,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    if kind == "gemma3_text":
        return {
            **common,
            "intermediate_size": 2 * hidden,
            "head_dim": hidden // heads,
            "query_pre_attn_scalar": hidden // heads,
            "rms_norm_eps": 1e-6,
            "sliding_window": sliding_window,
            # Layers 0, 2, … slide; every second layer is global.
            "sliding_window_pattern": 2,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        }
    if kind == "lfm2":
        types = ["conv" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return {
            **common,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": hidden,
            "block_ff_dim": 2 * hidden,
            "block_multiple_of": 32,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "rope_theta": 1_000_000.0,
            "layer_types": types,
            "tie_embedding": True,
        }
    if kind == "qwen3_5":
        # Every second layer is full attention (Qwen3.5 has one in four).
        text = {
            **common,
            "intermediate_size": 2 * hidden,
            "rms_norm_eps": 1e-6,
            "head_dim": hidden // heads,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {"type": "default", "rope_theta": 100000.0,
                                "partial_rotary_factor": 0.25},
        }
        return {"model_type": kind, "text_config": text, "eos_token_id": eos_id,
                "vocab_size": vocab_size}
    if kind == "nemotron_h":
        pattern = "".join("M" if i % 2 == 0 else "*" for i in range(layers))
        return {
            **common,
            "intermediate_size": 2 * hidden,
            "attention_bias": False,
            "head_dim": hidden // heads,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": list(pattern),
            "tie_word_embeddings": False,
        }
    if kind == "falcon_h1":
        return {
            **common,
            "intermediate_size": 2 * hidden,
            "head_dim": hidden // heads,
            "mamba_d_conv": 4,
            "mamba_d_head": 16,
            "mamba_d_ssm": 2 * hidden,
            "mamba_d_state": 16,
            "mamba_n_heads": 2 * hidden // 16,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 64,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")


def _init_parameters(model: Any, seed: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Draw every weight from N(0, 1/fan_in) with a key derived from `seed`; keep norms."""
    key = mx.random.key(seed)
    params = dict(tree_flatten(model.parameters()))
    out: dict[str, mx.array] = {}
    for name in sorted(params):
        p = params[name]
        key, sub = mx.random.split(key)
        if "norm" in name or name.endswith(".bias") or p.ndim < 2:
            value = p
        else:
            fan_in = 1
            for d in p.shape[1:]:
                fan_in *= d
            std = 1.0 if "embed" in name else fan_in**-0.5
            value = mx.random.normal(p.shape, key=sub) * std
        out[name] = value.astype(dtype)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_model(
    path: str | Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 768,
    sliding_window: int = 256,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random-weight mlx-lm model of `kind` to `path` and return the path.

    `kind` is one of `KINDS`. `dtype` is the weights' dtype name (``float32``,
    ``float16`` or ``bfloat16``); the KV cache follows it. The result loads with
    ``mlx_lm.load(str(path))`` without any network access.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = _write_tokenizer(out, vocab_size)
    eos_id = SPECIAL_TOKENS.index("<|im_end|>")
    config = _config(kind, n_vocab, eos_id, hidden_size, num_layers, sliding_window)
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = _init_parameters(model, seed, getattr(mx, dtype))
    # Round-trip through the model so the saved names are exactly what it loads.
    model.update(tree_unflatten(list(weights.items())))
    flat = dict(tree_flatten(model.parameters()))
    mx.eval(flat)
    mx.save_safetensors(str(out / "model.safetensors"), flat, metadata={"format": "mlx"})
    config["torch_dtype"] = dtype
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id, "bos_token_id": 1})
    return out
