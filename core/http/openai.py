"""OpenAI's generation routes: ``/v1/completions`` and ``/v1/chat/completions`` (with
llama-server's extras: timings, the mix used, ``__verbose``), and
``/v1/chat/completions/input_tokens``."""

from __future__ import annotations

import time

from aiohttp import web

from ..serve.scheduler import DoneEvent
from . import responses as R
from .generation import start_generation
from .plumbing import (
    choice_prompt,
    collect_all,
    encode_prompt,
    get_engine,
    json_body,
    log_verbose,
    model_id,
    raise_for_done,
    render_chat,
    stream_events,
    stream_many,
)


async def _start_oai(request: web.Request, id_prefix: str, chat: bool = False) -> tuple:
    """start_generation for the OpenAI routes, plus what their responses all carry:
    (eng, opts, prompt, gen, model id, all adapter ids, response id, created, n_top)."""
    eng, opts, prompt, gen = await start_generation(
        request, "messages" if chat else "prompt", oai=True, chat=chat
    )
    return (
        eng,
        opts,
        prompt,
        gen,
        opts.model or model_id(request, eng),
        [a["id"] for a in eng.adapters()],
        R.new_id(id_prefix),
        int(time.time()),
        opts.extra["n_top"],
    )


def _oai_final(
    last: dict, prompt_n: int, ev: DoneEvent, all_ids, usage_chunk: bool = False
) -> list[bytes]:
    """The closing OpenAI chunk (usage, llama-server timings, the mix used) and [DONE].
    With ``stream_options.include_usage`` (``usage_chunk``), usage and timings come in
    one more chunk whose ``choices`` is empty, as OpenAI and llama-server send them."""
    extra = {
        "usage": R.usage(prompt_n, ev),
        "timings": R.timings(ev.timings),
        "lora": R.mix_to_lora(ev.mix, all_ids),
    }
    if not usage_chunk:
        return [R.sse({**last, **extra}), R.SSE_DONE]
    return [R.sse(last), _usage_chunk(last, extra), R.SSE_DONE]


def _usage_chunk(like: dict, extra: dict) -> bytes:
    """The chunk after the last choice: ``like``'s id, object, created and model, an
    empty ``choices`` and ``extra`` (usage, timings...), as OpenAI sends usage."""
    tail = {k: v for k, v in like.items() if k != "choices"}
    return R.sse({**tail, "choices": [], **extra})


def _verbose_body(eng, opts, prompt: list[int], done: DoneEvent, mid: str, all_ids) -> dict:
    """The ``__verbose`` object of an OpenAI answer: the /completion form of the same
    result, with the prompt text the template built."""
    return R.completion_final(
        done,
        prompt_n=len(prompt),
        model=mid,
        all_ids=all_ids,
        return_tokens=False,
        probs=None,
        settings=R.generation_settings(
            opts.params,
            eng.ctx_size,
            mid,
            False,
            R.mix_to_lora(done.mix, all_ids),
            eog=eng.tokenizer.eog_ids,
        ),
        prompt_text=eng.tokenizer.decode(prompt, strip_prefix_space=False),
        n_ctx=eng.ctx_size,
    )


def _oai_answer(tok, done: DoneEvent, toks, prompt_n: int, meta, n_top: int, chat: bool) -> dict:
    """One non-streaming OpenAI answer, a chat.completion or a text_completion, with
    its logprobs when asked (``n_top``); meta is (model id, all adapter ids, response
    id, created). _oai_many takes each choice of its answer from one of these."""
    mid, all_ids, cid, created = meta
    if not n_top:
        lp = None
    elif chat:
        lp = [R.oai_chat_logprob(tok, t.token, t.logprob, t.top, n_top) for t in toks]
    else:
        lp = R.oai_completion_logprobs(tok, [(t.token, t.logprob, t.top) for t in toks], n_top)
    build = R.oai_chat if chat else R.oai_completion
    return build(
        done, cid=cid, created=created, model=mid, prompt_n=prompt_n, all_ids=all_ids, logprobs=lp
    )


async def _oai_one(request, eng, opts, prompt: list[int], gen, meta, chat=False) -> web.Response:
    """/v1/completions and /v1/chat/completions answered whole (no stream, one choice),
    with llama-server's ``__verbose`` copy when asked."""
    done, toks = await gen.collect()
    raise_for_done(done)
    if chat:
        log_verbose(request, "content", lambda: done.content)
    out = _oai_answer(eng.tokenizer, done, toks, len(prompt), meta, opts.extra["n_top"], chat)
    if opts.extra["verbose"]:  # llama-server's debug copy, in its /completion form
        mid, all_ids = meta[:2]
        out["__verbose"] = _verbose_body(eng, opts, prompt, done, mid, all_ids)
    return web.json_response(out)


