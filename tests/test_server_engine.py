"""The scheduler of ``kvstore serve`` (issue 43, kvstore/server/engine.py) on tiny
random-weight models: exact greedy tokens, the prompt cache's fetch and insert, chunked
prefill between decode steps, cancellation, one failing job among others, continuous
batching, a shared prefix computed once, checkpoints, and stop()."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

import kvstore
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.requests import CacheObserver, RequestRecord
from kvstore.server.engine import (
    FIRST_CHUNK,
    MIN_CHUNK,
    Busy,
    Done,
    Engine,
    Handle,
    Job,
    Prefill,
    Sampling,
    Token,
    chunk_tokens,
)
from kvstore.tiny import make_tiny_model

T = 16  # block_tokens of the roots here


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, tuple[str, None, None]]:
    path = make_tiny_model(tmp_path_factory.mktemp("model") / "llama", "llama")
    model, tok = mlx_lm.load(str(path))
    return model, tok, (str(path), None, None)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", durable=False, block_tokens=T) as s:
        yield s


class Finished(CacheObserver):
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def finished(self, rec: RequestRecord) -> None:
        self.records.append(rec)


@pytest.fixture
def make(tiny: Any, store: kvstore.Store) -> Iterator[Any]:
    """``make(**options)``: an engine of the tiny model over a fresh prompt cache (not
    started); every engine made is stopped at the end."""
    engines: list[Engine] = []
    caches: list[PersistentPromptCache] = []

    def _make(**kw: Any) -> Engine:
        model, tok, key = tiny
        pc = PersistentPromptCache(store, min_tokens=T)
        pc.observers.append(Finished())
        caches.append(pc)
        eng = Engine(kw.pop("model", model), tok, pc, model_key=key, **kw)
        engines.append(eng)
        return eng

    yield _make
    for e in engines:
        if e._thread is not None:
            assert e.stop(30) == 0
        assert e.healthy() or e._thread is None
    for c in caches:
        c.close()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 768) for _ in range(n)]  # 0-4: the tiny model's specials


def greedy(tiny: Any, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens for the prompt, up to and with the first EOS."""
    model, tok, _ = tiny
    out: list[int] = []
    for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(n), strict=False):
        out.append(int(t))
        if int(t) in tok.eos_token_ids:
            break
    return out


def drain(h: Handle, timeout: float = 60) -> tuple[list[Token], list[Prefill], Done]:
    toks: list[Token] = []
    pre: list[Prefill] = []
    while True:
        ev = h.get(timeout=timeout)
        if isinstance(ev, Token):
            toks.append(ev)
        elif isinstance(ev, Prefill):
            pre.append(ev)
        else:
            return toks, pre, ev


def ids(toks: list[Token]) -> list[int]:
    return [t.id for t in toks]


