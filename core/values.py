"""Checks and renderings of one value from a user, a client or a file: the bottom of
the layers (it imports nothing of Mixdesk), so the engine, the LoRA registry, sampling
and the options all apply the same "finite number" rule and show values the same way."""

from __future__ import annotations

import math
from typing import Any

BIG = 1e300  # past this an int overflows math.isfinite() itself


def is_finite_number(value: Any, limit: float = BIG) -> bool:
    """An int or float (not a bool), finite, with ``|value| <= limit``."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and abs(value) <= limit  # before isfinite(): a huge int would overflow it
        and math.isfinite(value)
    )


def shown(v: Any, limit: int = 32) -> str:
    """A value for an error message: its repr, cut short (a JSON int may have 400 digits)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."
