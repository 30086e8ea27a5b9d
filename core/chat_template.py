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

import functools
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
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
        self.deadline = time.monotonic() + limits.seconds
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
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = _budget()
        if b is not None:
            b.check_time()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj)
        return super().getattr(obj, attribute)

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
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI-style content parts -> one string; templates expect plain text."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            part.get("text", "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        ]
        return {**message, "content": "\n".join(texts)}
    return dict(message)


class ChatTemplate:
    """A compiled chat template; ChatML when the model ships none."""

    def __init__(
        self,
        source: str | None,
        bos_token: str = "",
        eos_token: str = "",
        limits: RenderLimits = DEFAULT_LIMITS,
    ):
        self.limits = limits
        self.is_fallback = not source
        if self.is_fallback:
            log.warning("model has no chat template (tokenizer.chat_template); using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
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
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": [_flatten_content(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
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
