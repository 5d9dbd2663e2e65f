"""The request parameters of ``/v1/chat/completions`` and ``/v1/completions``, checked before
anything reaches the model.

mlx_lm.server 0.32.2 read each field with ``body.get`` and checked types, not values: a
``"stop": [1]`` stopped its generation thread for good, a ``logit_bias`` id past the
vocabulary crashed the process, a NaN temperature sampled garbage and ``max_tokens`` had no
ceiling (issue 43, item 5). Here every field is checked, in mlx-lm's words where mlx-lm
had words for it, and a request that fails is an :class:`~kvstore.serving.chat.ApiError`
(400 ``invalid_request_error``, naming the field as ``param``) before it is templated.

The fields mlx_lm.server 0.32.2 accepts, and what ``kvstore serve`` does with each
(``chat``: ``/v1/chat/completions`` only; ``text``: ``/v1/completions`` only):

=========================  ======================================================================
field                      what kvstore serve does
=========================  ======================================================================
``messages`` (chat)        a non-empty list of objects with a string ``role``; content a string,
                           a list of ``text`` parts, or null; ``tool_calls[].function.arguments``
                           a JSON string or an object. Image parts: 400 (no vision models).
``tools`` (chat)           a list or null; rendered by the chat template; a template that
                           renders no tools: 400, or dropped with ``--drop-tools``
``role_mapping`` (chat)    an object or null: the roles' prefixes for a model without a chat
                           template (mlx-lm's ``convert_chat``)
``prompt`` (text)          a string (or a list of token ids below the vocabulary size)
``model``                  a string (default ``default_model``); any name is the served model,
                           and the answer echoes it
``stream``                 a boolean (default false): server-sent events
``stream_options``         an object or null; ``include_usage`` (default false): a last chunk
                           with ``usage`` and no choices
``max_tokens``,            a positive integer; ``max_completion_tokens`` wins when both are
``max_completion_tokens``  given; absent: ``--max-tokens``, which is also the ceiling unless the
                           server sets one apart (a larger value is cut to it, with a log line)
``temperature``            a finite number >= 0 (default ``--temp``)
``top_p``                  a finite number in [0, 1] (default ``--top-p``)
``top_k``                  an integer >= 0 (default ``--top-k``; 0: off; one >= the vocabulary
                           size keeps every token, as 0 does)
``min_p``                  a finite number in [0, 1] (default ``--min-p``)
``repetition_penalty``     a finite number >= 0 (default 0: off)
``presence_penalty``,      a finite number in [-2, 2] (OpenAI's range; default 0: off)
``frequency_penalty``
``*_context_size``         ``repetition_``, ``presence_``, ``frequency_context_size``: an
                           integer in [0, 2^31) (default 20)
``xtc_probability``,       a finite number in [0, 1] (defaults 0 and 0.1, mlx-lm's)
``xtc_threshold``
``logit_bias``             an object or null: integer token ids (as JSON keys) in [0, vocabulary
                           size), finite numbers
``logprobs``               a boolean (default false): the chosen tokens' logprobs (not streamed,
                           as mlx-lm)
``top_logprobs``           an integer in [0, 20] or -1 (none; default): the best k at each token
``seed``                   an integer or null
``stop``                   a string, a list of strings, or null: the answer ends before the
                           first one the text reaches; ``finish_reason`` ``stop``
``chat_template_kwargs``   an object or null, over ``--chat-template-args`` (``tools``,
                           ``tokenize``, ``add_generation_prompt``, ``messages``,
                           ``conversation``, ``return_dict``, ``chat_template``: 400)
``n``                      1 or absent (one choice only; more: 400)
``draft_model``,           ``draft_model``: a string, ignored (the server's ``--draft-model``,
``num_draft_tokens``       if any, is used); ``num_draft_tokens`` an integer >= 0
``adapters``               null or absent only: a request cannot load an adapter (400)
``cache_salt``             kvstore's: a non-empty string of at most 4096 bytes, or null
                           (tenants, docs/CLI.md)
``cache_control``          kvstore's (chat): Anthropic breakpoints on the body, messages, parts
                           and tools; at most 4
=========================  ======================================================================

Other fields (OpenAI's ``tool_choice``, ``response_format``, ``user``, ``parallel_tool_calls``,
...) are ignored, as mlx-lm ignores them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.serving.chat import ApiError, invalid
from kvstore.store.tenants import MAX_SALT_BYTES

from .engine import Sampling

__all__ = ["MAX_TOP_LOGPROBS", "Params", "check_salt", "parse_params", "stop_words"]

logger = logging.getLogger("kvstore.serve")

MAX_TOP_LOGPROBS = 20
_MAX_CONTEXT_SIZE = 1 << 31
#: chat_template_kwargs that would collide with the arguments the renderer passes itself
#: and a template of the request's own (``chat_template``: a Jinja program the server would
#: run; the operator's --chat-template-args may still name one)
RESERVED_TEMPLATE_ARGS = ("tools", "tokenize", "add_generation_prompt", "messages",
                          "conversation", "return_dict", "chat_template")


@dataclass
class Params:
    """A request's parameters, checked."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int  # capped by the ceiling
    asked_tokens: int | None  # what the request asked for (None: the default)
    sampling: Sampling
    logprobs: bool
    top_logprobs: int  # 0: none
    stops: list[str]
    salt: str | None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: Mapping[str, Any], name: str, default: Any) -> Any:
    """A field, its default when absent or null."""
    v = body.get(name)
    return default if v is None else v


