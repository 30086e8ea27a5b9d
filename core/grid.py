"""The X/Y grid of mixes (issue #21): one prompt under every combination of two axes.

An axis varies one thing over a list of values: the scale of one adapter
(``scale``), the scale of one control vector (``vector``), a named mix (``preset``),
the merge method (``method``: linear, ties, dare_ties, ... as core/lora/merge.py
defines them) or the sampling seed (``seed``). A cell's mix carries the base mix's
control vectors (a preset's own, when a preset axis sets the mix).
The cells are X × Y; each starts from a base mix (the desk's, with its method,
unless given) and takes the preset of its column/row first, then the adapter scale,
then the method, then the seed, so "preset × scale of adapter 2" means "each
preset, with adapter 2 at each scale".

All cells are submitted with ``Engine.submit_many``: the scheduler admits them in
the same step (up to its slot count; the rest wait in its queue and start as
slots free up, in waves) and runs them as one batch, whose base matmuls every
cell shares. Parsing, validation and exports are pure functions; the window
(``ui/grid.py``), the HTTP route (``core/http/grid.py``) and the bench
(``bench/grid.py``) share them.
"""

from __future__ import annotations

import csv
import io
import math
import queue
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import UserError
from .lora.control import SCALE_MAX as VECTOR_SCALE_MAX
from .lora.merge import MergeSpec
from .lora.mix import Mix, mix_text
from .lora.registry import LORA_SCALE_MAX, scales_of_list
from .options import is_finite_number
from .serve.sampling import SamplingParams
from .serve.scheduler import DoneEvent, Event, Request

MAX_CELLS = 64  # a grid is one batch (then waves): 64 sequences is already 8 waves of 8
MAX_SEED = 2**31 - 1
AXIS_KINDS = ("scale", "vector", "preset", "method", "seed")
# a cell applies its preset (a whole mix) first, then one adapter's scale, then how
# the adapters merge, then the seed
APPLY_ORDER = {"preset": 0, "scale": 1, "vector": 1, "method": 2, "seed": 3}


class GridError(UserError):
    """A grid the user asked for that cannot run (the HTTP layer answers 400)."""


@dataclass(frozen=True)
class Axis:
    """What varies along one side of the grid, and over which values."""

    kind: str  # one of AXIS_KINDS
    values: tuple  # floats (scale), preset names (preset), MergeSpecs (method), ints (seed)
    adapter: int | None = None  # the adapter whose scale varies (kind "scale")
    vector: int | None = None  # the control vector whose scale varies (kind "vector")
    name: str | None = None  # that vector's name, for labels

    def vector_name(self) -> str:
        return self.name or f"vector #{self.vector}"

    def label(self, i: int, names: Mapping[int, str] | None = None) -> str:
        v = self.values[i]
        if self.kind == "vector":
            return f"{self.vector_name()} ×{float(v):g}"
        if self.kind == "scale":
            name = (names or {}).get(self.adapter, f"#{self.adapter}")
            return f"{name} ×{float(v):g}"
        if self.kind == "seed":
            return f"seed {v}"
        if self.kind == "method":
            return merge_spec(v, "method").label()
        return str(v)

    def title(self, names: Mapping[int, str] | None = None) -> str:
        if self.kind == "vector":
            return f"scale of vector {self.vector_name()}"
        if self.kind == "scale":
            return f"scale of {(names or {}).get(self.adapter, f'#{self.adapter}')}"
        return self.kind


@dataclass
class GridSpec:
    """One prompt (chat ``messages`` or raw ``prompt`` text), sampling settings, an X
    axis and an optional Y axis; ``base`` is the mix unvaried adapters keep (None:
    the engine's global mix at submission); ``presets`` name the mixes a preset
    axis may use (name -> {adapter id: scale})."""

    x: Axis
    y: Axis | None = None
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    messages: list[dict] | None = None
    prompt: str | None = None
    base: dict[int, float] | None = None
    presets: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        """(columns, rows)."""
        return len(self.x.values), len(self.y.values) if self.y else 1

    @property
    def prompt_text(self) -> str:
        """The prompt as a person reads it (exports): the raw text, or the last user turn."""
        if self.prompt is not None:
            return self.prompt
        users = [m.get("content", "") for m in self.messages or [] if m.get("role") == "user"]
        return str(users[-1]) if users else ""


