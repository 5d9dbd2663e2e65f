"""The new server's OpenAI protocol layer (issue 43 items 1, 2, 5): a request body renders the
prompt tokens mlx_lm.server 0.32.2 (with the old server's hooks) rendered, and the engine's
events give the answer mlx_lm.server's ``handle_completion`` wrote, byte for byte but the
random ids: both are driven here side by side, mlx-lm's own code with the same tokens.
Tiny random-weight models, built locally; tests may import ``mlx_lm.server``, kvstore/
may not."""

from __future__ import annotations

import copy
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm import server as mls
from mlx_lm.generate import make_text_state_machine
from mlx_lm.tokenizer_utils import load as load_tokenizer

from kvstore.mlx_lm.cache_control import pin_type, take_breakpoints
from kvstore.server.engine import Done, Prefill, Token
from kvstore.server.openai import (
    Answer,
    Prepared,
    Served,
    model_limits,
    prepare_chat,
    prepare_text,
)
from kvstore.server.render import _partial, template_abilities
from kvstore.serving.chat import ApiError
from kvstore.serving.rules import names as rule_names
from kvstore.serving.templates import Abilities
from kvstore.tiny import make_tiny_model, sample_text

# a ChatML template that renders tools, tool calls and earlier reasoning (Qwen's layout):
# mlx-lm infers its json_tools parser from "<tool_call>" and "tool_call.name"
TOOLS_TEMPLATE = (
    "{#- tool_call.name -#}"
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}{% if message.role != 'system' or not loop.first %}"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>"
    "{% endif %}{{ message.content }}"
    "{% for tool_call in message.tool_calls or [] %}<tool_call>{\"name\": \""
    "{{ tool_call.function.name }}\", \"arguments\": "
    "{{ tool_call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("proto") / "model", "llama",
                           hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = make_tiny_model(tmp_path_factory.mktemp("proto-tools") / "model", "llama",
                        hidden_size=32, num_layers=1)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_tokenizer(d)
    assert t.has_tool_calling and t.tool_call_start == "<tool_call>"
    return t


def served(tokenizer: Any, **kw: Any) -> Served:
    defaults = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 512,
                "chat_template_args": {}}
    defaults.update(kw.pop("defaults", {}))
    return Served(model_id="tiny", aliases={"tiny"}, tokenizer=tokenizer,
                  vocab_size=kw.pop("vocab_size", 768),
                  context_length=kw.pop("context_length", 65536),
                  abilities=kw.pop("abilities", None)
                  or template_abilities(tokenizer, defaults["chat_template_args"]),
                  rules=kw.pop("rules", tuple(rule_names())), defaults=defaults,
                  fingerprint="fp", **kw)


# --- the prompt, as mlx-lm's server rendered it ---------------------------------------------


def mlx_tokenize(tokenizer: Any, body: dict[str, Any], cli_template_args: dict[str, Any]
                 ) -> tuple[list[int], dict[int, str], str]:
    """mlx_lm.server 0.32.2's own ``_tokenize`` of a chat body: the prompt, the cuts its
    segments make (end position -> type, the last segment's left out) and the initial
    state."""
    gen = SimpleNamespace(model_provider=SimpleNamespace(
        processor=None, cli_args=SimpleNamespace(chat_template_args=cli_template_args)))
    req = mls.CompletionRequest("chat", "", copy.deepcopy(body["messages"]),
                                body.get("tools") or None, body.get("role_mapping"))
    args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    prompt, segments, types, initial, _ = mls.ResponseGenerator._tokenize(gen, tokenizer, req,
                                                                         args)
    cuts, pos = {}, 0
    for seg, kind in list(zip(segments, types, strict=True))[:-1]:
        pos += len(seg)
        cuts[pos] = kind
    return list(prompt), cuts, initial


BODIES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"messages": [{"role": "user", "content": "Hello there."}]}),
    ("system", {"messages": [{"role": "system", "content": sample_text(40, seed=1)},
                             {"role": "user", "content": "What is the river?"}]}),
    ("parts", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are "},
                                       {"type": "text", "text": "terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again."}]}),
    ("last-assistant", {"messages": [{"role": "user", "content": "Go."},
                                     {"role": "assistant", "content": "Done"}]}),
    ("kwargs", {"messages": [{"role": "user", "content": "Hi"}],
                "chat_template_kwargs": {"enable_thinking": False, "x": 1}}),
]

TOOL_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("tools", {"messages": [{"role": "system", "content": "Use tools."},
                            {"role": "user", "content": "Weather in Paris?"}],
               "tools": [WEATHER]}),
    ("tool-calls", {"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
        {"role": "user", "content": "And Rome?"}], "tools": [WEATHER]}),
]


@pytest.mark.parametrize(("name", "body"), BODIES, ids=[n for n, _ in BODIES])
def test_a_chat_body_renders_the_tokens_mlx_lm_rendered(tok: Any, name: str,
                                                        body: dict[str, Any]) -> None:
    cli_args = {"x": 0, "y": 2} if name == "kwargs" else {}
    s = served(tok, rules=(), defaults={"chat_template_args": cli_args})
    p = prepare_chat(body, s)
    prompt, cuts, initial = mlx_tokenize(tok, body, cli_args)
    assert p.job.prompt == prompt and len(prompt) > 5
    assert p.cuts == cuts
    assert p.initial_state == initial
    if name == "system":
        assert list(cuts.values()) == ["system"]  # the system prompt's own snapshot


