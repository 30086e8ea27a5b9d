"""Tiny random llama models: cached incremental decode must equal one uncached
forward over the whole sequence, across GQA ratios, tied/untied output, rope
variants and quant types; batching sequences must not change any of them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from core.model.llama import BatchItem, LlamaModel
from core.model.weights import load_weights, open_model_file
from tests.tiny_gguf import write_tiny_llama


def build(tmp_path, **kw):
    path = write_tiny_llama(tmp_path / "tiny.gguf", **kw)
    gf, cfg = open_model_file(path)
    return LlamaModel(cfg, load_weights(gf, cfg, use_cache=False)), gf


def full_vs_incremental(model, tokens):
    full = model([BatchItem(np.array(tokens), model.new_cache(64), all_logits=True)])[0]
    cache = model.new_cache(64)
    steps = [model([BatchItem(np.array(tokens[:5]), cache, all_logits=True)])[0]]
    for t in tokens[5:]:
        steps.append(model([BatchItem(np.array([t]), cache)])[0])
    return full, np.concatenate(steps)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_heads=4, n_kv_heads=4),  # MHA
        dict(n_heads=4, n_kv_heads=2),  # GQA 2:1
        dict(n_heads=8, n_kv_heads=2, dim=64),  # GQA 4:1
        dict(n_heads=4, n_kv_heads=1),  # MQA
        dict(tied=False),
        dict(rope_base=500000.0),
        dict(rope_scale=4.0),
        dict(rope_freqs=True),  # llama3-style frequency factors
    ],
    ids=["mha", "gqa2", "gqa4", "mqa", "untied", "rope_base", "rope_linear", "rope_freqs"],
)
def test_cached_decode_equals_full_forward(tmp_path, kw):
    model, _ = build(tmp_path, **kw)
    tokens = list(np.random.default_rng(1).integers(3, 300, size=12))
    full, inc = full_vs_incremental(model, tokens)
    assert full.shape == (12, 300)
    np.testing.assert_allclose(inc, full, rtol=1e-4, atol=1e-4)


def test_rope_variants_change_outputs(tmp_path):
    """Guard against rope settings being silently ignored."""
    tokens = np.arange(3, 15)
    outs = []
    for i, kw in enumerate(
        (dict(), dict(rope_base=500000.0), dict(rope_scale=4.0), dict(rope_freqs=True))
    ):
        (tmp_path / str(i)).mkdir()
        model, _ = build(tmp_path / str(i), **kw)
        outs.append(model([BatchItem(tokens, model.new_cache(32), all_logits=True)])[0])
    for o in outs[1:]:
        assert not np.allclose(o, outs[0], atol=1e-3)


def test_batch_of_sequences_equals_each_alone(tmp_path):
    model, _ = build(tmp_path, n_heads=4, n_kv_heads=2)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, 300, size=n) for n in (7, 1, 12)]
    alone = [model([BatchItem(s, model.new_cache(32), all_logits=True)])[0] for s in seqs]
    batch = model([BatchItem(s, model.new_cache(32), all_logits=True) for s in seqs])
    # BLAS blocks a (T, d) matmul differently for different T, so float32 sums
    # differ in the last bits; anything beyond rounding noise is a bug.
    for a, b in zip(alone, batch):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "qtype",
    [
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ4_NL,
        Q.IQ4_XS,
        Q.IQ2_XXS,
        Q.IQ2_XS,
        Q.IQ2_S,
        Q.IQ3_XXS,
        Q.IQ3_S,
        Q.IQ1_S,
        Q.IQ1_M,
        Q.TQ1_0,
        Q.TQ2_0,
    ],
    ids=lambda q: q.name,
)
def test_every_quant_type_loads_to_its_dequantized_values(tmp_path, qtype):
    model, gf = build(tmp_path, dim=256, n_heads=4, n_kv_heads=2, ffn=256, qtype=qtype)
    info = gf.tensors["blk.0.attn_q.weight"]
    want = quants.dequantize(gf.raw(info.name), info.qtype).reshape(info.shape)
    np.testing.assert_array_equal(model.w.layers[0].wqkv[: info.shape[0]], want)
    out = model([BatchItem(np.arange(3, 9), model.new_cache(16))])[0]
    assert np.isfinite(out).all()


@pytest.mark.parametrize("block", [128, 3], ids=["one_block", "many_blocks"])
def test_chunked_prefill_equals_full_forward(tmp_path, monkeypatch, block):
    """Prompts are run in chunks (the scheduler's PREFILL_CHUNK) and attention in query
    blocks; a chunk starting at p0 > 0 must see exactly the keys a full forward sees."""
    import core.model.attention as M

    monkeypatch.setattr(M, "ATTN_BLOCK", block)
    model, _ = build(tmp_path, n_heads=4, n_kv_heads=2)
    tokens = np.random.default_rng(3).integers(3, 300, size=20)
    full = model([BatchItem(tokens, model.new_cache(32), all_logits=True)])[0]
    cache = model.new_cache(32)
    parts = [
        model([BatchItem(tokens[a:b], cache, all_logits=True)])[0]
        for a, b in ((0, 7), (7, 8), (8, 20))
    ]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-4, atol=1e-4)


def test_long_prompt_through_the_scheduler_matches_one_forward(smollm_path):
    """A 700-token prompt is prefilled in 512-token chunks by the scheduler; its first
    greedy token must be the argmax of a single full forward."""
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from core.serve.sampling import SamplingParams

    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=1024))
    try:
        prompt = [1] + list(np.random.default_rng(4).integers(100, 40000, size=699))
        steps = eng.stats()["steps"]
        done = eng.complete(prompt, SamplingParams(temperature=0, n_predict=1), cache_prompt=False)
        logits = eng.model([BatchItem(np.array(prompt), eng.model.new_cache(704))])[0]
        assert done.tokens == [int(np.argmax(logits[-1]))]
        assert done.timings.prompt_n == 700
        assert eng.stats()["steps"] - steps == 2  # 512 + 188: chunked, as intended
    finally:
        eng.stop()


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_rms_norm_matches_the_formula_for_one_row_and_many(rows):
    # one row takes a scalar shortcut (decode), more rows the vectorised path
    from core.model.primitives import rms_norm

    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-5) * w
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == np.float32 and got.shape == (rows, 576)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
