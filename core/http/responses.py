"""Pure request parsing and response building for the HTTP API.

Nothing here touches the network or the scheduler: every function takes plain
values (a JSON body, engine events, a tokenizer) and returns plain dicts, so the
shapes can be tested without a server. The shapes follow llama.cpp's
llama-server (``/completion``, ``/lora-adapters``, ``/tokenize`` ...) and the
OpenAI API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..serve.sampling import SamplingError, SamplingParams, validate
from .build_info import build_info


class HttpError(Exception):
    """An error answered as ``{"error": {"code", "message", "type"}}``."""

    def __init__(
        self, message: str, code: int = 400, type: str = "invalid_request_error", **extra: Any
    ):
        super().__init__(message)
        self.message, self.code, self.type, self.extra = message, code, type, extra

    def body(self) -> dict:
        return error_body(self.message, self.code, self.type, **self.extra)


def error_body(
    message: str, code: int = 400, type: str = "invalid_request_error", **extra: Any
) -> dict:
    return {"error": {"code": code, "message": message, "type": type, **extra}}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---- reading request bodies --------------------------------------------------------


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else."""
    if not raw.strip():
        raise HttpError("the request body is empty; expected a JSON object")
    body = _loads(raw)
    if not isinstance(body, dict):
        raise HttpError("the request body must be a JSON object")
    return body


def parse_json_any(raw: bytes) -> Any:
    """Any JSON value (POST /lora-adapters takes a bare list); 400 if malformed."""
    if not raw.strip():
        raise HttpError("the request body is empty")
    return _loads(raw)


# a \uD800-\uDFFF escape: JSON allows a lone surrogate there, UTF-8 cannot carry one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _loads(raw: bytes) -> Any:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise HttpError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HttpError("the request body is nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(value, "")
        if where is not None:
            # refused here, before any answer starts: a stream would otherwise send
            # its 200 headers and then break on the first chunk that echoes it
            raise HttpError(f"{where or 'the body'}: a lone surrogate escape is not valid text")
    return value


def _lone_surrogate(value: Any, where: str) -> str | None:
    """The place of the first string holding a lone surrogate, or None."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, at))
                stack.append((x, f"{at}.{k}" if at else k))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
    return None


_MISSING = object()


def get_bool(body: Mapping, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise HttpError(f"{name} must be a boolean, got {v!r}")
    return v


def get_int(
    body: Mapping, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and (not math.isfinite(v) or v != int(v)))
    ):
        raise HttpError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise HttpError(f"{name} must be in {rng}, got {v}")
    return v


def get_float(body: Mapping, name: str, default: float) -> float:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise HttpError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def get_str(
    body: Mapping, name: str, default: str | None = None, required: bool = False
) -> str | None:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise HttpError(f'"{name}" is required')
        return default
    if not isinstance(v, str):
        raise HttpError(f"{name} must be a string, got {type(v).__name__}")
    return v


def get_stop(body: Mapping) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise HttpError("stop must be a string or a list of strings")


MAX_CHOICES = 16  # completions in one request (prompts x n): each takes a batch row


@dataclass
class GenOptions:
    """A generation request as read from a body (any of the three endpoints)."""

    params: SamplingParams
    stream: bool = False
    cache_prompt: bool = True
    return_tokens: bool = False
    lora: Any = None  # the raw "lora" field; None if absent
    model: str | None = None
    id_slot: int = -1  # llama-server's id_slot: the KV slot to run in (-1: any)
    return_progress: bool = False  # stream prompt_progress chunks during prefill
    extra: dict = field(default_factory=dict)


def parse_sampling(
    body: Mapping,
    n_predict_default: int = -1,
    oai: bool = False,
    defaults: SamplingParams | None = None,
) -> SamplingParams:
    """llama-server's sampling fields (also accepted on the OpenAI endpoints). A field
    the body lacks takes the server's default (``defaults``: --temp, --seed, ...)."""
    d = defaults or SamplingParams()
    if oai:
        n_predict = get_int(body, "max_completion_tokens", None, lo=-1)
        if n_predict is None:
            n_predict = get_int(body, "max_tokens", None, lo=-1)
        if n_predict is None:
            n_predict = get_int(body, "n_predict", n_predict_default, lo=-1)
    else:
        n_predict = get_int(body, "n_predict", None, lo=-1)
        if n_predict is None:
            n_predict = get_int(body, "max_tokens", n_predict_default, lo=-1)
    seed = get_int(body, "seed", d.seed)
    p = SamplingParams(
        temperature=get_float(body, "temperature", d.temperature),
        top_k=get_int(body, "top_k", d.top_k),
        top_p=get_float(body, "top_p", d.top_p),
        min_p=get_float(body, "min_p", d.min_p),
        repeat_penalty=get_float(body, "repeat_penalty", d.repeat_penalty),
        repeat_last_n=get_int(body, "repeat_last_n", d.repeat_last_n, lo=-1),
        presence_penalty=get_float(body, "presence_penalty", d.presence_penalty),
        frequency_penalty=get_float(body, "frequency_penalty", d.frequency_penalty),
        seed=None if seed is None or seed < 0 else seed,
        n_predict=n_predict,
        stop=get_stop(body),
        ignore_eos=get_bool(body, "ignore_eos", d.ignore_eos),
        n_probs=get_int(body, "n_probs", 0, lo=0, hi=100),
        n_keep=get_int(body, "n_keep", 0, lo=-1),
        n_discard=get_int(body, "n_discard", 0, lo=0),
    )
    try:
        return validate(p)  # the engine's range rules, reported as a 400
    except SamplingError as e:
        raise HttpError(str(e)) from None


