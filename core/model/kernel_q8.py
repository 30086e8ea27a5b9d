"""Products with 8-bit activations (opt-in: ``--activations q8``), on the CPU's VNNI
dot instruction.

The default products keep activations float32 and multiply every weight in float32
(on AVX-512 about memory-bound since the K-quants' dots were written for it,
kernel_wide.WIDE; 7-8 G weights/s per thread on Q4_K, compute-bound, before).
llama.cpp
instead rounds each run of activations to int8 with one float scale and multiplies the
integer quants by the integer activations, four byte products summed per 32-bit lane
per instruction (``vpdpbusd``, AVX-512 VNNI or AVX-VNNI). This module does the same for
the types a Q4_K_M / Q8_0 / Q4_0 / Q4_1 model is made of: one activation scale per 32
for the 32-element types, per 256 for the K-quants (RUN; their sub-block scales are
integers, folded in with ``vpdpwssd``). Results differ from the float32 products by the
activations' rounding, as llama.cpp's do: so it is an opt-in speed mode, never the
default.

numba does not emit ``vpdpbusd`` from a loop (LLVM 22 gives neither it nor
``pmaddwd`` from an int8 x uint8 reduction), so the inner step is written as LLVM IR
through ``numba.extending.intrinsic`` (``_block``): per block, the weights' quants are
unpacked in registers (never stored) once for up to four rows of activations, and each
row's sums are scaled into eight float32 lanes of its ``acc`` (a load and a store per
block); the weights PREFETCH bytes ahead are asked for meanwhile. Only a CPU with VNNI
runs these kernels (:func:`available`); numba keys its cache on the CPU's features, so
a cached kernel never runs elsewhere.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import literally, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernel_base import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    _f16t,
    _jit,
    ir_at,
    ir_fn,
    ir_literal,
    ir_prefetch,
    target_has,
)
from .kernel_dots import _k_scales

ROWS_PER_CHUNK = 16  # output rows per prange unit (as core/model/kernels.py's)


def available() -> bool:
    """Whether the CPU numba compiles for has a 256-bit ``vpdpbusd``: AVX-512 VNNI with
    AVX-512 VL, or AVX-VNNI (LLVM lowers the same intrinsic to either)."""
    return (target_has("avx512vnni") and target_has("avx512vl")) or target_has("avxvnni")


# ---- the IR building blocks -------------------------------------------------------

_i8, _i16, _i32, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V8I32, _V8F32 = ir.VectorType(_i8, 32), ir.VectorType(_i32, 8), ir.VectorType(_f32, 8)
_V16I16, _V16I32 = ir.VectorType(_i16, 16), ir.VectorType(_i32, 16)


def _load32(builder, ptr, at: int):
    """The 32 bytes at byte ``at`` past ``ptr`` (an i8* cast to <32 x i8>*)."""
    p = builder.gep(builder.bitcast(ptr, _i8.as_pointer()), [ir.Constant(_i32, at)])
    return builder.load(builder.bitcast(p, _V32I8.as_pointer()), align=1)


def _splat8(builder, v, vty):
    one = builder.insert_element(ir.Constant(vty, None), v, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, None), ir.Constant(_V8I32, [0] * 8))


def _dpbusd(builder, u, s):
    """<8 x i32>: lane k = the sum of the four byte products u[4k+i] * s[4k+i], u's bytes
    unsigned and s's signed (vpdpbusd on a zero accumulator)."""
    fn = ir_fn(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32, [_V8I32] * 3)
    zero = ir.Constant(_V8I32, None)
    return builder.call(fn, [zero, builder.bitcast(u, _V8I32), builder.bitcast(s, _V8I32)])


