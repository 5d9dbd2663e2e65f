"""The real coding agents, installed from npm at the versions ``package.json`` and
``package-lock.json`` beside this file pin (the one place they are named), and run headless
with the settings the README's "Coding agents" section gives, read from the README itself.

Installed once into a cache directory outside the checkout, named by a digest of the lock
file (so a new pin is a new directory, and a rerun installs nothing): ``$KVSTORE_AGENTS``
when set, else ``<user cache dir>/kvstore/agents/<digest>``. ``python tests/agents/clients.py``
installs them (CI's step does, before its tests); the tests call :func:`install` too.

A client runs in a temporary ``HOME`` with an environment of its own, nothing inherited
from the caller's but the locale: its settings from the README, and the harness's own
(``HOME``, ``PATH``, and the recorder as ``HTTPS_PROXY``/``HTTP_PROXY``, a tripwire for any
request past 127.0.0.1; opencode installs its plugin package from npm at every start, so
``npm_config_registry`` points it at a closed port on 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
README = REPO / "README.md"
PACKAGE, LOCK = HERE / "package.json", HERE / "package-lock.json"
#: Node.js the install scripts need (ESM ``import``, ``fs.cpSync``); the clients themselves
#: are native binaries. Claude Code's package names node >= 22 for a JavaScript fallback it
#: does not use where its native binary installs.
MIN_NODE = 18
#: The address the README's settings name, replaced by the recorder's in the tests.
README_ADDRESS = "127.0.0.1:8080"
CLIENTS = {"claude": "Claude Code", "codex": "Codex", "opencode": "opencode"}


class InstallError(RuntimeError):
    """npm or Node.js is missing, too old, or the install failed: the message says which."""


def versions() -> dict[str, str]:
    """The pinned version of each client package."""
    deps: dict[str, str] = json.loads(PACKAGE.read_text())["dependencies"]
    return deps


def cache_dir() -> Path:
    """Where the pinned clients are (or will be) installed."""
    digest = hashlib.sha256(PACKAGE.read_bytes() + LOCK.read_bytes()).hexdigest()[:16]
    env = os.environ.get("KVSTORE_AGENTS")
    if env:
        return Path(env).expanduser() / digest
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore")) / "agents" / digest


def _node_major() -> int:
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        raise InstallError("node and npm are needed to install the coding agents (Debian: "
                           "apt-get install nodejs npm)")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    m = re.match(r"v(\d+)\.", out.stdout.strip())
    if m is None:
        raise InstallError(f"node --version said {out.stdout.strip()!r}")
    return int(m.group(1))


def install(timeout: float = 1200.0) -> Path:
    """The directory that holds the clients' commands, installed first when they are not."""
    d = cache_dir()
    bin_dir = d / "node_modules" / ".bin"
    stamp = d / "installed"
    if stamp.is_file() and all((bin_dir / c).exists() for c in CLIENTS):
        return bin_dir
    major = _node_major()
    if major < MIN_NODE:
        raise InstallError(f"node {major} is too old for the clients' install scripts "
                           f"(need >= {MIN_NODE})")
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PACKAGE, d / "package.json")
    shutil.copyfile(LOCK, d / "package-lock.json")
    # not `npm ci`: the lock leaves out the platform packages the registry does not have
    # at a pinned version (opencode's), and `npm ci` refuses such a lock; `npm install`
    # with the lock installs what it records, integrity checked, and changes nothing
    r = subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund",
                        "--loglevel=error"], cwd=d, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise InstallError(f"npm install in {d} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    missing = [c for c in CLIENTS if not (bin_dir / c).exists()]
    if missing:
        raise InstallError(f"npm install in {d} installed no {', '.join(missing)}")
    stamp.write_text(json.dumps(versions()) + "\n")
    return bin_dir


# --- the README's settings ------------------------------------------------------------


@dataclass
class Settings:
    """A client's settings as the README gives them: environment variables (its ``export``
    lines) and files under ``HOME`` (its config blocks)."""

    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # path under HOME: text


def readme_section(text: str | None = None) -> str:
    """The README's "Coding agents" section."""
    text = README.read_text() if text is None else text
    start = text.index("\n## Coding agents\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_settings(client: str, address: str) -> Settings:
    """``client``'s settings (a key of :data:`CLIENTS`) from the README, with the server's
    address (``127.0.0.1:8080`` there) replaced by ``address``."""
    section = readme_section()
    head = f"**{CLIENTS[client]}**"
    start = section.index(head)
    nxt = min((i for i in (section.find("\n**", start + len(head)),) if i != -1),
              default=len(section))
    part = section[start:nxt]
    paths = re.findall(r"`~/([^`]+)`", part.splitlines()[0])  # the heading names the files
    out = Settings()
    for lang, body in _BLOCK.findall(part):
        body = body.replace(README_ADDRESS, address)
        if lang == "sh":
            for line in body.splitlines():
                m = re.match(r"export (\w+)=(\S*)", line.strip())
                if m:
                    out.env[m.group(1)] = m.group(2)
        elif lang in ("toml", "json"):
            where = [p for p in paths if p.endswith("." + lang)]
            if len(where) != 1:
                raise ValueError(f"README: {CLIENTS[client]}'s heading names no one "
                                 f"~/….{lang} file for its {lang} block")
            out.files[where[0]] = body
    if not out.env and not out.files:
        raise ValueError(f"README: no settings found for {CLIENTS[client]}")
    return out


def serve_options() -> list[str]:
    """The options of the README's ``kvstore serve`` line for agents, less ``--model`` and
    ``--port`` (the tests choose those)."""
    m = re.search(r"^kvstore serve (.+)$", readme_section(), re.MULTILINE)
    if m is None:
        raise ValueError("README: no `kvstore serve` line in Coding agents")
    words = m.group(1).split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("--model", "--port"):
            skip = True
            continue
        out.append(w)
    return out


# --- running one ---------------------------------------------------------------------


def environment(home: Path, bin_dir: Path, settings: Settings, tripwire: str
                ) -> dict[str, str]:
    """A client's whole environment (see the module's docstring)."""
    env = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ")}
    node = shutil.which("node")  # Codex's launcher is a node script
    path = [str(bin_dir), *([str(Path(node).parent)] if node else []), "/usr/local/bin",
            "/usr/bin", "/bin"]
    env.update(HOME=str(home), PATH=":".join(path), TERM="dumb",
               USER="agent", NO_COLOR="1", CI="1")
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = tripwire
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["npm_config_registry"] = "http://127.0.0.1:9/"  # opencode's plugin install: refused
    env.update(settings.env)
    for rel, text in settings.files.items():
        p = home / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return env


@dataclass
class Run:
    """One run of a client: its command, exit status and output."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def ok(self) -> bool:
        """Exit status 0 and no API error in its output."""
        return self.returncode == 0 and "API Error" not in self.stdout + self.stderr

    def __str__(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode}\n--- stdout\n"
                f"{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300.0) -> Run:
    """Run a client to the end of its turn (bounded), stdin closed."""
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=timeout)
    return Run(argv, r.returncode, r.stdout, r.stderr)


if __name__ == "__main__":
    try:
        where = install()
    except InstallError as e:
        print(f"tests/agents: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"tests/agents: {', '.join(f'{k} {v}' for k, v in versions().items())} in {where}")
