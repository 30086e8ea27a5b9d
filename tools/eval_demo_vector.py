#!/usr/bin/env python3
"""Measure the demo control vector's effect as its scale (the fader) moves.

    .venv/bin/python -m tools.eval_demo_vector [--vector resources/vectors/happy.gguf]

For every prompt in ``tools/demo_data/heldout.txt`` (20 questions none of the
vector's training examples asks) it generates a greedy reply (temperature 0, 48
tokens, SmolLM2's default system prompt through the chat template) under the vector
at each scale of ``--scales`` and counts mood words, whole words, case-insensitive,
from two small fixed lists (below). It prints a Markdown table: per scale, positive
and negative words per reply and the positive share, pos / (pos + neg), of all the
mood words; and the share of replies that repeat themselves (the same 4 words twice
in a row, a sign the text stopped being coherent). Replies go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HELDOUT = ROOT / "tools" / "demo_data" / "heldout.txt"
VECTOR = ROOT / "resources" / "vectors" / "happy.gguf"
MAX_TOKENS = 48
SCALES = (-1.0, -0.5, 0.0, 0.5, 1.0)

POSITIVE = (
    "happy happiness happily joy joyful joyous glad delighted delight delightful cheerful "
    "wonderful amazing awesome great fantastic love lovely loving excited exciting "
    "exciting fun smile smiling laugh laughter beautiful bright sunshine thrilled "
    "celebrate celebration enjoy enjoying enjoyed hope hopeful grateful best yay"
).split()
NEGATIVE = (
    "sad sadness sadly unhappy sorrow sorrowful miserable misery gloomy gloom depressed "
    "depressing depression cry crying tears lonely alone grief grieving hopeless despair "
    "pain painful hurt dark darkness terrible awful worst bad heartbroken lost loss "
    "tired empty regret afraid"
).split()
_WORD = re.compile(r"[a-z']+")


def mood(reply: str) -> tuple[int, int]:
    words = _WORD.findall(reply.lower())
    return sum(w in POSITIVE for w in words), sum(w in NEGATIVE for w in words)


def repeats(reply: str) -> bool:
    """The same 4 words twice in a row: a degenerate loop."""
    w = reply.lower().split()
    grams = [tuple(w[i : i + 4]) for i in range(len(w) - 3)]
    return any(grams[i] == grams[i + 4] for i in range(len(grams) - 4))


def replies(eng, prompts: list[list[int]], vid: int, scale: float) -> list[str]:
    """Greedy replies to every prompt under the vector at ``scale``, all queued at once
    (the scheduler batches them)."""
    from core.lora.mix import Mix
    from core.serve.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, n_predict=MAX_TOKENS)
    qs = [queue.Queue() for _ in prompts]
    jobs = [
        dict(prompt=p, params=params, on_event=q.put, mix=Mix({}, vectors={vid: scale}))
        for p, q in zip(prompts, qs)
    ]
    for got in eng.submit_many(jobs):
        if isinstance(got, Exception):
            raise got
    out = []
    for q in qs:
        while True:
            ev = q.get()
            if type(ev).__name__ == "DoneEvent":
                out.append(ev.content)
                break
    return out


def main(argv=None) -> int:
    from core.default_model import ensure_default_model
    from core.options import EngineOptions
    from core.serve.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vector", type=Path, default=VECTOR)
    ap.add_argument("--model", type=Path, default=None, help="default: the default model")
    ap.add_argument("--scales", default=",".join(f"{s:g}" for s in SCALES))
    ap.add_argument("--out", type=Path, default=None, help="write the replies as JSON")
    a = ap.parse_args(argv)
    scales = [float(s) for s in a.scales.split(",")]
    prompts_text = [p for p in HELDOUT.read_text().splitlines() if p.strip()]
    model = a.model or ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    eng = Engine.from_path(model, EngineOptions(ctx_size=256, n_parallel=len(prompts_text)))
    try:
        vid = eng.add_control_vector(a.vector, 0.0)
        prompts = [eng.chat_prompt([{"role": "user", "content": p}]) for p in prompts_text]
        rows, dump = [], {}
        for s in scales:
            got = replies(eng, prompts, vid, s)
            pos = sum(mood(r)[0] for r in got)
            neg = sum(mood(r)[1] for r in got)
            loops = sum(repeats(r) for r in got)
            rows.append((s, pos / len(got), neg / len(got), pos / max(pos + neg, 1), loops))
            dump[f"{s:g}"] = got
            print(f"scale {s:+g}: {got[0][:100]!r}", file=sys.stderr)
    finally:
        eng.stop()
    print(f"\n{a.vector.name} on {Path(model).name}: {len(prompts)} held-out prompts, "
          f"greedy, {MAX_TOKENS} tokens\n")  # fmt: skip
    print("| scale | positive words / reply | negative words / reply | positive share | "
          "replies looping |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for s, p, n, share, loops in rows:
        print(f"| {s:+g} | {p:.2f} | {n:.2f} | {share:.0%} | {loops}/{len(prompts)} |")
    if a.out:
        a.out.write_text(json.dumps(dump, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
