"""Mixes: a scale per adapter, and the stacked low-rank weights a mix runs with.

A mix key is the sorted tuple of (adapter id, scale) pairs with a non-zero
scale, so a zero-scale adapter never makes a mix different. For each distinct
key we build, once and lazily, per layer and per fused projection one A
(R_total, in) and one B (out, R_total) with every adapter's effective scale
folded into B. The forward pass then adds ``(x Aᵀ) Bᵀ`` per sequence; base
weights are never touched, so switching mixes costs nothing model-sized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model import layout
from ..model.config import ModelConfig
from . import merge as M
from .adapter import Adapter, LoraPair
from .control import ControlVector, steer_rows
from .merge import MergeSpec

MixKey = tuple[tuple[int, float], ...]
Progress = Callable[[float, str], None]


class Mix(dict):
    """A mix as the engine takes and reports it: adapter id -> scale (a plain dict to
    every caller that only reads scales), plus ``merge``, how the adapters combine
    (None: not said; the engine then keeps its method for the global mix, and a
    request's own mix is a weighted sum). ``dict(mix)`` drops the method: pass the
    Mix itself where the method must follow (A/B compare, exports).

    ``vectors`` are the control vectors beside the adapters, vector id -> scale
    (core/lora/control.py); None: not said, the engine's global vectors apply (as
    llama-server applies its ``--control-vector`` flags to every request)."""

    def __init__(
        self,
        scales=(),
        merge: MergeSpec | None = None,
        vectors: Mapping[int, float] | None = None,
    ):
        super().__init__(scales)
        self.merge = merge
        self.vectors = None if vectors is None else dict(vectors)

    def __repr__(self) -> str:
        extra = "" if self.vectors is None else f", vectors={self.vectors!r}"
        return f"Mix({dict.__repr__(self)}, merge={self.merge!r}{extra})"


class MergedKey(tuple):
    """The key of a mix whose method builds a merged adapter (svd, ties, dare_*, ...):
    the same (id, scale) pairs as a linear key, so everything that reads a key's pairs
    still works, but equal only to a key with the same pairs *and* the same MergeSpec,
    so its built weights and prefix-cache entries are never shared with another method."""

    merge: MergeSpec

    def __new__(cls, pairs: Iterable[tuple[int, float]], merge: MergeSpec) -> MergedKey:
        self = super().__new__(cls, pairs)
        self.merge = merge
        return self

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MergedKey) and self.merge == other.merge and tuple.__eq__(self, other)
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((tuple(self), self.merge))

    def __repr__(self) -> str:
        return f"MergedKey({tuple.__repr__(self)}, {self.merge.label()})"


class SteeredKey(tuple):
    """The key of a mix with control vectors: the adapters' (id, scale) pairs as any
    key (a merge method's ``merge``, or None), plus ``steer``, the vectors' sorted
    non-zero (vector id, scale) pairs, and ``layers``, the inclusive range of layers
    they steer. Equal only to a SteeredKey with the same pairs, method, vectors and
    range, so a vector's built weights and prefix-cache KV are never served to another
    vector (or to no vector). Always true, even with no adapter: it steers."""

    merge: MergeSpec | None
    steer: tuple[tuple[int, float], ...]
    layers: tuple[int, int]

    def __new__(cls, pairs, merge, steer, layers) -> SteeredKey:
        self = super().__new__(cls, pairs)
        self.merge = merge if merge is not None and merge.builds and pairs else None
        self.steer, self.layers = tuple(steer), tuple(layers)
        return self

    def _id(self) -> tuple:
        return (tuple(self), self.merge, self.steer, self.layers)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SteeredKey) and self._id() == other._id()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._id())

    def __bool__(self) -> bool:
        return True

    def lora_key(self) -> MixKey:
        """The adapters' part alone, as mix_key gives it without vectors."""
        return mix_key(tuple(self), self.merge)

    def __repr__(self) -> str:
        return f"SteeredKey({tuple.__repr__(self)}, {self.merge}, {self.steer}, {self.layers})"


def mix_key(
    scales: Mapping[int, float] | Iterable[tuple[int, float]],
    merge: MergeSpec | None = None,
    steer: tuple[tuple[tuple[int, float], ...], tuple[int, int]] | None = None,
) -> MixKey:
    """Sorted non-zero (id, scale) pairs; a MergedKey when the method builds a merged
    adapter (``merge`` or, if None, the Mix's own); a SteeredKey when ``steer``, the
    vectors' (id, scale) pairs and their layer range, steers anything. Linear and cat
    keys stay plain tuples, so every linear key, cache entry and test is what it
    always was."""
    if merge is None:
        merge = getattr(scales, "merge", None)
    items = scales.items() if isinstance(scales, Mapping) else scales
    pairs = tuple(sorted((int(i), float(s)) for i, s in items if float(s) != 0.0))
    if steer is not None and steer[0]:
        return SteeredKey(pairs, merge, steer[0], steer[1])
    if merge is not None and merge.builds and pairs:
        return MergedKey(pairs, merge)
    return pairs


def mix_text(mix: Mapping[int, float] | Iterable[tuple[int, float]], names: Mapping) -> str:
    """'name ×0.50, other ×-1.00' for a {id: scale} dict, a Mix or a mix key (the
    chat's replies, A/B compare, the grid's cells and exports); a mix merged another
    way than a weighted sum says how: '... (ties d=0.5)'. ``names``: id -> name."""
    items = mix.items() if isinstance(mix, Mapping) else mix
    parts = [f"{names.get(int(a), f'#{a}')} ×{float(s):.2f}" for a, s in items if float(s) != 0.0]
    text = ", ".join(parts) if parts else "base model (no adapters)"
    merge = getattr(mix, "merge", None)
    if parts and merge is not None and merge.method != "linear":
        text += f" ({merge.label()})"
    return text


@dataclass
class Delta:
    """One fused target's low-rank delta, ``y += ((x Aᵀ) ⊙ s) Bᵀ``, without B's zeros:
    a mix's (its scales folded into B, s = 1) and an adapter stack's (unit scale, s a
    scale per row and rank column) alike.

    A fused matrix stacks parts (Q|K|V, gate|up) and an adapter's pieces each
    feed one part, so a fused B (out, R) would be block-diagonal: mostly zeros.
    A's rank rows are ordered by the part they feed, and each part keeps only
    its dense block, transposed: ``(row0, row1, col0, col1, Bᵀ (col1-col0, row1-row0))``.
    """

    a: np.ndarray  # (R, in)
    parts: tuple[tuple[int, int, int, int, np.ndarray], ...]
    n_out: int

    def apply(self, y: np.ndarray, x: np.ndarray, scale: np.ndarray | None = None) -> None:
        """y (n, out) += ((x (n, in) Aᵀ) ⊙ scale (n, R)) Bᵀ, part by part; scale None: 1."""
        u = x @ self.a.T  # (n, R)
        if scale is not None:
            u *= scale
        for r0, r1, c0, c1, bt in self.parts:
            y[:, r0:r1] += u[:, c0:c1] @ bt  # (n, rows)

    def product(self, x: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
        """The delta alone, a new (n, out) array."""
        y = np.zeros((x.shape[0], self.n_out), dtype=np.float32)  # (n, out)
        self.apply(y, x, scale)
        return y

    def dense_b(self) -> np.ndarray:
        """The fused (out, R) B, zeros included (for inspection and tests)."""
        b = np.zeros((self.n_out, self.a.shape[0]), dtype=np.float32)
        for r0, r1, c0, c1, bt in self.parts:
            b[r0:r1, c0:c1] = bt.T
        return b

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + sum(p[4].nbytes for p in self.parts)


@dataclass
class MixWeights:
    key: MixKey
    layers: list[dict[str, Delta]]
    embd: tuple[np.ndarray, np.ndarray] | None = None
    output: tuple[np.ndarray, np.ndarray] | None = None
    nbytes: int = 0
    adapter_ids: frozenset[int] = field(default_factory=frozenset)
    sources: tuple[tuple[Adapter, float], ...] = ()  # (adapter, user scale) per key entry
    # control vectors: (n_layers, d) added after each block (zero rows: not steered),
    # the layers with a non-zero row, and the vectors' ids
    steer: np.ndarray | None = None
    steer_layers: frozenset[int] = frozenset()
    vector_ids: frozenset[int] = frozenset()


def _placed(cfg: ModelConfig, ad: Adapter, scale: float):
    """One adapter at one scale: ((layer, target) -> [(row0, rows, A, B·s)], embd, output).
    ``row0, rows`` place B inside the fused matrix (Q|K|V, gate|up)."""
    parts: dict[tuple[int, str], list] = {}
    embd = outp = None
    for name, pair in ad.tensors.items():
        s = pair.scale_for(scale)
        if name == "token_embd.weight":
            embd = (pair.a, pair.b * s)
        elif name == "output.weight":
            outp = (pair.a, pair.b * s)
        else:
            layer, target, row0, rows = layout.fused_slot(cfg, name)
            parts.setdefault((layer, target), []).append((row0, rows, pair.a, pair.b * s))
    return parts, embd, outp


def _by_part(pieces: list) -> list[tuple[int, int, list]]:
    """[(row0, rows, a, b)] -> [(row0, row1, [(a, b), ...])] in row order, one per part."""
    parts: dict[tuple[int, int], list] = {}
    for row0, rows, a, b in pieces:
        parts.setdefault((row0, row0 + rows), []).append((a, b))
    return [(r0, r1, ab) for (r0, r1), ab in sorted(parts.items())]


def _fuse(cfg: ModelConfig, pieces: dict[tuple[int, str], list]) -> dict[tuple[int, str], Delta]:
    """(layer, target) -> Delta with every piece's rank rows grouped by part."""
    fused = {}
    for (layer, target), plist in pieces.items():
        a_rows, parts, col = [], [], 0
        for r0, r1, abs_ in _by_part(plist):
            r = sum(a.shape[0] for a, _ in abs_)
            a_rows += [a for a, _ in abs_]
            bt = np.concatenate([b for _, b in abs_], axis=1).T  # (cols, rows)
            parts.append((r0, r1, col, col + r, np.ascontiguousarray(bt)))
            col += r
        fused[layer, target] = Delta(
            np.concatenate(a_rows, axis=0), tuple(parts), layout.out_rows(cfg, target)
        )
    return fused


def _standard(name: str, pair: LoraPair) -> tuple[np.ndarray, np.ndarray]:
    """(A (r, in), B (out, r)) with ΔW = B A in (out, in); token_embd's pair is stored
    flipped (a (vocab, r), b (dim, r), ΔW (vocab, dim) = a bᵀ), so B = a and A = bᵀ."""
    return (pair.b.T, pair.a) if name == "token_embd.weight" else (pair.a, pair.b)


def merged_adapter(
    sources: Iterable[tuple[Adapter, float]],
    spec: MergeSpec,
    progress: Progress | None = None,
) -> Adapter:
    """The adapters of a mix merged by ``spec`` into one low-rank adapter (to be applied at
    scale 1): per base tensor, the task tensors ΔW_i = effective_scale_i(1)·B_i A_i of the
    adapters that have it, combined with the user's scales as weights
    (core/lora/merge.py), then reduced to the spec's rank by a truncated SVD."""
    sources = [(ad, float(s)) for ad, s in sources]
    names = sorted({n for ad, _ in sources for n in ad.tensors})
    tensors: dict[str, LoraPair] = {}
    for i, name in enumerate(names):
        if progress is not None:
            progress(i / len(names), f"merging {name} ({spec.label()})")
        present = [(ad.tensors[name], s) for ad, s in sources if name in ad.tensors]
        rank = spec.rank or M.default_rank([p.rank for p, _ in present])
        if spec.method in M.STACKED_METHODS or spec.method == "svd":
            # a weighted sum is already low rank: SVD of the stacked factors, no dense ΔW
            a = np.concatenate([_standard(name, p)[0] for p, _ in present], axis=0)  # (ΣR, in)
            b = np.concatenate(
                [_standard(name, p)[1] * np.float32(p.scale_for(s)) for p, s in present], axis=1
            )  # (out, ΣR)
            new_a, new_b = M.low_rank_svd(a, b, rank)
        else:
            tasks = np.stack(
                [
                    np.float32(p.scale_for(1.0)) * (_standard(name, p)[1] @ _standard(name, p)[0])
                    for p, _ in present
                ]
            )  # (n, out, in)
            weights = np.array([s for _, s in present], dtype=np.float32)  # (n,)
            new_a, new_b = M.truncated_svd(M.combine(spec, tasks, weights, name), rank)
        if name == "token_embd.weight":
            tensors[name] = LoraPair(
                np.ascontiguousarray(new_b), np.ascontiguousarray(new_a.T), None
            )
        else:
            tensors[name] = LoraPair(new_a, new_b, None)  # alpha None: the scale as is
    if progress is not None:
        progress(1.0, f"merged ({spec.label()})")
    label = " + ".join(ad.name for ad, _ in sources)
    return Adapter(
        path=Path(f"<{spec.method} merge>"),
        name=f"{spec.method}: {label}",
        format="merged",
        tensors=tensors,
    )


def build_mix(
    cfg: ModelConfig,
    key: MixKey,
    adapters: Mapping[int, Adapter],
    progress: Progress | None = None,
    vectors: Mapping[int, ControlVector] | None = None,
) -> MixWeights:
    """Stack the adapters of one mix into per-layer (A, B) pairs with scales in B; a
    MergedKey's adapters are first merged into one adapter by its method; a
    SteeredKey's control vectors (from ``vectors``) are summed into ``steer``."""
    if isinstance(key, SteeredKey):
        inner = key.lora_key()
        if inner:
            mw = build_mix(cfg, inner, adapters, progress)
        else:
            mw = MixWeights(key=inner, layers=[{} for _ in range(cfg.n_layers)])
        lo, hi = key.layers
        mw.steer = steer_rows(((vectors[vid], s) for vid, s in key.steer), lo, hi, cfg)
        if mw.steer is not None:
            mw.steer_layers = frozenset(np.flatnonzero(mw.steer.any(axis=1)).tolist())
            mw.nbytes += mw.steer.nbytes
        mw.key, mw.vector_ids = key, frozenset(v for v, _ in key.steer)
        return mw
    if isinstance(key, MergedKey):
        merged = merged_adapter(((adapters[aid], s) for aid, s in key), key.merge, progress)
        mw = build_mix(cfg, ((-1, 1.0),), {-1: merged})
        mw.key, mw.adapter_ids = key, frozenset(i for i, _ in key)
        return mw
    parts: dict[tuple[int, str], list] = {}  # (layer, target) -> [(row0, rows, a, b*s)]
    embd, outp = [], []
    for aid, scale in key:
        p, e, o = _placed(cfg, adapters[aid], scale)
        for k, v in p.items():
            parts.setdefault(k, []).extend(v)
        embd += [e] if e else []
        outp += [o] if o else []

    layers: list[dict[str, Delta]] = [{} for _ in range(cfg.n_layers)]
    nbytes = 0
    for (layer, target), delta in _fuse(cfg, parts).items():
        layers[layer][target] = delta
        nbytes += delta.nbytes

    def stack(pairs, flipped):
        if not pairs:
            return None
        # token_embd pairs are flipped: a (vocab, r), b (dim, r) -> concat along r
        axis = 1 if flipped else 0
        a = np.concatenate([p[0] for p in pairs], axis=axis)
        b = np.concatenate([p[1] for p in pairs], axis=1)
        return a, b

    mw = MixWeights(
        key=key,
        layers=layers,
        embd=stack(embd, True),
        output=stack(outp, False),
        adapter_ids=frozenset(i for i, _ in key),
        sources=tuple((adapters[aid], s) for aid, s in key),
    )
    mw.nbytes = nbytes + sum(x.nbytes for pair in (mw.embd, mw.output) if pair for x in pair)
    return mw


@dataclass
class AdapterStack:
    """The distinct adapters of a batch side by side along the rank axis, at unit scale.

    Per layer and target: a Delta (A (ΣR, in) and a dense Bᵀ block per output
    part, Q|K|V or gate|up, with each adapter's ``effective_scale(1)`` folded in),
    and (adapter index, first column, end column) for every run of one adapter's
    columns. Since the effective scale is linear in the user's scale, a row's delta
    under any mix of these adapters is ``((x Aᵀ) ⊙ s) Bᵀ`` with s the row's scale per
    adapter, spread over its columns. Eight streams on eight mixes of three adapters thus read three
    adapters' weights once per step, not eight mixes' worth.
    """

    adapters: tuple[Adapter, ...]
    # per layer: target -> (its Delta at unit scale, (adapter index, c0, c1) per run)
    layers: list[dict[str, tuple[Delta, tuple[tuple[int, int, int], ...]]]]


def stack_adapters(cfg: ModelConfig, adapters: Iterable[Adapter]) -> AdapterStack:
    adapters = tuple(adapters)
    placed = [_placed(cfg, ad, 1.0)[0] for ad in adapters]
    layers: list[dict] = [{} for _ in range(cfg.n_layers)]
    for layer, target in sorted({k for p in placed for k in p}):
        # columns ordered by part, then by adapter: each part's Bᵀ is one dense block
        tagged = [
            (row0, rows, (i, a), b)
            for i, p in enumerate(placed)
            for row0, rows, a, b in p.get((layer, target), [])
        ]
        a_rows, parts, segs, col = [], [], [], 0
        for r0, r1, iab in _by_part(tagged):
            c_part = col
            for (i, a), _ in iab:
                segs.append((i, col, col + a.shape[0]))
                a_rows.append(a)
                col += a.shape[0]
            bt = np.concatenate([b for _, b in iab], axis=1).T  # (cols, rows)
            parts.append((r0, r1, c_part, col, np.ascontiguousarray(bt)))
        delta = Delta(np.concatenate(a_rows, axis=0), tuple(parts), layout.out_rows(cfg, target))
        layers[layer][target] = (delta, tuple(segs))
    return AdapterStack(adapters, layers)
