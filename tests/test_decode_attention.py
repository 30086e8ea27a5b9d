"""The compiled decoding attention (attention.decode_attention, core/model/kernel_attn.py)
against softmax(q kᵀ) v written out in float64: each query over its own slot and its
own positions only, in chunks merged exactly, with windows and Gemma 2's soft cap, and
every index checked before the kernel reads raw memory; keys and values stored as
float16 (-ctk/-ctv f16) widened exactly as they are read."""

from __future__ import annotations

import numpy as np
import pytest

from core.model import attention, quant
from core.model.attention import decode_attention


def textbook(q, kc, vc, slots, lo, hi, softcap=0.0, back=None):
    """The same product in float64, one (query, kv head, head) at a time; head j stops
    back[j] positions short of hi."""
    n, KV, g, hd = q.shape
    back = np.zeros(g, dtype=int) if back is None else back
    out = np.empty((n, KV, g, hd))
    for i in range(n):
        for h in range(KV):
            for j in range(g):
                end = hi[i] - back[j]
                k = kc[slots[i], h, lo[i] : end].astype(np.float64)  # (m, hd)
                v = vc[slots[i], h, lo[i] : end].astype(np.float64)
                s = q[i, h, j].astype(np.float64) @ k.T  # (m,)
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[i, h, j] = (p / p.sum()) @ v
    return out


def spans(slots, lo, hi) -> np.ndarray:
    return np.stack([np.asarray(slots), np.asarray(lo), np.asarray(hi)], axis=1)  # (n, 3)


def arrays(rng, n, KV, g, hd, slots, cap):
    q = (rng.standard_normal((n, KV, g, hd)) / np.sqrt(hd)).astype(np.float32)
    kc = rng.standard_normal((slots, KV, cap, hd)).astype(np.float32)
    vc = rng.standard_normal((slots, KV, cap, hd)).astype(np.float32)
    return q, kc, vc


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "KV,g,hd", [(3, 3, 64), (1, 8, 32), (2, 1, 16)], ids=["smollm", "mqa", "mha"]
)
def test_one_query_per_sequence_over_its_own_positions(monkeypatch, threads, KV, g, hd):
    """Sequences of very different lengths in one call: the longest sets the chunk
    size, so the short ones run as one full chunk and empty ones (merged as nothing);
    positions past each one's length hold huge values that would show if read."""
    rng = np.random.default_rng(KV * 100 + g)
    q, kc, vc = arrays(rng, 4, KV, g, hd, 6, 700)
    slots, lo, hi = np.array([5, 0, 2, 3]), np.array([0, 0, 0, 130]), np.array([1, 650, 70, 511])
    for s, b in zip(slots, hi):
        kc[s, :, b:], vc[s, :, b:] = 1e30, 1e30
    monkeypatch.setattr(quant, "_threads", threads)  # the chunking follows the threads
    got = decode_attention(q, kc, vc, spans(slots, lo, hi))
    np.testing.assert_allclose(got, textbook(q, kc, vc, slots, lo, hi), rtol=1e-5, atol=2e-6)


