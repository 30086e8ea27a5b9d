"""Engine options: built once, from the command line or from the window, one set of defaults.

``Engine(options)`` takes one :class:`EngineOptions`; the headless server and the
window both build it with ``EngineOptions.from_args(args)``, so a flag means the same
in both. (The window used to build its engine from ctx_size and n_parallel only:
--draft-max and --chat-template-file were silently ignored there.) The defaults the
parser, the HTTP settings and the window show are the constants below. This module
sits below core/serve (which imports it) and imports nothing from there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UserError
from .values import BIG, is_finite_number  # noqa: F401 (imported from here too)

if TYPE_CHECKING:  # core.cli imports this module: keep --help free of jinja2 and numpy
    from .chat_template import ChatDefaults

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_CTX = 4096  # -c/--ctx-size; 0: the model's training context
DEFAULT_PARALLEL = 4  # -np/--parallel: sequences batched at once
DEFAULT_DRAFT_MAX = 8  # bench: +43% tok/s on a copy task, +3% on chat, outputs identical
DEFAULT_UBATCH = 512  # -ub/--ubatch-size: prompt tokens per step, the most of one embedding input
DEFAULT_BATCH = 2048  # -b/--batch-size: llama-server's; the physical batch is at most this
# the prefix cache: bytes of finished prompts' KV kept for reuse (core/serve/prefix_cache.py)
DEFAULT_PREFIX_CACHE_BYTES = 512 << 20
WEIGHT_STORAGES = ("quantized", "f32")  # how a model's matrices are held (core/model/weights.py)
# --activations: what quantized weights' decode-sized products multiply by: "f32",
# float32 activations (the default: the numbers of dequantize-then-matmul), or "q8",
# activations rounded to int8 (per 256 for the K-quants, per 32 for Q8_0/Q4_0/Q4_1)
# times the integer quants on VNNI, as llama.cpp does (core/model/kernel_q8.py)
ACTIVATION_MODES = ("f32", "q8")
# -ctk/-ctv (--cache-type-k/-v): how the KV cache stores keys and values. "f32" (the
# default: the numbers llama.cpp's reference data were recorded with) or "f16", half the
# memory and half the bytes a long context's attention reads (llama-server's default),
# keys and values rounded to float16 as llama.cpp's f16 cache rounds them
KV_CACHE_TYPES = ("f32", "f16")


def kv_type_problem(flag_: str, value: str) -> str | None:
    """Why ``value`` cannot be the KV cache's type given by ``flag_`` (-ctk/-ctv), or None:
    the one wording the CLI (a usage error) and EngineOptions (OptionsError) refuse with."""
    if value in KV_CACHE_TYPES:
        return None
    return f"{flag_} {value}: not supported; the KV cache holds {' or '.join(KV_CACHE_TYPES)}"


class OptionsError(UserError):
    """An option that cannot be used (an unreadable --chat-template-file)."""


def flag(args: argparse.Namespace, name: str, default: Any) -> Any:
    """A parsed flag's value, or ``default`` when the namespace lacks it or holds None
    (tests and tools pass namespaces with only the flags they care about)."""
    value = getattr(args, name, None)
    return default if value is None else value


@dataclass(frozen=True)
class EmbeddingOptions:
    """--embedding, --pooling, --ubatch-size: what /embedding and /v1/embeddings do."""

    enabled: bool = False  # /embedding, /v1/embeddings answer 501 without it
    pooling: str | None = None  # None: the model's own (ModelConfig.pooling)
    # the physical batch, min(-b, -ub): prompt tokens per sequence per step, and the
    # most tokens of one embedding input
    ubatch: int = DEFAULT_UBATCH

    def pooling_for(self, cfg) -> str:
        return self.pooling or cfg.pooling


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    ctx_size: int = DEFAULT_CTX  # per sequence; 0: the model's training context
    n_parallel: int = DEFAULT_PARALLEL
    draft_max: int = DEFAULT_DRAFT_MAX  # prompt-lookup drafts per step (0: off)
    threads: int | None = None  # compute threads (None: the BLAS thread count)
    chat_template: str | None = None  # template source replacing every model's own
    chat_defaults: ChatDefaults | None = None  # None: chat_template.DEFAULT_CHAT
    embeddings: EmbeddingOptions = EmbeddingOptions()
    context_shift: bool = False  # --context-shift: a full context drops old tokens
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    # --weights: "quantized" keeps the GGUF's blocks in memory (compiled kernels), "f32"
    # dequantizes every matrix to float32 (core/model/weights.py)
    weights: str = "quantized"
    activations: str = "f32"  # --activations: one of ACTIVATION_MODES
    # --mmap: quantized weights served from the model file's memory map instead of read
    # into memory (core/model/weights.py: slower decoding; pages the OS may drop)
    mmap: bool = False
    cache_type_k: str = "f32"  # -ctk: one of KV_CACHE_TYPES
    cache_type_v: str = "f32"  # -ctv
    # --control-vector / --control-vector-scaled: (file, scale) loaded with the first
    # model, in order; --control-vector-layer-range START END (<= 0: llama.cpp's
    # default, layers 1 .. the last), for every vector
    control_vectors: tuple[tuple[str, float], ...] = ()
    control_vector_layer_range: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_STORAGES:
            raise OptionsError(
                f"--weights must be one of {', '.join(WEIGHT_STORAGES)}, not {self.weights!r}"
            )
        if self.activations not in ACTIVATION_MODES:
            raise OptionsError(
                f"--activations must be one of {', '.join(ACTIVATION_MODES)}, "
                f"not {self.activations!r}"
            )
        for flag_, value in (("-ctk", self.cache_type_k), ("-ctv", self.cache_type_v)):
            if problem := kv_type_problem(flag_, value):
                raise OptionsError(problem)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """From main.py's parsed flags (core/cli.py); flags a caller's namespace lacks
        keep their defaults. --chat-template-file wins over --chat-template."""
        from .chat_template import DEFAULT_CHAT, ChatDefaults

        template = flag(args, "chat_template", None)  # a built-in's or an inline source
        if flag(args, "chat_template_file", None):
            p = Path(args.chat_template_file)
            try:
                template = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise OptionsError(
                    f"--chat-template-file: cannot read {p}: {getattr(e, 'strerror', None) or e}"
                ) from None
        return cls(
            ctx_size=flag(args, "ctx_size", DEFAULT_CTX),
            n_parallel=flag(args, "parallel", DEFAULT_PARALLEL),
            draft_max=flag(args, "draft_max", DEFAULT_DRAFT_MAX),
            threads=flag(args, "threads", None),
            chat_template=template,
            chat_defaults=ChatDefaults(
                reasoning=flag(args, "reasoning", DEFAULT_CHAT.reasoning),
                template_kwargs=flag(args, "chat_template_kwargs", None) or {},
                prefill_assistant=flag(args, "prefill_assistant", DEFAULT_CHAT.prefill_assistant),
            ),
            embeddings=EmbeddingOptions(
                enabled=bool(flag(args, "embedding", False)),
                pooling=flag(args, "pooling", None),
                # llama.cpp's physical batch is min(-b, -ub); an embedding input runs in one
                ubatch=min(
                    flag(args, "batch_size", DEFAULT_BATCH),
                    flag(args, "ubatch_size", DEFAULT_UBATCH),
                ),
            ),
            context_shift=bool(flag(args, "context_shift", False)),
            weights=flag(args, "weights", "quantized"),
            activations=flag(args, "activations", "f32"),
            mmap=bool(flag(args, "mmap", False)),
            cache_type_k=flag(args, "cache_type_k", "f32"),
            cache_type_v=flag(args, "cache_type_v", "f32"),
            control_vectors=tuple(flag(args, "control_vectors", None) or ()),
            control_vector_layer_range=tuple(
                flag(args, "control_vector_layer_range", None) or (-1, -1)
            ),
        )
