"""A mix's control vectors exported beside its LoRA export (issue 37, item 5): one
llama.cpp control-vector file whose directions are the mix's summed, scaled vectors
over its layer range, so that loading it at scale 1 with no range steers exactly as
the mix did; nothing steered is a clear error, and a merged model says it cannot hold
them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.lora.control import load_control_vector
from core.lora.export import CANNOT_FOLD, ExportError, export_control_vector, vector_path
from core.lora.mix import Mix
from core.model.llama import BatchItem
from core.options import EngineOptions
from tests.mixing import forward


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir):
    from core.serve.engine import Engine

    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256), start=False)
    d = ref_dir / "control_vectors"
    eng.vids = {n: eng.add_control_vector(d / n, 0.0) for n in ("cv_a.gguf", "cv_b.gguf")}
    yield eng


def logits(eng, mix, tokens):
    _, mw = eng.lora.built(mix)
    item = BatchItem(np.array(tokens), eng.model.new_cache(64), all_logits=True)
    return forward(eng.model, [item], [mw])[0]


def test_the_exported_vector_steers_as_the_mix_did(engine, tmp_path, ref_dir):
    a, b = engine.vids["cv_a.gguf"], engine.vids["cv_b.gguf"]
    engine.set_control_vector_range(6, 21)
    engine.set_control_vectors({a: 0.6, b: -1.1})
    pairs, layers = engine.steering()
    assert [s for _, s in pairs] == [0.6, -1.1] and layers == (6, 21)
    out = export_control_vector(engine.config, pairs, layers, tmp_path / "mix.cvec.gguf")
    back = load_control_vector(out.path, engine.config)
    assert set(back.layers) <= set(range(6, 22))  # nothing outside the range
    tokens = json.loads((ref_dir / "smollm2_f32_control_vectors.json").read_text())["greedy"][0][
        "prompt_tokens"
    ]
    want = logits(engine, Mix({}, vectors={a: 0.6, b: -1.1}), tokens)
    engine.set_control_vector_range(-1, -1)  # llama.cpp's default: every layer
    engine.set_control_vectors({a: 0.0, b: 0.0})
    c = engine.add_control_vector(out.path, 1.0)
    try:
        got = logits(engine, Mix({}, vectors={c: 1.0}), tokens)
    finally:
        engine.remove_control_vector(c)
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert np.abs(want - logits(engine, Mix({}, vectors={}), tokens)).max() > 0.1


def test_nothing_steered_is_a_clear_error(engine, tmp_path):
    a = engine.vids["cv_a.gguf"]
    engine.set_control_vectors({a: 1.0})
    (vec, _), *_ = engine.steering()[0]
    engine.set_control_vectors({a: 0.0})
    assert engine.steering()[0] == []
    with pytest.raises(ExportError, match="no control vector"):
        export_control_vector(engine.config, [(vec, 0.0)], (1, 29), tmp_path / "x.cvec.gguf")
    assert not (tmp_path / "x.cvec.gguf").exists()


def test_the_vector_file_is_named_after_the_export():
    assert vector_path("/x/mix.gguf").name == "mix.cvec.gguf"
    assert vector_path("/x/merged-f16.gguf").name == "merged-f16.cvec.gguf"
    assert vector_path("/x/peft-folder").name == "peft-folder.cvec.gguf"
    assert "not folded" in CANNOT_FOLD