async def oai_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/completions."""
    eng, opts, prompt, gen, mid, all_ids, cid, created, n_top = await _start_oai(request, "cmpl")
    tok = eng.tokenizer
    meta = (mid, all_ids, cid, created)
    if isinstance(gen, list):  # n > 1 or several prompts: one choice each
        return await _oai_many(request, eng, opts, prompt, gen, meta)
    if not opts.stream:
        return await _oai_one(request, eng, opts, prompt, gen, meta)

    def token_chunk(ev):
        lp = (
            R.oai_completion_logprobs(tok, [(ev.token, ev.logprob, ev.top)], n_top)
            if n_top and ev.kind == "token"
            else None
        )
        return (
            R.oai_completion_chunk(ev.text, cid=cid, created=created, model=mid, logprobs=lp)
            if ev.text or lp
            else None
        )

    usage_chunk = opts.extra["include_usage"]

    def final_chunks(ev):
        last = R.oai_completion_chunk(
            "", cid=cid, created=created, model=mid, finish=R.finish_reason(ev.stop_type)
        )
        return _oai_final(last, len(prompt), ev, all_ids, usage_chunk)

    base = R.oai_completion_chunk("", cid=cid, created=created, model=mid)
    progress = R.progress_chunk(base, opts.extra["timings_per_token"])
    return await stream_events(request, gen, token_chunk, final_chunks, progress=progress)


async def chat_input_tokens(request: web.Request) -> web.Response:
    """POST /chat/completions/input_tokens: how many tokens the chat's prompt takes
    (the template rendered as for a generation), without generating."""
    eng = get_engine(request)
    body = await json_body(request)
    text = await render_chat(request, eng, body)
    prompt = await encode_prompt(request, eng, text)
    return web.json_response({"input_tokens": len(prompt)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/chat/completions, with llama-server's timings and lora extras."""
    eng, opts, prompt, gen, mid, all_ids, cid, created, n_top = await _start_oai(
        request, "chatcmpl", chat=True
    )
    tok = eng.tokenizer
    meta = (mid, all_ids, cid, created)
    if isinstance(gen, list):  # n > 1
        return await _oai_many(request, eng, opts, prompt, gen, meta, chat=True)
    if not opts.stream:
        return await _oai_one(request, eng, opts, prompt, gen, meta, chat=True)

    def token_chunk(ev):
        lp = (
            [R.oai_chat_logprob(tok, ev.token, ev.logprob, ev.top, n_top)]
            if n_top and ev.kind == "token"
            else None
        )
        return (
            R.oai_chat_chunk({"content": ev.text}, cid=cid, created=created, model=mid, logprobs=lp)
            if ev.text or lp
            else None
        )

    usage_chunk = opts.extra["include_usage"]

    def final_chunks(ev):
        last = R.oai_chat_chunk(
            {}, cid=cid, created=created, model=mid, finish=R.finish_reason(ev.stop_type)
        )
        return _oai_final(last, len(prompt), ev, all_ids, usage_chunk)

    # llama-server's first chunk: the role, and a content that is null (not "")
    first = R.oai_chat_chunk(
        {"role": "assistant", "content": None}, cid=cid, created=created, model=mid
    )
    progress = R.progress_chunk(first, opts.extra["timings_per_token"])
    return await stream_events(
        request, gen, token_chunk, final_chunks, first=first, progress=progress
    )


async def _oai_many(request, eng, opts, prompts, gens, meta, chat=False) -> web.StreamResponse:
    """/v1/completions and /v1/chat/completions with n > 1 (or several prompts): one
    choice per generation, ``index`` prompt * n + j; usage adds up all of them."""
    mid, all_ids, cid, created = meta
    tok = eng.tokenizer
    n, n_top = opts.extra["n"], opts.extra["n_top"]
    prompt_n = sum(len(p) for p in prompts)

    def total_usage(dones: list[DoneEvent]) -> dict:
        u = R.usage(prompt_n, dones[0])
        u["completion_tokens"] = sum(len(d.tokens) for d in dones)
        u["total_tokens"] = prompt_n + u["completion_tokens"]
        u["prompt_tokens_details"] = {"cached_tokens": sum(d.timings.cache_n for d in dones)}
        return u

    if not opts.stream:
        got = await collect_all(gens)
        choices, out = [], {}
        for i, (done, toks) in enumerate(got):
            p_n = len(choice_prompt(prompts, n, i))
            one = _oai_answer(tok, done, toks, p_n, meta, n_top, chat)
            out = out or one
            choices.append({**one["choices"][0], "index": i})
        out["choices"] = choices
        out["usage"] = total_usage([d for d, _ in got])
        return web.json_response(out)

    build = R.oai_chat_chunk if chat else R.oai_completion_chunk

    def chunk(i: int, what, finish=None) -> dict:
        out = build(what, cid=cid, created=created, model=mid, finish=finish)
        out["choices"][0]["index"] = i
        return out

    def token_chunk(i: int, ev) -> dict | None:
        if not ev.text:
            return None
        return chunk(i, {"content": ev.text} if chat else ev.text)

    def final_chunks(i: int, ev) -> list[bytes]:
        return [R.sse(chunk(i, {} if chat else "", R.finish_reason(ev.stop_type)))]

    def closing(dones: list[DoneEvent]) -> list[bytes]:
        extra = {"usage": total_usage(dones), "timings": R.timings(dones[0].timings)}
        return [_usage_chunk(chunk(0, {} if chat else ""), extra), R.SSE_DONE]

    def first(i: int) -> dict:
        return chunk(i, {"role": "assistant", "content": None})

    return await stream_many(
        request, gens, token_chunk, final_chunks, closing, first if chat else None
    )
