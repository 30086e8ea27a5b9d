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
