"""The compiled quant kernels (core/model/kernels.py through core/model/quant.py):
dequantization bit for bit as gguf.quants, products equal to float32 math on the
dequantized weights up to summation order, and refusal of bad layouts.

Blocks are random bytes with finite f16 scales (every bit pattern of the quants,
including Q5's high bits and Q3_K's mask), plus gguf-py's own quantizer output for
the types it can quantize, plus the real SmolLM2 (Q4_1, Q8_0) and Qwen2.5 (Q4_K,
Q6_K, Q5_0, Q8_0) tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from core.gguf.reader import GGUFFile
from core.model import quant
from core.model.quant import FusedMatrix, QuantLayoutError, QuantMatrix, check_layout
from tests import background
from tests.tiny_gguf import random_matrix

TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
TYPES += [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# 1..16: small-batch kernels (2-4 rows of the 32-element types and Q8_0: the pair dots;
# 8 and more: two rows of W at a time); more: BLAS tiles
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 11, 16, 17, 33, 100)
# |y - y64| <= TOL * (|x| @ |W|.T): float32 sums of ~1000 products, any order
TOL = 2e-6


def reference(qt: Q, data: np.ndarray, shape) -> np.ndarray:
    return quants.dequantize(data, qt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def check_products(m, ref: np.ndarray, rng: np.random.Generator, counts=ROW_COUNTS) -> None:
    """m.matmul(x) against float64 x @ ref.T, relative to the sum of |terms|."""
    ref64 = ref.astype(np.float64)
    for t in counts:
        x = rng.standard_normal((t, ref.shape[1])).astype(np.float32)  # (T, in)
        y = m.matmul(x)  # (T, out)
        assert y.shape == (t, ref.shape[0]) and y.dtype == np.float32
        exact = x.astype(np.float64) @ ref64.T  # (T, out)
        scale = np.abs(x).astype(np.float64) @ np.abs(ref64).T  # (T, out)
        err = np.max(np.abs(y - exact) / scale)
        assert err < TOL, f"{m} T={t}: relative error {err:.2e}"


def run_fresh(code: str, *args: str, env: dict | None = None, timeout: int = 600):
    """``code`` run by a fresh Python in the repository (``args`` its argv, ``env`` over
    this process's environment); its CompletedProcess, once it has exited with 0."""
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    return run


@pytest.fixture(scope="module", autouse=True)
def compiled():
    # one compile (or cache load) for all tests; numba's own threads, two of them
    quant.set_threads(2)
    quant.warm_up(TYPES)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_dequantize_is_gguf_bit_for_bit(qt):
    rng = np.random.default_rng(int(qt))
    rows, cols = 37, 768  # 3 super-blocks, 24 small blocks per row
    data = random_matrix(qt, rows, cols, rng)
    ref = reference(qt, data, (rows, cols))
    m = QuantMatrix(qt, data, (rows, cols), name="w")
    assert m.shape == (rows, cols) and m.nbytes == data.nbytes and m.dtype == qt.name
    assert same_bits(m.dequantize(), ref)
    assert same_bits(m.dequantize(5, 9), ref[5:9])
    assert same_bits(m.rows(30, 37).dequantize(), ref[30:37])
    ids = [36, 0, 7, 7]
    assert same_bits(m.take(ids), ref[ids])


@pytest.mark.parametrize("qt", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantize_gguf_quantized_blocks(qt):
    """Blocks as gguf-py's quantizer writes them (real scales and mins)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((19, 320)) * 0.05).astype(np.float32)
    data = quants.quantize(x, qt).view(np.uint8).reshape(19, -1)
    m = QuantMatrix(qt, data, (19, 320))
    assert same_bits(m.dequantize(), reference(qt, data, (19, 320)))


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_products_match_float_math(qt):
    rng = np.random.default_rng(100 + int(qt))
    # 37 rows: two full chunks of 16 output rows and a ragged one; 1280 columns: the
    # K-chunks of the small kernels end mid-row for T >= 8
    cols = 1280 if GGML_QUANT_SIZES[qt][0] < 256 else 1536
    data = random_matrix(qt, 37, cols, rng)
    check_products(QuantMatrix(qt, data, (37, cols)), reference(qt, data, (37, cols)), rng)


def test_prefill_tiles_cover_every_row(monkeypatch):
    """Tiles much smaller than the matrix, the last one ragged."""
    monkeypatch.setattr(quant, "TILE_FLOATS", 16 * 512)  # 16 rows of 512 per tile
    rng = np.random.default_rng(5)
    data = random_matrix(Q.Q4_K, 70, 512, rng)
    m = QuantMatrix(Q.Q4_K, data, (70, 512))
    check_products(m, reference(Q.Q4_K, data, (70, 512)), rng, counts=(17, 64))


def test_a_fused_prefill_shares_tiles_across_its_parts(monkeypatch):
    """A prefill through a fused matrix whose parts stay apart (Q|K|V of three types)
    dequantizes all of them into the same tiles, one gemm a tile; tiles of equal size
    that start and end inside parts give the parts' own products."""
    monkeypatch.setattr(quant, "TILE_FLOATS", 24 * 512)  # 3 tiles of 22 rows for 66
    rng = np.random.default_rng(12)
    shapes = [(Q.Q4_K, 30), (Q.Q8_0, 20), (Q.Q6_K, 16)]
    datas = [random_matrix(qt, n, 512, rng) for qt, n in shapes]
    parts = [QuantMatrix(qt, d, (n, 512), name=qt.name) for (qt, n), d in zip(shapes, datas)]
    ref = np.concatenate([reference(qt, d, (n, 512)) for (qt, n), d in zip(shapes, datas)])
    f = FusedMatrix(parts, name="qkv")
    assert len(f._runs) == 3
    seen = []
    real = np.matmul
    monkeypatch.setattr(
        quant.np, "matmul", lambda *a, **k: seen.append(a[1].shape) or real(*a, **k)
    )
    check_products(f, ref, rng, counts=(17, 40))
    assert seen == [(512, 22)] * 6  # two prefills of three equal tiles


def test_vector_and_out_arguments():
    rng = np.random.default_rng(6)
    data = random_matrix(Q.Q8_0, 40, 256, rng)
    ref = reference(Q.Q8_0, data, (40, 256))
    m = QuantMatrix(Q.Q8_0, data, (40, 256))
    x = rng.standard_normal(256).astype(np.float32)  # (in,)
    y = m.matmul(x)
    assert y.shape == (40,)
    np.testing.assert_allclose(y, ref @ x, rtol=1e-4, atol=1e-5)
    big = np.zeros((3, 100), dtype=np.float32)
    xs = rng.standard_normal((3, 256)).astype(np.float32)
    m.matmul(xs, out=big[:, 50:90])  # a column slice, as a fused matrix hands out
    np.testing.assert_allclose(big[:, 50:90], xs @ ref.T, rtol=1e-4, atol=1e-5)
    assert not big[:, :50].any() and not big[:, 90:].any()
    with pytest.raises(ValueError, match="columns"):
        m.matmul(np.zeros((2, 128), dtype=np.float32))


def test_fused_matrix_mixed_types():
    """Q|K|V-like parts of different types and a float32 part, as one matrix."""
    rng = np.random.default_rng(7)
    q_data = random_matrix(Q.Q4_K, 48, 512, rng)
    k_data = random_matrix(Q.Q6_K, 20, 512, rng)
    v = (rng.standard_normal((12, 512)) * 0.02).astype(np.float32)
    parts = [QuantMatrix(Q.Q4_K, q_data, (48, 512)), QuantMatrix(Q.Q6_K, k_data, (20, 512)), v]
    ref = np.concatenate(
        [reference(Q.Q4_K, q_data, (48, 512)), reference(Q.Q6_K, k_data, (20, 512)), v]
    )  # (80, 512)
    f = FusedMatrix(parts, name="qkv")
    assert f.shape == (80, 512) and f.dtype == "Q4_K+Q6_K+F32"
    assert f.nbytes == q_data.nbytes + k_data.nbytes + v.nbytes
    check_products(f, ref, rng, counts=(1, 8, 40))
    assert same_bits(f.dequantize(), ref)
    assert same_bits(f.dequantize(40, 75), ref[40:75])
    ids = [79, 0, 50, 47, 68]
    assert same_bits(f.take(ids), ref[ids])
    inside = f.rows(50, 60)  # within the Q6_K part: that part's own view
    assert isinstance(inside, QuantMatrix) and inside.dtype == "Q6_K"
    assert same_bits(inside.dequantize(), ref[50:60])
    across = f.rows(40, 75)
    assert isinstance(across, FusedMatrix) and same_bits(across.dequantize(), ref[40:75])


def test_parts_back_to_back_in_one_buffer_run_as_one_matrix():
    """Parts of one type whose bytes follow each other in one buffer (a file's gate
    and up) are one matrix for the products, without a copy; the others stay apart."""
    rng = np.random.default_rng(9)
    gate = random_matrix(Q.Q4_K, 48, 512, rng)
    up = random_matrix(Q.Q4_K, 40, 512, rng)
    k = random_matrix(Q.Q6_K, 20, 512, rng)
    buf = np.concatenate([gate.reshape(-1), up.reshape(-1), k.reshape(-1)])  # one "file"
    g_n, u_n = gate.size, up.size
    g = QuantMatrix(Q.Q4_K, buf[:g_n], (48, 512), name="gate")
    u = QuantMatrix(Q.Q4_K, buf[g_n : g_n + u_n], (40, 512), name="up")
    kk = QuantMatrix(Q.Q6_K, buf[g_n + u_n :], (20, 512), name="k")
    ref = np.concatenate(
        [reference(Q.Q4_K, gate, (48, 512)), reference(Q.Q4_K, up, (40, 512)),
         reference(Q.Q6_K, k, (20, 512))]
    )  # fmt: skip
    f = FusedMatrix([g, u, kk], name="gate_up_k")
    (joined, lo, hi), (last, *_) = f._runs
    assert (lo, hi, joined.shape) == (0, 88, (88, 512)) and last is kk
    assert np.shares_memory(joined.data, buf) and not joined.data.flags.writeable
    check_products(f, ref, rng, counts=(1, 2, 4, 8, 40))
    assert same_bits(joined.dequantize(), ref[:88])
    assert len(f.parts) == 3 and same_bits(f.take([0, 50, 100]), ref[[0, 50, 100]])
    # not back to back, the other order, or two buffers: apart
    assert u.joined(g) is None and g.joined(kk) is None
    copy = QuantMatrix(Q.Q4_K, buf[g_n : g_n + u_n].copy(), (40, 512), name="up")
    assert g.joined(copy) is None and len(FusedMatrix([g, copy])._runs) == 2


def test_a_files_gate_and_up_run_as_one_matrix(smollm_path):
    """SmolLM2's file holds each block's ffn_gate and ffn_up back to back."""
    from core.model.config import ModelConfig
    from core.model.weights import map_weights

    gf = GGUFFile(smollm_path)
    w = map_weights(gf, ModelConfig.from_metadata(gf.metadata))
    runs = w.layers[0].w_gate_up._runs
    assert len(runs) == 1 and runs[0][0].shape == w.layers[0].w_gate_up.shape


def test_bad_layouts_are_refused():
    rng = np.random.default_rng(8)
    data = random_matrix(Q.Q4_K, 4, 512, rng)
    with pytest.raises(QuantLayoutError, match="truncated or corrupt"):
        QuantMatrix(Q.Q4_K, data.reshape(-1)[:-1], (4, 512), name="blk.0.attn_q.weight")
    with pytest.raises(QuantLayoutError, match="truncated or corrupt"):
        QuantMatrix(Q.Q4_K, data, (5, 512))  # more rows than bytes
    with pytest.raises(QuantLayoutError, match="whole number of Q4_K blocks"):
        QuantMatrix(Q.Q4_K, data, (8, 256 + 32))
    with pytest.raises(QuantLayoutError, match="expected a matrix"):
        check_layout(Q.Q8_0, (34,), 34)
    with pytest.raises(QuantLayoutError, match="no compiled kernels"):
        QuantMatrix(Q.IQ2_XXS, data, (4, 512))
    assert check_layout(Q.Q8_0, (3, 64), 3 * 68) == 68
    m = QuantMatrix(Q.Q4_K, data, (4, 512))
    with pytest.raises(IndexError, match="out of range"):
        m.take([0, 4])
    with pytest.raises(IndexError, match="out of range"):
        m.take([-1])
    with pytest.raises(IndexError, match="out of range"):
        m.rows(2, 5)


def test_weights_stay_a_view_of_the_file(smollm_path):
    """The matrix is the memory map's bytes, not a copy."""
    gf = GGUFFile(smollm_path)
    t = gf.tensors["blk.0.ffn_gate.weight"]
    raw = gf.raw(t.name)
    m = QuantMatrix(t.qtype, raw, t.shape, name=t.name)
    assert np.shares_memory(m.data, raw) and not m.data.flags.writeable


def _check_file_tensors(path, names) -> None:
    gf = GGUFFile(path)
    rng = np.random.default_rng(9)
    for name in names:
        t = gf.tensors[name]
        m = QuantMatrix(t.qtype, gf.raw(name), t.shape, name=name)
        n = min(t.shape[0], 300)  # the rows the products are checked on
        ref = gf.dequantize(name, rows=(0, n))  # (n, in)
        assert same_bits(m.dequantize(0, n), ref), name
        check_products(m.rows(0, n), ref, rng, counts=(1, 8, 33))


def test_smollm2_q4_1_tensors(smollm_path):
    _check_file_tensors(
        smollm_path, ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"]
    )
    gf = GGUFFile(smollm_path)
    emb = QuantMatrix(Q.Q8_0, gf.raw("token_embd.weight"), gf.tensors["token_embd.weight"].shape)
    ids = [0, 1, 49151, 17]
    assert same_bits(emb.take(ids), gf.dequantize("token_embd.weight")[ids])


def test_qwen_k_quant_tensors(qwen2_path):
    gf = GGUFFile(qwen2_path)
    by_type = {}
    for name, t in gf.tensors.items():
        if len(t.shape) == 2:
            by_type.setdefault(t.qtype, name)
    assert {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0} <= set(by_type)
    _check_file_tensors(qwen2_path, [by_type[q] for q in (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0)])


def test_warm_up_reports_time_and_progress():
    seen = []
    took = quant.warm_up(["Q4_K", Q.Q8_0, Q.F32, Q.IQ2_XXS], progress=seen.append)
    assert took >= 0 and seen == [0.5, 1.0]


def test_warm_up_hands_a_cancel_back_to_its_caller():
    """warm_up runs on a thread of its own; a progress callback that raises (a
    cancelled load) still stops it, with that exception, in the caller."""

    class Cancelled(Exception):
        pass

    def cancel(frac):
        raise Cancelled(frac)

    with pytest.raises(Cancelled):
        quant.warm_up(["Q4_K"], progress=cancel)


_LOAD_THEN_LAUNCH = """
import json, os, sys, threading, time
import numpy as np
from core.options import EngineOptions
from core.serve.engine import Engine

def threads():  # the process's OS threads that Python did not start: OpenMP's workers
    return len(os.listdir("/proc/self/task")) - threading.active_count()

eng = Engine(EngineOptions(weights="quantized", threads=2, n_parallel=1, draft_max=0))
before = threads()
eng.load_model(sys.argv[1])  # on this thread, as the headless server and benches do
# the passing thread's workers end when it does, but the OS may take a moment to reap
# them on a busy machine (seen: one still listed right after the load); a team kept
# alive never goes
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
loaded = threads()
w = eng.model.w.layers[0].w_gate_up
w.matmul(np.ones((1, w.shape[1]), dtype=np.float32))  # a product on this same thread
launched = threads()
print(json.dumps({"before": before, "loaded": loaded, "launched": launched}))
"""


def test_a_load_leaves_no_kernel_threads_behind(smollm_path):
    """Regression: the load's kernel warm-up ran on the loading thread, and numba's
    OpenMP layer kept that thread's team of workers alive beside the engine thread's.
    With more workers than cores libgomp stops letting idle workers spin, so every
    product of a decode step waited for one to wake: SmolLM2 decoded 10.2-10.8 ms a
    token on the engine thread, 8.0-8.4 once the warm-up ran on a passing thread.
    In a fresh process: after the load, no new thread is left; a product on the same
    thread does leave its team (so the count would see one)."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads through Linux's /proc")
    run = run_fresh(_LOAD_THEN_LAUNCH, str(smollm_path), env={"NUMBA_NUM_THREADS": "2"})
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] == got["before"], got
    assert got["launched"] > got["loaded"], got


_F32_DECODE = """
import json, os, sys, threading
import numpy as np
from core.model.llama import BatchItem
from core.options import EngineOptions
from core.serve.engine import Engine

def threads():  # the process's OS threads that Python did not start: OpenMP's workers
    return len(os.listdir("/proc/self/task")) - threading.active_count()

eng = Engine(EngineOptions(weights="f32", threads=2, n_parallel=1, draft_max=0))
before = threads()
# on this thread: its calibration times decode steps, as the decoding below
eng.load_model(sys.argv[1])
model = eng.model
cache = model.new_cache(256)
model([BatchItem(np.arange(10, 40), cache)])
for t in range(4):  # decoding: the compiled attention, between float32 products
    model([BatchItem(np.array([50 + t]), cache)])
print(json.dumps({"before": before, "decoded": threads()}))
"""


def test_the_float32_path_runs_decoding_attention_without_a_kernel_team(smollm_path):
    """Regression: decoding attention is compiled, and on the float32 path it ran on two
    kernel threads. Their OpenMP worker spins after each kernel while BLAS's threads
    (or Linear's helpers) want the core: SmolLM2 decoded at 330 ms a token instead of
    24. On the float32 path it runs on the calling thread alone: no worker appears."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads through Linux's /proc")
    run = run_fresh(_F32_DECODE, str(smollm_path), env={"NUMBA_NUM_THREADS": "2"})
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["decoded"] == got["before"], got


_SECOND_TEAM = """
import logging, threading
import numpy as np
from core.model import quant
from core.model.quant import QuantMatrix
from tests.tiny_gguf import random_matrix
from gguf import GGMLQuantizationType as Q

logging.basicConfig(format="%(levelname)s %(message)s")
quant.set_threads(2)
m = QuantMatrix(Q.Q4_0, random_matrix(Q.Q4_0, 64, 256, np.random.default_rng(0)), (64, 256))
x = np.ones((1, 256), dtype=np.float32)
quant.on_passing_thread(lambda: m.matmul(x))  # a warm-up: its team ends with it
launched, done = threading.Event(), threading.Event()

def engine():  # the long-lived thread that owns the kernels
    m.matmul(x)
    launched.set()
    done.wait()

t = threading.Thread(target=engine, name="engine-like")
t.start()
launched.wait()
print("MARK", flush=True)
m.matmul(x)  # a second live thread: the warning
for _ in range(3):  # a prefill's one-thread dequantizing, then products again: no more
    m.matmul(np.ones((40, 256), dtype=np.float32))
    m.matmul(x)
done.set()
t.join()
"""


def test_a_second_thread_starting_kernels_is_warned_of():
    """A product started on another thread while the engine's keeps its OpenMP team
    (what made bench.engine's decode read 20% low) logs a warning naming both threads;
    the passing warm-up thread and the engine-like thread after it log none, and the
    second thread is warned of once, not at every product after a prefill (bench.engine's
    grid logged it 28 times: a prefill's dequantizing runs on one thread, and the next
    product's return to two was taken for a new launch)."""
    run = run_fresh(_SECOND_TEAM, env={"NUMBA_NUM_THREADS": "2"})
    warnings = [ln for ln in run.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1, run.stderr[-2000:]
    assert "'MainThread#" in warnings[0] and "'engine-like#" in warnings[0]  # name#ident


def test_kernels_on_numbas_workqueue_pool_are_warned_of():
    """Without an OpenMP runtime numba runs the kernels on its workqueue pool, where
    SmolLM2 decoded 2.5x slower (measured with NUMBA_THREADING_LAYER=workqueue); the
    warm-up says so, and what to install."""
    code = (
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from core.model import quant\n"
        "quant.warm_up(['Q4_0'], helpers=False)\n"
        "print(quant.threading_layer())\n"
    )
    run = run_fresh(code, env={"NUMBA_THREADING_LAYER": "workqueue"})
    assert run.stdout.strip().splitlines()[-1] == "workqueue"
    warnings = [ln for ln in run.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1 and "libgomp1" in warnings[0], run.stderr[-2000:]


def test_kernel_cache_goes_to_the_user_cache_dir(tmp_path):
    """Compiled kernels are cached in cache_dir()/numba (or the NUMBA_CACHE_DIR the
    user set), in a folder named by the kernels' sources, so that an update of a
    module the entry points call never runs old cached code (numba checks only the
    entry point's own file)."""
    import os
    import subprocess
    import sys

    from core.model import kernel_base

    code = "import numba.core.config as c, core.model.kernels; print(c.CACHE_DIR)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["MIXDESK_CACHE"] = str(tmp_path / "cache")
    digest = kernel_base.sources_digest()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == str(tmp_path / "cache" / "numba" / digest), run.stderr
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == str(tmp_path / "mine" / digest), run.stderr
    # a child started with the named folder keeps it (no second level)
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine" / digest)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == str(tmp_path / "mine" / digest), run.stderr


def test_kernel_cache_folder_follows_every_kernel_source(tmp_path, monkeypatch):
    """Changing any one of the kernel modules (not only kernels.py, whose functions
    numba caches) moves the cache to a new folder."""
    from core.model import kernel_base

    here = Path(kernel_base.__file__).parent
    for name in kernel_base.KERNEL_SOURCES:
        (tmp_path / name).write_bytes((here / name).read_bytes())
    monkeypatch.setattr(kernel_base, "__file__", str(tmp_path / "kernel_base.py"))
    same = kernel_base.sources_digest()
    assert same == kernel_base.sources_digest()
    seen = {same}
    for name in kernel_base.KERNEL_SOURCES:
        with open(tmp_path / name, "a") as f:
            f.write("\n# changed\n")
        seen.add(kernel_base.sources_digest())
    assert len(seen) == 1 + len(kernel_base.KERNEL_SOURCES)


DOT = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("qt", DOT, ids=lambda q: q.name)
def test_fused_gemv_against_the_batched_kernel(qt):
    """One activation row takes the fused dot (kernels.DOT_TYPES), two rows the pair
    dot (the 32-element types, Q8_0) or the many-row one (the K-quants, where WIDE):
    both agree with float64 and with each other, on rows of an odd number of blocks
    (the 32-element types' dots take four blocks a pass, then the rest)."""
    from core.model import kernels

    assert int(qt) in kernels.DOT_TYPES
    rng = np.random.default_rng(300 + int(qt))
    cols = 41 * 32 if GGML_QUANT_SIZES[qt][0] == 32 else 3 * 256
    data = random_matrix(qt, 37, cols, rng)
    ref = reference(qt, data, (37, cols))
    m = QuantMatrix(qt, data, (37, cols))
    check_products(m, ref, rng, counts=(1,))
    x = rng.standard_normal((2, cols)).astype(np.float32)  # (2, in)
    one = m.matmul(x[:1])  # (1, out) fused dot
    two = m.matmul(x)  # (2, out) batched kernel
    scale = np.abs(x[:1]).astype(np.float64) @ np.abs(ref.astype(np.float64)).T
    assert np.max(np.abs(one - two[:1]) / scale) < TOL


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("blocks", [1, 3, 4, 7, 8])
def test_whole_row_dots_of_short_rows(qt, blocks):
    """kernel_wide._b32_row_ir runs a row's blocks four a turn, then the rest one by
    one, for one to four rows of x: rows of fewer blocks than a turn, of exact turns
    and of turns and a rest all agree with float64 (and Q4_0's and Q4_1's values
    come from a table of 16)."""
    rng = np.random.default_rng(blocks * 100 + int(qt))
    cols = 32 * blocks
    data = random_matrix(qt, 19, cols, rng)
    ref = reference(qt, data, (19, cols))
    check_products(QuantMatrix(qt, data, (19, cols)), ref, rng, counts=(1, 2, 3, 4))


_PORTABLE_DOTS = """
import json
import numpy as np
from gguf import quants
from gguf import GGMLQuantizationType as Q
from core.model import kernel_wide
from core.model.quant import QuantMatrix
from tests.tiny_gguf import random_matrix

errs = {}
for qt in (Q.Q4_K, Q.Q6_K):
    rng = np.random.default_rng(int(qt))
    data = random_matrix(qt, 37, 3 * 256, rng)  # (37, row bytes)
    ref = quants.dequantize(data, qt).reshape(37, 768).astype(np.float64)
    m = QuantMatrix(qt, data, (37, 768))
    for t in (1, 3):  # the decode dot; a few rows
        x = rng.standard_normal((t, 768)).astype(np.float32)
        scale = np.abs(x.astype(np.float64)) @ np.abs(ref).T
        err = np.abs(m.matmul(x) - x.astype(np.float64) @ ref.T) / scale
        errs[f"{qt.name} T={t}"] = float(err.max())
print(json.dumps({"wide": kernel_wide.WIDE, "errs": errs}))
"""


@background.job
def portable_dots(folder: Path):
    """The Q4_K and Q6_K products compiled for numba's generic x86-64 from nothing."""
    env = {k: None for k in os.environ if k.startswith("NUMBA_CPU_")}
    env.update(NUMBA_CACHE_DIR=str(folder / "numba"), NUMBA_CPU_NAME="generic")
    return background.python(_PORTABLE_DOTS, env=env)


@pytest.mark.background("portable_dots")
def test_k_quant_products_without_avx512_are_the_portable_ones():
    """The Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 dots are written for AVX-512
    (kernel_wide.WIDE). Compiled for a CPU without it (numba's generic x86-64, as a
    portable build would be), where LLVM could not lower one AVX-512 instruction, the
    products take the numba dots and the dequantize-then-dot kernel instead, and are
    as exact. Checked on Q4_K and Q6_K: the other types take the same ``if WIDE``
    branches of kernel_dots._dot and _dot_rows2, and compiling their dots a second time
    for this CPU added 80-100 s to the suite (measured, 2026-12-06). The compile (~90 s)
    runs in the background from the session's start (tests/background.py)."""
    run = background.result("portable_dots")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["wide"] is False
    assert len(got["errs"]) == 4
    assert all(e < TOL for e in got["errs"].values()), got


_SCRATCH_ANY_ALIGNMENT = """
import json
import numpy as np
from numba import njit
from gguf import quants
from gguf import GGMLQuantizationType as Q
from core.model import kernel_wide as D
from tests.tiny_gguf import random_matrix

@njit
def four_rows(w, x, xs, y, acc):
    for r in range(w.shape[0]):
        D._dot_block_rows(12, 4, w[r], x, xs, 0, y, r, acc)

rng = np.random.default_rng(5)
data = random_matrix(Q.Q4_K, 5, 512, rng)  # (5, row bytes)
ref = quants.dequantize(data, Q.Q4_K).reshape(5, 512).astype(np.float64)
x = rng.standard_normal((4, 512)).astype(np.float32)
xs = x.reshape(4, 16, 32).sum(axis=2, dtype=np.float32)  # (4, 16) sums per 32
raw = np.zeros(4 * D.ROW_LANES + 16, dtype=np.float32)
k = next(k for k in range(8) if (raw[k:].ctypes.data % 32) == 16)
acc = raw[k : k + 4 * D.ROW_LANES].reshape(4, D.ROW_LANES)  # 16 bytes past a 32-byte line
y = np.zeros((4, 5), dtype=np.float32)
four_rows(data, x, xs, y, acc)
err = np.abs(y - x.astype(np.float64) @ ref.T) / (np.abs(x.astype(np.float64)) @ np.abs(ref).T)
print(json.dumps({"misaligned": acc.ctypes.data % 32, "err": float(err.max())}))
"""


def test_the_wide_many_row_dot_takes_scratch_at_any_alignment():
    """Regression: _k_block_rows stored Q4_K's mins as an 8-float vector with LLVM's
    default alignment for it (32 bytes), so a scratch row not on a 32-byte boundary
    segfaulted. numba's own arrays are 32-byte aligned, so the engine never hit it; a
    numpy array 16 bytes past one did, in a bench. Every vector access now states the
    4-byte alignment a float has."""
    from core.model import kernel_wide

    if not kernel_wide.WIDE:
        pytest.skip("the 512-bit dots are compiled only where numba targets AVX-512")
    run = run_fresh(_SCRATCH_ANY_ALIGNMENT)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["misaligned"] == 16
    assert got["err"] < TOL, got


def test_the_k_quant_dots_take_avx512_where_the_cpu_has_it():
    """On a CPU with AVX-512 (kernel_base passes the host's features to numba), the
    K-quants' decode dots are the 512-bit ones, which the product tests above then
    check; a CPU without it never compiles them."""
    import llvmlite.binding as llvm

    from core.model import kernel_base, kernel_dots

    host = bool(llvm.get_host_cpu_features().get("avx512f"))
    assert kernel_dots.WIDE is host
    assert kernel_base.target_has("avx512f") is host


def test_wide_vectors_on_avx512_unless_the_user_chose(tmp_path):
    """kernels.py asks LLVM for 512-bit vectors on a CPU with AVX-512 (the dots ran
    faster so); a NUMBA_CPU_FEATURES the user set is kept as it is."""
    import os
    import subprocess
    import sys

    import llvmlite.binding as llvm

    code = "import core.model.kernels, numba.core.config as c; print(c.CPU_FEATURES)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    features = run.stdout.strip()
    if llvm.get_host_cpu_features().get("avx512f"):
        assert features.endswith(",-prefer-256-bit") and "+avx512f" in features, run.stderr
    else:
        assert features == "None", run.stderr
    env["NUMBA_CPU_FEATURES"] = "+avx2"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "+avx2", run.stderr


def test_old_kernel_cache_folders_are_deleted_when_unused_for_two_weeks(tmp_path):
    """Every update of the kernels leaves its predecessor's cache folder behind; one no
    process has used for STALE_CACHE_DAYS goes, this version's and anything not
    named by a digest stay, and this version's is marked used (loading from a cache
    writes nothing)."""
    import os
    import time

    from core.model import kernel_base

    now = time.time()
    old_age = now - (kernel_base.STALE_CACHE_DAYS + 1) * 86400
    recent_age = now - (kernel_base.STALE_CACHE_DAYS - 1) * 86400
    folders = {}
    for name, age in [
        ("kernels-old", old_age),
        ("kernels-recent", recent_age),
        ("kernels-mine", old_age),
        ("somebody-else", old_age),
    ]:
        d = tmp_path / name
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "k.nbc").write_bytes(b"x")
        os.utime(d, (age, age))
        folders[name] = d
    gone = kernel_base.prune_caches(tmp_path, "kernels-mine", now=now)
    assert gone == [folders["kernels-old"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernels-mine",
        "kernels-recent",
        "somebody-else",
    ]
    assert folders["kernels-mine"].stat().st_mtime == now
    # Mixdesk's own folder (no NUMBA_CACHE_DIR set): numba's per-module folders that
    # versions before the digest layout wrote straight into it go too, when as old
    os.utime(folders["kernels-mine"], (old_age, old_age))
    gone = kernel_base.prune_caches(tmp_path, "kernels-mine", now=now, legacy=True)
    assert gone == [folders["somebody-else"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels-mine", "kernels-recent"]
    # a root that cannot be read or written is left as it is, and the load goes on
    assert kernel_base.prune_caches(tmp_path / "missing" / "file.txt" / "x", "k") == []


_SHARED_FIRST_COMPILE = """
import os, json
os.cpu_count = lambda: 2  # a 2-core machine, whatever this one is
from core.model import kernels, quant
quant.warm_up(["Q4_0", "Q5_0", "Q8_0"])
stats = {n: getattr(kernels, "small_" + n).stats for n in ("q4_0", "q5_0", "q8_0")}
print(json.dumps({n: [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
                  for n, s in stats.items()}))
print(json.dumps([t for t in ("Q4_0", "Q5_0", "Q8_0") if not quant._cached(quant.T[t])]))
"""

_SERVED_FROM_THE_SHARED_CACHE = """
import json, numpy as np
from gguf import quants, GGMLQuantizationType as Q
from core.model import kernels, quant
from tests.tiny_gguf import random_matrix
rng, worst = np.random.default_rng(0), 0.0
for qt in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
    data = random_matrix(qt, 40, 512, rng)
    w = quants.dequantize(data, qt).reshape(40, 512).astype(np.float64)
    m = quant.QuantMatrix(qt, data, (40, 512))
    for t in (1, 3):
        x = rng.standard_normal((t, 512)).astype(np.float32)
        err = np.abs(m.matmul(x) - x @ w.T) / (np.abs(x) @ np.abs(w).T)
        worst = max(worst, float(err.max()))
    assert np.array_equal(m.take([3]), w[3:4].astype(np.float32))
misses = sum(sum(getattr(kernels, k + "_" + n).stats.cache_misses.values())
             for k in ("rows", "small") for n in ("q4_0", "q5_0", "q8_0"))
print(json.dumps([worst, misses]))
"""


@background.job
def shared_first_compile(folder: Path):
    """Three types compiled from nothing by a process and its helper, then a third
    process served from their cache (once the first has succeeded)."""
    env = {"NUMBA_CACHE_DIR": str(folder / "numba")}
    first = background.python(_SHARED_FIRST_COMPILE, env=env)
    if first.returncode != 0:
        return first, None, folder
    return first, background.python(_SERVED_FROM_THE_SHARED_CACHE, env=env), folder


@pytest.mark.background("shared_first_compile")
def test_a_first_compile_shares_the_types_with_a_helper_process():
    """With an empty kernel cache and several types, every other type is compiled by a
    second process into the shared disk cache, and this process loads it from there
    (numba's own hit and miss counts); a type already cached spawns nothing.

    The two processes write the cache at once, so only per-type entry points may go
    there (kernel_base._jit): a shared helper's index written by both once gave a type
    another type's code, and every later load segfaulted. So the cache holds entry
    points only, and a third process serves every type from it correctly. (The
    compiles run in the background from the session's start: tests/background.py.)"""
    run, check, folder = background.result("shared_first_compile")
    assert run.returncode == 0, run.stderr
    counts, again = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    assert counts["q5_0"] == [1, 0]  # the helper's: loaded from the cache
    assert counts["q4_0"][1] == 1 and counts["q8_0"][1] == 1  # compiled here
    assert again == []  # all cached now: a next load starts no helper
    cached = sorted({p.name.split("-")[0] for p in (folder / "numba").rglob("*.nbi")})
    assert cached == ["kernel_attn.attention_f32_f32"] + [
        f"kernels.{k}_{n}" for k in ("rows", "small") for n in ("q4_0", "q5_0", "q8_0")
    ]  # and decoding attention's over an f32 cache, which every load compiles here
    assert check.returncode == 0, check.stderr  # (a segfault is -11)
    worst, misses = json.loads(check.stdout.strip().splitlines()[-1])
    assert misses == 0 and worst < TOL  # every type from the cache, each its own code


_FROZEN_APPS_HELPER = """
import os, sys, json
os.cpu_count = lambda: 2
sys.frozen, sys.executable = True, {app!r}
from core.model import kernels, quant
spawned = quant._compile_elsewhere([quant.T.Q4_0, quant.T.Q5_0])
(proc,) = set(spawned.values())
print(json.dumps([sorted(t.name for t in spawned), proc.wait()]))
quant.warm_up(["Q5_0"], helpers=False)  # Q4_0 was left to this process: not needed here
s = kernels.small_q5_0.stats
print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values())]))
"""


@background.job
def frozen_apps_helper(folder: Path):
    """A "packaged app" (a script running main.py as a frozen app) asked by a loading
    process to compile a type; what each said, and the types the app was asked for."""
    import stat
    import sys

    app = folder / "mixdesk"
    app.write_text(
        f"#!/bin/sh\n"
        f'echo "$MIXDESK_COMPILE_KERNELS" >> {folder / "asked"}\n'
        f'exec {sys.executable} -c \'import sys; sys.frozen, sys.executable = True, "{app}"; '
        f'import main; r = main.main(); sys.exit(99 if "PySide6" in sys.modules else r)\'\n'
    )  # frozen as the app is: numba then stamps its cache with the executable's file
    app.chmod(app.stat().st_mode | stat.S_IEXEC)
    code = _FROZEN_APPS_HELPER.format(app=str(app))
    run = background.python(code, env={"NUMBA_CACHE_DIR": str(folder / "numba")})
    asked = folder / "asked"
    return run, asked.read_text() if asked.exists() else None


@pytest.mark.background("frozen_apps_helper")
def test_the_packaged_apps_helper_is_the_app_itself_started_to_compile():
    """In the packaged app sys.executable is the app: its helper is the app started with
    quant.COMPILE_ENV naming the types, which main.py compiles before parsing any flag
    (and without importing Qt). Here the "app" is a script running main.py as a frozen
    app (sys.frozen, sys.executable), and the helper's type is then a numba cache hit in
    the loading process. (In the background from the session's start.)"""
    run, asked = background.result("frozen_apps_helper")
    assert run.returncode == 0, run.stderr
    helper, counts = (json.loads(line) for line in run.stdout.strip().splitlines()[-2:])
    assert helper == [["Q5_0"], 0]  # the app compiled Q5_0 and exited cleanly, Qt-free
    assert asked is not None and asked.split() == ["Q5_0"]
    assert counts == [1, 0]  # the app's compile is what this process loaded
