"""Every name of ``mlx_lm.server`` kvstore relies on is there, in the shape relied on
(kvstore/mlx_lm/seam.py's ``RELIED_ON``); when an mlx-lm upgrade moves one, this fails
naming it."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import mlx_lm.server
import pytest

from kvstore.mlx_lm import seam
from kvstore.mlx_lm.seam import RELIED_ON, SeamError, check_server


def test_mlx_lm_server_has_everything_kvstore_relies_on() -> None:
    check_server(mlx_lm.server)


def _without(name: str, replacement: Any = None) -> types.SimpleNamespace:
    """``mlx_lm.server``'s names, with ``name`` (``A`` or ``A.b``) gone or replaced."""
    mod = types.SimpleNamespace(**vars(mlx_lm.server))
    head, _, attr = name.partition(".")
    if not attr:
        if replacement is None:
            delattr(mod, head)
        else:
            setattr(mod, head, replacement)
        return mod
    cls = getattr(mod, head)
    body = {k: v for k, v in vars(cls).items() if k != attr}
    if replacement is not None:
        body[attr] = replacement
    setattr(mod, head, type(head, (), body))
    return mod


@pytest.mark.parametrize("name", [n for n, _, _ in RELIED_ON])
def test_a_name_gone_is_named(name: str) -> None:
    why = next(w for n, _, w in RELIED_ON if n == name)
    with pytest.raises(SeamError) as e:
        check_server(_without(name))
    assert str(e.value) == f"mlx_lm.server.{name} is gone (kvstore relies on it: {why})"


def test_a_changed_signature_or_field_is_named() -> None:
    def generate(self: Any, request: Any, args: Any) -> None: ...

    with pytest.raises(SeamError) as e:
        check_server(_without("ResponseGenerator.generate", generate))
    assert str(e.value).startswith(
        "mlx_lm.server.ResponseGenerator.generate takes (self, request, args), kvstore relies "
        "on (self, request, generation_args, progress_callback)")

    @dataclasses.dataclass
    class GenerationContext:
        prompt: list[int]

    with pytest.raises(SeamError) as e:
        check_server(_without("GenerationContext", GenerationContext))
    assert str(e.value).startswith(
        "mlx_lm.server.GenerationContext has no field 'prompt_cache_count'")


def test_every_swap_and_hook_of_kvstore_is_in_the_table() -> None:
    """The names serve.py, tenants.py, metrics.py, prefill.py and seam.py touch on
    ``server`` appear in the table (a new use must be listed)."""
    import inspect
    import re

    from kvstore.mlx_lm import metrics, prefill, serve, tenants

    listed = {n for n, _, _ in RELIED_ON}
    used = set()
    for mod in (serve, tenants, metrics, prefill, seam):
        src = inspect.getsource(mod)
        used |= set(re.findall(r"\bserver\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)", src))
        used |= {f"{a}.{b}" for a, b in re.findall(
            r"_swapped\(server\.(\w+), \"(\w+)\"", src)}
        used |= {a for a in re.findall(r"_swapped\(server, \"(\w+)\"", src)}
    used = {u for u in used if hasattr(mlx_lm.server, u.split(".")[0])
            and u.split(".")[0] not in ("py",)}
    # attributes of an instance (the handler's, the generator's) are not module names
    missing = sorted(u for u in used if u not in listed
                     and u.split(".")[0] not in listed)
    assert not missing, missing
