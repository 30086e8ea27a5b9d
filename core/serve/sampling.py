"""Token sampling, log-probabilities and stop strings.

The sampler is a plain callable ``sampler(logits, history) -> token`` built from
:class:`SamplingParams`, so generation code can take any sampler (mlx-lm style).
The chain follows llama.cpp's default order: logit bias, grammar mask, penalties,
top-k, top-p, min-p, temperature. Temperature <= 0 is greedy (after the bias and
the mask: a banned token is never chosen, a forced one always is).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import MixdeskError, UserError
from ..options import flag
from ..values import is_finite_number, shown

Sampler = Callable[[np.ndarray, Sequence[int]], int]

# Penalty bounds. A model's logits are O(10), so a presence/frequency penalty of 100 or
# a repeat penalty of 100 (or 1/100) already makes a repeated token certain or
# impossible: nothing larger changes what is sampled. Within these bounds a penalty
# moves a logit by at most 100 x (count <= context length, ~1e6) = 1e8, far inside
# float32's range (3e38), so the sampler never sees inf/NaN made by a penalty; values
# like 1e300 (which llama.cpp also accepts) overflowed and stopped the engine.
PENALTY_MAX = 100.0  # |presence_penalty|, |frequency_penalty|
REPEAT_PENALTY_RANGE = (0.01, 100.0)
# A logit bias is clipped to this (float32 holds 3e38): +1e30 already forces a token.
BIAS_MAX = 1e30


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
    # token id -> added to its logit before anything else; -inf bans it
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # llguidance grammar text (core.serve.grammar), or None
    # context shift (--context-shift): prompt tokens always kept (-1: the whole prompt)
    # and tokens dropped per shift (0: half of the others), llama-server's n_keep/n_discard
    n_keep: int = 0
    n_discard: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingParams:
        """The sampling flags (--temp, --seed, --top-k, ..., -n) as the params every
        request starts from: -p uses them, and an HTTP request's fields override them
        one by one, as llama-server's defaults. Raises SamplingError (a UserError)
        naming a value out of range."""
        d = cls()  # the one home of the defaults (llama-server's)
        seed = flag(args, "seed", -1)
        return validate(
            cls(
                temperature=flag(args, "temp", d.temperature),
                top_k=flag(args, "top_k", d.top_k),
                top_p=flag(args, "top_p", d.top_p),
                min_p=flag(args, "min_p", d.min_p),
                repeat_penalty=flag(args, "repeat_penalty", d.repeat_penalty),
                repeat_last_n=flag(args, "repeat_last_n", d.repeat_last_n),
                presence_penalty=flag(args, "presence_penalty", d.presence_penalty),
                frequency_penalty=flag(args, "frequency_penalty", d.frequency_penalty),
                seed=None if seed < 0 else seed,
                n_predict=flag(args, "n_predict", d.n_predict),
                ignore_eos=bool(flag(args, "ignore_eos", d.ignore_eos)),
            )
        )


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
    validate_logit_bias(p.logit_bias)
    if p.grammar is not None and not isinstance(p.grammar, str):
        raise SamplingError("grammar must be a string")
    return p


def validate_logit_bias(bias, n_vocab: int | None = None) -> None:
    """Token ids in range (when n_vocab is known), biases finite or -inf (a ban)."""
    if not isinstance(bias, dict):
        raise SamplingError("logit_bias must map token ids to biases")
    for tok, b in bias.items():
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise SamplingError(f"logit_bias: token {shown(tok)} is not a token id")
        if n_vocab is not None and not 0 <= tok < n_vocab:
            raise SamplingError(
                f"logit_bias: token id {tok} is out of range (vocabulary has {n_vocab} tokens)"
            )
        ok = isinstance(b, (int, float)) and not isinstance(b, bool)
        if not ok or not (math.isfinite(b) or b == -math.inf):
            raise SamplingError(
                f"logit_bias: the bias of token {tok} must be a finite number or false "
                f"(never), got {shown(b)}"
            )


def parse_logit_bias(value, tokenizer, n_vocab: int) -> dict[int, float]:
    """A request's ``logit_bias`` in llama-server's forms: a list of ``[token, bias]``
    pairs or OpenAI's map ``{"token id": bias}``. A token given as text (a string in a
    pair, or a map key that is not a number) is tokenized and each of its tokens gets
    the bias; a bias of ``false`` bans the token. Entries for the same token add up,
    as llama.cpp applies them one after another. SamplingError (400) names a bad
    entry: llama-server skips those silently, which hides a client's typo."""
    if value is None:
        return {}
    if isinstance(value, dict):
        entries = list(value.items())
    elif isinstance(value, list):
        entries = []
        for i, el in enumerate(value):
            if not isinstance(el, list) or len(el) != 2:
                raise SamplingError(f"logit_bias[{i}] must be a [token, bias] pair")
            entries.append((el[0], el[1]))
    else:
        raise SamplingError("logit_bias must be a list of [token, bias] pairs or an object")
    out: dict[int, float] = {}
    for key, b in entries:
        bias = _bias_value(key, b)
        for tok in _bias_tokens(key, tokenizer, isinstance(value, dict)):
            if not 0 <= tok < n_vocab:
                raise SamplingError(
                    f"logit_bias: token id {tok} is out of range (vocabulary has {n_vocab} tokens)"
                )
            out[tok] = out.get(tok, 0.0) + bias
    return out


