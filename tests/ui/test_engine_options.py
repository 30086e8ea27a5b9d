"""The window builds its engine exactly as the headless server does (core/options.py):
--draft-max and --chat-template-file reach the window's engine (they were silently
ignored there: the window passed only ctx_size and n_parallel), and it loads the
adapters the flags name, as core/startup.py does for --headless."""

from __future__ import annotations

import asyncio

from core.cli import parse_args

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def test_window_engine_gets_draft_max_and_chat_template_file(qtbot, smollm_path, ref_dir, tmp_path):
    from ui.app import create_window

    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE, encoding="utf-8")
    adapter = ref_dir / "adapters" / "lora_attn.gguf"
    args = parse_args(
        ["-m", str(smollm_path), "--draft-max", "0", "--chat-template-file", str(tpl), "-c", "512"]
        + ["--lora-scaled", f"{adapter}:0.5", "--lora-init-without-apply"]
    )
    win = create_window(args)
    try:
        qtbot.waitUntil(lambda: win.engine.ready, timeout=120000)
        eng = win.engine
        assert eng.draft_max == 0 and eng.scheduler.draft_max == 0
        # -c is the total context, divided across the -np slots as in llama-server
        assert eng.requested_ctx == 512 // args.parallel
        assert eng.chat_template.source == TEMPLATE
        prompt = eng.chat_template.render([{"role": "user", "content": "hi"}])
        assert prompt.startswith("<|user|>hi")
        # the adapters named on the command line, as headless loads them (core/startup.py)
        qtbot.waitUntil(lambda: len(eng.adapters()) == 1, timeout=60000)
        assert eng.adapters()[0]["path"] == str(adapter) and eng.get_mix() == {0: 0.0}
    finally:
        if win.server.runner is not None:
            fut = asyncio.ensure_future(win.server.stop(remember=False))
            qtbot.waitUntil(fut.done, timeout=10000)
        win.close()
        win.engine.stop()
