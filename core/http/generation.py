"""llama-server's generation routes: ``/completion`` (also ``/completions``), ``/infill``,
and the resumable streams of ``/v1/stream``. ``start_generation`` reads a generation
request of any route (the OpenAI ones too, core/http/openai.py) and submits it."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from ..errors import HttpError
from ..lora.mix import Mix
from ..serve.grammar import request_constraint, wants_constraint
from ..serve.sampling import SamplingParams, parse_logit_bias
from ..serve.scheduler import DoneEvent
from . import endpoints as E
from . import parsing as P
from . import responses as R
from . import streams as S
from .plumbing import (
    STREAMS,
    TEXT_POOL,
    Generation,
    adapter_ids,
    choice_prompt,
    collect_all,
    encode_prompt,
    get_engine,
    get_settings,
    json_body,
    log_verbose,
    mixes_ready,
    model_id,
    open_sse,
    raise_for_done,
    render_chat,
    stream_events,
    stream_many,
)
from .security import DISCONNECTED


async def _sampling_fields(request: web.Request, eng, body: dict, params: SamplingParams) -> None:
    """logit_bias and structured output (grammar, json_schema, response_format) into
    params; a bad value is a 400 (SamplingError / GrammarError). The grammar compiles
    off the event loop: the first one per model builds the vocabulary index."""
    params.logit_bias = parse_logit_bias(
        body.get("logit_bias"), eng.tokenizer, eng.config.vocab_size
    )
    if wants_constraint(body):
        params.grammar = await request.app[TEXT_POOL].run(request_constraint, body, eng.tokenizer)


def _resolve_mix(eng, opts: P.GenOptions, oai: bool) -> dict[int, float] | None:
    """The mix for one request (see _lora_mix), with its "control_vectors" list when it
    has one (unlisted vectors 0, [] none; without it, the global vectors apply)."""
    mix = _lora_mix(eng, opts, oai)
    if opts.control_vectors is None:
        return mix
    vectors = P.parse_control_vectors(
        opts.control_vectors, "control_vectors", eng.lora.vector_ids()
    )
    base = eng.get_mix() if mix is None else mix  # the global mix, snapshotted now
    return Mix(base, getattr(base, "merge", None), vectors=vectors)


def _lora_mix(eng, opts: P.GenOptions, oai: bool) -> dict[int, float] | None:
    """The adapters of one request: its "lora" list (unlisted ids 0, [] all off); else,
    on OpenAI endpoints, "model": "<adapter name>" selects that adapter alone at
    scale 1 (vLLM); else None, the global mix."""
    if opts.lora is not None:
        return P.parse_lora(opts.lora, "lora", adapter_ids(eng))
    if oai and opts.model:
        ads = eng.adapters()
        match = [a["id"] for a in ads if a.get("name") == opts.model]
        if match:
            return {a["id"]: (1.0 if a["id"] == match[0] else 0.0) for a in ads}
    return None


async def start_generation(request: web.Request, prompt_field: Any, oai: bool, chat: bool = False):
    """Read a generation request of any route and submit it: (engine, options, prompt
    tokens, Generation), or, for several prompts or n > 1, (engine, options, the
    prompts, one Generation per choice). ``prompt_field`` is the body's prompt field,
    or a function building the tokens (/infill); ``chat`` renders "messages"."""
    eng = get_engine(request)
    s = get_settings(request)
    body = await json_body(request)
    opts = P.parse_generation(body, s.n_predict_default, oai=oai, defaults=s.sampling)
    opts.extra["post_sampling"] = P.get_bool(body, "post_sampling_probs", False)
    opts.extra["response_fields"] = P.parse_response_fields(body)
    opts.extra["verbose"] = P.get_bool(body, "verbose", False) or s.verbose
    opts.extra["timings_per_token"] = P.get_bool(body, "timings_per_token", False)
    if oai:
        n_top = P.parse_oai_logprobs(body, chat)
        if n_top:
            opts.params.n_probs = max(opts.params.n_probs, n_top)
        opts.extra["n_top"] = n_top
        opts.extra["include_usage"] = P.parse_include_usage(body)
    await _sampling_fields(request, eng, body, opts.params)
    mix = _resolve_mix(eng, opts, oai)
    if chat:
        text = await render_chat(request, eng, body)
        prompt = await encode_prompt(request, eng, text)
        log_verbose(request, "prompt", lambda: text)
    elif callable(prompt_field):  # /infill builds its tokens from its own fields
        prompt = prompt_field(eng, body)
        P.check_prompt_tokens(prompt, eng.config.vocab_size)
        log_verbose(request, "prompt", lambda: eng.tokenizer.decode(prompt))
    else:
        if "prompt" not in body:
            raise HttpError('"prompt" is required')
        if P.is_multi_prompt(body["prompt"]):
            P.check_choices(len(body["prompt"]), opts.extra["n"])
            prompts = [await encode_prompt(request, eng, p) for p in body["prompt"]]
            await mixes_ready(request, eng, [mix])
            return eng, opts, prompts, _start_many(request, eng, opts, prompts, mix)
        prompt = await encode_prompt(request, eng, body["prompt"])
        log_verbose(request, "prompt", lambda: eng.tokenizer.decode(prompt))
    await mixes_ready(request, eng, [mix])
    if opts.extra["n"] > 1:
        return eng, opts, [prompt], _start_many(request, eng, opts, [prompt], mix)
    gen = Generation(
        request,
        eng,
        prompt,
        opts.params,
        mix,
        opts.cache_prompt,
        id_slot=opts.id_slot,
        progress=opts.return_progress and opts.stream,
    )
    return eng, opts, prompt, gen


def _start_many(request, eng, opts, prompts: list[list[int]], mix) -> list[Generation]:
    """n completions of each prompt, prompt-major (choice index = prompt * n + j), in one
    batch. With a seed, completion j of a prompt samples with seed + j: reproducible,
    and the n choices differ as OpenAI's n means."""
    n, p = opts.extra["n"], opts.params
    jobs = [
        (prompt, replace(p, seed=None if p.seed is None else p.seed + j))
        for prompt in prompts
        for j in range(n)
    ]
    return Generation.many(request, eng, jobs, mix, opts.cache_prompt)


