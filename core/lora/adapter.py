"""LoRA adapters: the llama.cpp GGUF format and PEFT folders, validated against a base.

An :class:`Adapter` holds, per base tensor name (GGUF naming, e.g.
``blk.3.attn_q.weight``), a pair (A (rank, in), B (out, rank)) and the alpha to
use for it. Both loaders end in the same validation against the base model's
shapes, so every error names the adapter and the tensor.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..gguf.reader import GGUFError, GGUFFile, UnsupportedQuant, check_regular_file, short_name
from ..model import layout
from ..model.config import ModelConfig, describe_value
from .naming import hf_module_to_gguf, hf_modules, permute_qk_rows, rope_heads

log = logging.getLogger(__name__)


class AdapterError(UserError):
    """An adapter cannot be used; the message names the adapter (and tensor)."""


MAX_ALPHA = 65536.0  # |alpha|; real adapters use 1..512, more is corrupt or hostile
MAX_RANK = 65536
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_alpha(value: Any, key: str, label: str) -> float | None:
    """A LoRA alpha: None or 0 (use the scale as is), else a finite number of sane size.
    NaN/Inf/3e38 would turn every output into NaN (and, before this check, hang)."""
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or abs(value) > MAX_ALPHA:
        raise AdapterError(
            f"adapter {label}: {key} must be a finite number from {-MAX_ALPHA:g} to "
            f"{MAX_ALPHA:g}, not {describe_value(value)}"
        )
    return float(value) or None


def check_rank(value: Any, key: str, label: str) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_RANK:
        raise AdapterError(
            f"adapter {label}: {key} must be an integer from 1 to {MAX_RANK}, "
            f"not {describe_value(value)}"
        )
    return int(value)


def effective_scale(scale: float, alpha: float | None, rank: int) -> float:
    """The one LoRA scale formula: ``scale * alpha / rank`` if alpha is set, else ``scale``
    (as llama.cpp's llama_adapter_lora_weight::get_scale)."""
    return scale * alpha / rank if alpha else scale


# ---- the adapter ----------------------------------------------------------


@dataclass
class LoraPair:
    a: np.ndarray  # (rank, in); for token_embd: (vocab, rank)
    b: np.ndarray  # (out, rank); for token_embd: (dim, rank)
    alpha: float | None  # None: the scale is used as is

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def scale_for(self, scale: float) -> float:
        return effective_scale(scale, self.alpha, self.rank)


@dataclass
class Adapter:
    path: Path
    name: str
    format: str  # "gguf" | "peft"
    tensors: dict[str, LoraPair]
    alpha: float | None = None
    task_name: str = ""
    prompt_prefix: str = ""
    invocation_tokens: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    id: int = -1  # assigned by the registry; stable for the session

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.tensors.values()})

    @property
    def rank(self) -> int:
        return max(self.ranks) if self.tensors else 0

    @property
    def targets(self) -> list[str]:
        """Short target names, e.g. ['attn_k', 'attn_q', 'ffn_up']."""
        return sorted({re.sub(r"^blk\.\d+\.|\.weight$", "", n) for n in self.tensors})

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.tensors.values())

    def effective_scale(self, scale: float) -> float:
        """Representative effective scale (adapter-level alpha/rank), for display."""
        return effective_scale(scale, self.alpha, self.rank) if self.tensors else scale

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "path": str(self.path),
            "format": self.format,
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": self.targets,
            "n_tensors": len(self.tensors),
            "size_bytes": self.nbytes,
            "task_name": self.task_name,
            "prompt_prefix": self.prompt_prefix,
            "invocation_tokens": list(self.invocation_tokens),
        }


