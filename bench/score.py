"""A/B diff (#21): what scoring costs. The Diff toggle scores both replies under both
mixes (four teacher-forced texts) as one batch through Engine.score_many; this prints
that against the same four scored one after another and against one text alone.

Greedy replies of n_decode tokens (--quick: 32) to a chat prompt, under two mixes of
the reference adapters; best of two, interleaved, so a busy neighbour hits every
figure alike (--quick: one go).
"""

from __future__ import annotations

import time

from core.serve.sampling import SamplingParams

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
REPEATS = 2


def run(ctx) -> None:
    eng, ids = ctx.eng, ctx.ids
    if len(ids) < 2:
        print("score: skipped (needs two reference adapters that fit this model)")
        return
    n = 32 if ctx.args.quick else ctx.n_decode
    mixes = [{ids[0]: 1.0}, {ids[1]: 1.0}]
    prompt = eng.chat_prompt(PROMPT)
    params = SamplingParams(temperature=0.0, n_predict=n, ignore_eos=True)
    replies = [eng.complete(prompt, params, mix=m, cache_prompt=False).tokens for m in mixes]
    jobs = [(prompt + r, m, len(prompt)) for r in replies for m in mixes]
    eng.score_many(jobs)  # builds the mixes once
    best = {"batch": float("inf"), "sequential": float("inf"), "one": float("inf")}
    for _ in range(1 if ctx.args.quick else REPEATS):
        t = time.perf_counter()
        eng.score_many(jobs)
        best["batch"] = min(best["batch"], time.perf_counter() - t)
        t = time.perf_counter()
        for job in jobs:
            eng.score_many([job])
        best["sequential"] = min(best["sequential"], time.perf_counter() - t)
        t = time.perf_counter()
        eng.score_many(jobs[:1])
        best["one"] = min(best["one"], time.perf_counter() - t)
    b, s, o = (best[k] * 1e3 for k in ("batch", "sequential", "one"))
    print(
        f"score (A/B diff): 2 replies x 2 mixes, {len(prompt)} prompt + {n} reply tokens each: "
        f"one batch {b:.0f} ms, one after another {s:.0f} ms ({s / b:.2f}x the batch), "
        f"one text alone {o:.0f} ms (batch = {b / o:.2f}x one)"
    )