async def completion(request: web.Request, prompt_field: Any = "prompt") -> web.StreamResponse:
    """llama-server's POST /completion (also /completions, and /infill's answer)."""
    eng, opts, prompt, gen = await start_generation(request, prompt_field, oai=False)
    if isinstance(gen, list):  # several prompts or n_cmpl > 1
        return await _completion_many(request, eng, opts, prompt, gen)
    mid = model_id(request, eng)
    tok = eng.tokenizer
    n_probs = opts.params.n_probs
    all_ids = [a["id"] for a in eng.adapters()]

    post = opts.extra["post_sampling"]
    prompt_text = tok.decode(prompt, strip_prefix_space=False)

    def settings_for(done):
        out = R.generation_settings(
            opts.params,
            eng.ctx_size,
            mid,
            opts.stream,
            R.mix_to_lora(done.mix, all_ids),
            eog=eng.tokenizer.eog_ids,
        )
        out["post_sampling_probs"] = post
        return out

    def probability(token, logprob, top, merged):
        e = R.completion_probability(tok, token, logprob, top, merged)
        return R.as_post_sampling(e) if post else e

    def final(done, probs=None, streaming=False):
        """The last object of a /completion answer (the whole body when not streaming)."""
        return R.completion_final(
            done,
            prompt_n=len(prompt),
            model=mid,
            all_ids=all_ids,
            return_tokens=opts.return_tokens,
            probs=probs,
            settings=settings_for(done),
            streaming=streaming,
            prompt_text=prompt_text,
            n_ctx=eng.ctx_size,
        )

    if not opts.stream:
        done, toks = await gen.collect()
        raise_for_done(done)
        log_verbose(request, "content", lambda: done.content)
        probs = None
        if n_probs:
            merger, probs = tok.probs_merger(), []
            for t in toks:
                merged = merger.push(t.token)
                if merged is not None:  # None: ends inside a UTF-8 character
                    probs.append(probability(t.token, t.logprob, t.top, merged))
        out = final(done, probs)
        body = dict(R.select_fields(out, opts.extra["response_fields"]))
        if opts.extra["verbose"]:
            body["__verbose"] = out  # a copy of the whole answer, not itself
        return web.json_response(body)

    merger = tok.probs_merger()

    def token_chunk(ev):
        if ev.kind == "token":
            probs = None
            if n_probs:
                # a token ending inside a UTF-8 character gets no entry (its bytes go
                # into the next one, as in llama-server); its chunk still carries its
                # id and any complete text, so nothing a client counts is lost
                merged = merger.push(ev.token)
                probs = (
                    [] if merged is None else [probability(ev.token, ev.logprob, ev.top, merged)]
                )
            return R.completion_chunk(ev.text, [ev.token], probs, ev.slot)
        if not ev.text:
            return None
        return R.completion_chunk(ev.text, [], [] if n_probs else None, ev.slot)

    def final_chunks(ev):
        return [R.sse(final(ev, streaming=True))]

    base = {
        **R.completion_chunk("", [], None),
        "tokens_predicted": 0,
        "tokens_evaluated": len(prompt),
    }
    progress = R.progress_chunk(base, opts.extra["timings_per_token"])
    return await stream_events(request, gen, token_chunk, final_chunks, progress=progress)


async def infill(request: web.Request) -> web.Response:
    """/infill needs the model's fill-in-the-middle tokens (501 without them)."""
    missing = E.missing_fim_tokens(get_engine(request).tokenizer)
    if missing:  # before the body is read: the answer does not depend on it
        raise E.not_supported(f"Infill is not supported by this model: {missing}")
    s = get_settings(request)
    layout = partial(E.infill_prompt, n_batch=s.n_batch, n_predict=s.n_predict_default)
    return await completion(request, prompt_field=layout)


