"""The mixing desk's rule, without Qt: faders + mute + solo + bypass -> the engine mix.

One place for it: the mixer's live mix, a preset's mix (A/B compare), and so
what is exported (the engine's global mix, which the mixer sets from this).

* bypass: every adapter at 0 (the base model);
* any strip soloed: only the soloed strips sound;
* a muted strip is at 0, soloed or not;
* otherwise a strip sounds at its fader's value;
* the mix combines its adapters by the desk's merge method (core/lora/merge.py):
  linear unless chosen, with only the parameters that method uses;
* control vectors are channels too: a strip keyed :class:`VecKey` (the vector's id)
  follows the same rule (its solo silences adapters, an adapter's solo silences it)
  and goes to the Mix's ``vectors``, not to its adapter scales.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from core.errors import UserError
from core.lora import merge as M
from core.lora.merge import LINEAR, MergeSpec
from core.lora.mix import Mix, SteeredKey, mix_text

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class VecKey:
    """A control vector's strip key (its engine id), never equal to an adapter's int."""

    id: int


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


def desk_mix(
    channels: Mapping[K, Channel], bypass: bool = False, merge: MergeSpec | None = None
) -> Mix:
    """{key: engine scale} for every adapter strip (a dict), carrying the desk's merge
    method and, when the desk has vector strips, ``vectors`` {vector id: scale} (every
    one, 0 included: the mix then says which vectors steer, not the engine's globals)."""
    soloing = any(c.solo for c in channels.values())
    heard = {k: c.scale if sounds(c, soloing, bypass) else 0.0 for k, c in channels.items()}
    vectors = {k.id: s for k, s in heard.items() if isinstance(k, VecKey)}
    return Mix(
        {k: s for k, s in heard.items() if not isinstance(k, VecKey)},
        merge or LINEAR,
        vectors=vectors or None,
    )


def flat(mix: Mapping[Any, float]) -> dict:
    """A mix as {strip key: scale}: its adapters by id, its vectors (if it names any)
    by :class:`VecKey`, so one lookup serves every strip."""
    out = dict(mix)
    out.update({VecKey(v): s for v, s in (getattr(mix, "vectors", None) or {}).items()})
    return out


def merge_fields(method: str) -> set[str]:
    """The parameters the desk shows for a method: density where it trims or drops, rank
    where a merged adapter is built, seed where the drop is random."""
    shown = set()
    if method in M.DENSITY_METHODS:
        shown.add("density")
    if method not in M.STACKED_METHODS:
        shown.add("rank")
    if method in M.RANDOM_METHODS:
        shown.add("seed")
    return shown


def desk_merge(method: str, density: float, rank: int, seed: int) -> MergeSpec:
    """The desk's fields as a MergeSpec: rank 0 is "auto" (Σ ranks, at most 64)."""
    return MergeSpec.make(method, density=density, rank=rank or None, seed=seed)


def saved_merge(entry: Mapping[str, Any] | None) -> MergeSpec:
    """A preset's or saved desk's "merge"; none (saved before merge methods) or one that
    no longer parses: linear."""
    try:
        return MergeSpec.from_dict(dict(entry)) if entry else LINEAR
    except UserError:
        return LINEAR


def silenced(channels: Mapping[K, Channel], bypass: bool = False) -> set[K]:
    """Strips that the desk's buttons keep silent (muted, left out by solo, bypassed)."""
    soloing = any(c.solo for c in channels.values())
    return {k for k, c in channels.items() if not sounds(c, soloing, bypass)}


def mix_vectors(mix: Any) -> dict[int, float] | None:
    """The vectors a mix names: a Mix's ``vectors``, a steered mix key's (what a reply
    ran with), {} for a key that steers nothing; None for a mix that does not say."""
    if isinstance(mix, SteeredKey):
        return dict(mix.steer)
    if isinstance(mix, tuple):  # a key without vectors: it ran unsteered
        return {}
    return getattr(mix, "vectors", None)


def key_mix(key: Any) -> Mix:
    """A mix key a reply ran with (DoneEvent.mix) as a Mix to run or score again: its
    adapters, method and vectors (a key without vectors: none, not the globals)."""
    scales = key.lora_key() if isinstance(key, SteeredKey) else key
    return Mix(dict(scales), getattr(key, "merge", None), vectors=mix_vectors(key))


def mix_label(mix: Any, names: Mapping) -> str:
    """mix_text (core/lora/mix.py) with the mix's vectors after its adapters:
    "pirate ×0.50 + vec calm ×0.80"; ``names`` by strip key (ui/desk.py)."""
    text = mix_text(mix, {k: n for k, n in names.items() if not isinstance(k, VecKey)})
    vectors = mix_vectors(mix) or {}
    parts = [
        f"{names.get(VecKey(v), f'#{v}')} ×{float(s):.2f}"
        for v, s in sorted(vectors.items())
        if float(s) != 0.0
    ]
    if not parts:
        return text
    steer = "vec " + ", ".join(parts)
    return steer if text == mix_text({}, {}) else f"{text} + {steer}"
