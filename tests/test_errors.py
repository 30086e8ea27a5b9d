"""Bad model files and overflowing prompts give one clear error naming the file and
the problem: as exceptions in core, and as one line (no traceback) from the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from core.model.weights import ModelLoadError
from core.options import EngineOptions
from core.serve.engine import Engine, EngineError
from core.serve.sampling import SamplingParams
from tests.reference import reference_dir
from tests.tiny_gguf import write_tiny_llama

REPO = Path(__file__).resolve().parents[1]


def _truncated(tmp_path, smollm_path):
    p = tmp_path / "truncated.gguf"
    with open(smollm_path, "rb") as f:
        p.write_bytes(f.read(50_000_000))
    return p, "truncated"


def _bad_magic(tmp_path, smollm_path):
    p = tmp_path / "bad_magic.gguf"
    p.write_bytes(b"GGML" + b"\0" * 100)
    return p, "not a GGUF file"


def _header_only(tmp_path, smollm_path):
    p = tmp_path / "header_only.gguf"
    with open(smollm_path, "rb") as f:
        p.write_bytes(f.read(1000))  # cut inside the metadata
    return p, "truncated or corrupt"


def _wrong_arch(tmp_path, smollm_path):
    return write_tiny_llama(
        tmp_path / "gpt2ish.gguf", arch="gpt2"
    ), "unsupported architecture 'gpt2'"


def _unknown_quant(tmp_path, smollm_path):
    p = write_tiny_llama(tmp_path / "q.gguf", qtype=GGMLQuantizationType.Q8_0, dim=64)
    data = bytearray(p.read_bytes())
    # find the type field of the first quantized tensor info and set an unknown type id
    name = b"blk.0.attn_q.weight"
    i = data.index(name) + len(name)
    n_dims = int.from_bytes(data[i : i + 4], "little")
    t = i + 4 + 8 * n_dims
    data[t : t + 4] = (250).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    return p, "unknown type id 250"


def _adapter_as_model(tmp_path, smollm_path):
    return reference_dir() / "adapters" / "lora_attn.gguf", "LoRA adapter, not a base model"


CASES = [_truncated, _bad_magic, _header_only, _wrong_arch, _unknown_quant, _adapter_as_model]


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.strip("_"))
def test_bad_model_raises_clear_error(tmp_path, smollm_path, make):
    path, expect = make(tmp_path, smollm_path)
    eng = Engine()
    with pytest.raises(ModelLoadError) as ei:
        eng.load_model(path)
    msg = str(ei.value)
    assert expect in msg
    assert path.name in msg
    assert not eng.ready


@pytest.mark.parametrize("make", [_truncated, _wrong_arch], ids=["truncated", "wrong_arch"])
def test_cli_reports_one_line_without_traceback(tmp_path, smollm_path, make):
    path, expect = make(tmp_path, smollm_path)
    r = subprocess.run(
        [sys.executable, "main.py", "-m", str(path), "-p", "hi", "-n", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("mixdesk: error: ") and expect in lines[-1]


def test_failed_load_keeps_previous_model(tmp_path, smollm_path):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=64))
    try:
        with pytest.raises(ModelLoadError):
            eng.load_model(_bad_magic(tmp_path, smollm_path)[0])
        assert eng.ready and eng.path == Path(smollm_path)
        done = eng.complete([1, 2, 3], SamplingParams(temperature=0, n_predict=2, ignore_eos=True))
        assert len(done.tokens) == 2
    finally:
        eng.stop()


def test_context_overflow_is_a_clear_error(smollm_path):
    eng = Engine.from_path(smollm_path, EngineOptions(ctx_size=32))
    try:
        with pytest.raises(EngineError) as ei:
            eng.complete(list(range(100, 140)), SamplingParams(n_predict=4))
        assert ei.value.type == "exceed_context_size_error"
        assert "40 tokens" in str(ei.value) and "32" in str(ei.value)
        # a generation that reaches the end of the context stops with "limit"
        done = eng.complete(
            list(range(100, 120)), SamplingParams(temperature=0, n_predict=100, ignore_eos=True)
        )
        assert done.stop_type == "limit" and 20 + len(done.tokens) <= 32
    finally:
        eng.stop()
