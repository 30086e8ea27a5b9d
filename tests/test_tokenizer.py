"""Tokenizer tests: SmolLM2 against llama.cpp's own tokenizations, plus tiny
hand-made vocabularies for SPM and for pre-tokenizer differences."""

from __future__ import annotations

import gguf
import pytest

from core.gguf.reader import GGUFFile  # noqa: E402
from core.tokenizer import _BYTE_TO_CHAR, Tokenizer, TokenizerError, utf8_complete_len

N_REFERENCE = 32  # entries in both reference["tokenize"] and reference["greedy"]


@pytest.fixture(scope="module")
def tok(smollm_meta) -> Tokenizer:
    return Tokenizer.from_metadata(smollm_meta)


# --- SmolLM2 vs llama.cpp -------------------------------------------------------------


def test_reference_sizes(reference):
    assert len(reference["tokenize"]) == N_REFERENCE
    assert len(reference["greedy"]) == N_REFERENCE


@pytest.mark.parametrize("i", range(N_REFERENCE), ids=lambda i: f"tokenize{i:02d}")
def test_matches_llamacpp_tokenize(tok, reference, i):
    case = reference["tokenize"][i]
    assert tok.encode(case["text"], parse_special=case["parse_special"]) == case["tokens"]


@pytest.mark.parametrize("i", range(N_REFERENCE), ids=lambda i: f"greedy{i:02d}")
def test_matches_llamacpp_prompt_tokens(tok, reference, i):
    case = reference["greedy"][i]
    assert tok.encode(case["prompt"], parse_special=True) == case["prompt_tokens"]


def test_decode_roundtrips_reference_texts(tok, reference):
    texts = [c["text"] for c in reference["tokenize"] if not c["parse_special"]]
    assert len(texts) == N_REFERENCE // 2
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_only_parsed_on_request(tok):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text, parse_special=True)[0] == 1
    assert 1 not in tok.encode(text, parse_special=False)
    ids = tok.encode(text, parse_special=True)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.is_control(1) and not tok.is_control(4093)
    assert tok.token_bytes(2) == b"<|im_end|>" and tok.token_str(2) == "<|im_end|>"


def test_smollm_special_ids_and_bos(tok):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token = false in the file
    assert tok.encode("hi", add_special=True) == tok.encode("hi")
    assert tok.token_id_of("<|im_end|>") == 2 and tok.token_id_of("no such token") is None


def test_smollm_eog_ids_follow_llamacpp(tok):
    # llama.cpp: EOS (2, <|im_end|>), every token whose text is in its EOG list
    # (<|im_end|>, <|endoftext|> = 0), and the FIM repo token, which it detects as
    # "<reponame>" (4) and also treats as end of generation.
    assert tok.eog_ids == frozenset({0, 2, 4})
    assert tok.eot_id == 2
    assert tok.is_eog(0) and tok.is_eog(2) and not tok.is_eog(1)


# --- incremental decoding ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["emoji 🙂🚀 and flags 🇫🇷", "日本語のテキストと中文字符", "naïve café — déjà vu"]
)
def test_incremental_decode_is_exact_and_never_half_a_char(tok, text):
    ids = tok.encode(text)
    dec = tok.decoder()
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text


def test_split_character_is_held_back_until_complete(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1, "test needs an emoji spread over several byte tokens"
    dec = tok.decoder()
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert dec.flush() == ""


def test_incomplete_leftover_becomes_replacement_char_on_flush(tok):
    lead_byte = tok.encode("🙂")[0]  # starts a 4-byte sequence that never ends
    dec = tok.decoder()
    assert dec.push(lead_byte) == ""
    assert dec.flush() == "\ufffd"
    assert tok.decode([lead_byte]) == "\ufffd"


def test_decoder_skip_special(tok):
    dec = tok.decoder(skip_special=True)
    assert dec.push(1) == "" and dec.push(4093) == "user" and dec.push(2) == ""


def test_fresh_tokenizer_encodes_a_long_mixed_text_like_the_cached_one(smollm_meta, tok, reference):
    # a cold BPE cache is the slow case (bench/ times it); the result must not depend on it
    fresh = Tokenizer.from_metadata(smollm_meta)
    text = (
        " ".join(c["text"] for c in reference["tokenize"])
        + " ".join(g["prompt"] for g in reference["greedy"][::8]) * 8
    )[:2048]
    assert fresh.encode(text) == tok.encode(text)


# --- SPM (tokenizer.ggml.model = "llama") -------------------------------------------------

_SPM_WORDS = ["▁", "a", "b", "c", "ab", "bc"]


def _spm_tokens() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_WORDS
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_WORDS)
    return tokens, types


