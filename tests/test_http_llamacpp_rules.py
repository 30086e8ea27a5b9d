"""Small llama-server rules the HTTP layer follows, on a real server on 127.0.0.1:
/detokenize keeps a SentencePiece model's leading space, and completion_probabilities
has one entry per whole UTF-8 character (a token that ends inside a character gives
its bytes to the next entry), streaming or not."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from gguf import GGUFValueType

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine
from tests.serving import running_engine, serving
from tests.tiny_gguf import BYTE_VOCAB, write_tiny_llama

PARTY = "🎉🎉🎉 Party time! 🎉🎉"  # SmolLM2 continues with 🎉, three byte tokens each


async def _call(srv, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + path, data=json.dumps(body)) as r:
            return r.status, await r.text()


def post(srv, path, body):
    status, text = asyncio.run(_call(srv, path, body))
    assert status == 200, text
    return text


@pytest.fixture(scope="module")
def smol_srv(smollm_path):
    with running_engine(smollm_path, ctx_size=128, n_parallel=1) as eng, serving(eng) as srv:
        yield srv


def test_detokenize_keeps_the_sentencepiece_leading_space(tmp_path):
    # a tiny SPM model whose vocabulary has "▁hello" and "▁world"
    n = 300
    toks = ["<unk>", "<s>", "</s>"] + BYTE_VOCAB + ["▁hello", "▁world"]
    toks += [f"tok{i}" for i in range(n - len(toks))]
    path = write_tiny_llama(
        tmp_path / "spm.gguf",
        vocab=n,
        kv={"tokenizer.ggml.tokens": (toks, GGUFValueType.ARRAY)},
    )
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    eng.load_model(path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    try:
        hello, world = toks.index("▁hello"), toks.index("▁world")
        out = json.loads(post(srv, "/detokenize", {"tokens": [hello, world]}))
        # llama-server joins the pieces as they are; the text shown to a user
        # (tokenizer.decode) drops the first space
        assert out["content"] == " hello world"
        assert eng.tokenizer.decode([hello, world]) == "hello world"
    finally:
        srv.stop()
        eng.stop()


def _party_body(**kw):
    return {"prompt": PARTY, "n_predict": 6, "temperature": 0, "n_probs": 2, **kw}


def test_completion_probabilities_have_one_entry_per_character(smol_srv):
    out = json.loads(post(smol_srv, "/completion", _party_body()))
    assert out["content"] == "🎉🎉"
    probs = out["completion_probabilities"]
    # six tokens, two characters: the entries carry the completing token's id and
    # logprob with the bytes of the whole character
    assert [p["token"] for p in probs] == ["🎉", "🎉"]
    assert all(bytes(p["bytes"]) == "🎉".encode() for p in probs)
    assert all(len(p["top_logprobs"]) == 2 for p in probs)
    for p in probs:
        for c in p["top_logprobs"]:  # candidates: text without a broken tail, all bytes
            # (a lone continuation byte is invalid, not incomplete: U+FFFD, as JSON
            # output in llama-server replaces it)
            assert bytes(c["bytes"]).decode("utf-8", "replace").startswith(c["token"])


def test_streamed_probabilities_add_up_to_the_same_entries(smol_srv):
    text = post(smol_srv, "/completion", _party_body(stream=True))
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    content = "".join(c.get("content", "") for c in chunks)
    probs = [p for c in chunks for p in c.get("completion_probabilities") or []]
    tokens = [t for c in chunks if not c.get("stop") for t in c.get("tokens", [])]
    assert content == "🎉🎉"
    assert [p["token"] for p in probs] == ["🎉", "🎉"]
    assert len(tokens) == 6  # every token id still reaches the client
