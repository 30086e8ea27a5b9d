"""Making a control vector from examples: contrasting prompt pairs in, a GGUF out.

What llama.cpp's cvector-generator and repeng do, on Mixdesk's own forward:

* each pair is two instructions ("Act as if you are extremely happy." / "... sad."),
  each put as the user's message through the model's chat template, followed by a
  shared *suffix*, the start of the assistant's reply ("I think", "Today"). Only
  the instruction differs, so what differs in the hidden states is the concept;
* the hidden state collected is block li's output at the prompt's last token, taken
  by a ``Deltas`` hook in the engine's own forward (``layer_out``, where a control
  vector is added), so the direction lives in the very space it is added to;
* per layer, ``pca`` takes the first principal component of the pair differences
  (pos - neg), uncentred as llama.cpp's power iteration does (so a consistent shift
  is the component, not removed as a mean); ``mean`` takes the mean difference;
* the sign is oriented as repeng does: the hidden states are projected on the
  direction and it is flipped unless the positive side projects higher in most
  pairs (ties: on average), so a positive scale steers towards ``positive``;
* the size: llama.cpp writes unit vectors, whose effect then depends on each layer's
  hidden-state size; Mixdesk scales each direction to the mean distance of the
  pairs' two sides along it (the mean of |(pos - neg) . u|), so scale 1 on a layer
  moves a hidden state about as far as the examples differ there.

The engine runs each pair's forward between scheduler steps (``run`` below is
``Engine.run_on_engine``), so serving goes on while a vector is made, and the
caller's ``cancel`` is honoured between pairs, after the last one and, with
``load_made``, before the new file is loaded. The file is written as llama.cpp
reads it (core/lora/control.py): ``direction.N`` for block N's output, N >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..chat_template import build_prompt, encode_prompt
from ..model.deltas import Deltas, batch_spans
from ..model.llama import BatchItem
from ..values import shown
from .control import ControlVectorError, write_control_vector

METHODS = ("pca", "mean")
MAX_PAIRS = 64  # instruction pairs in one request
MAX_SUFFIXES = 64
MAX_EXAMPLES = 512  # pairs x suffixes: forwards of two short prompts each
MAX_TEXT_CHARS = 1000  # one instruction or suffix
MAX_PROMPT_TOKENS = 512  # one built prompt
NAME_CHARS = 64

Progress = Callable[[int, int], None]  # (pairs done, pairs in all)


class VectorTrainError(ControlVectorError):
    """A training request Mixdesk refuses (no pairs, an empty prompt, too many...)."""


class TrainCancelled(VectorTrainError):
    """The caller's cancel was set: nothing was written."""


@dataclass(frozen=True)
class Pair:
    positive: str
    negative: str


@dataclass(frozen=True)
class Template:
    label: str
    pairs: tuple[Pair, ...]


# Short reply starts shared by both sides of each pair (repeng's "truncated outputs"):
# varied openings, so the direction is the persona, not one sentence's topic.
SUFFIXES = (
    "",
    "I",
    "Well,",
    "Today",
    "The weather",
    "My day",
    "Honestly,",
    "You know what?",
    "Let me tell you",
    "This morning",
    "When I think about it,",
    "The best part",
    "Oh,",
    "So,",
    "Life",
    "My friend",
)


def _pairs(pos: Sequence[str], neg: Sequence[str]) -> tuple[Pair, ...]:
    return tuple(Pair(p, n) for p, n in zip(pos, neg))


TEMPLATES: dict[str, Template] = {
    "happy-sad": Template(
        "Happy / sad",
        _pairs(
            [
                "Act as if you are extremely happy.",
                "You are overjoyed and cheerful. Talk about your day.",
                "Respond with great joy and delight.",
            ],
            [
                "Act as if you are extremely sad.",
                "You are miserable and gloomy. Talk about your day.",
                "Respond with great sorrow and despair.",
            ],
        ),
    ),
    "formal-casual": Template(
        "Formal / casual",
        _pairs(
            [
                "Reply in a very formal, polite and professional tone.",
                "Write like a formal business letter.",
            ],
            [
                "Reply in a very casual, slangy, laid-back tone.",
                "Write like a quick text message to a buddy.",
            ],
        ),
    ),
    "verbose-terse": Template(
        "Verbose / terse",
        _pairs(
            [
                "Answer at great length, with many details and elaborations.",
                "Be extremely wordy and explain everything thoroughly.",
            ],
            [
                "Answer in as few words as possible.",
                "Be extremely brief and say only the essentials.",
            ],
        ),
    ),
}


