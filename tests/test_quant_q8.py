"""--activations q8: products of quantized weights with activations rounded to int8
per 32 (core/model/kernel_q8.py), as llama.cpp computes them.

The kernels' integer sums are exact, so each product must equal float64 math on the
dequantized weights and the *rounded* activations up to float32 summation; every row
of x must come out the same whatever rows it is batched with (A/B compare and the
grid must not depend on batching); and on the real SmolLM2 the engine in this mode
must track llama.cpp's own run on the Q4_1 file (which rounds activations so) more
closely than the exact float32 mode does. These kernels need a CPU with VNNI; on one
without, the mode falls back to float32, which is tested everywhere.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from core.model import kernel_q8, quant
from core.model.quant import FusedMatrix, QuantMatrix
from tests.tiny_gguf import random_matrix

VNNI = kernel_q8.available()
needs_vnni = pytest.mark.skipif(not VNNI, reason="this CPU has no VNNI (AVX-512 VNNI or AVX-VNNI)")

Q8_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1]
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16)  # fours, pairs and singles of rows of x
TOL = 2e-6  # relative to the sum of |terms|, as tests/test_quant_kernels.py


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """The q8 products of every type, compiled once (or loaded from the cache), shared
    out to a helper process as a model load does: ~12 s per type on an empty cache."""
    quant.set_threads(2)
    if VNNI:
        quant.warm_up(Q8_TYPES, activations="q8")


def rounded(x: np.ndarray, qt: Q) -> np.ndarray:
    """x as the q8 products of type ``qt`` see it: each run (256 values for the
    K-quants, 32 for the others) rounded to int8 times its scale."""
    t, n = x.shape
    run = kernel_q8.RUN[int(qt)]
    x8 = np.empty((t, n), np.int8)
    xd = np.empty((t, n // run), np.float32)
    xs = np.empty((t, n // 32), np.float32)
    kernel_q8.quantize_x(x, x8, xd, xs)
    return (x8.astype(np.float64).reshape(t, -1, run) * xd[..., None]).reshape(t, n)


# row widths: whole 256-blocks, and 576 (SmolLM2's: 18 blocks of 32, a tail of 2)
SHAPES = [(qt, n) for qt in Q8_TYPES for n in (512, 2048)]
SHAPES += [(qt, 576) for qt in (Q.Q8_0, Q.Q4_0, Q.Q4_1)]


@needs_vnni
@pytest.mark.parametrize("qt,n_in", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_products_equal_float_math_on_the_rounded_activations(qt, n_in):
    rng = np.random.default_rng(int(qt) * 7 + n_in)
    data = random_matrix(qt, 37, n_in, rng)
    m = QuantMatrix(qt, data, (37, n_in), activations="q8")
    w64 = quants.dequantize(data, qt).reshape(37, n_in).astype(np.float64)
    for t in ROW_COUNTS:
        x = rng.standard_normal((t, n_in)).astype(np.float32)
        y = m.matmul(x)  # (T, 37)
        xr = rounded(x, qt)
        exact = xr @ w64.T
        scale = np.abs(xr) @ np.abs(w64).T
        err = np.max(np.abs(y - exact) / scale)
        assert err < TOL, f"{qt.name} T={t}: relative error {err:.2e}"
        # and the rounding is real: float32 activations give other numbers
        assert not np.allclose(y, x.astype(np.float64) @ w64.T, rtol=1e-5, atol=0)


@needs_vnni
def test_a_row_of_x_gives_the_same_bits_batched_or_alone():
    """Rows of x go four, two or one at a time through the same per-row arithmetic:
    a stream's numbers do not depend on what it is batched with."""
    rng = np.random.default_rng(5)
    for qt, n_in in ((Q.Q4_K, 512), (Q.Q6_K, 512), (Q.Q4_1, 576), (Q.Q8_0, 576)):
        m = QuantMatrix(qt, random_matrix(qt, 40, n_in, rng), (40, n_in), activations="q8")
        x = rng.standard_normal((7, n_in)).astype(np.float32)
        whole = m.matmul(x)  # (7, 40): a four, a pair and a single
        for t in range(7):
            assert np.array_equal(m.matmul(x[t]), whole[t]), (qt.name, t)


