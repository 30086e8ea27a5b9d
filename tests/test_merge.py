"""Merge methods (#21): our ties / dare / magnitude_prune / svd / cat match PEFT's own
functions and PEFT's add_weighted_adapter module by module, are deterministic with a
seed, and a merged mix survives export -> reload with the live mix's greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import peft.utils.merge_utils as merge_utils
import pytest
import torch

from core.errors import MixdeskError
from core.lora import merge as M
from core.lora.adapter import Adapter, LoraPair
from core.lora.export import export_lora, export_merged
from core.lora.merge import MergeError, MergeSpec
from core.lora.mix import MergedKey, Mix, merged_adapter, mix_key
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.serving import wire_mix

OUT, IN = 24, 16
# (name, rank, alpha, targets): adapter 2 has no k module, so the k merge has two inputs
ADAPTERS = [("a0", 4, 8.0, ("q", "k")), ("a1", 6, 6.0, ("q", "k")), ("a2", 2, 4.0, ("q",))]
WEIGHTS = [0.7, -0.4, 1.2]
GGUF = {"q": "blk.0.attn_q.weight", "k": "blk.0.attn_k.weight"}


@pytest.fixture(scope="module")
def adapters() -> list[Adapter]:
    rng = np.random.default_rng(21)
    out = []
    for name, rank, alpha, targets in ADAPTERS:
        tensors = {
            GGUF[t]: LoraPair(
                (rng.standard_normal((rank, IN)) * 0.4).astype(np.float32),  # A (r, in)
                (rng.standard_normal((OUT, rank)) * 0.4).astype(np.float32),  # B (out, r)
                alpha,
            )
            for t in targets
        }
        out.append(Adapter(path=Path(name), name=name, format="gguf", tensors=tensors))
    return out


def tasks_of(adapters, module: str) -> tuple[np.ndarray, np.ndarray]:
    """Each adapter's ΔW at scale 1 for one module (n, out, in), and the weights (n,)."""
    present = [(ad.tensors[module], w) for ad, w in zip(adapters, WEIGHTS) if module in ad.tensors]
    tasks = np.stack([np.float32(p.scale_for(1.0)) * (p.b @ p.a) for p, _ in present])
    return tasks, np.array([w for _, w in present], dtype=np.float32)


def merged_delta(ad: Adapter, module: str) -> np.ndarray:
    p = ad.tensors[module]
    return np.float32(p.scale_for(1.0)) * (p.b @ p.a)  # (out, in)


def dare_masks(spec: MergeSpec, n: dict[str, int]) -> list[np.ndarray]:
    """The masks our dare draws, module by module in PEFT's module order (q, then k)."""
    masks = []
    for short in ("q", "k"):
        rng = M.module_rng(spec.seed, GGUF[short])
        masks += [M.drop_mask(rng, (OUT, IN), spec.density) for _ in range(n[short])]
    return masks


@pytest.fixture()
def feed_masks(monkeypatch):
    """PEFT draws DARE's masks with torch.bernoulli (torch's RNG, which numpy cannot
    reproduce): hand it our masks, in the order it asks for them, so both sides prune
    the same entries and the rest of the method (rescale, sign election, disjoint mean)
    is compared exactly."""

    def feed(masks: list[np.ndarray]):
        queue = list(masks)

        def bernoulli(p, *a, **kw):
            m = queue.pop(0)
            assert tuple(p.shape) == m.shape and float(p.reshape(-1)[0]) == pytest.approx(
                np.float32(SPEC_DENSITY)
            )
            return torch.from_numpy(m)

        monkeypatch.setattr(torch, "bernoulli", bernoulli)
        return queue

    return feed


SPEC_DENSITY = 0.4
DENSE_CASES = [
    ("magnitude_prune", {}),
    ("ties", {"majority_sign_method": "total"}),
    ("ties", {"majority_sign_method": "frequency"}),
    ("dare_linear", {"seed": 3}),
    ("dare_ties", {"seed": 3, "majority_sign_method": "total"}),
    ("dare_ties", {"seed": 5, "majority_sign_method": "frequency"}),
]


