"""The other families on tiny random GGUFs written here: qwen2 (Q/K/V biases, NeoX rope)
and gemma3 (Q/K norms, post norms, GeGLU, sliding-window layers with their own rope).

Cached decode (one sequence, and several decoding together in a KV pool) must equal one
uncached forward over the whole sequence; a sliding-window layer must really ignore the
keys outside its window; an unsupported architecture is refused in one line that
names it and the supported ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType

from core.model.attention import attend, causal_mask, window_mask
from core.model.families import model_class
from core.model.kv_cache import KVCache
from core.model.llama import BatchItem
from core.model.primitives import RopeTable, rope_neox
from core.model.weights import ModelLoadError, load_weights, open_model_file
from tests.mixing import forward
from tests.tiny_gguf import write_tiny_llama

GEMMA = dict(arch="gemma3", dim=48, n_heads=4, n_kv_heads=2, head_dim=16, ffn=80)
TIGHT_CAPS = {
    "gemma2.attn_logit_softcapping": (0.5, GGUFValueType.FLOAT32),
    "gemma2.final_logit_softcapping": (2.0, GGUFValueType.FLOAT32),
}
GEMMA2 = dict(GEMMA, arch="gemma2", kv=TIGHT_CAPS)


def build(tmp_path, name="tiny.gguf", **kw):
    gf, cfg = open_model_file(write_tiny_llama(tmp_path / name, **kw))
    return model_class(cfg)(cfg, load_weights(gf, cfg, use_cache=False))


def full_forward(model, tokens) -> np.ndarray:
    cache = model.new_cache(64)
    return model([BatchItem(np.array(tokens), cache, all_logits=True)])[0]  # (n, vocab)


def incremental(model, tokens, prompt=5) -> np.ndarray:
    cache = model.new_cache(64)
    steps = [model([BatchItem(np.array(tokens[:prompt]), cache, all_logits=True)])[0]]
    for t in tokens[prompt:]:
        steps.append(model([BatchItem(np.array([t]), cache)])[0])
    return np.concatenate(steps)


def pooled(model, seqs, prompt=3) -> list[np.ndarray]:
    """Each sequence prefilled in its own pool slot, then all decoded together one token
    per forward (the pooled batched attention), as the scheduler runs them."""
    pool = model.new_pool(len(seqs), 64)
    caches = [pool.acquire() for _ in seqs]
    outs = [
        [model([BatchItem(np.array(s[:prompt]), c, all_logits=True)])[0]]
        for s, c in zip(seqs, caches)
    ]
    for p in range(prompt, len(seqs[0])):
        got = model([BatchItem(np.array([s[p]]), c) for s, c in zip(seqs, caches)])
        for o, g in zip(outs, got):
            o.append(g)
    return [np.concatenate(o) for o in outs]


FAMILIES = {
    "qwen2": dict(arch="qwen2", n_heads=4, n_kv_heads=2),
    "qwen2_mqa_untied": dict(arch="qwen2", n_heads=4, n_kv_heads=1, tied=False),
    # Qwen3-0.6B's shape: head_dim * heads > dim
    "qwen3": dict(arch="qwen3", dim=48, n_heads=4, n_kv_heads=2, head_dim=16),
    # 7 layers: 0-4 and 6 slide over 4 keys, layer 5 is global; 14 tokens > window
    "gemma3_window": dict(GEMMA, n_layers=7, sliding_window=4),
    "gemma3_no_window": dict(GEMMA, n_layers=2),
    "gemma3_mqa": dict(GEMMA, n_heads=2, n_kv_heads=1, n_layers=6, sliding_window=3),
    # even layers slide, odd ones are global; attention and final soft-capping (the
    # default caps 50/30 barely bite on a tiny model: tight ones make them matter)
    "gemma2": dict(GEMMA2, n_layers=4, sliding_window=3),
    "phi3": dict(arch="phi3", n_heads=4, n_kv_heads=2),
    "phi3_longrope": dict(arch="phi3", n_heads=4, n_kv_heads=4, long_rope=(8, 1.2)),
}


@pytest.mark.parametrize("kw", FAMILIES.values(), ids=FAMILIES.keys())
def test_cached_decode_equals_full_forward(tmp_path, kw):
    model = build(tmp_path, **kw)
    tokens = list(np.random.default_rng(1).integers(3, 300, size=14))
    full = full_forward(model, tokens)
    assert full.shape == (14, 300) and np.isfinite(full).all()
    np.testing.assert_allclose(incremental(model, tokens), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", FAMILIES.values(), ids=FAMILIES.keys())
def test_pooled_decode_equals_full_forward(tmp_path, kw):
    model = build(tmp_path, **kw)
    rng = np.random.default_rng(2)
    seqs = [list(rng.integers(3, 300, size=12)) for _ in range(3)]
    for got, s in zip(pooled(model, seqs), seqs):
        np.testing.assert_allclose(got, full_forward(model, s), rtol=1e-4, atol=1e-4)


def test_gemma3_reads_its_hyper_parameters(tmp_path):
    model = build(tmp_path, **dict(GEMMA, n_layers=13, sliding_window=4))
    cfg = model.cfg
    assert (cfg.head_dim, cfg.q_dim, cfg.dim) == (16, 64, 48)  # q_dim need not be dim
    assert cfg.rope_neox and cfg.sliding_window == 4 and cfg.rope_base_swa == 10000.0
    assert cfg.swa_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12)  # every 6th is global
    assert cfg.scale == pytest.approx(1 / 4)  # 1/sqrt(key_length)
    assert model.w.layers[0].attn_q_norm.shape == (16,)


def test_sliding_window_ignores_keys_outside_it(tmp_path):
    """Two sliding layers of window 3: the last position's logits reach back 2 + 2 tokens
    and no further. Changing token 0 must leave positions >= 5 bit-for-bit alone (and
    move positions within reach); with a global layer, the change reaches them."""
    tokens = list(np.random.default_rng(3).integers(3, 300, size=10))
    edited = [7 if tokens[0] != 7 else 8] + tokens[1:]
    sliding = build(tmp_path, "swa.gguf", **dict(GEMMA, n_layers=2, sliding_window=3))
    a, b = full_forward(sliding, tokens), full_forward(sliding, edited)
    np.testing.assert_array_equal(a[5:], b[5:])
    assert np.abs(a[:5] - b[:5]).max(axis=1).min() > 1e-4
    # the same weights with the window off (no sliding_window key): layer 1 now sees all
    full = build(tmp_path, "full.gguf", **dict(GEMMA, n_layers=2))
    a, b = full_forward(full, tokens), full_forward(full, edited)
    assert np.abs(a[5:] - b[5:]).max(axis=1).min() > 1e-4


@pytest.mark.parametrize("p0, n", [(0, 9), (5, 4), (12, 1), (3, 300)])
def test_window_attention_equals_a_brute_force_mask(p0, n):
    """attend() with a window against softmax over an explicit mask, including a prompt
    longer than one attention block (300 > 128 queries)."""
    rng = np.random.default_rng(4)
    KV, H, hd, window, L = 2, 4, 8, 5, p0 + n
    keys = rng.standard_normal((L, KV, hd)).astype(np.float32)
    vals = rng.standard_normal((L, KV, hd)).astype(np.float32)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)

    class Cfg:
        n_layers, n_kv_heads, head_dim = 1, KV, hd

    cache = KVCache(Cfg, L)
    cache.update_and_fetch(0, keys[:p0], vals[:p0], [0] * p0)
    got = attend(0, cache, [0] * n, q, keys[p0:], vals[p0:], causal_mask(p0, n), H, 0.5, window)
    m = window_mask(p0, L, 0, L, window)  # (n, L)
    kh = np.repeat(keys, H // KV, axis=1)  # (L, H, hd)
    vh = np.repeat(vals, H // KV, axis=1)
    s = np.einsum("nhd,lhd->hnl", q * 0.5, kh) + m  # (H, n, L)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hnl,lhd->nhd", p / p.sum(-1, keepdims=True), vh).reshape(n, H * hd)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_rope_neox_rotates_halves():
    """Hugging Face's rotate_half rope: x*cos + rotate_half(x)*sin, same angles."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)

    class Cfg:
        rope_dim, rope_base, rope_scale = 8, 10000.0, 1.0

    pos = np.array([0, 4, 9])
    ang = pos[:, None] * RopeTable(Cfg, None).inv_freq[None, :]  # (3, 4)
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]  # (3, 1, 8)
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    rot = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    want = x * cos + rot * sin
    got = rope_neox(x, RopeTable(Cfg, None).get(pos))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_qwen2_biases_are_loaded_and_used(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", arch="qwen2")
    gf, cfg = open_model_file(path)
    w = load_weights(gf, cfg, use_cache=False)
    want = np.concatenate([gf.dequantize(f"blk.1.attn_{p}.bias") for p in "qkv"])
    np.testing.assert_array_equal(w.layers[1].wqkv_bias, want)
    model = model_class(cfg)(cfg, w)
    tokens = [5, 9, 33, 4]
    with_bias = full_forward(model, tokens)
    for lw in w.layers:
        lw.wqkv_bias = np.zeros_like(lw.wqkv_bias)
    assert np.abs(full_forward(model, tokens) - with_bias).max() > 1e-3


def test_missing_bias_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", arch="qwen2")
    gf, cfg = open_model_file(path)
    del gf.tensors["blk.0.attn_k.bias"]
    with pytest.raises(ModelLoadError, match="missing tensor 'blk.0.attn_k.bias'"):
        load_weights(gf, cfg, use_cache=False)


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    path = write_tiny_llama(tmp_path / "phi2.gguf", arch="phi2")
    with pytest.raises(ModelLoadError) as e:
        open_model_file(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert "unsupported architecture 'phi2'" in msg
    assert "llama, qwen2, qwen3, gemma2, gemma3, phi3" in msg


# ---- LoRA on the families: llama.cpp GGUFs, PEFT names, export round-trips -------------


def tiny_engine(path):
    from core.options import EngineOptions
    from core.serve.engine import Engine

    return Engine.from_path(path, EngineOptions(n_parallel=1, ctx_size=64))


def random_lora(path, cfg, targets=None, rank=4, seed=0):
    """A llama.cpp-format LoRA GGUF on ``targets`` of every layer (default: the parts
    of wqkv and w_gate_up, phi3's fused tensors included)."""
    from core.model import layout
    from tests.tiny_gguf import write_lora_gguf

    rng = np.random.default_rng(seed)
    shapes = layout.part_shapes(cfg)
    if targets is None:
        fused = layout.matrix(cfg, "wqkv").parts + layout.matrix(cfg, "w_gate_up").parts
        targets = [p.tensor for p in fused]
    tensors = {}
    for i in range(cfg.n_layers):
        for t in targets:
            out, inp = shapes[t]
            tensors[f"blk.{i}.{t}.weight.lora_a"] = 0.3 * rng.standard_normal((rank, inp))
            tensors[f"blk.{i}.{t}.weight.lora_b"] = 0.3 * rng.standard_normal((out, rank))
    return write_lora_gguf(path, tensors, {"adapter.lora.alpha": float(rank)}, arch=cfg.arch)


def engine_logits(eng, mix, tokens) -> np.ndarray:
    from core.lora.mix import mix_key

    adapters = {a["id"]: eng.adapter(a["id"]) for a in eng.adapters()}
    mw = eng.lora.mixes.get(mix_key(mix), adapters)
    cache = eng.model.new_cache(len(tokens))
    return forward(eng.model, [BatchItem(np.array(tokens), cache, all_logits=True)], [mw])[0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(arch="qwen2"),
        FAMILIES["qwen3"],
        dict(GEMMA, n_layers=6, sliding_window=3),
        FAMILIES["gemma2"],
        FAMILIES["phi3"],
    ],
    ids=["qwen2", "qwen3", "gemma3", "gemma2", "phi3"],
)
def test_exports_round_trip(tmp_path, kw):
    """LoRA GGUF, PEFT folder and merged GGUF of a two-adapter mix each reproduce the mix:
    no Q/K permutation for these families (a permuted PEFT B would move the logits),
    and the merged file keeps qwen2's biases and gemma3's extra norms."""
    from core.lora.export import export_lora, export_merged, export_peft
    from core.lora.naming import rope_heads

    eng = tiny_engine(write_tiny_llama(tmp_path / "base.gguf", **kw))
    try:
        cfg = eng.model.cfg
        # Q/K rows in Hugging Face order: PEFT import/export must not permute them
        assert rope_heads(cfg, "blk.0.attn_q.weight") == rope_heads(cfg, "blk.0.attn_k.weight") == 0
        a0 = eng.add_adapter(random_lora(tmp_path / "qkv.gguf", cfg))
        a1 = eng.add_adapter(
            random_lora(tmp_path / "mlp.gguf", cfg, ("attn_output", "ffn_down"), 2, 1)
        )
        mix = {a0: 0.7, a1: -0.5}
        tokens = [5, 40, 41, 200, 7, 9, 120, 33]
        want = engine_logits(eng, mix, tokens)
        assert np.abs(want - engine_logits(eng, {}, tokens)).max() > 1e-2  # the mix matters
        items = [(eng.adapter(a), s) for a, s in mix.items()]
        export_lora(eng, items, tmp_path / "mix.gguf")
        export_peft(eng, items, tmp_path / "mix_peft")
        for out in (tmp_path / "mix.gguf", tmp_path / "mix_peft"):
            aid = eng.add_adapter(out)
            np.testing.assert_allclose(engine_logits(eng, {aid: 1.0}, tokens), want, atol=1e-4)
            eng.remove_adapter(aid)
        export_merged(eng, items, tmp_path / "merged.gguf", outtype="f32")
    finally:
        eng.stop()
    merged = tiny_engine(tmp_path / "merged.gguf")
    try:
        np.testing.assert_allclose(engine_logits(merged, {}, tokens), want, atol=1e-4)
    finally:
        merged.stop()


def test_gemma3_peft_language_model_prefix(tmp_path):
    """A PEFT folder from Gemma3ForConditionalGeneration (model.language_model.layers.N)
    lands on the same GGUF tensors as one from Gemma3ForCausalLM (model.layers.N)."""
    from core.lora.naming import gguf_to_hf_module, hf_module_to_gguf
    from tests.tiny_gguf import write_tiny_peft

    path = write_tiny_llama(tmp_path / "g.gguf", **dict(GEMMA, n_layers=2))
    _, cfg = open_model_file(path)
    mm = "base_model.model.model.language_model.layers.1.mlp.down_proj"
    assert hf_module_to_gguf(cfg, mm) == "blk.1.ffn_down.weight"
    assert hf_module_to_gguf(cfg, "model.language_model.embed_tokens") == "token_embd.weight"
    assert gguf_to_hf_module(cfg, "blk.1.attn_k.weight") == "model.layers.1.self_attn.k_proj"
    eng = tiny_engine(path)
    try:
        plain = write_tiny_peft(tmp_path / "plain", dim=48, q_dim=64)
        prefixed = tmp_path / "prefixed"
        prefixed.mkdir()
        (prefixed / "adapter_config.json").write_bytes((plain / "adapter_config.json").read_bytes())
        from safetensors.numpy import load_file, save_file

        st = load_file(plain / "adapter_model.safetensors")
        mm_prefix = "base_model.model.model.language_model."
        renamed = {k.replace("base_model.model.model.", mm_prefix): v for k, v in st.items()}
        save_file(renamed, str(prefixed / "adapter_model.safetensors"))
        a, b = eng.add_adapter(plain), eng.add_adapter(prefixed)
        tokens = [5, 9, 33, 4]
        got = engine_logits(eng, {b: 1.0}, tokens)
        np.testing.assert_array_equal(got, engine_logits(eng, {a: 1.0}, tokens))
        assert np.abs(got - engine_logits(eng, {}, tokens)).max() > 1e-3
    finally:
        eng.stop()


def test_qwen3_qk_norms_are_used(tmp_path):
    """Qwen3's per-head Q/K norms run before rope: scaling a norm weight moves the logits
    (without them, attention would see the unnormalized heads)."""
    gf, cfg = open_model_file(write_tiny_llama(tmp_path / "q3.gguf", **FAMILIES["qwen3"]))
    w = load_weights(gf, cfg, use_cache=False)
    assert w.layers[0].attn_q_norm.shape == w.layers[0].attn_k_norm.shape == (16,)
    assert w.layers[0].wqkv_bias is None and cfg.rope_neox and cfg.q_dim == 64
    model = model_class(cfg)(cfg, w)
    tokens = [5, 9, 33, 4, 77]
    before = full_forward(model, tokens)
    w.layers[0].attn_k_norm = w.layers[0].attn_k_norm * 3.0
    assert np.abs(full_forward(model, tokens) - before).max() > 1e-3


def test_gemma2_reads_its_hyper_parameters_and_caps(tmp_path):
    model = build(tmp_path, **dict(GEMMA2, n_layers=5, sliding_window=3))
    cfg = model.cfg
    assert cfg.swa_layers == (0, 2, 4) and cfg.sliding_window == 3  # every other layer
    assert (cfg.attn_softcap, cfg.final_softcap) == (0.5, 2.0)
    assert cfg.rope_base_swa == 0.0 and model.rope_local is model.rope  # one rope base
    assert model.w.layers[0].attn_q_norm is None
    tokens = [5, 9, 33, 4, 77, 12]
    capped = full_forward(model, tokens)
    assert np.abs(capped).max() <= 2.0 + 1e-5  # final soft-cap bounds every logit
    # the same weights with the attention scores uncapped give other logits
    kv = {**TIGHT_CAPS, "gemma2.attn_logit_softcapping": (1e5, GGUFValueType.FLOAT32)}
    loose = build(tmp_path, "loose.gguf", **dict(GEMMA2, kv=kv, n_layers=5, sliding_window=3))
    assert np.abs(full_forward(loose, tokens) - capped).max() > 1e-2
    # without the keys: llama.cpp's defaults
    plain = build(tmp_path, "plain.gguf", **dict(GEMMA2, kv=None, n_layers=1))
    assert (plain.cfg.attn_softcap, plain.cfg.final_softcap) == (50.0, 30.0)
    assert plain.cfg.sliding_window == 4096


def test_phi3_fused_tensors_and_long_rope(tmp_path):
    """attn_qkv and ffn_up are the fused matrices as stored; LoRA on them covers all
    rows; LongRoPE picks the short factors while a sequence fits the original context
    and the long ones past it (as llama.cpp by context per sequence), cos/sin scaled."""
    from core.lora.naming import hf_module_to_gguf
    from core.model import layout

    path = write_tiny_llama(tmp_path / "phi3.gguf", **FAMILIES["phi3_longrope"])
    gf, cfg = open_model_file(path)
    w = load_weights(gf, cfg, use_cache=False)
    np.testing.assert_array_equal(w.layers[0].wqkv, gf.dequantize("blk.0.attn_qkv.weight"))
    np.testing.assert_array_equal(w.layers[1].w_gate_up, gf.dequantize("blk.1.ffn_up.weight"))
    assert layout.fused_slot(cfg, "blk.1.attn_qkv.weight") == (1, "wqkv", 0, 192)
    assert layout.fused_slot(cfg, "blk.0.ffn_up.weight") == (0, "w_gate_up", 0, 192)
    assert hf_module_to_gguf(cfg, "model.layers.2.self_attn.qkv_proj") == "blk.2.attn_qkv.weight"
    assert hf_module_to_gguf(cfg, "model.layers.0.mlp.gate_up_proj") == "blk.0.ffn_up.weight"
    assert (cfg.rope_ctx_orig, cfg.rope_attn_factor) == (8, pytest.approx(1.2))
    model = model_class(cfg)(cfg, w)
    short = model.rope_for(8)
    np.testing.assert_allclose(
        short.inv_freq * w.rope_short, model.rope_for(9).inv_freq * w.rope_long
    )
    assert np.abs(short.get(np.array([3]))).max() == pytest.approx(1.2, rel=1e-5)
    tokens = list(np.random.default_rng(6).integers(3, 300, size=8))
    model.new_pool(1, 8)
    fits = full_forward(model, tokens)
    model.new_pool(1, 64)
    longer = full_forward(model, tokens)
    assert np.abs(fits - longer).max() > 1e-3  # the long factors are in use
    np.testing.assert_allclose(incremental(model, tokens), longer, rtol=1e-4, atol=1e-4)


def test_gemma_27b_scales_queries_by_dim_over_heads(tmp_path):
    """llama.cpp's one size exception: Gemma 2/3 27B use query_pre_attn_scalar =
    embedding_length / head_count, not head_dim (recognised by its block count)."""
    from core.model.config import ModelConfig

    for arch, layers in (("gemma3", 62), ("gemma2", 46)):
        meta = {
            "general.architecture": arch,
            f"{arch}.embedding_length": 64,
            f"{arch}.attention.head_count": 2,
            f"{arch}.attention.key_length": 16,
            f"{arch}.block_count": layers,
            f"{arch}.feed_forward_length": 8,
            f"{arch}.vocab_size": 10,
        }
        assert ModelConfig.from_metadata(meta).scale == pytest.approx(1 / np.sqrt(32))
        meta[f"{arch}.block_count"] = layers - 1
        assert ModelConfig.from_metadata(meta).scale == pytest.approx(1 / 4)