@pytest.mark.parametrize(("name", "body"), TOOL_BODIES, ids=[n for n, _ in TOOL_BODIES])
def test_tools_render_the_tokens_mlx_lm_rendered(tool_tok: Any, name: str,
                                                 body: dict[str, Any]) -> None:
    s = served(tool_tok, rules=())
    assert s.abilities == Abilities(tools=True, mid_system=True)
    p = prepare_chat(body, s)
    prompt, cuts, _ = mlx_tokenize(tool_tok, body, {})
    assert p.job.prompt == prompt and p.cuts == cuts
    text = tool_tok.decode(prompt)
    assert "get_weather" in text
    if name == "tool-calls":
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
        assert "<think>Look it up.</think>" in text


def test_role_mapping_without_a_chat_template(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "bare"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    bare = load_tokenizer(d)
    assert not bare.has_chat_template
    body = {"messages": [{"role": "user", "content": "Hi"}],
            "role_mapping": {"user": "Q: ", "assistant": "A: ", "stop": "\n"}}
    p = prepare_chat(body, served(bare))
    assert p.job.prompt == bare.encode("Q: Hi\nA:")
    assert p.job.prompt == mlx_tokenize(bare, body, {})[0]


def test_text_completions_encode_the_prompt_as_mlx_lm(tok: Any) -> None:
    p = prepare_text({"prompt": "Once upon a time", "max_tokens": 3}, served(tok))
    assert p.kind == "text" and p.job.prompt == tok.encode("Once upon a time")
    assert p.job.max_tokens == 3 and p.cuts == {}
    ids = prepare_text({"prompt": [5, 6, 7]}, served(tok)).job.prompt
    assert ids == [5, 6, 7]
    with pytest.raises(ApiError, match="prompt must be a string"):
        prepare_text({"prompt": [5, 768]}, served(tok))
    with pytest.raises(ApiError, match="Request did not contain a prompt"):
        prepare_text({}, served(tok))
    if not tok.encode(""):  # no BOS: an empty prompt gives the engine nothing to start from
        with pytest.raises(ApiError, match="the prompt is empty: it renders no tokens"):
            prepare_text({"prompt": ""}, served(tok))
    else:
        assert prepare_text({"prompt": ""}, served(tok)).job.prompt == tok.encode("")


# --- breakpoints and rules ------------------------------------------------------------------

BILLING = "x-anthropic-billing-header: cc_version=2.1.37.a3f; cc_entrypoint=cli; cch=9f2c1;\n"


def _agent_body(marked: bool) -> dict[str, Any]:
    mark = {"cache_control": {"type": "ephemeral", "ttl": "1h"}} if marked else {}
    tool = {"type": "function", "function": {
        "parameters": {"properties": {"path": {"type": "string"}}, "type": "object"},
        "name": "read", "description": "Read a file."}, **mark}
    return {"messages": [
        {"role": "system", "content": [
            {"type": "text", "text": BILLING + "You are a coding agent.", **mark}]},
        {"role": "user", "content": [{"type": "text", "text": sample_text(30, seed=3)},
                                     {"type": "text", "text": "Fix the bug.", **mark}]}],
        "tools": [tool]}


def old_positions(tokenizer: Any, messages: list[Any], tools: list[Any], prompt: list[int],
                  marks: list[Any]) -> dict[int, tuple[float, str]]:
    """The old server's placement of each mark (kvstore.mlx_lm.cache_control.positions
    before the new server): the messages up to the mark, through mlx_lm.server's own
    process_message_content and the template without a generation prompt, then the common
    prefix with the prompt."""
    out: dict[int, tuple[float, str]] = {}
    for bp in marks:
        msgs, tl, priority = _partial(messages, tools, bp)
        msgs = copy.deepcopy(msgs)
        mls.process_message_content(msgs)
        rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tools=tl,
                                                 tokenize=True)
        n = next((i for i, (a, b) in enumerate(zip(rendered, prompt, strict=False)) if a != b),
                 min(len(rendered), len(prompt)))
        if 0 < n < len(prompt):
            out[n] = (max(bp.ttl, out.get(n, (0.0, ""))[0]), priority)
    return out


def test_marks_render_the_same_tokens_and_the_rules_fire_with_or_without_them(
        tool_tok: Any) -> None:
    s = served(tool_tok)
    with_marks, without = prepare_chat(_agent_body(True), s), prepare_chat(_agent_body(False), s)
    assert with_marks.job.prompt == without.job.prompt
    fired = {"claude-billing-header": 1, "sorted-tool-schemas": 1}
    assert with_marks.rewrites == without.rewrites == fired
    assert with_marks.job.context is not None and with_marks.job.context.rewrites == fired
    assert "x-anthropic-billing-header" not in tool_tok.decode(with_marks.job.prompt)
    assert without.job.breakpoints == {}
    # each mark where the old server put it (kvstore.mlx_lm.cache_control.positions on
    # the rewritten messages, rendered as mlx-lm renders)
    body = _agent_body(True)
    marks = take_breakpoints(body)
    from kvstore.serving.rules import rewrite

    body, _ = rewrite(body, rule_names())
    old = old_positions(tool_tok, body["messages"], body["tools"], with_marks.job.prompt,
                        marks)
    # the system text's mark and the tool's meet (this template renders the tools in the
    # system message), then the user's end
    assert len(old) == 2 and sorted(p for _, p in old.values()) == ["system", "user"]
    assert with_marks.job.breakpoints == {n: ttl for n, (ttl, _) in old.items()}
    assert set(with_marks.job.breakpoints.values()) == {3600.0}
    for n, (ttl, priority) in old.items():
        assert with_marks.cuts[n] == pin_type(ttl, priority)


