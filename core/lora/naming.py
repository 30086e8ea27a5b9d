"""Hugging Face (PEFT) <-> GGUF names of LoRA targets, and the Q/K row permutation.

Both directions read the block table in core/model/layout.py (each part's HF module
and whether its rows were permuted for rope), so importing a PEFT folder and
exporting one can never disagree.
"""

from __future__ import annotations

import re

import numpy as np

from ..model import layout
from ..model.config import ModelConfig

# Gemma 3 checkpoints of the multimodal class (Gemma3ForConditionalGeneration: 4B and
# up) name the text model's modules model.language_model.*; the text-only ones (270M,
# 1B) say model.*, as every other family does. PEFT folders of both map to one GGUF.
HF_TEXT_PREFIXES = {"gemma3": ("model.language_model.",)}


def hf_module_to_gguf(cfg: ModelConfig, module: str) -> str | None:
    """'model.layers.3.self_attn.q_proj' -> 'blk.3.attn_q.weight' (also embed/lm_head)."""
    module = module.removeprefix("base_model.model.")
    for prefix in HF_TEXT_PREFIXES.get(cfg.arch, ()):
        if module.startswith(prefix):
            module = "model." + module.removeprefix(prefix)
    if module == "model.embed_tokens":
        return "token_embd.weight"
    if module == "lm_head":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if m:
        for p in layout.parts(cfg):
            if p.hf == m.group(2):
                return f"blk.{m.group(1)}.{p.tensor}.weight"
    return None


def gguf_to_hf_module(cfg: ModelConfig, name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj' (and embed/lm_head);
    None for a tensor with no Hugging Face counterpart. Gemma 3 exports use the
    text-only class's names (model.layers.*), which its GGUFs are converted from."""
    if name == "token_embd.weight":
        return "model.embed_tokens"
    if name == "output.weight":
        return "lm_head"
    split = layout.split_name(name)
    part = layout.part_of(cfg, split[1]) if split else None
    return f"model.layers.{split[0]}.{part.hf}" if part else None


def hf_modules(cfg: ModelConfig) -> str:
    """The supported HF module names, for messages."""
    return ", ".join(p.hf.rsplit(".", 1)[-1] for p in layout.parts(cfg))


def rope_heads(cfg: ModelConfig, name: str) -> int:
    """Heads whose rows llama.cpp's converter permuted in GGUF tensor ``name`` (0: none)."""
    split = layout.split_name(name)
    part = layout.part_of(cfg, split[1]) if split else None
    return getattr(cfg, part.rope_heads) if part and part.rope_heads else 0


def permute_qk_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutes Q/K weight rows per head (HF rotate-half ->
    adjacent-pair rope). A LoRA's B on q_proj/k_proj needs the same permutation."""
    out, r = b.shape
    return b.reshape(n_head, 2, out // n_head // 2, r).swapaxes(1, 2).reshape(out, r)


def unpermute_qk_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk_rows`: llama.cpp's (GGUF) Q/K row order back to
    Hugging Face's rotate-half order."""
    out, r = b.shape
    return b.reshape(n_head, out // n_head // 2, 2, r).swapaxes(1, 2).reshape(out, r)
