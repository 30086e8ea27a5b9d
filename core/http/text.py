"""The text routes: ``/tokenize``, ``/detokenize`` and ``/apply-template`` (the prompt a
chat request would render), and the web page's ``/mixdesk/markdown`` (a reply's
Markdown as the page shows it). Long texts and templates run off the event loop."""

from __future__ import annotations

import asyncio
from functools import partial

from aiohttp import web

from ..errors import HttpError
from ..markdown import web_html
from . import parsing as P
from . import responses as R
from .plumbing import TEXT_POOL, TOKENIZE_INLINE_CHARS, get_engine, json_body, render_chat
from .webui import MARKDOWN_INLINE_CHARS, MARKDOWN_MAX_CHARS


async def tokenize(request: web.Request) -> web.Response:
    eng = get_engine(request)
    body = await json_body(request)
    content = P.get_str(body, "content", required=True)
    add_special = P.get_bool(body, "add_special", False)
    parse_special = P.get_bool(body, "parse_special", True)
    with_pieces = P.get_bool(body, "with_pieces", False)
    ids = (
        await request.app[TEXT_POOL].run(eng.tokenizer.encode, content, add_special, parse_special)
        if len(content) > TOKENIZE_INLINE_CHARS
        else eng.tokenizer.encode(content, add_special, parse_special)
    )
    if with_pieces:
        return web.json_response(
            {"tokens": [{"id": t, "piece": R.token_piece(eng.tokenizer, t)} for t in ids]}
        )
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    eng = get_engine(request)
    body = await json_body(request)
    ids = P.parse_token_list(body.get("tokens", []), eng.config.vocab_size)
    if len(ids) > TOKENIZE_INLINE_CHARS:
        text = await request.app[TEXT_POOL].run(
            partial(eng.tokenizer.decode, strip_prefix_space=False), ids
        )
    else:
        # llama-server's /detokenize joins the pieces as they are: a SentencePiece
        # model's leading space stays (decode() for display strips it)
        text = eng.tokenizer.decode(ids, strip_prefix_space=False)
    return web.json_response({"content": text})


async def apply_template(request: web.Request) -> web.Response:
    eng = get_engine(request)
    body = await json_body(request)
    return web.json_response({"prompt": await render_chat(request, eng, body)})


async def markdown(request: web.Request) -> web.StreamResponse:
    """POST /mixdesk/markdown ``{"text": "..."}`` -> ``{"html": "..."}``: the text's
    Markdown with every bit of HTML in it escaped, code blocks as ``<pre class="code">``
    with pygments classes (the page's stylesheet colours them)."""
    body = await json_body(request)
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str):
        raise HttpError('"text" must be a string', 400)
    if len(text) > MARKDOWN_MAX_CHARS:
        raise HttpError(f'"text" is over {MARKDOWN_MAX_CHARS} characters', 413)
    if len(text) > MARKDOWN_INLINE_CHARS:
        out = await asyncio.to_thread(web_html, text)
    else:
        out = web_html(text)
    return web.json_response({"html": out}, headers={"Cache-Control": "no-store"})
