"""The prefix-stability rules (:mod:`kvstore.serving.rules`) and a request's messages,
carried into mlx-lm's server for ``kvstore serve``.

Two of mlx-lm's methods are wrapped for the duration of :func:`rewriting_server`:

1. ``APIHandler.handle_chat_completions`` (the handler's thread): the request body
   passes the enabled rules before mlx-lm builds its request from it, so every API
   that reaches the chat path (chat completions, and the Messages and Responses
   adapters, which build a chat body) is rewritten alike; the counts of the rules that
   fired ride on the request object;
2. ``ResponseGenerator._tokenize`` (the generation thread, just before the request's
   cache lookup): the prompt cache is told the request's rewrites and how to place a
   token among its messages (:mod:`kvstore.mlx_lm.partings`), for its log line
   (:meth:`~kvstore.mlx_lm.PersistentPromptCache.set_request`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.serving.rules import rewrite

from .partings import locator
from .requests import RequestContext

__all__ = ["REWRITES_ATTR", "rewriting_server"]

#: On mlx-lm's CompletionRequest: the rules that fired (name: places rewritten).
REWRITES_ATTR = "kvstore_rewrites"
_ATTR = REWRITES_ATTR


@contextlib.contextmanager
def rewriting_server(server: Any, rules: Sequence[str], *, excerpts: bool = False
                     ) -> Iterator[None]:
    """mlx-lm's ``server`` module with the two hooks of this module's docstring; ``rules``:
    the names of the enabled rules; ``excerpts``: the log line quotes both sides of a
    parting (``--log-excerpts``)."""
    handler, generator = server.APIHandler, server.ResponseGenerator
    handle, tokenize = handler.handle_chat_completions, generator._tokenize
    enabled = tuple(rules)

    def handle_chat_completions(self: Any) -> Any:
        fired: dict[str, int] = {}
        if enabled and isinstance(self.body, dict) \
                and isinstance(self.body.get("messages"), list):
            self.body, fired = rewrite(self.body, enabled)
        request = handle(self)
        with contextlib.suppress(AttributeError):
            setattr(request, _ATTR, fired)
        return request

    def tokenize_noted(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        out = tokenize(self, tokenizer, request, args)
        set_request = getattr(self.prompt_cache, "set_request", None)
        if set_request is not None:
            set_request(_context(self, tokenizer, request, args, out, excerpts))
        return out

    handler.handle_chat_completions = handle_chat_completions
    generator._tokenize = tokenize_noted
    try:
        yield
    finally:
        handler.handle_chat_completions = handle
        generator._tokenize = tokenize


def _context(generator: Any, tokenizer: Any, request: Any, args: Any, out: Any,
             excerpts: bool) -> RequestContext:
    ctx = RequestContext(rewrites=dict(getattr(request, _ATTR, None) or {}))
    vision = out[4] if isinstance(out, tuple) and len(out) > 4 else None
    if request.request_type == "chat" and tokenizer.has_chat_template and vision is None:
        template_args = dict(generator.model_provider.cli_args.chat_template_args or {})
        template_args.update(args.chat_template_kwargs or {})
        ctx.locate = locator(tokenizer, request.messages, request.tools, template_args)
    if excerpts:
        ctx.decode = lambda toks: str(tokenizer.decode(list(toks)))
    return ctx
