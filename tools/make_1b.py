"""Write a Llama-3.2-1B-shaped GGUF with random weights, for load and bench figures.

    .venv/bin/python tools/make_1b.py OUT.gguf [--shape 1b|3b|8b]

``--shape 3b`` writes Llama-3.2-3B's shape (hidden 3072, 28 layers, 24 query heads
and 8 KV heads of 128, FFN 8192, tied, 3.2 B parameters, ~2.0 GB) and ``--shape 8b``
Llama-3.1-8B's (hidden 4096, 32 layers, 32 and 8 heads of 128, FFN 14336, an untied
Q6_K output matrix, rope scaling factor 8, 8.0 B parameters, ~4.9 GB); the rest of
this text speaks of the default, 1B.

The shape is meta-llama/Llama-3.2-1B's config.json: hidden 2048, 16 layers, 32 query
heads and 8 KV heads of 64, FFN 8192, vocab 128256, tied embeddings, rope_theta
500000 with llama3 rope scaling (factor 32, low/high frequency factors 1/4, original
context 8192), 1.24 B parameters.

The tensors follow llama.cpp's Q4_K_M recipe: Q6_K for token_embd and for attn_v and
ffn_down on the "more bits" layers, Q4_K for every other matrix, F32 norms. gguf-py
0.19.0 cannot quantize K-quants in numpy (``gguf.quants`` has no Q4_K/Q6_K
``quantize_blocks``), and the weights are random anyway, so the blocks are written
directly: random quants and sub-block scales, with the f16 super-block scales set so
every weight stays finite with a standard deviation near 0.02. The file is ~0.8 GB
(Llama-3.2-1B-Instruct-Q4_K_M.gguf is 0.81 GB) and dequantizes like the real one.

The tokenizer is SmolLM2's byte-level BPE (tokens, merges, ChatML template) grown to
Llama 3's size: synthetic merges of existing tokens up to 128000 ordinary tokens,
then Llama 3's 256 special tokens (<|begin_of_text|> at 128000), with Llama 3's
"llama-bpe" pre-tokenizer: 128256 tokens and 127748 merges to build at load (a real
Llama 3 has 280k merges).

Keep the file out of the repository (it is written where you say; /tmp or the cache).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VOCAB, N_SPECIAL = 128256, 256
ROPE_THETA, CTX = 500000.0, 131072
# the config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B:
# (hidden, layers, query heads, KV heads, head dim, FFN, tied output, rope scaling factor)
SHAPES = {
    "1b": (2048, 16, 32, 8, 64, 8192, True, 32.0),
    "3b": (3072, 28, 24, 8, 128, 8192, True, 32.0),
    "8b": (4096, 32, 32, 8, 128, 14336, False, 8.0),
}
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, TIED, _FACTOR = SHAPES["1b"]
ROPE_SCALING = dict(factor=_FACTOR, low_freq_factor=1.0, high_freq_factor=4.0, original=8192)


def use_shape(name: str) -> None:
    """Make the module's shape constants those of ``name`` (a key of SHAPES)."""
    global DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, TIED
    DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, TIED, factor = SHAPES[name]
    ROPE_SCALING["factor"] = factor


WEIGHT_STD = 0.02  # about what a trained 1B's matrices hold

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K


