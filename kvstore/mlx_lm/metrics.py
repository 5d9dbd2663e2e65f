"""``GET /metrics`` of ``kvstore serve``: the cache's counters in the Prometheus text format.

Built with ``prometheus_client``: the two latency histograms are observed as requests and
saves happen (:class:`ServeMetrics` is a
:class:`~kvstore.mlx_lm.requests.CacheObserver` of every prompt cache the server makes);
every other figure is read at scrape time from where it is kept already (the caches'
request and save counters, the store's :class:`~kvstore.store.counters.StoreCounters`, the
root's totals), so a scrape and the request log can never disagree. Counters count from the
server's start. docs/CLI.md lists the metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from kvstore import Store
from kvstore.serving.rules import names as rule_names
from kvstore.store.usage import MISS_REASONS

from .requests import CacheObserver, RequestRecord
from .writebehind import SaveDone

if TYPE_CHECKING:
    from .prompt_cache import PersistentPromptCache

__all__ = ["ServeMetrics"]

TIERS = ("memory", "local", "remote")
#: How a request ended, as ``kvstore serve``'s engine says (RequestRecord.outcome); any
#: other reason a client gave its cancel is counted as ``cancelled``.
OUTCOMES = ("stop", "length", "cancelled", "error")


class ServeMetrics(CacheObserver):
    """The registry of one server and the observer that feeds its histograms."""

    def __init__(self, store: Store, caches: Callable[[], Sequence[PersistentPromptCache]]
                 ) -> None:
        self.store = store
        self.caches = caches
        self.registry = CollectorRegistry()
        self.restore_seconds = Histogram(
            "kvstore_restore_seconds",
            "Time a request spent getting its cache (memory copy, store lookup and load), "
            "by the tier that gave it (none: a miss)",
            ["source"], registry=self.registry)
        self.save_seconds = Histogram(
            "kvstore_save_seconds", "Time a background save took (block writes and commit)",
            registry=self.registry,
            buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, float("inf")))
        self._lock = threading.Lock()
        self.rewrites: dict[str, int] = {}  # rule name: requests it fired in
        self.partings: dict[tuple[str, str], int] = {}  # (role, block): requests
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)  # requests by how they ended
        self.registry.register(_Figures(self))

    # --- the observer -----------------------------------------------------------------

    def fetched(self, rec: RequestRecord) -> None:
        self.restore_seconds.labels(rec.tier or "none").observe(rec.restore_seconds)

    def finished(self, rec: RequestRecord) -> None:
        with self._lock:
            if rec.outcome is not None:
                ended = rec.outcome if rec.outcome in self.outcomes else "cancelled"
                self.outcomes[ended] += 1
            for rule in rec.rewrites:
                self.rewrites[rule] = self.rewrites.get(rule, 0) + 1
            if rec.parting is not None:
                key = (rec.parting.role, rec.parting.block)
                self.partings[key] = self.partings.get(key, 0) + 1

    def saved(self, done: object) -> None:
        if isinstance(done, SaveDone) and not done.failed:
            self.save_seconds.observe(done.seconds)

    # --- the endpoint -------------------------------------------------------------------

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The body and content type of a scrape (OpenMetrics when the scraper asks)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def serve_apart(self, host: str, port: int) -> Any:
        """An HTTP server of its own answering ``GET /metrics`` at ``host:port`` (every
        other path a 404), serving in a daemon thread; ``shutdown()`` and
        ``server_close()`` it when done. ``port`` 0 picks a free one
        (``server_address``)."""
        import threading
        from http.server import ThreadingHTTPServer

        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if urlsplit(self.path).path != "/metrics":
                    self.send_error(404)
                    return
                metrics.answer(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # a scrape every few seconds is not news

        httpd = ThreadingHTTPServer((host, port), Handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, name="kvstore-metrics",
                         daemon=True).start()
        return httpd

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        """Answer ``GET /metrics`` on ``handler``: the exposition its scraper asked for."""
        body, content_type = self.exposition(handler.headers.get("Accept"))
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)


class _Figures(Collector):
    """Everything but the histograms, read when scraped."""

    def __init__(self, m: ServeMetrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # collected fresh at each scrape; no names to check up front

    def collect(self) -> Iterator[Metric]:
        caches = list(self.m.caches())
        counts = [c.request_counts() for c in caches]
        persist = [c.persist_stats() for c in caches]

        def total(items: Sequence[Any], name: str) -> int:
            return sum(int(getattr(x, name)) for x in items)

        req = CounterMetricFamily("kvstore_requests", "Requests served, by the tier that gave "
                                  "their reused tokens (none: nothing reused)", labels=["source"])
        tok = CounterMetricFamily("kvstore_prompt_tokens", "Prompt tokens of the requests, by "
                                  "where they came from (computed: prefilled)", labels=["source"])
        for t in TIERS:
            req.add_metric([t], total(counts, f"{t}_requests"))
            tok.add_metric([t], total(counts, f"{t}_tokens"))
        req.add_metric(["none"], total(counts, "misses"))
        tok.add_metric(["computed"], total(counts, "computed_tokens"))
        yield req
        yield tok
        why = CounterMetricFamily("kvstore_miss_reasons", "Requests that reused nothing, or less "
                                  "than the store shares with them, by reason", labels=["reason"])
        reasons: dict[str, int] = {}
        for c in counts:
            for r, n in [*c.miss_reasons.items(), *c.partial_reasons.items()]:
                reasons[r] = reasons.get(r, 0) + n
        for r in MISS_REASONS:
            why.add_metric([r], reasons.get(r, 0))
        yield why
        with self.m._lock:
            fired, parted = dict(self.m.rewrites), dict(self.m.partings)
            ended = dict(self.m.outcomes)
        out = CounterMetricFamily("kvstore_request_outcomes", "Requests by how they ended: "
                                  "stop (an end of turn or a stop string), length, cancelled "
                                  "(the client went away or cancelled), error",
                                  labels=["outcome"])
        for name in OUTCOMES:
            out.add_metric([name], ended[name])
        yield out
        rw = CounterMetricFamily("kvstore_rewrites", "Requests a prefix-stability rule "
                                 "rewrote, by rule", labels=["rule"])
        for name in rule_names():
            rw.add_metric([name], fired.get(name, 0))
        yield rw
        pt = CounterMetricFamily("kvstore_partings", "Requests whose prompt parted from the "
                                 "deepest stored sequence, by the role and block of the "
                                 "message where it did", labels=["role", "block"])
        for (role, block), n in sorted(parted.items()):
            pt.add_metric([role, block], n)
        yield pt

        saves = CounterMetricFamily("kvstore_saves", "Snapshots handed to the write-behind "
                                    "queue, by what became of them", labels=["outcome"])
        for outcome in ("saved", "failed", "dropped", "superseded", "skipped"):
            saves.add_metric([outcome], total(persist, outcome))
        yield saves
        depth = GaugeMetricFamily("kvstore_save_queue_snapshots", "Snapshots waiting: queued "
                                  "(or being written) and deferred", labels=["state"])
        depth.add_metric(["queued"], total(persist, "pending"))
        depth.add_metric(["deferred"], total(persist, "deferred"))
        yield depth
        qbytes = GaugeMetricFamily("kvstore_save_queue_bytes", "Bytes of the snapshots waiting",
                                   labels=["state"])
        qbytes.add_metric(["queued"], total(persist, "pending_bytes"))
        qbytes.add_metric(["deferred"], total(persist, "deferred_bytes"))
        yield qbytes
        written = total(persist, "bytes_written")
        added = total(persist, "kv_bytes_added")
        yield CounterMetricFamily("kvstore_written_bytes", "Bytes the saves wrote to block files",
                                  value=written)
        yield CounterMetricFamily("kvstore_kv_added_bytes", "KV bytes the saves added to the "
                                  "root beyond the prefix it held for each", value=added)
        if added:
            yield GaugeMetricFamily("kvstore_write_amplification_ratio", "Bytes written over "
                                    "the KV bytes they added", value=written / added)

        yield from self._store()

    def _store(self) -> Iterator[Metric]:
        store = self.m.store
        st = store.stats()
        yield GaugeMetricFamily("kvstore_root_entries", "Entries in the root", value=st.entries)
        yield _root_bytes(st)
        if store.max_bytes is not None:
            yield GaugeMetricFamily("kvstore_root_budget_bytes", "The byte budget the root is "
                                    "evicted to (--max-bytes)", value=store.max_bytes)
        yield GaugeMetricFamily("kvstore_quarantined_blocks", "Blocks in the root's "
                                "quarantine/ (moved aside as corrupt)",
                                value=store.quarantined())
        v = store.counters.values()
        for name, doc, value in (
            ("kvstore_evictions", "Entries the byte budget evicted", v.evicted_entries),
            ("kvstore_eviction_freed_bytes", "Block bytes those evictions unlinked",
             v.freed_bytes),
            ("kvstore_corrupt_blocks", "Blocks a restore found corrupt (quarantined)",
             v.corrupt_blocks),
            ("kvstore_remote_pulls", "Entries pulled from the remote tier", v.remote_pulls),
            ("kvstore_remote_pulled_bytes", "Block bytes pulled from the remote tier",
             v.remote_pulled_bytes),
            ("kvstore_remote_pushes", "Entries pushed to the remote tier", v.remote_pushes),
            ("kvstore_remote_pushed_bytes", "Block bytes pushed to the remote tier",
             v.remote_pushed_bytes),
            ("kvstore_remote_errors", "Remote lookups, pulls and pushes that failed or timed "
             "out", v.remote_errors),
            ("kvstore_remote_refused", "Remote entries refused: not signed with the signing "
             "key (each entry once)", v.remote_refused),
            ("kvstore_remote_deadline_misses", "Requests that did not wait for the remote "
             "past --remote-deadline (computed, pulled in the background)",
             v.remote_deadline_misses),
            ("kvstore_remote_pulls_shed", "Background pulls not queued (the queue was full)",
             v.remote_pulls_shed),
            ("kvstore_remote_pushes_given_up", "Pushes given up after their retries",
             v.remote_pushes_given_up),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def _root_bytes(st: Any) -> GaugeMetricFamily:
    g = GaugeMetricFamily("kvstore_root_bytes", "Bytes of the root's block files (physical) "
                          "and what its entries add up to (logical)", labels=["kind"])
    g.add_metric(["physical"], st.physical_bytes)
    g.add_metric(["logical"], st.logical_bytes)
    return g
