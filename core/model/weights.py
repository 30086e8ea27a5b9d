"""A model's weights: kept in their GGUF block formats (the default), or float32.

Quantized (``map_weights``, the default): every matrix stays in its GGUF block
format, and the products run on compiled kernels that dequantize blocks in registers
(core/model/quant.py): a 1B Q4_K_M serves from 0.8 GB, not 4.9 GB. A load reads the
header and checks every tensor's bytes against its shape and type. A model of at most
READ_MAX_BYTES then has the file's bytes read into memory (GGUFFile.read_into_memory,
in huge pages: a 1B decodes 1.13-1.20x faster than from the map). A larger one (a 3B,
an 8B: as fast mapped, and far quicker to load), one that would take most of the free
memory, one with tensors without kernels, and every model under ``--mmap`` is served
from the file's own memory map: the OS pages the weights in on first use, shares them
with the page cache, and may drop them again under memory pressure (``read_or_map``).
A type without kernels (IQ*, TQ*) is dequantized to float32 in RAM, that tensor
alone, and the load says so (``Weights.f32_tensors``). Fused matrices (Q|K|V,
gate|up) are ``FusedMatrix`` of the file's parts, which may differ in type.

Float32 (``load_weights``, ``--weights f32``: for comparison, and the fallback).
Cold load dequantizes every tensor (any type ``gguf.quants`` supports) straight
into one float32 file in the platformdirs cache dir, already in the fused layout
the forward pass wants (Q|K|V stacked, gate|up stacked), in pieces of at most
DEQUANT_PIECE weights: progress moves per piece (a 1B's token_embd alone is 263 M
weights) and the temporaries stay small. Before it writes, it says how much disk
the cache takes and refuses when the disk cannot hold it (4 bytes per weight: 4.9
GB for a 1B). Warm load maps that file read-only, which costs a few milliseconds:
the OS pages weights in on first use, shared with the page cache, never copied.
The cache key is the file's identity (resolved path, size, mtime), so an edited
or replaced model file gets a fresh cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..errors import UserError
from ..gguf.reader import GGUFError, GGUFFile, UnsupportedQuant, byte_size
from ..paths import cache_dir
from . import layout
from .config import ModelConfig
from .quant import SUPPORTED, FusedMatrix, QuantMatrix

log = logging.getLogger(__name__)

CACHE_FORMAT = 4  # bump when the fused layout changes
# weights per dequantize job: 8 MB of float32, ~0.05 s of one core for Q6_K (gguf-py
# does ~50 M weights/s), so progress moves several times a second on a busy machine
DEQUANT_PIECE = 2 << 20
# 4 KB pages of the cache whose crc32 the index keeps: a warm load reads only these
# (~1 ms), which catches a cache zeroed or overwritten in places (a crash before the
# data reached the disk, a copy cut short and padded) without reading 4.9 GB
SAMPLE_PAGES = 64
Progress = Callable[[float, str], None]


class ModelLoadError(UserError):
    """A model could not be loaded; the message names the file and the problem."""


class LoadCancelled(Exception):
    def __init__(self, message: str = "cancelled"):
        super().__init__(message)


FROM_CACHE = "loaded from cache"  # the progress message of weights mapped from the cache
MAPPED = "mapped"  # ... and of quantized weights mapped from the model file itself
READING = "reading"  # ... and of the model file's bytes being read into memory
# map_weights reads the file into memory when its tensor data is at most this share of
# the memory the OS says is available: the KV cache, the adapters and the rest of the
# system need the remainder, and mapped pages can be dropped under pressure, a copy's
# cannot (it would swap)
READ_SHARE_OF_AVAILABLE = 0.75
# ... and when it is at most this big. Reading costs load time (0.4-2 s a GB from the
# page cache, huge pages included) and gains decode speed only where the map was slow:
# a 1B-shaped Q4_K_M (0.8 GB) decoded 1.13-1.20x faster read than mapped, a 3B (2.0
# GB) and an 8B (5.0 GB) as fast either way, while the 8B's read took 3.6-15 s against
# 0.8 s to map (2 threads, this machine, 2026-12-07)
READ_MAX_BYTES = 1_500_000_000
Matrix = np.ndarray | QuantMatrix | FusedMatrix  # (out, in): what Linear multiplies by


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (dim,)
    wqkv: Matrix  # (q_dim + 2*kv_dim, dim)  fused Q|K|V
    wo: Matrix  # (dim, q_dim)
    ffn_norm: np.ndarray  # (dim,)
    w_gate_up: Matrix  # (2*ffn, dim)             fused gate|up
    w_down: Matrix  # (dim, ffn)
    # only the architectures whose block (core/model/layout.py) declares them:
    wqkv_bias: np.ndarray | None = None  # (q_dim + 2*kv_dim,)  qwen2
    attn_q_norm: np.ndarray | None = None  # (head_dim,)  qwen3, gemma3; shared by all heads
    attn_k_norm: np.ndarray | None = None  # (head_dim,)
    post_attention_norm: np.ndarray | None = None  # (dim,)
    post_ffw_norm: np.ndarray | None = None  # (dim,)

    @property
    def projections(self) -> tuple[Matrix, Matrix, Matrix, Matrix]:
        """The four matrices a block multiplies by, in the order it uses them."""
        return self.wqkv, self.wo, self.w_gate_up, self.w_down


@dataclass
class Weights:
    tok_embd: Matrix  # (vocab, dim)
    layers: list[LayerWeights]
    output_norm: np.ndarray  # (dim,)
    output: Matrix  # (vocab, dim); the same object as tok_embd when tied
    rope_freqs: np.ndarray | None  # (rope_dim/2,) llama3-style frequency factors
    tied: bool
    # (rope_dim/2,) phi3's LongRoPE factors: long for contexts past the original one
    rope_long: np.ndarray | None = None
    rope_short: np.ndarray | None = None
    storage: str = "f32"  # "quantized": matrices in their GGUF block formats (core/options.py: WEIGHT_STORAGES)
    # quantized storage: tensors of a type without kernels, held as float32 instead
    # ({tensor name: type name}); the load log and the model bar name them
    f32_tensors: dict[str, str] | None = None
    # what the quantized matrices' decode-sized products multiply by: "f32", or "q8"
    # (core/options.py's ACTIVATION_MODES; map_weights's, in force)
    activations: str = "f32"
    # quantized storage: True when the blocks are read from the model file's memory map
    # (--mmap, little free memory, tensors without kernels), False when they were read
    # into memory (map_weights)
    mapped: bool = False

    @property
    def quantized(self) -> bool:
        """True when some matrix is held in a GGUF block format (compiled products)."""
        return any(not isinstance(m, np.ndarray) for m in self.layers[0].projections)

    def qtypes(self) -> set[str]:
        """The block types of the matrices held quantized ('Q4_K', 'Q6_K', ...)."""
        mats = [self.tok_embd, self.output] + [m for lw in self.layers for m in lw.projections]
        parts = [p for m in mats for p in getattr(m, "parts", [m])]
        return {p.dtype for p in parts if not isinstance(p, np.ndarray)}

    def _arrays(self) -> list:
        """Every weight once (a tied output is the embedding)."""
        arrays = [self.tok_embd, self.output_norm] + ([] if self.tied else [self.output])
        for lw in self.layers:
            arrays += [a for a in vars(lw).values() if a is not None]
        return arrays

    @property
    def nbytes(self) -> int:
        """The bytes the weights take as held (quantized blocks, or float32)."""
        return sum(a.nbytes for a in self._arrays())

    @property
    def float32_nbytes(self) -> int:
        """The bytes the weights would take as float32 (``--weights f32``)."""
        return 4 * sum(a.size for a in self._arrays())


def check_tensors(cfg: ModelConfig, gf: GGUFFile) -> None:
    """Every tensor the model needs exists with the shape the metadata declares (as
    llama.cpp checks), before anything is allocated: a hostile block_count or
    feed_forward_length then fails here instead of allocating terabytes."""
    name = gf.path.name
    for src, (shape, keys) in layout.file_tensors(cfg, gf.metadata, gf.tensors).items():
        info = gf.tensors.get(src)
        if info is None:
            why = (
                f" ({cfg.arch}.block_count says {cfg.n_layers} blocks)" if src[:4] == "blk." else ""
            )
            raise ModelLoadError(f"{name}: missing tensor {src!r}{why}")
        if info.shape != shape:
            raise ModelLoadError(
                f"{name}: tensor {src!r} has shape {info.shape}, but {keys} say {shape}"
            )
    for src in layout.ROPE_FACTOR_TENSORS.values():
        if src not in gf.tensors:
            continue
        factors = gf.dequantize(src)  # (rope_dim/2,)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelLoadError(f"{name}: tensor {src!r} must hold finite positive factors")


def _cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    return hashlib.sha1(ident.encode()).hexdigest()[:20]


def _assemble(cfg: ModelConfig, arrays: dict[str, Matrix], **extra) -> Weights:
    layers = [
        LayerWeights(**{f: arrays[f"blk.{i}.{f}"] for f in layout.layer_fields(cfg)})
        for i in range(cfg.n_layers)
    ]
    tied = "output" not in arrays
    return Weights(
        tok_embd=arrays["tok_embd"],
        layers=layers,
        output_norm=arrays["output_norm"],
        output=arrays["tok_embd"] if tied else arrays["output"],
        rope_freqs=arrays.get("rope_freqs"),
        rope_long=arrays.get("rope_long"),
        rope_short=arrays.get("rope_short"),
        tied=tied,
        **extra,
    )


def _views(
    buf: np.ndarray, offsets: list[tuple[str, tuple[int, ...], int]]
) -> dict[str, np.ndarray]:
    """Views of the flat buffer. Matrices are stored (out, in) C-contiguous, as in
    the GGUF file: a gemv ``W @ x`` streams them at memory speed, and any run of
    rows is one contiguous block, which the small-batch products in core/model/linear.py
    depend on."""
    # Plain ndarray views (the memmap stays alive as their base): np.memmap's
    # subclass hooks would otherwise run on every slice in the forward pass.
    buf = np.asarray(buf)
    out = {}
    for name, shape, off in offsets:
        n = int(np.prod(shape))
        out[name] = buf[off : off + n].reshape(shape)
    return out


def map_weights(
    gf: GGUFFile,
    cfg: ModelConfig,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    activations: str = "f32",
    in_memory: bool = True,
) -> Weights:
    """The model's weights in the GGUF's own bytes: matrices in their block formats
    (QuantMatrix; FusedMatrix where the model fuses parts), norms, biases and rope
    factors (small) as float32 copies. Every matrix's bytes are checked against its
    shape and type before any kernel can index them (a truncated or corrupt file is a
    ModelLoadError). A type without kernels is dequantized to float32, that tensor
    alone, and named in ``f32_tensors``. ``activations``: what the matrices'
    decode-sized products multiply by (quant.activations_in_force). ``in_memory``:
    read the file's bytes into memory first (read_or_map says when that is skipped);
    False (--mmap): serve them from the file's memory map."""
    progress = progress or (lambda f, m: None)
    check_tensors(cfg, gf)
    plan = layout.fused_plan(cfg, gf.tensors)
    if in_memory and read_or_map(gf, plan) is None:

        def reading(frac: float) -> None:
            if cancel is not None and cancel.is_set():
                raise LoadCancelled()
            progress(frac, READING)

        try:
            reading(0.0)  # the bar says so before the first read (seconds for an 8B)
            gf.read_into_memory(reading)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from None
        except MemoryError as e:
            log.warning("%s: served from its memory map: %s", gf.path.name, e)
    arrays: dict[str, Matrix] = {}
    f32: dict[str, str] = {}
    for i, (name, shape, sources) in enumerate(plan):
        if cancel is not None and cancel.is_set():
            raise LoadCancelled()
        try:
            if len(shape) == 1:  # norms, biases (Q|K|V's, stacked), rope factors
                arrays[name] = np.concatenate([gf.dequantize(s).reshape(-1) for s in sources])
            else:
                parts = [_matrix(gf, s, f32, activations) for s in sources]
                if len(parts) == 1:
                    arrays[name] = parts[0]
                elif all(isinstance(m, np.ndarray) for m in parts):
                    # all float32 (an F32 file, or types without kernels): one array, so
                    # the products keep BLAS's regimes and their calibration
                    arrays[name] = np.concatenate(parts)  # (sum of rows, in)
                else:
                    arrays[name] = FusedMatrix(parts, name)
        except (UnsupportedQuant, GGUFError) as e:
            raise ModelLoadError(str(e)) from None
        progress((i + 1) / len(plan), MAPPED)
    if f32:
        kinds = sorted(set(f32.values()))
        log.warning(
            "%s: %d tensors of type %s have no compiled kernels; they are held as float32",
            gf.path.name,
            len(f32),
            ", ".join(kinds),
        )
    note = note_f32_caches()
    if note:
        log.info("%s", note)
    return _assemble(
        cfg,
        arrays,
        storage="quantized",
        f32_tensors=f32,
        activations=activations,
        mapped=not gf.in_memory,
    )