def _sums8(builder, vs):
    """Eight <8 x i32> -> one <8 x i32> whose lane k is the sum of vs[k]'s lanes: three
    rounds of pairwise shuffles and adds (7 adds, not 8 horizontal reductions)."""

    def fold(a, b, lo, hi):
        sa = builder.shuffle_vector(a, b, ir.Constant(_V8I32, lo))
        sb = builder.shuffle_vector(a, b, ir.Constant(_V8I32, hi))
        return builder.add(sa, sb)

    r1 = [
        fold(vs[i], vs[i + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15])
        for i in (0, 2, 4, 6)
    ]  # lanes: pair sums of (v_i, v_i+1) interleaved
    r2 = [
        fold(r1[i], r1[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
        for i in (0, 2)
    ]
    return fold(r2[0], r2[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


# ---- one block of each type, as intrinsics ----------------------------------------
#
# A block's weights are unpacked once into eight 32-byte operands, then multiplied
# with each row of activations given (one, two or four, as kernel_dots.py's pair dots:
# so n rows of x cost less than n times one). Per row, the 32-element types' eight
# vpdpbusd results are summed per run of 32 (_sums8) and scaled by the weights' and the
# activations' scales; a K-quant's go through its integer sub-block scales into one
# int32 vector (_k_rows) and take one float scale per block.


def _weights_q4_k(context, builder, bp, d, sc, sct):
    """Q4_K: sub-block j's nibbles (unsigned), its x at 32j; scale d * sc[j]."""
    mask, four = ir.Constant(_V32I8, [15] * 32), ir.Constant(_V32I8, [4] * 32)
    ops = []
    for p in range(4):  # 32 bytes: sub-block 2p in the low nibbles, 2p+1 in the high
        q = _load32(builder, bp, 16 + 32 * p)
        ops += [builder.and_(q, mask), builder.lshr(q, four)]
    scp = ir_at(context, builder, sct, sc, ir.Constant(_i32, 0), _i32)
    muls = []
    for j in range(8):  # sub-block j's scale in every 16-bit lane
        s = builder.trunc(builder.load(builder.gep(scp, [ir.Constant(_i32, j)])), _i16)
        one = builder.insert_element(ir.Constant(_V16I16, None), s, ir.Constant(_i32, 0))
        muls.append(builder.shuffle_vector(one, one, ir.Constant(_V16I32, [0] * 16)))
    return ops, [False] * 8, muls, None


def _weights_q6_k(context, builder, bp, d, sc, sct):
    """Q6_K: run j of 32 (signed, -32..31), its x at 32j; two scales of 16 per run,
    lanes 0-3 and 4-7 of its vpdpbusd (integer), then d."""
    v16i8 = ir.VectorType(_i8, 16)
    sp = builder.gep(builder.bitcast(bp, _i8.as_pointer()), [ir.Constant(_i32, 192)])
    sc16 = builder.sext(
        builder.load(builder.bitcast(sp, v16i8.as_pointer()), align=1), _V16I16
    )  # (16,) the block's signed scales

    def splat(n):
        return ir.Constant(_V32I8, [n] * 32)

    ops, muls = [], []
    for h in range(2):  # two halves of 128: ql 64 bytes, qh 32
        ql0, ql1 = _load32(builder, bp, 64 * h), _load32(builder, bp, 64 * h + 32)
        qh = _load32(builder, bp, 128 + 32 * h)
        lows = (
            builder.and_(ql0, splat(15)),
            builder.and_(ql1, splat(15)),
            builder.lshr(ql0, splat(4)),
            builder.lshr(ql1, splat(4)),
        )
        for r in range(4):
            hi = (
                builder.and_(builder.lshr(qh, splat(2 * r)), splat(3))
                if r
                else builder.and_(qh, splat(3))
            )
            raw = builder.or_(lows[r], builder.shl(hi, splat(4)))  # 0..63
            ops.append(builder.sub(raw, splat(32)))  # -32..31
            j = 4 * h + r  # the run's place in the block: scales 2j, 2j + 1
            muls.append(
                builder.shuffle_vector(
                    sc16, sc16, ir.Constant(_V16I32, [2 * j] * 8 + [2 * j + 1] * 8)
                )
            )
    return ops, [True] * 8, muls, None


def _weights32(code: int, n: int):
    """Q8_0, Q4_0, Q4_1: n (1-8) blocks of 32 from bp, block k's x at 32k; scale the
    block's float16 d (Q4_1's mins are the caller's)."""
    size = {Q8_0: 34, Q4_0: 18, Q4_1: 20}[code]
    v16i8 = ir.VectorType(_i8, 16)

    def quants(builder, bp, at):
        if code == Q8_0:
            return _load32(builder, bp, at + 2)
        p = builder.gep(
            builder.bitcast(bp, _i8.as_pointer()),
            [ir.Constant(_i32, at + (2 if code == Q4_0 else 4))],
        )
        v = builder.load(builder.bitcast(p, v16i8.as_pointer()), align=1)  # (16,) 32 nibbles
        lo = builder.and_(v, ir.Constant(v16i8, [15] * 16))  # elements 0-15
        hi = builder.lshr(v, ir.Constant(v16i8, [4] * 16))  # elements 16-31
        q = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
        return builder.sub(q, ir.Constant(_V32I8, [8] * 32)) if code == Q4_0 else q

    def weights(context, builder, bp, d, sc, sct):
        ops, ws = [], ir.Constant(_V8F32, None)
        for k in range(n):
            ops.append(quants(builder, bp, size * k))
            p = builder.gep(builder.bitcast(bp, _i8.as_pointer()), [ir.Constant(_i32, size * k)])
            h = builder.load(builder.bitcast(p, ir.HalfType().as_pointer()), align=1)
            ws = builder.insert_element(ws, builder.fpext(h, _f32), ir.Constant(_i32, k))
        return ops, [code != Q4_1] * n, None, ws

    return weights


_WEIGHTS = {Q4_K: _weights_q4_k, Q6_K: _weights_q6_k}


def _k_rows(context, builder, sig, args, nr, ops, us, signed, muls, psign):
    """A K-quant block times rows t .. t + nr - 1: per run of 32, pmaddubsw (byte
    products summed in pairs, 16 bits: at most 2 * 63 * 127, no saturation) then
    vpdpwssd with the run's integer scales, all eight runs into one int32 vector;
    then once per block, d * the row's activation scale for these 256 (xd[t + i, b])."""
    _, _, _, wt, _, _, _, _, xt, xdt, tt, acct = sig.args
    _, _, _, w_, o_, d_, sc_, xo_, x_, xd_, t_, acc_ = args
    maddubs = ir_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8])
    dpwssd = ir_fn(builder, "llvm.x86.avx512.vpdpwssd.256", _V8I32, [_V8I32] * 3)
    xa = context.make_array(xt)(context, builder, x_)
    xda = context.make_array(xdt)(context, builder, xd_)
    acca = context.make_array(acct)(context, builder, acc_)
    blk = builder.udiv(xo_, ir.Constant(xo_.type, 256))  # xd's column: one per 256
    zero = ir.Constant(t_.type, 0)
    for i in range(nr):
        row = builder.add(t_, ir.Constant(t_.type, i))
        xp = cgutils.get_item_pointer(context, builder, xt, xa, [row, xo_])
        isum = ir.Constant(_V8I32, None)
        for k in range(8):
            xv = _load32(builder, xp, 32 * k)
            if signed[k]:  # x takes q's sign: |q| . sign(q) x = q . x
                xv = builder.call(psign, [xv, ops[k]])
            p16 = builder.call(maddubs, [us[k], xv])  # (16,) i16 pair sums
            isum = builder.call(
                dpwssd, [isum, builder.bitcast(p16, _V8I32), builder.bitcast(muls[k], _V8I32)]
            )
        xdv = builder.load(cgutils.get_item_pointer(context, builder, xdt, xda, [row, blk]))
        scale = _splat8(builder, builder.fmul(d_, xdv), _V8F32)
        accp = cgutils.get_item_pointer(
            context, builder, acct, acca, [builder.add(zero, ir.Constant(t_.type, i)), zero]
        )
        accv = builder.bitcast(accp, _V8F32.as_pointer())
        f = builder.fmul(builder.sitofp(isum, _V8F32), scale)
        builder.store(builder.fadd(builder.load(accv, align=4), f), accv, align=4)


@intrinsic(prefer_literal=True)
def _block(typingctx, code, n_ops, n_rows, w, o, d, sc, xo, x8, xd, t, acc):
    """The block of type ``code`` at w[o] (n_ops: 8, or 1 trailing block of a 32-element
    type) times the activations x8[t + i, xo:] for i < n_rows (1, 2 or 4; the block
    unpacked once for all), each row's sums scaled by xd[t + i] and added to acc[i].
    ``code``, ``n_ops``, ``n_rows``: constants. d, sc: Q4_K's and Q6_K's scales."""
    kind, n, nr = ir_literal(code), ir_literal(n_ops), ir_literal(n_rows)
    weights = _WEIGHTS.get(kind) or _weights32(kind, n)

    def codegen(context, builder, sig, args):
        wt, _, _, sct, _, xt, xdt, tt, acct = sig.args[3:]
        w_, o_, d_, sc_, xo_, x_, xd_, t_, acc_ = args[3:]
        bp = ir_at(context, builder, wt, w_, o_, _i8)
        ir_prefetch(builder, bp)  # the weights kernel_base.PREFETCH bytes on
        ops, signed, muls, ws = weights(context, builder, bp, d_, sc_, sct)
        absb = ir_fn(builder, "llvm.abs.v32i8", _V32I8, [_V32I8, ir.IntType(1)])
        psign = ir_fn(builder, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8, _V32I8])
        # |q| once per block, for every row (|-128| = 128 read unsigned)
        us = [
            builder.call(absb, [q, ir.Constant(ir.IntType(1), 0)]) if sg else q
            for q, sg in zip(ops, signed)
        ]
        xa = context.make_array(xt)(context, builder, x_)
        xda = context.make_array(xdt)(context, builder, xd_)
        acca = context.make_array(acct)(context, builder, acc_)
        zero = ir.Constant(t_.type, 0)
        if ws is None:  # a K-quant: one activation scale per 256, integer sub-block scales
            _k_rows(context, builder, sig, args, nr, ops, us, signed, muls, psign)
            return context.get_dummy_value()
        run = builder.udiv(xo_, ir.Constant(xo_.type, 32))  # xd's column of x8[:, xo]
        for i in range(nr):
            row = builder.add(t_, ir.Constant(t_.type, i))
            xp = cgutils.get_item_pointer(context, builder, xt, xa, [row, xo_])
            dots = []
            for k in range(8):
                if k >= n:
                    dots.append(ir.Constant(_V8I32, None))
                    continue
                xv = _load32(builder, xp, 32 * k)
                if signed[k]:  # x takes q's sign: |q| . sign(q) x = q . x
                    xv = builder.call(psign, [xv, ops[k]])
                dot = _dpbusd(builder, us[k], xv)
                dots.append(builder.mul(dot, muls[k]) if muls else dot)
            xdp = cgutils.get_item_pointer(context, builder, xdt, xda, [row, run])
            if n == 8:
                xds = builder.load(builder.bitcast(xdp, _V8F32.as_pointer()), align=4)
            else:  # one block: lane 0
                xds = builder.insert_element(
                    ir.Constant(_V8F32, None), builder.load(xdp), ir.Constant(_i32, 0)
                )
            accp = cgutils.get_item_pointer(
                context, builder, acct, acca, [builder.add(zero, ir.Constant(t_.type, i)), zero]
            )
            accv = builder.bitcast(accp, _V8F32.as_pointer())
            f = builder.fmul(builder.sitofp(_sums8(builder, dots), _V8F32), builder.fmul(ws, xds))
            builder.store(builder.fadd(builder.load(accv, align=4), f), accv, align=4)
        return context.get_dummy_value()

    return types.none(code, n_ops, n_rows, w, o, d, sc, xo, x8, xd, t, acc), codegen


# ---- the activations, and one row ---------------------------------------------------


@_jit(entry=True, fastmath=True)
def quantize_x(x, x8, xd, xs):
    """x (T, in) float32 -> x8 (T, in) int8 with one scale per run of ``run`` values
    in xd (T, in // run), run = in // xd.shape[1]: 32 for the 32-element types, 256
    for the K-quants (their sub-block scales are integers, so a whole block's sums
    add up as integers, as llama.cpp's Q8_K); and xs (T, in // 32) float32 = the
    scale times the sum of each 32's int8 values (the mins' share). Rounded to
    nearest, |x8| <= 127; a run of zeros has scale 0."""
    run = x.shape[1] // xd.shape[1]
    for t in range(x.shape[0]):
        for j in range(xd.shape[1]):
            m = np.float32(0.0)
            for i in range(run):
                m = max(m, abs(x[t, j * run + i]))
            d = m / np.float32(127.0)
            inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
            for i in range(run):
                x8[t, j * run + i] = np.int8(np.rint(x[t, j * run + i] * inv))
            xd[t, j] = d
            for k in range(run // 32):
                s = 0
                for i in range(32):
                    s += x8[t, j * run + k * 32 + i]
                xs[t, j * (run // 32) + k] = d * np.float32(s)


@_jit(fastmath=True, inline="always")
def _rows(code, nr, w, x8, xd, xs, t, acc, sc, mins, out, r):
    """Row w of W (type ``code``) times activation rows t .. t + nr - 1 (nr: 1, 2 or 4,
    a constant; each block unpacked once for all): out[t + i, r]. Scratch: acc (4, 8)
    float32, sc (8,) int32, mins (4,) float32 (the mins' share, Q4_K's and Q4_1's)."""
    for i in range(nr):
        mins[i] = 0.0
        for k in range(8):
            acc[i, k] = 0.0
    n_in = x8.shape[1]
    if code == Q4_K:
        for b in range(n_in // 256):
            o = b * 144
            ks = w[o + 4 : o + 16]  # (12,) packed 6-bit scales and mins
            dmin = _f16t(w, o + 2)
            for j in range(8):
                s_, m_ = _k_scales(ks, j)
                sc[j] = np.int32(s_)
                for i in range(nr):
                    mins[i] += dmin * m_ * xs[t + i, b * 8 + j]
            _block(Q4_K, 8, nr, w, o, _f16t(w, o), sc, b * 256, x8, xd, t, acc)
    elif code == Q6_K:
        for b in range(n_in // 256):
            o = b * 210
            _block(Q6_K, 8, nr, w, o, _f16t(w, o + 208), sc, b * 256, x8, xd, t, acc)
    else:
        size = 34 if code == Q8_0 else 18 if code == Q4_0 else 20
        nb = n_in // 32
        z = np.float32(0.0)
        k = 0
        while k + 8 <= nb:
            _block(code, 8, nr, w, k * size, z, sc, k * 32, x8, xd, t, acc)
            k += 8
        while k < nb:
            _block(code, 1, nr, w, k * size, z, sc, k * 32, x8, xd, t, acc)
            k += 1
        if code == Q4_1:  # + m_k * sum(x_k) per block: a negative "mins"
            for k in range(nb):
                m = _f16t(w, k * 20 + 2)
                for i in range(nr):
                    mins[i] -= m * xs[t + i, k]
    for i in range(nr):
        y = np.float32(0.0)
        for k in range(8):
            y += acc[i, k]
        out[t + i, r] = y - mins[i]


@_jit(parallel=True)
def _products(code, w, x8, xd, xs, y):
    """y (T, out) = the rows of W (type ``code``, literal) times each row of x8 (T, in),
    activations x8 * xd as :func:`quantize_x` made them; parallel over chunks of
    ROWS_PER_CHUNK rows of W, each chunk read once for all T rows (it stays in cache)."""
    literally(code)
    n_out, n_x = w.shape[0], x8.shape[0]
    for u in prange((n_out + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK):
        acc = np.empty((4, 8), dtype=np.float32)  # a row's eight float32 lanes, per row of x
        sc = np.empty(8, dtype=np.int32)  # a Q4_K block's sub-block scales
        mins = np.empty(4, dtype=np.float32)  # per row of x
        r0 = u * ROWS_PER_CHUNK
        r1 = min(n_out, r0 + ROWS_PER_CHUNK)
        t = 0
        while t + 4 <= n_x:  # rows of x four at a time: each block unpacked once
            for r in range(r0, r1):
                _rows(code, 4, w[r], x8, xd, xs, t, acc, sc, mins, y, r)
            t += 4
        if t + 2 <= n_x:
            for r in range(r0, r1):
                _rows(code, 2, w[r], x8, xd, xs, t, acc, sc, mins, y, r)
            t += 2
        if t < n_x:
            for r in range(r0, r1):
                _rows(code, 1, w[r], x8, xd, xs, t, acc, sc, mins, y, r)


# one entry point per type, as core/model/kernels.py's (the code a constant in each)
@_jit(entry=True)
def q8_q4_k(w, x8, xd, xs, y):
    _products(Q4_K, w, x8, xd, xs, y)


@_jit(entry=True)
def q8_q6_k(w, x8, xd, xs, y):
    _products(Q6_K, w, x8, xd, xs, y)


@_jit(entry=True)
def q8_q8_0(w, x8, xd, xs, y):
    _products(Q8_0, w, x8, xd, xs, y)


@_jit(entry=True)
def q8_q4_0(w, x8, xd, xs, y):
    _products(Q4_0, w, x8, xd, xs, y)


@_jit(entry=True)
def q8_q4_1(w, x8, xd, xs, y):
    _products(Q4_1, w, x8, xd, xs, y)


# code -> its 8-bit-activation product, and the activations' run per scale it takes
PRODUCTS = {Q4_K: q8_q4_k, Q6_K: q8_q6_k, Q8_0: q8_q8_0, Q4_0: q8_q4_0, Q4_1: q8_q4_1}
RUN = {Q4_K: 256, Q6_K: 256, Q8_0: 32, Q4_0: 32, Q4_1: 32}
