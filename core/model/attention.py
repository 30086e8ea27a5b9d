"""Causal grouped-query attention over the KV cache: one softmax(QKᵀ)V core.

Every path goes through :func:`sdpa`: a prompt's queries (in blocks, with the
causal mask on each block's diagonal square), one decoding query of one sequence,
and one query each of several decoding sequences of one KV pool in one batched
matmul (:class:`PooledDecode`). Keys and values are written and read through the
cache objects of core/model/kv_cache.py; nothing here owns their arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .kv_cache import KVCache, KVPool

ATTN_BLOCK = 128  # queries per attention block during prefill


def exp_normalized_inplace(x: np.ndarray) -> np.ndarray:
    """x <- exp(x - max(x)) along the last axis; returns the row sums (…, 1).
    Callers divide the (much smaller) attention output by the sums instead of
    normalizing x, which saves a full pass over the scores."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x.sum(axis=-1, keepdims=True)


def sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: Callable[[np.ndarray], None] | None = None,
    softcap: float = 0.0,
) -> np.ndarray:
    """softmax(q kᵀ + mask) v over the last two axes. q (…, m, hd) already scaled by
    1/sqrt(hd) (scaling q, m*hd numbers, is cheaper than scaling the scores, m*L);
    k, v (…, L, hd); ``mask`` edits the scores (…, m, L) in place. ``softcap`` c > 0
    (Gemma 2): scores become c*tanh(scores/c) before the mask. Returns (…, m, hd)."""
    s = q @ k.swapaxes(-1, -2)  # (…, m, L)
    if softcap:
        s *= np.float32(1.0 / softcap)
        np.tanh(s, out=s)
        s *= np.float32(softcap)
    if mask is not None:
        mask(s)
    z = exp_normalized_inplace(s)  # (…, m, 1)
    o = s @ v  # (…, m, hd)
    o /= z
    return o


def causal_mask(p0: int, n: int) -> np.ndarray | None:
    """Additive mask (n, p0+n): query i sits at position p0+i and sees keys 0..p0+i.
    Built once per forward and shared by all layers; None for a single query."""
    if n == 1:
        return None
    L = p0 + n
    return np.where(
        np.arange(L)[None, :] > (p0 + np.arange(n))[:, None], np.float32(-np.inf), np.float32(0.0)
    )  # (n, L)


