"""The prefix-stability rules (issue 34 item 5): each rewrites what it names and nothing
else, leaves its input alone, keeps the prompt the same for the same logical content, and
is listed in docs/CLI.md exactly as :data:`kvstore.serving.rules.RULES` holds it."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from kvstore.serving import rules
from kvstore.serving.rules import RULES, UnknownRuleError, rewrite, select

DOCS = Path(__file__).resolve().parent.parent / "docs" / "CLI.md"

BILLING = ("x-anthropic-billing-header: cc_version=2.1.37.a3f; cc_entrypoint=cli; "
           "cch={};")


def _body(cch: str, *, parts: bool = False) -> dict:
    system_text = "You are a coding agent. Use the tools."
    content: object
    if parts:
        content = [{"type": "text", "text": BILLING.format(cch)},
                   {"type": "text", "text": system_text}]
    else:
        content = BILLING.format(cch) + "\n" + system_text
    return {"model": "m", "messages": [{"role": "system", "content": content},
                                       {"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parts", [False, True])
def test_the_billing_line_goes_and_the_rest_stays(parts: bool) -> None:
    a, b = _body("9f2c1", parts=parts), _body("00ab7", parts=parts)
    before = copy.deepcopy(a)
    ra, fired = rewrite(a, ["claude-billing-header"])
    rb, _ = rewrite(b, ["claude-billing-header"])
    assert a == before  # the body given is not changed
    assert fired == {"claude-billing-header": 1}
    assert ra == rb  # a new cch no longer changes the prompt
    sys = ra["messages"][0]["content"]
    if parts:  # the emptied part keeps its place: breakpoints name parts by index
        assert sys == [{"type": "text", "text": ""},
                       {"type": "text", "text": "You are a coding agent. Use the tools."}]
    else:
        assert sys == "You are a coding agent. Use the tools."
    assert ra["messages"][1] == {"role": "user", "content": "hi"}


def test_the_billing_line_goes_alone_when_the_next_block_follows_it_on_its_line() -> None:
    """Claude Code 2.1.332's blocks joined as sent: the billing line ends with ``;`` and the
    identity line follows without a line break. Only the billing fields go."""
    line = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;"
    joined = line + "You are a Claude agent.\nBe brief."
    out, fired = rewrite({"messages": [{"role": "system", "content": joined}]},
                         ["claude-billing-header"])
    assert fired == {"claude-billing-header": 1}
    assert out["messages"][0]["content"] == "You are a Claude agent.\nBe brief."
    # the same blocks as parts: the same text once the parts are joined
    parts = [{"type": "text", "text": line}, {"type": "text", "text": "You are a Claude agent."},
             {"type": "text", "text": "\nBe brief."}]
    out, _ = rewrite({"messages": [{"role": "system", "content": parts}]},
                     ["claude-billing-header"])
    assert "".join(p["text"] for p in out["messages"][0]["content"]) == \
        "You are a Claude agent.\nBe brief."


def test_the_billing_line_is_left_where_it_is_not_the_system_prompt() -> None:
    body = {"messages": [{"role": "user", "content": BILLING.format("12345")}]}
    out, fired = rewrite(body, ["claude-billing-header"])
    assert out == body and fired == {}
    mid = "Keep this: x-anthropic-billing-header: is a header name."  # not at a line start
    body = {"messages": [{"role": "system", "content": mid}]}
    assert rewrite(body, ["claude-billing-header"]) == (body, {})


def test_tool_schemas_are_sorted_recursively_lists_kept() -> None:
    tool = {"type": "function", "function": {
        "name": "read", "description": "Read a file",
        "parameters": {"type": "object", "required": ["path", "limit"],
                       "properties": {"path": {"type": "string"},
                                      "limit": {"type": "integer", "minimum": 1}}}}}
    shuffled = {"function": {"parameters": {"properties": {"limit": {"minimum": 1,
                                                                     "type": "integer"},
                                                           "path": {"type": "string"}},
                                            "required": ["path", "limit"], "type": "object"},
                             "description": "Read a file", "name": "read"},
                "type": "function"}
    a, fa = rewrite({"messages": [], "tools": [tool]}, ["sorted-tool-schemas"])
    b, fb = rewrite({"messages": [], "tools": [shuffled]}, ["sorted-tool-schemas"])
    assert json.dumps(a["tools"]) == json.dumps(b["tools"])  # the same order, key by key
    assert a["tools"][0]["function"]["parameters"]["required"] == ["path", "limit"]
    assert fa == {"sorted-tool-schemas": 1}
    already, fired = rewrite(a, ["sorted-tool-schemas"])
    assert fired == {} and already == a  # sorted already: not counted


def test_tool_call_arguments_are_sorted_strings_and_objects() -> None:
    def body(args: object) -> dict:
        return {"messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "edit", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}

    one, f1 = rewrite(body('{"path": "a.py", "old": {"z": 1, "a": 2}}'),
                      ["sorted-tool-arguments"])
    two, f2 = rewrite(body('{"old":{"a":2,"z":1},"path":"a.py"}'), ["sorted-tool-arguments"])
    three, f3 = rewrite(body({"path": "a.py", "old": {"z": 1, "a": 2}}),
                        ["sorted-tool-arguments"])
    args = [json.loads(b["messages"][1]["tool_calls"][0]["function"]["arguments"])
            for b in (one, two)]
    # what mlx-lm hands the template (the string parsed back): the same keys in one order
    assert list(args[0]) == list(args[1]) == ["old", "path"]
    assert list(args[0]["old"]) == ["a", "z"]
    assert list(three["messages"][1]["tool_calls"][0]["function"]["arguments"]) == ["old",
                                                                                     "path"]
    assert f1 == {"sorted-tool-arguments": 1} and f3 == {"sorted-tool-arguments": 1}
    assert f2 == {}  # keys already in order: left as sent, not counted
    assert two == body('{"old":{"a":2,"z":1},"path":"a.py"}')
    not_json, f4 = rewrite(body("not json"), ["sorted-tool-arguments"])
    assert f4 == {} and not_json == body("not json")


def test_select_turns_rules_off_and_refuses_unknown_names() -> None:
    every = tuple(r.name for r in RULES)
    assert select() == every
    assert select(off=["claude-billing-header"]) == every[1:]
    assert select(only="sorted-tool-schemas") == ("sorted-tool-schemas",)
    assert select(only="none") == () and select(only="") == ()
    with pytest.raises(UnknownRuleError, match=r"no rule named 'billing' \(rules: "
                                               r"claude-billing-header, "):
        select(off=["billing"])
    off, fired = rewrite(_body("12345"), select(off=["claude-billing-header"]))
    assert fired == {} and off == _body("12345")


def test_cli_md_lists_exactly_the_rules() -> None:
    text = DOCS.read_text()
    section = text.split("### Prefix-stability rules", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z-]+)` \| (.*) \|$", section, re.MULTILINE)
    assert [name for name, _ in rows] == rules.names()
    for (name, summary), rule in zip(rows, RULES, strict=True):
        assert summary == rule.summary, name


def test_serve_refuses_an_unknown_rule_in_one_line(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    from kvstore.server.main import serve_main

    assert serve_main(["--no-rule", "billing", "--model", "nowhere/none"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvstore: error: no rule named 'billing' (rules: claude-billing-header, "
                   "sorted-tool-schemas, sorted-tool-arguments, opencode-env-date)\n")


AGENTS = Path(__file__).resolve().parent / "data" / "agents"


def test_opencodes_date_moves_out_of_the_system_prompt_to_the_first_user_message() -> None:
    """opencode 1.18.33's own requests of one session, a day apart (tests/agents/capture.py):
    the date in the system prompt's <env> block parted them from there on, before every
    tool. Moved, the system prompt is the same on both days and the line is still sent."""
    day1 = json.loads((AGENTS / "opencode-1.18.33-a3-1.json").read_text())
    day2 = json.loads((AGENTS / "opencode-1.18.33-a4-1.json").read_text())
    assert day1["messages"][0]["content"] != day2["messages"][0]["content"]
    a, fa = rewrite(day1, ["opencode-env-date"])
    b, fb = rewrite(day2, ["opencode-env-date"])
    assert fa == fb == {"opencode-env-date": 1}
    assert a["messages"][0]["content"] == b["messages"][0]["content"]
    assert "Today's date" not in a["messages"][0]["content"]
    assert "<env>" in a["messages"][0]["content"]  # the rest of the block stays
    first_user = next(m for m in a["messages"] if m["role"] == "user")
    assert first_user["content"].endswith("\n\nToday's date: Sun Dec 06 2026")
    assert a["messages"][2:] == day1["messages"][2:]  # nothing after it moves
    # the same on a body without an <env> block: untouched
    plain = {"messages": [{"role": "system", "content": "Today's date: Sun Dec 06 2026\n"},
                          {"role": "user", "content": "hi"}]}
    assert rewrite(plain, ["opencode-env-date"]) == (plain, {})
