"""The 512-bit dots (AVX-512): GGUF blocks times float32 activations written as LLVM IR
through ``numba.extending.intrinsic``, for the types most models are made of (Q4_K, Q5_K,
Q6_K; Q4_0, Q4_1, Q8_0). core/model/kernel_dots.py's ``_dot`` and core/model/kernels.py's
launcher call them where numba compiles for AVX-512 (``WIDE``); elsewhere the numba
loops of kernel_dots.py run, and every codegen here emits nothing."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import literally, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernel_base import (
    BLOCK,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _jit,
    _size32,
    _size256,
    ir_at,
    ir_fn,
    ir_literal,
    ir_prefetch,
    target_has,
)

# ---- the 512-bit dots (AVX-512): the K-quants' blocks as LLVM IR ----
#
# The numba dots (kernel_dots.py) spend more than half their instructions on each block's head:
# a Q4_K block's 8 scales and 8 mins unpacked one byte at a time (~150 scalar
# instructions per 256 weights, against ~85 vector ones for the products). Here the
# head is three 32-bit words and one vector conversion (llama.cpp's kmask unpacking);
# Q6_K's, one int8 vector. A Q4_K low nibble's float value comes from a table: per
# sub-block j, the 16 values d * scale_j * q (q = 0..15) in one register, indexed by
# the nibbles with ``vpermps`` (which reads an index's low four bits only, so the low
# nibbles need no mask), on the shuffle port; a high nibble is converted, on the FMA
# port, so the two halves' work runs side by side. The values are the numba dot's:
# (d * scale_j) * q rounded once, times x, summed in float32 (another order); the
# mins through x's sums per 32. Written as IR because numba emits neither the permute
# nor the word-level unpacking from a loop. The dequantizers below build their values
# with gguf.quants' own operations, so they give its bits. Only where the target has
# AVX-512 (WIDE): elsewhere the numba code runs, and these emit nothing.

WIDE = target_has("avx512f")
ACC_LANES = 8 * 16 + 8  # eight 16-lane sums (independent FMA chains), then the mins' 8

_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_V16F, _V16I, _V8F = ir.VectorType(_f32, 16), ir.VectorType(_i32, 16), ir.VectorType(_f32, 8)
_V16B, _V32B = ir.VectorType(_i8, 16), ir.VectorType(_i8, 32)
_V8I = ir.VectorType(_i32, 8)


def _c(n):
    return ir.Constant(_i32, n)


def _b32(n):
    """32 bytes, each n."""
    return ir.Constant(_V32B, [n] * 32)


def _i32x16(n):
    """16 int32 lanes, each n."""
    return ir.Constant(_V16I, [n] * 16)


def _load32(builder, bp, at):
    """The 32 bytes at byte ``at`` past bp."""
    return builder.load(builder.bitcast(builder.gep(bp, [_c(at)]), _V32B.as_pointer()), align=1)


def _splat(builder, vec, lane, vty):
    """``vty`` with every lane = lane ``lane`` of ``vec``."""
    n = vty.count
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_i32, n), [lane] * n))


def _half(builder, v, k, ext):
    """Bytes 16k .. 16k + 16 of the <32 x i8> v as 16 int32 lanes (``ext``: zext/sext)."""
    lanes = ir.Constant(_V16I, list(range(16 * k, 16 * k + 16)))
    return ext(builder.shuffle_vector(v, v, lanes), _V16I)


def _q5_k_subblocks(builder, bp):
    """A Q5_K block's eight sub-blocks of 32 values, (j, (32,) int8 0..31) for j in 0..7:
    sub-block 2p the low nibbles of qs[32p:32p+32] (qs at byte 48), 2p + 1 their high
    nibbles, each with its fifth bit, bit j of qh's byte i (qh: 32 bytes at 16)."""
    qh = _load32(builder, bp, 16)
    for p in range(4):
        q = _load32(builder, bp, 48 + 32 * p)
        for h in range(2):
            j = 2 * p + h
            nib = builder.and_(q, _b32(15)) if h == 0 else builder.lshr(q, _b32(4))
            bit = builder.and_(builder.lshr(qh, _b32(j)) if j else qh, _b32(1))
            yield j, builder.or_(nib, builder.shl(bit, _b32(4)))


def _q4_k_head(builder, bp):
    """A Q4_K block's head at bp: (16,) float lanes 0-7 d * scale_j, and (8,) dmin * min_j."""
    hp = builder.bitcast(bp, ir.HalfType().as_pointer())
    d = builder.fpext(builder.load(hp, align=1), _f32)
    dmin = builder.fpext(builder.load(builder.gep(hp, [_c(1)]), align=1), _f32)
    # the 12 scale bytes as three words: 6-bit scales and mins of sub-blocks 0-3, and
    # the low four bits of 4-7, whose top two bits are 0-3's spare ones
    up = builder.bitcast(builder.gep(bp, [_c(4)]), _i32.as_pointer())
    u0, u1, u2 = (builder.load(builder.gep(up, [_c(k)]), align=1) for k in range(3))
    k1, k2, k3 = _c(0x3F3F3F3F), _c(0x0F0F0F0F), _c(0x03030303)

    def top2(u):  # the top two bits of u's four bytes, as bits 4-5
        return builder.shl(builder.and_(builder.lshr(u, _c(6)), k3), _c(4))

    words = [
        builder.and_(u0, k1),  # scales 0-3
        builder.or_(builder.and_(u2, k2), top2(u0)),  # scales 4-7
        builder.and_(u1, k1),  # mins 0-3
        builder.or_(builder.and_(builder.lshr(u2, _c(4)), k2), top2(u1)),  # mins 4-7
    ]
    v4 = ir.Constant(ir.VectorType(_i32, 4), None)
    for k, wd in enumerate(words):
        v4 = builder.insert_element(v4, wd, _c(k))
    sm = builder.uitofp(builder.zext(builder.bitcast(v4, _V16B), _V16I), _V16F)  # (16,)
    dv = builder.insert_element(ir.Constant(_V16F, None), d, _c(0))
    f = builder.fmul(sm, _splat(builder, dv, 0, _V16F))
    mins = builder.shuffle_vector(sm, sm, ir.Constant(_V8I, list(range(8, 16))))
    dm = builder.insert_element(ir.Constant(_V8F, None), dmin, _c(0))
    return f, builder.fmul(mins, _splat(builder, dm, 0, _V8F))


