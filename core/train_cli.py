"""main.py's control-vector mode: ``--train-control-vector PAIRS.json|TEMPLATE --out
FILE.gguf [--cv-method pca|mean] [-m MODEL]`` makes a vector (core/lora/vector_train.py)
with the engine every other mode uses, prints its progress and exits.

PAIRS.json is what POST /control-vectors/train takes: ``{"pairs": [{"positive",
"negative"}], "template"?, "suffixes"?, "method"?, "layers"?}``, or just the list of
pairs; a built-in template's name (happy-sad, formal-casual, verbose-terse) instead
of a file uses its pairs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .lora.vector_train import TEMPLATES, VectorTrainError, spec_of, train_on_engine


def read_request(value: str, method: str | None) -> dict:
    """The training request a --train-control-vector value names (a template or a
    JSON file), with --cv-method over the file's method."""
    if value in TEMPLATES:
        body: dict = {"template": value}
    else:
        p = Path(value)
        if not p.is_file():
            raise VectorTrainError(
                f"--train-control-vector: {value} is neither a file nor a template "
                f"({', '.join(TEMPLATES)})"
            )
        try:
            body = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VectorTrainError(f"{p.name}: not JSON ({e})") from None
        if isinstance(body, list):
            body = {"pairs": body}
        if not isinstance(body, dict):
            raise VectorTrainError(f"{p.name}: expected a list of pairs or an object")
        extra = set(body) - {"pairs", "template", "suffixes", "method", "layers"}
        if extra:
            raise VectorTrainError(f"{p.name}: unknown field {sorted(extra)[0]!r}")
    if method is not None:
        body["method"] = method
    return body


def run_train_vector(args) -> int:
    from .default_model import ensure_default_model
    from .options import EngineOptions
    from .serve.engine import Engine

    if not args.out:
        raise VectorTrainError("--train-control-vector needs --out FILE.gguf")
    body = read_request(args.train_control_vector, args.cv_method)
    spec = spec_of(body)
    model = (
        Path(args.model)
        if getattr(args, "model", None)
        else ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    )
    eng = Engine.from_path(model, EngineOptions(ctx_size=1024))
    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // total
        if pct // 10 > last[0] // 10 or done == total:
            print(f"mixdesk: control vector: {done}/{total} examples", file=sys.stderr, flush=True)
        last[0] = pct

    try:
        print(
            f"mixdesk: control vector: {len(spec.pairs)} pairs x {len(spec.suffixes)} "
            f"suffixes, {spec.method}, on {model.name}",
            file=sys.stderr,
        )
        out = train_on_engine(eng, spec, args.out, progress)
    finally:
        eng.stop()
    print(f"mixdesk: control vector: wrote {out}", file=sys.stderr)
    return 0