def _bias_value(key, b) -> float:
    if b is False:
        return -math.inf
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        b = float(b)
        if math.isfinite(b) or b == -math.inf:
            return b
    raise SamplingError(
        f"logit_bias: the bias of token {shown(key)} must be a finite number or false "
        f"(never), got {shown(b)}"
    )


def _bias_tokens(key, tokenizer, from_map: bool) -> list[int]:
    if isinstance(key, int) and not isinstance(key, bool):
        return [key]
    if isinstance(key, str):
        if from_map:
            try:
                return [int(key, 10)]
            except ValueError:
                pass  # not a number: text, tokenized below (llama-server's rule)
        if not key:
            raise SamplingError("logit_bias: a token given as text must not be empty")
        return tokenizer.encode(key)
    raise SamplingError(f"logit_bias: token {shown(key)} must be a token id or a string")


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


def apply_logit_bias(logits: np.ndarray, ids: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """A copy of logits with bias[i] added to logits[ids[i]] (-inf: that token never)."""
    out = logits.copy()
    ids = ids[ids < len(out)]  # a model may have fewer logits than the request's vocab check
    out[ids] += bias[: len(ids)]
    return out


def make_sampler(p: SamplingParams, eog_ids: Iterable[int] = (), constraint=None) -> Sampler:
    """The sampler of one sequence. ``constraint`` (core.serve.grammar.Constraint) is
    that sequence's grammar state: its mask is applied before every token and it is
    told every token chosen. ignore_eos does not fight a grammar: once the grammar is
    complete, only an end-of-generation token may follow."""
    seed = p.seed if p.seed is not None and p.seed >= 0 else None
    rng = np.random.default_rng(seed)
    banned = np.fromiter(eog_ids, dtype=np.int64) if p.ignore_eos and constraint is None else None
    bias_ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
    bias_vals = np.fromiter(p.logit_bias.values(), dtype=np.float64, count=len(p.logit_bias))
    # a finite bias beyond float32 (1e300, which llama-server accepts) must not become +inf
    bias_vals = np.where(
        np.isneginf(bias_vals), -np.inf, np.clip(bias_vals, -BIAS_MAX, BIAS_MAX)
    ).astype(np.float32)

    def choose(logits: np.ndarray, history: Sequence[int]) -> int:
        tok = pick(logits, history)
        if constraint is not None:
            constraint.accept(tok)
        return tok

    def pick(logits: np.ndarray, history: Sequence[int]) -> int:
        x = logits
        if len(bias_ids):
            x = apply_logit_bias(x, bias_ids, bias_vals)
        if constraint is not None:
            x = np.where(constraint.allowed(len(x)), x, np.float32(-np.inf))  # (n_vocab,)
        with np.errstate(over="ignore", invalid="ignore"):  # reported just below instead
            x = apply_penalties(x, history, p)
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

    return choose


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
