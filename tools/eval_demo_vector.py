#!/usr/bin/env python3
"""Measure the demo control vector's effect as its scale (the fader) moves.

    .venv/bin/python -m tools.eval_demo_vector [--vector resources/vectors/happy.gguf]

For every prompt in ``tools/demo_data/heldout.txt`` (20 questions none of the
vector's training examples asks) it generates a greedy reply (temperature 0, 48
tokens, SmolLM2's default system prompt through the chat template) under the vector
at each scale of ``--scales`` (all 20 prompts batched) and counts mood words, whole words, case-insensitive,
from two small fixed lists (below). It prints a Markdown table: per scale, positive
and negative words per reply, their difference (the mood), and the positive share,
pos / (pos + neg), of all the mood words; and the replies that loop (some 4 words 3 times or more, a sign the text
stopped being coherent). Replies go to ``--out`` as JSON; ``--replies FILE`` scores
such a file again instead of generating.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import time
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
    """A degenerate loop: some 4 words (punctuation aside) come 3 times or more."""
    w = _WORD.findall(reply.lower())
    grams = [tuple(w[i : i + 4]) for i in range(len(w) - 3)]
    return any(grams.count(g) >= 3 for g in set(grams))


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
    ap.add_argument("--replies", type=Path, default=None, help="score a --out file again")
    a = ap.parse_args(argv)
    scales = [float(s) for s in a.scales.split(",")]
    prompts_text = [p for p in HELDOUT.read_text().splitlines() if p.strip()]
    if a.replies is not None:
        dump = json.loads(a.replies.read_text())
        print_table(a.vector.name, "the saved replies", [(float(k), v) for k, v in dump.items()])
        return 0
    model = a.model or ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    eng = Engine.from_path(model, EngineOptions(ctx_size=256, n_parallel=len(prompts_text)))
    try:
        vid = eng.add_control_vector(a.vector, 0.0)
        prompts = [eng.chat_prompt([{"role": "user", "content": p}]) for p in prompts_text]
        got_all, dump = [], {}
        t0 = time.perf_counter()
        for s in scales:
            got = replies(eng, prompts, vid, s)
            got_all.append((s, got))
            dump[f"{s:g}"] = got
            print(f"scale {s:+g}: {time.perf_counter() - t0:.0f} s so far", file=sys.stderr)
            print(f"scale {s:+g}: {got[0][:100]!r}", file=sys.stderr)
    finally:
        eng.stop()
    print_table(a.vector.name, Path(model).name, got_all)
    if a.out:
        a.out.write_text(json.dumps(dump, indent=1) + "\n")
    return 0


def print_table(vector: str, model: str, got_all: list[tuple[float, list[str]]]) -> None:
    n = len(got_all[0][1])
    print(f"\n{vector} on {model}: {n} held-out prompts, greedy, {MAX_TOKENS} tokens\n")
    print("| scale | positive words / reply | negative words / reply | mood (pos − neg) / reply "
          "| positive share | replies looping |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for s, got in got_all:
        pos = sum(mood(r)[0] for r in got)
        neg = sum(mood(r)[1] for r in got)
        loops = sum(repeats(r) for r in got)
        p, q = pos / len(got), neg / len(got)
        print(f"| {s:+g} | {p:.2f} | {q:.2f} | {p - q:+.2f} | {pos / max(pos + neg, 1):.0%} | "
              f"{loops}/{len(got)} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
