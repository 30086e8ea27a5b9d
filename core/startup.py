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


def engine_from_args(
    args: argparse.Namespace,
    progress: Callable[[float, str], None] | None = None,
    say: Callable[[str], None] = print,
) -> Engine:
    """Load the model and the adapters named on the command line. Raises ValueError
    subclasses (ModelLoadError, AdapterError, ...) with a clear message."""
    eng = EngineOptions.from_args(args).engine()  # the window builds its engine the same way
    path = Path(args.model) if args.model else ensure_default_model(log=say)
    eng.load_model(path, progress=progress)
    for fname, scale in getattr(args, "adapters", []):
        eng.add_adapter(fname, scale=0.0 if args.lora_init_without_apply else scale)
    return eng
