"""Bench: the compiled quant kernels (core/model/kernels.py) against numpy float32 BLAS
on the same matrices, dequantized, each ratio measured in the same run.

    .venv/bin/python -m bench.kernels [--threads N] [--types Q4_K,Q6_K] [--quick]

Per type, on an 8192x2048 matrix (a 1B's gate/up): G weights/s of ``x @ W.T`` for
T=1 (gemv) and T=8 (a decode step of 8 mixes) next to numpy's float32 gemv and gemm
on the dequantized matrix, and what 8 rows cost relative to one. Then the
128256x2048 Q6_K output matrix (a 1B's token_embd, tied), a 512-row prefill against
numpy's float32 gemm, and the kernels' compile time: first-ever (empty cache) and
warm (cached), each in a fresh process.

Every figure is the best of several runs, the contenders interleaved so they see
the same minute of a shared machine; on a busy machine they are indicative only.
``--threads 1`` times thread CPU time instead of wall time: both numpy's BLAS and
the kernels then run on the calling thread, and the figures hold on a busy machine
(except for memory bandwidth, which other processes share).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from gguf import GGMLQuantizationType as Q
from threadpoolctl import threadpool_limits

from bench.engine import blas_header
from core.model import quant
from core.model.quant import QuantMatrix
from tests.tiny_gguf import random_matrix

TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0", "F16", "BF16", "Q4_0", "Q5_1"]
TYPES += ["Q2_K", "Q3_K", "Q5_K"]


CLOCK = time.perf_counter  # main() switches to thread CPU time for --threads 1


def best(fns: dict, rounds: int) -> dict:
    """Best seconds of each callable, the callables interleaved round by round."""
    out = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()  # warm: compile, page in
    for _ in range(rounds):
        for k, fn in fns.items():
            t = CLOCK()
            fn()
            out[k] = min(out[k], CLOCK() - t)
    return out


def matrix(qt: Q, rows: int, cols: int, rng) -> tuple[QuantMatrix, np.ndarray]:
    m = QuantMatrix(qt, random_matrix(qt, rows, cols, rng), (rows, cols), name=qt.name)
    return m, m.dequantize()  # (rows, cols) float32


def products(qt: Q, rows: int, cols: int, rounds: int, rng) -> str:
    m, w = matrix(qt, rows, cols, rng)
    x1 = rng.standard_normal((1, cols)).astype(np.float32)  # (1, in)
    x8 = rng.standard_normal((8, cols)).astype(np.float32)  # (8, in)
    t = best(
        {
            "q1": lambda: m.matmul(x1),
            "q8": lambda: m.matmul(x8),
            "np1": lambda: w @ x1[0],
            "np8": lambda: x8 @ w.T,
        },
        rounds,
    )
    n = rows * cols / 1e9

    def g(s):
        return f"{n / s:6.1f}"

    return (
        f"{qt.name:<5} {rows}x{cols}  T=1 {g(t['q1'])} G w/s ({t['np1'] / t['q1']:4.2f}x numpy "
        f"gemv {g(t['np1'])})   T=8 {g(t['q8'])} G w/s ({t['np8'] / t['q8']:4.2f}x numpy gemm)"
        f"   8 rows cost {t['q8'] / t['q1']:4.2f}x one (numpy {t['np8'] / t['np1']:4.2f}x)"
    )


def prefill(qt: Q, rows: int, cols: int, n_rows: int, rounds: int, rng) -> str:
    m, w = matrix(qt, rows, cols, rng)
    x = rng.standard_normal((n_rows, cols)).astype(np.float32)  # (T, in)
    t = best({"q": lambda: m.matmul(x), "np": lambda: x @ w.T}, rounds)
    return (
        f"prefill {n_rows} rows, {qt.name} {rows}x{cols}: {t['q'] * 1e3:.1f} ms vs numpy "
        f"float32 gemm {t['np'] * 1e3:.1f} ms ({t['np'] / t['q']:.2f}x)"
    )


def compile_times(types: list[str]) -> str:
    """warm_up(types) in a fresh process with an empty kernel cache, then again: the
    first-ever compile, and what the cached kernels add to a warm start, apart from
    importing numba and the kernel modules (quant.import_kernels), which a load does
    while it reads the weights (core/serve/loader.py)."""
    code = (
        "import time; t = time.perf_counter(); from core.model import quant; "
        "quant.import_kernels(); imported = time.perf_counter() - t; "
        f"s = quant.warm_up({types!r}); "
        "print(time.perf_counter() - t, s, time.process_time(), imported)"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = []
        for _ in range(2):
            run = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True
            )
            if run.returncode:
                return f"compile: failed: {run.stderr.strip().splitlines()[-1:]}"
            out.append(run.stdout.split())
    (first_all, first, first_cpu, _), (warm_all, warm, warm_cpu, imported) = (
        map(float, o) for o in out
    )
    return (
        f"compile {'+'.join(types)}: first-ever {first:.1f} s ({first_cpu:.1f} s CPU), "
        f"cached {warm:.2f} s; importing numba and the kernel modules first {imported:.2f} s "
        f"(a load does it while reading the weights); in all {first_all:.1f} s / "
        f"{warm_all:.2f} s ({warm_cpu:.2f} s CPU)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--quick", action="store_true", help="fewer rounds, no output matrix")
    args = ap.parse_args()
    types = [Q[t.strip().upper()] for t in args.types.split(",") if t.strip()]
    rounds = 5 if args.quick else 15
    if args.threads == 1:
        # one thread: numpy's BLAS and the kernels both run on this thread, so its CPU
        # time is the work done, whatever else a shared machine is running
        global CLOCK
        CLOCK = time.thread_time
    rng = np.random.default_rng(0)
    quant.set_threads(args.threads)
    with threadpool_limits(args.threads, user_api="blas"):
        print(blas_header())
        if not os.environ.get("NOCOMPILE"):
            print(compile_times(["Q4_K", "Q6_K"]), flush=True)
        quant.warm_up(types)
        import numba

        clock = "thread CPU time" if CLOCK is time.thread_time else "wall time"
        print(
            f"numba {numba.__version__}, threading layer {_layer()}, threads {args.threads}, "
            f"{clock}"
        )
        for qt in types:
            print(products(qt, 8192, 2048, rounds, rng), flush=True)
        if not args.quick:
            print(products(Q.Q6_K, 128256, 2048, max(3, rounds // 3), rng), flush=True)
        for qt in (Q.Q4_K, Q.Q6_K):
            print(prefill(qt, 8192, 2048, 512, max(3, rounds // 3), rng), flush=True)


def _layer() -> str:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return "(not started)"


if __name__ == "__main__":
    main()
