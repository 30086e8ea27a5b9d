"""KV caches, preallocated once and owned by the caller (not the model).

A standalone KVCache holds one sequence (the prefix cache keeps these). The
scheduler's running sequences live in a KVPool: one pair of arrays with a slot
per sequence, so the model can attend for every decoding sequence with one
batched matmul instead of a Python loop over sequences.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..memory import anonymous
from ..options import KV_CACHE_TYPES
from .config import ModelConfig

# what each of core/options.py's KV_CACHE_TYPES (-ctk/-ctv) stores keys or values as
KV_DTYPES = {name: np.dtype(f"float{name[1:]}") for name in KV_CACHE_TYPES}
KVTypes = tuple[str, str]  # (keys, values): names in KV_CACHE_TYPES
F32: KVTypes = ("f32", "f32")


def kernel_view(a: np.ndarray) -> np.ndarray:
    """Stored keys or values as the compiled decoding attention takes them: float16 as
    its bits (a uint16 view; numba has no float16 on the CPU), float32 as is."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


class ContextOverflow(UserError):
    pass


def kv_bytes(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    ctx: int,
    n_seq: int = 1,
    types: KVTypes = F32,
) -> int:
    """Bytes of keys and values (stored as ``types``, -ctk/-ctv) for n_seq sequences of
    ctx positions: the one formula behind every RAM figure Mixdesk shows (the model
    bar, Get a model, the catalogue), as pages a sequence has written (a pool's
    untouched pages cost none)."""
    per_value = sum(KV_DTYPES[t].itemsize for t in types)  # a key's and a value's bytes
    return n_layers * n_kv_heads * head_dim * per_value * ctx * n_seq


def ram_bytes(
    weight_bytes: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    ctx: int,
    n_seq: int = 1,
    types: KVTypes = F32,
) -> int:
    """RAM to run a model, as every figure Mixdesk shows counts it: the weights as held
    (a GGUF's tensors in their own blocks, or float32 under --weights f32) plus the
    keys and values of n_seq sequences at ctx positions (``kv_bytes``)."""
    return weight_bytes + kv_bytes(n_layers, n_kv_heads, head_dim, ctx, n_seq, types)


