"""/embedding, /embeddings and /v1/embeddings: llama-server's input forms and answers.

The route's handler, then the pure parsing and response building it uses (the
forward and pooling are ``core/serve/embeddings.py``). The input forms are llama-server's
(``handle_embeddings_impl``): ``input`` (or, non-OpenAI, ``content``) is a string, a
token list, tokens mixed with strings, a ``{"prompt_string"}`` object or an OpenAI
``{"content": [{"type": "text", "text"}]}`` object; or a list of those, which is
several inputs (a list holding a bare token id is one input).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web

from ..errors import HttpError
from ..serve.embeddings import check_pooling, normalize, packed, parse_normalize, pool
from . import endpoints as E
from . import parsing as P
from .plumbing import (
    METRICS,
    TEXT_POOL,
    TOKENIZE_INLINE_CHARS,
    adapter_ids,
    get_engine,
    json_body,
    mixes_ready,
    model_id,
)

NOT_OAI_POOLING = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
MEDIA_PARTS = ("image_url", "input_audio", "input_video")


async def embeddings(request: web.Request) -> web.Response:
    """/embedding, /embeddings (llama-server's form) and /v1/embeddings (OpenAI's):
    the final hidden states under the request's ``lora`` or the global mix, pooled by
    --pooling (core/serve/embeddings.py). 501 without --embedding."""
    eng = get_engine(request)
    opts = eng.embeddings
    if not opts.enabled:
        raise E.not_supported(
            "This server does not support embeddings. Start it with `--embeddings`"
        )
    pooling = check_pooling(opts.pooling_for(eng.config))
    oai = request.path.startswith("/v1/")
    if oai and pooling == "none":
        raise HttpError(NOT_OAI_POOLING)
    body = await json_body(request)
    if (request.content_length or 0) > TOKENIZE_INLINE_CHARS:  # long texts: off the loop
        inputs, content = await request.app[TEXT_POOL].run(parse_inputs, body, eng.tokenizer)
    else:
        inputs, content = parse_inputs(body, eng.tokenizer)
    b64 = parse_encoding(body)
    norm = parse_normalize_field(body)
    mix = (
        P.parse_lora(body["lora"], "lora", adapter_ids(eng))
        if body.get("lora") is not None
        else None
    )
    await mixes_ready(request, eng, [mix])
    t0 = time.perf_counter()
    hidden = await asyncio.wrap_future(eng.embed(inputs, mix))  # (n_i, d) per input
    request.app[METRICS].record_embedding(
        sum(len(ids) for ids in inputs),
        len(packed(inputs, opts.ubatch)),
        (time.perf_counter() - t0) * 1e3,
    )
    vectors = pooled(hidden, pooling, norm)
    if oai and not content:
        model = body.get("model") if isinstance(body.get("model"), str) else None
        counts = [len(ids) for ids in inputs]
        return web.json_response(oai_body(vectors, counts, model or model_id(request, eng), b64))
    return web.json_response(native_body(vectors))


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _content_text(content: Any) -> str:
    """An OpenAI content array's text (llama-server joins the text parts as they are)."""
    if not isinstance(content, list):
        raise HttpError('"content" must be an array')
    text = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise HttpError(f"content[{i}]: {kind} needs a multimodal model; this one is text only")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise HttpError(f'content[{i}] must be {{"type": "text", "text": "..."}}')
        text.append(part["text"])
    return "".join(text)


def _entry(p: Any, tokenizer) -> list[int]:
    if isinstance(p, dict) and "content" in p:
        return tokenizer.encode(_content_text(p["content"]), add_special=True, parse_special=True)
    if isinstance(p, list) and not p:
        return []  # refused as an empty input, with llama-server's words
    if isinstance(p, str | list | dict):
        return P.parse_prompt(p, tokenizer)
    raise HttpError(
        "input must be a string, a list of token ids, tokens mixed with strings, or a list of those"
    )


def parse_inputs(body: Mapping, tokenizer) -> tuple[list[list[int]], bool]:
    """The token lists a request embeds, and whether it used the non-OpenAI ``content``
    field (llama-server then answers in /embedding's form even on /v1/embeddings)."""
    if "input" in body:
        prompt, content = body["input"], False
    elif "content" in body:
        prompt, content = body["content"], True
    else:
        raise HttpError('"input" or "content" must be provided')
    if isinstance(prompt, list) and not any(_is_token(x) for x in prompt):
        return [_entry(p, tokenizer) for p in prompt], content
    return [_entry(prompt, tokenizer)], content


def parse_encoding(body: Mapping) -> bool:
    """encoding_format: True for base64, False for float (the default)."""
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise HttpError("The format to return the embeddings in. Can be either float or base64")
    return fmt == "base64"


def parse_normalize_field(body: Mapping) -> int:
    return parse_normalize(body.get("embd_normalize"))


def pooled(hidden: list[np.ndarray], pooling: str, norm: int) -> list[np.ndarray]:
    """Per input: (d,) pooled and normalized, or with pooling none (n, d) as it is
    (llama-server normalizes only pooled vectors)."""
    if pooling == "none":
        return [h for h in hidden]  # (n_i, d) each
    return [normalize(pool(h, pooling), norm) for h in hidden]  # (d,) each


def native_body(vectors: list[np.ndarray]) -> list[dict]:
    """/embedding's answer: per input its index and a list of vectors (one per token
    with pooling none, else the one pooled vector)."""
    return [
        {"index": i, "embedding": (v if v.ndim == 2 else v[None, :]).tolist()}
        for i, v in enumerate(vectors)
    ]


def oai_body(vectors: list[np.ndarray], counts: list[int], model: str, b64: bool) -> dict:
    """/v1/embeddings' answer (OpenAI's list; base64 is the float32 bytes, little-endian)."""
    data = []
    for i, v in enumerate(vectors):
        if b64:
            raw = np.ascontiguousarray(v, dtype="<f4").tobytes()
            entry = {"embedding": base64.b64encode(raw).decode("ascii"), "index": i}
            data.append({**entry, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": v.tolist(), "index": i, "object": "embedding"})
    n = sum(counts)
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": data,
    }