def load_adapter(path: str | Path, cfg: ModelConfig) -> Adapter:
    """Load a llama.cpp LoRA GGUF or a PEFT folder and validate it against ``cfg``."""
    p = Path(path)
    if p.is_dir() or p.name == "adapter_config.json" or p.suffix == ".safetensors":
        folder = p if p.is_dir() else p.parent
        adapter = _load_peft(folder, cfg)
    elif p.exists() or p.is_symlink():
        adapter = _load_gguf(p, cfg)
    else:
        raise AdapterError(f"{p}: no such file or folder")
    _validate(adapter, cfg)
    return adapter


def _load_gguf(path: Path, cfg: ModelConfig) -> Adapter:
    try:
        gf = GGUFFile(path)
    except GGUFError as e:
        # its message already names the file: "adapter x.gguf is not a valid GGUF
        # file: ...", never "adapter x.gguf: x.gguf is not ..."
        named = path.name in str(e).split(":", 1)[0]
        raise AdapterError(f"adapter {e}" if named else f"adapter {path.name}: {e}") from None
    meta = gf.metadata
    label = path.name

    def text(key: str, default: str = "") -> str:
        v = meta.get(key, default)
        if not isinstance(v, str):
            raise AdapterError(f"adapter {label}: {key} must be a string, not {describe_value(v)}")
        return v

    gtype, atype = text("general.type", "no general.type"), text("adapter.type", "lora")
    if gtype != "adapter" or atype != "lora":
        raise AdapterError(
            f"adapter {label}: not a LoRA adapter GGUF (general.type={short_name(gtype)}, "
            f"adapter.type={short_name(atype)})"
        )
    arch = text("general.architecture", "none")
    if arch != cfg.arch:
        raise AdapterError(
            f"adapter {label}: made for architecture {short_name(arch)}, "
            f"but the base model is {cfg.arch!r}"
        )
    alpha = check_alpha(meta.get("adapter.lora.alpha"), "adapter.lora.alpha", label)
    invocation = _invocation_tokens(meta.get("adapter.alora.invocation_tokens"), cfg, label)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    skipped = []
    for tname, info in gf.tensors.items():
        m = re.fullmatch(r"(.+)\.lora_([ab])", tname)
        if not m:
            raise AdapterError(
                f"adapter {path.name}: unexpected tensor {short_name(tname)} "
                "(expected <base>.lora_a / <base>.lora_b)"
            )
        base, which = m.groups()
        if base.endswith("_norm.weight"):
            skipped.append(tname)
            continue
        try:
            arr = gf.dequantize(tname)  # info.shape
        except UnsupportedQuant:
            raise AdapterError(
                f"adapter {path.name}: tensor {short_name(tname)} has unsupported type "
                f"{info.qtype.name}"
            ) from None
        pairs.setdefault(base, {})[which] = np.ascontiguousarray(arr, dtype=np.float32)
    if skipped:
        log.warning(
            "adapter %s: skipping %d norm tensors (as llama.cpp does): %s",
            path.name,
            len(skipped),
            ", ".join(skipped[:3]),
        )
    tensors = {}
    for base, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            missing = "lora_b" if "a" in ab else "lora_a"
            raise AdapterError(f"adapter {path.name}: tensor {short_name(base)} has no {missing}")
        tensors[base] = LoraPair(ab["a"], ab["b"], alpha)
    return Adapter(
        path=path,
        name=path.stem,
        format="gguf",
        tensors=tensors,
        alpha=alpha,
        task_name=text("adapter.lora.task_name"),
        prompt_prefix=text("adapter.lora.prompt_prefix"),
        invocation_tokens=invocation,
        skipped=skipped,
    )


def _invocation_tokens(
    value: Any, cfg: ModelConfig, label: str, key: str = "adapter.alora.invocation_tokens"
) -> list[int]:
    """An aLoRA's invocation tokens (``key``): token ids of the base model's vocabulary."""
    if value is None:
        return []
    ok = (isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu") or (
        isinstance(value, list) and all(_is_int(t) for t in value)
    )
    if not ok:
        raise AdapterError(
            f"adapter {label}: {key} must be an array of token ids, not {describe_value(value)}"
        )
    tokens = [int(t) for t in value]
    if any(not 0 <= t < cfg.vocab_size for t in tokens):
        raise AdapterError(
            f"adapter {label}: {key} holds a token id outside the base model's "
            f"vocabulary of {cfg.vocab_size}"
        )
    return tokens


