"""``y = x @ W.T`` for every weight matrix, picking the fastest BLAS call per batch size.

Weights are stored (out, in) C-contiguous, as GGUF has them. One row (single-stream
decode) is a gemv, ``W @ x``, that streams W once at memory speed on OpenBLAS's own
threads. More than SMALL_ROWS rows (prefill) go to OpenBLAS's packed gemm,
``x @ W.T``. For 2..SMALL_ROWS rows (several streams decoding, A/B compare,
speculative verification) three regimes compete:

* "gemv": one gemv per row. The first reads W from memory; the next ones find most
  of it still in cache (every matrix but the output head fits in L3), so on an
  AVX2 machine 2 rows cost 1.3x one row, 3 rows 1.9x. It grows with every row.
* "gemm": OpenBLAS's packed gemm on its own threads. It copies W into panels
  before it computes, so 2 to 8 rows all cost about 2.2-2.5x one row there.
* "blocked": we cut W into contiguous blocks of CHUNK rows and compute
  ``x @ Wbᵀ`` per block (one stacked ``np.matmul``, so the loop over blocks runs
  in C), each written into its columns of y. Where OpenBLAS has small-matrix
  kernels (AVX-512 cores: its SkylakeX kernels and later) such products read the
  block in place, and 8 rows cost ~1.7x one row. Those kernels run only while
  OpenBLAS runs on one thread, so the caller holds ``single_blas()`` and we split
  the blocks over our own threads (numpy releases the GIL).

A weight matrix kept in its GGUF block format (core/model/quant.py: QuantMatrix,
FusedMatrix) brings its own product, compiled kernels for every row count (a
small-batch kernel reads each block once for all rows; prefill dequantizes tiles for
BLAS), so none of the regimes below applies to it: ``__call__`` hands it over.

Which wins depends on the CPU and the BLAS build, by wide margins either way, so
``calibrate`` times them on the model's own matrices when it loads, for 2, 3, 4
and 8 rows, and keeps a regime per row count. For 8 rows (and so 5..SMALL_ROWS)
the model can hand it a whole decode step to time instead of bare products: the
packed gemm and the blocked products then differ by what surrounds them (BLAS's
own threads around attention and the norms, our helpers left to sleep between
products), which timing the products alone cannot see. ``bench/engine.py`` prints
the rooflines and the choice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import queue
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import UserError
from .quant import SMALL as KERNEL_ROWS  # rows a matrix in GGUF blocks runs on its kernels

SMALL_ROWS = 32  # up to here a small-batch regime can beat packed gemm (bench/engine.py)
CHUNK = 64  # rows of W per block: 64 x 1536 floats = 384 KB, fits L2
REGIMES = ("gemv", "gemm", "blocked")
CALIBRATE_ROWS = (2, 3, 4, 8)  # row counts timed at load; 5..SMALL_ROWS follow 8's choice
GEMV_ROWS = 4  # per-row gemv is timed (and used) only up to this many rows
BLOCKED_MARGIN = 1.3  # calibrate() picks the blocked products only when this much faster
# weights calibrate() passes over at load: more than an L3, SmolLM2's first 4 layers (56 MB)
CALIBRATE_BYTES = 64 << 20
# a stored calibration (calibrate(store=...)) is trusted this long, then timed again
CALIBRATION_MAX_AGE_S = 7 * 24 * 3600
# the row count calibrate(forward=...) times as whole decode steps (5..SMALL_ROWS follow it)
STEP_ROWS = CALIBRATE_ROWS[-1]
# before a regime's steps are timed, steps run untimed for at least this long: the
# first steps after a switch pay for the other regime's threads (OpenBLAS's spinning
# after its gemm, our helpers asleep); measured on a 2-core VM, SmolLM2: blocked steps
# 72-102 ms right after gemm steps, 36-50 ms a few steps later, gemm steps 56-86 ms
STEP_WARMUP_S = 0.15
STEP_WARMUP_MAX = 50  # ... but never more steps than this (a fast model, a fake clock)
STEP_TIMED = 5  # steps timed per regime and round; the fastest counts (a VM's noise only adds)
STEP_MARGIN = 1.1  # the blocked steps must be this much faster to be chosen


def blas_threads() -> int:
    """The BLAS thread count in force (honours -t/--threads, set with threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info

        n = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        return max(n) if n else (os.cpu_count() or 1)
    except Exception:  # pragma: no cover - threadpoolctl is a pinned dependency
        return os.cpu_count() or 1


def rows_of(w, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (n,) of a weight matrix as float32 (n, in): an embedding lookup,
    whether ``w`` is float32 or kept in a GGUF block format."""
    return w[ids] if isinstance(w, np.ndarray) else w.take(ids)  # (n, in) copy


def dense(w) -> np.ndarray:
    """A weight matrix as float32 (out, in): itself, or dequantized (a copy)."""
    return w if isinstance(w, np.ndarray) else w.dequantize()


def calibration_matrices(
    layers: list[tuple[np.ndarray, ...]], budget: int = CALIBRATE_BYTES
) -> list[np.ndarray]:
    """The matrices ``Linear.calibrate`` times, from the model's layers in order:
    whole layers while they fit ``budget`` bytes; when even the first does not (a
    1B's layer is 243 MB), the first rows of each of its matrices, the same share
    of each, in whole CHUNK-row blocks. Calibration makes 22 passes over what it is
    given, so it must cost a budget, not a model size: 4 whole layers of a 1B model
    (970 MB) made it 23 s of a 25 s warm load on 2 busy cores. Leading rows of a
    C-contiguous (out, in) matrix are one contiguous block: the products see the
    same in-dimension and memory layout as on the whole matrix."""
    out: list[np.ndarray] = []
    used = 0
    for mats in layers:
        size = sum(m.nbytes for m in mats)
        if used + size > budget:
            break
        out += mats
        used += size
    if out or not layers:
        return out
    share = budget / sum(m.nbytes for m in layers[0])
    return [m[: max(CHUNK, int(len(m) * share) // CHUNK * CHUNK)] for m in layers[0]]


class Linear:
    """Callable ``lin(x, w) -> x @ w.T`` with the regime picked from ``len(x)``.

    Owns ``threads - 1`` helper threads for the blocked regime, started by its first
    split; the calling thread does one share of the blocks itself.
    """

    def __init__(self, threads: int | None = None, small: str = "gemm", kernels: bool = False):
        self.threads = max(1, threads or blas_threads())
        # the model's matrices are in GGUF blocks: small batches run on the compiled
        # kernels' threads (numba's), whatever the regime says (see ``forward_context``)
        self.kernels = kernels
        self.force(small)
        # threads - 1 helpers, started by the first product split between threads (a
        # quantized model's products run on the kernels' threads and never split)
        self._helpers: list[_Helper] = []
        self._closed = False
        weakref.finalize(self, _close_all, self._helpers)
        self._blas = None
        # seconds per 8-row step by regime from the calibration in force ({} without
        # one): bench/engine.py prints them beside the choice
        self.step_times: dict[str, float] = {}
        # relative speed of each thread, without and with side work (see split)
        self._rel = {False: [1.0] * self.threads, True: [1.0] * self.threads}

    def close(self) -> None:
        _close_all(self._helpers)
        self._helpers.clear()
        self._closed = True  # later splits run on the calling thread

    def force(self, regime: str) -> None:
        """Use one regime for every row count from 2 to SMALL_ROWS."""
        self._by_rows = [_check_regime(regime)] * (SMALL_ROWS + 1)

    def regime(self, rows: int) -> str:
        """The regime a product of this many rows runs in."""
        if rows == 1:
            return "gemv"
        return self._by_rows[rows] if rows <= SMALL_ROWS else "gemm"

    def overlaps(self, rows: int) -> bool:
        """True when a product of this many rows runs on our own threads ("blocked"),
        so a ``side`` job given to ``__call__`` runs alongside the helpers' shares."""
        return self.regime(rows) == "blocked"

    def describe(self) -> str:
        """The chosen regimes as runs of row counts, e.g. '2-3 rows gemv, 4-32 rows gemm'."""
        runs: list[list] = []
        for t in range(2, SMALL_ROWS + 1):
            if runs and runs[-1][2] == self._by_rows[t]:
                runs[-1][1] = t
            else:
                runs.append([t, t, self._by_rows[t]])
        return ", ".join(f"{a}{'' if a == b else f'-{b}'} rows {r}" for a, b, r in runs)

    def calibrate(
        self,
        mats: list[np.ndarray],
        rounds: int = 2,
        timer: Callable[[], float] = time.perf_counter,
        step: Callable[[float], None] | None = None,
        store: Path | None = None,
        forward: Callable[[], None] | None = None,
    ) -> dict[int, dict[str, float]]:
        """Time one pass over ``mats`` in each regime for each of CALIBRATE_ROWS row
        counts (best of ``rounds``, alternating, so all see the same minute of a
        shared machine) and keep the fastest per row count, gemv only up to
        GEMV_ROWS rows and the blocked products only when clearly faster. Returns
        the seconds per pass: {rows: {regime: s}}.

        ``timer`` is the clock the passes are read from (seconds); the tests give a
        fake clock that the products advance, so the choice is checked without time.
        ``MIXDESK_SMALL_BATCH=gemv|gemm|blocked`` skips the timing and forces one.
        ``step(fraction_done)`` is called after each pass (a model load's progress; it
        may raise to cancel: calibration takes seconds, ~10 s on a busy laptop).

        ``forward``: one decode step of STEP_ROWS sequences through (part of) the model,
        run in whatever regime is set for STEP_ROWS rows. When given, STEP_ROWS is not
        decided by its products but by whole steps, each regime's run consecutively
        after a warm-up (``_time_steps``): on a 2-core VM the bare products of gemm and
        blocked timed the same (8.0 vs 8.5 ms a pass) while the engine's 8-stream steps
        ran 1.5x faster blocked, and an AVX2 machine showed the reverse (products
        within 10%, steps 40% slower blocked). Its entry in the returned times is then
        seconds per step.

        ``store``: a JSON file of earlier choices (the model load passes one in the
        cache dir). A choice stored for the same CPU, BLAS build, thread count and
        matrix shapes, less than CALIBRATION_MAX_AGE_S old, is used without timing
        (returns {}): the choice is the machine's, not the model file's, and timing
        it was most of a warm load (1.2-2.4 s of CPU of a 1B's ~3 s)."""
        forced = os.environ.get("MIXDESK_SMALL_BATCH")
        if forced:
            self.force(forced)
            return {}
        mats = [m for m in mats if isinstance(m, np.ndarray) and m.flags.c_contiguous]
        if not mats:
            return {}
        key = self._calibration_key(mats, forward is not None) if store is not None else ""
        if key and self._use_stored(store, key):
            return {}
        rng = np.random.default_rng(0)
        by_products = [t for t in CALIBRATE_ROWS if forward is None or t != STEP_ROWS]
        best: dict[int, dict[str, float]] = {
            t: {r: float("inf") for r in REGIMES if r != "gemv" or t <= GEMV_ROWS}
            for t in by_products
        }
        xs = {
            t: {m.shape[1]: rng.standard_normal((t, m.shape[1])).astype(np.float32) for m in mats}
            for t in by_products
        }
        # progress: a pass of products is one unit, a regime's steps in one round two
        n_steps = 2 * 2 * rounds if forward is not None else 0
        n_passes, done = rounds * sum(len(times) for times in best.values()) + n_steps, 0

        def progressed(units: int) -> None:
            nonlocal done
            done += units
            if step is not None:
                step(done / n_passes)

        for _ in range(rounds):
            for t, times in best.items():
                for regime in times:
                    t0 = timer()
                    with self.small_batch(regime):
                        for m in mats:
                            self.small_product(regime, xs[t][m.shape[1]], m)
                    times[regime] = min(times[regime], timer() - t0)
                    progressed(1)
        choice = {t: _fastest(times) for t, times in best.items()}
        if forward is not None:
            steps = self._time_steps(forward, rounds, timer, lambda: progressed(2))
            best[STEP_ROWS] = self.step_times = steps
            faster = steps["blocked"] * STEP_MARGIN < steps["gemm"]
            choice[STEP_ROWS] = "blocked" if faster else "gemm"
        self._use_choice(choice)
        if key:
            _store_choice(store, key, choice, self.step_times)
        return best

    def _time_steps(
        self,
        forward: Callable[[], None],
        rounds: int,
        timer: Callable[[], float],
        progressed: Callable[[], None],
    ) -> dict[str, float]:
        """Seconds per ``forward`` step at STEP_ROWS rows in "gemm" and "blocked": per
        round, each regime's steps back to back (the order flips every round, so a
        drifting machine favours neither), untimed ones first for STEP_WARMUP_S,
        then the fastest of STEP_TIMED (a shared machine's noise only adds); the best
        round counts."""
        best = {"gemm": float("inf"), "blocked": float("inf")}
        order = ["gemm", "blocked"]
        before = self._by_rows[STEP_ROWS]
        try:
            for r in range(rounds):
                for regime in order if r % 2 == 0 else order[::-1]:
                    self._by_rows[STEP_ROWS] = regime
                    t0, n = timer(), 0
                    while n < 2 or (timer() - t0 < STEP_WARMUP_S and n < STEP_WARMUP_MAX):
                        forward()
                        n += 1
                    times = []
                    for _ in range(STEP_TIMED):
                        t1 = timer()
                        forward()
                        times.append(timer() - t1)
                    best[regime] = min(best[regime], *times)
                    progressed()
        finally:
            self._by_rows[STEP_ROWS] = before
        return best

    def _use_choice(self, choice: dict[int, str]) -> None:
        for t in range(2, SMALL_ROWS + 1):
            self._by_rows[t] = choice[t if t in choice else CALIBRATE_ROWS[-1]]

    def _calibration_key(self, mats: list[np.ndarray], by_steps: bool = False) -> str:
        """What a calibration's choice depends on: the CPU, the BLAS build and its
        threads, our thread count, the matrix shapes, and the rule that chose
        (``by_steps``: STEP_ROWS decided by whole steps, see ``calibrate``)."""
        try:
            from threadpoolctl import threadpool_info

            blas = [
                [i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")]
                for i in threadpool_info()
                if i["user_api"] == "blas"
            ]
        except Exception:  # pragma: no cover - threadpoolctl is a pinned dependency
            blas = []
        ident = [
            _cpu_name(),
            os.cpu_count(),
            self.threads,
            blas,
            sorted({m.shape for m in mats}),
            CALIBRATE_ROWS,
            GEMV_ROWS,
            BLOCKED_MARGIN,
            CHUNK,
        ]
        if by_steps:  # an older store's entry (products only) is not this rule's choice
            ident += ["steps", STEP_ROWS, STEP_MARGIN, STEP_TIMED]
        return hashlib.sha1(json.dumps(ident, default=str).encode()).hexdigest()[:20]

    def _use_stored(self, store: Path, key: str) -> bool:
        entry = _read_store(store).get(key)
        try:
            if time.time() - float(entry["when"]) > CALIBRATION_MAX_AGE_S:
                return False
            choice = {int(t): _check_regime(r) for t, r in entry["rows"].items()}
            if sorted(choice) != sorted(CALIBRATE_ROWS):
                return False
        except Exception:  # no entry, or one written by hand or by another version
            return False
        self._use_choice(choice)
        steps = entry.get("steps")
        if isinstance(steps, dict) and all(isinstance(v, float) for v in steps.values()):
            self.step_times = dict(steps)
        return True

    def forward_context(self, rows: int):
        """The context a forward of ``rows`` rows runs in. BLAS is held at one thread
        while our own threads run the products: the blocked regime's, or the compiled
        kernels' for a model in GGUF blocks up to KERNEL_ROWS rows. Any BLAS call in
        between (a LoRA delta, attention) then stays on this thread: OpenBLAS's
        threads spin for a while after each call, and on a machine with as many cores
        as threads they took the cores from numba's (8 streams under 8 LoRA mixes on
        the 1B-shaped Q4_K_M: 11.2 tok/s, 21.8 with BLAS held at one thread; 2 cores,
        2026-12-06). Prefill (more rows) hands BLAS the products, on all threads."""
        if self.kernels:
            return self.single_blas() if rows <= KERNEL_ROWS else contextlib.nullcontext()
        return self.small_batch(self.regime(rows))

    def small_batch(self, regime: str):
        """The context products of this regime run in: BLAS held at one thread for
        the blocked products (ours are the threads), left alone otherwise."""
        if regime == "blocked":
            return self.single_blas()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def single_blas(self):
        """Hold OpenBLAS at one thread, so small products take its small-matrix kernels."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController().select(user_api="blas")
        with self._blas.limit(limits=1):
            yield

    def __call__(
        self, x: np.ndarray, w: np.ndarray, side: Callable[[], None] | None = None
    ) -> np.ndarray:
        """x: (T, in) float32; w: (out, in) C-contiguous float32, or a quantized
        matrix (its own compiled product) -> (T, out).

        ``side`` is other work that needs only x (a LoRA delta): in the blocked
        regime it runs on this thread while the helpers run their share of the
        product, which then shrinks this thread's share; otherwise after it."""
        T = x.shape[0]
        if not isinstance(w, np.ndarray):
            y = w.matmul(x)  # (T, out) compiled kernels on the GGUF blocks
        elif T == 1:
            y = (w @ x[0])[None]  # (1, out) gemv
        elif T > SMALL_ROWS or not w.flags.c_contiguous:
            y = x @ w.T  # (T, out) packed gemm
        else:
            return self.small_product(self.regime(T), x, w, side)
        if side is not None:
            side()
        return y

    def small_product(
        self, regime: str, x: np.ndarray, w: np.ndarray, side: Callable[[], None] | None = None
    ) -> np.ndarray:
        """``x @ w.T`` for 2..SMALL_ROWS rows in the given regime (the caller holds
        ``small_batch(regime)``); ``side`` as in ``__call__``."""
        if regime == "blocked":
            return self.blocked(x, w, side)
        if regime == "gemv":
            y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)  # (T, out)
            for i in range(x.shape[0]):
                np.matmul(w, x[i], out=y[i])  # (out,) W mostly cached
        else:
            y = x @ w.T  # (T, out) packed gemm
        if side is not None:
            side()
        return y

    def blocked(
        self, x: np.ndarray, w: np.ndarray, side: Callable[[], None] | None = None
    ) -> np.ndarray:
        n_out, n_in = w.shape
        x = np.ascontiguousarray(x)  # (T, in)
        y = np.empty((x.shape[0], n_out), dtype=np.float32)  # (T, out)
        # whole blocks are split between threads; the last share takes any ragged tail
        self.split(
            n_out // CHUNK,
            lambda i, j, last: _rows(w, x, y, i * CHUNK, n_out if last else j * CHUNK),
            side,
        )
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
        if n > 1 and not self._helpers and not self._closed:
            self._helpers.extend(_Helper() for _ in range(self.threads - 1))
        parts = len(self._helpers) + 1 if n > 1 else 1
        if parts == 1:
            fn(0, n, True)
            if side is not None:
                side()
            return
        rel = self._rel[side is not None]
        total = sum(rel)
        cuts = [0] + [round(n * sum(rel[: k + 1]) / total) for k in range(parts - 1)] + [n]
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
            for h in self._helpers[: parts - 1]:
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
    if name not in REGIMES:
        raise UserError(f"small-batch regime must be one of {', '.join(REGIMES)}, not {name!r}")
    return name


def _fastest(times: dict[str, float]) -> str:
    """The regime to keep from one row count's timings. The blocked products must
    win clearly: timed back to back they hide what they cost inside a forward
    pass, where the helper sleeps between products while this thread runs
    attention and must be woken for every one (seen on an AVX2 machine: timings
    within 10% of gemm, then 124-149 ms per 8-stream step against 82-94 ms with
    gemm). Where OpenBLAS has small-matrix kernels they win by ~2x and keep
    winning in the engine."""
    plain = min((r for r in times if r != "blocked"), key=times.get)
    if "blocked" in times and times["blocked"] * BLOCKED_MARGIN < times[plain]:
        return "blocked"
    return plain


def _cpu_name() -> str:
    """The CPU model, for the calibration key (/proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_store(store: Path) -> dict:
    try:
        data = json.loads(store.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_choice(store: Path, key: str, choice: dict[int, str], steps: dict[str, float]) -> None:
    """Add one choice to the store, atomically; a store that cannot be written only
    means the next load times again. ``steps``: the step times it came from."""
    data = _read_store(store)
    data[key] = {"when": time.time(), "rows": {str(t): r for t, r in choice.items()}}
    if steps:
        data[key]["steps"] = steps
    part = store.with_name(f".{store.name}.{os.getpid()}.partial")
    try:
        part.write_text(json.dumps(data, indent=1))
        os.replace(part, store)
    except OSError:
        part.unlink(missing_ok=True)


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
        np.matmul(
            x,
            w[a:full].reshape(nb, CHUNK, n_in).transpose(0, 2, 1),
            out=y[:, a:full].reshape(T, nb, CHUNK).transpose(1, 0, 2),
        )  # (blocks, T, CHUNK)
    if b > full:
        np.matmul(x, w[full:b].T, out=y[:, full:b])  # (T, tail)
