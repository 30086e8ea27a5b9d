"""``make interop``: a mix exported from Mixdesk means the same thing outside it.

Three mixes of the llama.cpp reference adapters on SmolLM2-135M (tests/data/llamacpp/):
a linear sum, a TIES merge, and a mix with a negative scale. Each is exported as a
LoRA GGUF, a merged float32 GGUF and a PEFT folder, then checked against the real
consumers of those files:

* **llama-server** (built from the pinned llama-cpp-python sdist, as ``tools/compat.py``
  builds it, or ``--llama-server-bin`` / ``MIXDESK_LLAMA_SERVER_BIN``) serves the
  dequantized float32 SmolLM2 with ``--lora mix.gguf``, then the merged model, both
  with a float32 KV cache (``-ctk f32 -ctv f32``): its greedy tokens must equal
  Mixdesk's for the same mix, on every reference prompt;
* **PEFT** loads the PEFT folder on the PyTorch model transformers builds from the same
  GGUF weights: its logits over prompt + Mixdesk's greedy continuation must be within
  1e-3 of Mixdesk's (``--atol``).

Everything it writes (the float32 base, the exports, a llama-server build) goes to the
user cache dir (``interop/`` under ``core.paths.cache_dir()``), never the repository.
Not part of ``make test``: building llama-server takes about 25 minutes the first time.

    python tools/interop.py [--llama-server-bin PATH] [--skip-llama-server] [--skip-peft]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(REPO))

N_PREDICT = 16
ATOL = 1e-3
ADAPTERS = ("lora_attn.gguf", "lora_ffn.gguf", "lora_all_q8.gguf")  # ids 0, 1, 2
# (name, {adapter file: scale}, merge method parameters or None for the linear sum)
MIXES = [
    ("linear", {"lora_attn.gguf": 0.7, "lora_ffn.gguf": 0.5}, None),
    ("ties", {"lora_attn.gguf": 0.9, "lora_all_q8.gguf": 0.7}, {"method": "ties", "density": 0.5}),
    ("negative", {"lora_attn.gguf": 0.6, "lora_ffn.gguf": -0.8}, None),
]  # fmt: skip


def work_dir() -> Path:
    from core.paths import cache_dir

    d = cache_dir() / "interop"
    d.mkdir(parents=True, exist_ok=True)
    return d


def prompts() -> list[list[int]]:
    """The reference prompts' token ids (each distinct prompt once)."""
    from tests.reference import reference_dir

    data = json.loads((reference_dir() / "smollm2_f32_llamacpp.json").read_text())
    seen, out = set(), []
    for case in data["greedy"]:
        key = tuple(case["prompt_tokens"])
        if key not in seen:
            seen.add(key)
            out.append(list(key))
    return out


# ---- Mixdesk's side ---------------------------------------------------------------


def load_engine(model: Path):
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from tests.reference import reference_dir

    eng = Engine.from_path(model, EngineOptions(n_parallel=1, ctx_size=512))
    ids = {n: eng.add_adapter(reference_dir() / "adapters" / n, scale=0.0) for n in ADAPTERS}
    return eng, ids


def engine_mix(ids: dict[str, int], scales: dict[str, float], merge: dict | None):
    from core.lora.merge import MergeSpec
    from core.lora.mix import Mix

    spec = MergeSpec.make(**merge) if merge else None
    return Mix({ids[n]: s for n, s in scales.items()}, spec), spec


def greedy(eng, mix, prompt: list[int]) -> list[int]:
    from core.serve.sampling import SamplingParams

    p = SamplingParams(temperature=0.0, n_predict=N_PREDICT, ignore_eos=True)
    return eng.complete(prompt, p, mix=mix, cache_prompt=False).tokens


def all_logits(eng, mix, tokens: list[int]) -> np.ndarray:
    """Logits at every position of ``tokens`` under ``mix`` (its method included):
    (len(tokens), vocab), the engine's own forward as the tests run it."""
    from tests.mixing import mix_logits

    return mix_logits(eng, mix, tokens)


# ---- llama-server's side ----------------------------------------------------------


def llama_server_binary(given: str | None) -> Path:
    if given:
        return Path(given)
    from tools import compat

    return compat.build_llama_server(compat.fetch_sdist(None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, extra: list[str] = ()):
    """A llama-server on ``model`` with a float32 KV cache (``extra``: more flags), on a
    free port of 127.0.0.1, healthy; yields its base URL and stops it after."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
           "-c", "512", "-np", "1", "-t", "2", "-ctk", "f32", "-ctv", "f32", "--no-warmup",
           *extra]  # fmt: skip
    log = open(work_dir() / "llama-server.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}); see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy in 300 s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def served_greedy(binary: Path, model: Path, lora: Path | None, plist: list[list[int]]):
    """llama-server's greedy tokens for each prompt, on ``model`` (+ ``lora`` at 1)."""
    with llama_server(binary, model, ["--lora", str(lora)] if lora is not None else []) as url:
        out = []
        for prompt in plist:
            body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                    "ignore_eos": True, "cache_prompt": False, "return_tokens": True}  # fmt: skip
            out.append(_post(f"{url}/completion", body)["tokens"])
        return out


