"""Every path, command, module and section the README and docs/ name exists: a reader who
follows one finds it. (The docs named `vectors/bunhash.json`, which is
`tests/data/bunhash.json`, and a moved module; nothing caught it.)

What counts as named:

- a repository path in backticks (`kvstore/…`, `tests/…`, `tools/…`, `docs/…`, `.ci/…`),
  and a file name in backticks ending in ``.py``, ``.sh``, ``.c``, ``.pyi``, ``.md``,
  ``.png`` or ``.toml`` (``local/gc.py``, ``warm.py``), or a ``.json`` with its folder
  (``vectors/bunhash.json``): some tracked file ends with it;
- a relative Markdown link, and its ``#anchor`` (GitHub's heading slugs);
- a ``kvstore …`` command in backticks or a shell block: its subcommands exist and so
  does every ``--option`` after them (``serve`` passes options on to mlx-lm: not checked);
- a dotted name ``kvstore.x.y``: a module, then attributes of it;
- a section named as ``FILE.md, "Heading"``: a heading of FILE.md starts with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
IDS = [p.relative_to(REPO).as_posix() for p in DOCS]

#: Words after ``kvstore`` that are not a command: the request log line's prefix
#: (``kvstore request id=7 …``) and a domain-separation string of FORMAT.md.
NOT_COMMANDS = {"request", "block"}
_FILE = r"[\w.-]*\w\.(?:py|sh|c|pyi|md|png|toml)"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _spans(text: str) -> list[str]:
    """The inline code spans, and each line of the shell code blocks."""
    blocks = re.findall(r"^```(?:sh|bash|console)\n(.*?)^```", text, re.S | re.M)
    inline = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", inline) + [ln for b in blocks for ln in b.splitlines()]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.split()


def named_paths(text: str) -> set[str]:
    found: set[str] = set()
    for span in _spans(text):
        for m in re.finditer(r"(?<![\w./~<>$-])((?:kvstore|tests|tools|docs|\.ci)/[\w./-]*)",
                             span):
            if not re.match(r"[<*…]", span[m.end():m.end() + 1]):
                found.add(m.group(1).rstrip("."))
        for m in re.finditer(rf"(?<![\w./~<>$-])((?:[\w.-]+/)*{_FILE})(?![\w/<*])", span):
            found.add(m.group(1))
        for m in re.finditer(r"(?<![\w./~<>$-])((?:[\w.-]+/)+[\w.-]*\w\.json)(?![\w/])", span):
            found.add(m.group(1))  # a JSON file with its folder: a repository file
    return found


def path_exists(path: str, tracked: list[str]) -> bool:
    if (REPO / path).exists():
        return True
    if re.search(rf"{_FILE}$", path) or path.endswith(".json"):
        return any(t == path or t.endswith("/" + path) for t in tracked)
    return False


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.S | re.M)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def has_section(path: Path, name: str) -> bool:
    """Whether a heading of ``path`` starts with ``name`` (its number, ``7.``, aside)."""
    name = name.replace("`", "")
    return any(re.sub(r"^\d+\. ", "", h.replace("`", "")).startswith(name)
               for h in headings(path))


def named_links(path: Path) -> list[tuple[Path, str]]:
    """Relative links: (target, anchor or "")."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(path)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve() if file else path, anchor))
    return out


def _resolve(words: list[str]) -> tuple[Any, list[str], list[str]]:
    from kvstore.cli import cli

    cmd: Any = cli
    path: list[str] = []
    i = 0
    while isinstance(cmd, click.Group) and i < len(words) and words[i] in cmd.commands:
        cmd = cmd.commands[words[i]]
        path.append(words[i])
        i += 1
    return cmd, path, words[i:]


def named_commands(text: str) -> list[list[str]]:
    """The words after ``kvstore`` of each command named, the group's options dropped."""
    out = []
    for span in _spans(text):
        for m in re.finditer(r"(?<![\w./$=-])kvstore((?: +[^\s|;&)`\"']+)*)", span):
            words = m.group(1).split()
            while words and words[0].startswith("-"):  # the group's --root R, --remote URL
                if words.pop(0) in ("--root", "--remote") and words:
                    words.pop(0)
            if words and re.fullmatch(r"[a-z][a-z-]*", words[0]) \
                    and words[0] not in NOT_COMMANDS:
                out.append(words)
    return out


def command_problem(words: list[str]) -> str | None:
    from kvstore.cli import cli

    cmd, path, rest = _resolve(words)
    if not path:
        return f"no command {words[0]!r}"
    if isinstance(cmd, click.Group) and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) \
            and rest[0] not in ("and", "or", "is", "the", "a", "to", "with", "on", "of"):
        return f"no command {' '.join(path)} {rest[0]}"
    if path[0] == "serve":
        return None  # its options are mlx_lm.server's too
    known = {o for p in [*cmd.params, *cli.params] for o in p.opts} | {"--help", "-h"}
    for w in rest:
        opt = w.split("=")[0].rstrip(".,:")
        if re.fullmatch(r"--[a-z][a-z-]*", opt) and opt not in known:
            return f"'kvstore {' '.join(path)}' has no option {opt}"
    return None


def named_modules(text: str) -> set[str]:
    return {m.group(1) for span in _spans(text)
            for m in re.finditer(r"(?<![\w./<$-])(kvstore(?:\.[A-Za-z_]\w*)+)(?![\w(/-])", span)
            if not re.search(r"\.(json|md|py|toml)$", m.group(1))}


