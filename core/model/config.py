"""One config dataclass for a llama-family model, built from GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import LlamaFileType

from ..errors import UserError
from ..gguf.reader import short_name

# Mistral-style and Llama 3.x models also say "llama"; Qwen2/2.5 and DeepSeek-R1-Distill-
# Qwen say "qwen2"; Qwen3 dense models "qwen3"; Gemma 2 "gemma2"; Gemma 3 text models
# say "gemma3"; Phi-3/3.5-mini "phi3"
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# Architectures whose Q/K rows are in Hugging Face order and rotate halves (llama.cpp's
# LLAMA_ROPE_TYPE_NEOX); llama's converter permutes Q/K rows for adjacent pairs instead.
NEOX_ROPE_ARCHS = ("qwen2", "qwen3", "gemma2", "gemma3", "phi3")
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp: set_swa_pattern(6), layers 5, 11, ... see all keys
GEMMA2_GLOBAL_EVERY = 2  # llama.cpp: set_swa_pattern(2), odd layers see all keys
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B by block_count
GEMMA2_DEFAULT_WINDOW = 4096  # llama.cpp's n_swa for gemma2 files without the key
# llama.cpp's enum llama_pooling_type, by value ({arch}.pooling_type, --pooling)
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")


class ModelConfigError(UserError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    ctx_len: int  # context length the model was trained for
    norm_eps: float
    rope_base: float
    rope_dim: int  # rotated dims per head (== head_dim for llama)
    rope_scale: float  # linear position scaling factor (1.0 = none)
    file_type: str  # e.g. "MOSTLY_Q4_1"
    rope_neox: bool = False  # rotate halves (HF order), not adjacent pairs
    # attention scale applied to q; 0: 1/sqrt(head_dim)
    attn_scale: float = 0.0
    sliding_window: int = 0  # keys a sliding-window layer sees (0: no such layers)
    swa_layers: tuple[int, ...] = ()  # layers that use the sliding window
    rope_base_swa: float = 0.0  # rope base of the sliding-window layers (0: rope_base)
    attn_softcap: float = 0.0  # gemma2: scores -> c*tanh(scores/c) before the mask (0: off)
    final_softcap: float = 0.0  # gemma2: logits -> c*tanh(logits/c) (0: off)
    rope_attn_factor: float = 1.0  # phi3 LongRoPE: cos/sin scaled by it (llama.cpp attn_factor)
    rope_ctx_orig: int = 0  # phi3: contexts past it use the long rope factors (0: ctx_len)
    # how an embedding pools the hidden states when --pooling does not say: the file's
    # {arch}.pooling_type (an embedding model's, e.g. Qwen3-Embedding: last), else
    # llama.cpp's default for a model without the key, none
    pooling: str = "none"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "model") -> ModelConfig:
        """Every hyper-parameter is type- and range-checked here, so a hostile file
        fails with the key's name instead of NaN logits, a hang or a huge allocation
        later. Shapes are checked against the tensors in core.model.weights."""
        m = _Meta(meta, source)
        arch = m.text("general.architecture", None)
        if arch is None:
            raise ModelConfigError(f"{source}: no general.architecture key (not a model GGUF?)")
        if m.text("general.type", "") == "adapter":
            raise ModelConfigError(
                f"{source}: this is a LoRA adapter, not a base model; "
                "open a base model first and add it as an adapter"
            )
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"{source}: unsupported architecture {short_name(arch)} "
                f"(Mixdesk runs {', '.join(SUPPORTED_ARCHS)})"
            )
        a = f"{arch}."
        dim = m.integer(a + "embedding_length", hi=MAX_DIM)
        n_heads = m.integer(a + "attention.head_count", hi=MAX_HEADS)
        n_kv = m.integer(a + "attention.head_count_kv", n_heads, hi=n_heads)
        if n_heads % n_kv:
            raise ModelConfigError(
                f"{source}: {n_heads} heads ({a}attention.head_count) is not a multiple of "
                f"{n_kv} kv heads ({a}attention.head_count_kv)"
            )
        if a + "attention.key_length" not in meta and dim % n_heads:
            raise ModelConfigError(
                f"{source}: {a}embedding_length {dim} is not a multiple of "
                f"{a}attention.head_count {n_heads}"
            )
        head_dim = m.integer(a + "attention.key_length", dim // n_heads, hi=MAX_DIM)
        if head_dim % 2:
            raise ModelConfigError(
                f"{source}: head size {head_dim} ({a}attention.key_length) must be even for "
                "rotary embeddings"
            )
        tokens = meta.get("tokenizer.ggml.tokens", ())
        if a + "vocab_size" in meta:
            vocab = m.integer(a + "vocab_size", hi=MAX_VOCAB)
        elif isinstance(tokens, (list, tuple)) and tokens:
            vocab = len(tokens)
        else:
            raise ModelConfigError(
                f"{source}: no {a}vocab_size and no tokenizer.ggml.tokens list to count"
            )
        scaling = m.text(a + "rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ModelConfigError(
                f"{source}: unsupported rope scaling type {short_name(scaling)} ({a}rope.scaling.type)"
            )
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = m.number(a + "rope.scaling.factor", 1.0, lo=0.0, hi=MAX_ROPE_SCALE)
        ft = m.integer("general.file_type", -1, lo=-1, hi=2**32)
        try:
            ft_name = LlamaFileType(ft).name if ft >= 0 else "unknown"
        except ValueError:
            ft_name = f"type {ft}"
        rope_dim = m.integer(a + "rope.dimension_count", head_dim, hi=MAX_DIM)
        if rope_dim != head_dim:
            raise ModelConfigError(
                f"{source}: partial rotary embeddings ({rope_dim} of "
                f"{head_dim} dims) are not supported"
            )
        name = meta.get("general.name", source)
        extra = _family_params(arch, m, head_dim)
        return cls(
            arch=arch,
            name=name if isinstance(name, str) else source,
            n_layers=m.integer(a + "block_count", hi=MAX_LAYERS),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=m.integer(a + "feed_forward_length", hi=MAX_FFN),
            vocab_size=vocab,
            ctx_len=m.integer(a + "context_length", 2048, hi=MAX_CTX),
            norm_eps=m.number(a + "attention.layer_norm_rms_epsilon", 1e-5, lo=0.0, hi=1.0),
            rope_base=m.number(a + "rope.freq_base", 10000.0, lo=0.0, hi=MAX_ROPE_BASE),
            rope_dim=rope_dim,
            rope_scale=rope_scale,
            file_type=ft_name.removeprefix("MOSTLY_"),
            pooling=POOLING_TYPES[
                m.integer(a + "pooling_type", 0, lo=0, hi=len(POOLING_TYPES) - 1)
            ],
            **extra,
        )

    @property
    def scale(self) -> float:
        """What q is multiplied by before q·k (a Python float: an np.float64 would
        upcast q to float64)."""
        return float(self.attn_scale or 1.0 / math.sqrt(self.head_dim))


def _family_params(arch: str, m: _Meta, head_dim: int) -> dict[str, Any]:
    """The hyper-parameters beyond llama's, read as llama.cpp reads them."""
    out: dict[str, Any] = {"rope_neox": arch in NEOX_ROPE_ARCHS}
    if arch in ("gemma2", "gemma3"):
        a = arch + "."
        n_layers = m.integer(a + "block_count", hi=MAX_LAYERS)
        # llama.cpp scales q by 1/sqrt(n_embd_head_k) (query_pre_attn_scalar = head_dim)
        # except for the 27B models, recognised by their layer count, whose
        # query_pre_attn_scalar is embedding_length / head_count
        out["attn_scale"] = 1.0 / math.sqrt(head_dim)
        if n_layers == GEMMA_27B_LAYERS[arch]:
            dim = m.integer(a + "embedding_length", hi=MAX_DIM)
            out["attn_scale"] = 1.0 / math.sqrt(dim / m.integer(a + "attention.head_count"))
        default = GEMMA2_DEFAULT_WINDOW if arch == "gemma2" else 0
        window = m.integer(a + "attention.sliding_window", default, lo=0, hi=MAX_CTX)
        every = GEMMA2_GLOBAL_EVERY if arch == "gemma2" else GEMMA3_GLOBAL_EVERY
        out["sliding_window"] = window
        if window:
            out["swa_layers"] = tuple(i for i in range(n_layers) if i % every < every - 1)
    if arch == "gemma3":
        out["rope_base_swa"] = GEMMA3_LOCAL_ROPE_BASE
    if arch == "phi3":
        # llama.cpp ignores phi3's attention.sliding_window (its "Phi SWA is disabled")
        a = "phi3."
        out["rope_attn_factor"] = m.number(a + "rope.scaling.attn_factor", 1.0, 0.0, 1e3)
        out["rope_ctx_orig"] = m.integer(a + "rope.scaling.original_context_length", 0, 0, MAX_CTX)
    if arch == "gemma2":
        cap = (0.0, MAX_SOFTCAP)
        out["attn_softcap"] = m.number(a + "attn_logit_softcapping", 50.0, *cap)
        out["final_softcap"] = m.number(a + "final_logit_softcapping", 30.0, *cap)
    return out