def read_or_map(gf: GGUFFile, plan) -> str | None:
    """Why ``gf``'s bytes should stay in its memory map rather than be read into
    memory (logged), or None to read them: a tensor of the plan without kernels (its
    bytes would be dequantized, and a copy of them held for nothing), or tensor data
    of more than READ_MAX_BYTES, or of more than READ_SHARE_OF_AVAILABLE of the
    available memory."""
    size = byte_size(gf.data_bytes)
    no_kernels = [
        s
        for _, shape, sources in plan
        for s in sources
        if len(shape) > 1
        and gf.tensors[s].qtype not in SUPPORTED
        and gf.tensors[s].qtype != GGMLQuantizationType.F32
    ]
    free = available_memory()
    if no_kernels:
        s = no_kernels[0]
        why = f"tensor {s} is {gf.tensors[s].qtype.name}, which has no compiled kernels"
    elif gf.data_bytes > READ_MAX_BYTES:
        why = (
            f"its {size} of weights are more than the {byte_size(READ_MAX_BYTES)} read "
            "into memory (faster to map, as fast to serve)"
        )
    elif free is not None and gf.data_bytes > READ_SHARE_OF_AVAILABLE * free:
        why = (
            f"its {size} of weights are more than {READ_SHARE_OF_AVAILABLE:.0%} of the "
            f"{byte_size(free)} of memory available"
        )
    else:
        return None
    log.info("%s: served from its memory map: %s", gf.path.name, why)
    return why


