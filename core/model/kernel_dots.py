"""The fused dots: one activation row (decode) times a row of weights left in its
GGUF blocks, ``w . x``, with no dequantized row in between (core/model/kernels.py's
GEMV operation calls ``_dot`` per output row)."""

from __future__ import annotations

import numpy as np
from numba import literally

from .kernel_base import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _f16t,
    _jit,
    _qh32,
    _size32,
)
from .kernel_wide import (  # noqa: F401  (WIDE: kernel_dots.WIDE is read by callers)
    ACC_LANES,
    WIDE,
    _b32_row,
    _b32_row2,
    _dot_k_wide,
    _dot_q6_k_wide,
)

# ---- fused dots for one activation row (decode): w . x with no dequantized row ----
#
# Each keeps 32 (Q6_K: 16) partial sums in ``acc`` and adds every weight's product to
# its lane, the sub-block's scale folded in: elementwise work LLVM vectorizes whole
# (32 lanes = two AVX-512 registers), with one horizontal sum per row. A sum per
# sub-block (the obvious form) is a 32-step reduction per 32 weights, and that form
# measured 1.7-7.7 G weights/s against these 7.5-9.6 (one thread, 8192x2048, AVX-512;
# 2026-12-06, /tmp bench). The K-quants' mins are applied once per block through the
# sums of x per 32 (``xs``), as llama.cpp does. Values: d * scale * q * x summed in
# another order than dequantize-then-dot, so products agree to float32 rounding
# (tests/test_quant_kernels.py bounds both against float64).
#
# The loops run a constant 32 (16) steps: unlike the dequantizers they store nothing
# that could alias w, so the fully unrolled body is vectorized as it stands.

DOT_TYPES = (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)  # types with a fused T=1 dot
SUMS_TYPES = (Q4_K, Q5_K, Q4_1, Q5_1)  # dots whose mins take x's sums per 32 (xs)


@_jit(fastmath=True, inline="always")
def _k_scales(s, j):
    """Sub-block j's scale and min as float32, from a K-quant block's 12 scale bytes
    ``s`` (_k_scale_min inlined into the dot: as a call it cost the Q4_K dot a third)."""
    if j < 4:
        return np.float32(s[j] & 63), np.float32(s[j + 4] & 63)
    return (
        np.float32(np.uint8(s[j + 4] & 15) | np.uint8((s[j - 4] >> 6) << 4)),
        np.float32(np.uint8(s[j + 4] >> 4) | np.uint8((s[j] >> 6) << 4)),
    )


@_jit(fastmath=True, inline="always")
def _acc_sum(acc, n):
    s = np.float32(0.0)
    for i in range(n):
        s += acc[i]
    return s


@_jit(fastmath=True, inline="always")
def _k_head(w, o, s):
    """A Q4_K/Q5_K block's head at w[o]: its 8 sub-block scales times d, and its mins'
    share of the dot, dmin * sum(m_j * s_j) with ``s`` the sums of x over the block's
    8 sub-blocks."""
    d = _f16t(w, o)
    dmin = _f16t(w, o + 2)
    ks = w[o + 4 : o + 16]  # (12,) packed 6-bit scales and mins
    sc0, m0 = _k_scales(ks, 0)
    sc1, m1 = _k_scales(ks, 1)
    sc2, m2 = _k_scales(ks, 2)
    sc3, m3 = _k_scales(ks, 3)
    sc4, m4 = _k_scales(ks, 4)
    sc5, m5 = _k_scales(ks, 5)
    sc6, m6 = _k_scales(ks, 6)
    sc7, m7 = _k_scales(ks, 7)
    mins = dmin * (
        m0 * s[0] + m1 * s[1] + m2 * s[2]
        + m3 * s[3] + m4 * s[4] + m5 * s[5]
        + m6 * s[6] + m7 * s[7]
    )  # fmt: skip
    return d * sc0, d * sc1, d * sc2, d * sc3, d * sc4, d * sc5, d * sc6, d * sc7, mins


