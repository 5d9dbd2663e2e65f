"""``kvstore bench --only serve`` (issue 43): ``kvstore serve`` against ``mlx_lm.server`` on
the same model, both driven over HTTP on 127.0.0.1 as black boxes, in one run.

For each model (the tiny llama of :func:`tiny_model`, then SmolLM2-135M; ``--quick``: the
tiny model alone, smaller):

1. **Concurrent multi-turn sessions.** 1, 4 and 8 clients at once, each holding a chat of
   a few turns (its own system prompt; each turn appends the previous answer and a new user
   message), non-streamed, greedy, a fixed ``max_tokens``: the output tokens the servers
   report in ``usage`` (not what was asked for) over the round's wall time. After a
   warm-up round on each server, the two servers' rounds alternate (A B, then B A at the
   next concurrency or repetition); the median of ``reps`` rounds is reported.
2. **Time to first token under a long prefill.** One client sends a streamed request with
   a new 30k-token prompt; other clients send short streamed requests spread over its
   prefill (see :func:`ttft_under_prefill`), each on its own connection. A short request's
   time to first token is the time to its first ``data:`` line with choices; only those
   sent before the long prompt's first token count. A new long prompt is sent while fewer
   than ``short_requests`` were counted, at most ``long_rounds`` times.
3. **Subagents on a new prefix.** ``subagents`` requests sent at once, the same new
   20k-token system prompt and each its own short user message: the prompt tokens each
   server computed, over the shared prefix's length (1.0: the prefix computed once).
   kvstore serve: the ``computed=`` fields of its request log lines; mlx_lm.server:
   ``prompt_tokens - prompt_tokens_details.cached_tokens`` of each answer's ``usage``.

The tiny model never emits its end-of-turn token in practice (random weights), so its
answers run to ``max_tokens``; SmolLM2 is asked for long stories, and every throughput row
carries the fewest tokens an answer had. SmolLM2 runs at the sizes of ``SERVE_REAL`` (a
CPU prefills it at about 10 tokens a second), and never past its 8,192 positions.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .common import Row, percentile
from .servers import server

Log = Callable[[str], None]

BASELINE = "mlx_lm.server"
SHORT_TIMEOUT = 300.0  # seconds: a short request, a session's turn
LONG_TIMEOUT = 600.0  # a long prefill, the subagents' requests
START_TIMEOUT = 300.0  # a server's start (until /health answers)
STOP_TIMEOUT = 60.0  # its stop after SIGTERM (then SIGKILL)


@dataclass(frozen=True)
class ServeSize:
    """The sizes of one run of the serve case."""

    name: str
    clients: tuple[int, ...] = (1, 4, 8)
    turns: int = 4
    max_tokens: int = 256  # per turn
    #: rounds per server and concurrency (alternating): the median is reported. The tiny
    #: model's round is 2-7 s, and one is up to ±20% from the next on the same server on a
    #: shared 2-core host: 3 rounds could not tell a 5% difference.
    reps: int = 7
    system_tokens: int = 200  # each session's system prompt
    long_prompt: int = 30_000  # the long prefill of (2)
    short_requests: int = 10
    long_rounds: int = 3
    short_max_tokens: int = 4
    prefix: int = 20_000  # the subagents' shared prefix
    subagents: int = 4
    real: ServeSize | None = None  # SmolLM2's sizes; None: the tiny model alone


#: SmolLM2 on a CPU: MLX prefills it at about 10 tokens a second and decodes one sequence
#: at about 5 on a 2-core x86 CPU (bfloat16 and float32 alike), so its sizes are cut to
#: what runs in minutes; it is there for real answers (their lengths, a real tokenizer
#: and template), the tiny model for the sizes of the issue. Its rounds are median of 3
#: a side: a round of one is ±7% from the next on the same server.
SERVE_REAL = ServeSize("real", turns=2, max_tokens=16, reps=3, system_tokens=48,
                       long_prompt=512, short_requests=10, long_rounds=1, short_max_tokens=2,
                       prefix=256)
SERVE_FULL = ServeSize("full", real=SERVE_REAL)
SERVE_QUICK = ServeSize("quick", clients=(1, 4), turns=2, max_tokens=32, reps=1,
                        system_tokens=100, long_prompt=6000, short_requests=3, long_rounds=2,
                        prefix=3000)
#: tokens left free below a model's context: the template's own, the answer's
CONTEXT_MARGIN = 512


def tiny_model(d: Path) -> Path:
    """The tiny llama of the serve case: 2 layers of hidden 32 (2 heads of 16, 1 KV head).
    Two layers, so that the prefill computes attention (MLX skips a lone layer's); hidden
    32, so that a 30k-token prefill takes about half a minute on a 2-core CPU."""
    from ..tiny import make_tiny_model

    return make_tiny_model(d, "llama", hidden_size=32, num_layers=2)


# --- HTTP, bounded ---------------------------------------------------------------------


class ServeBenchError(RuntimeError):
    """A server answered something the case cannot measure (a status, a missing field)."""


def _conn(port: int, timeout: float) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def post_chat(port: int, body: dict[str, Any], timeout: float = SHORT_TIMEOUT) -> dict[str, Any]:
    """A non-streamed ``/v1/chat/completions``: its JSON (``timeout`` bounds each socket
    operation, so the whole answer, which comes in one piece)."""
    conn = _conn(port, timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    if r.status != 200:
        raise ServeBenchError(f"port {port}: HTTP {r.status}: {data[:300]!r}")
    out: dict[str, Any] = json.loads(data)
    return out


@dataclass
class Streamed:
    """A streamed answer's times (``time.perf_counter()``) and usage."""

    sent: float
    first: float | None = None  # the first data line with choices
    ended: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.ended) - self.sent