def test_a_bad_mark_is_the_old_400(tok: Any) -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "persistent"}}]}]}
    with pytest.raises(ApiError) as e:
        prepare_chat(body, served(tok))
    assert (e.value.status, e.value.message) == (400, (
        "messages[0].content[0]: cache_control must be {\"type\": \"ephemeral\"} "
        "(optionally with \"ttl\": \"5m\" or \"1h\")"))


def test_tools_for_a_template_that_renders_none(tok: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    with pytest.raises(ApiError) as e:
        prepare_chat(body, served(tok))
    assert e.value.status == 400
    assert e.value.message.startswith("the chat template of tiny renders no tools")
    dropped = prepare_chat(body, served(tok, drop_tools=True))
    assert dropped.tools is None
    assert dropped.job.prompt == prepare_chat({"messages": body["messages"]},
                                              served(tok)).job.prompt


def test_a_late_system_message_goes_into_a_user_message_where_the_template_refuses(
        tok: Any) -> None:
    s = served(tok, abilities=Abilities(tools=False, mid_system=False))
    body = {"messages": [{"role": "user", "content": "Go."},
                         {"role": "system", "content": "Today is Sunday."}]}
    p = prepare_chat(body, s)
    assert p.rewrites == {"system-into-user": 1}
    assert tok.decode(p.job.prompt).startswith("<|im_start|>user\nGo.\n\nToday is Sunday.")


def test_the_salt_and_the_request_context(tok: Any) -> None:
    p = prepare_chat({"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "a"},
                     served(tok, excerpts=True))
    assert p.job.salt == "a"
    ctx = p.job.context
    assert ctx is not None and ctx.locate is not None and ctx.decode is not None
    assert ctx.decode(p.job.prompt) == tok.decode(p.job.prompt)
    assert ctx.locate(p.job.prompt, 2)[:2] == (0, "user")
    assert ctx.locate(p.job.prompt, len(p.job.prompt) - 1)[1] == "assistant"
    for bad in ("", 7, ["a"], "x" * 4097):
        with pytest.raises(ApiError) as e:
            prepare_chat({"messages": [{"role": "user", "content": "Hi"}], "cache_salt": bad},
                         served(tok))
        assert e.value.message == "cache_salt must be a non-empty string of at most 4096 bytes"


# --- the guards of issue 43 item 5 ------------------------------------------------------------

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("extra", "message"), [
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias: token id 99999999 is not in the "
                                      "vocabulary (0 to 767)"),
    ({"logit_bias": {"768": 1}}, "logit_bias: token id 768 is not in the vocabulary "
                                 "(0 to 767)"),
    ({"logit_bias": {"-1": 1}}, "logit_bias: token id -1 is not in the vocabulary (0 to 767)"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias: the bias of token 5 must be a finite "
                                          "number"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias: the bias of token 5 must be a finite "
                                          "number"),
    ({"logit_bias": {"x": 1}}, "logit_bias must be a dict of int to float"),
    ({"logit_bias": [1]}, "logit_bias must be of type dict"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": -0.5}, "temperature must be at least 0"),
    ({"temperature": "hot"}, "temperature must be of type ('float', 'int')"),
    ({"top_p": 1.5}, "top_p must be at most 1"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"top_k": -1}, "top_k must be at least 0"),
    ({"top_k": 2.5}, "top_k must be of type int"),
    ({"min_p": float("inf")}, "min_p must be a finite number"),
    ({"min_p": -0.1}, "min_p must be at least 0"),
    ({"repetition_penalty": -1}, "repetition_penalty must be at least 0"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
    ({"presence_penalty": 3}, "presence_penalty must be at most 2"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty must be a finite number"),
    ({"repetition_context_size": -1}, "repetition_context_size must be at least 0"),
    ({"xtc_probability": 2}, "xtc_probability must be at most 1"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": "10"}, "max_tokens must be of type int"),
    ({"max_tokens": True}, "max_tokens must be of type int"),
    ({"n": 2}, "n must be 1: kvstore serve answers with one choice"),
    ({"stream": "yes"}, "stream must be of type bool"),
    ({"top_logprobs": 21}, "top_logprobs must be at most 20"),
    ({"logprobs": 1}, "logprobs must be of type bool"),
    ({"seed": 1.5}, "seed must be of type int"),
    ({"adapters": "/tmp/lora"}, "adapters are not supported: kvstore serve serves its one "
                                "model"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set 'tools'"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs must be an object"),
    ({"model": 5}, "requested_model must be of type str"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, "messages[0] must be an object with a string role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://127.0.0.1:1/x.png"}}]}]}, "Only 'text' content type is supported."),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "Expecting property name"),
])
def test_a_bad_parameter_is_a_400_before_anything_runs(tok: Any, extra: dict[str, Any],
                                                       message: str) -> None:
    body = {"messages": CHAT, **extra}
    with pytest.raises(ApiError) as e:
        prepare_chat(body, served(tok))
    assert (e.value.status, e.value.kind) == (400, "invalid_request_error")
    assert e.value.message.startswith(message), e.value.message
    if "messages" not in extra:  # the same check on /v1/completions
        with pytest.raises(ApiError) as e2:
            prepare_text({"prompt": "Hi", **extra}, served(tok))
        assert e2.value.message == e.value.message


