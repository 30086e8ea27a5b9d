"""Channel meters: how much each adapter of a running mix changes the model right now.

A mixing desk's channel meter shows a channel's level while the music plays. Ours
shows, for each adapter of a request's mix, the size of its low-rank delta relative
to the base products it adds to, on one decode step:

    meter(a) = sqrt( Σ_products ‖Δ_a x‖² / Σ_products ‖W x‖² )

summed over every fused product of every layer (Q|K|V, O, gate|up, down), for the
row of the token being generated. ``Δ_a x`` is the adapter's own delta at its scale
in the mix (``(x Aᵀ) Bᵀ · scale · α/r``, as a one-adapter linear mix builds it), and
``W x`` is the base product (the mixed product minus the mix's own delta). 0 means
the adapter changes nothing; 0.05 means its deltas are 5% of the base products' size.
Under a merge method (TIES, DARE, ...) it is still each adapter's own delta at its
fader, before the merge.

A control vector's meter is the same ratio for what it adds: at each layer it steers,
its scaled direction against the hidden state it is added to (the block's output
without the mix's vectors), over the layers it steers:

    meter(v) = sqrt( Σ_layers ‖s·v_l‖² / Σ_layers ‖h_l‖² )

Measuring costs two small matmuls per adapter and product for one row, so the
scheduler meters a step at most every METER_INTERVAL_S (a meter redrawn 10 times a
second looks live, and decoding pays ~1% for it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..model.deltas import Deltas
from .mix import MixWeights

METER_INTERVAL_S = 0.1  # at most one metered step per this many seconds


class MeteredDeltas(Deltas):
    """``inner``'s deltas, unchanged, plus the meters of one batch row: ``own`` is that
    row's built mix, ``parts`` maps each of its adapter ids to a one-adapter mix at the
    same scale, ``vectors`` each of its control vectors' ids to what that vector adds
    after each block, (n_layers, d) (``control.steer_rows`` of the vector alone)."""

    def __init__(
        self,
        inner: Deltas,
        row: int,
        own: MixWeights,
        parts: Mapping[int, MixWeights],
        vectors: Mapping[int, np.ndarray] | None = None,
    ):
        self.inner = inner
        self.row = row
        self.own = own
        self.parts = dict(parts)
        self.delta_sq = dict.fromkeys(self.parts, 0.0)  # adapter id -> Σ ‖Δ_a x‖²
        self.base_sq = 0.0  # Σ ‖W x‖²
        self.vectors = dict(vectors or {})
        # vector id -> [Σ ‖s·v_l‖², Σ ‖h_l‖²] over the layers it steers
        self.vector_sq = {vid: [0.0, 0.0] for vid in self.vectors}

    def embed(self, x: np.ndarray, tokens: np.ndarray) -> None:
        self.inner.embed(x, tokens)

    def layer_out(self, x: np.ndarray, li: int) -> None:
        self.inner.layer_out(x, li)
        if not self.vectors:
            return
        h = x[self.row].copy()  # (d,) the block's output, steered ...
        if self.own.steer is not None and li in self.own.steer_layers:
            h -= self.own.steer[li]  # ... less the mix's vectors
        h_sq = float(np.dot(h, h))
        for vid, rows in self.vectors.items():
            v = rows[li]  # (d,)
            if v.any():
                acc = self.vector_sq[vid]
                acc[0] += float(np.dot(v, v))
                acc[1] += h_sq

    def logits(self, logits: np.ndarray, h: np.ndarray, counts) -> None:
        self.inner.logits(logits, h, counts)

    def project(self, lin, x: np.ndarray, w, li: int, target: str) -> np.ndarray:
        y = self.inner.project(lin, x, w, li, target)  # (T, out), every row's deltas in
        xr = x[self.row : self.row + 1]  # (1, in)
        base = y[self.row : self.row + 1].copy()  # (1, out) the mixed product ...
        own = self.own.layers[li].get(target)
        if own is not None:
            own.apply(base, -xr)  # ... less the mix's delta (merged or not): W x
        self.base_sq += float(np.dot(base[0], base[0]))
        for aid, mw in self.parts.items():
            delta = mw.layers[li].get(target)
            if delta is None:
                continue
            d = np.zeros_like(base)  # (1, out)
            delta.apply(d, xr)
            self.delta_sq[aid] += float(np.dot(d[0], d[0]))
        return y

    def values(self) -> dict[int, float]:
        """adapter id -> its meter (see the module docstring); {} before any product."""
        if self.base_sq <= 0.0 or not np.isfinite(self.base_sq):
            return {}
        return {aid: float(np.sqrt(sq / self.base_sq)) for aid, sq in self.delta_sq.items()}

    def vector_values(self) -> dict[int, float]:
        """control vector id -> its meter (see the module docstring); a vector whose
        layers saw no hidden state yet is left out."""
        return {
            vid: float(np.sqrt(v_sq / h_sq))
            for vid, (v_sq, h_sq) in self.vector_sq.items()
            if h_sq > 0.0 and np.isfinite(h_sq)
        }
