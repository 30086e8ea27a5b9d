"""Decoding attention, compiled: a query per sequence over its own keys and values, or a
few queries of one sequence (speculative decoding's drafts) each over its own prefix.

numpy's decode attention (core/model/attention.py's sdpa on (KV, g, hd) queries) makes
two batched matmuls of g rows each, which numpy runs far below the memory's speed, and
pooled decode read every slot up to the longest sequence: at 2048 positions SmolLM2's
layer took 424 us on one thread. This kernel reads each sequence's keys and values
once, from its own slot and only its own positions (lo..hi-1), on numba's threads (the
matrix kernels' team), with the positions of each kv head split into chunks so that
both cores work even for one sequence of three kv heads ("flash decoding": each chunk
keeps its own maximum, sum and weighted values, and a second pass merges them).

Keys and values are float32, or float16 (-ctk/-ctv f16) passed as their uint16 bits:
those are widened to float32 ROWS rows at a time into a thread's scratch (``_rows``,
``_widen``: LLVM's half-to-float conversion, vcvtph2ps), exactly, so the rest runs as
for float32.

A few new tokens of one sequence (a draft being verified) run as one query whose g
heads are the tokens' heads side by side, head j seeing the positions before
hi - back[j]: each key and value row is read, and widened, once for all of them.

Values: float32 throughout, exp(s - max) to within one unit in the last place
(``_exp``: straight-line code LLVM vectorizes, where calling expf per score took a
third of a long sequence's time), the softmax's sums and the dot products summed in
another order (fastmath's reassociation lets LLVM vectorize
the head_dim loops; no nnan/ninf: -inf and NaN are values here). A sequence whose
keys or values are NaN or inf gets a non-finite result, alone: nothing past its
own length is ever read, so no neighbour's stale rows reach it.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from .kernel_base import _jit

_FASTMATH = {"reassoc", "contract"}


@intrinsic
def _widen(typingctx, x):
    """A float16 key or value, given as its bits (uint16), as float32 (exact)."""
    if x != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def _as_float(typingctx, x):
    """The low 32 bits of an integer read as a float32 (its sign, exponent and mantissa)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        bits = args[0]
        if x.bitwidth > 32:
            bits = builder.trunc(bits, ir.IntType(32))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(x), codegen


@_jit()
def _exp(x):
    """exp(x) of a float32 score less its maximum (x <= 0), in straight-line code LLVM
    vectorizes (numba's math.exp is a call per number): Cephes' expf, x = n ln2 + r
    with |r| <= ln2/2 (ln2 in two parts, so n ln2 is exact), e^r a degree-6
    polynomial, 2^n written into the exponent's bits. Within 0.97 ulp of the exact
    value over [-87, 0] (numpy's float32 exp: 2.4; 3 million points against float64),
    exp(0) is 1 exactly, below -87 (e^-87 ~ 1.6e-38) gives 0, NaN stays NaN. Compiled
    without fastmath, so LLVM keeps the order the reduction needs (reassociated,
    n ln2's two parts would merge and lose the low bits)."""
    y = max(x, np.float32(-87.0))
    n = np.float32(np.int32(y * np.float32(1.44269504088896341) - np.float32(0.5)))  # round(y/ln2)
    r = y - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    out = p * _as_float((np.int64(n) + 127) << 23)  # p * 2^n
    if x < np.float32(-87.0):
        out = np.float32(0.0)
    if x != x:
        out = x
    return out


ROWS = 32  # key or value rows widened at a time (a float16 cache), per thread


def _rows(a, slot, h, t0, t1, buf):
    """Rows t0..t1-1 (at most ROWS) of kv head h of ``slot`` as float32 (t1-t0, hd): the
    array's own rows, or (float16's bits) widened into ``buf`` in one flat loop, once
    for all the query heads that read them."""
    raise NotImplementedError  # compiled only (the overload below)


@overload(_rows, inline="always")
def _rows_typed(a, slot, h, t0, t1, buf):
    if a.dtype == types.float32:
        return lambda a, slot, h, t0, t1, buf: a[slot, h, t0:t1]
    if a.dtype == types.uint16:

        def widened(a, slot, h, t0, t1, buf):
            src = a[slot, h, t0:t1].reshape(-1)  # contiguous rows: one loop
            out = buf[: t1 - t0].reshape(-1)
            for e in range(src.shape[0]):
                out[e] = _widen(src[e])
            return buf[: t1 - t0]

        return widened
    return None


