"""The adapter routes: llama-server's ``/lora-adapters`` (list them, set the global
mix), Mixdesk's ``/mixdesk/mix`` and runtime loading (``/lora-adapters/load|unload``,
behind ``--allow-runtime-lora``), vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, and the control vectors shaped like ``/lora-adapters``:
``GET|POST /control-vectors`` and ``/control-vectors/load|unload`` (same opt-in and
path policy as adapters), and ``POST /control-vectors/train``, which makes one from
prompt pairs (core/lora/vector_train.py) on its own one-at-a-time pool."""

from __future__ import annotations

import asyncio
import re

from aiohttp import web

from ..errors import HttpError, UserError
from . import parsing as P
from . import responses as R
from .plumbing import (
    ADAPTER_POOL,
    LOAD_LOCK,
    TRAIN_POOL,
    adapter_ids,
    get_engine,
    get_settings,
    json_body,
    read_body,
)
from .security import adapter_path, printable, runtime_lora_off


async def get_lora(request: web.Request) -> web.Response:
    eng = get_engine(request)
    return web.json_response([R.lora_adapter_entry(a) for a in eng.adapters()])


async def post_lora(request: web.Request) -> web.Response:
    """Set the global mix. Validated in full first: an invalid body changes nothing."""
    eng = get_engine(request)
    body = P.parse_json_any(await read_body(request))
    mix = P.parse_lora(body, "lora-adapters", adapter_ids(eng))
    eng.set_mix(mix, source="http")
    return web.json_response({"success": True})


async def get_mixdesk_mix(request: web.Request) -> web.Response:
    """The global mix in POST /lora-adapters' object form: {"adapters": [{"id", "scale"}],
    "method", and the method's parameters} (GET /lora-adapters stays llama-server's)."""
    eng = get_engine(request)
    mix = eng.get_mix()
    return web.json_response({"adapters": R.mix_to_lora(mix), **mix.merge.as_dict()})


def _load_lock(app: web.Application) -> asyncio.Lock:
    if app[LOAD_LOCK] is None:
        app[LOAD_LOCK] = asyncio.Lock()
    return app[LOAD_LOCK]


_BYTES_LITERAL = re.compile(r"(?<!\w)b'(?:[^'\\]|\\.)*'" + r'|(?<!\w)b"(?:[^"\\]|\\.)*"')


def _no_file_bytes(message: str) -> str:
    """An error about a file a client named must not quote the file's bytes
    (``bad magic b'root'`` told anyone the start of any readable file)."""
    return _BYTES_LITERAL.sub("<bytes not shown>", message)


def _add_adapter(eng, path, scale: float, name: str | None) -> dict:
    """Load (blocking) and return the new adapter's entry, read in the same breath,
    so an unload of the new id racing this load cannot leave us without it."""
    aid = eng.add_adapter(path, scale, name)
    info = next((a for a in eng.adapters() if a["id"] == aid), None)
    if info is None:
        raise HttpError(
            f"adapter {aid} was unloaded by another request while it was being loaded",
            409,
            "invalid_request_error",
        )
    return info


def _require_runtime_changes(request: web.Request) -> None:
    """Loading and unloading change the server's adapter set: both need
    --allow-runtime-lora (a 403 otherwise)."""
    if not get_settings(request).allow_runtime_lora:
        raise runtime_lora_off()


async def _load_adapter(request: web.Request, path: str, scale: float, name: str | None) -> dict:
    s = get_settings(request)
    _require_runtime_changes(request)
    eng = get_engine(request)
    target = adapter_path(path, s.lora_dirs)
    async with _load_lock(request.app):  # one load at a time: names stay unique
        if name is not None and any(a.get("name") == name for a in eng.adapters()):
            raise HttpError(f"an adapter named {name!r} is already loaded")
        return await _run_load(request, path, _add_adapter, eng, target, scale, name)


