"""``kvstore --help`` and every subcommand's ``--help``: options with one-line descriptions.

The top level runs as a subprocess; the subcommands' help, which only click
renders, runs in-process through ``kvstore.cli.main`` to keep this fast.
"""

from __future__ import annotations

import re

import pytest
from cli_helpers import Result, run_many

from kvstore.cli import main

COMMANDS = {
    "init": ["--hash", "--block-tokens", "--json"],
    "stats": ["--json"],
    "ls": ["--sort", "--namespace", "--reverse", "--json"],
    "show": ["--tokens", "--json"],
    "tree": ["--namespace", "--json"],
    "rm": ["--json"],
    "compact": ["--max-bytes", "--namespace-max-bytes", "--grace", "--dry-run", "--json"],
    "verify": ["--read-data", "--repair", "--json"],
    "import": ["--json"],
    "export": ["--format", "--force", "--json"],
    "inspect": ["--tokens", "--json"],
    "bench": ["--quick", "--config", "--only", "--scratch", "--json", "--model", "--remote"],
    "demo": [],
}
COMMON = ["--root", "--quiet", "--debug", "--help"]
# bench runs in scratch roots of its own and prints its own progress: no --root, no --quiet;
# inspect reads a file, not a root (issue 27, item 13)
OWN_COMMON = {"bench": ["--debug", "--help"], "inspect": ["--quiet", "--debug", "--help"]}


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], Result]:
    return run_many([("--help",), (), ("--version",)])


def test_top_level_help_lists_every_subcommand_with_a_description(
    helps: dict[tuple[str, ...], Result],
) -> None:
    r = helps[("--help",)]
    assert r.code == 0 and r.err == ""
    for name in [*COMMANDS, "serve"]:
        line = re.search(rf"^  {name}\s+(\S.*)$", r.out, re.M)
        assert line is not None, f"{name} missing from:\n{r.out}"
        assert not line.group(1).endswith("..."), line.group(0)  # not cut short
    for opt in COMMON:
        assert opt in r.out


def test_bare_kvstore_prints_the_help(helps: dict[tuple[str, ...], Result]) -> None:
    r = helps[()]
    assert r.code == 0
    assert "Commands:" in r.out and "ls" in r.out


def test_version(helps: dict[tuple[str, ...], Result]) -> None:
    r = helps[("--version",)]
    assert r.code == 0
    assert re.fullmatch(r"kvstore \d+\.\d+\.\d+\S*\n", r.out)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_subcommand_help_lists_its_options(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: kvstore {command}")
    for opt in COMMANDS[command] + OWN_COMMON.get(command, COMMON):
        m = re.search(rf"^\s+(?:-\w, )?{re.escape(opt)}\b(.*)$", out, re.M)
        assert m is not None, f"{opt} missing from:\n{out}"
        described = m.group(1).strip() or out[m.end():].lstrip("\n").split("\n")[0].strip()
        assert described, f"{opt} has no description"


@pytest.mark.parametrize("argv", [["inspect", "--help"], ["model", "fetch", "--help"]])
def test_commands_that_touch_no_root_offer_no_root_option(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27, item 13: --root and --remote would do nothing there."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--quiet" in out and "--debug" in out
    assert "--root" not in out and "--remote" not in out


def _commands() -> dict[str, set[str]]:
    """Every command the user runs (``model fetch``, ``remote ls``, …) -> its options."""
    import click

    from kvstore.cli import cli

    out: dict[str, set[str]] = {}

    def walk(group: click.Group, prefix: str) -> None:
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                walk(cmd, f"{prefix}{name} ")
            else:
                out[f"{prefix}{name}"] = {o for p in cmd.params for o in p.opts}

    walk(cli, "")
    return out


def test_the_readme_says_which_commands_take_root_and_quiet() -> None:
    """Issue 27, item 11: the README said every command takes --root and -q; bench takes
    neither, inspect and model fetch no --root."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())

    def named(pattern: str) -> set[str]:
        m = re.search(pattern, text)
        assert m is not None, pattern
        return set(re.findall(r"`([a-z ]+)`", m.group(1)))

    cmds = _commands()
    assert named(r"Every command but (.*?) takes `--root DIR`") == {
        c for c, o in cmds.items() if "--root" not in o}
    assert named(r"every command but (.*?) takes `-q/--quiet`") == {
        c for c, o in cmds.items() if "--quiet" not in o}
    assert all("--debug" in o for o in cmds.values())