def available_memory() -> int | None:
    """The bytes the OS can give without swapping (Linux's MemAvailable: free
    memory plus the page cache it can drop), or None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def f32_caches() -> list[Path]:
    """The float32 weight caches in the cache dir (written by ``--weights f32``, and by
    every load before weights stayed quantized): 4 bytes per weight each."""
    return sorted((cache_dir() / "weights").glob("*.f32"))


def note_f32_caches() -> str | None:
    """One line about float32 caches a quantized load does not use, or None."""
    found = f32_caches()
    if not found:
        return None
    size = sum(p.stat().st_size for p in found if p.exists())
    return (
        f"{len(found)} float32 weight cache(s) take {size / 1e9:.2f} GB in {found[0].parent}: "
        "weights now stay quantized in memory and only --weights f32 uses them; "
        "`mixdesk --clear-f32-cache` deletes them"
    )


def clear_f32_caches() -> tuple[int, int]:
    """Delete every float32 weight cache and its index; (files, bytes) freed."""
    n = freed = 0
    for p in f32_caches():
        try:
            size = p.stat().st_size
            p.unlink()
            p.with_suffix(".json").unlink(missing_ok=True)
        except OSError:
            continue
        n, freed = n + 1, freed + size
    return n, freed


def _matrix(gf: GGUFFile, src: str, f32: dict[str, str], activations: str = "f32") -> Matrix:
    """One GGUF matrix as the model holds it: F32 as a read-only view of the file, a
    type with kernels as a QuantMatrix (its bytes checked), any other dequantized."""
    info = gf.tensors[src]
    if info.qtype == GGMLQuantizationType.F32:
        return gf.raw(src).view(np.float32).reshape(info.shape)  # (out, in), no copy
    if info.qtype in SUPPORTED:
        name = f"{gf.path.name}: {src}"
        return QuantMatrix(info.qtype, gf.raw(src), info.shape, name, activations)
    f32[src] = info.qtype.name
    return gf.dequantize(src)  # (out, in) float32 in RAM


def load_weights(
    gf: GGUFFile,
    cfg: ModelConfig,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    use_cache: bool = True,
) -> Weights:
    progress = progress or (lambda f, m: None)
    check_tensors(cfg, gf)
    plan = layout.fused_plan(cfg, gf.tensors)
    offsets, off = [], 0
    for name, shape, _ in plan:
        offsets.append((name, shape, off))
        off += int(np.prod(shape))
    total = off

    cdir = cache_dir() / "weights"
    key = _cache_key(gf.path)
    bin_path, idx_path = cdir / f"{key}.f32", cdir / f"{key}.json"
    if cancel is not None and cancel.is_set():
        raise LoadCancelled()
    if use_cache and idx_path.exists() and bin_path.exists():
        try:
            idx = json.loads(idx_path.read_text())
            if idx.get("total") == total and bin_path.stat().st_size == total * 4:
                buf = np.memmap(bin_path, dtype=np.float32, mode="r", shape=(total,))
                if idx.get("sample_crc") == _sample_crc(buf):
                    progress(1.0, FROM_CACHE)
                    return _assemble(cfg, _views(buf, offsets), storage="f32")
                log.warning("weight cache %s does not match its index; rebuilding it", bin_path)
                del buf
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable weight cache %s: %s", bin_path, e)

    # Cold path: dequantize into a memory-mapped file (or RAM if the cache is not writable).
    tmp = None
    size = byte_size(total * 4)
    try:
        if not use_cache:
            raise OSError("cache disabled")
        cdir.mkdir(parents=True, exist_ok=True)
        check_disk(gf.path, cdir, total * 4)
        log.info("writing the float32 weight cache of %s: %s in %s", gf.path.name, size, cdir)
        progress(0.0, f"writing a {size} float32 weight cache to {cdir}")
        tmp = cdir / f".{key}.{os.getpid()}.partial"
        buf = np.memmap(tmp, dtype=np.float32, mode="w+", shape=(total,))
    except OSError:
        if tmp is not None:  # np.memmap sized the file before its map failed
            tmp.unlink(missing_ok=True)
        tmp = None
        try:
            buf = np.empty(total, dtype=np.float32)
        except MemoryError:
            raise out_of_memory(gf.path, size) from None
    views = _views(buf, offsets)

    # (destination view, source tensor, its rows [a, b), destination row of a): shapes
    # checked above; a tensor larger than DEQUANT_PIECE is cut into runs of rows
    jobs = []
    for name, _, sources in plan:
        row = 0
        for src in sources:
            info = gf.tensors[src]
            n_rows = info.shape[0] if len(info.shape) >= 2 else 1
            step = max(1, DEQUANT_PIECE * n_rows // max(info.n_elements, 1))
            for a in range(0, n_rows, step):
                jobs.append((views[name], info, a, min(a + step, n_rows), row + a))
            row += info.shape[0]

    done_elems = 0
    lock = threading.Lock()

    def run(job):
        nonlocal done_elems
        if cancel is not None and cancel.is_set():
            raise LoadCancelled()
        dest, info, a, b, row = job
        try:
            if len(info.shape) >= 2:
                data = gf.dequantize(info.name, rows=(a, b))  # (b - a, cols)
            else:
                data = gf.dequantize(info.name)  # a norm: all of it; a bias: its rows
        except UnsupportedQuant as e:
            raise ModelLoadError(str(e)) from None
        dest[row : row + len(data)] = data
        with lock:
            done_elems += data.size
            progress(min(done_elems / total, 0.999), f"dequantizing {info.name} ({size} cache)")

    try:
        # gguf.quants releases the GIL inside numpy, so two threads ~halve cold load.
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as ex:
            for _ in ex.map(run, jobs):
                pass
        if tmp is not None:
            buf.flush()
            crc = _sample_crc(buf)
            jobs.clear()  # their views hold the writable map: unmap it before the next
            del views, buf
            os.replace(tmp, bin_path)
            _write_index(idx_path, gf.path, total, crc)
            _drop_stale(cdir, gf.path, key)
            tmp = None
            # serve from a read-only map, exactly as a warm load would
            views = _views(np.memmap(bin_path, dtype=np.float32, mode="r", shape=(total,)), offsets)
    except MemoryError:  # a dequantized piece found no room
        raise out_of_memory(gf.path, size) from None
    except OSError as e:
        if e.errno == errno.ENOMEM:  # the cache's read-only map found no address space
            raise out_of_memory(gf.path, size) from None
        raise
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink()
    progress(1.0, "loaded")
    return _assemble(cfg, views, storage="f32")


def out_of_memory(model: Path, size: str) -> ModelLoadError:
    """The one-line error of a load that ran out of memory (RAM, or address space
    under ``ulimit -v``), naming the file and what it needed."""
    return ModelLoadError(
        f"{model.name}: not enough memory to load it: its float32 weights need {size}"
    )


def check_disk(model: Path, cdir: Path, need: int) -> None:
    """Refuse, before writing a byte, a cache the disk cannot hold: a disk filled
    halfway through a 4.9 GB write would fail late and leave the user's disk full."""
    free = shutil.disk_usage(cdir).free
    if free < need:
        raise ModelLoadError(
            f"{model.name}: its float32 weight cache takes {need / 1e9:.2f} GB "
            f"(4 bytes per weight) but {cdir} has {free / 1e9:.2f} GB free; free some "
            "disk space, or set MIXDESK_CACHE to a folder on a disk with room"
        )


