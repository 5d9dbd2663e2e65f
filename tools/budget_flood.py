"""Distinct long prompts through `kvstore serve --max-bytes` on a hybrid model (issue 36, item
6): the bytes of the root's block files after each, and whether the last conversation's
checkpoints are reused by another question about it.

Usage: python tools/budget_flood.py [--prompts 22] [--max-bytes 3M] [--kind lfm2] [--words 1800]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from kvstore.tiny import make_tiny_model, sample_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=22)
    ap.add_argument("--max-bytes", default="3M")
    ap.add_argument("--kind", default="lfm2")
    ap.add_argument("--words", type=int, default=1800)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = make_tiny_model(scratch / "model", a.kind)
        root = scratch / "root"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.serve", "--root", str(root), "--model", str(model),
             "--max-bytes", a.max_bytes, "--min-tokens", "32", "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=(scratch / "serve.log").open("w"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("kvstore serve did not start") from None
                    time.sleep(0.3)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   max_retries=0, timeout=300)

            def ask(text: str) -> tuple[int, int]:
                r = client.chat.completions.create(
                    model="default_model", max_tokens=2, temperature=0,
                    messages=[{"role": "user", "content": text}])
                d = r.usage.prompt_tokens_details
                return r.usage.prompt_tokens, (d.cached_tokens or 0) if d else 0

            def on_disk() -> int:
                return sum(f.stat().st_size for f in (root / "blocks").rglob("*") if f.is_file())

            docs = [sample_text(a.words, seed=100 + i) for i in range(a.prompts)]
            worst = 0
            for i, doc in enumerate(docs):
                ask(doc + "\nQ: what happened?")
                time.sleep(0.5)  # the write-behind worker's saves, and their budget
                worst = max(worst, on_disk())
                print(f"prompt {i + 1}: {on_disk() / 2**20:.2f} MiB on disk", flush=True)
            prompt, cached = ask(docs[-1] + "\nQ: who was there?")
            print(f"largest: {worst / 2**20:.2f} MiB; the last document, another question: "
                  f"{cached} of {prompt} prompt tokens reused")
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
