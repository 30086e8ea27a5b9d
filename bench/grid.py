"""X/Y grid (#21): a 5 × 2 grid of mixes on one prompt, run as one batch, against the
same ten runs one after another and against one run alone.

The grid is the scale of one reference adapter over 0, 0.25, 0.5, 0.75, 1 times a
second adapter off/on: ten distinct mixes. It runs on an engine of its own with ten
slots, so the whole grid is one batch (the bench engine has eight: it would run in
two waves), while the bench engine's thread is stopped (one team of kernel threads). Greedy, prompt cache off, so every run pays its prefill; best of two,
interleaved, so a busy neighbour hits all three figures alike (--quick: one go).
"""

from __future__ import annotations

import time

from core import grid as G
from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams

SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)
PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
REPEATS = 2  # best of two (--quick: one)


def run(ctx) -> None:
    ids = ctx.ids
    if len(ids) < 2:
        print("grid: skipped (needs two reference adapters that fit this model)")
        return
    n = 16 if ctx.args.quick else 48
    paths = [ctx.eng.adapter(i).path for i in ids[:2]]
    # one engine thread at a time: numba's OpenMP layer keeps a team of kernel threads
    # per launching thread, and with the bench's engine still running beside this one
    # every launch waited for a worker to wake (the two-team warning in every make bench
    # log, and pessimistic grid figures). Its thread ends here and starts again after.
    ctx.eng.stop()
    try:
        eng = Engine(
            EngineOptions(
                ctx_size=512, n_parallel=len(SCALES) * 2, draft_max=0, weights=ctx.args.weights
            )
        )
        eng.load_model(ctx.path)
        grid_ids = [eng.add_adapter(p) for p in paths]
        eng.start()
        try:
            _measure(eng, grid_ids, n, ctx.args.quick)
        finally:
            eng.stop()
    finally:
        ctx.eng.start()


def _measure(eng: Engine, ids: list[int], n: int, quick: bool) -> None:
    params = SamplingParams(temperature=0.0, n_predict=n, ignore_eos=True)
    spec = G.GridSpec(
        G.Axis("scale", SCALES, adapter=ids[0]),
        G.Axis("scale", (0.0, 1.0), adapter=ids[1]),
        params,
        messages=PROMPT,
    )
    prompt = G.encode(eng, spec)
    cells = G.cells(spec, eng.get_mix())
    G.run_grid(eng, spec, prompt, cache_prompt=False)  # builds the ten mixes once
    # wall and CPU seconds (process_time: every thread of this process) of each figure;
    # on a shared machine the CPU seconds show the work, the wall time what a user waits
    best = {k: (float("inf"), float("inf")) for k in ("grid", "sequential", "one")}
    steps = 0

    def timed(name: str, fn) -> None:
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        best[name] = (min(best[name][0], wall), min(best[name][1], cpu))

    def grid() -> None:
        nonlocal steps
        run, results = G.run_grid(eng, spec, prompt, cache_prompt=False)
        steps = len({r.admitted_step for r in run.requests})
        assert all(r.tokens == n for r in results)

    def sequential() -> None:
        for c in cells:
            eng.complete(prompt, c.params, mix=c.mix, cache_prompt=False)

    def one() -> None:
        eng.complete(prompt, params, mix=cells[-1].mix, cache_prompt=False)

    for _ in range(1 if quick else REPEATS):
        # one run alone before the grid and again after it: the best of the two
        timed("one", one)
        timed("grid", grid)
        timed("sequential", sequential)
        timed("one", one)
    (g, g_cpu), (s, s_cpu), (o, o_cpu) = best["grid"], best["sequential"], best["one"]
    print(
        f"grid 5x2 ({len(cells)} mixes, {len(prompt)}-token prompt, {n} tokens each, "
        f"{eng.n_parallel} slots, admitted in {steps} step{'s' if steps > 1 else ''}): "
        f"wall {g:.2f} s as one batch vs {s:.2f} s one after another ({s / g:.2f}x faster) "
        f"vs {o:.2f} s one run alone ({g / o:.2f}x one run); CPU {g_cpu:.1f} s vs "
        f"{s_cpu:.1f} s ({s_cpu / g_cpu:.2f}x less) vs {o_cpu:.1f} s ({g_cpu / o_cpu:.2f}x)"
    )
