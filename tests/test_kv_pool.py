"""The KV pool: running sequences share one pair of arrays, and decoding rows of
a batch attend in one compiled call. It must give exactly what standalone caches
give, commit memory only as positions are used, and every slot must come back."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from core.model.attention import PooledDecode
from core.model.kv_cache import KVPool
from core.model.llama import BatchItem
from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.test_model_shapes import build


@pytest.mark.parametrize("regime", ["blocked", "gemm", "gemv"])
@pytest.mark.parametrize(
    "kw", [dict(n_heads=4, n_kv_heads=2), dict(n_heads=8, n_kv_heads=1)], ids=["gqa2", "mqa"]
)
def test_pooled_decode_equals_standalone_caches(tmp_path, kw, regime):
    model, _ = build(tmp_path, **kw)
    model.lin.force(regime)  # every small-batch product, whichever calibration chose
    rng = np.random.default_rng(0)
    pool = model.new_pool(6, 48)
    lengths = [3, 11, 7, 1, 20]
    pooled = [pool.acquire() for _ in lengths]
    pool.release(pooled[2])  # a free slot inside the attended range
    alone = [model.new_cache(48) for _ in lengths]
    prompts = [rng.integers(0, 128, size=n) for n in lengths]
    for i, p in enumerate(prompts):
        if i != 2:
            model([BatchItem(p, pooled[i])])
        model([BatchItem(p, alone[i])])
    for _step in range(4):
        nxt = [np.array([int(rng.integers(0, 128))]) for _ in lengths]
        # slot 2 is free; the last item runs 3 tokens at once (per-sequence path)
        nxt[-1] = rng.integers(0, 128, size=3)
        live = [i for i in range(len(lengths)) if i != 2]
        items = [BatchItem(nxt[i], pooled[i]) for i in live]
        assert PooledDecode.plan(items, [(k, k + 1) for k in range(len(items))]) is not None
        got = model(items)
        want = [model([BatchItem(nxt[i], alone[i])])[0] for i in live]
        for g, w in zip(got, want):
            # Pooled rows go through the blocked small-batch product, a lone row through
            # gemv: the same sums in another order, so float32 rounding differs by a few
            # ulps of the largest logit (seen: 1.2e-5 on logits up to 21 with OpenBLAS's
            # Haswell kernels). A wrong slot, length or mask moves logits by whole units.
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())
    for i in live:
        assert pooled[i].tokens == alone[i].tokens


def test_pool_commits_memory_only_for_used_positions(smollm_path):
    from core.model.weights import open_model_file

    _, cfg = open_model_file(smollm_path)

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 1e6

    r0 = rss_mb()
    pool = KVPool(cfg, 8, 2048)  # 755 MB of address space
    assert pool.k.nbytes + pool.v.nbytes > 700e6
    caches = [pool.acquire() for _ in range(8)]
    for c in caches:
        c.k[:, :, :16] = 1.0
        c.v[:, :, :16] = 1.0
    assert rss_mb() - r0 < 40  # ~12 MB touched, not 755
    assert not np.any(pool.k[:, :, :, 16:100])  # untouched positions read as zeros


def test_scheduler_returns_every_slot(smollm_path):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256, n_parallel=3, draft_max=0))
    try:
        pool = eng.scheduler.pool
        assert pool.n_free == 3
        results = []

        def run(i):
            prompt = eng.tokenizer.encode(f"Count to {i}:")
            results.append(
                eng.complete(
                    prompt, SamplingParams(n_predict=4 + i, temperature=0, ignore_eos=True)
                )
            )

        threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 5 and all(r.stop_type == "limit" for r in results)
        # a cancelled request gives its slot back too
        gen = eng.generate(
            eng.tokenizer.encode("Tell me a long story."),
            SamplingParams(n_predict=200, ignore_eos=True),
        )
        next(gen)  # running: it holds a slot
        assert pool.n_free == 2
        gen.close()  # cancels
        deadline = time.time() + 30
        while pool.n_free != 3 and time.time() < deadline:
            time.sleep(0.01)
        assert pool.n_free == 3
        # and the prefix cache kept a compact copy that a later request reuses
        done = eng.complete(
            eng.tokenizer.encode("Count to 1:"), SamplingParams(n_predict=2, temperature=0)
        )
        assert done.timings.cache_n > 0
    finally:
        eng.stop()


def test_pool_reclaims_an_untouched_slot_and_refuses_a_reused_one(tmp_path):
    model, _ = build(tmp_path)
    pool = model.new_pool(2, 32)
    a = pool.acquire()
    model([BatchItem(np.arange(5, 12), a)])
    slot, gen, keys = a.slot, pool.generation(a), a.k[:, :, :7].copy()
    pool.release(a)
    got = pool.reclaim(slot, gen, list(range(5, 10)))
    assert got is not None and got.slot == slot and got.tokens == list(range(5, 10))
    assert np.array_equal(got.k[:, :, :7], keys)  # the KV was left in place
    assert pool.reclaim(slot, gen, [1]) is None  # in use now
    pool.release(got)
    # the least recently released slot is handed out first, so the other one is reused
    b = pool.acquire()
    assert b.slot != slot
    pool.release(b)
    c, d = pool.acquire(), pool.acquire()  # now both slots are handed out again
    pool.release(c)
    pool.release(d)
    assert pool.reclaim(slot, gen, [1]) is None  # its contents may have changed


def test_switch_back_reuses_the_slot_without_copying(smollm_path, ref_dir):
    """Mix A -> mix B -> mix A: A's KV is still in its slot when A comes back."""
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256, n_parallel=2, draft_max=0))
    aid = eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf")
    try:
        pool = eng.scheduler.pool
        copies = []
        real = type(pool._caches[0]).copy_prefix_from

        def counting(self, other, n):
            if self.pool is pool:
                copies.append(n)
            return real(self, other, n)

        prompt = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
        p = SamplingParams(n_predict=2, temperature=0)
        type(pool._caches[0]).copy_prefix_from = counting
        try:
            eng.complete(prompt, p, mix={})  # A: base model
            eng.complete(prompt, p, mix={aid: 1.0})  # B: cold under its own mix
            done = eng.complete(prompt, p, mix={})  # A again
        finally:
            type(pool._caches[0]).copy_prefix_from = real
        assert done.timings.cache_n == len(prompt) - 1
        assert copies == []
    finally:
        eng.stop()


