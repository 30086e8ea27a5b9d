"""--context-shift (issue #20) on a real server over real SmolLM2: when a generation
fills its slot, the first n_keep tokens stay, half of the others go, and generation
goes on exactly as a fresh request whose prompt is what was kept; without it, the
generation ends there with ``truncated``, and a prompt that does not fit is refused
with llama-server's wording."""

from __future__ import annotations

import pytest
from test_http_api import req

from tests.serving import running_engine, serving

CTX = 32
N = 20  # tokens generated: one context shift, after CTX - prompt of them
# a prompt that fills most of the slot, so the shift comes after few generated tokens
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman"


@pytest.fixture(scope="module")
def eng(smollm_path):
    with running_engine(
        smollm_path, ctx_size=CTX, n_parallel=1, draft_max=0, context_shift=True
    ) as e:
        yield e


@pytest.fixture(scope="module")
def server(eng):
    with serving(eng) as srv:
        yield srv


@pytest.fixture
def no_shift(eng):
    # one model load per module: the same live scheduler, with the flag's other value
    eng.scheduler.context_shift = False
    yield
    eng.scheduler.context_shift = True


def generate(server, prompt, n, **extra):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True}
    st, out = req(server, "POST", "/completion", {**body, "return_tokens": True, **extra})
    assert st == 200, out
    return out


@pytest.mark.parametrize("n_keep", [0, 4])
def test_a_full_context_drops_half_of_the_unkept_tokens_and_goes_on(server, n_keep):
    out = generate(server, PROMPT, N, n_keep=n_keep, cache_prompt=False)
    p, gen = out["timings"]["prompt_n"], out["tokens"]
    assert out["timings"]["predicted_n"] == N and len(gen) == N  # past the context
    assert p + N > CTX and out["truncated"] is True and out["stop_type"] == "limit"
    # the first shift: the slot held the prompt and g1 - 1 generated tokens (CTX - 1),
    # the g1-th was sampled; n_keep stay, half of the rest (n_discard) go
    _, prompt_ids = req(server, "POST", "/tokenize", {"content": PROMPT})
    held = prompt_ids["tokens"] + gen
    g1 = CTX - p
    n_left = CTX - 1 - n_keep
    n_discard = n_left // 2
    kept = held[:n_keep] + held[n_keep + n_discard : CTX - 1] + [gen[g1 - 1]]
    assert 4 <= N - g1 < CTX - len(kept)  # the tokens compared come before a second shift
    # from there on, the text is what a fresh request with the kept tokens writes
    fresh = generate(server, kept, N - g1, cache_prompt=False)
    assert fresh["tokens"] == gen[g1:]
    assert out["generation_settings"]["n_keep"] == n_keep


def test_without_context_shift_a_full_context_ends_the_generation(server, no_shift):
    out = generate(server, PROMPT, N, cache_prompt=False)
    p = out["timings"]["prompt_n"]
    # as llama-server: it stops once prompt + generated tokens reach the context
    assert out["timings"]["predicted_n"] == CTX - p
    assert out["truncated"] is True and out["stop_type"] == "limit"
    short = generate(server, PROMPT, 4, cache_prompt=False)
    assert short["truncated"] is False


def test_a_prompt_longer_than_the_context_is_refused(server):
    st, out = req(server, "POST", "/completion", {"prompt": "word " * 40, "n_predict": 4})
    assert st == 400 and out["error"]["type"] == "exceed_context_size_error"
    assert "exceeds the available context size" in out["error"]["message"]
    generate(server, PROMPT, 2)  # and the server goes on serving


@pytest.mark.parametrize("field, value", [("n_keep", -2), ("n_discard", -1), ("n_keep", "x")])
def test_bad_n_keep_or_n_discard_is_a_400(server, field, value):
    st, out = req(server, "POST", "/completion", {"prompt": "Hi", "n_predict": 1, field: value})
    assert st == 400 and field in out["error"]["message"]
