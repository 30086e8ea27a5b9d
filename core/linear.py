"""``y = x @ W.T`` for every weight matrix, picking the fastest BLAS call per batch size.

Weights are stored (out, in) C-contiguous, as GGUF has them. Three regimes, all
measured on the shapes of SmolLM2 (``bench/engine.py`` prints the effect):

* one row (single-stream decode): ``W @ x`` is a gemv that streams W once at
  memory speed, on OpenBLAS's own threads.
* 2..SMALL_ROWS rows (several streams decoding, speculative verification):
  OpenBLAS's packed gemm copies all of W into panels before it computes, so 8
  rows cost ~3x one row although they read the same bytes. Instead we cut W into
  contiguous blocks of CHUNK rows and compute ``x @ Wbᵀ`` per block (one stacked
  ``np.matmul``, so the loop over blocks runs in C), each written into its
  columns of y. Such small products with a transposed B go to OpenBLAS's
  small-matrix "NT" kernel, which reads the block in place; a block is small
  enough to stay in L2 while the rows of x reuse it. It beats the NoTrans
  "direct" kernel on ``Wb @ xᵀ`` (the bench's ``kernel`` line: 1.91 against
  1.40-1.53 G weights/s for 8 rows on one thread) and needs no transposed
  copies of x or y. These
  kernels run single-threaded only while OpenBLAS runs on one thread, so the
  caller holds ``single_blas()`` and we split the blocks over our own threads
  (numpy releases the GIL).
* more rows (prefill): the packed gemm is the right tool; ``x @ W.T``.

Which of the first two wins for 2..SMALL_ROWS rows depends on the BLAS build and
the CPU, by a wide margin either way, so ``calibrate`` times both on the model's
own matrices when it loads. OpenBLAS has small-matrix
kernels only for AVX-512 cores (its SkylakeX kernels and later), where the
blocked products win; on AVX2 cores (its Haswell kernels, e.g. AMD Zen 3) every
small product packs its block first, and its own threaded packed gemm wins.
``bench/engine.py`` prints both batch-8 rooflines and the regime chosen.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from typing import Callable

import numpy as np

SMALL_ROWS = 32      # up to here the blocked products can beat packed gemm (bench/engine.py)
CHUNK = 64           # rows of W per block: 64 x 1536 floats = 384 KB, fits L2
BLOCKED_MARGIN = 1.3  # calibrate() picks the blocked products only when this much faster


def blas_threads() -> int:
    """The BLAS thread count in force (honours -t/--threads, set with threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
        n = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        return max(n) if n else (os.cpu_count() or 1)
    except Exception:  # pragma: no cover - threadpoolctl is a pinned dependency
        return os.cpu_count() or 1


class Linear:
    """Callable ``lin(x, w) -> x @ w.T`` with the regime picked from ``len(x)``.

    Owns ``threads - 1`` helper threads for the blocked regime; the calling thread
    does one share of the blocks itself.
    """

    def __init__(self, threads: int | None = None, small: str = "blocked"):
        self.threads = max(1, threads or blas_threads())
        # the regime for 2..SMALL_ROWS rows: "blocked" (our threads) or "gemm"
        # (OpenBLAS's packed gemm on its own threads); see calibrate()
        self.small = _check_regime(small)
        self._helpers = [_Helper() for _ in range(self.threads - 1)]
        weakref.finalize(self, _close_all, self._helpers)
        self._blas = None
        # relative speed of each thread, without and with side work (see split)
        self._rel = {False: [1.0] * self.threads, True: [1.0] * self.threads}

    def close(self) -> None:
        _close_all(self._helpers)
        self._helpers = []

    def calibrate(self, mats: list[np.ndarray], rows: int = 8, rounds: int = 3
                  ) -> dict[str, float]:
        """Time one pass of ``rows`` rows over ``mats`` in both small-batch regimes
        (best of ``rounds``, alternating, so both see the same minute of a shared
        machine) and keep gemm unless the blocked products are clearly faster.
        Returns the seconds per pass of each.

        ``MIXDESK_SMALL_BATCH=blocked|gemm`` skips the timing and forces a regime."""
        forced = os.environ.get("MIXDESK_SMALL_BATCH")
        if forced:
            self.small = _check_regime(forced)
            return {}
        mats = [m for m in mats if m.flags.c_contiguous]
        if not mats:
            return {}
        rng = np.random.default_rng(0)
        xs = {m.shape[1]: rng.standard_normal((rows, m.shape[1])).astype(np.float32)
              for m in mats}
        best = {"blocked": float("inf"), "gemm": float("inf")}
        for _ in range(rounds):
            for regime in best:
                t = time.perf_counter()
                with self.small_batch(regime):
                    for m in mats:
                        self.small_product(regime, xs[m.shape[1]], m, None)
                best[regime] = min(best[regime], time.perf_counter() - t)
        # The blocked products must win clearly: timed back to back they hide what
        # they cost inside a forward pass, where the helper sleeps between products
        # while this thread runs attention and has to be woken for every one (seen
        # here: calibration within 10% either way, then 124-149 ms per 8-stream step
        # blocked against 82-94 ms with gemm). Where OpenBLAS has the small-matrix
        # kernels they win by ~2x, and keep winning in the engine.
        self.small = "blocked" if best["blocked"] * BLOCKED_MARGIN < best["gemm"] else "gemm"
        return best

    def small_batch(self, regime: str | None = None):
        """The context a 2..SMALL_ROWS-row forward runs in: BLAS held at one thread
        for the blocked regime (ours are the threads), left alone for gemm."""
        if (regime or self.small) == "blocked":
            return self.single_blas()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def single_blas(self):
        """Hold OpenBLAS at one thread, so small products take the direct kernel."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController
            self._blas = ThreadpoolController().select(user_api="blas")
        with self._blas.limit(limits=1):
            yield

    def __call__(self, x: np.ndarray, w: np.ndarray, side: Callable[[], None] | None = None
                 ) -> np.ndarray:
        """x: (T, in) float32; w: (out, in) C-contiguous -> (T, out).

        ``side`` is other work that needs only x (a LoRA delta): in the blocked
        regime it runs on this thread while the helpers run their share of the
        product, which then shrinks this thread's share; otherwise after it."""
        T = x.shape[0]
        if T == 1:
            y = (w @ x[0])[None]                                       # (1, out) gemv
        elif T > SMALL_ROWS or not w.flags.c_contiguous:
            y = x @ w.T                                                # (T, out) packed gemm
        else:
            return self.small_product(self.small, x, w, side)
        if side is not None:
            side()
        return y

    def small_product(self, regime: str, x: np.ndarray, w: np.ndarray,
                      side: Callable[[], None] | None = None) -> np.ndarray:
        """``x @ w.T`` for 2..SMALL_ROWS rows in the given regime (the caller holds
        ``small_batch(regime)``); ``side`` as in ``__call__``."""
        if regime == "blocked":
            return self.blocked(x, w, side)
        y = x @ w.T                                                    # (T, out) packed gemm
        if side is not None:
            side()
        return y

    def blocked(self, x: np.ndarray, w: np.ndarray, side: Callable[[], None] | None = None
                ) -> np.ndarray:
        n_out, n_in = w.shape
        x = np.ascontiguousarray(x)                                    # (T, in)
        y = np.empty((x.shape[0], n_out), dtype=np.float32)            # (T, out)
        # whole blocks are split between threads; the last share takes any ragged tail
        self.split(n_out // CHUNK, lambda i, j, last: _rows(
            w, x, y, i * CHUNK, n_out if last else j * CHUNK), side)
        return y

    def split(self, n: int, fn, side: Callable[[], None] | None = None) -> None:
        """Run ``fn(i, j, last)`` over ``threads`` ranges covering [0, n): the first on
        this thread, the others on the helpers; return when all are done.

        The ranges are sized by each thread's measured speed, so all finish
        together: a helper starts ~50 us late (it has to wake up) and, on a
        shared VM, its core may run slower than ours (measured: 16% slower,
        which left this thread waiting 16 ms per 8-stream step). ``side`` runs on
        this thread after its range; splits with and without one keep separate
        speed estimates."""
        parts = len(self._helpers) + 1 if n > 1 else 1
        if parts == 1:
            fn(0, n, True)
            if side is not None:
                side()
            return
        rel = self._rel[side is not None]
        total = sum(rel)
        cuts = [0] + [round(n * sum(rel[:k + 1]) / total) for k in range(parts - 1)] + [n]
        done = [0.0] * parts
        t0 = time.perf_counter()

        def run(k: int) -> None:
            fn(cuts[k], cuts[k + 1], k == parts - 1)
            if k == 0 and side is not None:
                side()
            done[k] = time.perf_counter() - t0

        for k in range(1, parts):
            self._helpers[k - 1].run(lambda k=k: run(k))
        try:
            run(0)
        finally:
            for h in self._helpers[:parts - 1]:
                h.wait()
        # blocks per second from submission to finish, relative to the mean: an EMA
        speed = [(cuts[k + 1] - cuts[k]) / done[k] if done[k] > 0 else 0.0 for k in range(parts)]
        if all(speed):
            mean = sum(speed) / parts
            self._rel[side is not None] = [0.9 * r + 0.1 * s / mean for r, s in zip(rel, speed)]


