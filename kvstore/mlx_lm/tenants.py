"""Tenants of one ``kvstore serve``: a request's ``cache_salt`` (the name vLLM uses, a
field of the chat and completions request body) keeps its prompt cache apart from
every other salt's, and from requests without one.

mlx-lm's server calls its prompt cache from one generation thread with a model key
that knows nothing of the request, so the salt travels with the request instead:

1. the handler checks the field (a non-empty string of at most 4 KiB; absent or
   ``null`` is no salt, as in vLLM; anything else is a 400 answer) as mlx-lm checks its
   own parameters, in the handler's thread;
2. ``ResponseGenerator.generate``, called next in that thread, makes the request's
   model description one that compares equal only to the same model *and* salt:
   mlx-lm adds a request to the running batch only when its model description equals
   the batch's, so one batch never mixes salts (another salt waits for the batch to
   drain, as another model does);
3. ``ResponseGenerator._tokenize``, which the generation thread calls for each
   request just before its cache lookup, sets the prompt cache's tenant
   (:meth:`~kvstore.mlx_lm.PersistentPromptCache.set_tenant`): every lookup and
   insert until the next request's is that batch's, hence that salt's.

The salt is kept in memory only; the store sees a keyed hash of it
(:mod:`kvstore.store.tenants`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from kvstore.store.tenants import MAX_SALT_BYTES

__all__ = ["FIELD", "check_salt", "salted_server"]

FIELD = "cache_salt"
_request = threading.local()  # the salt of the request the handler's thread serves


def check_salt(value: object) -> str | None:
    """The request's salt (None when absent or ``null``: no salt); ValueError when it is not
    a usable one."""
    if value is None:
        return None
    if not isinstance(value, str) or not value \
            or len(value.encode("utf-8", "surrogatepass")) > MAX_SALT_BYTES:
        raise ValueError(f"{FIELD} must be a non-empty string of at most {MAX_SALT_BYTES} "
                         "bytes")
    return value


@contextlib.contextmanager
def salted_server(server: Any) -> Iterator[None]:
    """mlx-lm's ``server`` module with the three hooks of this module's docstring, for the
    duration of the block."""

    @dataclasses.dataclass
    class SaltedModel(server.ModelDescription):  # type: ignore[misc]
        cache_salt: str = ""

    handler, generator = server.APIHandler, server.ResponseGenerator
    validate, generate, tokenize = (handler.validate_model_parameters, generator.generate,
                                    generator._tokenize)

    def validate_model_parameters(self: Any) -> None:
        _request.salt = None
        validate(self)
        _request.salt = check_salt(self.body.get(FIELD))

    def generate_salted(self: Any, request: Any, generation_args: Any, *args: Any,
                        **kwargs: Any) -> Any:
        salt = getattr(_request, "salt", None)
        _request.salt = None
        if salt is not None:
            m = generation_args.model
            generation_args = dataclasses.replace(generation_args, model=SaltedModel(
                model=m.model, draft=m.draft, adapter=m.adapter, cache_salt=salt))
        return generate(self, request, generation_args, *args, **kwargs)

    def tokenize_salted(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        set_tenant = getattr(self.prompt_cache, "set_tenant", None)
        if set_tenant is not None:
            set_tenant(getattr(args.model, FIELD, None))
        return tokenize(self, tokenizer, request, args)

    handler.validate_model_parameters = validate_model_parameters
    generator.generate, generator._tokenize = generate_salted, tokenize_salted
    try:
        yield
    finally:
        handler.validate_model_parameters = validate
        generator.generate, generator._tokenize = generate, tokenize
