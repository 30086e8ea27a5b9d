"""core/model/linear.py: every regime computes x @ W.T (gemv, blocked on our threads,
packed gemm), on awkward shapes and on the real model's matrices."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from core.errors import UserError
from core.model.linear import CHUNK, SMALL_ROWS, Linear


def blas_thread_counts() -> list[int]:
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


@pytest.fixture(
    scope="module",
    params=[(1, "blocked"), (2, "blocked"), (3, "blocked"), (2, "gemm"), (2, "gemv")],
    ids=lambda p: f"threads={p[0]}-{p[1]}",
)
def lin(request):
    threads, small = request.param
    lin = Linear(threads, small=small)
    yield lin
    lin.close()


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, SMALL_ROWS, SMALL_ROWS + 1, 70])
@pytest.mark.parametrize("n_out", [1, CHUNK - 1, CHUNK, 3 * CHUNK + 5, 200])
def test_every_regime_equals_plain_matmul(lin, rows, n_out):
    rng = np.random.default_rng(rows * 1000 + n_out)
    w = rng.standard_normal((n_out, 48)).astype(np.float32)
    x = rng.standard_normal((rows, 48)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    for ctx in (lin.single_blas(), contextlib.nullcontext()):
        with ctx:
            got = lin(x, w)
        assert got.shape == (rows, n_out) and got.dtype == np.float32
        assert got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_non_contiguous_weights_fall_back_to_plain_matmul(lin):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 130)).astype(np.float32)[:, ::2]  # (40, 65) strided view
    x = rng.standard_normal((4, 65)).astype(np.float32)
    np.testing.assert_allclose(lin(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("regime", ["gemv", "gemm", "blocked"])
def test_real_matrices_every_regime_equals_plain_matmul(smollm_path, regime):
    from core.model.weights import load_weights, open_model_file

    gf, cfg = open_model_file(smollm_path)
    w = load_weights(gf, cfg)
    lin = Linear(2, small=regime)
    rng = np.random.default_rng(0)
    for m in (w.layers[0].wqkv, w.layers[3].w_down, w.output):
        x = rng.standard_normal((8, m.shape[1])).astype(np.float32)
        with lin.small_batch(regime):
            got = lin(x, m)
        np.testing.assert_allclose(got, x @ m.T, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(lin(x[:1], m), x[:1] @ m.T, rtol=1e-4, atol=1e-3)
    lin.close()


def test_single_blas_restores_the_thread_count():
    before = blas_thread_counts()
    lin = Linear(2)
    with lin.single_blas():
        inside = blas_thread_counts()
    after = blas_thread_counts()
    assert inside == [1] * len(before) and after == before


def test_split_balances_by_measured_speed_and_covers_every_block_once():
    lin = Linear(3)
    try:
        lin._rel[False] = [3.0, 1.0, 0.2]  # as if this thread were much faster than the helpers
        seen = []
        lin.split(50, lambda i, j, last: seen.append((i, j, last)))
        seen.sort()
        assert seen[0][0] == 0 and seen[-1][1] == 50 and seen[-1][2]
        assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))  # contiguous, no overlap
        assert seen[0][1] - seen[0][0] > seen[1][1] - seen[1][0]  # the fast thread got more
        # products stay exact whatever the shares, ragged tail included
        rng = np.random.default_rng(3)
        w = rng.standard_normal((5 * CHUNK + 7, 40)).astype(np.float32)
        x = rng.standard_normal((8, 40)).astype(np.float32)
        for rel in ([1.0, 1.0, 1.0], [5.0, 0.1, 0.1], [0.1, 0.1, 5.0]):
            lin._rel[False] = rel
            np.testing.assert_allclose(lin.blocked(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
        # measured speeds move the shares but keep them summing to the thread count
        lin._rel[False] = [1.0, 1.0, 1.0]
        big = rng.standard_normal((64 * CHUNK, 256)).astype(np.float32)
        xb = rng.standard_normal((8, 256)).astype(np.float32)
        for _ in range(5):
            lin.blocked(xb, big)
        assert abs(sum(lin._rel[False]) - 3.0) < 0.05 and all(r > 0 for r in lin._rel[False])
    finally:
        lin.close()


@pytest.mark.parametrize("rows", [1, 8, SMALL_ROWS + 4])
def test_side_work_runs_once_in_every_regime(lin, rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3 * CHUNK, 32)).astype(np.float32)
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    calls = []
    with lin.single_blas():
        y = lin(x, w, side=lambda: calls.append(1))
    assert calls == [1]
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 8, SMALL_ROWS])
def test_blocked_product_takes_strided_rows(lin, rows):
    # the blocked regime writes each block straight into its columns of y; a strided
    # x (a column slice, as qkv[:, :q] would be) must give the same product
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3 * CHUNK + 7, 96)).astype(np.float32)
    x = rng.standard_normal((rows, 192)).astype(np.float32)[:, ::2]  # (rows, 96) view
    with lin.single_blas():
        got = lin(x, w)
    np.testing.assert_allclose(
        got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4
    )


def test_calibrate_times_every_regime_on_real_matrices(smollm_path, monkeypatch):
    from core.model.linear import CALIBRATE_ROWS, GEMV_ROWS
    from core.model.weights import load_weights, open_model_file

    gf, cfg = open_model_file(smollm_path)
    w = load_weights(gf, cfg)
    mats = [m for lw in w.layers[:2] for m in lw.projections]
    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    lin = Linear(2)
    try:
        times = lin.calibrate(mats, rounds=1)
        assert sorted(times) == sorted(CALIBRATE_ROWS)
        for t, by in times.items():
            assert set(by) == (
                {"gemv", "gemm", "blocked"} if t <= GEMV_ROWS else {"gemm", "blocked"}
            )
            assert all(s > 0 for s in by.values())
            # which regime wins is the machine's business (the fake-clock test below
            # checks the rule); here: the choice is one of the timed regimes
            assert lin.regime(t) in by
        assert all(lin.regime(t) == lin.regime(8) for t in range(5, 33))
        assert lin.regime(1) == "gemv" and lin.regime(33) == "gemm"
        # whichever won, the product it gives is x @ W.T
        x = np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32)
        with lin.small_batch(lin.regime(3)):
            got = lin(x, mats[0])
        np.testing.assert_allclose(got, x @ mats[0].T, rtol=1e-4, atol=1e-3)
    finally:
        lin.close()


def test_calibration_matrices_are_a_budget_not_a_model_size(smollm_path):
    """Load-time calibration passes over at most CALIBRATE_BYTES of weights: SmolLM2's
    first whole layers; for a layer larger than the budget (a 1B's is 243 MB), the
    leading rows of each of its matrices, contiguous views of the weights."""
    from core.model.linear import CALIBRATE_BYTES, calibration_matrices
    from core.model.weights import load_weights, open_model_file

    gf, cfg = open_model_file(smollm_path)
    layers = [lw.projections for lw in load_weights(gf, cfg).layers]
    mats = calibration_matrices(layers)
    per_layer = sum(m.nbytes for m in layers[0])
    n_whole = CALIBRATE_BYTES // per_layer  # 4 for SmolLM2
    assert n_whole >= 1 and len(mats) == 4 * n_whole
    assert all(m is w for m, w in zip(mats, [w for ws in layers[:n_whole] for w in ws]))

    budget = per_layer // 3  # one layer is too big: a share of each of its matrices
    part = calibration_matrices(layers, budget=budget)
    assert len(part) == 4 and sum(m.nbytes for m in part) <= budget
    for m, w in zip(part, layers[0]):
        assert m.shape[1] == w.shape[1] and 0 < m.shape[0] < w.shape[0]
        assert m.shape[0] % CHUNK == 0 and m.flags.c_contiguous
        assert np.shares_memory(m, w) and (m == w[: m.shape[0]]).all()


def test_small_batch_regime_can_be_forced_and_rejects_unknown_names(monkeypatch):
    lin = Linear(2)
    try:
        w = np.ones((CHUNK, 8), dtype=np.float32)
        outside = blas_thread_counts()
        for regime, want in (("gemm", outside), ("gemv", outside), ("blocked", [1] * len(outside))):
            monkeypatch.setenv("MIXDESK_SMALL_BATCH", regime)
            assert lin.calibrate([w]) == {}
            assert {lin.regime(t) for t in range(2, 33)} == {regime}
            assert lin.describe() == f"2-32 rows {regime}"
            # blocked: BLAS on one thread, ours split the blocks; else BLAS's own threads
            with lin.small_batch(lin.regime(8)):
                assert blas_thread_counts() == want
            assert blas_thread_counts() == outside
        monkeypatch.setenv("MIXDESK_SMALL_BATCH", "fast")
        with pytest.raises(UserError, match="gemv, gemm, blocked"):
            lin.calibrate([w])
        with pytest.raises(UserError):
            Linear(1, small="turbo")
    finally:
        lin.close()


@pytest.mark.parametrize(
    "cost, want",
    [
        # ms per pass for (regime, rows): gemv grows with the rows, the others do not
        (dict(gemv=3, gemm=8, blocked=12), "2-4 rows gemv, 5-32 rows gemm"),
        (dict(gemv=4, gemm=8, blocked=4), "2 rows gemv, 3-32 rows blocked"),
        (dict(gemv=9, gemm=8, blocked=7), "2-32 rows gemm"),  # blocked not 1.3x faster
    ],
)
def test_calibrate_keeps_the_fastest_regime_per_row_count(monkeypatch, cost, want):
    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    lin = Linear(2)

    clock = [0.0]  # a fake clock: each product advances it by its set cost

    def fake_product(regime, x, w, side=None):
        clock[0] += cost[regime] * (len(x) / 2 if regime == "gemv" else 1) / 1e3

    monkeypatch.setattr(lin, "small_product", fake_product)
    try:
        times = lin.calibrate(
            [np.ones((CHUNK, 8), dtype=np.float32)], rounds=2, timer=lambda: clock[0]
        )
        assert lin.describe() == want
        for t, by in times.items():
            for r, s in by.items():
                assert s == pytest.approx(cost[r] * (t / 2 if r == "gemv" else 1) / 1e3)
    finally:
        lin.close()


def test_a_stored_calibration_is_used_without_timing(tmp_path, monkeypatch):
    """The choice is the machine's: a second load with the same CPU, BLAS, threads and
    shapes reuses it (a 1B's warm load was mostly this timing); other shapes, an entry
    past CALIBRATION_MAX_AGE_S, or an unreadable store time again."""
    import json

    from core.model import linear

    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    store = tmp_path / "calibration.json"
    clock, passes = [0.0], [0]
    cost = dict(gemv=4, gemm=8, blocked=4)  # "2 rows gemv, 3-32 rows blocked"

    def calibrate(mats):
        lin = Linear(2)

        def fake_product(regime, x, w, side=None):
            passes[0] += 1
            clock[0] += cost[regime] * (len(x) / 2 if regime == "gemv" else 1) / 1e3

        monkeypatch.setattr(lin, "small_product", fake_product)
        try:
            times = lin.calibrate(mats, timer=lambda: clock[0], store=store)
            return times, lin.describe()
        finally:
            lin.close()

    mats = [np.ones((CHUNK, 8), dtype=np.float32)]
    times, first = calibrate(mats)
    assert times and passes[0] > 0 and first == "2 rows gemv, 3-32 rows blocked"
    passes[0] = 0
    cost.update(gemv=9, blocked=20)  # the machine would now choose gemm: not asked
    assert calibrate(mats) == ({}, first) and passes[0] == 0
    # other shapes are another key: timed, and stored beside the first
    times, other = calibrate([np.ones((CHUNK, 16), dtype=np.float32)])
    assert times and passes[0] > 0 and other == "2-32 rows gemm"
    assert len(json.loads(store.read_text())) == 2
    # too old: timed again, and the new choice replaces the old
    data = json.loads(store.read_text())
    for entry in data.values():
        entry["when"] -= linear.CALIBRATION_MAX_AGE_S + 1
    store.write_text(json.dumps(data))
    passes[0] = 0
    times, again = calibrate(mats)
    assert times and passes[0] > 0 and again == "2-32 rows gemm"
    # a store that is not JSON (or an entry naming no known regime): timed
    for text in ("{not json", json.dumps({k: {"when": 9e99, "rows": {"2": "fast"}} for k in data})):
        store.write_text(text)
        passes[0] = 0
        times, _ = calibrate(mats)
        assert times and passes[0] > 0


class _Steps:
    """A fake decode step for ``Linear.calibrate(forward=...)``: each call advances a
    fake clock by its regime's cost (the regime set for STEP_ROWS rows), plus a
    penalty on the first ``settle`` steps after the regime changed — what a real
    machine showed (blocked steps 72-102 ms right after gemm steps, 36-50 ms a few
    steps later)."""

    def __init__(self, lin, clock, cost, penalty=0.0, settle=0):
        self.lin, self.clock, self.cost = lin, clock, cost
        self.penalty, self.settle = penalty, settle
        self.last, self.since, self.calls = None, 0, []

    def __call__(self):
        from core.model.linear import STEP_ROWS

        regime = self.lin.regime(STEP_ROWS)
        self.since = self.since + 1 if regime == self.last else 0
        self.last = regime
        self.calls.append(regime)
        slow = self.penalty if self.since < self.settle else 0.0
        self.clock[0] += (self.cost[regime] + slow) / 1e3


@pytest.mark.parametrize(
    "products, steps, want",
    [
        # products alike (no 1.3x margin), steps clearly faster blocked: blocked
        (dict(gemv=9, gemm=8, blocked=7.5), dict(gemm=80, blocked=50), "blocked"),
        # products say blocked (2x), whole steps say gemm: gemm
        (dict(gemv=9, gemm=8, blocked=4), dict(gemm=50, blocked=80), "gemm"),
        # steps within STEP_MARGIN: the packed gemm stays
        (dict(gemv=9, gemm=8, blocked=4), dict(gemm=50, blocked=48), "gemm"),
    ],
)
def test_eight_rows_are_decided_by_whole_steps(monkeypatch, products, steps, want):
    """With ``forward``, 8 rows (and so 5..32) follow whole decode steps, not bare
    products; 2-4 rows still follow their products."""
    from core.model.linear import STEP_ROWS

    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    lin = Linear(2)
    clock = [0.0]

    def fake_product(regime, x, w, side=None):
        clock[0] += products[regime] * (len(x) / 2 if regime == "gemv" else 1) / 1e3

    monkeypatch.setattr(lin, "small_product", fake_product)
    forward = _Steps(lin, clock, steps)
    try:
        times = lin.calibrate(
            [np.ones((CHUNK, 8), dtype=np.float32)],
            timer=lambda: clock[0],
            forward=forward,
        )
        assert {lin.regime(t) for t in range(5, SMALL_ROWS + 1)} == {want}
        assert times[STEP_ROWS] == pytest.approx({r: s / 1e3 for r, s in steps.items()})
        assert set(forward.calls) == {"gemm", "blocked"}
        # 2 rows: the products' choice (gemv at 9 ms for 2 rows vs gemm 8: gemm,
        # or blocked when 1.3x faster)
        assert lin.regime(2) == ("blocked" if products["blocked"] * 1.3 < 8 else "gemm")
    finally:
        lin.close()


def test_step_timing_waits_out_the_switch_between_regimes(monkeypatch):
    """Steps alternating regime by regime would charge blocked for the gemm steps
    before it (a 30 ms penalty on the first 3 steps after a switch makes blocked
    look slower, 80 vs 70); timed back to back after a warm-up, blocked wins."""
    from core.model import linear

    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    lin = Linear(2)
    clock = [0.0]
    monkeypatch.setattr(
        lin, "small_product", lambda regime, x, w, side=None: clock.__setitem__(0, clock[0] + 1e-3)
    )
    forward = _Steps(lin, clock, dict(gemm=70, blocked=50), penalty=30, settle=3)
    try:
        lin.calibrate(
            [np.ones((CHUNK, 8), dtype=np.float32)], timer=lambda: clock[0], forward=forward
        )
        assert lin.regime(8) == "blocked"
        # every regime's timed steps came after at least 2 untimed ones and the warm-up
        runs = [[forward.calls[0], 0]]
        for r in forward.calls:
            if r == runs[-1][0]:
                runs[-1][1] += 1
            else:
                runs.append([r, 1])
        # 2 rounds, the order flipped in the second: gemm, blocked | blocked, gemm
        assert [r for r, _ in runs] == ["gemm", "blocked", "gemm"]
        assert all(n >= linear.STEP_TIMED + 2 for _, n in runs)
        assert runs[1][1] >= 2 * (linear.STEP_TIMED + 2)
    finally:
        lin.close()


def test_a_products_only_calibration_is_not_reused_for_steps(tmp_path, monkeypatch):
    """A stored choice made from products alone (an older Mixdesk, or a caller
    without ``forward``) is another rule's: a load with steps times again."""
    monkeypatch.delenv("MIXDESK_SMALL_BATCH", raising=False)
    store = tmp_path / "calibration.json"
    clock = [0.0]
    mats = [np.ones((CHUNK, 8), dtype=np.float32)]
    lin = Linear(2)
    monkeypatch.setattr(
        lin, "small_product", lambda regime, x, w, side=None: clock.__setitem__(0, clock[0] + 1e-3)
    )
    try:
        assert lin.calibrate(mats, timer=lambda: clock[0], store=store)
        forward = _Steps(lin, clock, dict(gemm=80, blocked=50))
        assert lin.calibrate(mats, timer=lambda: clock[0], store=store, forward=forward)
        assert forward.calls and lin.regime(8) == "blocked"
        assert lin.step_times == pytest.approx({"gemm": 0.08, "blocked": 0.05})
    finally:
        lin.close()
    # the same rule again, a new load: the stored choice and its step times, no steps
    again = Linear(2)
    try:
        forward = _Steps(again, clock, dict(gemm=10, blocked=90))
        assert again.calibrate(mats, timer=lambda: clock[0], store=store, forward=forward) == {}
        assert not forward.calls and again.regime(8) == "blocked"
        assert again.step_times == pytest.approx({"gemm": 0.08, "blocked": 0.05})
    finally:
        again.close()


def test_the_calibration_step_runs_the_model_and_leaves_no_trace(smollm_path):
    """LlamaModel.calibration_step: 8 pooled one-token sequences through the first
    whole layers within CALIBRATION_STEP_BYTES (SmolLM2: 9 of 30), no output matrix;
    each call leaves the sequences as they were, whichever regime is in force."""
    from core.model.families import model_class
    from core.model.llama import CALIBRATION_CTX, CALIBRATION_STEP_BYTES
    from core.model.weights import load_weights, open_model_file

    gf, cfg = open_model_file(smollm_path)
    model = model_class(cfg)(cfg, load_weights(gf, cfg))
    calls = []
    real = type(model).forward

    def spy(self, items):
        calls.append(
            (len(self.w.layers), [(len(it.tokens), it.cache.length, it.hidden) for it in items])
        )
        out = real(self, items)
        assert all(o.shape == (1, cfg.dim) and np.isfinite(o).all() for o in out)
        return out

    try:
        type(model).forward = spy
        step = model.calibration_step()
        for regime in ("gemm", "blocked", "gemm"):
            model.lin.force(regime)
            step()
    finally:
        type(model).forward = real
        model.lin.close()
    per_layer = sum(m.nbytes for m in model.w.layers[0].projections)
    k = CALIBRATION_STEP_BYTES // per_layer
    assert 1 <= k < cfg.n_layers
    assert calls == [(k, [(1, CALIBRATION_CTX, True)] * 8)] * 3
    assert len(model.w.layers) == cfg.n_layers  # the model itself keeps every layer


def test_a_quantized_decode_holds_blas_at_one_thread(smollm_path):
    """A model in GGUF blocks runs its decode products on numba's threads; a BLAS call
    between them (a LoRA delta, attention) must stay on the calling thread, or
    OpenBLAS's spinning threads take the cores from numba's (8 streams under 8 mixes
    ran at half speed). Prefill, which hands BLAS the products, keeps every thread."""
    from core.model.deltas import Deltas
    from core.model.families import model_class
    from core.model.llama import BatchItem
    from core.model.quant import SMALL
    from core.model.weights import map_weights, open_model_file

    gf, cfg = open_model_file(smollm_path)
    model = model_class(cfg)(cfg, map_weights(gf, cfg), threads=2)
    seen: list[list[int]] = []

    class Spy(Deltas):
        def project(self, lin, x, w, li, target):
            seen.append(blas_thread_counts())
            return lin(x, w)

    outside = blas_thread_counts()
    assert max(outside) > 1  # else there is nothing to hold
    caches = [model.new_cache(64) for _ in range(8)]
    for c in caches:  # a prefill: BLAS keeps its threads
        model([BatchItem(np.arange(1, SMALL + 2), c)], Spy())
    assert seen and all(s == outside for s in seen)
    seen.clear()
    model([BatchItem(np.array([5]), c) for c in caches], Spy())  # 8 streams decoding
    assert seen and all(s == [1] * len(outside) for s in seen)
    seen.clear()
    model([BatchItem(np.array([6]), caches[0])], Spy())  # one stream
    assert seen and all(s == [1] * len(outside) for s in seen)
    assert blas_thread_counts() == outside
    model.lin.close()


def _linear_threads() -> set:
    """The live helper threads of every Linear in this process (other tests' models may
    end theirs meanwhile: compare sets, not counts)."""
    import threading

    return {t for t in threading.enumerate() if t.name == "mixdesk-linear" and t.is_alive()}


def test_helper_threads_start_with_the_first_split_and_end_with_close():
    """A quantized model's products never split between Linear's threads: it starts
    none. A float32 blocked product starts threads - 1 of them, once."""
    before = _linear_threads()
    lin = Linear(threads=3, small="blocked")
    assert not _linear_threads() - before
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * CHUNK, 64)).astype(np.float32)  # (out, in)
    x = rng.standard_normal((4, 64)).astype(np.float32)  # (4, in)
    np.testing.assert_allclose(lin(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    started = _linear_threads() - before
    assert len(started) == 2
    lin(x, w)
    assert _linear_threads() - before == started
    lin.close()
    for t in started:  # each helper returns from its queue and ends (a wait, not a measure)
        t.join(timeout=60)
    assert not any(t.is_alive() for t in started)
    np.testing.assert_allclose(lin(x, w), x @ w.T, rtol=1e-5, atol=1e-5)  # on this thread
    assert not _linear_threads() - before


def test_a_quantized_model_starts_no_linear_helpers(smollm_path):
    from core.model.llama import BatchItem
    from core.serve.loader import load_model

    before = _linear_threads()
    lm = load_model(smollm_path, lambda f, m: None, lambda: None)
    try:
        cache = lm.model.new_cache(64)
        lm.model([BatchItem(np.arange(5, 13), cache)])  # a prefill
        lm.model([BatchItem(np.array([7]), cache)])  # a decode step
        assert not _linear_threads() - before
    finally:
        lm.model.lin.close()


_TIMEOUT_WHEN_NUMPY_LOADS = """
import json, os, sys
seen = []

class Watch:  # the environment at the moment numpy is first imported
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not seen:
            seen.append(os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
        return None

sys.meta_path.insert(0, Watch())
import importlib
importlib.import_module(sys.argv[1])
import numpy  # (the window's module loads numpy only with its engine, after core)
print(json.dumps(seen))
"""


@pytest.mark.parametrize("entry", ["core.startup", "ui.app", "bench.weights", "bench.engine"])
def test_openblas_spins_briefly_from_every_entry_point(entry):
    """OpenBLAS's threads spin 2**28 cycles (~0.1 s) after a call by default, which took
    the cores from the kernels' threads after every prefill (core/__init__.py has the
    figures). Every entry point (the headless server and the window build their engine
    through core.startup; the window's module; the benches) imports core before numpy
    loads OpenBLAS, so OPENBLAS_THREAD_TIMEOUT=20 is in force when it does; a value the
    user set is kept."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env.update(PYTHONPATH=str(root), QT_QPA_PLATFORM="offscreen")
    for user, want in ((None, "20"), ("8", "8")):
        run_env = env if user is None else {**env, "OPENBLAS_THREAD_TIMEOUT": user}
        run = subprocess.run(
            [sys.executable, "-c", _TIMEOUT_WHEN_NUMPY_LOADS, entry],
            env=run_env, cwd=root, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == [want], (entry, user)