def test_chunks_merge_to_one_softmax_for_any_chunk_count(monkeypatch):
    """The same query split into 1..many chunks gives the one softmax each time (a
    wrong rescale of a chunk's sum or values would differ by far more)."""
    rng = np.random.default_rng(3)
    q, kc, vc = arrays(rng, 1, 2, 4, 32, 1, 1000)
    q *= 6.0  # peaked scores: a chunk's maximum far from another's
    want = textbook(q, kc, vc, [0], [0], [1000])
    for per_thread in (1, 3, 50):
        monkeypatch.setattr(attention, "ATTN_ITEMS_PER_THREAD", per_thread)
        got = decode_attention(q, kc, vc, spans([0], [0], [1000]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_window_and_softcap():
    rng = np.random.default_rng(4)
    q, kc, vc = arrays(rng, 2, 2, 2, 16, 2, 300)
    q *= 20.0  # scores beyond the cap, so that tanh matters
    slots, lo, hi = np.array([1, 0]), np.array([217, 0]), np.array([300, 40])
    got = decode_attention(q, kc, vc, spans(slots, lo, hi), softcap=30.0)
    want = textbook(q, kc, vc, slots, lo, hi, softcap=30.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    plain = textbook(q, kc, vc, slots, lo, hi)
    assert np.abs(plain - want).max() > 1e-2  # the cap changed the result


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "k16,v16", [(True, True), (True, False), (False, True)], ids=["both", "keys", "values"]
)
def test_float16_keys_and_values_are_read_as_the_values_they_hold(monkeypatch, threads, k16, v16):
    """A float16 cache's keys or values (each apart, as -ctk/-ctv set them) give the
    product of exactly the float16 values, widened: the float64 textbook on the same
    rounded arrays, as tight as float32's. Rounding did change the inputs (the float32
    arrays' product differs by far more), so reading the bits as anything else, or
    the float32 arrays, would fail."""
    rng = np.random.default_rng(8)
    q, kc, vc = arrays(rng, 3, 2, 4, 64, 4, 600)
    q *= 4.0  # peaked scores: the keys' rounding shows in the result
    slots, lo, hi = np.array([3, 0, 1]), np.array([0, 0, 100]), np.array([600, 37, 400])
    k = kc.astype(np.float16) if k16 else kc
    v = vc.astype(np.float16) if v16 else vc
    for s_, b in zip(slots, hi):  # past each length: values that would show if read
        k[s_, :, b:], v[s_, :, b:] = 6e4, 6e4
    monkeypatch.setattr(quant, "_threads", threads)
    got = decode_attention(q, k, v, spans(slots, lo, hi))
    want = textbook(q, k, v, slots, lo, hi)  # float64 from the float16 values
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    unrounded = textbook(q, kc, vc, slots, lo, hi)
    assert np.abs(unrounded - want).max() > 1e-4


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("per_thread", [1, 4, 40])
def test_heads_that_stop_short_see_only_their_own_positions(monkeypatch, f16, per_thread):
    """A draft's tokens as one query's heads (attention.attend): head j reads up to
    hi - back[j]. The positions a head must not see hold huge values that would show,
    and with many chunks some chunks hold none of a head's positions (merged as
    nothing); both cache types, both thread counts."""
    rng = np.random.default_rng(9)
    q, kc, vc = arrays(rng, 2, 2, 6, 32, 2, 900)
    q *= 3.0
    if f16:
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    slots, lo, hi = np.array([1, 0]), np.array([0, 0]), np.array([900, 700])
    back = np.array([0, 5, 1, 2, 4, 3])  # (g,)
    monkeypatch.setattr(attention, "ATTN_ITEMS_PER_THREAD", per_thread)
    want = textbook(q, kc, vc, slots, lo, hi, back=back)
    for threads in (1, 2):
        monkeypatch.setattr(quant, "_threads", threads)
        got = decode_attention(q, kc, vc, spans(slots, lo, hi), back=back)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    vc[1, :, 895:900], vc[0, :, 695:700] = 6e4, 6e4  # the last 5: head 0 alone sees all
    got = decode_attention(q, kc, vc, spans(slots, lo, hi), back=back)
    want = textbook(q, kc, vc, slots, lo, hi, back=back)
    assert np.abs(want[:, :, 1]).max() < 10 < np.abs(want[:, :, 0]).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_scores_far_below_the_maximum_weigh_nothing_and_nan_stays():
    """The kernel's own exp: a key scoring ~1e4 below the best adds nothing (exp
    underflows to 0, as numpy's), a score of exactly the maximum weighs 1, and a NaN
    score makes its head's result NaN rather than being clamped away."""
    q = np.zeros((1, 1, 2, 4), dtype=np.float32)
    q[0, 0, :, 0] = 100.0
    kc = np.zeros((1, 1, 3, 4), dtype=np.float32)
    vc = np.zeros((1, 1, 3, 4), dtype=np.float32)
    kc[0, 0, :, 0] = [1.0, -100.0, 1.0]  # scores 100, -1e4, 100
    vc[0, 0, :, 1] = [2.0, 1e6, 4.0]
    got = decode_attention(q, kc, vc, spans([0], [0], [3]))
    np.testing.assert_array_equal(got[0, 0, :, 1], [3.0, 3.0])  # (2 + 4) / 2, exactly
    kc[0, 0, 1, 0] = np.nan
    assert np.isnan(decode_attention(q, kc, vc, spans([0], [0], [3]))[0, 0]).all()


def test_the_kernels_exp_is_within_an_ulp_of_the_exact_value():
    """kernel_attn._exp, the softmax's exponential, against float64's over [-87, 0]
    (scores less their maximum): within one unit in the last place of float32 at
    every point, exp(0) exactly 1, -inf to 0 and NaN kept."""
    from numba import njit

    from core.model.kernel_attn import _exp

    @njit
    def each(x, out):
        for i in range(x.size):
            out[i] = _exp(x[i])

    rng = np.random.default_rng(10)
    x = np.concatenate([np.linspace(-87, 0, 200_001), -rng.exponential(3.0, 100_000)]).astype(
        np.float32
    )
    x = x[x >= -87]
    got = np.empty_like(x)
    each(x, got)
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(got - exact) / np.spacing(exact.astype(np.float32))
    assert ulps.max() < 1.0, ulps.max()
    edges = np.empty(3, dtype=np.float32)
    each(np.array([0.0, -np.inf, np.nan], dtype=np.float32), edges)
    assert edges[0] == 1.0 and edges[1] == 0.0 and np.isnan(edges[2])


def test_non_finite_keys_stay_with_their_sequence():
    rng = np.random.default_rng(5)
    q, kc, vc = arrays(rng, 2, 1, 2, 16, 2, 64)
    kc[0, 0, 10] = np.nan  # inside sequence 0's positions
    vc[1, 0, 50] = np.inf  # past sequence 1's length: never read
    got = decode_attention(q, kc, vc, spans([0, 1], [0, 0], [64, 50]))
    assert np.isnan(got[0]).all()
    np.testing.assert_allclose(
        got[1], textbook(q, kc, vc, [0, 1], [0, 0], [64, 50])[1], rtol=1e-5, atol=2e-6
    )


@pytest.mark.parametrize(
    "slots,lo,hi,back",
    [
        ([2], [0], [8], 0), ([-1], [0], [8], 0), ([0], [0], [9], 0), ([0], [-1], [8], 0),
        ([0], [5], [5], 0), ([0], [2], [8], 6), ([0], [0], [8], -1),
    ],
    ids=[
        "slot", "negative-slot", "past-capacity", "negative-start", "no-keys",
        "stopped-before-its-start", "past-the-end",
    ],
)  # fmt: skip
def test_indices_are_checked_before_the_kernel_reads(slots, lo, hi, back):
    rng = np.random.default_rng(6)
    q, kc, vc = arrays(rng, 1, 1, 1, 8, 2, 8)
    with pytest.raises(IndexError):
        decode_attention(q, kc, vc, spans(slots, lo, hi), back=[back])


def test_shapes_and_layouts_are_checked():
    rng = np.random.default_rng(7)
    q, kc, vc = arrays(rng, 1, 2, 1, 8, 1, 8)
    with pytest.raises(ValueError):
        decode_attention(q[:, :1], kc, vc, spans([0], [0], [8]))  # one kv head of two
    with pytest.raises(ValueError):
        decode_attention(q, kc[:, :, ::2], vc[:, :, ::2], spans([0], [0], [4]))  # strided
    with pytest.raises(ValueError):
        decode_attention(q.astype(np.float64), kc, vc, spans([0], [0], [8]))
    with pytest.raises(ValueError):  # one stop per head
        decode_attention(q, kc, vc, spans([0], [0], [8]), back=[0, 1])
    with pytest.raises(ValueError):  # a cache holds float32 or float16, nothing else
        decode_attention(q, kc.astype(np.float64), vc, spans([0], [0], [8]))
