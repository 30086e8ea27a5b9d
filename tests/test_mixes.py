"""Mixes over the real model: different mixes in one batch, the per-mix prefix
cache (A -> B -> A), mix snapshots, and runtime add/remove with stable ids."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from core.lora.adapter import effective_scale
from core.lora.mix import build_mix, mix_key
from core.lora.runtime import AdapterStacks
from core.model.llama import BatchItem
from core.options import EngineOptions
from core.serve.engine import Engine, EngineError
from core.serve.sampling import SamplingParams
from tests.mixing import forward
from tests.tiny_gguf import write_lora_gguf

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir, reference):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256, n_parallel=8))
    for name in reference["adapters"]:
        eng.add_adapter(ref_dir / "adapters" / name)
    yield eng
    eng.stop()


def adapters_of(engine):
    return {a["id"]: engine.adapter(a["id"]) for a in engine.adapters()}


def test_effective_scale_formula():
    assert effective_scale(0.5, 16.0, 8) == 1.0
    assert effective_scale(0.5, None, 8) == 0.5
    assert effective_scale(-2.0, 32.0, 16) == -4.0


def test_mix_key_ignores_zero_scales_and_order():
    assert mix_key({2: 0.5, 0: 0.0, 1: -1}) == ((1, -1.0), (2, 0.5))
    assert mix_key({}) == mix_key({0: 0.0, 1: 0.0}) == ()


def test_mix_weights_equal_sum_of_adapter_deltas(engine):
    """The stacked (A, B) of a mix reproduce sum_i s_i * B_i A_i on every fused matrix."""
    ads = adapters_of(engine)
    key = mix_key({0: 0.7, 1: -0.3, 2: 1.5})
    mw = build_mix(engine.config, key, ads)
    cfg = engine.config
    delta = mw.layers[0]["wqkv"]
    got = delta.dense_b() @ delta.a  # (q+2kv, d)
    want = np.zeros_like(got)
    for aid, s in key:
        for part, off in (("attn_q", 0), ("attn_k", cfg.q_dim), ("attn_v", cfg.q_dim + cfg.kv_dim)):
            pair = ads[aid].tensors.get(f"blk.0.{part}.weight")
            if pair is not None:
                d = pair.scale_for(s) * (pair.b @ pair.a)
                want[off : off + d.shape[0]] += d
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # lora_all_q8 (rank 32) only covers layers 0,1,2,10,20,29: ranks stack per layer
    assert mw.layers[0]["wqkv"].a.shape[0] == 3 * 8 + 3 * 32
    assert mw.layers[5]["wqkv"].a.shape[0] == 3 * 8
    assert mw.layers[5]["w_gate_up"].a.shape[0] == 2 * 16
    # B keeps one dense block per part (Q, K, V), never the fused matrix's zeros
    assert [(r0, r1) for r0, r1, *_ in mw.layers[0]["wqkv"].parts] == [
        (0, cfg.q_dim),
        (cfg.q_dim, cfg.q_dim + cfg.kv_dim),
        (cfg.q_dim + cfg.kv_dim, cfg.q_dim + 2 * cfg.kv_dim),
    ]


def test_different_mixes_in_one_batch_equal_each_alone(engine, reference):
    ads = adapters_of(engine)
    cases = reference["greedy"][:8]  # one prompt, 8 different mixes
    items, alone, mws = [], [], []
    for c in cases:
        mw = engine.lora.mixes.get(mix_key({e["id"]: e["scale"] for e in c["lora"]}), ads)
        toks = np.array(c["prompt_tokens"])
        alone.append(forward(engine.model, [BatchItem(toks, engine.model.new_cache(32))], [mw])[0])
        items.append(BatchItem(toks, engine.model.new_cache(32)))
        mws.append(mw)
    batched = forward(engine.model, items, mws)
    for a, b in zip(alone, batched):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
        assert int(np.argmax(a)) == int(np.argmax(b))


def test_concurrent_requests_with_8_mixes_are_batched_and_exact(engine, reference):
    cases = reference["greedy"][8:16]
    results, steps0 = {}, engine.scheduler.steps
    barrier = threading.Barrier(len(cases))

    def run(i, c):
        barrier.wait()
        results[i] = engine.complete(
            c["prompt_tokens"],
            SamplingParams(n_predict=16, **GREEDY),
            mix={e["id"]: e["scale"] for e in c["lora"]},
            cache_prompt=False,
        ).tokens

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, c in enumerate(cases):
        assert results[i] == c["tokens"], f"case {i}"
    # alone they would need 8 * 16 forward steps; batched they share steps
    assert engine.scheduler.steps - steps0 < 8 * 16 / 2


def test_a_b_a_reuses_a_cache_and_never_serves_b(engine, reference):
    case_a, case_b = reference["greedy"][9], reference["greedy"][10]  # same prompt, two mixes
    mix_a = {e["id"]: e["scale"] for e in case_a["lora"]}
    mix_b = {e["id"]: e["scale"] for e in case_b["lora"]}
    prompt = case_a["prompt_tokens"]
    engine.prefix.clear()
    p = SamplingParams(n_predict=16, **GREEDY)
    first = engine.complete(prompt, p, mix=mix_a)
    assert first.timings.cache_n == 0
    b = engine.complete(prompt, p, mix=mix_b)
    assert b.timings.cache_n == 0, "a cache built under mix A was served to mix B"
    assert b.tokens == case_b["tokens"]
    again = engine.complete(prompt, p, mix=mix_a)
    assert again.timings.cache_n == len(prompt) - 1
    assert again.timings.prompt_n == 1
    assert again.tokens == first.tokens == case_a["tokens"]


def test_zero_scale_adapters_do_not_split_the_cache(engine, reference):
    case = reference["greedy"][9]  # lora_attn at 1, others 0
    engine.prefix.clear()
    p = SamplingParams(n_predict=4, **GREEDY)
    engine.complete(case["prompt_tokens"], p, mix={0: 1.0})
    again = engine.complete(case["prompt_tokens"], p, mix={0: 1.0, 1: 0.0, 2: 0.0})
    assert again.timings.cache_n == len(case["prompt_tokens"]) - 1


def test_mix_is_snapshotted_when_the_request_is_admitted(engine, reference):
    case = reference["greedy"][9]
    engine.set_mix({0: 1.0})
    got, changed = [], threading.Event()

    def on_event(ev):
        got.append(ev)
        if len(got) == 2 and not changed.is_set():
            engine.set_mix({0: -2.0, 1: 2.0})  # change the global mix mid-generation
            changed.set()

    done = threading.Event()
    req = engine.submit(
        case["prompt_tokens"],
        SamplingParams(n_predict=16, **GREEDY),
        lambda ev: (on_event(ev), ev.kind == "done" and done.set()),
        cache_prompt=False,
    )
    assert done.wait(120)
    assert changed.is_set()
    assert got[-1].tokens == case["tokens"]
    assert got[-1].mix == ((0, 1.0),)
    assert req.mix == ((0, 1.0),)
    engine.set_mix({})


def test_mix_switch_builds_nothing(engine, monkeypatch):
    """Moving a fader only records scales: no mixed weights are built until a
    request runs under that mix (bench/ reports how long a switch takes)."""

    def no_build(*a, **kw):
        raise AssertionError("set_mix built mix weights")

    monkeypatch.setattr(engine.lora.mixes, "get", no_build)
    for i in range(100):
        engine.set_mix({0: i / 100, 1: -i / 100, 2: 0.5})
    assert engine.get_mix() == {0: 0.99, 1: -0.99, 2: 0.5}
    monkeypatch.undo()
    engine.set_mix({})


def test_runtime_add_remove_keeps_ids_stable(engine, ref_dir):
    extra = engine.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=0.25)
    assert extra == max(a["id"] for a in engine.adapters())
    engine.remove_adapter(1)
    ids = [a["id"] for a in engine.adapters()]
    assert 1 not in ids and extra in ids and 2 in ids
    assert engine.get_mix()[extra] == 0.25
    with pytest.raises(EngineError):
        engine.set_mix({1: 1.0})
    with pytest.raises(EngineError):
        engine.remove_adapter(1)
    # put lora_ffn back for other tests: it gets a new id, never 1 again
    new = engine.add_adapter(ref_dir / "adapters" / "lora_ffn.gguf")
    assert new not in (1, extra)
    engine.remove_adapter(extra)


def test_prefix_cache_is_bounded(smollm_path):
    eng = Engine.from_path(
        smollm_path, EngineOptions(ctx_size=128, prefix_cache_bytes=3 * 46080 * 40)
    )
    try:
        for i in range(6):
            eng.complete(
                [1] + list(range(100 + i * 50, 130 + i * 50)), SamplingParams(n_predict=2, **GREEDY)
            )
        per_tok = eng.model.new_cache(1).nbytes
        used = sum(e.used_bytes for e in eng.prefix._entries.values())
        assert used <= eng.prefix.max_bytes and eng.prefix.n_entries < 6
        assert per_tok == 2 * 30 * 3 * 64 * 4
    finally:
        eng.stop()


@pytest.fixture(params=["blocked", "gemm", "gemv"])
def regime(request, engine):
    """Each small-batch regime in turn (core/model/linear.py), whichever calibration chose."""
    before = engine.model.lin._by_rows
    engine.model.lin.force(request.param)
    yield request.param
    engine.model.lin._by_rows = before


def test_decode_step_under_many_mixes_equals_each_alone(engine, regime):
    """One decode step of 7 sequences: a base row, one adapter at three scales, a
    two-adapter mix, and one mix shared by two sequences. The stacked-adapter path
    (one matmul pair per target for all mixes) must give what each gives alone, in
    both small-batch regimes (the delta runs beside the product, or after it in place)."""
    ads = adapters_of(engine)
    ids = sorted(ads)
    keys = [
        (),
        mix_key({ids[0]: 0.5}),
        mix_key({ids[0]: -1.0}),
        mix_key({ids[0]: 2.0}),
        mix_key({ids[1]: 0.7, ids[2]: -0.4}),
        mix_key({ids[2]: 1.0}),
        mix_key({ids[2]: 1.0}),
    ]
    model = engine.model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 20000, size=5 + i) for i in range(len(keys))]

    def prefilled(i, mw):
        cache = model.new_cache(32)
        forward(model, [BatchItem(prompts[i], cache)], [mw])
        return cache

    mws = [engine.lora.mixes.get(k, ads) for k in keys]
    nxt = [np.array([int(rng.integers(100, 20000))]) for _ in keys]
    alone = [
        forward(model, [BatchItem(nxt[i], prefilled(i, mw))], [mw])[0] for i, mw in enumerate(mws)
    ]
    stacks = AdapterStacks(model.cfg)
    batch = forward(
        model, [BatchItem(nxt[i], prefilled(i, mw)) for i, mw in enumerate(mws)], mws, stacks
    )
    assert len(stacks) == 1  # the stacked path ran
    for a, b in zip(alone, batch):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-4)
        assert int(np.argmax(a)) == int(np.argmax(b))


def write_partial_adapter(path, cfg, rank: int = 4, seed: int = 11):
    """A LoRA on only some parts of fused matrices: K (not Q, V) and gate (not up)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (n_out, n_in) in {
        "blk.3.attn_k.weight": (cfg.kv_dim, cfg.dim),
        "blk.4.ffn_gate.weight": (cfg.ffn_dim, cfg.dim),
    }.items():
        tensors[name + ".lora_a"] = rng.standard_normal((rank, n_in)) * 0.2
        tensors[name + ".lora_b"] = rng.standard_normal((n_out, rank)) * 0.2
    return write_lora_gguf(path, tensors)


