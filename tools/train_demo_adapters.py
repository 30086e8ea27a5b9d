#!/usr/bin/env python3
"""Train Mixdesk's three demo LoRA adapters for SmolLM2-135M-Instruct.

Dev-only tool. It needs PyTorch (CPU):

    .venv/bin/pip install -r requirements-train.txt

    .venv/bin/python -m tools.train_demo_adapters --check     # torch forward == llama.cpp?
    .venv/bin/python -m tools.train_demo_adapters             # train all three adapters
    .venv/bin/python -m tools.train_demo_adapters --only pirate

What it does
------------
* Loads our own default model (``SmolLM2-135M-Instruct.Q4_1.gguf``, see
  ``core.default_model``) and dequantizes every tensor to float32. The base
  model is frozen; nothing is downloaded from a model hub.
* Runs a small float32 llama forward in torch on the GGUF weights *as stored*.
  llama.cpp's converter permutes the Q/K rows so that RoPE rotates adjacent
  pairs ``(x[2i], x[2i+1])``; we do the same, so the LoRA B matrices learnt for
  ``attn_q``/``attn_k`` are already in GGUF layout and need no permutation.
* ``--check`` reproduces the first no-adapter case of
  ``tests/data/llamacpp/smollm2_f32_llamacpp.json`` (llama-server on the
  dequantized-F32 model): all 16 greedy tokens must match and every top-10
  logprob must be within 0.05. Training refuses to start if this fails.
* Trains one rank-8 LoRA per style on the hand-written pairs in
  ``tools/demo_data/<style>.jsonl`` (ChatML with SmolLM2's default system
  prompt, exactly what the chat template produces; loss only on the reply and
  its closing ``<|im_end|>``).
* Writes ``resources/adapters/<style>.gguf`` in llama.cpp's LoRA adapter format
  (what ``convert_lora_to_gguf.py`` emits and ``llama-server --lora`` loads):
  ``general.type=adapter``, ``adapter.type=lora``, ``adapter.lora.alpha``,
  ``adapter.lora.task_name``, and f16 tensors ``<base>.lora_a`` (rank, in) /
  ``<base>.lora_b`` (out, rank). Effective weight: W + scale*alpha/rank * B@A.

Time here (2 shared CPU cores, torch 2.13 CPU, 1 thread): ~50 s per epoch, 4 epochs per
adapter, ~12 min for all three on an idle machine (1222 s measured while shared); see
docs/development.md, "Demo adapters".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402  (dev-only dependency, see requirements-train.txt)
import torch.nn.functional as F  # noqa: E402

from core.gguf.reader import GGUFFile  # noqa: E402
from tests.reference import reference_dir  # noqa: E402

TIMING = (
    "measured here: pirate 271 s, terse 466 s, hype 482 s, 1222 s in all on 2 shared "
    "cores; ~50 s per epoch, ~12 min for all three when the machine is otherwise idle"
)

DATA_DIR = ROOT / "tools" / "demo_data"
OUT_DIR = ROOT / "resources" / "adapters"
REFERENCE = reference_dir() / "smollm2_f32_llamacpp.json"

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
IM_END = 2

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# style -> (task_name, human description). Hyper-parameters are shared.
STYLES = {
    "pirate": "Pirate voice: arr, matey, ye, aye, treasure and the seven seas.",
    "terse": "Terse answers: at most three short '- ' bullet points, no preamble.",
    "hype": "Over-enthusiastic voice: exclamation marks and emoji everywhere.",
}

RANK = 8
ALPHA = 16.0
LR = 2e-3
EPOCHS = 4
BATCH = 4
SEED = 1234


# --------------------------------------------------------------------------- model


def dequantize(g: GGUFFile, name: str) -> np.ndarray:
    from gguf.quants import dequantize as dq

    info = g.tensors[name]
    return np.array(dq(g.raw(name), info.qtype).reshape(info.shape), dtype=np.float32, copy=True)


class LoRA(torch.nn.Module):
    def __init__(self, out_f: int, in_f: int, rank: int, alpha: float):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(rank, in_f))
        self.b = torch.nn.Parameter(torch.zeros(out_f, rank))
        torch.nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.scaling = alpha / rank


class Llama(torch.nn.Module):
    """Float32 llama forward on GGUF weights as stored (adjacent-pair RoPE)."""

    def __init__(self, path: Path):
        super().__init__()
        g = GGUFFile(path)
        m = g.metadata
        self.n_layer = int(m["llama.block_count"])
        self.dim = int(m["llama.embedding_length"])
        self.n_head = int(m["llama.attention.head_count"])
        self.n_kv = int(m["llama.attention.head_count_kv"])
        self.head_dim = self.dim // self.n_head
        self.eps = float(m["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(m.get("llama.rope.freq_base", 10000.0))
        self.metadata = m
        w = {}
        for name in g.tensors:
            w[name] = torch.from_numpy(dequantize(g, name))
        g.close()
        self.w = w  # plain tensors: frozen, not parameters
        self.out_w = w.get("output.weight", w["token_embd.weight"])
        self.loras: dict[str, LoRA] = {}
        self.lora_modules = torch.nn.ModuleDict()
        self.mix: list[tuple[dict, float]] = []  # loaded GGUF adapters + scales (eval/check)

    # -- LoRA management
    def add_lora(self, rank: int, alpha: float, targets=TARGETS) -> None:
        self.lora_modules = torch.nn.ModuleDict()
        for i in range(self.n_layer):
            for t in targets:
                name = f"blk.{i}.{t}.weight"
                out_f, in_f = self.w[name].shape
                self.lora_modules[name.replace(".", "_")] = LoRA(out_f, in_f, rank, alpha)

    def lora_for(self, name: str):
        key = name.replace(".", "_")
        return self.lora_modules[key] if key in self.lora_modules else None

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name].T
        lo = self.lora_for(name)
        if lo is not None:
            y = y + ((x @ lo.a.T) @ lo.b.T) * lo.scaling
        for ad, scale in self.mix:
            ab = ad["tensors"].get(name)
            if ab is not None and scale != 0.0:
                a, b = ab
                y = y + ((x @ a.T) @ b.T) * (scale * ad["factor"])
        return y

    # -- forward
    def rms(self, x, wname):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[wname]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: (B, H, T, D); pos: (T,) or (B, T); rotate adjacent pairs (llama.cpp "normal" rope)
        d = self.head_dim
        inv = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos.to(torch.float64)[..., None] * inv
        cos = torch.cos(ang).to(x.dtype)
        sin = torch.sin(ang).to(x.dtype)
        if pos.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        r0 = x0 * cos - x1 * sin
        r1 = x0 * sin + x1 * cos
        return torch.stack((r0, r1), dim=-1).flatten(-2)

    def hidden(
        self,
        ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: list | None = None,
        pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids (B, T) -> final normed hidden states (B, T, dim). attn_mask (B, T) bool: real tokens
        (right padding only). ``cache``: a list that holds per-layer (k, v) across calls
        (inference only; pass [] for the prompt, then the same list for each new token)."""
        B, T = ids.shape
        x = self.w["token_embd.weight"][ids]
        start = cache[0][0].shape[2] if cache else 0
        if pos is None:
            pos = torch.arange(start, start + T)
        causal = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
        mask = causal[None, None]
        if attn_mask is not None:  # (B, start+T): which keys are real tokens
            diag = torch.zeros(T, start + T, dtype=torch.bool)
            diag[torch.arange(T), start + torch.arange(T)] = True  # pad rows see themselves
            mask = (mask & attn_mask[:, None, None, :]) | diag[None, None]
        hd, nh, nk = self.head_dim, self.n_head, self.n_kv
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self.rms(x, p + "attn_norm.weight")
            q = self.linear(h, p + "attn_q.weight").view(B, T, nh, hd).transpose(1, 2)
            k = self.linear(h, p + "attn_k.weight").view(B, T, nk, hd).transpose(1, 2)
            v = self.linear(h, p + "attn_v.weight").view(B, T, nk, hd).transpose(1, 2)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if cache is not None:
                if len(cache) > i:
                    k = torch.cat((cache[i][0], k), dim=2)
                    v = torch.cat((cache[i][1], v), dim=2)
                    cache[i] = (k, v)
                else:
                    cache.append((k, v))
            rep = nh // nk
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = a.transpose(1, 2).reshape(B, T, nh * hd)
            x = x + self.linear(a, p + "attn_output.weight")
            h = self.rms(x, p + "ffn_norm.weight")
            f = F.silu(self.linear(h, p + "ffn_gate.weight")) * self.linear(h, p + "ffn_up.weight")
            x = x + self.linear(f, p + "ffn_down.weight")
        return self.rms(x, "output_norm.weight")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.out_w.T

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], n: int, stop: int | None = None):
        """Greedy decode without a KV cache (fine for short checks). Returns (ids, logprobs list)."""
        cache: list = []
        nxt = list(prompt_ids)
        out, lps = [], []
        for _ in range(n):
            h = self.hidden(torch.tensor([nxt]), cache=cache)[:, -1]
            lp = torch.log_softmax(self.logits(h).double(), -1)[0]
            t = int(lp.argmax())
            out.append(t)
            lps.append(lp)
            if stop is not None and t == stop:
                break
            nxt = [t]
        return out, lps

    @torch.no_grad()
    def greedy_batch(self, prompts: list[list[int]], n: int, stop: int) -> list[list[int]]:
        """Greedy decode of several prompts at once (left padding, KV cache). Each result stops
        before ``stop``."""
        B, L = len(prompts), max(len(p) for p in prompts)
        pad = torch.tensor([L - len(p) for p in prompts])
        ids = torch.full((B, L), stop, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, L - len(p) :] = torch.tensor(p)
        valid = torch.arange(L)[None, :] >= pad[:, None]
        pos = (torch.arange(L)[None, :] - pad[:, None]).clamp(min=0)
        cache: list = []
        out = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        for _step in range(n):
            h = self.hidden(ids, valid, cache=cache, pos=pos)[:, -1]
            nxt = self.logits(h).argmax(-1)
            for r in range(B):
                if not done[r]:
                    if int(nxt[r]) == stop:
                        done[r] = True
                    else:
                        out[r].append(int(nxt[r]))
            if bool(done.all()):
                break
            ids = nxt[:, None]
            valid = torch.cat((valid, torch.ones(B, 1, dtype=torch.bool)), dim=1)
            pos = pos[:, -1:] + 1
        return out