async def _completion_many(request, eng, opts, prompts, gens) -> web.StreamResponse:
    """/completion with several prompts (or n_cmpl > 1): llama-server answers a JSON
    array of results, each with its ``index``; streamed, each chunk carries it."""
    mid = model_id(request, eng)
    tok = eng.tokenizer
    all_ids = [a["id"] for a in eng.adapters()]
    n = opts.extra["n"]
    post = opts.extra["post_sampling"]

    def final(i: int, done: DoneEvent, probs=None, streaming=False) -> dict:
        prompt = choice_prompt(prompts, n, i)
        out = R.completion_final(
            done,
            prompt_n=len(prompt),
            prompt_text=tok.decode(prompt, strip_prefix_space=False),
            n_ctx=eng.ctx_size,
            model=mid,
            all_ids=all_ids,
            return_tokens=opts.return_tokens,
            probs=probs,
            settings=R.generation_settings(
                gens[i].req.params,
                eng.ctx_size,
                mid,
                opts.stream,
                R.mix_to_lora(done.mix, all_ids),
                eog=eng.tokenizer.eog_ids,
            ),
            streaming=streaming,
        )
        out["generation_settings"]["post_sampling_probs"] = post
        out["index"] = i
        return out

    def probability(token, logprob, top, merged):
        e = R.completion_probability(tok, token, logprob, top, merged)
        return R.as_post_sampling(e) if post else e

    def probs_of(toks) -> list[dict] | None:
        if not opts.params.n_probs:
            return None
        merger, probs = tok.probs_merger(), []
        for t in toks:
            merged = merger.push(t.token)
            if merged is not None:  # None: ends inside a UTF-8 character
                probs.append(probability(t.token, t.logprob, t.top, merged))
        return probs

    def body(out: dict) -> dict:  # response_fields and verbose, as for one result
        shown = dict(R.select_fields(out, opts.extra["response_fields"]))
        if opts.extra["verbose"]:
            shown["__verbose"] = out
        return shown

    if not opts.stream:
        got = await collect_all(gens)
        return web.json_response([body(final(i, d, probs_of(t))) for i, (d, t) in enumerate(got)])

    mergers = [tok.probs_merger() for _ in gens]  # one per choice: its own UTF-8 state

    def token_chunk(i: int, ev) -> dict | None:
        if not ev.text and ev.kind != "token":
            return None
        probs = None
        if opts.params.n_probs:  # as the one-result stream (see completion)
            merged = mergers[i].push(ev.token) if ev.kind == "token" else None
            probs = (
                [probability(ev.token, ev.logprob, ev.top, merged)] if merged is not None else []
            )
        out = R.completion_chunk(ev.text, [ev.token] if ev.kind == "token" else [], probs)
        out["index"] = i
        return out

    def final_chunks(i: int, ev) -> list[bytes]:
        return [R.sse(final(i, ev, streaming=True))]

    return await stream_many(request, gens, token_chunk, final_chunks)


def _conv_param(request: web.Request) -> str:
    cid = request.query.get("conv_id", "")
    if not cid:
        raise HttpError("Missing conversation id in path")
    return cid


async def stream_replay(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream?conv_id=…&from=N: the session's SSE bytes from offset N, then the
    live ones until its generation ends (404 when unknown or expired)."""
    cid = _conv_param(request)
    session = request.app[STREAMS].get(cid)
    if session is None:
        raise HttpError("Stream not found or expired", 404, "not_found_error")
    raw = request.query.get("from", "0") or "0"
    if not raw.isdigit() or len(raw) > 18:
        raise HttpError("Invalid 'from' offset")
    offset = int(raw)
    if offset < session.dropped_prefix:
        raise HttpError("Stream offset lost, please restart")
    resp = await open_sse(request)
    try:
        while True:
            try:
                data = session.read(offset)
            except S.OffsetLost:  # the writer outran this reader past the cap
                break
            if data:
                offset += len(data)
                await resp.write(data)
                continue
            if session.done:
                break
            await session.changed()
    except ConnectionError:
        request[DISCONNECTED] = True
    return resp


async def streams_lookup(request: web.Request) -> web.Response:
    """POST /v1/streams/lookup {"conversation_ids": [...]}: only the ids named."""
    body = await json_body(request)
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
    return web.json_response(request.app[STREAMS].lookup(wanted[: S.MAX_SESSIONS]))


async def stream_delete(request: web.Request) -> web.Response:
    """DELETE /v1/stream?conv_id=…: the explicit Stop; 204 even when already gone."""
    request.app[STREAMS].evict_and_cancel(_conv_param(request))
    return web.Response(status=204)
