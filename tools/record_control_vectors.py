"""Record llama-server's control-vector reference data (tests/data/llamacpp/).

Writes two random control vectors for SmolLM2-135M (seeded: the same files every run)
into ``tests/data/llamacpp/control_vectors/``, serves the dequantized float32 SmolLM2
(``tools/interop.py`` writes it) with a float32 KV cache, once per case:

* ``one``: ``--control-vector-scaled cv_a.gguf:0.8``;
* ``two_range``: ``--control-vector-scaled cv_a.gguf:0.6,cv_b.gguf:-1.1
  --control-vector-layer-range 6 21`` (two vectors add up, only layers 6..21 steered);
* ``plain``: ``--control-vector cv_b.gguf`` (scale 1; cv_b names only some layers),

and records, for each reference prompt, llama-server's 16 greedy tokens and top-10
logprobs per step into ``smollm2_f32_control_vectors.json`` (the README says how).
With ``--family gemma3`` it does the same for Gemma-3-270M (its float32 GGUF written
here from the catalogue's Q4_K_M if missing; one case, ``gemma3_cv.gguf:0.7`` over
layers 3..14) into ``gemma3_f32_control_vectors.json``: the same hook on another
block. With ``--family demo`` it records SmolLM2 under the demo vector Mixdesk made
(resources/vectors/happy.gguf, copied into control_vectors/) at scales 1 and -1 into
``smollm2_f32_demo_vector.json``: a Mixdesk-written vector, loaded by llama-server.
tests/test_control_vectors.py checks Mixdesk against all three.

    python tools/record_control_vectors.py [--family smollm2|gemma3|demo] [--llama-server-bin PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from the checkout
    sys.path.insert(0, str(REPO))

from tools import interop  # noqa: E402

N_LAYERS, DIM = 30, 576  # SmolLM2-135M
OUT_JSON = "smollm2_f32_control_vectors.json"
# file -> (seed, component std, layers it names)
VECTORS = {
    "cv_a.gguf": (37, 0.25, range(1, N_LAYERS)),
    "cv_b.gguf": (73, 0.20, range(2, N_LAYERS, 3)),
}
# (case name, llama-server flags, [(file, scale)], layer range or None)
CASES = [
    ("one", ["--control-vector-scaled", "{cv_a.gguf}:0.8"], [("cv_a.gguf", 0.8)], None),
    (
        "two_range",
        [
            "--control-vector-scaled",
            "{cv_a.gguf}:0.6,{cv_b.gguf}:-1.1",
            "--control-vector-layer-range",
            "6",
            "21",
        ],  # fmt: skip
        [("cv_a.gguf", 0.6), ("cv_b.gguf", -1.1)],
        [6, 21],
    ),
    ("plain", ["--control-vector", "{cv_b.gguf}"], [("cv_b.gguf", 1.0)], None),
]


# Gemma-3-270M: 18 layers of 640; its residual stream is larger (embeddings times
# sqrt(640)), so its random vector is larger too
GEMMA = {
    "n_layers": 18,
    "dim": 640,
    "vectors": {"gemma3_cv.gguf": (41, 1.0, range(1, 18))},
    "cases": [
        (
            "gemma3_range",
            [
                "--control-vector-scaled",
                "{gemma3_cv.gguf}:0.7",
                "--control-vector-layer-range",
                "3",
                "14",
            ],  # fmt: skip
            [("gemma3_cv.gguf", 0.7)],
            [3, 14],
        )
    ],
    "out": "gemma3_f32_control_vectors.json",
    "reference": "gemma3_f32_llamacpp.json",
}


# the demo vector Mixdesk makes (tools/train_demo_vector.py), copied here so the
# reference stays with the file it was recorded with: llama-server must load what
# Mixdesk writes, and steer as Mixdesk does, at the fader's two ends
DEMO = {
    "source": REPO / "resources" / "vectors" / "happy.gguf",
    "vectors": {"happy.gguf": None},
    "cases": [
        ("demo_happy", ["--control-vector-scaled", "{happy.gguf}:1"], [("happy.gguf", 1.0)], None),
        ("demo_sad", ["--control-vector-scaled", "{happy.gguf}:-1"], [("happy.gguf", -1.0)], None),
    ],
    "out": "smollm2_f32_demo_vector.json",
}


def vector_dir() -> Path:
    from tests.reference import reference_dir

    return reference_dir() / "control_vectors"


def write_vector(path: Path, seed: int, std: float, layers, dim: int = DIM) -> None:
    """A random control vector as llama.cpp's cvector-generator writes one: arch
    "controlvector", its model hint and layer count, one F32 ``direction.N`` per layer."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "llama")
    w.add_uint32("controlvector.layer_count", len(layers))
    for n in layers:
        w.add_tensor(f"direction.{n}", (rng.standard_normal(dim) * std).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _with_paths(flag: str, d: Path, names) -> str:
    """A CASES flag with each {file} replaced by the file's path in ``d``."""
    for n in names:
        flag = flag.replace("{" + n + "}", str(d / n))
    return flag


def gemma3_f32() -> Path:
    """Gemma-3-270M dequantized to float32 (every tensor), as its llama.cpp reference
    was recorded on; written once into the interop work dir."""
    out = interop.work_dir() / "gemma-3-270m.F32.gguf"
    if not out.exists():
        from core import catalog
        from core.lora.export import export_merged
        from core.options import EngineOptions
        from core.serve.engine import Engine

        if not catalog.is_fetched("gemma-3-270m"):
            raise SystemExit(
                "gemma-3-270m is not fetched: run the gemma3 tests once (they fetch it)"
            )
        eng = Engine.from_path(catalog.model_path("gemma-3-270m"), EngineOptions(), start=False)
        export_merged(eng, [], out, outtype="f32", allow_empty=True)
        eng.stop()
    return out


def distinct_prompts(reference: str) -> list[list[int]]:
    from tests.reference import reference_dir

    data = json.loads((reference_dir() / reference).read_text())
    seen: list[list[int]] = []
    for case in data["greedy"]:
        if case["prompt_tokens"] not in seen:
            seen.append(case["prompt_tokens"])
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-server-bin",
        default=os.environ.get("MIXDESK_LLAMA_SERVER_BIN"),
        help="a llama-server built beforehand (default: $MIXDESK_LLAMA_SERVER_BIN, else "
        "built from the pinned sdist into the cache, as make compat does)",
    )
    ap.add_argument("--family", choices=("smollm2", "gemma3", "demo"), default="smollm2")
    a = ap.parse_args(argv)
    d = vector_dir()
    d.mkdir(exist_ok=True)
    if a.family == "demo":
        import shutil

        vecs, case_list, out_name = DEMO["vectors"], DEMO["cases"], DEMO["out"]
        shutil.copy(DEMO["source"], d / "happy.gguf")
        f32 = interop.work_dir() / "SmolLM2-135M-Instruct.F32.gguf"
        if not f32.exists():
            raise SystemExit(f"{f32} is missing: run tools/interop.py first (it writes it)")
        plist = interop.prompts()
    elif a.family == "gemma3":
        vecs, case_list, out_name = GEMMA["vectors"], GEMMA["cases"], GEMMA["out"]
        for name, (seed, std, layers) in vecs.items():
            write_vector(d / name, seed, std, list(layers), GEMMA["dim"])
        f32 = gemma3_f32()
        plist = distinct_prompts(GEMMA["reference"])
    else:
        vecs, case_list, out_name = VECTORS, CASES, OUT_JSON
        for name, (seed, std, layers) in vecs.items():
            write_vector(d / name, seed, std, list(layers))
        f32 = interop.work_dir() / "SmolLM2-135M-Instruct.F32.gguf"
        if not f32.exists():
            raise SystemExit(f"{f32} is missing: run tools/interop.py first (it writes it)")
        plist = interop.prompts()
    binary = interop.llama_server_binary(a.llama_server_bin)
    cases = []
    for name, flags, vectors, rng in case_list:
        extra = [_with_paths(f, d, vecs) for f in flags]
        print(f"record: {name}: llama-server {' '.join(extra)}")
        with interop.llama_server(binary, f32, extra) as url:
            for prompt in plist:
                body = {"prompt": prompt, "n_predict": interop.N_PREDICT, "temperature": 0,
                        "ignore_eos": True, "cache_prompt": False, "n_probs": 10,
                        "post_sampling_probs": False, "return_tokens": True}  # fmt: skip
                r = interop._post(f"{url}/completion", body)
                top = [
                    [[t["id"], t["logprob"]] for t in step["top_logprobs"]]
                    for step in r["completion_probabilities"]
                ]
                cases.append({
                    "case": name,
                    "flags": [f.replace("{", "").replace("}", "") for f in flags],
                    "vectors": [{"file": f, "scale": s} for f, s in vectors],
                    "layer_range": rng,
                    "prompt_tokens": prompt,
                    "tokens": r["tokens"],
                    "top_logprobs": top,
                })  # fmt: skip
                print(f"record:   {prompt[:6]}… -> {r['tokens']}")
    out = {"vectors": list(vecs), "n_predict": interop.N_PREDICT, "greedy": cases}
    (d.parent / out_name).write_text(json.dumps(out, indent=1) + "\n")
    print(f"record: wrote {d.parent / out_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
