"""Engine benchmark: every speed is printed next to a ratio measured in the same run.

    .venv/bin/python -m bench.engine [--quick] [-m MODEL]

Roofline: one pass of ``x @ W.T`` over float32 matrices of the model's fused
shapes (QKV, O, gate|up, down per layer, plus the output matrix), at batch 1
(decode) and batch 512 (prefill). Nothing the engine does can beat pure BLAS on
the same shapes, so "ratio" says how close to numpy's physical limit we are.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.default_model import ensure_default_model  # noqa: E402
from core.errors import UserError  # noqa: E402
from core.model import layout, quant  # noqa: E402
from core.model.weights import load_weights, open_model_file  # noqa: E402
from core.options import EngineOptions
from core.serve.engine import Engine  # noqa: E402
from core.serve.sampling import SamplingParams  # noqa: E402
from tests.reference import reference_dir  # noqa: E402

REF_ADAPTERS = reference_dir() / "adapters"
# llama.cpp's reference adapters per architecture (tests/data/llamacpp/adapters); the
# llama ones are SmolLM2's, so another llama-shaped model (a 1B) gets none that fit
REF_ADAPTER_FILES = {
    "llama": ("lora_attn.gguf", "lora_ffn.gguf", "lora_all_q8.gguf"),
    "qwen2": ("qwen2_lora_qv.gguf", "qwen2_lora_mlp.gguf"),
    "gemma3": ("gemma3_lora_qkv.gguf", "gemma3_lora_all.gguf"),
}
N_ADAPTERS = 3  # the mixes below use three adapters
RANDOM_RANK = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)
# A fixed passage for the "copy" task (outputs that repeat their context are where
# prompt-lookup drafts pay off); fixed so the figure is comparable between runs.
COPY_TEXT = (
    "Mixdesk is a desktop mixing desk for LoRA adapters. You open one base model, add the "
    "adapters you trained, and move a fader per adapter to decide how much of each style "
    "goes into the next reply. Changing the mix never reloads the model, because the "
    "adapters are applied as small low-rank corrections on top of the shared base weights. "
    "Requests with different mixes still run together in one batch, and a prompt that was "
    "already processed under a mix is reused the next time that same mix comes back. The "
    "same session is served over an HTTP API that speaks the llama-server dialect, so "
    "scripts and the window always see the same adapters and the same faders."
)


def best_of(fn, n=3):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def step_times(lin) -> str:
    """The 8-row calibration steps the choice came from, e.g. '; 8-row steps: gemm
    20.8 ms, blocked 16.4 ms' (core/model/linear.py: Linear.calibrate)."""
    if not lin.step_times:
        return ""
    return "; 8-row steps: " + ", ".join(
        f"{r} {s * 1e3:.1f} ms"
        for r, s in sorted(lin.step_times.items(), key=lambda i: i[0] != "gemm")
    )


def roofline(model, batch: int, reps: int, regime: str | None = None) -> float:
    """tok/s of the pure matmuls at this batch size: every fused weight matrix once.
    Batch 1 as a gemv (``W @ x``, as the engine decodes one stream); more rows as
    ``x @ W.T`` (OpenBLAS's own choice of kernel), or with ``regime`` in one of the
    engine's small-batch regimes (core/model/linear.py: "blocked" products on our threads,
    or "gemm", OpenBLAS's packed gemm on its threads)."""
    w = model.w
    mats = [m for lw in w.layers for m in lw.projections] + [w.output]
    xs = {m.shape[1]: np.random.rand(batch, m.shape[1]).astype(np.float32) for m in mats}

    def run():
        for m in mats:
            if not isinstance(m, np.ndarray):  # GGUF blocks: their own compiled product
                m.matmul(xs[m.shape[1]])
            elif batch == 1:
                m @ xs[m.shape[1]][0]
            else:
                xs[m.shape[1]] @ m.T

    def run_regime():
        with model.lin.small_batch(regime):
            for m in mats:
                if not isinstance(m, np.ndarray):
                    m.matmul(xs[m.shape[1]])
                else:
                    model.lin.small_product(regime, xs[m.shape[1]], m)

    fn = run_regime if regime else run

    def timed() -> float:
        # untimed passes for 0.2 s first: a pass right after another regime's pays for
        # its threads (OpenBLAS's spinning after a gemm; the batch-8 blocked figure,
        # timed right after the gemm one, swung from 100 to 245 tok/s between runs)
        t0, n = time.perf_counter(), 0
        while n < 1 or time.perf_counter() - t0 < 0.2:
            fn()
            n += 1
        return batch / best_of(fn, reps)

    # on a thread that ends with it: compiled kernels launched from this (main) thread
    # would leave an OpenMP team beside the engine thread's for the rest of the run,
    # and every decode figure after it read ~20% low (core/model/quant.py)
    return quant.on_passing_thread(timed)


