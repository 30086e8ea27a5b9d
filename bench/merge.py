"""Bench section: what a merge method's mix costs to build (#21), next to a linear mix.

A linear mix only stacks its adapters' low-rank pairs; ties, dare_ties and svd build
a merged adapter on first use (dense ΔW per module -> method -> truncated SVD), once
per distinct mix. Both are timed here on the same adapters in the same run, and the
line gives the ratio. Standalone (no other bench figures):
``python -m bench.merge [-m MODEL.gguf]``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

from core.lora.merge import MergeSpec
from core.lora.mix import build_mix, mix_key

METHODS = (
    MergeSpec.make("svd"),
    MergeSpec.make("ties", density=0.5),
    MergeSpec.make("dare_ties", density=0.5, seed=0),
)


def merge_lines(eng, ids: list[int]) -> Iterator[str]:
    """Build times of one mix of two adapters at 0.7/0.5, line by line as measured: linear
    (best of 3, as it is milliseconds) and each merge method (once: seconds, and what a
    user waits for)."""
    if len(ids) < 2:
        yield "merge build: needs two adapters that fit this model (none here)"
        return
    scales = {ids[0]: 0.7, ids[1]: 0.5}
    adapters = {i: eng.adapter(i) for i in ids[:2]}
    cfg = eng.config
    linear = []
    for _ in range(3):
        t = time.perf_counter()
        build_mix(cfg, mix_key(scales), adapters)
        linear.append(time.perf_counter() - t)
    base = min(linear)
    names = " + ".join(a.name for a in adapters.values())
    yield f"merge build ({names}, {eng.path.name}): linear {base * 1e3:.1f} ms"
    for spec in METHODS:
        t = time.perf_counter()
        mw = build_mix(cfg, mix_key(scales, spec), adapters)
        took = time.perf_counter() - t
        yield (
            f"  {spec.label():<22} {took:7.2f} s  ({took / base:,.0f}x linear; "
            f"merged adapter {mw.nbytes / 1e6:.1f} MB)"
        )


def run(ctx) -> None:
    for line in merge_lines(ctx.eng, ctx.ids):
        print(line, flush=True)


def main() -> None:
    from core.default_model import ensure_default_model
    from core.errors import UserError
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from tests.reference import reference_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    args = ap.parse_args()
    # as bench.engine: a weight cache of the run's own, never the user's
    tmp = tempfile.mkdtemp(prefix="mixdesk-bench-merge-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ["MIXDESK_CACHE"] = tmp
    path = args.model or ensure_default_model(log=lambda m: None)
    eng = Engine(EngineOptions(ctx_size=256, n_parallel=1))
    eng.load_model(path)
    ids = []
    for f in sorted((reference_dir() / "adapters").glob("*.gguf")):
        try:
            ids.append(eng.add_adapter(f))
        except UserError:  # made for another model
            continue
    for line in merge_lines(eng, ids):
        print(line, flush=True)


if __name__ == "__main__":
    main()
