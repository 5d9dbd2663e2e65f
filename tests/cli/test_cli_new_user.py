"""What a new user met on the command line: ``model fetch`` of a name it does not know,
``compact`` without a budget, ``--remote`` where it does nothing, ``stats`` that said one
figure twice, and ``model fetch`` of a model already there paying for MLX's import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import Root, assert_user_error, run, run_here

from kvstore.models import CONVERTED_MARKER, MODELS

# --- model fetch of a name it does not know ------------------------------------------------


def test_model_fetch_of_an_unknown_name_names_the_known_ones_and_what_to_give(
        tmp_path: Path) -> None:
    r = run("model", "fetch", "llama", env={"KVSTORE_MODELS": str(tmp_path / "models")})
    assert_user_error(r)
    assert r.err == (
        "kvstore: error: no model named 'llama' to fetch; kvstore fetches smollm2 "
        f"({MODELS['smollm2'].description}). For another model, give its mlx-lm directory "
        "or a Hugging Face Hub id to 'kvstore serve --model' ('kvstore demo' and 'kvstore "
        "bench' take --model DIR)\n")
    assert not (tmp_path / "models").exists()  # nothing fetched, nothing made


def test_model_fetch_help_names_the_models_it_knows(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    assert main(["model", "fetch", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "NAME is smollm2 (SmolLM2-135M-Instruct" in out
    assert "give its mlx-lm directory or a Hugging Face Hub id to 'kvstore serve --model'" in out


# --- model fetch of a model already there ----------------------------------------------------

_FOUND = """\
import sys
from kvstore.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "pip")
               or m.startswith("kvstore.mlx_lm"))
print("CODE", code, "HEAVY", heavy)
"""


def _converted(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}\n")
    (d / CONVERTED_MARKER).write_text(json.dumps({"source": "x.gguf", "complete": True}))
    return d


@pytest.mark.parametrize("where", ["cache", "dir"])
def test_a_converted_model_is_printed_without_loading_mlx_or_pip(tmp_path: Path,
                                                                 where: str) -> None:
    """``--model "$(kvstore model fetch smollm2)"`` pays this at every start: a model already
    converted is found by its files, and nothing of MLX, mlx-lm or pip is imported."""
    models = tmp_path / "models"
    d = _converted(models / MODELS["smollm2"].dirname if where == "cache"
                   else tmp_path / "mine")
    args = ["model", "fetch", "smollm2", *([] if where == "cache" else [str(d)])]
    env = {**os.environ, "KVSTORE_MODELS": str(models)}
    p = subprocess.run([sys.executable, "-P", "-c", _FOUND, *args], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    assert p.stdout == f"{d}\nCODE 0 HEAVY []\n"


def test_only_a_whole_conversion_is_taken_for_one(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its marker says complete, and a config is there: else ``model fetch`` converts."""
    from kvstore.models import cached_model, converted

    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))
    d = _converted(tmp_path / "models" / MODELS["smollm2"].dirname)
    assert converted("smollm2") == cached_model("smollm2") == converted("smollm2", d) == d
    (d / CONVERTED_MARKER).write_text(json.dumps({"source": "x.gguf", "complete": False}))
    assert converted("smollm2", d) is None and cached_model("smollm2") is None
    (d / CONVERTED_MARKER).write_text(json.dumps({"source": "x.gguf", "complete": True}))
    (d / "config.json").unlink()
    assert converted("smollm2", d) is None
    (d / "config.json").write_text("{}\n")
    (d / CONVERTED_MARKER).write_text("[1, 2]")  # not a marker kvstore wrote
    assert converted("smollm2", d) is None


# --- compact without a budget ------------------------------------------------------------------


def test_compact_without_a_budget_says_so_and_what_it_swept(fresh_root: Root) -> None:
    root = str(fresh_root.path)
    r = run_here("compact", "--root", root)
    assert (r.code, r.err) == (0, "")
    hint = (f"no budget given, so no entry was evicted ('kvstore compact --max-bytes SIZE "
            f"--root {root}', e.g. 10G, evicts the least recently used entries until the "
            "root fits)")
    lines = r.out.splitlines()
    assert lines[:2] == [hint, "nothing to sweep: no block unreferenced for over 600 s (the "
                               "grace), no orphan block file, no stale temp file"]
    assert re.fullmatch(r"on disk: [\d.]+ KiB", lines[2]) and len(lines) == 3, r.out
    # an entry removed: its blocks wait for the grace, and compact says until when
    assert run_here("rm", fresh_root.ids["a90"], "--root", root, "-q").code == 0
    r = run_here("compact", "--root", root)
    lines = r.out.splitlines()
    assert lines[1].startswith("nothing to sweep") and len(lines) == 4, r.out
    assert re.fullmatch(r"unreferenced: [\d.]+ KiB in 2 blocks kept by the 600 s grace until "
                        r".*'kvstore compact --grace 0 --root .*' frees them now\)", lines[2])
    # what --grace 0 would sweep, then sweeps
    r = run_here("compact", "--root", root, "--grace", "0", "--dry-run")
    lines = r.out.splitlines()
    assert lines[0] == "dry run: nothing was changed; compact would do this:"
    assert lines[1] == hint.replace("was evicted", "would be evicted")
    assert re.fullmatch(r"would sweep 2 unreferenced blocks \([\d.]+ KiB\)", lines[2]), r.out
    assert re.fullmatch(r"on disk: [\d.]+ KiB, [\d.]+ KiB after", lines[3]) and len(lines) == 4
    r = run_here("compact", "--root", root, "--grace", "0")
    lines = r.out.splitlines()
    assert re.fullmatch(r"swept 2 unreferenced blocks \([\d.]+ KiB\)", lines[1]), r.out
    assert re.fullmatch(r"on disk: [\d.]+ KiB, [\d.]+ KiB before", lines[2]) and len(lines) == 3


