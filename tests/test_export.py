"""Exports of a mix round-trip: the exported LoRA GGUF, merged model and PEFT
folder reproduce the mix they came from, on the real SmolLM2 and the llama.cpp
reference adapters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.gguf.reader import GGUFFile
from core.lora.adapter import AdapterError
from core.lora.export import ExportError, export_lora, export_merged, export_peft
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from core.version import version
from tests.mixing import mix_logits
from tests.tiny_gguf import write_lora_gguf

REPO = Path(__file__).resolve().parents[1]
N_PREDICT = 16
MIX = {"lora_attn.gguf": 0.6, "lora_ffn.gguf": -0.4, "lora_all_q8.gguf": 1.0}


# ---- helpers --------------------------------------------------------------------


def logits(eng: Engine, mix: dict[int, float], tokens: list[int]) -> np.ndarray:
    """All-position logits of ``tokens`` under ``mix`` (the engine's own forward)."""
    return mix_logits(eng, mix, tokens)


def greedy(eng: Engine, mix: dict[int, float], tokens: list[int], n: int = N_PREDICT) -> list[int]:
    p = SamplingParams(temperature=0.0, n_predict=n, ignore_eos=True)
    return eng.complete(tokens, p, mix=mix, cache_prompt=False).tokens


class Ref:
    """A mix's greedy continuation of the prompt (run once through the scheduler)
    and its logits over prompt + continuation in one teacher-forced forward.

    Another model whose argmax matches at every position of that same sequence
    makes exactly the same greedy choices, so one forward checks 16 greedy
    steps (this keeps the suite fast on a busy machine)."""

    def __init__(self, eng: Engine, mix: dict[int, float], prompt: list[int]):
        self.prompt, self.tokens = prompt, greedy(eng, mix, prompt)
        self.seq = prompt + self.tokens[:-1]
        self.logits = logits(eng, mix, self.seq)

    def gen_logits(self, lg: np.ndarray) -> np.ndarray:
        return lg[len(self.prompt) - 1 :]  # the rows that chose each generated token

    def check(self, eng: Engine, mix: dict[int, float], atol: float) -> np.ndarray:
        got = logits(eng, mix, self.seq)
        np.testing.assert_allclose(got, self.logits, atol=atol, rtol=0)
        assert self.gen_logits(got).argmax(-1).tolist() == self.tokens  # same greedy tokens
        return got

    def agreement(self, eng: Engine, mix: dict[int, float]) -> tuple[float, list[int]]:
        choice = self.gen_logits(logits(eng, mix, self.seq)).argmax(-1).tolist()
        return float(np.mean([a == b for a, b in zip(choice, self.tokens)])), choice


def write_embd_output_adapter(path: Path, cfg, rank: int = 4, seed: int = 7) -> Path:
    """A llama.cpp-format LoRA on token_embd (flipped a/b) and output.weight."""
    rng = np.random.default_rng(seed)
    return write_lora_gguf(
        path,
        {
            "token_embd.weight.lora_a": rng.standard_normal((cfg.vocab_size, rank)) * 0.1,
            "token_embd.weight.lora_b": rng.standard_normal((cfg.dim, rank)) * 0.1,
            "output.weight.lora_a": rng.standard_normal((rank, cfg.dim)) * 0.05,
            "output.weight.lora_b": rng.standard_normal((cfg.vocab_size, rank)) * 0.05,
        },
        {"adapter.lora.alpha": float(rank)},
        arch=cfg.arch,
    )


@pytest.fixture(scope="session")
def prompt(reference) -> list[int]:
    case = next(c for c in reference["greedy"] if c["prompt"].startswith("Once upon a time"))
    return case["prompt_tokens"]


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="session")
def engine(smollm_path, ref_dir, work):
    eng = Engine.from_path(smollm_path, n_parallel=2, ctx_size=256)
    eng.ids = {n: eng.add_adapter(ref_dir / "adapters" / n) for n in MIX}
    eng.ids["embd_out"] = eng.add_adapter(
        write_embd_output_adapter(work / "embd_out.gguf", eng.config)
    )
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def mix(engine) -> dict[int, float]:
    return {engine.ids[n]: s for n, s in MIX.items()}


