"""Hostile model and adapter files (corrupt, adversarial or merely absurd) are refused
at load with one clear UserError naming the key or the file: never a hang, a huge
allocation, another exception type, or a message that echoes the file's bytes.

Every hostile file is written here, into tmp_path, by the test that uses it.
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as T

from core.errors import UserError
from core.gguf.reader import GGUFError, GGUFFile
from core.lora.adapter import AdapterError, load_adapter
from core.model.config import ModelConfigError
from core.model.weights import ModelLoadError, load_weights, open_model_file
from core.serve.engine import Engine
from tests.tiny_gguf import write_lora_gguf, write_tiny_llama, write_tiny_peft

REPO = Path(__file__).resolve().parents[1]
DIM, N_HEADS, N_KV, FFN, VOCAB = 64, 4, 2, 96, 300  # write_tiny_llama's defaults
BYTES_REPR = re.compile(r"(?:^|[\s(=,:])b['\"]|\\x[0-9a-f]{2}")  # b'..' or an escaped byte


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXDESK_CACHE", str(tmp_path / "cache"))


def bounded(fn, *args, timeout: float = 60.0):
    """Run fn(*args) in a daemon thread; the test fails (instead of hanging) if it
    has not returned after ``timeout`` s. Returns the exception it raised, or None."""
    out: dict = {}

    def run():
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {timeout} s"
    return out.get("error")


def load_model_error(path: Path) -> UserError:
    """The UserError loading ``path`` as a model gives, through the engine's own path."""

    def load():
        eng = Engine()
        try:
            eng.load_model(path)
        finally:
            eng.stop()

    err = bounded(load)
    assert err is not None, f"{path.name} loaded"
    assert isinstance(err, ModelLoadError), f"{type(err).__name__}: {err}"
    assert_clean_message(str(err))
    return err


def assert_clean_message(msg: str) -> None:
    """One line, no Python bytes repr, no absurd 20-digit numbers."""
    assert "\n" not in msg
    assert not BYTES_REPR.search(msg), msg
    assert not re.search(r"\d{16,}", msg), msg
    assert len(msg) < 400, msg


def tiny_cfg(tmp_path):
    return open_model_file(write_tiny_llama(tmp_path / "base.gguf"))[1]


def adapter_error(path: Path, cfg) -> AdapterError:
    err = bounded(load_adapter, path, cfg)
    assert err is not None, f"{path.name} loaded"
    assert isinstance(err, AdapterError), f"{type(err).__name__}: {err}"
    assert_clean_message(str(err))
    return err


# ---- hostile but well-formed hyper-parameters (item 5) ----------------------------------

HYPER = {
    "rope_freq_base_nan": ("llama.rope.freq_base", (math.nan, T.FLOAT32)),
    "rope_freq_base_inf": ("llama.rope.freq_base", (math.inf, T.FLOAT32)),
    "rope_freq_base_zero": ("llama.rope.freq_base", (0.0, T.FLOAT32)),
    "rms_eps_negative": ("llama.attention.layer_norm_rms_epsilon", (-1.0, T.FLOAT32)),
    "rms_eps_nan": ("llama.attention.layer_norm_rms_epsilon", (math.nan, T.FLOAT32)),
    "rope_scale_nan": ("llama.rope.scaling.factor", (math.nan, T.FLOAT32)),
    "head_count_zero": ("llama.attention.head_count", (0, T.UINT32)),
    "head_count_kv_zero": ("llama.attention.head_count_kv", (0, T.UINT32)),
    "key_length_zero": ("llama.attention.key_length", (0, T.UINT32)),
    "embedding_length_zero": ("llama.embedding_length", (0, T.UINT32)),
    "block_count_zero": ("llama.block_count", (0, T.UINT32)),
    "context_length_zero": ("llama.context_length", (0, T.UINT32)),
    "context_length_huge": ("llama.context_length", (2**62, T.UINT64)),
    "embedding_length_array": ("llama.embedding_length", ([64, 64], T.ARRAY)),
    "block_count_string": ("llama.block_count", ("2", T.STRING)),
    "block_count_float": ("llama.block_count", (2.5, T.FLOAT32)),
    "block_count_bool": ("llama.block_count", (True, T.BOOL)),
    "freq_base_string": ("llama.rope.freq_base", ("1e4", T.STRING)),
    "file_type_array": ("general.file_type", ([1, 2], T.ARRAY)),
    "architecture_array": ("general.architecture", ([1, 2], T.ARRAY)),
    "general_type_array": ("general.type", ([1, 2], T.ARRAY)),
    "scaling_type_array": ("llama.rope.scaling.type", ([1, 2], T.ARRAY)),
}


