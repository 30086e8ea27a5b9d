"""Activated LoRA (aLoRA): an adapter that is off until its invocation sequence appears
in the prompt, and on from there, as llama-server runs it (llama.cpp PR #15327).

An aLoRA carries ``invocation_tokens`` (GGUF ``adapter.alora.invocation_tokens``; PEFT
``alora_invocation_tokens``). llama-server's rule, which this module states once:

* it applies only when every adapter of the request's mix with a non-zero scale is an
  aLoRA, and then exactly one may be (more is an error);
* the invocation sequence is searched from the end of the prompt: its last occurrence
  starts at token ``start``. Not found, the request runs on the base model;
* prompt positions before ``start - 1`` run without the adapter, so their keys and
  values are the base model's and the prefix cache shares them with base requests;
  from ``start - 1`` on (llama-server switches one token early) and for every
  generated token, the adapter is on.

A mix with a plain LoRA beside the aLoRA runs the aLoRA as a plain LoRA from the first
token, as llama-server does. Control vectors in the mix steer every position (llama-server's
are global): the positions off the aLoRA run under the vectors alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..errors import EngineError
from .adapter import Adapter

MULTIPLE = "Cannot run multiple aLoRAs in a single request"  # llama-server's words


def invocation_start(prompt: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Where the last occurrence of ``invocation`` starts in ``prompt``, or None."""
    n = len(invocation)
    if not n:
        return None
    for i in range(len(prompt) - n, -1, -1):
        if list(prompt[i : i + n]) == list(invocation):
            return i
    return None


def alora_of(pairs: Iterable[tuple[int, float]], adapters: Mapping[int, Adapter]) -> Adapter | None:
    """The aLoRA a mix's (id, scale) pairs run under llama-server's rule: None when some
    non-zero adapter is a plain LoRA (or there is none); EngineError when several are
    aLoRAs."""
    used = [adapters[aid] for aid, s in pairs if s != 0.0 and aid in adapters]
    if not used or any(not ad.invocation_tokens for ad in used):
        return None
    if len(used) > 1:
        raise EngineError(MULTIPLE)
    return used[0]


def base_positions(alora: Adapter, prompt: Sequence[int]) -> int | None:
    """How many leading prompt positions run without ``alora``: ``start - 1`` (at least
    0), or None when the prompt never invokes it (the request runs on the base)."""
    start = invocation_start(prompt, alora.invocation_tokens)
    return None if start is None else max(start - 1, 0)