def _q6_k_head(builder, bp):
    """A Q6_K block's head at bp: (16,) d * the scale of each run of 16."""
    hp = builder.bitcast(builder.gep(bp, [_c(208)]), ir.HalfType().as_pointer())
    d = builder.fpext(builder.load(hp, align=1), _f32)
    sp = builder.bitcast(builder.gep(bp, [_c(192)]), _V16B.as_pointer())
    sc = builder.sitofp(builder.sext(builder.load(sp, align=1), _V16I), _V16F)  # (16,)
    dv = builder.insert_element(ir.Constant(_V16F, None), d, _c(0))
    return builder.fmul(sc, _splat(builder, dv, 0, _V16F))


def _q6_k_runs(builder, bp):
    """A Q6_K block's 8 runs of 32 values (-32..31) as <32 x i8>, run 4j + r at x
    offset 128j + 32r, its scales 8j + 2r (first 16) and 8j + 2r + 1."""
    runs = []
    for j in range(2):  # halves of 128: ql 64 bytes, qh 32
        ql0, ql1, qh = (
            _load32(builder, bp, 64 * j),
            _load32(builder, bp, 64 * j + 32),
            _load32(builder, bp, 128 + 32 * j),
        )
        lows = (
            builder.and_(ql0, _b32(15)),
            builder.and_(ql1, _b32(15)),
            builder.lshr(ql0, _b32(4)),
            builder.lshr(ql1, _b32(4)),
        )
        for r in range(4):  # run r of 32: its two high bits at bit 2r of qh
            hi = builder.and_(builder.lshr(qh, _b32(2 * r)) if r else qh, _b32(3))
            runs.append(builder.sub(builder.or_(lows[r], builder.shl(hi, _b32(4))), _b32(32)))
    return runs


def _k_open(context, builder, sig, args):
    """What the one-row Q4_K and Q5_K dots (_q4_k_wide, _q5_k_wide: the same head) do
    first: the block's pointer (prefetched ahead); its head's scales f (lanes 0-7
    d * scale_j); dmin * m_j * xs[xo/32 + j] added to acc[128:136]; x's pointer at xo;
    and the pointers of the eight 16-lane sums in acc."""
    wt, _, xt, _, xst, acct = sig.args
    w_, o_, x_, xo_, xs_, acc_ = args
    bp = ir_at(context, builder, wt, w_, o_, _i8)  # the block's first byte
    ir_prefetch(builder, bp)
    f, mins = _q4_k_head(builder, bp)  # lanes 0-7: d * scale_j; (8,) dmin * min_j
    xsp = ir_at(context, builder, xst, xs_, builder.udiv(xo_, ir.Constant(xo_.type, 32)), _V8F)
    accp = ir_at(context, builder, acct, acc_, ir.Constant(xo_.type, 0), _f32)
    fma8 = ir_fn(builder, "llvm.fma.v8f32", _V8F, [_V8F] * 3)
    mp = builder.bitcast(builder.gep(accp, [_c(128)]), _V8F.as_pointer())
    m = builder.call(fma8, [mins, builder.load(xsp, align=4), builder.load(mp, align=4)])
    builder.store(m, mp, align=4)
    xp = ir_at(context, builder, xt, x_, xo_, _f32)
    ap = [builder.bitcast(builder.gep(accp, [_c(16 * j)]), _V16F.as_pointer()) for j in range(8)]
    return bp, f, xp, ap


@intrinsic
def _q4_k_wide(typingctx, w, o, x, xo, xs, acc):
    """The Q4_K block at byte o of row w times x[xo : xo + 256]: the products added to
    acc[:128] (eight 16-lane sums, one per sub-block), dmin * m_j * xs[xo/32 + j] to
    acc[128:136]."""

    def codegen(context, builder, sig, args):
        if not WIDE:  # never called there (_dot branches on WIDE): emit no AVX-512
            return context.get_dummy_value()
        bp, f, xp, ap = _k_open(context, builder, sig, args)
        # the products: sub-block 2p in the low nibbles of bytes 16 + 32p .. + 32, 2p + 1
        # in the high ones; their x at xo + 64p and xo + 64p + 32
        fma = ir_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
        permvar = ir_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I])
        iota = ir.Constant(_V16F, [float(k) for k in range(16)])
        accs = [builder.load(p, align=4) for p in ap]

        def x16(at):  # x[xo + at : xo + at + 16]
            p = builder.bitcast(builder.gep(xp, [_c(at)]), _V16F.as_pointer())
            return builder.load(p, align=4)

        for p in range(4):
            qp = builder.bitcast(builder.gep(bp, [_c(16 + 32 * p)]), _V32B.as_pointer())
            q = builder.load(qp, align=1)  # (32,) two sub-blocks of nibbles
            # each half of the bytes widened once, to 16 int32 lanes: its low nibbles
            # index the table, its high ones are the lanes shifted right by 4 (rather
            # than the bytes shifted, masked and widened again: the Q4_K dot 4-10%
            # faster, one and two threads, the same bits, 2026-12-07)
            wide = [_half(builder, q, k, builder.zext) for k in range(2)]  # (16,) each
            # the low nibbles: d * scale * q from a table (vpermps reads an index's low
            # four bits: no mask), on the shuffle port
            lo = 2 * p
            table = builder.fmul(_splat(builder, f, lo, _V16F), iota)  # (16,) d*sc*(0..15)
            t = None
            for k in range(2):
                vals = builder.call(permvar, [table, wide[k]])  # (16,)
                xv = x16(64 * p + 16 * k)
                t = builder.fmul(vals, xv) if t is None else builder.call(fma, [vals, xv, t])
            accs[lo] = builder.fadd(accs[lo], t)
            # the high nibbles: converted (vcvtdq2ps, on the FMA port), summed, then
            # scaled once. Splitting the work between the two ports measured 1.5x the
            # numba dot, against 1.35x with tables or conversions alone (one thread,
            # 1024 rows of the 1B's gate matrix in cache, 2026-12-06)
            t = None
            for k in range(2):
                vals = builder.sitofp(builder.lshr(wide[k], _i32x16(4)), _V16F)  # (16,) q
                xv = x16(64 * p + 32 + 16 * k)
                t = builder.fmul(vals, xv) if t is None else builder.call(fma, [vals, xv, t])
            sc = _splat(builder, f, lo + 1, _V16F)
            accs[lo + 1] = builder.call(fma, [sc, t, accs[lo + 1]])
        for p, a in zip(ap, accs):
            builder.store(a, p, align=4)
        return context.get_dummy_value()

    return types.none(w, o, x, xo, xs, acc), codegen