@dataclass(frozen=True)
class TrainSpec:
    """What to make: instruction pairs, the shared reply starts, the method and the
    inclusive layer range written (None: every layer from 1)."""

    pairs: tuple[Pair, ...]
    suffixes: tuple[str, ...] = SUFFIXES
    method: str = "pca"
    layers: tuple[int, int] | None = None

    @property
    def n_examples(self) -> int:
        return len(self.pairs) * len(self.suffixes)


def _text(value: Any, what: str, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise VectorTrainError(f"{what} must be a string, got {shown(value)}")
    if not empty_ok and not value.strip():
        raise VectorTrainError(f"{what} must not be empty")
    if len(value) > MAX_TEXT_CHARS:
        raise VectorTrainError(f"{what} is {len(value)} characters; at most {MAX_TEXT_CHARS}")
    return value


def check_method(method: Any) -> str:
    if method not in METHODS:
        raise VectorTrainError(f"method must be one of {', '.join(METHODS)}, not {shown(method)}")
    return method


def check_name(name: Any) -> str:
    """A vector's file stem: letters, digits, '-', '_' and '.', not starting with '.'."""
    ok = (
        isinstance(name, str)
        and 0 < len(name) <= NAME_CHARS
        and not name.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "-_.") for c in name)
    )
    if not ok:
        raise VectorTrainError(
            f"name must be 1 to {NAME_CHARS} letters, digits, '-', '_' or '.' (not starting "
            f"with '.'), got {shown(name)}"
        )
    return name


def spec_of(body: Mapping[str, Any]) -> TrainSpec:
    """make_spec from a request body or a pairs file ({"pairs", "template", "suffixes",
    "method", "layers"}): the one reader of that shape (HTTP and the CLI)."""
    return make_spec(
        body.get("pairs"),
        body.get("template"),
        body.get("suffixes"),
        body.get("method", "pca"),
        body.get("layers"),
    )


def make_spec(
    pairs: Any = None,
    template: Any = None,
    suffixes: Any = None,
    method: Any = "pca",
    layers: Any = None,
) -> TrainSpec:
    """A checked TrainSpec from a client's or a user's values: ``pairs`` a list of
    {"positive", "negative"} (or 2-tuples), ``template`` a TEMPLATES name whose pairs
    come first; at least one pair in all. VectorTrainError, saying what, otherwise."""
    got: list[Pair] = []
    if template is not None:
        if template not in TEMPLATES:
            raise VectorTrainError(
                f"template must be one of {', '.join(TEMPLATES)}, not {shown(template)}"
            )
        got += TEMPLATES[template].pairs
    if pairs is not None:
        if not isinstance(pairs, list):
            raise VectorTrainError(f"pairs must be a list, got {shown(pairs)}")
        for i, p in enumerate(pairs):
            if isinstance(p, Mapping):
                extra = set(p) - {"positive", "negative"}
                if extra:
                    raise VectorTrainError(f"pairs[{i}]: unknown field {sorted(extra)[0]!r}")
                pos, neg = p.get("positive"), p.get("negative")
            elif isinstance(p, (list, tuple)) and len(p) == 2:
                pos, neg = p
            else:
                raise VectorTrainError(
                    f'pairs[{i}] must be {{"positive": ..., "negative": ...}}, got {shown(p)}'
                )
            got.append(Pair(_text(pos, f"pairs[{i}].positive"), _text(neg, f"pairs[{i}].negative")))
    if not got:
        raise VectorTrainError("no pairs: give pairs of contrasting prompts or a template")
    if len(got) > MAX_PAIRS:
        raise VectorTrainError(f"{len(got)} pairs; at most {MAX_PAIRS}")
    if suffixes is None:
        sfx = SUFFIXES
    else:
        if not isinstance(suffixes, list) or not suffixes:
            raise VectorTrainError("suffixes must be a non-empty list of strings")
        if len(suffixes) > MAX_SUFFIXES:
            raise VectorTrainError(f"{len(suffixes)} suffixes; at most {MAX_SUFFIXES}")
        sfx = tuple(_text(s, f"suffixes[{i}]", empty_ok=True) for i, s in enumerate(suffixes))
    spec = TrainSpec(tuple(got), sfx, check_method(method), _layers(layers))
    if spec.n_examples > MAX_EXAMPLES:
        raise VectorTrainError(
            f"{len(got)} pairs x {len(sfx)} suffixes = {spec.n_examples} examples; "
            f"at most {MAX_EXAMPLES}"
        )
    return spec


