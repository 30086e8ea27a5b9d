"""Tokenizer built from a GGUF file's vocabulary, matching llama.cpp token for token.

Two vocabulary types are supported:

* ``gpt2``: byte-level BPE. Text is split by the pre-tokenizer regexes named by
  ``tokenizer.ggml.pre``, each piece is mapped byte-by-byte to GPT-2's printable
  alphabet and then merged by rank.
* ``llama``: SentencePiece-style BPE driven by token scores, with ``<0xNN>`` byte
  fallback and an optional leading space (``add_space_prefix``).

Special tokens are found in the text before normal tokenization (llama.cpp's
"partition" step): control tokens only with ``parse_special``, user-defined
tokens always. The behaviour follows llama.cpp's ``src/llama-vocab.cpp`` and
``src/unicode.cpp``; comments point out where and why we deviate.
"""

from __future__ import annotations

import codecs
import heapq
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex

from .errors import UserError
from .gguf.reader import short_name
from .model.config import describe_value

log = logging.getLogger(__name__)


class TokenizerError(UserError):
    """The model's tokenizer metadata is unsupported or inconsistent."""


# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*).
_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 2, 3, 4, 5, 6

# Token attribute bits (llama.cpp LLAMA_TOKEN_ATTR_*); a token's type maps to one bit,
# and auto-detection below can add CONTROL to tokens that look like control tokens.
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = (
    1,
    2,
    4,
    8,
    16,
    32,
)
_TYPE_TO_ATTR = {
    1: ATTR_NORMAL,
    _TYPE_UNKNOWN: ATTR_UNKNOWN,
    _TYPE_CONTROL: ATTR_CONTROL,
    _TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    _TYPE_UNUSED: ATTR_UNUSED,
    _TYPE_BYTE: ATTR_BYTE,
}
_ATTR_HIDDEN = ATTR_CONTROL | ATTR_UNKNOWN  # dropped by skip_special
_ATTR_SPECIAL = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # matched before BPE/SPM

_SPM_SPACE = "\u2581"  # '▁': SentencePiece's visible space

# --- pre-tokenizers ---------------------------------------------------------------
# The exact regex lists llama.cpp uses. Each regex further splits the pieces left by
# the previous one; text a regex does not match stays as its own piece. The `regex`
# package's \s is the same whitespace set as llama.cpp's, and \p{L}/\p{N} the same
# categories (up to Unicode version differences).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Tekken (Mistral Nemo / Small 3) and GPT-4o (Phi-4-mini, Llama 4) split words at
# case changes. Their tokenizer.json regexes use \p{Lu}/\p{Ll}...; llama.cpp runs an
# adapted form where "upper" is any letter but a-z and "lower" any letter but A-Z,
# and so do we (a non-ASCII letter counts as both, as in llama.cpp).
_UPPERISH = r"(?:(?=\p{L})[^a-z])"
_LOWERISH = r"(?:(?=\p{L})[^A-Z])"
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTION}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTION}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM / Coder: a cascade of simple regexes. The CJK/Hangul run covers
# U+4E00-U+9FA5, U+0800-U+4E00 and U+AC00-U+D7FF, as llama.cpp's ranges do.
_CJK_RUN = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    # llama.cpp spells out the cased letters (Lu, Ll, Lt) as ranges; \p{LC} is that set
    r"\s?\p{LC}+",
    # ASCII !-/ and :-~ (which includes the letters), full-width punctuation and
    # letters, curly quotes and the ideographic space/comma/full stop
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+\Z",  # llama.cpp's "\s+$": trailing whitespace of the piece (ECMAScript $)
    _CJK_RUN,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUN, r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token skips BPE (llama3)
    add_bos: bool = False  # llama.cpp's default before tokenizer.ggml.add_bos_token


