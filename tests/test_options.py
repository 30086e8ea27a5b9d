"""core/options.py: one EngineOptions from the command line; defaults in one place; the
chat template given by flag survives a model reload (it is the engine's, not a patch
applied once after the first load)."""

from __future__ import annotations

import pytest

from core import options
from core.chat_template import DEFAULT_CHAT
from core.cli import parse_args
from core.errors import UserError
from core.options import EngineOptions, is_finite_number
from core.serve.engine import Engine
from core.startup import engine_from_args, startup_adapters

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def test_defaults_are_the_parsers():
    args = parse_args([])
    opts = EngineOptions.from_args(args)
    assert opts == EngineOptions(chat_defaults=DEFAULT_CHAT)
    assert (args.host, args.port) == (options.DEFAULT_HOST, options.DEFAULT_PORT)
    assert (args.ctx_size, args.parallel, args.draft_max) == (
        options.DEFAULT_CTX,
        options.DEFAULT_PARALLEL,
        options.DEFAULT_DRAFT_MAX,
    )


def test_flags_reach_the_options(tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE, encoding="utf-8")
    args = parse_args(
        ["--draft-max", "0", "--chat-template-file", str(tpl), "-np", "2", "-c", "0", "-t", "1"]
        + ["--reasoning", "off"]
    )
    o = EngineOptions.from_args(args)
    assert (o.draft_max, o.n_parallel, o.ctx_size, o.threads) == (0, 2, 0, 1)
    assert o.chat_template == TEMPLATE and o.chat_defaults.reasoning == "off"
    eng = Engine(o)
    assert (eng.draft_max, eng.n_parallel, eng.requested_ctx, eng.threads) == (0, 2, 0, 1)


def test_unreadable_template_file_is_a_user_error(tmp_path):
    bad = tmp_path / "t.jinja"
    bad.write_bytes(b"\xff\xfe not utf-8")
    args = parse_args(["--chat-template-file", str(bad)])
    with pytest.raises(UserError, match="--chat-template-file: cannot read"):
        EngineOptions.from_args(args)


def test_headless_engine_keeps_the_flag_template_across_a_reload(smollm_path, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE, encoding="utf-8")
    args = parse_args(["-m", str(smollm_path), "--chat-template-file", str(tpl), "-c", "256"])
    eng = engine_from_args(args, say=lambda m: None)
    try:
        assert eng.chat_template.source == TEMPLATE
        eng.load_model(smollm_path)  # the window's "Open model" or POST /models/load
        assert eng.chat_template.source == TEMPLATE
    finally:
        eng.stop()


def test_startup_adapters_are_the_flags_in_order():
    """One list for the headless server and the window (which adds the demo adapters
    only when neither a model nor an adapter was named)."""
    flags = ["--lora", "a.gguf,b.gguf", "--lora-scaled", "c.gguf:0.5"]
    assert startup_adapters(parse_args(flags)) == [
        ("a.gguf", 1.0),
        ("b.gguf", 1.0),
        ("c.gguf", 0.5),
    ]
    zeroed = startup_adapters(parse_args([*flags, "--lora-init-without-apply"]))
    assert zeroed == [("a.gguf", 0.0), ("b.gguf", 0.0), ("c.gguf", 0.0)]
    assert startup_adapters(parse_args([])) == []


@pytest.mark.parametrize(
    "value, ok",
    [(1, True), (-2.5, True), (True, False), (float("nan"), False), (float("inf"), False)]
    + [(10**400, False), ("1", False), (None, False)],
)
def test_is_finite_number(value, ok):
    assert is_finite_number(value) is ok
