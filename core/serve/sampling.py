"""Token sampling, log-probabilities and stop strings.

The sampler is a plain callable ``sampler(logits, history) -> token`` built from
:class:`SamplingParams`, so generation code can take any sampler (mlx-lm style).
The chain follows llama.cpp's default order: penalties, top-k, top-p, min-p,
temperature. Temperature <= 0 is greedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import MixdeskError, UserError
from ..options import is_finite_number

Sampler = Callable[[np.ndarray, Sequence[int]], int]

# Penalty bounds. A model's logits are O(10), so a presence/frequency penalty of 100 or
# a repeat penalty of 100 (or 1/100) already makes a repeated token certain or
# impossible: nothing larger changes what is sampled. Within these bounds a penalty
# moves a logit by at most 100 x (count <= context length, ~1e6) = 1e8, far inside
# float32's range (3e38), so the sampler never sees inf/NaN made by a penalty; values
# like 1e300 (which llama.cpp also accepts) overflowed and stopped the engine.
PENALTY_MAX = 100.0  # |presence_penalty|, |frequency_penalty|
REPEAT_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None or -1: a fresh random seed
    n_predict: int = -1  # -1: until end of generation or context full
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n_probs: int = 0  # top-N logprobs to report per generated token


class SamplingError(UserError):
    pass


class NonFiniteLogits(MixdeskError):
    """The logits to sample from hold NaN or +inf (or nothing but -inf): there is no
    meaningful token. The scheduler fails that one request with this message."""


def validate(p: SamplingParams) -> SamplingParams:
    """Reject values that would make sampling meaningless, naming the field."""

    def finite(name):
        v = getattr(p, name)
        if not is_finite_number(v):
            raise SamplingError(f"{name} must be a finite number, got {shown(v)}")

    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        finite(name)
    for name in ("top_k", "repeat_last_n", "n_predict", "n_probs"):
        v = getattr(p, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise SamplingError(f"{name} must be an integer, got {v!r}")
    if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool)):
        raise SamplingError(f"seed must be an integer, got {p.seed!r}")
    if not 0.0 <= p.top_p <= 1.0:
        raise SamplingError(f"top_p must be in [0, 1], got {p.top_p}")
    if not 0.0 <= p.min_p <= 1.0:
        raise SamplingError(f"min_p must be in [0, 1], got {p.min_p}")
    lo, hi = REPEAT_PENALTY_RANGE
    if not lo <= p.repeat_penalty <= hi:
        raise SamplingError(f"repeat_penalty must be in [{lo:g}, {hi:g}], got {p.repeat_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if abs(v) > PENALTY_MAX:
            raise SamplingError(f"{name} must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {v}")
    if p.n_probs < 0 or p.n_probs > 100:
        raise SamplingError(f"n_probs must be in [0, 100], got {p.n_probs}")
    if not isinstance(p.stop, list) or not all(isinstance(s, str) for s in p.stop):
        raise SamplingError("stop must be a list of strings")
    return p


def shown(v, limit: int = 32) -> str:
    """A value for an error message: its repr, cut short (a JSON int may have 400 digits)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - math.log(np.exp(x).sum())


def top_logprobs(logits: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens with logprobs over the full vocabulary."""
    lp = log_softmax(logits)
    idx = np.argpartition(-lp, n)[:n] if n < len(lp) else np.arange(len(lp))
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return [(int(i), float(lp[i])) for i in idx]


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    if (
        p.repeat_last_n == 0
        or not history
        or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
    ):
        return logits
    window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n :]
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    out = logits.copy()
    vals = out[ids]
    # llama.cpp: divide positive logits, multiply negative ones
    vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals -= counts * p.frequency_penalty + p.presence_penalty
    out[ids] = vals
    return out


def make_sampler(p: SamplingParams, eog_ids: Iterable[int] = ()) -> Sampler:
    seed = p.seed if p.seed is not None and p.seed >= 0 else None
    rng = np.random.default_rng(seed)
    banned = np.fromiter(eog_ids, dtype=np.int64) if p.ignore_eos else None

    def sample(logits: np.ndarray, history: Sequence[int]) -> int:
        with np.errstate(over="ignore", invalid="ignore"):  # reported just below instead
            x = apply_penalties(logits, history, p)
        if banned is not None and len(banned):
            x = x.copy() if x is logits else x
            x[banned] = -np.inf
        # max() is NaN if any entry is NaN: one pass finds NaN, +inf and all -inf (banned
        # tokens are -inf on purpose and are fine as long as some token is finite)
        if not math.isfinite(float(x.max())):
            raise NonFiniteLogits(
                "the logits are not finite (NaN or infinity) after penalties: "
                "no token can be sampled"
            )
        if p.temperature <= 0:
            return int(np.argmax(x))
        # candidates as (ids, logits), sorted descending
        k = p.top_k if 0 < p.top_k < len(x) else len(x)
        ids = np.argpartition(-x, k - 1)[:k] if k < len(x) else np.arange(len(x))
        ids = ids[np.argsort(-x[ids], kind="stable")]
        lg = x[ids].astype(np.float64)
        probs = np.exp(lg - lg[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, lg, probs = ids[:keep], lg[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, lg = ids[keep], lg[keep]
        z = (lg - lg[0]) / p.temperature
        w = np.exp(z)
        w /= w.sum()
        return int(ids[rng.choice(len(ids), p=w)])

    return sample


class StopMatcher:
    """Cuts generated text at the first stop string, exactly.

    ``feed(piece)`` returns the text that is now safe to show: anything that
    could still be the start of a stop string is held back until it can't be.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far
        self.sent = 0  # how much of text was released
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        if self.hit is not None:
            return ""
        self.text += piece
        for s in self.stops:
            i = self.text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1 and (self.hit is None or i < self._hit_at):
                self.hit, self._hit_at = s, i
        if self.hit is not None:
            self.text = self.text[: self._hit_at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_len())

    def _partial_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def flush(self) -> str:
        return self._release(len(self.text))
