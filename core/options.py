"""Engine options: built once, from the command line or from the window, one set of defaults.

The headless server and the window both make their engine with
``EngineOptions.from_args(args).engine()``, so a flag means the same in both.
(The window used to build its engine from ctx_size and n_parallel only: --draft-max
and --chat-template-file were silently ignored there.) The defaults the parser,
the HTTP settings and the window show are the constants below, and the one check
for "a finite number" that the engine, sampling and exports apply is
:func:`is_finite_number`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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


class OptionsError(UserError):
    """An option that cannot be used (an unreadable --chat-template-file)."""


@dataclass(frozen=True)
class EngineOptions:
    ctx_size: int = DEFAULT_CTX
    n_parallel: int = DEFAULT_PARALLEL
    draft_max: int = DEFAULT_DRAFT_MAX  # prompt-lookup drafts per step (0: off)
    threads: int | None = None  # compute threads (None: the BLAS thread count)
    chat_template: str | None = None  # template source replacing every model's own
    chat_defaults: ChatDefaults | None = None  # None: chat_template.DEFAULT_CHAT
    embedding: bool = False  # --embedding: serve /embedding and /v1/embeddings
    pooling: str | None = None  # --pooling; None: the model's own (else none)
    # the physical batch, min(-b, -ub): prompt tokens per sequence per step, and the
    # most tokens of one embedding input
    ubatch_size: int = DEFAULT_UBATCH
    context_shift: bool = False  # --context-shift: a full context drops old tokens

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """From main.py's parsed flags (core/cli.py); flags a caller's namespace lacks
        keep their defaults. --chat-template-file wins over --chat-template."""
        from .chat_template import DEFAULT_CHAT, ChatDefaults

        get = lambda name, default: (
            default if getattr(args, name, None) is None else getattr(args, name)
        )
        template = get("chat_template", None)  # a built-in's or an inline source (cli.py)
        if get("chat_template_file", None):
            p = Path(args.chat_template_file)
            try:
                template = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise OptionsError(
                    f"--chat-template-file: cannot read {p}: {getattr(e, 'strerror', None) or e}"
                ) from None
        return cls(
            ctx_size=get("ctx_size", DEFAULT_CTX),
            n_parallel=get("parallel", DEFAULT_PARALLEL),
            draft_max=get("draft_max", DEFAULT_DRAFT_MAX),
            threads=get("threads", None),
            chat_template=template,
            chat_defaults=ChatDefaults(
                reasoning=get("reasoning", DEFAULT_CHAT.reasoning),
                template_kwargs=get("chat_template_kwargs", None) or {},
                prefill_assistant=get("prefill_assistant", DEFAULT_CHAT.prefill_assistant),
            ),
            embedding=bool(get("embedding", False)),
            pooling=get("pooling", None),
            # llama.cpp's physical batch is min(-b, -ub); an embedding input runs in one
            ubatch_size=min(get("batch_size", DEFAULT_BATCH), get("ubatch_size", DEFAULT_UBATCH)),
            context_shift=bool(get("context_shift", False)),
        )

    @staticmethod
    def sampling(args: argparse.Namespace):
        """The sampling flags (--temp, --seed, --top-k, ..., -n) as the SamplingParams
        every request starts from: -p uses them, and an HTTP request's fields override
        them one by one, as llama-server's defaults. Raises SamplingError (a UserError)
        naming a value out of range."""
        from .serve.sampling import SamplingParams, validate

        d = SamplingParams()  # the one home of the defaults (llama-server's)
        get = lambda name, default: (
            default if getattr(args, name, None) is None else getattr(args, name)
        )
        seed = get("seed", -1)
        return validate(
            SamplingParams(
                temperature=get("temp", d.temperature),
                top_k=get("top_k", d.top_k),
                top_p=get("top_p", d.top_p),
                min_p=get("min_p", d.min_p),
                repeat_penalty=get("repeat_penalty", d.repeat_penalty),
                repeat_last_n=get("repeat_last_n", d.repeat_last_n),
                presence_penalty=get("presence_penalty", d.presence_penalty),
                frequency_penalty=get("frequency_penalty", d.frequency_penalty),
                seed=None if seed < 0 else seed,
                n_predict=get("n_predict", d.n_predict),
                ignore_eos=bool(get("ignore_eos", d.ignore_eos)),
            )
        )

    def engine(self):
        """An Engine with these options, no model loaded yet."""
        from .chat_template import DEFAULT_CHAT
        from .serve.embeddings import EmbeddingOptions
        from .serve.engine import Engine

        return Engine(
            ctx_size=self.ctx_size,
            n_parallel=self.n_parallel,
            draft_max=self.draft_max,
            threads=self.threads,
            chat_template=self.chat_template,
            chat_defaults=self.chat_defaults or DEFAULT_CHAT,
            embeddings=EmbeddingOptions(self.embedding, self.pooling, self.ubatch_size),
            context_shift=self.context_shift,
        )
