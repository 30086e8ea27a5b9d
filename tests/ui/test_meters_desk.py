"""The desk's channel meters (ui/meter.py): while a reply streams, the strip of each
adapter and control vector its mix uses shows the engine's meter readings
(core/lora/meter.py) and falls back to empty after it ends; an adapter the mix does not
use stays empty."""

from __future__ import annotations

import math

from core.serve.sampling import SamplingParams
from ui.meter import FLOOR, level_of


def test_the_meter_scale_is_log_from_a_tenth_of_a_percent_to_all():
    assert level_of(0.0) == 0.0 and level_of(FLOOR) == 0.0 and level_of(math.nan) == 0.0
    assert level_of(1.0) == 1.0 and level_of(5.0) == 1.0
    assert abs(level_of(0.01) - 1 / 3) < 1e-9  # 0.1% -> 1% is one of three decades
    assert level_of(0.01) < level_of(0.02) < level_of(0.1)


def test_a_streaming_reply_moves_the_meters_of_its_adapters_only(loaded, qtbot):
    w = loaded
    attn, q8 = w.ids["lora_attn"], w.ids["lora_all_q8"]
    assert w.engine.meters  # the desk turns them on
    readings = []
    w.bridge.channel_meter.connect(lambda ev: readings.append(dict(ev.values)))
    req = w.engine.submit(
        [1, 2, 3, 4],
        SamplingParams(temperature=0.0, n_predict=400),
        lambda ev: None,
        mix={attn: 1.0},
        source="http",
    )
    meter = w.mixer.strips[attn].meter
    # The engine thread posts a reading to the mixer's slot, then to the lambda above; the
    # GUI thread may run the first before the second is posted, so wait for both.
    qtbot.waitUntil(lambda: meter.level > 0.0 and bool(readings), timeout=20000)
    shown = meter.value
    assert "%" in meter.toolTip()
    assert w.mixer.strips[q8].meter.level == 0.0
    req.cancel()
    qtbot.waitUntil(lambda: meter.level == 0.0, timeout=5000)  # falls back once it ends
    # by now every reading posted has been delivered to both
    assert all(set(r) == {attn} for r in readings)
    assert shown in [r[attn] for r in readings]


def test_a_reply_under_a_control_vector_moves_the_vectors_meter(loaded, qtbot, ref_dir):
    from core.lora.mix import Mix
    from ui.desk import VecKey

    w = loaded
    attn = w.ids["lora_attn"]
    vid = w.engine.add_control_vector(ref_dir / "control_vectors" / "cv_a.gguf", 0.0)
    try:
        qtbot.waitUntil(lambda: VecKey(vid) in w.mixer.strips, timeout=5000)
        meter = w.mixer.strips[VecKey(vid)].meter
        req = w.engine.submit(
            [1, 2, 3, 4],
            SamplingParams(temperature=0.0, n_predict=400),
            lambda ev: None,
            mix=Mix({}, vectors={vid: 1.0}),
            source="http",
        )
        qtbot.waitUntil(lambda: meter.level > 0.0, timeout=20000)
        assert "%" in meter.toolTip()
        assert w.mixer.strips[attn].meter.level == 0.0  # not in the mix
        req.cancel()
        qtbot.waitUntil(lambda: meter.level == 0.0, timeout=5000)
    finally:
        w.engine.remove_control_vector(vid)