@dataclass(frozen=True)
class Cell:
    index: int  # row-major: y * columns + x
    x: int
    y: int
    mix: Mix  # every loaded adapter's scale in this cell, and its method (.merge)
    params: SamplingParams
    x_label: str
    y_label: str


@dataclass
class CellResult:
    cell: Cell
    text: str
    tokens: int
    tok_s: float
    stop: str  # the DoneEvent's stop_type: eos, limit, word, cancel, error
    error: str | None = None

    @classmethod
    def from_done(cls, cell: Cell, done: DoneEvent) -> CellResult:
        t = done.timings.as_dict()
        return cls(
            cell,
            done.content,
            int(t["predicted_n"]),
            float(t["predicted_per_second"]),
            done.stop_type,
            done.error,
        )

    def as_dict(self, names: Mapping[int, str] | None = None) -> dict[str, Any]:
        """The cell as the HTTP API returns it."""
        c = self.cell
        return {
            "cell": c.index,
            "x": c.x,
            "y": c.y,
            "x_label": c.x_label,
            "y_label": c.y_label,
            "lora": [{"id": a, "scale": s} for a, s in sorted(c.mix.items())],
            "mix": mix_text(c.mix, names or {}),
            **({"merge": c.mix.merge.as_dict()} if c.mix.merge is not None else {}),
            "seed": c.params.seed,
            "content": self.text,
            "tokens_predicted": self.tokens,
            "predicted_per_second": self.tok_s,
            "stop_type": self.stop,
            **({"error": self.error} if self.error else {}),
        }


# ---- parsing (the HTTP body's axes; the window builds Axis objects directly) ---------


def parse_axis(obj: Any, what: str, adapters: Mapping[int, str]) -> Axis:
    """{"kind": "scale", "adapter": id or name, "values": [...]}, {"kind": "preset",
    "values": [names]}, {"kind": "method", "values": ["ties", {"method": "dare_ties",
    "density": 0.3}, ...]} or {"kind": "seed", "values": [ints]} -> a checked Axis.
    ``adapters``: the loaded adapters, id -> name."""
    if not isinstance(obj, Mapping):
        raise GridError(f'{what} must be an object like {{"kind": "scale", "values": [...]}}')
    kind = obj.get("kind")
    if kind not in AXIS_KINDS:
        raise GridError(f"{what}.kind must be one of {', '.join(AXIS_KINDS)}, got {kind!r}")
    values = obj.get("values")
    if not isinstance(values, list):
        raise GridError(f"{what}.values must be a list")
    adapter = vector = None
    if kind == "scale":
        adapter = resolve_adapter(obj.get("adapter"), f"{what}.adapter", adapters)
    if kind == "vector":  # by id (GET /control-vectors); the engine refuses an unknown one
        vector = obj.get("vector")
        if isinstance(vector, bool) or not isinstance(vector, int):
            raise GridError(f"{what}.vector must be a control vector id, got {vector!r}")
    if kind == "method":
        values = [merge_spec(v, f"{what}.values[{i}]") for i, v in enumerate(values)]
    return check_axis(Axis(kind, tuple(values), adapter, vector), what, adapters)


def merge_spec(value: Any, what: str) -> MergeSpec:
    """A method by name ("ties") or as an object ({"method", "density", "rank", "seed",
    "majority_sign_method"}, core/lora/merge.py) -> its MergeSpec; GridError if bad."""
    if isinstance(value, MergeSpec):
        return value
    try:
        if isinstance(value, Mapping):
            return MergeSpec.from_dict(dict(value), what)
        return MergeSpec.make(value)
    except UserError as e:  # MergeError
        raise GridError(f"{what}: {e}") from None