def test_kv_reservation_failure_is_a_clear_error_and_keeps_the_old_model(smollm_path, monkeypatch):
    import core.model.kv_cache as kv
    from core.serve.engine import ModelLoadError

    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=128, n_parallel=2, draft_max=0))
    try:
        old_model, old_sched = eng.model, eng.scheduler

        def refuse(shape, dtype):
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(kv, "_zero_pages", refuse)
        eng.requested_ctx = 1 << 20
        with pytest.raises(
            ModelLoadError,
            match=r"KV cache for 2 sequences of 1048576 tokens.*"
            r"-c/--ctx-size",
        ):
            eng.load_model(smollm_path)
        assert eng.model is old_model and eng.scheduler is old_sched and eng.ready
        monkeypatch.undo()
        done = eng.complete(
            eng.tokenizer.encode("Hello"), SamplingParams(n_predict=3, temperature=0)
        )
        assert done.timings.predicted_n == 3
    finally:
        eng.stop()


def test_a_pool_larger_than_memory_can_be_reserved(smollm_path):
    """A long context on many slots reserves address space only (MAP_NORESERVE):
    64 GB maps on a 24 GB machine, where the kernel's overcommit heuristic refuses
    a plain anonymous mapping of that size."""
    import sys

    from core.model.weights import open_model_file

    if not sys.platform.startswith("linux"):
        pytest.skip("MAP_NORESERVE semantics are Linux's")
    _, cfg = open_model_file(smollm_path)
    per_token = 2 * cfg.n_layers * cfg.kv_dim * 4  # k and v
    slots = 8
    capacity = (64 << 30) // (per_token * slots)
    pool = KVPool(cfg, slots, capacity)
    assert pool.k.nbytes + pool.v.nbytes >= 63 << 30
    c = pool.acquire()
    c.k[:, :, :4] = 1.0  # and it is usable
    assert c.k[0, 0, 3, 0] == 1.0 and pool.v[0, 0, 0, capacity - 1, 0] == 0.0


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("regime", ["blocked", "gemv"])
def test_non_finite_garbage_past_a_length_does_not_leak_into_pooled_decode(
    tmp_path, garbage, regime
):
    """A slot once used by a sequence whose activations blew up holds NaN/inf rows.
    Pooled decode reads them (masked) when the slot's next sequence is shorter than its
    neighbour; masked scores are exact zeros, and 0 x NaN used to poison the healthy
    sequence (issue #15, item 2). Its logits must equal a clean slot's exactly."""
    model, _ = build(tmp_path, n_heads=4, n_kv_heads=2)
    model.lin.force(regime)
    rng = np.random.default_rng(1)
    short, long = rng.integers(0, 128, size=4), rng.integers(0, 128, size=15)

    def decode(dirty: bool) -> list[np.ndarray]:
        pool = model.new_pool(3, 48)
        a, b = pool.acquire(), pool.acquire()
        if dirty:  # what a failed previous occupant may leave in slot a (and a free slot)
            pool.k[:, a.slot], pool.v[:, a.slot] = garbage, garbage
            pool.k[:, 2], pool.v[:, 2] = garbage, garbage
        model([BatchItem(short, a)])
        model([BatchItem(long, b)])
        out = []
        for tok in (5, 9, 17, 33):
            items = [BatchItem(np.array([tok]), a), BatchItem(np.array([tok + 1]), b)]
            assert PooledDecode.plan(items, [(0, 1), (1, 2)]) is not None
            out += model(items)
        return out

    clean, dirty = decode(False), decode(True)
    for c, d in zip(clean, dirty):
        assert np.isfinite(d).all()
        np.testing.assert_array_equal(c, d)