# ---- PEFT's side ------------------------------------------------------------------


def torch_model(model: Path):
    """The PyTorch LlamaForCausalLM transformers builds from the same GGUF (its loader
    dequantizes every tensor and undoes llama.cpp's Q/K row permutation)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tensor would bury the results
    hf_logging.set_verbosity_error()
    torch.set_num_threads(2)
    m = AutoModelForCausalLM.from_pretrained(
        str(model.parent), gguf_file=model.name, dtype=torch.float32
    )
    return m.eval()


def peft_logits(base, peft_dir: Path, tokens: list[int]) -> np.ndarray:
    import warnings

    import torch
    from peft import PeftModel

    with warnings.catch_warnings():
        # target_modules names module kinds (q_proj, gate_proj, ...) for every layer, and
        # a mix of adapters on some layers has no weights for the others: PEFT creates
        # those with B = 0 (they add nothing) and warns about each "missing adapter key"
        warnings.filterwarnings("ignore", message="Found missing adapter keys")
        m = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    try:
        with torch.no_grad():
            out = m(torch.tensor([tokens])).logits[0].float().numpy()  # (n, vocab)
    finally:
        m.unload()  # the base without the adapter, for the next mix
    return out


# ---- the run ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-server-bin",
        default=os.environ.get("MIXDESK_LLAMA_SERVER_BIN"),
        help="a llama-server built beforehand (default: $MIXDESK_LLAMA_SERVER_BIN, "
        "else built from the pinned sdist into the cache, as make compat does)",
    )
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--atol", type=float, default=ATOL, help="PEFT logits tolerance")
    a = ap.parse_args(argv)

    from core.default_model import ensure_default_model
    from core.lora.export import export_lora, export_merged, export_peft

    model = ensure_default_model(log=print)
    work = work_dir()
    plist = prompts()
    eng, ids = load_engine(model)
    results: list[tuple[str, str, str]] = []  # (mix, check, outcome)
    failed = False
    try:
        f32_base = work / "SmolLM2-135M-Instruct.F32.gguf"
        if not a.skip_llama_server and not f32_base.exists():
            print(f"interop: writing the float32 base {f32_base}")
            export_merged(eng, [], f32_base, outtype="f32", allow_empty=True)
        binary = None if a.skip_llama_server else llama_server_binary(a.llama_server_bin)
        torch_base = None if a.skip_peft else torch_model(model)
        for name, scales, merge in MIXES:
            mix, spec = engine_mix(ids, scales, merge)
            ours = [greedy(eng, mix, p) for p in plist]
            label = ", ".join(f"{n.removesuffix('.gguf')} {s:+g}" for n, s in scales.items())
            label += f" ({merge['method']}, density {merge['density']})" if merge else " (linear)"
            print(f"interop: mix {name}: {label}")
            lora_gguf = work / f"{name}.lora.gguf"
            merged = work / f"{name}.merged-f32.gguf"
            peft_dir = work / f"{name}.peft"
            export_lora(eng, mix, lora_gguf, merge=spec)
            if binary is not None:
                export_merged(eng, mix, merged, outtype="f32", merge=spec)
                for check, gguf, lora in (
                    ("llama-server --lora", f32_base, lora_gguf),
                    ("llama-server merged", merged, None),
                ):
                    theirs = served_greedy(binary, gguf, lora, plist)
                    same = sum(t == o for t, o in zip(theirs, ours))
                    ok = same == len(plist)
                    failed |= not ok
                    results.append(
                        (
                            name,
                            check,
                            f"{same}/{len(plist)} prompts, {N_PREDICT} greedy tokens identical",
                        )
                    )
                    print(f"interop:   {check}: {results[-1][2]}" + ("" if ok else "  FAILED"))
                    if not ok:
                        for p, t, o in zip(plist, theirs, ours):
                            if t != o:
                                print(
                                    f"interop:     prompt {p[:8]}…: llama-server {t} vs Mixdesk {o}"
                                )
                merged.unlink(missing_ok=True)  # 0.5 GB each
            if torch_base is not None:
                export_peft(eng, mix, peft_dir, merge=spec)
                worst = 0.0
                for p, cont in zip(plist, ours):
                    seq = p + cont[:-1]
                    diff = np.abs(
                        peft_logits(torch_base, peft_dir, seq) - all_logits(eng, mix, seq)
                    )
                    worst = max(worst, float(diff.max()))
                ok = worst <= a.atol
                failed |= not ok
                results.append(
                    (name, "PEFT on transformers", f"max |Δ logit| {worst:.2e} (≤ {a.atol:g})")
                )
                print(f"interop:   PEFT: {results[-1][2]}" + ("" if ok else "  FAILED"))
    finally:
        eng.stop()
    print("\n| mix | check | result |\n|---|---|---|")
    for row in results:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")
    print("\ninterop: " + ("FAILED" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
