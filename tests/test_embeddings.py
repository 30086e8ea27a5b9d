"""Embeddings (issue #20): /embedding, /embeddings and /v1/embeddings against a real
server on 127.0.0.1 with the real SmolLM2 and a reference adapter, and the flags
--embedding, --pooling, --ubatch-size.

One engine for the module; a test that needs another pooling swaps the engine's
EmbeddingOptions (what --pooling builds) for its duration.
"""

from __future__ import annotations

import base64
import contextlib
import struct
from dataclasses import replace

import numpy as np
import pytest
from test_http_api import assert_400, req

from core.cli import parse_args
from core.http import ServerSettings, ServerThread
from core.model.linear import dense
from core.model.llama import BatchItem
from core.options import EmbeddingOptions, EngineOptions
from core.serve.embeddings import EmbeddingError, normalize, packed
from core.serve.engine import Engine
from tests.serving import running_engine, serving

TEXT = "I believe the meaning of life is"
UBATCH = 64


@pytest.fixture(scope="module")
def eng(smollm_path, ref_dir):
    with running_engine(
        smollm_path,
        adapters=[ref_dir / "adapters" / "lora_attn.gguf"],
        ctx_size=128,
        n_parallel=2,
        embeddings=EmbeddingOptions(True, "mean", UBATCH),
    ) as e:
        yield e


@pytest.fixture(scope="module")
def server(eng):
    with serving(eng) as srv:
        yield srv


@contextlib.contextmanager
def options(eng, **changes):
    saved = eng.embeddings
    eng.embeddings = replace(saved, **changes)
    try:
        yield
    finally:
        eng.embeddings = saved


def pooling(eng, kind):
    return options(eng, pooling=kind)


def oai(server, body):
    st, out = req(server, "POST", "/v1/embeddings", body)
    assert st == 200, out
    return [np.array(d["embedding"], dtype=np.float64) for d in out["data"]], out


def native(server, body):
    st, out = req(server, "POST", "/embedding", body)
    assert st == 200, out
    return [np.array(d["embedding"], dtype=np.float64) for d in out]  # (k, d) each


def n_tokens(eng, text):
    return len(eng.tokenizer.encode(text, add_special=True, parse_special=True))


# ---- the forward ------------------------------------------------------------------------


def test_hidden_state_is_the_row_the_output_matrix_turns_into_logits(eng):
    """What is pooled is llama.cpp's t_embd: after the output norm, before the output
    matrix, so hidden @ output.T reproduces the model's logits (whose parity with
    llama.cpp tests/test_parity.py checks)."""
    ids = eng.tokenizer.encode(TEXT, add_special=True, parse_special=True)
    h = eng.embed([ids]).result()[0]  # (n, d)
    assert h.shape == (len(ids), eng.config.dim) and h.dtype == np.float32

    def logits(model):
        return model([BatchItem(np.array(ids), model.new_cache(len(ids)), all_logits=True)])[0]

    lg = eng.run_on_engine(logits).result()  # (n, vocab)
    w = dense(eng.model.w.output)  # (vocab, d) float32, dequantized if held in blocks
    np.testing.assert_allclose(h @ w.T, lg, atol=2e-4, rtol=1e-4)


def test_a_batch_of_inputs_equals_each_alone(eng):
    texts = [TEXT, "This is a test", "hello"]
    ids = [eng.tokenizer.encode(t, add_special=True, parse_special=True) for t in texts]
    together = eng.embed(ids).result()
    for one, h in zip(ids, together):
        np.testing.assert_allclose(eng.embed([one]).result()[0], h, rtol=1e-4, atol=1e-4)


def test_inputs_beyond_one_forward_are_split_across_forwards(eng):
    """Inputs are packed into forwards of at most --ubatch-size rows: 5 inputs of 20
    tokens under a 64-row batch take 2 forwards and still match one by one."""
    ids = [list(range(100 + 20 * i, 120 + 20 * i)) for i in range(5)]
    assert [len(g) for g in packed(ids, UBATCH)] == [3, 2]
    assert [len(g) for g in packed([[1] * UBATCH, [2], [3] * UBATCH], UBATCH)] == [1, 1, 1]
    together = eng.embed(ids).result()
    assert [h.shape[0] for h in together] == [20] * 5
    for one, h in zip(ids, together):
        np.testing.assert_allclose(eng.embed([one]).result()[0], h, rtol=1e-4, atol=1e-4)