def _patterns(pc: dict, key: str, label: str, check) -> list[tuple[str, re.Pattern, Any]]:
    """PEFT rank_pattern / alpha_pattern, compiled and checked: a key matches a module
    by full name or as a dotted suffix (PEFT treats keys as regexes anchored at a dot)."""
    patterns = pc.get(key) or {}
    if not isinstance(patterns, dict):
        raise AdapterError(
            f"adapter {label}: {key} in adapter_config.json must be an object, "
            f"not {describe_value(patterns)}"
        )
    out = []
    for pat, val in patterns.items():
        try:
            rx = re.compile(rf"(?:.*\.)?(?:{pat})")
        except (re.error, RecursionError, OverflowError):
            raise AdapterError(
                f"adapter {label}: {key} key {short_name(pat)} in adapter_config.json "
                "is not a valid regular expression"
            ) from None
        out.append((pat, rx, check(val, f"{key}[{short_name(pat)}]", label)))
    return out


def _pattern_value(patterns: list[tuple[str, re.Pattern, Any]], module: str, default):
    for pat, rx, val in patterns:
        if module == pat or rx.fullmatch(module):
            return val
    return default


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Tensors as float32. numpy has no bfloat16, so BF16 is widened by hand."""
    from safetensors import safe_open

    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    if header_len <= 0 or header_len > path.stat().st_size:
        raise AdapterError(f"adapter {path.parent.name}: {path.name} is not a safetensors file")
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        out = {}
        bf16 = {k: v for k, v in header.items() if k != "__metadata__" and v["dtype"] == "BF16"}
        for k, v in bf16.items():
            s, e = v["data_offsets"]
            f.seek(data_start + s)
            raw = np.frombuffer(f.read(e - s), dtype="<u2").astype(np.uint32) << 16
            out[k] = raw.view(np.float32).reshape(v["shape"])
    with safe_open(str(path), framework="np") as st:
        for k in st.keys():
            if k not in out:
                out[k] = st.get_tensor(k).astype(np.float32)
    return out


def _read_config(cfg_path: Path, label: str) -> dict:
    """adapter_config.json as a dict; a FIFO, a huge file, bad JSON or a JSON value
    that is not an object are refused by name."""
    size = check_regular_file(cfg_path, AdapterError, f"adapter {label}: ")
    if size > MAX_CONFIG_BYTES:
        raise AdapterError(f"adapter {label}: adapter_config.json is too large ({size} bytes)")
    try:
        pc = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise AdapterError(f"adapter {label}: adapter_config.json is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise AdapterError(
            f"adapter {label}: adapter_config.json is not valid JSON "
            f"(line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:
        raise AdapterError(f"adapter {label}: adapter_config.json is nested too deeply") from None
    if not isinstance(pc, dict):
        raise AdapterError(
            f"adapter {label}: adapter_config.json must hold a JSON object, "
            f"not {describe_value(pc)}"
        )
    return pc


def _config_field(pc: dict, key: str, label: str, kinds: tuple, want: str, default: Any):
    v = pc.get(key, default)
    if v is not None and not isinstance(v, kinds):
        raise AdapterError(
            f"adapter {label}: {key} in adapter_config.json must be {want}, not {describe_value(v)}"
        )
    return v


def _load_peft(folder: Path, cfg: ModelConfig) -> Adapter:
    label = folder.name
    cfg_path = folder / "adapter_config.json"
    st_path = folder / "adapter_model.safetensors"
    if not cfg_path.exists() and not cfg_path.is_symlink():
        raise AdapterError(f"adapter {label}: no adapter_config.json in {folder}")
    if not st_path.exists() and not st_path.is_symlink():
        extra = (
            " (adapter_model.bin is not supported: re-save with safetensors)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise AdapterError(f"adapter {label}: no adapter_model.safetensors in {folder}{extra}")
    pc = _read_config(cfg_path, label)

    def field(key: str, kinds: tuple, want: str, default: Any = None) -> Any:
        return _config_field(pc, key, label, kinds, want, default)

    ptype = field("peft_type", (str,), "a string", "LORA")
    if ptype != "LORA":
        raise AdapterError(
            f"adapter {label}: unsupported: PEFT type {short_name(ptype)} (only LORA)"
        )
    if field("use_dora", (bool,), "true or false"):
        raise AdapterError(f"adapter {label}: unsupported: DoRA (use_dora=true)")
    to_save = field("modules_to_save", (list,), "a list of module names")
    if to_save and not all(isinstance(m, str) for m in to_save):
        raise AdapterError(
            f"adapter {label}: modules_to_save in adapter_config.json must be a list of "
            "module names"
        )
    if to_save:
        raise AdapterError(
            f"adapter {label}: unsupported: modules_to_save "
            f"({', '.join(short_name(m) for m in to_save[:8])}) stores full weights, not a LoRA"
        )
    bias = field("bias", (str,), "a string", "none")
    if bias != "none":
        raise AdapterError(f"adapter {label}: unsupported: bias training (bias={short_name(bias)})")
    if field("fan_in_fan_out", (bool,), "true or false"):
        raise AdapterError(f"adapter {label}: unsupported: fan_in_fan_out=true (Conv1D models)")
    r_default = check_rank(pc.get("r", 8), "r in adapter_config.json", label)
    alpha_default = check_alpha(
        pc.get("lora_alpha", r_default), "lora_alpha in adapter_config.json", label
    )
    rslora = bool(field("use_rslora", (bool,), "true or false"))
    task = field("task_type", (str,), "a string") or ""
    rank_patterns = _patterns(pc, "rank_pattern", label, check_rank)
    alpha_patterns = _patterns(pc, "alpha_pattern", label, check_alpha)
    check_regular_file(st_path, AdapterError, f"adapter {label}: ")
    try:
        raw = _read_safetensors(st_path)
    except AdapterError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        # its messages can quote the file's header: log them, show a plain reason
        log.info("adapter %s: unreadable safetensors: %s", label, e)
        raise AdapterError(
            f"adapter {label}: adapter_model.safetensors is not a valid safetensors file "
            "(truncated or corrupt)"
        ) from None

    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in raw.items():
        m = re.fullmatch(
            r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
            r"lora_magnitude_vector)(?:\.default)?(?:\.weight)?",
            key,
        )
        if not m:
            if key.endswith(".bias"):
                raise AdapterError(
                    f"adapter {label}: unsupported: bias training ({short_name(key)})"
                )
            raise AdapterError(f"adapter {label}: unexpected tensor {short_name(key)}")
        module, kind = m.groups()
        if kind == "lora_magnitude_vector":
            raise AdapterError(f"adapter {label}: unsupported: DoRA ({short_name(key)})")
        modules.setdefault(module, {})[kind] = arr

    tensors: dict[str, LoraPair] = {}
    for module, parts in modules.items():
        gname = hf_module_to_gguf(cfg, module)
        if gname is None:
            raise AdapterError(
                f"adapter {label}: module {short_name(module)} has no counterpart in a "
                f"{cfg.arch} GGUF (supported: {hf_modules(cfg)}, embed_tokens, lm_head)"
            )
        short = module.removeprefix("base_model.model.")
        rank = _pattern_value(rank_patterns, short, r_default)
        alpha = _pattern_value(alpha_patterns, short, alpha_default)
        if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
            if set(parts) != {"lora_embedding_A", "lora_embedding_B"}:
                raise AdapterError(
                    f"adapter {label}: module {short_name(module)} needs both "
                    "lora_embedding_A and lora_embedding_B"
                )
            # PEFT embedding LoRA: A (r, vocab), B (dim, r); llama.cpp wants a (vocab, r), b (dim, r)
            a, b = parts["lora_embedding_A"].T, parts["lora_embedding_B"]
        else:
            if "lora_A" not in parts or "lora_B" not in parts:
                raise AdapterError(
                    f"adapter {label}: module {short_name(module)} lacks lora_A or lora_B"
                )
            a, b = parts["lora_A"], parts["lora_B"]
            want_out = layout.lora_targets(cfg).get(gname, (None,))[0]
            if b.ndim != 2 or b.shape[0] != want_out:
                raise AdapterError(
                    f"adapter {label}: tensor {gname!r} lora_B has shape "
                    f"{b.shape}, the base has {want_out} output rows"
                )
            heads = rope_heads(cfg, gname)
            if heads:
                b = permute_qk_rows(b, heads)
        if a.ndim != 2 or b.ndim != 2:
            raise AdapterError(
                f"adapter {label}: tensor {gname!r}: lora_A/lora_B must be 2-D matrices"
            )
        if b.shape[1] != rank:
            raise AdapterError(
                f"adapter {label}: tensor {gname!r} has rank {b.shape[1]} but "
                f"adapter_config.json says r={rank}"
            )
        # rsLoRA scales by alpha/sqrt(r); express it as an alpha for the one formula.
        eff_alpha = alpha * math.sqrt(rank) if rslora and alpha else alpha
        tensors[gname] = LoraPair(
            np.ascontiguousarray(a, dtype=np.float32),
            np.ascontiguousarray(b, dtype=np.float32),
            eff_alpha,
        )
    return Adapter(
        path=folder,
        name=folder.name,
        format="peft",
        tensors=tensors,
        alpha=alpha_default * math.sqrt(r_default) if rslora and alpha_default else alpha_default,
        task_name=task,
        # PEFT's aLoRA (LoraConfig.alora_invocation_tokens), llama.cpp's
        # adapter.alora.invocation_tokens once converted: the same checks
        invocation_tokens=_invocation_tokens(
            pc.get("alora_invocation_tokens"), cfg, label, "alora_invocation_tokens"
        ),
    )


def _validate(adapter: Adapter, cfg: ModelConfig) -> None:
    label = adapter.path.name
    if not adapter.tensors:
        raise AdapterError(f"adapter {label}: contains no LoRA tensors")
    shapes = layout.lora_targets(cfg)
    for name, pair in adapter.tensors.items():
        shown = short_name(name)
        if name not in shapes:
            raise AdapterError(
                f"adapter {label}: tensor {shown} does not exist in the base "
                f"model ({cfg.name}, {cfg.n_layers} layers)"
            )
        out, inp = shapes[name]
        a, b = pair.a, pair.b
        if a.ndim != 2 or b.ndim != 2:
            raise AdapterError(f"adapter {label}: tensor {shown}: lora_a/lora_b must be 2-D")
        if 0 in a.shape or 0 in b.shape:
            # rank 0 would divide by zero in alpha/rank on every request
            raise AdapterError(
                f"adapter {label}: tensor {shown} has rank 0 (lora_a {a.shape}, "
                f"lora_b {b.shape}); a LoRA needs rank 1 or more"
            )
        if name == "token_embd.weight":
            want_a, want_b = (out, b.shape[1]), (inp, a.shape[1])  # flipped, as llama.cpp
        else:
            want_a, want_b = (a.shape[0], inp), (out, a.shape[0])
        if a.shape != want_a or b.shape != want_b:
            raise AdapterError(
                f"adapter {label}: tensor {shown} does not fit the base: lora_a {a.shape}, "
                f"lora_b {b.shape}; base weight is {(out, inp)} (out, in), so expected "
                f"lora_a {want_a} and lora_b {want_b}"
            )
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"adapter {label}: tensor {shown} contains NaN or Inf")