@_jit(fastmath=True)
def _dot_k_wide(code, w, x, xs, acc):
    """_dot_q4_k or _dot_q5_k (``code``) through _q4_k_wide or _q5_k_wide; ``acc``:
    ACC_LANES floats of scratch."""
    literally(code)
    for i in range(ACC_LANES):
        acc[i] = 0.0
    for b in range(x.shape[0] // 256):
        if code == Q4_K:
            _q4_k_wide(w, b * 144, x, b * 256, xs, acc)
        else:
            _q5_k_wide(w, b * 176, x, b * 256, xs, acc)
    s = np.float32(0.0)
    for i in range(128):
        s += acc[i]
    m = np.float32(0.0)
    for i in range(128, ACC_LANES):
        m += acc[i]
    return s - m


@intrinsic
def _q6_k_wide(typingctx, w, o, x, xo, acc):
    """The Q6_K block at byte o of row w times x[xo : xo + 256], added to acc[:128]
    (eight 16-lane sums)."""

    def codegen(context, builder, sig, args):
        if not WIDE:  # never called there (_dot branches on WIDE): emit no AVX-512
            return context.get_dummy_value()
        wt, _, xt, _, acct = sig.args
        w_, o_, x_, xo_, acc_ = args
        bp = ir_at(context, builder, wt, w_, o_, _i8)  # the block's first byte
        ir_prefetch(builder, bp)
        s = _q6_k_head(builder, bp)  # (16,) d * scale of each 16
        fma = ir_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
        xp = ir_at(context, builder, xt, x_, xo_, _f32)
        accp = ir_at(context, builder, acct, acc_, ir.Constant(xo_.type, 0), _f32)
        ap = [
            builder.bitcast(builder.gep(accp, [_c(16 * j)]), _V16F.as_pointer()) for j in range(8)
        ]
        accs = [builder.load(p, align=4) for p in ap]

        for n, v in enumerate(_q6_k_runs(builder, bp)):
            j, r = divmod(n, 4)
            for k in range(2):  # 16 weights, one scale
                vals = builder.sitofp(_half(builder, v, k, builder.sext), _V16F)  # (16,) q
                xq = builder.gep(xp, [_c(128 * j + 32 * r + 16 * k)])
                t = builder.fmul(
                    vals, builder.load(builder.bitcast(xq, _V16F.as_pointer()), align=4)
                )
                sk = _splat(builder, s, 8 * j + 2 * r + k, _V16F)
                i = (2 * n + k) % 8
                accs[i] = builder.call(fma, [sk, t, accs[i]])
        for p, a in zip(ap, accs):
            builder.store(a, p, align=4)
        return context.get_dummy_value()

    return types.none(w, o, x, xo, acc), codegen


@_jit(fastmath=True)
def _dot_q6_k_wide(w, x, xs, acc):
    """_dot_q6_k through _q6_k_wide; ``acc``: ACC_LANES floats of scratch."""
    for i in range(128):
        acc[i] = 0.0
    for b in range(x.shape[0] // 256):
        _q6_k_wide(w, b * 210, x, b * 256, acc)
    s = np.float32(0.0)
    for i in range(128):
        s += acc[i]
    return s


@intrinsic(prefer_literal=True)
def _k_deq(typingctx, code, w, o, out, oo):
    """The Q4_K, Q5_K or Q6_K (``code``, a constant) block at byte o of row w dequantized
    into out[oo : oo + 256] with gguf.quants' own float32 operations, so its bits: Q4_K
    (d * scale_j) * q - dmin * m_j, per sub-block j a 16-entry table of those values
    indexed by the nibbles; Q5_K the same with q (0..31) converted; Q6_K (d * scale) * q."""
    kind = ir_literal(code)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in (Q4_K, Q5_K, Q6_K):  # never called (kernels' _run
            return context.get_dummy_value()  # branches on WIDE): emit nothing
        wt, _, outt, _ = sig.args[1:]
        w_, o_, out_, oo_ = args[1:]
        bp = ir_at(context, builder, wt, w_, o_, _i8)
        op = ir_at(context, builder, outt, out_, oo_, _f32)

        def put(vals, at):  # out[oo + at : oo + at + 16] = vals
            dst = builder.bitcast(builder.gep(op, [_c(at)]), _V16F.as_pointer())
            builder.store(vals, dst, align=4)

        if kind == Q6_K:
            s = _q6_k_head(builder, bp)  # (16,) d * scale of each 16
            for n, v in enumerate(_q6_k_runs(builder, bp)):
                j, r = divmod(n, 4)
                for k in range(2):  # 16 values, one scale
                    q16 = builder.sitofp(_half(builder, v, k, builder.sext), _V16F)
                    put(builder.fmul(q16, _splat(builder, s, 8 * j + 2 * r + k, _V16F)),
                        128 * j + 32 * r + 16 * k)  # fmt: skip
            return context.get_dummy_value()
        f, mins = _q4_k_head(builder, bp)  # lanes 0-7: d * scale_j; (8,) dmin * min_j
        if kind == Q5_K:  # values 0..31 converted
            for j, v in _q5_k_subblocks(builder, bp):
                for k in range(2):  # no FMA: a product rounded, then the difference
                    q16 = builder.sitofp(_half(builder, v, k, builder.zext), _V16F)
                    a = builder.fmul(_splat(builder, f, j, _V16F), q16)
                    put(builder.fsub(a, _splat(builder, mins, j, _V16F)), 32 * j + 16 * k)
            return context.get_dummy_value()
        permvar = ir_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I])
        iota = ir.Constant(_V16F, [float(k) for k in range(16)])
        for p in range(4):
            qp = builder.bitcast(builder.gep(bp, [_c(16 + 32 * p)]), _V32B.as_pointer())
            q = builder.load(qp, align=1)  # (32,) two sub-blocks of nibbles
            wide = [_half(builder, q, k, builder.zext) for k in range(2)]  # (16,) each
            for h in range(2):  # low nibbles: sub-block 2p; high: 2p + 1
                j = 2 * p + h
                # no FMA: a product rounded, then the difference, as numpy does
                a = builder.fmul(_splat(builder, f, j, _V16F), iota)
                table = builder.fsub(a, _splat(builder, mins, j, _V16F))  # (16,)
                for k in range(2):  # vpermps reads an index's low four bits
                    nib = wide[k] if h == 0 else builder.lshr(wide[k], _i32x16(4))
                    vals = builder.call(permvar, [table, nib])
                    put(vals, 64 * p + 32 * h + 16 * k)
        return context.get_dummy_value()

    return types.none(code, w, o, out, oo), codegen


