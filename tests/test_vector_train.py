"""Making a control vector from examples (core/lora/vector_train.py): the direction
math on synthetic hidden states, the GGUF it writes read back by our loader, the
hidden states collected through the engine's own forward on the real SmolLM2,
cancel, and the --train-control-vector CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from core.gguf.reader import GGUFFile
from core.lora.control import ControlVectorError, load_control_vector, write_control_vector
from core.lora.vector_train import (
    MAX_EXAMPLES,
    MAX_PAIRS,
    MAX_TEXT_CHARS,
    TEMPLATES,
    TrainCancelled,
    VectorTrainError,
    direction,
    last_hidden,
    make_spec,
    train_on_engine,
)
from core.model.deltas import Deltas
from core.model.llama import BatchItem
from core.options import EngineOptions

REPO = Path(__file__).resolve().parents[1]
TINY = [{"positive": "Be happy.", "negative": "Be sad."}]


def synthetic(n=24, d=64, sep=3.0, seed=0):
    """pos/neg hidden states that differ along one known unit direction ``u`` by
    ``sep`` (plus noise), on top of a large shared, varying part."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    shared = rng.standard_normal((n, d)) * 5.0  # (n, d) what both sides of a pair share
    noise = rng.standard_normal((2, n, d)) * 0.3
    pos = shared + noise[0] + sep / 2 * u  # (n, d)
    neg = shared + noise[1] - sep / 2 * u  # (n, d)
    return pos.astype(np.float32), neg.astype(np.float32), u


@pytest.mark.parametrize("method", ["pca", "mean"])
def test_direction_recovers_a_known_direction_oriented_to_the_positive_side(method):
    pos, neg, u = synthetic()
    v = direction(pos, neg, method)
    cos = float(v @ u) / float(np.linalg.norm(v))
    assert cos > 0.95  # the right direction, and the positive side's sign
    # as long as the mean separation along it (3.0, the noise shifts it a little)
    assert np.linalg.norm(v) == pytest.approx(3.0, rel=0.1)
    # swapping the sides flips it: the sign follows "positive", not the SVD's whim
    w = direction(neg, pos, method)
    np.testing.assert_allclose(w, -v, atol=1e-4)


def test_direction_of_sides_that_do_not_differ_is_zero():
    pos, _, _ = synthetic()
    assert not direction(pos, pos.copy(), "pca").any()
    assert not direction(pos, pos.copy(), "mean").any()


def test_pca_follows_the_majority_when_the_mean_is_misleading():
    """repeng's vote: most pairs project higher on the positive side, even when one
    outlier pair pulls the mean difference the other way."""
    pos, neg, u = synthetic(n=9, sep=1.0, seed=3)
    pos[0] -= 40 * u.astype(np.float32)  # one outlier, far on the negative side
    v = direction(pos, neg, "pca")
    higher = (pos - neg) @ v
    assert np.mean(higher > 0) > 0.5


def test_written_vector_round_trips_through_our_loader(smollm_cfg, tmp_path):
    rng = np.random.default_rng(5)
    dirs = {n: rng.standard_normal(smollm_cfg.dim).astype(np.float32) for n in (1, 7, 29)}
    path = write_control_vector(tmp_path / "v.gguf", dirs, model_hint="llama")
    cv = load_control_vector(path, smollm_cfg)
    assert cv.layers == (1, 7, 29) and cv.model_hint == "llama"
    for n, v in dirs.items():
        np.testing.assert_array_equal(cv.directions[n], v)
    gf = GGUFFile(path)
    assert gf.get("general.architecture") == "controlvector"
    assert gf.get("controlvector.layer_count") == 3
    gf.close()
    assert [p.name for p in tmp_path.iterdir()] == ["v.gguf"]  # no temporary left
    with pytest.raises(ControlVectorError, match="layers 1 and up"):
        write_control_vector(tmp_path / "w.gguf", {0: dirs[1]})
    assert not (tmp_path / "w.gguf").exists()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(), "no pairs"),
        (dict(pairs=[]), "no pairs"),
        (dict(pairs=[{"positive": "", "negative": "x"}]), r"pairs\[0\].positive must not be empty"),
        (dict(pairs=[{"positive": "a", "negative": "  "}]), "negative must not be empty"),
        (dict(pairs=[{"positive": "a", "negative": 3}]), "must be a string"),
        (dict(pairs=[{"positive": "a", "negative": "b", "x": 1}]), "unknown field"),
        (dict(pairs=["ab"]), r"pairs\[0\] must be"),
        (dict(pairs=TINY * (MAX_PAIRS + 1)), f"at most {MAX_PAIRS}"),
        (dict(pairs=[{"positive": "a" * (MAX_TEXT_CHARS + 1), "negative": "b"}]), "characters"),
        (dict(pairs=TINY * 40, suffixes=["s"] * 40), f"at most {MAX_EXAMPLES}"),
        (dict(pairs=TINY, method="svd"), "method must be one of pca, mean"),
        (dict(template="angry-calm"), "template must be one of"),
        (dict(pairs=TINY, suffixes=[]), "suffixes must be a non-empty list"),
        (dict(pairs=TINY, layers=[0, 3]), "layers must be"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(kw, match):
    with pytest.raises(VectorTrainError, match=match):
        make_spec(**kw)


def test_templates_make_specs():
    for name, t in TEMPLATES.items():
        spec = make_spec(template=name)
        assert spec.pairs == t.pairs and spec.n_examples <= MAX_EXAMPLES


@pytest.fixture(scope="module")
def engine(smollm_path):
    from core.serve.engine import Engine

    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=256))
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def smollm_cfg(smollm_path):
    from core.model.weights import open_model_file

    return open_model_file(smollm_path)[1]


