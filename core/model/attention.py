"""Causal grouped-query attention over the KV cache: softmax(QKᵀ)V, two ways.

A prompt's queries go through :func:`sdpa` (in blocks, with the causal mask on each
block's diagonal square); decoding queries, one per sequence, through the compiled
kernel (:func:`decode_attention`, core/model/kernel_attn.py): one sequence's, or
several sequences' of one KV pool in one call (:class:`PooledDecode`). So do a few
new tokens of one sequence over a float16 cache (a draft being verified), which
numpy's products could only read widened whole, in every layer, at every step. Keys and
values are written and read through the cache objects of core/model/kv_cache.py;
nothing here owns their arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import quant
from .kv_cache import F32, KV_DTYPES, KVCache, KVPool, kernel_view

ATTN_BLOCK = 128  # queries per attention block during prefill
# decoding (decode_attention): chunks of positions per kernel thread, over all the
# sequences' key rows, and positions per chunk at least (SmolLM2's 3 kv heads of one
# sequence at 2048 positions run as 9 chunks of 683 on 2 threads)
ATTN_ITEMS_PER_THREAD = 4
ATTN_CHUNK_MIN = 64
# new tokens of one sequence over a float16 cache that take the compiled kernel, at
# most: numpy's products need the layer's keys and values widened first, which cost
# more than the kernel's per-token work up to ~12-16 tokens (a 1B's layer at 8000
# positions: 2 tokens 20.5 ms against 3.9, 9 tokens 25.5 against 14.4; at 2048
# positions 9 tokens 5.3 against 3.1). On a float32 cache numpy's products are the
# faster from ~5 tokens and about as fast below (9 tokens 9.3 against 11.9 ms), so
# those keep them.
ATTN_F16_QUERIES_MAX = 12


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


# what a KV cache holds: its arrays' dtypes, each with its -ctk/-ctv name
_STORED = {dtype: name for name, dtype in KV_DTYPES.items()}


def decode_attention(q, kc, vc, spans, softcap: float = 0.0, back=None) -> np.ndarray:
    """softmax(q kᵀ) v of one new query per sequence over its own positions, compiled
    (core/model/kernel_attn.py): q (n, KV, g, hd) float32 already scaled; query i reads
    kc/vc[slot, :, lo:hi] of (S, KV, cap, hd) arrays, float32 or float16 each (the KV
    cache's -ctk/-ctv), spans[i] = (slot, lo, hi); ``back`` (g,) ints: head j reads
    only up to hi - back[j] (default 0: all). Returns (n, KV, g, hd). Launched as the
    matrix kernels are (quant.launch); the kernel checks every span before it reads
    (raw memory): IndexError if one is out or leaves a head no position."""
    n, KV, g, hd = q.shape
    if (
        vc.shape != kc.shape
        or kc.shape[1] != KV
        or kc.shape[3] != hd
        or q.dtype != np.float32
        or kc.dtype not in _STORED
        or vc.dtype not in _STORED
        or not (q.flags.c_contiguous and kc.flags.c_contiguous and vc.flags.c_contiguous)
    ):
        raise ValueError(f"decode_attention: q {q.shape} does not fit keys {kc.shape}")
    kernel = quant.attention_kernel((_STORED[kc.dtype], _STORED[vc.dtype]))
    kc, vc = kernel_view(kc), kernel_view(vc)  # float16 as its bits
    spans = np.asarray(spans, dtype=np.int64).reshape(n, 3)  # (n, 3) slot, lo, hi
    back = _stops(1, g) if back is None else np.asarray(back, dtype=np.int64)  # (g,)
    if back.shape != (g,):
        raise ValueError(f"decode_attention: back {back.shape} is not one per head ({g})")
    out = np.empty((n, KV, g, hd), dtype=np.float32)  # (n, KV, g, hd)
    if n == 0:
        return out
    bad = quant.launch(
        kernel,
        q, kc, vc, spans, back, float(softcap),
        quant.kernel_threads(), ATTN_ITEMS_PER_THREAD, ATTN_CHUNK_MIN, out,
    )  # fmt: skip
    if bad:
        raise IndexError(f"decode_attention: span {spans[bad - 1]} is not in keys {kc.shape}")
    return out


@lru_cache(maxsize=64)
def _stops(n: int, g: int) -> np.ndarray:
    """(n*g,) how far short of the last position each head of n new tokens' g heads
    each stops: token t's n-1-t (built once per shape, not per layer and step; kept
    writeable, as numba compiles a read-only array as another type)."""
    return np.repeat(np.arange(n - 1, -1, -1, dtype=np.int64), g)  # (n*g,)


def widened(a: np.ndarray) -> np.ndarray:
    """Keys or values as float32 for numpy's products: a float16 cache's (-ctk/-ctv f16)
    widened, exactly, in one copy per layer and forward; float32 as is."""
    return a if a.dtype == np.float32 else a.astype(np.float32)


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
    f16 = cache.types != F32  # either of them float16 (-ctk/-ctv f16)
    if n == 1 or (f16 and not window and n <= ATTN_F16_QUERIES_MAX):
        # Decoding: one query over this sequence's keys, compiled (numpy's two thin
        # matmuls took longer than the token's products from ~1000 positions on); or a
        # few over a float16 cache as one query of n*g heads, token t's head gi as
        # head t*g + gi, seeing the keys up to its own position p0 + t
        kc, vc = cache.layer(li)  # (1, KV, cap, hd) each
        q4 = (q * scale).reshape(n, KV, g, hd).transpose(1, 0, 2, 3)  # (KV, n, g, hd)
        q4 = q4.reshape(1, KV, n * g, hd)  # (1, KV, n*g, hd), a copy unless n == 1
        back = _stops(n, g)  # (n*g,) token t's heads stop n-1-t short
        lo = max(0, p0 - window + 1) if window else 0  # (n == 1 with a window)
        o = decode_attention(q4, kc, vc, [0, lo, L], softcap, back)  # (1, KV, n*g, hd)
        return o.reshape(KV, n, g, hd).transpose(1, 0, 2, 3).reshape(n, n_heads * hd)
    if window or softcap:
        return _attend_window(keys, values, q, n, n_heads, scale, window or L, softcap)
    keys, values = widened(keys), widened(values)  # (KV, L, hd) float32 each
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

        kc = widened(keys[:, k0:Lb])  # (KV, Lb-k0, hd): only what the window reaches
        vc = widened(values[:, k0:Lb])
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

    @staticmethod
    def plan(items, spans) -> PooledDecode | None:
        idx = [i for i, it in enumerate(items) if len(it.tokens) == 1 and it.cache.pool is not None]
        pools = {id(items[i].cache.pool) for i in idx}
        if len(idx) < 2 or len(pools) != 1:
            return None
        return PooledDecode(
            items[idx[0]].cache.pool,
            frozenset(idx),
            [items[i].cache for i in idx],
            np.array([items[i].tokens[0] for i in idx]),
            np.array([spans[i][0] for i in idx]),
            np.array([items[i].cache.slot for i in idx]),
            np.array([items[i].cache.length for i in idx]),
        )

    def attend(
        self, li: int, q, k, v, n_heads: int, scale: float, window: int = 0, softcap: float = 0.0
    ) -> np.ndarray:
        """One new query (n, H, hd) for each of n decoding sequences, in one compiled
        call (decode_attention): each reads its own slot's keys up to its own
        position (and, with ``window``, none ``window`` or more before it)."""
        n, KV, hd = k.shape
        kc, vc = self.pool.update_and_fetch(li, self.caches, k, v, self.tokens)
        q4 = (q * scale).reshape(n, KV, n_heads // KV, hd)  # (n, KV, g, hd)
        o = decode_attention(q4, kc, vc, self._spans(window), softcap)  # (n, KV, g, hd)
        return o.reshape(n, n_heads * hd)  # (n, H*hd)

    def _spans(self, window: int) -> np.ndarray:
        """(n, 3) slot, first and end position each query reads: built once per forward
        and window (Gemma's layers take turns), not once per layer."""
        got = self.__dict__.setdefault("_spans_by_window", {})
        if window not in got:
            lo = np.maximum(self.pos - window + 1, 0) if window else np.zeros_like(self.pos)
            got[window] = np.stack([self.slots, lo, self.pos + 1], axis=1).astype(np.int64)
        return got[window]
