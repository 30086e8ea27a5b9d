"""One config dataclass for a llama-family model, built from GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf.constants import LlamaFileType

from .errors import UserError

SUPPORTED_ARCHS = ("llama",)  # Mistral-style and Llama 3.x models also say "llama"


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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "model") -> ModelConfig:
        arch = meta.get("general.architecture")
        if arch is None:
            raise ModelConfigError(f"{source}: no general.architecture key (not a model GGUF?)")
        if meta.get("general.type") == "adapter":
            raise ModelConfigError(
                f"{source}: this is a LoRA adapter, not a base model; "
                "open a base model first and add it as an adapter"
            )
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"{source}: unsupported architecture {arch!r} "
                f"(Mixdesk runs {', '.join(SUPPORTED_ARCHS)})"
            )

        def req(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ModelConfigError(f"{source}: missing metadata key {full}")
            return meta[full]

        dim = int(req("embedding_length"))
        n_heads = int(req("attention.head_count"))
        n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", dim // n_heads))
        if n_heads % n_kv:
            raise ModelConfigError(
                f"{source}: {n_heads} heads is not a multiple of {n_kv} kv heads"
            )
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ModelConfigError(f"{source}: unsupported rope scaling type {scaling!r}")
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) or 1.0
        ft = meta.get("general.file_type")
        try:
            ft_name = LlamaFileType(int(ft)).name if ft is not None else "unknown"
        except ValueError:
            ft_name = f"type {ft}"
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelConfigError(
                f"{source}: partial rotary embeddings ({rope_dim} of "
                f"{head_dim} dims) are not supported"
            )
        return cls(
            arch=arch,
            name=str(meta.get("general.name", source)),
            n_layers=int(req("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=int(req("feed_forward_length")),
            vocab_size=int(vocab),
            ctx_len=int(meta.get(f"{arch}.context_length", 2048)),
            norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=rope_dim,
            rope_scale=rope_scale,
            file_type=ft_name.removeprefix("MOSTLY_"),
        )
