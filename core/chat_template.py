"""Render a model's chat template (``tokenizer.chat_template``) into a prompt string.

Templates come from model files, so they are untrusted input: they run in
jinja2's ImmutableSandboxedEnvironment (as in HF transformers), and any unsafe
attribute access fails at once instead of quietly rendering as empty text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
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


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox normally turns a blocked attribute into an Undefined that
    prints as "", so ``{{ ''.__class__ }}`` would pass silently. Raise instead, so a
    hostile template is reported rather than half-rendered."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


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
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
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

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = not source
        if self.is_fallback:
            log.warning("model has no chat template (tokenizer.chat_template); using ChatML")
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _make_environment().from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], tokenizer: Tokenizer | None = None
    ) -> ChatTemplate:
        def token_text(token_id: int | None) -> str:
            if token_id is None or tokenizer is None:
                return ""
            return tokenizer.token_str(token_id)

        return cls(
            meta.get("tokenizer.chat_template"),
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
            return self._template.render(**context)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template can trigger any Python error (e.g. 1/0, bad +)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
