"""``kvstore demo`` runs offline and its second process reuses the first one's cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvstore
from kvstore.demo import run_demo


def test_demo_reuses_across_processes(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    assert run_demo(root) == 0
    out = capfd.readouterr().out
    rows = [line for line in out.splitlines() if "reused" in line]
    assert len(rows) == 7
    reused = [int(m.group(1)) for m in (re.search(r"reused\s+(\d+)", r) for r in rows) if m]
    assert reused[0] == 0 and all(n > 1000 for n in reused[1:])
    second = rows[-1]
    assert second.startswith("2nd process") and "(disk" in second
    with kvstore.Store.open(root) as store:
        stats = store.stats()
    assert stats.entries == 7 and stats.dedup_ratio > 2


def test_demo_quiet_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_demo(tmp_path / "root", quiet=True) == 0
    assert capfd.readouterr().out == ""