_DEFAULT_PRE = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_SMOLLM_PRE = _PreTokenizer((r"\p{N}", _GPT2))
# tokenizer.ggml.pre -> pre-tokenizer, with the names llama.cpp maps to each
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT_PRE,
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo"), _PreTokenizer((_GPT2,))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _PreTokenizer((_QWEN2,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), _SMOLLM_PRE),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4"), _PreTokenizer((_GPT4O,))),
    "deepseek-llm": _PreTokenizer(_DEEPSEEK_LLM),
    "deepseek-coder": _PreTokenizer(_DEEPSEEK_CODER),
    "deepseek-v3": _PreTokenizer(_DEEPSEEK_V3),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabs."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}

# --- special-token auto-detection (llama.cpp identifies these by their text) -------
_EOT_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_AUTO_IDS = {  # metadata key -> candidate texts, tried when the key is absent
    "eot": _EOT_NAMES,
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_DEPRECATED_FIM_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
_EOG_NAMES = frozenset(_EOT_NAMES) | {
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "</s>",
    "<|eom_id|>",
    "[EOS]",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "[e~[",
}

_BPE_CACHE_LIMIT = 100_000  # words; bounds memory on huge, varied inputs
_SPM_CACHE_MAX_CHARS = 256  # longer SPM pieces (a run without spaces) are not cached
_SPM_SHORT = 48  # up to this many characters the list-based SPM beats the heap
_NO_MERGE = float("-inf")  # score of a pair that is not a token


class Tokenizer:
    """Encode/decode text exactly as llama.cpp does for the same GGUF vocabulary."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int]

    def __init__(self, meta: Mapping[str, Any]):
        check_metadata_types(meta)
        self.model = meta.get("tokenizer.ggml.model")
        if self.model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer model {short_name(self.model)} (supported: 'gpt2' BPE, 'llama' SPM)"
            )
        self._load_vocab(meta)
        if self.model == "gpt2":
            self._init_bpe(meta)
        else:
            self._init_spm(meta)
        self._load_special_ids(meta)
        self._detect_eog()
        # Longest first, as llama.cpp partitions: a longer special token wins over a
        # shorter one it contains.
        special = [i for i, a in enumerate(self._attrs) if a & _ATTR_SPECIAL]
        special.sort(key=lambda i: -len(self._tokens[i]))
        self._special_all = special
        # Without parse_special only user-defined tokens are matched, and never one that
        # also carries the control attribute (Gemma 3's "</s>" is user-defined in the
        # file and made control by the EOG detection above), as in llama.cpp.
        self._special_user = [
            i
            for i in special
            if self._attrs[i] & ATTR_USER_DEFINED and not self._attrs[i] & _ATTR_HIDDEN
        ]
        self._rstrip = self._rstrip_tokens(meta)
        self._special_index = {
            False: _SpecialIndex(self._special_user, self._tokens),
            True: _SpecialIndex(special, self._tokens),
        }
        self._pieces: list[bytes | None] = [None] * self.vocab_size

    def _rstrip_tokens(self, meta: Mapping[str, Any]) -> frozenset[int]:
        """Special tokens that swallow the whitespace after them when partitioning.
        llama.cpp sets this by model name: for Phi-3 every special token but <unk>,
        <s> and <|endoftext|> (plus "</s>"), so "<|user|>\nhi" tokenizes without the
        newline, as Phi-3's own tokenizer does."""
        name = meta.get("general.name")
        if not isinstance(name, str) or not ("phi-3" in name.lower() or "phi3" in name.lower()):
            return frozenset()
        ids = set(self._special_all)
        ids |= {self._token_to_id[t] for t in ("</s>",) if t in self._token_to_id}
        ids -= {self._token_to_id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")}
        return frozenset(ids)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        return cls(meta)

    # --- construction ---------------------------------------------------------------

    def _load_vocab(self, meta: Mapping[str, Any]) -> None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("model has no tokenizer.ggml.tokens vocabulary")
        # llama.cpp renames empty tokens so every id keeps a unique, findable text
        if all(tokens):
            self._tokens = list(tokens)
        else:
            self._tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.vocab_size = len(self._tokens)
        # (built with C-level calls: Gemma 3 has 262k tokens, and this runs at each load)
        self._token_to_id = dict(zip(self._tokens, range(self.vocab_size)))
        if len(self._token_to_id) != self.vocab_size:
            raise TokenizerError("duplicate token text in tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            self._attrs = [ATTR_NORMAL] * self.vocab_size
        else:
            types = np.asarray(types[: self.vocab_size], dtype=np.int64)
            if len(types) < self.vocab_size:
                raise TokenizerError("tokenizer.ggml.token_type is shorter than the vocabulary")
            lut = np.zeros(8, dtype=np.int64)  # GGUF token type -> attribute bit; others 0
            for t, attr in _TYPE_TO_ATTR.items():
                lut[t] = attr
            known = (types >= 0) & (types < len(lut))
            self._attrs = np.where(known, lut[np.where(known, types, 0)], 0).tolist()

    def _init_bpe(self, meta: Mapping[str, Any]) -> None:
        pre_name = meta.get("tokenizer.ggml.pre")
        if not pre_name:
            log.warning(
                "GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer "
                "(as llama.cpp does); tokenization may be degraded"
            )
            pre_name = "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise TokenizerError(
                f"unsupported pre-tokenizer {short_name(pre_name)} (tokenizer.ggml.pre); "
                f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
            )
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError("BPE tokenizer has no tokenizer.ggml.merges")
        self._pre_regexes = [regex.compile(r) for r in pre.regexes]
        self._ignore_merges = pre.ignore_merges
        self._ranks = _merge_ranks(merges)
        self._bpe_cache: dict[str, tuple[int, ...]] = {}
        self.add_space_prefix = False  # the BPE path never prefixes a space
        self.add_bos, self.add_eos = pre.add_bos, False
        # llama.cpp's defaults when the file names none (GPT-2's <|endoftext|> is 11)
        self._default_bos_eos = (11, 11)

    def _init_spm(self, meta: Mapping[str, Any]) -> None:
        scores = meta.get("tokenizer.ggml.scores")
        self._scores = (
            [0.0] * self.vocab_size
            if scores is None
            else np.asarray(scores, dtype=np.float64).tolist()  # float32 values, exactly
        )
        if len(self._scores) < self.vocab_size:
            raise TokenizerError("tokenizer.ggml.scores is shorter than the vocabulary")
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        self.add_bos, self.add_eos = True, False
        self._default_bos_eos = (1, 2)  # <s>, </s>
        self._spm_cut = _spm_word_boundaries(self._tokens)
        self._spm_score = dict(zip(self._tokens, self._scores))  # token text -> score
        self._spm_cache: dict[str, tuple[int, ...]] = {}

    def _load_special_ids(self, meta: Mapping[str, Any]) -> None:
        def read(name: str, default: int | None) -> int | None:
            if default is not None and default >= self.vocab_size:
                default = None  # llama.cpp disables out-of-range defaults
            value = meta.get(f"tokenizer.ggml.{name}_token_id")
            if value is None and name in _DEPRECATED_FIM_KEYS:
                value = meta.get(f"tokenizer.ggml.{_DEPRECATED_FIM_KEYS[name]}_token_id")
            if value is None:
                return default
            if not 0 <= int(value) < self.vocab_size:
                log.warning(
                    "tokenizer.ggml.%s_token_id = %s is out of range; ignoring it", name, value
                )
                return default
            return int(value)

        self.bos_id = read("bos", self._default_bos_eos[0])
        self.eos_id = read("eos", self._default_bos_eos[1])
        self._auto_ids = {name: read(name, None) for name in _AUTO_IDS}
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", self.add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", self.add_eos))
        if self.add_bos and self.bos_id is None:
            raise TokenizerError(
                "tokenizer.ggml.add_bos_token is true but the model has no BOS token"
            )
        if self.add_eos and self.eos_id is None:
            raise TokenizerError(
                "tokenizer.ggml.add_eos_token is true but the model has no EOS token"
            )

    def _detect_eog(self) -> None:
        """End-of-generation ids, as llama.cpp builds them from ids and token texts.

        Tokens found this way are forced to CONTROL so they are hidden by
        skip_special and parsed as specials, which is what llama.cpp does too.
        """
        for name, candidates in _AUTO_IDS.items():
            if self._auto_ids[name] is None:
                found = next(
                    (self._token_to_id[t] for t in candidates if t in self._token_to_id), None
                )
                if found is not None:
                    self._attrs[found] |= ATTR_CONTROL
                self._auto_ids[name] = found
        self.eot_id = self._auto_ids["eot"]

        eog = {self._auto_ids[k] for k in ("fim_pad", "fim_rep", "fim_sep")}
        for text in _EOG_NAMES & self._token_to_id.keys():
            tid = self._token_to_id[text]
            self._attrs[tid] |= ATTR_CONTROL
            eog.add(tid)
        eog |= {self.eos_id, self.eot_id, self._auto_ids["eom"]}
        eog.discard(None)
        self.eog_ids = frozenset(eog)

    # --- queries ----------------------------------------------------------------------

    def token_id_of(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def is_eog(self, id: int) -> bool:
        return id in self.eog_ids

    def is_control(self, id: int) -> bool:
        return bool(self._attrs[id] & ATTR_CONTROL)

    def token_bytes(self, id: int) -> bytes:
        piece = self._pieces[id]
        if piece is None:
            piece = self._pieces[id] = self._render_piece(id)
        return piece

    def token_str(self, id: int) -> str:
        return self.token_bytes(id).decode("utf-8", errors="replace")

    def _render_piece(self, id: int) -> bytes:
        text, attr = self._tokens[id], self._attrs[id]
        if attr & _ATTR_SPECIAL:
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            # Characters outside GPT-2's byte alphabet should not occur; llama.cpp
            # emits an [UNK_BYTE_..] marker, we keep the character itself.
            return b"".join(
                bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode("utf-8")
                for c in text
            )
        if attr & ATTR_BYTE:
            return bytes((int(text[3:5], 16),))  # "<0xNN>"
        return b""  # unused/undefined tokens render as nothing, as in llama.cpp

    def _visible_bytes(self, id: int, skip_special: bool) -> bytes:
        if skip_special and self._attrs[id] & _ATTR_HIDDEN:
            return b""
        return self.token_bytes(id)

    # --- encoding -------------------------------------------------------------------

    def encode(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        prev_special = True  # SPM prefixes a space at the start and after each special token
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    fragment = " " + fragment
                self._spm_encode_words(fragment.replace(" ", _SPM_SPACE), ids)
            else:
                for word in self._pre_tokenize(fragment):
                    ids.extend(self._bpe_word(word))
            prev_special = False
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split text into raw-text fragments and special-token ids.

        Control/unknown tokens are recognised only with parse_special; user-defined
        tokens always are (llama.cpp follows HF tokenizers here).
        """
        fragments: list[str | int] = [text] if text else []
        for tid in self._special_index[parse_special].present_in(text):
            needle = self._tokens[tid]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            split: list[str | int] = []
            for f in fragments:
                if not isinstance(f, str) or needle not in f:
                    split.append(f)
                    continue
                rstrip = tid in self._rstrip
                for n, part in enumerate(f.split(needle)):
                    if n:
                        split.append(tid)
                        if rstrip:  # C isspace, as llama.cpp strips
                            part = part.lstrip(" \t\n\v\f\r")
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self._pre_regexes:
            pieces = [p for piece in pieces for p in _regex_split(pattern, piece)]
        return pieces

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        ids = self._bpe_cache.get(word)
        if ids is None:
            if len(self._bpe_cache) >= _BPE_CACHE_LIMIT:
                self._bpe_cache.clear()
            ids = self._bpe_cache[word] = self._bpe_uncached(word)
        return ids

    def _bpe_uncached(self, word: str) -> tuple[int, ...]:
        symbol = "".join(_BYTE_TO_CHAR[b] for b in word.encode("utf-8"))
        vocab = self._token_to_id
        if self._ignore_merges and symbol in vocab:
            return (vocab[symbol],)
        # Repeatedly merge the lowest-ranked adjacent pair, leftmost on ties. This is
        # the order llama.cpp's priority queue (rank, then left index) produces.
        parts = list(symbol)
        ranks = self._ranks
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                rank = ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best_rank is None or rank < best_rank):
                    best, best_rank = i, rank
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids: list[int] = []
        for part in parts:
            if part in vocab:
                ids.append(vocab[part])
            else:  # a merge produced a non-token: fall back to its single characters
                ids.extend(vocab[c] for c in part if c in vocab)
        return tuple(ids)

    def _spm_encode_words(self, text: str, out: list[int]) -> None:
        """SPM over text cut where no token can span (see _spm_word_boundaries), with
        each piece's tokens cached: the same result as one pass over the whole text,
        at the speed of a word cache (Gemma 3's 262k vocabulary would otherwise be
        several times slower per character than SmolLM2's BPE)."""
        pieces = self._spm_cut.split(text) if self._spm_cut is not None else (text,)
        cache = self._spm_cache
        for piece in pieces:
            ids = cache.get(piece)
            if ids is None:
                found: list[int] = []
                if len(piece) <= _SPM_SHORT:
                    self._spm_encode_short(piece, found)
                else:
                    self._spm_encode(piece, found)
                ids = tuple(found)
                if len(piece) <= _SPM_CACHE_MAX_CHARS:
                    if len(cache) >= _BPE_CACHE_LIMIT:
                        cache.clear()
                    cache[piece] = ids
            out.extend(ids)

    def _spm_encode_short(self, text: str, out: list[int]) -> None:
        """_spm_encode for a short piece (a word): the same merges in the same order
        (highest score, leftmost on ties), with the candidate scores in a flat list
        instead of a heap, which is ~3x faster for a handful of symbols."""
        score = self._spm_score.get
        sym = list(text)
        none = _NO_MERGE
        pairs = [score(a + b, none) for a, b in zip(sym, sym[1:])]  # pairs[i]: sym[i]+sym[i+1]
        while pairs:
            best = max(pairs)
            if best == none:
                break
            i = pairs.index(best)  # leftmost of the best
            sym[i : i + 2] = [sym[i] + sym[i + 1]]
            del pairs[i]
            if i > 0:
                pairs[i - 1] = score(sym[i - 1] + sym[i], none)
            if i < len(pairs):
                pairs[i] = score(sym[i] + sym[i + 1], none)
        vocab = self._token_to_id
        for piece in sym:
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._spm_byte_token(b) for b in piece.encode("utf-8"))

    def _spm_encode(self, text: str, out: list[int]) -> None:
        """llama.cpp's SPM tokenizer: greedily merge the adjacent pair whose joined text
        is the highest-scoring token (leftmost on ties), then map leftovers to bytes."""
        if not text:
            return
        sym = list(text)  # current text of each symbol; "" once merged into its left
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]
        queue: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = sym[left] + sym[right]
            tid = self._token_to_id.get(joined)
            if tid is not None:
                heapq.heappush(queue, (-self._scores[tid], left, right, len(joined)))

        for i in range(1, n):
            push(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            # stale entry: one side was merged elsewhere since it was queued
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            push(prev[left], left)
            push(left, nxt[left])

        i = 0
        while i != -1:
            tid = self._token_to_id.get(sym[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._spm_byte_token(b) for b in sym[i].encode("utf-8"))
            i = nxt[i]

    def _spm_byte_token(self, byte: int) -> int:
        tid = self._token_to_id.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self._token_to_id.get(chr(byte))
        if tid is None:
            raise TokenizerError(f"SPM vocabulary has no byte token for 0x{byte:02X}")
        return tid

    # --- decoding -------------------------------------------------------------------

    def decode(
        self, ids: Iterable[int], skip_special: bool = False, strip_prefix_space: bool = True
    ) -> str:
        """Concatenated token pieces; invalid UTF-8 becomes U+FFFD.

        With strip_prefix_space (the default, for text shown to the user) two
        deliberate differences from llama.cpp's detokenize keep decode(encode(text))
        == text: the SPM prefix space is also dropped after a leading BOS (llama.cpp
        keeps it there), and BPE "clean_spaces" rewriting (" ," -> ",", " 's" ->
        "'s", ...) is not applied. strip_prefix_space=False returns the pieces as
        they are, leading space included: what llama-server's /detokenize returns
        (it concatenates token_to_piece with special tokens rendered).
        """
        ids = list(ids)
        data = b"".join(self._visible_bytes(i, skip_special) for i in ids)
        if (
            strip_prefix_space
            and self.add_space_prefix
            and data.startswith(b" ")
            and self._starts_with_text(ids)
        ):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def probs_piece(self, id: int, skip_special: bool = False) -> tuple[str, bytes]:
        """(token, bytes) of a top_logprobs entry as llama-server writes them: the text
        is the piece without a trailing incomplete UTF-8 character, the bytes are all
        of the piece's bytes."""
        data = self._visible_bytes(id, skip_special)
        return data[: utf8_complete_len(data)].decode("utf-8", errors="replace"), data

    def _starts_with_text(self, ids: list[int]) -> bool:
        """True if the first non-empty piece comes from a normal token after at most a BOS."""
        for n, tid in enumerate(ids):
            if n == 0 and tid == self.bos_id:
                continue
            return not self._attrs[tid] & _ATTR_SPECIAL
        return False

    def decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)

    def probs_merger(self, skip_special: bool = False) -> ProbsMerger:
        return ProbsMerger(self, skip_special)


class IncrementalDecoder:
    """Streams token ids to text without ever emitting half a UTF-8 character.

    Used for generated tokens, which follow the prompt, so no SPM leading space is
    removed here.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Python's incremental UTF-8 decoder holds back an incomplete trailing
        # sequence and replaces bytes that can never become valid.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        return self._utf8.decode(self._tokenizer._visible_bytes(id, self._skip_special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _SpecialIndex:
    """The special tokens (in partition order) that occur in a text, found without
    testing each one: Gemma 3 has 6,400 control tokens and scanning the text for each
    made parse_special=True 25x slower than SmolLM2. Tokens are grouped by their first
    two characters and a group is only searched when its prefix is in the text."""

    def __init__(self, ids: list[int], tokens: list[str]):
        self._order = {tid: n for n, tid in enumerate(ids)}
        self._groups: dict[str, list[int]] = {}
        for tid in ids:
            self._groups.setdefault(tokens[tid][:2], []).append(tid)
        self._tokens = tokens

    def present_in(self, text: str) -> list[int]:
        tokens = self._tokens
        found = [
            tid
            for prefix, group in self._groups.items()
            if prefix in text
            for tid in group
            if tokens[tid] in text
        ]
        found.sort(key=self._order.__getitem__)
        return found


def utf8_complete_len(data: bytes) -> int:
    """Length of data without a trailing, incomplete UTF-8 character (a lead byte in
    the last 3 bytes whose sequence is longer than what follows it). This is the
    check llama-server applies to generated text and to top_logprobs pieces; bytes
    that can never be valid are left for the decoder to replace."""
    n = len(data)
    # like llama-server, look at each of the last 4 bytes (not only the nearest lead
    # byte): b"\xf0\xc3\xa9" counts as incomplete because of its \xf0
    for back in range(1, min(4, n) + 1):
        c = data[n - back]
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        if back < need:
            return n - back
    return n


class ProbsMerger:
    """Groups generated tokens into completion_probabilities entries as llama-server
    does: a token after which the generated text ends inside a UTF-8 character gets
    no entry (push returns None); the token that completes the character gets one
    entry carrying the bytes of every token since the last entry (push returns
    them), with its own id, logprob and top_logprobs.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pending = b""  # bytes of tokens not yet given an entry
        self._tail = b""  # the last bytes already given out, for the incomplete check

    def push(self, id: int) -> bytes | None:
        self._pending += self._tokenizer._visible_bytes(id, self._skip_special)
        window = self._tail + self._pending
        if utf8_complete_len(window) < len(window):
            return None
        out, self._pending = self._pending, b""
        self._tail = window[-3:]
        return out

    @property
    def pending(self) -> bytes:
        """Bytes still waiting for the rest of their character (lost if generation
        stops here, as in llama-server)."""
        return self._pending


def _spm_word_boundaries(tokens: list[str]) -> regex.Pattern | None:
    """Where SPM text can be cut into independent pieces: before a "▁" that follows
    a character c such that no token contains c + "▁".

    A merge across such a cut would make a token containing that pair, so none can
    happen, and the score-ordered merging inside each piece is unchanged: encoding
    the pieces one by one gives llama.cpp's result for the whole text. Gemma 3 has
    one such token (">▁</"), so its text is cut at almost every word.
    """
    # one C-level scan of all tokens joined by NUL: a NUL before a token's leading "▁"
    # only adds a harmless blocker (a cut that is never made is always safe)
    blockers = set(re.findall(f"([^{_SPM_SPACE}]){_SPM_SPACE}", "\0".join(tokens)))
    allowed = "".join(regex.escape(c) for c in sorted(blockers | {_SPM_SPACE}))
    return regex.compile(rf"(?<=[^{allowed}])(?={_SPM_SPACE})")


def _regex_split(pattern: regex.Pattern, text: str) -> list[str]:
    """Matches of pattern in text, with unmatched stretches kept as pieces too
    (llama.cpp's unicode_regex_split_stl)."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start > pos:
            pieces.append(text[pos:start])
        if end > start:
            pieces.append(text[start:end])
        pos = end
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_str_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and set(map(type, v)) <= {str}


def _is_array_of(kinds: str) -> Any:
    """A numeric GGUF array (parsed as a 1-D ndarray, or a list of Python numbers)
    whose numpy dtype kind is in ``kinds``."""

    def check(v: Any) -> bool:
        if isinstance(v, np.ndarray):
            return v.ndim == 1 and v.dtype.kind in kinds
        py = (int, float) if "f" in kinds else (int,)
        return isinstance(v, (list, tuple)) and all(
            isinstance(x, py) and not isinstance(x, bool) for x in v
        )

    return check


# tokenizer.ggml.* key -> (check, what it must be); as llama.cpp, which refuses a key
# of the wrong GGUF type instead of guessing.
_KEY_TYPES = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "pre": (lambda v: isinstance(v, str), "a string"),
    "tokens": (_is_str_list, "an array of strings"),
    "merges": (_is_str_list, "an array of strings"),
    "scores": (_is_array_of("fiu"), "an array of numbers"),
    "token_type": (_is_array_of("iu"), "an array of integers"),
    "add_bos_token": (lambda v: isinstance(v, (bool, np.bool_)), "a boolean"),
    "add_eos_token": (lambda v: isinstance(v, (bool, np.bool_)), "a boolean"),
    "add_space_prefix": (lambda v: isinstance(v, (bool, np.bool_)), "a boolean"),
}


def check_metadata_types(meta: Mapping[str, Any]) -> None:
    """Refuse tokenizer metadata of the wrong type with the key's name (merges stored
    as uint32, a token id that is an array, ...), before anything iterates it."""
    for key, value in meta.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        short = key.removeprefix("tokenizer.ggml.")
        if short.endswith("_token_id"):
            check, want = _is_int, "an integer"
        elif short in _KEY_TYPES:
            check, want = _KEY_TYPES[short]
        else:
            continue
        if not check(value):
            raise TokenizerError(f"{key} must be {want}, not {describe_value(value)}")


def _merge_ranks(merges: Iterable[str]) -> dict[tuple[str, str], int]:
    """Merge pair -> rank. llama.cpp splits each entry at the first space after its
    first character, so a pair whose left side is a space still parses."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        if cut > 0:
            ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)
    return ranks
