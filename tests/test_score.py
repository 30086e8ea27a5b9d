"""Teacher-forced scoring (the A/B diff view, #21) on the real SmolLM2 and reference
adapters: a greedy reply scored under its own mix gives back the generated token as
top-1 at every position, with the generation's own n_probs logprobs; chunking and
batching do not change the numbers; where two mixes' top-1 differ is exactly where
their greedy generations part."""

from __future__ import annotations

import pytest

import core.serve.score
from core.options import EngineOptions
from core.serve.engine import Engine, EngineError
from core.serve.sampling import SamplingParams
from core.serve.score import disagreements

N = 12  # reply tokens
TOP_K = 5
LP_TOL = 1e-3  # the brief's bound; measured differences are ~1e-5


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256, n_parallel=2))
    eng.attn = eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf")
    eng.ffn = eng.add_adapter(ref_dir / "adapters" / "lora_ffn.gguf")
    yield eng
    eng.stop()


def greedy_reply(engine, prompt, mix):
    """The greedy reply's token events (with n_probs) under ``mix``."""
    p = SamplingParams(temperature=0, n_predict=N, n_probs=TOP_K)
    events = [
        ev
        for ev in engine.generate(prompt, p, mix=mix, cache_prompt=False)
        if ev.kind == "token" and ev.token >= 0
    ]
    assert 0 < len(events) <= N
    return events


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.chat_prompt([{"role": "user", "content": "Tell me about the moon."}])


@pytest.fixture(scope="module")
def mix(engine):
    return {engine.attn: 1.0, engine.ffn: 0.5}


@pytest.fixture(scope="module")
def reply(engine, prompt, mix):
    return greedy_reply(engine, prompt, mix)


@pytest.fixture(scope="module")
def scored(engine, prompt, mix, reply):
    return engine.score(prompt + [ev.token for ev in reply], mix, len(prompt), top_k=TOP_K)


def test_a_greedy_reply_scored_under_its_mix_gives_back_the_generation(reply, scored):
    assert [s.token for s in scored] == [ev.token for ev in reply]
    for pos, (s, ev) in enumerate(zip(scored, reply)):
        assert s.top1 == ev.token, f"position {pos}"
        assert abs(s.logprob - ev.logprob) < LP_TOL, f"position {pos}"
        assert [c.id for c in s.top] == [t for t, _ in ev.top], f"position {pos}"
        for c, (_, lp) in zip(s.top, ev.top):
            assert abs(c.logprob - lp) < LP_TOL, f"position {pos}"
    # the texts put back together are the reply the user saw
    assert "".join(s.text for s in scored) == "".join(ev.text for ev in reply)


def test_chunked_scoring_gives_the_same_numbers(engine, prompt, mix, reply, scored, monkeypatch):
    """A long text runs in chunks of PREFILL_CHUNK rows per forward (bounded memory):
    with chunks of 4 rows, so the prompt and the reply span many chunks and the reply
    starts inside one, every position comes out the same."""
    monkeypatch.setattr(core.serve.score, "PREFILL_CHUNK", 4)
    chunked = engine.score(prompt + [ev.token for ev in reply], mix, len(prompt), top_k=TOP_K)
    assert len(chunked) == len(scored)
    for a, b in zip(chunked, scored):
        assert [c.id for c in a.top] == [c.id for c in b.top]
        assert abs(a.logprob - b.logprob) < 1e-4


def test_two_mixes_disagree_exactly_where_their_greedy_replies_part(
    engine, prompt, mix, reply, scored
):
    """Score the mix's reply under the base model too, in one batch with the mix:
    the base's top-1 equals the reply up to the token where the base model's own
    greedy reply takes another way, and differs there."""
    tokens = prompt + [ev.token for ev in reply]
    under_mix, under_base = engine.score_many(
        [(tokens, mix, len(prompt)), (tokens, {}, len(prompt))], top_k=TOP_K
    )
    for a, b in zip(under_mix, scored):  # batching changes nothing
        assert [c.id for c in a.top] == [c.id for c in b.top]
        assert abs(a.logprob - b.logprob) < 1e-4
    base = [ev.token for ev in greedy_reply(engine, prompt, {})]
    mixed = [ev.token for ev in reply]
    assert base != mixed, "the reference adapters change this reply"
    part = next(i for i, (x, y) in enumerate(zip(base, mixed)) if x != y)
    diff = disagreements(under_mix, under_base)
    assert diff[:part] == [False] * part
    assert diff[part] is True
    assert under_base[part].top1 == base[part]
    assert disagreements(under_mix, under_mix) == [False] * len(mixed)


@pytest.mark.parametrize(
    "case",
    ["start 0", "empty reply", "token out of vocabulary", "unknown adapter"],
)
def test_bad_input_is_a_400_and_the_engine_goes_on(engine, prompt, case):
    tokens, mix, start = prompt[:6], {}, 3
    if case == "start 0":
        start = 0
    elif case == "empty reply":
        start = len(tokens)
    elif case == "token out of vocabulary":
        tokens = tokens + [engine.config.vocab_size]
    else:
        mix = {999: 1.0}
    with pytest.raises(EngineError) as e:
        engine.score(tokens, mix, start)
    assert e.value.code == 400
    assert len(engine.score(prompt[:6], {}, 3, top_k=2)[0].top) == 2


def test_disagreements_refuses_two_different_texts(scored):
    with pytest.raises(ValueError):
        disagreements(scored, scored[1:])
