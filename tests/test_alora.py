"""Activated LoRA (core/lora/alora.py) against llama-server's own run of it
(tests/data/llamacpp/smollm2_f32_alora.json, tools/record_alora.py): the reference
adapter lora_attn with SmolLM2's assistant header as its invocation tokens, on the
float32 SmolLM2 with a float32 KV cache. Off until the invocation, on from one token
before it, base model when the prompt never invokes it; the base's KV of the prompt
before the invocation is shared with base requests (cache_n); two aLoRAs in one mix
are refused as llama-server refuses them; the listing carries llama-server's fields."""

from __future__ import annotations

import json
import threading

import pytest

from core.errors import EngineError
from core.lora.alora import MULTIPLE, base_positions, invocation_start
from core.serve.sampling import SamplingParams
from tests.serving import running_engine


@pytest.fixture(scope="module")
def data(ref_dir) -> dict:
    return json.loads((ref_dir / "smollm2_f32_alora.json").read_text())


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir, data):
    ads = [ref_dir / "adapters" / data["adapter"], ref_dir / "adapters" / "lora_attn.gguf"]
    with running_engine(smollm_path, adapters=ads, ctx_size=256, n_parallel=1) as eng:
        yield eng


def run(engine, prompt, mix, n=16, cache_prompt=False):
    out, done = {}, threading.Event()

    def on_event(ev):
        if ev.kind == "done":
            out["done"] = ev
            done.set()

    engine.submit(
        list(prompt),
        SamplingParams(temperature=0.0, n_predict=n, ignore_eos=True),
        on_event,
        mix=mix,
        cache_prompt=cache_prompt,
    )
    assert done.wait(120)
    return out["done"]


def test_the_invocation_is_found_from_the_end_of_the_prompt():
    inv = [1, 520, 9531, 198]
    assert invocation_start([5, 1, 520, 9531, 198, 7], inv) == 1
    assert invocation_start([1, 520, 9531, 198, 3, 1, 520, 9531, 198], inv) == 5
    assert invocation_start([1, 520, 9531], inv) is None
    assert invocation_start([1, 520, 9531, 198], []) is None


def test_greedy_tokens_match_llama_servers_before_and_after_the_invocation(engine, data):
    alora = next(a["id"] for a in engine.adapters() if a.get("alora_invocation_tokens"))
    for case in data["cases"]:
        done = run(engine, case["prompt_tokens"], {alora: case["scale"]})
        assert done.tokens == case["tokens"], (case["case"], case["scale"])
    # the cases differ where they should: invoked at the end, the adapter changes the
    # reply; never invoked, the reply is the base model's
    by = {(c["case"], c["scale"]): c["tokens"] for c in data["cases"]}
    assert by[("invoked_at_end", 1.0)] != by[("invoked_at_end", 0.0)]
    assert by[("not_invoked", 1.0)] == by[("not_invoked", 0.0)]


def test_the_base_prefix_before_the_invocation_is_reused(engine, data):
    alora = next(a["id"] for a in engine.adapters() if a.get("alora_invocation_tokens"))
    r = data["reuse"]
    base = run(engine, r["base_prompt"], {}, cache_prompt=True)
    assert base.tokens == r["base_tokens"]
    then = run(engine, r["alora_prompt"], {alora: 1.0}, cache_prompt=True)
    assert then.tokens == r["alora_tokens"]
    # llama-server keeps the base's KV up to one token before the invocation
    assert then.timings.cache_n == r["alora_cache_n"] > 0
    # and an aLoRA's own run leaves that base prefix for the next request
    again = run(engine, r["alora_prompt"], {alora: 1.0}, cache_prompt=True)
    assert again.timings.cache_n == r["alora_cache_n"]
    assert again.tokens == r["alora_tokens"]


def test_two_aloras_in_one_mix_are_refused_and_a_plain_lora_beside_makes_it_plain(
    engine, data, ref_dir
):
    ids = {a["name"]: a["id"] for a in engine.adapters()}
    alora = next(a["id"] for a in engine.adapters() if a.get("alora_invocation_tokens"))
    plain = ids["lora_attn"]
    second = engine.add_adapter(ref_dir / "adapters" / data["adapter"], scale=0.0)
    try:
        prompt = data["cases"][0]["prompt_tokens"]
        with pytest.raises(EngineError, match=MULTIPLE) as e:
            run(engine, prompt, {alora: 1.0, second: 0.5})
        assert e.value.code == 400
        # with a plain LoRA beside it, llama-server runs the aLoRA as a plain LoRA
        # from the first token: the same as the plain adapter at twice the scale (the
        # two files hold the same weights)
        mixed = run(engine, data["cases"][-1]["prompt_tokens"], {alora: 0.5, plain: 0.5})
        doubled = run(engine, data["cases"][-1]["prompt_tokens"], {plain: 1.0})
        assert mixed.tokens == doubled.tokens
    finally:
        engine.remove_adapter(second)


def test_the_listing_names_the_invocation_as_llama_server_does(engine, data):
    entry = next(a for a in engine.adapters() if a.get("alora_invocation_tokens"))
    assert entry["alora_invocation_tokens"] == data["invocation_tokens"]
    assert entry["alora_invocation_string"] == "<|im_start|>assistant\n"
    plain = next(a for a in engine.adapters() if a["name"] == "lora_attn")
    assert "alora_invocation_tokens" not in plain


def test_base_positions_switch_one_token_before_the_invocation(engine, data):
    ad = engine.adapter(
        next(a["id"] for a in engine.adapters() if a.get("alora_invocation_tokens"))
    )
    prompt = data["reuse"]["alora_prompt"]
    assert base_positions(ad, prompt) == len(data["reuse"]["base_prompt"]) - 1
    assert base_positions(ad, data["reuse"]["base_prompt"]) is None


def test_control_vectors_steer_the_positions_before_the_invocation(engine, data, ref_dir):
    """llama-server's control vectors steer every position, so with a vector in the mix
    the positions before the invocation run under the vector alone: never invoked, the
    reply is the vector's alone; invoked, the prefix a vector-only request left in the
    prefix cache is reused, as the base's is without vectors. (It ran the aLoRA as a
    plain LoRA from the first token.)"""
    from core.lora.mix import Mix

    alora = next(a["id"] for a in engine.adapters() if a.get("alora_invocation_tokens"))
    vid = engine.add_control_vector(
        ref_dir.parents[2] / "resources" / "vectors" / "happy.gguf", scale=0.0
    )
    try:
        steer = {vid: 1.5}
        never = next(c for c in data["cases"] if c["case"] == "not_invoked")["prompt_tokens"]
        alone = run(engine, never, Mix({}, vectors=steer))
        assert alone.tokens != run(engine, never, {}).tokens  # the vector steers
        assert run(engine, never, Mix({alora: 1.0}, vectors=steer)).tokens == alone.tokens

        r = data["reuse"]
        run(engine, r["base_prompt"], Mix({}, vectors=steer), cache_prompt=True)
        then = run(engine, r["alora_prompt"], Mix({alora: 1.0}, vectors=steer), cache_prompt=True)
        assert then.timings.cache_n == r["alora_cache_n"]  # the vector's prefix, reused
        assert then.tokens != r["alora_tokens"]  # steered
        cold = run(engine, r["alora_prompt"], Mix({alora: 1.0}, vectors=steer))
        assert cold.timings.cache_n == 0 and cold.tokens == then.tokens
    finally:
        engine.remove_control_vector(vid)