def test_a_sequence_with_non_finite_keys_fails_alone_in_pooled_decode(tmp_path):
    """Its own NaN keys stay its own: the neighbour decoded in the same matmul is exact."""
    model, _ = build(tmp_path, n_heads=4, n_kv_heads=2)
    rng = np.random.default_rng(2)
    p0, p1 = rng.integers(0, 128, size=6), rng.integers(0, 128, size=9)
    pool = model.new_pool(2, 32)
    a, b = pool.acquire(), pool.acquire()
    model([BatchItem(p0, a)])
    model([BatchItem(p1, b)])
    alone = model.new_cache(32)
    model([BatchItem(p1, alone)])
    pool.k[1, a.slot, :, 2] = np.nan  # inside a's length: a's own state is broken
    got = model([BatchItem(np.array([7]), a), BatchItem(np.array([8]), b)])
    want = model([BatchItem(np.array([8]), alone)])[0]
    assert not np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[1], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_release_with_scrub_zeroes_only_the_rows_written(tmp_path):
    model, _ = build(tmp_path)
    pool = model.new_pool(2, 32)
    a = pool.acquire()
    model([BatchItem(np.arange(3, 10), a)])
    a.trim(5)  # rows past the length were still written: they are scrubbed too
    assert a.written == 7
    pool.k[:, a.slot, :, :7] = np.nan
    pool.release(a, scrub=True)
    assert not pool.k[:, a.slot].any() and not pool.v[:, a.slot].any()
    assert a.written == 0


def test_float16_pool_and_caches_round_what_they_store(tmp_path):
    """-ctk/-ctv f16 on a tiny model: the pool, its slots, standalone caches and the
    prefix cache's snapshots all hold float16 (keys and values each in its own type);
    what is stored reads back as the float16 rounding of what was written, and
    kv_bytes counts 2 bytes a value."""
    from core.model.kv_cache import KVCache, kv_bytes

    model, _ = build(tmp_path, n_heads=4, n_kv_heads=2)
    cfg = model.cfg
    assert kv_bytes(2, 3, 8, 100, 1, ("f16", "f32")) == 2 * 3 * 8 * (2 + 4) * 100
    assert (
        kv_bytes(2, 3, 8, 100, 2, ("f16", "f16")) == kv_bytes(2, 3, 8, 100) == 2 * 3 * 8 * 8 * 100
    )
    pool = KVPool(cfg, 2, 16, ("f16", "f32"))
    assert pool.k.dtype == np.float16 and pool.v.dtype == np.float32
    c = pool.acquire()
    assert c.k.dtype == np.float16 and c.types == ("f16", "f32")
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)  # (n, KV, hd)
    v = rng.standard_normal((3, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    for li in range(cfg.n_layers):
        keys, values = c.update_and_fetch(li, k, v, [1, 2, 3])
    assert np.array_equal(keys, k.transpose(1, 0, 2).astype(np.float16))  # (KV, 3, hd)
    assert np.array_equal(values, v.transpose(1, 0, 2))
    snap = pool.snapshot(c, 8)
    assert (snap.k.dtype, snap.v.dtype) == (np.float16, np.float32)
    assert np.array_equal(snap.state[1], c.state[1]) and snap.tokens == [1, 2, 3]
    alone = KVCache(cfg, 4, types=("f16", "f16"))
    assert alone.nbytes == KVCache(cfg, 4).nbytes // 2
