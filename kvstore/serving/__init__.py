"""The APIs coding agents speak, as adapters to one internal chat request (issue 34).

- ``chat.py``: the internal request (an OpenAI chat-completions body) and the events that
  answer it (chat chunks, progress, the finish with the request's cache figures);
- ``anthropic_protocol.py`` + ``anthropic_messages.py``: the Anthropic Messages API
  (``/v1/messages``, ``/v1/messages/count_tokens``);
- ``responses_protocol.py`` + ``responses.py``: the OpenAI Responses API (``/v1/responses``);
- ``rules.py``: the named prefix-stability rewrites of a chat body, applied to every API's
  request before templating.

A protocol module declares the wire types (msgspec Structs that validate and bound); a
serving module converts to the internal request and the events back. Nothing here knows
mlx-lm: ``kvstore.server.app`` runs the request through the server's chat path.
"""