@pytest.fixture(scope="session")
def mix_items(engine, mix) -> list:
    return [(engine.adapter(aid), s) for aid, s in mix.items()]


@pytest.fixture(scope="session")
def full_mix(engine, mix) -> dict[int, float]:
    """The reference mix plus a LoRA on token_embd and output (the tied-model case)."""
    return {**mix, engine.ids["embd_out"]: 0.5}


@pytest.fixture(scope="session")
def mix_ref(engine, mix, prompt) -> Ref:
    return Ref(engine, mix, prompt)


@pytest.fixture(scope="session")
def full_ref(engine, full_mix, prompt) -> Ref:
    return Ref(engine, full_mix, prompt)


@pytest.fixture(scope="session")
def merged_cache(tmp_path_factory):
    """Loading a merged model caches ~0.5 GB of f32 weights: keep that out of the
    user's cache dir."""
    return tmp_path_factory.mktemp("merged_cache")


def load_base(path: Path, cache: Path) -> Engine:
    old = os.environ.get("MIXDESK_CACHE")
    os.environ["MIXDESK_CACHE"] = str(cache)
    try:
        return Engine.from_path(path, n_parallel=1, ctx_size=256)
    finally:
        if old is None:
            del os.environ["MIXDESK_CACHE"]
        else:
            os.environ["MIXDESK_CACHE"] = old


# ---- (a) one LoRA GGUF ----------------------------------------------------------


def test_lora_export_reproduces_mix(engine, mix, mix_items, mix_ref, work):
    seen = []
    out = work / "mix_lora.gguf"
    res = export_lora(engine, mix_items, out, progress=lambda f, m: seen.append(f))
    assert res.path == out and out.exists() and res.rank == 48
    assert seen[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in seen)
    assert not list(work.glob(".*.partial"))

    gf = GGUFFile(out)
    assert gf.metadata["general.architecture"] == "llama"
    assert gf.metadata["general.type"] == "adapter"
    assert gf.metadata["adapter.type"] == "lora"
    assert "adapter.lora.alpha" not in gf.metadata
    assert gf.metadata["mixdesk.version"] == version()  # which Mixdesk wrote it
    # attn (8) + all_q8 (32) on layer 0's q; ffn (16) + all_q8 (32) on its gate
    assert gf.tensors["blk.0.attn_q.weight.lora_a"].shape == (40, 576)
    assert gf.tensors["blk.0.attn_q.weight.lora_b"].shape == (576, 40)
    assert gf.tensors["blk.0.ffn_gate.weight.lora_b"].shape == (1536, 48)
    assert gf.tensors["blk.5.attn_v.weight.lora_a"].shape == (8, 576)
    assert {t.qtype.name for t in gf.tensors.values()} == {"F32"}

    aid = engine.add_adapter(out)
    try:
        # a real generation through the scheduler, then the teacher-forced check
        assert greedy(engine, {aid: 1.0}, mix_ref.prompt) == mix_ref.tokens
        mix_ref.check(engine, {aid: 1.0}, atol=1e-4)
        # a scale on the exported adapter scales the whole mix
        half = logits(engine, {k: s * 0.5 for k, s in mix.items()}, mix_ref.prompt)
        np.testing.assert_allclose(
            logits(engine, {aid: 0.5}, mix_ref.prompt), half, atol=1e-4, rtol=0
        )
    finally:
        engine.remove_adapter(aid)


def test_lora_export_f16_and_embeddings(engine, full_mix, full_ref, work):
    out = work / "mix_full_f16.gguf"
    export_lora(engine, full_mix, out, dtype="f16")
    gf = GGUFFile(out)
    assert {t.qtype.name for t in gf.tensors.values()} == {"F16"}
    assert gf.tensors["token_embd.weight.lora_a"].shape == (49152, 4)  # flipped, as llama.cpp
    assert gf.tensors["token_embd.weight.lora_b"].shape == (576, 4)
    assert gf.tensors["output.weight.lora_b"].shape == (49152, 4)
    aid = engine.add_adapter(out)
    try:
        got = logits(engine, {aid: 1.0}, full_ref.seq)
        assert np.abs(got - full_ref.logits).max() < 5e-2  # f16 rounding of A and s*B
        assert full_ref.gen_logits(got).argmax(-1).tolist() == full_ref.tokens
    finally:
        engine.remove_adapter(aid)


