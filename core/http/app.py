"""The aiohttp application: llama-server's endpoints, OpenAI's, and the LoRA extras.

``create_app(engine, settings)`` builds it; the headless server and the GUI (on
its qasync loop) run the same app. The engine may be None while the model is
still loading: every endpoint then answers 503 ``unavailable_error``; call
``set_engine(app, engine)`` once it is ready.

The routes live by family: generation.py (llama-server's /completion, /infill,
/v1/stream), openai.py (/v1/completions, /v1/chat/completions), adapters.py (the
adapters and the global mix), service.py (health, props, models, slots, metrics),
text.py (tokenize, apply-template), embeddings.py and grid.py; what they share
(the app's state, pools, reading a request, running a generation) is plumbing.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from ..options import DEFAULT_BATCH, DEFAULT_HOST, DEFAULT_PORT
from ..serve.relay import LoopRelay
from ..serve.sampling import SamplingParams
from . import adapters, generation, openai, service, text
from . import endpoints as E
from . import streams as S
from .embeddings import embeddings
from .grid import grid
from .plumbing import (
    ADAPTER_POOL,
    ENGINE,
    LOAD_LOCK,
    METRICS,
    MIX_POOL,
    RELAY,
    REQUEST_LOG,
    SETTINGS,
    STREAMS,
    TEXT_POOL,
    TRAIN_POOL,
    BlockingPool,
    EngineBox,
)
from .security import add_cors_on_prepare, make_middlewares
from .webui import MARKDOWN_PATH, add_webui_routes

log = logging.getLogger("mixdesk.http")


@dataclass
class ServerSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)
    alias: str | None = None
    n_predict_default: int = -1
    n_batch: int = DEFAULT_BATCH  # -b: /infill fits its prefix and suffix in one batch
    verbose: bool = False
    max_body: int = 8 << 20
    lora_init_without_apply: bool = False
    on_log: Callable[[str], None] | None = None
    # POST /lora-adapters/load and /v1/load_lora_adapter open a path the client
    # names: off unless asked for, and then only inside these folders
    allow_runtime_lora: bool = False
    lora_dirs: list[Path] = field(default_factory=list)
    # a connection idle (or still sending its headers) this long is closed, and a
    # body must arrive within body_timeout: slow clients cannot hold connections
    idle_timeout: float = 30.0
    body_timeout: float = 60.0
    adapter_load_timeout: float = 120.0
    # the sampling flags (--temp, --seed, ...): what a request's absent fields take
    sampling: SamplingParams | None = None
    aliases: list[str] = field(default_factory=list)  # --alias a,b: /v1/models aliases
    tags: list[str] = field(default_factory=list)  # --tags
    slots: bool = True  # GET /slots (--no-slots: 501)
    slot_save_path: Path | None = None  # POST /slots/{id}?action=save|restore
    # a slot action on a busy slot waits for it (as llama-server's), then answers 409
    slot_wait: float = 600.0
    metrics: bool = False  # GET /metrics (--metrics)
    webui: bool = True  # the chat page at / and its assets (--no-webui / --no-ui: 404)

    @classmethod
    def from_args(cls, args) -> ServerSettings:
        from ..paths import data_dir
        from .security import default_lora_dirs

        allow = bool(getattr(args, "allow_runtime_lora", False))
        dirs = [Path(d) for d in getattr(args, "lora_dir", None) or []]
        if allow and not dirs:
            given = [p for p, _ in getattr(args, "adapters", [])]
            dirs = default_lora_dirs(given, data_dir() / "adapters")

        timeout = getattr(args, "timeout", None)
        save = getattr(args, "slot_save_path", None)
        return cls(
            host=args.host,
            port=args.port,
            api_keys=list(args.api_key or []),
            cors_origins=list(args.cors_origins or []),
            alias=args.alias,
            n_predict_default=args.n_predict,
            n_batch=getattr(args, "batch_size", None) or DEFAULT_BATCH,
            verbose=bool(args.verbose),
            lora_init_without_apply=bool(getattr(args, "lora_init_without_apply", False)),
            allow_runtime_lora=allow,
            lora_dirs=dirs,
            body_timeout=float(timeout) if timeout else 60.0,
            sampling=SamplingParams.from_args(args),
            aliases=list(getattr(args, "aliases", None) or []),
            tags=list(getattr(args, "tags", None) or []),
            slots=bool(getattr(args, "slots", True)),
            slot_save_path=Path(save) if save else None,
            metrics=bool(getattr(args, "metrics", False)),
            webui=bool(getattr(args, "webui", True)),
        )

    @property
    def hosts(self) -> list[str]:
        """--host may list several addresses (comma-separated): each one is bound."""
        return [h.strip() for h in self.host.split(",") if h.strip()] or [self.host]


def create_app(engine, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()

    def on_line(line: str) -> None:
        log.info("%s", line)
        if settings.on_log is not None:
            try:
                settings.on_log(line)
            except Exception:
                log.exception("on_log callback failed")

    app = web.Application(
        middlewares=make_middlewares(settings, on_line), client_max_size=settings.max_body
    )
    app[ENGINE] = EngineBox(engine)
    app[SETTINGS] = settings
    app[REQUEST_LOG] = on_line
    app[LOAD_LOCK] = asyncio.Lock() if _has_loop() else None  # created lazily otherwise
    app[ADAPTER_POOL] = BlockingPool(
        "adapter load", workers=2, queue=4, timeout=settings.adapter_load_timeout
    )
    # chat templates stop themselves (RenderLimits); the timeout is a backstop
    app[TEXT_POOL] = BlockingPool("text", workers=2, queue=64, timeout=60.0)
    # merge-method builds: one at a time (each already keeps both cores busy in BLAS),
    # a bounded queue (a client sending new seeds cannot pile up threads), and a build
    # that outlasts the timeout still lands in the mix cache for the retry
    app[MIX_POOL] = BlockingPool("mix build", workers=1, queue=16, timeout=600.0)
    # making a control vector: one at a time, none queued (a second is a 503 at once)
    app[TRAIN_POOL] = BlockingPool("control-vector training", workers=1, queue=0, timeout=900.0)
    app[METRICS] = E.Metrics()
    app[RELAY] = LoopRelay()  # bound to the serving loop by the first generation
    app[STREAMS] = S.StreamSessions()
    app.on_shutdown.append(_close_streams)
    app.on_response_prepare.append(add_cors_on_prepare)
    r = app.router
    r.add_get("/health", service.health)
    r.add_get("/v1/health", service.health)
    r.add_get("/props", service.props)
    r.add_get("/v1/models", service.models)
    r.add_get("/models", service.models)
    r.add_get("/lora-adapters", adapters.get_lora)
    r.add_post("/lora-adapters", adapters.post_lora)
    r.add_get("/mixdesk/mix", adapters.get_mixdesk_mix)
    r.add_post("/lora-adapters/load", adapters.lora_load)
    r.add_post("/lora-adapters/unload", adapters.lora_unload)
    r.add_post("/v1/load_lora_adapter", adapters.vllm_load)
    r.add_post("/v1/unload_lora_adapter", adapters.vllm_unload)
    r.add_get("/control-vectors", adapters.get_control_vectors)
    r.add_post("/control-vectors", adapters.post_control_vectors)
    r.add_post("/control-vectors/load", adapters.control_vectors_load)
    r.add_post("/control-vectors/unload", adapters.control_vectors_unload)
    r.add_post("/control-vectors/train", adapters.control_vectors_train)
    r.add_post("/completion", generation.completion)
    r.add_post("/completions", generation.completion)
    r.add_post("/v1/completions", openai.oai_completions)
    r.add_post("/chat/completions", openai.chat_completions)
    r.add_post("/v1/chat/completions", openai.chat_completions)
    r.add_post("/chat/completions/input_tokens", openai.chat_input_tokens)
    r.add_post("/v1/chat/completions/input_tokens", openai.chat_input_tokens)
    r.add_post("/tokenize", text.tokenize)
    r.add_post("/detokenize", text.detokenize)
    r.add_post("/apply-template", text.apply_template)
    r.add_get("/slots", service.slots)
    r.add_post("/slots/{id_slot}", service.slots_action)
    r.add_get("/metrics", service.metrics)
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        r.add_post(path, embeddings)
    r.add_post("/infill", generation.infill)
    r.add_get("/v1/stream", generation.stream_replay)
    r.add_delete("/v1/stream", generation.stream_delete)
    r.add_post("/v1/streams/lookup", generation.streams_lookup)
    r.add_post("/mixdesk/grid", grid)  # the X/Y grid of mixes (#21)
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        r.add_post(path, service.rerank)
    if settings.webui:
        add_webui_routes(r)  # the chat page at / (llama-server's web UI)
        r.add_post(MARKDOWN_PATH, text.markdown)  # its replies' Markdown
    return app


async def _close_streams(app: web.Application) -> None:
    app[STREAMS].close()  # producers cancelled, replay readers woken


def set_engine(app: web.Application, engine) -> None:
    """Hand the app its engine once the model is loaded (until then: 503)."""
    app[ENGINE].engine = engine


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
