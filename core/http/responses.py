"""Building answers: llama-server's and OpenAI's response bodies.

Nothing here touches the network or the scheduler: every function takes plain values
(engine events, a tokenizer, a mix) and returns plain dicts or SSE bytes, so the shapes
can be tested without a server. The shapes follow llama.cpp's llama-server
(``/completion``, ``/lora-adapters``, ``/tokenize`` ...) and the OpenAI API
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``). Reading the requests
is core/http/parsing.py.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..serve.sampling import SamplingParams
from .build_info import build_info


def error_body(
    message: str, code: int = 400, type: str = "invalid_request_error", **extra: Any
) -> dict:
    return {"error": {"code": code, "message": message, "type": type, **extra}}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def mix_to_lora(
    mix: Iterable[tuple[int, float]] | Mapping[int, float], all_ids: Iterable[int] = ()
) -> list[dict]:
    """A mix as llama-server's ``[{"id", "scale"}]`` list, listing every known adapter."""
    d = dict(mix.items() if isinstance(mix, Mapping) else mix)
    ids = sorted(set(all_ids) | set(d))
    return [{"id": i, "scale": d.get(i, 0.0)} for i in ids]


def lora_adapter_entry(info: Mapping) -> dict:
    """GET /lora-adapters entry: llama-server's five fields plus our adapter name."""
    return {
        "id": info["id"],
        "path": info["path"],
        "scale": info["scale"],
        "task_name": info.get("task_name", ""),
        "prompt_prefix": info.get("prompt_prefix", ""),
        "name": info.get("name", ""),
    }


def token_piece(tokenizer, tid: int) -> str | list[int]:
    """/tokenize piece: a string if the token's bytes are valid UTF-8, else the bytes."""
    b = tokenizer.token_bytes(tid)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def _prob_entry(tokenizer, tid: int, logprob: float) -> dict:
    b = tokenizer.token_bytes(tid)
    return {
        "id": tid,
        "token": b.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(b),
    }


def as_post_sampling(entry: dict) -> dict:
    """A completion_probabilities entry in llama-server's post_sampling_probs form:
    ``prob``/``top_probs`` (probabilities, not logs) and no zero-probability
    candidate. Mixdesk's candidates come from the distribution the sampler drew from
    before top-k/top-p/min-p truncation, so a truncated candidate still shows its
    probability there."""
    out = {k: v for k, v in entry.items() if k not in ("logprob", "top_logprobs")}
    out["prob"] = math.exp(entry["logprob"])
    out["top_probs"] = [
        {**{k: v for k, v in t.items() if k != "logprob"}, "prob": math.exp(t["logprob"])}
        for t in entry.get("top_logprobs", [])
        if math.exp(t["logprob"]) > 0.0
    ]
    return out


def select_fields(body: dict, paths: Any) -> dict:
    """llama-server's ``response_fields``: only the named fields, each under its path
    (``"generation_settings/n_predict"``); a name that is not in the body is left
    out, as llama-server does. An empty list keeps the whole body."""
    if not paths:
        return body
    out = {}
    for path in paths:
        cur: Any = body
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def completion_probability(
    tokenizer,
    token: int,
    logprob: float | None,
    top: Sequence[tuple[int, float]] | None,
    merged: bytes | None = None,
) -> dict:
    """One ``completion_probabilities`` item of llama-server's /completion.

    ``merged`` is what ``Tokenizer.probs_merger().push(token)`` returned: the bytes of
    every token since the last entry, so one entry covers whole UTF-8 characters as in
    llama-server (a token that ends inside a character gets no entry of its own).
    Candidates show their piece without a trailing incomplete character, with all of
    its bytes."""
    lp = logprob if logprob is not None else 0.0
    if merged is None:
        e = _prob_entry(tokenizer, token, lp)
    else:
        e = {
            "id": token,
            "token": merged.decode("utf-8", errors="replace"),
            "logprob": lp,
            "bytes": list(merged),
        }
    tops = []
    for t, tlp in top or []:
        text, raw = tokenizer.probs_piece(t)
        tops.append({"id": t, "token": text, "logprob": tlp, "bytes": list(raw)})
    e["top_logprobs"] = tops
    return e