def resolve_adapter(ref: Any, what: str, adapters: Mapping[int, str]) -> int:
    """An adapter named by id (int) or by name (str) -> its id."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        if ref not in adapters:
            raise GridError(f"{what}: no adapter with id {ref}")
        return ref
    if isinstance(ref, str):
        ids = [a for a, n in adapters.items() if n == ref]
        if len(ids) != 1:
            why = "no adapter" if not ids else "several adapters"
            raise GridError(f"{what}: {why} named {ref!r}")
        return ids[0]
    raise GridError(f"{what} must be an adapter id or name, got {ref!r}")


def check_axis(axis: Axis, what: str, adapters: Mapping[int, str]) -> Axis:
    """The axis with its values checked (and scales as floats); GridError otherwise."""
    if not axis.values:
        raise GridError(f"{what} has no values: give at least one")
    if axis.kind in ("scale", "vector"):
        if axis.kind == "scale" and axis.adapter not in adapters:
            raise GridError(f"{what}: no adapter with id {axis.adapter}")
        noun, bound = (
            ("scale", LORA_SCALE_MAX)
            if axis.kind == "scale"
            else ("vector scale", VECTOR_SCALE_MAX)
        )
        for v in axis.values:
            if not is_finite_number(v, bound):
                raise GridError(
                    f"{what}: a {noun} must be a finite number in "
                    f"[-{bound:g}, {bound:g}], got {v!r}"
                )
        return replace(axis, values=tuple(float(v) for v in axis.values))
    if axis.kind == "seed":
        for v in axis.values:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SEED:
                raise GridError(f"{what}: a seed must be an integer in [0, {MAX_SEED}], got {v!r}")
        return axis
    if axis.kind == "preset":
        for v in axis.values:
            if not isinstance(v, str) or not v:
                raise GridError(f"{what}: a preset must be named by a non-empty string, got {v!r}")
        return axis
    if axis.kind == "method":
        return replace(axis, values=tuple(merge_spec(v, what) for v in axis.values))
    raise GridError(f"{what}.kind must be one of {', '.join(AXIS_KINDS)}, got {axis.kind!r}")


def parse_mix_list(entries: Any, what: str, adapters: Mapping[int, str]) -> dict[int, float]:
    """llama-server's [{"id", "scale"}] list (unlisted adapters 0) -> a full mix; an
    adapter may be named by id or name. GridError otherwise (a bad scale's too)."""
    try:
        return scales_of_list(
            entries, what, adapters, lambda ref: resolve_adapter(ref, f"{what}: id", adapters)
        )
    except UserError as e:  # check_scale's EngineError
        raise GridError(str(e)) from None


def parse_spec(body: Mapping, params: SamplingParams, adapters: Mapping[int, str]) -> GridSpec:
    """A grid from an HTTP body (sampling fields already parsed into ``params``).

    ``{"messages": [...]} or {"prompt": "text"}``, ``"x"`` and optional ``"y"`` axes,
    optional ``"presets": {name: [{"id", "scale"}]}`` (the named mixes a preset axis
    uses) and ``"lora": [{"id", "scale"}]`` (the base mix; default the global one)."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if (messages is None) == (prompt is None):
        raise GridError('give the prompt as either "messages" (chat) or "prompt" (raw text)')
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise GridError('"prompt" must be a non-empty string')
    if messages is not None and (not isinstance(messages, list) or not messages):
        raise GridError('"messages" must be a non-empty list of {"role", "content"} objects')
    if "x" not in body:
        raise GridError('"x" (the X axis) is required')
    x = parse_axis(body["x"], "x", adapters)
    y = parse_axis(body["y"], "y", adapters) if body.get("y") is not None else None
    raw_presets = body.get("presets", {})
    if not isinstance(raw_presets, Mapping):
        raise GridError('"presets" must be an object: {name: [{"id", "scale"}, ...]}')
    presets = {
        str(n): parse_mix_list(m, f"presets[{n!r}]", adapters) for n, m in raw_presets.items()
    }
    base = parse_mix_list(body["lora"], "lora", adapters) if body.get("lora") is not None else None
    spec = GridSpec(x, y, params, messages=messages, prompt=prompt, base=base, presets=presets)
    check_spec(spec, adapters)
    return spec


def check_spec(spec: GridSpec, adapters: Mapping[int, str]) -> None:
    """Raise GridError unless the grid can run: valid axes, known presets, not too many
    cells, two axes that do not vary the same thing."""
    axes = [("x", spec.x)] + ([("y", spec.y)] if spec.y else [])
    for what, axis in axes:
        check_axis(axis, what, adapters)
        if axis.kind == "preset":
            unknown = [v for v in axis.values if v not in spec.presets]
            if unknown:
                known = ", ".join(sorted(spec.presets)) or "none"
                raise GridError(f"{what}: unknown preset {unknown[0]!r} (known: {known})")
    if spec.y is not None and (spec.x.kind, spec.x.adapter, spec.x.vector) == (
        spec.y.kind,
        spec.y.adapter,
        spec.y.vector,
    ):
        raise GridError("x and y vary the same thing: pick two different axes")
    cols, rows = spec.shape
    if cols * rows > MAX_CELLS:
        raise GridError(
            f"a grid of {cols} × {rows} = {cols * rows} cells is too large "
            f"(at most {MAX_CELLS}); use fewer values"
        )


# ---- cells -------------------------------------------------------------------------------


def cells(
    spec: GridSpec, current: Mapping[int, float], names: Mapping[int, str] | None = None
) -> list[Cell]:
    """The X × Y cells, row-major. ``current``: the mix to start from when the spec has
    no base (the engine's global mix): every loaded adapter, by id, and its method as
    ``.merge`` (a core.lora.mix.Mix), which cells keep unless a method axis says
    otherwise. ``names`` (adapter id -> name) name the adapters in the axis labels."""
    base = dict(spec.base if spec.base is not None else current)
    base_merge = getattr(current, "merge", None) if spec.base is None else None
    # the base's control vectors (None: the engine's global ones, at submission)
    base_vectors = getattr(spec.base if spec.base is not None else current, "vectors", None)
    cols, rows = spec.shape
    out = []
    for j in range(rows):
        for i in range(cols):
            mix, merge, params = dict(base), base_merge, spec.params
            vectors = None if base_vectors is None else dict(base_vectors)
            picks = [(spec.x, i)] + ([(spec.y, j)] if spec.y else [])
            # presets first (a whole mix), then one adapter's scale, the method, the seed
            for axis, k in sorted(picks, key=lambda p: APPLY_ORDER[p[0].kind]):
                v = axis.values[k]
                if axis.kind == "preset":
                    mix = {a: spec.presets[v].get(a, 0.0) for a in base}
                    own = getattr(spec.presets[v], "vectors", None)
                    vectors = vectors if own is None else dict(own)
                elif axis.kind == "scale":
                    mix[axis.adapter] = float(v)
                elif axis.kind == "vector":
                    vectors = {**(vectors or {}), axis.vector: float(v)}
                elif axis.kind == "method":
                    merge = merge_spec(v, "method")
                else:
                    params = replace(params, seed=int(v))
            if params.seed is None or params.seed < 0:
                # a random seed, drawn here rather than by the sampler: the cell records
                # the seed it ran with (the CSV, the API), and it can be run again
                params = replace(params, seed=secrets.randbelow(MAX_SEED + 1))
            out.append(
                Cell(
                    j * cols + i,
                    i,
                    j,
                    Mix(mix, merge, vectors=vectors),
                    params,
                    spec.x.label(i, names),
                    spec.y.label(j, names) if spec.y else "",
                )
            )
    return out


# ---- running -------------------------------------------------------------------------------


class GridRun:
    """A grid's cells in flight: ``requests[i]`` runs ``cells[i]``."""

    def __init__(self, cells_: list[Cell], requests: list[Request]):
        self.cells, self.requests = cells_, requests

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()


def submit_grid(
    eng,
    cell_list: list[Cell],
    prompt: list[int],
    on_event: Callable[[int, Event], None],
    source: str = "grid",
    cache_prompt: bool = True,
) -> GridRun:
    """Submit every cell at once (``Engine.submit_many``: admitted in the same step up
    to the slot count, the rest queued). ``on_event(cell index, event)`` runs on the
    engine thread. If any cell is refused, none runs and its error is raised."""
    jobs = [
        dict(
            prompt=prompt,
            params=c.params,
            on_event=lambda ev, i=c.index: on_event(i, ev),
            mix=c.mix,
            cache_prompt=cache_prompt,
            source=source,
        )
        for c in cell_list
    ]
    got = eng.submit_many(jobs)
    bad = [r for r in got if isinstance(r, BaseException)]
    if bad:
        for r in got:
            if not isinstance(r, BaseException):
                r.cancel()
        raise bad[0]
    return GridRun(cell_list, got)


def run_grid(
    eng,
    spec: GridSpec,
    prompt: list[int] | None = None,
    on_event: Callable[[int, Event], None] | None = None,
    timeout: float | None = None,
    cache_prompt: bool = True,
) -> tuple[GridRun, list[CellResult]]:
    """Run a grid to the end on ``eng`` (scripts, bench, tests): its requests and one
    result per cell. ``prompt`` defaults to the spec's (chat template or raw text);
    ``cache_prompt`` False keeps the prefix cache out of it (the bench's timings)."""
    adapters = {a["id"]: a["name"] for a in eng.adapters()}
    check_spec(spec, adapters)
    tokens = prompt if prompt is not None else encode(eng, spec)
    q: queue.Queue = queue.Queue()

    def relay(i: int, ev: Event) -> None:
        if on_event is not None:
            on_event(i, ev)
        if isinstance(ev, DoneEvent):
            q.put((i, ev))

    run = submit_grid(
        eng, cells(spec, eng.get_mix(), adapters), tokens, relay, cache_prompt=cache_prompt
    )
    dones: dict[int, DoneEvent] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(dones) < len(run.cells):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                i, ev = q.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"the grid did not finish within {timeout:g} s") from None
            dones[i] = ev
    finally:
        run.cancel()  # no-op for finished cells; frees the slots of the rest
    return run, [CellResult.from_done(c, dones[c.index]) for c in run.cells]


def encode(eng, spec: GridSpec) -> list[int]:
    """The prompt's tokens: chat messages through the model's template, raw text as
    /completion encodes a string (with BOS if the model wants one)."""
    if spec.messages is not None:
        return eng.chat_prompt(spec.messages)
    return eng.tokenizer.encode(spec.prompt, add_special=True, parse_special=True)


# ---- exports ---------------------------------------------------------------------------------

CSV_COLUMNS = (
    "cell",
    "x",
    "y",
    "prompt",
    "mix",
    "seed",
    "reply",
    "tokens",
    "tok_s",
    "stop",
)


def to_csv(prompt: str, results: Sequence[CellResult], names: Mapping[int, str]) -> str:
    """One row per cell (the csv module quotes commas, quotes and newlines in replies)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in results:
        c = r.cell
        w.writerow(
            [
                c.index,
                c.x_label,
                c.y_label,
                prompt,
                mix_text(c.mix, names),
                "" if c.params.seed is None else c.params.seed,
                r.text,
                r.tokens,
                f"{r.tok_s:.1f}",
                r.stop,
            ]
        )
    return buf.getvalue()


def params_text(p: SamplingParams) -> str:
    """The sampling settings a grid ran with, on one line (the PNG export's header)."""
    length = "until the end" if p.n_predict < 0 else str(p.n_predict)
    return (
        f"temperature {p.temperature:.2f} · top-k {p.top_k} · top-p {p.top_p:.2f} · "
        f"min-p {p.min_p:.2f} · repeat penalty {p.repeat_penalty:.2f} · max tokens {length}"
    )


def _md_cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped, line breaks as <br>."""
    return (
        text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")
    )


def to_markdown(
    prompt: str,
    results: Sequence[CellResult],
    names: Mapping[int, str],
    spec: GridSpec | None = None,
) -> str:
    """A heading with the prompt, then a table with one row per cell."""
    x_title = spec.x.title(names) if spec else "x"
    y_title = spec.y.title(names) if spec and spec.y else "y"
    lines = [
        "## X/Y grid",
        "",
        f"**Prompt:** {_md_cell(prompt)}",
        "",
        f"| # | {_md_cell(x_title)} | {_md_cell(y_title)} | mix | reply | tokens | tok/s | stop |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    for r in results:
        c = r.cell
        tps = f"{r.tok_s:.1f}" if math.isfinite(r.tok_s) else ""
        lines.append(
            f"| {c.index} | {_md_cell(c.x_label)} | {_md_cell(c.y_label)} | "
            f"{_md_cell(mix_text(c.mix, names))} | {_md_cell(r.text.strip())} | "
            f"{r.tokens} | {tps} | {r.stop} |"
        )
    return "\n".join(lines) + "\n"
