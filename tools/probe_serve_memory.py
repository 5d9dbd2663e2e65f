"""The peak memory of ``kvstore serve`` for one long prompt, checkpoints on and off (issue 26).

Builds a tiny random-weight hybrid model (large enough that its key/value rows show in the
process's memory), starts ``kvstore serve`` on a fresh root for each setting, sends one
chat request of about ``--tokens`` prompt tokens (one reply token), waits until the
write-behind queue has written everything (the server drains it as it stops), and
reports the server's peak resident set (``VmHWM`` in ``/proc/<pid>/status``, Linux only,
read every 0.1 s until the process is gone). Settings run one after another, in the
order given, on the same model.

    python tools/probe_serve_memory.py --tokens 32768 --every 0 1024

prints one JSON object per setting: the prompt and cached tokens, the checkpoints the
store holds, the root's bytes on disk, the seconds the request took and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_rss(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


class _Watch(threading.Thread):
    """The highest VmHWM of a process seen until it exits."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak = pid, 0

    def run(self) -> None:
        while (v := _peak_rss(self.pid)) is not None:
            self.peak = max(self.peak, v)
            time.sleep(0.1)


def _chat(port: int, text: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return dict(json.loads(r.read()))


def run(model: Path, work: Path, every: int, text: str, extra: list[str]) -> dict[str, Any]:
    from kvstore import Store

    root = work / f"root-{every}"
    port = _port()
    log = work / f"serve-{every}.log"
    argv = [sys.executable, "-m", "kvstore.serve", "--root", str(root), "--model", str(model),
            "--checkpoint-every", str(every), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "INFO", *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        watch = _Watch(proc.pid)
        watch.start()
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            t = time.perf_counter()
            reply = _chat(port, text)
            seconds = time.perf_counter() - t
        finally:
            proc.send_signal(signal.SIGTERM)  # the write-behind queue drains, then it exits
            proc.wait(3600)
            watch.join(10)
    peak = watch.peak
    usage = reply["usage"]
    with Store.open(root, create=False) as s:
        ckpts = sum(1 for e in s.entries() if e.priority == "checkpoint")
        disk = s.stats().physical_bytes
    return {"every": every, "serve_args": " ".join(extra),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "checkpoints": ckpts, "root_bytes": disk, "request_s": round(seconds, 2),
            "peak_rss_bytes": peak, "peak_rss_gib": round(peak / 2**30, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="prompt tokens, about")
    p.add_argument("--every", type=int, nargs="+", default=[0, 1024],
                   help="--checkpoint-every settings to run, in order (0: off)")
    p.add_argument("--kind", default="qwen3_5", help="tiny model kind (kvstore.tiny.KINDS)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--serve-args", default="",
                   help="more options for the server, e.g. '--prefill-step-size 1024'")
    args = p.parse_args()

    from kvstore.tiny import make_tiny_model, sample_text

    with tempfile.TemporaryDirectory(prefix="kvstore-serve-memory-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", args.kind, hidden_size=args.hidden,
                                num_layers=args.layers, dtype="float32")
        text = sample_text(int(args.tokens / 1.28), seed=5)  # ~1.28 tokens a word here
        for every in args.every:
            print(json.dumps({"kind": args.kind, "hidden": args.hidden, "layers": args.layers,
                              **run(model, work, every, text, args.serve_args.split())}),
                  flush=True)


if __name__ == "__main__":
    main()
