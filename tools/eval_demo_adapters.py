#!/usr/bin/env python3
"""Measure the demo adapters' effects on 20 held-out prompts.

    .venv/bin/python -m tools.eval_demo_adapters                    # Mixdesk engine if present
    .venv/bin/python -m tools.eval_demo_adapters --backend torch    # the training script's model

For every prompt in ``tools/demo_data/heldout.txt`` (none of them is in the
training data) it generates a greedy reply (temperature 0, at most 64 tokens,
SmolLM2's default system prompt via the chat template) with:

* no adapter (scale 0),
* each adapter at scale 0.5 and 1,
* one 50/50 mix: pirate @ 0.5 + hype @ 0.5,

and prints a Markdown table of marker rates. The markers (defined below, one per
style) are computed on every reply, so the table also shows each marker's base
rate and how one style leaks into another:

* pirate: the reply contains a pirate word (arr, matey, ahoy, aye, ye, yer,
  hearty, landlubber, ...), whole words, case-insensitive.
* terse: the reply starts with a "- " bullet and has at most 30 words.
* hype: the reply has at least two "!" and at least one emoji.

Replies are saved as JSON (``--out``) so the table can be checked by eye.

Backends: ``engine`` uses Mixdesk's numpy engine (``core.engine.Engine``);
``torch`` uses the float32 torch model from ``tools/train_demo_adapters.py``
(same math: W + scale*alpha/rank*B@A, checked against llama-server's outputs by
``train_demo_adapters.py --check``). ``auto`` picks the engine if it imports.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HELDOUT = ROOT / "tools" / "demo_data" / "heldout.txt"
ADAPTER_DIR = ROOT / "resources" / "adapters"
MAX_TOKENS = 64

PIRATE_WORDS = re.compile(
    r"\b(arr+|arrgh|matey|mateys|ahoy|aye|ye|yer|ye'll|ye've|hearty|hearties|landlubbers?|"
    r"shiver me timbers|scallywags?|buccaneers?|doubloons?|booty|grog)\b",
    re.I,
)
EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\u2b50\u2b55\u2190-\u21ff\u2300-\u23ff]")
TERSE_MAX_WORDS = 30


def is_pirate(reply: str) -> bool:
    return bool(PIRATE_WORDS.search(reply))


def is_terse(reply: str) -> bool:
    text = reply.strip()
    return text.startswith("- ") and len(text.split()) <= TERSE_MAX_WORDS


def is_hype(reply: str) -> bool:
    return reply.count("!") >= 2 and bool(EMOJI.search(reply))


MARKERS = {"pirate": is_pirate, "terse": is_terse, "hype": is_hype}

# (label, {adapter style: scale})
CONFIGS = [
    ("base (no adapter)", {}),
    ("pirate @ 0.5", {"pirate": 0.5}),
    ("pirate @ 1", {"pirate": 1.0}),
    ("terse @ 0.5", {"terse": 0.5}),
    ("terse @ 1", {"terse": 1.0}),
    ("hype @ 0.5", {"hype": 0.5}),
    ("hype @ 1", {"hype": 1.0}),
    ("mix: pirate @ 0.5 + hype @ 0.5", {"pirate": 0.5, "hype": 0.5}),
]


class EngineBackend:
    name = "Mixdesk numpy engine (core.engine)"
    parallel = 8

    def __init__(self, model_path: Path):
        from core.options import EngineOptions
        from core.serve.engine import Engine

        self.eng = Engine.from_path(model_path, EngineOptions(n_parallel=self.parallel))
        self.ids: dict[str, int] = {}

    def add(self, style: str, path: Path) -> None:
        self.ids[style] = self.eng.add_adapter(path)

    def reply(self, prompt: str, mix: dict[str, float]) -> str:
        m = {self.ids[s]: v for s, v in mix.items()}
        return self.eng.chat(
            [{"role": "user", "content": prompt}], mix=m, max_tokens=MAX_TOKENS, temperature=0.0
        )

    def close(self) -> None:
        self.eng.stop()


class TorchBackend:
    name = "float32 torch model of tools/train_demo_adapters.py"
    parallel = 1

    def __init__(self, model_path: Path):
        import torch

        from tools import train_demo_adapters as T

        torch.set_grad_enabled(False)
        torch.set_num_threads(1)  # see train_demo_adapters.py: 1 thread on a shared 2-core box
        self.T = T
        self.model = T.Llama(model_path)
        self.tok = T.get_tokenizer(self.model.metadata)
        self.adapters: dict[str, dict] = {}

    def add(self, style: str, path: Path) -> None:
        self.adapters[style] = self.T.load_adapter(path)

    def reply(self, prompt: str, mix: dict[str, float]) -> str:
        T = self.T
        self.model.mix = [(self.adapters[s], v) for s, v in mix.items()]
        try:
            ids = self.tok.encode(T.chatml(prompt), parse_special=True)
            out, _ = self.model.greedy(ids, MAX_TOKENS, stop=T.IM_END)
        finally:
            self.model.mix = []
        if out and out[-1] == T.IM_END:
            out = out[:-1]
        return self.tok.decode(out)

    def replies(self, prompts: list[str], mix: dict[str, float]) -> list[str]:
        """All prompts in one batch (left-padded, KV cache): same greedy replies, much faster."""
        T = self.T
        self.model.mix = [(self.adapters[s], v) for s, v in mix.items()]
        try:
            ids = [self.tok.encode(T.chatml(p), parse_special=True) for p in prompts]
            outs = self.model.greedy_batch(ids, MAX_TOKENS, stop=T.IM_END)
        finally:
            self.model.mix = []
        return [self.tok.decode(o) for o in outs]

    def close(self) -> None:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["auto", "engine", "torch"], default="auto")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--adapters", type=Path, default=ADAPTER_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "demo_data" / "eval_replies.json")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke test)")
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="recompute the table from the saved replies (--out) without generating",
    )
    args = ap.parse_args(argv)
    if args.table_only:
        saved = json.loads(args.out.read_text(encoding="utf-8"))
        print_table(saved["backend"], saved["results"])
        return 0
    if args.model is None:
        from core.default_model import default_model_path

        args.model = default_model_path()

    backend = None
    if args.backend in ("auto", "engine"):
        try:
            backend = EngineBackend(args.model)
        except Exception as e:  # noqa: BLE001 - report and fall back
            if args.backend == "engine":
                raise
            print(f"engine unavailable ({type(e).__name__}: {e}); using torch", file=sys.stderr)
    if backend is None:
        backend = TorchBackend(args.model)
    for style in MARKERS:
        backend.add(style, args.adapters / f"{style}.gguf")

    prompts = [
        line.strip() for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    prompts = prompts[: args.limit] if args.limit else prompts
    results = []
    t0 = time.time()
    for label, mix in CONFIGS:
        if hasattr(backend, "replies"):
            replies = backend.replies(prompts, mix)
        elif backend.parallel > 1:  # the engine batches concurrent requests
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(backend.parallel) as ex:
                replies = list(ex.map(lambda p, mix=mix: backend.reply(p, mix), prompts))
        else:
            replies = [backend.reply(p, mix) for p in prompts]
        rates = {m: sum(f(r) for r in replies) / len(replies) for m, f in MARKERS.items()}
        words = sum(len(r.split()) for r in replies) / len(replies)
        results.append(
            {
                "config": label,
                "mix": mix,
                "rates": rates,
                "mean_words": words,
                "replies": dict(zip(prompts, replies)),
            }
        )
        print(f"{label}: {rates} words={words:.1f} ({time.time() - t0:.0f}s)", file=sys.stderr)

    backend.close()
    args.out.write_text(
        json.dumps(
            {"backend": backend.name, "max_tokens": MAX_TOKENS, "results": results},
            indent=1,
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
    print_table(backend.name, results)
    return 0


def print_table(backend_name: str, results: list[dict]) -> None:
    n = len(results[0]["replies"])
    print(f"Backend: {backend_name}; {n} held-out prompts, greedy, max {MAX_TOKENS} tokens.\n")
    print("| Adapter mix | pirate marker | terse marker | hype marker | mean words | mean '!' |")
    print("|---|---|---|---|---|---|")
    for r in results:
        replies = list(r["replies"].values())
        cells = " | ".join(
            f"{100 * sum(MARKERS[m](x) for x in replies) / len(replies):.0f}%" for m in MARKERS
        )
        words = sum(len(x.split()) for x in replies) / len(replies)
        bangs = sum(x.count("!") for x in replies) / len(replies)
        print(f"| {r['config']} | {cells} | {words:.1f} | {bangs:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