def middle_layers(n_layers: int) -> tuple[int, int]:
    """The band of layers the window steers by default, L/6 .. 2L/3: SmolLM2's 5..20,
    the demo vector's. Steering every layer, the last ones (whose hidden states are
    an order of magnitude larger) made replies loop at a fifth of the scale
    (tools/train_demo_vector.py)."""
    return max(1, n_layers // 6), max(1, min(n_layers - 1, 2 * n_layers // 3))


def _layers(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 1 <= value[0] <= value[1] <= 1 << 16
    )
    if not ok:
        raise VectorTrainError(f"layers must be [first, last] with 1 <= first <= last, got {value}")
    return int(value[0]), int(value[1])


# ---- the directions (numpy only: tested on synthetic hidden states) ---------------------


def direction(pos: np.ndarray, neg: np.ndarray, method: str) -> np.ndarray:
    """One layer's direction from the hidden states of the positive and the negative
    side of N examples, pos and neg (N, d): ``pca`` or ``mean`` (module docstring),
    oriented so the positive side projects higher, and as long as the mean distance
    of the two sides along it. A zero vector when the two sides do not differ."""
    diff = (pos - neg).astype(np.float64)  # (N, d)
    if method == "mean":
        u = diff.mean(axis=0)  # (d,)
    elif method == "pca":
        # the first right singular vector of the uncentred differences: the top
        # eigenvector of diffᵀdiff without forming the (d, d) matrix
        _, _, vt = np.linalg.svd(diff, full_matrices=False)  # vt (min(N, d), d)
        u = vt[0]  # (d,)
    else:
        raise VectorTrainError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    norm = float(np.linalg.norm(u))
    if not norm > 0.0 or not math.isfinite(norm):
        return np.zeros(pos.shape[1], dtype=np.float32)
    u /= norm
    # repeng's orientation: the share of examples whose positive side projects higher
    higher = (pos.astype(np.float64) @ u) - (neg.astype(np.float64) @ u)  # (N,)
    votes = float(np.mean(higher > 0)) - float(np.mean(higher < 0))
    if votes < 0 or (votes == 0 and higher.mean() < 0):
        u, higher = -u, -higher
    # its length: how far apart the two sides of an example lie along it, on average
    return (u * float(np.abs(higher).mean())).astype(np.float32)  # (d,)


# ---- collecting hidden states through the engine's forward ------------------------------


class LastRows(Deltas):
    """A forward's hook that keeps each block's output at the last row of every item:
    ``rows[li]`` (B, d) for B items, copied (the forward reuses its buffers)."""

    def __init__(self, lengths: Sequence[int], n_layers: int):
        self.last = [e - 1 for _, e in batch_spans(lengths)]
        self.rows: list[np.ndarray | None] = [None] * n_layers

    def layer_out(self, x: np.ndarray, li: int) -> None:
        self.rows[li] = x[self.last].copy()  # (B, d)


def last_hidden(model, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """Every block's output at each prompt's last token, (n_layers, B, d); one forward
    of the B prompts with temporary caches. Call on the engine thread."""
    items = [
        BatchItem(np.asarray(p, dtype=np.int64), model.new_cache(len(p)), hidden=True)
        for p in prompts
    ]
    hook = LastRows([len(p) for p in prompts], model.cfg.n_layers)
    model(items, hook)
    return np.stack(hook.rows)  # (L, B, d)


def example_prompts(spec: TrainSpec, render: Callable[[str, str], list[int]]) -> list[tuple]:
    """(positive tokens, negative tokens) of every pair x suffix, ``render(instruction,
    suffix)`` building one prompt; VectorTrainError for a prompt over MAX_PROMPT_TOKENS."""
    out = []
    for pair in spec.pairs:
        for sfx in spec.suffixes:
            two = (render(pair.positive, sfx), render(pair.negative, sfx))
            for toks in two:
                if len(toks) > MAX_PROMPT_TOKENS:
                    raise VectorTrainError(
                        f"a prompt is {len(toks)} tokens with the chat template; at most "
                        f"{MAX_PROMPT_TOKENS}: shorten the pair or the suffix"
                    )
            out.append(two)
    return out


def train(
    spec: TrainSpec,
    render: Callable[[str, str], list[int]],
    run: Callable[[Callable[[Any], Any]], Any],
    n_layers: int,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> dict[int, np.ndarray]:
    """The directions {layer: (d,)} for layers 1..n_layers-1 (or spec.layers),
    ``run(fn)`` running ``fn(model)`` where the model may run (the engine thread)
    and returning its result. TrainCancelled as soon as ``cancel()`` is true."""
    lo, hi = spec.layers or (1, n_layers - 1)
    if hi >= n_layers:
        raise VectorTrainError(f"layers {lo}..{hi}: the model's layers are 1..{n_layers - 1}")
    examples = example_prompts(spec, render)
    pos, neg = [], []
    for i, (p, n) in enumerate(examples):
        if cancel is not None and cancel():
            raise TrainCancelled("cancelled: no control vector was written")
        h = run(lambda model, p=p, n=n: last_hidden(model, [p, n]))  # (L, 2, d)
        # only the layers written are kept: 512 examples of a 4096-wide model's 32
        # layers would hold 270 MB
        pos.append(h[lo : hi + 1, 0])  # (layers, d)
        neg.append(h[lo : hi + 1, 1])
        if progress is not None:
            progress(i + 1, len(examples))
    if cancel is not None and cancel():  # set during the last pair: nothing to write
        raise TrainCancelled("cancelled: no control vector was written")
    hp, hn = np.stack(pos, axis=1), np.stack(neg, axis=1)  # (layers, N, d) each
    return {lo + k: direction(hp[k], hn[k], spec.method) for k in range(hi - lo + 1)}


def engine_render(eng) -> Callable[[str, str], list[int]]:
    """``render`` for ``train`` with an engine's template and tokenizer: the instruction
    as the user's message, then the suffix as the start of the assistant's reply."""

    def render(instruction: str, suffix: str) -> list[int]:
        text = build_prompt(
            eng.chat_template,
            [{"role": "user", "content": instruction}],
            defaults=eng.chat_defaults,
        )
        return encode_prompt(eng.tokenizer, text + suffix)

    return render


def train_on_engine(
    eng,
    spec: TrainSpec,
    out: str | Path,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> Path:
    """Make the vector of ``spec`` with a loaded engine (core/serve/engine.py's, taken
    as it is: the LoRA layer does not import the serving layer) and write it to
    ``out``; each forward runs on the engine thread between scheduler steps."""
    eng.require_ready()
    cfg, first = eng.config, eng.model

    def run(fn):
        def same_model(model):
            # a model loaded meanwhile would mix two models' hidden states
            if model is not first:
                raise VectorTrainError("the model changed while the vector was being made")
            return fn(model)

        return eng.run_on_engine(same_model).result()

    dirs = train(spec, engine_render(eng), run, cfg.n_layers, progress, cancel)
    return write_control_vector(out, dirs, model_hint=cfg.arch)


def load_made(path: Path, add: Callable[[Path], Any], cancel: Callable[[], bool] | None = None):
    """``add(path)`` (the caller's load of the file just made) unless its ``cancel`` was
    set while the file was written: then TrainCancelled, so a caller that has gone
    (an HTTP client that hung up, a closed dialog) gets nothing registered. The file
    goes if it is not loaded (cancelled, or the load refuses it)."""
    try:
        if cancel is not None and cancel():
            raise TrainCancelled("cancelled: no control vector was kept")
        return add(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
