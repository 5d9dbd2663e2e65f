"""What a chat template renders, found by probes (``kvstore.serving.templates``), and the
fallback for a system message it cannot render in the conversation's midst: checked on real
templates (the tiny model's ChatML, which prints no tools; one that raises on a late system
message, as Gemma's and Mistral's do; one that renders both) through mlx-lm's tokenizer."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from kvstore.mlx_lm.cache_control import take_breakpoints
from kvstore.serving.templates import PROBE_TOOL, Abilities, probe, system_into_user
from kvstore.tiny import CHAT_TEMPLATE, make_tiny_model

RAISES = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
          "{% endfor %}" + CHAT_TEMPLATE)
DROPS = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}"
         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
         "{% if tools %}{{ tools | tojson }}{% endif %}")
ALL = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
       + CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = make_tiny_model(tmp_path_factory.mktemp("tpl") / "model", "llama", hidden_size=32,
                        num_layers=1)
    return load_tokenizer(Path(d))


def _render(tok: Any, template: str) -> Any:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return str(tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=True,
                                           chat_template=template))
    return render


@pytest.mark.parametrize(("template", "expected"), [
    (CHAT_TEMPLATE, Abilities(tools=False, mid_system=True)),  # ChatML: no tools
    (RAISES, Abilities(tools=False, mid_system=False)),
    (DROPS, Abilities(tools=True, mid_system=False)),  # renders it nowhere: as good as none
    (ALL, Abilities(tools=True, mid_system=True)),
])
def test_probes_find_what_a_template_renders(tokenizer: Any, template: str,
                                             expected: Abilities) -> None:
    assert probe(_render(tokenizer, template)) == expected


def test_the_probe_tool_is_a_chat_tool() -> None:
    assert PROBE_TOOL["type"] == "function" and PROBE_TOOL["function"]["parameters"]


def test_a_late_system_message_joins_the_user_message_before_it() -> None:
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello."}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                        "cache_control": {"type": "ephemeral"}}]}]}
    before = copy.deepcopy(body)
    out, n = system_into_user(body)
    assert body == before and n == 1
    assert out["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello."},
                                     {"type": "text", "text": "\n\n"},
                                     {"type": "text", "text": "# Environment",
                                      "cache_control": {"type": "ephemeral"}}]}]
    # its mark is read where its text now is: the end of the user message
    marks = take_breakpoints(copy.deepcopy(out))
    assert [(b.message, b.part) for b in marks] == [(1, 2)]


def test_the_fallback_is_the_same_from_turn_to_turn() -> None:
    """A turn later the conversation has grown behind the system message: what it became
    is the same messages, so the prompt's prefix holds."""
    turn1 = {"messages": [{"role": "user", "content": "Go."},
                          {"role": "system", "content": "Today is Sunday."}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "Done."},
                          {"role": "user", "content": "Again."},
                          {"role": "system", "content": "Today is Monday now.",
                           "cache_control": {"type": "ephemeral"}},
                          {"role": "assistant", "content": "", "tool_calls": []},
                          {"role": "system", "content": "Last."}]}
    a, na = system_into_user(turn1)
    b, nb = system_into_user(turn2)
    assert (na, nb) == (1, 3)
    assert b["messages"][: len(a["messages"])] == a["messages"]
    roles = [m["role"] for m in b["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert b["messages"][2]["content"][-1] == {"type": "text", "text": "Today is Monday now.",
                                               "cache_control": {"type": "ephemeral"}}
    assert b["messages"][4]["content"] == [{"type": "text", "text": "Last."}]
    # one before a user message, after an assistant's: it opens that user message
    c, _ = system_into_user({"messages": [{"role": "assistant", "content": "x"},
                                          {"role": "system", "content": "Note."},
                                          {"role": "user", "content": "y"}]})
    assert c["messages"][1] == {"role": "user", "content": [
        {"type": "text", "text": "Note."}, {"type": "text", "text": "\n\n"},
        {"type": "text", "text": "y"}]}
    assert json.dumps(system_into_user({"messages": []})) == json.dumps(({"messages": []}, 0))


def test_the_fallback_renders_where_the_template_refused(tokenizer: Any) -> None:
    render = _render(tokenizer, RAISES)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "system", "content": "P"}]
    with pytest.raises(Exception, match="System message must be at the beginning"):
        render(messages, None)
    out, _ = system_into_user({"messages": messages})
    from mlx_lm.server import process_message_content

    fixed = copy.deepcopy(out["messages"])
    process_message_content(fixed)
    assert render(fixed, None) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU\n\nP"
                                   "<|im_end|>\n<|im_start|>assistant\n")
