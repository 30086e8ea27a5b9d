"""The llama forward pass in numpy, over a batch of sequences (also Qwen2's and Qwen3's:
the same block plus Q/K/V biases (qwen2) or per-head Q/K norms (qwen3), and NeoX rope,
all read from the layout and the config).

Each sequence in a batch brings its own new tokens, its own start position and its
own KV cache. The base matmuls run once over all tokens of the batch (that is where
the time goes). Whatever adds to the products (each sequence's LoRA mix on its own
rows, core/lora/runtime.py) comes in as one ``Deltas`` object built by the caller:
the model knows no LoRA policy (core/model/deltas.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..paths import cache_dir
from . import layout, quant
from .attention import PooledDecode, attend, causal_mask
from .config import ModelConfig
from .deltas import NO_DELTAS, Deltas, batch_spans
from .kv_cache import F32, KVCache, KVPool, KVTypes
from .linear import STEP_ROWS, Linear, calibration_matrices, rows_of
from .primitives import RopeTable, rms_norm, rms_norm_heads, rope, rope_neox, silu_mul
from .weights import LayerWeights, Weights


@dataclass
class BatchItem:
    tokens: np.ndarray  # (n,) int token ids to run
    cache: KVCache  # positions [cache.length, cache.length+n) get written
    all_logits: bool = False  # False: logits of the last token only
    # True: instead of logits, every token's final hidden state after the output norm
    # (n, d): what llama.cpp pools into an embedding (t_embd)
    hidden: bool = False


# ---- the model ---------------------------------------------------------------

# tokens each sequence of a calibration step has seen: a short chat's worth
CALIBRATION_CTX = 64
# weights a calibration step passes through (whole layers, at least one): with SmolLM2's
# first 4 layers (54 MB) gemm and blocked steps came out apart on 5 loads of 6 on a
# 2-core VM, with 19 layers (256 MB) on every one, at 1.5 s rather than 0.9 s a load
CALIBRATION_STEP_BYTES = 128 << 20


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        threads: int | None = None,
        kv_types: KVTypes = F32,
    ):
        self.cfg = cfg
        self.w = weights
        self.kv_types = kv_types  # how its KV caches store keys and values (-ctk/-ctv)
        # every x @ W.T goes through here; small batches in the regime per row count
        # that calibrate() picks for this CPU ("gemm" for all until then)
        self.lin = Linear(threads, kernels=weights.quantized)
        # the compiled kernels (the matrices', decoding attention's) run on as many
        # threads as BLAS; beside float32 products, on this thread alone: their idle
        # workers spin after each kernel, and BLAS's threads (or Linear's helpers) then
        # wait for a core (SmolLM2 decoded at 330 ms a token instead of 24)
        quant.set_threads(self.lin.threads if weights.quantized else 1)
        self.rope = RopeTable(cfg, weights.rope_freqs)
        # Q/K in HF order rotate halves (qwen2, gemma3); llama's permuted rows, pairs
        self.rope_qk = rope_neox if cfg.rope_neox else rope
        # where the fused products' parts start (core/model/layout.py); Q and K are
        # adjacent, so rope turns both in one call
        # (Q|K|V and gate|up in that order whether the file stores them apart or fused)
        assert layout.out_rows(cfg, "wqkv") == cfg.q_dim + 2 * cfg.kv_dim
        qk = cfg.q_dim + cfg.kv_dim
        self.qk_rows, self.v_rows = slice(0, qk), slice(qk, qk + cfg.kv_dim)
        self.gate_rows, self.up_rows = slice(0, cfg.ffn_dim), slice(cfg.ffn_dim, 2 * cfg.ffn_dim)
        self.scale = cfg.scale  # a Python float: an np.float64 would upcast q to float64

    def calibrate(self, progress: Callable[[float], None] | None = None) -> None:
        """Pick the fastest small-batch products on this CPU (core/model/linear.py):
        passes over the first layers' matrices (CALIBRATE_BYTES, more than an L3,
        whatever the model size) for 2-4 rows, whole decode steps through those
        layers for 8. A choice stored for this machine and these shapes skips the
        timing. ``progress(fraction)`` reports and may raise to cancel the load (the
        helper threads are then closed: they would outlive a cancelled load)."""
        if self.w.quantized:
            return  # the products run on the compiled kernels whatever the row count
        mats = calibration_matrices([lw.projections for lw in self.w.layers])
        try:
            forward = self.calibration_step()
        except (MemoryError, OSError):
            # no room even for its small KV pool: time the products alone; the
            # engine's own KV reservation, next, says what memory is missing
            forward = None
        try:
            self.lin.calibrate(
                mats, step=progress, store=cache_dir() / "calibration.json", forward=forward
            )
        except BaseException:
            self.lin.close()
            raise

    def calibration_step(
        self, rows: int = STEP_ROWS, ctx: int = CALIBRATION_CTX
    ) -> Callable[[], None]:
        """One decode step of ``rows`` sequences ``ctx`` tokens in, pooled as the
        scheduler's are, through this model's first layers (whole layers within
        CALIBRATION_STEP_BYTES, at least one) and no output matrix (its product is as in
        the products' passes): what Linear.calibrate times for STEP_ROWS. Each call
        leaves the sequences where they were. The KV is zeros: attention costs the
        same whatever the values."""
        per_layer = [sum(m.nbytes for m in lw.projections) for lw in self.w.layers]
        k = max(1, int(np.searchsorted(np.cumsum(per_layer), CALIBRATION_STEP_BYTES, side="right")))
        probe = copy.copy(self)  # the same Linear, rope and adapters; fewer layers
        probe.w = replace(self.w, layers=self.w.layers[:k])
        # a pool of its own, built directly: phi3's new_pool re-picks the model's rope
        pool = KVPool(replace(self.cfg, n_layers=k), rows, ctx + 1, self.kv_types)
        caches = [pool.acquire() for _ in range(rows)]
        zeros = np.zeros((ctx, self.cfg.n_kv_heads, self.cfg.head_dim), dtype=np.float32)
        for c in caches:  # ctx tokens of history: the pool's rows are zeros already
            for li in range(k):
                c.update_and_fetch(li, zeros, zeros, [0] * ctx)
        tokens = [np.array([i + 1]) for i in range(rows)]  # (1,) each

        def run() -> None:
            probe.forward([BatchItem(t, c, hidden=True) for t, c in zip(tokens, caches)])
            for c in caches:
                c.trim(1)

        return run

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.cfg, capacity, types=self.kv_types)

    def new_pool(self, n_slots: int, capacity: int) -> KVPool:
        return KVPool(self.cfg, n_slots, capacity, self.kv_types)

    def __call__(self, items: Sequence[BatchItem], deltas: Deltas = NO_DELTAS) -> list[np.ndarray]:
        return self.forward(items, deltas)

    @staticmethod
    def pack(items: Sequence[BatchItem]) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """Check each item's cache has room for its new tokens (ContextOverflow before
        anything is written) and lay the batch out as one: (spans: item i's rows [s, e),
        tokens (T,), positions (T,) in its own sequence)."""
        for it in items:
            it.cache.check_room(len(it.tokens))
        spans = batch_spans([len(it.tokens) for it in items])
        tokens = np.concatenate([np.asarray(it.tokens, dtype=np.int64) for it in items])  # (T,)
        positions = np.concatenate(
            [np.arange(it.cache.length, it.cache.length + len(it.tokens)) for it in items]
        )  # (T,)
        return spans, tokens, positions

    def forward(self, items: Sequence[BatchItem], deltas: Deltas = NO_DELTAS) -> list[np.ndarray]:
        """Run new tokens of every item; return logits per item:
        (n, vocab) when ``all_logits`` else (1, vocab) for its last token. ``deltas``
        adds to the products (every row's LoRA delta under its own sequence's mix,
        built by the caller for this batch's layout, ``batch_spans``)."""
        spans, tokens, positions = self.pack(items)
        cis = self.rope_cis(positions)
        # BLAS at one thread for the whole forward while our threads do the products
        # (the blocked regime, the compiled kernels' small batches)
        with self.lin.forward_context(len(tokens)):
            x = self.embed(tokens, deltas)  # (T, d)
            pooled = PooledDecode.plan(items, spans)
            masks = [causal_mask(it.cache.length, len(it.tokens)) for it in items]
            for li, lw in enumerate(self.w.layers):
                x = self._block(li, lw, x, items, spans, deltas, cis, masks, pooled)  # (T, d)
                deltas.layer_out(x, li)  # every architecture's block output: one call
            return self._logits(items, spans, x, deltas)

    def rope_cis(self, positions: np.ndarray):
        """The rotations of these positions (T,), as the blocks take them."""
        return self.rope.get(positions)  # (T, 1, hd/2)

    def embed(self, tokens: np.ndarray, deltas: Deltas) -> np.ndarray:
        """The embedding rows of ``tokens`` (T,) with their deltas, (T, d)."""
        x = rows_of(self.w.tok_embd, tokens)  # (T, d) copy
        deltas.embed(x, tokens)
        return x

    def _logits(self, items, spans, x, deltas: Deltas) -> list[np.ndarray]:
        """Final norm and output matrix on the rows each item wants logits for; an
        item with ``hidden`` gets its normed rows themselves (no output matrix)."""
        cfg = self.cfg
        rows = [
            np.arange(s, e) if it.all_logits or it.hidden else np.array([e - 1])
            for it, (s, e) in zip(items, spans)
        ]
        sel = np.concatenate(rows)
        h = rms_norm(x[sel], self.w.output_norm, cfg.norm_eps)  # (R, d)
        starts = np.cumsum([0] + [len(r) for r in rows])  # (B+1,) item i: h[starts[i]:starts[i+1]]
        if all(it.hidden for it in items):  # an embedding batch: no vocab-sized product
            return [h[a:b] for a, b in zip(starts[:-1], starts[1:])]
        logits = self.lin(h, self.w.output)  # (R, vocab)
        deltas.logits(logits, h, [len(r) for r in rows])
        return [
            h[a:b] if it.hidden else logits[a:b] for it, a, b in zip(items, starts[:-1], starts[1:])
        ]

    def _block(self, li: int, lw: LayerWeights, x, items, spans, deltas, cis, masks, pooled):
        cfg = self.cfg
        T = x.shape[0]
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)  # (T, d)
        qkv = deltas.project(self.lin, h, lw.wqkv, li, "wqkv")  # (T, q+2kv)
        if lw.wqkv_bias is not None:
            qkv += lw.wqkv_bias  # (q+2kv,) qwen2
        qk = qkv[:, self.qk_rows].reshape(T, H + KV, hd)  # (T, H+KV, hd)
        if lw.attn_q_norm is not None:  # qwen3: per-head norms before rope
            qn = rms_norm_heads(qk[:, :H], lw.attn_q_norm, cfg.norm_eps)  # (T, H, hd)
            kn = rms_norm_heads(qk[:, H:], lw.attn_k_norm, cfg.norm_eps)  # (T, KV, hd)
            qk = np.concatenate([qn, kn], axis=1)  # (T, H+KV, hd)
        qk = self.rope_qk(qk, cis)  # (T, H+KV, hd)
        q, k = qk[:, :H], qk[:, H:]  # (T, H, hd), (T, KV, hd)
        v = qkv[:, self.v_rows].reshape(T, KV, hd)  # (T, KV, hd)

        attn = np.empty((T, cfg.q_dim), dtype=np.float32)  # (T, H*hd)
        if pooled is not None:
            r = pooled.rows
            attn[r] = pooled.attend(li, q[r], k[r], v[r], H, self.scale)
        for i, (it, (s, e), mask) in enumerate(zip(items, spans, masks)):
            if pooled is None or i not in pooled.items:
                attn[s:e] = attend(
                    li, it.cache, it.tokens, q[s:e], k[s:e], v[s:e], mask, H, self.scale
                )

        o = deltas.project(self.lin, attn, lw.wo, li, "wo")  # (T, d)
        x = x + o

        h = rms_norm(x, lw.ffn_norm, cfg.norm_eps)  # (T, d)
        gu = deltas.project(self.lin, h, lw.w_gate_up, li, "w_gate_up")  # (T, 2f)
        act = silu_mul(gu[:, self.gate_rows], gu[:, self.up_rows])  # (T, f)
        d = deltas.project(self.lin, act, lw.w_down, li, "w_down")  # (T, d)
        return x + d