@pytest.mark.parametrize("case", HYPER, ids=str)
def test_hostile_hyper_parameter_is_refused_naming_the_key(tmp_path, cache_home, case):
    key, value = HYPER[case]
    kv = {key: value}
    if key == "llama.rope.scaling.factor":
        kv["llama.rope.scaling.type"] = ("linear", T.STRING)
    path = write_tiny_llama(tmp_path / f"{case}.gguf", kv=kv)
    err = load_model_error(path)
    assert key in str(err) and path.name in str(err)


# ---- shapes that would hang or allocate terabytes (item 6) ------------------------------

HUGE = {
    "block_count_1e9": ("llama.block_count", (10**9, T.UINT32)),
    "block_count_2e64": ("llama.block_count", (2**64 - 1, T.UINT64)),
    "ffn_2e31": ("llama.feed_forward_length", (2**31, T.UINT32)),
    "vocab_2e31": ("llama.vocab_size", (2**31, T.UINT32)),
    "embedding_2e31": ("llama.embedding_length", (2**31, T.UINT32)),
    "head_count_kv_more": ("llama.attention.head_count_kv", (8, T.UINT32)),
    "key_length_2e20": ("llama.attention.key_length", (2**20, T.UINT32)),
}


@pytest.mark.parametrize("case", HUGE, ids=str)
def test_declared_shapes_are_checked_against_the_tensors(tmp_path, cache_home, case):
    key, value = HUGE[case]
    path = write_tiny_llama(tmp_path / f"{case}.gguf", kv={key: value})
    err = load_model_error(path)
    assert key in str(err) and path.name in str(err)


def test_missing_block_tensor_is_named_before_any_allocation(tmp_path, cache_home):
    # the file has blocks 0 and 1; block_count says 3
    path = write_tiny_llama(tmp_path / "three.gguf", kv={"llama.block_count": (3, T.UINT32)})
    err = load_model_error(path)
    assert "blk.2." in str(err) and "llama.block_count" in str(err)


def test_load_weights_checks_every_tensor_before_allocating(tmp_path, cache_home):
    # the config matches the metadata, but one tensor has the wrong shape: the
    # check happens before the (possibly huge) float32 buffer is allocated
    path = write_tiny_llama(tmp_path / "m.gguf", ffn=96)
    gf, cfg = open_model_file(path)
    from dataclasses import replace

    big = replace(cfg, ffn_dim=2**31)
    err = bounded(load_weights, gf, big)
    assert isinstance(err, ModelLoadError), f"{type(err).__name__}: {err}"
    assert "ffn_gate" in str(err) and "feed_forward_length" in str(err)


@pytest.mark.parametrize("alignment", [0, 3, 2**40])
def test_bad_alignment_is_refused(tmp_path, alignment):
    path = write_tiny_llama(
        tmp_path / "align.gguf", kv={"general.alignment": (alignment, T.UINT64)}
    )
    err = load_model_error(path)
    assert "general.alignment" in str(err)


def test_alignment_of_wrong_type_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "align.gguf", kv={"general.alignment": ("32", T.STRING)})
    assert "general.alignment" in str(load_model_error(path))


