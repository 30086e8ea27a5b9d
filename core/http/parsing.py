"""Reading requests: llama-server's and OpenAI's request bodies into plain values.

Nothing here touches the network or the scheduler: every function takes a JSON body
(or its bytes) and returns plain values, or raises HttpError, a 400 naming the field.
The fields and their rules follow llama.cpp's llama-server (``/completion``,
``/lora-adapters``, ``/tokenize`` ...) and the OpenAI API. Building the answers is
core/http/responses.py.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import HttpError
from ..lora.control import check_scale as check_vector_scale
from ..lora.merge import MergeSpec
from ..lora.mix import Mix
from ..lora.registry import scales_of_list
from ..serve.sampling import SamplingError, SamplingParams, validate


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
    control_vectors: Any = None  # the raw "control_vectors" field; None if absent
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
        control_vectors=body.get("control_vectors"),
        model=get_str(body, "model"),
        id_slot=get_int(body, "id_slot", -1, lo=-1),
        return_progress=get_bool(body, "return_progress", False),
    )
    for name in ("lora", "control_vectors"):
        if name in body and body[name] is None:
            raise HttpError(f'{name} must be a list of {{"id", "scale"}} objects, got null')
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


def parse_response_fields(body: Mapping) -> list[str]:
    v = body.get("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise HttpError("response_fields must be a list of field names")
    return v


def parse_include_usage(body: Mapping) -> bool:
    """OpenAI's ``stream_options: {"include_usage": true}``."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise HttpError("stream_options must be an object")
    return get_bool(so, "include_usage", False)


def parse_lora(entries: Any, what: str, known: Iterable[int]) -> dict[int, float] | Mix:
    """A mix from its wire form: llama-server's ``[{"id", "scale"}]`` list, as a full
    mix over the ``known`` adapter ids (unlisted ids 0); or Mixdesk's object form
    ``{"adapters": [{"id", "scale"}, ...], "method", "density", "rank", "seed",
    "majority_sign_method"}``, as a Mix carrying its MergeSpec. The one reading of a
    request's ``"lora"`` field and of ``POST /lora-adapters``'s body; raises a 400
    naming the field, and changes nothing."""
    ids = list(known)
    if isinstance(entries, dict):
        fields = dict(entries)
        if "adapters" not in fields:
            raise HttpError(f'{what}: the object form needs "adapters": [{{"id", "scale"}}, ...]')
        scales = parse_lora(fields.pop("adapters"), f"{what}.adapters", ids)
        return Mix(scales, MergeSpec.from_dict(fields, what))
    if not isinstance(entries, list):
        raise HttpError(
            f'{what} must be a list of {{"id", "scale"}} objects '
            '(or {"adapters": [...], "method": ...})'
        )
    return scales_of_list(entries, what, ids, error=HttpError)


def parse_control_vectors(entries: Any, what: str, known: Iterable[int]) -> dict[int, float]:
    """Control-vector scales from their wire form, ``[{"id", "scale"}]`` as a ``lora``
    list (scale 1 when left out; unlisted ids 0, so ``[]`` is no vector): the one
    reading of a request's ``"control_vectors"`` field and of ``POST
    /control-vectors``'s body. A 400 naming the field, and nothing changed."""
    return scales_of_list(
        entries, what, known, error=HttpError, noun="control vector", check=check_vector_scale
    )
