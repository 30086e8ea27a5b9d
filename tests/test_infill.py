"""/infill on a model with fill-in-the-middle tokens (issue #20): the real
Qwen2.5-Coder-0.5B, whose vocabulary has <|fim_prefix|>, <|fim_suffix|>,
<|fim_middle|>, <|repo_name|> and <|file_sep|>. The prompt is llama-server's
format_prompt_infill layout; generations are greedy and short.
"""

from __future__ import annotations

import pytest
from test_http_api import assert_400, req

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

N_BATCH = 64  # a small -b, so the prefix/suffix limits (48 / 16 - 2 - prompt) bite
CTX = 512  # per slot: the extra chunks keep their last CTX - N_BATCH - 2 * n_predict
BODY = {
    "input_prefix": '#include <cstdio>\n#include "llama.h"\n\nint main() {\n',
    "prompt": "    int n_threads = llama_",
    "input_suffix": "}\n",
    "temperature": 0,
}
EXTRA = [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}]


@pytest.fixture(scope="module")
def server(qwen2_path):
    eng = Engine(EngineOptions(ctx_size=CTX, n_parallel=1))
    eng.load_model(qwen2_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, n_batch=N_BATCH)).start()
    yield srv
    srv.stop()
    eng.stop()


def ids(server, text, special=False):
    return server.engine.tokenizer.encode(text, add_special=False, parse_special=special)


def piece(server, name):
    tok = server.engine.tokenizer
    return tok.encode(name, add_special=False, parse_special=True)


def test_the_prompt_is_llama_servers_repo_level_fim_layout(server):
    body = {**BODY, "input_extra": EXTRA, "n_predict": 1, "return_tokens": True}
    st, out = req(server, "POST", "/infill", body)
    assert st == 200, out
    want = (
        piece(server, "<|repo_name|>")
        + ids(server, "myproject\n")
        + piece(server, "<|file_sep|>")
        + ids(server, "llama.h\n")
        + ids(server, EXTRA[0]["text"])
        + piece(server, "<|file_sep|>")
        + ids(server, "filename\n")
        + piece(server, "<|fim_prefix|>")
        + ids(server, BODY["input_prefix"])
        + ids(server, BODY["prompt"], special=True)
        + piece(server, "<|fim_suffix|>")
        + ids(server, BODY["input_suffix"])
        + piece(server, "<|fim_middle|>")
    )
    assert len(piece(server, "<|fim_middle|>")) == 1  # one special token, not its text
    assert out["tokens_evaluated"] == len(want)
    tok = server.engine.tokenizer
    assert out["prompt"] == tok.decode(want, strip_prefix_space=False)


def test_the_model_fills_the_middle_from_the_extra_file(server):
    """With llama.h in input_extra the coder completes ``llama_`` with the function the
    header declares (upstream's test_with_qwen_model expects the same start from the
    1.5B); without it, it cannot know that name."""
    st, with_extra = req(server, "POST", "/infill", {**BODY, "input_extra": EXTRA, "n_predict": 4})
    assert st == 200
    assert with_extra["content"].startswith("n_threads(")
    st, without = req(server, "POST", "/infill", {**BODY, "n_predict": 4})
    assert st == 200 and not without["content"].startswith("n_threads(")


def test_long_prefix_and_suffix_are_cut_to_fit_a_batch(server):
    """The prefix keeps its last 3/4 * n_batch tokens, the suffix its first
    n_batch/4 - 2 - len(prompt) (format_prompt_infill's ratio)."""
    prefix = "".join(f"int a{i} = {i};\n" for i in range(40))
    suffix = "".join(f"int b{i} = {i};\n" for i in range(40))
    body = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "prompt": "x",
        "n_predict": 1,
    }
    st, out = req(server, "POST", "/infill", body)
    assert st == 200, out
    n_prompt = len(ids(server, "x", special=True))
    keep_pre = 3 * (N_BATCH // 4)
    keep_suf = N_BATCH // 4 - 2 - n_prompt
    assert len(ids(server, prefix)) > keep_pre and len(ids(server, suffix)) > keep_suf
    # the extra part still has the repo name and the current file's separator
    n_extra = len(piece(server, "<|repo_name|>") + ids(server, "myproject\n")) + len(
        piece(server, "<|file_sep|>") + ids(server, "filename\n")
    )
    assert out["tokens_evaluated"] == n_extra + 1 + keep_pre + n_prompt + 1 + keep_suf + 1
    tok = server.engine.tokenizer
    kept = tok.decode(ids(server, prefix)[-keep_pre:], strip_prefix_space=False)
    assert kept in out["prompt"] and "int a0 = 0;" not in out["prompt"]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"input_extra": [{}]}, '"text" field'),
        ({"input_extra": [{"filename": "ok"}]}, '"text" field'),
        ({"input_extra": [{"filename": 123, "text": "abc"}]}, '"filename" field'),
        ({"input_extra": {"filename": "a", "text": "b"}}, "must be an array"),
        ({"prompt": ["x"]}, '"prompt" must be a string'),
        ({"input_prefix": None}, '"input_prefix" must be'),
        ({"input_suffix": [1.5]}, '"input_suffix" must be'),
    ],
)
def test_bad_infill_fields_are_400(server, change, words):
    st, out = req(server, "POST", "/infill", {**BODY, **change, "n_predict": 1})
    assert_400(st, out)
    assert words in out["error"]["message"]


def test_prefix_and_suffix_are_required(server):
    for key in ("input_prefix", "input_suffix"):
        body = {k: v for k, v in BODY.items() if k != key}
        st, out = req(server, "POST", "/infill", {**body, "n_predict": 1})
        assert_400(st, out)
        assert f'"{key}" is required' in out["error"]["message"]