def module_problem(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        obj: Any = importlib.import_module(mod)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:i])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def named_sections(text: str) -> list[tuple[str, str]]:
    """``(FILE.md, heading)`` of each ``FILE.md, "Heading"`` or ``FILE.md ("Heading")``."""
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"(?:docs/)?([A-Z]+\.md),? \(?\"([^\"]+)\"", " ".join(text.split()))]


# --- the checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_path_named_exists(doc: Path) -> None:
    tracked = _tracked()
    missing = sorted(p for p in named_paths(_text(doc)) if not path_exists(p, tracked))
    assert missing == [], f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_link_and_its_anchor_resolve(doc: Path) -> None:
    bad = []
    for target, anchor in named_links(doc):
        if not target.exists():
            bad.append(f"{target.relative_to(REPO)} does not exist")
        elif anchor and target.suffix == ".md" and anchor not in {slug(h) for h in
                                                                  headings(target)}:
            bad.append(f"{target.name} has no heading #{anchor}")
    assert bad == [], f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_command_named_exists_with_its_options(doc: Path) -> None:
    bad = [f"kvstore {' '.join(w)}: {why}" for w in named_commands(_text(doc))
           if (why := command_problem(w)) is not None]
    assert bad == [], f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_module_and_name_named_exists(doc: Path) -> None:
    bad = [f"{m}: {why}" for m in sorted(named_modules(_text(doc)))
           if (why := module_problem(m)) is not None]
    assert bad == [], f"{doc.name}: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_every_section_named_exists(doc: Path) -> None:
    bad = []
    for file, heading in named_sections(_text(doc)):
        target = REPO / ("README.md" if file == "README.md" else f"docs/{file}")
        if not has_section(target, heading):
            bad.append(f'{file}, "{heading}"')
    assert bad == [], f"{doc.name} names sections that do not exist: {bad}"


def test_the_checks_find_what_is_missing(tmp_path: Path) -> None:
    """Each check fails on a made-up name (so a check that finds nothing is not blind)."""
    tracked = _tracked()
    text = ("`tools/no_such_tool.py`, `local/nothing.py`, `kvstore/gc.py`, "
            "`vectors/bunhash.json`, "
            "`kvstore gc`, `kvstore compact --budget 10G`, `kvstore remote list`, "
            "`kvstore.mlx_lm.gguf.fetch_everything`, `kvstore.nowhere`, "
            'docs/BENCHMARKS.md, "Nothing here"')
    assert {p for p in named_paths(text) if not path_exists(p, tracked)} == {
        "tools/no_such_tool.py", "local/nothing.py", "kvstore/gc.py", "vectors/bunhash.json"}
    assert [command_problem(w) for w in named_commands(text)] == [
        "no command 'gc'", "'kvstore compact' has no option --budget",
        "no command remote list"]
    assert [module_problem(m) for m in sorted(named_modules(text))] == [
        "kvstore.mlx_lm.gguf has no 'fetch_everything'", "kvstore has no 'nowhere'"]
    assert named_sections(text) == [("BENCHMARKS.md", "Nothing here")]
    assert not has_section(REPO / "docs" / "BENCHMARKS.md", "Nothing here")
    assert has_section(REPO / "docs" / "FORMAT.md", "Trust and security")  # "7. Trust…"
    doc = tmp_path / "x.md"
    doc.write_text("[a](CLI.md#no-such-heading) [b](missing.md)\n")
    assert [(t.name, a) for t, a in named_links(doc)] == [("CLI.md", "no-such-heading"),
                                                          ("missing.md", "")]
    assert slug("`kvstore serve` as a service: the request log, `/metrics`") == \
        "kvstore-serve-as-a-service-the-request-log-metrics"
    assert slug("7. Trust and security") == "7-trust-and-security"


# --- the figures of a real model are of the conversion users get ------------------------------

_UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "MiB": 2**20, "GiB": 2**30, "KiB": 2**10}


def _amount(cell: str) -> float:
    m = re.match(r"([\d.,]+) (µs|ms|s|KiB|MiB|GiB)\b", cell.strip())
    assert m is not None, cell
    return float(m.group(1).replace(",", "")) * _UNITS[m.group(2)]


def test_the_real_model_figures_are_of_the_conversion_users_get() -> None:
    """The README's SmolLM2 table came from a conversion `kvstore model fetch` no longer
    makes (float32). Every figure in it is one of docs/BENCHMARKS.md's "Real model", whose
    rows name the directory `kvstore model fetch smollm2` converts into today."""
    from kvstore.models import MODELS

    bench = _text(REPO / "docs" / "BENCHMARKS.md")
    rows = [cells for ln in bench.splitlines() if ln.startswith("| ")
            if re.search(r"\(SmolLM2[^ ()]*\)$",
                         (cells := [c.strip() for c in ln.strip().strip("|").split("|")])[0])]
    assert len(rows) >= 6
    assert all(r[0].endswith(f"({MODELS['smollm2'].dirname})") for r in rows), [
        r[0] for r in rows]
    readme = _text(REPO / "README.md")
    table = readme[readme.index("| SmolLM2-135M-Instruct | kvstore |"):]
    ours = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in table.splitlines()[2:] if ln.startswith("|")]
    assert len(ours) == 5
    section = bench[bench.index("\n## Real model"):]
    section = section[:section.index("\n## ", 1)]
    figures = [_amount(m.group(0)) for m in
               re.finditer(r"[\d.,]*\d (?:µs|ms|s|KiB|MiB|GiB)\b", section)]
    for r in ours:
        for cell in r[1:3]:
            v = _amount(cell)
            assert any(abs(v - f) <= 0.006 * f for f in figures), (r[0], cell)
