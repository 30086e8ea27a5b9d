"""Merge methods: how the adapters of a mix combine, beyond a weighted sum.

``linear`` (the default) is llama-server's weighted sum, ``Σ w_i ΔW_i``, run as stacked
low-rank pairs without ever forming a dense matrix (core/lora/mix.py); ``cat`` is the
same sum by name (PEFT's ``cat``, which stacks the ranks, as we always do). The other
methods need the dense weight change of each adapter, ``ΔW_i = effective_scale(1)·B_i
A_i`` (out, in), per module: they combine the stack of those "task tensors" with the
user's scales as weights, then reduce the result to a rank r with a truncated SVD, so
that it runs as one more low-rank adapter. This is PEFT's
``add_weighted_adapter(combination_type="<method>_svd")`` (``svd`` for the plain sum),
with the method functions of ``peft/utils/merge_utils.py``, which follow the papers:

* ``svd``: the weighted sum, reduced to rank r.
* ``magnitude_prune``: each task tensor keeps its ``density`` fraction of largest
  magnitudes, then the weighted sum.
* ``ties`` (TIES-Merging, Yadav et al. 2023): trim as magnitude_prune; elect a sign per
  entry from the trimmed tensors (``total``: sign of their sum; ``frequency``: the sign
  most of them have); the weighted entries that agree with it are averaged (a
  disjoint mean: divided by how many agree, not by how many adapters there are).
* ``dare_linear`` / ``dare_ties`` (DARE, Yu et al. 2023): each entry of a task tensor is
  kept with probability ``density`` and rescaled by ``1/density`` (so its expectation
  is unchanged), then the weighted sum / the TIES sign election and disjoint mean.
  The drop mask comes from a seeded generator: the same seed gives the same merge.

PEFT's plain ``ties``/``dare_*``/``magnitude_prune`` (without ``_svd``) apply the method
to the A and B factors separately (and need equal ranks); trimming a factor is not
trimming the weight change the papers define, so we offer the ΔW forms only.

Everything here is pure numpy on stacked tensors; building a mix from it is
``core/lora/mix.py``'s job.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UserError

METHODS = ("linear", "cat", "svd", "ties", "dare_linear", "dare_ties", "magnitude_prune")
DENSITY_METHODS = frozenset({"ties", "dare_linear", "dare_ties", "magnitude_prune"})
SIGN_METHODS = frozenset({"ties", "dare_ties"})
RANDOM_METHODS = frozenset({"dare_linear", "dare_ties"})
STACKED_METHODS = frozenset({"linear", "cat"})  # exact low-rank stacking, nothing to build
SIGN_RULES = ("total", "frequency")
DEFAULT_DENSITY = 0.5
MAX_DEFAULT_RANK = 64  # the default rank: the sum of the adapters' ranks, at most this
MAX_RANK = 4096
FIELDS = ("method", "density", "rank", "seed", "majority_sign_method")


class MergeError(UserError):
    """A merge method or one of its parameters is not valid; the message says which."""


def _shown(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


@dataclass(frozen=True)
class MergeSpec:
    """How a mix's adapters combine. Build it with :meth:`make` (checked, and with the
    fields the method does not use set to None, so that two specs that merge the same
    way are equal and share a cache entry)."""

    method: str = "linear"
    density: float | None = None  # kept fraction, 0 < d <= 1 (ties, dare_*, magnitude_prune)
    rank: int | None = None  # rank of the merged adapter; None: Σ ranks, at most 64
    seed: int | None = None  # dare_*: the drop mask's seed
    majority_sign_method: str | None = None  # ties, dare_ties: "total" | "frequency"

    @classmethod
    def make(
        cls,
        method: Any = "linear",
        density: Any = None,
        rank: Any = None,
        seed: Any = None,
        majority_sign_method: Any = None,
    ) -> MergeSpec:
        if not isinstance(method, str) or method not in METHODS:
            raise MergeError(
                f"merge method must be one of {', '.join(METHODS)}, not {_shown(method)}"
            )
        if density is not None and (
            not isinstance(density, (int, float))
            or isinstance(density, bool)
            or not math.isfinite(density)
            or not 0.0 < density <= 1.0
        ):
            raise MergeError(f"density must be a number in (0, 1], not {_shown(density)}")
        if rank is not None and (
            not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK
        ):
            raise MergeError(f"rank must be an integer from 1 to {MAX_RANK}, not {_shown(rank)}")
        if seed is not None and (
            not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63
        ):
            raise MergeError(f"seed must be a non-negative integer, not {_shown(seed)}")
        if majority_sign_method is not None and majority_sign_method not in SIGN_RULES:
            raise MergeError(
                f"majority_sign_method must be one of {', '.join(SIGN_RULES)}, "
                f"not {_shown(majority_sign_method)}"
            )
        if method in STACKED_METHODS:
            return cls(method)
        return cls(
            method,
            float(density if density is not None else DEFAULT_DENSITY)
            if method in DENSITY_METHODS
            else None,
            rank,
            (seed if seed is not None else 0) if method in RANDOM_METHODS else None,
            (majority_sign_method or "total") if method in SIGN_METHODS else None,
        )

    @classmethod
    def from_dict(cls, d: Any, what: str = "merge") -> MergeSpec:
        """From JSON ({"method", "density", "rank", "seed", "majority_sign_method"});
        an unknown field is an error, so a typo never silently merges another way."""
        if not isinstance(d, dict):
            raise MergeError(f"{what} must be an object, not {_shown(d)}")
        unknown = sorted(set(d) - set(FIELDS))
        if unknown:
            raise MergeError(
                f"{what}: unknown field {_shown(unknown[0])} (known: {', '.join(FIELDS)})"
            )
        return cls.make(**d)

    @property
    def builds(self) -> bool:
        """Whether the mix needs a merged adapter built (anything but linear/cat)."""
        return self.method not in STACKED_METHODS

    def as_dict(self) -> dict[str, Any]:
        """The method and the parameters it uses (rank None: the default)."""
        return {
            k: getattr(self, k) for k in FIELDS if k == "method" or getattr(self, k) is not None
        }

    def label(self) -> str:
        """Short text for the window: "ties d=0.5", "svd r=16"."""
        parts = [self.method]
        if self.density is not None:
            parts.append(f"d={self.density:g}")
        if self.rank is not None:
            parts.append(f"r={self.rank}")
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        if self.majority_sign_method not in (None, "total"):
            parts.append(self.majority_sign_method)
        return " ".join(parts)


LINEAR = MergeSpec()


def default_rank(ranks: list[int]) -> int:
    """The merged adapter's rank when none is chosen: the sum of the ranks, at most 64."""
    return max(1, min(sum(ranks), MAX_DEFAULT_RANK))