class KVCache:
    """Keys/values of one sequence for every layer, written only through its methods.

    ``k``/``v`` are (n_layers, n_kv_heads, capacity, head_dim) arrays (own arrays, or
    views of a pool slot) of float32, or float16 under -ctk/-ctv f16 (``types``): what
    is stored is rounded so, and every reader widens it back to float32. ``tokens``
    lists the token ids whose keys are stored, which is what the prefix cache matches
    on.

    The forward pass appends with one call per layer, ``update_and_fetch`` (mlx-lm's
    shape): it stores the layer's new keys/values after the cached ones and returns
    the layer's keys/values so far; the new tokens join ``tokens`` when the last
    layer's are stored, so a forward that fails half-way leaves the sequence as it
    was. ``trim`` drops tokens from the end; ``state``/``from_state`` copy a sequence
    out and back (slot save and restore, the prefix cache).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        capacity: int,
        _kv: tuple | None = None,
        pool: KVPool | None = None,
        slot: int = -1,
        types: KVTypes = F32,
    ):
        if _kv is None:
            # np.empty: untouched capacity costs no RSS
            shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
            _kv = tuple(np.empty(shape, dtype=KV_DTYPES[t]) for t in types)
        self.k, self.v = _kv  # (L, n_kv, cap, hd) each
        self.types = types
        self.capacity = capacity
        self.pool, self.slot = pool, slot
        self.origin: tuple[int, int] = (-1, -1)  # prefix-cache copies: (pool slot, generation)
        self.tokens: list[int] = []
        # positions ever written (high-water mark, kept across trims): what
        # KVPool.scrub must clear; trimmed positions keep their old rows
        self.written = 0

    @classmethod
    def from_state(
        cls,
        cfg: ModelConfig,
        tokens: list[int],
        k: np.ndarray,
        v: np.ndarray,
        capacity: int | None = None,
        origin: tuple[int, int] = (-1, -1),
        types: KVTypes = F32,
    ) -> KVCache:
        """A standalone cache holding ``tokens`` with keys/values (L, n_kv, n, hd)
        (a restored slot, a prefix-cache copy), stored as ``types``; ``origin``: the
        pool slot and its generation they came from, whose rows may still hold them."""
        n = len(tokens)
        cache = cls(cfg, max(n, capacity or n), types=types)
        cache.k[:, :, :n] = k  # (L, n_kv, n, hd)
        cache.v[:, :, :n] = v
        cache.tokens = [int(t) for t in tokens]
        cache.written = n
        cache.origin = origin
        return cache

    @property
    def state(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(tokens, keys, values): copies of what the cache holds, (L, n_kv, n, hd) each."""
        n = self.length
        return list(self.tokens), self.k[:, :, :n].copy(), self.v[:, :, :n].copy()

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ContextOverflow(
                f"context overflow: {self.length + n_new} tokens do not fit "
                f"in a context of {self.capacity}"
            )

    def update_and_fetch(
        self, li: int, k: np.ndarray, v: np.ndarray, tokens
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store layer li's keys/values (n, n_kv, hd) of the n new ``tokens`` at the
        positions after the cached ones; return the layer's keys and values up to and
        including them, (n_kv, length+n, hd) views. Storing the last layer's makes the
        tokens part of the cache. ContextOverflow when they do not fit."""
        n, p0 = k.shape[0], self.length
        if li == 0:
            self.check_room(n)
            self.written = max(self.written, p0 + n)  # from now on, see ``written``
        if n == 1:
            self.k[li, :, p0] = k[0]  # (n_kv, hd)
            self.v[li, :, p0] = v[0]
        else:
            self.k[li, :, p0 : p0 + n] = k.transpose(1, 0, 2)  # (n_kv, n, hd)
            self.v[li, :, p0 : p0 + n] = v.transpose(1, 0, 2)
        if li == self.k.shape[0] - 1:
            self.tokens.extend(int(t) for t in tokens)
        return self.k[li, :, : p0 + n], self.v[li, :, : p0 + n]  # (n_kv, p0+n, hd) views

    def layer(self, li: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer li's whole key and value arrays, (1, n_kv, capacity, hd) each: what the
        compiled decoding attention reads, as slot 0, up to the length it is given."""
        return self.k[li][None], self.v[li][None]  # (1, n_kv, cap, hd) views

    def trim(self, n: int) -> list[int]:
        """Drop the last n tokens (their rows are simply overwritten later); returns them,
        for ``untrim``."""
        n = max(0, min(n, self.length))
        dropped = self.tokens[self.length - n :]
        del self.tokens[self.length - n :]
        return dropped

    def untrim(self, tokens: list[int]) -> None:
        """Take back tokens just trimmed whose rows were not written since (speculative
        decoding verifies a draft one token at a time after trimming it)."""
        if self.length + len(tokens) > self.written:
            raise ValueError("untrim: these positions hold no keys/values")
        self.tokens.extend(tokens)

    def copy_prefix_from(self, other: KVCache, n: int) -> None:
        """Take the first n positions of another cache (used to share cached prefixes)."""
        self.k[:, :, :n] = other.k[:, :, :n]
        self.v[:, :, :n] = other.v[:, :, :n]
        self.tokens = list(other.tokens[:n])
        self.written = max(self.written, n)


class KVPool:
    """``n_slots`` caches of one capacity in one pair of (L, slots, n_kv, cap, hd) arrays.

    Zero-filled, though nothing reads a position before a sequence writes it (the
    decoding attention reads each slot only up to its own length). The arrays live
    in anonymous mmaps with transparent huge pages refused: the OS then zero-fills
    4 KB pages on first touch, so RSS follows the positions actually used. (numpy's
    own allocator asks for huge pages, and 2 MB pages would make the whole pool
    resident at once: each (layer, slot, head) run of positions starts on one.)
    """

    def __init__(self, cfg: ModelConfig, n_slots: int, capacity: int, types: KVTypes = F32):
        self.cfg = cfg
        shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k, self.v = (_zero_pages(shape, KV_DTYPES[t]) for t in types)
        self.capacity = capacity
        self.types = types
        self._caches = [
            KVCache(cfg, capacity, (self.k[:, i], self.v[:, i]), self, i, types)
            for i in range(n_slots)
        ]
        # Free slots, least recently released first: a released slot keeps its keys
        # and values until it is handed out again, so handing out the oldest one
        # first keeps a just-finished sequence's KV in place for as long as possible.
        self._free = list(range(n_slots))
        self._gen = [0] * n_slots  # bumped on every acquire of the slot
        # per free slot, the tokens whose keys/values its rows still hold (what the
        # sequence that released it left): what /slots shows and a slot save writes
        self._resident: list[list[int]] = [[] for _ in range(n_slots)]

    @property
    def n_slots(self) -> int:
        return len(self._caches)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def acquire(self, prefer: int = -1) -> KVCache:
        """A free slot: ``prefer`` when it is free (a request's ``id_slot``), else the
        one released longest ago."""
        if not self._free:
            raise RuntimeError("no free KV slot")  # the scheduler admits at most n_slots
        slot = prefer if prefer in self._free else self._free[0]
        self._free.remove(slot)
        return self._take(slot)

    def reclaim(self, slot: int, gen: int, tokens: list[int]) -> KVCache | None:
        """The slot back with its KV as a finished sequence (generation ``gen``) left
        it, holding ``tokens`` (a prefix of what it held): or None if the slot was
        handed out since. Spares the copy from the prefix cache."""
        if slot not in self._free or self._gen[slot] != gen:
            return None
        self._free.remove(slot)
        cache = self._take(slot)
        cache.tokens = list(tokens)
        return cache

    def generation(self, cache: KVCache) -> int:
        return self._gen[cache.slot]

    def _take(self, slot: int) -> KVCache:
        self._gen[slot] += 1
        self._resident[slot] = []
        cache = self._caches[slot]
        cache.tokens = []
        return cache

    def resident(self, slot: int) -> list[int]:
        """The tokens a free slot's rows still hold ([] for a busy or erased slot)."""
        return list(self._resident[slot]) if slot in self._free else []

    def forget(self, slot: int) -> int:
        """Erase a free slot's content (its rows are overwritten later); how many
        tokens it held. Bumps its generation: no prefix-cache copy reclaims it."""
        n = len(self._resident[slot])
        self._resident[slot] = []
        self._gen[slot] += 1
        return n

    def read(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of a slot's first n keys and values, (L, n_kv, n, hd) each (a slot save:
        the slot may be handed out again as soon as this returns)."""
        cache = self._caches[slot]
        return cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy()

    def load(self, slot: int, tokens: list[int], k: np.ndarray, v: np.ndarray) -> int:
        """Put keys/values (L, n_kv, n, hd) of ``tokens`` into a free slot's first rows
        (a slot restore); returns the slot's new generation."""
        assert slot in self._free
        n = len(tokens)
        cache = self._caches[slot]
        cache.k[:, :, :n] = k  # (L, n_kv, n, hd)
        cache.v[:, :, :n] = v
        cache.written = max(cache.written, n)
        self._gen[slot] += 1
        self._resident[slot] = list(tokens)
        return self._gen[slot]

    def holds(self, cache: KVCache) -> bool:
        """True while ``cache`` is a slot of this pool handed out and not yet released."""
        return cache.pool is self and cache.slot not in self._free

    def release(self, cache: KVCache, scrub: bool = False) -> None:
        """Give the slot back. ``scrub`` zeroes every row it ever wrote first: for a
        sequence that failed, whose keys/values may be NaN or inf, so that they are
        neither kept for reuse nor saved; it costs only the rows written, never the
        whole capacity."""
        assert self.holds(cache)
        if scrub:
            self.scrub(cache)
        self._resident[cache.slot] = [] if scrub else list(cache.tokens)
        cache.tokens = []
        self._free.append(cache.slot)

    def update_and_fetch(
        self, li: int, caches: list[KVCache], k: np.ndarray, v: np.ndarray, tokens
    ) -> tuple[np.ndarray, np.ndarray]:
        """One new key/value (n, n_kv, hd) of layer li for each of n decoding sequences
        (``caches``, slots of this pool, each at its own length), and their tokens (n,);
        returns the layer's keys/values of every slot, (slots, n_kv, capacity, hd) views,
        which the compiled decoding attention reads by slot, each up to its own length.
        As KVCache.update_and_fetch: the tokens join their caches when the last layer's
        keys are stored."""
        slots = np.array([c.slot for c in caches])  # (n,)
        pos = np.array([c.length for c in caches])  # (n,)
        if li == 0:
            for c in caches:
                c.check_room(1)
                c.written = max(c.written, c.length + 1)
        self.k[li][slots, :, pos] = k  # (n, n_kv, hd)
        self.v[li][slots, :, pos] = v
        if li == self.k.shape[0] - 1:
            for c, t in zip(caches, tokens):
                c.tokens.append(int(t))
        return self.k[li], self.v[li]  # (slots, n_kv, cap, hd)

    def snapshot(self, cache: KVCache, capacity: int) -> KVCache:
        """A compact standalone copy of a slot's sequence (the prefix cache keeps these),
        remembering the slot and generation it came from: while the slot is not handed
        out again, ``reclaim`` takes the rows back without copying."""
        assert self.holds(cache)
        n = cache.length
        return KVCache.from_state(
            self.cfg, cache.tokens, cache.k[:, :, :n], cache.v[:, :, :n],
            capacity, origin=(cache.slot, self._gen[cache.slot]), types=self.types,
        )  # fmt: skip

    def scrub(self, cache: KVCache) -> None:
        n = cache.written
        self.k[:, cache.slot, :, :n] = 0.0  # (L, n_kv, n, hd)
        self.v[:, cache.slot, :, :n] = 0.0
        cache.written = 0


def _zero_pages(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array of zeros whose memory is committed page by page on first touch, in
    4 KB pages. Address space only (no commit charge): a long context reserves it, and
    the kernel's overcommit heuristic must not refuse a pool that will mostly stay
    empty."""
    count = int(np.prod(shape))
    buf = anonymous(count * dtype.itemsize, huge_pages=False, reserve=False)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