ROW_LANES = 2 * 16 + 8  # per row of x in _dot_block_rows: two 16-lane sums, the mins' 8


def _rows_open(context, builder, types_, values, nr):
    """What the many-row K-quant blocks (_k_block_rows) do first. ``types_`` and
    ``values``: w, o, x, t, xo, xs, acc (x (T, in), xs (T, in/32), acc 2-D). Returns
    the block's first byte (prefetched ahead), the rows t .. t + nr - 1, row i's x at
    xo, row i's lanes acc[i], and a function giving row r's xs at column xo / 32."""
    wt, _, xt, _, _, xst, acct = types_
    w_, o_, x_, t_, xo_, xs_, acc_ = values
    tt = t_.type  # the LLVM integer type of row numbers
    bp = ir_at(context, builder, wt, w_, o_, _i8)  # the block's first byte
    ir_prefetch(builder, bp)
    xa = context.make_array(xt)(context, builder, x_)
    acca = context.make_array(acct)(context, builder, acc_)
    rows = [builder.add(t_, ir.Constant(tt, i)) for i in range(nr)]
    xps = [cgutils.get_item_pointer(context, builder, xt, xa, [r, xo_]) for r in rows]
    zero = ir.Constant(tt, 0)
    aps = [
        cgutils.get_item_pointer(context, builder, acct, acca, [ir.Constant(tt, i), zero])
        for i in range(nr)
    ]

    def xs_at(r):  # row r's sums of x per 32, from the block's column on
        xsa = context.make_array(xst)(context, builder, xs_)
        col = builder.udiv(xo_, ir.Constant(xo_.type, 32))
        return cgutils.get_item_pointer(context, builder, xst, xsa, [r, col])

    return bp, rows, xps, aps, xs_at


@intrinsic(prefer_literal=True)
def _k_block_rows(typingctx, code, n_rows, w, o, x, t, xo, xs, acc):
    """The Q4_K, Q5_K or Q6_K (``code``) block at byte o of row w times
    x[t + i, xo : xo + 256] for i < n_rows (1, 2 or 4; ``code`` and ``n_rows``
    constants). The block is unpacked once and each weight's value d * scale * q made
    once, for every row; row i's products go to acc[i, :32] (two 16-lane sums), Q4_K's
    and Q5_K's mins dmin * m_j * xs[t + i, xo/32 + j] to acc[i, 32:40]."""
    kind, nr = ir_literal(code), ir_literal(n_rows)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in (Q4_K, Q5_K, Q6_K):  # never called: emit nothing
            return context.get_dummy_value()
        bp, rows, xps, aps, xs_at = _rows_open(context, builder, sig.args[2:], args[2:], nr)
        fma = ir_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)

        def vec(ptr, at, vty):  # vty at float ``at`` past ptr
            return builder.bitcast(builder.gep(ptr, [_c(at)]), vty.as_pointer())

        accs = [[builder.load(vec(a, 16 * k, _V16F), align=4) for k in range(2)] for a in aps]

        def feed(vals, at, k):  # every row: sum k += vals * x[row, xo + at : + 16]
            for i in range(nr):
                xv = builder.load(vec(xps[i], at, _V16F), align=4)
                accs[i][k] = builder.call(fma, [vals, xv, accs[i][k]])

        if kind in (Q4_K, Q5_K):  # the same head; Q5_K's fifth bits in qh (32 bytes at 16)
            f, mins = _q4_k_head(builder, bp)
            fma8 = ir_fn(builder, "llvm.fma.v8f32", _V8F, [_V8F] * 3)
            for i in range(nr):
                xsv = builder.load(builder.bitcast(xs_at(rows[i]), _V8F.as_pointer()), align=4)
                mp = vec(aps[i], 32, _V8F)
                m = builder.call(fma8, [mins, xsv, builder.load(mp, align=4)])
                builder.store(m, mp, align=4)  # a float's alignment: acc may be anywhere
        if kind == Q5_K:  # values 0..31 converted, as _q5_k_wide makes them
            for j, v in _q5_k_subblocks(builder, bp):
                sc = _splat(builder, f, j, _V16F)
                for k in range(2):
                    q16 = builder.sitofp(_half(builder, v, k, builder.zext), _V16F)
                    feed(builder.fmul(q16, sc), 32 * j + 16 * k, k)
        elif kind == Q4_K:
            permvar = ir_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I])
            iota = ir.Constant(_V16F, [float(k) for k in range(16)])
            for p in range(4):
                qp = builder.bitcast(builder.gep(bp, [_c(16 + 32 * p)]), _V32B.as_pointer())
                q = builder.load(qp, align=1)  # (32,) two sub-blocks of nibbles
                wide = [_half(builder, q, k, builder.zext) for k in range(2)]  # (16,) each
                table = builder.fmul(_splat(builder, f, 2 * p, _V16F), iota)  # d*sc*(0..15)
                for k in range(2):
                    vals = builder.call(permvar, [table, wide[k]])
                    feed(vals, 64 * p + 16 * k, k)
                sc = _splat(builder, f, 2 * p + 1, _V16F)
                for k in range(2):
                    q16 = builder.sitofp(builder.lshr(wide[k], _i32x16(4)), _V16F)
                    feed(builder.fmul(q16, sc), 64 * p + 32 + 16 * k, k)
        else:
            s = _q6_k_head(builder, bp)  # (16,) d * scale of each 16
            for n, v in enumerate(_q6_k_runs(builder, bp)):
                j, r = divmod(n, 4)
                for k in range(2):  # 16 weights, one scale
                    q16 = builder.sitofp(_half(builder, v, k, builder.sext), _V16F)
                    vals = builder.fmul(q16, _splat(builder, s, 8 * j + 2 * r + k, _V16F))
                    feed(vals, 128 * j + 32 * r + 16 * k, k)
        for i in range(nr):
            for k in range(2):
                builder.store(accs[i][k], vec(aps[i], 16 * k, _V16F), align=4)
        return context.get_dummy_value()

    return types.none(code, n_rows, w, o, x, t, xo, xs, acc), codegen


