"""Export a mix: one LoRA GGUF, a merged model GGUF, or a PEFT folder.

Every export is a pure function of (base, adapters + scales, output path,
options, progress). ``base`` is an :class:`~core.serve.engine.Engine` (its model file
and loaded adapters; ``adapters=None`` means its current global mix) or the path
of a base model GGUF. ``adapters`` is a list of ``(adapter, scale)`` where
adapter is an :class:`~core.lora.adapter.Adapter`, an adapter path, or (with an engine)
an adapter id. Zero-scale adapters are dropped.

All three are exact, with no SVD: the mix's per-tensor (A_i, s_i·B_i) pairs are
concatenated along the rank axis, so ``B_cat @ A_cat == Σ s_i B_i A_i`` where
s_i is each adapter's effective scale (alpha/rank folded in). The exported
adapter therefore means "this mix at scale 1". A mix with a merge method other
than linear/cat (``merge``, or the engine's global mix's method) is exported as
what it runs with: its merged adapter (core/lora/mix.py: merged_adapter), at scale 1.

Files are written to a temporary name next to the target and moved into place
with ``os.replace``, so a failed or interrupted export never leaves a half file.
Errors a user can cause are :class:`ExportError` (a ValueError) with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

from ..errors import UserError
from ..gguf.metadata import typed_metadata, writable_value
from ..gguf.reader import GGUFError, GGUFFile, UnsupportedQuant
from ..model import layout
from ..model.config import ModelConfig
from ..model.weights import open_model_file
from ..version import version
from .adapter import Adapter, load_adapter
from .merge import MergeSpec
from .mix import merged_adapter, mix_key
from .naming import gguf_to_hf_module, rope_heads, unpermute_qk_rows

# the metadata key naming the Mixdesk version that wrote a GGUF (both GGUF exports)
VERSION_KEY = "mixdesk.version"

Progress = Callable[[float, str], None]


OUTTYPES = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
}
FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
}


class ExportError(UserError):
    """An export cannot be done; the message says why in one line."""


@dataclass
class ExportResult:
    path: Path
    n_tensors: int  # base tensors the mix changes
    rank: int  # largest concatenated rank
    nbytes: int  # size of what was written
    vectors: Path | None = None  # the mix's control vectors, written beside it


@dataclass
class _Mix:
    """The mix as per-base-tensor concatenated pairs, scales folded into B."""

    cfg: ModelConfig
    base_path: Path | None
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (A (R,in), B (out,R)); embd flipped
    names: list[str]  # adapter names, for messages/metadata

    def delta(self, name: str) -> np.ndarray | None:
        """Σ s_i B_i A_i in the base tensor's numpy (rows, cols) layout, float32."""
        ab = self.pairs.get(name)
        if ab is None:
            return None
        a, b = ab
        if name == "token_embd.weight":
            return a @ b.T  # (vocab, R) @ (R, dim) -> (vocab, dim)
        return b @ a  # (out, R) @ (R, in) -> (out, in)


# ---- resolving the inputs ------------------------------------------------------