@pytest.mark.parametrize("run", [32, 256])
def test_quantize_x_rounds_each_run_to_int8(run):
    rng = np.random.default_rng(1)
    n = 3 * run
    x = (rng.standard_normal((2, n)) * [[1.0], [40.0]]).astype(np.float32)
    x[0, run : 2 * run] = 0.0  # a run of zeros: scale 0, quants 0
    x[1, 5] = -1000.0  # the run's largest |x| becomes -127
    x8 = np.empty(x.shape, np.int8)
    xd = np.empty((2, 3), np.float32)
    xs = np.empty((2, n // 32), np.float32)
    kernel_q8.quantize_x(x, x8, xd, xs)
    assert xd[0, 1] == 0 and not x8[0, run : 2 * run].any()
    assert x8[1, 5] == -127 and xd[1, 0] == pytest.approx(1000.0 / 127)
    assert np.abs(x8.astype(int)).max() <= 127
    back = (x8.astype(np.float64).reshape(2, 3, run) * xd[..., None]).reshape(2, n)
    assert np.all(np.abs(back - x) <= xd.repeat(run, axis=1) * 0.5 * (1 + 1e-6))
    # xs: per 32, the run's scale times the sum of the 32 quants (the mins' share)
    sums = x8.astype(np.float64).reshape(2, n // 32, 32).sum(-1)
    assert np.allclose(xs, xd.repeat(run // 32, axis=1) * sums, rtol=1e-6)


def test_without_vnni_q8_falls_back_to_float32(monkeypatch):
    monkeypatch.setattr(kernel_q8, "available", lambda: False)
    assert quant.activations_in_force("q8") == "f32"
    assert quant.activations_in_force("f32") == "f32"
    with pytest.raises(ValueError, match="activations must be one of f32, q8"):
        quant.activations_in_force("int4")
    rng = np.random.default_rng(2)
    data = random_matrix(Q.Q4_K, 16, 512, rng)
    plain = QuantMatrix(Q.Q4_K, data, (16, 512))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    asked = QuantMatrix(Q.Q4_K, data, (16, 512), activations=quant.activations_in_force("q8"))
    assert np.array_equal(asked.matmul(x), plain.matmul(x))


@needs_vnni
def test_a_fused_matrix_of_mixed_types_takes_q8_where_it_can():
    """Q4_K_M's Q|K|V: Q4_K beside Q6_K beside a float32 part (numpy) and a Q5_0 part
    (no q8 product: its float32 kernel); each part as it would be alone."""
    rng = np.random.default_rng(3)
    specs = [(Q.Q4_K, 24), (Q.Q6_K, 8), (Q.Q5_0, 8)]
    parts = [
        QuantMatrix(qt, random_matrix(qt, n, 512, rng), (n, 512), activations="q8")
        for qt, n in specs
    ]
    f32 = rng.standard_normal((4, 512)).astype(np.float32)
    fused = FusedMatrix(parts + [f32])
    x = rng.standard_normal((2, 512)).astype(np.float32)
    y = fused.matmul(x)  # (2, 44)
    want = np.concatenate([p.matmul(x) for p in parts] + [x @ f32.T], axis=1)
    assert np.array_equal(y, want)
    q5 = QuantMatrix(Q.Q5_0, parts[2].data, (8, 512))  # f32 activations
    assert np.array_equal(y[:, 32:40], q5.matmul(x))


def teacher_forced(eng, ref: dict, n_cases: int) -> tuple[float, float, float]:
    """(top-1 agreement, mean and max |logprob - reference|) over the reference's top 5,
    the cases' tokens fed back step by step: the prompt in runs of at most
    quant.SMALL tokens and each reply token alone, so every product is decode-sized
    (the q8 kernels'; longer runs are prefill, float32 BLAS)."""
    from core.lora.mix import mix_key
    from core.model.llama import BatchItem
    from core.model.quant import SMALL
    from core.serve.sampling import log_softmax
    from tests.mixing import forward

    m, same, total, diffs = eng.model, 0, 0, []
    everyone = {a["id"]: eng.adapter(a["id"]) for a in eng.adapters()}
    for case in ref["greedy"][:n_cases]:
        mw = eng.lora.mixes.get(mix_key({e["id"]: e["scale"] for e in case["lora"]}), everyone)
        toks, n = case["prompt_tokens"] + case["tokens"], len(case["prompt_tokens"])
        cache = m.new_cache(128)
        for a in range(0, n, SMALL):
            logits = forward(m, [BatchItem(np.array(toks[a : min(n, a + SMALL)]), cache)], [mw])[0]
        for step, top in enumerate(case["top_logprobs"]):
            lp = log_softmax(logits.reshape(-1, logits.shape[-1])[-1])  # (vocab,)
            same += int(np.argmax(lp)) == top[0][0]
            total += 1
            diffs += [abs(lp[tid] - ref_lp) for tid, ref_lp in top[:5]]
            logits = forward(m, [BatchItem(np.array([toks[n + step]]), cache)], [mw])[0]
    return same / total, float(np.mean(diffs)), float(np.max(diffs))


@needs_vnni
def test_smollm2_in_q8_is_as_close_to_exact_math_as_llama_cpps_own_quantized_run(
    smollm_path, reference, reference_q4, ref_dir
):
    """How far q8 may be from exact float32 math: as far as llama.cpp's own run on the
    Q4_1 file is (it rounds activations too). The float32 engine matches llama.cpp's
    float32 reference to ~0.002, so its distance to the Q4_1 run is that run's noise;
    the q8 engine's distance to the float32 reference must be of the same size
    (measured 2026-12-06: mean 0.078 against 0.075, top-1 124 and 122 of 128)."""
    from core.options import EngineOptions
    from core.serve.engine import Engine

    got = {}
    for mode in ("f32", "q8"):
        eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256, activations=mode))
        try:
            assert eng.model_info()["activations"] == mode
            for name in reference["adapters"]:
                eng.add_adapter(ref_dir / "adapters" / name)
            got[mode] = teacher_forced(eng, reference, 8), teacher_forced(eng, reference_q4, 8)
        finally:
            eng.stop()
    (f32_exact, f32_vs_llama_q4), (q8_exact, _) = got["f32"], got["q8"]
    assert f32_exact[0] == 1.0 and f32_exact[1] < 0.01  # the float32 engine is exact
    assert q8_exact[1] > 5 * f32_exact[1]  # q8 does round: it is not the exact path
    top1, mean, worst = q8_exact
    noise_top1, noise_mean, noise_worst = f32_vs_llama_q4
    assert top1 >= noise_top1 - 0.03
    assert mean <= 1.25 * noise_mean
    assert worst <= 1.5 * noise_worst


@pytest.mark.parametrize("mode", ["q8", "f32"])
def test_the_engine_says_which_activations_are_in_force(tmp_path, mode, monkeypatch, caplog):
    """--activations reaches the loaded model and model_info; asked for q8 on a CPU
    without VNNI, the load says so and runs float32."""
    from core.options import EngineOptions, OptionsError
    from core.serve.engine import Engine
    from tests.tiny_gguf import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, qtype=Q.Q4_K, dim=256, n_heads=4, n_kv_heads=2, ffn=512)
    if mode == "f32":  # a CPU without VNNI
        monkeypatch.setattr(kernel_q8, "available", lambda: False)
    with caplog.at_level(logging.WARNING):
        eng = Engine.from_path(path, EngineOptions(ctx_size=64, activations="q8"))
    try:
        want = "q8" if VNNI and mode == "q8" else "f32"
        assert eng.model_info()["activations"] == want
        assert eng.model.w.output.activations == want or not isinstance(
            eng.model.w.output, QuantMatrix
        )
        assert ("needs a CPU with VNNI" in caplog.text) == (want == "f32")
    finally:
        eng.stop()
    with pytest.raises(OptionsError, match="--activations must be one of f32, q8"):
        EngineOptions(activations="q4")
