"""What the engine announces to its subscribers (the window's bridge, tests).

One dataclass per event, so each event's fields are declared once, here. A listener
``fn(event)`` gets the event object itself and tells events apart by type
(ui/bridge.py re-emits each type on its own Qt signal, the object as it is).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEvent:
    """The base of every event (a listener may take them all and match on type)."""


@dataclass(frozen=True)
class ModelLoading(EngineEvent):
    path: str
    progress: float  # 0..1
    message: str


@dataclass(frozen=True)
class ModelLoaded(EngineEvent):
    info: dict  # Engine.model_info()


@dataclass(frozen=True)
class ModelError(EngineEvent):
    path: str
    error: str
    cancelled: bool  # the user cancelled it: not an error to show


@dataclass(frozen=True)
class AdaptersChanged(EngineEvent):
    adapters: list  # Engine.adapters()


@dataclass(frozen=True)
class AdaptersDropped(EngineEvent):
    dropped: list  # {id, name, path, error} of each adapter a reload unloaded


@dataclass(frozen=True)
class VectorsChanged(EngineEvent):
    """Control vectors were loaded, unloaded or rescaled (the global vectors' scales)."""

    vectors: list  # Engine.control_vectors(): {id, path, name, layers, model_hint, scale}
    source: str  # "gui", "api", "load", "unload", ...


@dataclass(frozen=True)
class MixChanged(EngineEvent):
    mix: dict  # adapter id -> scale
    source: str  # "gui", "api", "unload", ...
    merge: dict | None = None  # the global mix's method: MergeSpec.as_dict()


@dataclass(frozen=True)
class MixBuilding(EngineEvent):
    """A merge method's mix being built (first use of that mix): per module, then done."""

    method: str
    progress: float  # 0..1
    message: str


@dataclass(frozen=True)
class RequestStarted(EngineEvent):
    id: int
    source: str
    mix: dict
    prompt_n: int


@dataclass(frozen=True)
class PromptProgress(EngineEvent):
    """A chunk of a request's prompt was evaluated (one per scheduler prefill chunk)."""

    id: int
    source: str
    done: int  # prompt tokens in the cache so far, cached prefix included
    total: int


@dataclass(frozen=True)
class ChannelMeter(EngineEvent):
    """One metered decode step of a running request (Engine.meters on): how much each
    adapter and control vector of its mix changes the model (core/lora/meter.py), at most every
    METER_INTERVAL_S per request."""

    id: int
    source: str
    values: dict  # adapter id -> ‖Δ_a x‖ / ‖W x‖ over the step's products
    vectors: dict  # control vector id -> ‖s·v‖ / ‖h‖ over the layers it steers


@dataclass(frozen=True)
class RequestFinished(EngineEvent):
    id: int
    source: str
    stop_type: str
    predicted_n: int
    timings: dict
    error: str | None
