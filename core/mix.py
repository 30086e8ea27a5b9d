"""Mixes: a scale per adapter, and the stacked low-rank weights a mix runs with.

A mix key is the sorted tuple of (adapter id, scale) pairs with a non-zero
scale, so a zero-scale adapter never makes a mix different. For each distinct
key we build, once and lazily, per layer and per fused projection one A
(R_total, in) and one B (out, R_total) with every adapter's effective scale
folded into B. The forward pass then adds ``(x Aᵀ) Bᵀ`` per sequence; base
weights are never touched, so switching mixes costs nothing model-sized.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from .config import ModelConfig
from .lora import Adapter, fused_slot

MixKey = tuple[tuple[int, float], ...]


def mix_key(scales: Mapping[int, float] | Iterable[tuple[int, float]]) -> MixKey:
    items = scales.items() if isinstance(scales, Mapping) else scales
    return tuple(sorted((int(i), float(s)) for i, s in items if float(s) != 0.0))


@dataclass
class MixWeights:
    key: MixKey
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]
    embd: tuple[np.ndarray, np.ndarray] | None = None
    output: tuple[np.ndarray, np.ndarray] | None = None
    nbytes: int = 0
    adapter_ids: frozenset[int] = field(default_factory=frozenset)
    sources: tuple[tuple[Adapter, float], ...] = ()   # (adapter, user scale) per key entry


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
            layer, target, row0, rows = fused_slot(cfg, name)
            parts.setdefault((layer, target), []).append((row0, rows, pair.a, pair.b * s))
    return parts, embd, outp


def _out_rows(cfg: ModelConfig) -> dict[str, int]:
    return {"wqkv": cfg.q_dim + 2 * cfg.kv_dim, "wo": cfg.dim,
            "w_gate_up": 2 * cfg.ffn_dim, "w_down": cfg.dim}


def _fuse(cfg: ModelConfig, parts: dict[tuple[int, str], list]):
    """(layer, target) -> (A (R, in), B (out, R)) with the placed pieces side by side."""
    out_rows = _out_rows(cfg)
    fused = {}
    for (layer, target), plist in parts.items():
        a = np.concatenate([p[2] for p in plist], axis=0)                  # (R, in)
        b = np.zeros((out_rows[target], a.shape[0]), dtype=np.float32)    # (out, R)
        col = 0
        for row0, rows, pa, pb in plist:
            r = pa.shape[0]
            b[row0:row0 + rows, col:col + r] = pb
            col += r
        fused[layer, target] = (a, b)
    return fused


def build_mix(cfg: ModelConfig, key: MixKey, adapters: Mapping[int, Adapter]) -> MixWeights:
    """Stack the adapters of one mix into per-layer (A, B) pairs with scales in B."""
    parts: dict[tuple[int, str], list] = {}   # (layer, target) -> [(row0, rows, a, b*s)]
    embd, outp = [], []
    for aid, scale in key:
        p, e, o = _placed(cfg, adapters[aid], scale)
        for k, v in p.items():
            parts.setdefault(k, []).extend(v)
        embd += [e] if e else []
        outp += [o] if o else []

    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(cfg.n_layers)]
    nbytes = 0
    for (layer, target), (a, b) in _fuse(cfg, parts).items():
        layers[layer][target] = (a, b)
        nbytes += a.nbytes + b.nbytes

    def stack(pairs, flipped):
        if not pairs:
            return None
        # token_embd pairs are flipped: a (vocab, r), b (dim, r) -> concat along r
        axis = 1 if flipped else 0
        a = np.concatenate([p[0] for p in pairs], axis=axis)
        b = np.concatenate([p[1] for p in pairs], axis=1)
        return a, b

    mw = MixWeights(key=key, layers=layers, embd=stack(embd, True), output=stack(outp, False),
                    adapter_ids=frozenset(i for i, _ in key),
                    sources=tuple((adapters[aid], s) for aid, s in key))
    mw.nbytes = nbytes + sum(x.nbytes for pair in (mw.embd, mw.output) if pair for x in pair)
    return mw


@dataclass
class AdapterStack:
    """The distinct adapters of a batch side by side along the rank axis, at unit scale.

    Per layer and target: Aᵀ (in, ΣR), Bᵀ (ΣR, out) with each adapter's
    ``effective_scale(1)`` folded in, and (adapter index, first column, end column)
    per adapter that has the target. Since the effective scale is linear in the
    user's scale, a row's delta under any mix of these adapters is
    ``((x Aᵀ) ⊙ s) Bᵀ`` with s the row's scale per adapter, spread over its
    columns. Eight streams on eight mixes of three adapters thus read three
    adapters' weights once per step, not eight mixes' worth.
    """
    adapters: tuple[Adapter, ...]
    layers: list[dict[str, tuple[np.ndarray, np.ndarray, tuple[tuple[int, int, int], ...]]]]


def stack_adapters(cfg: ModelConfig, adapters: Iterable[Adapter]) -> AdapterStack:
    adapters = tuple(adapters)
    per_ad = [_fuse(cfg, _placed(cfg, ad, 1.0)[0]) for ad in adapters]
    layers: list[dict] = [{} for _ in range(cfg.n_layers)]
    for layer, target in sorted({k for f in per_ad for k in f}):
        segs, at, bt, col = [], [], [], 0
        for i, f in enumerate(per_ad):
            if (layer, target) in f:
                a, b = f[layer, target]
                segs.append((i, col, col + a.shape[0]))
                col += a.shape[0]
                at.append(a)
                bt.append(b)
        layers[layer][target] = (np.ascontiguousarray(np.concatenate(at, axis=0).T),  # (in, ΣR)
                                 np.ascontiguousarray(np.concatenate(bt, axis=1).T),  # (ΣR, out)
                                 tuple(segs))
    return AdapterStack(adapters, layers)


class MixCache:
    """Built MixWeights by key, least recently used dropped first."""

    def __init__(self, cfg: ModelConfig, max_entries: int = 32):
        self.cfg = cfg
        self.max_entries = max_entries
        self._cache: OrderedDict[MixKey, MixWeights] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: MixKey, adapters: Mapping[int, Adapter]) -> MixWeights | None:
        if not key:
            return None
        with self._lock:
            mw = self._cache.get(key)
            if mw is not None:
                self._cache.move_to_end(key)
                return mw
        mw = build_mix(self.cfg, key, adapters)
        with self._lock:
            self._cache[key] = mw
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return mw

    def forget_adapter(self, aid: int) -> None:
        with self._lock:
            for k in [k for k, mw in self._cache.items() if aid in mw.adapter_ids]:
                del self._cache[k]