@_jit(fastmath=True, inline="always")
def _dot_block_rows(code, nr, w, x, xs, t, y, r, acc):
    """y[t + i, r] = w . x[t + i] for i < nr (1, 2 or 4, a constant), w one row of a
    Q4_K, Q5_K or Q6_K matrix, x (T, in); ``acc``: (4, ROW_LANES) float32 scratch. The
    K-quants' route for 2 to 16 rows of x (a batch of mixes, A/B compare) where WIDE:
    each block is unpacked once for up to four rows, where the dequantize-then-dot
    kernel writes every weight to a buffer and reads it back per row."""
    for i in range(nr):
        for k in range(ROW_LANES):
            acc[i, k] = 0.0
    size = _size256(code)
    for b in range(x.shape[1] // 256):
        _k_block_rows(code, nr, w, b * size, x, t, b * 256, xs, acc)
    for i in range(nr):
        s = np.float32(0.0)
        for k in range(32):
            s += acc[i, k]
        m = np.float32(0.0)
        for k in range(32, ROW_LANES):
            m += acc[i, k]
        y[t + i, r] = s - m


@intrinsic
def _q5_k_wide(typingctx, w, o, x, xo, xs, acc):
    """The Q5_K block at byte o of row w times x[xo : xo + 256]: acc as _q4_k_wide's
    (eight 16-lane sums, one per sub-block; dmin * m_j * xs[xo/32 + j] in acc[128:136]).
    Q5_K is Q4_K with a fifth bit per weight: sub-block j's in bit j of the 32 bytes
    qh. Its values (0..31) are converted, summed against x, and scaled once per
    sub-block (a 16-entry table, as Q4_K's low nibbles take, would need 32 here)."""

    def codegen(context, builder, sig, args):
        if not WIDE:  # never called there (_dot branches on WIDE): emit no AVX-512
            return context.get_dummy_value()
        bp, f, xp, ap = _k_open(context, builder, sig, args)
        fma = ir_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
        accs = [builder.load(p, align=4) for p in ap]
        for j, v in _q5_k_subblocks(builder, bp):  # (32,) 0..31
            t = None
            for k in range(2):
                vals = builder.sitofp(_half(builder, v, k, builder.zext), _V16F)  # (16,) q
                pk = builder.bitcast(builder.gep(xp, [_c(32 * j + 16 * k)]), _V16F.as_pointer())
                xv = builder.load(pk, align=4)
                t = builder.fmul(vals, xv) if t is None else builder.call(fma, [vals, xv, t])
            accs[j] = builder.call(fma, [_splat(builder, f, j, _V16F), t, accs[j]])
        for p, a in zip(ap, accs):
            builder.store(a, p, align=4)
        return context.get_dummy_value()

    return types.none(w, o, x, xo, xs, acc), codegen


# ---- the 32-element types and Q8_0 as IR (AVX-512) ----
#
# SmolLM2's Q4_1 rows are 576 and 1536 wide: 18 and 48 blocks of 20 bytes, and its
# decode step is ~80% products (py-spy). The numba dots above took its rows at 7-8 and
# 9.5-9.8 G weights/s, Q8_0 at 6-7 and 10 (one thread, cache-hot); these take them at
# 8.7-10.6 and 11.5-13.2, Q8_0 at 10-14 and 14-18 (random blocks of SmolLM2's shapes,
# the two interleaved by process, 2026-12-06). Here a block's 16 bytes of nibbles become two
# 16-lane int32 vectors (zero-extended, masked or shifted) and are converted; their
# products with x are summed in a vector, and that sum is scaled by d once per block
# (Q4_0 and Q4_1: their values d * q come from a table, _b32_table). A row's whole
# block loop is in the IR (_b32_row_ir), four 16-lane sums taking turns, added as
# vectors and then summed as a tree once a row (_hsum): the four-block calls this
# replaced kept one sum in memory, and their 64-lane sum a row, which LLVM did lane
# by lane, was 1.6x slower than the numba dot (2026-12-06). Values:
# d * (sum of q * x), which is the numba dot's (d * q) * x in another order; the
# mins (Q4_1, Q5_1) through x's sums per block, as there.
# Q5_0 and Q5_1 add a fifth bit per element from the block's 32-bit qh: element j's is
# bit j, a lane test of qh broadcast, 16 where set. Qwen2.5-0.5B's and Gemma-3-270M's
# Q4_K_M files hold most of their matrices as Q5_0 (rows 896 and 640 wide, not whole
# 256-element super-blocks); the numba dot took them at 13.6 G weights/s where Q4_0's
# IR dot takes 35 (2048x8192, 2 threads, 2026-12-06).

# per type: bytes a block, where its 16 bytes of nibbles (Q8_0: 32 int8) start, where
# qh is (Q5 types; 0: none)
B32_LAYOUT = {
    code: (BLOCK[code][1], at, qh)
    for code, at, qh in ((Q4_0, 2, 0), (Q4_1, 4, 0), (Q5_0, 6, 2), (Q5_1, 8, 4), (Q8_0, 2, 0))
}


def _b32_block(builder, bp, kind, b0):
    """The block of type ``kind`` (one of B32_LAYOUT) at byte b0 past bp, unpacked:
    its q as two (16,) float32 vectors (elements 0-15, 16-31), d, and m (Q4_1, Q5_1;
    else None) as floats."""
    size, at, qh_at = B32_LAYOUT[kind]
    hp = ir.HalfType().as_pointer()
    sixteen, zero = ir.Constant(_V16I, [16] * 16), ir.Constant(_V16I, [0] * 16)

    def q16(off):  # 16 bytes of the block at off
        p = builder.bitcast(builder.gep(bp, [_c(off)]), _V16B.as_pointer())
        return builder.load(p, align=1)

    def half_float(off):  # the f16 at byte off of the block, as a float
        return builder.fpext(
            builder.load(builder.bitcast(builder.gep(bp, [_c(off)]), hp), align=1), _f32
        )

    def fifth(qh, h):  # elements 16h..16h+15's fifth bits, as 16 or 0
        bit = [1 << (16 * h + j) for j in range(16)]  # as signed i32: bit 31 negative
        bits = ir.Constant(_V16I, [b - (1 << 32) if b >> 31 else b for b in bit])
        hit = builder.icmp_unsigned("!=", builder.and_(qh, bits), zero)
        return builder.select(hit, sixteen, zero)

    if kind == Q8_0:  # 32 int8
        halves = [builder.sext(q16(b0 + at + 16 * h), _V16I) for h in range(2)]
    else:  # 16 bytes: elements i in the low nibbles, 16 + i in the high
        q = q16(b0 + at)
        lo = builder.and_(q, ir.Constant(_V16B, [15] * 16))
        hi = builder.lshr(q, ir.Constant(_V16B, [4] * 16))
        if kind == Q4_0:  # -8..7
            eight = ir.Constant(_V16B, [8] * 16)
            halves = [builder.sext(builder.sub(v, eight), _V16I) for v in (lo, hi)]
        else:
            halves = [builder.zext(v, _V16I) for v in (lo, hi)]
        if qh_at:  # Q5_0, Q5_1: the fifth bits; Q5_0's values then -16..15
            qp = builder.bitcast(builder.gep(bp, [_c(b0 + qh_at)]), _i32.as_pointer())
            qv = builder.insert_element(ir.Constant(_V16I, None), builder.load(qp, align=1), _c(0))
            qh = _splat(builder, qv, 0, _V16I)
            halves = [builder.or_(v, fifth(qh, h)) for h, v in enumerate(halves)]
            if kind == Q5_0:
                halves = [builder.sub(v, sixteen) for v in halves]
    vals = [builder.sitofp(v, _V16F) for v in halves]  # (16,) q, twice
    m = half_float(b0 + 2) if kind in (Q4_1, Q5_1) else None
    return vals, half_float(b0), m


def _splat_float(builder, f):
    """(16,) lanes of the float f."""
    return _splat(builder, builder.insert_element(ir.Constant(_V16F, None), f, _c(0)), 0, _V16F)


def _hsum(builder, v):
    """The 16 lanes of v summed as a tree (8 + 8, 4 + 4, 2 + 2, 1 + 1): a float."""
    n = 16
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, n), list(range(n))))
        hi = builder.shuffle_vector(
            v, v, ir.Constant(ir.VectorType(_i32, n), list(range(n, 2 * n)))
        )
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _c(0))