def kernel_rates() -> tuple[float, float]:
    """Weights per second one thread streams through: a gemv over one row, and the
    small-matrix NT kernel (core/model/linear.py: x @ Wbᵀ per 64-row block) over 8 rows, on
    blocks larger than this machine's L3."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    w = rng.random((800, 64, 576), dtype=np.float32)  # 118 MB of 64-row blocks
    flat = w.reshape(-1, 576)
    x1 = rng.random(576, dtype=np.float32)
    x8 = rng.random((8, 576), dtype=np.float32)
    with threadpool_limits(1):
        t1 = best_of(lambda: flat @ x1, 10)
        t8 = best_of(lambda: np.matmul(x8, w.transpose(0, 2, 1)), 10)
    return w.size / t1 / 1e9, w.size / t8 / 1e9


def blas_header() -> str:
    try:
        from threadpoolctl import threadpool_info

        info = [
            f"{i['internal_api']} {i.get('version')} {i.get('architecture')} "
            f"threads={i['num_threads']}"
            for i in threadpool_info()
            if i["user_api"] == "blas"
        ]
    except Exception as e:  # pragma: no cover
        info = [f"threadpoolctl unavailable: {e}"]
    core = os.environ.get("OPENBLAS_CORETYPE")
    return "BLAS: " + "; ".join(info) + (f"  (OPENBLAS_CORETYPE={core})" if core else "")


def timed_completion(eng, prompt, n, mix=None, cache_prompt=True):
    t0 = time.perf_counter()
    first = None
    done = None
    for ev in eng.generate(
        prompt, SamplingParams(n_predict=n, **GREEDY), mix=mix, cache_prompt=cache_prompt
    ):
        if first is None and ev.kind == "token":
            first = time.perf_counter() - t0
        if ev.kind == "done":
            done = ev
    return first, done


def tokenizer_lines(path: Path) -> list[str]:
    """One line per model: tokenizer build time and cold encode speed per character of
    a fixed, varied text (few repeated words: the word caches do not hide the merge
    cost), with the ratio to SmolLM2 (the default model)."""
    from core import catalog
    from core.gguf.reader import GGUFFile
    from core.tokenizer import Tokenizer

    readme = (reference_dir() / "README.md").read_text()
    text = (COPY_TEXT + "\n" + readme + "\nnaïve café — déjà vu 日本語のテキスト 🙂 1234567")[:8192]
    paths = [path] + [
        p
        for m in catalog.CATALOG
        if (p := catalog.model_path(m)).is_file() and p.resolve() != path.resolve()
    ]
    figures = []
    for p in paths:
        meta = GGUFFile(p).metadata
        t = time.perf_counter()
        fresh = Tokenizer.from_metadata(meta)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        n_tok = len(fresh.encode(text))
        enc_s = time.perf_counter() - t
        figures.append((p.name, fresh.vocab_size, build_s, n_tok, enc_s / len(text) * 1e6))
    smol = next((f[4] for f in figures if f[0] == catalog.find("smollm2-135m").file_name), None)
    lines = []
    for name, vocab, build_s, n_tok, us in figures:
        ratio = f", {us / smol:.2f}x SmolLM2's" if smol else ""
        lines.append(
            f"tokenizer {name} ({vocab} tokens): build {build_s * 1e3:.0f} ms (target <= 500 ms), "
            f"cold encode of {len(text)} chars -> {n_tok} tokens, {us:.2f} us/char"
            f"{ratio} (target <= 25 us/char, Gemma 3 about SmolLM2's)"
        )
    return lines


def random_adapter(cfg, out: Path, which: str, seed: int) -> Path:
    """A llama.cpp LoRA GGUF of rank RANDOM_RANK shaped for this model, with random
    weights, on the attention matrices ("attn"), the FFN ones ("ffn") or all: for a
    model no reference adapter fits, so its mixes cost what real ones would."""
    from tests.tiny_gguf import write_lora_gguf

    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.n_layers):
        for e in layout.block(cfg):
            if isinstance(e, layout.Norm):
                continue
            for p in e.parts:
                if which != "all" and not p.tensor.startswith(which):
                    continue
                rows, cols = layout.size(cfg, p.rows), layout.size(cfg, e.cols)
                name = f"blk.{i}.{p.tensor}.weight"
                tensors[name + ".lora_a"] = 0.01 * rng.standard_normal((RANDOM_RANK, cols))
                tensors[name + ".lora_b"] = 0.01 * rng.standard_normal((rows, RANDOM_RANK))
    kv = {"adapter.lora.alpha": float(2 * RANDOM_RANK)}
    return write_lora_gguf(out, tensors, kv=kv, arch=cfg.arch)


def bench_adapters(eng: Engine, tmp: Path) -> tuple[list[int], list[str]]:
    """N_ADAPTERS adapters added to eng: the reference adapters of the model's
    architecture that fit it, topped up with random ones shaped for it. Returns the
    ids and one label per adapter, for the header line."""
    cfg = eng.config
    ids, labels = [], []
    for name in REF_ADAPTER_FILES.get(cfg.arch, ()):
        try:
            ids.append(eng.add_adapter(REF_ADAPTERS / name))
            labels.append(name)
        except UserError:  # made for another model of this architecture
            continue
    for which in ("attn", "ffn", "all")[len(ids) :]:
        f = random_adapter(cfg, tmp / f"random_{which}.gguf", which, seed=len(ids))
        ids.append(eng.add_adapter(f))
        labels.append(f"random rank-{RANDOM_RANK} {which}")
    return ids[:N_ADAPTERS], labels[:N_ADAPTERS]


def load_targets(n_params: int) -> tuple[float, float]:
    """(cold, warm) load targets in seconds: SmolLM2's 3 and 1, and issue #18's 30 and
    2 for a 1B; cold grows with the weights to dequantize (~24 s per billion)."""
    return max(3.0, 24.0 * n_params / 1e9), (1.0 if n_params < 5e8 else 2.0)


def rss_split() -> str:
    """Resident memory right now, anonymous vs file-backed (the mapped weight cache
    counts there, shared with the page cache, not a copy); Linux only."""
    try:
        kb = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile"):
                kb[k] = int(v.split()[0])
        return f"anon {kb['RssAnon'] / 1024:.0f} MB, file-backed {kb['RssFile'] / 1024:.0f} MB"
    except (OSError, KeyError, ValueError):
        return "n/a"


def peak_rss_mb(reset: bool = False) -> float | None:
    """The process's peak resident memory since start or the last reset (VmHWM), in MB;
    ``reset`` then starts a new peak (writing 5 to /proc/self/clear_refs), so each bench
    section's own peak can be told apart. None where Linux's files are missing."""
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        kb = next(
            int(v.split()[0]) for k, _, v in (s.partition(":") for s in status) if k == "VmHWM"
        )
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return kb / 1024
    except (OSError, StopIteration, ValueError):
        return None


# Further sections live in their own modules, each a ``run(ctx: BenchContext)`` that
# prints its lines (speeds next to ratios measured in the same run). They run in this
# order after the engine figures above, on the same loaded engine.
SECTIONS: tuple[str, ...] = (
    "bench.merge",
    "bench.grid",
    "bench.http",
    "bench.embeddings",
    "bench.score",
)


@dataclass
class BenchContext:
    eng: Engine  # loaded, started, draft_max 0, 8 slots of 2048
    path: Path  # the model file
    args: argparse.Namespace
    ids: list[int]  # the reference adapters added to eng (empty if they do not fit)
    prompt: list[int]  # n_prefill random tokens
    n_decode: int
    n_prefill: int


STREAM_SCALES = (0.5, 1, -0.5, 1.5, 0.25, -1, 2)  # the 8 streams' mixes: {} + one each


def eight_mixes(ids: list[int]) -> list[dict[int, float]]:
    """The "8 streams x 8 mixes" figure's mixes, here and in bench.http: no adapter,
    then one adapter at each STREAM_SCALES scale (no adapters: 8 empty mixes)."""
    if not ids:
        return [{}] * 8
    return [{}] + [{ids[i % len(ids)]: s} for i, s in enumerate(STREAM_SCALES)]


def run_streams(eng: Engine, prompts: list, mixes: list, n: int) -> tuple[float, float]:
    """One stream per mix (prompts[k] under mixes[k], n greedy tokens each), submitted at
    once. Aggregate tok/s: (wall clock from submission to the last token, prompts
    included; decode only: the tokens over the longest stream's decode time, as one
    stream's decode figure is timed, llama.cpp batched-bench's S_TG). Results come back
    through callbacks on the engine thread, as the HTTP server and the GUI take them
    (call_soon_threadsafe / a Qt signal): 8 blocking consumer threads would mostly
    measure their own fight for the GIL."""
    done, finished = [], threading.Event()

    def on_event(ev):
        if ev.kind == "done":
            done.append(ev)
            if len(done) == len(mixes):
                finished.set()

    t = time.perf_counter()
    for p, m in zip(prompts, mixes):
        eng.submit(p, SamplingParams(n_predict=n, **GREEDY), on_event, mix=m, cache_prompt=False)
    finished.wait()
    wall = time.perf_counter() - t
    tokens = sum(d.timings.predicted_n for d in done)
    return tokens / wall, tokens / (max(d.timings.predicted_ms for d in done) / 1e3)


def eight_vectors(eng: Engine, tmp: Path) -> list:
    """Eight random control vectors (every layer, components of std 0.1: a real
    vector's size) loaded at scale 0, as eight mixes with one vector each at 1."""
    from core.lora.control import write_control_vector
    from core.lora.mix import Mix

    cfg = eng.config
    rng = np.random.default_rng(37)
    mixes = []
    for k in range(8):
        dirs = {
            n: (0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
            for n in range(1, cfg.n_layers)
        }
        vid = eng.add_control_vector(
            write_control_vector(tmp / f"vec{k}.gguf", dirs, cfg.arch), 0.0
        )
        mixes.append(Mix({}, vectors={vid: 1.0}))
    return mixes


def bench_args() -> tuple[argparse.Namespace, Path, int, int]:
    """The flags every bench takes (-m, --quick): (args, model path, n_decode, n_prefill);
    prints the BLAS header."""
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--quick", action="store_true", help="fewer tokens, for a smoke run")
    ap.add_argument(
        "--weights",
        choices=("quantized", "f32"),
        default="quantized",
        help="the engine's weights (f32: the dequantized path, as before issue 35)",
    )
    args = ap.parse_args()
    path = Path(args.model) if args.model else ensure_default_model(log=lambda m: None)
    print(blas_header())
    return args, path, (32 if args.quick else 128), (128 if args.quick else 512)


def main() -> None:
    args, path, n_decode, n_prefill = bench_args()
    print(f"model: {path.name}   cores: {os.cpu_count()}")

    # -- load -------------------------------------------------------------------
    # Every load here uses a cache dir of the bench's own, removed at exit: the cold
    # load is really cold, and a 1B's 4.9 GB float32 cache is written once, not once
    # here and again in the user's cache. (Removed at exit, not before: the engine
    # maps the cache file for the whole run.)
    tmp = Path(tempfile.mkdtemp(prefix="mixdesk-bench-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    os.environ["MIXDESK_CACHE"] = str(tmp / "cache")
    gf, cfg = open_model_file(path)
    n_params = sum(t.n_elements for t in gf.tensors.values())
    cpu = time.process_time()
    t = time.perf_counter()
    load_weights(gf, cfg)
    cold, cold_cpu = time.perf_counter() - t, time.process_time() - cpu
    t = time.perf_counter()
    load_weights(open_model_file(path)[0], cfg)
    warm_mapped = time.perf_counter() - t
    # draft_max=0: the figures below are plain decoding; speculation is measured last.
    # The first engine load times the small-batch products and stores the choice (as
    # a user's first load on a machine does); "warm" is the load after it.
    eng = Engine(EngineOptions(ctx_size=2048, n_parallel=8, draft_max=0, weights=args.weights))
    t = time.perf_counter()
    eng.load_model(path)
    first = time.perf_counter() - t  # weights cached by now: mostly the calibration
    eng.model.lin.close()
    cpu = time.process_time()
    t = time.perf_counter()
    eng = Engine(EngineOptions(ctx_size=2048, n_parallel=8, draft_max=0, weights=args.weights))
    eng.load_model(path)
    warm, warm_cpu = time.perf_counter() - t, time.process_time() - cpu
    eng.start()
    cold_target, warm_target = load_targets(n_params)
    cache_gb = sum(f.stat().st_size for f in (tmp / "cache" / "weights").glob("*.f32")) / 1e9
    print(
        f"load ({n_params / 1e9:.2f} B params, float32 cache {cache_gb:.2f} GB): "
        f"cold weights {cold:.2f} s, {cold_cpu:.1f} s CPU (target <= {cold_target:.0f})   "
        f"warm to ready {warm:.2f} s, {warm_cpu:.1f} s CPU (target <= {warm_target:.0f}; "
        f"weights map {warm_mapped * 1e3:.0f} ms; first load, timing the products, "
        f"{first:.2f} s)   RSS after: {rss_split()}"
    )

    # -- rooflines ------------------------------------------------------------------
    roof1 = roofline(eng.model, 1, 20)  # best of many: the roofline is an upper bound
    roof8_gemm = roofline(eng.model, 8, 10)
    roof8_blocked = roofline(eng.model, 8, 10, regime="blocked")
    roof8 = max(roof8_gemm, roof8_blocked)
    roof512 = roofline(eng.model, 512, 3)
    rate1, rate8 = kernel_rates()
    print(
        f"roofline (pure BLAS, fused shapes): batch 1 {roof1:.1f} tok/s, batch 512 "
        f"{roof512:.0f} tok/s, batch 8 {roof8_gemm:.1f} tok/s as x @ W.T and "
        f"{roof8_blocked:.1f} tok/s blocked ({roof8 / roof1:.1f}x batch 1 at best; "
        f"the engine calibrated to: {eng.model.lin.describe()}{step_times(eng.model.lin)})"
    )
    print(
        f"kernel (one thread, 118 MB of 64-row blocks): gemv {rate1:.2f} G weights/s for 1 row, "
        f"NT kernel {rate8:.2f} G weights/s for 8 rows ({rate8 / rate1:.2f})"
    )

    # random ordinary tokens of this vocabulary (the first hundred ids hold specials
    # in every family here), after the model's BOS when it has one
    rng = np.random.default_rng(0)
    hi = min(40000, cfg.vocab_size)
    bos = [eng.tokenizer.bos_id] if eng.tokenizer.bos_id is not None else []
    prompt = bos + [int(i) for i in rng.integers(100, hi, size=n_prefill - len(bos))]

    # -- prefill ------------------------------------------------------------------------
    # best of 3, alternating with the batch-512 roofline it is compared with (also
    # best of 3 there): the two must come from the same minute of this VM
    pre = 0.0
    for _ in range(3):
        _, done = timed_completion(eng, prompt, 1, cache_prompt=False)
        pre = max(pre, done.timings.prompt_n / (done.timings.prompt_ms / 1e3))
        roof512 = max(roof512, roofline(eng.model, 512, 1))
    print(
        f"prefill {n_prefill} tok: {pre:.0f} tok/s   ratio to roofline {pre / roof512:.2f} "
        f"(target >= 0.6)"
    )

    # -- decode, 0/1/3 adapters ------------------------------------------------------------
    # Interleaved in short runs, best of 6: on a shared VM a single run can lose 25% to
    # a neighbour, and a ratio of two runs taken minutes apart would measure the neighbour.
    short = prompt[:16]
    ids, labels = bench_adapters(eng, tmp)
    print(f"adapters: {', '.join(labels)}")
    cases = {"0 adapters": {}}
    if ids:
        cases.update({"1 adapter": {ids[0]: 1.0}, "3 adapters": {i: 0.5 for i in ids}})
    decode = {label: 0.0 for label in cases}
    for _ in range(6):
        for label, mix in cases.items():
            _, done = timed_completion(eng, short, n_decode // 2, mix=mix, cache_prompt=False)
            decode[label] = max(
                decode[label], done.timings.predicted_n / (done.timings.predicted_ms / 1e3)
            )
    base = decode["0 adapters"]
    print(
        f"decode {n_decode // 2} tok: {base:.1f} tok/s   ratio to roofline {base / roof1:.2f} "
        f"(target >= 0.7)"
    )
    for label, v in decode.items():
        if label != "0 adapters":
            print(
                f"decode with {label}: {v:.1f} tok/s   slowdown {100 * (1 - v / base):.0f}% "
                f"(3 adapters target <= 15%)"
            )

    # -- tokenizer ----------------------------------------------------------------------------
    # (was a timed test; speed lives here): build from metadata, then a cold-cache encode,
    # for this model and each catalogue model already in the cache (no download), so
    # Gemma 3's 262k SentencePiece vocabulary is compared per character with SmolLM2's BPE
    for line in tokenizer_lines(path):
        print(line)

    # -- mix switch ---------------------------------------------------------------------------
    if ids:
        n = 1000
        t = time.perf_counter()
        for i in range(n):
            eng.set_mix({ids[0]: (i % 7) / 7, ids[1]: -0.5, ids[2]: 0.25})
        sw = (time.perf_counter() - t) / n
        print(f"mix switch: {sw * 1e6:.0f} us (target <= 1000 us)")

        # A -> B -> A time to first token, with a 512-token prompt
        mix_a, mix_b = {ids[0]: 1.0}, {ids[1]: 1.0}
        eng.prefix.clear()
        cold_ttft, _ = timed_completion(eng, prompt, 1, mix=mix_a)
        timed_completion(eng, prompt, 1, mix=mix_b)
        back_ttft, d = timed_completion(eng, prompt, 1, mix=mix_a)
        print(
            f"A->B->A: switch-back TTFT {back_ttft * 1e3:.0f} ms = "
            f"{100 * back_ttft / cold_ttft:.1f}% of cold {cold_ttft * 1e3:.0f} ms "
            f"(target <= 5%; cache_n={d.timings.cache_n})"
        )
        eng.set_mix({})

    # -- 8 concurrent streams, 8 different mixes ----------------------------------------------------
    mixes = eight_mixes(ids)

    def streams(mixes_: list) -> float:
        prompts = [prompt[k : k + 16] for k in range(len(mixes_))]
        return run_streams(eng, prompts, mixes_, n_decode)[0]

    # one stream is measured again right next to the 8 (and 2) streams: the ratio must
    # not compare two different minutes of a VM whose speed drifts (seen: -30% in 3 min)
    # The A/B figure compares like with like: two streams under two adapters against
    # one stream under one of them, both timed the same way (wall clock, prompts
    # included). Against ``one`` (no adapter, decode time only) it read 0.88-1.11x
    # (docs/performance.md), which looked like batching two mixes lost speed.
    # The 8-stream figure is timed alike too: one stream without an adapter through the
    # same submission (prompt included); it divided by a decode-only rate before.
    agg = agg2 = one = one_a = 0.0
    for _ in range(2):
        one = max(one, streams(mixes[:1]))
        agg = max(agg, streams(mixes))
        one_a = max(one_a, streams(mixes[1:2]))
        agg2 = max(agg2, streams(mixes[1:3]))
    # 4x was set when one stream read float32 weights from RAM and eight streams cost
    # little more; on the kernels one stream is ~3x faster and eight rows are bound by
    # their multiplications, so issue 35 set 2.5x for quantized weights
    goal = "4x, the float32 path's" if args.weights == "f32" else "2.5x on quantized weights"
    print(
        f"8 streams x 8 mixes: {agg:.1f} tok/s aggregate = {agg / one:.1f}x one stream "
        f"({one:.1f} tok/s alongside, timed alike; target >= {goal}); ratio to the best "
        f"batch-8 roofline {agg / roof8:.2f}"
    )
    print(
        f"2 streams x 2 mixes (A/B compare): {agg2:.1f} tok/s aggregate = "
        f"{agg2 / one_a:.2f}x one stream under one of the mixes ({one_a:.1f} tok/s, "
        f"timed alike)"
    )

    # -- 8 concurrent streams, 8 different control vectors (#37) -----------------------------
    vecs = eight_vectors(eng, tmp)
    agg_v = one_v = 0.0
    for _ in range(2):
        one_v = max(one_v, streams(vecs[:1]))  # one stream under one vector, timed alike
        agg_v = max(agg_v, streams(vecs))
    print(
        f"8 streams x 8 control vectors: {agg_v:.1f} tok/s aggregate = {agg_v / one_v:.1f}x "
        f"one stream ({one_v:.1f} tok/s alongside, timed alike; as for 8 mixes, one forward a "
        f"step)"
    )
    for vid in eng.lora.vector_ids():
        eng.remove_control_vector(vid)

    # -- prompt-lookup speculative decoding (greedy), on and off --------------------------------
    text = COPY_TEXT
    tasks = {
        "copy": "Repeat the following text exactly, word for word:\n\n" + text,
        "chat": "Tell me about the history of the moon landing.",
    }
    for name, content in tasks.items():
        prompt_t = eng.chat_prompt([{"role": "user", "content": content}])
        speeds, outs = {}, {}
        for dm in (0, 8):
            eng.scheduler.draft_max = dm
            best = 0.0
            for _ in range(2):
                _, d = timed_completion(eng, prompt_t, n_decode)
                best = max(best, d.timings.predicted_n / (d.timings.predicted_ms / 1e3))
            speeds[dm], outs[dm] = best, d.tokens
        print(
            f"speculative (prompt lookup, 8 drafts), {name} task: {speeds[8]:.1f} tok/s vs "
            f"{speeds[0]:.1f} plain = {speeds[8] / speeds[0]:.2f}x; "
            f"identical output: {outs[8] == outs[0]}"
        )
    eng.scheduler.draft_max = 0

    ctx = BenchContext(eng, path, args, ids, prompt, n_decode, n_prefill)
    peaks = {"serving figures above": peak_rss_mb(reset=True)}
    for name in SECTIONS:
        importlib.import_module(name).run(ctx)
        peaks[name.removeprefix("bench.")] = peak_rss_mb(reset=True)

    # the target is SmolLM2's 1536 MB: its float32 weights (0.5 GB) and 1 GB of the rest,
    # for one engine serving with three adapters: every section but the grid, which
    # loads a second engine (ten slots) beside this one
    rss_target = eng.model.w.float32_nbytes / 2**20 + 1024
    if all(v is not None for v in peaks.values()):
        serving = max(v for k, v in peaks.items() if k != "grid")
        print(
            f"peak RSS: {serving:.0f} MB with one engine (target <= {rss_target:.0f} MB with "
            f"three adapters: the float32 weights + 1 GB); {max(peaks.values()):.0f} MB with "
            f"the grid's second engine; now {rss_split()}"
        )
        print("peak RSS by section: " + ", ".join(f"{k} {v:.0f} MB" for k, v in peaks.items()))
    else:  # no VmHWM to reset: the process's peak, all sections together
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"peak RSS: {rss:.0f} MB, the grid's second engine included (target <= "
            f"{rss_target:.0f} MB with three adapters: the float32 weights + 1 GB); "
            f"now {rss_split()}"
        )
    eng.stop()


if __name__ == "__main__":
    main()