# Upper bounds far above any real llama-family model: a value past one is a corrupt
# or hostile file (the shapes are checked against the tensors present anyway).
MAX_DIM = 1 << 16  # embedding_length, key_length
MAX_HEADS = 1 << 12
MAX_FFN = 1 << 20
MAX_VOCAB = 1 << 22
MAX_LAYERS = 1 << 12
MAX_CTX = 1 << 24  # 16M tokens
MAX_ROPE_BASE = 1e12
MAX_ROPE_SCALE = 1e4
MAX_SOFTCAP = 1e6

_REQUIRED = object()


class _Meta:
    """Typed, range-checked reads of GGUF metadata; every error names the key.
    A default is returned as is when the key is absent."""

    def __init__(self, meta: Mapping[str, Any], source: str):
        self.meta, self.source = meta, source

    def _bad(self, key: str, want: str, value: Any) -> ModelConfigError:
        got = describe_value(value)
        return ModelConfigError(f"{self.source}: {key} must be {want}, not {got}")

    def _missing(self, key: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: missing metadata key {key}")

    def integer(self, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = 1 << 31) -> int:
        """An integer in [lo, hi] (every count and size here must be at least 1)."""
        if key not in self.meta:
            if default is _REQUIRED:
                raise self._missing(key)
            return default
        v = self.meta[key]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise self._bad(key, "an integer", v)
        if not lo <= int(v) <= hi:
            raise self._bad(key, f"an integer from {lo} to {hi}", v)
        return int(v)

    def number(self, key: str, default: float, lo: float, hi: float) -> float:
        """A finite number in (lo, hi]: no NaN, no Inf, no zero or negative scale."""
        if key not in self.meta:
            return default
        v = self.meta[key]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise self._bad(key, "a number", v)
        if not (math.isfinite(v) and lo < v <= hi):
            raise self._bad(key, f"a finite number above {lo:g} and at most {hi:g}", v)
        return float(v)

    def text(self, key: str, default: Any) -> Any:
        if key not in self.meta:
            return default
        v = self.meta[key]
        if not isinstance(v, str):
            raise self._bad(key, "a string", v)
        return v


def describe_value(v: Any) -> str:
    """A metadata value for a message, never a dump of it."""
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (bool, np.bool_)):
        return "a boolean"
    if isinstance(v, (int, np.integer, float, np.floating)):
        if not math.isfinite(v):
            return str(float(v))  # nan / inf / -inf
        return str(v) if abs(v) < 1e12 else f"{float(v):.3g}"
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype.name}"
    if isinstance(v, (list, tuple)) and v:
        kind = "arrays" if isinstance(v[0], (list, np.ndarray)) else "strings"
        return f"an array of {kind}" if isinstance(v[0], (list, str, np.ndarray)) else "an array"
    return "an array" if isinstance(v, (list, tuple)) else "a value of another type"
