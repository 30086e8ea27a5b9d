"""Sampling: seeds reproduce, filters do what they say, stop strings cut exactly."""

from __future__ import annotations

import numpy as np
import pytest

from core.options import EngineOptions
from core.serve.engine import Engine, EngineError
from core.serve.sampling import (
    NonFiniteLogits,
    SamplingError,
    SamplingParams,
    StopMatcher,
    apply_penalties,
    make_sampler,
    top_logprobs,
    validate,
)


def logits_for(probs):
    return np.log(np.asarray(probs, dtype=np.float32))


def draws(params, logits, n=400):
    s = make_sampler(params)
    return [s(logits, []) for _ in range(n)]


def test_greedy_at_temperature_zero():
    lg = logits_for([0.1, 0.6, 0.3])
    assert set(draws(SamplingParams(temperature=0), lg, 20)) == {1}


def test_seed_reproducible_and_different_seeds_differ():
    lg = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    assert draws(p, lg, 50) == draws(p, lg, 50)
    assert draws(p, lg, 50) != draws(SamplingParams(**{**p.__dict__, "seed": 43}), lg, 50)


def test_top_k_top_p_min_p_restrict_the_candidates():
    lg = logits_for([0.5, 0.25, 0.15, 0.07, 0.03])
    base = dict(temperature=1.0, seed=1, top_k=0, top_p=1.0, min_p=0.0)
    assert set(draws(SamplingParams(**{**base, "top_k": 2}), lg)) == {0, 1}
    assert set(draws(SamplingParams(**{**base, "top_p": 0.7}), lg)) == {0, 1}
    assert set(draws(SamplingParams(**{**base, "min_p": 0.2}), lg)) == {0, 1, 2}
    assert set(draws(SamplingParams(**base), lg, 2000)) == {0, 1, 2, 3, 4}


def test_temperature_sharpens():
    lg = logits_for([0.6, 0.4])
    base = dict(top_k=0, top_p=1.0, min_p=0.0, seed=3)
    hot = draws(SamplingParams(temperature=1.0, **base), lg, 2000)
    cold = draws(SamplingParams(temperature=0.2, **base), lg, 2000)
    assert 0.5 < hot.count(0) / 2000 < 0.7
    assert cold.count(0) / 2000 > 0.8


def test_penalties():
    lg = np.array([2.0, -1.0, 1.0], dtype=np.float32)
    out = apply_penalties(lg, [0, 1, 0], SamplingParams(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -2.0, 1.0]  # positive divided, negative multiplied
    out = apply_penalties(
        lg, [0, 0, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    )
    assert out.tolist() == pytest.approx([2.0 - 0.5 - 0.5, -1.0, 1.0 - 0.5 - 0.25])


def test_ignore_eos_bans_eog_tokens():
    lg = logits_for([0.9, 0.1])
    assert draws(SamplingParams(temperature=0, ignore_eos=True), lg, 1) == [0]
    s = make_sampler(SamplingParams(temperature=0, ignore_eos=True), eog_ids=[0])
    assert s(lg, []) == 1


def test_top_logprobs_normalized_over_vocab():
    lg = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    top = top_logprobs(lg, 5)
    full = lg - np.log(np.exp(lg.astype(np.float64)).sum())
    assert [t for t, _ in top] == list(np.argsort(-lg)[:5])
    assert [v for _, v in top] == pytest.approx(full[np.argsort(-lg)[:5]], abs=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=float("nan")),
        dict(top_p=1.5),
        dict(top_k=1.5),
        dict(seed="x"),
        dict(n_probs=-1),
        dict(stop="###"),
    ],
)
def test_validate_rejects(bad):
    with pytest.raises(SamplingError):
        validate(SamplingParams(**bad))


@pytest.mark.parametrize(
    "field, value",
    [
        ("frequency_penalty", -1e300),
        ("frequency_penalty", 1e300),
        ("presence_penalty", 1e300),
        ("presence_penalty", -1e300),
        ("repeat_penalty", 1e-300),
        ("repeat_penalty", 1e300),
    ],
)
def test_validate_rejects_penalties_that_overflow_the_logits(field, value):
    # finite but huge: at temperature > 0 they made the logits inf/NaN and the sampler
    # raised IndexError on the scheduler thread, which then stopped serving for good
    with pytest.raises(SamplingError, match=field):
        validate(SamplingParams(temperature=1.0, **{field: value}))


