"""The Gemma 3 (and Gemma 2) forward pass: llama's batch machinery with Gemma's block.

As llama.cpp builds it (src/models/gemma3.cpp): embeddings scaled by sqrt(dim);
per-head RMS norms on Q and K before a NeoX rope; norms after attention and after
the FFN, before their residual adds; a GeGLU FFN (gelu-tanh gate); q scaled by
1/sqrt(head_dim). Five of every six layers attend over a sliding window with the
local rope base (10000); every sixth layer attends globally with rope.freq_base.
The GGUF stores Gemma's (1 + w) norm weights already as 1 + w (llama.cpp's
converter adds the one), so every norm here is a plain RMS norm.

Gemma 2 (src/models/gemma2.cpp) is the same pass without the Q/K norms, with one rope
base for all layers, sliding windows on every other layer, and soft-capping:
attention scores c*tanh(s/c) before the mask, final logits likewise.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import attend
from .kv_cache import F32
from .llama import LlamaModel
from .primitives import RopeTable, gelu_mul, rms_norm, rms_norm_heads, rope_neox
from .weights import LayerWeights


class Gemma3Model(LlamaModel):
    def __init__(self, cfg, weights, threads=None, kv_types=F32):
        super().__init__(cfg, weights, threads=threads, kv_types=kv_types)
        # gemma3's sliding-window layers keep their own base and no position scaling
        self.rope_local = (
            RopeTable(cfg, None, base=cfg.rope_base_swa, scale=1.0)
            if cfg.rope_base_swa
            else self.rope
        )
        self.swa = frozenset(cfg.swa_layers)
        self.embed_scale = np.float32(math.sqrt(cfg.dim))

    def rope_cis(self, positions: np.ndarray):
        glob = self.rope.get(positions)  # (T, 1, hd/2)
        local = glob if self.rope_local is self.rope else self.rope_local.get(positions)
        return glob, local

    def embed(self, tokens: np.ndarray, deltas) -> np.ndarray:
        x = super().embed(tokens, deltas)  # llama.cpp adds the LoRA delta before the scaling
        x *= self.embed_scale
        return x

    def _block(self, li: int, lw: LayerWeights, x, items, spans, deltas, cis, masks, pooled):
        cfg = self.cfg
        T = x.shape[0]
        H, KV, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        window = cfg.sliding_window if li in self.swa else 0
        cs = cis[1] if li in self.swa else cis[0]  # (T, 1, hd/2)

        h = rms_norm(x, lw.attn_norm, eps)  # (T, d)
        qkv = deltas.project(self.lin, h, lw.wqkv, li, "wqkv")  # (T, q+2kv)
        q = qkv[:, self.qk_rows][:, : H * hd].reshape(T, H, hd)  # (T, H, hd)
        k = qkv[:, self.qk_rows][:, H * hd :].reshape(T, KV, hd)  # (T, KV, hd)
        if lw.attn_q_norm is not None:  # gemma3
            q, k = rms_norm_heads(q, lw.attn_q_norm, eps), rms_norm_heads(k, lw.attn_k_norm, eps)
        q, k = rope_neox(q, cs), rope_neox(k, cs)  # (T, H, hd), (T, KV, hd)
        cap = cfg.attn_softcap  # gemma2
        v = qkv[:, self.v_rows].reshape(T, KV, hd)  # (T, KV, hd)

        attn = np.empty((T, cfg.q_dim), dtype=np.float32)  # (T, H*hd)
        if pooled is not None:
            r = pooled.rows
            attn[r] = pooled.attend(li, q[r], k[r], v[r], H, self.scale, window, cap)
        for i, (it, (s, e), mask) in enumerate(zip(items, spans, masks)):
            if pooled is None or i not in pooled.items:
                attn[s:e] = attend(
                    li,
                    it.cache,
                    it.tokens,
                    q[s:e],
                    k[s:e],
                    v[s:e],
                    mask,
                    H,
                    self.scale,
                    window,
                    cap,
                )

        o = deltas.project(self.lin, attn, lw.wo, li, "wo")  # (T, d)
        x = x + rms_norm(o, lw.post_attention_norm, eps)

        h = rms_norm(x, lw.ffn_norm, eps)  # (T, d)
        gu = deltas.project(self.lin, h, lw.w_gate_up, li, "w_gate_up")  # (T, 2f)
        act = gelu_mul(gu[:, self.gate_rows], gu[:, self.up_rows])  # (T, f)
        d = deltas.project(self.lin, act, lw.w_down, li, "w_down")  # (T, d)
        return x + rms_norm(d, lw.post_ffw_norm, eps)

    def _logits(self, items, spans, x, deltas) -> list[np.ndarray]:
        out = super()._logits(items, spans, x, deltas)
        c = self.cfg.final_softcap
        if c:  # gemma2: after the output LoRA, as llama.cpp does
            for lg in (lg for it, lg in zip(items, out) if not it.hidden):
                lg *= np.float32(1.0 / c)
                np.tanh(lg, out=lg)
                lg *= np.float32(c)
        return out