def llama3_rope_factors() -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for llama3
    rope scaling: 1 for high frequencies, ``factor`` for low ones, smooth between."""
    s = ROPE_SCALING
    freqs = 1.0 / ROPE_THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    low_wavelen = s["original"] / s["low_freq_factor"]
    high_wavelen = s["original"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)  # (HEAD_DIM/2,)


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """(rows, cols / block * type_size) uint8: random K-quant blocks whose f16
    super-block scales are set so the weights are finite with std ~WEIGHT_STD."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = np.frombuffer(rng.bytes(n_blocks * type_size), dtype=np.uint8).copy()
    blocks = raw.reshape(n_blocks, type_size)  # (blocks, type_size)
    if qtype == Q4_K:
        # w = d * sc * q - dmin * m, q in 0..15, sc and m in 0..63: std ~200 d,
        # and dmin = 7.5 d centres the mean of q at zero
        d = np.full(n_blocks, WEIGHT_STD / 200, dtype=np.float16)  # (blocks,)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
        blocks[:, 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(n_blocks, 2)
    elif qtype == Q6_K:
        # w = d * sc * (q - 32), q in 0..63, sc int8: std ~1350 d
        d = np.full(n_blocks, WEIGHT_STD / 1350, dtype=np.float16)  # (blocks,)
        blocks[:, 208:210] = d.view(np.uint8).reshape(n_blocks, 2)
    else:  # pragma: no cover - only the two types above are written
        raise ValueError(qtype)
    return blocks.reshape(rows, cols // block * type_size)


def more_bits(i: int) -> bool:
    """llama.cpp's use_more_bits(): the Q4_K_M layers whose attn_v/ffn_down get Q6_K."""
    n = N_LAYERS
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def grown_vocab(rng: np.random.Generator) -> tuple[list[str], list[int], list[str], str]:
    """SmolLM2's tokens, types and merges grown to Llama 3's 128000 + 256, and its
    chat template."""
    from core.default_model import ensure_default_model

    r = GGUFReader(str(ensure_default_model(log=print)))

    def field(key):
        return r.fields[key].contents()

    tokens: list[str] = list(field("tokenizer.ggml.tokens"))
    types: list[int] = list(field("tokenizer.ggml.token_type"))
    merges: list[str] = list(field("tokenizer.ggml.merges"))
    template: str = field("tokenizer.chat_template")
    seen = set(tokens)
    # ordinary tokens to pair up: short ones, so the synthetic words stay word-sized
    parts = [t for t, ty in zip(tokens, types) if ty == 1 and 1 <= len(t) <= 4]
    target = VOCAB - N_SPECIAL
    while len(tokens) < target:
        a, b = parts[rng.integers(len(parts))], parts[rng.integers(len(parts))]
        if a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        types.append(1)
        merges.append(f"{a} {b}")
    # Llama 3's special tokens, in its order
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    special += ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]
    special += ["<|finetune_right_pad_id|>", "<|reserved_special_token_2|>"]
    special += ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
    special += ["<|python_tag|>"]
    special += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + N_SPECIAL - len(special))]
    tokens += special
    types += [3] * len(special)  # CONTROL
    assert len(tokens) == VOCAB, len(tokens)
    return tokens, types, merges, template


def write(out: Path, seed: int = 0, shape: str = "1b") -> Path:
    use_shape(shape)
    rng = np.random.default_rng(seed)
    tokens, types, merges, template = grown_vocab(rng)
    w = GGUFWriter(str(out), "llama")
    base = "Llama-3.1-8B" if shape == "8b" else f"Llama-3.2-{shape.upper()}"
    w.add_name(f"{base}-shaped random (tools/make_1b.py)")
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("llama.attention.key_length", HEAD_DIM)
    w.add_uint32("llama.attention.value_length", HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB - N_SPECIAL)  # <|begin_of_text|>
    w.add_eos_token_id(tokens.index("<|im_end|>"))  # the ChatML template's end of turn
    w.add_add_bos_token(True)
    w.add_chat_template(template)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        w.add_tensor(name, random_blocks(rows, cols, qtype, rng), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))

    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    w.add_tensor("rope_freqs.weight", llama3_rope_factors())
    matrix("token_embd.weight", VOCAB, DIM, Q6_K)
    for i in range(N_LAYERS):
        b = f"blk.{i}."
        more = Q6_K if more_bits(i) else Q4_K
        norm(b + "attn_norm.weight")
        matrix(b + "attn_q.weight", q_dim, DIM, Q4_K)
        matrix(b + "attn_k.weight", kv_dim, DIM, Q4_K)
        matrix(b + "attn_v.weight", kv_dim, DIM, more)
        matrix(b + "attn_output.weight", DIM, q_dim, Q4_K)
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", FFN, DIM, Q4_K)
        matrix(b + "ffn_up.weight", FFN, DIM, Q4_K)
        matrix(b + "ffn_down.weight", DIM, FFN, more)
    norm("output_norm.weight")
    if not TIED:
        matrix("output.weight", VOCAB, DIM, Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the .gguf to write (keep it out of the repo)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    args = ap.parse_args(argv)
    write(args.out, args.seed, args.shape)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
