"""Weights kept in their GGUF block formats (issue #35): what a load holds, that it
computes today's numbers, and that a bad file is refused before a kernel reads it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from core.gguf.reader import HUGE_PAGE, GGUFError, GGUFFile
from core.model import weights as weights_module
from core.model.llama import BatchItem
from core.model.quant import FusedMatrix, QuantMatrix
from core.model.weights import LoadCancelled, ModelLoadError, map_weights, open_model_file
from core.options import EngineOptions, OptionsError
from core.paths import cache_dir
from core.serve.engine import Engine
from core.serve.loader import load_model
from core.serve.sampling import SamplingParams
from tests.mixing import mix_logits
from tests.tiny_gguf import write_tiny_llama

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def both(smollm_path):
    """SmolLM2 loaded both ways, with the same reference adapter."""
    from tests.reference import reference_dir

    engines = {}
    for storage in ("quantized", "f32"):
        e = Engine(EngineOptions(weights=storage, ctx_size=256, n_parallel=2))
        e.load_model(smollm_path)
        e.add_adapter(reference_dir() / "adapters" / "lora_attn.gguf")
        e.start()
        engines[storage] = e
    yield engines
    for e in engines.values():
        e.stop()


def test_quantized_load_maps_the_file_and_writes_no_float32_cache(both, smollm_path):
    q, f = both["quantized"], both["f32"]
    info = q.model_info()
    assert info["weights"] == "quantized" and info["f32_tensors"] == {}
    assert f.model_info()["weights"] == "f32"
    # the file's own blocks: less than the file itself, a fifth of the float32 copy
    assert info["memory_bytes"] < smollm_path.stat().st_size
    assert info["memory_bytes"] * 4 < f.model_info()["memory_bytes"]
    # what the same weights take as float32 (bench.engine's RSS target), from either load
    assert q.model.w.float32_nbytes == f.model.w.float32_nbytes == f.model.w.nbytes
    assert q.model.w.qtypes() == {"Q4_1", "Q8_0"}
    lw = q.model.w.layers[0]
    assert isinstance(lw.wqkv, FusedMatrix) and isinstance(lw.wo, QuantMatrix)
    # only the f32 engine wrote a cache; the quantized load wrote none of its own
    caches = list((cache_dir() / "weights").glob("*.f32"))
    assert len(caches) == 1


@pytest.mark.parametrize("mix", [{}, {0: 0.8}])
def test_quantized_logits_equal_the_float32_path(both, mix):
    """The same numbers as dequantizing to float32 first, up to summation order."""
    toks = both["f32"].tokenizer.encode(PROMPT)
    want = mix_logits(both["f32"], mix, toks)  # (n, vocab)
    got = mix_logits(both["quantized"], mix, toks)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 2e-2


def test_quantized_generation_equals_the_float32_path(both):
    p = SamplingParams(temperature=0, n_predict=24, ignore_eos=True)
    prompt = both["f32"].tokenizer.encode(PROMPT)
    got = [both[s].complete(prompt, p, mix={0: 0.5}, cache_prompt=False).tokens for s in both]
    assert got[0] == got[1]


def test_a_type_without_kernels_is_held_as_float32_and_named(tmp_path, caplog):
    path = write_tiny_llama(tmp_path / "iq.gguf", qtype=GGMLQuantizationType.IQ4_NL)
    gf, cfg = open_model_file(path)
    with caplog.at_level(logging.WARNING):
        w = map_weights(gf, cfg)
    assert w.f32_tensors and set(w.f32_tensors.values()) == {"IQ4_NL"}
    assert "blk.0.attn_q.weight" in w.f32_tensors
    assert "IQ4_NL" in caplog.text and "float32" in caplog.text
    # its IQ4_NL bytes are dequantized: a copy of the file in memory would hold them
    # for nothing, so the rest is served from the map
    assert w.mapped and not gf.in_memory
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    eng.load_model(path)
    assert eng.model_info()["f32_tensors"]["blk.1.ffn_down.weight"] == "IQ4_NL"
    want = Engine(EngineOptions(weights="f32", ctx_size=64, n_parallel=1))
    want.load_model(path)
    toks = [5, 6, 7, 8]
    np.testing.assert_allclose(
        mix_logits(eng, {}, toks), mix_logits(want, {}, toks), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.F16],
)
def test_tiny_models_of_each_storage_agree(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=qtype, dim=256, ffn=256, tied=False)
    got, want = (
        Engine(EngineOptions(ctx_size=64)),
        Engine(EngineOptions(weights="f32", ctx_size=64)),
    )
    got.load_model(path)
    want.load_model(path)
    toks = list(range(3, 40))
    np.testing.assert_allclose(
        mix_logits(got, {}, toks), mix_logits(want, {}, toks), rtol=1e-3, atol=1e-3
    )


def test_a_file_cut_short_is_refused_before_any_kernel_reads_it(tmp_path):
    path = write_tiny_llama(
        tmp_path / "cut.gguf", qtype=GGMLQuantizationType.Q4_K, dim=256, ffn=256
    )
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # the last tensor's blocks lose their tail
    eng = Engine(EngineOptions(ctx_size=64))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        eng.load_model(path)
    assert eng.model is None


def test_weights_option_is_checked():
    with pytest.raises(OptionsError, match="--weights must be one of quantized, f32"):
        EngineOptions(weights="int3")


def test_old_float32_caches_are_noted_and_can_be_cleared(both, caplog):
    from core.model.weights import clear_f32_caches, note_f32_caches

    before = len(list((cache_dir() / "weights").glob("*.f32")))  # the f32 engine's, at least
    note = note_f32_caches()
    assert note and f"{before} float32 weight cache(s)" in note and "--clear-f32-cache" in note
    n, freed = clear_f32_caches()
    assert n == before >= 1 and freed > 4 * 100_000_000  # SmolLM2's alone is 538 MB
    assert note_f32_caches() is None
    assert not list((cache_dir() / "weights").glob("*"))


def _tensor_bytes(path) -> dict[str, bytes]:
    gf = GGUFFile(path)
    return {name: gf.raw(name).tobytes() for name in gf.tensors}


def test_weights_read_into_memory_are_the_files_bytes_read_only(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q4_K, dim=256, ffn=256)
    want = _tensor_bytes(path)
    gf = GGUFFile(path)
    steps = []
    gf.read_into_memory(steps.append)
    assert gf.in_memory and steps[-1] == 1.0
    for name, b in want.items():
        got = gf.raw(name)
        assert got.tobytes() == b, name
        assert not got.flags.writeable
        with pytest.raises(ValueError):
            got[:1] = 0
    # the copy starts on a huge page (the kernels' reads then need few page walks)
    first = min(gf.tensors.values(), key=lambda t: t.offset)
    assert gf.raw(first.name).ctypes.data % HUGE_PAGE == 0
    gf.read_into_memory()  # a second call keeps the copy it has
    assert gf.raw(first.name).ctypes.data % HUGE_PAGE == 0


@pytest.fixture
def small_parts(monkeypatch):
    """read_into_memory's parts and reads made small, so that a tiny file is read in
    several parts on several threads, each in several reads, as a model is."""
    from core.gguf import reader

    monkeypatch.setattr(reader, "READ_CHUNK", 8192)
    monkeypatch.setattr(reader, "HUGE_PAGE", 16384)
    monkeypatch.setattr(reader.os, "cpu_count", lambda: 4)


def test_a_read_in_parts_on_threads_is_the_files_bytes(tmp_path, small_parts, monkeypatch):
    """The copy is read in parts, on up to READ_THREADS threads: every byte lands where
    the file has it, progress never goes back and ends at 1, and the calling thread is
    the one that sees it."""
    import threading

    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256, ffn=512)
    want = _tensor_bytes(path)
    gf = GGUFFile(path)
    assert gf.file_size - gf._data_from() > 3 * 16384  # four parts of whole "huge pages"
    names = set()
    real_start = threading.Thread.start

    def start(self):
        names.add(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    steps, callers = [], set()

    def step(f):
        steps.append(f)
        callers.add(threading.current_thread().name)

    gf.read_into_memory(step)
    assert {n for n in names if n.startswith("mixdesk-read-")} == {
        f"mixdesk-read-{i}" for i in range(4)
    }
    assert callers == {threading.current_thread().name}
    assert steps == sorted(steps) and steps[-1] == 1.0
    for name, b in want.items():
        assert gf.raw(name).tobytes() == b, name


def test_a_read_stopped_by_its_progress_stops_every_part(tmp_path, small_parts, monkeypatch):
    """A cancel raised from the progress callback stops the parts' threads at their next
    read, drops the copy and is raised to the caller; a later read starts again and
    completes. Each part's read is held until the cancel has been raised and the stop
    set, so every part has made exactly the read it was in, however fast the machine."""
    import threading
    import types

    from core.gguf import reader

    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256, ffn=512)
    want = _tensor_bytes(path)
    gf = GGUFFile(path)
    reads = []
    cancelled = threading.Event()
    stops: list[threading.Event] = []  # the stop flag read_into_memory's parts share

    def event():
        stops.append(threading.Event())
        return stops[-1]

    class Held:  # a file whose reads wait for the cancel and the stop it sets
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, at):
            self.f.seek(at)

        def readinto(self, view):
            if len(stops) == 1:  # the first read_into_memory's parts
                assert cancelled.wait(10) and stops[0].wait(10)
            reads.append(len(view))
            return self.f.readinto(view)

    held = types.SimpleNamespace(Thread=threading.Thread, Event=event)
    monkeypatch.setattr(reader, "threading", held)
    monkeypatch.setattr(reader, "open", lambda *a, **k: Held(open(*a, **k)), raising=False)

    def step(f):
        cancelled.set()
        raise LoadCancelled()

    with pytest.raises(LoadCancelled):
        gf.read_into_memory(step)
    assert not gf.in_memory
    assert not any(t.name.startswith("mixdesk-read-") for t in threading.enumerate())
    total = -(-(gf.file_size - gf._data_from()) // 8192)  # reads a whole copy takes
    assert total > 8 and len(reads) == 4, (len(reads), total)  # the four parts' first
    reads.clear()
    gf.read_into_memory()  # (its own stop, never set: reads go straight through)
    assert gf.in_memory and all(gf.raw(n).tobytes() == b for n, b in want.items())
    assert len(reads) >= total


def test_a_file_cut_short_while_it_is_read_in_parts_is_a_clear_error(tmp_path, small_parts):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256, ffn=512)
    gf = GGUFFile(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20000])  # the last part's end is gone
    with pytest.raises(GGUFError, match="became shorter while it was being read"):
        gf.read_into_memory()
    assert not gf.in_memory


def test_a_file_cut_short_while_it_is_read_is_a_clear_error(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256)
    gf, cfg = open_model_file(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])  # replaced by a shorter file after opening
    with pytest.raises(GGUFError, match="became shorter while it was being read"):
        gf.read_into_memory()
    assert not gf.in_memory
    with pytest.raises(ModelLoadError, match="m.gguf became shorter"):
        map_weights(gf, cfg)


def test_a_cancel_stops_the_read(tmp_path):
    import threading

    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256)
    gf, cfg = open_model_file(path)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        map_weights(gf, cfg, cancel=cancel)
    assert not gf.in_memory


def test_weights_larger_than_the_free_memory_allows_are_mapped(tmp_path, monkeypatch, caplog):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256)
    gf, cfg = open_model_file(path)
    monkeypatch.setattr(weights_module, "available_memory", lambda: gf.data_bytes)
    with caplog.at_level(logging.INFO):
        w = map_weights(gf, cfg)
    assert w.mapped and not gf.in_memory
    assert "served from its memory map" in caplog.text and "75% of the" in caplog.text
    # with room, the same file is read
    monkeypatch.setattr(weights_module, "available_memory", lambda: 2 * gf.data_bytes)
    gf2, _ = open_model_file(path)
    assert not map_weights(gf2, cfg).mapped and gf2.in_memory


def test_a_model_larger_than_the_read_limit_is_mapped(tmp_path, monkeypatch, caplog):
    """A 3B or an 8B serves as fast from the map and maps in a fraction of the read."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=GGMLQuantizationType.Q8_0, dim=256)
    gf, cfg = open_model_file(path)
    monkeypatch.setattr(weights_module, "READ_MAX_BYTES", gf.data_bytes - 1)
    with caplog.at_level(logging.INFO):
        assert map_weights(gf, cfg).mapped and not gf.in_memory
    assert "read into memory (faster to map" in caplog.text
    monkeypatch.setattr(weights_module, "READ_MAX_BYTES", gf.data_bytes)
    gf2, _ = open_model_file(path)
    assert not map_weights(gf2, cfg).mapped


