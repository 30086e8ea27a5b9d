"""Turn parsed command-line flags into a ready Engine (shared by every mode)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from .default_model import ensure_default_model
from .options import EngineOptions
from .serve.engine import Engine

log = logging.getLogger(__name__)


def limit_threads(n: int | None):
    """Honour -t/--threads for BLAS (threadpoolctl); returns the limiter to keep alive."""
    if not n:
        return None
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def startup_adapters(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(path, scale) of the adapters named on the command line, in order: --lora at 1,
    --lora-scaled at its scale; all at 0 with --lora-init-without-apply. The headless
    server and the window both load these at start."""
    zero = bool(getattr(args, "lora_init_without_apply", False))
    return [(str(p), 0.0 if zero else float(s)) for p, s in getattr(args, "adapters", None) or []]


def engine_from_args(
    args: argparse.Namespace,
    progress: Callable[[float, str], None] | None = None,
    say: Callable[[str], None] = print,
) -> Engine:
    """Load the model and the adapters named on the command line. Raises ValueError
    subclasses (ModelLoadError, AdapterError, ...) with a clear message."""
    eng = Engine(EngineOptions.from_args(args))  # the window builds its engine the same way
    path = Path(args.model) if args.model else ensure_default_model(log=say)
    eng.load_model(path, progress=progress)
    for fname, scale in startup_adapters(args):
        eng.add_adapter(fname, scale=scale)
    return eng