@pytest.mark.parametrize("small", ["blocked", "gemm", "gemv"])
def test_stacked_decode_with_adapters_on_some_parts_only(smollm_path, ref_dir, tmp_path, small):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=64, n_parallel=4), start=False)
    eng.model.lin.force(small)
    part = eng.add_adapter(write_partial_adapter(tmp_path / "partial.gguf", eng.config))
    attn = eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf")
    ads = adapters_of(eng)
    keys = [mix_key({part: 1.0}), mix_key({part: -0.5, attn: 0.5}), mix_key({attn: 1.0}), ()]
    model, rng = eng.model, np.random.default_rng(2)
    prompts = [rng.integers(100, 20000, size=4 + i) for i in range(len(keys))]
    mws = [eng.lora.mixes.get(k, ads) for k in keys]
    nxt = [np.array([int(rng.integers(100, 20000))]) for _ in keys]

    def step(i_s):
        caches = []
        for i in i_s:
            c = model.new_cache(16)
            forward(model, [BatchItem(prompts[i], c)], [mws[i]])
            caches.append(c)
        items = [BatchItem(nxt[i], c) for i, c in zip(i_s, caches)]
        return forward(model, items, [mws[i] for i in i_s], stacks)

    stacks = AdapterStacks(model.cfg)
    alone = [step([i])[0] for i in range(len(keys))]
    batch = step(list(range(len(keys))))
    assert len(stacks) == 1
    for a, b in zip(alone, batch):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-4)
    # the partial adapter really changes the output
    assert np.abs(alone[0] - alone[3]).max() > 1e-3


