"""Teacher-forced scoring: what a mix would have predicted at every position of a text.

The A/B diff view (#21) runs side B's reply through mix A (and the other way round)
and marks each token where the two mixes' top-1 differ. Scoring is a forward pass
that is not a generation: it runs on the engine thread (``Engine.run_on_engine``),
with its own temporary KV cache (never a pool slot, so running requests keep theirs),
in chunks of at most PREFILL_CHUNK rows per forward so memory stays bounded however
long the text is. Several texts (each with its own mix) run in one batch, as the
scheduler runs requests, so scoring two replies under two mixes costs about one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from ..lora.mix import MixWeights
from ..lora.runtime import LoraDeltas
from ..model.llama import BatchItem
from .sampling import log_softmax, top_logprobs
from .scheduler import PREFILL_CHUNK

DEFAULT_TOP_K = 5


class ScoreError(UserError):
    """A text that cannot be scored (empty reply, token out of the vocabulary, too long)."""


@dataclass
class Candidate:
    id: int
    text: str  # the token's piece as top_logprobs shows it
    logprob: float


@dataclass
class TokenScore:
    """One reply position: the token that is there and what the mix predicted for it."""

    token: int
    text: str  # what this token adds to the reply's text ("" for an end-of-generation)
    logprob: float  # of ``token`` under the mix
    top: list[Candidate] = field(default_factory=list)  # best first

    @property
    def top1(self) -> int:
        return self.top[0].id


@dataclass
class ScoreJob:
    tokens: list[int]  # prompt + reply
    mix: MixWeights | None  # None: the base model
    start: int  # index of the first reply token in ``tokens``


def check_job(job: ScoreJob, vocab_size: int, ctx_size: int) -> None:
    n = len(job.tokens)
    if not 1 <= job.start < n:
        raise ScoreError(
            f"nothing to score: the reply starts at {job.start} of {n} tokens "
            "(it needs at least one token before it and one in it)"
        )
    bad = [t for t in job.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ScoreError(f"token id {bad[0]} is not in the vocabulary (size {vocab_size})")
    if n - 1 > ctx_size:
        raise ScoreError(f"{n} tokens do not fit in a context of {ctx_size}")


def score_many(model, tokenizer, jobs: Sequence[ScoreJob], top_k: int = DEFAULT_TOP_K):
    """Score every job's reply under its own mix; call on the engine thread.

    Returns one list of TokenScore per job, one entry per reply token
    ``tokens[start:]``. Position i's logits come from running tokens[:i], so the last
    token itself never runs; rows before ``start - 1`` only fill the KV cache.
    """
    vocab = model.cfg.vocab_size
    top_k = max(1, min(int(top_k), vocab))
    caches = [model.new_cache(len(j.tokens) - 1) for j in jobs]
    inputs = [np.asarray(j.tokens[:-1], dtype=np.int64) for j in jobs]  # (n-1,) each
    out: list[list[TokenScore]] = [[] for _ in jobs]
    decoders = [tokenizer.decoder() for _ in jobs]
    # one forward holds at most PREFILL_CHUNK rows in all: their logits (rows × vocab
    # float32) are the largest buffer of a scoring pass
    chunk = max(1, PREFILL_CHUNK // max(1, len(jobs)))
    while True:
        live = [i for i, c in enumerate(caches) if c.length < len(inputs[i])]
        if not live:
            return out
        items, mixes, firsts = [], [], []
        for i in live:
            p0 = caches[i].length
            rows = inputs[i][p0 : p0 + chunk]  # (c,)
            # logits are wanted for rows at positions >= start - 1 (they predict the reply)
            want = p0 + len(rows) - 1 >= jobs[i].start - 1
            items.append(BatchItem(rows, caches[i], all_logits=want))
            mixes.append(jobs[i].mix)
            firsts.append(p0)
        logits = model(items, LoraDeltas.of(items, mixes))  # per item (c, vocab) or (1, vocab)
        for i, it, p0, lg in zip(live, items, firsts, logits):
            if not it.all_logits:
                continue
            job = jobs[i]
            for r in range(max(0, job.start - 1 - p0), len(it.tokens)):
                tok = job.tokens[p0 + r + 1]  # the token these logits predict
                out[i].append(_position(tokenizer, decoders[i], lg[r], tok, top_k))


def _position(tokenizer, decoder, logits: np.ndarray, tok: int, k: int) -> TokenScore:
    # the same top-k and logprobs as a generation's n_probs (over the raw logits)
    top = [Candidate(t, tokenizer.probs_piece(t)[0], lp) for t, lp in top_logprobs(logits, k)]
    own = next((c.logprob for c in top if c.id == tok), None)
    if own is None:
        own = float(log_softmax(logits)[tok])  # (vocab,) float64, one entry read
    # the reply's own text, released as the generation released it (whole UTF-8
    # characters; an end-of-generation token adds nothing)
    text = decoder.flush() if tokenizer.is_eog(tok) else decoder.push(tok)
    return TokenScore(tok, text, own, top)


def disagreements(a: Sequence[TokenScore], b: Sequence[TokenScore]) -> list[bool]:
    """Per position of one text scored under two mixes: True where their top-1 differ."""
    if len(a) != len(b) or any(x.token != y.token for x, y in zip(a, b)):
        raise ValueError("disagreements() compares two scorings of the same text")
    return [x.top1 != y.top1 for x, y in zip(a, b)]
