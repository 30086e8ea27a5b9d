"""Mixdesk entry point.

    python main.py                       the desktop window (default)
    python main.py --headless [flags]    the llama-server-compatible HTTP API, no Qt
    python main.py -p "prompt" -n 64     one-shot completion to stdout (llama-cli style)
    python main.py --export-lora OUT.gguf -m BASE --lora-scaled A.gguf:0.6,B.gguf:-0.4

Errors are printed as one clear line (no traceback) and exit with status 1.
"""

from __future__ import annotations

import logging
import sys


def _fail(msg: str) -> int:
    print(f"mixdesk: error: {msg}", file=sys.stderr)
    return 1


def one_shot(args) -> int:
    from core.serve.engine import DoneEvent
    from core.serve.sampling import SamplingParams
    from core.startup import engine_from_args

    params = SamplingParams.from_args(args)  # the same defaults the HTTP API starts from
    eng = engine_from_args(args, say=lambda m: print(m, file=sys.stderr))
    eng.start()
    prompt = eng.tokenizer.encode(args.prompt, add_special=True, parse_special=True)
    done = None
    try:
        for ev in eng.generate(prompt, params, source="cli"):
            if isinstance(ev, DoneEvent):
                done = ev
            else:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        eng.stop()
    sys.stdout.write("\n")
    if done is not None:
        if done.stop_type == "error":
            return _fail(done.error or "generation failed")
        t = done.timings.as_dict()
        print(
            f"prompt: {t['prompt_n']} tokens, {t['prompt_per_second']:.1f} tok/s | "
            f"generation: {t['predicted_n']} tokens, {t['predicted_per_second']:.1f} tok/s | "
            f"stop: {done.stop_type}",
            file=sys.stderr,
        )
    return 0


def get_model(name: str) -> int:
    """--get-model NAME: fetch a catalogue model (progress on stderr), print its path."""
    from core import catalog

    if name == "list":
        for n in catalog.names():
            print(f"{n}: {catalog.find(n).summary()}")
        return 0
    m = catalog.find(name)  # a UserError listing the valid names
    print(m.summary(), file=sys.stderr)
    path = catalog.fetch(m, progress=catalog.console_progress())
    terms = catalog.terms_path(m)
    if terms is not None:
        print(f"terms of use: {terms} ({m.license_url})", file=sys.stderr)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    import os

    kernel_types = os.environ.get("MIXDESK_COMPILE_KERNELS")  # core.model.quant.COMPILE_ENV
    if kernel_types:  # a kernel-compiling helper of the packaged app's first load
        from core.model import quant

        quant.compile_for_helper(kernel_types)
        return 0
    from core.cli import parse_args
    from core.errors import UserError

    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from core.startup import limit_threads

    _limits = limit_threads(args.threads)  # noqa: F841 (kept alive for the process)
    try:
        if args.get_model:
            return get_model(args.get_model)
        if args.clear_f32_cache:
            from core.model.weights import clear_f32_caches

            n, freed = clear_f32_caches()
            print(f"deleted {n} float32 weight cache(s), {freed / 1e9:.2f} GB", file=sys.stderr)
            return 0
        if args.export_lora or args.export_merged or args.export_peft:
            from core.export_cli import run_exports

            return run_exports(args)
        if args.train_control_vector:
            from core.train_cli import run_train_vector

            return run_train_vector(args)
        if args.prompt is not None:
            return one_shot(args)
        if args.headless:
            from core.http.server import run_headless

            return run_headless(args)
        try:
            from ui.app import run_gui
        except ImportError as e:
            return _fail(f"the desktop window needs PySide6 ({e}); use --headless for the API")
        return run_gui(args)
    except UserError as e:  # a user's mistake: one line; anything else is a bug (traceback)
        return _fail(str(e))
    except OSError as e:  # one line too; no ": " before a message that names no file
        what = e.strerror or str(e)
        return _fail(f"{e.filename}: {what}" if e.filename else what)


if __name__ == "__main__":
    sys.exit(main())
