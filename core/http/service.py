"""The service routes: ``/health``, ``/props``, ``/models`` (and OpenAI's ``/v1/models``),
``/slots`` and its actions, ``/metrics``, and the reranking routes Mixdesk answers 501."""

from __future__ import annotations

from aiohttp import web

from ..errors import HttpError
from ..serve.sampling import SamplingParams
from ..version import version
from . import endpoints as E
from . import responses as R
from .build_info import build_info
from .plumbing import ENGINE, METRICS, get_engine, get_settings, json_body, model_id


async def health(request: web.Request) -> web.Response:
    ok, reason = get_engine(request).health()  # 503 unless the engine loop is serving
    if not ok:
        raise HttpError(reason, 503, "unavailable_error")
    return web.json_response({"status": "ok"})


async def props(request: web.Request) -> web.Response:
    eng = get_engine(request)
    s = get_settings(request)
    mid = model_id(request, eng)
    params = s.sampling or SamplingParams(n_predict=s.n_predict_default)
    lora = R.mix_to_lora(eng.get_mix())
    return web.json_response(
        {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": eng.ctx_size,
                "speculative": False,
                "is_processing": False,
                "params": R.generation_settings(params, eng.ctx_size, mid, False, lora),
            },
            "total_slots": eng.n_parallel,
            "model_path": str(eng.path),
            "model_alias": mid,
            "chat_template": eng.chat_template.source if eng.chat_template else "",
            "chat_template_caps": {},
            "bos_token": eng.chat_template.bos_token if eng.chat_template else "",
            "eos_token": eng.chat_template.eos_token if eng.chat_template else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": build_info(),
            "mixdesk_version": version(),  # ours; llama-server's fields above are unchanged
            "is_sleeping": False,
            "lora_init_without_apply": s.lora_init_without_apply,
            # ours: the loaded control vectors ({id, path, scale, ...}, GET
            # /control-vectors) and the layers they steer (START, END; <= 0: default)
            "control_vectors": eng.control_vectors(),
            "control_vector_layer_range": list(eng.lora.vector_range),
        }
    )


async def models(request: web.Request) -> web.Response:
    eng = get_engine(request)
    s = get_settings(request)
    return web.json_response(
        R.models_list(
            model_id(request, eng),
            request.app[ENGINE].model_info(),
            eng.adapters(),
            aliases=s.aliases,
            tags=s.tags,
        )
    )


async def slots(request: web.Request) -> web.Response:
    """GET /slots (--no-slots: 501); ?fail_on_no_slot answers 503 when all are busy."""
    s = get_settings(request)
    if not s.slots:
        raise E.not_supported(
            "This server does not support slots endpoint. Start it with `--slots`"
        )
    eng = get_engine(request)
    if "fail_on_no_slot" in request.query and E.idle_slots(eng) == 0:
        raise HttpError("no slot available", 503, "unavailable_error")
    return web.json_response(E.slots_list(eng))


async def slots_action(request: web.Request) -> web.Response:
    eng = get_engine(request)
    action = request.query.get("action")
    body = await json_body(request) if action in ("save", "restore") else {}
    out = await E.slot_action(
        eng, get_settings(request), request.match_info["id_slot"], action, body
    )
    return web.json_response(out)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text with llama-server's names (--metrics; else 501)."""
    if not get_settings(request).metrics:
        raise E.not_supported(
            "This server does not support metrics endpoint. Start it with `--metrics`"
        )
    eng = get_engine(request)
    return web.Response(
        text=request.app[METRICS].prometheus(eng.stats()),
        content_type="text/plain",
        charset="utf-8",
        headers={"Process-Start-Time-Unix": str(E.PROCESS_START)},
    )


async def rerank(request: web.Request) -> web.Response:
    raise E.not_supported("This server does not support reranking. Start it with `--reranking`")
