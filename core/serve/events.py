"""What the engine announces to its subscribers (the window's bridge, tests).

One dataclass per event, so each event's fields are declared once, here. Listeners
keep the ``fn(name, payload)`` form (ui/bridge.py dispatches on the name): the
engine sends ``event.name`` and ``event.payload()``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class EngineEvent:
    name: ClassVar[str]

    def payload(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ModelLoading(EngineEvent):
    name: ClassVar[str] = "model_loading"
    path: str
    progress: float  # 0..1
    message: str


@dataclass(frozen=True)
class ModelLoaded(EngineEvent):
    name: ClassVar[str] = "model_loaded"
    info: dict  # Engine.model_info()


@dataclass(frozen=True)
class ModelError(EngineEvent):
    name: ClassVar[str] = "model_error"
    path: str
    error: str
    cancelled: bool  # the user cancelled it: not an error to show


@dataclass(frozen=True)
class AdaptersChanged(EngineEvent):
    name: ClassVar[str] = "adapters_changed"
    adapters: list  # Engine.adapters()


@dataclass(frozen=True)
class AdaptersDropped(EngineEvent):
    name: ClassVar[str] = "adapters_dropped"
    dropped: list  # {id, name, path, error} of each adapter a reload unloaded


@dataclass(frozen=True)
class MixChanged(EngineEvent):
    name: ClassVar[str] = "mix_changed"
    mix: dict  # adapter id -> scale
    source: str  # "gui", "api", "unload", ...
    merge: dict | None = None  # the global mix's method: MergeSpec.as_dict()


@dataclass(frozen=True)
class MixBuilding(EngineEvent):
    """A merge method's mix being built (first use of that mix): per module, then done."""

    name: ClassVar[str] = "mix_building"
    method: str
    progress: float  # 0..1
    message: str


@dataclass(frozen=True)
class RequestStarted(EngineEvent):
    name: ClassVar[str] = "request_started"
    id: int
    source: str
    mix: dict
    prompt_n: int


@dataclass(frozen=True)
class PromptProgress(EngineEvent):
    """A chunk of a request's prompt was evaluated (one per scheduler prefill chunk)."""

    name: ClassVar[str] = "prompt_progress"
    id: int
    source: str
    done: int  # prompt tokens in the cache so far, cached prefix included
    total: int


@dataclass(frozen=True)
class RequestFinished(EngineEvent):
    name: ClassVar[str] = "request_finished"
    id: int
    source: str
    stop_type: str
    predicted_n: int
    timings: dict
    error: str | None