def stream_chat(port: int, body: dict[str, Any], timeout: float,
                on_progress: Callable[[bytes | None], None] | None = None) -> Streamed:
    """A streamed ``/v1/chat/completions`` read to its end (``[DONE]`` or the connection's
    close) within ``timeout`` seconds in all; ``on_progress`` gets each comment line (a
    keep-alive) and None at the first data line with choices."""
    deadline = time.monotonic() + timeout
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = _conn(port, timeout)
    out = Streamed(sent=time.perf_counter())
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise ServeBenchError(f"port {port}: HTTP {r.status}: {r.read(300)!r}")
        for raw in r:
            if time.monotonic() > deadline:
                raise ServeBenchError(f"port {port}: a streamed answer ran past {timeout:g} s")
            line = raw.strip()
            if line.startswith(b":"):
                if on_progress is not None:
                    on_progress(line)
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if out.first is None and chunk.get("choices"):
                out.first = time.perf_counter()
                if on_progress is not None:
                    on_progress(None)
            if chunk.get("usage"):
                out.usage = chunk["usage"]
    finally:
        conn.close()
    out.ended = time.perf_counter()
    return out


def computed(usage: dict[str, Any]) -> int | None:
    """Prompt tokens a server computed by its own ``usage``; None when it does not say
    how many were cached."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(usage["prompt_tokens"]) - int(details["cached_tokens"])


# --- prompts ---------------------------------------------------------------------------


class Prompts:
    """Texts of an exact token length in a model's tokenizer, each new one starting with
    its own tag so that no cache holds any of it."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.utils import load_tokenizer

        self.tok: Any = load_tokenizer(model_dir)  # type: ignore[no-untyped-call]
        self._n = 0

    def text(self, tokens: int, tag: str, seed: int = 0) -> str:
        """About ``tokens`` tokens of English after ``tag`` (cut at a token boundary)."""
        from ..tiny import sample_text

        words = max(16, tokens)
        while True:
            ids = self.tok.encode(sample_text(words, seed=seed), add_special_tokens=False)
            if len(ids) >= tokens:
                break
            words *= 2
        head = self.tok.encode(f"{tag}. ", add_special_tokens=False)
        return f"{tag}. " + str(self.tok.decode(ids[:max(0, tokens - len(head))]))

    def tag(self, what: str) -> str:
        self._n += 1
        return f"{what} {self._n} {os.urandom(3).hex()}"

    def rendered(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids)


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": "default_model", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0}


