"""Render a model's chat template (``tokenizer.chat_template``) into a prompt string.

Templates come from model files, so they are untrusted input: they run in
jinja2's ImmutableSandboxedEnvironment (as in HF transformers), and any unsafe
attribute access fails at once instead of quietly rendering as empty text.

The sandbox alone does not stop a template from taking all the CPU time or memory
(``{% for a in range(99999) %}{% for b in range(99999) %}...``, ``'x' * 10**9``),
so every render also runs under limits (:class:`RenderLimits`), checked from
inside the render: a deadline (a line tracer on the template's own code, so loops
without any call are stopped too), and a size budget checked *before* each
operation that could build a big value (``*``, ``+``, ``%``, ``**``, ``~``, method
and filter calls with a huge count) and on the output as it is produced. Going
over either raises ChatTemplateError, which the HTTP API answers with a 400.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer

from .errors import UserError

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(UserError):
    """The chat template is invalid, raised an error, or tried something unsafe."""


class TemplateLimitError(ChatTemplateError):
    """A render went over its time or size limit (RenderLimits)."""


@dataclass(frozen=True)
class RenderLimits:
    """How much one render may take. The size budget grows with the input, so a long
    conversation still renders: ``min_chars + per_input_char * (characters given)``.
    A real chat template renders in milliseconds and adds a few hundred characters."""

    seconds: float = 5.0
    min_chars: int = 1 << 20
    per_input_char: int = 4
    max_int_bits: int = 4096  # ints a template computes (10**10**10 would hang in C)


DEFAULT_LIMITS = RenderLimits()
_TEMPLATE_FILENAME = "<template>"  # co_filename of jinja's compiled template code
_BIG_FORMAT_WIDTH = re.compile(r"\d{7,}")  # a width/precision of a million or more


class _Budget:
    """The limits of the render running on this thread."""

    def __init__(self, limits: RenderLimits, input_chars: int):
        # inside build_prompt, every render of one prompt shares that prompt's deadline
        shared = getattr(_current, "deadline", None)
        own = time.monotonic() + limits.seconds
        self.deadline = own if shared is None else min(own, shared)
        self.seconds = limits.seconds
        self.chars = limits.min_chars + limits.per_input_char * input_chars
        self.max_int_bits = limits.max_int_bits

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"chat template took longer than {self.seconds:g} s to render (limit)"
            )

    def check_size(self, n: int, what: str) -> None:
        if n > self.chars:
            raise TemplateLimitError(
                f"chat template would build {what} of {n} items, over the limit of {self.chars}"
            )


_current = threading.local()  # .budget: the _Budget of the render on this thread
# .deadline: the time limit of the prompt being built on this thread (build_prompt), which
# may render the template up to three times (the system-role probe, and the two renders
# of a continued message): the limit is the prompt's, not each render's
# .probe: a marker text whose reading the capability probe records in .probe_seen


def _note_probe(value: Any) -> Any:
    """During a capability probe, record that the template read the marker value
    (llama-server's engine tracks the same: was the system content used at all)."""
    marker = getattr(_current, "probe", None)
    if marker is not None and isinstance(value, str) and value == marker:
        _current.probe_seen = True
    return value


@contextlib.contextmanager
def _one_deadline(limits: RenderLimits):
    """Every render inside shares one deadline, ``limits.seconds`` from now (an outer
    one, if earlier, stays)."""
    outer = getattr(_current, "deadline", None)
    mine = time.monotonic() + limits.seconds
    _current.deadline = mine if outer is None else min(mine, outer)
    try:
        yield
    finally:
        _current.deadline = outer


def _budget() -> _Budget | None:
    return getattr(_current, "budget", None)


def _sized(v: Any) -> bool:
    return isinstance(v, (str, list, tuple, bytes))


def _check_binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too big, before it is computed."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        if _sized(left) and isinstance(right, int):
            b.check_size(len(left) * max(right, 0), "a value")
        elif _sized(right) and isinstance(left, int):
            b.check_size(len(right) * max(left, 0), "a value")
        elif ints and left.bit_length() + right.bit_length() > b.max_int_bits:
            raise TemplateLimitError("chat template computes a number too large (limit)")
    elif op == "+" and _sized(left) and _sized(right):
        b.check_size(len(left) + len(right), "a value")
    elif op == "**" and ints:
        bits = abs(left).bit_length() if abs(left) > 1 else 1
        if right > 0 and bits * right > b.max_int_bits:
            raise TemplateLimitError("chat template computes a number too large (limit)")
    elif op == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        if _BIG_FORMAT_WIDTH.search(left) or any(
            isinstance(a, int) and abs(a) > b.chars for a in args
        ):
            raise TemplateLimitError("chat template formats a value too wide (limit)")


def _check_args(b: _Budget, args: tuple, kwargs: dict) -> None:
    """A call given a count beyond the budget (``'x'.ljust(10**9)``,
    ``lipsum(n=10**9)``, ``center(10**9)``) would build a value that big."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > b.chars:
            raise TemplateLimitError(f"chat template passes {a} to a call, over the size limit")


def _check_format(text: str) -> None:
    """``'{:>999999999}'.format(x)``: a format string asking for a huge width."""
    if _BIG_FORMAT_WIDTH.search(text):
        raise TemplateLimitError("chat template formats a value too wide (limit)")


def _check_result(b: _Budget, value: Any) -> Any:
    if _sized(value):
        b.check_size(len(value), "a value")
    return value


def _guard_filter(fn):
    """A built-in filter wrapped with the argument and result checks (filters are
    called directly by compiled code, not through the sandbox's ``call``)."""

    @functools.wraps(fn)  # keeps jinja_pass_arg (pass_context, pass_environment...)
    def guarded(*args, **kwargs):
        b = _budget()
        if b is not None:
            b.check_time()
            _check_args(b, args[1:], kwargs)
            return _check_result(b, fn(*args, **kwargs))
        return fn(*args, **kwargs)

    return guarded


class _GuardedCodeGenerator(CodeGenerator):
    """``a ~ b`` compiles to a plain join that no sandbox hook sees; route it through
    the environment so its size is checked before the string is built."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.guarded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LenientUndefined(jinja2.ChainableUndefined):
    """An undefined name renders as "" and its attributes and items are undefined too
    (``functions.x``, ``tools[0]``), as in llama-server's template engine: templates
    written for it read variables Mixdesk may not pass. Unsafe attributes still
    raise (the sandbox's ``unsafe_undefined`` below)."""

    __slots__ = ()


def _blank(v: Any) -> bool:
    return v is None or isinstance(v, jinja2.Undefined)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox normally turns a blocked attribute into an Undefined that
    prints as "", so ``{{ ''.__class__ }}`` would pass silently. Raise instead, so a
    hostile template is reported rather than half-rendered.

    Also the place where the render limits are enforced: every call, attribute
    lookup and intercepted operator checks the deadline and the size budget."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _budget()
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.check_time()
        _check_args(b, args, kwargs)
        return _check_result(b, super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        if b is not None:
            b.check_time()
            _check_binop(b, operator, left, right)
        if operator == "+":  # llama-server: none/undefined + text is the text
            if isinstance(left, str) and _blank(right):
                return left
            if isinstance(right, str) and _blank(left):
                return right
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = _budget()
        if b is not None:
            b.check_time()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj)
        return _note_probe(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _note_probe(super().getitem(obj, argument))

    def guarded_concat(self, parts: tuple) -> str:
        strs = [p if isinstance(p, str) else str(p) for p in parts]
        b = _budget()
        if b is not None:
            b.check_size(sum(len(p) for p in strs), "a string")
        return "".join(strs)


def _deadline_tracer(b: _Budget):
    """A sys.settrace function that checks the deadline on every line of the
    template's compiled code (a loop with an empty body still runs its ``for`` line),
    and leaves every other frame untraced."""

    def local(frame, event, arg):
        if event == "line":
            b.check_time()
        return local

    def global_(frame, event, arg):
        if frame.f_code.co_filename == _TEMPLATE_FILENAME:
            b.check_time()
            return local
        return None

    return global_


def _input_chars(value: Any, depth: int = 0) -> int:
    """Characters of text in the render's input (messages, tools, extra context)."""
    if isinstance(value, str):
        return len(value)
    if depth > 20:
        return 0
    if isinstance(value, Mapping):
        return sum(
            _input_chars(k, depth + 1) + _input_chars(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        return sum(_input_chars(v, depth + 1) for v in value)
    return 0


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's version: jinja's built-in tojson HTML-escapes <, >, & and ', which would
    # corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_environment() -> jinja2.Environment:
    # optimized=False: jinja's optimizer evaluates constant expressions at compile
    # time, outside any render limit ('x'|center(10**9) would be built while loading).
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        optimized=False,
        undefined=_LenientUndefined,
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten_content(message: Mapping[str, Any], sep: str = "\n") -> dict[str, Any]:
    """OpenAI-style content parts -> one string; templates expect plain text. Parts are
    joined by ``sep``: a newline, as llama.cpp's concat_content_parts (a continued final
    message: a blank line, its render_content)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            part.get("text", "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return {**message, "content": sep.join(texts)}
    return dict(message)


class ChatTemplate:
    """A compiled chat template; ChatML when the model ships none."""

    def __init__(
        self,
        source: str | None,
        bos_token: str = "",
        eos_token: str = "",
        limits: RenderLimits = DEFAULT_LIMITS,
        add_bos: bool = False,
        add_eos: bool = False,
    ):
        self.limits = limits
        self.is_fallback = not source
        if self.is_fallback:
            log.warning("model has no chat template (tokenizer.chat_template); using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        # whether the tokenizer adds BOS/EOS itself: then a BOS/EOS the template
        # writes is cut from the text, as llama-server does (no double BOS)
        self.add_bos, self.add_eos = add_bos, add_eos
        self._system_role: bool | None = None
        # Jinja evaluates constant parts ({{ 'x'|center(10**9) }}) while compiling, so
        # compiling runs under the limits too (an over-limit constant is left to the render).
        outer = getattr(_current, "budget", None)
        _current.budget = _Budget(limits, len(source))
        try:
            self._template = _make_environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        except (RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}") from e
        finally:
            _current.budget = outer

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], tokenizer: Tokenizer | None = None
    ) -> ChatTemplate:
        def token_text(token_id: int | None) -> str:
            if token_id is None or tokenizer is None:
                return ""
            return tokenizer.token_str(token_id)

        source = meta.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            log.warning(
                "the model's tokenizer.chat_template is a %s, not text; using ChatML",
                type(source).__name__,
            )
            source = None
        return cls(
            source,
            bos_token=token_text(tokenizer.bos_id if tokenizer else None),
            eos_token=token_text(tokenizer.eos_id if tokenizer else None),
            add_bos=bool(tokenizer and tokenizer.add_bos),
            add_eos=bool(tokenizer and tokenizer.add_eos),
        )

    def with_source(self, source: str) -> ChatTemplate:
        """Another template (--chat-template, --chat-template-file) for the same
        tokenizer: same BOS/EOS texts and flags."""
        return ChatTemplate(
            source, self.bos_token, self.eos_token, self.limits, self.add_bos, self.add_eos
        )

    @property
    def supports_system_role(self) -> bool:
        """Whether the template reads a leading system message's content at all, found
        as llama-server finds it: render [system, user] and watch whether the system
        text is read (Gemma 2 and Mistral v0.1 raise before reading it). When not,
        build_prompt merges the system text into the first user turn."""
        if self._system_role is None:
            marker = "System message \u2063probe"
            probe = [
                {"role": "system", "content": marker},
                {"role": "user", "content": "User message"},
            ]
            _current.probe, _current.probe_seen = marker, False
            try:
                self.render(probe, add_generation_prompt=True, tools=[])
            except TemplateLimitError:
                raise  # over its limits on a two-message probe: decide nothing, say so
            except ChatTemplateError:
                pass  # a template that raises may still have read it
            finally:
                seen = bool(getattr(_current, "probe_seen", False))
                _current.probe = None
            self._system_role = seen
        return self._system_role

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The template's text for these messages, as is (build_prompt is the full
        llama-server prompt: variables, system-role merge, prefill, BOS cut).
        ``add_generation_prompt`` is left undefined when false, as llama-server does."""
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": [_flatten_content(m) for m in messages],
        }
        if add_generation_prompt:
            context["add_generation_prompt"] = True
        else:
            context.pop("add_generation_prompt", None)
        try:
            return self._render_limited(context)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory") from None
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template can trigger any Python error (e.g. 1/0, bad +)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def _render_limited(self, context: dict) -> str:
        """Render under self.limits (see the module docstring). Call it off the event
        loop: it can take up to ``limits.seconds``."""
        b = _Budget(self.limits, _input_chars(context))
        outer = getattr(_current, "budget", None)
        _current.budget = b
        previous_trace = sys.gettrace()
        sys.settrace(_deadline_tracer(b))
        try:
            out: list[str] = []
            n = 0
            for chunk in self._template.generate(**context):
                n += len(chunk)
                b.check_size(n, "an output")
                out.append(chunk)
            return "".join(out)
        finally:
            sys.settrace(previous_trace)
            _current.budget = outer


# ---- llama-server's built-in template names ----------------------------------------
# Our own Jinja sources for the formats llama.cpp writes in C++ (src/llama-chat.cpp)
# under these names: --chat-template NAME selects one.


def _mistral_source(lead: str, trail: str, trim: bool) -> str:
    """Mistral v1/v3/v3-tekken: one [INST] per turn; a system text opens the turn."""
    content = "m.content|trim" if trim else "m.content"
    return (
        "{%- set ns = namespace(inside=false) -%}"
        "{%- for m in messages -%}"
        "{%- if not ns.inside -%}{{- '" + lead + "[INST]" + trail + "' -}}"
        "{%- set ns.inside = true -%}{%- endif -%}"
        "{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
        "{%- elif m.role == 'user' -%}{{- m.content + '" + lead + "[/INST]' -}}"
        "{%- else -%}{{- '" + trail + "' + " + content + " + '</s>' -}}"
        "{%- set ns.inside = false -%}{%- endif -%}"
        "{%- endfor -%}"
    )


def _mistral_v7_source(space: str) -> str:
    return (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT]" + space + "' + m.content + "
        "'[/SYSTEM_PROMPT]' -}}"
        "{%- elif m.role == 'user' -%}{{- '[INST]" + space + "' + m.content + '[/INST]' -}}"
        "{%- else -%}{{- '" + space + "' + m.content + '</s>' -}}{%- endif -%}"
        "{%- endfor -%}"
    )


def _llama2_source(system: bool, bos_inside: bool = False) -> str:
    sys_text = "'<<SYS>>\n' + m.content + '\n<</SYS>>\n\n'" if system else "m.content + '\n'"
    reopen = "<s>[INST] " if bos_inside else "[INST] "
    return (
        "{{- '[INST] ' -}}{%- set ns = namespace(inside=true) -%}"
        "{%- for m in messages -%}"
        "{%- if not ns.inside -%}{{- '" + reopen + "' -}}{%- set ns.inside = true -%}{%- endif -%}"
        "{%- if m.role == 'system' -%}{{- " + sys_text + " -}}"
        "{%- elif m.role == 'user' -%}{{- m.content + ' [/INST]' -}}"
        "{%- else -%}{{- m.content + '</s>' -}}{%- set ns.inside = false -%}{%- endif -%}"
        "{%- endfor -%}"
    )


def _per_message_source(head: str, tail: str, gen: str, content: str = "m.content") -> str:
    """``head`` (with ROLE for the role) + content + ``tail`` per message, ``gen`` last."""
    head_expr = "'" + head.replace("ROLE", "' + m.role + '") + "'"
    return (
        "{%- for m in messages -%}{{- " + head_expr + " + " + content + " + '" + tail + "' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '" + gen + "' -}}{%- endif -%}"
    )


BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "llama2": _llama2_source(system=False),
    "llama2-sys": _llama2_source(system=True),
    "llama2-sys-bos": _llama2_source(system=True, bos_inside=True),
    "llama3": _per_message_source(
        "<|start_header_id|>ROLE<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        content="m.content|trim",
    ),
    "mistral-v1": _mistral_source(" ", " ", trim=False),
    "mistral-v3": _mistral_source("", " ", trim=True),
    "mistral-v3-tekken": _mistral_source("", "", trim=False),
    "mistral-v7": _mistral_v7_source(" "),
    "mistral-v7-tekken": _mistral_v7_source(""),
    "phi3": _per_message_source("<|ROLE|>\n", "<|end|>\n", "<|assistant|>\n"),
    "phi4": _per_message_source(
        "<|im_start|>ROLE<|im_sep|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>"
    ),
    "falcon3": _per_message_source("<|ROLE|>\n", "\n", "<|assistant|>\n"),
    "zephyr": _per_message_source("<|ROLE|>\n", "<|endoftext|>\n", "<|assistant|>\n"),
    "granite": _per_message_source(
        "<|start_of_role|>ROLE<|end_of_role|>",
        "<|end_of_text|>\n",
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
    "gemma": (  # no system turn: its text opens the next user turn
        "{%- set ns = namespace(sys='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + m.content|trim -%}"
        "{%- else -%}"
        "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
        "{{- '<start_of_turn>' + role + '\n' -}}"
        "{%- if ns.sys and role != 'model' -%}{{- ns.sys + '\n\n' -}}{%- set ns.sys = '' -%}"
        "{%- endif -%}"
        "{{- m.content|trim + '<end_of_turn>\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
    ),
    "deepseek3": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
        "{%- elif m.role == 'user' -%}{{- '<\uff5cUser\uff5c>' + m.content -}}"
        "{%- elif m.role == 'assistant' -%}"
        "{{- '<\uff5cAssistant\uff5c>' + m.content + '<\uff5cend\u2581of\u2581sentence\uff5c>' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<\uff5cAssistant\uff5c>' -}}{%- endif -%}"
    ),
    "vicuna": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
        "{%- elif m.role == 'user' -%}{{- 'USER: ' + m.content + '\n' -}}"
        "{%- elif m.role == 'assistant' -%}{{- 'ASSISTANT: ' + m.content + '</s>\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    ),
    "command-r": (
        "{%- for m in messages -%}"
        "{%- set tag = {'system': 'SYSTEM', 'user': 'USER', 'assistant': 'CHATBOT'}[m.role] -%}"
        "{%- if tag -%}{{- '<|START_OF_TURN_TOKEN|><|' + tag + '_TOKEN|>' + m.content|trim + "
        "'<|END_OF_TURN_TOKEN|>' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"
    ),
}


def resolve_template_arg(value: str) -> str:
    """--chat-template VALUE: a built-in name (BUILTIN_TEMPLATES) or an inline Jinja
    template. Raises ChatTemplateError for a name that is neither."""
    name = value.strip()
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    # text with a space is never a name: llama-server (--jinja) takes it as a template
    # too, and plain text renders as itself; a lone unknown word is a mistyped name
    if "{{" in value or "{%" in value or any(c.isspace() for c in name):
        return value
    known = ", ".join(sorted(BUILTIN_TEMPLATES))
    raise ChatTemplateError(
        f"--chat-template: {name[:40]!r} is neither a built-in template ({known}) "
        "nor a Jinja template"
    )


# ---- the prompt, built as llama-server builds it ------------------------------------

REASONING_MODES = ("on", "off", "auto")


@dataclass(frozen=True)
class ChatDefaults:
    """Server-wide prompt settings from the command line: llama-server's
    ``--reasoning on|off|auto``, ``--chat-template-kwargs`` and
    ``--no-prefill-assistant``. A request's chat_template_kwargs override them."""

    reasoning: str = "auto"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prefill_assistant: bool = True

    @property
    def enable_thinking(self) -> bool:
        return self.reasoning != "off"  # auto: on (llama-server: enable_reasoning != 0)


DEFAULT_CHAT = ChatDefaults()


def _continuation(value: Any) -> bool:
    """llama-server's continue_final_message: true, "content" or
    "reasoning_content" continue the last message; anything else does not."""
    return value is True or value in ("content", "reasoning_content")


def _merge_system(messages: list[dict]) -> list[dict]:
    """The system-role polyfill: a leading system text opens the next message
    (joined by a newline); alone, it is dropped."""
    if not messages or messages[0].get("role") != "system":
        return messages
    if len(messages) == 1:
        log.warning("the chat template has no system role; the system message is dropped")
        return []
    first, second = messages[0], messages[1]
    merged = {
        **second,
        "content": f"{first.get('content') or ''}\n{second.get('content') or ''}",
    }
    return [merged, *messages[2:]]


def _template_context(
    enable_thinking: bool,
    tools: list | None,
    kwargs: Mapping[str, Any],
    now: datetime,
) -> dict[str, Any]:
    ctx: dict[str, Any] = {"enable_thinking": enable_thinking}
    if tools:
        ctx["tools"] = tools
    ctx["datetime"] = now.strftime("%b %d %Y")
    ctx["date_string"] = now.strftime("%d %b %Y")
    ctx.update(kwargs)  # request kwargs override everything above, as in llama-server
    return ctx


def build_prompt(
    template: ChatTemplate,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: Any = None,
    tools: list | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    defaults: ChatDefaults = DEFAULT_CHAT,
    now: datetime | None = None,
) -> str:
    """The prompt text llama-server builds from these messages (the one function the
    HTTP API, the window's chat and Engine.chat use):

    - a trailing assistant message is continued (prefill) unless
      ``--no-prefill-assistant``; ``continue_final_message`` asks for it explicitly;
    - ``developer`` messages become ``system``; a system message opens the first user
      turn when the template has no system role;
    - the template gets ``bos_token``, ``eos_token``, ``enable_thinking``,
      ``date_string``, ``datetime``, ``tools`` (when given), ``add_generation_prompt``
      (when true), the ``strftime_now`` function and the template kwargs;
    - a BOS (EOS) text the template writes first (last) is cut when the tokenizer adds
      its own, so the prompt has one BOS.

    All of it, however many renders it takes, runs within one ``template.limits``
    time limit. Raises ChatTemplateError (a 400 on the API) for requests llama-server
    refuses."""
    kwargs = {**defaults.template_kwargs, **(template_kwargs or {})}
    enable_thinking = defaults.enable_thinking
    if "enable_thinking" in kwargs:
        v = kwargs["enable_thinking"]
        if not isinstance(v, bool):
            raise ChatTemplateError(
                f'invalid type for "enable_thinking" (expected boolean, got {type(v).__name__})'
            )
        enable_thinking = v
    msgs = list(messages)
    cont = _continuation(continue_final_message)
    if not cont and defaults.prefill_assistant and msgs and msgs[-1].get("role") == "assistant":
        if len(msgs) >= 2 and msgs[-2].get("role") == "assistant":
            raise ChatTemplateError(
                "Cannot have 2 or more assistant messages at the end of the list."
            )
        cont, add_generation_prompt = True, False
    if cont and add_generation_prompt:
        raise ChatTemplateError(
            "Cannot set both add_generation_prompt and continue_final_message to true."
        )
    last = msgs[-1] if cont and msgs else None
    if last is not None and last.get("role") == "assistant" and last.get("tool_calls"):
        raise ChatTemplateError("Cannot continue an assistant message that contains tool calls.")
    if last is not None:
        msgs = msgs[:-1]
    if "<|channel|>" not in template.source:  # GPT-OSS keeps its developer role
        msgs = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in msgs]
    with _one_deadline(template.limits):  # the probe and every render: one limit
        if not template.supports_system_role:
            msgs = [_flatten_content(m) for m in msgs]
            msgs = _merge_system(msgs)
        extra = _template_context(enable_thinking, tools, kwargs, now or datetime.now())
        if last is None:
            text = template.render(msgs, add_generation_prompt=add_generation_prompt, **extra)
        else:
            # the history, the template's own generation prompt, then the text to continue
            before = template.render(msgs, add_generation_prompt=False, **extra)
            opened = template.render(msgs, add_generation_prompt=True, **extra)
            n = 0
            while n < min(len(before), len(opened)) and before[n] == opened[n]:
                n += 1
            text = before + opened[n:] + (_flatten_content(last, "\n\n").get("content") or "")
    if template.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token) :]
    if template.add_eos and template.eos_token and text.endswith(template.eos_token):
        text = text[: -len(template.eos_token)]
    return text


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Tokens of a built prompt, as llama-server tokenizes it: the tokenizer's own BOS
    (the template's was cut by build_prompt) and special tokens parsed."""
    return tokenizer.encode(text, add_special=True, parse_special=True)