@pytest.mark.parametrize("method,extra", DENSE_CASES)
def test_method_matches_peft_merge_utils(adapters, feed_masks, method, extra):
    """Our combine() on the stacked task tensors == PEFT's merge_utils function on the same
    tensors (full rank: this is the method itself, before the SVD)."""
    spec = MergeSpec.make(method, density=SPEC_DENSITY, **extra)
    for module in GGUF.values():
        tasks, weights = tasks_of(adapters, module)
        ours = M.combine(spec, tasks, weights, module)  # (out, in)
        t_tasks = [torch.from_numpy(t.copy()) for t in tasks]
        t_w = torch.from_numpy(weights.copy())
        if method in M.RANDOM_METHODS:
            rng = M.module_rng(spec.seed, module)
            feed_masks([M.drop_mask(rng, (OUT, IN), spec.density) for _ in tasks])
        fn = getattr(merge_utils, method)
        kw = {"majority_sign_method": spec.majority_sign_method} if method in M.SIGN_METHODS else {}
        theirs = fn(t_tasks, t_w, spec.density, **kw).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        if method in ("magnitude_prune", "ties"):
            # trimming really dropped entries: not the plain weighted sum
            assert not np.allclose(ours, merge_utils.task_arithmetic(t_tasks, t_w).numpy())


def test_linear_matches_peft_task_arithmetic(adapters):
    tasks, weights = tasks_of(adapters, GGUF["q"])
    theirs = merge_utils.task_arithmetic(
        [torch.from_numpy(t.copy()) for t in tasks], torch.tensor(weights)
    )
    np.testing.assert_allclose(
        M.combine(MergeSpec.make("svd"), tasks, weights, "q"), theirs.numpy(), rtol=1e-5, atol=1e-6
    )


# ---- end to end against PEFT's add_weighted_adapter ----------------------------------