# the types whose nibbles _b32_row reads through a table of their 16 values
TABLE_TYPES = (Q4_0, Q4_1)
ROW_GROUP = 4  # blocks a turn of _b32_row's loop (one prefetch a turn)


def _b32_table(builder, bp, kind, b0):
    """The Q4_0 or Q4_1 block at byte b0 past bp as two (16,) float32 vectors of d * q
    (elements 0-15, 16-31), and m (Q4_1) or None. The 16 values d * q (q = 0..15;
    Q4_0's q - 8) are one vector multiply, and ``vpermps`` picks each element's from
    its nibble (it reads an index's low four bits only, so the low nibbles need no
    mask), on the shuffle port: against _b32_block's two conversions and a scale, 1.2x
    on SmolLM2's Q4_1 rows (one thread, cache-hot, 2026-12-07). The values are
    gguf.quants' d * q, each rounded once."""
    permvar = ir_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I])
    size, at, _ = B32_LAYOUT[kind]
    hp = ir.HalfType().as_pointer()

    def half_float(off):  # the f16 at byte off of the block, as a float
        p = builder.bitcast(builder.gep(bp, [_c(b0 + off)]), hp)
        return builder.fpext(builder.load(p, align=1), _f32)

    qp = builder.bitcast(builder.gep(bp, [_c(b0 + at)]), _V16B.as_pointer())
    lo = builder.zext(builder.load(qp, align=1), _V16I)  # (16,) the bytes; low nibble indexes
    hi = builder.lshr(lo, ir.Constant(_V16I, [4] * 16))  # (16,) the high nibbles
    q = [float(j - 8) if kind == Q4_0 else float(j) for j in range(16)]
    table = builder.fmul(_splat_float(builder, half_float(0)), ir.Constant(_V16F, q))
    vals = [builder.call(permvar, [table, idx]) for idx in (lo, hi)]  # (16,) d * q, twice
    return vals, (half_float(2) if kind == Q4_1 else None)


