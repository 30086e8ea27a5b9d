"""Compiled kernels for GGUF block-quantized weights (numba): exact dequantization of
blocks and the products ``y = x @ W.T`` with W left in its GGUF bytes.

W is a (out, row_bytes) uint8 array, each row whole blocks of its type (a view of
the GGUF's bytes). Every type has one dequantizer, ``_run_<type>(w, e0, e1,
out)``: elements [e0, e1) of one row (whole blocks) to float32, computed with the
same float32 operations in the same order as ``gguf.quants`` (gguf==0.19.0), so
the values are the same bits. It is compiled without fastmath (no FMA contraction
of ``d * q + m``, which would round once instead of twice).

On top of the dequantizers, one parallel kernel per type, ``_launch`` (``prange``
over output rows), specialised through a literal type code so that it holds only
its type's code, does three things:

* ROWS: dequantize selected rows (a tile for prefill, an embedding lookup);
* SMALL: the product for a few activation rows (decode, 8-mix batches). Each
  output row is dequantized once, a K-chunk at a time, into a small float32
  scratch that stays in L1, and dotted with all T activation rows (four at a time:
  one load of the weight feeds four FMAs; with 8 rows or more, two rows of W against
  eight of x, 16 sums a pass: a 1B layer's products for 8 rows went from 3.4-3.9x
  one row's cost to 2.3-2.5x, one thread). The K-chunk keeps T rows of x in L1
  too: with T=8 and a 2048-long row, x alone is 64 KB, and sweeping it from L2 for
  every output row made 8 rows cost 3.5x 4 rows (measured, one thread);
* GEMV: one activation row (decode) of a type in DOT_TYPES: a fused dot per
  output row, the block's integers multiplied by x as they are unpacked, with the
  scales folded in and the K-quants' mins applied through sums of x
  (core/model/kernel_dots.py). 1.7-2.4x the dequantize-then-dot kernel for one row on the 1B's
  matrices (step products 190 -> 100 ms on two threads, 2026-12-06). On a CPU with
  AVX-512 the Q4_K and Q6_K dots are written as LLVM IR, with a software prefetch
  (kernel_wide.WIDE): 1.2-1.5x the numba dots on one thread, cache-hot, and one 1B
  token's products, each matrix read once from RAM, 113 -> 62-70 ms. So are Q5_K's
  (1.5-1.7x, one thread, cache-hot) and Q4_0, Q4_1 and Q8_0's (SmolLM2's Q4_1 rows
  1.2-1.4x, its Q8_0 output 1.7-2.1x; its decode 57-62 -> 74-82 tok/s, 2026-12-06).
  Two to four rows of the 32-element types and Q8_0 (A/B compare, a few streams)
  take the same route with pair dots, each weight unpacked once for two rows of x
  (``_gemv_rows``); on AVX-512 those are IR as well (two rows of SmolLM2's shapes
  1.2-1.4x faster in Q4_1, 1.6x in Q8_0, one thread), and three or four rows go in one
  pass (kernel_wide._b32_rows: 1.2-1.4x two pair passes). Since 2026-12-07 one to
  four rows of these types are dotted a whole row at a time, the block loop in the
  IR (kernel_wide._b32_row_ir): one row of SmolLM2's Q4_1 1.2-1.4x faster, two
  1.1-1.4x. The K-quants' two to four rows take kernel_wide._dot_block_rows there.

What the kernels share (numba's configuration, type codes, block-field readers) is in
core/model/kernel_base.py.

The public entry points are the per-type wrappers at the bottom (tiny functions
that pass the code as a constant): numba caches compiled kernels on disk only
for plain arguments (a function passed as an argument is a cache miss every run).

Integer typing: numba widens byte arithmetic to int64, and int64 vectors are
a quarter of the lanes; wrapping byte results in ``np.uint8``/``np.int8`` lets
LLVM keep 8-bit lanes (measured: 4.0 -> 6.5 G weights/s for Q4_K on one thread).

Loop lengths: LLVM fully unrolls a loop of a known 16 or 32 steps before its loop
vectorizer runs, and the unrolled stores to ``out`` may alias the loads from ``w``
(numba cannot say they do not), so the straight-line code stays scalar. The
dequantizers' inner loops therefore run ``n32 = min(32, e1 - e0 - oo)`` steps
(``oo`` the block's first element): always 32 (whole blocks), but not a constant,
not even one per call (LLVM versions a loop on a loop-invariant length), so the loop
vectorizer takes them with a run-time alias check (Q8_0: 2.3 -> 3.2 G weights/s).
"""