def test_parameters_reach_the_job(tok: Any) -> None:
    p = prepare_chat({"messages": CHAT, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                      "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": -1,
                      "frequency_penalty": 0.5, "frequency_context_size": 64,
                      "logit_bias": {"5": -100, "7": 2.5}, "seed": 3, "logprobs": True,
                      "top_logprobs": 4, "stop": "END", "stream": True,
                      "stream_options": {"include_usage": True}, "model": "gpt-4o",
                      "max_completion_tokens": 9, "max_tokens": 100, "top_logprobs_x": 1},
                     served(tok))
    s = p.job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.7, 0.9, 40, 0.05)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, -1.0, 0.5)
    assert (s.frequency_context_size, s.seed, s.xtc_threshold) == (64, 3, 0.1)
    assert s.logit_bias == ((5, -100.0), (7, 2.5))
    assert (p.job.logprobs, p.job.top_logprobs, p.job.max_tokens) == (True, 4, 9)
    assert (p.stops, p.stream, p.include_usage, p.model) == (["END"], True, True, "gpt-4o")
    # the server's defaults where the request says nothing; top_k past the vocabulary: off
    d = prepare_chat({"messages": CHAT, "top_k": 5000, "top_logprobs": -1},
                     served(tok, defaults={"temp": 0.3, "top_p": 0.8, "min_p": 0.1,
                                           "max_tokens": 64}))
    assert (d.job.sampling.temperature, d.job.sampling.top_p, d.job.sampling.min_p,
            d.job.sampling.top_k, d.job.max_tokens, d.job.top_logprobs) == (
        0.3, 0.8, 0.1, 0, 64, 0)
    assert (d.model, d.stream, d.include_usage, d.stops) == ("default_model", False, False, [])


def test_max_tokens_is_capped_at_the_ceiling_with_a_log_line(
        tok: Any, caplog: pytest.LogCaptureFixture) -> None:
    s = served(tok, defaults={"max_tokens": 16})
    with caplog.at_level(logging.WARNING, logger="kvstore.serve"):
        p = prepare_chat({"messages": CHAT, "max_tokens": 10 ** 9}, s)
    assert (p.job.max_tokens, p.asked_tokens) == (16, 10 ** 9)
    assert "kvstore: a request asked for up to 1000000000 tokens: it gets at most 16 " \
           "(--max-tokens)" in caplog.text
    assert prepare_chat({"messages": CHAT, "max_tokens": 5}, s).job.max_tokens == 5
    assert prepare_chat({"messages": CHAT}, s).job.max_tokens == 16


def test_4096_tools_are_a_400_before_any_prefill(tool_tok: Any) -> None:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "A tool of the test. " * 4,
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
        for i in range(4096)]
    with pytest.raises(ApiError) as e:
        prepare_chat({"messages": CHAT, "tools": tools}, served(tool_tok))
    assert e.value.status == 400
    assert e.value.message.startswith("the prompt is ")
    assert e.value.message.endswith(" tokens, more than the model's context of 65536 tokens")
    assert int(e.value.message.split()[3]) > 65536
    # and --max-prompt-tokens, below the context
    with pytest.raises(ApiError) as e:
        prepare_chat({"messages": CHAT, "tools": tools[:8]},
                     served(tool_tok, defaults={"max_prompt_tokens": 100}))
    assert e.value.message.endswith("more than the server takes (--max-prompt-tokens 100)")
    with pytest.raises(ApiError, match="more than the server takes"):
        prepare_text({"prompt": sample_text(200)}, served(tok_of(tool_tok),
                                                          defaults={"max_prompt_tokens": 50}))


def tok_of(t: Any) -> Any:
    return t


def test_limits_from_a_config() -> None:
    assert model_limits({"vocab_size": 49152, "max_position_embeddings": 8192}) == (49152, 8192)
    assert model_limits({"text_config": {"vocab_size": 10, "n_positions": 7}}) == (10, 7)
    assert model_limits({}) == (None, None)


# --- the answer, as mlx-lm's handle_completion wrote it -------------------------------------


class _Gen:
    """mlx-lm's ResponseGenerator for one request: its context, then the responses."""

    def __init__(self, ctx: Any, responses: list[Any]) -> None:
        self.ctx, self.responses = ctx, responses

    def generate(self, request: Any, args: Any, progress_callback: Any = None) -> Any:
        return self.ctx, iter(self.responses)