def _int(body: Mapping[str, Any], name: str, default: int, lo: int | None = None,
         hi: int | None = None) -> int:
    v = _get(body, name, default)
    if not _is_int(v):
        raise invalid(f"{name} must be of type int", param=name)
    if lo is not None and v < lo:
        raise invalid(f"{name} must be at least {lo}", param=name)
    if hi is not None and v > hi:
        raise invalid(f"{name} must be at most {hi}", param=name)
    return int(v)


def _number(body: Mapping[str, Any], name: str, default: float, lo: float | None = None,
            hi: float | None = None) -> float:
    v = _get(body, name, default)
    if not _is_number(v):
        raise invalid(f"{name} must be of type ('float', 'int')", param=name)
    if not math.isfinite(v):
        raise invalid(f"{name} must be a finite number", param=name)
    if lo is not None and v < lo:
        raise invalid(f"{name} must be at least {lo:g}", param=name)
    if hi is not None and v > hi:
        raise invalid(f"{name} must be at most {hi:g}", param=name)
    return float(v)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = _get(body, name, default)
    if not isinstance(v, bool):
        raise invalid(f"{name} must be of type bool", param=name)
    return v


def check_salt(value: object) -> str | None:
    """The request's ``cache_salt`` (None when absent or null: no salt); a 400 when it is not
    a usable one (kvstore.mlx_lm.tenants' rule and words)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value \
            or len(value.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES:
        raise invalid(f"cache_salt must be a non-empty string of at most {MAX_SALT_BYTES} "
                      "bytes", param="cache_salt")
    return value


def stop_words(value: object) -> list[str]:
    """``stop``: a string, a list of strings, or null; the empty strings left out."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid("stop must be a string or a list of strings", param="stop")


