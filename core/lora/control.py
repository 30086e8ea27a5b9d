"""Control vectors, as llama.cpp reads and applies them.

A control-vector GGUF (llama.cpp's cvector-generator, repeng's ``export_gguf``) holds
one float32 1-D tensor ``direction.N`` of the model's embedding size per steered
layer N. llama.cpp (``common_control_vector_load`` and ``llama_adapter_cvec``):

* ``direction.0`` is refused (layer 0 is never steered) and so is a name that is not
  ``direction.<integer>``; a tensor that is not F32 or not 1-D is refused; two
  tensors for one layer add up;
* several vectors add up, each times its scale (``--control-vector-scaled F:S``);
* ``direction.N`` is added to the output of block N, after its residual add (the
  ``l_out`` of the graph), for every N in the layer range (``--control-vector-layer-range
  START END``, inclusive; START <= 0 means 1, END <= 0 means the model's layer count).

llama.cpp silently skips a direction for a layer the model does not have; Mixdesk
refuses the file instead (a vector made for another model), as it refuses an adapter
made for another model. Layers a file does not name are simply not steered, as in
llama.cpp (repeng exports a subset of layers when asked to).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..gguf.reader import GGMLQuantizationType, GGUFError, GGUFFile, check_regular_file
from ..model.config import ModelConfig
from ..values import is_finite_number, shown

# A vector is n_layers x dim float32: 8 MB for 128 layers of 16384. A bigger file is
# not a control vector (and is not read into memory to find that out).
MAX_FILE_BYTES = 64 << 20
# |scale| bound for a vector's scale, as for a LoRA scale (core/lora/registry.py).
SCALE_MAX = 100.0
# |value| bound for one direction component: real vectors are O(1) (a PCA direction
# has unit norm, repeng scales it to the hidden states' size); far beyond the hidden
# states' range is corrupt and would overflow float32 once scaled
MAX_COMPONENT = 1e6

_DIRECTION = re.compile(r"direction\.(\d+)")


class ControlVectorError(UserError):
    """A control-vector file or setting Mixdesk refuses, with the reason."""


@dataclass
class ControlVector:
    """One loaded control vector: ``directions`` (n_layers, dim) float32, row N the
    direction added after block N (row 0 always zero); ``layers`` the rows its file
    names. ``id`` is its session id once registered."""

    path: Path
    name: str
    directions: np.ndarray  # (n_layers, d)
    layers: tuple[int, ...]
    model_hint: str = ""
    id: int = -1
    meta: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        """Its GET /control-vectors entry (the scale is added by the registry)."""
        return {
            "id": self.id,
            "path": str(self.path),
            "name": self.name,
            "layers": list(self.layers),
            "model_hint": self.model_hint,
        }

    def fits(self, cfg: ModelConfig) -> bool:
        return self.directions.shape == (cfg.n_layers, cfg.dim)


def check_scale(value: Any, what: str) -> float:
    """A vector scale from a user or a client, as a float; ControlVectorError otherwise."""
    if not is_finite_number(value, SCALE_MAX):
        raise ControlVectorError(
            f"{what} must be a finite number in [-{SCALE_MAX:g}, {SCALE_MAX:g}], got {shown(value)}"
        )
    return float(value)


def load_control_vector(path: str | Path, cfg: ModelConfig) -> ControlVector:
    """Read a llama.cpp control-vector GGUF and check it against ``cfg``; a
    ControlVectorError naming the file for anything llama.cpp refuses, a vector made
    for another model (embedding size, layer count), NaN/Inf values, no directions,
    a FIFO or a huge file."""
    p = Path(path)
    label = p.name
    size = check_regular_file(p, ControlVectorError, prefix="control vector: ")
    if size > MAX_FILE_BYTES:
        raise ControlVectorError(
            f"control vector {label}: {size} bytes is too large for a control vector "
            f"(at most {MAX_FILE_BYTES >> 20} MB)"
        )
    try:
        gf = GGUFFile(p)
    except GGUFError as e:
        raise ControlVectorError(f"control vector {label}: {e}") from None
    try:
        directions = np.zeros((cfg.n_layers, cfg.dim), dtype=np.float32)  # (L, d)
        named: set[int] = set()
        if not gf.tensors:
            raise ControlVectorError(f"control vector {label}: it holds no direction tensors")
        for name, t in gf.tensors.items():
            m = _DIRECTION.fullmatch(name)
            if m is None:
                raise ControlVectorError(
                    f"control vector {label}: tensor {shown(name)} is not named direction.<layer>"
                )
            layer = int(m.group(1))
            if layer == 0:
                raise ControlVectorError(
                    f"control vector {label}: direction.0 is invalid (llama.cpp never steers "
                    "layer 0)"
                )
            if t.qtype != GGMLQuantizationType.F32 or len(t.shape) != 1:
                raise ControlVectorError(
                    f"control vector {label}: {name} must be a 1-D F32 tensor, not "
                    f"{t.qtype.name} of shape {list(t.shape)}"
                )
            if t.shape[0] != cfg.dim:
                raise ControlVectorError(
                    f"control vector {label}: {name} has {t.shape[0]} values, but the model's "
                    f"embedding size is {cfg.dim} (a vector made for another model?)"
                )
            if layer >= cfg.n_layers:
                raise ControlVectorError(
                    f"control vector {label}: {name} steers layer {layer}, but the model's "
                    f"layers are 0..{cfg.n_layers - 1} (a vector made for another model?)"
                )
            v = gf.dequantize(name)  # (d,)
            if not np.all(np.isfinite(v)) or float(np.abs(v).max(initial=0.0)) > MAX_COMPONENT:
                raise ControlVectorError(
                    f"control vector {label}: {name} holds NaN, Inf or values beyond "
                    f"±{MAX_COMPONENT:g}"
                )
            directions[layer] += v  # two tensors of one layer add, as in llama.cpp
            named.add(layer)
        hint = gf.get("controlvector.model_hint", "")
        return ControlVector(
            path=p,
            name=p.stem,
            directions=directions,
            layers=tuple(sorted(named)),
            model_hint=hint if isinstance(hint, str) else "",
        )
    finally:
        gf.close()


def write_control_vector(
    path: str | Path, directions: Mapping[int, np.ndarray], model_hint: str = ""
) -> Path:
    """Write ``directions`` {layer N: (d,) float32} as llama.cpp's cvector-generator
    does, the file load_control_vector reads back: arch "controlvector", its
    ``controlvector.model_hint`` and ``controlvector.layer_count`` (the directions
    written), one F32 ``direction.N`` per layer. Our layer N is llama.cpp's N (both
    add ``direction.N`` to block N's output), so the numbers are written as they are.
    Written beside ``path`` and renamed over it: no reader sees half a file."""
    import gguf  # the writer (pinned gguf package); the reader is our own

    if not directions or any(int(n) < 1 for n in directions):
        raise ControlVectorError("a control vector needs directions for layers 1 and up")
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, "controlvector")
        w.add_string("controlvector.model_hint", model_hint)
        w.add_uint32("controlvector.layer_count", len(directions))
        for n in sorted(directions):
            v = np.ascontiguousarray(directions[n], dtype=np.float32)  # (d,)
            w.add_tensor(f"direction.{int(n)}", v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


def layer_range(start: int, end: int, n_layers: int) -> tuple[int, int]:
    """The inclusive layers steered under ``--control-vector-layer-range START END``,
    as llama.cpp resolves it: START <= 0 is 1, END <= 0 is the layer count."""
    return (start if start > 0 else 1, end if end > 0 else n_layers)


def check_layer_range(start: Any, end: Any) -> tuple[int, int]:
    """A layer range from a user or a client: two integers; ControlVectorError else."""
    for what, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 1 << 20:
            raise ControlVectorError(
                f"control vector layer range {what} must be an integer, got {shown(v)}"
            )
    return int(start), int(end)


def steer_rows(
    pairs: Iterable[tuple[ControlVector, float]], lo: int, hi: int, cfg: ModelConfig
) -> np.ndarray | None:
    """The summed, scaled directions of ``pairs`` as added after each block, rows
    outside [lo, hi] zero: (n_layers, d), or None when nothing is steered."""
    out = np.zeros((cfg.n_layers, cfg.dim), dtype=np.float32)  # (L, d)
    for vec, scale in pairs:
        out += np.float32(scale) * vec.directions  # (L, d)
    keep = np.zeros(cfg.n_layers, dtype=bool)
    keep[max(lo, 0) : max(hi + 1, 0)] = True
    out[~keep] = 0.0
    if not np.all(np.isfinite(out)):
        raise ControlVectorError("the scaled control vectors overflow float32")
    return out if out.any() else None


def parse_scaled(text: str) -> list[tuple[str, float]]:
    """``--control-vector-scaled``'s value, ``FNAME:SCALE[,FNAME:SCALE...]``, as
    llama-server splits it (on ',' then on ':')."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not parts[0]:
            raise ControlVectorError(
                f"control-vector-scaled format: FNAME:SCALE, not {shown(item)}"
            )
        try:
            scale = float(parts[1])
        except ValueError:
            raise ControlVectorError(
                f"control-vector-scaled: {shown(parts[1])} is not a number"
            ) from None
        out.append((parts[0], check_scale(scale, f"scale of {parts[0]}")))
    return out


def steer_pairs(scales: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """Sorted non-zero (vector id, scale) pairs: the vectors part of a mix key."""
    return tuple(sorted((int(i), float(s)) for i, s in scales.items() if float(s) != 0.0))
