"""What the store says of the requests it serves: their per-tier counts
(:mod:`.usage`), why one missed (:mod:`.diagnose`), and how much of a prompt the
root already holds. A part of :class:`~kvstore.store.Store` (``store.served``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..catalog import keys as P
from ..local import Root
from ..schema import Namespace
from .access import AccessLog
from .diagnose import Diagnosis
from .tiers import Tiers
from .usage import Usage, check_request, read_usage, reset_usage


class Served:
    """The request counts and miss reasons of one store."""

    def __init__(self, root: Root, access: AccessLog, tiers: Tiers,
                 keys_for: Callable[[Any, Namespace], P.TokenKeys]) -> None:
        self.root = root
        self.access = access
        self.tiers = tiers
        self.diagnosis = Diagnosis(root.catalog, keys_for)

    def note_request(self, prompt_tokens: int, reused_tokens: int, tier: str | None,
                     miss: str | None) -> None:
        """Count one served request (:meth:`kvstore.store.Store.note_request`)."""
        check_request(prompt_tokens, reused_tokens, tier, miss)
        self.access.note_request(prompt_tokens, reused_tokens, tier if reused_tokens else None,
                                 miss)

    def usage(self) -> Usage:
        """The root's request counts, over its lifetime and since the last reset."""
        self.access.flush()
        return read_usage(self.root)

    def reset_usage(self) -> Usage:
        """Start the root's since-reset request counts anew; returns them as they were."""
        self.access.flush()
        return reset_usage(self.root)

    def miss_reason(self, tokens: Any, ns: Namespace, reused: int) -> str | None:
        """Why the store gave no more than ``reused`` leading tokens of ``tokens``
        (:meth:`kvstore.store.diagnose.Diagnosis.reason`); None when it holds no more."""
        return self.diagnosis.reason(tokens, ns, reused, remote_down=self.tiers.unavailable)

    def parting(self, tokens: Any, ns: Namespace) -> tuple[int, list[int] | None]:
        """The tokens the deepest local entry shares with ``tokens``, and its next ones
        (:meth:`kvstore.store.diagnose.Diagnosis.parting`)."""
        return self.diagnosis.parting(tokens, ns)


__all__ = ["Served"]