class Every(Deltas):
    def __init__(self):
        self.seen = {}

    def layer_out(self, x, li):
        self.seen[li] = x.copy()


def test_collected_states_are_each_blocks_output_at_the_last_token(engine):
    """last_hidden batches two prompts in one forward and keeps, per block, the row of
    each one's last token: the same numbers a forward of that prompt alone gives."""
    a, b = engine.tokenizer.encode("I am so happy"), engine.tokenizer.encode("Sad, sad day, alas")
    got = engine.run_on_engine(lambda m: last_hidden(m, [a, b])).result()
    assert got.shape == (engine.config.n_layers, 2, engine.config.dim)
    for k, toks in enumerate((a, b)):
        rec = Every()
        item = BatchItem(np.array(toks), engine.model.new_cache(len(toks)), hidden=True)
        engine.run_on_engine(lambda m, item=item, rec=rec: m([item], rec)).result()
        want = np.stack([rec.seen[li][-1] for li in range(engine.config.n_layers)])
        np.testing.assert_allclose(got[:, k], want, atol=2e-3)


def test_train_on_engine_writes_a_vector_that_loads_and_cancel_writes_nothing(engine, tmp_path):
    spec = make_spec(TINY, suffixes=["", "Today"], method="mean", layers=[3, 9])
    seen = []
    path = train_on_engine(engine, spec, tmp_path / "tiny.gguf", lambda i, n: seen.append((i, n)))
    assert seen == [(1, 2), (2, 2)]
    cv = load_control_vector(path, engine.config)
    assert cv.layers == tuple(range(3, 10)) and cv.model_hint == "llama"
    assert np.all(np.linalg.norm(cv.directions[3:10], axis=1) > 0)
    # Cancel after the first example: TrainCancelled, no file
    stop = threading.Event()
    with pytest.raises(TrainCancelled):
        train_on_engine(
            engine, spec, tmp_path / "never.gguf", lambda i, n: stop.set(), cancel=stop.is_set
        )
    assert not (tmp_path / "never.gguf").exists()


def test_cli_makes_a_vector_and_refuses_a_bad_file(smollm_path, smollm_cfg, tmp_path):
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps({"pairs": TINY, "suffixes": [""], "layers": [1, 4]}))
    out = tmp_path / "cli.gguf"
    r = subprocess.run(
        [sys.executable, "main.py", "-m", str(smollm_path), "--train-control-vector",
         str(pairs), "--out", str(out), "--cv-method", "mean"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "1/1 examples" in r.stderr and f"wrote {out}" in r.stderr
    assert load_control_vector(out, smollm_cfg).layers == (1, 2, 3, 4)
    pairs.write_text(json.dumps({"pairs": [{"positive": "", "negative": "x"}]}))
    r = subprocess.run(
        [sys.executable, "main.py", "-m", str(smollm_path), "--train-control-vector",
         str(pairs), "--out", str(tmp_path / "bad.gguf")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 1 and "positive must not be empty" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "bad.gguf").exists()


def test_out_and_method_without_training_are_refused(capsys):
    from core.cli import parse_args

    for argv in (["--out", "x.gguf"], ["--cv-method", "mean"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "are for --train-control-vector" in capsys.readouterr().err
    args = parse_args(["--train-control-vector", "happy-sad", "--out", "h.gguf"])
    assert (args.train_control_vector, args.out, args.cv_method) == ("happy-sad", "h.gguf", None)


def test_read_request_takes_a_template_a_list_or_an_object(tmp_path):
    from core.train_cli import read_request

    assert read_request("happy-sad", "mean") == {"template": "happy-sad", "method": "mean"}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(TINY))
    assert read_request(str(f), None) == {"pairs": TINY}
    f.write_text(json.dumps({"pairs": TINY, "lr": 3}))
    with pytest.raises(VectorTrainError, match="unknown field 'lr'"):
        read_request(str(f), None)
    f.write_text("{not json")
    with pytest.raises(VectorTrainError, match="not JSON"):
        read_request(str(f), None)
    with pytest.raises(VectorTrainError, match="neither a file nor a template"):
        read_request(str(tmp_path / "missing.json"), None)


def test_a_model_swapped_mid_run_stops_the_run(engine, tmp_path):
    """A model loaded while a vector is made would mix two models' hidden states: the
    run stops with a clear error and writes nothing."""
    spec = make_spec(TINY, suffixes=["", "Today"], layers=[1, 2])
    real = engine.model

    def swap(i, n):
        engine.model = object()  # what a reload does to the engine's model, in effect

    try:
        with pytest.raises(VectorTrainError, match="model changed"):
            train_on_engine(engine, spec, tmp_path / "mixed.gguf", swap)
    finally:
        engine.model = real
    assert not (tmp_path / "mixed.gguf").exists()