def _b32_row_ir(context, builder, kind, wt, w_, n, xp0s, sp0s):
    """The body of the _b32_row intrinsics: the whole row w (type wt, value w_) of type
    ``kind``, n elements, dotted with each row of x (xp0s: float pointers to each
    one's first element; sp0s: to each one's sums per 32, for Q4_1 and Q5_1); the
    dots as floats. Each block is unpacked once for all the rows."""
    size = B32_LAYOUT[kind][0]
    fma = ir_fn(builder, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
    ity = n.type

    def i(v):
        return ir.Constant(ity, v)

    bp0 = ir_at(context, builder, wt, w_, i(0), _i8)
    # allocas in the entry block: LLVM keeps them in registers (mem2reg)
    zero = ir.Constant(_V16F, [0.0] * 16)
    sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(4)] for _ in xp0s]
    mins = [cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0)) for _ in xp0s]

    def blocks(first, count):  # blocks first .. first + count - 1 into the sums
        bp = builder.gep(bp0, [builder.mul(first, i(size))])
        if count > 1:
            ir_prefetch(builder, bp)
        xps = [builder.gep(xp0, [builder.mul(first, i(32))]) for xp0 in xp0s]
        lanes = [[builder.load(a) for a in row] for row in sums]
        mn = [None] * len(xp0s)
        for k in range(count):

            def x16(r, h, k=k):  # row r's x at block k's element 16h, 16 floats
                p = builder.gep(xps[r], [_c(32 * k + 16 * h)])
                return builder.load(builder.bitcast(p, _V16F.as_pointer()), align=4)

            j = 2 * (k % 2)  # sums j and j + 1: this block's halves
            if kind in TABLE_TYPES:  # values d * q
                vals, m = _b32_table(builder, bp, kind, k * size)
                for r, ln in enumerate(lanes):
                    for h in range(2):
                        ln[j + h] = builder.call(fma, [vals[h], x16(r, h), ln[j + h]])
            else:  # values q, the block's sum scaled by d
                vals, d, m = _b32_block(builder, bp, kind, k * size)
                ds = _splat_float(builder, d)
                jj = j + k // 2 % 2  # one sum a block: four blocks a turn of the four
                for r, ln in enumerate(lanes):
                    t = builder.fmul(vals[0], x16(r, 0))
                    t = builder.call(fma, [vals[1], x16(r, 1), t])
                    ln[jj] = builder.call(fma, [ds, t, ln[jj]])
            if m is not None:  # m * (the sum of x over the block)
                for r, sp0 in enumerate(sp0s):
                    s = builder.load(builder.gep(sp0, [builder.add(first, i(k))]), align=4)
                    mx = builder.fmul(m, s)
                    mn[r] = mx if mn[r] is None else builder.fadd(mn[r], mx)
        for row, ln in zip(sums, lanes):
            for a, v in zip(row, ln):
                builder.store(v, a)
        for a, v in zip(mins, mn):
            if v is not None:
                builder.store(builder.fadd(builder.load(a), v), a)

    nb = builder.udiv(n, i(32))  # blocks in the row
    groups = builder.udiv(nb, i(ROW_GROUP))
    with cgutils.for_range(builder, groups) as loop:
        blocks(builder.mul(loop.index, i(ROW_GROUP)), ROW_GROUP)
    done = builder.mul(groups, i(ROW_GROUP))
    with cgutils.for_range(builder, builder.sub(nb, done)) as loop:
        blocks(builder.add(done, loop.index), 1)
    dots = []
    for row, mn in zip(sums, mins):
        v = [builder.load(a) for a in row]
        total = builder.fadd(builder.fadd(v[0], v[1]), builder.fadd(v[2], v[3]))  # (16,)
        dots.append(builder.fadd(_hsum(builder, total), builder.load(mn)))
    return dots


@intrinsic(prefer_literal=True)
def _b32_row(typingctx, code, w, x, xs):
    """The whole row w of type ``code`` (one of B32_LAYOUT, a constant) dotted with x
    (in,), xs x's sums per 32 (Q4_1, Q5_1; else not read): a float32, the decode
    step's one-row dot of these types.

    The block loop is LLVM's own, so the sums stay in registers, where the four-block
    calls it replaced loaded and stored one sum in memory every call. Four 16-lane
    sums take turns, so four FMA chains run side by side (with one, each block waited
    ~4 cycles on the one before). Q4_0 and Q4_1 read their values through a table
    (_b32_table). SmolLM2's shapes, one thread, cache-hot (2026-12-07): Q4_1 576x576
    29.3 -> 22.8 us, 3072x576 143 -> 108, 576x1536 58.6 -> 48.9; its Q8_0 output
    1.78 -> 1.53 ms. The values: Q4_0's and Q4_1's d * q (rounded once) times x; the
    other types' d * (q . x) per block; the mins m * (x's sum over the block); summed
    in another order than the numba dots."""
    kind = ir_literal(code)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in B32_LAYOUT:  # never called: emit nothing
            return ir.Constant(_f32, 0.0)
        wt, xt, xst = sig.args[1:]
        w_, x_, xs_ = args[1:]
        xps, sps, n = _rows_of(context, builder, kind, [(xt, x_, xst, xs_)])
        return _b32_row_ir(context, builder, kind, wt, w_, n, xps, sps)[0]

    return types.float32(code, w, x, xs), codegen


