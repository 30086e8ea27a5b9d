"""The Phi-3 forward pass: llama's block on weights the file stores fused.

As llama.cpp builds it (src/models/phi3.cpp): ``attn_qkv`` is Q|K|V in one tensor and
``ffn_up`` is gate|up in one (the layout table declares each as one part covering all
rows, so the fused products are the file's own matrices), NeoX rope, SwiGLU. With
LongRoPE (Phi-3-mini-128k, Phi-3.5-mini) the file holds ``rope_factors_short`` and
``rope_factors_long``: llama.cpp divides the frequencies by the short factors while
the context per sequence fits the original one (rope.scaling.original_context_length)
and by the long ones past it, and scales cos/sin by rope.scaling.attn_factor.
"""

from __future__ import annotations

from .kv_cache import F32, KVPool
from .llama import LlamaModel
from .primitives import RopeTable


class Phi3Model(LlamaModel):
    def __init__(self, cfg, weights, threads=None, kv_types=F32):
        super().__init__(cfg, weights, threads=threads, kv_types=kv_types)
        self.rope = self.rope_for(cfg.ctx_len if not cfg.rope_ctx_orig else cfg.rope_ctx_orig)

    def rope_for(self, n_ctx: int) -> RopeTable:
        """The rope of a context of n_ctx positions per sequence (llama.cpp's
        get_rope_factors: long factors when n_ctx_per_seq > the original context)."""
        cfg, w = self.cfg, self.w
        if w.rope_freqs is not None:
            factors = w.rope_freqs
        elif w.rope_long is not None and n_ctx > (cfg.rope_ctx_orig or cfg.ctx_len):
            factors = w.rope_long
        else:
            factors = w.rope_short
        return RopeTable(cfg, factors, mscale=cfg.rope_attn_factor)

    def new_pool(self, n_slots: int, capacity: int) -> KVPool:
        # the engine's pool says how long a sequence may grow: pick the factors for it
        self.rope = self.rope_for(capacity)
        return super().new_pool(n_slots, capacity)