def attend(
    li: int,
    cache: KVCache,
    tokens,
    q,
    k,
    v,
    mask: np.ndarray | None,
    n_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """Causal GQA attention of n new queries (n, H, hd) of one sequence over its cache,
    after appending the keys/values (n, KV, hd) of its n new ``tokens`` to it.
    ``window`` > 0: a sliding-window layer, where the query at position p sees only
    keys at p-window+1..p (llama.cpp's LLAMA_SWA_TYPE_STANDARD). ``softcap``: see sdpa."""
    n, KV, hd = k.shape
    g = n_heads // KV
    p0 = cache.length
    L = p0 + n
    keys, values = cache.update_and_fetch(li, k, v, tokens)  # (KV, L, hd) each
    if window or softcap:
        return _attend_window(keys, values, q, n, n_heads, scale, window or L, softcap)
    if n == 1:
        # Decoding: one query, no mask, no blocks. Half the numpy calls of the
        # general path, which matters when 8 streams run 30 layers per step.
        q3 = (q * scale).reshape(KV, g, hd)  # (KV, g, hd)
        o = sdpa(q3, keys, values)  # (KV, g, hd)
        return o.reshape(1, n_heads * hd)  # (1, H*hd)
    # Query head h reads kv head h // g, so group the g query heads per kv head.
    q4 = (q * scale).reshape(n, KV, g, hd).transpose(1, 2, 0, 3)  # (KV, g, n, hd)
    out = np.empty((KV, g, n, hd), dtype=np.float32)
    # Long prompts run in query blocks: a block only needs keys up to its last
    # position, which skips the masked upper triangle (~40% less work at n=512).
    for i0 in range(0, n, ATTN_BLOCK):
        i1 = min(n, i0 + ATTN_BLOCK)
        nb, Lb = i1 - i0, p0 + i1
        qb = q4[:, :, i0:i1].reshape(KV, g * nb, hd)  # (KV, g*nb, hd)

        def diagonal(s, i0=i0, i1=i1, nb=nb, Lb=Lb):
            # keys before the block are visible to all its queries: only the
            # block's own (nb, nb) diagonal square needs the causal mask
            d0 = p0 + i0
            s.reshape(KV, g, nb, Lb)[..., d0:] += mask[i0:i1, d0:Lb]  # (nb, nb) broadcast

        o = sdpa(qb, keys[:, :Lb], values[:, :Lb], diagonal if mask is not None else None)
        out[:, :, i0:i1] = o.reshape(KV, g, nb, hd)  # from (KV, g*nb, hd)
    return out.transpose(2, 0, 1, 3).reshape(n, n_heads * hd)  # (n, H*hd)


def window_mask(q0: int, q1: int, k0: int, k1: int, window: int) -> np.ndarray:
    """Additive mask (q1-q0, k1-k0) of queries at positions q0..q1-1 over keys at
    k0..k1-1: a key is seen when it is not in the future and less than ``window``
    positions back."""
    qp, kp = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
    seen = (kp <= qp) & (kp > qp - window)
    return np.where(seen, np.float32(0.0), np.float32(-np.inf))  # (q1-q0, k1-k0)


def _attend_window(
    keys: np.ndarray, values: np.ndarray, q, n: int, n_heads: int, scale, window, softcap=0.0
):
    """attend() for a sliding-window layer (or a soft-capped one, window = all keys) over
    one layer's keys/values (KV, L, hd), the n new queries last: each query block reads
    only the keys its window reaches (the cache keeps them all; the window is a view)."""
    KV, L, hd = keys.shape
    g = n_heads // KV
    p0 = L - n
    q4 = (q * scale).reshape(n, KV, g, hd).transpose(1, 2, 0, 3)  # (KV, g, n, hd)
    out = np.empty((KV, g, n, hd), dtype=np.float32)
    for i0 in range(0, n, ATTN_BLOCK):
        i1 = min(n, i0 + ATTN_BLOCK)
        nb, Lb = i1 - i0, p0 + i1
        k0 = max(0, p0 + i0 - window + 1)  # the first key the block's first query sees
        qb = q4[:, :, i0:i1].reshape(KV, g * nb, hd)  # (KV, g*nb, hd)
        m = window_mask(p0 + i0, p0 + i1, k0, Lb, window)  # (nb, Lb-k0)

        def masked(s, m=m, nb=nb, n_k=Lb - k0):
            s.reshape(KV, g, nb, n_k)[...] += m

        kc = keys[:, k0:Lb]  # (KV, Lb-k0, hd)
        vc = values[:, k0:Lb]
        out[:, :, i0:i1] = sdpa(qb, kc, vc, masked, softcap).reshape(KV, g, nb, hd)
    return out.transpose(2, 0, 1, 3).reshape(n, n_heads * hd)  # (n, H*hd)


@dataclass
class PooledDecode:
    """Which items of a forward decode one token each in slots of one KVPool."""

    pool: KVPool
    items: frozenset[int]  # item indices
    caches: list[KVCache]  # their caches, slots of ``pool``
    tokens: np.ndarray  # (n,) the token each one runs
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
            [items[i].cache for i in idx],
            np.array([items[i].tokens[0] for i in idx]),
            np.array([spans[i][0] for i in idx]),
            slots,
            pos,
            s0,
            s1,
            L,
            slots - s0,
            hidden,
        )

    def attend(
        self, li: int, q, k, v, n_heads: int, scale: float, window: int = 0, softcap: float = 0.0
    ) -> np.ndarray:
        """One new query (n, H, hd) for each of n decoding sequences, batched: the slots
        s0..s1 are attended in one matmul up to the longest length, and positions past
        each sequence's own length are masked (and, with ``window``, positions at or
        more than ``window`` before it)."""
        n, KV, hd = k.shape
        g = n_heads // KV
        kc, vc = self.pool.update_and_fetch(
            li, self.caches, k, v, self.tokens, self.s0, self.s1, self.L
        )  # (S', KV, L, hd) each
        q4 = np.zeros((self.s1 - self.s0, KV, g, hd), dtype=np.float32)  # (S', KV, g, hd)
        q4[self.at] = (q * scale).reshape(n, KV, g, hd)
        hidden = self._windowed(window) if window else self.hidden
        o = self._product(kc, vc, q4, hidden, softcap)[self.at]  # (n, KV, g, hd)
        if not np.isfinite(o).all():
            # Masked scores become exact zeros, but 0 x NaN is NaN: stale rows past a
            # slot's length holding NaN/inf (left by whatever failed in it before)
            # would poison a healthy sequence. Those rows are dead (a running sequence
            # overwrites them before it reads them), so zero them and attend again:
            # the result is then exactly a clean slot's. A sequence whose own
            # keys/values are non-finite stays non-finite, alone, and fails alone.
            for slot, pos in zip(self.slots, self.pos):
                self.pool.clear(li, slot, pos + 1, self.L)
            o = self._product(kc, vc, q4, hidden, softcap)[self.at]
        return o.reshape(n, n_heads * hd)  # (n, H*hd)

    def _windowed(self, window: int) -> np.ndarray:
        """``hidden`` plus the keys out of each slot's window, built once per forward."""
        got = self.__dict__.setdefault("_window_hidden", {})
        if window not in got:
            old = np.arange(self.L)[None, :] <= (self.pos - window)[:, None]  # (n, L)
            h = self.hidden.copy()
            h[self.at, 0, 0, :] |= old
            got[window] = h
        return got[window]

    @staticmethod
    def _product(kc, vc, q4: np.ndarray, hidden: np.ndarray, softcap=0.0) -> np.ndarray:
        """softmax(q Kᵀ + mask) V for the slots s0..s1 of one layer, keys/values (S', KV, L, hd)."""
        hide = lambda s: np.copyto(s, np.float32(-np.inf), where=hidden)  # (S',1,1,L)
        return sdpa(q4, kc, vc, hide, softcap)  # (S', KV, g, hd)
