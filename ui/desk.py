"""The mixing desk's rule, without Qt: faders + mute + solo + bypass -> the engine mix.

One place for it: the mixer's live mix, a preset's mix (A/B compare), and so
what is exported (the engine's global mix, which the mixer sets from this).

* bypass: every adapter at 0 (the base model);
* any strip soloed: only the soloed strips sound;
* a muted strip is at 0, soloed or not;
* otherwise a strip sounds at its fader's value.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Channel:
    """One strip: its fader value and its buttons."""

    scale: float = 0.0
    muted: bool = False
    solo: bool = False

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any] | None) -> Channel:
        """From a saved desk or preset entry ({"scale", "muted", "solo"}); none: silent."""
        entry = entry or {}
        return cls(
            float(entry.get("scale", 0.0)), bool(entry.get("muted")), bool(entry.get("solo"))
        )


def sounds(channel: Channel, soloing: bool, bypass: bool) -> bool:
    """Whether a strip is heard (a strip that is not is dimmed on the desk)."""
    return not bypass and not channel.muted and (channel.solo or not soloing)


def desk_mix(channels: Mapping[K, Channel], bypass: bool = False) -> dict[K, float]:
    """{key: engine scale} for every strip."""
    soloing = any(c.solo for c in channels.values())
    return {k: c.scale if sounds(c, soloing, bypass) else 0.0 for k, c in channels.items()}


def silenced(channels: Mapping[K, Channel], bypass: bool = False) -> set[K]:
    """Strips that the desk's buttons keep silent (muted, left out by solo, bypassed)."""
    soloing = any(c.solo for c in channels.values())
    return {k for k, c in channels.items() if not sounds(c, soloing, bypass)}