def mlx_answer(tokenizer: Any, prepared: Prepared, steps: list[tuple[int, str]],
               finish: str, cached: int, *, logprobs: list[float] | None = None,
               top: list[list[tuple[int, float]]] | None = None) -> list[Any]:
    """What mlx_lm.server 0.32.2's ``handle_completion`` writes for ``steps`` (token, text),
    the last one ending with ``finish``: the JSON objects it sends (a streamed answer's
    ``data:`` lines, ``[DONE]`` as a string)."""
    kind = prepared.kind
    h = object.__new__(mls.APIHandler)
    h.__dict__.update(
        stream=prepared.stream, created=1700000000, system_fingerprint="fp",
        stream_options={"include_usage": prepared.include_usage} if prepared.stream else None,
        requested_model=prepared.model, requested_draft_model="default_model", adapter=None,
        request_id="rid", object_type=("chat.completion.chunk" if prepared.stream
                                       else "chat.completion") if kind == "chat"
        else "text_completion",
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0,
        xtc_threshold=0.1, logit_bias=None, repetition_penalty=0.0, repetition_context_size=20,
        presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0,
        frequency_context_size=20, max_tokens=prepared.job.max_tokens, num_draft_tokens=3,
        logprobs=prepared.job.logprobs,
        top_logprobs=prepared.job.top_logprobs or -1, seed=None, chat_template_kwargs=None,
        wfile=io.BytesIO())
    h._set_stream_headers = lambda status=200: None
    h._set_completion_headers = lambda status=200: None
    h.send_header = lambda *a: None
    h.end_headers = lambda: None
    ctx = mls.GenerationContext(
        has_tool_calling=tokenizer.has_tool_calling, has_thinking=tokenizer.has_thinking,
        tool_parser=tokenizer.tool_parser, text_sm=make_text_state_machine(tokenizer, []),
        initial_state=prepared.initial_state, prompt=prepared.job.prompt,
        prompt_cache_count=cached)
    responses = []
    for i, (token, text) in enumerate(steps):
        last = i == len(steps) - 1
        names = tokenizer.convert_ids_to_tokens([t for t, _ in top[i]]) if top else []
        responses.append(mls.Response(
            text, token, logprobs[i] if logprobs else 0.0, finish if last else None,
            tuple({"id": t, "token": s, "logprob": g}
                  for (t, g), s in zip(top[i], names, strict=True)) if top else ()))
    h.response_generator = _Gen(ctx, responses)
    request = mls.CompletionRequest(kind, "", prepared.messages, prepared.tools, None)
    h.handle_completion(request, [])
    raw = h.wfile.getvalue().decode()
    if not prepared.stream:
        return [json.loads(raw)]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in raw.split("\n\n") if line]


def ours(tokenizer: Any, prepared: Prepared, steps: list[tuple[int, str]], finish: str,
         cached: int, *, logprobs: list[float] | None = None,
         top: list[list[tuple[int, float]]] | None = None) -> list[Any]:
    """The same from :class:`Answer` fed the engine's events (an EOS token has no text)."""
    a = Answer(prepared, served(tokenizer), "rid", 1700000000)
    out: list[Any] = []
    assert a.feed(Prefill(4, len(prepared.job.prompt))) == []
    for i, (token, text) in enumerate(steps):
        out += a.feed(Token(token, text, logprobs[i] if logprobs else -0.5,
                            top[i] if top else None))
        assert not a.stop_hit
    out += a.feed(Done(finish, len(prepared.job.prompt), cached, len(steps)))
    if not prepared.stream:
        return [a.response()]
    return [*out, "[DONE]"]


def _ids(objs: list[Any]) -> list[Any]:
    """Tool call ids are random uuids in both: the same placeholder."""
    text = json.dumps(objs)
    for o in objs:
        for c in (o.get("choices") or []) if isinstance(o, dict) else []:
            for call in (c.get("message") or c.get("delta") or {}).get("tool_calls") or []:
                text = text.replace(call["id"], "ID")
    return json.loads(text)


def _both(tokenizer: Any, prepared: Prepared, steps: list[tuple[int, str]], finish: str,
          cached: int = 3, **kw: Any) -> list[Any]:
    mine = _ids(ours(tokenizer, prepared, steps, finish, cached, **kw))
    assert mine == _ids(mlx_answer(tokenizer, prepared, steps, finish, cached, **kw))
    return mine


TOOL_STEPS = [(10, "Let me"), (11, " check."), (12, "<tool_call>"), (13, '{"name": "get_'),
              (14, 'weather", "arguments": {"city": "Paris"}}'), (15, "</tool_call>"),
              (4, "")]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_into_tool_calls_as_mlx_lm_does(tool_tok: Any, stream: bool
                                                              ) -> None:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
            "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "model": "gpt-4o"}
    p = prepare_chat(body, served(tool_tok))
    got = _both(tool_tok, p, TOOL_STEPS, "stop")
    if not stream:
        (r,) = got
        assert set(r) == {"id", "system_fingerprint", "object", "model", "created", "choices",
                          "usage"}
        assert (r["id"], r["object"], r["model"], r["created"]) == (
            "rid", "chat.completion", "gpt-4o", 1700000000)
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls"
        assert c["message"]["content"] == "Let me check."
        assert c["message"]["tool_calls"] == [{"function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}, "type": "function",
            "id": "ID"}]
        assert r["usage"] == {"prompt_tokens": len(p.job.prompt), "completion_tokens": 7,
                              "total_tokens": len(p.job.prompt) + 7,
                              "prompt_tokens_details": {"cached_tokens": 3}}
    else:
        assert got[-1] == "[DONE]"
        assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 7
        assert got[-3]["choices"][0]["finish_reason"] == "tool_calls"
        calls = [d["delta"].get("tool_calls") for g in got[:-2]
                 for d in g["choices"] if d["delta"].get("tool_calls")]
        assert calls == [[{"function": {"name": "get_weather",
                                        "arguments": "{\"city\": \"Paris\"}"},
                           "type": "function", "id": "ID", "index": 0}]]


