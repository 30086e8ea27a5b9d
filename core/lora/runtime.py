"""The LoRA work at run time: built mixes, adapter stacks, and the deltas of a forward.

The forward pass (core/model/llama.py) knows no LoRA policy: the caller hands it a
:class:`LoraDeltas` (a core/model/deltas.py ``Deltas``), which it asks for each fused
product (``project``), for the embedding rows (``embed``) and for the logits
(``logits``). This module decides how: per mix on its own rows, or, for a few rows
under several mixes, through one stack of the batch's distinct adapters.
:class:`MixCache` keeps built mixes and :class:`AdapterStacks` the stacks, both owned
by the engine beside its adapters (as vLLM's model manager owns its caches).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

from ..model.config import ModelConfig
from ..model.deltas import Deltas, batch_spans
from ..model.linear import SMALL_ROWS, Linear
from .adapter import Adapter
from .control import ControlVector
from .mix import AdapterStack, MixKey, MixWeights, Progress, build_mix, stack_adapters

STACKS_KEPT = 2  # adapter sets whose stacked LoRA weights stay built


def lora_delta(x: np.ndarray, ab: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    # x: (n, in); A: (R, in); B: (out, R) with the scale folded in -> (n, out)
    a, b = ab
    return (x @ a.T) @ b.T


class AdapterStacks:
    """Built AdapterStacks by adapter set, the STACKS_KEPT most recently used."""

    def __init__(self, cfg: ModelConfig, kept: int = STACKS_KEPT):
        self.cfg = cfg
        self.kept = kept
        self._stacks: OrderedDict[tuple, AdapterStack] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stacks)

    def clear(self) -> None:
        self._stacks.clear()

    def get(self, adapters: Iterable[Adapter]) -> AdapterStack:
        ads = {id(ad): ad for ad in adapters}
        key = tuple(sorted(ads))
        st = self._stacks.get(key)
        if st is None:
            st = self._stacks[key] = stack_adapters(self.cfg, (ads[k] for k in key))
            while len(self._stacks) > self.kept:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(key)
        return st


def _mix_groups(mixes, spans) -> list[tuple[int, int, MixWeights]]:
    """Merge adjacent items that share a mix, so their deltas run as one matmul."""
    groups: list[tuple[int, int, MixWeights]] = []
    for mix, (s, e) in zip(mixes, spans):
        if mix is None:
            continue
        if groups and groups[-1][2] is mix and groups[-1][1] == s:
            groups[-1] = (groups[-1][0], e, mix)
        else:
            groups.append((s, e, mix))
    return groups


class LoraDeltas(Deltas):
    """The LoRA work of one forward, for every sequence under its own mix.

    One mix in the batch, or many rows (prefill): ``(x Aᵀ) Bᵀ`` per mix on its
    rows, with the mix's scales folded into B. A few rows under several mixes
    (decoding streams): an AdapterStack of the batch's distinct adapters (built
    once per adapter set, kept while it lasts) and a per-row scale matrix, so each
    target costs two small matmuls however many mixes run, and each adapter's
    weights are read once per step."""

    def __init__(self, mixes, spans, stacks: AdapterStacks | None = None):
        """``mixes[i]`` (or None) runs on rows ``spans[i]`` = (start, end) of the batch.
        Without ``stacks`` every mix runs on its own rows (a one-off forward: scoring,
        embeddings, tests)."""
        self.mixes, self.spans = mixes, spans
        self.groups = groups = _mix_groups(mixes, spans)
        n_rows = spans[-1][1] if spans else 0
        self.stack = None
        if (
            stacks is not None
            and len(groups) > 1
            and n_rows <= SMALL_ROWS
            and not any(mw.embd is not None or mw.output is not None for _, _, mw in groups)
            and any(mw.sources for _, _, mw in groups)
        ):
            st = self.stack = stacks.get(ad for _, _, mw in groups for ad, _ in mw.sources)
            index = {id(ad): i for i, ad in enumerate(st.adapters)}
            # scale[row, adapter]: the user's scale of that adapter in the row's mix
            self.scale = np.zeros((n_rows, len(st.adapters)), dtype=np.float32)
            for s, e, mw in groups:
                for ad, sc in mw.sources:
                    self.scale[s:e, index[id(ad)]] += sc
            self._spread: dict[tuple, np.ndarray] = {}

    @classmethod
    def of(cls, items, mixes, stacks: AdapterStacks | None = None) -> Deltas:
        """The deltas of a batch of forward items (BatchItem: ``tokens`` each), item i
        under ``mixes[i]`` (None: the base model); the plain base products when no item
        has a mix."""
        if all(m is None for m in mixes):
            return Deltas()
        return cls(mixes, batch_spans([len(it.tokens) for it in items]), stacks)

    def embed(self, x: np.ndarray, tokens: np.ndarray) -> None:
        """x (T, d): the embedding rows of ``tokens`` (T,), each mix's delta added in place."""
        for mix, (s, e) in zip(self.mixes, self.spans):
            if mix is not None and mix.embd is not None:
                a, b = mix.embd  # (vocab, R), (d, R)
                x[s:e] += a[tokens[s:e]] @ b.T  # (n, d)

    def layer_out(self, x: np.ndarray, li: int) -> None:
        """x (T, d): block li's output; each mix's control vectors added in place."""
        for s, e, mix in self.groups:
            if li in mix.steer_layers:
                x[s:e] += mix.steer[li]  # (n, d) += (d,)

    def logits(self, logits: np.ndarray, h: np.ndarray, counts: list[int]) -> None:
        """logits (R, vocab) += each mix's output delta; item i owns the next counts[i] rows."""
        k = 0
        for mix, n in zip(self.mixes, counts):
            if mix is not None and mix.output is not None:
                logits[k : k + n] += lora_delta(h[k : k + n], mix.output)
            k += n

    def project(self, lin: Linear, x: np.ndarray, w: np.ndarray, li: int, target: str):
        """x @ W.T plus every row's delta for fused matrix ``target`` of layer li. With
        several mixes in a small batch under products on our own threads, the delta is
        computed on this thread while the helper threads run their share of the base
        product (core/model/linear.py sizes the shares to match); otherwise it is added
        in place afterwards."""
        if self.stack is None:
            y = lin(x, w)
            self.add(y, x, li, target)
            return y
        if target not in self.stack.layers[li]:
            return lin(x, w)
        if not lin.overlaps(x.shape[0]):
            # OpenBLAS's own threads run the product: nothing to overlap, add in place
            y = lin(x, w)
            self.stacked_delta(x, li, target, into=y)
            return y
        box = []
        y = lin(x, w, side=lambda: box.append(self.stacked_delta(x, li, target)))
        y += box[0]
        return y

    def add(self, y: np.ndarray, x: np.ndarray, li: int, target: str) -> None:
        """Without a stack: each mix's delta onto its own rows of y, in place."""
        for s, e, mix in self.groups:
            delta = mix.layers[li].get(target)
            if delta is not None:
                delta.apply(y[s:e], x[s:e])

    def stacked_delta(
        self, x: np.ndarray, li: int, target: str, into: np.ndarray | None = None
    ) -> np.ndarray:
        """Every row's delta for this target under its own mix, from the adapter stack:
        added to ``into`` in place when given (and returned), else a new array."""
        delta, segs = self.stack.layers[li][target]
        sc = self._spread.get(segs)
        if sc is None:
            sc = self._spread[segs] = np.repeat(
                self.scale[:, [i for i, _, _ in segs]], [c1 - c0 for _, c0, c1 in segs], axis=1
            )  # (T, ΣR)
        if into is None:
            return delta.product(x, sc)  # (T, out)
        delta.apply(into, x, sc)
        return into