def submit_during(eng: Engine, handles: list[Handle], max_tokens: int, at: int,
                  later: Job) -> Any:
    """A sampling hook: the ``at``-th sampler call of the job of ``max_tokens`` submits
    ``later`` (its handle appended to ``handles``)."""
    seen = [0]

    def hook(job: Job, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        def counting(logprobs: mx.array) -> mx.array:
            if job.max_tokens == max_tokens:
                seen[0] += 1
                if seen[0] == at:
                    handles.append(eng.submit(later))
            return sampler(logprobs)
        return counting, processors

    return hook


def records(eng: Engine) -> list[RequestRecord]:
    return next(o for o in eng.cache.observers if isinstance(o, Finished)).records


# --- serial ------------------------------------------------------------------------------


def test_greedy_tokens_are_mlx_lms_and_the_second_request_hits_the_cache(
        tiny: Any, make: Any) -> None:
    eng = make(prefill_chunk=64)
    eng.start()
    prompt = tokens(1, 300)
    want = greedy(tiny, prompt, 16)
    toks, pre, done = drain(eng.submit(Job(prompt=prompt, max_tokens=16)))
    assert ids(toks) == want
    assert "".join(t.text for t in toks) == tiny[1].decode(want)
    # 299 tokens before the last: chunks of 64 (4 progress events), then the end
    assert [(p.done, p.total) for p in pre] == [(64, 300), (128, 300), (192, 300),
                                               (256, 300), (300, 300)]
    assert (done.finish, done.prompt_tokens, done.cached_tokens, done.generated) == (
        "length" if len(want) == 16 else "stop", 300, 0, len(want))
    assert eng.counts()["prefill_tokens"] == 299
    # the same prompt again: all but its last token come from memory
    toks2, pre2, done2 = drain(eng.submit(Job(prompt=prompt, max_tokens=16)))
    assert ids(toks2) == want
    assert (done2.cached_tokens, [(p.done, p.total) for p in pre2]) == (299, [(1, 1)])
    assert eng.counts()["prefill_tokens"] == 299
    assert done2.record is not None and done2.record.tier == "memory"
    assert done2.record.reused_tokens == 299
    # its reply extends the prompt: a longer prompt starting with prompt + reply reuses both
    longer = prompt + want[:-1] + tokens(2, 40)
    toks3, _, done3 = drain(eng.submit(Job(prompt=longer, max_tokens=4)))
    assert done3.cached_tokens == len(prompt) + len(want) - 1
    assert ids(toks3) == greedy(tiny, longer, 4)
    assert [r.outcome for r in records(eng)] == [done.finish, done2.finish, done3.finish]
    assert "outcome=length" in records(eng)[2].line()


def test_logprobs_and_top_logprobs(tiny: Any, make: Any) -> None:
    eng = make()
    eng.start()
    prompt = tokens(3, 50)
    toks, _, _ = drain(eng.submit(Job(prompt=prompt, max_tokens=3, logprobs=True,
                                      top_logprobs=5)))
    model = tiny[0]
    logits = model(mx.array(prompt)[None])[0, -1]
    lp = (logits - mx.logsumexp(logits)).tolist()
    best = sorted(range(len(lp)), key=lambda i: -lp[i])[:5]
    first = toks[0]
    assert first.id == best[0]
    assert first.logprob == pytest.approx(lp[first.id], abs=1e-4)
    assert first.top is not None
    assert [i for i, _ in first.top] == best
    assert [v for _, v in first.top] == pytest.approx([lp[i] for i in best], abs=1e-4)
    plain, _, _ = drain(eng.submit(Job(prompt=prompt, max_tokens=3)))
    assert [(t.logprob, t.top) for t in plain] == [(None, None)] * 3


def test_a_seed_gives_the_same_sampled_tokens(tiny: Any, make: Any) -> None:
    eng = make()
    eng.start()
    prompt = tokens(4, 40)
    hot = Sampling(temperature=5.0, seed=7)
    a = ids(drain(eng.submit(Job(prompt=prompt, max_tokens=12, sampling=hot)))[0])
    b = ids(drain(eng.submit(Job(prompt=prompt, max_tokens=12, sampling=hot)))[0])
    c = ids(drain(eng.submit(Job(prompt=prompt, max_tokens=12,
                                 sampling=Sampling(temperature=5.0, seed=8))))[0])
    assert a == b != c


class Gate:
    """A model that runs ``then(calls)`` on the engine's thread before each of its calls."""

    def __init__(self, model: Any, then: Any) -> None:
        self.model, self.then, self.calls = model, then, 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        self.then(self.calls, args[0].shape)
        return self.model(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_cancel_mid_prefill_keeps_what_was_computed(tiny: Any, make: Any) -> None:
    handles: list[Handle] = []

    def then(calls: int, shape: Any) -> None:
        if calls == 3:  # before the third chunk
            handles[0].cancel("disconnected")

    eng = make(prefill_chunk=32, model=Gate(tiny[0], then))
    prompt = tokens(5, 400)
    handles.append(eng.submit(Job(prompt=prompt, max_tokens=8)))
    eng.start()
    toks, pre, done = drain(handles[0])
    assert toks == []
    assert (done.finish, done.cached_tokens, done.generated) == ("disconnected", 0, 0)
    assert [p.done for p in pre] == [32, 64, 96]  # the third chunk ran; no fourth
    assert eng.counts()["prefill_tokens"] == 96
    assert eng.counts()["cancelled"] == 1
    rec = records(eng)[0]
    assert (rec.outcome, rec.reply) == ("cancelled", "none")
    assert "outcome=cancelled" in rec.line()
    # the 96 tokens were kept: the same prompt starts from there
    toks2, _, done2 = drain(eng.submit(Job(prompt=prompt, max_tokens=8)))
    assert done2.cached_tokens == 96
    assert ids(toks2) == greedy(tiny, prompt, 8)


def test_cancel_mid_decode_ends_within_a_step_and_keeps_the_prompt(
        tiny: Any, make: Any) -> None:
    eng = make()
    handles: list[Handle] = []
    seen = [0]

    def hook(job: Job, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        def counting(logprobs: mx.array) -> mx.array:
            seen[0] += 1
            if seen[0] == 3:
                handles[0].cancel("stop")  # as the protocol does when a stop string matched
            return sampler(logprobs)
        return counting, processors

    eng.sampling_hook = hook
    prompt = tokens(6, 120)
    handles.append(eng.submit(Job(prompt=prompt, max_tokens=50)))
    eng.start()
    toks, _, done = drain(handles[0])
    want = greedy(tiny, prompt, 50)
    assert done.finish == "stop" and 1 <= done.generated <= 4  # one step more at most
    assert ids(toks) == want[:done.generated]
    assert records(eng)[0].outcome == "stop"
    assert records(eng)[0].reply in ("queued", "deferred")
    # prompt and the reply so far are in the cache
    _, _, again = drain(eng.submit(Job(prompt=prompt, max_tokens=2)))
    assert again.cached_tokens == len(prompt) - 1
    handles[0].cancel()  # after its Done: nothing happens
    with pytest.raises(TimeoutError):
        handles[0].get(timeout=0.2)


def test_a_failing_job_ends_alone_and_the_next_one_runs(tiny: Any, make: Any) -> None:
    eng = make()

    def hook(job: Job, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        if job.max_tokens == 13:
            def boom(tokens: mx.array, logits: mx.array) -> mx.array:
                raise RuntimeError("the processor broke")
            return sampler, [boom]
        return sampler, processors

    eng.sampling_hook = hook
    prompt = tokens(7, 60)
    bad = eng.submit(Job(prompt=prompt, max_tokens=13))
    good = eng.submit(Job(prompt=prompt, max_tokens=5))
    eng.start()
    toks, _, done = drain(bad)
    assert (done.finish, done.error, toks) == (
        "error", "RuntimeError: the processor broke", [])
    toks, _, done = drain(good)
    assert done.finish in ("length", "stop") and ids(toks) == greedy(tiny, prompt, 5)
    assert eng.counts()["errors"] == 1 and eng.healthy()
    assert records(eng)[0].outcome == "error"


def test_an_exception_in_prefill_ends_that_job(tiny: Any, make: Any) -> None:
    def then(calls: int, shape: Any) -> None:
        if shape[1] == 77:
            raise ValueError("bad chunk")

    eng = make(model=Gate(tiny[0], then), max_concurrency=1)
    bad = eng.submit(Job(prompt=tokens(8, 78), max_tokens=3))
    good = eng.submit(Job(prompt=tokens(9, 30), max_tokens=3))
    eng.start()
    assert drain(bad)[2].error == "ValueError: bad chunk"
    assert ids(drain(good)[0]) == greedy(tiny, tokens(9, 30), 3)
    assert eng.healthy()


# --- batching ----------------------------------------------------------------------------


def test_four_jobs_decoded_together_give_each_ones_own_tokens(tiny: Any, make: Any) -> None:
    eng = make(max_concurrency=4, prefill_chunk=64)
    prompts = [tokens(10 + i, n) for i, n in enumerate((90, 200, 33, 150))]
    handles = [eng.submit(Job(prompt=p, max_tokens=10 + 3 * i, salt=f"s{i % 2}"))
               for i, p in enumerate(prompts)]
    eng.start()
    for i, (p, h) in enumerate(zip(prompts, handles, strict=True)):
        toks, _, done = drain(h)
        assert ids(toks) == greedy(tiny, p, 10 + 3 * i), i
    steps = eng.counts()["decode_steps"]
    assert steps < sum(10 + 3 * i for i in range(4))  # shared steps, not one job's each


def test_a_short_job_starts_decoding_while_a_long_prefill_goes_on(
        tiny: Any, make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[int, Any]] = []
    put = Handle._put

    def logged(self: Handle, ev: Any) -> None:
        log.append((id(self), ev))
        put(self, ev)

    monkeypatch.setattr(Handle, "_put", logged)
    eng = make(max_concurrency=2, prefill_chunk=32)
    long_p, short_p = tokens(20, 1200), tokens(21, 20)
    long_h = eng.submit(Job(prompt=long_p, max_tokens=2))
    short_h = eng.submit(Job(prompt=short_p, max_tokens=6))
    eng.start()
    assert ids(drain(short_h)[0]) == greedy(tiny, short_p, 6)
    assert ids(drain(long_h)[0]) == greedy(tiny, long_p, 2)
    first = next(i for i, (h, ev) in enumerate(log) if h == id(short_h) and isinstance(ev, Token))
    before = [ev for h, ev in log[:first] if h == id(long_h)]
    after = [ev for h, ev in log[first:] if h == id(long_h) and isinstance(ev, Prefill)]
    assert len(before) <= 2  # at most a chunk of the long one per step
    assert len(after) >= 30  # of its 38 chunks


def test_busy_when_the_queue_is_full(tiny: Any, make: Any) -> None:
    eng = make(max_concurrency=1, max_queue=2, retry_after=3.0)
    hs = [eng.submit(Job(prompt=tokens(30 + i, 20), max_tokens=2)) for i in range(3)]
    with pytest.raises(Busy) as e:
        eng.submit(Job(prompt=tokens(40, 20), max_tokens=2))
    assert (e.value.retry_after, e.value.stopping) == (3.0, False)
    assert eng.counts()["busy"] == 1
    eng.start()
    for h in hs:
        assert drain(h)[2].finish in ("length", "stop")


def test_a_queued_job_cancelled_never_runs(tiny: Any, make: Any,
                                          caplog: pytest.LogCaptureFixture) -> None:
    eng = make(max_concurrency=1)
    a = eng.submit(Job(prompt=tokens(50, 20), max_tokens=2))
    b = eng.submit(Job(prompt=tokens(51, 20), max_tokens=2))
    b.cancel("disconnected")
    with caplog.at_level(logging.INFO, logger="kvstore.server"):
        eng.start()
        assert drain(b)[2].finish == "disconnected"
        assert drain(a)[2].generated == 2
    assert eng.counts()["prefill_tokens"] == 19
    assert eng.counts()["cancelled"] == 1
    # it never reached the cache's lookup, so no request line: the engine says it left
    assert [r.getMessage() for r in caplog.records if "queued" in r.getMessage()] == [
        "kvstore: a request left while queued: prompt=20 outcome=disconnected"]


# --- a shared prefix ---------------------------------------------------------------------


def test_jobs_sharing_a_prefix_compute_it_once(tiny: Any, make: Any) -> None:
    eng = make(max_concurrency=4, prefill_chunk=512)
    prefix = tokens(60, 3000)
    tails = [tokens(61 + i, 40 + 10 * i) for i in range(4)]
    prompts = [prefix + t for t in tails]
    handles = [eng.submit(Job(prompt=p, max_tokens=6)) for p in prompts]
    eng.start()
    dones = []
    for p, h in zip(prompts, handles, strict=True):
        toks, _, done = drain(h)
        assert ids(toks) == greedy(tiny, p, 6)
        dones.append(done)
    computed = eng.counts()["prefill_tokens"]
    assert computed <= 1.1 * len(prefix) + sum(len(t) for t in tails)
    assert [d.cached_tokens for d in dones] == [0, 3000, 3000, 3000]
    assert eng.counts()["shared_waits"] == 3


def test_different_salts_never_share_a_prefix(tiny: Any, make: Any) -> None:
    eng = make(max_concurrency=2, prefill_chunk=256)
    prefix = tokens(70, 600)
    a = eng.submit(Job(prompt=prefix + tokens(71, 20), max_tokens=2, salt="a"))
    b = eng.submit(Job(prompt=prefix + tokens(72, 20), max_tokens=2, salt="b"))
    eng.start()
    assert [drain(h)[2].cached_tokens for h in (a, b)] == [0, 0]
    assert eng.counts()["shared_waits"] == 0


# --- stop --------------------------------------------------------------------------------


def test_stop_refuses_new_jobs_and_finishes_the_running_ones(tiny: Any, make: Any) -> None:
    eng = make(max_concurrency=2)
    hs = [eng.submit(Job(prompt=tokens(80 + i, 40), max_tokens=20)) for i in range(3)]
    eng.start()
    left: list[int] = []
    t = threading.Thread(target=lambda: left.append(eng.stop(60)))
    t.start()
    for h in hs:
        assert drain(h)[2].generated >= 1
    t.join(60)
    assert left == [0]
    with pytest.raises(Busy) as e:
        eng.submit(Job(prompt=tokens(90, 10), max_tokens=2))
    assert e.value.stopping
    assert eng.healthy()


# --- other caches: sliding windows, hybrids, checkpoints ---------------------------------


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> Any:
    loaded: dict[str, Any] = {}

    def load(kind: str) -> tuple[Any, Any, tuple[str, None, None]]:
        if kind not in loaded:
            path = make_tiny_model(tmp_path_factory.mktemp(kind) / kind, kind,
                                   sliding_window=64)
            model, tok = mlx_lm.load(str(path))
            loaded[kind] = (model, tok, (str(path), None, None))
        return loaded[kind]  # type: ignore[no-any-return]

    return load


def _engine(kind: Any, store: kvstore.Store, **kw: Any) -> Engine:
    model, tok, key = kind
    pc = PersistentPromptCache(store, min_tokens=T)
    pc.observers.append(Finished())
    return Engine(model, tok, pc, model_key=key, **kw)


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("name", ["gemma3_text", "lfm2", "qwen3_5"])
def test_windowed_and_hybrid_models_give_their_own_tokens_batched(
        kinds: Any, store: kvstore.Store, name: str, lanes: int) -> None:
    kind = kinds(name)
    eng = _engine(kind, store, max_concurrency=3, prefill_chunk=48, prefill_threads=lanes)
    prompts = [tokens(100 + i, n) for i, n in enumerate((150, 40, 90))]
    hs = [eng.submit(Job(prompt=p, max_tokens=12)) for p in prompts]
    eng.start()
    try:
        for p, h in zip(prompts, hs, strict=True):
            assert ids(drain(h)[0]) == greedy(kind, p, 12)
    finally:
        assert eng.stop(30) == 0
        eng.cache.close()



@pytest.mark.parametrize("name", ["gemma3_text", "lfm2", "qwen3_5"])
def test_windowed_and_hybrid_models_decoded_alone_then_batched(
        kinds: Any, store: kvstore.Store, name: str, solo_calls: dict[str, int]) -> None:
    """A job decoded alone on its own caches past the 64-token window, then handed to the
    batch when a second one is ready: both give mlx-lm's own tokens."""
    kind = kinds(name)
    eng = _engine(kind, store, max_concurrency=2)
    handles: list[Handle] = []
    first, second = tokens(105, 50), tokens(106, 30)
    # at its 40th token: 50 + 39 tokens in its window-sized cache by then
    eng.sampling_hook = submit_during(eng, handles, 60, 40, Job(prompt=second, max_tokens=10))
    handles.append(eng.submit(Job(prompt=first, max_tokens=60)))
    eng.start()
    try:
        assert ids(drain(handles[0])[0]) == greedy(kind, first, 60)
        assert ids(drain(handles[1])[0]) == greedy(kind, second, 10)
        assert solo_calls["handover"] == solo_calls["started"] == 1
    finally:
        assert eng.stop(30) == 0
        eng.cache.close()

def test_checkpoints_of_a_model_whose_cache_cannot_be_trimmed(
        kinds: Any, store: kvstore.Store) -> None:
    """Every 128 prompt tokens the cache goes to the store as a checkpoint (not into
    memory); a prompt that parts from it later restores the deepest one before the
    parting. A trimmable model gets none."""
    lfm2 = kinds("lfm2")
    eng = _engine(lfm2, store, prefill_chunk=100, checkpoint_every=128)
    first = tokens(110, 600)
    h = eng.submit(Job(prompt=first, max_tokens=3))
    eng.start()
    try:
        assert eng.checkpoint_every == 128
        assert ids(drain(h)[0]) == greedy(lfm2, first, 3)
        assert eng.cache.drain(30)
        ckpts = sorted(e.n_tokens for e in store.entries() if e.priority == "checkpoint")
        assert ckpts == [128, 256, 384, 512]
        assert records(eng)[0].saves_queued == 5  # and the reply
        # chunks end at each checkpoint: 100, 128, 228, 256, 356, 384, 484, 512, 599
        assert eng.counts()["prefill_chunks"] == 9
        second = first[:450] + tokens(111, 30)
        toks, _, done = drain(eng.submit(Job(prompt=second, max_tokens=3)))
        assert done.cached_tokens == 384
        assert ids(toks) == greedy(lfm2, second, 3)
    finally:
        assert eng.stop(30) == 0
        eng.cache.close()


def test_no_checkpoints_for_a_trimmable_model(tiny: Any, make: Any, store: kvstore.Store
                                              ) -> None:
    eng = make(checkpoint_every=128)
    eng.start()
    drain(eng.submit(Job(prompt=tokens(120, 600), max_tokens=2)))
    assert eng.checkpoint_every == 0
    assert eng.cache.drain(30)
    assert [e.priority for e in store.entries()] == ["assistant"]


# --- events, metrics ---------------------------------------------------------------------


def test_events_in_asyncio_and_outcomes_in_the_metrics(tiny: Any, make: Any,
                                                       store: kvstore.Store) -> None:
    import asyncio

    from kvstore.mlx_lm.metrics import ServeMetrics

    eng = make(max_concurrency=2, prefill_chunk=32)
    metrics = ServeMetrics(store, lambda: [eng.cache])
    eng.cache.observers.append(metrics)
    prompt = tokens(130, 100)
    eng.start()

    async def run() -> tuple[list[Any], list[Any]]:
        a = eng.submit(Job(prompt=prompt, max_tokens=5))
        b = eng.submit(Job(prompt=tokens(131, 100), max_tokens=500))

        async def take(h: Handle, cancel_after: int | None) -> list[Any]:
            got = []
            async for batch in h.batches(None):
                for ev in batch:
                    got.append(ev)
                    if cancel_after is not None and sum(isinstance(e, Token)
                                                        for e in got) == 2:
                        h.cancel()
            return got

        return await asyncio.wait_for(asyncio.gather(take(a, None), take(b, 2)), 60)

    a_events, b_events = asyncio.run(run())
    assert [e.id for e in a_events if isinstance(e, Token)] == greedy(tiny, prompt, 5)
    assert isinstance(a_events[-1], Done) and isinstance(b_events[-1], Done)
    assert b_events[-1].finish == "cancelled" and b_events[-1].generated < 500
    text = metrics.exposition(None)[0].decode()
    assert 'kvstore_request_outcomes_total{outcome="cancelled"} 1.0' in text
    assert f'kvstore_request_outcomes_total{{outcome="{a_events[-1].finish}"}} 1.0' in text
    assert 'kvstore_request_outcomes_total{outcome="error"} 0.0' in text


def test_a_job_that_comes_after_a_prefill_passed_its_prefix_gets_a_copy(
        tiny: Any, make: Any) -> None:
    submitted = threading.Event()

    def then(calls: int, shape: Any) -> None:
        if calls == 5:  # the fifth chunk waits for the second job
            assert submitted.wait(30)

    eng = make(max_concurrency=2, prefill_chunk=256, model=Gate(tiny[0], then))
    prefix = tokens(140, 1000)
    first, second = prefix + tokens(141, 500), prefix + tokens(142, 30)
    a = eng.submit(Job(prompt=first, max_tokens=3))
    eng.start()
    assert [drain_prefill(a) for _ in range(4)] == [256, 512, 768, 1024]
    b = eng.submit(Job(prompt=second, max_tokens=3))
    submitted.set()
    toks, _, done = drain(b)
    assert done.cached_tokens == 1000 and ids(toks) == greedy(tiny, second, 3)
    assert ids(drain(a)[0]) == greedy(tiny, first, 3)
    assert eng.counts()["shared_copies"] == 1
    assert eng.counts()["prefill_tokens"] == 1499 + 29  # each prompt but its last token


def drain_prefill(h: Handle) -> int:
    ev = h.get(timeout=30)
    assert isinstance(ev, Prefill)
    return ev.done


def test_stop_ends_what_is_left_after_its_timeout(tiny: Any, make: Any) -> None:
    eng = make(prefill_chunk=16)

    def hook(job: Job, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        def slow(logprobs: mx.array) -> mx.array:
            threading.Event().wait(0.05)
            return sampler(logprobs)
        return slow, processors

    eng.sampling_hook = hook
    h = eng.submit(Job(prompt=tokens(150, 40), max_tokens=1000))
    eng.start()
    assert isinstance(h.get(timeout=30), Prefill)
    assert eng.stop(0.3) == 1
    toks, _, done = drain(h)
    assert done.finish == "cancelled" and 0 < done.generated < 1000
    assert (eng.counts()["cancelled"], eng.counts()["completed"]) == (1, 0)
    assert eng.healthy()
    assert records(eng)[0].outcome == "cancelled"


def test_healthy_is_false_when_the_loop_died(tiny: Any, make: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make()
    assert not eng.healthy()  # not started

    def broken() -> None:
        raise SystemExit("the loop broke")

    monkeypatch.setattr(eng, "_loop", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    eng.start()
    assert eng._thread is not None
    eng._thread.join(10)
    assert not eng.healthy()
    with pytest.raises(RuntimeError, match="not running"):
        eng.submit(Job(prompt=[5, 6], max_tokens=1))
    eng._thread = None  # nothing to stop at the end


def test_checkpoint_every_none_is_the_models_default(kinds: Any, store: kvstore.Store) -> None:
    from kvstore.mlx_lm.prefill import default_every

    lfm2 = kinds("lfm2")
    eng = _engine(lfm2, store, checkpoint_every=None)
    eng.start()
    try:
        assert eng.checkpoint_every == default_every(lfm2[0], T) >= 1024
    finally:
        assert eng.stop(30) == 0
        eng.cache.close()


def test_at_most_one_chunk_of_prefill_between_decode_steps_shared_by_short_prompts(
        tiny: Any, make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, bool]] = []  # (batch, tokens, any job decoding) of each call
    engines: list[Engine] = []

    def then(n: int, shape: Any) -> None:
        calls.append((int(shape[0]), int(shape[1]), bool(engines[0]._decoding)))

    log: list[tuple[int, Any]] = []
    put = Handle._put

    def logged(self: Handle, ev: Any) -> None:
        log.append((id(self), ev))
        put(self, ev)

    monkeypatch.setattr(Handle, "_put", logged)
    eng = make(max_concurrency=5, prefill_chunk=128, model=Gate(tiny[0], then))
    engines.append(eng)
    prompts = [tokens(160 + i, 30) for i in range(4)]
    shorts = [eng.submit(Job(prompt=p, max_tokens=4)) for p in prompts]
    long_p = tokens(170, 1000)
    long_h = eng.submit(Job(prompt=long_p, max_tokens=4))
    eng.start()
    for p, h in zip(prompts, shorts, strict=True):
        assert ids(drain(h)[0]) == greedy(tiny, p, 4)
    assert ids(drain(long_h)[0]) == greedy(tiny, long_p, 4)
    # the four short prompts were all computed before any job's first token
    first_token = next(i for i, (_, ev) in enumerate(log) if isinstance(ev, Token))
    ends = [ev for _, ev in log[:first_token] if isinstance(ev, Prefill) and ev.done == ev.total]
    assert len(ends) == 4
    # while jobs are decoding, at most 128 prompt tokens between two decode calls (one
    # token a sequence): the long prompt's chunks, or the short ones together
    run = worst = 0
    for _, n, decoding in calls:
        if n == 1:
            run = 0
        elif decoding:
            run += n
            worst = max(worst, run)
    assert worst == 128


def test_cuts_and_breakpoints_keep_the_cache_where_they_say(
        kinds: Any, store: kvstore.Store) -> None:
    """On a model whose cache cannot be trimmed, only a cut gives a later prompt that parts
    after it its prefix: a segment end (``system``) and a breakpoint (pinned)."""
    from kvstore.mlx_lm.cache_control import pin_type

    lfm2 = kinds("lfm2")
    eng = _engine(lfm2, store, prefill_chunk=512)
    first = tokens(180, 300)
    h = eng.submit(Job(prompt=first, max_tokens=2, cuts={200: "system"},
                       breakpoints={150: 300.0, 250: 300.0}))
    eng.start()
    try:
        drain(h)
        assert eng.counts()["prefill_chunks"] == 4  # 150, 200, 250, 299
        pins = {len(p.tokens): p.cache_type for p in eng.cache._pins.values()}
        assert pins == {150: "user", 250: "user"}
        for n in (150, 200, 250):
            other = first[:n] + tokens(181 + n, 20)
            assert drain(eng.submit(Job(prompt=other, max_tokens=2)))[2].cached_tokens == n
        unmarked = first[:120] + tokens(190, 20)
        assert drain(eng.submit(Job(prompt=unmarked, max_tokens=2)))[2].cached_tokens == 0
        # a pinned type given as a cut is the protocol's (the breakpoint's own priority)
        h = eng.submit(Job(prompt=tokens(191, 100), max_tokens=2,
                           cuts={60: pin_type(300.0, "system")}, breakpoints={60: 300.0}))
        drain(h)
        assert sorted(p.cache_type for p in eng.cache._pins.values()) == [
            "system", "user", "user"]
    finally:
        assert eng.stop(30) == 0
        eng.cache.close()


# --- chunks bounded in time ----------------------------------------------------------------


def test_chunk_tokens_is_about_the_time_asked_within_its_bounds() -> None:
    assert chunk_tokens(None, 1.0, 2048) == FIRST_CHUNK == 256  # nothing timed yet
    assert chunk_tokens(None, 1.0, 100) == 100
    assert chunk_tokens(700.0, 1.0, 2048) == 700
    assert chunk_tokens(700.0, 0.5, 2048) == 350
    assert chunk_tokens(15.0, 1.0, 2048) == MIN_CHUNK == 64  # a slow machine: no fewer
    assert chunk_tokens(15.0, 1.0, 32) == 32  # ... unless the step size says fewer
    assert chunk_tokens(1e6, 1.0, 2048) == 2048
    assert chunk_tokens(700.0, 0.0, 2048) == chunk_tokens(None, 0.0, 2048) == 2048  # off


def test_a_slow_prefill_is_cut_into_chunks_of_about_the_time_asked(
        tiny: Any, make: Any) -> None:
    """A model that prefills 500 tokens a second at best (2 ms a token, slept) and
    ``prefill_seconds`` 0.2: after the first chunk (256 tokens, nothing timed yet), each
    chunk is at most 100 tokens (0.2 s at 500 a second) and at least 64, where
    ``prefill_chunk`` alone would make it 2,048, until at most 256 are left: those go in
    one chunk. The tokens are still mlx-lm's."""
    sizes: list[int] = []

    def then(calls: int, shape: Any) -> None:
        if int(shape[1]) > 1:  # a prefill chunk, not a decode step
            sizes.append(int(shape[1]))
            time.sleep(0.002 * int(shape[1]))

    eng = make(prefill_chunk=2048, prefill_seconds=0.2, model=Gate(tiny[0], then))
    prompt = tokens(7, 900)
    h = eng.submit(Job(prompt=prompt, max_tokens=3))
    eng.start()
    assert ids(drain(h)[0]) == greedy(tiny, prompt, 3)
    assert sum(sizes) == 899 and sizes[0] == 256
    assert all(64 <= n <= 100 for n in sizes[1:-1]), sizes
    # the rest, once at most FIRST_CHUNK tokens, in one chunk: not cut by time
    assert sum(sizes[1:-1]) > 899 - 256 - 256 and sizes[-1] == 899 - sum(sizes[:-1]) <= 256
    assert eng.counts()["prefill_chunks"] == len(sizes)


def test_prefill_seconds_zero_keeps_chunks_of_prefill_chunk_tokens(tiny: Any, make: Any) -> None:
    sizes: list[int] = []

    def then(calls: int, shape: Any) -> None:
        if int(shape[1]) > 1:
            sizes.append(int(shape[1]))
            time.sleep(0.002 * int(shape[1]))

    eng = make(prefill_chunk=300, prefill_seconds=0, model=Gate(tiny[0], then))
    h = eng.submit(Job(prompt=tokens(8, 700), max_tokens=2))
    eng.start()
    assert drain(h)[2].generated == 2
    assert sizes == [300, 300, 99]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_prefill_seconds_must_be_a_finite_number_at_least_0(tiny: Any, make: Any,
                                                             bad: float) -> None:
    with pytest.raises(ValueError, match="prefill_seconds must be >= 0 and finite"):
        make(prefill_seconds=bad)


def test_each_job_s_chunk_is_sized_by_its_own_rate_not_a_quick_neighbour_s(
        tiny: Any, make: Any) -> None:
    """A long prompt that prefills at 500 tokens a second at best (2 ms a token, slept) and
    short prompts that prefill at the tiny model's own speed, arriving while it runs: the
    long prompt's chunks stay within 0.2 s of its own rate (at most 100 tokens), although
    the short ones' chunks, thousands of tokens a second, are timed in between."""
    long_p = tokens(9, 1200)
    long_sizes: list[int] = []
    shorts: list[Handle] = []
    engines: list[Engine] = []

    def then(calls: int, shape: Any) -> None:
        n = int(shape[1])
        if n > 1 and n != 20 - 1:  # a chunk of the long prompt (each short one is 19)
            long_sizes.append(n)
            time.sleep(0.002 * n)
            if len(shorts) < 6:
                shorts.append(engines[0].submit(Job(prompt=tokens(300 + len(shorts), 20),
                                                    max_tokens=2)))

    eng = make(prefill_chunk=2048, prefill_seconds=0.2, model=Gate(tiny[0], then))
    engines.append(eng)
    h = eng.submit(Job(prompt=long_p, max_tokens=2))
    eng.start()
    assert ids(drain(h)[0]) == greedy(tiny, long_p, 2)
    for s in shorts:
        assert drain(s)[2].generated == 2
    assert len(shorts) == 6 and sum(long_sizes) == 1199 and long_sizes[0] == 256
    assert all(n <= 100 for n in long_sizes[1:-1]), long_sizes
    assert long_sizes[-1] <= 256


def test_a_reader_that_fell_behind_takes_the_ready_events_at_once_after_one_wake_up() -> None:
    """``Handle.batches``: what was put before the reader looked comes as one batch; the
    engine's thread wakes the reader's loop once for events put while it waits, not once
    an event; an idle interval gives an empty batch; Done ends it."""
    import asyncio

    h = Handle(lambda: None)
    wakes = 0

    async def run() -> list[list[Any]]:
        nonlocal wakes
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*a: Any, **kw: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(*a, **kw)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        got: list[list[Any]] = []
        it = h.batches(0.2)
        h._put(Prefill(1, 3))  # before the reader registered: no wake-up to send
        h._put(Prefill(3, 3))
        got.append(await it.__anext__())

        def engine() -> None:  # three tokens while the reader waits, then a pause
            for i in range(3):
                h._put(Token(i, str(i)))

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        got.append(await it.__anext__())
        got.append(await it.__anext__())  # nothing for 0.2 s
        h._put(Done("length", 3, 0, 3))
        got.append(await it.__anext__())
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert [[type(e).__name__ for e in b] for b in got] == [
        ["Prefill", "Prefill"], ["Token", "Token", "Token"], [], ["Done"]]
    assert [e.id for e in got[1]] == [0, 1, 2]
    assert wakes == 2  # the three tokens, then the Done


def test_short_prompts_that_arrive_together_are_prefilled_in_the_same_step(
        tiny: Any, make: Any) -> None:
    """Four prompts of 200 tokens on a model that prefills 500 tokens a second (slept) and
    ``prefill_seconds`` 0.1: none is cut by time (each has at most 256 tokens left), so
    all four are prefilled before the first decode step and decoded together."""
    calls: list[int] = []

    def then(n: int, shape: Any) -> None:
        calls.append(int(shape[0]) if int(shape[1]) == 1 else -int(shape[1]))
        if int(shape[1]) > 1:
            time.sleep(0.002 * int(shape[1]))

    eng = make(max_concurrency=4, prefill_chunk=2048, prefill_seconds=0.1,
               model=Gate(tiny[0], then))
    prompts = [tokens(400 + i, 200) for i in range(4)]
    hs = [eng.submit(Job(prompt=p, max_tokens=3)) for p in prompts]
    eng.start()
    for p, h in zip(prompts, hs, strict=True):
        assert ids(drain(h)[0]) == greedy(tiny, p, 3)
    first_decode = next(i for i, c in enumerate(calls) if c > 0)
    assert calls[:first_decode] == [-199] * 4
    assert calls[first_decode] == 4  # the four decoded together from their first token


@pytest.mark.parametrize("streamed", [False, True])
def test_a_reader_not_streamed_is_woken_for_its_tokens_at_most_every_bulk_wake(
        streamed: bool) -> None:
    """A request not streamed answers once, at the end: the engine wakes its loop for a
    token at most every BULK_WAKE seconds (a Prefill or Done at once); a stream's reader
    is woken for each token it waits for. Every event arrives, in order."""
    import asyncio

    from kvstore.server.engine import BULK_WAKE

    h = Handle(lambda: None, streamed=streamed)
    wakes: list[str] = []

    async def run() -> list[Any]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*a: Any, **kw: Any) -> Any:
            wakes.append("wake")
            return real(*a, **kw)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        got: list[Any] = []
        it = h.batches(None)
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # the reader waits

        def engine() -> None:
            h._put(Prefill(3, 3))
            for i in range(40):  # a token every 2 ms: 80 ms, four BULK_WAKEs
                time.sleep(0.002)
                h._put(Token(i, str(i)))
            h._put(Done("length", 3, 0, 40))

        thread = threading.Thread(target=engine)
        thread.start()
        got += await first
        while not got or not isinstance(got[-1], Done):
            got += await it.__anext__()
        thread.join()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert [e.id for e in got if isinstance(e, Token)] == list(range(40))
    assert isinstance(got[0], Prefill) and isinstance(got[-1], Done)
    if streamed:
        assert len(wakes) >= 20  # about one a token
    else:
        assert 2 <= len(wakes) <= 2 + 0.08 / BULK_WAKE + 2  # Prefill, Done, one a 20 ms


# --- prefill lanes -----------------------------------------------------------------------


def test_two_lanes_prefill_two_jobs_side_by_side_and_each_gets_its_own_tokens(
        tiny: Any, make: Any) -> None:
    """With ``prefill_threads=2`` two jobs' chunks run at the same time, on the engine's
    thread and a lane; the tokens are mlx-lm's own for each prompt, and the lane's thread
    is gone once the engine stops."""
    spans: list[tuple[int, float, float]] = []  # (thread, start, end) of each prefill call
    lock = threading.Lock()

    class Timed:
        def __init__(self, model: Any) -> None:
            self.model = model

        def __call__(self, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = self.model(*args, **kw)
            if args[0].shape[1] > 1:
                mx.eval(out)
                time.sleep(0.05)  # long enough to overlap, whatever the machine
                with lock:
                    spans.append((threading.get_ident(), t0, time.perf_counter()))
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.model, name)

    eng = make(max_concurrency=4, prefill_chunk=64, prefill_threads=2, model=Timed(tiny[0]))
    prompts = [tokens(500 + i, n) for i, n in enumerate((300, 90, 200, 33))]
    hs = [eng.submit(Job(prompt=p, max_tokens=8)) for p in prompts]
    eng.start()
    for p, h in zip(prompts, hs, strict=True):
        assert ids(drain(h)[0]) == greedy(tiny, p, 8)
    assert len({t for t, _, _ in spans}) == 2
    overlapped = sum(1 for a in spans for b in spans
                     if a[0] < b[0] and a[1] < b[2] and b[1] < a[2])
    assert overlapped >= 3
    assert eng.counts()["prefill_tokens"] == sum(len(p) - 1 for p in prompts)
    assert eng.stop(30) == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("kvstore-prefill")]


def test_a_chunk_that_fails_on_a_lane_ends_its_job_alone(tiny: Any, make: Any) -> None:
    raised_on: list[str] = []

    def then(calls: int, shape: Any) -> None:
        if shape[1] == 77:
            raised_on.append(threading.current_thread().name)
            raise ValueError("bad chunk")

    eng = make(model=Gate(tiny[0], then), max_concurrency=2, prefill_threads=2)
    good_p = tokens(9, 30)
    # a new engine's turn takes the second ready job first, onto its own thread: the
    # first one submitted goes to the lane
    bad = eng.submit(Job(prompt=tokens(8, 78), max_tokens=3))
    good = eng.submit(Job(prompt=good_p, max_tokens=3))
    eng.start()
    assert drain(bad)[2].error == "ValueError: bad chunk"
    assert raised_on == ["kvstore-prefill-1"]
    assert ids(drain(good)[0]) == greedy(tiny, good_p, 3)
    assert eng.healthy()


def test_a_lane_without_a_stream_fails_the_chunks_sent_to_it_and_nothing_hangs(
        tiny: Any, make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(device: Any) -> Any:
        raise RuntimeError("no stream here")

    monkeypatch.setattr(mx, "new_stream", refused)
    eng = make(max_concurrency=2, prefill_threads=2)
    prompts = [tokens(20, 40), tokens(21, 40)]
    hs = [eng.submit(Job(prompt=p, max_tokens=3)) for p in prompts]
    eng.start()
    got = [drain(h, timeout=30) for h in hs]
    assert sorted(str(done.error) for _, _, done in got) == [
        "None", "RuntimeError: no stream here"]
    for p, (toks, _, done) in zip(prompts, got, strict=True):
        if done.error is None:
            assert ids(toks) == greedy(tiny, p, 3)
    assert eng.healthy()


def test_prefill_threads_must_be_at_least_1(tiny: Any, make: Any) -> None:
    with pytest.raises(ValueError, match="prefill_threads must be >= 1, got 0"):
        make(prefill_threads=0)


# --- a job decoded alone -------------------------------------------------------------------


@pytest.fixture
def solo_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the engines stepped a job decoded alone and handed one to the batch."""
    from kvstore.server import engine as engine_mod

    seen = {"next": 0, "handover": 0, "started": 0}
    step, hand = engine_mod._Solo.next, engine_mod._Solo.handover

    def counted_next(self: Any) -> Any:
        seen["next"] += 1
        return step(self)

    def counted_handover(self: Any) -> Any:
        seen["handover"] += 1
        seen["started"] += self._next is not None
        return hand(self)

    monkeypatch.setattr(engine_mod._Solo, "next", counted_next)
    monkeypatch.setattr(engine_mod._Solo, "handover", counted_handover)
    return seen


@pytest.mark.parametrize("sampling,logprobs", [
    (Sampling(), True),
    (Sampling(repetition_penalty=1.3, repetition_context_size=8), False),
    (Sampling(temperature=5.0, seed=11), True),
])
def test_a_job_decoded_alone_gives_what_the_batch_gives(
        tiny: Any, make: Any, solo_calls: dict[str, int], sampling: Sampling,
        logprobs: bool) -> None:
    prompt = tokens(40, 90)
    got = []
    for solo in (True, False):
        eng = make(solo=solo)
        eng.start()
        job = Job(prompt=prompt, max_tokens=24, sampling=sampling, logprobs=logprobs,
                  top_logprobs=3 if logprobs else 0)
        toks, _, done = drain(eng.submit(job))
        # what it leaves in the prompt cache: the prompt and its whole reply
        _, _, again = drain(eng.submit(Job(prompt=prompt + ids(toks) + tokens(41, 5),
                                           max_tokens=1)))
        got.append(([(t.id, t.text, t.logprob, t.top) for t in toks],
                    (done.finish, done.generated), again.cached_tokens))
        assert solo_calls["next"] == 24 + 1  # its 24 and the next job's one: none batched
    assert got[0] == got[1]
    assert got[0][2] == len(prompt) + 24
    if sampling.temperature == 0 and sampling.repetition_penalty is None:
        assert [t for t, *_ in got[0][0]] == greedy(tiny, prompt, 24)


def test_a_job_decoded_alone_goes_into_the_batch_when_another_is_ready(
        tiny: Any, make: Any, solo_calls: dict[str, int]) -> None:
    eng = make(max_concurrency=4)
    handles: list[Handle] = []
    first, second = tokens(42, 120), tokens(43, 50)
    # the first job alone for 9 tokens, then another one
    eng.sampling_hook = submit_during(eng, handles, 40, 10, Job(prompt=second, max_tokens=12))
    handles.append(eng.submit(Job(prompt=first, max_tokens=40)))
    eng.start()
    a_toks, _, a_done = drain(handles[0])
    b_toks, _, b_done = drain(handles[1])
    assert ids(a_toks) == greedy(tiny, first, 40) and a_done.generated == 40
    assert ids(b_toks) == greedy(tiny, second, 12)
    assert solo_calls["handover"] == solo_calls["started"] == 1
    assert 9 <= solo_calls["next"] <= 11  # then the batch stepped both
    # the whole reply is in the cache, across the handover
    _, _, again = drain(eng.submit(Job(prompt=first + ids(a_toks) + tokens(44, 5),
                                       max_tokens=1)))
    assert again.cached_tokens == len(first) + 40
    assert (eng.counts()["completed"], eng.counts()["errors"]) == (3, 0)


def test_a_job_decoded_alone_that_fails_ends_alone_and_the_engine_goes_on(
        tiny: Any, make: Any, solo_calls: dict[str, int]) -> None:
    steps = [0]

    def then(calls: int, shape: Any) -> None:
        if tuple(shape) == (1, 1):
            steps[0] += 1
            if steps[0] == 5:
                raise RuntimeError("the decode step broke")

    eng = make(model=Gate(tiny[0], then))

    def hook(job: Job, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        if job.max_tokens == 13:
            def boom(tokens: mx.array, logits: mx.array) -> mx.array:
                if tokens.size > 63:
                    raise ValueError("the processor broke")
                return logits
            return sampler, [boom]
        return sampler, processors

    eng.sampling_hook = hook
    eng.start()
    prompt = tokens(45, 60)
    toks, _, done = drain(eng.submit(Job(prompt=prompt, max_tokens=8)))
    assert (done.finish, done.error) == ("error", "RuntimeError: the decode step broke")
    assert ids(toks) == greedy(tiny, prompt, 3)  # 5th call: the step after the 3rd token
    toks, _, done = drain(eng.submit(Job(prompt=tokens(46, 60), max_tokens=13)))
    assert (done.finish, done.error) == ("error", "ValueError: the processor broke")
    assert ids(toks) == greedy(tiny, tokens(46, 60), 3)
    toks, _, done = drain(eng.submit(Job(prompt=prompt, max_tokens=6)))
    assert done.finish == "length" and ids(toks) == greedy(tiny, prompt, 6)
    assert eng.counts()["errors"] == 2 and eng.healthy() and eng._solo is None
    assert solo_calls["next"] >= 3 + 3 + 6