def _sample_crc(buf: np.ndarray) -> int:
    """crc32 of SAMPLE_PAGES 4 KB pages spread evenly over the cache, first and last
    included (all of a small cache)."""
    data = np.asarray(buf).view(np.uint8)  # (bytes,)
    page = 4096
    last = max(data.size - 1, 0) // page
    crc = 0
    for p in sorted({round(i * last / max(SAMPLE_PAGES - 1, 1)) for i in range(SAMPLE_PAGES)}):
        crc = zlib.crc32(data[p * page : (p + 1) * page], crc)
    return crc


def _write_index(idx_path: Path, model: Path, total: int, sample_crc: int) -> None:
    part = idx_path.with_suffix(".json.partial")
    index = {
        "model": str(model.resolve()),
        "total": total,
        "format": CACHE_FORMAT,
        "sample_crc": sample_crc,
    }
    part.write_text(json.dumps(index))
    os.replace(part, idx_path)


def _drop_stale(cdir: Path, model: Path, keep: str) -> None:
    """Delete caches of earlier versions of the same model file."""
    target = str(model.resolve())
    for idx in cdir.glob("*.json"):
        if idx.stem == keep:
            continue
        try:
            if json.loads(idx.read_text()).get("model") == target:
                idx.with_suffix(".f32").unlink(missing_ok=True)
                idx.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue


def open_model_file(path: str | os.PathLike) -> tuple[GGUFFile, ModelConfig]:
    """Parse a model file's header; all failures become ModelLoadError naming the file."""
    from .config import ModelConfigError

    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file")
    try:
        gf = GGUFFile(p)
        cfg = ModelConfig.from_metadata(gf.metadata, source=p.name)
    except (GGUFError, ModelConfigError) as e:
        raise ModelLoadError(str(e)) from None
    check_tensors(cfg, gf)
    return gf, cfg