def parse_generation(
    body: Mapping,
    n_predict_default: int = -1,
    oai: bool = False,
    defaults: SamplingParams | None = None,
) -> GenOptions:
    params = parse_sampling(body, n_predict_default, oai, defaults)
    n = parse_n(body)
    opts = GenOptions(
        params=params,
        stream=get_bool(body, "stream", False),
        cache_prompt=get_bool(body, "cache_prompt", True),
        return_tokens=get_bool(body, "return_tokens", False),
        lora=body.get("lora"),
        model=get_str(body, "model"),
        id_slot=get_int(body, "id_slot", -1, lo=-1),
        return_progress=get_bool(body, "return_progress", False),
    )
    if "lora" in body and body["lora"] is None:
        raise HttpError('lora must be a list of {"id", "scale"} objects, got null')
    opts.extra["n"] = n
    return opts


def parse_n(body: Mapping) -> int:
    """Completions per prompt: OpenAI's ``n``, llama-server's ``n_cmpl``. Every one is a
    sequence in the batch, so a request may ask for at most MAX_CHOICES in all."""
    n = get_int(body, "n_cmpl", None)
    name = "n_cmpl" if n is not None else "n"
    n = n if n is not None else get_int(body, "n", 1)
    if n < 1:
        raise HttpError(f"{name} must be at least 1, got {n}")
    if n > MAX_CHOICES:
        raise HttpError(
            f"{name} = {n} is too many completions for one request (at most {MAX_CHOICES})"
        )
    return n


def is_multi_prompt(prompt: Any) -> bool:
    """llama-server's several prompts in one request: a list of two or more prompts,
    each a string, a token list or a {"prompt_string"} object."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(x, (str, list, dict)) for x in prompt)
    )


def check_choices(n_prompts: int, n: int) -> None:
    if n_prompts * n > MAX_CHOICES:
        raise HttpError(
            f"{n_prompts} prompts x n = {n} is {n_prompts * n} completions, too many for "
            f"one request (at most {MAX_CHOICES})"
        )


def parse_oai_logprobs(body: Mapping, chat: bool) -> int:
    """OpenAI's logprobs knobs as a top-N count (0: off). Chat: logprobs bool +
    top_logprobs int; completions: logprobs int."""
    if chat:
        on = get_bool(body, "logprobs", False)
        top = get_int(body, "top_logprobs", None, lo=0, hi=20)
        if top and not on:
            raise HttpError("top_logprobs requires logprobs: true")
        return max(top or 0, 1) if on else 0
    v = body.get("logprobs")
    if v is None or v is False:
        return 0
    return get_int(body, "logprobs", 0, lo=0, hi=20) or 0


def parse_prompt(prompt: Any, tokenizer) -> list[int]:
    """llama-server's prompt forms: a string, a token list, or tokens mixed with
    strings. A BOS is added (if the model wants one) only when the prompt starts
    with text."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list):
        if not prompt:
            raise HttpError("the prompt is empty")
        if all(isinstance(x, (str, list, dict)) for x in prompt):
            if len(prompt) == 1:
                return parse_prompt(prompt[0], tokenizer)
            raise HttpError(
                "multiple prompts in one request are not supported; send one request per prompt"
            )
        out: list[int] = []
        for i, x in enumerate(prompt):
            if isinstance(x, bool):
                raise HttpError(f"prompt[{i}]: expected a token id or a string, got {x!r}")
            if isinstance(x, int):
                out.append(x)
            elif isinstance(x, str):
                out += tokenizer.encode(x, add_special=(i == 0), parse_special=True)
            else:
                raise HttpError(f"prompt[{i}]: expected a token id or a string, got {x!r}")
        return out
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_string"), str):
        if prompt.get("multimodal_data"):
            raise HttpError("multimodal prompts are not supported")
        return parse_prompt(prompt["prompt_string"], tokenizer)
    if prompt is None:
        raise HttpError('"prompt" is required')
    raise HttpError("prompt must be a string, a list of token ids, or a list mixing both")


