"""The fused weight layout: the one table of what a block reads from a GGUF file.

A block multiplies by a few fused matrices (``wqkv`` = Q|K|V stacked along the
rows, ``w_gate_up`` = gate|up, ...). Each is declared here once, as its parts in
row order, each part one GGUF tensor with its output size, its Hugging Face module
name and whether llama.cpp's converter permuted its rows for rope. Everything that
needs to know where a tensor lives reads this table: the weight loader (what to
stack, which shapes to check against which metadata keys), LoRA (which fused rows
an adapter tensor lands in, HF <-> GGUF names), the forward pass (where Q, K, V,
gate and up start) and the exports. A new architecture declares its block here:
Phi-3, whose file stores ``attn_qkv`` already fused, would list one source part
covering q+2kv rows; Qwen2's Q/K/V biases are the ``bias`` field of their parts (the
fused bias ``<matrix>_bias`` is stacked like the matrix).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class Dim:
    """One size of the model and the metadata keys it follows from (named in errors)."""

    size: Callable[[ModelConfig], int]
    keys: str  # "{a}" stands for "<arch>."


DIMS: dict[str, Dim] = {
    "dim": Dim(lambda c: c.dim, "{a}embedding_length"),
    "q": Dim(lambda c: c.q_dim, "{a}attention.head_count × {a}attention.key_length"),
    "kv": Dim(lambda c: c.kv_dim, "{a}attention.head_count_kv × {a}attention.key_length"),
    "ffn": Dim(lambda c: c.ffn_dim, "{a}feed_forward_length"),
    "hd": Dim(lambda c: c.head_dim, "{a}attention.key_length"),
    # tensors a file stores already fused (phi3): Q|K|V, gate|up
    "qkv": Dim(
        lambda c: c.q_dim + 2 * c.kv_dim,
        "{a}attention.head_count, {a}attention.head_count_kv, {a}embedding_length",
    ),
    "ffn2": Dim(lambda c: 2 * c.ffn_dim, "{a}feed_forward_length (× 2: gate|up)"),
}


@dataclass(frozen=True)
class Part:
    """One GGUF tensor ``blk.N.<tensor>.weight``: a run of rows of a fused matrix."""

    tensor: str  # GGUF name inside a block, e.g. "attn_q"
    rows: str  # DIMS name of its output size
    hf: str  # Hugging Face (PEFT) module inside a layer, e.g. "self_attn.q_proj"
    rope_heads: str = ""  # ModelConfig field: heads whose rows the GGUF converter permuted
    bias: bool = False  # the file also holds blk.N.<tensor>.bias (rows,)


@dataclass(frozen=True)
class Matrix:
    """A fused matrix of a block: a LayerWeights field and a LoRA target."""

    name: str
    parts: tuple[Part, ...]  # stacked along the rows in this order
    cols: str  # DIMS name of its input size

    @property
    def bias(self) -> str:
        """LayerWeights field of its fused bias ("" when no part has one)."""
        return f"{self.name}_bias" if any(p.bias for p in self.parts) else ""


@dataclass(frozen=True)
class Norm:
    """A norm weight of a block: LayerWeights field ``name``, GGUF ``blk.N.<name>.weight``."""

    name: str
    size: str = "dim"  # DIMS name of its length ("hd": one head's, shared by all heads)


LLAMA_BLOCK: tuple[Norm | Matrix, ...] = (
    Norm("attn_norm"),
    Matrix(
        "wqkv",
        (
            Part("attn_q", "q", "self_attn.q_proj", rope_heads="n_heads"),
            Part("attn_k", "kv", "self_attn.k_proj", rope_heads="n_kv_heads"),
            Part("attn_v", "kv", "self_attn.v_proj"),
        ),
        "dim",
    ),
    Matrix("wo", (Part("attn_output", "dim", "self_attn.o_proj"),), "q"),
    Norm("ffn_norm"),
    Matrix(
        "w_gate_up",
        (Part("ffn_gate", "ffn", "mlp.gate_proj"), Part("ffn_up", "ffn", "mlp.up_proj")),
        "dim",
    ),
    Matrix("w_down", (Part("ffn_down", "dim", "mlp.down_proj"),), "ffn"),
)
# Qwen2: llama's block with Q/K/V biases, Q/K rows in Hugging Face order (no permutation)
QWEN2_BLOCK: tuple[Norm | Matrix, ...] = (
    Norm("attn_norm"),
    Matrix(
        "wqkv",
        (
            Part("attn_q", "q", "self_attn.q_proj", bias=True),
            Part("attn_k", "kv", "self_attn.k_proj", bias=True),
            Part("attn_v", "kv", "self_attn.v_proj", bias=True),
        ),
        "dim",
    ),
    *LLAMA_BLOCK[2:],
)
# Q/K/V with their rows in Hugging Face order (no rope permutation) and no biases:
# Qwen3's and Gemma 3's
QKV_HF_ORDER = Matrix(
    "wqkv",
    (
        Part("attn_q", "q", "self_attn.q_proj"),
        Part("attn_k", "kv", "self_attn.k_proj"),
        Part("attn_v", "kv", "self_attn.v_proj"),
    ),
    "dim",
)
# Qwen3: llama's block with per-head RMS norms on Q and K (before rope), no biases
QWEN3_BLOCK: tuple[Norm | Matrix, ...] = (
    Norm("attn_norm"),
    QKV_HF_ORDER,
    Norm("attn_q_norm", "hd"),
    Norm("attn_k_norm", "hd"),
    *LLAMA_BLOCK[2:],
)
# Gemma 3: per-head Q/K norms, norms after attention and after the FFN (llama.cpp's
# converter already stores Gemma's (1 + w) RMS norm weights as 1 + w)
GEMMA3_BLOCK: tuple[Norm | Matrix, ...] = (
    Norm("attn_norm"),
    QKV_HF_ORDER,
    Norm("attn_q_norm", "hd"),
    Norm("attn_k_norm", "hd"),
    LLAMA_BLOCK[2],  # wo
    Norm("post_attention_norm"),
    *LLAMA_BLOCK[3:],  # ffn_norm, w_gate_up, w_down
    Norm("post_ffw_norm"),
)
# Phi-3: the file stores Q|K|V as one attn_qkv and gate|up as one ffn_up (one part
# covering all rows of each; LoRA and PEFT's qkv_proj / gate_up_proj land on all of them)
PHI3_BLOCK: tuple[Norm | Matrix, ...] = (
    Norm("attn_norm"),
    Matrix("wqkv", (Part("attn_qkv", "qkv", "self_attn.qkv_proj"),), "dim"),
    LLAMA_BLOCK[2],  # wo
    Norm("ffn_norm"),
    Matrix("w_gate_up", (Part("ffn_up", "ffn2", "mlp.gate_up_proj"),), "dim"),
    LLAMA_BLOCK[5],  # w_down
)
# Gemma 2: Gemma 3's block without the Q/K norms
GEMMA2_BLOCK: tuple[Norm | Matrix, ...] = tuple(
    e for e in GEMMA3_BLOCK if not (isinstance(e, Norm) and e.size == "hd")
)
# The order of a block's entries is the order of the weight cache file (core/model/
# weights.py: bump its CACHE_FORMAT when this table changes).
BLOCKS: dict[str, tuple[Norm | Matrix, ...]] = {
    "llama": LLAMA_BLOCK,
    "qwen2": QWEN2_BLOCK,
    "qwen3": QWEN3_BLOCK,
    "phi3": PHI3_BLOCK,
    "gemma2": GEMMA2_BLOCK,
    "gemma3": GEMMA3_BLOCK,
}

# rope frequency factors a file may hold: Weights field -> GGUF tensor, (rope_dim/2,) each
ROPE_FACTOR_TENSORS = {
    "rope_freqs": "rope_freqs.weight",  # llama 3.x
    "rope_long": "rope_factors_long.weight",  # phi3 LongRoPE
    "rope_short": "rope_factors_short.weight",
}

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def block(cfg: ModelConfig) -> tuple[Norm | Matrix, ...]:
    return BLOCKS[cfg.arch]


def matrices(cfg: ModelConfig) -> tuple[Matrix, ...]:
    """The block's fused matrices in the order the forward pass uses them."""
    return tuple(e for e in block(cfg) if isinstance(e, Matrix))