def _resolve(
    base: Any,
    adapters: Iterable | Mapping | None,
    merge: MergeSpec | None = None,
    progress: Progress | None = None,
    allow_empty: bool = False,
) -> _Mix:
    engine = None
    if hasattr(base, "config") and hasattr(base, "add_adapter"):  # an Engine (no import cycle)
        engine = base
        if engine.config is None:
            raise ExportError("no model loaded")
        cfg, base_path = engine.config, engine.path
        if adapters is None:
            adapters = engine.get_mix()
    else:
        if base is None:
            raise ExportError("no base model given")
        _, cfg = open_model_file(base)  # ModelLoadError (ValueError) names the file
        base_path = Path(base)
        if adapters is None:
            adapters = []
    items = adapters.items() if isinstance(adapters, Mapping) else adapters

    chosen: list[tuple[Adapter, float]] = []
    for item in items:
        try:
            ref, scale = item
        except (TypeError, ValueError):
            raise ExportError(
                f"each adapter must be given as (adapter, scale), got {item!r}"
            ) from None
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise ExportError(f"scale of adapter {ref!r} must be a number, got {scale!r}") from None
        if not np.isfinite(scale):
            raise ExportError(f"scale of adapter {ref!r} must be finite, got {scale!r}")
        if isinstance(ref, Adapter):
            ad = ref
        elif isinstance(ref, int) and not isinstance(ref, bool):
            if engine is None:
                raise ExportError(f"adapter id {ref} needs an engine; pass a path instead")
            ad = engine.adapter(ref)
        else:
            ad = load_adapter(ref, cfg)  # AdapterError names the adapter
        if scale != 0.0:
            chosen.append((ad, scale))
    if not chosen and not allow_empty:
        raise ExportError(
            "nothing to export: no adapter with a non-zero scale "
            "(add adapters with --lora or --lora-scaled)"
        )
    names = [ad.name for ad, _ in chosen]
    merge = merge if merge is not None else getattr(adapters, "merge", None)  # an engine Mix's
    if merge is not None and merge.builds and chosen:
        chosen = [(_merged(engine, chosen, merge, progress), 1.0)]
        names.append(f"merged by {merge.label()}")

    collected: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for ad, scale in chosen:
        for name, pair in ad.tensors.items():
            collected.setdefault(name, []).append(
                (pair.a, pair.b * np.float32(pair.scale_for(scale)))
            )
    pairs = {}
    for name, plist in collected.items():
        a_axis = 1 if name == "token_embd.weight" else 0
        a = np.concatenate([p[0] for p in plist], axis=a_axis).astype(np.float32, copy=False)
        b = np.concatenate([p[1] for p in plist], axis=1).astype(np.float32, copy=False)
        pairs[name] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    return _Mix(cfg, base_path, pairs, names)


def _merged(
    engine: Any, chosen: list[tuple[Adapter, float]], merge: MergeSpec, progress: Progress | None
) -> Adapter:
    """The mix's merged adapter: the engine's own when the mix runs there (built once,
    kept in its MixCache: exporting the mix just used costs no second merge), else
    merged here."""
    if engine is not None and engine.lora.mixes is not None:
        loaded = {a["id"] for a in engine.adapters()}
        own = {ad.id: ad for ad, _ in chosen if ad.id in loaded}
        if len(own) == len(chosen) and all(engine.adapter(i) is ad for i, ad in own.items()):
            key = mix_key({ad.id: s for ad, s in chosen}, merge)
            return engine.lora.mixes.get(key, own, progress).sources[0][0]
    return merged_adapter(chosen, merge, progress)


def _rank_of(ab: tuple[np.ndarray, np.ndarray]) -> int:
    return ab[1].shape[1]


# ---- writing files safely ------------------------------------------------------


def _check_target(out: Path, mix: _Mix, what: str) -> None:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"{what}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{what}: output folder {parent} is not writable")
    if out.is_dir() and what != "export-peft":
        raise ExportError(f"{what}: {out} is a folder; give a file name")
    if mix.base_path is not None and out.exists() and out.resolve() == mix.base_path.resolve():
        raise ExportError(f"{what}: refusing to overwrite the base model {out}")


def _partial(out: Path) -> Path:
    return out.with_name(f".{out.name}.{os.getpid()}.partial")


@contextlib.contextmanager
def _atomic_gguf(out: Path, arch: str, what: str):
    """A GGUFWriter on a temp file next to ``out``: moved over ``out`` when the block
    completes, removed when it raises (an OSError, or a cancel from a progress callback)."""
    tmp = _partial(out)
    w = None
    try:
        w = GGUFWriter(tmp, arch)
        w.add_string(VERSION_KEY, version())  # which Mixdesk wrote it (llama.cpp ignores it)
        yield w
        w.close()
        os.replace(tmp, out)
    except OSError as e:
        raise _os_error(what, out, e) from None
    finally:
        if w is not None:
            w.close()  # before the unlink (an open file cannot be removed on Windows)
        if tmp.exists():
            tmp.unlink()


