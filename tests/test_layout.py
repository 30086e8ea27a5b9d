"""core/model/layout.py is the one table of the fused weight layout: the loader, LoRA,
the mixes, the forward pass and the exports all read it. These tests pin the table
to the files it describes (a real GGUF's tensors, a real adapter's rows) and check
that the attention core is the textbook softmax(QKᵀ)V."""

from __future__ import annotations

import numpy as np
import pytest

from core.gguf.reader import GGUFFile
from core.lora.adapter import load_adapter
from core.lora.naming import (
    gguf_to_hf_module,
    hf_module_to_gguf,
    permute_qk_rows,
    rope_heads,
    unpermute_qk_rows,
)
from core.model import layout
from core.model.attention import sdpa
from core.model.config import ModelConfig
from core.model.weights import load_weights, open_model_file
from tests.reference import reference_dir
from tests.tiny_gguf import write_tiny_llama


@pytest.fixture
def tiny(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", dim=64, n_heads=4, n_kv_heads=2, ffn=96)
    gf, cfg = open_model_file(path)
    return gf, cfg


def test_fused_plan_stacks_exactly_the_file_tensors(tiny):
    """Every tensor the file holds is read once, and each fused matrix's rows are the
    sum of its parts' rows, in the order the table lists them."""
    gf, cfg = tiny
    plan = layout.fused_plan(cfg, gf.tensors)
    sources = [s for _, _, srcs in plan for s in srcs]
    assert sorted(sources) == sorted(gf.tensors)
    for name, shape, srcs in plan:
        rows = sum(gf.tensors[s].shape[0] for s in srcs)
        assert (shape[0] if len(shape) > 1 else shape[0]) == rows, name
    want = layout.file_tensors(cfg, gf.metadata, gf.tensors)
    assert {n: gf.tensors[n].shape for n in want} == {n: s for n, (s, _) in want.items()}


def test_loaded_rows_are_where_fused_slot_says(tiny):
    """Slicing a fused matrix at fused_slot's rows gives back the file's tensor."""
    gf, cfg = tiny
    w = load_weights(gf, cfg, use_cache=False)
    for name, info in gf.tensors.items():
        slot = layout.fused_slot(cfg, name)
        if slot is None:
            continue
        layer, target, r0, n = slot
        got = getattr(w.layers[layer], target)[r0 : r0 + n]
        want = np.frombuffer(gf.raw(name).tobytes(), dtype=np.float32).reshape(info.shape)
        np.testing.assert_array_equal(got, want)


def test_parts_tile_each_fused_matrix_and_slices_agree(tiny):
    _, cfg = tiny
    for m in layout.matrices(cfg):
        placed = layout.placed(cfg, m)
        assert placed[0][1] == 0
        for (_, r0, n), (_, r1, _) in zip(placed, placed[1:]):
            assert r0 + n == r1  # no gap, no overlap
        assert sum(n for _, _, n in placed) == layout.out_rows(cfg, m.name)
    assert layout.fused_slot(cfg, "blk.1.attn_v.weight") == (
        1,
        "wqkv",
        cfg.q_dim + cfg.kv_dim,
        cfg.kv_dim,
    )
    assert layout.fused_slot(cfg, "blk.0.attn_norm.weight") is None
    assert layout.fused_slot(cfg, "output.weight") is None


def test_hf_names_round_trip_and_only_q_k_are_permuted(tiny):
    _, cfg = tiny
    for name in layout.lora_targets(cfg):
        module = gguf_to_hf_module(cfg, name)
        assert hf_module_to_gguf(cfg, f"base_model.model.{module}") == name
    assert rope_heads(cfg, "blk.0.attn_q.weight") == cfg.n_heads
    assert rope_heads(cfg, "blk.0.attn_k.weight") == cfg.n_kv_heads
    assert rope_heads(cfg, "blk.0.attn_v.weight") == 0
    assert hf_module_to_gguf(cfg, "model.layers.0.mlp.experts") is None
    b = np.random.default_rng(0).standard_normal((cfg.q_dim, 3)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk_rows(permute_qk_rows(b, 4), 4), b)


def test_every_reference_adapter_lands_in_the_table(smollm_path):
    """The real adapters' tensors all have a slot, and the slot's row count is their B's."""
    _, cfg = open_model_file(smollm_path)
    paths = sorted((reference_dir() / "adapters").glob("*.gguf"))
    ours = [p for p in paths if GGUFFile(p).metadata["general.architecture"] == cfg.arch]
    assert len(ours) >= 3
    for path in ours:
        ad = load_adapter(path, cfg)
        for name, pair in ad.tensors.items():
            if name in ("token_embd.weight", "output.weight"):
                continue
            _, _, _, rows = layout.fused_slot(cfg, name)
            assert pair.b.shape[0] == rows, (path.name, name)


def test_an_unknown_architecture_has_no_block():
    cfg = ModelConfig(
        "gpt2", "x", 1, 8, 2, 2, 4, 16, 10, 64, 1e-5, 1e4, 4, 1.0, "ALL_F32"
    )  # not declared in layout.BLOCKS
    with pytest.raises(KeyError):
        layout.block(cfg)


@pytest.mark.parametrize("shape", [(2, 3, 1, 8), (2, 6, 5, 8)])
def test_sdpa_is_the_textbook_softmax(shape):
    """The one attention core against softmax(q kᵀ + mask) v written out in float64."""
    rng = np.random.default_rng(1)
    kv, m, L, hd = shape[0], shape[1], shape[2] + 4, shape[3]
    q = rng.standard_normal((kv, m, hd)).astype(np.float32)
    k = rng.standard_normal((kv, L, hd)).astype(np.float32)
    v = rng.standard_normal((kv, L, hd)).astype(np.float32)
    add = np.where(rng.random((m, L)) < 0.3, -np.inf, 0.0).astype(np.float32)
    add[:, 0] = 0.0  # every row sees at least one key

    def mask(s):
        s += add

    got = sdpa(q, k, v, mask)
    s = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) + add
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_real_file_matches_the_table(smollm_path):
    """SmolLM2's own file: every tensor the table expects exists with that shape."""
    gf = GGUFFile(smollm_path)
    _, cfg = open_model_file(smollm_path)
    for name, (shape, _) in layout.file_tensors(cfg, gf.metadata, gf.tensors).items():
        assert gf.tensors[name].shape == shape


def test_reader_names_a_quant_type_it_cannot_dequantize(tmp_path):
    """GGUFFile.dequantize is the one dequantize path (loader, adapters, export): a type
    gguf-py cannot dequantize is a UserError naming file, tensor and type."""
    from gguf import GGUFWriter

    from core.errors import UserError
    from core.gguf.reader import UnsupportedQuant

    path = tmp_path / "ints.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.int32).reshape(2, 32))
    w.add_tensor("ok.weight", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(path)
    np.testing.assert_array_equal(gf.dequantize("ok.weight"), np.ones((2, 32)))
    with pytest.raises(UnsupportedQuant) as err:
        gf.dequantize("blk.0.attn_q.weight")
    assert isinstance(err.value, UserError)
    assert str(err.value) == (
        "ints.gguf: tensor 'blk.0.attn_q.weight' uses quant type I32, which cannot be dequantized"
    )