def _write_spm_gguf(path, scores: dict[str, float]) -> None:
    tokens, types = _spm_tokens()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([scores.get(t, 0.0) for t in tokens])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def spm(tmp_path) -> Tokenizer:
    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path, {"ab": -1.0, "bc": -0.5})
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


def _ids(t: Tokenizer, *texts: str) -> list[int]:
    return [t.token_id_of(x) for x in texts]


def test_spm_merges_by_score(spm, tmp_path):
    # "bc" outscores "ab", so it is merged first and "ab" can no longer form.
    assert spm.encode("abc") == _ids(spm, "▁", "a", "bc")
    path = tmp_path / "swapped.gguf"
    _write_spm_gguf(path, {"ab": -0.5, "bc": -1.0})
    swapped = Tokenizer.from_metadata(GGUFFile(path).metadata)
    assert swapped.encode("abc") == _ids(swapped, "▁", "ab", "c")


def test_spm_byte_fallback(spm):
    ids = spm.encode("aé")  # é is not in the vocab: its UTF-8 bytes C3 A9 are used
    assert ids == _ids(spm, "▁", "a", "<0xC3>", "<0xA9>")
    assert spm.token_bytes(ids[2]) == b"\xc3"
    assert spm.decode(ids) == "aé"


def test_spm_space_prefix_and_bos(spm):
    assert spm.add_space_prefix and spm.add_bos  # llama.cpp's SPM defaults
    assert spm.encode("a b") == _ids(spm, "▁", "a", "▁", "b")
    assert spm.token_bytes(spm.token_id_of("▁")) == b" "
    ids = spm.encode("a b", add_special=True)
    assert ids[0] == 1
    assert spm.decode(ids, skip_special=True) == "a b"  # the added prefix space is dropped


def test_spm_without_space_prefix(tmp_path):
    tokens, types = _spm_tokens()
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
    }
    t = Tokenizer.from_metadata(meta)
    assert t.encode("ab") == _ids(t, "ab")
    assert t.decode(t.encode(" ab")) == " ab"


def test_spm_parse_special(spm):
    assert spm.encode("<s>a", parse_special=True) == [1] + _ids(spm, "▁", "a")
    raw = spm.encode("<s>a")
    assert 1 not in raw and spm.decode(raw) == "<s>a"


# --- BPE pre-tokenizers on a tiny byte-level vocabulary ----------------------------------


def _bpe_meta(pre: str, words: list[str], merges: list[str], **extra) -> dict:
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + words
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [1] * len(tokens),
        **extra,
    }


_DIGIT_MERGES = ["1 2", "12 3", "123 4", "4 5"]
_DIGIT_WORDS = ["12", "123", "1234", "45"]


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("llama-bpe", ["123", "45"]),  # \p{N}{1,3}: groups of up to three digits
        ("default", ["123", "45"]),  # its [0-9][0-9][0-9] pass does the same
        ("gpt2", ["1234", "5"]),  # \p{N}+: one piece, merges run across it
        ("smollm", ["1", "2", "3", "4", "5"]),  # \p{N}: every digit alone
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_digit_splitting(pre, pieces):
    t = Tokenizer.from_metadata(_bpe_meta(pre, _DIGIT_WORDS, _DIGIT_MERGES))
    assert t.encode("12345") == _ids(t, *pieces)
    assert t.decode(t.encode("12345")) == "12345"