def _os_error(what: str, out: Path, e: OSError) -> ExportError:
    return ExportError(f"{what}: cannot write {out}: {e.strerror or e}")


class _Reporter:
    def __init__(self, progress: Progress | None):
        self.fn = progress or (lambda f, m: None)

    def __call__(self, frac: float, msg: str) -> None:
        self.fn(max(0.0, min(1.0, frac)), msg)


# ---- 1. one LoRA GGUF ----------------------------------------------------------


def export_lora(
    base: Any,
    adapters: Iterable | Mapping | None,
    out: str | os.PathLike,
    *,
    dtype: str = "f32",
    progress: Progress | None = None,
    merge: MergeSpec | None = None,
) -> ExportResult:
    """Write the mix as one llama.cpp LoRA GGUF that means the mix at scale 1
    (no ``adapter.lora.alpha``: llama.cpp then uses the scale as is)."""
    if dtype not in ("f32", "f16"):
        raise ExportError(f"export-lora: dtype must be f32 or f16, got {dtype!r}")
    report = _Reporter(progress)
    out = Path(out)
    mix = _resolve(base, adapters, merge, lambda f, m: report(0.0, m))
    _check_target(out, mix, "export-lora")
    np_dtype = np.float32 if dtype == "f32" else np.float16
    report(0.0, "collecting tensors")
    with _atomic_gguf(out, mix.cfg.arch, "export-lora") as w:
        w.add_type("adapter")
        w.add_string("adapter.type", "lora")
        w.add_name(f"{mix.cfg.name} mix: " + ", ".join(mix.names))
        names = _ordered(mix.cfg, mix.pairs)
        for i, name in enumerate(names):
            a, b = mix.pairs[name]
            w.add_tensor(f"{name}.lora_a", a.astype(np_dtype))
            w.add_tensor(f"{name}.lora_b", b.astype(np_dtype))
            report(0.5 * (i + 1) / len(names), f"prepared {name}")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        report(0.6, "writing tensors")
        w.write_tensors_to_file()
    report(1.0, f"wrote {out.name}")
    return ExportResult(
        out, len(mix.pairs), max(_rank_of(p) for p in mix.pairs.values()), out.stat().st_size
    )


def _ordered(cfg: ModelConfig, pairs: Mapping[str, Any]) -> list[str]:
    """Base tensor names in model order (token_embd, blocks, output)."""
    order = {n: i for i, n in enumerate(layout.lora_targets(cfg))}
    return sorted(pairs, key=lambda n: order.get(n, len(order)))


# ---- 2. a merged model GGUF ----------------------------------------------------


def _planned_type(shape: tuple[int, ...], outtype: str) -> GGMLQuantizationType:
    """The ggml type a tensor of this shape is written in: norms and other 1-D tensors
    stay F32; a row that does not fit Q8_0 blocks falls back to F16."""
    if len(shape) < 2 or outtype == "f32":
        return GGMLQuantizationType.F32
    if outtype == "q8_0" and shape[-1] % 32 == 0:
        return GGMLQuantizationType.Q8_0
    return GGMLQuantizationType.F16