@_jit(fastmath=True)
def _dot_q4_k(w, x, xs, acc):
    for i in range(32):
        acc[i] = 0.0
    mins = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 144
        f0, f1, f2, f3, f4, f5, f6, f7, m = _k_head(w, o, xs[b * 8 : b * 8 + 8])
        mins += m
        q = w[o + 16 : o + 144]  # (128,) two sub-blocks per 32 bytes: low, high nibbles
        xb = x[b * 256 : b * 256 + 256]  # (256,)
        for i in range(32):
            v0, v1, v2, v3 = q[i], q[32 + i], q[64 + i], q[96 + i]
            acc[i] += (
                f0 * np.float32(np.uint8(v0 & 15)) * xb[i]
                + f1 * np.float32(np.uint8(v0 >> 4)) * xb[32 + i]
                + f2 * np.float32(np.uint8(v1 & 15)) * xb[64 + i]
                + f3 * np.float32(np.uint8(v1 >> 4)) * xb[96 + i]
                + f4 * np.float32(np.uint8(v2 & 15)) * xb[128 + i]
                + f5 * np.float32(np.uint8(v2 >> 4)) * xb[160 + i]
                + f6 * np.float32(np.uint8(v3 & 15)) * xb[192 + i]
                + f7 * np.float32(np.uint8(v3 >> 4)) * xb[224 + i]
            )
    return _acc_sum(acc, 32) - mins


@_jit(fastmath=True, inline="always")
def _q5(v, h, bit):
    """A Q5_K value: the nibble ``v`` with bit ``bit`` of ``h`` as its fifth bit."""
    return np.float32(np.uint8(v) | np.uint8(((h >> bit) & 1) << 4))


@_jit(fastmath=True)
def _dot_q5_k(w, x, xs, acc):
    for i in range(32):
        acc[i] = 0.0
    mins = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 176
        f0, f1, f2, f3, f4, f5, f6, f7, m = _k_head(w, o, xs[b * 8 : b * 8 + 8])
        mins += m
        qh = w[o + 16 : o + 48]  # (32,) bit j of qh[i]: fifth bit of sub-block j's element i
        q = w[o + 48 : o + 176]  # (128,)
        xb = x[b * 256 : b * 256 + 256]  # (256,)
        for i in range(32):
            h = qh[i]
            v0, v1, v2, v3 = q[i], q[32 + i], q[64 + i], q[96 + i]
            acc[i] += (
                f0 * _q5(v0 & 15, h, 0) * xb[i]
                + f1 * _q5(v0 >> 4, h, 1) * xb[32 + i]
                + f2 * _q5(v1 & 15, h, 2) * xb[64 + i]
                + f3 * _q5(v1 >> 4, h, 3) * xb[96 + i]
                + f4 * _q5(v2 & 15, h, 4) * xb[128 + i]
                + f5 * _q5(v2 >> 4, h, 5) * xb[160 + i]
                + f6 * _q5(v3 & 15, h, 6) * xb[192 + i]
                + f7 * _q5(v3 >> 4, h, 7) * xb[224 + i]
            )
    return _acc_sum(acc, 32) - mins


@_jit(fastmath=True, inline="always")
def _q6(lo, h, shift):
    """A Q6_K value: the nibble ``lo`` and two bits of ``h`` at ``shift``, minus 32."""
    return np.float32(
        np.int8(np.int8(np.uint8(lo) | np.uint8(((h >> shift) & 3) << 4)) - np.int8(32))
    )


