"""PEFT folders load as the same adapter as their llama.cpp GGUF conversion, and
bad adapters fail with a clear error while the engine keeps serving.

The GGUF side is written here with gguf's GGUFWriter and this file's own copy of
llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, LlamaModel.permute), so
the loader under test (core.lora.adapter) is checked against an independent conversion.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from core.lora.adapter import AdapterError
from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.mixing import mix_logits
from tests.tiny_gguf import write_lora_gguf

PROMPT = [1, 504, 3426, 314, 253, 9357, 436]
LAYERS = (0, 7, 29)
# HF module -> llama.cpp tensor suffix (written out here, not imported)
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py: HF rotate-half rows -> llama.cpp's interleaved rope rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# ---- writers ------------------------------------------------------------------------


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """HF (out, in) of each projection."""
    d, q, kv, f = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return {
        "self_attn.q_proj": (q, d),
        "self_attn.k_proj": (kv, d),
        "self_attn.v_proj": (kv, d),
        "self_attn.o_proj": (d, q),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }


def random_lora(
    cfg, rank: int | dict[str, int] = 4, seed: int = 0, modules=tuple(HF_TO_GGUF)
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """'model.layers.N.<module>' -> (A (r, in), B (out, r)) in HF layout."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in LAYERS:
        for mod in modules:
            o, i = shapes(cfg)[mod]
            r = rank.get(mod, 4) if isinstance(rank, dict) else rank
            out[f"model.layers.{layer}.{mod}"] = (
                (rng.standard_normal((r, i)) * 0.08).astype(np.float32),
                (rng.standard_normal((o, r)) * 0.08).astype(np.float32),
            )
    return out


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values that bf16 represents exactly (truncated mantissa)."""
    return ((x.astype(np.float32).view(np.uint32) >> 16) << 16).view(np.float32)


def save_bf16_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """numpy has no bfloat16: write the safetensors file by hand."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        raw = (
            (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16)
            .astype("<u2")
            .tobytes()
        )
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def write_peft(folder: Path, lora: dict, bf16: bool = False, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in lora.items():
        # contiguous: safetensors.numpy.save_file writes a strided view's base buffer
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
    if bf16:
        save_bf16_safetensors(tensors, folder / "adapter_model.safetensors")
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    conf = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in lora}),
        "bias": "none",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    conf.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    return folder


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, np.ndarray]],
    alpha: float | None = None,
    arch: str = "llama",
    general_type: str = "adapter",
) -> Path:
    flat = {f"{name}.lora_{ab}": t for name, pair in tensors.items() for ab, t in zip("ab", pair)}
    return write_lora_gguf(
        path,
        flat,
        {} if alpha is None else {"adapter.lora.alpha": alpha},
        arch=arch,
        general_type=general_type,
    )