def peft_model(adapters):
    """The same adapters as PEFT LoRA modules on a two-Linear torch model."""
    from peft import LoraConfig, get_peft_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(IN, OUT, bias=False)
            self.k = torch.nn.Linear(IN, OUT, bias=False)

        def forward(self, x):
            return self.q(x) + self.k(x)

    torch.manual_seed(0)
    model = None
    for ad, (name, rank, alpha, targets) in zip(adapters, ADAPTERS):
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets))
        if model is None:
            model = get_peft_model(Net(), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        for short in targets:
            layer = getattr(model.base_model.model, short)
            pair = ad.tensors[GGUF[short]]
            layer.lora_A[name].weight.data = torch.from_numpy(pair.a.copy())
            layer.lora_B[name].weight.data = torch.from_numpy(pair.b.copy())
    return model


PEFT_CASES = [
    ("svd", "svd", {"rank": 5}),
    ("ties", "ties_svd", {"rank": 7, "density": 0.5}),
    ("ties", "ties_svd", {"rank": 12, "density": 0.3, "majority_sign_method": "frequency"}),
    ("magnitude_prune", "magnitude_prune_svd", {"rank": 6, "density": 0.6}),
    ("dare_linear", "dare_linear_svd", {"rank": 8, "density": 0.4, "seed": 1}),
    ("dare_ties", "dare_ties_svd", {"rank": 8, "density": 0.4, "seed": 2}),
]


@pytest.mark.parametrize("method,combination,kw", PEFT_CASES)
def test_merged_adapter_matches_peft_add_weighted_adapter(
    adapters, feed_masks, method, combination, kw
):
    """Method + truncated SVD to rank r, per module: our merged adapter's ΔW == the ΔW
    of the adapter PEFT's add_weighted_adapter builds (its "<method>_svd" combination)."""
    spec = MergeSpec.make(method, **kw)
    ours = merged_adapter(zip(adapters, WEIGHTS), spec)
    model = peft_model(adapters)
    n = {s: sum(GGUF[s] in ad.tensors for ad in adapters) for s in GGUF}
    queue = feed_masks(dare_masks(spec, n) if method in M.RANDOM_METHODS else [])
    model.add_weighted_adapter(
        [a[0] for a in ADAPTERS],
        WEIGHTS,
        "merged",
        combination_type=combination,
        svd_rank=spec.rank,
        density=spec.density,
        majority_sign_method=spec.majority_sign_method or "total",
    )
    for short, module in GGUF.items():
        layer = getattr(model.base_model.model, short)
        theirs = layer.get_delta_weight("merged").detach().numpy()  # (out, in), scaling 1
        assert ours.tensors[module].rank == spec.rank == layer.r["merged"]
        np.testing.assert_allclose(merged_delta(ours, module), theirs, rtol=1e-4, atol=2e-5)
    assert not queue  # PEFT drew exactly the masks we did


def test_cat_matches_peft_cat_and_full_rank_svd(adapters):
    """PEFT's cat stacks the ranks: exactly the weighted sum, as our linear mix. Our svd
    at full rank (the sum of ranks) reproduces it too: the SVD loses nothing."""
    model = peft_model(adapters)
    model.add_weighted_adapter([a[0] for a in ADAPTERS], WEIGHTS, "cat", combination_type="cat")
    ours = merged_adapter(zip(adapters, WEIGHTS), MergeSpec.make("svd"))  # default: Σ ranks
    for short, module in GGUF.items():
        layer = getattr(model.base_model.model, short)
        theirs = layer.get_delta_weight("cat").detach().numpy()
        tasks, weights = tasks_of(adapters, module)
        np.testing.assert_allclose(M.task_arithmetic(tasks, weights), theirs, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(merged_delta(ours, module), theirs, rtol=1e-4, atol=2e-5)


# ---- determinism, keys and specs -------------------------------------------------------


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_is_deterministic_with_a_seed(adapters, method):
    def build(seed):
        spec = MergeSpec.make(method, density=0.5, seed=seed, rank=8)
        return merged_adapter(zip(adapters, WEIGHTS), spec)

    one, two, other = build(7), build(7), build(8)
    for module in GGUF.values():
        np.testing.assert_array_equal(merged_delta(one, module), merged_delta(two, module))
        assert not np.allclose(merged_delta(one, module), merged_delta(other, module))


def test_dare_rescale_keeps_the_expectation(adapters):
    """DARE drops with probability 1-d and rescales by 1/d: averaged over many seeds, the
    dropped task tensor is the task tensor (the property the rescale exists for)."""
    tasks, _ = tasks_of(adapters, GGUF["q"])
    mean = np.mean(
        [M.drop(tasks, 0.3, np.random.default_rng(s)) for s in range(400)], axis=0
    )  # (n, out, in)
    scale = np.abs(tasks).mean()
    assert np.abs(mean - tasks).mean() < 0.1 * scale
    kept = (M.drop(tasks, 0.3, np.random.default_rng(0)) != 0).mean()
    assert 0.25 < kept < 0.35


def test_keys_linear_unchanged_merged_distinct():
    scales = {0: 0.5, 1: 0.0, 2: -1.0}
    plain = mix_key(scales)
    assert plain == ((0, 0.5), (2, -1.0)) and type(plain) is tuple
    assert mix_key(Mix(scales, MergeSpec.make("linear"))) == plain
    assert type(mix_key(Mix(scales, MergeSpec.make("cat")))) is tuple  # cat: the same weights
    ties = mix_key(Mix(scales, MergeSpec.make("ties", density=0.5)))
    assert isinstance(ties, MergedKey) and list(ties) == list(plain)  # same pairs to read
    assert ties != plain and plain != ties and hash(ties) != hash(plain)
    assert ties == mix_key(scales, MergeSpec.make("ties"))  # density 0.5 is the default
    assert ties != mix_key(scales, MergeSpec.make("ties", density=0.2))
    assert mix_key({0: 0.0}, MergeSpec.make("ties")) == ()  # nothing to merge: the base model
    # a spec ignores what its method does not use, so equal merges share one cache entry
    assert MergeSpec.make("svd", density=0.3, seed=4) == MergeSpec.make("svd")
    assert MergeSpec.make("ties", rank=8).as_dict() == {
        "method": "ties",
        "density": 0.5,
        "rank": 8,
        "majority_sign_method": "total",
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"method": "slerp"},
        {"method": "ties", "density": 0},
        {"method": "ties", "density": 1.5},
        {"method": "ties", "density": "half"},
        {"method": "svd", "rank": -1},
        {"method": "svd", "rank": 2.5},
        {"method": "dare_ties", "seed": -3},
        {"method": "ties", "majority_sign_method": "vote"},
        {"method": "ties", "densty": 0.5},
    ],
)
def test_bad_specs_are_refused_by_name(fields):
    with pytest.raises(MergeError) as e:
        MergeSpec.from_dict(fields)
    assert next(k for k in fields if k != "method" or len(fields) == 1) in str(e.value)


# ---- a merged mix on a real model: engine, events, exports ---------------------------

REF_ADAPTERS = ("lora_attn.gguf", "lora_all_q8.gguf")  # both change the attention
N_PREDICT = 12


@pytest.fixture(scope="module")
def smol(smollm_path, ref_dir):
    eng = Engine.from_path(smollm_path, n_parallel=2, ctx_size=128)
    eng.ids = [eng.add_adapter(ref_dir / "adapters" / n, scale=0.0) for n in REF_ADAPTERS]
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def prompt(reference) -> list[int]:
    return next(c for c in reference["greedy"] if c["prompt"].startswith("Once upon a time"))[
        "prompt_tokens"
    ]


def greedy(eng: Engine, mix, tokens: list[int]) -> list[int]:
    p = SamplingParams(temperature=0.0, n_predict=N_PREDICT, ignore_eos=True)
    return eng.complete(tokens, p, mix=mix, cache_prompt=False).tokens