@pytest.fixture
def think_tok(tool_tok: Any) -> Any:
    """The tool template's tokenizer that reasons between <think> tags (text-level: the
    state machine works on text)."""
    t = copy.copy(tool_tok)
    object.__setattr__(t, "_think_start", "<think>")
    object.__setattr__(t, "_think_end", "</think>")
    object.__setattr__(t, "_think_start_tokens", (999_001,))
    object.__setattr__(t, "_think_end_tokens", (999_002,))
    assert t.has_thinking
    return t


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_out_as_mlx_lm_does(think_tok: Any, stream: bool) -> None:
    p = prepare_chat({"messages": CHAT, "stream": stream}, served(think_tok))
    steps = [(10, "<think>"), (11, "The user"), (12, " greets."), (13, "</think>"),
             (14, "Hello"), (15, "!"), (4, "")]
    got = _both(think_tok, p, steps, "stop")
    if not stream:
        m = got[0]["choices"][0]["message"]
        assert (m["reasoning"], m["content"]) == ("The user greets.", "Hello!")
        assert got[0]["choices"][0]["finish_reason"] == "stop"
    else:
        assert "".join(g["choices"][0]["delta"].get("reasoning", "") for g in got[:-1]) \
            == "The user greets."
        assert "usage" not in json.dumps(got)  # include_usage not asked


@pytest.mark.parametrize("stream", [False, True])
def test_length_text_completion_and_logprobs_as_mlx_lm(tok: Any, stream: bool) -> None:
    steps = [(40, "Once"), (41, " upon"), (42, " a")]
    lps = [-0.1, -0.2, -0.3]
    p = prepare_text({"prompt": "Tell me", "max_tokens": 3, "stream": stream,
                      "logprobs": True}, served(tok))
    got = _both(tok, p, steps, "length", logprobs=lps)
    if not stream:
        c = got[0]["choices"][0]
        assert (got[0]["object"], c["text"], c["finish_reason"]) == (
            "text_completion", "Once upon a", "length")
        assert c["logprobs"] == {"content": [{"id": 40, "logprob": -0.1},
                                             {"id": 41, "logprob": -0.2},
                                             {"id": 42, "logprob": -0.3}]}
    chat = prepare_chat({"messages": CHAT, "max_tokens": 3, "stream": stream,
                         "stream_options": {"include_usage": stream}}, served(tok))
    _both(tok, chat, steps, "length", cached=0)


def test_top_logprobs_name_the_chosen_token(tok: Any) -> None:
    """mlx-lm's entry is the first of its top list (unordered argpartition); ours is the
    token chosen, with the same shape."""
    p = prepare_chat({"messages": CHAT, "top_logprobs": 2}, served(tok))
    a = Answer(p, served(tok), "rid", 1)
    a.feed(Token(40, "Once", -0.1, [(40, -0.1), (7, -2.5)]))
    a.feed(Token(4, "", -0.2, [(9, -0.05), (4, -0.2)]))
    a.feed(Done("stop", len(p.job.prompt), 0, 2))
    (first, second) = a.response()["choices"][0]["logprobs"]["content"]
    names = tok.convert_ids_to_tokens([40, 7, 9, 4])
    assert first == {"id": 40, "token": names[0], "logprob": -0.1, "top_logprobs": [
        {"id": 40, "token": names[0], "logprob": -0.1},
        {"id": 7, "token": names[1], "logprob": -2.5}]}
    assert second["id"] == 4 and second["logprob"] == -0.2
    assert [t["id"] for t in second["top_logprobs"]] == [9, 4]


# --- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_before_it(tok: Any, stream: bool) -> None:
    p = prepare_chat({"messages": CHAT, "stop": ["never", "END"], "stream": stream,
                      "stream_options": {"include_usage": True}}, served(tok))
    a = Answer(p, served(tok), "rid", 1)
    chunks: list[Any] = []
    for i, text in enumerate(["Hello", " wor", "ld E", "N"]):
        chunks += a.feed(Token(10 + i, text, -0.1))
        assert not a.stop_hit
    chunks += a.feed(Token(20, "D and more", -0.1))
    assert a.stop_hit and a.stop_word == "END"
    assert a.feed(Token(21, " ignored", -0.1)) == []  # before the cancel took effect
    chunks += a.feed(Done("stop", len(p.job.prompt), 0, 6))  # cancel("stop")'s Done
    if stream:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]
                       if c["choices"])
        assert text == "Hello world "
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] == 5
    else:
        r = a.response()
        assert r["choices"][0]["message"]["content"] == "Hello world "
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == 5


def test_a_stop_string_in_one_token_and_a_stop_on_text_completions(tok: Any) -> None:
    p = prepare_text({"prompt": "x", "stop": "\n\n"}, served(tok))
    a = Answer(p, served(tok), "rid", 1)
    a.feed(Token(5, "line one\n\nline two", -0.1))
    assert a.stop_hit and a.stop_word == "\n\n"
    a.feed(Done("stop", 1, 0, 1))
    assert a.response()["choices"][0]["text"] == "line one"