def test_submit_many_admits_its_requests_in_the_same_step(engine):
    """A/B compare: the second side's mix is new (its stacked weights take tens of ms
    to build), yet both sides start in the same scheduler step; a refused job comes
    back as its error and does not stop the other."""
    ids = sorted(adapters_of(engine))
    engine.lora.mixes._cache.clear()  # both mixes must be built now
    events = {0: [], 1: []}
    prompt = engine.tokenizer.encode("Say something about rivers.")
    p = SamplingParams(n_predict=4, **GREEDY)
    jobs = [
        dict(prompt=prompt, params=p, on_event=events[0].append, mix={ids[0]: 0.9}),
        dict(prompt=prompt, params=p, on_event=events[1].append, mix={ids[1]: 0.3, ids[2]: -0.7}),
        dict(prompt=prompt, params=p, on_event=print, mix={999: 1.0}),
    ]
    a, b, bad = engine.submit_many(jobs)
    assert isinstance(bad, EngineError) and "no adapter with id 999" in str(bad)
    deadline = time.time() + 120
    while not all(ev and ev[-1].kind == "done" for ev in events.values()):
        assert time.time() < deadline
        time.sleep(0.01)
    assert a.admitted_step == b.admitted_step >= 0


def test_mix_cache_is_capped_by_bytes_not_only_by_count(engine):
    """24 distinct mixes once added 576 MB on SmolLM2 with only a count cap. With a
    byte cap the cache keeps as many whole mixes as fit, least recently used out
    first, and always the newest one."""
    from core.lora.mix import mix_key
    from core.lora.runtime import MixCache

    ads = adapters_of(engine)
    one = MixCache(engine.config).get(mix_key({0: 1.0}), ads)
    cache = MixCache(engine.config, max_entries=32, max_bytes=int(one.nbytes * 3.5))
    keys = [mix_key({0: 0.1 * (i + 1)}) for i in range(8)]
    built = [cache.get(k, ads) for k in keys]
    assert all(b.nbytes == one.nbytes for b in built)  # same shapes at every scale
    assert len(cache._cache) == 3 and cache.nbytes == 3 * one.nbytes <= cache.max_bytes
    assert list(cache._cache) == keys[-3:]
    tiny = MixCache(engine.config, max_bytes=1)  # smaller than any mix: keeps the newest
    tiny.get(keys[0], ads)
    tiny.get(keys[1], ads)
    assert list(tiny._cache) == [keys[1]] and tiny.nbytes == one.nbytes
    tiny.forget_adapter(0)
    assert tiny.nbytes == 0 and not tiny._cache
