"""main.py's export mode: ``-m BASE --lora A [--lora-scaled B:0.5] --export-lora OUT``
(and --export-merged, --export-peft, --merge-method ...), on core/lora/export.py.

Above both the parser (core/cli.py) and the exports: an export writes files from
flags, so it reads the parser's defaults, which the LoRA layer must not know of.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .lora.adapter import load_adapter
from .lora.export import ExportError, Progress, export_lora, export_merged, export_peft
from .lora.merge import MergeError, MergeSpec
from .model.weights import open_model_file


def _cli_progress(label: str) -> Progress:
    tty = sys.stderr.isatty()
    last = [-1]

    def show(frac: float, msg: str) -> None:
        pct = int(frac * 100)
        if tty:
            sys.stderr.write(f"\rmixdesk: {label}: {pct:3d}% {msg[:60]:<60}")
            if frac >= 1.0:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif pct // 10 > last[0] // 10 or (frac >= 1.0 and last[0] < 100):
            print(f"mixdesk: {label}: {pct:3d}% {msg}", file=sys.stderr, flush=True)
        last[0] = pct

    return show


def run_exports(args) -> int:
    """main.py's export mode: -m BASE, --lora/--lora-scaled, one or more of
    --export-lora/--export-merged/--export-peft. Raises ValueError subclasses
    (printed as one line by main.py); returns the exit status."""
    from .default_model import ensure_default_model

    adapters = list(getattr(args, "adapters", None) or [])
    if not adapters:
        raise ExportError("nothing to export: give adapters with --lora or --lora-scaled")
    base = (
        Path(args.model)
        if getattr(args, "model", None)
        else ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    )
    # Load every adapter once (clear errors before any file is written).
    _, cfg = open_model_file(base)
    loaded = [(load_adapter(p, cfg), s) for p, s in adapters]
    # --outtype is documented for the merged model; it picks f16 LoRA/PEFT only
    # when it was given explicitly (its parser default is for --export-merged).
    outtype = getattr(args, "outtype", None) or "f16"
    explicit = _explicit_outtype(args)
    small = "f16" if explicit == "f16" else "f32"
    merge = _merge_spec(args)
    jobs = []
    if args.export_lora:
        jobs.append(
            (
                "export-lora",
                lambda p: export_lora(
                    base, loaded, args.export_lora, dtype=small, progress=p, merge=merge
                ),
            )
        )
    if args.export_peft:
        jobs.append(
            (
                "export-peft",
                lambda p: export_peft(
                    base, loaded, args.export_peft, dtype=small, progress=p, merge=merge
                ),
            )
        )
    if args.export_merged:
        jobs.append(
            (
                "export-merged",
                lambda p: export_merged(
                    base, loaded, args.export_merged, outtype=outtype, progress=p, merge=merge
                ),
            )
        )
    for label, job in jobs:
        res = job(_cli_progress(label))
        print(
            f"mixdesk: {label}: wrote {res.path} ({res.nbytes / 1e6:.1f} MB, "
            f"{res.n_tensors} tensors, rank up to {res.rank})",
            file=sys.stderr,
        )
    return 0


def _merge_spec(args) -> MergeSpec | None:
    """--merge-method and its parameters as a checked MergeSpec (None: plain linear,
    the exact stacking). A parameter the method does not use is an error rather than
    silently ignored: --merge-density with svd most likely means another method."""
    method = getattr(args, "merge_method", None) or "linear"
    given = {
        "density": getattr(args, "merge_density", None),
        "rank": getattr(args, "merge_rank", None),
        "seed": getattr(args, "merge_seed", None),
        "majority_sign_method": getattr(args, "merge_sign", None),
    }
    spec = MergeSpec.make(method, **given)
    unused = [k for k, v in given.items() if v is not None and getattr(spec, k) is None]
    if unused:
        flags = {"density": "--merge-density", "rank": "--merge-rank", "seed": "--merge-seed"}
        flags["majority_sign_method"] = "--merge-sign"
        raise MergeError(
            f"--merge-method {method} does not use {', '.join(flags[k] for k in unused)}"
        )
    return None if spec == MergeSpec() else spec


def _explicit_outtype(args) -> str | None:
    try:
        from .cli import build_parser

        default = build_parser().get_default("outtype")
    except Exception:
        default = None
    val = getattr(args, "outtype", None)
    return val if val != default else None