async def _run_load(request: web.Request, path: str, fn, *args) -> dict:
    """``fn(*args)`` (a blocking load of the file the client named) on the adapter pool;
    the file's fault is a 400 that never quotes the file's bytes."""
    try:
        return await request.app[ADAPTER_POOL].run(fn, *args)
    except HttpError:
        raise
    except UserError as e:  # AdapterError, ControlVectorError, GGUFError: the file's
        raise HttpError(_no_file_bytes(str(e))) from None
    except OSError as e:
        raise HttpError(
            f"{printable(path)}: cannot read it ({e.strerror or type(e).__name__})"
        ) from None


async def lora_load(request: web.Request) -> web.Response:
    """POST /lora-adapters/load {"path", "scale"?, "name"?} -> the new GET entry."""
    body = await json_body(request)
    path = P.get_str(body, "path", required=True)
    default = 0.0 if get_settings(request).lora_init_without_apply else 1.0
    scale = P.get_float(body, "scale", default)
    name = P.get_str(body, "name")
    info = await _load_adapter(request, path, scale, name)
    return web.json_response(R.lora_adapter_entry(info))


async def _unload_by_id(request: web.Request, remove) -> web.Response:
    """``{"id"}`` -> ``remove(id)``: /lora-adapters/unload and /control-vectors/unload."""
    _require_runtime_changes(request)
    body = await json_body(request)
    uid = P.get_int(body, "id", None)
    if uid is None:
        raise HttpError('"id" is required')
    remove(uid)
    return web.json_response({"success": True})


async def lora_unload(request: web.Request) -> web.Response:
    return await _unload_by_id(request, get_engine(request).remove_adapter)


async def vllm_load(request: web.Request) -> web.Response:
    """vLLM: {"lora_name", "lora_path"}. Loaded at scale 0: as in vLLM, it applies
    only to requests whose "model" names it."""
    body = await json_body(request)
    name = P.get_str(body, "lora_name", required=True)
    path = P.get_str(body, "lora_path", required=True)
    if not name:
        raise HttpError("lora_name must not be empty")
    await _load_adapter(request, path, 0.0, name)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: web.Request) -> web.Response:
    _require_runtime_changes(request)
    eng = get_engine(request)
    body = await json_body(request)
    name = P.get_str(body, "lora_name")
    aid = P.get_int(body, "lora_int_id", None)
    if name is None and aid is None:
        raise HttpError('"lora_name" is required')
    found = [
        a
        for a in eng.adapters()
        if (name is not None and a.get("name") == name) or (name is None and a["id"] == aid)
    ]
    if not found:
        raise HttpError(
            f"The lora adapter '{name if name is not None else aid}' cannot be found.",
            404,
            "not_found_error",
        )
    eng.remove_adapter(found[0]["id"])
    return web.Response(text=f"Success: LoRA adapter '{found[0]['name']}' removed successfully.")


# -- control vectors (core/lora/control.py) ---------------------------------------------


def control_vector_entry(info: dict) -> dict:
    """GET /control-vectors entry: id, path, scale (as /lora-adapters' entries), plus
    the vector's name, the layers its file steers and its model hint."""
    keys = ("id", "path", "scale", "name", "layers", "model_hint")
    return {k: info[k] for k in keys}


async def get_control_vectors(request: web.Request) -> web.Response:
    eng = get_engine(request)
    return web.json_response([control_vector_entry(v) for v in eng.control_vectors()])


async def post_control_vectors(request: web.Request) -> web.Response:
    """Set the global vectors' scales, ``[{"id", "scale"}]`` as POST /lora-adapters
    (unlisted ids 0). Validated in full first: an invalid body changes nothing."""
    eng = get_engine(request)
    body = P.parse_json_any(await read_body(request))
    scales = P.parse_control_vectors(body, "control-vectors", eng.lora.vector_ids())
    eng.set_control_vectors(scales)
    return web.json_response({"success": True})


def _add_vector(eng, path, scale: float) -> dict:
    vid = eng.add_control_vector(path, scale)
    info = next((v for v in eng.control_vectors() if v["id"] == vid), None)
    if info is None:
        raise HttpError(f"control vector {vid} was unloaded while it was being loaded", 409)
    return info