def test_validate_accepts_the_ends_of_the_penalty_ranges():
    validate(SamplingParams(frequency_penalty=-100, presence_penalty=100, repeat_penalty=0.01))
    validate(SamplingParams(frequency_penalty=100, presence_penalty=-100, repeat_penalty=100))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sampler_refuses_non_finite_logits_with_a_clear_error(temperature, bad):
    lg = np.zeros(8, dtype=np.float32)
    lg[3] = bad
    s = make_sampler(SamplingParams(temperature=temperature, seed=1))
    with pytest.raises(NonFiniteLogits, match="not finite"):
        s(lg, [])


def test_sampler_refuses_penalties_that_overflow_even_unvalidated():
    # validate() is the front door; the sampler must still not crash with IndexError
    lg = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    p = SamplingParams(temperature=1.0, frequency_penalty=-1e300, seed=1)
    with pytest.raises(NonFiniteLogits):
        make_sampler(p)(lg, [0, 1])


def test_sampler_still_samples_with_banned_tokens_at_minus_infinity():
    lg = logits_for([0.5, 0.3, 0.2])
    s = make_sampler(SamplingParams(temperature=1.0, seed=3, ignore_eos=True), eog_ids=[0])
    assert {s(lg, []) for _ in range(50)} <= {1, 2}


def test_stop_matcher_cuts_exactly_and_holds_back_partials():
    m = StopMatcher(["</end>", "\n\n"])
    assert m.feed("Hello <") == "Hello "  # "<" might start "</end>"
    assert m.feed("/e") == ""
    assert m.feed("x") == "</ex"  # no longer a prefix: released
    assert m.feed(" ok</en") == " ok"
    assert m.feed("d> tail") == ""
    assert m.hit == "</end>" and m.text == "Hello </ex ok"


def test_stop_matcher_earliest_stop_wins_within_one_piece():
    m = StopMatcher(["b", "a"])
    assert m.feed("xxab") == "xx"
    assert m.hit == "a"


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256))
    yield eng
    eng.stop()


def test_engine_seeded_sampling_is_reproducible(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Tell me a story."}])
    p = SamplingParams(temperature=1.0, seed=1234, n_predict=12, ignore_eos=True)
    a, b = engine.complete(prompt, p), engine.complete(prompt, p)
    assert a.tokens == b.tokens
    c = engine.complete(
        prompt, SamplingParams(temperature=1.0, seed=99, n_predict=12, ignore_eos=True)
    )
    assert c.tokens != a.tokens


def test_engine_stop_string_cuts_exactly(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Count from 1 to 10."}])
    free = engine.complete(prompt, SamplingParams(temperature=0, n_predict=24)).content
    # stop at the first "3" that appears in the greedy output
    assert "3" in free
    done = engine.complete(prompt, SamplingParams(temperature=0, n_predict=24, stop=["3"]))
    assert done.stop_type == "word" and done.stopping_word == "3"
    assert done.content == free[: free.index("3")]
    streamed = "".join(
        ev.text
        for ev in engine.generate(prompt, SamplingParams(temperature=0, n_predict=24, stop=["3"]))
        if ev.kind != "done"
    )
    assert streamed == done.content


def test_engine_rejects_bad_params_and_tokens(engine):
    with pytest.raises(SamplingError):
        engine.complete([1, 2], SamplingParams(top_p=7))
    with pytest.raises(EngineError, match="invalid token id"):
        engine.complete([1, 10**6], SamplingParams())


@pytest.mark.parametrize(
    "bias",
    [{5: float("nan")}, {5: float("inf")}, {"5": 1.0}, {True: 1.0}, {5: "x"}, [(5, 1.0)]],
)
def test_validate_rejects_bad_logit_bias(bias):
    with pytest.raises(SamplingError, match="logit_bias"):
        validate(SamplingParams(logit_bias=bias))


def test_logit_bias_ban_and_force_hold_at_every_temperature():
    logits = logits_for([0.7, 0.2, 0.05, 0.05])
    for t in (0.0, 0.5, 1.5):
        banned = SamplingParams(temperature=t, seed=1, top_k=0, min_p=0, logit_bias={0: -np.inf})
        assert 0 not in draws(validate(banned), logits, 100)
        forced = SamplingParams(temperature=t, seed=1, logit_bias={3: 1e6})
        assert set(draws(validate(forced), logits, 100)) == {3}


def test_logit_bias_ban_survives_penalties():
    """-inf stays -inf through the repeat penalty (multiplied) and a negative presence
    penalty (subtracted): a banned token never comes back."""
    p = SamplingParams(
        temperature=0, repeat_penalty=1.5, presence_penalty=-50.0, logit_bias={1: -np.inf}
    )
    assert make_sampler(validate(p))(logits_for([0.1, 0.8, 0.1]), [1, 1, 1]) != 1