@intrinsic(prefer_literal=True)
def _b32_row2(typingctx, code, w, x, y, xs, ys):
    """_b32_row for two rows of x at once, x and y (xs, ys their sums per 32): the two
    dots, each block unpacked once for both (A/B compare, two streams)."""
    kind = ir_literal(code)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in B32_LAYOUT:  # never called: emit nothing
            zero = ir.Constant(_f32, 0.0)
            return context.make_tuple(builder, sig.return_type, [zero, zero])
        wt, xt, yt, xst, yst = sig.args[1:]
        w_, x_, y_, xs_, ys_ = args[1:]
        xps, sps, n = _rows_of(context, builder, kind, [(xt, x_, xst, xs_), (yt, y_, yst, ys_)])
        dots = _b32_row_ir(context, builder, kind, wt, w_, n, xps, sps)
        return context.make_tuple(builder, sig.return_type, dots)

    return types.UniTuple(types.float32, 2)(code, w, x, y, xs, ys), codegen


def _rows_of(context, builder, kind, rows):
    """For _b32_row_ir: each row's x and (Q4_1, Q5_1) sums as float pointers, from
    (x type, x, xs type, xs) per row (1-D arrays), and the row length."""
    xt, x_ = rows[0][:2]
    n = cgutils.unpack_tuple(builder, context.make_array(xt)(context, builder, x_).shape, 1)[0]
    zero = ir.Constant(n.type, 0)
    xps = [ir_at(context, builder, t, a, zero, _f32) for t, a, _, _ in rows]
    sps = [ir_at(context, builder, t, a, zero, _f32) for _, _, t, a in rows]
    return xps, (sps if kind in (Q4_1, Q5_1) else []), n


@intrinsic(prefer_literal=True)
def _b32_rows(typingctx, code, n_rows, w, x, t, xs, y, r):
    """y[t + i, r] = w . x[t + i] for i < ``n_rows`` (a constant, 3 or 4): _b32_row for
    rows of a 2-D x (T, in), xs (T, in/32) their sums per 32, y (T, out); each block
    unpacked once for all the rows (three or four streams of a small model)."""
    kind, nr = ir_literal(code), ir_literal(n_rows)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in B32_LAYOUT:  # never called: emit nothing
            return context.get_dummy_value()
        wt, xt, _, xst, yt, _ = sig.args[2:]
        w_, x_, t_, xs_, y_, r_ = args[2:]
        xa = context.make_array(xt)(context, builder, x_)
        n = cgutils.unpack_tuple(builder, xa.shape, 2)[1]  # x's row length
        zero = ir.Constant(t_.type, 0)
        rows = [builder.add(t_, ir.Constant(t_.type, i)) for i in range(nr)]
        xps = [cgutils.get_item_pointer(context, builder, xt, xa, [q, zero]) for q in rows]
        sps = []
        if kind in (Q4_1, Q5_1):
            xsa = context.make_array(xst)(context, builder, xs_)
            sps = [cgutils.get_item_pointer(context, builder, xst, xsa, [q, zero]) for q in rows]
        dots = _b32_row_ir(context, builder, kind, wt, w_, n, xps, sps)
        ya = context.make_array(yt)(context, builder, y_)
        for q, d in zip(rows, dots):
            builder.store(d, cgutils.get_item_pointer(context, builder, yt, ya, [q, r_]))
        return context.get_dummy_value()

    return types.none(code, n_rows, w, x, t, xs, y, r), codegen


@intrinsic(prefer_literal=True)
def _b32_deq(typingctx, code, w, o, out, oo):
    """The block of type ``code`` (one of B32_LAYOUT, a constant) at byte o of row w
    dequantized into out[oo : oo + 32] with gguf.quants' own float32 operations, so its
    bits: d * q, and + m for Q4_1 and Q5_1 (a product rounded, then the sum: no FMA).
    The 5+ row kernel's (kernels._small_rows) and embedding rows' route for these types."""
    kind = ir_literal(code)

    def codegen(context, builder, sig, args):
        if not WIDE or kind not in B32_LAYOUT:  # never called (kernels' _run
            return context.get_dummy_value()  # branches on WIDE): emit nothing
        wt, _, outt, _ = sig.args[1:]
        w_, o_, out_, oo_ = args[1:]
        bp = ir_at(context, builder, wt, w_, o_, _i8)
        op = ir_at(context, builder, outt, out_, oo_, _f32)
        vals, d, m = _b32_block(builder, bp, kind, 0)
        ds = _splat_float(builder, d)
        for h in range(2):
            v = builder.fmul(ds, vals[h])
            if m is not None:
                v = builder.fadd(v, _splat_float(builder, m))
            dst = builder.bitcast(builder.gep(op, [_c(16 * h)]), _V16F.as_pointer())
            builder.store(v, dst, align=4)
        return context.get_dummy_value()

    return types.none(code, w, o, out, oo), codegen


# the types _deq_wide dequantizes: the K-quants of _k_deq and the B32_LAYOUT types
DEQ_WIDE_TYPES = (Q4_K, Q5_K, Q6_K, *B32_LAYOUT)


@_jit(inline="always")
def _deq_wide(code, w, e0, e1, out):
    """Elements [e0, e1) of row w (whole blocks) of type ``code`` (a constant: a K-quant
    of _k_deq's or one of B32_LAYOUT) dequantized into out[: e1 - e0], block by block:
    the kernels' dequantizers (core/model/kernels.py) where WIDE."""
    if code == Q4_K or code == Q5_K or code == Q6_K:
        bs = _size256(code)
        for b in range((e1 - e0) // 256):
            _k_deq(code, w, (e0 // 256 + b) * bs, out, b * 256)
    else:
        bs = _size32(code)
        for b in range((e1 - e0) // 32):
            _b32_deq(code, w, (e0 // 32 + b) * bs, out, b * 32)