def test_compact_with_a_budget_reports_as_before(fresh_root: Root) -> None:
    r = run_here("compact", "--root", fresh_root.path, "--max-bytes", "10G")
    assert r.code == 0 and "no budget given" not in r.out
    assert re.search(r"^physical before\s+[\d.]+ KiB$", r.out, re.M), r.out


# --- --remote where it acts, and nowhere else ----------------------------------------------------


def _commands() -> dict[str, set[str]]:
    import click

    from kvstore.cli import cli

    out: dict[str, set[str]] = {}

    def walk(group: click.Group, prefix: str) -> None:
        for name, c in group.commands.items():
            if isinstance(c, click.Group):
                out[f"{prefix}{name}"] = {o for p in c.params for o in p.opts}
                walk(c, f"{prefix}{name} ")
            else:
                out[f"{prefix}{name}"] = {o for p in c.params for o in p.opts}

    walk(cli, "")
    return out


def test_remote_is_offered_by_the_commands_that_use_it_alone() -> None:
    from kvstore.cli._util import REMOTE_COMMANDS

    offered = {c for c, o in _commands().items() if "--remote" in o}
    assert offered == {c for c in _commands() if c.split(" ")[0] in REMOTE_COMMANDS}
    assert {"ls", "compact", "demo", "show", "stats", "verify"}.isdisjoint(offered)


@pytest.mark.parametrize("argv", [["ls", "--remote", "s3://b/p"],
                                  ["compact", "--remote", "s3://b/p"]])
def test_remote_given_to_a_local_command_is_an_error(fresh_root: Root, argv: list[str]) -> None:
    r = run_here(*argv, "--root", fresh_root.path)
    assert_user_error(r, "No such option '--remote'", f"see 'kvstore {argv[0]} --help'")


@pytest.mark.parametrize("command", ["ls", "stats", "demo", "model"])
def test_the_groups_remote_before_a_local_command_is_an_error(fresh_root: Root,
                                                              command: str) -> None:
    r = run_here("--remote", "s3://b/p", "--root", fresh_root.path, command)
    assert_user_error(r)
    assert r.err == (f"kvstore: error: --remote goes with push, pull, remote, serve or bench; "
                     f"'kvstore {command}' does not use the remote tier (see 'kvstore "
                     "--help')\n")


def test_the_readme_says_which_commands_take_remote() -> None:
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    m = re.search(r"`--remote URL` \(default `\$KVSTORE_REMOTE`\) goes with (.*?) alone", text)
    assert m is not None
    from kvstore.cli._util import REMOTE_COMMANDS

    assert set(re.findall(r"`([a-z]+)`", m.group(1))) == set(REMOTE_COMMANDS)


# --- stats: each figure once, the lookups beside the requests explained ---------------------------


def test_stats_says_tokens_saved_once_and_why_lookups_are_not_requests(tmp_path: Path) -> None:
    from kvstore import Namespace, Store

    root = tmp_path / "root"
    with Store.open(root, block_tokens=16, namespace=Namespace(model_id="m")) as s:
        s.note_request(571, 570, "local")
        s.note_request(300, 250, "memory")
        s.note_request(100, 0, miss="no_entry")
        s.lookup(list(range(40)))  # one lookup: the three requests above made none
    r = run_here("stats", "--root", root)
    assert (r.code, r.err) == (0, "")
    assert r.out.count("84.4% (820 of 971 prompt tokens)") == 1, r.out
    assert re.search(r"^tokens saved\s+84\.4% \(820 of 971 prompt tokens\)$", r.out, re.M)
    assert re.search(r"^store lookups\s+1 lookup, 0 loaded an entry \(0\.0%\), for 3 requests: "
                     r"a request that memory answered in full looked nothing up in the root$",
                     r.out, re.M), r.out
    assert "  tokens saved" not in r.out
    # after a reset the headline gives both shares, once each
    run_here("stats", "--root", root, "--reset", "-q")
    with Store.open(root) as s:
        s.note_request(200, 150, "remote")
    r = run_here("stats", "--root", root)
    assert re.search(r"^tokens saved\s+82\.8% \(970 of 1,171 prompt tokens\); since the reset "
                     r"\(.*\): 75\.0% \(150 of 200 prompt tokens\)$", r.out, re.M), r.out
    assert "  tokens saved" not in r.out


def test_stats_lookups_beyond_the_requests_are_explained(tmp_path: Path) -> None:
    from kvstore import Namespace, Store

    root = tmp_path / "root"
    with Store.open(root, block_tokens=16, namespace=Namespace(model_id="m")) as s:
        s.note_request(100, 0, miss="no_entry")
        s.lookup(list(range(40)))
        s.lookup(list(range(40)))
    r = run_here("stats", "--root", root)
    assert re.search(r"^store lookups\s+2 lookups, 0 loaded an entry \(0\.0%\), for 1 request: "
                     r"a restore whose entry went bad looks again, and a lookup of the Python "
                     r"API alone is no request$", r.out, re.M), r.out
