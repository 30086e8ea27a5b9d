"""-ctk/-ctv f16: the KV cache stores keys and values as float16 (llama-server's default
cache type), half the bytes of float32, on the three real families with their
reference adapters.

llama.cpp's reference data were recorded with an f32 cache, so they are the numbers of
the default; the keys' and values' rounding to float16 moves logprobs by about as much
as float32's summation order does (worst top-5 difference from the reference, all
cases: SmolLM2 0.019 against 0.015 in f32, Qwen2.5 0.014 against 0.015, Gemma-3 0.028
against 0.025 without its q8_0 adapter, 2026-12-07). So an f16 cache is held to the
parity tests' own bounds: top-1 at every step, top-5 within 0.05 (0.15 where Gemma's
q8_0 adapter is mixed in), and llama.cpp's greedy tokens through the engine's pool.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_http_api import req
from test_parity_families import Q8_ADAPTER, Q8_TOL, TOL

from core.http import ServerSettings, ServerThread
from core.lora.mix import mix_key
from core.model import attention
from core.model.kv_cache import kv_bytes
from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.mixing import check_teacher_forced

# family -> (its model's fixture, its reference's fixture)
FAMILIES = {
    "smollm2": ("smollm_path", "reference"),
    "qwen2": ("qwen2_path", "qwen2_reference"),
    "gemma3": ("gemma3_path", "gemma3_reference"),
}


def f16_engine(path, **kw) -> Engine:
    opts = dict(ctx_size=256, n_parallel=2, draft_max=0, cache_type_k="f16", cache_type_v="f16")
    return Engine.from_path(path, EngineOptions(**{**opts, **kw}))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, ref_dir):
    """(name, an engine with an f16 cache and the reference adapters, reference)."""
    model_fx, ref_fx = FAMILIES[request.param]
    ref = request.getfixturevalue(ref_fx)
    eng = f16_engine(request.getfixturevalue(model_fx))
    for name in ref["adapters"]:
        eng.add_adapter(ref_dir / "adapters" / name)
    yield request.param, eng, ref
    eng.stop()


def case_mix(case) -> dict[int, float]:
    return {e["id"]: e["scale"] for e in case["lora"]}


def q8_mixed(name: str, case) -> bool:
    """Whether the case mixes in an adapter llama.cpp ran with 8-bit activations."""
    q8 = Q8_ADAPTER.get(name)
    return q8 is not None and bool(case_mix(case).get(q8))


def test_the_cache_holds_float16_in_half_the_bytes(family):
    name, eng, _ = family
    info = eng.model_info()
    c = eng.config
    f32 = kv_bytes(c.n_layers, c.n_kv_heads, c.head_dim, info["n_ctx"])
    assert (info["cache_type_k"], info["cache_type_v"]) == ("f16", "f16")
    assert info["kv_bytes"] == f32 // 2
    assert info["ram_bytes"] == info["memory_bytes"] + f32 // 2
    pool = eng.scheduler.pool
    assert pool.k.dtype == pool.v.dtype == np.float16
    assert pool.k.nbytes + pool.v.nbytes == 2 * f32 // 2  # two slots of n_ctx
    cache = eng.model.new_cache(8)  # a standalone sequence's (scores, embeddings)
    assert cache.k.dtype == cache.v.dtype == np.float16


def test_teacher_forced_cases_keep_llamacpp_parity(family):
    """Every reference case in one forward (the prompt's attention over a float16
    cache, widened for numpy's products)."""
    name, eng, ref = family
    adapters = {a["id"]: eng.adapter(a["id"]) for a in eng.adapters()}
    for case in ref["greedy"]:
        mw = eng.lora.mixes.get(mix_key(case_mix(case)), adapters)
        check_teacher_forced(eng.model, mw, case, Q8_TOL if q8_mixed(name, case) else TOL)


def test_drafts_verified_over_a_float16_cache_keep_llamacpp_parity(family, monkeypatch):
    """Every third reference case (each mix of adapters among them) with its reply fed
    5 tokens a forward, as speculative decoding verifies a draft: those forwards read
    the float16 cache in the compiled kernel, each token over the keys up to its own
    position (one query of 5*g heads), and keep llama.cpp's top-1 and top-5 bounds."""
    name, eng, ref = family
    calls: list[tuple[int, int]] = []  # (heads, queries) of each compiled call
    real = attention.decode_attention

    def spy(q, kc, vc, spans, softcap=0.0, back=None):
        calls.append((q.shape[2], q.shape[0]))
        return real(q, kc, vc, spans, softcap, back)

    monkeypatch.setattr(attention, "decode_attention", spy)
    adapters = {a["id"]: eng.adapter(a["id"]) for a in eng.adapters()}
    for case in ref["greedy"][::3]:
        mw = eng.lora.mixes.get(mix_key(case_mix(case)), adapters)
        check_teacher_forced(eng.model, mw, case, Q8_TOL if q8_mixed(name, case) else TOL, chunk=5)
    g = eng.config.n_heads // eng.config.n_kv_heads
    assert (5 * g, 1) in calls  # the drafts' forwards took the kernel


def test_free_running_greedy_two_at_a_time(family):
    """Through the scheduler, two cases at once: both decode in the pool's compiled
    attention over float16 keys and values, and each gives llama.cpp's 16 tokens."""
    name, eng, ref = family
    cases = [c for c in ref["greedy"] if not q8_mixed(name, c)][::3]
    params = SamplingParams(temperature=0, n_predict=16, ignore_eos=True)
    for a, b in zip(cases[::2], cases[1::2]):
        done: dict[int, object] = {}
        finished = threading.Event()

        def on_event(ev, k, done=done, finished=finished):
            if ev.kind == "done":
                done[k] = ev
                if len(done) == 2:
                    finished.set()

        jobs = [
            dict(prompt=c["prompt_tokens"], params=params, mix=case_mix(c), cache_prompt=False,
                 on_event=lambda ev, k=k: on_event(ev, k))
            for k, c in enumerate((a, b))
        ]  # fmt: skip
        eng.submit_many(jobs)  # admitted in one step: both decode in every step
        assert finished.wait(120)
        assert done[0].tokens == a["tokens"] and done[1].tokens == b["tokens"]


def test_keys_and_values_apart(smollm_path, reference, ref_dir):
    """-ctk f16 with -ctv f32 (and the other way): each array in its own type, and
    llama.cpp's greedy tokens either way."""
    case = reference["greedy"][5]
    for k, v in (("f16", "f32"), ("f32", "f16")):
        eng = f16_engine(smollm_path, cache_type_k=k, cache_type_v=v)
        try:
            for name in reference["adapters"]:
                eng.add_adapter(ref_dir / "adapters" / name)
            info = eng.model_info()
            assert (info["cache_type_k"], info["cache_type_v"]) == (k, v)
            assert eng.scheduler.pool.k.dtype == np.dtype(np.float16 if k == "f16" else np.float32)
            assert eng.scheduler.pool.v.dtype == np.dtype(np.float16 if v == "f16" else np.float32)
            params = SamplingParams(temperature=0, n_predict=16, ignore_eos=True)
            done = eng.complete(case["prompt_tokens"], params, mix=case_mix(case))
            assert done.tokens == case["tokens"]
        finally:
            eng.stop()


def test_a_saved_slot_restores_into_a_float16_cache(smollm_path, tmp_path):
    """A slot file holds float32 (float16 widens exactly), so a slot saved from an f16
    cache restores into it bit for bit: the prompt is served from it (one token of
    prefill) with the same greedy text."""
    eng = f16_engine(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, slot_save_path=tmp_path)).start()
    try:
        body = {"prompt": "The capital of France is a city called", "n_predict": 6}
        body |= {"temperature": 0, "ignore_eos": True}
        st, first = req(srv, "POST", "/completion", {**body, "id_slot": 1})
        assert st == 200, first
        st, saved = req(srv, "POST", "/slots/1?action=save", {"filename": "f16.bin"})
        assert st == 200, saved
        st, _ = req(srv, "POST", "/slots/1?action=erase")
        assert st == 200
        st, restored = req(srv, "POST", "/slots/0?action=restore", {"filename": "f16.bin"})
        assert st == 200 and restored["n_restored"] == saved["n_saved"], restored
        st, again = req(srv, "POST", "/completion", {**body, "id_slot": 0})
        assert st == 200 and again["timings"]["prompt_n"] == 1, again["timings"]
        assert again["content"] == first["content"]
    finally:
        srv.stop()
        eng.stop()


def test_the_headless_server_runs_with_an_f16_cache_and_says_so(smollm_path, reference):
    """`main.py --headless -ctk f16 -ctv f16`, as a llama-server user types it: no
    notice that the flags are ignored, the load log names the cache's types, and a real
    HTTP client gets llama.cpp's greedy tokens."""
    from test_http_headless import free_port, http, start, stop, wait_healthy

    case = reference["greedy"][0]  # no adapter
    port = free_port()
    proc = start(["-m", str(smollm_path), "--port", str(port), "-ctk", "f16", "-ctv", "f16"])
    try:
        wait_healthy(proc, port)
        body = {"prompt": case["prompt_tokens"], "n_predict": 16, "temperature": 0}
        body |= {"ignore_eos": True, "return_tokens": True}
        st, out = http(port, "POST", "/completion", body)
        assert st == 200, out
        assert out["tokens"] == case["tokens"]
    finally:
        err = stop(proc)
    assert "KV cache f16/f16 (keys/values)" in err
    assert "kept in f32" not in err
