"""A prompt cache's observer that keeps what it was told (tests of PersistentPromptCache's
per-request records)."""

from __future__ import annotations

from typing import Any

from kvstore.mlx_lm.requests import CacheObserver, RequestRecord


class Seen(CacheObserver):
    """The records of the requests opened (``fetched``) and finished, and the saves done."""

    def __init__(self) -> None:
        self.opened: list[RequestRecord] = []
        self.done: list[RequestRecord] = []
        self.saves: list[Any] = []

    def fetched(self, rec: RequestRecord) -> None:
        self.opened.append(rec)

    def finished(self, rec: RequestRecord) -> None:
        self.done.append(rec)

    def saved(self, done: object) -> None:
        self.saves.append(done)
