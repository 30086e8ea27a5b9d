"""Embeddings (#20): what /v1/embeddings costs. A request with several inputs runs them
packed into one forward (up to --ubatch-size rows, Engine.embed); this prints that
against the same inputs embedded one request after another, and the tokens per second.

8 inputs of 32 random tokens (--quick: 4 of 16), base model; best of two, interleaved,
so a busy neighbour hits every figure alike (--quick: one go).
"""

from __future__ import annotations

import time

import numpy as np

REPEATS = 2


def run(ctx) -> None:
    eng = ctx.eng
    n_in, n_tok = (4, 16) if ctx.args.quick else (8, 32)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(100, eng.config.vocab_size, n_tok).tolist() for _ in range(n_in)]
    eng.embed(inputs[:1]).result()  # warm: the first forward of this shape
    best = {"batch": float("inf"), "sequential": float("inf")}
    for _ in range(1 if ctx.args.quick else REPEATS):
        t = time.perf_counter()
        eng.embed(inputs).result()
        best["batch"] = min(best["batch"], time.perf_counter() - t)
        t = time.perf_counter()
        for one in inputs:
            eng.embed([one]).result()
        best["sequential"] = min(best["sequential"], time.perf_counter() - t)
    b, s = best["batch"], best["sequential"]
    print(
        f"embeddings: {n_in} inputs x {n_tok} tokens: one forward {b * 1e3:.0f} ms "
        f"({n_in * n_tok / b:.0f} tok/s), one after another {s * 1e3:.0f} ms "
        f"({s / b:.2f}x the batch)"
    )
