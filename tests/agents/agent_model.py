"""A tiny model for the real coding agents: it answers ``Done.`` and ends its turn, or, when
the user's last message asks for it (:data:`TOOL_WORD`), calls one tool and then, given
the tool's result, answers ``Done.``: a whole tool round trip from a real client, fast.

It is a llama of ``kvstore.tiny`` whose weights are set, not drawn: every layer adds
nothing to the residual stream (its output projections are zero), so the logits of a
position depend on its token alone, and the head maps a few scripted tokens to their
successors and every other token to the end of the turn (``<|im_end|>``). The chat template
(which renders tools, tool calls, tool results and a system message anywhere) ends the
generation prompt with a trigger token that starts the script:

- ``<|kv_reply|>`` -> ``Done.`` -> end of turn;
- ``<|kv_tool|>`` -> ``<tool_call>`` -> the call (one added token whose text is the call's
  JSON) -> ``</tool_call>`` -> end of turn; mlx-lm's ``json_tools`` parser reads it.

The template renders an assistant turn of the history with the same trigger, so a reply
rendered back matches the tokens that were generated, as a real model's would.

Its size (:class:`Shape`: layers, hidden size, heads) changes what a prefill costs and
nothing of what it answers: the residual stream is the token's embedding at every size.
The tests use the smallest, one layer: a prefill chunk evaluates only the cache, whose keys
and values of a first layer come from the embeddings alone, so MLX computes no attention
and 30k tokens take a tenth of a second. ``tools/bench_agents.py`` uses a larger shape, whose
prefill costs what a small real model's does (each layer but the last computes its
attention, as a real model's prefill does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The words in the user's last message that make the model call its tool.
TOOL_WORD = "KVSTORE-TOOL"
REPLY = "Done."
_REPLY_TRIGGER, _TOOL_TRIGGER = "<|kv_reply|>", "<|kv_tool|>"
_START, _END = "<tool_call>", "</tool_call>"

TEMPLATE = (
    "{% macro tools_block() %}\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>{% endmacro %}"
    "{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "{% if tools %}{{ tools_block() }}{% endif %}<|im_end|>\n"
    "{% elif tools %}<|im_start|>system{{ tools_block() }}<|im_end|>\n{% endif %}"
    "{% set ns = namespace(last='') %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% set ns.last = 'tool' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.tool_calls %}" + _TOOL_TRIGGER + "{% else %}" + _REPLY_TRIGGER + "{% endif %}"
    "{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}" + _START + "{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}" + _END + "{% endfor %}<|im_end|>\n"
    "{% set ns.last = 'assistant' %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% if m.role == 'user' %}{% set ns.last = 'user:' ~ m.content %}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if ns.last.startswith('user:') and '" + TOOL_WORD + "' in ns.last %}" + _TOOL_TRIGGER
    + "{% else %}" + _REPLY_TRIGGER + "{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """The llama's size: what a prefill costs, never what the model answers."""

    layers: int = 1
    hidden: int = 32
    heads: int = 2
    kv_heads: int = 1
    intermediate: int = 64

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate) < 1:
            raise ValueError(f"every part of a shape is at least 1: {self!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"the hidden size must be a multiple of the heads, and the heads "
                             f"of the key-value heads: {self!r}")
        if self.hidden < 5:  # directions 0-4 carry the script
            raise ValueError(f"the hidden size must be at least 5: {self!r}")

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``LAYERSxHIDDENxHEADSxKV_HEADS[xINTERMEDIATE]`` (intermediate: twice the hidden
        size), e.g. ``2x64x2x1``."""
        try:
            parts = [int(p) for p in text.lower().split("x")]
        except ValueError:
            parts = []
        if len(parts) not in (4, 5):
            raise ValueError(f"a shape is LAYERSxHIDDENxHEADSxKV_HEADS[xINTERMEDIATE], "
                             f"got {text!r}")
        if len(parts) == 4:
            parts.append(2 * parts[1])
        return cls(*parts)

    def __str__(self) -> str:
        def n(count: int, what: str) -> str:
            return f"{count} {what}{'' if count == 1 else 's'}"

        return (f"{n(self.layers, 'layer')}, hidden {self.hidden}, {n(self.heads, 'head')} of "
                f"{self.hidden // self.heads}, {n(self.kv_heads, 'KV head')}, MLP "
                f"{self.intermediate}")


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """The text of a call as the model writes it between ``<tool_call>`` and its end."""
    return json.dumps({"name": name, "arguments": arguments})


def make_agent_model(path: Path, tool: str, arguments: dict[str, Any],
                     shape: Shape = Shape()) -> Path:
    """Write the model to ``path``: it calls ``tool`` with ``arguments`` when asked; its
    size is ``shape``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama
    from tokenizers import AddedToken, Tokenizer

    from kvstore.tiny import make_tiny_model

    d = make_tiny_model(path, "llama", hidden_size=32, num_layers=1)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    call = call_text(tool, arguments)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in (_REPLY_TRIGGER, _TOOL_TRIGGER, _START, _END)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in (REPLY, call)])
    tok.save(str(d / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (_REPLY_TRIGGER, _TOOL_TRIGGER, _START, _END,
                                           REPLY, call, "<|im_end|>")}
    vocab = tok.get_vocab_size()

    config = json.loads((d / "config.json").read_text())
    config.update(vocab_size=vocab, num_hidden_layers=shape.layers, hidden_size=shape.hidden,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  intermediate_size=shape.intermediate)
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(chat_template=TEMPLATE, tool_parser_type="json_tools")
    (d / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    model = llama.Model(llama.ModelArgs.from_dict(config))
    hidden = config["hidden_size"]
    # token -> direction: each scripted token its own, every other token direction 0
    slots = {ids[_REPLY_TRIGGER]: 1, ids[_TOOL_TRIGGER]: 2, ids[_START]: 3, ids[call]: 4}
    successor = {ids[_REPLY_TRIGGER]: ids[REPLY], ids[_TOOL_TRIGGER]: ids[_START],
                 ids[_START]: ids[call], ids[call]: ids[_END]}
    embed = mx.zeros((vocab, hidden)).at[:, 0].add(1.0)
    head = mx.zeros((vocab, hidden)).at[ids["<|im_end|>"], 0].add(4.0)
    for token, slot in slots.items():
        embed = embed.at[token, 0].add(-1.0).at[token, slot].add(1.0)
        head = head.at[successor[token], slot].add(4.0)
    params = dict(tree_flatten(model.parameters()))
    out = {}
    key = mx.random.key(0)
    for name, p in params.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value = mx.zeros(p.shape)  # the layers add nothing
        elif "norm" in name:
            value = mx.ones(p.shape)
        elif name == "model.embed_tokens.weight":
            value = embed
        elif name == "lm_head.weight":
            value = head
        else:
            key, sub = mx.random.split(key)
            value = mx.random.normal(p.shape, key=sub) * 0.1
        out[name] = value.astype(mx.float32)
    model.update(tree_unflatten(list(out.items())))
    flat = dict(tree_flatten(model.parameters()))
    mx.eval(flat)
    mx.save_safetensors(str(d / "model.safetensors"), flat, metadata={"format": "mlx"})
    return d
