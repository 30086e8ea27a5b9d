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


def build_mix(cfg: ModelConfig, key: MixKey, adapters: Mapping[int, Adapter]) -> MixWeights:
    """Stack the adapters of one mix into per-layer (A, B) pairs with scales in B."""
    parts: dict[tuple[int, str], list] = {}   # (layer, target) -> [(row0, rows, a, b*s)]
    embd, outp = [], []
    for aid, scale in key:
        ad = adapters[aid]
        for name, pair in ad.tensors.items():
            s = pair.scale_for(scale)
            if name == "token_embd.weight":
                embd.append((pair.a, pair.b * s))
            elif name == "output.weight":
                outp.append((pair.a, pair.b * s))
            else:
                layer, target, row0, rows = fused_slot(cfg, name)
                parts.setdefault((layer, target), []).append((row0, rows, pair.a, pair.b * s))

    out_rows = {"wqkv": cfg.q_dim + 2 * cfg.kv_dim, "wo": cfg.dim,
                "w_gate_up": 2 * cfg.ffn_dim, "w_down": cfg.dim}
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(cfg.n_layers)]
    nbytes = 0
    for (layer, target), plist in parts.items():
        a = np.concatenate([p[2] for p in plist], axis=0)                  # (R, in)
        b = np.zeros((out_rows[target], a.shape[0]), dtype=np.float32)    # (out, R)
        col = 0
        for row0, rows, pa, pb in plist:
            r = pa.shape[0]
            b[row0:row0 + rows, col:col + r] = pb
            col += r
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
                    adapter_ids=frozenset(i for i, _ in key))
    mw.nbytes = nbytes + sum(x.nbytes for pair in (mw.embd, mw.output) if pair for x in pair)
    return mw


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
