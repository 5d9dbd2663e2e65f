"""The remote benchmark group runs end to end against the real gateway in its smoke size
(never a timing check: the rows exist, with finite figures, and leave nothing behind)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstore.bench import main
from kvstore.remote.s3 import S3Client


def test_remote_group_writes_its_rows_and_cleans_up(url: str, bucket: str,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--config", "smoke", "--only", "remote", "--remote", url,
                 "--json", str(out), "--scratch", str(tmp_path)]) == 0
    doc = json.loads(out.read_text())
    names = [r["name"] for r in doc["rows"]]
    for want in ("push 600 tokens", "pull-restore 600 tokens",
                 "time to first token on a second machine, 300 tokens"):
        assert any(n.startswith(want) for n in names), f"no row {want!r} in {names}"
    for r in doc["rows"]:
        assert r["group"] == "remote"
        assert math.isfinite(r["ratio"]) and r["kvstore"] > 0 and r["baseline"] > 0, r
    held = {t["name"] for t in doc["targets"]}
    assert any(t.startswith("remote: push") for t in held)
    assert any(t.startswith("remote: time to first token") for t in held)
    c = S3Client(bucket)
    try:
        assert [o.key for o in c.list("")] == [], "the bench left objects in the bucket"
    finally:
        c.close()
    assert list(tmp_path.iterdir()) == [out], "the scratch roots were not removed"


def test_remote_group_without_a_url_is_skipped_with_a_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVSTORE_REMOTE", raising=False)
    assert main(["--config", "smoke", "--only", "remote", "--scratch", str(tmp_path)]) == 0
    assert "[remote] skipped: no --remote URL and no $KVSTORE_REMOTE" in capsys.readouterr().out


def test_kvstore_bench_takes_the_remote_from_its_option_and_from_the_global_one(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main as cli

    monkeypatch.delenv("KVSTORE_REMOTE", raising=False)
    for argv in (["bench", "--remote", url], ["--remote", url, "bench"]):
        out = tmp_path / f"{len(argv[0])}.json"
        assert cli([*argv, "--config", "smoke", "--only", "remote", "--scratch",
                    str(tmp_path), "--json", str(out)]) == 0, argv
        assert f"[remote] {url}" in capsys.readouterr().out
        assert {r["group"] for r in json.loads(out.read_text())["rows"]} == {"remote"}
