"""Loading a model file into everything that serves it, on the caller's thread.

``load_model`` opens and checks the GGUF, reads its tokenizer and chat template, holds
its weights (the file's own blocks, or float32 with ``--weights f32``), gets the
compiled kernels of its block types ready, builds the forward pass of its architecture
and, for float32 weights, times the small-batch products. The Engine
(core/serve/engine.py) wraps it: events, Cancel, the KV pool, the adapters' refit and
the swap into service. Progress goes to ``report(fraction, message)`` on the scale below;
``check()`` is called between stages and raises to cancel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..chat_template import ChatTemplate
from ..errors import UserError
from ..model import quant
from ..model.config import ModelConfig
from ..model.families import model_class
from ..model.kv_cache import F32, KVTypes
from ..model.llama import LlamaModel
from ..model.weights import (
    FROM_CACHE,
    MAPPED,
    READING,
    ModelLoadError,
    load_weights,
    map_weights,
    open_model_file,
)
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A model load's progress bar: float32 weights fill it up to LOAD_WEIGHTS_DONE (a cold
# load dequantizes for tens of seconds); weights mapped from the model file or the
# float32 cache take ~no time, so the bar then stands at LOAD_CACHED_WEIGHTS; quantized
# weights read into memory fill it up to LOAD_READ (0.3 s for a 1B, seconds for an 8B
# from a cold disk). The
# compiled kernels (decoding attention's, and a quantized model's matrix kernels:
# compiled on first use, seconds per type; then read from the cache) fill it up to
# LOAD_KERNELS. Timing the float32 products (LlamaModel's
# calibration: 4 s for SmolLM2 on 2 busy cores) fills it up to LOAD_CALIBRATED; the
# engine's KV pool and adapter checks take the rest. 100% is never shown before the
# model is in service.
LOAD_OPENED, LOAD_WEIGHTS_DONE, LOAD_CACHED_WEIGHTS = 0.02, 0.8, 0.05
LOAD_READ = 0.5
LOAD_KERNELS = 0.9
LOAD_CALIBRATED, LOAD_KV_DONE = 0.96, 0.98

Report = Callable[[float, str], None]


@dataclass
class LoadedModel:
    path: Path
    cfg: ModelConfig
    n_params: int  # the elements of every tensor in the file
    tokenizer: Tokenizer
    template: ChatTemplate
    model: LlamaModel  # its helper threads are the caller's to close (model.lin.close())


def _import_kernels() -> None:
    """quant.import_kernels on the loader's helper thread. A failure is left for
    warm_up to raise where the load reports it."""
    try:
        quant.import_kernels()
    except Exception:  # noqa: BLE001 — warm_up raises it again, on the loading thread
        log.debug("importing the kernels ahead of warm-up failed", exc_info=True)


def load_model(
    path: str | Path,
    report: Report,
    check: Callable[[], None],
    cancel: threading.Event | None = None,
    weights: str = "quantized",
    activations: str = "f32",
    threads: int | None = None,
    template_source: str | None = None,
    mmap: bool = False,
    kv_types: KVTypes = F32,
) -> LoadedModel:
    """Everything that serves ``path``; ModelLoadError naming the file for a file that
    cannot be served, LoadCancelled when ``check`` or ``cancel`` says so."""
    at = [0.0]  # the bar's position, so each stage starts where the last one ended

    def say(frac: float, msg: str) -> None:
        at[0] = frac
        report(frac, msg)

    def weights_progress(frac: float, msg: str) -> None:
        if msg == FROM_CACHE:  # mapped, not computed: the work left is all after it
            say(LOAD_CACHED_WEIGHTS, "weights mapped from the cache")
        elif msg == READING:  # the file's bytes into memory (--mmap: skipped)
            say(LOAD_OPENED + (LOAD_READ - LOAD_OPENED) * frac, "reading the weights into memory")
        elif msg == MAPPED:  # the file's own blocks: checked, not computed
            if at[0] < LOAD_READ:  # (after a read the bar stays where the read left it)
                say(LOAD_OPENED + (LOAD_CACHED_WEIGHTS - LOAD_OPENED) * frac, "mapping the weights")
        else:
            say(LOAD_OPENED + (LOAD_WEIGHTS_DONE - LOAD_OPENED) * frac, msg)

    # numba and the kernel modules take ~0.5 s to import, which a warm start would
    # otherwise spend after the weights are read: import them meanwhile (a read
    # releases Python's lock), from the start
    importing = threading.Thread(target=_import_kernels, name="mixdesk-import-kernels", daemon=True)
    importing.start()
    gf, cfg = open_model_file(path)
    n_params = sum(t.n_elements for t in gf.tensors.values())
    say(LOAD_OPENED / 2, "reading the tokenizer")
    try:
        tok = Tokenizer.from_metadata(gf.metadata)
    except UserError as e:
        raise ModelLoadError(f"{Path(path).name}: {e}") from None
    template = ChatTemplate.from_metadata(gf.metadata, tok)
    if template_source is not None:
        template = template.with_source(template_source)
    check()
    if weights == "quantized":
        mode = quant.activations_in_force(activations)
        if mode != activations:
            log.warning(
                "--activations %s needs a CPU with VNNI (AVX-512 VNNI or AVX-VNNI): "
                "this one has none, so activations stay %s",
                activations,
                mode,
            )
        w = map_weights(
            gf, cfg, progress=weights_progress, cancel=cancel, activations=mode, in_memory=not mmap
        )
    else:  # float32 matrices: numpy's products, float32 activations
        w = load_weights(gf, cfg, progress=weights_progress, cancel=cancel)
    check()
    importing.join()
    lo = at[0]

    def compiling(frac: float) -> None:
        check()
        msg = "preparing the compiled kernels (compiled on first use, then cached)"
        say(lo + (LOAD_KERNELS - lo) * frac, msg)

    # the decoding attention's kernel, and the matrix kernels of a quantized model
    took = quant.warm_up(w.qtypes(), compiling, activations=w.activations, kv_types=kv_types)
    log.info(
        "compiled kernels (decoding attention%s) ready in %.2f s (numba's %s threads)",
        "".join(f", {t}" for t in sorted(w.qtypes())),
        took,
        quant.threading_layer() or "no",
    )
    lo = at[0]

    def calibrating(frac: float) -> None:
        check()
        say(lo + (LOAD_CALIBRATED - lo) * frac, "timing the matrix products")

    # the forward pass of this architecture
    model = model_class(cfg)(cfg, w, threads=threads, kv_types=kv_types)
    model.calibrate(calibrating)  # closes the model's threads if cancelled
    return LoadedModel(Path(path), cfg, n_params, tok, template, model)