def oai_chat_logprob(
    tokenizer,
    token: int,
    logprob: float | None,
    top: Sequence[tuple[int, float]] | None,
    n_top: int,
) -> dict:
    """One ``choices[0].logprobs.content`` item of OpenAI chat completions."""

    def one(t, lp):
        b = tokenizer.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    e = one(token, logprob if logprob is not None else 0.0)
    e["top_logprobs"] = [one(t, lp) for t, lp in (top or [])[:n_top]]
    return e


def finish_reason(stop_type: str) -> str:
    return "length" if stop_type == "limit" else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def timings(t) -> dict:
    """llama-server's timings: the generation rate counts n - 1 decode steps, as the
    first token comes from the prompt's last logits (no decode of its own); one
    generated token gives a rate of 0."""
    out = t.as_dict()
    steps = max(t.predicted_n - 1, 0)
    ms = t.predicted_ms
    out["predicted_per_token_ms"] = ms / steps if steps and ms > 0 else 0.0
    out["predicted_per_second"] = 1e3 * steps / ms if steps and ms > 0 else 0.0
    return out


def usage(prompt_n: int, done) -> dict:
    t = done.timings
    return {
        "completion_tokens": len(done.tokens),
        "prompt_tokens": prompt_n,
        "total_tokens": prompt_n + len(done.tokens),
        "prompt_tokens_details": {"cached_tokens": t.cache_n},
    }


def completion_final(
    done,
    *,
    prompt_n: int,
    model: str,
    all_ids: Iterable[int],
    return_tokens: bool,
    probs: list[dict] | None,
    settings: dict,
    streaming: bool = False,
    prompt_text: str = "",
    n_ctx: int = 0,
) -> dict:
    """llama-server's /completion response (or its last stream chunk). ``truncated``:
    generation stopped because the slot's context (``n_ctx``) was full."""
    full = n_ctx > 0 and prompt_n + len(done.tokens) >= n_ctx
    out = {
        "index": 0,
        "content": "" if streaming else done.content,
        "tokens": [] if streaming or not return_tokens else list(done.tokens),
        "id_slot": done.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": len(done.tokens),
        "tokens_evaluated": prompt_n,
        "generation_settings": settings,
        "prompt": prompt_text,
        "has_new_line": "\n" in done.content,
        "truncated": done.truncated or (done.stop_type == "limit" and full),
        "stop_type": done.stop_type if done.stop_type in ("eos", "limit", "word") else "none",
        "stopping_word": done.stopping_word,
        "tokens_cached": done.timings.cache_n,
        "timings": timings(done.timings),
        "lora": mix_to_lora(done.mix, all_ids),
    }
    if probs is not None and not streaming:
        out["completion_probabilities"] = probs
    return out


def completion_chunk(
    text: str, tokens: list[int], probs: list[dict] | None, id_slot: int = -1
) -> dict:
    """One streamed /completion token chunk (``id_slot``: the slot it runs in, -1 before
    the request has one)."""
    out = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": id_slot}
    if probs is not None:
        out["completion_probabilities"] = probs
    return out


def prompt_progress(ev) -> dict:
    """llama-server's ``prompt_progress`` object (``return_progress``): prompt tokens in
    all, of which came from the cache, in the cache so far, and the time spent."""
    return {"total": ev.total, "cache": ev.cache_n, "processed": ev.done, "time_ms": ev.time_ms}


def progress_chunk(base: dict, with_timings: bool):
    """The function making one endpoint's prompt_progress chunk: ``base`` (its chunk
    shape) plus the progress, and with ``timings_per_token`` the timings so far (the
    first report: nothing evaluated, all zero), as llama-server sends them."""
    from ..serve.scheduler import Timings

    def make(ev) -> dict:
        out = {**base, "prompt_progress": prompt_progress(ev)}
        if with_timings:
            t = Timings(prompt_n=ev.done - ev.cache_n, prompt_ms=ev.time_ms, cache_n=ev.cache_n)
            out["timings"] = timings(t)
        return out

    return make


# generation_settings fields of llama-server's samplers Mixdesk does not have, at the
# values that switch them off (what llama-server shows for a request not using them):
# a script reading any of them finds it, with the value that means "not applied"
LLAMA_ONLY_SETTINGS = {
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.9,
    "n_keep": 0,
    "n_discard": 0,
    "logit_bias": [],
    "min_keep": 0,
    "grammar": "",
    "grammar_lazy": False,
    "grammar_triggers": [],
    "preserved_tokens": [],
    "chat_format": "Content-only",
    "reasoning_format": "none",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
}


