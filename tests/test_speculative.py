"""Prompt-lookup speculative decoding: drafts are verified with the request's own
sampler, so the output is token-for-token what plain greedy decoding gives."""

from __future__ import annotations

import pytest

from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from core.serve.scheduler import prompt_lookup

TEXT = (
    "The mixing desk has three faders. The first fader controls the pirate voice. "
    "The second fader controls the terse voice. The third fader controls the hype voice."
)


def test_prompt_lookup_finds_the_latest_continuation():
    h = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 5, 1, 2, 3, 4]
    assert prompt_lookup(h, 3) == [7, 8, 5]  # the most recent earlier match wins
    assert prompt_lookup(h, 1) == [7]
    assert prompt_lookup([1, 2, 3, 4, 5], 4) == []  # no earlier occurrence
    assert prompt_lookup([5, 6, 7, 0, 6, 7], 2) == []  # 2-grams are too weak to draft from


@pytest.fixture(scope="module")
def engines(smollm_path, ref_dir):
    plain = Engine.from_path(smollm_path, EngineOptions(ctx_size=1024, draft_max=0))
    spec = Engine.from_path(smollm_path, EngineOptions(ctx_size=1024, draft_max=8))
    for e in (plain, spec):
        e.add_adapter(ref_dir / "adapters" / "lora_attn.gguf")
    yield plain, spec
    plain.stop()
    spec.stop()


# Five cases, not the full product of options x mixes: each option meets the drafting
# path once, and the adapter path twice (one option each side of the mix), which is
# what can differ; 32 tokens reach the first repeated phrase where drafts start.
@pytest.mark.parametrize(
    "params, mix",
    [
        (dict(n_predict=32), None),
        (dict(n_predict=32), {0: 0.8}),
        (dict(n_predict=32, ignore_eos=True, n_probs=3), {0: 0.8}),
        (dict(n_predict=48, stop=["second"]), None),
        (dict(n_predict=32, repeat_penalty=1.05, repeat_last_n=16), None),
    ],
    ids=["greedy-base", "greedy-lora", "logprobs-lora", "stop", "penalty"],
)
def test_speculation_reproduces_plain_greedy(engines, params, mix):
    plain, spec = engines
    prompt = plain.chat_prompt([{"role": "user", "content": "Repeat exactly: " + TEXT}])
    before = spec.stats()["draft_tokens"]
    a = plain.complete(prompt, SamplingParams(temperature=0, **params), mix=mix, cache_prompt=False)
    b = spec.complete(prompt, SamplingParams(temperature=0, **params), mix=mix, cache_prompt=False)
    assert b.tokens == a.tokens
    assert b.content == a.content and b.stop_type == a.stop_type
    assert spec.stats()["draft_tokens"] > before, "nothing was drafted: the test proves nothing"


def test_logprobs_with_speculation_match(engines):
    plain, spec = engines
    prompt = plain.chat_prompt([{"role": "user", "content": "Repeat exactly: " + TEXT}])
    p = SamplingParams(temperature=0, n_predict=32, n_probs=2, ignore_eos=True)
    ea = [e for e in plain.generate(prompt, p, cache_prompt=False) if e.kind == "token"]
    eb = [e for e in spec.generate(prompt, p, cache_prompt=False) if e.kind == "token"]
    assert [e.token for e in ea] == [e.token for e in eb]
    for x, y in zip(ea, eb):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert y.logprob == pytest.approx(x.logprob, abs=1e-3)


def test_sampling_with_temperature_is_never_speculated(engines):
    _, spec = engines
    prompt = spec.chat_prompt([{"role": "user", "content": "Repeat exactly: " + TEXT}])
    before = spec.stats()["draft_tokens"]
    spec.complete(prompt, SamplingParams(temperature=0.7, seed=3, n_predict=24), cache_prompt=False)
    assert spec.stats()["draft_tokens"] == before


def test_drafts_that_keep_failing_back_off(engines, monkeypatch):
    """Every draft is wrong here: after each miss the sequence waits twice as long
    before drafting again, so a long reply pays for a handful of drafts, not one
    in five steps, and still equals plain decoding."""
    import core.serve.scheduler as sched

    plain, spec = engines
    bad = spec.config.vocab_size - 1  # a token greedy decoding never picks
    monkeypatch.setattr(sched, "prompt_lookup", lambda history, k: [bad] * k)
    prompt = plain.chat_prompt([{"role": "user", "content": "Tell me about the moon."}])
    p = SamplingParams(temperature=0, n_predict=64, ignore_eos=True)
    before = spec.stats()["draft_tokens"]
    b = spec.complete(prompt, p, cache_prompt=False)
    a = plain.complete(prompt, p, cache_prompt=False)
    assert b.tokens == a.tokens
    draft_steps = (spec.stats()["draft_tokens"] - before) // spec.scheduler.draft_max
    # waits of 4, 8, 16, 32 plain steps: 4-5 draft steps fit in 64 tokens (a fixed
    # 4-step wait would have drafted ~12 times)
    assert 3 <= draft_steps <= 5
