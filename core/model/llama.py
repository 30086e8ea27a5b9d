"""The llama forward pass in numpy, over a batch of sequences.

Each sequence in a batch brings its own new tokens, its own start position, its
own KV cache and its own LoRA mix. The base matmuls run once over all tokens of
the batch (that is where the time goes); each sequence then adds its low-rank
deltas ``(x Aᵀ) Bᵀ`` on its own rows, so different mixes share one forward.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..lora.mix import AdapterStack, Delta, stack_adapters
from .config import ModelConfig
from .kv_cache import KVCache, KVPool
from .linear import SMALL_ROWS, Linear
from .weights import LayerWeights, Weights

# Fused projections that LoRA deltas attach to, in the order a block uses them.
TARGETS = ("wqkv", "wo", "w_gate_up", "w_down")
ATTN_BLOCK = 128  # queries per attention block during prefill
SILU_ROWS = 32  # rows per block of the SwiGLU passes (32 x 1536 floats: 196 KB)
STACKS_KEPT = 2  # adapter sets whose stacked LoRA weights stay built
CALIBRATE_LAYERS = 4  # layers whose matrices time the small-batch regimes at load


class MixWeights(Protocol):
    """What the forward pass needs from a mix (see core/lora/mix.py)."""

    layers: list[dict[str, Delta]]  # per layer: target -> low-rank delta
    embd: tuple[np.ndarray, np.ndarray] | None  # (A (vocab,R), B (dim,R)·scale)
    output: tuple[np.ndarray, np.ndarray] | None  # (A (R,d), B (vocab,R)·scale)


@dataclass
class BatchItem:
    tokens: np.ndarray  # (n,) int token ids to run
    cache: KVCache  # positions [cache.length, cache.length+n) get written
    mix: MixWeights | None = None  # None: base model only
    all_logits: bool = False  # False: logits of the last token only


# ---- primitives ------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x: (T, d), w: (d,) -> (T, d)
    d = x.shape[1]
    if x.shape[0] == 1:
        # one decoding stream: a dot and a Python scalar, 3 numpy calls instead of 7
        # (61 norms per token, each dominated by call overhead at this size)
        r = 1.0 / math.sqrt(float(x[0] @ x[0]) / d + eps)
        return x * (w * np.float32(r))  # (1, d)
    ms = np.einsum("td,td->t", x, x)[:, None] / d  # (T, 1) mean square
    return x * (1.0 / np.sqrt(ms + eps)) * w


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # SwiGLU: silu(g) * u, with silu(g) = h * (1 + tanh(h)) for h = g/2. tanh never
    # overflows (unlike 1/(1+exp(-g))), and in-place steps avoid 4 temporaries.
    # Long prompts go through in row blocks so that the chain of passes stays in L2
    # (measured: 90 -> 64 ms per 512-token prefill).
    T, f = gate.shape
    out = np.empty((T, f), dtype=np.float32)  # (T, f)
    h = np.empty((min(T, SILU_ROWS), f), dtype=np.float32)
    for r in range(0, T, SILU_ROWS):
        o, hb = out[r : r + SILU_ROWS], h[: min(SILU_ROWS, T - r)]
        np.multiply(gate[r : r + SILU_ROWS], 0.5, out=hb)
        np.tanh(hb, out=o)
        o += 1.0
        o *= hb
        o *= up[r : r + SILU_ROWS]
    return out


def rope(x: np.ndarray, cis: np.ndarray) -> np.ndarray:
    # x: (T, H, hd) float32 with a contiguous last axis; cis: (T, 1, hd/2) complex64.
    # llama's "normal" rope rotates adjacent pairs (x[2i], x[2i+1]) (GGUF stores Q/K
    # rows permuted for exactly that), which is x[2i] + i*x[2i+1] times e^(i*theta):
    # one complex multiply, 5x faster than strided even/odd arithmetic.
    return (x.view(np.complex64) * cis).view(np.float32)  # (T, H, hd)


def exp_normalized_inplace(x: np.ndarray) -> np.ndarray:
    """x <- exp(x - max(x)) along the last axis; returns the row sums (…, 1).
    Callers divide the (much smaller) attention output by the sums instead of
    normalizing x, which saves a full pass over the scores."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x.sum(axis=-1, keepdims=True)


def causal_mask(p0: int, n: int) -> np.ndarray | None:
    """Additive mask (n, p0+n): query i sits at position p0+i and sees keys 0..p0+i.
    Built once per forward and shared by all layers; None for a single query."""
    if n == 1:
        return None
    L = p0 + n
    return np.where(
        np.arange(L)[None, :] > (p0 + np.arange(n))[:, None], np.float32(-np.inf), np.float32(0.0)
    )  # (n, L)


