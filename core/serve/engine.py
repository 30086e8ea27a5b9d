"""The one engine that owns the model: adapters, the global mix, and the scheduler.

The GUI, the HTTP API and the CLI all talk to one :class:`Engine`. It never
imports Qt. Long work (loading a model) runs on the caller's thread and reports
progress through a callback; generation runs on the scheduler thread, which
either :meth:`Engine.start` creates, or a host thread (the GUI's QThread) drives
by calling :meth:`Engine.run_loop`.

Observers subscribe to typed events (core/serve/events.py) with
:meth:`Engine.subscribe`; callbacks run on whichever thread made the change, so GUI
code must marshal to its own thread (the worker bridge does this with queued signals).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..chat_template import DEFAULT_CHAT, ChatDefaults, ChatTemplate, build_prompt, encode_prompt
from ..errors import EngineError
from ..lora.adapter import Adapter, AdapterError
from ..lora.alora import alora_of, base_positions
from ..lora.merge import MergeSpec
from ..lora.mix import Mix, MixKey
from ..lora.registry import LORA_SCALE_MAX, AdapterRegistry
from ..model.config import ModelConfig
from ..model.kv_cache import ContextOverflow, kv_bytes, ram_bytes
from ..model.llama import LlamaModel
from ..model.weights import (
    LoadCancelled,
    ModelLoadError,
)
from ..options import EngineOptions
from ..tokenizer import Tokenizer
from .embeddings import check_inputs, hidden_states
from .events import (
    AdaptersChanged,
    AdaptersDropped,
    ChannelMeter,
    EngineEvent,
    MixBuilding,
    MixChanged,
    ModelError,
    ModelLoaded,
    ModelLoading,
    PromptProgress,
    RequestFinished,
    RequestStarted,
    VectorsChanged,
)
from .loader import LOAD_CALIBRATED, LOAD_KV_DONE, load_model
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, validate
from .scheduler import (
    DoneEvent,
    Event,
    MeterEvent,
    PromptProgressEvent,
    Request,
    Scheduler,
    TokenEvent,
)
from .score import ScoreError, ScoreJob, TokenScore, check_job, score_many

log = logging.getLogger(__name__)

Listener = Callable[[EngineEvent], None]
LOOP_RESTART_S = 0.1  # pause before the engine loop is restarted after it raised


class Engine:
    def __init__(self, options: EngineOptions | None = None):
        """An engine with no model yet. ``options`` is the one options object
        (core/options.py: built from the flags by EngineOptions.from_args); its
        ``chat_template`` source replaces every loaded model's own template."""
        o = self.options = options or EngineOptions()
        self.weights = o.weights  # "quantized": GGUF blocks in memory; "f32": dequantized
        self.activations = o.activations  # --activations, asked for ("q8" needs VNNI)
        self.mmap = o.mmap  # --mmap: quantized weights served from the file's map
        self.kv_types = (o.cache_type_k, o.cache_type_v)  # -ctk/-ctv: keys', values' storage
        self.embeddings = o.embeddings  # --embedding, --pooling, -ub
        self.requested_ctx = o.ctx_size  # 0: the model's training context
        self.context_shift = o.context_shift  # a full context drops old tokens
        self.ctx_size = o.ctx_size  # the model's context once loaded (requested_ctx or its own)
        self.n_parallel = o.n_parallel
        self.draft_max = o.draft_max  # prompt-lookup speculative decoding (0: off)
        self.threads = o.threads  # compute threads (None: the BLAS thread count)
        self.path: Path | None = None
        self.config: ModelConfig | None = None
        self.n_params = 0
        self.model: LlamaModel | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat_template: ChatTemplate | None = None
        self.template_source = o.chat_template  # None: each model's own template
        # --reasoning, --chat-template-kwargs
        self.chat_defaults: ChatDefaults = o.chat_defaults or DEFAULT_CHAT
        self.loading = False
        self.load_progress = 0.0
        self.load_ms = 0.0
        # the adapters, the global mix, built mixes and adapter stacks (core/lora/registry.py)
        self.lora = AdapterRegistry()
        self.lora.set_vector_range(*o.control_vector_layer_range)
        self._option_vectors = list(o.control_vectors)  # loaded with the first model
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self.prefix = PrefixCache(o.prefix_cache_bytes)
        self.scheduler: Scheduler | None = None
        self._thread: threading.Thread | None = None
        self._requests: dict[int, Request] = {}
        # channel meters (core/lora/meter.py): requests submitted while on are metered
        # and listeners get ChannelMeter events; the window turns them on
        self.meters = False

    # -- construction --------------------------------------------------------
    @classmethod
    def from_path(
        cls, path: str | Path, options: EngineOptions | None = None, start: bool = True
    ) -> Engine:
        eng = cls(options)
        eng.load_model(path)
        if start:
            eng.start()
        return eng

    # -- events -----------------------------------------------------------------
    def subscribe(self, fn: Listener) -> Callable[[], None]:
        """Call ``fn(event)`` with each EngineEvent (core/serve/events.py), on the thread
        that made the change; returns the call that unsubscribes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _notify(self, event: EngineEvent) -> None:
        for fn in list(self._listeners):
            try:
                fn(event)
            except Exception:
                log.exception("listener failed on %s", type(event).__name__)

    # -- model --------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.model is not None and not self.loading

    def load_model(
        self,
        path: str | Path,
        progress: Callable[[float, str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> ModelConfig:
        """Load (or replace) the base model. Raises ModelLoadError with a clear message;
        on failure the previously loaded model stays in service. On a reload the
        adapters that fit the new model stay registered with their ids and scales;
        the others are unloaded and announced by an "adapters_dropped" event
        ({id, name, path, error} each)."""
        t0 = time.perf_counter()
        self.loading = True
        self._notify(ModelLoading(path=str(path), progress=0.0, message="opening"))

        def report(frac: float, msg: str) -> None:
            self.load_progress = frac
            if progress:
                progress(frac, msg)
            self._notify(ModelLoading(path=str(path), progress=frac, message=msg))

        def check() -> None:  # Cancel works until the new model is swapped in
            if cancel is not None and cancel.is_set():
                raise LoadCancelled()

        try:
            got = load_model(
                path,
                report,
                check,
                cancel,
                weights=self.weights,
                activations=self.activations,
                threads=self.threads,
                mmap=self.mmap,
                kv_types=self.kv_types,
                template_source=self.template_source,
            )
            model, cfg = got.model, got.cfg
            tok, template, n_params = got.tokenizer, got.template, got.n_params
            ctx = self.requested_ctx or cfg.ctx_len
            try:
                report(LOAD_CALIBRATED, "reserving the KV cache")
                scheduler = self._new_scheduler(model, tok, path, cfg, ctx)
                if self.lora:
                    report(LOAD_KV_DONE, "checking the adapters against the model")
                kept, dropped = self.lora.refit(cfg, check)
                check()  # the last point where Cancel is honoured
            except BaseException:
                model.lin.close()  # its helper threads would outlive a failed load
                raise
        except BaseException as e:
            self.loading = False
            cancelled = isinstance(e, LoadCancelled)
            self._notify(ModelError(path=str(path), error=str(e), cancelled=cancelled))
            raise
        was_running = self._thread is not None
        self.stop()
        with self._lock:
            self.path, self.config, self.n_params = Path(path), cfg, n_params
            self.ctx_size = ctx
            if self.model is not None:
                self.model.lin.close()
            self.model = model
            self.tokenizer, self.chat_template = tok, template
            self.prefix.clear()
            # ids stay: an adapter removed while the model loaded is not brought back
            had_vectors = bool(self.lora.vector_ids())  # bind drops those that do not fit
            before = self.lora.bind(cfg, kept)
            dropped = [d for d in dropped if d["id"] in before]
            scheduler.stacks = self.lora.stacks
            self.scheduler = scheduler
        self.load_ms = (time.perf_counter() - t0) * 1e3
        log.info(
            "loaded %s in %.0f ms; small-batch products: %s",
            Path(path).name,
            self.load_ms,
            model.lin.describe(),
        )
        self.loading = False
        self._notify(ModelLoaded(info=self.model_info()))
        if before:
            self._notify(AdaptersChanged(adapters=self.adapters()))
        if dropped:
            self._notify(AdaptersDropped(dropped=dropped))
        if had_vectors:
            self._notify(VectorsChanged(vectors=self.control_vectors(), source="reload"))
        # --control-vector(-scaled), with the first model: a bad file raises here once
        # (the headless server stops with its message), the model stays loaded
        while self._option_vectors:
            fname, scale = self._option_vectors.pop(0)
            self.add_control_vector(fname, scale)
        if was_running:
            self.start()
        return cfg

    def _new_scheduler(
        self, model: LlamaModel, tok: Tokenizer, path: str | Path, cfg: ModelConfig, ctx: int
    ) -> Scheduler:
        try:
            # the KV pool reserves address space for every slot's whole context
            return Scheduler(
                model,
                tok,
                self.prefix,
                ctx,
                self.n_parallel,
                draft_max=self.draft_max,
                context_shift=self.context_shift,
                # llama-server evaluates a prompt in physical batches of min(-b, -ub)
                prefill_chunk=self.embeddings.ubatch,
            )
        except (MemoryError, OSError) as e:
            gb = 2 * cfg.n_layers * cfg.kv_dim * 4 * ctx * self.n_parallel / 1e9
            raise ModelLoadError(
                f"{Path(path).name}: cannot reserve the KV cache for {self.n_parallel} "
                f"sequences of {ctx} tokens ({gb:.1f} GB): {e}. Lower -c/--ctx-size or "
                f"-np/--parallel."
            ) from None

    def model_info(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        c = self.config
        kv = self.model.kv_types
        return {
            "path": str(self.path),
            "name": c.name,
            "arch": c.arch,
            "n_params": self.n_params,
            "quant": c.file_type,
            "n_ctx_train": c.ctx_len,
            "n_ctx": self.ctx_size,
            "n_layers": c.n_layers,
            "dim": c.dim,
            "n_vocab": c.vocab_size,
            "n_kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "memory_bytes": self.model.w.nbytes,  # the weights as held
            # one sequence's keys and values at n_ctx (kv_bytes, as Get a model counts)
            "kv_bytes": kv_bytes(c.n_layers, c.n_kv_heads, c.head_dim, self.ctx_size, 1, kv),
            # the two together (ram_bytes: the model bar's and Get a model's one figure)
            "ram_bytes": ram_bytes(
                self.model.w.nbytes, c.n_layers, c.n_kv_heads, c.head_dim, self.ctx_size, 1, kv
            ),
            # how the KV cache stores keys and values (-ctk/-ctv): "f32" or "f16" each
            "cache_type_k": kv[0],
            "cache_type_v": kv[1],
            # "quantized" (GGUF blocks, compiled kernels) or "f32"; tensors of a type
            # without kernels that a quantized load holds as float32 {name: type}
            "weights": self.model.w.storage,
            # what quantized weights are multiplied by, in force: "f32" or "q8"
            "activations": self.model.w.activations,
            # quantized blocks served from the file's memory map (--mmap, little free
            # memory, types without kernels) rather than read into memory
            "mapped": self.model.w.mapped,
            "f32_tensors": dict(self.model.w.f32_tensors or {}),
            "load_ms": self.load_ms,
            "chat_template": self.chat_template.source if self.chat_template else "",
        }

    def require_ready(self) -> None:
        if not self.ready:
            raise EngineError(
                "Loading model" if self.loading else "no model loaded",
                type="unavailable_error",
                code=503,
            )

    # -- adapters (core/lora/registry.py; the engine adds events and the prefix cache) ----
    def add_adapter(self, path: str | Path, scale: float = 0.0, name: str | None = None) -> int:
        """Load and validate an adapter; returns its id (stable for the session).
        Raises AdapterError naming the adapter; nothing changes on failure."""
        self.require_ready()
        aid = self.lora.add(path, scale, name).id
        self._notify(AdaptersChanged(adapters=self.adapters()))
        return aid

    def remove_adapter(self, aid: int) -> None:
        with self._lock:
            self.lora.remove(aid)
            self.prefix.forget_adapter(aid)
        self._notify(AdaptersChanged(adapters=self.adapters()))
        mix = self.get_mix()
        self._notify(MixChanged(mix=mix, source="unload", merge=mix.merge.as_dict()))

    def adapter(self, aid: int) -> Adapter:
        return self.lora.get(aid)

    def adapters(self) -> list[dict[str, Any]]:
        """llama-server's GET /lora-adapters entries, plus our extra info fields. An
        aLoRA's carry llama-server's ``alora_invocation_tokens`` and
        ``alora_invocation_string`` (the tokens' text)."""
        out = self.lora.listing()
        for info in out:
            tokens = info.get("invocation_tokens")
            if tokens:
                info["alora_invocation_tokens"] = list(tokens)
                info["alora_invocation_string"] = (
                    self.tokenizer.decode(tokens, strip_prefix_space=False)
                    if self.tokenizer is not None
                    else ""
                )
        return out

    # -- control vectors (core/lora/control.py, registered beside the adapters) ---------
    def add_control_vector(self, path: str | Path, scale: float = 1.0) -> int:
        """Load and check a control vector, steering every request that names no vectors
        at ``scale``; returns its id. ControlVectorError, nothing changed, on failure."""
        self.require_ready()
        vid = self.lora.add_vector(path, scale).id
        self._notify(VectorsChanged(vectors=self.control_vectors(), source="load"))
        return vid

    def remove_control_vector(self, vid: int) -> None:
        with self._lock:
            self.lora.remove_vector(vid)
        self._notify(VectorsChanged(vectors=self.control_vectors(), source="unload"))

    def control_vectors(self) -> list[dict[str, Any]]:
        """GET /control-vectors: {id, path, name, layers, model_hint, scale} each."""
        return self.lora.vector_listing()

    def steering(self) -> tuple[list[tuple[Any, float]], tuple[int, int]]:
        """The global mix's control vectors at their non-zero scales, (ControlVector,
        scale), and the inclusive layers they steer."""
        return self.lora.steering()

    def set_control_vector_range(self, start: int, end: int) -> None:
        """--control-vector-layer-range START END (inclusive; <= 0: llama.cpp's default)."""
        self.lora.set_vector_range(start, end)

    def set_control_vectors(
        self, scales: Mapping[int, float], replace: bool = True, source: str = "api"
    ) -> None:
        """Set the global vectors' scales (unlisted ones to 0 with ``replace``)."""
        self.lora.set_vectors(scales, replace)
        self._notify(VectorsChanged(vectors=self.control_vectors(), source=source))

    # -- the global mix ---------------------------------------------------------------
    def get_mix(self) -> Mix:
        """The global mix: {id: scale} (a dict) with its method as ``.merge``."""
        return self.lora.get_mix()

    def set_mix(
        self,
        scales: Mapping[int, float],
        source: str = "api",
        replace: bool = True,
        merge: MergeSpec | None = None,
    ) -> None:
        """Set the global mix. With replace, unlisted adapters go to 0. ``merge`` (or, if
        None, a Mix's own ``.merge``) sets its method; neither keeps the method it has.
        O(#adapters): nothing model-sized happens here (a merged mix is built on first use)."""
        merge = merge if merge is not None else getattr(scales, "merge", None)
        mix, spec = self.lora.set_mix(scales, replace, merge)
        self._notify(MixChanged(mix=mix, source=source, merge=spec.as_dict()))

    def stats(self) -> dict[str, Any]:
        """Scheduler load: running and queued sequences, forward steps so far, cache use."""
        s = self.scheduler
        return {
            "active": len(s.active) if s else 0,
            "queued": s.queue.qsize() if s else 0,
            "steps": s.steps if s else 0,
            "n_parallel": self.n_parallel,
            "prefix_cache_entries": self.prefix.n_entries,
            "prefix_cache_hits": self.prefix.hits,
            "prefix_cache_misses": self.prefix.misses,
            "draft_tokens": s.drafted if s else 0,
            "draft_accepted": s.accepted if s else 0,
        }

    def health(self) -> tuple[bool, str]:
        """(ok, reason): ok only when a model is loaded and the scheduler loop is
        serving, so that GET /health never says "ok" while no request would run."""
        if self.loading:
            return False, "Loading model"
        sched = self.scheduler
        if self.model is None or sched is None:
            return False, "no model loaded"
        if not sched.running:
            return False, "the engine loop is not running: requests would not be served"
        return True, "ok"

    # -- generation ---------------------------------------------------------------------
    def start(self) -> None:
        """Run the scheduler on a background thread (headless, tests, CLI)."""
        if self.scheduler is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self.run_loop, name="mixdesk-engine", daemon=True)
        self._thread.start()

    def run_loop(self) -> None:
        """Blocking scheduler loop; a GUI QThread may call this instead of start().
        The scheduler survives a failing step by itself; should its loop still raise,
        it is restarted (after a short pause) until stop()."""
        sched = self.scheduler
        if sched is None:
            return
        sched._stop.clear()
        while True:
            try:
                sched.run()
                return
            except Exception:
                log.exception("engine loop failed; restarting it")
                if sched._stop.wait(LOOP_RESTART_S):
                    return

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def run_on_engine(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(model)`` on the engine thread, between scheduler steps, and return a
        Future of its result: the way to run a forward pass that is not a generation
        (scoring a text under a mix, embeddings) without racing the scheduler for the
        model's buffers. Raises EngineError (503) with no model loaded."""
        self.require_ready()
        model = self.model
        return self.scheduler.call(lambda: fn(model))

    def score(
        self, tokens: list[int], mix: Mapping[int, float] | None, start: int, top_k: int = 5
    ) -> list[TokenScore]:
        """Teacher-force ``tokens`` (prompt + reply, the reply from index ``start``)
        under ``mix`` (None: the global mix): per reply token, the mix's top_k and the
        logprob of the token that is there. Blocks until the engine thread ran it."""
        return self.score_many([(tokens, mix, start)], top_k)[0]

    def score_many(
        self, jobs: list[tuple[list[int], Mapping[int, float] | None, int]], top_k: int = 5
    ) -> list[list[TokenScore]]:
        """``score`` for several (tokens, mix, start) at once, run as one batch (the A/B
        diff view scores both replies under both mixes). Bad input is an EngineError."""
        self.require_ready()
        built = []
        for tokens, mix, start in jobs:
            job = ScoreJob(list(tokens), self._built_mix(mix)[1], int(start))
            try:
                check_job(job, self.config.vocab_size, self.ctx_size)
            except ScoreError as e:
                raise EngineError(str(e)) from None
            built.append(job)
        tokenizer = self.tokenizer
        return self.run_on_engine(lambda model: score_many(model, tokenizer, built, top_k)).result()

    def _built_mix(self, mix: Mapping[int, float] | None) -> tuple[MixKey, Any]:
        """A mix (None: the global mix, snapshotted now) as its key and built weights."""
        return self.lora.built(mix, self._build_progress)

    def mixes_built(self, mixes: Iterable[Mapping[int, float] | None]) -> bool:
        """Whether every mix (None: the global mix) is built already, so that a submit
        under them builds nothing. An unknown adapter counts as built: the submit
        itself refuses it, at once."""
        return self.lora.is_built(mixes)

    def prepare_mixes(self, mixes: Iterable[Mapping[int, float] | None]) -> None:
        """Build every mix that is not built yet, in the calling thread. A merge
        method's build takes seconds, so the HTTP server calls this in a worker
        thread before it submits (core/http/plumbing.py ``mixes_ready``): its event loop,
        the GUI's too, keeps answering meanwhile. Errors are left to the submit."""
        for mix in mixes:
            try:
                self._built_mix(mix)
            except EngineError:
                pass

    def _build_progress(self, merge: MergeSpec | None):
        """Listeners hear how a merged mix's first build goes (MixBuilding events)."""
        if merge is None or not merge.builds:
            return None
        return lambda frac, msg: self._notify(
            MixBuilding(method=merge.method, progress=frac, message=msg)
        )

    def embed(
        self, inputs: list[list[int]], mix: Mapping[int, float] | None = None
    ) -> concurrent.futures.Future:
        """The final hidden states (n_i, d) of every input under ``mix`` (None: the
        global mix, snapshotted now), as a Future: the forward runs on the engine
        thread. Bad input (empty, too long, a token outside the vocabulary) raises
        EmbeddingError here, before anything is queued."""
        self.require_ready()
        ubatch = self.embeddings.ubatch
        check_inputs(inputs, self.config.vocab_size, self.ctx_size, ubatch)
        weights = self._built_mix(mix)[1]
        batch = [list(ids) for ids in inputs]
        return self.run_on_engine(lambda model: hidden_states(model, batch, weights, ubatch))

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_event: Callable[[Event], None],
        mix: Mapping[int, float] | None = None,
        cache_prompt: bool = True,
        source: str = "",
        progress: bool = False,
        id_slot: int = -1,
    ) -> Request:
        """Queue a generation. ``mix`` None means the global mix, snapshotted now:
        later mix changes do not alter this request (llama.cpp #10374). With
        ``progress``, on_event also gets a PromptProgressEvent per prompt chunk.
        ``id_slot``: run in that KV slot when it is free (llama-server's id_slot)."""
        got = self.submit_many(
            [
                dict(
                    prompt=prompt,
                    params=params,
                    on_event=on_event,
                    mix=mix,
                    cache_prompt=cache_prompt,
                    source=source,
                    progress=progress,
                    id_slot=id_slot,
                )
            ]
        )[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def submit_many(self, jobs: list[dict]) -> list[Request | Exception]:
        """Queue several generations (each a dict of ``submit``'s arguments) so that the
        scheduler admits them in the same step: every mix is built and every request
        checked first, then all are queued at once. A/B compare uses this so that side
        B never starts a step (a whole prefill) after side A. A refused job comes back
        as its exception (EngineError, ...) and the others still run. With no model
        loaded, raises EngineError (503, "unavailable_error")."""
        self.require_ready()
        results: list[Request | Exception] = []
        for job in jobs:
            try:
                req = self._request(**job)
                try:
                    self.scheduler.check(req)
                except ContextOverflow as e:
                    raise EngineError(str(e), type="exceed_context_size_error") from None
                results.append(req)
            except Exception as e:
                results.append(e)
        reqs = [r for r in results if isinstance(r, Request)]
        self.scheduler.submit_many(reqs)
        for req in reqs:
            self._notify(
                RequestStarted(
                    id=req.id,
                    source=req.source,
                    mix=dict(req.mix),
                    prompt_n=len(req.prompt),
                )
            )
        return results

    def _request(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_event: Callable[[Event], None],
        mix: Mapping[int, float] | None = None,
        cache_prompt: bool = True,
        source: str = "",
        progress: bool = False,
        id_slot: int = -1,
    ) -> Request:
        self.require_ready()
        validate(params)
        if not -1 <= id_slot < self.n_parallel:
            raise EngineError(f"invalid id_slot {id_slot}: the server has {self.n_parallel} slots")
        if not prompt:
            raise EngineError("the prompt is empty")
        bad = [t for t in prompt if not (0 <= t < self.config.vocab_size)]
        if bad:
            raise EngineError(
                f"prompt contains invalid token id {bad[0]} "
                f"(vocabulary has {self.config.vocab_size})"
            )
        key, weights = self._built_mix(mix)
        key, weights, base_until, (base_key, base_weights) = self._alora(key, weights, prompt)
        ids: list[int] = []

        def relay(ev: Event) -> None:
            if isinstance(ev, MeterEvent):  # for listeners (the desk) only
                self._notify(
                    ChannelMeter(
                        id=ids[0] if ids else -1,
                        source=source,
                        values=ev.values,
                        vectors=ev.vectors,
                    )
                )
                return
            if isinstance(ev, PromptProgressEvent):
                # listeners (the window) hear of every evaluated chunk; the caller gets
                # them, and the report at admission, only if it asked
                if not ev.start:
                    self._notify(
                        PromptProgress(
                            id=ids[0] if ids else -1, source=source, done=ev.done, total=ev.total
                        )
                    )
                if progress:
                    on_event(ev)
                return
            if isinstance(ev, DoneEvent):
                # listeners first: whoever hears the reply end (the chat pane) then finds
                # the window already told, so no strip is still lit after the reply
                self._notify(
                    RequestFinished(
                        id=ids[0] if ids else -1,
                        source=source,
                        stop_type=ev.stop_type,
                        predicted_n=ev.timings.predicted_n,
                        timings=ev.timings.as_dict(),
                        error=ev.error,
                    )
                )
            on_event(ev)

        req = Request(list(prompt), params, key, weights, relay, cache_prompt, source)
        req.base_until, req.base_mix, req.base_weights = base_until, base_key, base_weights
        if self.meters and weights is not None:
            try:
                req.meter_parts = self.lora.meter_parts(key)
                req.meter_vectors = self.lora.meter_vectors(key)
            except Exception:  # a meter must never cost the user a reply
                log.exception("could not build the channel meters of mix %s", key)
        req.progress = True  # relay() turns each chunk into a PromptProgress for listeners
        req.id_slot = id_slot
        ids.append(req.id)
        return req

    def _alora(self, key: MixKey, weights, prompt: list[int]) -> tuple[MixKey, Any, int, tuple]:
        """A mix whose adapters are one aLoRA, as llama-server runs it
        (core/lora/alora.py): (key, weights, leading prompt positions off the aLoRA,
        (key, weights) those positions run under). Off the aLoRA is the mix's control
        vectors alone, or the base model: llama-server's vectors steer every position.
        Without its invocation in the prompt, the whole request runs so."""
        if weights is None:
            return key, weights, 0, ((), None)
        alora = alora_of(key, {aid: self.adapter(aid) for aid, _ in key})
        if alora is None:
            return key, weights, 0, ((), None)
        off = self.lora.vectors_only(key)
        n = base_positions(alora, prompt)
        if n is None:
            return *off, 0, off
        return key, weights, n, off

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        mix: Mapping[int, float] | None = None,
        cache_prompt: bool = True,
        source: str = "",
        progress: bool = False,
    ) -> Iterator[Event]:
        """Synchronous generator of events for one request (CLI, tests, scripts).
        Closing the generator early cancels the request."""
        q: queue.Queue[Event] = queue.Queue()
        req = self.submit(
            prompt,
            params,
            q.put,
            mix=mix,
            cache_prompt=cache_prompt,
            source=source,
            progress=progress,
        )
        try:
            while True:
                ev = q.get()
                yield ev
                if isinstance(ev, DoneEvent):
                    return
        finally:
            req.cancel()

    def complete(
        self,
        prompt: list[int],
        params: SamplingParams,
        mix: Mapping[int, float] | None = None,
        **kw,
    ) -> DoneEvent:
        done = None
        for ev in self.generate(prompt, params, mix=mix, **kw):
            if isinstance(ev, DoneEvent):
                done = ev
        if done.stop_type == "error":
            kind = done.error_type or "server_error"
            raise EngineError(done.error or "generation failed", type=kind, code=500)
        return done

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The prompt tokens llama-server builds for these messages (the one prompt
        path, shared with the HTTP API: chat_template.build_prompt)."""
        self.require_ready()
        text = build_prompt(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            defaults=self.chat_defaults,
        )
        return encode_prompt(self.tokenizer, text)

    def chat(
        self,
        messages: list[dict],
        mix: Mapping[int, float] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        **params,
    ) -> str:
        """One chat reply as a string (scripts and the demo-adapter evaluation)."""
        p = SamplingParams(temperature=temperature, n_predict=max_tokens, **params)
        return self.complete(self.chat_prompt(messages), p, mix=mix).content


__all__ = [
    "Engine",
    "LORA_SCALE_MAX",
    "EngineError",
    "AdapterError",
    "ModelLoadError",
    "SamplingParams",
    "TokenEvent",
    "DoneEvent",
    "PromptProgressEvent",
    "Event",
    "Request",
    "MixKey",
]
