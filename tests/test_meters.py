"""Channel meters (core/lora/meter.py): on the real SmolLM2 with the reference adapters,
each adapter's meter is its own delta's size over the base products' size, measured
inside the forward; a metered engine sends ChannelMeter events while a reply streams,
only for the adapters the request's mix uses, at most every METER_INTERVAL_S, and a
meter follows the fader."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from core.lora.meter import METER_INTERVAL_S, MeteredDeltas
from core.lora.mix import mix_key
from core.lora.runtime import LoraDeltas
from core.model.deltas import Deltas
from core.model.llama import BatchItem
from core.serve.events import ChannelMeter, RequestFinished
from core.serve.sampling import SamplingParams
from tests.mixing import mix_weights
from tests.serving import running_engine


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir):
    ads = [ref_dir / "adapters" / f"{n}.gguf" for n in ("lora_attn", "lora_ffn", "lora_all_q8")]
    with running_engine(smollm_path, adapters=ads, ctx_size=256, n_parallel=2) as eng:
        yield eng


class Independent(Deltas):
    """The same forward's products measured another way: the base product from the
    model's own product (no delta), each adapter's delta as its one-adapter mix's
    product less that base; sums of squares for row ``row``."""

    def __init__(self, inner, row, singles):
        self.inner, self.row, self.singles = inner, row, singles
        self.delta_sq = dict.fromkeys(singles, 0.0)
        self.base_sq = 0.0

    def embed(self, x, tokens):
        self.inner.embed(x, tokens)

    def layer_out(self, x, li):
        self.inner.layer_out(x, li)

    def logits(self, logits, h, counts):
        self.inner.logits(logits, h, counts)

    def project(self, lin, x, w, li, target):
        y = self.inner.project(lin, x, w, li, target)
        xr = x[self.row : self.row + 1].copy()
        base = lin(xr, w)[0].astype(np.float64)  # (out,)
        self.base_sq += float(base @ base)
        for aid, d in self.singles.items():
            only = d.project(lin, xr, w, li, target)[0].astype(np.float64) - base
            self.delta_sq[aid] += float(only @ only)
        return y


def test_the_meter_is_each_adapters_delta_over_the_base_product(engine):
    ids = {a["name"]: a["id"] for a in engine.adapters()}
    mix = {ids["lora_attn"]: 0.8, ids["lora_ffn"]: -0.5}
    own = mix_weights(engine, mix)
    parts = engine.lora.meter_parts(mix_key(mix))
    assert set(parts) == set(mix)
    tokens = [1, 504, 3458, 282, 4109, 314]
    model = engine.model

    def run(wrap):
        cache = model.new_cache(16)
        model([BatchItem(np.array(tokens[:-1]), cache)], LoraDeltas([own], [(0, 5)]))
        item = BatchItem(np.array(tokens[-1:]), cache)  # one decode row
        d = wrap(LoraDeltas([own], [(0, 1)]))
        return model([item], d)[0], d

    singles = {
        aid: LoraDeltas([mw], [(0, 1)]) for aid, mw in parts.items()
    }  # each alone, on the same x
    lg_m, metered = run(lambda inner: MeteredDeltas(inner, 0, own, parts))
    lg_i, check = run(lambda inner: Independent(inner, 0, singles))
    np.testing.assert_array_equal(lg_m, lg_i)  # metering changes nothing
    got = metered.values()
    for aid in mix:
        want = np.sqrt(check.delta_sq[aid] / check.base_sq)
        # float32 products summed in float64: agreement to ~1e-8 here; leaving the
        # mix's own delta in the base would be off by ~4e-4
        assert got[aid] == pytest.approx(want, rel=1e-5), aid
        assert 1e-4 < got[aid] < 1.0


def collect(engine, mix, n_predict=24):
    """Generate under ``mix`` with meters on; the ChannelMeter events of that request,
    in order."""
    meters, done, req_id = [], threading.Event(), []

    def listen(ev):
        if isinstance(ev, ChannelMeter) and req_id and ev.id == req_id[0]:
            meters.append(ev)
        if isinstance(ev, RequestFinished) and req_id and ev.id == req_id[0]:
            done.set()

    unsubscribe = engine.subscribe(listen)
    try:
        req = engine.submit(
            [1, 504, 3458, 282, 4109, 314],
            SamplingParams(temperature=0.0, n_predict=n_predict),
            lambda ev: None,
            mix=mix,
        )
        req_id.append(req.id)
        assert done.wait(60)
    finally:
        unsubscribe()
    return meters


def test_a_metered_reply_sends_meters_for_its_adapters_that_follow_the_fader(engine):
    ids = {a["name"]: a["id"] for a in engine.adapters()}
    attn, ffn = ids["lora_attn"], ids["lora_ffn"]
    engine.meters = True
    try:
        full = collect(engine, {attn: 1.0, ffn: 0.0})
        half = collect(engine, {attn: 0.5, ffn: 0.0})
        none = collect(engine, {})  # the base model: nothing to meter
    finally:
        engine.meters = False
    assert full and half and not none
    assert all(set(ev.values) == {attn} for ev in full + half)  # a 0 scale is not in the mix
    # the first metered step is the first decode step of the same prompt: half the
    # scale, about half the delta (the activations differ a little under the two mixes)
    assert 0.35 < half[0].values[attn] / full[0].values[attn] < 0.65


def test_an_engine_without_meters_sends_none(engine):
    ids = {a["name"]: a["id"] for a in engine.adapters()}
    assert not engine.meters
    meters = collect(engine, {ids["lora_attn"]: 1.0})
    assert meters == []


def test_one_decoding_stream_is_metered_a_step_at_most_every_interval():
    """The scheduler's choice (Scheduler._metered), with the times given: a stream is
    due METER_INTERVAL_S after its last metered step, the longest-waiting first, never
    while its prompt runs or without meter parts, one a step."""
    from types import SimpleNamespace as NS

    from core.serve.scheduler import Scheduler

    def seq(at, parts=True, pending=(), weights=True):
        req = NS(
            meter_parts={0: object()} if parts else None,
            meter_vectors={},
            mix_weights=object() if weights else None,
        )
        return NS(req=req, metered_at=at, pending=list(pending))

    now = 100.0
    seqs = [seq(now - 0.05), seq(now - 0.5), seq(now - 0.2), seq(now - 9, parts=False)]
    assert Scheduler._metered(seqs, now) == 1  # the longest-waiting of those due
    assert Scheduler._metered(seqs[:1], now) is None  # metered 0.05 s ago: not yet
    assert Scheduler._metered([seq(now - 2 * METER_INTERVAL_S)], now) == 0
    assert Scheduler._metered([seq(0.0, pending=[5])], now) is None  # prompt running
    assert Scheduler._metered([seq(0.0, weights=False)], now) is None  # the base model


def test_a_vector_meter_is_what_it_adds_over_the_hidden_state_it_is_added_to(engine, ref_dir):
    """A control vector's meter: at each layer it steers, ‖s·v_l‖ against the block's
    output before the mix's vectors are added, summed over those layers; measured here
    from the vector file's own directions and the hidden states seen before the
    engine's hook steers them. Beside an adapter, both meters come from one forward."""
    from core.lora.mix import Mix

    ids = {a["name"]: a["id"] for a in engine.adapters()}
    from core.lora.control import load_control_vector

    a, b = ref_dir / "control_vectors" / "cv_a.gguf", ref_dir / "control_vectors" / "cv_b.gguf"
    va = engine.add_control_vector(a, scale=0.0)
    vb = engine.add_control_vector(b, scale=0.0)
    try:
        mix = Mix({ids["lora_attn"]: 0.8}, vectors={va: 0.7, vb: -1.2})
        key, own = engine.lora.built(mix)
        parts = engine.lora.meter_parts(key)
        vectors = engine.lora.meter_vectors(key)
        assert set(vectors) == {va, vb}
        lo, hi = key.layers
        dirs = {
            va: 0.7 * load_control_vector(a, engine.config).directions,
            vb: -1.2 * load_control_vector(b, engine.config).directions,
        }
        tokens = [1, 504, 3458, 282, 4109, 314]
        model = engine.model
        hidden = {}

        class Seen(Deltas):  # the block outputs before the mix's vectors
            def __init__(self, inner):
                self.inner = inner

            def embed(self, x, tokens):
                self.inner.embed(x, tokens)

            def project(self, lin, x, w, li, target):
                return self.inner.project(lin, x, w, li, target)

            def layer_out(self, x, li):
                hidden[li] = x[0].astype(np.float64).copy()
                self.inner.layer_out(x, li)

            def logits(self, logits, h, counts):
                self.inner.logits(logits, h, counts)

        def run(wrap):
            cache = model.new_cache(16)
            model([BatchItem(np.array(tokens[:-1]), cache)], LoraDeltas([own], [(0, 5)]))
            d = wrap(LoraDeltas([own], [(0, 1)]))
            return model([BatchItem(np.array(tokens[-1:]), cache)], d)[0], d

        lg_m, metered = run(lambda inner: MeteredDeltas(inner, 0, own, parts, vectors))
        lg_s, _ = run(Seen)
        np.testing.assert_array_equal(lg_m, lg_s)  # metering changes nothing
        got = metered.vector_values()
        for vid, d in dirs.items():
            steered = [li for li in range(max(lo, 0), min(hi + 1, len(d))) if d[li].any()]
            assert steered
            v_sq = sum(float(d[li].astype(np.float64) @ d[li]) for li in steered)
            h_sq = sum(float(hidden[li] @ hidden[li]) for li in steered)
            assert got[vid] == pytest.approx(np.sqrt(v_sq / h_sq), rel=1e-5), vid
            assert 1e-4 < got[vid] < 10.0
        assert set(metered.values()) == {ids["lora_attn"]}  # the adapter's, as before

        # a metered reply sends both kinds, and a vector alone is metered too
        engine.meters = True
        try:
            both = collect(engine, mix)
            alone = collect(engine, Mix({}, vectors={va: 0.7}))
            half = collect(engine, Mix({}, vectors={va: 0.35}))
        finally:
            engine.meters = False
        assert both and alone and half
        assert all(set(ev.vectors) == {va, vb} and set(ev.values) == {ids["lora_attn"]}
                   for ev in both)  # fmt: skip
        assert all(set(ev.vectors) == {va} and ev.values == {} for ev in alone)
        assert 0.35 < half[0].vectors[va] / alone[0].vectors[va] < 0.65
    finally:
        engine.remove_control_vector(va)
        engine.remove_control_vector(vb)