# A built mix holds its adapters' A and scaled B matrices: ~24 MB for three adapters on
# SmolLM2-135M, so 24 mixes added 576 MB when only the count was capped. The byte cap
# bounds that whatever the adapters' ranks; a running request keeps its own mix alive.
MIX_CACHE_BYTES = 256 << 20


class MixCache:
    """Built MixWeights by key, least recently used dropped first, capped both by
    count and by bytes (the newest entry always stays, however large)."""

    def __init__(self, cfg: ModelConfig, max_entries: int = 32, max_bytes: int = MIX_CACHE_BYTES):
        self.cfg = cfg
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._cache: OrderedDict[MixKey, MixWeights] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # one lock per key being built: a second thread asking for the same new mix
        # waits for the first one's build (a merge method's takes seconds) instead of
        # running its own beside it
        self._building: dict[MixKey, threading.Lock] = {}

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(
        self,
        key: MixKey,
        adapters: Mapping[int, Adapter],
        progress: Progress | None = None,
        vectors: Mapping[int, ControlVector] | None = None,
    ) -> MixWeights | None:
        """The built mix of ``key``, built on first use (a merge method's build reports
        to ``progress``; a linear mix's takes milliseconds and reports nothing; a
        SteeredKey's vectors come from ``vectors``)."""
        if not key:
            return None
        mw = self.cached(key)
        if mw is not None:
            return mw
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        try:
            with building:
                mw = self.cached(key)  # built while this thread waited for the lock
                if mw is None:
                    mw = build_mix(self.cfg, key, adapters, progress, vectors)
                    self._put(key, mw)
        finally:
            with self._lock:
                if self._building.get(key) is building:
                    del self._building[key]
        return mw

    def cached(self, key: MixKey) -> MixWeights | None:
        """The built mix of ``key`` if it is in the cache (marked recently used)."""
        with self._lock:
            mw = self._cache.get(key)
            if mw is not None:
                self._cache.move_to_end(key)
            return mw

    def _put(self, key: MixKey, mw: MixWeights) -> None:
        with self._lock:
            old = self._cache.pop(key, None)
            self._bytes -= old.nbytes if old is not None else 0
            self._cache[key] = mw
            self._bytes += mw.nbytes
            while len(self._cache) > 1 and (
                len(self._cache) > self.max_entries or self._bytes > self.max_bytes
            ):
                _, dropped = self._cache.popitem(last=False)
                self._bytes -= dropped.nbytes

    def forget_adapter(self, aid: int) -> None:
        with self._lock:
            for k in [k for k, mw in self._cache.items() if aid in mw.adapter_ids]:
                self._bytes -= self._cache.pop(k).nbytes

    def forget_vector(self, vid: int) -> None:
        with self._lock:
            for k in [k for k, mw in self._cache.items() if vid in mw.vector_ids]:
                self._bytes -= self._cache.pop(k).nbytes