@_jit(fastmath=_FASTMATH)
def _part(q, kc, vc, i, h, slot, a, b, hi, back, softcap, sc, pm, ps, po, rows):
    """Query i's g heads of kv head h over positions a..b-1 (a < b) of ``slot``, head j
    only over those before hi - back[j]: each head's maximum score pm (g,), sum of
    exp(score - maximum) ps (g,) and values weighted by those exps po (g, hd); a head
    that sees none of them gets ps 0 (merged as nothing). ``sc`` (g, >= b-a): scratch
    for the scores;
    ``rows`` (ROWS, hd): a float16 cache's rows, widened ROWS at a time for the g
    queries (widened in each query's loop, or a row at a time, a 1B's decode at 8000
    positions ran slower than on a float32 cache)."""
    g, hd = q.shape[2], q.shape[3]
    # the queries and the weighted values in arrays of this call's own: LLVM knows no
    # store to the scores or the caller's po reaches them, so it need not reload and
    # store them around every row (a 1B layer at 4096 positions 10-30% faster)
    ql = q[i, h].copy()  # (g, hd)
    ol = np.zeros((g, hd), dtype=np.float32)  # (g, hd)
    cap = np.float32(softcap)
    inv_cap = np.float32(1.0 / softcap) if softcap > 0 else np.float32(0.0)
    for t0 in range(a, b, ROWS):  # each key row read once for the g queries of its head
        t1 = min(b, t0 + ROWS)
        ks = _rows(kc, slot, h, t0, t1, rows)  # (t1-t0, hd)
        for t in range(t0, t1):
            for j in range(g):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += ql[j, d] * ks[t - t0, d]
                if softcap > 0:
                    acc = cap * np.float32(math.tanh(acc * inv_cap))
                sc[j, t - a] = acc
    for j in range(g):
        e = min(b, hi - back[j]) - a  # head j's positions in this chunk
        if e <= 0:
            pm[j] = -np.inf
            ps[j] = 0.0
            continue
        m = sc[j, 0]
        for t in range(1, e):
            m = max(m, sc[j, t])
        total = np.float32(0.0)
        for t in range(e):
            x = _exp(sc[j, t] - m)
            sc[j, t] = x
            total += x
        pm[j] = m
        ps[j] = total
    for t0 in range(a, b, ROWS):  # each value row read once for the g queries
        t1 = min(b, t0 + ROWS)
        vs = _rows(vc, slot, h, t0, t1, rows)  # (t1-t0, hd)
        for t in range(t0, t1):
            for j in range(g):
                if t >= hi - back[j]:  # past what head j sees (a draft's later token)
                    continue
                p = sc[j, t - a]
                for d in range(hd):
                    ol[j, d] += p * vs[t - t0, d]
    po[:] = ol