def _encode(arr: np.ndarray, outtype: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """float32 (rows, cols) -> (data to write, its ggml type from _planned_type, the
    type the header already announced)."""
    qt = _planned_type(arr.shape, outtype)
    if qt == GGMLQuantizationType.F32:
        return np.ascontiguousarray(arr, dtype=np.float32), qt
    if qt == GGMLQuantizationType.Q8_0:
        return quants.quantize(arr, qt), qt
    return arr.astype(np.float16), qt


def _encoded_nbytes(shape: tuple[int, ...], qt: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qt]
    return int(np.prod(shape)) // block * size


def _engine_weights(base: Any, mix: _Mix) -> Callable[[str], np.ndarray | None] | None:
    """With an engine on float32 weights, base tensors come from its already
    dequantized arrays (the same values, without dequantizing the file again). Weights
    kept in their GGUF blocks are dequantized from the file, as without an engine."""
    model = getattr(base, "model", None)
    if model is None or getattr(base, "path", None) != mix.base_path or model.w.quantized:
        return None
    cfg, wts = mix.cfg, model.w

    def view(name: str) -> np.ndarray | None:
        if name == "token_embd.weight":
            return wts.tok_embd
        if name == "output.weight":
            return None if wts.tied else wts.output
        if name == "output_norm.weight":
            return wts.output_norm
        slot = layout.fused_slot(cfg, name)
        if slot is not None:
            layer, target, row0, rows = slot
            return getattr(wts.layers[layer], target)[row0 : row0 + rows]
        split = layout.split_name(name)
        if split and split[1] in layout.norms(cfg):
            return getattr(wts.layers[split[0]], split[1])
        return None

    return view


def export_merged(
    base: Any,
    adapters: Iterable | Mapping | None,
    out: str | os.PathLike,
    *,
    outtype: str = "f16",
    progress: Progress | None = None,
    merge: MergeSpec | None = None,
    allow_empty: bool = False,
) -> ExportResult:
    """Write base + mix as a normal model GGUF: W' = W + Σ s_i B_i A_i per tensor,
    every KV of the base kept (general.file_type updated), names and shapes as in
    the base. Streams one tensor at a time, so memory stays about one tensor.
    ``allow_empty``: an empty mix writes the base itself in ``outtype`` (the float32
    base that llama-server serves in ``make interop``); otherwise it is refused."""
    if outtype not in OUTTYPES:
        raise ExportError(
            f"export-merged: outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}"
        )
    report = _Reporter(progress)
    out = Path(out)
    mix = _resolve(base, adapters, merge, lambda f, m: report(0.0, m), allow_empty)
    if mix.base_path is None:
        raise ExportError("export-merged: the engine has no model file")
    _check_target(out, mix, "export-merged")
    try:
        gf = GGUFFile(mix.base_path)
    except GGUFError as e:
        raise ExportError(f"export-merged: {e}") from None
    cfg = mix.cfg

    # On a tied model (no output.weight) the logits use token_embd unchanged, and a
    # LoRA on output.weight has nowhere to go: write an explicit output.weight then.
    extra_output = "output.weight" not in gf.tensors and (
        "token_embd.weight" in mix.pairs or "output.weight" in mix.pairs
    )
    plan = [(name, info.shape) for name, info in gf.tensors.items()]
    if extra_output:
        plan.append(("output.weight", gf.tensors["token_embd.weight"].shape))
    missing = [
        n for n in mix.pairs if n not in gf.tensors and not (n == "output.weight" and extra_output)
    ]
    if missing:
        raise ExportError(
            f"export-merged: the base {mix.base_path.name} has no tensor {missing[0]!r}"
        )

    engine_view = _engine_weights(base, mix)
    report(0.0, "reading base metadata")
    try:
        with _atomic_gguf(out, cfg.arch, "export-merged") as w:
            for key, vtype, sub, val in typed_metadata(mix.base_path):
                if key in ("general.architecture", "general.file_type", "general.alignment"):
                    continue
                if key == VERSION_KEY:
                    continue  # a base Mixdesk exported: this export's own version is written
                if vtype == GGUFValueType.ARRAY and len(val) == 0:
                    continue  # the writer cannot write an empty array; nothing reads one
                w.add_key_value(
                    key,
                    writable_value(vtype, val),
                    GGUFValueType(vtype),
                    GGUFValueType(sub) if sub is not None else None,
                )
            if "general.alignment" in gf.metadata:
                w.add_custom_alignment(int(gf.metadata["general.alignment"]))
            w.add_file_type(int(FILE_TYPES[outtype]))
            if outtype == "q8_0" and "general.quantization_version" not in gf.metadata:
                w.add_quantization_version(2)

            total = 0
            for name, shape in plan:
                qt = _planned_type(shape, outtype)
                nbytes = _encoded_nbytes(shape, qt)
                if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    w.add_tensor_info(
                        name,
                        shape,
                        np.dtype(np.float32 if qt == GGMLQuantizationType.F32 else np.float16),
                        nbytes,
                    )
                else:
                    w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qt)
                total += int(np.prod(shape))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()

            done = 0
            for name, shape in plan:
                src = "token_embd.weight" if (name == "output.weight" and extra_output) else name
                info = gf.tensors[src]
                arr = engine_view(src) if engine_view else None
                if arr is None or arr.shape != info.shape:
                    try:
                        arr = gf.dequantize(src)  # info.shape
                    except UnsupportedQuant:
                        raise ExportError(
                            f"export-merged: tensor {src!r} of the base uses "
                            f"{info.qtype.name}, which cannot be dequantized"
                        ) from None
                arr = np.array(arr, dtype=np.float32)  # a private, writable float32 copy
                d = mix.delta(name)
                if d is not None:
                    arr += d
                    del d
                data, _ = _encode(arr, outtype)
                del arr
                w.write_tensor_data(data)
                del data
                done += int(np.prod(shape))
                report(0.02 + 0.97 * done / total, f"wrote {name}")
    finally:
        gf.close()
    report(1.0, f"wrote {out.name}")
    rank = max((_rank_of(p) for p in mix.pairs.values()), default=0)
    return ExportResult(out, len(mix.pairs), rank, out.stat().st_size)


