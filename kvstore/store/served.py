"""What the store says of the requests it serves: their per-tier counts (:mod:`.usage`),
why one missed (:mod:`.diagnose`), and how much of a prompt the root already holds.
Mixed into :class:`~kvstore.store.Store`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..blocks import LocalBlockStore
from ..index import Index
from ..schema import Namespace
from .access import AccessLog
from .counters import StoreCounters
from .diagnose import Diagnosis
from .usage import Usage, check_request, read_usage, reset_usage

if TYPE_CHECKING:
    from .keys import TokenKeys
    from .lookup import Match
    from .tiered import RemoteLink


class Served:
    """Mixed into :class:`~kvstore.store.Store`."""

    index: Index
    blocks: LocalBlockStore
    _access: AccessLog
    _bisect: bool
    _link: RemoteLink | None
    if TYPE_CHECKING:

        def flush_access(self) -> None: ...
        def _check_writable(self, what: str) -> None: ...
        def _ns(self, namespace: Namespace | None) -> Namespace: ...
        def _keys(self, tokens: Any, ns: Namespace) -> TokenKeys: ...
        def _find(self, tokens: Any, namespace: Namespace | None, *, remote: bool = True
                  ) -> Match | None: ...

    counters: StoreCounters  # this process's counts of what the store did (Store.__init__)
    _diagnosis: Diagnosis

    def note_request(self, prompt_tokens: int, reused_tokens: int = 0, tier: str | None = None,
                     *, miss: str | None = None) -> None:
        """Count one served request in the root's per-tier request counts.

        ``tier`` (``memory``, ``local`` or ``remote``) gave the ``reused_tokens`` leading
        tokens of a prompt of ``prompt_tokens``; ``miss`` is why it reused nothing or
        less than it might have (:data:`kvstore.store.usage.MISS_REASONS`).
        :meth:`restore` and :class:`~kvstore.mlx_lm.PersistentPromptCache` count their own
        requests; a caller that serves prompts through :meth:`lookup` and :meth:`load`
        reports its own here. The counts are written within a second (``kvstore stats``).
        """
        check_request(prompt_tokens, reused_tokens, tier, miss)
        self._access.note_request(prompt_tokens, reused_tokens, tier if reused_tokens else None,
                                  miss)

    def usage(self) -> Usage:
        """The root's request counts, over its lifetime and since the last reset."""
        self.flush_access()
        return read_usage(self.index)

    def reset_usage(self) -> Usage:
        """Start the root's since-reset request counts anew; returns them as they were."""
        self._check_writable("reset the request counts")
        self.flush_access()
        return reset_usage(self.index)

    def quarantined_blocks(self) -> int:
        """How many blocks ``quarantine/`` holds (moved aside by restores, ``verify --repair``)."""
        return self.blocks.quarantined()

    def stored_prefix(self, tokens: Any, *, namespace: Namespace | None = None) -> int:
        """How many leading tokens of ``tokens`` a local entry can serve (0: none).

        Neither counted as a lookup nor asked of the remote: for deciding what to save.
        """
        match = self._find(tokens, namespace, remote=False)
        return match.length if match is not None else 0

    def miss_reason(self, tokens: Any, *, namespace: Namespace | None = None,
                    reused: int = 0) -> str | None:
        """Why the store gave no more than ``reused`` leading tokens of ``tokens``
        (:meth:`kvstore.store.diagnose.Diagnosis.reason`); None when it holds no more."""
        link = self._link
        return self._diagnosis.reason(tokens, self._ns(namespace), reused, bisect=self._bisect,
                                      remote_down=link is not None and link.unavailable)
