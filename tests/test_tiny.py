"""The tiny local models load with mlx-lm offline, generate deterministically, chat."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from kvstore.tiny import KINDS, make_tiny_model, sample_text

EXPECTED_CACHES = {
    "llama": {KVCache},
    "gemma3_text": {RotatingKVCache, KVCache},
    "lfm2": {ArraysCache, KVCache},
    "qwen3_5": {ArraysCache, KVCache},
    "nemotron_h": {ArraysCache, KVCache},
    "falcon_h1": {CacheList},
}

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(root / kind, kind) for kind in KINDS}


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("kind", KINDS)
def test_loads_with_expected_cache_classes(model_dirs: dict[str, Path], kind: str) -> None:
    model, tokenizer = mlx_lm.load(str(model_dirs[kind]))
    kinds = {type(c) for c in make_prompt_cache(model)}
    assert kinds == EXPECTED_CACHES[kind]
    assert 256 < tokenizer.vocab_size <= 1024
    args = getattr(model.args, "text_config", None) or vars(model.args)  # qwen3_5 nests it
    assert args["vocab_size"] == tokenizer.vocab_size


@pytest.mark.parametrize("kind", KINDS)
def test_generation_is_deterministic(model_dirs: dict[str, Path], kind: str) -> None:
    model, tokenizer = mlx_lm.load(str(model_dirs[kind]))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    first = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    second = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert first == second
    # A freshly loaded copy of the same directory generates the same text.
    model2, tokenizer2 = mlx_lm.load(str(model_dirs[kind]))
    assert mlx_lm.generate(model2, tokenizer2, prompt, max_tokens=16) == first
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    assert len(tokens) >= 1


def test_chat_template_applies(model_dirs: dict[str, Path]) -> None:
    _, tokenizer = mlx_lm.load(str(model_dirs["llama"]))
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


def test_tokenizer_round_trips_english(model_dirs: dict[str, Path]) -> None:
    _, tokenizer = mlx_lm.load(str(model_dirs["llama"]))
    text = sample_text(300, seed=7) + " Unicode too: café, naïve, 東京."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Trained merges: English compresses well below one token per character.
    assert len(ids) < len(text) / 2


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = _digests(make_tiny_model(tmp_path / "a", "llama", seed=3))
    b = _digests(make_tiny_model(tmp_path / "b", "llama", seed=3))
    c = _digests(make_tiny_model(tmp_path / "c", "llama", seed=4))
    assert a == b
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["tokenizer.json"] == a["tokenizer.json"]


def test_prefill_of_2k_tokens_is_fast(model_dirs: dict[str, Path]) -> None:
    model, tokenizer = mlx_lm.load(str(model_dirs["llama"]))
    ids = tokenizer.encode(sample_text(1200))[:1024]
    assert len(ids) == 1024
    logits = model(mx.array(ids)[None], cache=make_prompt_cache(model))
    mx.eval(logits)
    assert logits.shape == (1, 1024, tokenizer.vocab_size)


def test_unknown_kind_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        make_tiny_model(tmp_path / "x", "gpt9")