@_jit(fastmath=True)
def _dot_q6_k(w, x, xs, acc):
    # per half j of the block: ql[64], qh[32], and 8 scales of 16 elements; lane i
    # takes elements i and 16 + i of each of the half's four 32-element runs. (Taking
    # the -32 out through sums of x per 16, one operation fewer per weight, measured
    # no faster.)
    for i in range(16):
        acc[i] = 0.0
    for b in range(x.shape[0] // 256):
        o = b * 210
        d = _f16t(w, o + 208)
        for j in range(2):
            ql = w[o + j * 64 : o + j * 64 + 64]  # (64,)
            qh = w[o + 128 + j * 32 : o + 128 + j * 32 + 32]  # (32,)
            xb = x[b * 256 + j * 128 : b * 256 + j * 128 + 128]  # (128,)
            k = o + 192 + j * 8  # scales: k + 2r for run r's first 16, k + 2r + 1 its second
            s0, t0 = d * np.float32(np.int8(w[k])), d * np.float32(np.int8(w[k + 1]))
            s1, t1 = d * np.float32(np.int8(w[k + 2])), d * np.float32(np.int8(w[k + 3]))
            s2, t2 = d * np.float32(np.int8(w[k + 4])), d * np.float32(np.int8(w[k + 5]))
            s3, t3 = d * np.float32(np.int8(w[k + 6])), d * np.float32(np.int8(w[k + 7]))
            for i in range(16):
                a, c, h = ql[i], ql[32 + i], qh[i]
                a2, c2, h2 = ql[16 + i], ql[48 + i], qh[16 + i]
                acc[i] += (
                    s0 * _q6(a & 15, h, 0) * xb[i]
                    + s1 * _q6(c & 15, h, 2) * xb[32 + i]
                    + s2 * _q6(a >> 4, h, 4) * xb[64 + i]
                    + s3 * _q6(c >> 4, h, 6) * xb[96 + i]
                    + t0 * _q6(a2 & 15, h2, 0) * xb[16 + i]
                    + t1 * _q6(c2 & 15, h2, 2) * xb[48 + i]
                    + t2 * _q6(a2 >> 4, h2, 4) * xb[80 + i]
                    + t3 * _q6(c2 >> 4, h2, 6) * xb[112 + i]
                )
    return _acc_sum(acc, 16)


@_jit(fastmath=True, inline="always")
def _dot_q8_0(w, x, xs, acc):
    # four blocks per pass: one 32-step pass per block was a quarter as fast
    for i in range(32):
        acc[i] = 0.0
    nb = x.shape[0] // 32
    b = 0
    while b + 4 <= nb:
        o = b * 34
        d0, d1, d2, d3 = _f16t(w, o), _f16t(w, o + 34), _f16t(w, o + 68), _f16t(w, o + 102)
        q = w[o : o + 136]  # (136,) four blocks
        xb = x[b * 32 : b * 32 + 128]  # (128,)
        for i in range(32):
            acc[i] += (
                d0 * np.float32(np.int8(q[2 + i])) * xb[i]
                + d1 * np.float32(np.int8(q[36 + i])) * xb[32 + i]
                + d2 * np.float32(np.int8(q[70 + i])) * xb[64 + i]
                + d3 * np.float32(np.int8(q[104 + i])) * xb[96 + i]
            )
        b += 4
    while b < nb:
        o = b * 34
        d0 = _f16t(w, o)
        q = w[o : o + 34]
        xb = x[b * 32 : b * 32 + 32]
        for i in range(32):
            acc[i] += d0 * np.float32(np.int8(q[2 + i])) * xb[i]
        b += 1
    return _acc_sum(acc, 32)


@_jit(fastmath=True, inline="always")
def _lo_hi(code, w, o, qh, i):
    """Elements i and 16 + i of the 32-element block at w[o] (Q4_0, Q4_1, Q5_0, Q5_1),
    before the block's scale and min, as float32; ``qh``: a Q5 block's high bits."""
    if code == Q4_0:
        v = w[o + 2 + i]
        return (
            np.float32(np.int8(np.int8(v & 15) - np.int8(8))),
            np.float32(np.int8(np.int8(v >> 4) - np.int8(8))),
        )
    if code == Q4_1:
        v = w[o + 4 + i]
        return np.float32(np.uint8(v & 15)), np.float32(np.uint8(v >> 4))
    if code == Q5_0:
        v = w[o + 6 + i]
        lo = np.uint8(v & 15) | np.uint8(((qh >> i) & 1) << 4)
        hi = np.uint8(v >> 4) | np.uint8(((qh >> (i + 16)) & 1) << 4)
        return (
            np.float32(np.int8(np.int8(lo) - np.int8(16))),
            np.float32(np.int8(np.int8(hi) - np.int8(16))),
        )
    v = w[o + 8 + i]  # Q5_1
    lo = np.uint8(v & 15) | np.uint8(((qh >> i) & 1) << 4)
    hi = np.uint8(v >> 4) | np.uint8(((qh >> (i + 16)) & 1) << 4)
    return np.float32(lo), np.float32(hi)


@_jit(fastmath=True, inline="always")
def _head32(code, w, o):
    """A 32-element block's scale, min (0 for Q4_0, Q5_0) and high bits (Q5 types)."""
    d = _f16t(w, o)
    if code == Q4_0:
        return d, np.float32(0.0), np.uint32(0)
    if code == Q4_1:
        return d, _f16t(w, o + 2), np.uint32(0)
    if code == Q5_0:
        return d, np.float32(0.0), _qh32(w, o + 2)
    return d, _f16t(w, o + 2), _qh32(w, o + 4)


@_jit(fastmath=True, inline="always")
def _heads4(code, w, o, bs):
    """The heads (_head32) of the four blocks from w[o], and their mins' weights as
    (d0, d1, d2, d3), (m0, m1, m2, m3), (h0, h1, h2, h3)."""
    d0, m0, h0 = _head32(code, w, o)
    d1, m1, h1 = _head32(code, w, o + bs)
    d2, m2, h2 = _head32(code, w, o + 2 * bs)
    d3, m3, h3 = _head32(code, w, o + 3 * bs)
    return (d0, d1, d2, d3), (m0, m1, m2, m3), (h0, h1, h2, h3)


@_jit(fastmath=True, inline="always")
def _mins4(m, s, b):
    """The four blocks' mins (m) against x's sums over them (s[b : b + 4])."""
    return m[0] * s[b] + m[1] * s[b + 1] + m[2] * s[b + 2] + m[3] * s[b + 3]


@_jit(fastmath=True, inline="always")
def _dot_32(code, w, x, xs, acc):
    """The dot for the 32-element block types Q4_0, Q4_1, Q5_0, Q5_1: lane i takes
    elements i and 16 + i of four blocks a pass (as _dot_q8_0), then the rest a block
    at a time; Q4_1's and Q5_1's mins through the sums of x per block (``xs``)."""
    bs = _size32(code)
    for i in range(16):
        acc[i] = 0.0
    mins = np.float32(0.0)
    nb = x.shape[0] // 32
    b = 0
    while b + 4 <= nb:
        o = b * bs
        (d0, d1, d2, d3), m, (h0, h1, h2, h3) = _heads4(code, w, o, bs)
        if code == Q4_1 or code == Q5_1:
            mins += _mins4(m, xs, b)
        xb = x[b * 32 : b * 32 + 128]  # (128,)
        for i in range(16):
            a0, c0 = _lo_hi(code, w, o, h0, i)
            a1, c1 = _lo_hi(code, w, o + bs, h1, i)
            a2, c2 = _lo_hi(code, w, o + 2 * bs, h2, i)
            a3, c3 = _lo_hi(code, w, o + 3 * bs, h3, i)
            acc[i] += (
                d0 * a0 * xb[i] + d0 * c0 * xb[16 + i]
                + d1 * a1 * xb[32 + i] + d1 * c1 * xb[48 + i]
                + d2 * a2 * xb[64 + i] + d2 * c2 * xb[80 + i]
                + d3 * a3 * xb[96 + i] + d3 * c3 * xb[112 + i]
            )  # fmt: skip
        b += 4
    while b < nb:
        o = b * bs
        d0, m0, h0 = _head32(code, w, o)
        if code == Q4_1 or code == Q5_1:
            mins += m0 * xs[b]
        xb = x[b * 32 : b * 32 + 32]
        for i in range(16):
            a0, c0 = _lo_hi(code, w, o, h0, i)
            acc[i] += d0 * a0 * xb[i] + d0 * c0 * xb[16 + i]
        b += 1
    return _acc_sum(acc, 16) + mins


# ---- pair dots: one row of weights against two rows of x (A/B compare, two streams) ----
#
# Each weight is unpacked and scaled once and feeds both rows' sums: for the 32-element
# types (whose block head is a scale and a min, nothing to unpack per sub-block) two
# rows of x cost 1.33x one row against 1.96x for two dots (SmolLM2's 576- and
# 1536-wide Q4_1 rows, one thread, 2026-12-06). ``acc`` holds both rows' lanes.
# The K-quants keep the dequantize-then-dot kernel: their per-block scale unpacking
# made a pair dot no faster than it (1.6-1.8x one row, Q4_K 8192x2048).

PAIR_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)


