"""One request must never stop or corrupt the engine (issue #15, items 1, 2, 3, 9).

Over the real SmolLM2: a request whose sampler or forward pass meets non-finite numbers
fails alone (its DoneEvent says why, with an error type) while the others in the same
step go on unchanged; a bug in one step fails that step's requests and the loop keeps
serving; a failed adapter load leaves nothing behind; health tells the truth. The
hostile adapter is written by the test: finite weights (it passes validation) so large
that the activations overflow float32.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

import core.serve.engine
import core.serve.scheduler
from core.lora.adapter import AdapterError, LoraPair
from core.serve.engine import Engine, EngineError
from core.serve.sampling import SamplingParams
from core.serve.scheduler import DoneEvent
from tests.serving import wire_mix
from tests.tiny_gguf import write_lora_gguf

WAIT_S = 120  # a request that never finishes fails the test instead of hanging it


def write_hostile_adapter(path, cfg):
    rng = np.random.default_rng(0)
    return write_lora_gguf(
        path,
        {
            "blk.0.attn_v.weight.lora_a": rng.standard_normal((2, cfg.dim)),
            "blk.0.attn_v.weight.lora_b": np.full((cfg.kv_dim, 2), 3e38),  # finite float32
        },
    )


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir, tmp_path_factory):
    eng = Engine.from_path(smollm_path, ctx_size=256, n_parallel=2)
    eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf")
    eng.hostile = eng.add_adapter(
        write_hostile_adapter(tmp_path_factory.mktemp("hostile") / "hostile.gguf", eng.config)
    )
    yield eng
    eng.stop()


def greedy(n=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, n_predict=n, ignore_eos=True, **kw)


def job(engine, text, params, **kw) -> dict:
    return dict(prompt=engine.tokenizer.encode(text), params=params, cache_prompt=False, **kw)


def run_jobs(engine, jobs: list[dict]) -> list[DoneEvent]:
    """Submit together (admitted in one step), wait for every DoneEvent."""
    qs = [queue.Queue() for _ in jobs]
    got = engine.submit_many([dict(j, on_event=q.put) for j, q in zip(jobs, qs)])
    dones = []
    for r, q in zip(got, qs):
        if isinstance(r, Exception):
            raise r
        while not isinstance(ev := q.get(timeout=WAIT_S), DoneEvent):
            pass
        dones.append(ev)
    return dones


SHORT = "The capital of France is"
LONG = "Here is a long story about a lighthouse keeper who counted the waves every night:"


def test_unvalidated_penalty_fails_only_its_request_and_the_engine_keeps_serving(
    engine, monkeypatch
):
    """frequency_penalty=-1e300 at temperature 1 (validate() now refuses it; here it is
    let through as a value no check foresaw) made the sampler raise IndexError on the
    scheduler thread: every later request waited forever."""
    (want,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    monkeypatch.setattr(core.serve.engine, "validate", lambda p: p)
    bad = SamplingParams(temperature=1, n_predict=4, frequency_penalty=-1e300, seed=1)
    # the repeated prompt token makes the penalty apply at the first sample
    bad_done, good = run_jobs(engine, [job(engine, "Hi Hi Hi", bad), job(engine, SHORT, greedy())])
    assert bad_done.stop_type == "error" and bad_done.error_type == "server_error"
    assert "not finite" in bad_done.error
    assert good.stop_type == "limit" and good.tokens == want.tokens
    monkeypatch.undo()
    (again,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    assert again.tokens == want.tokens
    assert engine.health() == (True, "ok")


def test_hostile_mix_fails_alone_and_leaves_no_trace_in_its_slot(engine):
    """A mix that overflows float32 used to answer 200 with token garbage and leave NaN
    keys/values in its pool slot, which then corrupted a later, unrelated request in that
    slot decoded next to a longer one."""
    pair = [job(engine, LONG, greedy()), job(engine, SHORT, greedy())]
    want = run_jobs(engine, pair)
    hostile = job(engine, SHORT, greedy(4), mix={engine.hostile: 1.0})
    bad, good = run_jobs(engine, [hostile, job(engine, SHORT, greedy())])
    assert bad.stop_type == "error" and bad.error_type == "server_error"
    assert "not finite" in bad.error and "LoRA" in bad.error
    assert good.tokens == want[1].tokens  # same step, same forward: unaffected
    (bad,) = run_jobs(engine, [hostile])  # alone in a slot this time
    assert bad.stop_type == "error"
    pool = engine.scheduler.pool
    assert np.isfinite(pool.k).all() and np.isfinite(pool.v).all()  # scrubbed
    # the short request lands in either slot, next to the longer one
    for jobs in (pair, pair[::-1]):
        got = {d.content: d.tokens for d in run_jobs(engine, jobs)}
        assert got == {d.content: d.tokens for d in want}


def test_lora_scales_are_bounded_where_they_enter(engine, ref_dir):
    """Scales of 1e20 (per request) or 1e308 (global mix, answered 200 before) overflow
    the forward pass; |scale| <= 100 is refused up front, naming the field."""
    aid = engine.hostile
    before = engine.get_mix()
    with pytest.raises(EngineError, match=rf"scale of adapter {aid} .*\[-100, 100\]"):
        engine.set_mix({aid: 1e308})
    with pytest.raises(EngineError, match=rf"lora: scale of adapter {aid}"):
        wire_mix(engine, [{"id": aid, "scale": 1e20}], "lora")
    with pytest.raises(EngineError, match=r"lora: scale .*got 1e\+20"):
        engine.submit_many(
            [job(engine, SHORT, greedy(), mix=wire_mix(engine, [{"id": 0, "scale": 1e20}]))]
        )
    n = len(engine.adapters())
    with pytest.raises(EngineError, match="scale"):
        engine.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=1e308)
    assert len(engine.adapters()) == n and engine.get_mix() == before
    assert wire_mix(engine, [{"id": 0, "scale": -100}])[0] == -100.0
    with pytest.raises(EngineError):
        wire_mix(engine, [{"id": 0, "scale": 100.5}])


def test_a_failing_step_fails_its_requests_and_the_loop_survives(engine, monkeypatch):
    sched = engine.scheduler
    (want,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    failures = sched.step_failures

    def boom(s):
        monkeypatch.undo()  # once
        raise RuntimeError("boom in a step")

    monkeypatch.setattr(sched, "_propose", boom)  # runs for a lone greedy sequence
    (done,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    assert done.stop_type == "error" and done.error_type == "server_error"
    assert "RuntimeError: boom in a step" in done.error
    assert sched.step_failures == failures + 1 and engine.health() == (True, "ok")
    (again,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    assert again.tokens == want.tokens


def test_a_bug_in_one_sequences_sampling_fails_it_alone(engine, monkeypatch):
    (want,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    real = core.serve.scheduler.make_sampler

    def make(p, eog=(), constraint=None):
        if p.seed != 4242:
            return real(p, eog, constraint)

        def broken(logits, history):
            raise RuntimeError("sampler bug")

        return broken

    monkeypatch.setattr(core.serve.scheduler, "make_sampler", make)
    bad, good = run_jobs(
        engine, [job(engine, LONG, greedy(seed=4242)), job(engine, SHORT, greedy())]
    )
    assert bad.stop_type == "error" and "RuntimeError: sampler bug" in bad.error
    assert good.tokens == want.tokens


def test_a_request_that_cannot_be_admitted_fails_alone(engine, monkeypatch):
    (want,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    free = engine.scheduler.pool.n_free

    def take(key, prompt):
        monkeypatch.undo()
        raise RuntimeError("prefix cache bug")

    monkeypatch.setattr(engine.scheduler.prefix, "take", take)
    (bad,) = run_jobs(engine, [dict(job(engine, SHORT, greedy()), cache_prompt=True)])
    assert bad.stop_type == "error" and "prefix cache bug" in bad.error
    assert bad.error_type == "server_error"
    assert engine.scheduler.pool.n_free == free  # no slot was lost
    (again,) = run_jobs(engine, [job(engine, SHORT, greedy())])
    assert again.tokens == want.tokens


def test_health_says_whether_requests_would_be_served(engine):
    assert engine.health() == (True, "ok")
    engine.stop()
    try:
        ok, reason = engine.health()
        assert not ok and "not running" in reason
    finally:
        engine.start()
    deadline = time.monotonic() + WAIT_S
    while engine.health() != (True, "ok"):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_engine_without_a_model_refuses_requests_with_503():
    eng = Engine()
    assert eng.health() == (False, "no model loaded")
    for call in (
        lambda: eng.submit([1, 2], SamplingParams(), print),
        lambda: eng.submit_many([dict(prompt=[1, 2], params=SamplingParams(), on_event=print)]),
    ):
        with pytest.raises(EngineError, match="no model loaded") as e:
            call()
        assert e.value.code == 503 and e.value.type == "unavailable_error"


@pytest.mark.parametrize("where", ["build", "info"])
def test_a_failed_adapter_load_leaves_nothing_behind(engine, ref_dir, monkeypatch, where):
    """An adapter that passes loading but fails later (a validation gap) is refused as an
    AdapterError naming it: no id, no scale, listings and the mix as they were."""
    real = core.serve.engine.load_adapter

    def load(path, cfg):
        ad = real(path, cfg)
        if where == "build":  # no fused slot for this name: building the mix would fail
            pair = next(iter(ad.tensors.values()))
            ad.tensors["blk.0.attn_sideways.weight"] = LoraPair(pair.a, pair.b, pair.alpha)
        else:

            def info():
                raise KeyError("broken metadata")

            ad.info = info
        return ad

    monkeypatch.setattr(core.serve.engine, "load_adapter", load)
    engine.set_mix({0: 0.5})
    listed, mix, next_id, info = (
        engine.adapters(),
        engine.get_mix(),
        engine._next_id,
        engine.model_info(),
    )
    with pytest.raises(AdapterError, match="lora_attn.gguf: cannot be applied"):
        engine.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=0.7)
    assert engine.adapters() == listed and engine.get_mix() == mix
    assert engine._next_id == next_id and engine.model_info() == info
    (done,) = run_jobs(engine, [job(engine, SHORT, greedy(4))])  # the global mix still runs
    assert done.stop_type == "limit"
    engine.set_mix({})


def test_run_on_engine_runs_on_the_engine_thread_and_returns_or_raises(engine):
    """Scoring and embeddings run their forward passes through run_on_engine: the
    function runs on the engine thread (which owns the model), its result or its error
    comes back through the Future, and the loop keeps serving after an error."""
    import threading

    seen = {}

    def probe(model):
        seen["thread"] = threading.current_thread().name
        seen["model"] = model
        return 42

    assert engine.run_on_engine(probe).result(timeout=WAIT_S) == 42
    assert seen["thread"] == "mixdesk-engine" and seen["model"] is engine.model

    def boom(model):
        raise RuntimeError("scoring failed")

    with pytest.raises(RuntimeError, match="scoring failed"):
        engine.run_on_engine(boom).result(timeout=WAIT_S)
    done = run_jobs(engine, [job(engine, "Hello", greedy(n=3))])
    assert done[0].error is None and len(done[0].tokens) == 3


def test_run_on_engine_without_a_model_is_a_503():
    with pytest.raises(EngineError) as e:
        Engine().run_on_engine(lambda model: None)
    assert e.value.code == 503
