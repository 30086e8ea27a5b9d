"""Quantized weights against the float32 path and against llama-server, in one run.

    .venv/bin/python -m bench.weights [-m MODEL] [--vs-llama-server] [--no-f32] [--no-q8]
        [--no-compile] [--quick]

Each side runs in its own fresh process, one after the other on the same file, so
that its peak RSS and its start are its own: Mixdesk with ``--weights quantized``
(the GGUF's blocks in memory, compiled kernels), the same with ``--activations q8``
(the opt-in speed mode; skipped on a CPU without VNNI), Mixdesk with ``--weights f32``
(today's dequantized path; its float32 cache is written first, untimed), and with
``--vs-llama-server`` llama-server itself, built from the pinned llama-cpp-python
sdist as tools/compat.py builds it, run ``-t THREADS -c CTX``. Every figure is
printed with its ratio to the others measured in this same run.

Measured per side: ready after start (process start to the first request being
answerable: Mixdesk's ``Engine.load_model``, llama-server's ``/health``), one
stream's decode (64 greedy tokens, 2 rounds, best), a 512-token prefill, one
stream's decode after a LONG-token prompt (64 tokens, once; 256 with --quick), 8 streams
under 8 different LoRA mixes (Mixdesk only: llama-server batches one mix), and peak
RSS serving one stream at CTX context. Last, the file's block types compiled in a
fresh process with an empty kernel cache (a first-ever start), then again from that
cache (what the kernels add to a warm start). The default model is the 1B-shaped Q4_K_M
of tools/make_1b.py, written to the cache on first use.

Run it on an idle machine, with OpenBLAS on its native kernels as a user's machine
has it: ``make bench-weights`` unsets OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PREFILL = 512  # prompt tokens of the prefill figure
# prompt tokens before the "decode, long prompt" figure: a long chat, where every
# token's attention reads all the keys and values before it (--quick: 256)
LONG = 2048
DECODE = 64  # tokens of the decode figure
THREADS = 2


def default_model() -> Path:
    """The 1B-shaped Q4_K_M of tools/make_1b.py, made once in the cache dir."""
    from core.paths import cache_dir

    out = cache_dir() / "bench" / "llama-3.2-1b-shaped-q4_k_m.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {out} (tools/make_1b.py, once)", flush=True)
        subprocess.run([sys.executable, str(REPO / "tools" / "make_1b.py"), str(out)], check=True)
    return out


def prompt_tokens(n: int, vocab: int) -> list[int]:
    """A fixed prompt of n ordinary token ids (the same for every side)."""
    rng = np.random.default_rng(7)
    return [int(t) for t in rng.integers(1000, min(vocab, 30000) - 1, size=n)]


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- one Mixdesk side, in a child process ----------------------------------------------------
def child(storage: str, model: Path, ctx: int, quick: bool, t0: float) -> dict:
    """One side's figures; ``t0``: the wall clock when the parent started this process
    (ready_s counts Python's start and imports too, as llama-server's counts its own)."""
    from bench.engine import GREEDY, bench_adapters, eight_mixes, run_streams
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from core.serve.sampling import SamplingParams

    # "q8": quantized weights times activations rounded to int8 (--activations q8)
    weights, activations = ("quantized", "q8") if storage == "q8" else (storage, "f32")
    opts = EngineOptions(
        weights=weights,
        activations=activations,
        ctx_size=ctx,
        n_parallel=8,
        draft_max=0,
        threads=THREADS,
    )
    eng = Engine(opts)
    eng.load_model(model)
    eng.start()
    out: dict = {"ready_s": time.time() - t0, "memory_mb": eng.model.w.nbytes / 1e6}
    out["activations"] = eng.model_info()["activations"]
    if quick is None:  # only load (the float32 cache is written so, untimed)
        return out
    vocab = eng.config.vocab_size
    n_dec = 16 if quick else DECODE

    def one(prompt, n, mix=None):
        done = eng.complete(
            prompt, SamplingParams(n_predict=n, **GREEDY), mix=mix, cache_prompt=False
        )
        return done.timings

    short = prompt_tokens(16, vocab)
    one(short, 4)  # warm: first-touch of the weights' pages, the KV pages
    decode = max(
        t.predicted_n / (t.predicted_ms / 1e3) for t in (one(short, n_dec) for _ in range(2))
    )
    out["decode_tok_s"] = decode
    pre = one(prompt_tokens(PREFILL, vocab), 1)
    out["prefill_tok_s"] = pre.prompt_n / (pre.prompt_ms / 1e3)
    out["peak_rss_mb"] = peak_rss_mb()  # one stream served, the prefill included
    t = one(prompt_tokens(256 if quick else LONG, vocab), n_dec)
    out["long_decode_tok_s"] = t.predicted_n / (t.predicted_ms / 1e3)

    with tempfile.TemporaryDirectory() as tmp:
        ids, _ = bench_adapters(eng, Path(tmp))
        mixes = eight_mixes(ids)

        def streams(mixes_: list) -> tuple[float, float]:
            prompts = [prompt_tokens(16 + k, vocab)[k:] for k in range(len(mixes_))]
            return run_streams(eng, prompts, mixes_, n_dec)

        for m in mixes:  # build the mixes first: their build is not decode time
            eng.complete(short, SamplingParams(n_predict=1, **GREEDY), mix=m, cache_prompt=False)
        # the ratio's two sides are timed alike, in the same minute: one stream through
        # the same submission (its prompt included) right after the 8, best of 2 each
        (wall8, dec8), (wall1, dec1) = (0.0, 0.0), (0.0, 0.0)
        for _ in range(2):
            w8, d8 = streams(mixes)
            w1, d1 = streams(mixes[:1])
            wall8, dec8, wall1, dec1 = max(wall8, w8), max(dec8, d8), max(wall1, w1), max(dec1, d1)
        out["streams8_tok_s"] = wall8
        out["streams8_ratio"] = wall8 / wall1
        out["streams8_decode_tok_s"] = dec8
        out["streams8_decode_ratio"] = dec8 / dec1
    eng.stop()
    return out


def run_child(storage: str, model: Path, ctx: int, quick: bool | None) -> dict:
    cmd = [sys.executable, "-m", "bench.weights", "--child", storage, "-m", str(model)]
    cmd += ["--ctx", str(ctx), "--t0", repr(time.time())]
    cmd += ["--quick"] if quick else ["--load-only"] if quick is None else []
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench child ({storage}) failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- llama-server ----------------------------------------------------------------------------
def llama_server_binary(given: str | None) -> Path:
    if given:
        return Path(given)
    if os.environ.get("MIXDESK_LLAMA_SERVER"):
        return Path(os.environ["MIXDESK_LLAMA_SERVER"])
    sys.path.insert(0, str(REPO / "tools"))
    import compat  # tools/compat.py: the pinned sdist, built once in the cache

    return compat.build_llama_server(compat.fetch_sdist(None))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def llama_server(binary: Path, model: Path, ctx: int, quick: bool, vocab: int) -> dict:
    port = 18000 + os.getpid() % 1000
    cmd = [str(binary), "-m", str(model), "-t", str(THREADS), "-c", str(ctx), "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "-np", "1", "--no-webui"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - t0
        n_dec = 16 if quick else DECODE
        short = prompt_tokens(16, vocab)

        def one(prompt, n):
            body = dict(prompt=prompt, n_predict=n, temperature=0, ignore_eos=True)
            return _post(url + "/completion", dict(body, cache_prompt=False))["timings"]

        one(short, 4)
        decode = max(one(short, n_dec)["predicted_per_second"] for _ in range(2))
        pre = one(prompt_tokens(PREFILL, vocab), 1)
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        rss = next(int(s.split()[1]) / 1024 for s in status if s.startswith("VmHWM:"))
        long = one(prompt_tokens(256 if quick else LONG, vocab), n_dec)
        return {
            "ready_s": ready,
            "decode_tok_s": decode,
            "prefill_tok_s": pre["prompt_per_second"],
            "peak_rss_mb": rss,
            "long_decode_tok_s": long["predicted_per_second"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- the report ------------------------------------------------------------------------------
def report(model: Path, sides: dict[str, dict]) -> None:
    q = sides["quantized"]
    print(f"model {model.name}: quantized weights {q['memory_mb']:.0f} MB in memory")
    rows = [
        ("decode, one stream", "decode_tok_s", "tok/s", True),
        (f"prefill, {PREFILL} tokens", "prefill_tok_s", "tok/s", True),
        ("ready after start", "ready_s", "s", False),
        ("peak RSS, one stream", "peak_rss_mb", "MB", False),
        # Mixdesk keeps keys and values in float32 (as the llama.cpp references were
        # recorded), llama-server in float16 by default: half the bytes to read
        ("decode, long prompt", "long_decode_tok_s", "tok/s", True),
    ]
    for mine in ("quantized", "q8"):  # q8: --activations q8, the opt-in speed mode
        if mine not in sides:
            continue
        if mine == "q8":
            print("with --activations q8 (activations rounded to int8, VNNI products):")
        m = sides[mine]
        for label, key, unit, _ in rows:
            line = f"{label:<24} {mine} {m[key]:8.1f} {unit}"
            for other in ("f32", "llama-server") + (("quantized",) if mine == "q8" else ()):
                if other in sides:
                    v = sides[other][key]
                    line += f" | {other} {v:8.1f} {unit} ({mine} = {m[key] / v:.2f}x)"
            print(line)
        line = f"{'8 streams x 8 mixes':<24} {mine} {m['streams8_tok_s']:8.1f} tok/s = "
        line += f"{m['streams8_ratio']:.2f}x one stream timed alike (prompts included)"
        if "f32" in sides and mine == "quantized":
            line += f" | f32 {sides['f32']['streams8_ratio']:.2f}x"
        print(line)
        line = f"{'  decode only':<24} {mine} {m['streams8_decode_tok_s']:8.1f} tok/s = "
        line += f"{m['streams8_decode_ratio']:.2f}x one stream's decode"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="16 decode tokens, for a smoke run")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 path")
    ap.add_argument("--no-q8", action="store_true", help="skip --activations q8")
    ap.add_argument(
        "--no-compile", action="store_true", help="skip the first-ever compile of the file's types"
    )
    ap.add_argument("--vs-llama-server", action="store_true")
    ap.add_argument("--llama-server", help="a llama-server binary (default: build the pinned one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    model = Path(a.model) if a.model else default_model()
    if a.child:
        quick = None if a.load_only else a.quick
        print(json.dumps(child(a.child, model, a.ctx, quick, a.t0 or time.time())))
        return
    from threadpoolctl import threadpool_info

    blas = [f"{i['internal_api']} {i.get('architecture')}" for i in threadpool_info()]
    print(f"BLAS {'; '.join(blas)}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}")
    sides = {"quantized": run_child("quantized", model, a.ctx, a.quick)}
    if not a.no_q8:
        q8 = run_child("q8", model, a.ctx, a.quick)
        if q8["activations"] == "q8":
            sides["q8"] = q8
        else:
            print("--activations q8: this CPU has no VNNI; not measured")
    if not a.no_f32:
        run_child("f32", model, 256, None)  # writes the float32 cache, untimed
        sides["f32"] = run_child("f32", model, a.ctx, a.quick)
    if a.vs_llama_server:
        from core.model.weights import open_model_file

        vocab = open_model_file(model)[1].vocab_size
        sides["llama-server"] = llama_server(
            llama_server_binary(a.llama_server), model, a.ctx, a.quick, vocab
        )
    report(model, sides)
    if not a.no_compile:
        print(compile_line(model), flush=True)


def compile_line(model: Path) -> str:
    """The first-ever compile of this file's block types (an empty kernel cache, in a
    fresh process, helpers as a load runs them), and what the cached kernels then add
    to a warm start."""
    from bench.kernels import compile_times
    from core.gguf.reader import GGUFFile
    from core.model import quant

    types = sorted({t.qtype for t in GGUFFile(model).tensors.values()} & quant.SUPPORTED)
    names = [t.name for t in types if t.name != "F32"]
    return compile_times(names) + " (target: a warm start adds <= 0.5 s)"


if __name__ == "__main__":
    main()