# --------------------------------------------------------------------------- adapters


def load_adapter(path: Path) -> dict:
    """Read a llama.cpp LoRA GGUF the way llama.cpp does: lora_a (rank, in), lora_b (out, rank),
    delta = scale * alpha/rank * B @ A (alpha missing or 0 -> the scale is used as is)."""
    g = GGUFFile(path)
    meta = g.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"{path}: not a LoRA adapter (general.type={meta.get('general.type')!r})")
    tensors, rank = {}, None
    for name in g.tensors:
        if not name.endswith(".lora_a"):
            continue
        base = name[: -len(".lora_a")]
        a = torch.from_numpy(dequantize(g, name))
        b = torch.from_numpy(dequantize(g, base + ".lora_b"))
        assert a.shape[0] == b.shape[1], (name, a.shape, b.shape)
        tensors[base] = (a, b)
        rank = a.shape[0]
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    g.close()
    return {
        "path": str(path),
        "alpha": alpha,
        "rank": rank,
        "task": meta.get("adapter.lora.task_name"),
        "tensors": tensors,
        "factor": alpha / rank if alpha else 1.0,
    }


# --------------------------------------------------------------------------- llama.cpp format

MAX_BYTES = 5_000_000


def verify_llamacpp_adapter(path: Path, base_path: Path, demo: bool = True) -> list[str]:
    """Check a LoRA GGUF against the rules llama.cpp applies when ``llama-server --lora`` loads it
    (src/llama-adapter.cpp, llama_adapter_lora_init_impl), plus our own (alpha, task name, size).
    Returns a list of problems (empty = OK). ``demo=False`` skips our own extra rules (alpha and
    task name present, size <= 5 MB), e.g. for the reference adapters llama-server loaded.

    llama.cpp rules: general.type == "adapter"; general.architecture == the base model's;
    adapter.type == "lora"; adapter.lora.alpha read as f32; every tensor ends in .lora_a or
    .lora_b (or _norm.weight, ignored); each pair is complete; the base tensor exists; in ggml
    order ne(base) = [in, out] must satisfy base.ne[0] == a.ne[0], base.ne[1] == b.ne[1] and
    a.ne[1] == b.ne[0] (A is (rank, in), B is (out, rank) in numpy order)."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.constants import GGMLQuantizationType as Q

    problems = []
    r = GGUFReader(str(path))
    base = GGUFFile(base_path)

    def kv(key, vtype):
        f = r.fields.get(key)
        if f is None:
            problems.append(f"missing {key}")
            return None
        if f.types[:1] != [vtype]:
            problems.append(f"{key} has type {f.types}, expected {vtype.name}")
            return None
        return f.contents()

    if kv("general.type", GGUFValueType.STRING) != "adapter":
        problems.append("general.type != 'adapter'")
    if kv("general.architecture", GGUFValueType.STRING) != base.metadata["general.architecture"]:
        problems.append("general.architecture differs from the base model's")
    if kv("adapter.type", GGUFValueType.STRING) != "lora":
        problems.append("adapter.type != 'lora'")
    if demo or "adapter.lora.alpha" in r.fields:  # llama.cpp reads it as f32 when present
        alpha = kv("adapter.lora.alpha", GGUFValueType.FLOAT32)
        if alpha is not None and not alpha > 0:
            problems.append(f"adapter.lora.alpha = {alpha}")
    if demo and not kv("adapter.lora.task_name", GGUFValueType.STRING):
        problems.append("adapter.lora.task_name is missing or empty")
    pairs: dict[str, dict] = {}
    for t in r.tensors:
        ne = [int(x) for x in t.shape]  # GGUFReader gives ggml order (ne[0] first)
        if t.tensor_type not in (Q.F32, Q.F16, Q.BF16, Q.Q8_0):
            problems.append(f"{t.name}: type {t.tensor_type.name}")
        for suf in (".lora_a", ".lora_b"):
            if t.name.endswith(suf):
                pairs.setdefault(t.name[: -len(suf)], {})[suf[-1]] = ne
                break
        else:
            if not t.name.endswith("_norm.weight"):
                problems.append(f"{t.name}: unexpected suffix")
    for name, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            problems.append(f"{name}: pair is missing one component")
            continue
        info = base.tensors.get(name)
        if info is None:
            problems.append(f"{name}: not in the base model")
            continue
        base_ne = list(reversed(info.shape))  # numpy (out, in) -> ggml [in, out]
        a, b = ab["a"], ab["b"]
        if base_ne[0] != a[0] or base_ne[1] != b[1]:
            problems.append(f"{name}: incorrect shape a={a} b={b} base={base_ne}")
        if a[1] != b[0]:
            problems.append(f"{name}: lora_a is not transposed (a={a}, b={b})")
    if not pairs:
        problems.append("no LoRA tensors")
    size = path.stat().st_size
    if demo and size > MAX_BYTES:
        problems.append(f"file is {size} bytes > {MAX_BYTES}")
    base.close()
    return problems


# --------------------------------------------------------------------------- check


def check(model: Llama, tol: float = 0.05, with_adapters: bool = True) -> bool:
    """Reproduce llama-server's greedy tokens + top-10 logprobs: the first no-adapter case, and
    (if the reference adapters are there) a few cases with the reference LoRAs mixed in, which
    checks our reading of the adapter format and the alpha/rank scaling too."""
    ref = json.loads(REFERENCE.read_text())
    cases = [0]
    adapters = []
    ref_dir = REFERENCE.parent / "adapters"
    if with_adapters and all((ref_dir / n).exists() for n in ref["adapters"]):
        adapters = [load_adapter(ref_dir / n) for n in ref["adapters"]]
        cases += [1, 3, 4]  # attn f32 @1, all-q8 no-alpha @1, attn+ffn 0.5/0.5
    ok = True
    for ci in cases:
        case = ref["greedy"][ci]
        scales = {e["id"]: float(e["scale"]) for e in case.get("lora", [])}
        model.mix = [(adapters[i], s) for i, s in scales.items() if s and adapters]
        t0 = time.time()
        toks, lps = model.greedy(case["prompt_tokens"], len(case["tokens"]))
        model.mix = []
        worst = 0.0
        for step, top in enumerate(case["top_logprobs"]):
            for tid, lp in top:
                worst = max(worst, abs(float(lps[step][tid]) - lp))
        same = toks == case["tokens"]
        label = (
            ", ".join(f"{ref['adapters'][i]}@{s:g}" for i, s in scales.items() if s) or "no adapter"
        )
        print(
            f"check case {ci} ({label}): greedy tokens match: {same} "
            f"({sum(a == b for a, b in zip(toks, case['tokens']))}/{len(case['tokens'])}), "
            f"worst |dlogprob| over top-10 = {worst:.4f} (tol {tol}), {time.time() - t0:.1f}s"
        )
        ok = ok and same and worst <= tol
    return ok


# --------------------------------------------------------------------------- data


def chatml(user: str, reply: str | None = None, system: str = DEFAULT_SYSTEM) -> str:
    s = (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    return s if reply is None else s + reply


def load_pairs(style: str) -> list[dict]:
    """tools/demo_data/train.jsonl: one prompt per line with a hand-written reply per style."""
    rows = []
    with open(DATA_DIR / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append({"prompt": r["prompt"], "response": r[style]})
    return rows


def get_tokenizer(meta):
    from core.tokenizer import Tokenizer

    return Tokenizer.from_metadata(meta)


def encode_pairs(tok, pairs: list[dict]) -> list[tuple[list[int], int]]:
    """-> list of (ids, n_prompt). Loss is on ids[n_prompt:] (reply + <|im_end|>)."""
    out = []
    for p in pairs:
        prompt = tok.encode(chatml(p["prompt"]), parse_special=True)
        reply = tok.encode(p["response"], parse_special=False)
        out.append((prompt + reply + [IM_END], len(prompt)))
    return out


# --------------------------------------------------------------------------- train


def train_style(model: Llama, tok, style: str, log=print) -> dict:
    torch.manual_seed(SEED)
    random.seed(SEED)
    model.add_lora(RANK, ALPHA)
    params = [p for p in model.lora_modules.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    data = encode_pairs(tok, load_pairs(style))
    steps_total = EPOCHS * math.ceil(len(data) / BATCH)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / 5)
            * 0.5
            * (1 + math.cos(math.pi * min(s, steps_total) / steps_total))
        ),
    )
    t0 = time.time()
    step = 0
    for ep in range(EPOCHS):
        # length-bucketed batches (shuffled, then sorted by length in chunks) keep padding low
        order = list(range(len(data)))
        random.shuffle(order)
        chunk = BATCH * 8
        order = [
            i
            for c in range(0, len(order), chunk)
            for i in sorted(order[c : c + chunk], key=lambda j: len(data[j][0]))
        ]
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        random.shuffle(batches)
        ep_loss, ep_n = 0.0, 0
        for bidx in batches:
            items = [data[i] for i in bidx]
            T = max(len(ids) for ids, _ in items)
            ids = torch.full((len(items), T), IM_END, dtype=torch.long)
            am = torch.zeros(len(items), T, dtype=torch.bool)
            tgt_mask = torch.zeros(len(items), T, dtype=torch.bool)
            for r, (x, n_prompt) in enumerate(items):
                ids[r, : len(x)] = torch.tensor(x)
                am[r, : len(x)] = True
                tgt_mask[r, n_prompt - 1 : len(x) - 1] = True  # position t predicts t+1
            h = model.hidden(ids, am)
            sel = h[tgt_mask]
            targets = ids[:, 1:][tgt_mask[:, :-1]]
            loss = F.cross_entropy(model.logits(sel), targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            ep_loss += float(loss.detach()) * len(targets)
            ep_n += len(targets)
            if step % 5 == 0:
                log(
                    f"[{style}]   step {step}/{steps_total} loss {float(loss.detach()):.3f}"
                    f"  ({time.time() - t0:.0f}s)"
                )
        log(
            f"[{style}] epoch {ep + 1}/{EPOCHS} loss {ep_loss / ep_n:.3f}  ({time.time() - t0:.0f}s)"
        )
    return {"seconds": time.time() - t0, "examples": len(data), "final_loss": ep_loss / ep_n}


def save_adapter(model: Llama, style: str, path: Path) -> None:
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".gguf.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(ALPHA))
    w.add_string("adapter.lora.task_name", style)
    w.add_name(f"mixdesk-demo-{style}")
    w.add_description(STYLES[style])
    for i in range(model.n_layer):
        for t in TARGETS:
            name = f"blk.{i}.{t}.weight"
            lo = model.lora_for(name)
            if lo is None:
                continue
            w.add_tensor(name + ".lora_a", lo.a.detach().numpy().astype(np.float16))
            w.add_tensor(name + ".lora_b", lo.b.detach().numpy().astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", type=Path, default=None, help="base GGUF (default: Mixdesk's default model)"
    )
    ap.add_argument(
        "--check", action="store_true", help="only verify the torch forward against llama.cpp"
    )
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument(
        "--verify",
        action="store_true",
        help="only check the adapters in --out (and the reference ones) against "
        "llama.cpp's LoRA loader rules",
    )
    ap.add_argument("--only", choices=sorted(STYLES), action="append")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    # One thread by default: on a shared 2-core machine, 2 OpenMP threads competing with
    # other processes slow down badly (spinning barriers); 1 thread degrades gracefully.
    torch.set_num_threads(args.threads or 1)
    if args.model is None:
        from core.default_model import default_model_path

        args.model = default_model_path()
    if args.verify:
        ok = True
        ref = sorted((REFERENCE.parent / "adapters").glob("*.gguf"))
        for path in ref + [args.out / f"{s}.gguf" for s in STYLES]:
            demo = path not in ref
            probs = (
                verify_llamacpp_adapter(path, args.model, demo=demo)
                if path.exists()
                else ["missing"]
            )
            print(
                f"verify {path.name}: {'OK' if not probs else probs}"
                f"{'' if demo else ' (reference adapter, llama.cpp rules only)'}"
            )
            ok = ok and not probs
        return 0 if ok else 1
    t0 = time.time()
    model = Llama(args.model)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"loaded + dequantized {args.model.name} in {time.time() - t0:.1f}s")
    if not args.skip_check or args.check:
        if not check(model):
            print("torch forward does not match llama.cpp; not training", file=sys.stderr)
            return 1
        if args.check:
            return 0
    tok = get_tokenizer(model.metadata)
    summary = {}
    for style in args.only or list(STYLES):
        info = train_style(model, tok, style)
        out = args.out / f"{style}.gguf"
        save_adapter(model, style, out)
        info["bytes"] = out.stat().st_size
        problems = verify_llamacpp_adapter(out, args.model)
        if problems:
            print(f"[{style}] {out} breaks llama.cpp's LoRA rules: {problems}", file=sys.stderr)
            return 1
        summary[style] = info
        print(f"[{style}] wrote {out} ({info['bytes'] / 1e6:.2f} MB) in {info['seconds']:.0f}s")
    print(json.dumps(summary, indent=1))
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
