"""The adapters of one engine, its global mix, and what is built from them.

One home for the LoRA state the engine serves with (as vLLM's LoRA model manager owns
its adapters and caches): the registered adapters under their session ids, the global
mix (a scale per adapter and how they combine), the built mixes (``MixCache``) and
the adapter stacks of mixed decode steps (``AdapterStacks``). The engine is a facade
over it: it adds events, the prefix cache and the model's life cycle.

Thread safety: the GUI thread sets the mix while the engine thread and HTTP workers
read it; every read or change of the adapters and the mix takes ``lock``. Building a
mix (milliseconds for a linear one, seconds for a merge method) never holds it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineError, UserError
from ..model.config import ModelConfig
from ..values import is_finite_number, shown
from .adapter import Adapter, AdapterError, load_adapter
from .control import (
    ControlVector,
    ControlVectorError,
    check_layer_range,
    layer_range,
    load_control_vector,
    steer_pairs,
    steer_rows,
)
from .control import check_scale as check_vector_scale
from .merge import LINEAR, MergeSpec
from .mix import Mix, MixKey, MixWeights, Progress, SteeredKey, build_mix, mix_key
from .runtime import AdapterStacks, MixCache

log = logging.getLogger(__name__)

# |scale| bound for every LoRA scale (global mix, per-request "lora", --lora-scaled).
# Useful scales are O(1) (the mixer's faders span -2..2); 100 leaves room for adapters
# trained with a small alpha/rank, while 1e20 or 1e308 (accepted before) overflow
# float32 in the forward pass, and a global mix like that broke every request.
LORA_SCALE_MAX = 100.0


def check_scale(value: Any, what: str) -> float:
    """A LoRA scale from a user or a client, as a float; EngineError (400) otherwise."""
    if not is_finite_number(value, LORA_SCALE_MAX):
        raise EngineError(
            f"{what} must be a finite number in [-{LORA_SCALE_MAX:g}, {LORA_SCALE_MAX:g}], "
            f"got {shown(value)}"
        )
    return float(value)


def scales_of_list(
    entries: Any,
    what: str,
    known: Iterable[int],
    resolve: Callable[[Any], int] | None = None,
    error: Callable[[str], Exception] = EngineError,
    noun: str = "adapter",
    check: Callable[[Any, str], float] = check_scale,
) -> dict[int, float]:
    """llama-server's ``[{"id", "scale"}]`` list (scale 1 when left out) as full scales
    over the ``known`` ids, in their order (unlisted ids 0). The one reading of that
    list: a request's ``"lora"`` (core/http/parsing.py), a grid's base mix and presets
    (core/grid.py, whose ``resolve`` also takes an adapter's name), and, with ``noun``
    "control vector" and the vectors' ``check``, a request's ``"control_vectors"``. A
    list of the wrong shape or an unknown id raises ``error`` (the caller's kind), a bad
    scale ``check``'s error; each names ``what``."""
    ids = list(known)
    if not isinstance(entries, list):
        raise error(f'{what} must be a list of {{"id", "scale"}} objects')
    out: dict[int, float] = {}
    for e in entries:
        if not isinstance(e, Mapping) or "id" not in e:
            raise error(f'each {what} entry must be an object with "id" and "scale"')
        if resolve is not None:
            i = resolve(e["id"])
        else:
            i = e["id"]
            if not isinstance(i, int) or isinstance(i, bool):
                raise error(f"{what}: {noun} id must be an integer, got {shown(i)}")
            if i not in ids:
                raise error(f"{what}: no {noun} with id {i}")
        out[i] = check(e.get("scale", 1.0), f"{what}: scale of {noun} {i}")
    return {i: out.get(i, 0.0) for i in ids}


class AdapterRegistry:
    """Adapters by id, the global mix, built mixes and adapter stacks of one model."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cfg: ModelConfig | None = None
        self._adapters: dict[int, Adapter] = {}
        self._scales: dict[int, float] = {}  # the global mix: adapter id -> scale
        self._merge: MergeSpec = LINEAR  # and how its adapters combine (core/lora/merge.py)
        self._next_id = 0
        self.mixes: MixCache | None = None  # built mixes by key (None before a model)
        self.stacks: AdapterStacks | None = None  # several mixes' adapters, stacked
        # control vectors (core/lora/control.py) by id, their global scales (a mix that
        # says none runs under these, as llama-server's flags apply to every request)
        # and the layer range all vectors steer (START, END as given; 0 = default)
        self._vectors: dict[int, ControlVector] = {}
        self._vscales: dict[int, float] = {}
        self._vrange: tuple[int, int] = (-1, -1)
        self._next_vid = 0

    # -- the model ---------------------------------------------------------------------
    def bind(self, cfg: ModelConfig, kept: Mapping[int, Adapter]) -> list[int]:
        """A new model is in service: fresh caches for it, and of the adapters that
        fit it (``kept``, from ``refit``) those still registered, under their ids and
        scales. Returns the ids registered before (an adapter removed while the model
        loaded is not brought back)."""
        with self.lock:
            before = list(self._adapters)
            self.cfg = cfg
            self.mixes = MixCache(cfg)
            self.stacks = AdapterStacks(cfg)
            self._adapters = {aid: ad for aid, ad in kept.items() if aid in before}
            self._scales = {aid: self._scales.get(aid, 0.0) for aid in self._adapters}
            # a vector steers one model's hidden states: those that do not fit go
            self._vectors = {v: cv for v, cv in self._vectors.items() if cv.fits(cfg)}
            self._vscales = {v: self._vscales.get(v, 0.0) for v in self._vectors}
            return before

    def refit(
        self, cfg: ModelConfig, check: Callable[[], None] = lambda: None
    ) -> tuple[dict[int, Adapter], list[dict]]:
        """The registered adapters re-read and re-checked against a model being loaded:
        ({id: adapter} of those that fit it, under their old ids, so that a client's
        ``{"id": 0}`` keeps naming the same adapter across a reload; and an entry
        {id, name, path, error} for each one that does not fit it). Re-read from the
        file, not reused: the new model may differ in shapes, layers or architecture.
        ``check`` is called between adapters (it may raise to cancel)."""
        with self.lock:
            registered = dict(self._adapters)
        kept: dict[int, Adapter] = {}
        dropped: list[dict] = []
        for aid, old in registered.items():
            check()
            try:
                adapter = load_adapter(old.path, cfg)
                adapter.name, adapter.id = old.name, aid
                check_usable(adapter, 0.0, cfg)
            except UserError as e:
                dropped.append(_dropped(aid, old, str(e)))
            except Exception as e:  # a file that changed on disk in a way we did not foresee
                log.exception("adapter %s failed its checks on reload", old.path)
                why = f"cannot be read again ({type(e).__name__})"
                dropped.append(_dropped(aid, old, f"adapter {Path(old.path).name}: {why}"))
            else:
                kept[aid] = adapter
        return kept, dropped

    # -- adapters ----------------------------------------------------------------------
    def add(self, path: str | Path, scale: float = 0.0, name: str | None = None) -> Adapter:
        """Load and validate an adapter and register it (its ``id`` set); AdapterError
        naming it, with nothing changed, when it cannot be used with this model."""
        scale = check_scale(scale, "scale")
        adapter = load_adapter(path, self.cfg)
        if name:
            adapter.name = name
        check_usable(adapter, scale, self.cfg)
        with self.lock:
            adapter.id = self._next_id
            self._next_id += 1
            self._adapters[adapter.id] = adapter
            self._scales[adapter.id] = scale
        return adapter

    def remove(self, aid: int) -> None:
        with self.lock:
            if aid not in self._adapters:
                raise EngineError(f"no adapter with id {aid}")
            del self._adapters[aid]
            del self._scales[aid]
            if self.mixes:
                self.mixes.forget_adapter(aid)

    def get(self, aid: int) -> Adapter:
        with self.lock:
            if aid not in self._adapters:
                raise EngineError(f"no adapter with id {aid}")
            return self._adapters[aid]

    def ids(self) -> set[int]:
        with self.lock:
            return set(self._adapters)

    def __bool__(self) -> bool:
        return bool(self._adapters)

    def listing(self) -> list[dict[str, Any]]:
        """llama-server's GET /lora-adapters entries, plus our extra info fields."""
        with self.lock:
            out = []
            for aid, ad in sorted(self._adapters.items()):
                info = ad.info()
                info["scale"] = self._scales[aid]
                info["effective_scale"] = ad.effective_scale(self._scales[aid])
                out.append(info)
            return out

    # -- the global mix ----------------------------------------------------------------
    def get_mix(self) -> Mix:
        """The global mix: {id: scale} (a dict) with its method as ``.merge``."""
        with self.lock:
            return Mix(self._scales, self._merge)

    def set_mix(
        self, scales: Mapping[int, float], replace: bool = True, merge: MergeSpec | None = None
    ) -> tuple[dict[int, float], MergeSpec]:
        """Set the global mix (see Engine.set_mix); returns it as (scales, method).
        Nothing changes when a scale or an id is refused."""
        with self.lock:
            for aid in scales:
                if aid not in self._adapters:
                    raise EngineError(f"no adapter with id {aid}")
            checked = {aid: check_scale(s, f"scale of adapter {aid}") for aid, s in scales.items()}
            if replace:
                self._scales = {aid: checked.get(aid, 0.0) for aid in self._adapters}
            else:
                self._scales.update(checked)
            if merge is not None:
                self._merge = merge
            return dict(self._scales), self._merge

    # -- control vectors ------------------------------------------------------------

    def add_vector(self, path: str | Path, scale: float = 1.0) -> ControlVector:
        """Load and check a control vector and register it (``id`` set) at ``scale`` in
        the global vectors; ControlVectorError, with nothing changed, when it cannot
        steer this model."""
        scale = check_vector_scale(scale, "scale")
        vec = load_control_vector(path, self.cfg)
        with self.lock:
            vec.id = self._next_vid
            self._next_vid += 1
            self._vectors[vec.id] = vec
            self._vscales[vec.id] = scale
        return vec

    def remove_vector(self, vid: int) -> None:
        with self.lock:
            if vid not in self._vectors:
                raise ControlVectorError(f"no control vector with id {vid}")
            del self._vectors[vid]
            del self._vscales[vid]
            if self.mixes:
                self.mixes.forget_vector(vid)

    def vector_ids(self) -> set[int]:
        with self.lock:
            return set(self._vectors)

    def vector_listing(self) -> list[dict[str, Any]]:
        """GET /control-vectors: {id, path, name, layers, model_hint, scale} per vector."""
        with self.lock:
            return [
                {**cv.info(), "scale": self._vscales[vid]}
                for vid, cv in sorted(self._vectors.items())
            ]

    def get_vectors(self) -> dict[int, float]:
        """The global vectors: {vector id: scale}."""
        with self.lock:
            return dict(self._vscales)

    def steering(self) -> tuple[list[tuple[ControlVector, float]], tuple[int, int]]:
        """The global mix's control vectors at their non-zero scales, (vector, scale)
        by id, and the inclusive layers they steer (what an export writes)."""
        with self.lock:
            pairs = [
                (self._vectors[v], s)
                for v, s in sorted(self._vscales.items())
                if s != 0.0 and v in self._vectors
            ]
            return pairs, layer_range(*self._vrange, self.cfg.n_layers if self.cfg else 0)

    def set_vectors(self, scales: Mapping[int, float], replace: bool = True) -> dict[int, float]:
        """Set the global vectors' scales (ids not given: 0 when ``replace``); nothing
        changes when an id or a scale is refused."""
        with self.lock:
            for vid in scales:
                if vid not in self._vectors:
                    raise ControlVectorError(f"no control vector with id {vid}")
            checked = {
                v: check_vector_scale(s, f"scale of control vector {v}") for v, s in scales.items()
            }
            if replace:
                self._vscales = {v: checked.get(v, 0.0) for v in self._vectors}
            else:
                self._vscales.update(checked)
            return dict(self._vscales)

    @property
    def vector_range(self) -> tuple[int, int]:
        """The layer range as set (START, END; <= 0: llama.cpp's default)."""
        with self.lock:
            return self._vrange

    def set_vector_range(self, start: Any, end: Any) -> None:
        """--control-vector-layer-range START END: the layers every vector steers."""
        rng = check_layer_range(start, end)
        with self.lock:
            self._vrange = rng

    def _steer(self, mix: Mapping[int, float] | None):
        """The vectors part of ``mix``'s key (its own ``vectors``, else the global
        ones), under the lock: (sorted pairs, inclusive layer range)."""
        own = getattr(mix, "vectors", None)
        scales = self._vscales if mix is None or own is None else own
        for vid in scales:
            if vid not in self._vectors:
                raise ControlVectorError(f"no control vector with id {vid}")
        pairs = steer_pairs(
            {v: check_vector_scale(s, f"scale of control vector {v}") for v, s in scales.items()}
        )
        return pairs, layer_range(*self._vrange, self.cfg.n_layers if self.cfg else 0)

    # -- built mixes -------------------------------------------------------------------
    def key(
        self, mix: Mapping[int, float] | None
    ) -> tuple[MixKey, dict[int, Adapter], MergeSpec | None]:
        """A mix (None: the global mix, snapshotted now) as (key, adapters, method)."""
        with self.lock:
            scales = dict(self._scales) if mix is None else dict(mix)
            # the global mix's method; a mix given without one (a plain dict, a request's
            # "lora" list) is a weighted sum, as in llama-server
            merge = self._merge if mix is None else getattr(mix, "merge", None)
            for aid in scales:
                if aid not in self._adapters:
                    raise EngineError(f"no adapter with id {aid}")
            adapters = dict(self._adapters)
            steer = self._steer(mix)
        return mix_key(scales, merge, steer), adapters, merge

    def built(
        self,
        mix: Mapping[int, float] | None,
        progress: Callable[[MergeSpec | None], Progress | None] = lambda merge: None,
    ) -> tuple[MixKey, MixWeights | None]:
        """A mix (None: the global mix, snapshotted now) as its key and built weights;
        ``progress(method)`` gives the reporter of a merge method's first build."""
        key, adapters, merge = self.key(mix)
        # built outside the lock: a first build takes tens of ms (a merge method's,
        # seconds), and set_mix (the GUI thread) must never wait for it
        with self.lock:
            vectors = dict(self._vectors)
        for vid, _ in getattr(key, "steer", ()):
            if vid not in vectors:  # unloaded since the key was made
                raise ControlVectorError(f"no control vector with id {vid}")
        return key, self.mixes.get(key, adapters, progress(merge), vectors)

    def vectors_only(self, key: MixKey) -> tuple[MixKey, MixWeights | None]:
        """The control vectors of a built mix's ``key`` without its adapters, built:
        what an aLoRA's positions before its invocation run under (core/lora/alora.py).
        ((), None), the base model, for a key that steers nothing."""
        if not getattr(key, "steer", None):
            return (), None
        base = SteeredKey((), None, key.steer, key.layers)
        with self.lock:
            vectors = dict(self._vectors)
        return base, self.mixes.get(base, {}, None, vectors)

    def meter_parts(self, key: MixKey) -> dict[int, MixWeights]:
        """Each adapter of a built mix's ``key`` as a one-adapter linear mix at its
        scale: what its channel meter measures (core/lora/meter.py). Built once per
        adapter and scale, then served from the mix cache."""
        with self.lock:
            adapters = dict(self._adapters)
        return {
            aid: self.mixes.get(mix_key(((aid, s),)), {aid: adapters[aid]})
            for aid, s in key
            if aid in adapters
        }

    def meter_vectors(self, key: MixKey) -> dict[int, np.ndarray]:
        """Each control vector of a built mix's ``key`` as what it alone adds after each
        block, (n_layers, d): what its channel meter measures (core/lora/meter.py)."""
        steer = getattr(key, "steer", ())
        if not steer:
            return {}
        with self.lock:
            vectors = dict(self._vectors)
        lo, hi = key.layers
        out = {}
        for vid, s in steer:
            rows = steer_rows([(vectors[vid], s)], lo, hi, self.cfg) if vid in vectors else None
            if rows is not None:
                out[vid] = rows
        return out

    def is_built(self, mixes: Iterable[Mapping[int, float] | None]) -> bool:
        """Whether every mix (None: the global mix) is built already. An unknown adapter
        counts as built: whoever uses the mix refuses it, at once."""
        try:
            return all(
                not key or self.mixes.cached(key) is not None for key, _, _ in map(self.key, mixes)
            )
        except EngineError:
            return True


def check_usable(adapter: Adapter, scale: float, cfg: ModelConfig) -> None:
    """Everything the engine will later do with an adapter, done once before it is
    registered: its listing entry, and its low-rank weights built into a mix. An
    adapter that gets past loading but fails here (a validation gap) is refused now,
    as an AdapterError naming it, instead of breaking GET /lora-adapters or every
    request under the global mix later. Nothing is registered before this passes, so a
    failure leaves the adapters and the mix exactly as they were."""
    try:
        adapter.info()
        adapter.effective_scale(scale)
        build_mix(cfg, ((-1, 1.0),), {-1: adapter})  # built, then dropped
    except AdapterError:
        raise
    except Exception as e:
        log.exception("adapter %s failed its checks", adapter.path)
        raise AdapterError(
            f"adapter {Path(adapter.path).name}: cannot be applied to this model "
            f"({type(e).__name__}: {e})"
        ) from None


def _dropped(aid: int, adapter: Adapter, error: str) -> dict[str, Any]:
    return {"id": aid, "name": adapter.name, "path": str(adapter.path), "error": error}
