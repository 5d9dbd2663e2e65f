"""Every case of the shared codec suite through ``verify --read-data`` and ``--repair``
(issue 17, item 1): a root holding one entry of each cache kind verifies sound, a bad
block of each is found, and repair keeps what is intact with exact refcounts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_mlxlm_codecs import CASES

import kvstore

NS = kvstore.Namespace(model_id="codec-suite-verify")
T = 16


def _cli(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


def _block_file(root: Path, digest: bytes) -> Path:
    hx = digest.hex()
    return root / "blocks" / hx[:2] / hx


def test_every_codec_case_through_verify_read_data_and_repair(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ids: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    with kvstore.Store.open(root, namespace=NS, block_tokens=T, durable=False) as s:
        for i, (name, (build, n)) in enumerate(sorted(CASES.items())):
            tokens[name] = [1000 * (i + 1) + j for j in range(n)]
            ids[name] = s.save(tokens[name], build(n)).id
    sound = _cli("verify", "--read-data", "--json", "--root", root, cwd=tmp_path)
    assert sound.returncode == 0, sound.stderr
    assert json.loads(sound.stdout)["report"]["entries"] == len(CASES)
    nothing = _cli("verify", "--read-data", "--repair", "--root", root, cwd=tmp_path)
    assert nothing.returncode == 0 and "nothing needed repair" in nothing.stdout, nothing

    # spoil the last block of every entry (a token block where it has any, else a window block)
    bad: dict[str, bytes] = {}
    with kvstore.Store.open(root, create=False) as s:
        for name, eid in ids.items():
            m = s.manifest(eid)
            d = bytes((m.token_blocks or m.window_blocks or m.state_blocks)[-1])
            bad[name] = d
    for d in set(bad.values()):
        path = _block_file(root, d)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    found = _cli("verify", "--read-data", "--json", "--root", root, cwd=tmp_path)
    assert found.returncode == 1, found.stderr
    assert sorted(json.loads(found.stdout)["report"]["corrupt_blocks"]) == sorted(
        d.hex() for d in set(bad.values()))
    fixed = _cli("verify", "--read-data", "--repair", "--json", "--root", root, cwd=tmp_path)
    assert "Traceback" not in fixed.stderr, fixed.stderr
    plan = json.loads(fixed.stdout)["report"]["plan"]
    assert sorted(plan["quarantine"]) == sorted(d.hex() for d in set(bad.values()))
    after = _cli("verify", "--read-data", "--json", "--root", root, cwd=tmp_path)
    assert after.returncode == 0, after.stdout  # refcounts, keys and totals exact again

    with kvstore.Store.open(root, create=False) as s:
        cut = {c["entry"]: c["n_tokens"] for c in plan["cut"]}
        for name, eid in ids.items():
            cache, n = s.restore(tokens[name], namespace=NS)
            if eid in cut:  # a trimmable entry keeps its intact full blocks
                assert n == cut[eid] and n % T == 0 and cache is not None
            else:
                assert eid in plan["drop"] and (cache, n) == (None, 0), name
        # an entry of at least two token blocks that can be trimmed is cut, not dropped
        assert ids["kv-bf16"] in cut and cut[ids["kv-bf16"]] == 64
