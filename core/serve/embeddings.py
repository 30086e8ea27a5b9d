"""Embeddings: the final hidden states of a forward pass, pooled as llama.cpp pools them.

llama.cpp's embedding is ``t_embd``, each token's hidden state after the output norm
(the row the output matrix would turn into logits). ``--pooling`` picks what a request
gets back (llama.cpp's enum llama_pooling_type):

* ``none``: every token's vector, unnormalized (only /embedding can return that);
* ``mean``: their average; ``cls``: the first token's; ``last``: the last token's;
  each then normalized as the request's ``embd_normalize`` says (default 2, Euclidean);
* ``rank``: a reranker's classification head, which none of Mixdesk's families has.

The options (--embedding, --pooling, -ub) are core.options.EmbeddingOptions. The
forward is not a generation: it runs on the engine thread (``Engine.run_on_engine``)
with a temporary KV cache per input (never a pool slot, so running requests keep
theirs). An input runs in one forward, as llama-server runs a pooled input in one
physical batch (``--ubatch-size``): several inputs share a forward up to that many
rows. The mix is the request's (its ``lora``) or the global one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import UserError
from ..lora.mix import MixWeights
from ..lora.runtime import LoraDeltas
from ..model.config import POOLING_TYPES
from ..model.llama import BatchItem

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit for /v1/embeddings)
DEFAULT_NORMALIZE = 2  # embd_normalize: Euclidean (llama-server's default)
MAX_P_NORM = 64  # beyond it |x|^p over- or underflows a double for any useful vector


class EmbeddingError(UserError):
    """An input that cannot be embedded (empty, too long, not tokens or text)."""


def check_pooling(name: str) -> str:
    if name not in POOLING_TYPES:
        raise EmbeddingError(f"pooling must be one of {', '.join(POOLING_TYPES)}, not {name!r}")
    if name == "rank":
        raise EmbeddingError(
            "pooling rank needs a reranker's classification head; this model has none"
        )
    return name


def check_inputs(inputs: Sequence[Sequence[int]], vocab_size: int, n_ctx: int, ubatch: int) -> None:
    """llama-server's checks, in its order: an empty input, one larger than the physical
    batch (it runs in one forward), one larger than a slot's context; and ours: token
    ids in the vocabulary, at most MAX_INPUTS inputs."""
    if not inputs:
        raise EmbeddingError('"input" must not be empty')
    if len(inputs) > MAX_INPUTS:
        raise EmbeddingError(f"{len(inputs)} inputs in one request; at most {MAX_INPUTS}")
    for i, ids in enumerate(inputs):
        n = len(ids)
        if n == 0:
            raise EmbeddingError("Input content cannot be empty")
        if n > ubatch:
            raise EmbeddingError(
                f"input ({n} tokens) is too large to process. increase the physical batch "
                f"size (current batch size: {ubatch})"
            )
        if n > n_ctx:
            raise EmbeddingError(
                f"input ({n} tokens) is larger than the max context size ({n_ctx} tokens). skipping"
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise EmbeddingError(
                f"input {i}: token id {bad[0]} is out of range (vocabulary has {vocab_size} tokens)"
            )


def packed(inputs: Sequence[Sequence[int]], ubatch: int) -> list[list[Sequence[int]]]:
    """Inputs whole, packed in order into forwards of at most ``ubatch`` rows (an input
    alone may fill one: check_inputs bounds it); one list of inputs per forward."""
    groups: list[list[Sequence[int]]] = []
    rows = 0
    for ids in inputs:
        if not groups or rows + len(ids) > ubatch:
            groups.append([])
            rows = 0
        groups[-1].append(ids)
        rows += len(ids)
    return groups


def hidden_states(
    model, inputs: Sequence[Sequence[int]], mix: MixWeights | None, ubatch: int
) -> list[np.ndarray]:
    """Every input's final hidden states (n_i, d) under ``mix``, one forward per group
    of :func:`packed`; call on the engine thread."""
    out: list[np.ndarray] = []
    for group in packed(inputs, ubatch):
        items = []
        for ids in group:
            tokens = np.asarray(ids, dtype=np.int64)  # (n,)
            items.append(BatchItem(tokens, model.new_cache(len(tokens)), hidden=True))
        out += model(items, LoraDeltas.of(items, [mix] * len(items)))  # (n_i, d) per item
    return out


def pool(h: np.ndarray, pooling: str) -> np.ndarray:
    """(n, d) hidden states -> (d,) for mean/cls/last; none keeps (n, d)."""
    if pooling == "none":
        return h  # (n, d)
    if pooling == "mean":
        return h.mean(axis=0, dtype=np.float64).astype(np.float32)  # (d,)
    if pooling == "cls":
        return h[0]  # (d,)
    if pooling == "last":
        return h[-1]  # (d,)
    raise EmbeddingError(f"pooling {pooling!r} is not supported")


def normalize(v: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-absolute scaled to int16's
    range, 2 Euclidean, any other p > 0 the p-norm (1: taxicab). A zero vector stays 0."""
    x = v.astype(np.float64)  # (d,) the sums in double, as llama.cpp
    if norm == -1:
        s = 1.0
    elif norm == 0:
        s = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif norm == 2:
        s = float(np.sqrt(np.dot(x, x)))
    else:
        s = float(np.sum(np.abs(x) ** norm) ** (1.0 / norm))
    return (x * (1.0 / s if s > 0 else 0.0)).astype(np.float32)  # (d,)


def parse_normalize(value) -> int:
    """embd_normalize: an integer, -1 or more (llama-server reads it as an int)."""
    if value is None:
        return DEFAULT_NORMALIZE
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= MAX_P_NORM:
        raise EmbeddingError(
            "embd_normalize must be an integer: -1 none, 0 max absolute, 1 taxicab, "
            f"2 Euclidean, up to {MAX_P_NORM} a p-norm"
        )
    return value