QUESTIONS = (
    "Write a long story about a miller's daughter who counts sacks of grain, with many "
    "details about the river, the market and the weather.",
    "Now continue the story for as long again: the travellers on the northern road arrive "
    "at the inn.",
    "Continue once more: describe the harbour, the ship and the sailors in detail.",
    "Continue: the library, the student and the table of numbers.",
    "Continue with the next morning in the market square.",
)


# --- the three parts -------------------------------------------------------------------


@dataclass
class Plan:
    """One model of the run: where it is and the sizes it runs at."""

    label: str
    model_dir: Path
    size: ServeSize

    @property
    def max_tokens(self) -> int:
        return self.size.max_tokens


def _session(port: int, plan: Plan, prompts: Prompts, system: str) -> list[int]:
    """One client's multi-turn chat: the output tokens of each turn."""
    messages = [{"role": "system", "content": system}]
    got = []
    for turn in range(plan.size.turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        r = post_chat(port, chat_body(messages, plan.max_tokens))
        got.append(int(r["usage"]["completion_tokens"]))
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return got


@dataclass
class Round:
    tokens: int
    seconds: float
    fewest: int  # the fewest output tokens of one answer

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def sessions_round(port: int, plan: Plan, prompts: Prompts, clients: int) -> Round:
    """``clients`` sessions started together; their output tokens over the wall time."""
    systems = [prompts.text(plan.size.system_tokens, prompts.tag("Session"), seed=i)
               for i in range(clients)]
    start = threading.Barrier(clients + 1, timeout=SHORT_TIMEOUT)

    def one(system: str) -> list[int]:
        start.wait()
        return _session(port, plan, prompts, system)

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(one, s) for s in systems]
        start.wait()
        t0 = time.perf_counter()
        results = [f.result(timeout=SHORT_TIMEOUT * plan.size.turns) for f in futures]
        seconds = time.perf_counter() - t0
    flat = [n for r in results for n in r]
    return Round(sum(flat), seconds, min(flat))


@dataclass
class Ttft:
    samples: list[float]
    long_prompt: int  # the long prompt's tokens (its usage)
    long_ttft: list[float]  # each long prompt's own time to first token
    sent: int  # short requests sent in all (those after a prefill ended are not samples)


def ttft_under_prefill(port: int, plan: Plan, prompts: Prompts) -> Ttft:
    """Part 2: short requests' times to first token while a long prompt is prefilled.

    The short requests are spread over the prefill: the i-th of n (from 0) is sent when the
    long prompt's keep-alives say that (i + 1/2)/n of it is done, or ``SHORT_GAP`` s after the one
    before, whichever comes first (a server that sends no keep-alives), each on its own
    connection without waiting for the others."""
    size = plan.size
    samples: list[float] = []
    longs: list[Streamed] = []
    sent = 0
    for _ in range(size.long_rounds):
        want = size.short_requests - len(samples)
        if want <= 0:
            break
        long_text = prompts.text(size.long_prompt, prompts.tag("Document"), seed=11)
        body = chat_body([{"role": "user", "content": long_text + "\nSummarise it."}], 2)
        progress = _Progress()
        box: dict[str, Any] = {}

        def run_long(body: dict[str, Any] = body, progress: _Progress = progress,
                     box: dict[str, Any] = box) -> None:
            try:
                box["r"] = stream_chat(port, body, LONG_TIMEOUT, on_progress=progress.update)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["e"] = e
            finally:
                progress.finish()

        th = threading.Thread(target=run_long, daemon=True)
        th.start()
        with ThreadPoolExecutor(want) as pool:
            shorts = []
            for i in range(want):
                if not progress.wait_for((i + 0.5) / want, SHORT_GAP):
                    break  # the long prompt's prefill ended
                q = prompts.text(24, prompts.tag("Question"), seed=5)
                shorts.append(pool.submit(stream_chat, port, chat_body(
                    [{"role": "user", "content": q}], size.short_max_tokens), SHORT_TIMEOUT))
            mine = [f.result(timeout=SHORT_TIMEOUT + LONG_TIMEOUT) for f in shorts]
        sent += len(mine)
        th.join(LONG_TIMEOUT)
        if th.is_alive() or "e" in box:
            raise ServeBenchError(f"port {port}: the long prompt failed: {box.get('e')}")
        long: Streamed = box["r"]
        longs.append(long)
        end = long.first if long.first is not None else long.ended
        samples += [s.ttft for s in mine if s.sent < end]
    tokens = int(longs[-1].usage.get("prompt_tokens", 0)) if longs else 0
    return Ttft(samples, tokens, [s.ttft for s in longs], sent)


