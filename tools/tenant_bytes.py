"""What salted tenants cost and what they no longer reveal (issue 36, item 5): N tenants
of one ``kvstore serve`` (tiny random-weight llama) send the same system prompt, each
under its own ``cache_salt``; for each, the bytes the server wrote and the root's growth,
read from ``/metrics``.

    python tools/tenant_bytes.py --tenants 4 --words 2000

Before salted blocks, tenants after the first wrote 0 B (the blocks were shared, and
``/metrics`` told them so); with them, each writes the prompt's bytes again. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.serving import free_port, server_process  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvstore.tiny import make_tiny_model, sample_text  # noqa: E402


def figures(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvstore_written_bytes_total":
                out["written"] = s.value
            if s.name == "kvstore_root_bytes" and s.labels == {"kind": "physical"}:
                out["physical"] = s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--words", type=int, default=2000)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="tenant-bytes-"))
    model = make_tiny_model(d / "model", "llama")
    mport = free_port()
    system = sample_text(a.words, seed=21)
    rows = []
    with server_process("kvstore.serve", ["--root", str(d / "root"), "--min-tokens", "16",
                                          "--defer-seconds", "0", "--model", str(model),
                                          "--metrics-port", str(mport)],
                        d / "serve.log") as (_, client):
        for i in range(a.tenants):
            f0 = figures(mport)
            r = client.chat.completions.create(
                model="default_model", temperature=0.0, max_tokens=4,
                extra_body={"cache_salt": f"tenant-{i}-{time.time_ns()}"},
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": "What did I say?"}])
            time.sleep(3)  # the background save
            f1 = figures(mport)
            rows.append({"tenant": i, "prompt_tokens": r.usage.prompt_tokens,
                         "written_bytes": f1["written"] - f0["written"],
                         "root_growth_bytes": f1["physical"] - f0["physical"]})
        total = figures(mport)["physical"]
    print(json.dumps({"tenants": rows, "root_physical_bytes": total}))


if __name__ == "__main__":
    main()
