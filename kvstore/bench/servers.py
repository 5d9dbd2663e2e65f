"""The servers the bench starts (``kvstore serve``, ``mlx_lm.server``): one launcher.

Each runs as ``python -P -m MODULE`` on 127.0.0.1 (``-P``: run from the folder that holds
a clone named ``kvstore``, that clone must not hide the installed package), its output
written to a log file; the launcher waits for ``/health``, and a server that does not
start is an error at once (its exit code), naming a copy of its log kept in the temp dir,
which outlives the bench's scratch folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kept(log_file: Path) -> Path:
    """A copy of a failed child's log outside the bench's scratch folder (which is deleted
    when the bench ends): in the temp dir, named so that it is found."""
    fd, name = tempfile.mkstemp(prefix="kvstore-bench-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as out, log_file.open("rb") as src:
        shutil.copyfileobj(src, out)
    return Path(name)


@contextlib.contextmanager
def server(module: str, args: Sequence[str], log_file: Path, *, timeout: float = 300,
           append: bool = False, stop_timeout: float | None = None) -> Iterator[int]:
    """``python -P -m MODULE ARGS --host 127.0.0.1 --port P``, its output in ``log_file``
    (appended to with ``append``); yields P once ``/health`` answers, then stops it with
    SIGTERM (SIGKILL after ``stop_timeout``, default ``timeout``). RuntimeError when it does
    not start."""
    port = free_port()
    argv = [sys.executable, "-P", "-m", module, *args, "--host", "127.0.0.1",
            "--port", str(port)]
    name = ("kvstore serve" if module == "kvstore.serve"
            or (module == "kvstore" and args[:1] == ["serve"]) else module)
    with log_file.open("a" if append else "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError) as e:
                    if (code := proc.poll()) is not None or time.monotonic() > deadline:
                        how = (f"exit code {code}" if code is not None
                               else f"no answer in {timeout:g} s")
                        raise RuntimeError(f"{name} did not start ({how}); its log: "
                                           f"{kept(log_file)}") from e
                    time.sleep(0.3)
            yield port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout if stop_timeout is None else stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