SHORT_GAP = 2.0  # seconds between two short requests when no keep-alive says more
_KEEPALIVE = re.compile(rb"keepalive (\d+)/(\d+)")


class _Progress:
    """How much of the long prompt is done, by its keep-alives (``: keepalive N/M``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.fraction = 0.0
        self.done = False  # the prefill ended (its first token, or the request's end)

    def update(self, line: bytes | None) -> None:
        with self._cond:
            m = _KEEPALIVE.search(line) if line is not None else None
            if m and int(m.group(2)):
                self.fraction = max(self.fraction, int(m.group(1)) / int(m.group(2)))
            elif line is None:
                self.done = True
            self._cond.notify_all()

    def finish(self) -> None:
        self.update(None)

    def wait_for(self, fraction: float, timeout: float) -> bool:
        """Wait until ``fraction`` of the prompt is done or ``timeout`` s have passed;
        False when the prefill has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self.done or self.fraction >= fraction, timeout)
            return not self.done


_COMPUTED = re.compile(r"\bcomputed=(\d+)")


def request_log_computed(log_file: Path, offset: int, n: int, wait: float = 10.0) -> list[int]:
    """The ``computed=`` fields of the ``kvstore request`` lines written after ``offset``;
    waits up to ``wait`` s for ``n`` of them (a line is written as its request ends)."""
    deadline = time.monotonic() + wait
    while True:
        with log_file.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
        found = [int(m.group(1)) for line in text.splitlines() if "kvstore request " in line
                 for m in [_COMPUTED.search(line)] if m]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@dataclass
class Subagents:
    prefix: int  # tokens the prompts share (rendered)
    prompt_tokens: list[int]
    by_usage: int | None  # computed, by the answers' usage (None: not reported)
    by_log: int | None = None  # computed, by kvstore's request log (kvstore serve only)


def subagents(port: int, plan: Plan, prompts: Prompts, log_file: Path | None) -> Subagents:
    """Part 3: ``subagents`` requests on a new shared prefix, sent at once."""
    size = plan.size
    system = prompts.text(size.prefix, prompts.tag("Instructions"), seed=21)
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Subagent {i}: find every caller of handler_{i} "
                                          "and list their files."}]
             for i in range(size.subagents)]
    rendered = [prompts.rendered(m) for m in convs]
    shared = len(os.path.commonprefix(rendered))
    offset = log_file.stat().st_size if log_file is not None else 0
    start = threading.Barrier(size.subagents, timeout=SHORT_TIMEOUT)

    def one(messages: list[dict[str, str]]) -> dict[str, Any]:
        start.wait()
        return post_chat(port, chat_body(messages, 2), LONG_TIMEOUT)

    with ThreadPoolExecutor(size.subagents) as pool:
        answers = list(pool.map(one, convs, timeout=LONG_TIMEOUT))
    usages = [a["usage"] for a in answers]
    each = [computed(u) for u in usages]
    out = Subagents(shared, [int(u["prompt_tokens"]) for u in usages],
                    None if None in each else sum(c for c in each if c is not None))
    if log_file is not None:
        lines = request_log_computed(log_file, offset, size.subagents)
        if len(lines) == size.subagents:
            out.by_log = sum(lines)
    return out


