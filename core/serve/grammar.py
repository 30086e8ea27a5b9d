"""Structured output: a GBNF grammar, a JSON schema or a regex constrains sampling.

The grammar engine is llguidance (the Rust library behind Guidance, with prebuilt
wheels): it reads llama.cpp's GBNF (converted to its Lark dialect), JSON schema and
regex, works on the tokenizer's token *bytes*, and computes the set of allowed next
tokens in well under a millisecond per step, so writing our own Earley parser over
byte-level tokens was not worth it.

``compile_grammar`` turns a request's field into llguidance's grammar text and
validates it against the model's vocabulary (a bad grammar or schema is the user's
mistake: GrammarError, a 400). ``Constraint`` is one sequence's parser state: the
sampler asks it for the allowed-token mask before each token and tells it the token
chosen. Unconstrained sequences never build one, so they pay nothing.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from ..errors import MixdeskError, UserError

KINDS = ("gbnf", "json_schema", "lark", "regex")
MAX_GRAMMAR_CHARS = 256 << 10  # a grammar or schema longer than this is refused
_ANY_JSON_OBJECT = '{"type": "object"}'

_llt_lock = threading.Lock()
_llt_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> LLTokenizer


class GrammarError(UserError):
    """An invalid grammar, JSON schema or regex in a request."""


class ConstraintError(MixdeskError):
    """The grammar left no token to sample (a bug or a grammar that cannot continue):
    the scheduler fails that one request with this message."""


class _VocabWrapper:
    """What llguidance's TokenizerWrapper reads: every token's bytes (control tokens
    marked with a leading 0xFF, as llguidance expects special tokens), the EOS id and
    an encode function for the text it needs to tokenize itself."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else -1
        self.bos_token_id = tokenizer.bos_id
        tokens, special = [], []
        for i in range(tokenizer.vocab_size):
            b = tokenizer.token_bytes(i)
            if tokenizer.is_control(i):
                b, _ = b"\xff" + b, special.append(i)
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def lltokenizer(tokenizer):
    """llguidance's view of this model's vocabulary, built once per Tokenizer (~0.2 s
    for a 49k vocabulary). Every end-of-generation token ends a grammar."""
    import llguidance

    with _llt_lock:
        llt = _llt_cache.get(tokenizer)
        if llt is None:
            eos = sorted(tokenizer.eog_ids) or None
            wrapper = llguidance.TokenizerWrapper(_VocabWrapper(tokenizer))
            llt = llguidance.LLTokenizer(wrapper, eos_token=eos)
            _llt_cache[tokenizer] = llt
        return llt


def compile_grammar(kind: str, text: Any, tokenizer) -> str:
    """llguidance's grammar text for a request's ``grammar`` (GBNF or Lark),
    ``json_schema`` (a schema object or its JSON text) or ``regex``, validated against
    the tokenizer; GrammarError names the field and says what is wrong."""
    import llguidance

    field = "json_schema" if kind == "json_schema" else kind
    if kind == "json_schema":
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except ValueError:
                raise GrammarError("json_schema: not valid JSON") from None
        if not isinstance(text, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object")
        text = json.dumps(text)
    elif not isinstance(text, str):
        raise GrammarError(f"{field} must be a string")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"{field} is too long ({len(text)} characters, limit {MAX_GRAMMAR_CHARS})"
        )
    try:
        fmt = {"gbnf": "gbnf", "lark": "lark", "json_schema": "json_schema", "regex": "regex"}[kind]
        grammar = llguidance.grammar_from(fmt, text)
    except KeyError:
        raise GrammarError(f"unknown grammar kind {kind!r}") from None
    except Exception as e:  # the GBNF converter raises ValueError/Exception on bad input
        raise GrammarError(f"invalid {_what(kind)}: {_one_line(e)}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer(tokenizer))
    if err:
        raise GrammarError(f"invalid {_what(kind)}: {_one_line(err)}")
    return grammar


def request_constraint(body, tokenizer) -> str | None:
    """The grammar a generation request asks for, compiled, or None: llama-server's
    ``grammar`` (GBNF; Lark is accepted too) and ``json_schema``, and OpenAI's
    ``response_format`` (``json_object``, optionally with a ``schema``, or
    ``json_schema`` with ``json_schema.schema``). Blocking (~0.2 s the first time per
    model): call it off the event loop."""
    kind, text = _requested(body)
    return None if kind is None else compile_grammar(kind, text, tokenizer)


def wants_constraint(body) -> bool:
    """Cheap check (no compiling): does this body ask for structured output?"""
    return _requested(body)[0] is not None


def _requested(body) -> tuple[str | None, Any]:
    grammar = body.get("grammar")
    schema = body.get("json_schema")
    if grammar is not None and not isinstance(grammar, str):
        raise GrammarError('"grammar" must be a string')
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise GrammarError('"response_format" must be an object')
        t = fmt.get("type") or "text"  # llama-server: an absent or empty type is text
        if t == "json_object":
            if "schema" in fmt or schema is None:  # else the body's json_schema stays
                schema = fmt.get("schema", {})
        elif t == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict):
                raise GrammarError('response_format: "json_schema" must be an object')
            schema = js.get("schema", {})
        elif t != "text":
            got = t if isinstance(t, str) else json.dumps(t)
            raise GrammarError(
                'response_format type must be one of "text", "json_object" or "json_schema", '
                f"but got: {_one_line(got, 40)}"
            )
    if schema == {}:
        schema = json.loads(_ANY_JSON_OBJECT)  # llama-server: an empty schema means any object
    if grammar and schema is not None:
        raise GrammarError('Either "json_schema" or "grammar" can be specified, but not both')
    if schema is not None:
        return "json_schema", schema
    if grammar:
        return "gbnf", grammar  # GBNF, or Lark (llguidance tells them apart)
    return None, None


def _what(kind: str) -> str:
    return {"gbnf": "grammar", "lark": "grammar", "json_schema": "JSON schema"}.get(kind, kind)


def _one_line(e: object, limit: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Constraint:
    """One sequence's grammar state: which tokens may come next, and what came."""

    def __init__(self, grammar: str, tokenizer):
        import llguidance

        self.n_vocab = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(lltokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"grammar: {_one_line(self.matcher.get_error())}")

    def allowed(self, n_logits: int) -> np.ndarray:
        """A boolean mask over the model's logits (n_logits may exceed the tokenizer's
        vocabulary: padding rows are never allowed)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)  # (n_vocab,)
        if n_logits != self.n_vocab:
            out = np.zeros(n_logits, dtype=bool)  # (n_logits,)
            k = min(n_logits, self.n_vocab)
            out[:k] = mask[:k]
            mask = out
        if self.matcher.is_error() or not mask.any():
            why = self.matcher.get_error() or "no token can continue it"
            raise ConstraintError(f"the grammar allows no next token: {_one_line(why)}")
        return mask

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(
                f"the grammar rejected token {token}: {_one_line(self.matcher.get_error())}"
            )