async def control_vectors_load(request: web.Request) -> web.Response:
    """POST /control-vectors/load {"path", "scale"?} -> the new GET entry; behind
    --allow-runtime-lora and only from the --lora-dir folders, as adapters."""
    s = get_settings(request)
    _require_runtime_changes(request)
    body = await json_body(request)
    path = P.get_str(body, "path", required=True)
    scale = P.get_float(body, "scale", 0.0 if s.lora_init_without_apply else 1.0)
    eng = get_engine(request)
    target = adapter_path(path, s.lora_dirs)
    async with _load_lock(request.app):
        info = await _run_load(request, path, _add_vector, eng, target, scale)
    return web.json_response(control_vector_entry(info))


async def control_vectors_unload(request: web.Request) -> web.Response:
    return await _unload_by_id(request, get_engine(request).remove_control_vector)


TRAIN_FIELDS = {"pairs", "template", "suffixes", "method", "layers", "name", "load", "scale"}


def _train_and_load(eng, spec, dest, load: bool, scale: float, cancel) -> dict:
    """Make the vector (each forward on the engine thread, between scheduler steps),
    write it, and load it when asked; the new file goes if the load refuses it or the
    client went meanwhile (``cancel``, set by the handler: TrainCancelled)."""
    from ..lora.vector_train import load_made, train_on_engine

    path = train_on_engine(eng, spec, dest, cancel=cancel.is_set)
    out = {"path": str(path), "name": path.stem, "method": spec.method,
           "examples": spec.n_examples}  # fmt: skip
    if load:
        info = load_made(path, lambda p: _add_vector(eng, p, scale), cancel.is_set)
        out["vector"] = control_vector_entry(info)
    return out


async def control_vectors_train(request: web.Request) -> web.Response:
    """POST /control-vectors/train {"pairs": [{"positive", "negative"}], "template"?,
    "suffixes"?, "method"?: "pca"|"mean", "layers"?: [first, last], "name"?, "load"?,
    "scale"?} -> {"path", "name", "method", "examples", "vector"? (its GET entry when
    loaded)}. Behind --allow-runtime-lora (it writes a file on the server and may load
    it); the file goes to the data dir's adapters/ folder, never over an existing one.
    Checked in full first: a bad body is a 400 and nothing runs."""
    import threading

    from ..lora.vector_train import check_name, spec_of
    from ..paths import data_dir

    s = get_settings(request)
    _require_runtime_changes(request)
    body = await json_body(request)
    extra = set(body) - TRAIN_FIELDS
    if extra:
        raise HttpError(
            f"unknown field {sorted(extra)[0]!r}; fields: {', '.join(sorted(TRAIN_FIELDS))}"
        )
    eng = get_engine(request)
    eng.require_ready()
    try:
        spec = spec_of(body)
        name = check_name(body.get("name", f"{body.get('template') or 'vector'}-{spec.method}"))
    except UserError as e:
        raise HttpError(str(e)) from None
    load = P.get_bool(body, "load", False)
    scale = P.get_float(body, "scale", 0.0 if s.lora_init_without_apply else 1.0)
    if load:
        from ..lora.control import check_scale

        try:
            check_scale(scale, "scale")
        except UserError as e:
            raise HttpError(str(e)) from None
    dest = data_dir() / "adapters" / f"{name}.gguf"
    if dest.exists():
        raise HttpError(f"a control vector named {name!r} exists already ({dest})", 409)
    cancel = threading.Event()  # set when the client goes or the pool gives up
    try:
        out = await request.app[TRAIN_POOL].run(
            _train_and_load, eng, spec, dest, load, scale, cancel
        )
    except HttpError:
        cancel.set()
        raise
    except UserError as e:  # too long a prompt with the template, a load the engine refuses
        raise HttpError(str(e)) from None
    except BaseException:
        cancel.set()
        raise
    return web.json_response(out)