def test_normalize_follows_llama_cpp():
    v = np.array([3.0, -4.0], dtype=np.float32)
    np.testing.assert_allclose(normalize(v, 2), [0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 1), [3 / 7, -4 / 7], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, -1), v)
    np.testing.assert_allclose(normalize(v, 0), v * (32760 / 4), rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 3), v / (27 + 64) ** (1 / 3), rtol=1e-6)
    assert not normalize(np.zeros(3, np.float32), 2).any()  # no 0/0


# ---- /v1/embeddings ---------------------------------------------------------------------


def test_oai_single_is_unit_length_with_usage(server, eng):
    (v,), out = oai(server, {"input": TEXT})
    assert v.shape == (eng.config.dim,)
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    n = n_tokens(eng, TEXT)
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert out["object"] == "list" and out["data"][0]["object"] == "embedding"
    assert out["data"][0]["index"] == 0 and out["model"]


def test_same_input_twice_gives_the_same_vector(server):
    vs, out = oai(server, {"input": [TEXT, "This is a test", TEXT]})
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    np.testing.assert_allclose(vs[0], vs[2], atol=1e-6)
    assert np.abs(vs[0] - vs[1]).max() > 1e-3
    (again,), _ = oai(server, {"input": TEXT})
    np.testing.assert_allclose(again, vs[0], atol=1e-6)


def test_input_forms(server, eng):
    ids = eng.tokenizer.encode(TEXT, add_special=True, parse_special=True)
    (by_text,), _ = oai(server, {"input": TEXT})
    (by_ids,), _ = oai(server, {"input": ids})
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    parts = {
        "content": [{"type": "text", "text": "I believe "}, {"type": "text", "text": TEXT[10:]}]
    }
    vs, _ = oai(server, {"input": [TEXT, parts, {"prompt_string": TEXT}, ids]})
    for v in vs[1:]:
        np.testing.assert_allclose(v, by_text, atol=1e-6)
    (mixed,), _ = oai(server, {"input": [ids[0], "string", ids[1]]})  # one input
    assert mixed.shape == by_text.shape


def test_base64_is_the_float32_vector(server):
    (v,), _ = oai(server, {"input": TEXT})
    st, out = req(server, "POST", "/v1/embeddings", {"input": TEXT, "encoding_format": "base64"})
    assert st == 200
    d = out["data"][0]
    assert d["encoding_format"] == "base64"
    raw = base64.b64decode(d["embedding"])
    floats = struct.unpack(f"<{len(raw) // 4}f", raw)
    np.testing.assert_allclose(floats, v, atol=1e-7)


def test_a_mix_changes_the_embedding_and_lora_off_restores_it(server, eng):
    (base,), _ = oai(server, {"input": TEXT})
    (mixed,), _ = oai(server, {"input": TEXT, "lora": [{"id": 0, "scale": 1.0}]})
    assert np.abs(mixed - base).max() > 1e-3
    eng.set_mix({0: 1.0})  # the global mix applies when the request names none
    try:
        (glob,), _ = oai(server, {"input": TEXT})
        (off,), _ = oai(server, {"input": TEXT, "lora": []})
    finally:
        eng.set_mix({0: 0.0})
    np.testing.assert_allclose(glob, mixed, atol=1e-6)
    np.testing.assert_allclose(off, base, atol=1e-6)


# ---- pooling ----------------------------------------------------------------------------


def test_pooling_none_gives_per_token_vectors_whose_mean_is_mean_pooling(server, eng):
    with pooling(eng, "none"):
        (per_token,) = native(server, {"content": TEXT})
        st, out = req(server, "POST", "/v1/embeddings", {"input": TEXT})
        assert_400(st, out)
        assert "not OAI compatible" in out["error"]["message"]
    n = n_tokens(eng, TEXT)
    assert per_token.shape == (n, eng.config.dim)
    norms = np.linalg.norm(per_token, axis=1)
    assert np.all(np.abs(norms - 1) > 1e-3)  # not normalized
    (mean,) = native(server, {"content": TEXT, "embd_normalize": -1})
    assert mean.shape == (1, eng.config.dim)
    np.testing.assert_allclose(mean[0], per_token.mean(axis=0), atol=1e-5)
    with pooling(eng, "cls"):
        (cls,) = native(server, {"content": TEXT, "embd_normalize": -1})
    with pooling(eng, "last"):
        (last,) = native(server, {"content": TEXT, "embd_normalize": -1})
    np.testing.assert_allclose(cls[0], per_token[0], atol=1e-5)
    np.testing.assert_allclose(last[0], per_token[-1], atol=1e-5)
    assert np.abs(cls - last).max() > 1e-2 and np.abs(mean - last).max() > 1e-2