def test_llama3_uses_whole_word_tokens_without_merges():
    # llama.cpp sets ignore_merges for llama3: a piece that is a token is used as is.
    words, merges = ["abc"], []
    llama3 = Tokenizer.from_metadata(_bpe_meta("llama-bpe", words, merges))
    gpt2 = Tokenizer.from_metadata(_bpe_meta("gpt2", words, merges))
    assert llama3.encode("abc") == _ids(llama3, "abc")
    assert gpt2.encode("abc") == _ids(gpt2, "a", "b", "c")


def test_llama3_adds_bos_by_default():
    meta = _bpe_meta("llama-bpe", ["<|begin_of_text|>"], [], **{"tokenizer.ggml.bos_token_id": 256})
    t = Tokenizer.from_metadata(meta)
    assert t.add_bos and t.encode("a", add_special=True) == [256, t.token_id_of("a")]


def test_user_defined_tokens_are_parsed_even_without_parse_special():
    meta = _bpe_meta("gpt2", ["<tool>", "<ctl>"], [])
    meta["tokenizer.ggml.token_type"] = [1] * 256 + [4, 3]  # user-defined, control
    t = Tokenizer.from_metadata(meta)
    a, tool, ctl = _ids(t, "a", "<tool>", "<ctl>")
    assert t.encode("a<tool>a") == [a, tool, a]
    assert ctl not in t.encode("a<ctl>") and t.encode("a<ctl>", parse_special=True) == [a, ctl]


def test_gpt2_has_no_bos_or_eos_for_a_tiny_vocab():
    # llama.cpp's BPE default BOS/EOS id 11 only applies when it exists in the vocab
    t = Tokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": [],
        }
    )
    assert (t.bos_id, t.eos_id, t.eog_ids) == (None, None, frozenset())


# --- unsupported input -------------------------------------------------------------------


def test_unsupported_model_is_named():
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


def test_unsupported_pre_tokenizer_is_named():
    with pytest.raises(TokenizerError, match="'klingon-bpe'"):
        Tokenizer.from_metadata(_bpe_meta("klingon-bpe", [], []))


def test_add_bos_without_bos_token_is_rejected():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.tokens": ["a", "b"],
        "tokenizer.ggml.add_bos_token": True,
    }
    with pytest.raises(TokenizerError, match="BOS"):
        Tokenizer.from_metadata(meta)


# --- the pre-tokenizers of other families (regexes as llama.cpp runs them) ---------------


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        # Tekken (Mistral Nemo / Small 3): words split at case changes, digits alone
        (
            "tekken",
            "HelloWorld ÉcoleNormale 12345",
            ["Hello", "World", " École", "Normale", " ", "1", "2", "3", "4", "5"],
        ),
        ("tekken", "it's OK/path/\n\nx", ["it", "'s", " OK", "/path", "/\n\n", "x"]),
        # GPT-4o (Phi-4-mini, Llama 4): the same case split, contractions kept, 3 digits
        ("gpt-4o", "HelloWorld 12345", ["Hello", "World", " ", "123", "45"]),
        ("gpt-4o", "it's OK/path/\n\nx", ["it's", " OK", "/path", "/\n\n", "x"]),
        # DeepSeek LLM: a cascade; each regex re-splits every piece of the previous one,
        # so the ASCII-symbol pass cuts a non-ASCII letter off its word
        (
            "deepseek-llm",
            "Hello 世界123, déjà  ",
            ["Hello", " ", "世界", "123", ",", " d", "é", "j", "à", "  "],
        ),
        ("deepseek-llm", "it's\n\nx", ["it", "'", "s", "\n", "\n", "x"]),
        # DeepSeek Coder: letters, punctuation, CJK runs, every digit alone
        (
            "deepseek-coder",
            "HelloWorld 世界123, déjà",
            ["HelloWorld", " ", "世界", "1", "2", "3", ",", " déjà"],
        ),
        ("deepseek-v3", "Hello 世界12345, x", ["Hello", " ", "世界", "123", "45", ",", " x"]),
    ],
)
def test_family_pre_tokenizers_split_like_llamacpp(pre, text, pieces):
    t = Tokenizer.from_metadata(_bpe_meta(pre, [], []))
    assert t._pre_tokenize(text) == pieces
    assert t.decode(t.encode(text)) == text