def norms(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(e.name for e in block(cfg) if isinstance(e, Norm))


def layer_fields(cfg: ModelConfig) -> tuple[str, ...]:
    """LayerWeights fields one block of this architecture fills, in file order."""
    out: list[str] = []
    for e in block(cfg):
        out.append(e.name)
        if isinstance(e, Matrix) and e.bias:
            out.append(e.bias)
    return tuple(out)


def matrix(cfg: ModelConfig, name: str) -> Matrix:
    return next(m for m in matrices(cfg) if m.name == name)


def parts(cfg: ModelConfig) -> Iterator[Part]:
    for m in matrices(cfg):
        yield from m.parts


def size(cfg: ModelConfig, dim: str) -> int:
    return DIMS[dim].size(cfg)


def placed(cfg: ModelConfig, m: Matrix) -> list[tuple[Part, int, int]]:
    """(part, first row, rows) of each part of ``m``, in row order."""
    out, row = [], 0
    for p in m.parts:
        n = size(cfg, p.rows)
        out.append((p, row, n))
        row += n
    return out


def out_rows(cfg: ModelConfig, name: str) -> int:
    return sum(size(cfg, p.rows) for p in matrix(cfg, name).parts)


def fused_shape(cfg: ModelConfig, m: Matrix) -> tuple[int, int]:
    return out_rows(cfg, m.name), size(cfg, m.cols)


def part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """GGUF tensor name inside a block -> its numpy (out, in) shape."""
    return {
        p.tensor: (size(cfg, p.rows), size(cfg, m.cols)) for m in matrices(cfg) for p in m.parts
    }


def split_name(name: str) -> tuple[int, str] | None:
    """'blk.3.attn_q.weight' -> (3, 'attn_q'); None for a tensor outside the blocks."""
    m = _BLOCK_NAME.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def fused_slot(cfg: ModelConfig, name: str) -> tuple[int, str, int, int] | None:
    """blk.N.<t>.weight -> (layer, fused matrix, first row, rows); None if no matrix holds it."""
    split = split_name(name)
    if split is None:
        return None
    for m in matrices(cfg):
        for p, r0, n in placed(cfg, m):
            if p.tensor == split[1]:
                return split[0], m.name, r0, n
    return None


def part_of(cfg: ModelConfig, tensor: str) -> Part | None:
    """The Part of GGUF block tensor ``tensor`` (e.g. 'attn_q'), or None."""
    return next((p for p in parts(cfg) if p.tensor == tensor), None)


# ---- the whole file -----------------------------------------------------------------


def fused_plan(
    cfg: ModelConfig, present: Mapping[str, object]
) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """(fused name, numpy shape, GGUF tensors stacked along its rows) in file order.
    ``present``: the file's tensors (output.weight and rope_freqs.weight are optional)."""
    d = cfg.dim
    plan = [("tok_embd", (cfg.vocab_size, d), ["token_embd.weight"])]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        for e in block(cfg):
            if isinstance(e, Norm):
                plan.append((b + e.name, (size(cfg, e.size),), [f"{b}{e.name}.weight"]))
                continue
            plan.append(
                (b + e.name, fused_shape(cfg, e), [f"{b}{p.tensor}.weight" for p in e.parts])
            )
            if e.bias:
                bias = [f"{b}{p.tensor}.bias" for p in e.parts]
                plan.append((b + e.bias, (out_rows(cfg, e.name),), bias))
    plan.append(("output_norm", (d,), ["output_norm.weight"]))
    if "output.weight" in present:
        plan.append(("output", (cfg.vocab_size, d), ["output.weight"]))
    for field, src in ROPE_FACTOR_TENSORS.items():
        if src in present:
            plan.append((field, (cfg.rope_dim // 2,), [src]))
    return plan


def file_tensors(
    cfg: ModelConfig, meta: Mapping[str, object], present: Mapping[str, object]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every GGUF tensor the model reads: its numpy shape and the metadata keys that
    shape follows from (named when a file's tensor disagrees)."""
    a = cfg.arch + "."
    keys = {k: dim.keys.format(a=a) for k, dim in DIMS.items()}
    vocab = a + "vocab_size" if a + "vocab_size" in meta else "tokenizer.ggml.tokens"
    d, dim_k = cfg.dim, keys["dim"]
    want = {"token_embd.weight": ((cfg.vocab_size, d), f"{vocab}, {dim_k}")}
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        for e in block(cfg):
            if isinstance(e, Norm):
                want[f"{b}{e.name}.weight"] = ((size(cfg, e.size),), keys[e.size])
                continue
            for p in e.parts:
                shape = (size(cfg, p.rows), size(cfg, e.cols))
                want[f"{b}{p.tensor}.weight"] = (shape, f"{keys[p.rows]}, {keys[e.cols]}")
                if p.bias:
                    want[f"{b}{p.tensor}.bias"] = ((size(cfg, p.rows),), keys[p.rows])
    want["output_norm.weight"] = ((d,), dim_k)
    if "output.weight" in present:
        want["output.weight"] = ((cfg.vocab_size, d), f"{vocab}, {dim_k}")
    for src in ROPE_FACTOR_TENSORS.values():
        if src in present:
            want[src] = ((cfg.rope_dim // 2,), a + "rope.dimension_count")
    return want


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """numpy (out, in) shape of every base matrix a LoRA may target: token_embd, output,
    then the blocks' parts (the order exported LoRA files list their tensors in)."""
    vd = (cfg.vocab_size, cfg.dim)
    shapes = {"token_embd.weight": vd, "output.weight": vd}
    per = part_shapes(cfg)
    for i in range(cfg.n_layers):
        for t, s in per.items():
            shapes[f"blk.{i}.{t}.weight"] = s
    return shapes