def hf_to_gguf_tensors(
    cfg, lora: dict, scales: dict[str, float] | None = None, permute: bool = True
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What llama.cpp's convert_lora_to_gguf.py produces: names mapped, B of q/k
    permuted per head, and (optionally) a per-module scale folded into B."""
    out = {}
    for module, (a, b) in lora.items():
        layer, mod = module.split(".", 3)[2], module.split(".", 3)[3]
        if permute and mod == "self_attn.q_proj":
            b = llama_permute(b, cfg.n_heads)
        elif permute and mod == "self_attn.k_proj":
            b = llama_permute(b, cfg.n_kv_heads)
        if scales is not None:
            b = b * scales[module]
        out[f"blk.{layer}.{HF_TO_GGUF[mod]}.weight"] = (a, b)
    return out


# ---- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def engine(smollm_path, ref_dir):
    eng = Engine.from_path(smollm_path, EngineOptions(n_parallel=2, ctx_size=128))
    eng.keep = eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=1.0)
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peft")


@pytest.fixture(scope="session")
def base_logits(engine):
    return logits(engine, {})


def logits(eng: Engine, mix: dict[int, float]) -> np.ndarray:
    return mix_logits(eng, mix, PROMPT)


def compare(
    eng: Engine, peft: Path, gguf: Path, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    a, b = eng.add_adapter(peft), eng.add_adapter(gguf)
    try:
        return logits(eng, {a: scale}), logits(eng, {b: scale})
    finally:
        eng.remove_adapter(a)
        eng.remove_adapter(b)


# ---- PEFT == GGUF ------------------------------------------------------------------


def test_peft_matches_independent_gguf(engine, work, base_logits):
    cfg = engine.config
    lora = random_lora(cfg, seed=1)
    peft = write_peft(work / "plain", lora)
    gguf = write_gguf(work / "plain.gguf", hf_to_gguf_tensors(cfg, lora), alpha=8.0)
    for scale in (1.0, -0.7):
        lp, lg = compare(engine, peft, gguf, scale)
        assert np.abs(lp - base_logits).max() > 0.5  # the adapter does something
        np.testing.assert_allclose(lp, lg, atol=1e-5, rtol=0)


def test_qk_permutation_matters(engine, work):
    cfg = engine.config
    lora = random_lora(cfg, seed=2, modules=("self_attn.q_proj", "self_attn.k_proj"))
    peft = write_peft(work / "qk", lora)
    right = write_gguf(work / "qk.gguf", hf_to_gguf_tensors(cfg, lora), alpha=8.0)
    wrong = write_gguf(
        work / "qk_unpermuted.gguf", hf_to_gguf_tensors(cfg, lora, permute=False), alpha=8.0
    )
    lp, lg = compare(engine, peft, right)
    np.testing.assert_allclose(lp, lg, atol=1e-5, rtol=0)
    lp, lw = compare(engine, peft, wrong)
    assert np.abs(lp - lw).max() > 1e-2


def test_rslora_scales_by_alpha_over_sqrt_r(engine, work):
    cfg = engine.config
    lora = random_lora(cfg, rank=4, seed=3)
    peft = write_peft(work / "rslora", lora, r=4, lora_alpha=8, use_rslora=True)
    s = 8 / math.sqrt(4)  # 4, not alpha/r = 2
    gguf = write_gguf(work / "rslora.gguf", hf_to_gguf_tensors(cfg, lora, {m: s for m in lora}))
    lp, lg = compare(engine, peft, gguf)
    np.testing.assert_allclose(lp, lg, atol=1e-5, rtol=0)


def test_rank_and_alpha_pattern(engine, work):
    cfg = engine.config
    ranks = {"self_attn.q_proj": 2, "mlp.up_proj": 6}
    lora = random_lora(cfg, rank=ranks, seed=4)
    # a full-name key for one module, a short suffix key for a kind of module
    lora["model.layers.7.self_attn.k_proj"] = (
        lora["model.layers.7.self_attn.k_proj"][0][:3],
        lora["model.layers.7.self_attn.k_proj"][1][:, :3],
    )
    rank_pattern = {"q_proj": 2, "mlp.up_proj": 6, "model.layers.7.self_attn.k_proj": 3}
    alpha_pattern = {"down_proj": 1.0, "model.layers.7.self_attn.k_proj": 12.0}
    peft = write_peft(
        work / "patterns",
        lora,
        r=4,
        lora_alpha=8,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )

    def scale(module):
        r = lora[module][0].shape[0]
        alpha = (
            12.0
            if module == "model.layers.7.self_attn.k_proj"
            else 1.0
            if module.endswith("down_proj")
            else 8.0
        )
        return alpha / r

    gguf = write_gguf(
        work / "patterns.gguf", hf_to_gguf_tensors(cfg, lora, {m: scale(m) for m in lora})
    )
    lp, lg = compare(engine, peft, gguf)
    np.testing.assert_allclose(lp, lg, atol=1e-5, rtol=0)


def test_bf16_tensors(engine, work):
    cfg = engine.config
    lora = {m: (bf16_round(a), bf16_round(b)) for m, (a, b) in random_lora(cfg, seed=5).items()}
    peft = write_peft(work / "bf16", lora, bf16=True)
    gguf = write_gguf(work / "bf16.gguf", hf_to_gguf_tensors(cfg, lora), alpha=8.0)
    lp, lg = compare(engine, peft, gguf)
    np.testing.assert_allclose(lp, lg, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name,config,extra_tensor",
    [
        ("dora", {"use_dora": True}, None),
        (
            "dora_vector",
            {},
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        ),
        ("modules_to_save", {"modules_to_save": ["lm_head"]}, None),
        ("bias_all", {"bias": "all"}, None),
    ],
)
def test_unsupported_peft_features(engine, work, name, config, extra_tensor):
    folder = work / f"unsupported_{name}"
    write_peft(folder, random_lora(engine.config, seed=6, modules=("self_attn.q_proj",)), **config)
    if extra_tensor:
        st = folder / "adapter_model.safetensors"
        from safetensors.numpy import load_file

        t = load_file(st)
        t[extra_tensor] = np.ones(576, dtype=np.float32)
        save_file(t, str(st))
    before = engine.adapters()
    with pytest.raises(AdapterError, match="unsupported") as ei:
        engine.add_adapter(folder)
    assert folder.name in str(ei.value)
    assert engine.adapters() == before


# ---- GGUF adapter validation -----------------------------------------------------------


def _good_pair(rank=4, out=576, inp=576):
    rng = np.random.default_rng(9)
    return (
        rng.standard_normal((rank, inp)).astype(np.float32) * 0.01,
        rng.standard_normal((out, rank)).astype(np.float32) * 0.01,
    )


def _bad_adapters(work: Path, smollm_path: Path) -> list[tuple[Path, list[str]]]:
    """(path, substrings the error must contain)."""
    good = {"blk.0.attn_q.weight": _good_pair()}
    a, b = _good_pair()
    cases = [
        (write_gguf(work / "bad_arch.gguf", good, arch="qwen2"), ["bad_arch.gguf", "qwen2"]),
        (
            write_gguf(work / "bad_missing.gguf", {**good, "blk.99.attn_q.weight": _good_pair()}),
            ["bad_missing.gguf", "blk.99.attn_q.weight", "does not exist"],
        ),
        (
            write_gguf(work / "bad_shape.gguf", {"blk.0.ffn_down.weight": _good_pair(inp=576)}),
            ["bad_shape.gguf", "blk.0.ffn_down.weight", "(576, 1536)"],
        ),
        (
            write_gguf(
                work / "bad_rank.gguf", {"blk.0.attn_v.weight": (a, _good_pair(rank=3, out=192)[1])}
            ),
            ["bad_rank.gguf", "blk.0.attn_v.weight"],
        ),
        (smollm_path, [smollm_path.name, "not a LoRA adapter"]),
    ]
    trunc = write_gguf(work / "bad_truncated.gguf", {"blk.0.attn_q.weight": _good_pair(rank=16)})
    data = trunc.read_bytes()
    trunc.write_bytes(data[: int(len(data) * 0.6)])
    cases.append((trunc, ["bad_truncated.gguf", "truncated"]))
    return cases


def test_bad_gguf_adapters_fail_clearly_and_engine_keeps_serving(engine, work, smollm_path):
    params = SamplingParams(temperature=0.0, n_predict=4, ignore_eos=True)
    before_tokens = engine.complete(PROMPT, params, cache_prompt=False).tokens
    before = engine.adapters()
    for path, needles in _bad_adapters(work, smollm_path):
        with pytest.raises(AdapterError) as ei:
            engine.add_adapter(path, scale=1.0)
        msg = str(ei.value)
        assert "\n" not in msg
        for n in needles:
            assert n in msg, (path.name, msg)
    assert engine.adapters() == before
    assert engine.get_mix() == {engine.keep: 1.0}
    # the global mix (lora_attn at 1.0) still serves
    assert engine.complete(PROMPT, params, cache_prompt=False).tokens == before_tokens


def test_rank_mismatch_message_names_both_shapes(engine, work):
    a, _ = _good_pair(rank=4)
    _, b = _good_pair(rank=3)
    path = write_gguf(work / "rank_mismatch.gguf", {"blk.2.attn_output.weight": (a, b)})
    with pytest.raises(AdapterError) as ei:
        engine.add_adapter(path)
    msg = str(ei.value)
    assert "(4, 576)" in msg and "(576, 3)" in msg and "blk.2.attn_output.weight" in msg


def test_an_alora_peft_folder_loads_with_its_invocation_tokens(engine, work):
    """PEFT's aLoRA (alora_invocation_tokens in adapter_config.json) loads as an aLoRA:
    the engine lists its invocation as llama-server does; tokens outside the vocabulary
    are refused, naming the field."""
    from core.lora.adapter import AdapterError

    lora = random_lora(engine.config, rank=4, seed=5)
    inv = [1, 520, 9531, 198]
    folder = write_peft(work / "alora", lora, alora_invocation_tokens=inv)
    aid = engine.add_adapter(folder, scale=0.0)
    try:
        entry = next(a for a in engine.adapters() if a["id"] == aid)
        assert entry["alora_invocation_tokens"] == inv
        assert entry["alora_invocation_string"] == "<|im_start|>assistant\n"
    finally:
        engine.remove_adapter(aid)
    bad = write_peft(work / "alora-bad", lora, alora_invocation_tokens=[1, 10**9])
    with pytest.raises(AdapterError, match="alora_invocation_tokens"):
        engine.add_adapter(bad)