def test_weights_in_memory_and_mapped_give_the_same_logits(smollm_path):
    """--mmap changes where the blocks are read from, not a number: the same kernels
    over the same bytes, bit for bit."""
    got = {}
    for mmap in (False, True):
        said: list[str] = []
        lm = load_model(
            smollm_path, lambda f, m, said=said: said.append(m), lambda: None, mmap=mmap
        )
        try:
            assert lm.model.w.mapped is mmap
            # the load bar says which
            assert ("mapping the weights" in said) is mmap
            assert ("reading the weights into memory" in said) is not mmap
            cache = lm.model.new_cache(64)
            toks = np.array(lm.tokenizer.encode(PROMPT))
            first = lm.model([BatchItem(toks, cache)])[0]  # (1, vocab) a prefill
            step = lm.model([BatchItem(np.array([first.argmax()]), cache)])[0]  # a decode
            got[mmap] = np.concatenate([first, step])
        finally:
            lm.model.lin.close()
    np.testing.assert_array_equal(got[False], got[True])


def test_the_mmap_flag_reaches_the_model_and_its_info(smollm_path):
    from core.cli import parse_args

    assert EngineOptions.from_args(parse_args(["--mmap"])).mmap
    assert not EngineOptions.from_args(parse_args(["--no-mmap"])).mmap
    assert not EngineOptions.from_args(parse_args([])).mmap
    for mmap in (False, True):
        eng = Engine(EngineOptions(ctx_size=64, n_parallel=1, mmap=mmap))
        eng.load_model(smollm_path)
        eng.start()
        try:
            assert eng.model_info()["mapped"] is mmap
        finally:
            eng.stop()