def test_no_answer_when_the_job_failed_or_was_cancelled(tok: Any) -> None:
    p = prepare_chat({"messages": CHAT}, served(tok))
    a = Answer(p, served(tok), "rid", 1)
    a.feed(Token(5, "x", -0.1))
    assert a.feed(Done("error", 3, 0, 1, error="RuntimeError: boom")) == []
    assert a.error is not None and a.error.status == 500
    assert a.error.message == "generation stopped before the answer was complete: " \
                              "RuntimeError: boom"
    with pytest.raises(ApiError):
        a.response()
    b = Answer(p, served(tok), "rid", 1)
    b.feed(Done("cancelled", 3, 0, 0))
    assert b.error is not None and "cancelled" in b.error.message


def test_keepalives_are_mlx_lms_comment_lines(tok: Any) -> None:
    streamed = prepare_chat({"messages": CHAT, "stream": True}, served(tok))
    assert Answer(streamed, served(tok), "r", 1).keepalive(Prefill(2048, 5000)) \
        == ": keepalive 2048/5000\n\n"
    whole = prepare_chat({"messages": CHAT}, served(tok))
    assert Answer(whole, served(tok), "r", 1).keepalive(Prefill(1, 2)) is None


# --- end to end: the engine answers as mlx_lm.server 0.32.2 answered -------------------------

_MODELS = os.environ.get("KVSTORE_MODELS")  # as the user set it, before the suite's fixture


def _engine_of(path: Path, base: Path) -> Iterator[tuple[Any, Any, Served, Path]]:
    """An engine of the model at ``path`` over a fresh root (started), its Served, the
    model's directory."""
    import mlx_lm

    import kvstore
    from kvstore.mlx_lm import PersistentPromptCache
    from kvstore.server.engine import Engine

    model, tok = mlx_lm.load(str(path))
    vocab, context = model_limits(json.loads((path / "config.json").read_text()))
    assert vocab is not None
    s = Served(model_id="model", aliases={"model"}, tokenizer=tok, vocab_size=vocab,
               context_length=context, abilities=template_abilities(tok, {}),
               rules=tuple(rule_names()), fingerprint="fp",
               defaults={"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                         "max_tokens": 512, "chat_template_args": {}})
    with kvstore.Store.open(base / "root", durable=False, block_tokens=16) as store:
        pc = PersistentPromptCache(store, min_tokens=16)
        eng = Engine(model, tok, pc, model_key=(str(path), None, None))
        eng.start()
        try:
            yield eng, tok, s, path
        finally:
            assert eng.stop(30) == 0
            pc.close()


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Served, Path]]:
    """An engine of the tiny model."""
    base = tmp_path_factory.mktemp("e2e")
    yield from _engine_of(make_tiny_model(base / "model", "llama"), base)


@pytest.fixture(scope="module")
def e2e_smollm2(tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Any, Any, Served, Path]]:
    """An engine of SmolLM2-135M-Instruct (the model cache's: fetched once)."""
    from kvstore.mlx_lm.gguf import fetch_model

    saved = os.environ.pop("KVSTORE_MODELS", None)
    try:
        if _MODELS is not None:
            os.environ["KVSTORE_MODELS"] = _MODELS
        path = fetch_model("smollm2")
    finally:
        if saved is not None:
            os.environ["KVSTORE_MODELS"] = saved
        else:
            os.environ.pop("KVSTORE_MODELS", None)
    yield from _engine_of(path, tmp_path_factory.mktemp("e2e-smollm2"))


def run_engine(eng: Any, s: Served, body: dict[str, Any]) -> tuple[Answer, list[Any]]:
    """``prepare`` -> ``engine.submit`` -> events fed to the answer, as the app does: a stop
    string cancels the job with "stop"."""
    kind = "chat" if "messages" in body else "text"
    p = prepare_chat(body, s) if kind == "chat" else prepare_text(body, s)
    a = Answer(p, s, "rid", 1700000000)
    h = eng.submit(p.job)
    out: list[Any] = []
    while True:
        ev = h.get(timeout=120)
        out += a.feed(ev)
        if a.stop_hit:
            h.cancel("stop")
        if isinstance(ev, Done):
            break
    if p.stream:
        out.append("[DONE]")
    else:
        out = [a.response()]
    return a, out


def ask_mlx(port: int, path: str, body: dict[str, Any]) -> list[Any]:
    """mlx_lm.server's answer: the JSON body, or a stream's ``data:`` objects."""
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return [json.loads(raw)]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in raw.split("\n\n") if line.startswith("data: ")]


def _same_ids(objs: list[Any]) -> list[Any]:
    for o in objs:
        if isinstance(o, dict):
            o.update(id="rid", created=1700000000, system_fingerprint="fp")
    return objs


def test_the_engine_answers_as_mlx_lm_server_answered(e2e: Any, tmp_path: Path) -> None:
    """The same bodies to mlx_lm.server 0.32.2 (a subprocess on 127.0.0.1) and to
    prepare -> engine -> Answer: the same JSON, the same stream chunks (ids, ``created`` and
    the fingerprint aside; every request a first one, nothing cached on either side; the
    model is "default_model": plain mlx_lm.server looks any other name up on the hub)."""
    _same_as_mlx_lm(e2e, tmp_path)