def test_tekken_defaults_add_bos_and_ignores_merges():
    meta = _bpe_meta("tekken", ["<s>", "Hello"], [], **{"tokenizer.ggml.bos_token_id": 256})
    t = Tokenizer.from_metadata(meta)
    assert t.add_bos  # llama.cpp's default for tekken, before tokenizer.ggml.add_bos_token
    assert t.encode("Hello", add_special=True) == [256, t.token_id_of("Hello")]
    gpt4o = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "gpt-4o"})
    assert not gpt4o.add_bos
    assert gpt4o.encode("Hello") == _ids(gpt4o, "H", "e", "l", "l", "o")  # no merges


def test_deepseek_llm_trailing_whitespace_is_its_own_piece_only_at_the_end():
    t = Tokenizer.from_metadata(_bpe_meta("deepseek-llm", [], []))
    # "\s+$" is ECMAScript's end of input, not Python's "before a final newline"
    assert t._pre_tokenize("a  ") == ["a", "  "]
    assert t._pre_tokenize("  a") == [" ", " a"]


# --- parse_special=False never matches a control token ------------------------------------


def test_a_user_defined_token_that_is_also_control_needs_parse_special():
    # Phi-3 and Gemma 3 files mark "<|end|>" / "</s>" user-defined; llama.cpp adds the
    # control attribute when it finds them end-of-generation, so parse_special=False
    # must leave them as text, while a plain user-defined token is still matched.
    meta = _bpe_meta("gpt2", ["<|end|>", "</s>", "<tool>"], [])
    meta["tokenizer.ggml.token_type"] = [1] * 256 + [4, 4, 4]
    t = Tokenizer.from_metadata(meta)
    end, eos, tool = _ids(t, "<|end|>", "</s>", "<tool>")
    assert t.is_control(end) and t.is_control(eos) and not t.is_control(tool)
    raw = t.encode("a<|end|>b</s>c<tool>", parse_special=False)
    assert end not in raw and eos not in raw and tool in raw
    assert t.decode(raw) == "a<|end|>b</s>c<tool>"
    parsed = t.encode("a<|end|>b</s>c<tool>", parse_special=True)
    assert parsed == [*_ids(t, "a"), end, *_ids(t, "b"), eos, *_ids(t, "c"), tool]


# --- /detokenize keeps SPM's leading space; completion_probabilities per character --------


def test_detokenize_keeps_the_spm_leading_space_like_llama_server(spm):
    ids = spm.encode("a b")
    assert spm.decode(ids) == "a b"  # for display: the added prefix space is dropped
    assert spm.decode(ids, strip_prefix_space=False) == " a b"  # llama-server /detokenize
    with_bos = spm.encode("a b", add_special=True)
    assert spm.decode(with_bos, strip_prefix_space=False) == "<s> a b"


@pytest.mark.parametrize(
    "data, complete",
    [
        (b"", 0),
        (b"abc", 3),
        ("é".encode(), 2),
        ("é".encode()[:1], 0),
        (b"a" + "🙂".encode()[:3], 1),
        ("a🙂".encode(), 5),
        (b"\xf0\xc3\xa9", 0),  # llama-server looks at each of the last 4 bytes
        (b"\x80\x80", 2),  # stray continuation bytes are left for the decoder to replace
    ],
)
def test_utf8_complete_len(data, complete):
    assert utf8_complete_len(data) == complete


