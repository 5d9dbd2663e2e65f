"""A server process on 127.0.0.1 for the end-to-end tests (``kvstore serve`` or plain
``mlx_lm.server``) and an ``openai`` client for it: started, waited for, stopped, bounded."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout: float,
                 poll: float = 0.2) -> None:
    """Wait until ``/health`` on ``port`` answers; fails (with the log's tail) when the
    process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(poll)


@contextmanager
def server_process(module: str, args: Sequence[str], log: Path, *,
                   env: Mapping[str, str] | None = None, client_timeout: float = 120.0,
                   start_timeout: float = 120.0, stop_timeout: float = 60.0
                   ) -> Iterator[tuple[int, Any]]:
    """``python -m MODULE ARGS --host 127.0.0.1 --port P`` with its output appended to
    ``log``; yields ``(P, openai client)`` once ``/health`` answers (within
    ``start_timeout``), then stops it with SIGTERM (killed after ``stop_timeout``) and
    asserts that it exited cleanly."""
    port = free_port()
    argv = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None)
        try:
            wait_healthy(proc, port, log, start_timeout)
            yield port, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                      timeout=client_timeout, max_retries=0)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]