# ---- the methods, on stacked task tensors ---------------------------------------------
# tasks: (n, ...) one task tensor per adapter (float32); weights: (n,) the user's scales.


def _weighted(tasks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return tasks * weights.astype(tasks.dtype).reshape((-1,) + (1,) * (tasks.ndim - 1))  # (n, ...)


def magnitude_mask(task: np.ndarray, density: float) -> np.ndarray:
    """True at the ``int(density · size)`` largest |entries| of one task tensor (PEFT's
    magnitude_based_pruning: k counts over the whole tensor, not per row)."""
    flat = np.abs(task).reshape(-1)  # (size,)
    k = int(density * flat.size)
    mask = np.zeros(flat.size, dtype=bool)  # (size,)
    if k >= flat.size:
        mask[:] = True
    elif k > 0:
        mask[np.argpartition(flat, flat.size - k)[flat.size - k :]] = True
    return mask.reshape(task.shape)


def trim(tasks: np.ndarray, density: float) -> np.ndarray:
    """Each task tensor keeps its top-density magnitudes (density 1: unchanged)."""
    if density >= 1.0:
        return tasks
    return np.stack([t * magnitude_mask(t, density) for t in tasks])  # (n, ...)


def drop(tasks: np.ndarray, density: float, rng: np.random.Generator) -> np.ndarray:
    """DARE: each entry kept with probability density, then rescaled by 1/density.
    One mask per task tensor, drawn in order from ``rng`` (density 1: unchanged, no draw)."""
    if density >= 1.0:
        return tasks
    out = np.empty_like(tasks)  # (n, ...)
    for i, t in enumerate(tasks):
        out[i] = t * drop_mask(rng, t.shape, density) / np.float32(density)
    return out


def drop_mask(rng: np.random.Generator, shape: tuple[int, ...], density: float) -> np.ndarray:
    """One DARE keep-mask: each entry 1 with probability density (float32 0/1)."""
    return (rng.random(shape, dtype=np.float32) < np.float32(density)).astype(np.float32)


def majority_sign_mask(tasks: np.ndarray, rule: str = "total") -> np.ndarray:
    """True where an entry's sign is the elected one: the sign of the sum of the entries
    ("total") or of the sum of their signs ("frequency"); a tie elects +. Zeros never agree."""
    sign = np.sign(tasks)  # (n, ...)
    mass = tasks.sum(axis=0) if rule == "total" else sign.sum(axis=0)  # (...)
    elected = np.where(mass >= 0, 1.0, -1.0).astype(tasks.dtype)  # (...)
    return sign == elected  # (n, ...)


def disjoint_mean(weighted: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """Mean over the adapters that agree with the elected sign, entry by entry."""
    total = (weighted * agree).sum(axis=0)  # (...)
    count = agree.sum(axis=0).astype(weighted.dtype)  # (...)
    return total / np.maximum(count, 1.0)


def task_arithmetic(tasks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return _weighted(tasks, weights).sum(axis=0)  # (...)


def magnitude_prune(tasks: np.ndarray, weights: np.ndarray, density: float) -> np.ndarray:
    return task_arithmetic(trim(tasks, density), weights)  # (...)


def ties(tasks: np.ndarray, weights: np.ndarray, density: float, rule: str = "total") -> np.ndarray:
    trimmed = trim(tasks, density)  # (n, ...)
    return disjoint_mean(_weighted(trimmed, weights), majority_sign_mask(trimmed, rule))


def dare_linear(
    tasks: np.ndarray, weights: np.ndarray, density: float, rng: np.random.Generator
) -> np.ndarray:
    return task_arithmetic(drop(tasks, density, rng), weights)  # (...)


def dare_ties(
    tasks: np.ndarray,
    weights: np.ndarray,
    density: float,
    rng: np.random.Generator,
    rule: str = "total",
) -> np.ndarray:
    dropped = drop(tasks, density, rng)  # (n, ...)
    return disjoint_mean(_weighted(dropped, weights), majority_sign_mask(dropped, rule))


def module_rng(seed: int, module: str) -> np.random.Generator:
    """The drop masks' generator for one module: from the seed and the module's name, so
    a module's masks do not depend on which other modules are merged, or in what order."""
    return np.random.default_rng([seed, zlib.crc32(module.encode())])


def combine(spec: MergeSpec, tasks: np.ndarray, weights: np.ndarray, module: str) -> np.ndarray:
    """The merged dense weight change of one module: tasks (n, out, in) -> (out, in)."""
    m = spec.method
    if m in ("linear", "cat", "svd"):
        return task_arithmetic(tasks, weights)
    if m == "magnitude_prune":
        return magnitude_prune(tasks, weights, spec.density)
    if m == "ties":
        return ties(tasks, weights, spec.density, spec.majority_sign_method)
    rng = module_rng(spec.seed, module)
    if m == "dare_linear":
        return dare_linear(tasks, weights, spec.density, rng)
    if m == "dare_ties":
        return dare_ties(tasks, weights, spec.density, rng, spec.majority_sign_method)
    raise MergeError(f"unknown merge method {m!r}")


# ---- back to low rank ---------------------------------------------------------------


def truncated_svd(delta: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """delta (out, in) -> (A (r, in), B (out, r)) with B A the best rank-r approximation
    of delta, the product PEFT's truncated SVD gives (r at most min(out, in)).

    Through the eigenvectors of the smaller Gram matrix, in float64: the top r singular
    vectors of an (out, in) matrix without a full SVD, about 4x fewer flops for an FFN
    module (the build's cost is almost all here). B A = delta V Vᵀ (or U Uᵀ delta), the
    projection onto the top r singular directions: exactly U_r S_r Vh_r."""
    d = delta.astype(np.float64)  # (out, in)
    r = min(rank, *d.shape)
    if d.shape[0] >= d.shape[1]:
        _, v = np.linalg.eigh(d.T @ d)  # (in, in), eigenvalues ascending
        top = v[:, ::-1][:, :r]  # (in, r) the top right singular vectors
        a, b = top.T, d @ top  # (r, in) = Vh_r, (out, r) = U_r S_r
    else:
        _, u = np.linalg.eigh(d @ d.T)  # (out, out)
        top = u[:, ::-1][:, :r]  # (out, r) the top left singular vectors
        a, b = top.T @ d, top  # (r, in) = S_r Vh_r, (out, r) = U_r
    return np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)


def low_rank_svd(a: np.ndarray, b: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The same as ``truncated_svd(b @ a, rank)`` for a product of stacked factors,
    a (R, in) and b (out, R), without forming the dense (out, in) matrix: the SVD of
    a rank-R product is that of a small R×R core between two orthonormal bases (the
    ``svd`` method's sum of adapters is such a product)."""
    qb, rb = np.linalg.qr(b.astype(np.float64))  # (out, R), (R, R)
    qa, ra = np.linalg.qr(a.T.astype(np.float64))  # (in, R), (R, R)
    uc, s, vch = np.linalg.svd(rb @ ra.T)  # (R, R), (R,), (R, R)
    r = min(rank, s.size)
    new_b = (qb @ uc[:, :r]) * s[:r]  # (out, r)
    new_a = vch[:r] @ qa.T  # (r, in)
    return np.ascontiguousarray(new_a, dtype=np.float32), np.ascontiguousarray(
        new_b, dtype=np.float32
    )