def check_prompt_tokens(ids: list[int], n_vocab: int) -> None:
    """Every prompt token id must be in the vocabulary: a 400 naming the first one
    that is not (it would otherwise fail deep in the engine, or in a log line)."""
    for i, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise HttpError(
                f"prompt[{i}]: token id {t} is out of range (vocabulary has {n_vocab} tokens)"
            )


def parse_messages(body: Mapping) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise HttpError('"messages" must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HttpError(f'messages[{i}] must be an object with a string "role"')
        if m["role"] != "assistant" and "content" not in m:
            raise HttpError(f'messages[{i}]: all non-assistant messages must contain "content"')
        if m["role"] == "assistant" and "content" not in m and "tool_calls" not in m:
            raise HttpError(f'messages[{i}]: an assistant message needs "content" or "tool_calls"')
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise HttpError(f"messages[{i}].content must be a string or a list of parts")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise HttpError(f"messages[{i}].content[{j}]: only text parts are supported")
    return msgs


@dataclass
class ChatOptions:
    """The prompt settings of a chat request, as llama-server reads them."""

    add_generation_prompt: bool = True
    continue_final_message: Any = None
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _tool(i: int, t: Any) -> dict:
    """One OpenAI tool, re-emitted as llama-server gives it to the template."""
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HttpError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
    desc = fn.get("description", "")
    params = fn.get("parameters")
    if not isinstance(desc, str):
        raise HttpError(f"tools[{i}].function.description must be a string")
    if params is not None and not isinstance(params, dict):
        raise HttpError(f"tools[{i}].function.parameters must be an object")
    if not params:
        params = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": fn["name"], "description": desc, "parameters": params},
    }


def parse_chat_options(body: Mapping) -> ChatOptions:
    """add_generation_prompt, continue_final_message, tools/tool_choice and
    chat_template_kwargs of a chat or /apply-template request; the rules that need
    the messages (prefill, two trailing assistant messages) are build_prompt's."""
    opts = ChatOptions(add_generation_prompt=get_bool(body, "add_generation_prompt", True))
    cont = body.get("continue_final_message")
    if cont is not None and not isinstance(cont, (bool, str)):
        raise HttpError(
            'continue_final_message must be a boolean, "content" or "reasoning_content"'
        )
    opts.continue_final_message = cont
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise HttpError('"tools" must be a list of {"type": "function", ...} objects')
        opts.tools = [_tool(i, t) for i, t in enumerate(tools)] or None
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required"):
        if not isinstance(choice, dict):
            raise HttpError('tool_choice must be "auto", "none", "required" or an object')
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise HttpError("chat_template_kwargs must be an object")
        opts.template_kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise HttpError("reasoning_effort must be a string")
    if effort == "none":  # OpenAI's switch: no reasoning
        opts.template_kwargs["enable_thinking"] = False
        opts.template_kwargs.pop("reasoning_effort", None)
    elif effort:
        opts.template_kwargs["reasoning_effort"] = effort
    return opts


def parse_token_list(v: Any, n_vocab: int, what: str = "tokens") -> list[int]:
    if not isinstance(v, list):
        raise HttpError(f'"{what}" must be a list of token ids')
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int):
            raise HttpError(f"{what}[{i}] must be an integer token id, got {t!r}")
        if not 0 <= t < n_vocab:
            raise HttpError(f"{what}[{i}]: token id {t} is out of range (vocabulary has {n_vocab})")
    return v


# ---- building responses ------------------------------------------------------------


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


def parse_response_fields(body: Mapping) -> list[str]:
    v = body.get("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise HttpError("response_fields must be a list of field names")
    return v


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


def parse_include_usage(body: Mapping) -> bool:
    """OpenAI's ``stream_options: {"include_usage": true}``."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise HttpError("stream_options must be an object")
    return get_bool(so, "include_usage", False)


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