# ---- raw GGUF bytes -----------------------------------------------------------------------


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def raw_gguf(kv: list[bytes], n_tensors: int = 0, tail: bytes = b"") -> bytes:
    """A GGUF v3 header with pre-encoded key/value records."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kv)) + b"".join(kv) + tail


def test_deeply_nested_metadata_is_refused(tmp_path):
    depth = 1000
    value = struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(depth))
    value += struct.pack("<IQ", 0, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(raw_gguf([_gguf_string(b"deep.key") + value]))
    err = load_model_error(path)
    assert "deep.key" in str(err) and "nested" in str(err)
    assert isinstance(bounded(GGUFFile, path), GGUFError)


def test_bad_magic_does_not_echo_file_content(tmp_path):
    path = tmp_path / "shadow.gguf"
    path.write_bytes(b"root:$6$secret:19000:0:99999:7:::\n" * 4)
    err = load_model_error(path)
    assert "not a GGUF file" in str(err) and "root" not in str(err)


@pytest.mark.parametrize(
    "name,blob",
    [
        ("huge_string", raw_gguf([struct.pack("<Q", 17217572901099579928)])),
        ("huge_array", raw_gguf([_gguf_string(b"k") + struct.pack("<IIQ", 9, 4, 2**61)])),
        (
            "huge_string_array",
            raw_gguf([_gguf_string(b"k") + struct.pack("<IIQ", 9, 8, 2**62)]),
        ),
        (
            "huge_nested_array",
            raw_gguf([_gguf_string(b"k") + struct.pack("<IIQ", 9, 9, 2**62)]),
        ),
        ("many_keys", b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63) + b"\0" * 64),
        (
            "tensor_beyond_eof",
            raw_gguf(
                [],
                n_tensors=1,
                tail=_gguf_string(b"t") + struct.pack("<IQQIQ", 2, 32, 32, 0, 2**62),
            ),
        ),
        (
            "tensor_huge_dims",
            raw_gguf(
                [],
                n_tensors=1,
                tail=_gguf_string(b"t") + struct.pack("<IQQIQ", 2, 2**62, 2**62, 0, 0),
            ),
        ),
        (
            "duplicate_tensor",
            raw_gguf(
                [],
                n_tensors=2,
                tail=(_gguf_string(b"t") + struct.pack("<IQIQ", 1, 8, 0, 0)) * 2 + b"\0" * 96,
            ),
        ),
        (
            "misaligned_tensor",
            raw_gguf(
                [],
                n_tensors=1,
                tail=_gguf_string(b"t") + struct.pack("<IQIQ", 1, 8, 0, 3) + b"\0" * 96,
            ),
        ),
    ],
)
def test_corrupt_header_is_a_short_clean_error(tmp_path, name, blob):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(blob + b"\0" * 64)
    err = bounded(GGUFFile, path)
    assert isinstance(err, GGUFError), f"{type(err).__name__}: {err}"
    assert_clean_message(str(err))
    assert path.name in str(err) and "not a valid GGUF file" in str(err)


def test_truncated_metadata_says_not_a_valid_gguf(tmp_path):
    path = write_tiny_llama(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:300])
    err = load_model_error(path)
    assert "cut.gguf is not a valid GGUF file: it is truncated or corrupt" in str(err)


# ---- tokenizer metadata of the wrong type -----------------------------------------------


def _gpt2_vocab():
    toks = ["a", "b", "ab", "<|endoftext|>"] + [f"t{i}" for i in range(VOCAB - 4)]
    return {
        "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.pre": ("gpt2", T.STRING),
        "tokenizer.ggml.tokens": (toks, T.ARRAY),
        "tokenizer.ggml.scores": None,
        "tokenizer.ggml.token_type": ([1] * VOCAB, T.ARRAY),
        "tokenizer.ggml.merges": (["a b"], T.ARRAY),
    }


TOKENIZER = {
    "merges_uint32": ("tokenizer.ggml.merges", ([1, 2, 3], T.ARRAY)),
    "merges_string": ("tokenizer.ggml.merges", ("a b", T.STRING)),
    "tokens_uint32": ("tokenizer.ggml.tokens", (list(range(VOCAB)), T.ARRAY)),
    "tokens_string": ("tokenizer.ggml.tokens", ("abc", T.STRING)),
    "token_type_strings": ("tokenizer.ggml.token_type", (["x"] * VOCAB, T.ARRAY)),
    "scores_strings": ("tokenizer.ggml.scores", (["x"] * VOCAB, T.ARRAY)),
    "bos_id_string": ("tokenizer.ggml.bos_token_id", ("1", T.STRING)),
    "bos_id_array": ("tokenizer.ggml.bos_token_id", ([1, 2], T.ARRAY)),
    "model_array": ("tokenizer.ggml.model", ([1, 2], T.ARRAY)),
    "pre_array": ("tokenizer.ggml.pre", ([1, 2], T.ARRAY)),
}


@pytest.mark.parametrize("case", TOKENIZER, ids=str)
def test_tokenizer_metadata_of_the_wrong_type_is_refused(tmp_path, cache_home, case):
    key, value = TOKENIZER[case]
    kv = _gpt2_vocab() if case in ("merges_uint32", "merges_string", "pre_array") else {}
    kv[key] = value
    path = write_tiny_llama(tmp_path / f"{case}.gguf", kv=kv)
    err = load_model_error(path)
    assert key in str(err) and path.name in str(err)


# ---- not a regular file (item 4) ----------------------------------------------------------


def _unblock(fifo: Path) -> None:
    """If a reader is stuck in open() on the FIFO, let it through."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe.gguf"
    os.mkfifo(p)
    yield p
    _unblock(p)