@_jit(fastmath=True, inline="always")
def _dot_q8_0x2(w, x, y, acc):
    for i in range(64):
        acc[i] = 0.0
    nb = x.shape[0] // 32
    b = 0
    while b + 2 <= nb:
        o = b * 34
        d0, d1 = _f16t(w, o), _f16t(w, o + 34)
        q = w[o : o + 68]  # (68,) two blocks
        xb = x[b * 32 : b * 32 + 64]  # (64,)
        yb = y[b * 32 : b * 32 + 64]  # (64,)
        for i in range(32):
            a0 = d0 * np.float32(np.int8(q[2 + i]))
            a1 = d1 * np.float32(np.int8(q[36 + i]))
            acc[i] += a0 * xb[i] + a1 * xb[32 + i]
            acc[32 + i] += a0 * yb[i] + a1 * yb[32 + i]
        b += 2
    while b < nb:
        o = b * 34
        d0 = _f16t(w, o)
        for i in range(32):
            a0 = d0 * np.float32(np.int8(w[o + 2 + i]))
            acc[i] += a0 * x[b * 32 + i]
            acc[32 + i] += a0 * y[b * 32 + i]
        b += 1
    return _acc_sum(acc, 32), _acc_sum(acc[32:], 32)


@_jit(fastmath=True, inline="always")
def _dot_32x2(code, w, x, y, xs, ys, acc):
    """_dot_32 for two rows of x at once (``xs``, ``ys``: their sums per block)."""
    bs = _size32(code)
    for i in range(32):
        acc[i] = 0.0
    mins = np.float32(0.0)
    mins2 = np.float32(0.0)
    nb = x.shape[0] // 32
    b = 0
    while b + 4 <= nb:
        o = b * bs
        (d0, d1, d2, d3), m, (h0, h1, h2, h3) = _heads4(code, w, o, bs)
        if code == Q4_1 or code == Q5_1:
            mins += _mins4(m, xs, b)
            mins2 += _mins4(m, ys, b)
        xb = x[b * 32 : b * 32 + 128]  # (128,)
        yb = y[b * 32 : b * 32 + 128]  # (128,)
        for i in range(16):
            a0, c0 = _lo_hi(code, w, o, h0, i)
            a1, c1 = _lo_hi(code, w, o + bs, h1, i)
            a2, c2 = _lo_hi(code, w, o + 2 * bs, h2, i)
            a3, c3 = _lo_hi(code, w, o + 3 * bs, h3, i)
            a0, c0, a1, c1 = d0 * a0, d0 * c0, d1 * a1, d1 * c1
            a2, c2, a3, c3 = d2 * a2, d2 * c2, d3 * a3, d3 * c3
            acc[i] += (
                a0 * xb[i] + c0 * xb[16 + i] + a1 * xb[32 + i] + c1 * xb[48 + i]
                + a2 * xb[64 + i] + c2 * xb[80 + i] + a3 * xb[96 + i] + c3 * xb[112 + i]
            )  # fmt: skip
            acc[16 + i] += (
                a0 * yb[i] + c0 * yb[16 + i] + a1 * yb[32 + i] + c1 * yb[48 + i]
                + a2 * yb[64 + i] + c2 * yb[80 + i] + a3 * yb[96 + i] + c3 * yb[112 + i]
            )  # fmt: skip
        b += 4
    while b < nb:
        o = b * bs
        d0, m0, h0 = _head32(code, w, o)
        if code == Q4_1 or code == Q5_1:
            mins += m0 * xs[b]
            mins2 += m0 * ys[b]
        for i in range(16):
            a0, c0 = _lo_hi(code, w, o, h0, i)
            a0, c0 = d0 * a0, d0 * c0
            acc[i] += a0 * x[b * 32 + i] + c0 * x[b * 32 + 16 + i]
            acc[16 + i] += a0 * y[b * 32 + i] + c0 * y[b * 32 + 16 + i]
        b += 1
    return _acc_sum(acc, 16) + mins, _acc_sum(acc[16:], 16) + mins2


