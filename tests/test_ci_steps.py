"""CI's steps (``.ci/run``) partition the tests: every test runs in exactly one step (the
README's default suite or one ``marked`` group), and a test that needs the S3 gateway runs
only in the step that starts it. A stop once failed because a test both ``slow`` and
``remote`` ran in the slow step, before the gateway was up.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARKERS = ("slow", "model", "remote", "agents")

#: Collects every test with its markers, in a fresh interpreter (the suite's own options
#: would deselect the marked tests).
COLLECT = """
import json, sys, pytest
class P:
    items = []
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        P.items = [[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in items]
rc = pytest.main(["--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                  "tests"], plugins=[P()])
sys.stdout.write("\\n@@" + json.dumps(P.items))
sys.exit(rc)
"""


def selects(expr: str, markers: set[str]) -> bool:
    """pytest's ``-m`` expressions of this project use only names, ``and``, ``or``,
    ``not`` and parentheses, which Python evaluates the same way."""
    names = set(re.findall(r"[A-Za-z_]\w*", expr)) - {"and", "or", "not"}
    assert names <= set(MARKERS), f"unknown marker in {expr!r}: {names - set(MARKERS)}"
    return bool(eval(expr, {"__builtins__": {}}, {m: m in markers for m in MARKERS}))


def ci_steps() -> dict[str, str]:
    """The default suite's expression (pyproject's addopts) and each ``marked`` step's."""
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    args = shlex.split(addopts)
    steps = {"default": args[args.index("-m") + 1]}
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["marked"]:
            assert "-m" in words, line
            steps[words[words.index("-m") + 1]] = words[words.index("-m") + 1]
    return steps


@pytest.fixture(scope="module")
def collected() -> list[tuple[str, set[str]]]:
    r = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    items = json.loads(r.stdout.rsplit("\n@@", 1)[1])
    return [(nodeid, set(marks)) for nodeid, marks in items]


def test_every_test_runs_in_exactly_one_ci_step(collected: list[tuple[str, set[str]]]) -> None:
    steps = ci_steps()
    assert len(steps) == 5, steps  # the default suite, slow, model, agents, remote
    assert len(collected) > 1000
    wrong = {}
    for nodeid, marks in collected:
        ran = [name for name, expr in steps.items() if selects(expr, marks)]
        if len(ran) != 1:
            wrong[nodeid] = ran
    assert not wrong, wrong


def test_only_the_gateway_step_runs_a_test_that_needs_the_gateway(
    collected: list[tuple[str, set[str]]],
) -> None:
    gateway = [n for n, _ in collected if n.startswith("tests/remote/")]
    assert len(gateway) > 100
    steps = ci_steps()
    for nodeid, marks in collected:
        if nodeid.startswith("tests/remote/"):
            ran = [name for name, expr in steps.items() if selects(expr, marks)]
            assert ran == ["remote"], (nodeid, ran)
    # the reproduction: slow and remote at once
    both = [n for n, m in collected if {"slow", "remote"} <= m]
    assert both, "the case this guards against is gone; keep one such test or drop this line"


def test_the_expression_reader_agrees_with_pytest() -> None:
    assert selects("slow and not remote", {"slow"})
    assert not selects("slow and not remote", {"slow", "remote"})
    assert selects("not slow and not model and not remote", set())
    assert not selects("not slow and not model and not remote", {"model"})
    assert selects("agents and not remote", {"agents"})
    assert not selects("not slow and not model and not remote and not agents", {"agents"})
    with pytest.raises(AssertionError, match="unknown marker"):
        selects("gpu", set())
