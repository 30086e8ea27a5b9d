"""What a forward pass asks of whatever adds to its products: by default, nothing.

The model knows shapes and products, not LoRA policy (core/lora/runtime.py's
``LoraDeltas`` is the one implementation that adds anything). A forward takes one
``Deltas`` for its whole batch and calls its four hooks: ``embed`` on the embedding
rows, ``project`` for every fused product of a block, ``layer_out`` on each block's
output (after its residual add: where llama.cpp adds control vectors), ``logits`` on
the output rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Product = Callable[[np.ndarray, object], np.ndarray]  # (x, W) -> x @ W.T


class Deltas:
    """The base model: products as they are."""

    def embed(self, x: np.ndarray, tokens: np.ndarray) -> None:
        """x (T, d): the embedding rows of ``tokens`` (T,), to edit in place."""

    def project(self, lin, x: np.ndarray, w, li: int, target: str) -> np.ndarray:
        """``x @ W.T`` (T, out) for fused matrix ``target`` of layer li, by ``lin``."""
        return lin(x, w)

    def layer_out(self, x: np.ndarray, li: int) -> None:
        """x (T, d): the output of block li (the next block's input), to edit in place."""

    def logits(self, logits: np.ndarray, h: np.ndarray, counts: Sequence[int]) -> None:
        """logits (R, vocab) of normed rows h (R, d), item i owning the next counts[i]
        rows, to edit in place."""


NO_DELTAS = Deltas()


def batch_spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Item i's rows [s, e) of a batch whose items run lengths[i] tokens each, in order:
    how the forward lays a batch out (LlamaModel.pack)."""
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return spans