def _logit_bias(value: object, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias must be of type dict", param="logit_bias")
    out: dict[int, float] = {}
    for k, v in value.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise invalid("logit_bias must be a dict of int to float",
                          param="logit_bias") from None
        if not _is_number(v):
            raise invalid("logit_bias must be a dict of int to float", param="logit_bias")
        if not 0 <= token < vocab_size:
            raise invalid(f"logit_bias: token id {k} is not in the vocabulary (0 to "
                          f"{vocab_size - 1})", param="logit_bias")
        if not math.isfinite(v):
            raise invalid(f"logit_bias: the bias of token {k} must be a finite number",
                          param="logit_bias")
        out[token] = float(v)
    return tuple(out.items())


def _max_tokens(body: Mapping[str, Any], default: int, ceiling: int) -> tuple[int, int | None]:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    asked = body.get(name)
    if asked is None:
        return min(default, ceiling), None
    if not _is_int(asked):
        raise invalid("max_tokens must be of type int", param=name)
    if asked < 1:
        raise invalid("max_tokens must be at least 1", param=name)
    if asked > ceiling:
        logger.warning("kvstore: a request asked for up to %d tokens: it gets at most %d "
                       "(--max-tokens)", asked, ceiling)
        return ceiling, int(asked)
    return int(asked), int(asked)


def parse_params(body: Mapping[str, Any], defaults: Mapping[str, Any], vocab_size: int
                 ) -> Params:
    """The checked parameters of a chat or text completion ``body``. ``defaults``: the
    server's ``temp``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens`` (the default and the
    ceiling, unless ``max_tokens_ceiling`` is given apart), ``num_draft_tokens``;
    ``vocab_size``: the model's output size."""
    model = _get(body, "model", "default_model")
    if not isinstance(model, str):
        raise invalid("requested_model must be of type str", param="model")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be of type dict", param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise invalid("n must be 1: kvstore serve answers with one choice", param="n")
    if body.get("adapters") is not None:
        raise invalid("adapters are not supported: kvstore serve serves its one model",
                      param="adapters")
    draft = body.get("draft_model")
    if draft is not None and not isinstance(draft, str):
        raise invalid("draft_model must be of type str", param="draft_model")
    _int(body, "num_draft_tokens", int(defaults.get("num_draft_tokens", 3)), lo=0)

    default = int(defaults.get("max_tokens", 512))
    ceiling = int(defaults.get("max_tokens_ceiling") or default)
    max_tokens, asked = _max_tokens(body, default, ceiling)
    top_k = _int(body, "top_k", int(defaults.get("top_k", 0)), lo=0)
    sampling = Sampling(
        temperature=_number(body, "temperature", float(defaults.get("temp", 0.0)), lo=0),
        top_p=_number(body, "top_p", float(defaults.get("top_p", 1.0)), lo=0, hi=1),
        top_k=top_k if top_k < vocab_size else 0,  # every token: no filter
        min_p=_number(body, "min_p", float(defaults.get("min_p", 0.0)), lo=0, hi=1),
        xtc_probability=_number(body, "xtc_probability", 0.0, lo=0, hi=1),
        xtc_threshold=_number(body, "xtc_threshold", 0.1, lo=0, hi=1),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, lo=0),
        repetition_context_size=_int(body, "repetition_context_size", 20, lo=0,
                                     hi=_MAX_CONTEXT_SIZE - 1),
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2, hi=2),
        presence_context_size=_int(body, "presence_context_size", 20, lo=0,
                                   hi=_MAX_CONTEXT_SIZE - 1),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
        frequency_context_size=_int(body, "frequency_context_size", 20, lo=0,
                                    hi=_MAX_CONTEXT_SIZE - 1),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        seed=None if body.get("seed") is None else _int(body, "seed", 0),
    )
    logprobs = _bool(body, "logprobs", False)
    top = _get(body, "top_logprobs", -1)
    if not _is_int(top):
        raise invalid("top_logprobs must be of type int", param="top_logprobs")
    if top != -1 and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}" if top > 0
                      else "top_logprobs must be at least 0", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise invalid("chat_template_kwargs must be an object",
                          param="chat_template_kwargs")
        bad = [k for k in kwargs if k in RESERVED_TEMPLATE_ARGS]
        if bad:
            raise invalid(f"chat_template_kwargs may not set {bad[0]!r}",
                          param="chat_template_kwargs")
    return Params(model=model, stream=stream, include_usage=include_usage,
                  max_tokens=max_tokens, asked_tokens=asked, sampling=sampling,
                  logprobs=logprobs, top_logprobs=max(0, int(top)),
                  stops=stop_words(body.get("stop")), salt=check_salt(body.get("cache_salt")),
                  chat_template_kwargs=dict(kwargs or {}))


def as_api_error(e: ValueError, param: str | None = None) -> ApiError:
    """A ValueError of a checking function (cache_control's) as a 400."""
    return invalid(str(e), param=param)
