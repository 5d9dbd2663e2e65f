"""``kvstore serve``: an OpenAI-compatible server of one mlx-lm model with a persistent,
shared prompt cache (issue 43).

- :mod:`kvstore.server.engine`: the scheduler; one thread owns the model, prefills each
  request in chunks and decodes the running ones together;
- :mod:`kvstore.server.openai`: requests in, answers out (no HTTP, no threads);
- :mod:`kvstore.server.app`: HTTP (Starlette on uvicorn) and the command.
"""
