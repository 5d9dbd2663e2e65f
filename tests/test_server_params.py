"""The request fields of the new server's chat and text completions: every field
mlx_lm.server 0.32.2 reads is in kvstore.server.params' table (docs/CLI.md takes it from
there), and what the table promises for the fields mlx-lm left unchecked."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from kvstore.server import params
from kvstore.server.params import RESERVED_TEMPLATE_ARGS, parse_params, stop_words
from kvstore.serving.chat import ApiError

DEFAULTS = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 512}


def mlx_lm_fields() -> set[str]:
    """The body fields mlx_lm.server reads (``body.get("x")``, ``body["x"]``,
    ``"x" in body``), from its source."""
    src = (Path(mlx_lm.__file__).parent / "server.py").read_text()
    found = set(re.findall(r'body\.get\(\s*"([a-z_]+)"', src))
    found |= set(re.findall(r'body\["([a-z_]+)"\]', src))
    found |= set(re.findall(r'"([a-z_]+)" in (?:self\.)?body', src))
    found |= set(re.findall(r'stream_options\["([a-z_]+)"\]', src))
    return found


def test_the_table_names_every_field_mlx_lm_server_reads() -> None:
    fields = mlx_lm_fields()
    assert {"messages", "prompt", "stop", "logit_bias", "max_completion_tokens",
            "include_usage", "role_mapping", "adapters"} <= fields  # the scan finds them
    doc = params.__doc__ or ""
    missing = sorted(f for f in fields if f"``{f}``" not in doc
                     and not (f.endswith("_context_size") and "``*_context_size``" in doc))
    assert missing == []
    for ours in ("cache_salt", "cache_control", "n"):
        assert f"``{ours}``" in doc


def test_null_is_the_default_and_bools_are_not_numbers() -> None:
    p = parse_params({"temperature": None, "top_k": None, "stop": None, "seed": None,
                      "logit_bias": None, "stream_options": None, "max_tokens": None},
                     DEFAULTS, 100)
    assert (p.sampling.temperature, p.sampling.top_k, p.stops, p.sampling.seed,
            p.sampling.logit_bias, p.include_usage, p.max_tokens) == (0.0, 0, [], None, (),
                                                                       False, 512)
    for name in ("temperature", "top_p", "repetition_penalty"):
        with pytest.raises(ApiError, match=f"{name} must be of type"):
            parse_params({name: True}, DEFAULTS, 100)
    with pytest.raises(ApiError, match="logit_bias must be a dict of int to float"):
        parse_params({"logit_bias": {"5": True}}, DEFAULTS, 100)


def test_stop_words() -> None:
    assert stop_words("x") == ["x"] and stop_words(["a", "", "b"]) == ["a", "b"]
    assert stop_words("") == [] and stop_words(None) == []
    for bad in ([1], [None], {"a": 1}, 3.5, [["a"]]):
        with pytest.raises(ApiError) as e:
            stop_words(bad)
        assert (e.value.status, e.value.param) == (400, "stop")


@pytest.mark.parametrize("key", RESERVED_TEMPLATE_ARGS)
def test_a_request_cannot_set_the_renderers_own_arguments(key: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_params({"chat_template_kwargs": {key: "x"}}, DEFAULTS, 100)
    assert e.value.message == f"chat_template_kwargs may not set {key!r}"
    ok: dict[str, Any] = parse_params({"chat_template_kwargs": {"enable_thinking": False}},
                                      DEFAULTS, 100).chat_template_kwargs
    assert ok == {"enable_thinking": False}


def test_the_ceiling_holds_for_max_completion_tokens_too() -> None:
    p = parse_params({"max_completion_tokens": 10 ** 9, "max_tokens": 3},
                     {**DEFAULTS, "max_tokens": 64}, 100)
    assert (p.max_tokens, p.asked_tokens) == (64, 10 ** 9)
    with pytest.raises(ApiError) as e:
        parse_params({"max_completion_tokens": -5}, DEFAULTS, 100)
    assert (e.value.message, e.value.param) == ("max_tokens must be at least 1",
                                                "max_completion_tokens")


def test_a_ceiling_apart_from_the_default() -> None:
    """``max_tokens_ceiling`` (when the server sets one): a request without max_tokens gets
    the default, one that asks for more than the default gets it up to the ceiling."""
    d = {**DEFAULTS, "max_tokens": 512, "max_tokens_ceiling": 32768}
    assert parse_params({}, d, 100).max_tokens == 512
    assert parse_params({"max_tokens": 32000}, d, 100).max_tokens == 32000
    assert parse_params({"max_tokens": 10 ** 9}, d, 100).max_tokens == 32768
    assert parse_params({"max_tokens": 32000}, DEFAULTS, 100).max_tokens == 512