def test_fifo_model_is_refused_without_blocking(fifo):
    err = load_model_error(fifo)
    assert "pipe.gguf" in str(err) and "not a regular file" in str(err)


def test_directory_and_device_models_are_refused(tmp_path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    assert "not a regular file" in str(load_model_error(d))
    if Path("/dev/null").exists():
        assert "not a regular file" in str(load_model_error(Path("/dev/null")))


def test_fifo_adapter_is_refused_without_blocking(tmp_path, fifo):
    err = adapter_error(fifo, tiny_cfg(tmp_path))
    assert "pipe.gguf" in str(err) and "not a regular file" in str(err)


@pytest.mark.parametrize("member", ["adapter_config.json", "adapter_model.safetensors"])
def test_fifo_inside_a_peft_folder_is_refused(tmp_path, member):
    folder = write_tiny_peft(tmp_path / "peft")
    (folder / member).unlink()
    os.mkfifo(folder / member)
    try:
        err = adapter_error(folder, tiny_cfg(tmp_path))
        assert member in str(err) and "not a regular file" in str(err)
    finally:
        _unblock(folder / member)


def test_peft_member_that_is_a_directory_is_refused(tmp_path):
    folder = write_tiny_peft(tmp_path / "peft")
    (folder / "adapter_config.json").unlink()
    (folder / "adapter_config.json").mkdir()
    err = adapter_error(folder, tiny_cfg(tmp_path))
    assert "adapter_config.json" in str(err) and "not a regular file" in str(err)


def test_socket_is_refused(tmp_path):
    import socket

    path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert "not a regular file" in str(load_model_error(path))


# ---- adapters (items 3 and 5) -------------------------------------------------------------


def _pair(rank_a: int, rank_b: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((rank_a, DIM)).astype(np.float32) * 0.1,  # (rank, in)
        rng.standard_normal((DIM, rank_b)).astype(np.float32) * 0.1,  # (q_dim, rank)
    )


def test_rank_zero_adapter_is_refused(tmp_path):
    a, b = _pair(0, 0)
    path = write_lora_gguf(
        tmp_path / "rank0.gguf",
        {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
        {"adapter.lora.alpha": 8.0},
    )
    err = adapter_error(path, tiny_cfg(tmp_path))
    assert "blk.0.attn_q.weight" in str(err) and "rank 0" in str(err)


def test_rank_zero_peft_adapter_is_refused(tmp_path):
    folder = write_tiny_peft(tmp_path / "peft0", rank=0, config={"r": 0, "lora_alpha": 8})
    err = adapter_error(folder, tiny_cfg(tmp_path))
    assert "r" in str(err) and "adapter_config.json" in str(err)


def test_mismatched_ranks_are_refused(tmp_path):
    a, b = _pair(4, 2)
    path = write_lora_gguf(
        tmp_path / "mismatch.gguf",
        {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
    )
    err = adapter_error(path, tiny_cfg(tmp_path))
    assert "blk.0.attn_q.weight" in str(err)


@pytest.mark.parametrize("which", ["a", "b"])
def test_unpaired_lora_tensor_is_refused(tmp_path, which):
    a, b = _pair(4, 4)
    t = {"a": a, "b": b}[which]
    path = write_lora_gguf(tmp_path / "half.gguf", {f"blk.0.attn_q.weight.lora_{which}": t})
    err = adapter_error(path, tiny_cfg(tmp_path))
    assert "blk.0.attn_q.weight" in str(err) and "lora_" in str(err)


def test_rank_zero_adapter_does_not_register_in_the_engine(tmp_path, cache_home):
    eng = Engine()
    eng.load_model(write_tiny_llama(tmp_path / "base.gguf"))
    try:
        a, b = _pair(0, 0)
        path = write_lora_gguf(
            tmp_path / "rank0.gguf",
            {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b},
        )
        with pytest.raises(AdapterError):
            eng.add_adapter(path, scale=1.0)
        assert eng.adapters() == []
    finally:
        eng.stop()


ALPHAS = {
    "nan": (math.nan, T.FLOAT32),
    "inf": (math.inf, T.FLOAT32),
    "minus_inf": (-math.inf, T.FLOAT32),
    "3e38": (3e38, T.FLOAT32),
    "string": ("8", T.STRING),
    "array": ([8.0, 8.0], T.ARRAY),
}


def _write_adapter_kv(path: Path, kv: dict) -> Path:
    """A valid rank-4 adapter on blk.0.attn_q with hostile metadata values."""
    from gguf import GGUFWriter
    from gguf.gguf_writer import GGUFValue

    a, b = _pair(4, 4)
    w = GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    for key, (value, vtype) in kv.items():
        sub = T.get_type(value[0]) if vtype == T.ARRAY else None
        w.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub)
    w.add_tensor("blk.0.attn_q.weight.lora_a", a)
    w.add_tensor("blk.0.attn_q.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", ALPHAS, ids=str)
def test_hostile_gguf_alpha_is_refused(tmp_path, case):
    path = _write_adapter_kv(tmp_path / f"alpha_{case}.gguf", {"adapter.lora.alpha": ALPHAS[case]})
    err = adapter_error(path, tiny_cfg(tmp_path))
    assert "adapter.lora.alpha" in str(err) and path.name in str(err)


@pytest.mark.parametrize(
    "key,value",
    [
        ("adapter.alora.invocation_tokens", ("abc", T.STRING)),
        ("adapter.alora.invocation_tokens", ([1.5, 2.5], T.ARRAY)),
        ("adapter.alora.invocation_tokens", ([10**9], T.ARRAY)),
        ("general.type", ([1, 2], T.ARRAY)),
        ("general.architecture", ([1, 2], T.ARRAY)),
        ("adapter.type", ([1, 2], T.ARRAY)),
    ],
)
def test_hostile_gguf_adapter_metadata_is_refused(tmp_path, key, value):
    path = _write_adapter_kv(tmp_path / "meta.gguf", {key: value})
    err = adapter_error(path, tiny_cfg(tmp_path))
    assert key in str(err) and path.name in str(err)


def test_cli_with_a_nan_alpha_adapter_fails_fast_with_one_line(tmp_path, cache_home):
    model = write_tiny_llama(tmp_path / "base.gguf")
    adapter = _write_adapter_kv(
        tmp_path / "alpha_nan.gguf", {"adapter.lora.alpha": (math.nan, T.FLOAT32)}
    )
    r = subprocess.run(
        [sys.executable, "main.py", "-m", str(model), "--lora", str(adapter), "-p", "Hi"]
        + ["-n", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MIXDESK_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("mixdesk: error: ") and "adapter.lora.alpha" in last


PEFT_CONFIGS = {
    "list": ([1, 2, 3], "adapter_config.json"),
    "string": ("LORA", "adapter_config.json"),
    "r_list": ({"r": [8]}, "r"),
    "r_infinity": ({"r": math.inf}, "r"),
    "r_nan": ({"r": math.nan}, "r"),
    "r_negative": ({"r": -4}, "r"),
    "r_float": ({"r": 4.5}, "r"),
    "r_bool": ({"r": True}, "r"),
    "r_huge": ({"r": 10**30}, "r"),
    "alpha_nan": ({"lora_alpha": math.nan}, "lora_alpha"),
    "alpha_inf": ({"lora_alpha": math.inf}, "lora_alpha"),
    "alpha_huge": ({"lora_alpha": 3e38}, "lora_alpha"),
    "alpha_string": ({"lora_alpha": "16"}, "lora_alpha"),
    "rank_pattern_bad_regex": ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern"),
    "rank_pattern_list": ({"rank_pattern": [4]}, "rank_pattern"),
    "rank_pattern_value": ({"rank_pattern": {"q_proj": [4]}}, "rank_pattern"),
    "alpha_pattern_nan": ({"alpha_pattern": {"q_proj": math.nan}}, "alpha_pattern"),
    "modules_to_save_ints": ({"modules_to_save": [1, 2]}, "modules_to_save"),
    "peft_type_list": ({"peft_type": ["LORA"]}, "peft_type"),
    "use_rslora_string": ({"use_rslora": "yes"}, "use_rslora"),
}


@pytest.mark.parametrize("case", PEFT_CONFIGS, ids=str)
def test_hostile_peft_config_is_refused_naming_the_key(tmp_path, case):
    config, key = PEFT_CONFIGS[case]
    folder = write_tiny_peft(tmp_path / f"peft_{case}", config=config)
    err = adapter_error(folder, tiny_cfg(tmp_path))
    assert key in str(err) and folder.name in str(err)


def test_peft_safetensors_garbage_is_a_clean_error(tmp_path):
    folder = write_tiny_peft(tmp_path / "peft")
    (folder / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", 40) + b'{"root:$6$secret": 1, "x": [1,2,3]}     '
    )
    err = adapter_error(folder, tiny_cfg(tmp_path))
    assert "adapter_model.safetensors" in str(err) and "secret" not in str(err)


def test_well_formed_tiny_adapters_still_load(tmp_path):
    cfg = tiny_cfg(tmp_path)
    peft = load_adapter(write_tiny_peft(tmp_path / "ok"), cfg)
    assert peft.rank == 4 and peft.alpha == 8.0
    path = _write_adapter_kv(tmp_path / "ok.gguf", {"adapter.lora.alpha": (16.0, T.FLOAT32)})
    assert load_adapter(path, cfg).alpha == 16.0


def test_open_model_config_rejections_are_model_config_errors(tmp_path):
    path = write_tiny_llama(
        tmp_path / "nan.gguf", kv={"llama.rope.freq_base": (math.nan, T.FLOAT32)}
    )
    from core.model.config import ModelConfig

    with pytest.raises(ModelConfigError) as ei:
        ModelConfig.from_metadata(GGUFFile(path).metadata, source=path.name)
    assert "llama.rope.freq_base" in str(ei.value)


# ---- seeded corruption fuzz ----------------------------------------------------------------


def _mutants(blob: bytes, header_end: int, n: int, seed: int):
    """``n`` corrupted copies of ``blob``: byte flips and random 1/4/8-byte values in
    the header (where counts, lengths, types and offsets live), and truncations."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        data = bytearray(blob)
        kind = i % 4
        if kind == 0:  # flip a few header bytes
            for pos in rng.integers(4, header_end, size=int(rng.integers(1, 4))):
                data[pos] ^= 1 << int(rng.integers(0, 8))
        elif kind in (1, 2):  # overwrite a header field-sized run with a random value
            width = int(rng.choice([1, 4, 8]))
            pos = int(rng.integers(4, header_end - width))
            value = int(rng.integers(0, 2**63)) if kind == 1 else int(rng.integers(0, 2**16))
            data[pos : pos + width] = value.to_bytes(8, "little")[:width]
        else:  # truncate anywhere
            del data[int(rng.integers(0, len(data))) :]
        yield i, bytes(data)


def _fuzz(tmp_path: Path, blob: bytes, n: int, seed: int, load) -> list[str]:
    gf = GGUFFile(tmp_path / "clean.gguf")
    header_end = min(t.offset for t in gf.tensors.values())
    gf.close()
    bad = []
    for i, data in _mutants(blob, header_end, n, seed):
        path = tmp_path / f"m{i}.gguf"
        path.write_bytes(data)
        try:
            load(path)
        except UserError as e:
            msg = str(e)
            if (
                "\n" in msg
                or BYTES_REPR.search(msg)
                or re.search(r"\d{16,}", msg)
                or len(msg) > 400
            ):
                bad.append(f"case {i}: unclean message: {msg[:200]}")
        except Exception as e:  # noqa: BLE001 - the point of the test
            bad.append(f"case {i}: {type(e).__name__}: {str(e)[:200]}")
        path.unlink()
    return bad


def test_fuzzed_model_files_load_or_fail_cleanly(tmp_path, cache_home):
    from core.tokenizer import Tokenizer

    clean = write_tiny_llama(tmp_path / "clean.gguf", dim=32, n_heads=2, n_kv_heads=1, ffn=48)

    def load(path):
        gf, cfg = open_model_file(path)
        Tokenizer.from_metadata(gf.metadata)
        load_weights(gf, cfg, use_cache=False)

    bad = bounded(
        lambda: _FUZZ.append(_fuzz(tmp_path, clean.read_bytes(), 300, 7, load)), timeout=300
    )
    assert bad is None and _FUZZ.pop() == []


def test_fuzzed_adapter_files_load_or_fail_cleanly(tmp_path):
    cfg = tiny_cfg(tmp_path)
    a, b = _pair(4, 4)
    clean = write_lora_gguf(
        tmp_path / "clean.gguf",
        {
            "blk.0.attn_q.weight.lora_a": a,
            "blk.0.attn_q.weight.lora_b": b,
            "blk.1.attn_q.weight.lora_a": a,
            "blk.1.attn_q.weight.lora_b": b,
        },
        {"adapter.lora.alpha": 8.0},
    )
    bad = bounded(
        lambda: _FUZZ.append(
            _fuzz(tmp_path, clean.read_bytes(), 300, 11, lambda p: load_adapter(p, cfg))
        ),
        timeout=300,
    )
    assert bad is None and _FUZZ.pop() == []


_FUZZ: list[list[str]] = []


def test_fuzzed_peft_folders_load_or_fail_cleanly(tmp_path):
    cfg = tiny_cfg(tmp_path)
    clean = write_tiny_peft(tmp_path / "clean", config={"rank_pattern": {"q_proj": 4}})
    st = (clean / "adapter_model.safetensors").read_bytes()
    conf = (clean / "adapter_config.json").read_bytes()
    header_end = 8 + int.from_bytes(st[:8], "little")
    rng = np.random.default_rng(5)
    bad = []

    def run():
        for i, data in _mutants(st, header_end, 150, 13):
            c = bytearray(conf)
            for pos in rng.integers(0, len(c), size=int(rng.integers(0, 3))):
                c[pos] = int(rng.choice(list(b'{}[]":,0123456789-.eE \x00\xff')))
            folder = write_tiny_peft(tmp_path / f"p{i}")
            (folder / "adapter_model.safetensors").write_bytes(data)
            (folder / "adapter_config.json").write_bytes(bytes(c))
            try:
                load_adapter(folder, cfg)
            except UserError as e:
                msg = str(e)
                if "\n" in msg or BYTES_REPR.search(msg) or re.search(r"\d{16,}", msg):
                    bad.append(f"case {i}: unclean message: {msg[:200]}")
            except Exception as e:  # noqa: BLE001 - the point of the test
                bad.append(f"case {i}: {type(e).__name__}: {str(e)[:200]}")

    assert bounded(run, timeout=300) is None
    assert bad == []


def test_default_model_path_that_is_a_fifo_is_refused(tmp_path, monkeypatch):
    from core import default_model

    monkeypatch.setenv("MIXDESK_CACHE", str(tmp_path / "cache"))
    dest = default_model.default_model_path()
    dest.parent.mkdir(parents=True)
    os.mkfifo(dest)
    try:
        err = bounded(default_model.ensure_default_model, lambda m: None)
        assert isinstance(err, default_model.DefaultModelError), repr(err)
        assert "not a regular file" in str(err)
    finally:
        _unblock(dest)


# ---- a model bigger than the memory (issue #33, item 5) -----------------------------------

ADDRESS_SPACE = 6 << 30  # ulimit -v 6291456


def _sparse_llama(path: Path, n_layers: int) -> Path:
    """A llama of 4096-wide F32 layers (~0.7 GB each) whose tensor bytes are a hole:
    gigabytes on paper, a few KB on disk."""
    return write_tiny_llama(
        path, dim=4096, n_heads=32, n_kv_heads=8, ffn=11008, n_layers=n_layers, sparse=True
    )


def _under_ulimit_v(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    """``python args...`` with its address space capped at ADDRESS_SPACE, as under
    ``ulimit -v``: every map and allocation beyond it fails with ENOMEM."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=cap,
        env={**os.environ, "MIXDESK_CACHE": str(cache)},
    )


LOAD_AND_SAY = (
    "import sys\n"
    "from core.serve.engine import Engine\n"
    "try:\n"
    "    Engine(ctx_size=64).load_model(sys.argv[1])\n"
    "except Exception as e:\n"
    "    print(type(e).__name__, e, sep=': ')\n"
)


@pytest.mark.parametrize(
    "n_layers, message",
    [
        # the file itself does not fit in the address space
        (12, "open it: mapping the file needs 8.51 GB of address space (Cannot allocate memory)"),
        # the file maps, its float32 weights do not fit beside it
        (5, "load it: its float32 weights need 3.55 GB"),
    ],
)
def test_model_bigger_than_the_memory_is_one_line_naming_the_file(tmp_path, n_layers, message):
    model = _sparse_llama(tmp_path / "huge.gguf", n_layers)
    cache = tmp_path / "cache"
    r = _under_ulimit_v(["-c", LOAD_AND_SAY, str(model)], cache)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() == f"ModelLoadError: huge.gguf: not enough memory to {message}"
    assert not list((cache / "weights").glob(".*partial"))  # no half-written cache left

    r = _under_ulimit_v(["main.py", "-m", str(model), "-p", "Hi", "-n", "1"], cache)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert last == f"mixdesk: error: huge.gguf: not enough memory to {message}"