from __future__ import annotations

import numpy as np
from numba import literally, prange

from .kernel_base import (  # noqa: F401  (BLOCK and the type codes: this module's API)
    BF16,
    BLOCK,
    F16,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _f16,
    _jit,
    _k_scale_min,
    _qh32,
    numba,
)
from .kernel_dots import (
    DOT_TYPES,
    PAIR_TYPES,
    SUMS_TYPES,
    _dot_rows,
    _dot_rows2,
    _sums,
)
from .kernel_wide import (
    DEQ_WIDE_TYPES,
    ROW_LANES,
    WIDE,
    _b32_rows,
    _deq_wide,
    _dot_block_rows,
)

ROWS_PER_CHUNK = 16  # output rows per prange unit: fine-grained enough to balance threads
PAIR_ROWS = 4  # rows of x the pair dots take (see _gemv_rows)
WIDE_ROWS = 4  # rows of x the K-quants' 512-bit dots take (see _launch)
# (the K-chunk a SMALL product runs in is the caller's choice: core/model/quant.py)


# ---- dequantizers: elements [e0, e1) of one row's bytes w into out[: e1 - e0] ----


@_jit()
def _run_f16(w, e0, e1, out):
    # normal numbers (exponent 1..30): the sign, and the exponent and mantissa shifted
    # into float32's fields and rebiased by 127 - 15, in integer lanes; zeros,
    # subnormals, inf and nan (exponent 0 or 31) are redone in a second pass when a
    # chunk has any (a trained matrix has a few tiny weights in most rows)
    h16 = w.view(np.uint16)[e0:e1]
    bits = out.view(np.uint32)
    n = e1 - e0
    rare = 0
    for i in range(n):
        h = np.uint32(h16[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        bits[i] = sign | (((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23))
        e = h & np.uint32(0x7C00)
        rare += (e == 0) | (e == 0x7C00)
    if rare:  # a second pass of selects (no branches: it vectorizes too)
        for i in range(n):
            h = h16[i]
            e = h & 0x7C00
            m = h & 0x3FF
            v = out[i]
            if e == 0:
                v = np.float32(m) * np.float32(2.0**-24)  # zero or subnormal: exact
            elif e == 0x7C00:
                v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
            if e == 0 or e == 0x7C00:
                v = -v if h & 0x8000 else v
            out[i] = v


@_jit()
def _run_bf16(w, e0, e1, out):
    h16 = w.view(np.uint16)[e0:e1]
    bits = out.view(np.uint32)
    for i in range(e1 - e0):
        bits[i] = np.uint32(h16[i]) << 16


@_jit()
def _run_q8_0(w, e0, e1, out):
    w = w[e0 // 32 * 34 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 32):
        o = b * 34
        d = _f16(w, o)
        oo = b * 32
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for i in range(n32):
            out[oo + i] = np.float32(np.int8(w[o + 2 + i])) * d


@_jit()
def _run_q4_0(w, e0, e1, out):
    w = w[e0 // 32 * 18 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 32):
        o = b * 18
        d = _f16(w, o)
        oo = b * 32
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for i in range(n32 // 2):
            v = w[o + 2 + i]
            out[oo + i] = d * np.float32(np.int8(np.int8(v & 15) - np.int8(8)))
            out[oo + 16 + i] = d * np.float32(np.int8(np.int8(v >> 4) - np.int8(8)))


@_jit()
def _run_q4_1(w, e0, e1, out):
    w = w[e0 // 32 * 20 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 32):
        o = b * 20
        d = _f16(w, o)
        m = _f16(w, o + 2)
        oo = b * 32
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for i in range(n32 // 2):
            v = w[o + 4 + i]
            out[oo + i] = d * np.float32(np.uint8(v & 15)) + m
            out[oo + 16 + i] = d * np.float32(np.uint8(v >> 4)) + m


@_jit()
def _run_q5_0(w, e0, e1, out):
    w = w[e0 // 32 * 22 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 32):
        o = b * 22
        d = _f16(w, o)
        qh = _qh32(w, o + 2)
        oo = b * 32
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for i in range(n32 // 2):
            v = w[o + 6 + i]
            lo = np.uint8(v & 15) | np.uint8(((qh >> i) & 1) << 4)
            hi = np.uint8(v >> 4) | np.uint8(((qh >> (i + 16)) & 1) << 4)
            out[oo + i] = d * np.float32(np.int8(np.int8(lo) - np.int8(16)))
            out[oo + 16 + i] = d * np.float32(np.int8(np.int8(hi) - np.int8(16)))


@_jit()
def _run_q5_1(w, e0, e1, out):
    w = w[e0 // 32 * 24 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 32):
        o = b * 24
        d = _f16(w, o)
        m = _f16(w, o + 2)
        qh = _qh32(w, o + 4)
        oo = b * 32
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for i in range(n32 // 2):
            v = w[o + 8 + i]
            lo = np.uint8(v & 15) | np.uint8(((qh >> i) & 1) << 4)
            hi = np.uint8(v >> 4) | np.uint8(((qh >> (i + 16)) & 1) << 4)
            out[oo + i] = d * np.float32(lo) + m
            out[oo + 16 + i] = d * np.float32(hi) + m


@_jit()
def _run_q2_k(w, e0, e1, out):
    # block: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin;
    # element j*128 + s*32 + l is bits 2s..2s+1 of qs[j*32 + l], sub-block of 16
    w = w[e0 // 256 * 84 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 256):
        o = b * 84
        d = _f16(w, o + 80)
        dmin = _f16(w, o + 82)
        oo = b * 256
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for j in range(2):
            for s in range(4):
                for h in range(2):
                    sc = w[o + j * 8 + s * 2 + h]
                    dl = d * np.float32(np.uint8(sc & 15))
                    ml = dmin * np.float32(np.uint8(sc >> 4))
                    base = oo + j * 128 + s * 32 + h * 16
                    qo = o + 16 + j * 32 + h * 16
                    for i in range(n32 // 2):
                        q = np.uint8((w[qo + i] >> (2 * s)) & 3)
                        out[base + i] = dl * np.float32(q) - ml


@_jit()
def _q3k_scale(w, o, k):
    """Sub-block k's 6-bit signed scale of a Q3_K block whose scales start at w[o]."""
    lo = np.uint8(w[o + k] & 15) if k < 8 else np.uint8(w[o + k - 8] >> 4)
    hi = np.uint8((w[o + 8 + k % 4] >> (2 * (k // 4))) & 3)
    return np.int8(np.int8(lo | (hi << 4)) - np.int8(32))


@_jit()
def _run_q3_k(w, e0, e1, out):
    # block: hmask[32], qs[64], scales[12], d; element j*128 + s*32 + l is bits
    # 2s..2s+1 of qs[j*32 + l] minus 4 unless bit j*4+s of hmask[l] is set
    w = w[e0 // 256 * 110 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 256):
        o = b * 110
        d = _f16(w, o + 108)
        oo = b * 256
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for j in range(2):
            for s in range(4):
                for h in range(2):
                    dl = d * np.float32(_q3k_scale(w, o + 96, j * 8 + s * 2 + h))
                    base = oo + j * 128 + s * 32 + h * 16
                    bit = j * 4 + s
                    for i in range(n32 // 2):
                        ql = np.int8((w[o + 32 + j * 32 + h * 16 + i] >> (2 * s)) & 3)
                        hm = np.int8((w[o + h * 16 + i] >> bit) & 1)
                        out[base + i] = dl * np.float32(np.int8(ql - np.int8((hm ^ 1) << 2)))


@_jit()
def _run_q4_k(w, e0, e1, out):
    # block: d, dmin, scales[12], qs[128]; sub-block 2c is the low nibbles of
    # qs[c*32 : c*32+32], sub-block 2c+1 their high nibbles
    w = w[e0 // 256 * 144 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 256):
        o = b * 144
        d = _f16(w, o)
        dmin = _f16(w, o + 2)
        oo = b * 256
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for c in range(4):
            sc0, m0 = _k_scale_min(w, o + 4, 2 * c)
            sc1, m1 = _k_scale_min(w, o + 4, 2 * c + 1)
            a0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
            a1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
            base = oo + c * 64
            qo = o + 16 + c * 32
            for i in range(n32):
                v = w[qo + i]
                out[base + i] = a0 * np.float32(np.uint8(v & 15)) - n0
                out[base + 32 + i] = a1 * np.float32(np.uint8(v >> 4)) - n1


@_jit()
def _run_q5_k(w, e0, e1, out):
    # block: d, dmin, scales[12], qh[32], qs[128]; as Q4_K, plus bit j of qh[l] as
    # bit 4 of element l of sub-block j
    w = w[e0 // 256 * 176 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 256):
        o = b * 176
        d = _f16(w, o)
        dmin = _f16(w, o + 2)
        oo = b * 256
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for c in range(4):
            sc0, m0 = _k_scale_min(w, o + 4, 2 * c)
            sc1, m1 = _k_scale_min(w, o + 4, 2 * c + 1)
            a0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
            a1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
            base = oo + c * 64
            qo = o + 48 + c * 32
            for i in range(n32):
                v = w[qo + i]
                h = w[o + 16 + i]
                q0 = np.uint8(v & 15) | np.uint8(((h >> (2 * c)) & 1) << 4)
                q1 = np.uint8(v >> 4) | np.uint8(((h >> (2 * c + 1)) & 1) << 4)
                out[base + i] = a0 * np.float32(q0) - n0
                out[base + 32 + i] = a1 * np.float32(q1) - n1


@_jit()
def _run_q6_k(w, e0, e1, out):
    # block: ql[128], qh[64], scales[16] (int8), d; element j*128 + i takes
    # nibble i//64 of ql[j*64 + i%64] and bits 2(i//32).. of qh[j*32 + i%32],
    # minus 32; sub-blocks of 16
    w = w[e0 // 256 * 210 :]  # from block e0 on: every index below is >= 0
    for b in range((e1 - e0) // 256):
        o = b * 210
        d = _f16(w, o + 208)
        oo = b * 256
        n32 = min(32, e1 - e0 - oo)  # 32, unknown to LLVM: see the module docstring
        for j in range(2):
            for h in range(2):
                k = o + 192 + j * 8 + h  # scale of elements j*128 + h*16 .. +16 (then +32 ...)
                s0 = d * np.float32(np.int8(w[k]))
                s1 = d * np.float32(np.int8(w[k + 2]))
                s2 = d * np.float32(np.int8(w[k + 4]))
                s3 = d * np.float32(np.int8(w[k + 6]))
                base = oo + j * 128 + h * 16
                for i in range(n32 // 2):
                    a = w[o + j * 64 + h * 16 + i]
                    c = w[o + j * 64 + 32 + h * 16 + i]
                    qh = w[o + 128 + j * 32 + h * 16 + i]
                    q0 = np.int8(np.int8(np.uint8(a & 15) | np.uint8((qh & 3) << 4)) - np.int8(32))
                    q1 = np.int8(
                        np.int8(np.uint8(c & 15) | np.uint8(((qh >> 2) & 3) << 4)) - np.int8(32)
                    )
                    q2 = np.int8(
                        np.int8(np.uint8(a >> 4) | np.uint8(((qh >> 4) & 3) << 4)) - np.int8(32)
                    )
                    q3 = np.int8(np.int8(np.uint8(c >> 4) | np.uint8((qh >> 6) << 4)) - np.int8(32))
                    out[base + i] = s0 * np.float32(q0)
                    out[base + 32 + i] = s1 * np.float32(q1)
                    out[base + 64 + i] = s2 * np.float32(q2)
                    out[base + 96 + i] = s3 * np.float32(q3)


@_jit()
def _run(code, w, e0, e1, out):
    """Dequantize elements [e0, e1) of row w of type ``code`` (a literal: only the
    branch for the type is compiled) into out[: e1 - e0]. Where WIDE, the types with
    512-bit dequantizers take them (kernel_wide._deq_wide: the same operations,
    vectorized, so the same bits); the ``_run_*`` loops are the portable code."""
    literally(code)
    if WIDE and code in DEQ_WIDE_TYPES:
        _deq_wide(code, w, e0, e1, out)
    elif code == F16:
        _run_f16(w, e0, e1, out)
    elif code == BF16:
        _run_bf16(w, e0, e1, out)
    elif code == Q8_0:
        _run_q8_0(w, e0, e1, out)
    elif code == Q4_0:
        _run_q4_0(w, e0, e1, out)
    elif code == Q4_1:
        _run_q4_1(w, e0, e1, out)
    elif code == Q5_0:
        _run_q5_0(w, e0, e1, out)
    elif code == Q5_1:
        _run_q5_1(w, e0, e1, out)
    elif code == Q2_K:
        _run_q2_k(w, e0, e1, out)
    elif code == Q3_K:
        _run_q3_k(w, e0, e1, out)
    elif code == Q4_K:
        _run_q4_k(w, e0, e1, out)
    elif code == Q5_K:
        _run_q5_k(w, e0, e1, out)
    elif code == Q6_K:
        _run_q6_k(w, e0, e1, out)


# ---- the parallel launcher ----

ROWS, SMALL = 0, 1  # _launch's operations


@_jit(inline="always")
def _gemv_rows(code):
    """Up to how many rows of x the fused dots run rather than the dequantize-then-dot
    kernel, each chunk of W rows against every row of x while the chunk is in cache.
    The 32-element types and Q8_0 take the rows of x two at a time (PAIR_TYPES):
    on SmolLM2's 576- and 1536-wide Q4_1 rows and its Q8_0 output, rows of x cost
    (one row = 1) 1.2-1.4 for two, 1.8-2.3 for three and 1.9-2.8 for four, against
    2.3-2.6, 2.2-2.5 and 2.2-2.9 on the dequantize-then-dot kernel (2 threads, best
    of 15, 2026-12-06); those were the numba pair dots, and the 512-bit ones
    (kernel_wide._b32_row2) take their place where WIDE. The K-quants' numba pair dot
    was no faster than that kernel, so they take one row here; where WIDE, two to four
    rows of them go to kernel_wide._dot_block_rows instead (``wide_rows`` in _launch)."""
    if code in PAIR_TYPES:
        return PAIR_ROWS
    return 1


@_jit(parallel=True)
def _launch(code, op, w, ids, x, out, kc):
    """One parallel kernel per type for both operations (numba's parallel lowering
    costs seconds of compile per function, so one function, not two):

    * ROWS: out[i] = row ids[i] of w dequantized ((len(ids), in) float32);
    * SMALL: out = x @ W.T for a few rows of x ((T, in) -> (T, out) float32), in
      chunks of ROWS_PER_CHUNK output rows; ``kc``: elements per K-chunk (a multiple
      of 256, so of every block size)."""
    literally(code)
    n_out = w.shape[0]
    n_in = out.shape[1] if op == ROWS else x.shape[1]
    n_units = ids.shape[0] if op == ROWS else (n_out + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    # a type with a fused dot and at most _gemv_rows(code) rows of x (one: the decode
    # step's gemv): the fused dots over each chunk of W rows while it is in cache
    n_x = x.shape[0] if op == SMALL else 0
    gemv = op == SMALL and code in DOT_TYPES and n_x <= _gemv_rows(code)
    # two to four rows of a K-quant with the 512-bit dots: each block unpacked once
    # for all of them (kernel_wide._dot_block_rows). On the 1B's gate (Q4_K) and down
    # (Q6_K) matrices, 2 threads: two rows 0.71-0.77 ms against 1.41-1.86 on the
    # dequantize-then-dot kernel, four 1.08-1.17 against 1.45-1.52; eight (two passes
    # of four, or one of eight) 2.3-3.3 against 2.1-2.2, so those keep that kernel.
    # Q5_K (Q5_K_M files): two rows 2.3 ms on that kernel, a 2048x8192 matrix
    wide_k = code == Q4_K or code == Q5_K or code == Q6_K
    wide_rows = op == SMALL and WIDE and wide_k and 1 < n_x <= WIDE_ROWS
    xs = np.empty((n_x, 0), dtype=np.float32)  # x's sums per 32: the mins of these types
    if (gemv or wide_rows) and code in SUMS_TYPES:
        xs = np.empty((n_x, n_in // 32), dtype=np.float32)
        for t in range(n_x):
            xs[t] = _sums(x[t], 32)
    for u in prange(n_units):
        if op == ROWS:
            _run(code, w[ids[u]], 0, n_in, out[u])
        elif gemv:
            r0 = u * ROWS_PER_CHUNK
            r1 = min(n_out, r0 + ROWS_PER_CHUNK)
            t = 0
            if WIDE and code in PAIR_TYPES and n_x >= 3:  # four rows at a time, then pairs
                while t + 4 <= n_x:
                    for r in range(r0, r1):
                        _b32_rows(code, 4, w[r], x, t, xs, out, r)
                    t += 4
                if n_x - t == 3:
                    for r in range(r0, r1):
                        _b32_rows(code, 3, w[r], x, t, xs, out, r)
                    t += 3
            if code in PAIR_TYPES:  # rows of x two at a time: each weight unpacked once
                while t + 2 <= n_x:
                    _dot_rows2(
                        code, w, x[t], x[t + 1], xs[t], xs[t + 1], out[t], out[t + 1], r0, r1
                    )
                    t += 2
            while t < n_x:
                _dot_rows(code, w, x[t], xs[t], out[t], r0, r1)
                t += 1
        elif wide_rows:
            acc = np.empty((4, ROW_LANES), dtype=np.float32)
            r0 = u * ROWS_PER_CHUNK
            r1 = min(n_out, r0 + ROWS_PER_CHUNK)
            t = 0
            if n_x == 4:
                for r in range(r0, r1):
                    _dot_block_rows(code, 4, w[r], x, xs, t, out, r, acc)
                t += 4
            if t + 2 <= n_x:
                for r in range(r0, r1):
                    _dot_block_rows(code, 2, w[r], x, xs, t, out, r, acc)
                t += 2
            if t < n_x:
                for r in range(r0, r1):
                    _dot_block_rows(code, 1, w[r], x, xs, t, out, r, acc)
        else:
            buf = np.empty((2, min(kc, n_in)), dtype=np.float32)  # a K-chunk of two rows
            r0 = u * ROWS_PER_CHUNK
            _small_rows(code, w, x, out, kc, r0, min(n_out, r0 + ROWS_PER_CHUNK), buf)


@_jit(fastmath=True)
def _dots(buf, x, k0, y, r, t0, t1):
    """y[t, r] += buf . x[t, k0 : k0 + len(buf)] for t in [t0, t1), four rows of x per
    pass so each weight loaded feeds four FMAs."""
    kb = buf.shape[0]
    t = t0
    while t + 4 <= t1:
        x0, x1, x2, x3 = x[t, k0:], x[t + 1, k0:], x[t + 2, k0:], x[t + 3, k0:]
        s0 = s1 = s2 = s3 = np.float32(0.0)
        for i in range(kb):
            v = buf[i]
            s0 += v * x0[i]
            s1 += v * x1[i]
            s2 += v * x2[i]
            s3 += v * x3[i]
        y[t, r] += s0
        y[t + 1, r] += s1
        y[t + 2, r] += s2
        y[t + 3, r] += s3
        t += 4
    if t + 2 <= t1:
        x0, x1 = x[t, k0:], x[t + 1, k0:]
        s0 = s1 = np.float32(0.0)
        for i in range(kb):
            v = buf[i]
            s0 += v * x0[i]
            s1 += v * x1[i]
        y[t, r] += s0
        y[t + 1, r] += s1
        t += 2
    if t < t1:
        x0 = x[t, k0:]
        s0 = np.float32(0.0)
        for i in range(kb):
            s0 += buf[i] * x0[i]
        y[t, r] += s0


@_jit(fastmath=True)
def _dots2x8(b0, b1, x, k0, y, r, t):
    """y[t + j, r] += b0 . x[t + j, k0:] and y[t + j, r + 1] += b1 . x[t + j, k0:] for
    j in [0, 8): two rows of W against eight of x, 16 sums a pass, so each load of a
    weight or of x feeds 8 or 2 FMAs (10 loads per 16 FMAs, against 5 per 4 for
    ``_dots``): 1.5x ``_dots``'s speed with 8 rows of x, one thread, buffers in L1,
    while two weight rows against four of x was no faster than ``_dots`` (2026-12-06)."""
    kb = b0.shape[0]
    x0, x1, x2, x3 = x[t, k0:], x[t + 1, k0:], x[t + 2, k0:], x[t + 3, k0:]
    x4, x5, x6, x7 = x[t + 4, k0:], x[t + 5, k0:], x[t + 6, k0:], x[t + 7, k0:]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    u0 = u1 = u2 = u3 = u4 = u5 = u6 = u7 = np.float32(0.0)
    for i in range(kb):
        v, w = b0[i], b1[i]
        a0, a1, a2, a3 = x0[i], x1[i], x2[i], x3[i]
        a4, a5, a6, a7 = x4[i], x5[i], x6[i], x7[i]
        s0 += v * a0
        s1 += v * a1
        s2 += v * a2
        s3 += v * a3
        s4 += v * a4
        s5 += v * a5
        s6 += v * a6
        s7 += v * a7
        u0 += w * a0
        u1 += w * a1
        u2 += w * a2
        u3 += w * a3
        u4 += w * a4
        u5 += w * a5
        u6 += w * a6
        u7 += w * a7
    y[t, r] += s0
    y[t + 1, r] += s1
    y[t + 2, r] += s2
    y[t + 3, r] += s3
    y[t + 4, r] += s4
    y[t + 5, r] += s5
    y[t + 6, r] += s6
    y[t + 7, r] += s7
    y[t, r + 1] += u0
    y[t + 1, r + 1] += u1
    y[t + 2, r + 1] += u2
    y[t + 3, r + 1] += u3
    y[t + 4, r + 1] += u4
    y[t + 5, r + 1] += u5
    y[t + 6, r + 1] += u6
    y[t + 7, r + 1] += u7


@_jit(fastmath=True)
def _small_rows(code, w, x, y, kc, r0, r1, buf):
    """Rows [r0, r1) of ``_small``'s product; ``buf``: scratch of (2, min(kc, in))
    floats, one K-chunk each of two rows of W. Two rows at a time when there are
    eight rows of x or more (``_dots2x8``), else one (``_dots``, four rows of x a pass)."""
    literally(code)
    n = x.shape[1]
    T = x.shape[0]
    pair = T >= 8
    for r in range(r0, r1):
        for t in range(T):
            y[t, r] = 0.0
    for k0 in range(0, n, kc):
        k1 = min(n, k0 + kc)
        p0 = buf[0, : k1 - k0]
        p1 = buf[1, : k1 - k0]
        r = r0
        while pair and r + 2 <= r1:
            _run(code, w[r], k0, k1, p0)
            _run(code, w[r + 1], k0, k1, p1)
            t = 0
            while t + 8 <= T:
                _dots2x8(p0, p1, x, k0, y, r, t)
                t += 8
            if t < T:
                _dots(p0, x, k0, y, r, t, T)
                _dots(p1, x, k0, y, r + 1, t, T)
            r += 2
        while r < r1:
            _run(code, w[r], k0, k1, p0)
            _dots(p0, x, k0, y, r, 0, T)
            r += 1


@_jit(signature_or_function="int64(int64)")
def _plain(v):
    """``v`` as a run-time int64: numba passes a constant argument as a literal, and
    _launch would then compile once per operation instead of once per type."""
    return v


# ---- per-type entry points: the type code as a constant, so each caches on disk ----


@_jit(entry=True)
def rows_f16(w, ids, out):
    _launch(F16, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_f16(w, x, y, kc):
    _launch(F16, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_bf16(w, ids, out):
    _launch(BF16, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_bf16(w, x, y, kc):
    _launch(BF16, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q8_0(w, ids, out):
    _launch(Q8_0, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q8_0(w, x, y, kc):
    _launch(Q8_0, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q4_0(w, ids, out):
    _launch(Q4_0, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q4_0(w, x, y, kc):
    _launch(Q4_0, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q4_1(w, ids, out):
    _launch(Q4_1, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q4_1(w, x, y, kc):
    _launch(Q4_1, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q5_0(w, ids, out):
    _launch(Q5_0, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q5_0(w, x, y, kc):
    _launch(Q5_0, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q5_1(w, ids, out):
    _launch(Q5_1, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q5_1(w, x, y, kc):
    _launch(Q5_1, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q2_k(w, ids, out):
    _launch(Q2_K, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q2_k(w, x, y, kc):
    _launch(Q2_K, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q3_k(w, ids, out):
    _launch(Q3_K, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q3_k(w, x, y, kc):
    _launch(Q3_K, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q4_k(w, ids, out):
    _launch(Q4_K, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q4_k(w, x, y, kc):
    _launch(Q4_K, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q5_k(w, ids, out):
    _launch(Q5_K, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q5_k(w, x, y, kc):
    _launch(Q5_K, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


@_jit(entry=True)
def rows_q6_k(w, ids, out):
    _launch(Q6_K, _plain(ROWS), w, ids, np.empty((0, 0), np.float32), out, _plain(0))


@_jit(entry=True)
def small_q6_k(w, x, y, kc):
    _launch(Q6_K, _plain(SMALL), w, np.empty(0, np.int64), x, y, kc)


# code -> (rows kernel, small-product kernel)
KERNELS = {
    F16: (rows_f16, small_f16),
    BF16: (rows_bf16, small_bf16),
    Q8_0: (rows_q8_0, small_q8_0),
    Q4_0: (rows_q4_0, small_q4_0),
    Q4_1: (rows_q4_1, small_q4_1),
    Q5_0: (rows_q5_0, small_q5_0),
    Q5_1: (rows_q5_1, small_q5_1),
    Q2_K: (rows_q2_k, small_q2_k),
    Q3_K: (rows_q3_k, small_q3_k),
    Q4_K: (rows_q4_k, small_q4_k),
    Q5_K: (rows_q5_k, small_q5_k),
    Q6_K: (rows_q6_k, small_q6_k),
}
