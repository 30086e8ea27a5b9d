"""Write tiny random GGUF models with gguf.GGUFWriter, for shape/edge-case tests: llama,
and with ``arch=`` the tensors and keys of the other families Mixdesk runs (qwen2's Q/K/V
biases; qwen3's and gemma3's Q/K norms; gemma2's and gemma3's post norms, key_length and
sliding window)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
from gguf.gguf_writer import GGUFValue

BYTE_VOCAB = [f"<0x{i:02X}>" for i in range(256)]


def quantize_or_random(a: np.ndarray, qtype, rng) -> np.ndarray:
    """Quantized bytes of ``a``; for types gguf-py cannot quantize (the K-quants),
    random blocks whose bytes stay below 0x3C so every f16 scale is finite."""
    try:
        return quants.quantize(a, qtype)
    except NotImplementedError:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = a.shape[-1] // block * type_size
        return rng.integers(0, 0x3C, size=(*a.shape[:-1], n_bytes), dtype=np.uint8)


# where each block type keeps its f16 scales (byte offsets in the block)
F16_AT = {
    GGMLQuantizationType.Q4_0: [0],
    GGMLQuantizationType.Q4_1: [0, 2],
    GGMLQuantizationType.Q5_0: [0],
    GGMLQuantizationType.Q5_1: [0, 2],
    GGMLQuantizationType.Q8_0: [0],
    GGMLQuantizationType.Q2_K: [80, 82],
    GGMLQuantizationType.Q3_K: [108],
    GGMLQuantizationType.Q4_K: [0, 2],
    GGMLQuantizationType.Q5_K: [0, 2],
    GGMLQuantizationType.Q6_K: [208],
}


def random_matrix(
    qt: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator
) -> np.ndarray:
    """(rows, row_bytes) uint8 of random blocks whose f16 scales are finite."""
    if qt == GGMLQuantizationType.F16:
        # every finite f16 bit pattern is fair, subnormals and -0.0 included
        bits = rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
        exp_all_ones = (bits & 0x7C00) == 0x7C00
        bits[exp_all_ones] &= 0xBFFF  # exponent 30, not inf/nan
        bits[0, :4] = [0x0001, 0x8000, 0x03FF, 0x8001]  # subnormals and -0
        return bits.view(np.uint8).reshape(rows, cols * 2)
    if qt == GGMLQuantizationType.BF16:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return quants.quantize(x, GGMLQuantizationType.BF16)
    block, size = GGML_QUANT_SIZES[qt]
    n = rows * cols // block
    raw = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).copy().reshape(n, size)
    for at in F16_AT[qt]:
        scale = (rng.standard_normal(n) * 0.01).astype(np.float16)  # (blocks,)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // block * size)


def write_tiny_llama(
    path: Path,
    *,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    ffn=96,
    vocab=300,
    tied=True,
    rope_base=10000.0,
    rope_scale=None,
    rope_freqs=False,
    qtype=GGMLQuantizationType.F32,
    arch="llama",
    seed=0,
    ctx=256,
    kv: dict[str, tuple[Any, GGUFValueType] | None] | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    long_rope: tuple[int, float] | None = None,
    sparse: bool = False,
) -> Path:
    """``kv`` overrides metadata after the normal keys are set: key -> (value, type),
    or None to drop the key; for writing hostile but well-formed files. ``head_dim``
    writes attention.key_length (gemma3: head_dim * n_heads need not be dim);
    ``sliding_window`` writes attention.sliding_window (gemma3); ``long_rope``
    (original context, attn_factor) writes phi3's LongRoPE keys and factor tensors.
    ``sparse`` writes only the header and leaves every F32 tensor's bytes a hole in a
    sparse file: a file that claims gigabytes of weights and takes a few KB of disk."""
    rng = np.random.default_rng(seed)
    hd = head_dim or dim // n_heads
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if head_dim:
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    if rope_scale:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", rope_scale)
    # a byte-level SPM vocab so the engine can build a tokenizer
    toks = ["<unk>", "<s>", "</s>"] + BYTE_VOCAB
    toks += [f"tok{i}" for i in range(vocab - len(toks))]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, override in (kv or {}).items():
        if override is None:
            w.kv_data[0].pop(key, None)
        else:
            value, vtype = override
            sub = None
            if vtype == GGUFValueType.ARRAY:
                sub = GGUFValueType.get_type(value[0])
            w.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub)

    def t(name, shape, scale=0.2, norm=False):
        if sparse:  # the tensor's info only: its bytes are left a hole below
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            return
        a = (
            1.0 + 0.1 * rng.standard_normal(shape) if norm else scale * rng.standard_normal(shape)
        ).astype(np.float32)
        if not norm and qtype != GGMLQuantizationType.F32:
            if qtype == GGMLQuantizationType.F16:
                w.add_tensor(name, a.astype(np.float16))
            else:
                w.add_tensor(name, quantize_or_random(a, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    t("token_embd.weight", (vocab, dim), 1.0)
    for i in range(n_layers):
        b = f"blk.{i}."
        t(b + "attn_norm.weight", (dim,), norm=True)
        if arch == "phi3":  # stored fused: Q|K|V, and gate|up below
            t(b + "attn_qkv.weight", ((n_heads + 2 * n_kv_heads) * hd, dim))
        else:
            t(b + "attn_q.weight", (n_heads * hd, dim))
            t(b + "attn_k.weight", (n_kv_heads * hd, dim))
            t(b + "attn_v.weight", (n_kv_heads * hd, dim))
        if arch == "qwen2":  # biases stay F32, like llama.cpp's 1-D tensors
            w.add_tensor(b + "attn_q.bias", rng.standard_normal(n_heads * hd).astype(np.float32))
            for n in ("attn_k.bias", "attn_v.bias"):
                w.add_tensor(b + n, rng.standard_normal(n_kv_heads * hd).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            t(b + "attn_q_norm.weight", (hd,), norm=True)
            t(b + "attn_k_norm.weight", (hd,), norm=True)
        if arch in ("gemma2", "gemma3"):
            t(b + "post_attention_norm.weight", (dim,), norm=True)
            t(b + "post_ffw_norm.weight", (dim,), norm=True)
        t(b + "attn_output.weight", (dim, n_heads * hd))
        t(b + "ffn_norm.weight", (dim,), norm=True)
        if arch == "phi3":
            t(b + "ffn_up.weight", (2 * ffn, dim))
        else:
            t(b + "ffn_gate.weight", (ffn, dim))
            t(b + "ffn_up.weight", (ffn, dim))
        t(b + "ffn_down.weight", (dim, ffn))
    t("output_norm.weight", (dim,), norm=True)
    if not tied:
        t("output.weight", (vocab, dim))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
    if long_rope:  # phi3 LongRoPE: (original context, attn_factor)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", long_rope[0])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", long_rope[1])
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 9.0, hd // 2, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, hd // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if sparse:
        w.write_ti_data_to_file()
        w.close()
        align = w.data_alignment
        pad = lambda n: -(-n // align) * align  # noqa: E731
        end = pad(path.stat().st_size) + sum(pad(ti.nbytes) for ti in w.tensors[0].values())
        os.truncate(path, end)  # a hole: no disk blocks for the tensor data
        return path
    w.write_tensors_to_file()
    w.close()
    return path


def write_lora_gguf(
    path: Path,
    tensors: dict[str, np.ndarray],
    kv: dict | None = None,
    arch: str = "llama",
    general_type: str = "adapter",
) -> Path:
    """A llama.cpp-format LoRA adapter. ``tensors`` by full name
    ("blk.0.attn_q.weight.lora_a"); ``kv`` metadata: floats as f32, lists as arrays,
    anything else as strings."""
    w = GGUFWriter(str(path), arch)
    w.add_type(general_type)
    w.add_string("adapter.type", "lora")
    for k, v in (kv or {}).items():
        if isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_string(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tiny_peft(
    folder: Path,
    *,
    dim=64,
    q_dim=64,
    rank=4,
    layers=(0, 1),
    config: Any = None,
    seed=0,
) -> Path:
    """A PEFT folder with LoRA on q_proj of ``layers`` of a write_tiny_llama model.
    ``config`` replaces the whole adapter_config.json value when it is not a dict
    (for hostile configs); a dict updates the default config."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in layers:
        m = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{m}.lora_A.weight"] = (0.1 * rng.standard_normal((rank, dim))).astype(np.float32)
        tensors[f"{m}.lora_B.weight"] = (0.1 * rng.standard_normal((q_dim, rank))).astype(
            np.float32
        )
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    conf: Any = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj"],
        "bias": "none",
    }
    if isinstance(config, dict):
        conf.update(config)
    elif config is not None:
        conf = config
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    return folder