@pytest.mark.model
def test_smollm2_answers_as_mlx_lm_server_answered(e2e_smollm2: Any, tmp_path: Path) -> None:
    """The same with SmolLM2's own template and tokenizer (real words, spaces and all)."""
    _same_as_mlx_lm(e2e_smollm2, tmp_path)


def _same_as_mlx_lm(e2e: Any, tmp_path: Path) -> None:
    from helpers.serving import server_process

    eng, tok, s, path = e2e
    system = sample_text(30, seed=11)
    bodies: list[tuple[str, dict[str, Any]]] = []
    for i, stream in enumerate((False, True)):
        extra = {"stream": stream, "stream_options": {"include_usage": True}} if stream else {}
        bodies += [
            ("/v1/chat/completions", {"max_tokens": 12, "messages": [
                {"role": "system", "content": f"{system} ({i})"},
                {"role": "user", "content": "What is the river?"}], **extra}),
            ("/v1/chat/completions", {"max_tokens": 6, "logprobs": True, "messages": [
                {"role": "user", "content": [{"type": "text", "text": f"Say {i}"}]}], **extra}),
            ("/v1/completions", {"prompt": f"The river {i} was",
                                 "max_tokens": 10, **extra}),
        ]
    with server_process("mlx_lm.server", ["--model", str(path)], tmp_path / "mlx.log"
                        ) as (port, _):
        theirs = [_same_ids(ask_mlx(port, route, body)) for route, body in bodies]
    for (_, body), expected in zip(bodies, theirs, strict=True):
        _, mine = run_engine(eng, s, body)
        assert mine == expected, body
    # the answers say something (the model's greedy text, up to 12 tokens of it)
    first = theirs[0][0]
    assert 0 < first["usage"]["completion_tokens"] <= 12
    assert first["choices"][0]["message"]["content"]


def test_a_stop_string_through_the_engine(e2e: Any) -> None:
    """A stop string the greedy answer reaches: the answer is the text before it, the
    job is cancelled with "stop" at that token, ``finish_reason`` "stop"."""
    eng, tok, s, _ = e2e
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Tell me of the river."}],
                            "max_tokens": 16}
    _, (free,) = run_engine(eng, s, body)
    text = free["choices"][0]["message"]["content"]
    assert free["usage"]["completion_tokens"] == 16 and len(text) > 10
    stop = text[len(text) // 2:len(text) // 2 + 3]
    before = text[:text.find(stop)]
    for stream in (False, True):
        a, out = run_engine(eng, s, {**body, "stop": [stop], "stream": stream})
        assert a.stop_hit and a.stop_word == stop
        if stream:
            got = "".join(c["choices"][0]["delta"].get("content", "") for c in out[:-1])
            assert out[-2]["choices"][0]["finish_reason"] == "stop"
        else:
            got = out[0]["choices"][0]["message"]["content"] or ""
            assert out[0]["choices"][0]["finish_reason"] == "stop"
            assert out[0]["usage"]["completion_tokens"] < 16
        assert got == before
    assert a.done is not None and a.done.finish == "stop"  # cancel("stop")'s Done


def test_a_capped_request_and_the_next_one_through_the_engine(e2e: Any) -> None:
    """max_tokens 10^9 is cut to the ceiling and runs to it; a bad request after it is a
    400 that never reaches the engine; the next request is answered normally."""
    eng, tok, s, _ = e2e
    capped = Served(**{**s.__dict__, "defaults": {**s.defaults, "max_tokens": 8}})
    _, (r,) = run_engine(eng, capped, {"messages": CHAT, "max_tokens": 10 ** 9,
                                       "logit_bias": {"5": 1.0}})
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"
    before = eng.counts()["submitted"]
    for bad in ({"stop": [1]}, {"logit_bias": {"99999999": 5}}, {"temperature": float("nan")}):
        with pytest.raises(ApiError):
            prepare_chat({"messages": CHAT, **bad}, s)
    assert eng.counts()["submitted"] == before
    _, (ok,) = run_engine(eng, s, {"messages": CHAT, "max_tokens": 3})
    assert ok["usage"]["completion_tokens"] == 3


def test_a_prompt_that_opens_its_thinking_starts_the_reply_reasoning(tok: Any) -> None:
    """A generation prompt that ends inside a think block (Qwen3's with thinking on): the
    reply starts in ``reasoning`` and the thinking tail is a segment of its own, as mlx-lm's
    ``_tokenize`` has it. Here the tiny template's ``assistant`` header plays the think
    start."""
    t = copy.copy(tok)
    start = tuple(tok.encode("assistant", add_special_tokens=False))
    object.__setattr__(t, "_think_start", "assistant")
    object.__setattr__(t, "_think_end", "</think>")
    object.__setattr__(t, "_think_start_tokens", start)
    object.__setattr__(t, "_think_end_tokens", (999_002,))
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}]}
    p = prepare_chat(body, served(t, rules=()))
    prompt, cuts, initial = mlx_tokenize(t, body, {})
    assert p.job.prompt == prompt
    assert (p.initial_state, initial) == ("reasoning", "reasoning")
    assert p.cuts == cuts and sorted(cuts.values()) == ["system", "user"]
    a = Answer(p, served(t), "r", 1)
    a.feed(Token(10, "Thinking", -0.1))
    a.feed(Token(11, "</think>Hi!", -0.1))
    a.feed(Done("stop", len(prompt), 0, 2))
    m = a.response()["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == ("Thinking", "Hi!")
