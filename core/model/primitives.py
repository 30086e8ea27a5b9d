"""Shared building blocks of the forward passes: RMS norm, SwiGLU, GeGLU, rope.

Architectures (core/model/llama.py, and the ones to come) compose these; each one
is measured at SmolLM2's sizes, which is what the comments' numbers refer to.
"""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig

SILU_ROWS = 32  # rows per block of the SwiGLU passes (32 x 1536 floats: 196 KB)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x: (T, d), w: (d,) -> (T, d)
    d = x.shape[1]
    if x.shape[0] == 1:
        # one decoding stream: a dot and a Python scalar, 3 numpy calls instead of 7
        # (61 norms per token, each dominated by call overhead at this size)
        r = 1.0 / math.sqrt(float(x[0] @ x[0]) / d + eps)
        return x * (w * np.float32(r))  # (1, d)
    ms = np.einsum("td,td->t", x, x)[:, None] / d  # (T, 1) mean square
    return x * (1.0 / np.sqrt(ms + eps)) * w


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # SwiGLU: silu(g) * u, with silu(g) = h * (1 + tanh(h)) for h = g/2. tanh never
    # overflows (unlike 1/(1+exp(-g))), and in-place steps avoid 4 temporaries.
    # Long prompts go through in row blocks so that the chain of passes stays in L2
    # (measured: 90 -> 64 ms per 512-token prefill).
    T, f = gate.shape
    out = np.empty((T, f), dtype=np.float32)  # (T, f)
    h = np.empty((min(T, SILU_ROWS), f), dtype=np.float32)
    for r in range(0, T, SILU_ROWS):
        o, hb = out[r : r + SILU_ROWS], h[: min(SILU_ROWS, T - r)]
        np.multiply(gate[r : r + SILU_ROWS], 0.5, out=hb)
        np.tanh(hb, out=o)
        o += 1.0
        o *= hb
        o *= up[r : r + SILU_ROWS]
    return out


def gelu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # GeGLU (Gemma): gelu(g) * u with the tanh approximation, as llama.cpp's
    # ggml_gelu: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), in row blocks like
    # silu_mul so the chain of in-place passes stays in L2.
    T, f = gate.shape
    out = np.empty((T, f), dtype=np.float32)  # (T, f)
    h = np.empty((min(T, SILU_ROWS), f), dtype=np.float32)
    for r in range(0, T, SILU_ROWS):
        g = gate[r : r + SILU_ROWS]
        o, hb = out[r : r + SILU_ROWS], h[: min(SILU_ROWS, T - r)]
        np.multiply(g, g, out=hb)
        hb *= np.float32(0.044715)
        hb += 1.0
        hb *= g
        hb *= np.float32(math.sqrt(2.0 / math.pi))
        np.tanh(hb, out=o)
        o += 1.0
        o *= g
        o *= 0.5
        o *= up[r : r + SILU_ROWS]
    return out


def rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # per-head RMS norm (Gemma 3's and Qwen3's Q/K norms): x (T, H, hd), w (hd,)
    ms = np.einsum("thd,thd->th", x, x)[..., None] / x.shape[-1]  # (T, H, 1)
    return x * (1.0 / np.sqrt(ms + eps)) * w  # (T, H, hd)


def rope_neox(x: np.ndarray, cis: np.ndarray) -> np.ndarray:
    # x: (T, H, hd); cis: (T, 1, hd/2). NeoX-style rope (llama.cpp's ROPE_TYPE_NEOX,
    # Hugging Face's rotate_half): dims i and i + hd/2 form the pair, so the complex
    # number is x[i] + i*x[i+hd/2]; the same angles as the adjacent-pair rope.
    half = x.shape[-1] // 2
    z = np.empty((*x.shape[:-1], half), dtype=np.complex64)  # (T, H, hd/2)
    z.real, z.imag = x[..., :half], x[..., half:]
    z *= cis
    out = np.empty(x.shape, dtype=np.float32)  # (T, H, hd)
    out[..., :half], out[..., half:] = z.real, z.imag
    return out


def rope(x: np.ndarray, cis: np.ndarray) -> np.ndarray:
    # x: (T, H, hd) float32 with a contiguous last axis; cis: (T, 1, hd/2) complex64.
    # llama's "normal" rope rotates adjacent pairs (x[2i], x[2i+1]) (GGUF stores Q/K
    # rows permuted for exactly that), which is x[2i] + i*x[2i+1] times e^(i*theta):
    # one complex multiply, 5x faster than strided even/odd arithmetic.
    return (x.view(np.complex64) * cis).view(np.float32)  # (T, H, hd)


class RopeTable:
    """e^(i*theta) per absolute position, grown on demand (never per token)."""

    def __init__(
        self,
        cfg: ModelConfig,
        freq_factors: np.ndarray | None,
        base: float | None = None,
        scale: float | None = None,
        mscale: float = 1.0,
    ):
        """``base``/``scale`` replace cfg's (Gemma 3's sliding-window layers); ``mscale``
        multiplies cos and sin (llama.cpp's attn_factor: phi3's LongRoPE)."""
        half = cfg.rope_dim // 2
        base = cfg.rope_base if base is None else base
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)  # (half,)
        if freq_factors is not None:
            inv = inv / np.asarray(freq_factors, dtype=np.float64)
        self.inv_freq = inv / (cfg.rope_scale if scale is None else scale)
        self.mscale = mscale
        self.cis = np.zeros((0, half), dtype=np.complex64)

    def get(self, positions: np.ndarray) -> np.ndarray:
        need = int(positions.max()) + 1
        if need > len(self.cis):
            n = max(need, 2 * len(self.cis), 1024)
            ang = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]  # (n, half)
            self.cis = (self.mscale * np.exp(1j * ang)).astype(np.complex64)
        return self.cis[positions][:, None, :]  # (T, 1, half)
