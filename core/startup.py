"""Turn parsed command-line flags into a ready Engine (shared by every mode)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from .chat_template import ChatDefaults
from .default_model import ensure_default_model
from .serve.engine import Engine

log = logging.getLogger(__name__)


def limit_threads(n: int | None):
    """Honour -t/--threads for BLAS (threadpoolctl); returns the limiter to keep alive."""
    if not n:
        return None
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def engine_from_args(
    args: argparse.Namespace,
    progress: Callable[[float, str], None] | None = None,
    say: Callable[[str], None] = print,
) -> Engine:
    """Load the model and the adapters named on the command line. Raises ValueError
    subclasses (ModelLoadError, AdapterError, ...) with a clear message."""
    path = Path(args.model) if args.model else ensure_default_model(log=say)
    eng = Engine(
        ctx_size=args.ctx_size or 0,
        n_parallel=args.parallel,
        draft_max=getattr(args, "draft_max", 8),
        threads=getattr(args, "threads", None),
    )
    eng.load_model(path, progress=progress)
    if getattr(args, "chat_template_file", None):
        src = Path(args.chat_template_file).read_text(encoding="utf-8")
        eng.chat_template = eng.chat_template.with_source(src)
    elif getattr(args, "chat_template", None):  # a built-in's or an inline source (cli.py)
        eng.chat_template = eng.chat_template.with_source(args.chat_template)
    eng.chat_defaults = ChatDefaults(
        reasoning=getattr(args, "reasoning", "auto"),
        template_kwargs=getattr(args, "chat_template_kwargs", None) or {},
        prefill_assistant=getattr(args, "prefill_assistant", True),
    )
    for fname, scale in getattr(args, "adapters", []):
        eng.add_adapter(fname, scale=0.0 if args.lora_init_without_apply else scale)
    return eng