def generation_settings(
    p: SamplingParams,
    n_ctx: int,
    model: str,
    stream: bool,
    lora: list[dict],
    eog: Iterable[int] = (),
) -> dict:
    """llama-server's generation_settings. ``eog``: the end-of-generation tokens, which
    ``ignore_eos`` bans and llama-server then lists in logit_bias (bias null = -inf)."""
    bias = dict(p.logit_bias)
    if p.ignore_eos and not p.grammar:  # a finished grammar may still end (scheduler)
        bias.update((t, -math.inf) for t in eog)
    return {
        **LLAMA_ONLY_SETTINGS,
        "n_ctx": n_ctx,
        "model": model,
        "n_predict": p.n_predict,
        "seed": p.seed if p.seed is not None else 4294967295,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "stop": list(p.stop),
        "max_tokens": p.n_predict,
        "ignore_eos": p.ignore_eos,
        "stream": stream,
        "n_probs": p.n_probs,
        "n_keep": p.n_keep,
        "n_discard": p.n_discard,
        "logit_bias": logit_bias_settings(bias),
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "lora": lora,
    }


def logit_bias_settings(bias: Mapping[int, float]) -> list[dict]:
    """generation_settings.logit_bias as llama-server echoes it: one {"bias", "token"}
    per token; a ban (-inf) is null there (JSON has no infinity)."""
    return [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in sorted(bias.items())]


def oai_completion(
    done,
    *,
    cid: str,
    created: int,
    model: str,
    prompt_n: int,
    all_ids: Iterable[int],
    logprobs: dict | None,
) -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": build_info(),
        "choices": [
            {
                "text": done.content,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": finish_reason(done.stop_type),
            }
        ],
        "usage": usage(prompt_n, done),
        "timings": timings(done.timings),
        "lora": mix_to_lora(done.mix, all_ids),
    }


def oai_completion_chunk(
    text: str,
    *,
    cid: str,
    created: int,
    model: str,
    finish: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": build_info(),
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
    }


def oai_completion_logprobs(
    tokenizer, items: list[tuple[int, float | None, list]], n: int, text_offset0: int = 0
) -> dict:
    """OpenAI legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    toks, lps, tops, offs = [], [], [], []
    off = text_offset0
    for tid, lp, top in items:
        s = tokenizer.token_str(tid)
        toks.append(s)
        lps.append(lp)
        tops.append({tokenizer.token_str(t): v for t, v in (top or [])[:n]})
        offs.append(off)
        off += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def oai_chat(
    done,
    *,
    cid: str,
    created: int,
    model: str,
    prompt_n: int,
    all_ids: Iterable[int],
    logprobs: list[dict] | None,
) -> dict:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": build_info(),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.content},
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason(done.stop_type),
            }
        ],
        "usage": usage(prompt_n, done),
        "timings": timings(done.timings),
        "lora": mix_to_lora(done.mix, all_ids),
    }


def oai_chat_chunk(
    delta: dict,
    *,
    cid: str,
    created: int,
    model: str,
    finish: str | None = None,
    logprobs: list[dict] | None = None,
) -> dict:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": build_info(),
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish,
            }
        ],
    }


def models_list(
    base_id: str,
    model_info: Mapping,
    adapters: Sequence[Mapping],
    created: int | None = None,
    aliases: Sequence[str] = (),
    tags: Sequence[str] = (),
) -> dict:
    """GET /v1/models: the base model (llama-server's entry, with its --alias list and
    --tags) and every loaded adapter (vLLM's shape: ``parent`` is the base, ``root`` the
    adapter's path)."""
    created = int(created if created is not None else time.time())
    data = [
        {
            "id": base_id,
            "aliases": list(aliases),
            "tags": list(tags),
            "object": "model",
            "created": created,
            "owned_by": "llamacpp",
            "meta": {
                "n_vocab": model_info.get("n_vocab"),
                "n_ctx_train": model_info.get("n_ctx_train"),
                "n_embd": model_info.get("dim"),
                "n_params": model_info.get("n_params"),
                "size": model_info.get("memory_bytes"),
            },
        }
    ]
    for a in adapters:
        data.append(
            {
                "id": a["name"],
                "object": "model",
                "created": created,
                "owned_by": "mixdesk",
                "parent": base_id,
                "root": a["path"],
                "lora": {"id": a["id"], "scale": a["scale"]},
            }
        )
    return {"object": "list", "data": data}