@_jit()
def _dot_rows2(code, w, x, y, xs, ys, out_x, out_y, r0, r1):
    """out_x[r], out_y[r] = w[r] . x, w[r] . y for the rows [r0, r1) of a matrix of a
    type in PAIR_TYPES (``code`` literal), the pair dot inlined into the row loop."""
    literally(code)
    acc = np.empty(64, dtype=np.float32)  # both rows' partial sums
    for r in range(r0, r1):
        if WIDE:
            out_x[r], out_y[r] = _b32_row2(code, w[r], x, y, xs, ys)
        elif code == Q8_0:
            out_x[r], out_y[r] = _dot_q8_0x2(w[r], x, y, acc)
        else:
            out_x[r], out_y[r] = _dot_32x2(code, w[r], x, y, xs, ys, acc)


@_jit(inline="always")
def _dot(code, w, x, xs, acc):
    """Row w of type ``code`` (one of DOT_TYPES) dotted with x. Inlined into
    _dot_rows, where ``code`` is a constant, so only its branch is left."""
    if WIDE:  # the 512-bit IR dots (kernel_wide.py)
        if code == Q4_K or code == Q5_K:
            return _dot_k_wide(code, w, x, xs, acc)
        if code == Q6_K:
            return _dot_q6_k_wide(w, x, xs, acc)
        return _b32_row(code, w, x, xs)  # Q8_0, Q4_0 .. Q5_1: the whole row in IR
    if code == Q4_K:
        return _dot_q4_k(w, x, xs, acc)
    elif code == Q5_K:
        return _dot_q5_k(w, x, xs, acc)
    elif code == Q6_K:
        return _dot_q6_k(w, x, xs, acc)
    elif code == Q8_0:
        return _dot_q8_0(w, x, xs, acc)
    elif code == Q4_0 or code == Q4_1 or code == Q5_0 or code == Q5_1:
        return _dot_32(code, w, x, xs, acc)
    return np.float32(0.0)