# ---- 3. a PEFT folder ----------------------------------------------------------


def export_peft(
    base: Any,
    adapters: Iterable | Mapping | None,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "f32",
    progress: Progress | None = None,
    merge: MergeSpec | None = None,
) -> ExportResult:
    """Write the mix as a PEFT LoRA folder (adapter_config.json +
    adapter_model.safetensors, HF module names and HF Q/K row order) whose scaling
    is 1 everywhere (lora_alpha = r, per module through rank/alpha_pattern)."""
    from safetensors.numpy import save_file

    if dtype not in ("f32", "f16"):
        raise ExportError(f"export-peft: dtype must be f32 or f16, got {dtype!r}")
    report = _Reporter(progress)
    out_dir = Path(out_dir)
    mix = _resolve(base, adapters, merge, lambda f, m: report(0.0, m))
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"export-peft: {out_dir} exists and is not a folder")
    _check_target(out_dir, mix, "export-peft")
    cfg = mix.cfg
    np_dtype = np.float32 if dtype == "f32" else np.float16

    report(0.0, "converting to Hugging Face layout")
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    short_targets: set[str] = set()
    names = _ordered(cfg, mix.pairs)
    for i, name in enumerate(names):
        a, b = mix.pairs[name]
        module = gguf_to_hf_module(cfg, name)
        if module is None:
            raise ExportError(f"export-peft: tensor {name!r} has no Hugging Face counterpart")
        prefix = f"base_model.model.{module}"
        short_targets.add(module.rsplit(".", 1)[-1])
        if name == "token_embd.weight":
            # llama.cpp a (vocab, r), b (dim, r) -> PEFT lora_embedding_A (r, vocab), B (dim, r)
            tensors[f"{prefix}.lora_embedding_A"] = np.ascontiguousarray(a.T, dtype=np_dtype)
            tensors[f"{prefix}.lora_embedding_B"] = np.ascontiguousarray(b, dtype=np_dtype)
            ranks[module] = a.shape[1]
            continue
        heads = rope_heads(cfg, name)
        if heads:
            b = unpermute_qk_rows(b, heads)
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a, dtype=np_dtype)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b, dtype=np_dtype)
        ranks[module] = a.shape[0]
        report(0.6 * (i + 1) / len(names), f"converted {name}")

    # The most common rank is r; the others go to rank_pattern, with alpha = r per
    # module so every module's scaling alpha/r is exactly 1.
    counts = Counter(ranks.values())
    r = max(counts, key=lambda k: (counts[k], k))
    rank_pattern = {m: rk for m, rk in ranks.items() if rk != r}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.name,
        "r": r,
        "lora_alpha": r,
        "target_modules": sorted(short_targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": dict(rank_pattern),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    # the version goes in the safetensors header, not adapter_config.json: PEFT warns on
    # an unknown config key, and other loaders may refuse one
    meta = {"format": "pt", "mixdesk_mix": json.dumps(mix.names), "mixdesk_version": version()}
    created = False
    st_tmp = cfg_tmp = None
    try:
        if not out_dir.exists():
            out_dir.mkdir()
            created = True
        st_path, cfg_path = out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"
        st_tmp, cfg_tmp = _partial(st_path), _partial(cfg_path)
        report(0.7, "writing adapter_model.safetensors")
        save_file(tensors, str(st_tmp), metadata=meta)
        cfg_tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(st_tmp, st_path)
        os.replace(cfg_tmp, cfg_path)
    except BaseException as e:  # also a progress callback that raises (GUI cancel)
        if created:
            for p in (st_tmp, cfg_tmp):
                if p is not None and p.exists():
                    p.unlink()
            try:
                out_dir.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise _os_error("export-peft", out_dir, e) from None
        raise
    finally:
        for p in (st_tmp, cfg_tmp):
            if p is not None and p.exists():
                p.unlink()
    report(1.0, f"wrote {out_dir.name}")
    return ExportResult(
        out_dir,
        len(mix.pairs),
        max(ranks.values()),
        sum(p.stat().st_size for p in (st_path, cfg_path)),
    )


# ---- control vectors beside a mix's export -----------------------------------------

VECTOR_SUFFIX = ".cvec.gguf"  # the control vectors' file beside an export of the mix
CANNOT_FOLD = (
    "control vectors are not folded into a merged model: a vector adds a constant after "
    "each block, which no weight of the model can hold exactly"
)


def vector_path(out: str | os.PathLike) -> Path:
    """Where a mix export at ``out`` writes its control vectors: beside it, named after
    it (model.gguf -> model.cvec.gguf; a PEFT folder mix -> mix.cvec.gguf)."""
    out = Path(out)
    stem = out.name[: -len(".gguf")] if out.name.endswith(".gguf") else out.name
    return out.with_name(stem + VECTOR_SUFFIX)


def export_control_vector(
    cfg: ModelConfig,
    vectors: Iterable[tuple[Any, float]],
    layers: tuple[int, int],
    out: str | os.PathLike,
) -> ExportResult:
    """Write a mix's control vectors, (ControlVector, scale) pairs steering the
    inclusive ``layers``, as ONE llama.cpp control-vector GGUF: per layer the summed,
    scaled directions (zero outside the range), so that ``--control-vector FILE``
    (scale 1, no layer range) steers as the mix does."""
    from .control import ControlVectorError, steer_rows, write_control_vector

    pairs = [(v, float(s)) for v, s in vectors if float(s) != 0.0]
    try:
        rows = steer_rows(pairs, layers[0], layers[1], cfg) if pairs else None  # (L, d)
    except ControlVectorError as e:
        raise ExportError(f"export: {e}") from None
    if rows is None:
        raise ExportError("export: the mix steers with no control vector")
    directions = {n: rows[n] for n in range(1, cfg.n_layers) if rows[n].any()}  # N: (d,)
    out = Path(out)
    try:
        write_control_vector(out, directions, model_hint=cfg.arch)
    except OSError as e:
        raise _os_error("export", out, e) from None
    return ExportResult(out, len(directions), 0, out.stat().st_size)