def lora_delta(x: np.ndarray, ab: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    # x: (n, in); A: (R, in); B: (out, R) with the scale folded in -> (n, out)
    a, b = ab
    return (x @ a.T) @ b.T


# ---- the model ---------------------------------------------------------------


class RopeTable:
    """e^(i*theta) per absolute position, grown on demand (never per token)."""

    def __init__(self, cfg: ModelConfig, freq_factors: np.ndarray | None):
        half = cfg.rope_dim // 2
        inv = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)  # (half,)
        if freq_factors is not None:
            inv = inv / np.asarray(freq_factors, dtype=np.float64)
        self.inv_freq = inv / cfg.rope_scale
        self.cis = np.zeros((0, half), dtype=np.complex64)

    def get(self, positions: np.ndarray) -> np.ndarray:
        need = int(positions.max()) + 1
        if need > len(self.cis):
            n = max(need, 2 * len(self.cis), 1024)
            ang = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]  # (n, half)
            self.cis = np.exp(1j * ang).astype(np.complex64)
        return self.cis[positions][:, None, :]  # (T, 1, half)


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        threads: int | None = None,
        calibrate_step: Callable[[float], None] | None = None,
    ):
        self.cfg = cfg
        self.w = weights
        self.lin = Linear(threads)  # every x @ W.T goes through here
        # pick the fastest small-batch products on this CPU: passes over the first
        # layers' matrices (~60 MB for SmolLM2, more than an L3) in each regime;
        # calibrate_step(fraction) reports progress and may raise to cancel the load
        mats = [m for lw in weights.layers[:CALIBRATE_LAYERS] for m in lw.projections]
        try:
            self.lin.calibrate(mats, step=calibrate_step)
        except BaseException:
            self.lin.close()  # its helper threads would outlive a cancelled load
            raise
        self._stacks: OrderedDict[tuple, AdapterStack] = OrderedDict()
        self.rope = RopeTable(cfg, weights.rope_freqs)
        self.scale = float(
            1.0 / np.sqrt(cfg.head_dim)
        )  # a Python float: an np.float64 would upcast q to float64

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.cfg, capacity)

    def new_pool(self, n_slots: int, capacity: int) -> KVPool:
        return KVPool(self.cfg, n_slots, capacity)

    def __call__(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        return self.forward(items)

    def forward(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """Run new tokens of every item; return logits per item:
        (n, vocab) when ``all_logits`` else (1, vocab) for its last token."""
        spans, start = [], 0
        for it in items:
            n = len(it.tokens)
            it.cache.check_room(n)
            it.cache.written = max(it.cache.written, it.cache.length + n)
            spans.append((start, start + n))
            start += n
        tokens = np.concatenate([np.asarray(it.tokens, dtype=np.int64) for it in items])  # (T,)
        positions = np.concatenate(
            [np.arange(it.cache.length, it.cache.length + len(it.tokens)) for it in items]
        )  # (T,)
        cis = self.rope.get(positions)
        # the regime calibrated for this many rows (blocked products on our threads
        # hold BLAS at one thread for the whole forward)
        with self.lin.small_batch(self.lin.regime(len(tokens))):
            return self._forward(items, spans, tokens, cis)

    def _forward(self, items, spans, tokens, cis) -> list[np.ndarray]:
        cfg = self.cfg

        x = self.w.tok_embd[tokens]  # (T, d) copy
        for it, (s, e) in zip(items, spans):
            if it.mix is not None and it.mix.embd is not None:
                a, b = it.mix.embd  # (vocab, R), (d, R)
                x[s:e] += a[tokens[s:e]] @ b.T  # (n, d)

        lora = LoraDeltas(_mix_groups(items, spans), len(tokens), self._stacks, self.cfg)
        pooled = PooledDecode.plan(items, spans)
        masks = [causal_mask(it.cache.length, len(it.tokens)) for it in items]
        for li, lw in enumerate(self.w.layers):
            x = self._block(li, lw, x, items, spans, lora, cis, masks, pooled)

        for it in items:
            it.cache.tokens.extend(int(t) for t in it.tokens)

        rows = [
            np.arange(s, e) if it.all_logits else np.array([e - 1])
            for it, (s, e) in zip(items, spans)
        ]
        sel = np.concatenate(rows)
        h = rms_norm(x[sel], self.w.output_norm, cfg.norm_eps)  # (R, d)
        logits = self.lin(h, self.w.output)  # (R, vocab)
        out, k = [], 0
        for it, r in zip(items, rows):
            if it.mix is not None and it.mix.output is not None:
                logits[k : k + len(r)] += lora_delta(h[k : k + len(r)], it.mix.output)
            out.append(logits[k : k + len(r)])
            k += len(r)
        return out

    def _block(self, li: int, lw: LayerWeights, x, items, spans, lora, cis, masks, pooled):
        cfg = self.cfg
        T = x.shape[0]
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        h = rms_norm(x, lw.attn_norm, cfg.norm_eps)  # (T, d)
        qkv = self._linear(h, lw.wqkv, lora, li, "wqkv")  # (T, q+2kv)
        qk = rope(qkv[:, : cfg.q_dim + cfg.kv_dim].reshape(T, H + KV, hd), cis)  # (T, H+KV, hd)
        q, k = qk[:, :H], qk[:, H:]  # (T, H, hd), (T, KV, hd)
        v = qkv[:, cfg.q_dim + cfg.kv_dim :].reshape(T, KV, hd)  # (T, KV, hd)

        attn = np.empty((T, cfg.q_dim), dtype=np.float32)  # (T, H*hd)
        if pooled is not None:
            r = pooled.rows
            attn[r] = self._attend_pooled(li, pooled, q[r], k[r], v[r])
        for i, (it, (s, e), mask) in enumerate(zip(items, spans, masks)):
            if pooled is None or i not in pooled.items:
                attn[s:e] = self._attend(li, it.cache, q[s:e], k[s:e], v[s:e], mask)

        o = self._linear(attn, lw.wo, lora, li, "wo")  # (T, d)
        x = x + o

        h = rms_norm(x, lw.ffn_norm, cfg.norm_eps)  # (T, d)
        gu = self._linear(h, lw.w_gate_up, lora, li, "w_gate_up")  # (T, 2f)
        act = silu_mul(gu[:, : cfg.ffn_dim], gu[:, cfg.ffn_dim :])  # (T, f)
        d = self._linear(act, lw.w_down, lora, li, "w_down")  # (T, d)
        return x + d

    def _linear(self, x, w, lora: LoraDeltas, li: int, target: str) -> np.ndarray:
        """x @ W.T plus every row's LoRA delta. With several mixes in a small batch
        under the blocked products, the delta is computed on this thread while the
        helper threads run their share of the base product (core/model/linear.py sizes
        the shares to match); under gemv or gemm it is added in place afterwards."""
        if lora.stack is None:
            y = self.lin(x, w)
            lora.add(y, x, li, target)
            return y
        if target not in lora.stack.layers[li]:
            return self.lin(x, w)
        if self.lin.regime(x.shape[0]) != "blocked":
            # OpenBLAS's own threads run the product: nothing to overlap, add in place
            y = self.lin(x, w)
            lora.stacked_delta(x, li, target, into=y)
            return y
        box = []
        y = self.lin(x, w, side=lambda: box.append(lora.stacked_delta(x, li, target)))
        y += box[0]
        return y

    def _attend_pooled(self, li: int, p: PooledDecode, q, k, v) -> np.ndarray:
        """One new query for each of n decoding sequences of one KV pool, batched:
        the slots s0..s1 are attended in one matmul up to the longest length, and
        positions past each sequence's own length are masked."""
        cfg = self.cfg
        n = q.shape[0]
        KV, hd = cfg.n_kv_heads, cfg.head_dim
        g = cfg.n_heads // KV
        kc, vc = p.pool.k[li], p.pool.v[li]  # (S, KV, cap, hd)
        kc[p.slots, :, p.pos] = k  # (n, KV, hd)
        vc[p.slots, :, p.pos] = v
        q4 = np.zeros((p.s1 - p.s0, KV, g, hd), dtype=np.float32)  # (S', KV, g, hd)
        q4[p.at] = (q * self.scale).reshape(n, KV, g, hd)
        o = _pooled_product(p, q4, kc, vc)[p.at]  # (n, KV, g, hd)
        if not np.isfinite(o).all():
            # Masked scores become exact zeros, but 0 x NaN is NaN: stale rows past a
            # slot's length holding NaN/inf (left by whatever failed in it before)
            # would poison a healthy sequence. Those rows are dead (a running sequence
            # overwrites them before it reads them), so zero them and attend again:
            # the result is then exactly a clean slot's. A sequence whose own
            # keys/values are non-finite stays non-finite, alone, and fails alone.
            for slot, pos in zip(p.slots, p.pos):
                kc[slot, :, pos + 1 : p.L] = 0.0  # (KV, L-pos-1, hd)
                vc[slot, :, pos + 1 : p.L] = 0.0
            o = _pooled_product(p, q4, kc, vc)[p.at]
        return o.reshape(n, cfg.q_dim)  # (n, H*hd)

    def _attend(self, li: int, cache: KVCache, q, k, v, mask) -> np.ndarray:
        """Causal GQA attention of n new queries over this sequence's cache."""
        cfg = self.cfg
        n = q.shape[0]
        KV, hd = cfg.n_kv_heads, cfg.head_dim
        g = cfg.n_heads // KV
        p0 = cache.length
        L = p0 + n
        if n == 1:
            # Decoding: one query, no mask, no blocks. Half the numpy calls of the
            # general path, which matters when 8 streams run 30 layers per step.
            cache.k[li, :, p0] = k[0]  # (KV, hd)
            cache.v[li, :, p0] = v[0]
            q3 = (q * self.scale).reshape(KV, g, hd)  # (KV, g, hd)
            s = q3 @ cache.k[li, :, :L].transpose(0, 2, 1)  # (KV, g, L)
            z = exp_normalized_inplace(s)  # (KV, g, 1)
            o = s @ cache.v[li, :, :L]  # (KV, g, hd)
            o /= z
            return o.reshape(1, cfg.q_dim)  # (1, H*hd)
        cache.k[li, :, p0:L] = k.transpose(1, 0, 2)  # (KV, n, hd)
        cache.v[li, :, p0:L] = v.transpose(1, 0, 2)
        # Query head h reads kv head h // g, so group the g query heads per kv head.
        # Scaling q (n*H*hd) is cheaper than scaling the scores (n*H*L).
        q4 = (q * self.scale).reshape(n, KV, g, hd).transpose(1, 2, 0, 3)  # (KV, g, n, hd)
        out = np.empty((KV, g, n, hd), dtype=np.float32)
        # Long prompts run in query blocks: a block only needs keys up to its last
        # position, which skips the masked upper triangle (~40% less work at n=512).
        for i0 in range(0, n, ATTN_BLOCK):
            i1 = min(n, i0 + ATTN_BLOCK)
            nb, Lb = i1 - i0, p0 + i1
            qb = q4[:, :, i0:i1].reshape(KV, g * nb, hd)  # (KV, g*nb, hd)
            s = qb @ cache.k[li, :, :Lb].transpose(0, 2, 1)  # (KV, g*nb, Lb)
            if mask is not None:
                # keys before the block are visible to all its queries: only the
                # block's own (nb, nb) diagonal square needs the causal mask
                d0 = p0 + i0
                s.reshape(KV, g, nb, Lb)[..., d0:] += mask[i0:i1, d0:Lb]  # (nb, nb) broadcast
            z = exp_normalized_inplace(s)  # (KV, g*nb, 1)
            o = s @ cache.v[li, :, :Lb]  # (KV, g*nb, hd)
            o /= z
            out[:, :, i0:i1] = o.reshape(KV, g, nb, hd)
        return out.transpose(2, 0, 1, 3).reshape(n, cfg.q_dim)  # (n, H*hd)


@dataclass
class PooledDecode:
    """Which items of a forward decode one token each in slots of one KVPool."""

    pool: KVPool
    items: frozenset[int]  # item indices
    rows: np.ndarray  # (n,) their rows in the batch
    slots: np.ndarray  # (n,) their pool slots
    pos: np.ndarray  # (n,) the position each one writes
    s0: int  # slots s0..s1 are attended together
    s1: int
    L: int  # keys attended: 0..L-1 (the longest sequence)
    at: np.ndarray  # (n,) slot - s0
    hidden: np.ndarray  # (s1-s0, 1, 1, L) True where a key lies past a slot's length

    @staticmethod
    def plan(items, spans) -> PooledDecode | None:
        idx = [i for i, it in enumerate(items) if len(it.tokens) == 1 and it.cache.pool is not None]
        pools = {id(items[i].cache.pool) for i in idx}
        if len(idx) < 2 or len(pools) != 1:
            return None
        slots = np.array([items[i].cache.slot for i in idx])
        pos = np.array([items[i].cache.length for i in idx])
        s0, s1, L = int(slots.min()), int(slots.max()) + 1, int(pos.max()) + 1
        # slots in range but not in this batch keep nothing hidden: their query is 0,
        # their result is dropped, and an all-hidden row would give 0/0
        hidden = np.zeros((s1 - s0, 1, 1, L), dtype=bool)
        hidden[slots - s0, 0, 0, :] = np.arange(L)[None, :] > pos[:, None]
        return PooledDecode(
            items[idx[0]].cache.pool,
            frozenset(idx),
            np.array([spans[i][0] for i in idx]),
            slots,
            pos,
            s0,
            s1,
            L,
            slots - s0,
            hidden,
        )


def _pooled_product(p: PooledDecode, q4: np.ndarray, kc: np.ndarray, vc: np.ndarray):
    """softmax(q Kᵀ + mask) V for the slots s0..s1 of one layer's pool arrays."""
    s = q4 @ kc[p.s0 : p.s1, :, : p.L].transpose(0, 1, 3, 2)  # (S', KV, g, L)
    np.copyto(s, np.float32(-np.inf), where=p.hidden)  # (S', 1, 1, L) mask
    z = exp_normalized_inplace(s)  # (S', KV, g, 1)
    o = s @ vc[p.s0 : p.s1, :, : p.L]  # (S', KV, g, hd)
    o /= z
    return o  # (S', KV, g, hd)


def _mix_groups(items, spans) -> list[tuple[int, int, MixWeights]]:
    """Merge adjacent items that share a mix, so their deltas run as one matmul."""
    groups: list[tuple[int, int, MixWeights]] = []
    for it, (s, e) in zip(items, spans):
        if it.mix is None:
            continue
        if groups and groups[-1][2] is it.mix and groups[-1][1] == s:
            groups[-1] = (groups[-1][0], e, it.mix)
        else:
            groups.append((s, e, it.mix))
    return groups


class LoraDeltas:
    """The LoRA work of one forward, for every sequence under its own mix.

    One mix in the batch, or many rows (prefill): ``add`` puts ``(x Aᵀ) Bᵀ`` per
    mix on its rows, with the mix's scales folded into B. A few rows under several
    mixes (decoding streams): ``stacked_delta`` uses an AdapterStack of the batch's distinct adapters (built
    once per adapter set, kept while it lasts) and a per-row scale matrix, so each
    target costs two small matmuls however many mixes run, and each adapter's
    weights are read once per step."""

    def __init__(self, groups, n_rows: int, stacks: OrderedDict[tuple, AdapterStack], cfg):
        self.groups = groups
        self.stack = None
        if (
            len(groups) > 1
            and n_rows <= SMALL_ROWS
            and not any(mw.embd is not None or mw.output is not None for _, _, mw in groups)
        ):
            ads = {id(ad): ad for _, _, mw in groups for ad, _ in mw.sources}
            key = tuple(sorted(ads))
            st = stacks.get(key)
            if st is None:
                st = stacks[key] = stack_adapters(cfg, (ads[k] for k in key))
                while len(stacks) > STACKS_KEPT:
                    stacks.popitem(last=False)
            stacks.move_to_end(key)
            self.stack = st
            index = {id(ad): i for i, ad in enumerate(st.adapters)}
            # scale[row, adapter]: the user's scale of that adapter in the row's mix
            self.scale = np.zeros((n_rows, len(st.adapters)), dtype=np.float32)
            for s, e, mw in groups:
                for ad, sc in mw.sources:
                    self.scale[s:e, index[id(ad)]] += sc
            self._spread: dict[tuple, np.ndarray] = {}

    def add(self, y: np.ndarray, x: np.ndarray, li: int, target: str) -> None:
        """Without a stack: each mix's delta onto its own rows of y, in place."""
        for s, e, mix in self.groups:
            delta = mix.layers[li].get(target)
            if delta is not None:
                delta.apply(y[s:e], x[s:e])

    def stacked_delta(
        self, x: np.ndarray, li: int, target: str, into: np.ndarray | None = None
    ) -> np.ndarray:
        """Every row's delta for this target under its own mix, from the adapter stack:
        added to ``into`` in place when given (and returned), else a new array."""
        at, parts, segs, n_out = self.stack.layers[li][target]  # (in, ΣR), dense Bᵀ blocks
        sc = self._spread.get(segs)
        if sc is None:
            sc = self._spread[segs] = np.repeat(
                self.scale[:, [i for i, _, _ in segs]], [c1 - c0 for _, c0, c1 in segs], axis=1
            )  # (T, ΣR)
        u = x @ at  # (T, ΣR)
        u *= sc
        if into is not None:
            for r0, r1, c0, c1, bt in parts:
                into[:, r0:r1] += u[:, c0:c1] @ bt  # (T, rows)
            return into
        d = np.zeros((x.shape[0], n_out), dtype=np.float32)  # (T, out)
        for r0, r1, c0, c1, bt in parts:
            d[:, r0:r1] = u[:, c0:c1] @ bt  # (T, rows)
        return d