@_jit()
def _dot_rows(code, w, x, xs, y, r0, r1):
    """y[r] = w[r] . x for the rows [r0, r1) of a matrix of type ``code`` (literal).

    The row loop is here and the 32-element types' and Q8_0's dots are inlined into
    it: as two calls per row (array arguments and all) they cost ~60 ns a row more,
    which on SmolLM2's 576-wide Q4_1 rows was 1.8x the whole (143 -> 79 ns a row).
    The K-quants' dots stay one call per row: inlined, the Q4_K dot ran 1.6x faster
    on 512-wide rows but ~15% slower on 8192-wide ones (the 1B's down matrix) and no
    faster on 2048 (one thread, thread CPU time, best of 40; 2026-12-06)."""
    literally(code)
    acc = np.empty(ACC_LANES, dtype=np.float32)  # the dot's partial sums
    for r in range(r0, r1):
        y[r] = _dot(code, w[r], x, xs, acc)


@_jit(fastmath=True)
def _sums(x, n):
    """Sums of x over each run of n ((in,) -> (in // n,))."""
    out = np.empty(x.shape[0] // n, dtype=np.float32)
    for j in range(out.shape[0]):
        s = np.float32(0.0)
        for i in range(n):
            s += x[j * n + i]
        out[j] = s
    return out