def test_embeddings_alias_and_native_form(server, eng):
    st, out = req(server, "POST", "/embeddings", {"input": [TEXT, "hello"]})
    assert st == 200
    assert [e["index"] for e in out] == [0, 1]
    v = np.array(out[0]["embedding"])  # (1, d): one pooled vector per input
    assert v.shape == (1, eng.config.dim) and abs(np.linalg.norm(v) - 1) < 1e-5
    # "content" is the non-OpenAI field: /v1/embeddings answers in /embedding's form
    st, out = req(server, "POST", "/v1/embeddings", {"content": TEXT})
    assert st == 200 and isinstance(out, list) and out[0]["index"] == 0


def test_embd_normalize_taxicab(server):
    (v,) = native(server, {"content": TEXT, "embd_normalize": 1})
    assert abs(np.abs(v).sum() - 1) < 1e-4


# ---- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": ""}, "Input content cannot be empty"),
        ({"input": []}, "must not be empty"),
        ({"input": [TEXT, ""]}, "Input content cannot be empty"),
        ({}, '"input" or "content" must be provided'),
        ({"input": 3.5}, "input must be"),
        ({"input": {"content": "string"}}, '"content" must be an array'),
        ({"input": {"content": [{"type": "unknown"}]}}, "content[0]"),
        ({"input": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}}, "multimodal"),
        ({"input": [1, 10**9]}, "out of range"),
        ({"input": TEXT, "encoding_format": "hex"}, "float or base64"),
        ({"input": TEXT, "embd_normalize": "2"}, "embd_normalize"),
        ({"input": TEXT, "embd_normalize": 10**30}, "embd_normalize"),
        ({"input": TEXT, "lora": [{"id": 99, "scale": 1}]}, "99"),
        ({"input": "word " * (UBATCH + 5)}, "too large to process"),
    ],
)
def test_bad_input_is_a_400(server, body, words):
    st, out = req(server, "POST", "/v1/embeddings", body)
    assert_400(st, out)
    assert words in out["error"]["message"]


def test_an_input_longer_than_the_context_is_refused(eng):
    with options(eng, ubatch=4096), pytest.raises(EmbeddingError, match="max context size"):
        eng.embed([[1] * (eng.ctx_size + 1)])  # a -ub larger than -c: the context decides


def test_too_many_inputs_is_a_400(server):
    st, out = req(server, "POST", "/v1/embeddings", {"input": [[1]] * 2049})
    assert_400(st, out)
    assert "at most 2048" in out["error"]["message"]


def test_without_embedding_the_routes_answer_501(smollm_path):
    e = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    e.load_model(smollm_path)
    e.start()
    srv = ServerThread(e, ServerSettings(port=0)).start()
    try:
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            st, out = req(srv, "POST", path, {"input": TEXT})
            assert st == 501
            assert out["error"]["type"] == "not_supported_error"
            assert "Start it with `--embeddings`" in out["error"]["message"]
    finally:
        srv.stop()
        e.stop()


def test_pooling_none_is_the_default_without_the_models_key(server, eng):
    """llama.cpp's rule: no --pooling and no {arch}.pooling_type in the file: none."""
    assert eng.config.pooling == "none"
    with pooling(eng, None):
        st, out = req(server, "POST", "/v1/embeddings", {"input": TEXT})
        assert_400(st, out)
        (per_token,) = native(server, {"content": TEXT})
    assert per_token.shape == (n_tokens(eng, TEXT), eng.config.dim)


# ---- flags ------------------------------------------------------------------------------


