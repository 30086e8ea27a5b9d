"""Tokenizers of the real Qwen2.5 (byte-level BPE, 'qwen2' pre-tokenizer) and Gemma 3
(SentencePiece, 262k tokens, byte fallback) files against llama-server's own
tokenizations in tests/data/llamacpp, plus the behaviour llama-server shows on them
(control tokens, /detokenize, completion_probabilities per character)."""

from __future__ import annotations

import pytest

from core.tokenizer import Tokenizer, utf8_complete_len
from tests.reference import reference_dir

N_TOKENIZE, N_GREEDY = 32, 12  # entries in each family's reference file


@pytest.fixture(scope="module")
def qwen2_tok(qwen2_meta) -> Tokenizer:
    return Tokenizer.from_metadata(qwen2_meta)


@pytest.fixture(scope="module")
def gemma3_tok(gemma3_meta) -> Tokenizer:
    return Tokenizer.from_metadata(gemma3_meta)


FAMILIES = ["qwen2", "gemma3"]


@pytest.fixture
def family(request):
    """(tokenizer, reference) of the family named by the test's parameter."""
    name = request.param
    return request.getfixturevalue(f"{name}_tok"), request.getfixturevalue(f"{name}_reference")


def test_reference_sizes(qwen2_reference, gemma3_reference):
    for ref in (qwen2_reference, gemma3_reference):
        assert (len(ref["tokenize"]), len(ref["greedy"])) == (N_TOKENIZE, N_GREEDY)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
@pytest.mark.parametrize("i", range(N_TOKENIZE), ids=lambda i: f"tokenize{i:02d}")
def test_matches_llamacpp_tokenize(family, i):
    tok, ref = family
    case = ref["tokenize"][i]
    assert tok.encode(case["text"], parse_special=case["parse_special"]) == case["tokens"]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
@pytest.mark.parametrize("i", range(N_GREEDY), ids=lambda i: f"greedy{i:02d}")
def test_matches_llamacpp_prompt_tokens(family, i):
    tok, ref = family
    case = ref["greedy"][i]
    assert tok.encode(case["prompt"], parse_special=True) == case["prompt_tokens"]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_decode_roundtrips_the_reference_texts(family):
    tok, ref = family
    texts = [c["text"] for c in ref["tokenize"] if not c["parse_special"]]
    assert len(texts) == N_TOKENIZE // 2
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_family_settings_follow_the_files(qwen2_tok, gemma3_tok):
    assert (qwen2_tok.model, qwen2_tok.add_bos, qwen2_tok.vocab_size) == ("gpt2", False, 151936)
    assert qwen2_tok.eot_id == qwen2_tok.token_id_of("<|im_end|>")
    assert (gemma3_tok.model, gemma3_tok.add_bos, gemma3_tok.add_space_prefix) == (
        "llama",
        True,
        False,
    )
    assert gemma3_tok.vocab_size == 262144
    assert gemma3_tok.encode("hi", add_special=True)[0] == gemma3_tok.bos_id == 2
    assert gemma3_tok.is_eog(gemma3_tok.token_id_of("<end_of_turn>"))


def _long_mixed_text(ref: dict) -> str:
    readme = (reference_dir() / "README.md").read_text()
    cases = [c["text"] for c in ref["tokenize"]] + [g["prompt"] for g in ref["greedy"]]
    # "a> </b>" holds Gemma's one token with a space inside a word (">▁</")
    return readme + "\n" + " ".join(cases) + "  x a> </b>  \u3000 tab\tend"


def test_gemma3_word_cache_gives_the_whole_text_result(gemma3_meta, gemma3_reference):
    # SPM text is cut where no token can span and each piece is cached: the result
    # must be that of one pass over the whole text, cold and warm
    tok = Tokenizer.from_metadata(gemma3_meta)
    text = _long_mixed_text(gemma3_reference).replace(" ", "\u2581")
    whole: list[int] = []
    tok._spm_encode(text, whole)
    assert tok.token_id_of(">\u2581</") in whole
    for _ in range(2):  # cold, then from the cache
        pieces: list[int] = []
        tok._spm_encode_words(text, pieces)
        assert pieces == whole
    text = _long_mixed_text(gemma3_reference)
    assert tok.decode(tok.encode(text)) == text


def test_gemma3_control_tokens_need_parse_special(gemma3_tok):
    # "</s>" is user-defined in Gemma 3's file and control for llama.cpp (an EOG text):
    # without parse_special it is plain text, as llama-server tokenizes it
    eos_text = gemma3_tok.token_id_of("</s>")
    assert gemma3_tok.is_control(eos_text)
    raw = gemma3_tok.encode("a</s>b", parse_special=False)
    assert eos_text not in raw and gemma3_tok.decode(raw) == "a</s>b"
    assert eos_text in gemma3_tok.encode("a</s>b", parse_special=True)
    turn = gemma3_tok.token_id_of("<start_of_turn>")
    assert turn not in gemma3_tok.encode("<start_of_turn>user", parse_special=False)


def test_qwen2_detokenize_is_unchanged_without_a_prefix_space(qwen2_tok, gemma3_tok):
    # neither family adds an SPM prefix space, so llama-server's /detokenize text is the
    # plain decode; SentencePiece files with one are covered in test_tokenizer.py
    for tok in (qwen2_tok, gemma3_tok):
        ids = tok.encode(" leading space", add_special=True)
        assert tok.decode(ids, strip_prefix_space=False) == tok.decode(ids)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_probs_merger_covers_the_text_one_character_group_at_a_time(family):
    tok, ref = family
    for case in ref["tokenize"]:
        ids = tok.encode(case["text"], parse_special=case["parse_special"])
        merger = tok.probs_merger()
        entries = [merger.push(i) for i in ids]
        assert merger.pending == b""
        merged = [e for e in entries if e is not None]
        assert b"".join(merged) == b"".join(tok.token_bytes(i) for i in ids)
        for e in merged:  # every entry is whole characters
            assert utf8_complete_len(e) == len(e)
            e.decode("utf-8")


def test_qwen2_flag_emoji_is_one_entry_on_the_token_that_completes_it(qwen2_tok):
    # " 🇫🇷" is split over byte-level tokens: llama-server gives the tokens that end
    # inside a character no entry, and the completing token the whole text
    ids = qwen2_tok.encode(" flags 🇫🇷")
    merger = qwen2_tok.probs_merger()
    entries = [merger.push(i) for i in ids]
    assert None in entries
    texts = [e.decode("utf-8") for e in entries if e is not None]
    assert "".join(texts) == " flags 🇫🇷"
    held = entries.index(None)
    assert qwen2_tok.probs_piece(ids[held])[0] != qwen2_tok.token_bytes(ids[held]).decode(
        "utf-8", errors="replace"
    )
