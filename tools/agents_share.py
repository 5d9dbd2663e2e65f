"""How much of each request's prompt `kvstore serve` reuses when 1, 2 or 4 agents with the same
system prompt and tools run at once (issue 34, item 7).

Each agent is a thread that sends its own conversation, turn after turn, to one server (so
mlx-lm batches them as it would concurrent clients): the shared system prompt, then per turn
a user message of its own and the reply so far. Printed per setting: the requests, the
mean share of the prompt reused by the first request of each agent after the first (the
shared system prompt: they start once the first agent has had its first reply) and by the
later ones (its own conversation), and the worst later request. Settings: mlx-lm's
default LRU (10 entries) and no budget, then a tight one (an LRU of one entry and a disk
budget of about two conversations).

Usage: python tools/agents_share.py [--turns 5] [--system-words 900] [--agents 1 2 4]
       [--tight-bytes 2M] [--think 0] [--serve-args '--defer-seconds 0']
       [--model DIR] (default: a tiny random-weight llama built in a scratch directory)
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

from kvstore.tiny import make_tiny_model, sample_text


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: Path, root: Path, log: Path, extra: list[str]) -> tuple[Any, int]:
    port = _port()
    argv = [sys.executable, "-m", "kvstore.serve", "--root", str(root), "--model", str(model),
            "--min-tokens", "32", *extra, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log.open("a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvstore serve did not start; see {log}") from None
            time.sleep(0.2)


def _agent(client: Any, system: str, agent: int, turns: int,
           out: list[tuple[int, int, int]], started: threading.Event, think: float) -> None:
    """One agent's conversation; appends (turn, prompt tokens, cached tokens) per request.
    Agent 0 sets ``started`` after its first reply; the others wait for it (subagents start
    once their parent has run), then all run at once."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    if agent:
        started.wait()
    for turn in range(turns):
        if turn == 1 and agent == 0:
            started.set()
        if turn:
            time.sleep(think)  # a tool runs: the write-behind queue drains meanwhile
        messages.append({"role": "user",
                         "content": sample_text(60, seed=1000 * agent + turn)})
        r = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=8, temperature=0)
        d = r.usage.prompt_tokens_details
        out.append((turn, r.usage.prompt_tokens, (d.cached_tokens or 0) if d else 0))
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})


def run(model: Path, scratch: Path, agents: int, turns: int, system: str,
        extra: list[str], label: str, think: float = 0.0) -> None:
    root = scratch / f"root-{label}-{agents}"
    proc, port = _serve(model, root, scratch / "serve.log", extra)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=300, max_retries=0)
        results: list[list[tuple[int, int, int]]] = [[] for _ in range(agents)]
        started = threading.Event()
        threads = [threading.Thread(target=_agent,
                                    args=(client, system, a, turns, results[a], started,
                                          think))
                   for a in range(agents)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(60)
    rows = [r for res in results for r in res]
    first = [c / p for turn, p, c in (res[0] for res in results[1:])] or [0.0]
    later = [c / p for turn, p, c in rows if turn > 0]
    print(f"| {label} | {agents} | {len(rows)} | {statistics.mean(first):.1%} "
          f"| {statistics.mean(later):.1%} | {min(later):.1%} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=900)
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tight-bytes", default="2M", help="the tight setting's --max-bytes")
    ap.add_argument("--think", type=float, default=0.0,
                    help="seconds each agent waits between turns (its tools run)")
    ap.add_argument("--serve-args", default="", help="more kvstore serve options, for both "
                    "settings (e.g. '--defer-seconds 0': every snapshot to disk at once)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = a.model or make_tiny_model(scratch / "model", "llama")
        system = sample_text(a.system_words, seed=7)
        print("| setting | agents | requests | other agents' first request reused | later "
              "requests reused "
              "(mean) | worst later request |")
        print("|---|---|---|---|---|---|")
        for n in a.agents:
            run(model, scratch, n, a.turns, system, a.serve_args.split(),
                "default LRU, no budget", a.think)
        for n in a.agents:
            run(model, scratch, n, a.turns, system,
                ["--prompt-cache-size", "1", "--max-bytes", a.tight_bytes,
                 *a.serve_args.split()], "LRU 1, budget", a.think)


if __name__ == "__main__":
    main()
