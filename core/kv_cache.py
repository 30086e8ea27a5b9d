"""Per-sequence KV cache, preallocated once and owned by the caller (not the model)."""
from __future__ import annotations

import numpy as np

from .config import ModelConfig


class ContextOverflow(ValueError):
    pass


class KVCache:
    """Keys/values of one sequence for every layer.

    ``k``/``v`` are (n_layers, n_kv_heads, capacity, head_dim) float32, allocated
    with np.empty so untouched capacity costs no RSS. ``tokens`` lists the token
    ids whose keys are stored, which is what the prefix cache matches on.
    """

    def __init__(self, cfg: ModelConfig, capacity: int):
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = np.empty(shape, dtype=np.float32)   # (L, n_kv, cap, hd)
        self.v = np.empty(shape, dtype=np.float32)   # (L, n_kv, cap, hd)
        self.capacity = capacity
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise ContextOverflow(f"context overflow: {self.length + n_new} tokens do not fit "
                                  f"in a context of {self.capacity}")

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens (their KV is simply overwritten later)."""
        del self.tokens[n:]

    def copy_prefix_from(self, other: "KVCache", n: int) -> None:
        """Take the first n positions of another cache (used to share cached prefixes)."""
        self.k[:, :, :n] = other.k[:, :, :n]
        self.v[:, :, :n] = other.v[:, :, :n]
        self.tokens = list(other.tokens[:n])