def test_flags_build_the_engines_embedding_options():
    args = parse_args(["--embeddings", "--pooling", "last", "-ub", "128"])
    opts = EngineOptions.from_args(args)
    assert opts.embeddings == EmbeddingOptions(True, "last", 128)
    assert Engine(opts).embeddings == EmbeddingOptions(True, "last", 128)
    # the physical batch is min(-b, -ub), as in llama.cpp
    assert EngineOptions.from_args(parse_args(["-b", "100"])).embeddings.ubatch == 100
    assert Engine(EngineOptions.from_args(parse_args([]))).embeddings == EmbeddingOptions()


def test_pooling_rank_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--embedding", "--pooling", "rank"])
    assert "--pooling rank" in capsys.readouterr().err


# ---- every family; the file's pooling_type ---------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_hidden_rows_in_a_mixed_batch_on_every_family(tmp_path, arch):
    """A batch mixing an embedding item with a generating one: the embedding item gets
    the normed hidden rows (Gemma 2's final soft-capping is for logits only), the other
    its logits, equal to the output matrix (then the cap) over those same rows."""
    from gguf import GGUFValueType

    from core.model.families import model_class
    from core.model.weights import load_weights, open_model_file
    from tests.tiny_gguf import write_tiny_llama

    kw = {"arch": arch}
    if arch == "gemma2":
        cap = {"gemma2.final_logit_softcapping": (2.0, GGUFValueType.FLOAT32)}
        kw.update(dim=48, n_heads=4, n_kv_heads=2, head_dim=16, ffn=80, kv=cap)
    gf, cfg = open_model_file(write_tiny_llama(tmp_path / "t.gguf", **kw))
    model = model_class(cfg)(cfg, load_weights(gf, cfg, use_cache=False))
    toks = np.array([5, 17, 42, 99, 7])
    h, lg = model(
        [
            BatchItem(toks, model.new_cache(8), hidden=True),
            BatchItem(toks, model.new_cache(8), all_logits=True),
        ]
    )
    assert h.shape == (5, cfg.dim) and lg.shape == (5, cfg.vocab_size)
    want = h @ model.w.output.T  # (5, vocab)
    if cfg.final_softcap:
        want = cfg.final_softcap * np.tanh(want / cfg.final_softcap)
        assert np.abs(lg).max() <= cfg.final_softcap
    np.testing.assert_allclose(lg, want, rtol=1e-4, atol=1e-4)
    (alone,) = model([BatchItem(toks, model.new_cache(8), hidden=True)])
    np.testing.assert_allclose(alone, h, rtol=1e-5, atol=1e-5)


def test_the_files_pooling_type_is_the_default(tmp_path):
    from gguf import GGUFValueType

    from core.errors import UserError
    from core.model.weights import open_model_file
    from tests.tiny_gguf import write_tiny_llama

    last = {"llama.pooling_type": (3, GGUFValueType.UINT32)}
    _, cfg = open_model_file(write_tiny_llama(tmp_path / "last.gguf", kv=last))
    assert cfg.pooling == "last"
    assert EmbeddingOptions(True).pooling_for(cfg) == "last"
    assert EmbeddingOptions(True, "mean").pooling_for(cfg) == "mean"  # --pooling wins
    bad = {"llama.pooling_type": (9, GGUFValueType.UINT32)}
    with pytest.raises(UserError, match="pooling_type must be an integer from 0 to 4"):
        open_model_file(write_tiny_llama(tmp_path / "bad.gguf", kv=bad))


def test_metrics_count_embedding_prompts(eng):
    """As llama-server's /metrics: an embedding samples no token, but its prompt is
    counted in prompt_tokens_total and its forwards in n_decode_total."""
    from test_http_endpoints import parse_metrics

    with serving(eng, metrics=True) as srv:
        st, before = req(srv, "GET", "/metrics")
        m0 = parse_metrics(before)
        _, out = oai(srv, {"input": ["hello world", "goodbye world"]})
        st, after = req(srv, "GET", "/metrics")
    assert st == 200
    m1 = parse_metrics(after)
    grew = lambda name: m1[f"llamacpp:{name}"][1] - m0[f"llamacpp:{name}"][1]  # noqa: E731
    assert grew("prompt_tokens_total") == out["usage"]["prompt_tokens"] > 0
    assert grew("n_decode_total") == 1  # both inputs in one forward
    assert grew("tokens_predicted_total") == 0
    assert m1["llamacpp:prompt_seconds_total"][1] > 0