def test_export_with_engine_global_mix(engine, mix, mix_ref, work):
    """adapters=None exports the engine's current global mix (what the GUI does)."""
    engine.set_mix(mix)
    try:
        out = work / "global_mix.gguf"
        export_lora(engine, None, out)
        aid = engine.add_adapter(out)
        mix_ref.check(engine, {aid: 1.0}, atol=1e-4)
        engine.remove_adapter(aid)
    finally:
        engine.set_mix({})


# ---- (c) PEFT folder -------------------------------------------------------------


def test_peft_export_round_trip(engine, full_mix, full_ref, work):
    out = work / "mix_peft"
    export_peft(engine, full_mix, out)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA"
    assert conf["base_model_name_or_path"] == engine.config.name
    assert conf["lora_alpha"] == conf["r"]
    assert set(conf["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "embed_tokens",
        "lm_head",
    }
    # ranks differ per module (8+32 on layer 0's attention, 8 on layer 5's): every
    # module that is not r has its rank and alpha = rank in the patterns
    assert conf["rank_pattern"] == conf["alpha_pattern"]
    assert conf["rank_pattern"]["model.layers.0.self_attn.q_proj"] == 40
    assert "model.layers.5.self_attn.q_proj" not in conf["rank_pattern"]  # r == 8 is common
    assert conf["r"] == 8

    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(out / "adapter_model.safetensors", "np") as f:  # not in the config:
        assert f.metadata()["mixdesk_version"] == version()  # PEFT warns on unknown keys
    assert "mixdesk_version" not in conf
    st = load_file(out / "adapter_model.safetensors")
    assert st["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (40, 576)
    assert st["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (576, 48)
    assert st["base_model.model.model.embed_tokens.lora_embedding_A"].shape == (4, 49152)
    assert st["base_model.model.lm_head.lora_B.weight"].shape == (49152, 4)

    aid = engine.add_adapter(out)
    try:
        full_ref.check(engine, {aid: 1.0}, atol=1e-4)
    finally:
        engine.remove_adapter(aid)


def test_peft_qk_rows_are_in_hf_order(engine, mix_items, work):
    """The exported lora_B of q_proj is the GGUF one with llama.cpp's permutation undone."""
    from safetensors.numpy import load_file

    out = work / "attn_only_peft"
    attn = engine.adapter(engine.ids["lora_attn.gguf"])
    export_peft(engine, [(attn, 1.0)], out)
    st = load_file(out / "adapter_model.safetensors")
    hf_b = st["base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"]
    gg = attn.tensors["blk.3.attn_q.weight"]
    n_head, (rows, r) = engine.config.n_heads, hf_b.shape
    # llama.cpp's converter: reshape(n_head, 2, rows/n_head/2, r).swapaxes(1, 2)
    permuted = hf_b.reshape(n_head, 2, rows // n_head // 2, r).swapaxes(1, 2).reshape(rows, r)
    np.testing.assert_allclose(permuted, gg.b * gg.scale_for(1.0), rtol=1e-6, atol=1e-7)
    assert not np.allclose(hf_b, gg.b * gg.scale_for(1.0))
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 8 and conf["rank_pattern"] == {}


# ---- (b) merged model GGUF ---------------------------------------------------------


@pytest.fixture(scope="session")
def merged_f32(engine, full_mix, work):
    out = work / "merged_f32.gguf"
    seen = []
    export_merged(engine, full_mix, out, outtype="f32", progress=lambda f, m: seen.append((f, m)))
    assert seen[-1][0] == 1.0 and len(seen) > 100  # progress per tensor
    return out


def test_merged_f32_reproduces_mix(full_ref, merged_f32, merged_cache, smollm_path):
    base, out = GGUFFile(smollm_path), GGUFFile(merged_f32)
    # every KV of the base is kept (the tokenizer included), file type updated
    assert out.metadata["mixdesk.version"] == version()
    for k, v in base.metadata.items():
        if k == "general.file_type":
            continue
        got = out.metadata[k]
        assert np.array_equal(got, v) if isinstance(v, np.ndarray) else got == v, k
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype, k
    assert out.metadata["general.file_type"] == 0  # ALL_F32
    # original names and shapes, plus output.weight because the mix touches the
    # tied embedding (the logits must keep using the un-adapted embedding + lm_head LoRA)
    assert set(out.tensors) == set(base.tensors) | {"output.weight"}
    assert all(out.tensors[n].shape == t.shape for n, t in base.tensors.items())
    assert {t.qtype.name for t in out.tensors.values()} == {"F32"}

    m = load_base(merged_f32, merged_cache)
    try:
        full_ref.check(m, {}, atol=1e-3)  # all 16 greedy choices, in one forward
        assert greedy(m, {}, full_ref.prompt, n=4) == full_ref.tokens[:4]  # and via the scheduler
    finally:
        m.stop()


def test_merged_from_path_matches_engine_export(engine, full_mix, merged_f32, smollm_path, work):
    """The path form (dequantizes the file) writes the same bytes as the engine
    form (reuses the engine's float32 weights)."""
    out = work / "merged_f32_from_path.gguf"
    export_merged(
        smollm_path, [(engine.adapter(a), s) for a, s in full_mix.items()], out, outtype="f32"
    )
    assert out.read_bytes() == merged_f32.read_bytes()
    out.unlink()


def test_merging_into_a_merged_export_writes_one_version_key(
    ref_dir, merged_f32, merged_cache, work
):
    """A merged export carries mixdesk.version; using it as the base of another merged
    export must not copy that key next to the new one (a GGUF with the key twice is
    refused by the writer), and the new file names the version that wrote it."""
    out = work / "merged_again.gguf"
    export_merged(merged_f32, [(ref_dir / "adapters" / "lora_attn.gguf", 0.5)], out, outtype="q8_0")
    gf = GGUFFile(out)
    assert gf.metadata["mixdesk.version"] == version()
    assert gf.metadata["general.file_type"] == 7
    out.unlink()


@pytest.mark.parametrize("outtype,file_type,min_agree", [("f16", 1, 0.9), ("q8_0", 7, 0.75)])
def test_merged_f16_q8_load_and_run(
    engine, mix, mix_ref, merged_cache, work, outtype, file_type, min_agree
):
    out = work / f"merged_{outtype}.gguf"
    export_merged(engine, mix, out, outtype=outtype)
    gf = GGUFFile(out)
    assert gf.metadata["general.file_type"] == file_type
    assert gf.tensors["blk.0.ffn_norm.weight"].qtype.name == "F32"  # norms stay F32
    assert gf.tensors["blk.0.attn_q.weight"].qtype.name == outtype.upper()
    assert "output.weight" not in gf.tensors  # no embedding LoRA: stays tied
    m = load_base(out, merged_cache)
    try:
        agree, choice = mix_ref.agreement(m, {})
        assert agree >= min_agree, (choice, mix_ref.tokens)
        toks = greedy(m, {}, mix_ref.prompt, n=6)
        text = m.tokenizer.decode(toks)
        assert text.strip() and "\ufffd" not in text
    finally:
        m.stop()
        out.unlink()


# ---- (d) the command line -----------------------------------------------------------


def test_cli_export_lora_subprocess(smollm_path, ref_dir, engine, mix_ref, work):
    out = work / "cli_mix.gguf"
    ad = ref_dir / "adapters"
    cmd = [
        sys.executable,
        str(REPO / "main.py"),
        "--export-lora",
        str(out),
        "-m",
        str(smollm_path),
        "--lora-scaled",
        ",".join(f"{ad / n}:{s}" for n, s in MIX.items()),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "100%" in r.stderr and "export-lora: wrote" in r.stderr
    aid = engine.add_adapter(out)
    try:
        mix_ref.check(engine, {aid: 1.0}, atol=1e-4)
    finally:
        engine.remove_adapter(aid)


def test_cli_export_peft_and_lora_in_process(smollm_path, ref_dir, work, capsys):
    import main

    ad = ref_dir / "adapters"
    out_dir, out = work / "cli_peft", work / "cli_both.gguf"
    rc = main.main(
        [
            "--export-peft",
            str(out_dir),
            "--export-lora",
            str(out),
            "-m",
            str(smollm_path),
            "--lora",
            str(ad / "lora_attn.gguf"),
            "--lora-scaled",
            f"{ad / 'lora_ffn.gguf'}:0.5",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert (out_dir / "adapter_config.json").exists() and out.exists()


@pytest.mark.parametrize(
    "flags, spec",
    [
        (["--merge-method", "svd", "--merge-rank", "4"], dict(method="svd", rank=4)),
        (
            ["--merge-method", "ties", "--merge-density", "0.3", "--merge-sign", "frequency"],
            dict(method="ties", density=0.3, majority_sign_method="frequency"),
        ),
        (
            ["--merge-method", "dare_linear", "--merge-seed", "7"],
            dict(method="dare_linear", seed=7),
        ),
    ],
    ids=["svd", "ties", "dare_linear"],
)
def test_cli_export_with_a_merge_method_writes_what_the_api_writes(
    smollm_path, ref_dir, work, capsys, flags, spec
):
    """--merge-method (and its parameters) on the command line merge as the desk and
    POST /lora-adapters do: the file equals export_lora's with the same MergeSpec,
    and differs from the exact linear stacking."""
    import main
    from core.lora.merge import MergeSpec

    ad = ref_dir / "adapters"
    pair = [(ad / "lora_attn.gguf", 0.9), (ad / "lora_all_q8.gguf", 0.7)]
    out = work / f"cli_{spec['method']}.gguf"
    argv = ["--export-lora", str(out), "-m", str(smollm_path), "--lora-scaled"]
    argv += [",".join(f"{p}:{s}" for p, s in pair), *flags]
    assert main.main(argv) == 0, capsys.readouterr().err
    api = export_lora(smollm_path, pair, work / "api.gguf", merge=MergeSpec.make(**spec))
    linear = export_lora(smollm_path, pair, work / "linear.gguf")
    got, want, plain = (GGUFFile(p) for p in (out, api.path, linear.path))
    assert sorted(got.tensors) == sorted(want.tensors)
    for name in want.tensors:
        np.testing.assert_array_equal(got.dequantize(name), want.dequantize(name))
    assert any(
        got.dequantize(n).shape != plain.dequantize(n).shape
        or not np.array_equal(got.dequantize(n), plain.dequantize(n))
        for n in plain.tensors
        if n in got.tensors
    )
    if spec["method"] == "svd":
        assert max(got.dequantize(n).shape[0] for n in got.tensors if n.endswith("lora_a")) == 4


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--merge-method", "average"], ["merge method must be one of", "linear", "dare_ties"]),
        (["--merge-method", "svd", "--merge-density", "0.5"], ["svd does not use --merge-density"]),
        (["--merge-method", "ties", "--merge-density", "1.5"], ["density must be", "(0, 1]"]),
        (["--merge-density", "0.5"], ["linear does not use --merge-density"]),
    ],
)
def test_cli_export_merge_flags_bad_values(smollm_path, ref_dir, work, capsys, flags, words):
    out = work / "never.gguf"
    argv = ["--export-lora", str(out), "-m", str(smollm_path)]
    argv += ["--lora", str(ref_dir / "adapters" / "lora_attn.gguf"), *flags]
    msg = _cli_error(argv, capsys)
    assert all(w in msg for w in words), msg
    assert not out.exists()


def test_merge_flags_without_an_export_are_refused(capsys):
    """A server's or the desk's method is set per request or on the desk: a merge
    flag there would be silently ignored, so it is refused by name."""
    from core.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--headless", "--merge-method", "ties", "--merge-seed", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--merge-method, --merge-seed: only for --export-lora" in err


# ---- (e) bad inputs ------------------------------------------------------------------


def _cli_error(argv, capsys) -> str:
    import main

    rc = main.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    errors = [line for line in err if line.startswith("mixdesk: error:")]
    assert len(errors) == 1 and errors == [err[-1]], err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


def test_cli_unknown_adapter(smollm_path, work, capsys):
    msg = _cli_error(
        [
            "--export-lora",
            str(work / "x.gguf"),
            "-m",
            str(smollm_path),
            "--lora-scaled",
            "/nonexistent/adapter.gguf:0.5",
        ],
        capsys,
    )
    assert "/nonexistent/adapter.gguf" in msg and "no such file" in msg
    assert not (work / "x.gguf").exists()


def test_cli_no_adapters(smollm_path, work, capsys):
    msg = _cli_error(["--export-merged", str(work / "y.gguf"), "-m", str(smollm_path)], capsys)
    assert "nothing to export" in msg


def test_cli_output_folder_missing(smollm_path, ref_dir, work, capsys):
    msg = _cli_error(
        [
            "--export-lora",
            str(work / "no_such_dir" / "z.gguf"),
            "-m",
            str(smollm_path),
            "--lora",
            str(ref_dir / "adapters" / "lora_attn.gguf"),
        ],
        capsys,
    )
    assert "does not exist" in msg and "no_such_dir" in msg


def test_output_not_writable(engine, mix_items, tmp_path, capsys, smollm_path, ref_dir):
    if os.geteuid() == 0:
        target = Path("/proc/mixdesk_export_test.gguf")  # root may write anywhere but /proc
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = ro / "out.gguf"
    with pytest.raises(ExportError, match="cannot write|not writable") as ei:
        export_lora(engine, mix_items, target)
    assert "\n" not in str(ei.value)
    msg = _cli_error(
        [
            "--export-lora",
            str(target),
            "-m",
            str(smollm_path),
            "--lora",
            str(ref_dir / "adapters" / "lora_attn.gguf"),
        ],
        capsys,
    )
    assert str(target.parent) in msg


def test_export_refuses_bad_requests(engine, mix_items, smollm_path, work):
    with pytest.raises(ExportError, match="nothing to export"):
        export_lora(engine, [], work / "a.gguf")
    with pytest.raises(ExportError, match="nothing to export"):
        export_peft(engine, [(a, 0.0) for a, _ in mix_items], work / "a_peft")
    with pytest.raises(AdapterError, match="no such file"):
        export_merged(smollm_path, [("/nope/x.gguf", 1.0)], work / "a.gguf")
    with pytest.raises(ExportError, match="outtype"):
        export_merged(engine, mix_items, work / "a.gguf", outtype="q4_0")
    with pytest.raises(ExportError, match="overwrite the base"):
        export_merged(smollm_path, mix_items, smollm_path, outtype="f32")
    assert not list(work.glob("a.gguf")) and not list(work.glob("a_peft"))


def test_an_empty_mix_writes_the_base_in_outtype_only_when_asked(tmp_path):
    """make interop serves the float32 base in llama-server: export_merged with no
    adapters and allow_empty=True writes every tensor of the base, dequantized and
    unchanged, with its metadata; without allow_empty an empty mix stays refused."""
    from gguf import GGMLQuantizationType

    from tests.tiny_gguf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "base.gguf", qtype=GGMLQuantizationType.Q8_0)
    with pytest.raises(ExportError, match="nothing to export"):
        export_merged(base, [], tmp_path / "refused.gguf", outtype="f32")
    res = export_merged(base, [], tmp_path / "f32.gguf", outtype="f32", allow_empty=True)
    assert res.rank == 0 and res.n_tensors == 0
    src, out = GGUFFile(base), GGUFFile(res.path)
    assert set(out.tensors) == set(src.tensors)
    for name in src.tensors:
        assert out.tensors[name].qtype.name == "F32"
        np.testing.assert_array_equal(out.dequantize(name), src.dequantize(name))
    assert out.metadata["general.architecture"] == src.metadata["general.architecture"]
    assert out.metadata["mixdesk.version"] == version()