@_jit(parallel=True, nogil=True, fastmath=_FASTMATH)
def _decode_attention(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out):
    """out[i] = softmax(q[i] . keys) values for each query i (n, KV, g, hd), q already
    scaled; its keys and values are kc/vc[slot, kv head, lo:hi] of (S, KV, cap, hd)
    arrays (float32, or float16's bits as uint16), spans[i] = (slot, lo, hi), and its
    head j stops back[j] (g,) positions short of hi (0: a query per sequence).
    ``softcap`` c > 0: scores become c*tanh(s/c) (Gemma 2). Returns 0, or i + 1 when
    query i's span lies outside the arrays or leaves one of its heads no position
    (nothing is read then). Each (query, kv head) runs as chunks of at least
    ``chunk_min`` positions, about ``per_thread``
    non-empty chunks for each of the ``threads`` numba runs this on (set by the caller:
    numba.get_num_threads in here would keep the kernel out of the disk cache). Always
    on the threads: even 64 positions of SmolLM2's three kv heads ran faster so (10.7
    against 11.8 us on this thread). Called through one entry point per pair of stored
    types (ENTRIES)."""
    n, KV, g, hd = q.shape
    S, cap = kc.shape[0], kc.shape[2]
    longest = positions = 0
    for i in range(n):
        slot, lo, hi = spans[i, 0], spans[i, 1], spans[i, 2]
        if slot < 0 or slot >= S or lo < 0 or hi <= lo or hi > cap:
            return i + 1
        for j in range(g):
            if back[j] < 0 or hi - back[j] <= lo:
                return i + 1
        longest = max(longest, hi - lo)
        positions += hi - lo
    # chunks of about an items-th of all the key rows: a long sequence beside short ones
    # is split so the threads share it (its kv heads alone would leave one idle)
    items = max(1, threads * per_thread)
    chunk = max(chunk_min, (KV * positions + items - 1) // items)
    n_chunks = (longest + chunk - 1) // chunk
    chunk = (longest + n_chunks - 1) // n_chunks
    work = n * KV * n_chunks
    # work item w on thread w % nt: numba's prange hands each thread one contiguous
    # block, which put all of a long sequence's chunks (its items come first) on one
    nt = max(1, min(threads, work))
    part_m = np.empty((work, g), dtype=np.float32)  # each chunk's maximum score
    part_s = np.empty((work, g), dtype=np.float32)  # and sum of exp(score - maximum)
    part_o = np.empty((work, g, hd), dtype=np.float32)  # and exp-weighted values
    scores = np.empty((nt, g, chunk), dtype=np.float32)  # a thread's scratch
    rows = np.empty((nt, ROWS, hd), dtype=np.float32)  # and its widened rows
    for th in prange(nt):
        for w in range(th, work, nt):
            i = w // (KV * n_chunks)
            h = (w // n_chunks) % KV
            a = spans[i, 1] + (w % n_chunks) * chunk
            b = min(spans[i, 2], a + chunk)
            if a >= b:  # past a short sequence's end: an empty chunk, merged as nothing
                for j in range(g):
                    part_s[w, j] = 0.0
            else:
                _part(q, kc, vc, i, h, spans[i, 0], a, b, spans[i, 2], back, softcap, scores[th],
                      part_m[w], part_s[w], part_o[w], rows[th])  # fmt: skip
                if n_chunks == 1:  # the (query, kv head) whole: its sums are the softmax's
                    for j in range(g):
                        for d in range(hd):
                            out[i, h, j, d] = part_o[w, j, d] / part_s[w, j]
    if n_chunks == 1:  # nothing to merge: no second wake-up of the threads
        return 0
    for u in prange(n * KV):
        i = u // KV
        h = u % KV
        w0 = u * n_chunks
        for j in range(g):
            m = -np.inf
            for c in range(n_chunks):
                if part_s[w0 + c, j] != 0.0:  # an empty chunk's maximum is no maximum
                    m = max(m, part_m[w0 + c, j])
            total = np.float32(0.0)
            for d in range(hd):
                out[i, h, j, d] = 0.0
            for c in range(n_chunks):
                if part_s[w0 + c, j] == 0.0:
                    continue
                f = np.float32(math.exp(part_m[w0 + c, j] - m))
                total += f * part_s[w0 + c, j]
                for d in range(hd):
                    out[i, h, j, d] += f * part_o[w0 + c, j, d]
            for d in range(hd):
                out[i, h, j, d] /= total
    return 0


# One entry point per pair of stored types (keys, values), each compiled for its own
# arrays and cached on its own: numba's cache index of one function is read, extended
# and rewritten without a lock, so two processes compiling two signatures of one entry
# at once (a load with -ctk f16 beside one without) could leave an index naming one
# signature's code for the other (core/model/kernel_base.py's _jit says how that went
# for the matrix kernels).
@_jit(entry=True, nogil=True)
def attention_f32_f32(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out):
    return _decode_attention(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out)


@_jit(entry=True, nogil=True)
def attention_f16_f16(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out):
    return _decode_attention(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out)


@_jit(entry=True, nogil=True)
def attention_f16_f32(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out):
    return _decode_attention(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out)


@_jit(entry=True, nogil=True)
def attention_f32_f16(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out):
    return _decode_attention(q, kc, vc, spans, back, softcap, threads, per_thread, chunk_min, out)


# (keys' type, values' type) -> its entry point; "f16" arrays are passed as their bits
ENTRIES = {
    ("f32", "f32"): attention_f32_f32,
    ("f16", "f16"): attention_f16_f16,
    ("f16", "f32"): attention_f16_f32,
    ("f32", "f16"): attention_f32_f16,
}