def test_probs_merger_gives_one_entry_per_complete_character(spm):
    c3, a9 = spm.token_id_of("<0xC3>"), spm.token_id_of("<0xA9>")
    a = spm.token_id_of("a")
    merger = spm.probs_merger()
    assert [merger.push(i) for i in (a, c3, a9, a)] == [b"a", None, "é".encode(), b"a"]
    assert merger.pending == b""
    assert merger.push(c3) is None and merger.pending == b"\xc3"
    assert spm.probs_piece(c3) == ("", b"\xc3")  # top_logprobs: text cut, bytes kept
    assert spm.probs_piece(a) == ("a", b"a")


def test_spm_short_path_merges_exactly_like_the_heap(tmp_path):
    # words use a flat list instead of the heap; ties (equal scores) must still merge
    # leftmost first. Equal scores for "ab"/"bc" and for "▁a"/"aa" force ties.
    import random

    path = tmp_path / "ties.gguf"
    _write_spm_gguf(path, {"ab": -1.0, "bc": -1.0, "▁": -2.0})
    t = Tokenizer.from_metadata(GGUFFile(path).metadata)
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("abc▁é") for _ in range(rng.randint(1, 40)))
        short: list[int] = []
        heap: list[int] = []
        t._spm_encode_short(text, short)
        t._spm_encode(text, heap)
        assert short == heap, text


def _naive_partition(t: Tokenizer, text: str, parse_special: bool) -> list:
    """llama.cpp's partition spelled out: every special token, longest first."""
    fragments: list = [text] if text else []
    ids = t._special_all if parse_special else t._special_user
    for tid in ids:
        needle, out = t._tokens[tid], []
        for f in fragments:
            if not isinstance(f, str):
                out.append(f)
                continue
            for n, part in enumerate(f.split(needle)):
                out.extend([tid] if n else [])
                out.extend([part] if part else [])
        fragments = out
    return fragments


def test_special_token_index_partitions_like_the_naive_loop():
    # overlapping specials sharing prefixes, control and user-defined, in random texts
    import random

    specials = ["<a>", "<ab>", "b<a>", "<a", "ab", "<<", "a>", "<ctl>", "<c"]
    meta = _bpe_meta("gpt2", specials, [])
    meta["tokenizer.ggml.token_type"] = [1] * 256 + [4, 3, 4, 3, 4, 4, 3, 3, 4]
    t = Tokenizer.from_metadata(meta)
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(["<", ">", "a", "b", "c", "tl", " "]) for _ in range(30))
        for parse_special in (False, True):
            assert t._partition(text, parse_special) == _naive_partition(t, text, parse_special)


def _phi3_like_meta(name: str) -> dict:
    tokens, types = _spm_tokens()
    extra = ["<|user|>", "<|end|>", "<|endoftext|>"]
    return {
        "general.name": name,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens + extra,
        "tokenizer.ggml.token_type": types + [4, 4, 4],
        "tokenizer.ggml.scores": [0.0] * (len(tokens) + 3),
    }


def test_phi3_special_tokens_swallow_the_whitespace_after_them():
    # llama.cpp gives every Phi-3 special token but <unk>, <s>, <|endoftext|> the
    # rstrip attribute (by model name): "<|user|>\nab" tokenizes as "<|user|>ab"
    phi3 = Tokenizer.from_metadata(_phi3_like_meta("Phi-3-mini-4k-instruct"))
    user, end, eot = _ids(phi3, "<|user|>", "<|end|>", "<|endoftext|>")
    nl = phi3.token_id_of("<0x0A>")
    assert phi3.encode("<|user|>\n ab<|end|>\n", parse_special=True) == phi3.encode(
        "<|user|>ab<|end|>", parse_special=True
    )
    assert nl in phi3.encode("<|endoftext|>\nab", parse_special=True)  # not stripped
    other = Tokenizer.from_metadata(_phi3_like_meta("Mistral-7B"))
    assert nl in other.encode("<|user|>\nab", parse_special=True)
    assert {user, end} <= phi3._rstrip and eot not in phi3._rstrip
