"""Finished sequences' KV caches, reusable by a later request with the same mix.

Entries are keyed by (mix key, tokens). A lookup only considers entries whose
mix key is identical, so a cache built under one mix is never served to another
(llama.cpp #26207). Zero-scale adapters are not part of a mix key, so they do
not split the cache. Memory is bounded by an LRU on the bytes actually used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..lora.mix import MixKey
from ..model.kv_cache import KVCache


@dataclass
class _Entry:
    key: MixKey
    cache: KVCache

    @property
    def used_bytes(self) -> int:
        per_pos = self.cache.nbytes // max(self.cache.capacity, 1)
        return per_pos * self.cache.length


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def take(
        self, key: MixKey, prompt: list[int], limit: int | None = None
    ) -> tuple[KVCache | None, int]:
        """Remove and return the entry sharing the longest prefix with ``prompt``
        under exactly this mix, and how many tokens of it are usable (at most
        ``limit``). At least the last prompt token is always recomputed, since its
        logits are needed."""
        best, best_n = None, 0
        cap = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        with self._lock:
            for eid, e in self._entries.items():
                if e.key != key:
                    continue
                n = min(common_prefix(e.cache.tokens, prompt), cap)
                if n > best_n:
                    best, best_n = eid, n
            if best is None:
                self.misses += 1
                return None, 0
            self.hits += 1
            entry = self._entries.pop(best)
        entry.cache.trim(entry.cache.length - best_n)
        return entry.cache, best_n

    def put(self, key: MixKey, cache: KVCache) -> None:
        if cache.length == 0:
            return
        with self._lock:
            self._entries[self._next] = _Entry(key, cache)
            self._next += 1
            total = sum(e.used_bytes for e in self._entries.values())
            while total > self.max_bytes and self._entries:
                _, old = self._entries.popitem(last=False)
                total -= old.used_bytes

    def forget_adapter(self, aid: int) -> None:
        with self._lock:
            for eid in [i for i, e in self._entries.items() if any(a == aid for a, _ in e.key)]:
                del self._entries[eid]

    def forget_slot(self, slot: int) -> None:
        """Drop the entries copied from one pool slot (a slot erase)."""
        with self._lock:
            for eid in [i for i, e in self._entries.items() if e.cache.origin[0] == slot]:
                del self._entries[eid]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    @property
    def n_entries(self) -> int:
        return len(self._entries)