class _Helper:
    """One worker thread: ``run(fn)`` hands fn over, ``wait()`` returns once it has
    returned (re-raising what it raised). Leaner than a ThreadPoolExecutor: no
    Future per call, which matters at ~120 handoffs per decode step."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Lock()
        self._done.acquire()
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="mixdesk-linear", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as e:  # handed to the waiting thread
                self._error = e
            self._done.release()

    def run(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def wait(self) -> None:
        self._done.acquire()
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        self._q.put(None)


def _check_regime(name: str) -> str:
    if name not in ("blocked", "gemm"):
        raise ValueError(f"small-batch regime must be 'blocked' or 'gemm', not {name!r}")
    return name


def _close_all(helpers: list[_Helper]) -> None:
    for h in helpers:
        h.close()


def _rows(w: np.ndarray, x: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
    """y[:, a:b] = x @ w[a:b].T, as stacked CHUNK-row blocks plus a ragged tail.

    Wb is read in place through a transposed view; each block's result goes to its
    columns of y through a strided view of y."""
    T, n_in = x.shape
    full = a + (b - a) // CHUNK * CHUNK
    if full > a:
        nb = (full - a) // CHUNK
        np.matmul(x, w[a:full].reshape(nb, CHUNK, n_in).transpose(0, 2, 1),
                  out=y[:, a:full].reshape(T, nb, CHUNK).transpose(1, 0, 2))  # (blocks, T, CHUNK)
    if b > full:
        np.matmul(x, w[full:b].T, out=y[:, full:b])                    # (T, tail)