def test_global_mix_carries_its_method(smol):
    events = []
    unsubscribe = smol.subscribe(lambda name, payload: events.append((name, payload)))
    try:
        a, b = smol.ids
        smol.set_mix(Mix({a: 0.5, b: 0.5}, MergeSpec.make("ties", density=0.3)))
        got = smol.get_mix()
        assert got == {a: 0.5, b: 0.5} and got.merge == MergeSpec.make("ties", density=0.3)
        smol.set_mix({a: 1.0, b: 0.0})  # a plain dict moves the faders, keeps the method
        assert smol.get_mix() == {a: 1.0, b: 0.0} and smol.get_mix().merge.method == "ties"
        changed = [p for n, p in events if n == "mix_changed"]
        assert changed[-1]["merge"] == {
            "method": "ties",
            "density": 0.3,
            "majority_sign_method": "total",
        }
    finally:
        smol.set_mix({i: 0.0 for i in smol.ids}, merge=MergeSpec.make("linear"))
        unsubscribe()
    assert smol.get_mix().merge.method == "linear"


def test_object_form_parses_and_bad_fields_change_nothing(smol):
    a, b = smol.ids
    mix = wire_mix(
        smol,
        {"adapters": [{"id": a, "scale": 0.5}], "method": "dare_ties", "density": 0.25, "seed": 9},
    )
    assert mix == {a: 0.5, b: 0.0}
    assert mix.merge == MergeSpec.make("dare_ties", density=0.25, seed=9)
    assert type(wire_mix(smol, [{"id": a, "scale": 0.5}])) is dict  # llama-server's list
    for bad in (
        {"adapters": [], "method": "slerp"},
        {"adapters": [], "method": "ties", "density": 0},
        {"adapters": [], "method": "svd", "rank": -1},
        {"adapters": [], "metod": "ties"},
        {"method": "ties"},
    ):
        with pytest.raises(MixdeskError):  # the wire form's HttpError or MergeError
            wire_mix(smol, bad)


@pytest.mark.parametrize(
    "spec",
    [MergeSpec.make("ties", density=0.5), MergeSpec.make("dare_ties", density=0.5, seed=4)],
    ids=["ties", "dare_ties"],
)
def test_merged_mix_survives_export_and_reload(smol, prompt, spec, tmp_path):
    """The live mix (built once, with progress) greedy == the f32 merged GGUF export of
    that mix, reloaded; and == its LoRA GGUF export loaded as one adapter at scale 1."""
    a, b = smol.ids
    mix = Mix({a: 0.9, b: 0.7}, spec)
    events = []
    unsubscribe = smol.subscribe(lambda name, payload: events.append((name, payload)))
    try:
        live = greedy(smol, mix, prompt)
    finally:
        unsubscribe()
    building = [p for n, p in events if n == "mix_building"]
    assert building and building[-1]["progress"] == 1.0 and building[0]["method"] == spec.method
    key = mix_key(mix)
    assert isinstance(key, MergedKey)
    merged_w = smol.lora.mixes.get(key, {a: smol.adapter(a) for a in smol.lora.ids()})
    linear_w = smol.lora.mixes.get(
        mix_key(dict(mix)), {a: smol.adapter(a) for a in smol.lora.ids()}
    )
    assert merged_w is not linear_w and merged_w.adapter_ids == {a, b}

    lora = smol.add_adapter(export_lora(smol, mix, tmp_path / "m.gguf").path, scale=0.0)
    try:
        assert greedy(smol, {lora: 1.0}, prompt) == live
    finally:
        smol.remove_adapter(lora)

    out = tmp_path / "merged.gguf"
    export_merged(smol, mix, out, outtype="f32")
    reloaded = Engine.from_path(out, n_parallel=1, ctx_size=128)
    try:
        assert greedy(reloaded, {}, prompt) == live
    finally:
        reloaded.stop()
        out.unlink()


@pytest.mark.parametrize("shape", [(40, 24), (24, 40)], ids=["tall", "wide"])
def test_truncated_svd_gives_the_product_of_torch_svd(shape):
    """Our truncated SVD (through the smaller Gram matrix) == PEFT's torch.linalg.svd
    truncation as a product, for tall and wide modules."""
    d = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    a, b = M.truncated_svd(d, 7)
    assert a.shape == (7, shape[1]) and b.shape == (shape[0], 7)
    u, s, vh = torch.linalg.svd(torch.from_numpy(d), full_matrices=True)
    ref = ((u[:, :7] @ torch.diag(s[:7])) @ vh[:7, :]).numpy()
    np.testing.assert_allclose(b @ a, ref, rtol=1e-4, atol=1e-5)
