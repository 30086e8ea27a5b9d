"""Forward passes under LoRA mixes, for tests that check the engine's numbers directly.

The model knows no LoRA policy (core/model/deltas.py): a caller builds the deltas of a
batch and hands them in. These helpers do that the way the scheduler does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from core.lora.mix import MixWeights, mix_key
from core.lora.runtime import AdapterStacks, LoraDeltas
from core.model.llama import BatchItem


def mix_weights(eng, mix: Mapping[int, float]) -> MixWeights | None:
    """The engine's built mix of {adapter id: scale}."""
    return eng.lora.mixes.get(mix_key(mix), {a["id"]: eng.adapter(a["id"]) for a in eng.adapters()})


def forward(
    model,
    items: Sequence[BatchItem],
    mixes: Sequence[MixWeights | None] | None = None,
    stacks: AdapterStacks | None = None,
) -> list[np.ndarray]:
    """``model(items)`` with item i under ``mixes[i]`` (None: the base model)."""
    mixes = list(mixes) if mixes is not None else [None] * len(items)
    return model(items, LoraDeltas.of(items, mixes, stacks))


def mix_logits(eng, mix: Mapping[int, float], tokens: Sequence[int]) -> np.ndarray:
    """All-position logits (n, vocab) of ``tokens`` under ``mix``, from a fresh cache."""
    cache = eng.model.new_cache(len(tokens) + 8)
    item = BatchItem(np.asarray(tokens), cache, all_logits=True)
    return forward(eng.model, [item], [mix_weights(eng, mix)])[0]


def check_teacher_forced(
    model, mw: MixWeights | None, case: Mapping, tol: float = 0.05, chunk: int = 0
) -> None:
    """One recorded llama-server case, teacher-forced through ``model`` under ``mw``:
    the same top-1 token at every step and the reference's top-5 logprobs within
    ``tol``. In one forward, or with ``chunk`` > 0 the prompt first and then the reply
    ``chunk`` tokens a forward, as speculative decoding verifies a draft."""
    from core.serve.sampling import log_softmax

    toks = np.array(case["prompt_tokens"] + case["tokens"])  # (T,)
    n = len(case["prompt_tokens"])
    cache = model.new_cache(max(64, len(toks)))
    cuts = [0, n, *range(n + chunk, len(toks), chunk)] if chunk else [0]
    logits = np.concatenate(
        [
            forward(model, [BatchItem(toks[a:b], cache, all_logits=True)], [mw])[0]
            for a, b in zip(cuts, [*cuts[1:], len(toks)])
        ]
    )  # (T, vocab)
    for step, top in enumerate(case["top_logprobs"]):
        lp = log_softmax(logits[n - 1 + step])
        assert int(np.argmax(lp)) == top[0][0], f"step {step}: top-1 differs"
        for tid, ref_lp in top[:5]:
            assert abs(lp[tid] - ref_lp) < tol, f"step {step} token {tid}: {lp[tid]} vs {ref_lp}"