# --- the run ---------------------------------------------------------------------------


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _fit(plan: Plan) -> Plan:
    """``plan`` with its long prompt and prefix cut to the model's context."""
    cfg = json.loads((plan.model_dir / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings") or 0)
    if not ctx:
        return plan
    room = ctx - CONTEXT_MARGIN
    size = replace(plan.size, long_prompt=min(plan.size.long_prompt, room),
                   prefix=min(plan.size.prefix, room))
    return replace(plan, size=size)


@contextlib.contextmanager
def both_servers(model_dir: Path, scratch: Path, tag: str) -> Iterator[tuple[int, int, Path]]:
    """``kvstore serve`` on a fresh root and ``mlx_lm.server``, on ``model_dir``: their
    ports and kvstore's log file."""
    kv_log = scratch / f"serve-{tag}-kvstore.log"
    with contextlib.ExitStack() as stack:
        kv = stack.enter_context(server(
            "kvstore", ["serve", "--model", str(model_dir), "--root", str(scratch / f"root-{tag}"),
                        "--log-level", "INFO"], kv_log,
            timeout=START_TIMEOUT, stop_timeout=STOP_TIMEOUT))
        base = stack.enter_context(server(
            "mlx_lm.server", ["--model", str(model_dir), "--log-level", "INFO"],
            scratch / f"serve-{tag}-mlx_lm.log", timeout=START_TIMEOUT, stop_timeout=STOP_TIMEOUT))
        yield kv, base, kv_log


def model_rows(plan: Plan, scratch: Path, log: Log) -> list[Row]:
    """The rows of one model: both servers started, warmed up, then the three parts."""
    plan = _fit(plan)
    size, label = plan.size, plan.label
    prompts = Prompts(plan.model_dir)
    rows: list[Row] = []
    tag = re.sub(r"\W+", "-", label)
    with both_servers(plan.model_dir, scratch, tag) as (kv, base, kv_log):
        ports = {"kvstore": kv, BASELINE: base}
        log(f"[serve] {label}: kvstore serve on :{kv}, mlx_lm.server on :{base} "
            f"(load average {_load():.2f})")
        for port in ports.values():  # warm-up: a round of 2 sessions, one turn each
            sessions_round(port, replace(plan, size=replace(size, turns=1)), prompts, 2)

        # 1. concurrent multi-turn sessions
        for i, clients in enumerate(size.clients):
            every: dict[str, list[Round]] = {name: [] for name in ports}
            load0 = _load()
            for rep in range(size.reps):
                order = list(ports) if (i + rep) % 2 == 0 else list(reversed(ports))
                for name in order:
                    every[name].append(sessions_round(ports[name], plan, prompts, clients))
            k, b = (sorted(every[name], key=lambda r: r.rate)[(size.reps - 1) // 2]
                    for name in ("kvstore", BASELINE))
            log(f"  {clients} client(s) x {size.turns} turns, median of {size.reps}: kvstore "
                f"{k.rate:.1f} tok/s "
                f"({k.tokens} tokens, fewest {k.fewest}), mlx_lm.server {b.rate:.1f} tok/s "
                f"({b.tokens} tokens, fewest {b.fewest}); load {load0:.2f} -> {_load():.2f}")
            rows.append(Row(
                "serve", f"serve: output tokens/s, {clients} concurrent session(s) x "
                f"{size.turns} turns, max_tokens {plan.max_tokens} ({label})", "tok/s",
                k.rate, b.rate, BASELINE, "throughput",
                extra={"clients": clients, "turns": size.turns, "max_tokens": plan.max_tokens,
                       "kvstore_tokens": k.tokens, "baseline_tokens": b.tokens,
                       "kvstore_seconds": k.seconds, "baseline_seconds": b.seconds,
                       "kvstore_fewest": k.fewest, "baseline_fewest": b.fewest,
                       "target_min_ratio": 1.0, "load_before": load0, "reps": size.reps,
                       **{f"kvstore_rate_{j + 1}": r.rate for j, r in enumerate(every["kvstore"])},
                       **{f"baseline_rate_{j + 1}": r.rate
                          for j, r in enumerate(every[BASELINE])}}))

        # 2. time to first token while a long prompt is prefilled
        ttft: dict[str, Ttft] = {}
        for name, port in ports.items():
            load0 = _load()
            t = ttft[name] = ttft_under_prefill(port, plan, prompts)
            shown = (f"p50 {percentile(t.samples, 0.5) * 1e3:.0f} ms, p95 "
                     f"{percentile(t.samples, 0.95) * 1e3:.0f} ms" if t.samples else "none")
            log(f"  short requests during a {t.long_prompt}-token prefill, {name}: "
                f"{len(t.samples)} of {t.sent} sent during it, {shown}; the long prompt's "
                f"own TTFT " + ", ".join(f"{s:.1f} s" for s in t.long_ttft)
                + f"; load {load0:.2f} -> {_load():.2f}")
        k_t, b_t = ttft["kvstore"], ttft[BASELINE]
        for q, qname in ((0.5, "p50"), (0.95, "p95")):
            def at(t: Ttft, q: float = q) -> float:
                return percentile(t.samples, q) if t.samples else float("nan")

            rows.append(Row(
                "serve", f"serve: time to first token {qname}, a short request during a "
                f"{k_t.long_prompt}-token prefill ({label})", "s", at(k_t), at(b_t), BASELINE,
                "speedup",
                extra={"kvstore_samples": len(k_t.samples), "baseline_samples": len(b_t.samples),
                       "long_prompt_tokens": k_t.long_prompt,
                       "kvstore_long_ttft": max(k_t.long_ttft, default=0.0),
                       "baseline_long_ttft": max(b_t.long_ttft, default=0.0)}))

        # 3. subagents on a new prefix
        sub: dict[str, Subagents] = {}
        for name, port in ports.items():
            load0 = _load()
            t0 = time.perf_counter()
            s = sub[name] = subagents(port, plan, prompts, kv_log if name == "kvstore" else None)
            log(f"  {size.subagents} subagents on a new {s.prefix}-token prefix, {name}: "
                f"computed {s.by_log if s.by_log is not None else '-'} (request log), "
                f"{s.by_usage if s.by_usage is not None else 'not reported'} (usage) in "
                f"{time.perf_counter() - t0:.1f} s; load {load0:.2f} -> {_load():.2f}")
        k_s, b_s = sub["kvstore"], sub[BASELINE]
        k_c = k_s.by_log if k_s.by_log is not None else k_s.by_usage
        rows.append(Row(
            "serve", f"serve: {size.subagents} subagents at once on a new {k_s.prefix}-token "
            f"prefix: prompt tokens computed / prefix ({label})", "x",
            k_c / k_s.prefix if k_c is not None else float("nan"),
            b_s.by_usage / b_s.prefix if b_s.by_usage is not None else float("nan"),
            BASELINE, "fraction",
            extra={"prefix_tokens": k_s.prefix, "subagents": size.subagents,
                   "kvstore_computed_log": float(k_s.by_log if k_s.by_log is not None else -1),
                   "kvstore_computed_usage": float(k_s.by_usage if k_s.by_usage is not None
                                                   else -1),
                   "baseline_computed_usage": float(b_s.by_usage if b_s.by_usage is not None
                                                    else -1),
                   "prompt_tokens": float(sum(k_s.prompt_tokens)),
                   # about the least a server computes: the prefix once, each one's own rest
                   "floor": (sum(k_s.prompt_tokens) - (size.subagents - 1) * k_s.prefix)
                   / k_s.prefix,
                   "target_max": 1.1, "target_prefix": float(SERVE_FULL.prefix)}))
    return rows


def serve_rows(scratch: Path, log: Log, *, quick: bool = False,
               model: Path | None = None) -> list[Row]:
    """Every row of the serve case: the tiny model, then SmolLM2 (or ``model``), unless
    ``quick``. A model whose servers fail (start, status, timeout) is one line, and the
    other model's rows stand."""
    size = SERVE_QUICK if quick else SERVE_FULL
    rows = _guarded(Plan("tiny llama 2x32", tiny_model(scratch / "serve-tiny"), size),
                    scratch, log)
    if size.real is None:
        log("[serve] --quick: the tiny model only")
        return rows
    if model is None:
        from ..mlx_lm.gguf import fetch_model

        try:
            model = fetch_model("smollm2", log=log)
        except Exception as e:  # noqa: BLE001 - the tiny model's rows stand on their own
            log(f"[serve] SmolLM2 skipped: it could not be fetched ({e})")
            return rows
    # the directory's name, as the model group's rows have it (the conversion is in it)
    return rows + _guarded(Plan(model.name, model, size.real), scratch, log)


def _guarded(plan: Plan, scratch: Path, log: Log) -> list[Row]:
    try:
        return model_rows(plan, scratch, log)
    except (ServeBenchError, RuntimeError, OSError) as e:  # socket timeouts are OSErrors
        log(f"[serve] {plan.label}: FAILED, no rows: {type(e).__name__}: {e}")
        return []
