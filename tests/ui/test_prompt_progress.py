"""Prompt progress: the scheduler reports each evaluated prompt chunk, the engine
relays it to listeners (the window) and, on request, to the caller (HTTP
``return_progress``); the chat shows "Reading prompt…" with a bar meanwhile."""

from __future__ import annotations

from core.serve.engine import DoneEvent, PromptProgressEvent, SamplingParams
from core.serve.events import PromptProgress
from core.serve.scheduler import PREFILL_CHUNK

LONG = PREFILL_CHUNK + 200  # two prefill chunks


def _long_prompt() -> list[int]:
    return [1] + [100 + i % 5000 for i in range(LONG - 1)]  # (LONG,) valid ids


def test_engine_reports_each_prompt_chunk(clean_engine):
    clean_engine.start()  # no window here: the engine's own loop thread
    heard = []
    off = clean_engine.subscribe(heard.append)
    try:
        params = SamplingParams(temperature=0.0, n_predict=1)
        evs = list(clean_engine.generate(_long_prompt(), params, cache_prompt=False, progress=True))
    finally:
        off()
    start, *prog = [e for e in evs if isinstance(e, PromptProgressEvent)]
    # the caller first hears of the admission (llama-server's first report: nothing
    # evaluated yet), then of each chunk; listeners only of the chunks
    assert start.start and (start.done, start.total, start.time_ms) == (0, LONG, 0.0)
    assert [(p.done, p.total) for p in prog] == [(PREFILL_CHUNK, LONG), (LONG, LONG)]
    assert not any(p.start for p in prog)
    assert prog[0].cache_n == 0 and prog[1].time_ms >= prog[0].time_ms > 0
    assert isinstance(evs[-1], DoneEvent) and evs[-1].stop_type == "limit"
    relayed = [e for e in heard if isinstance(e, PromptProgress)]
    assert [(p.done, p.total) for p in relayed] == [(PREFILL_CHUNK, LONG), (LONG, LONG)]


def test_progress_is_opt_in_for_the_caller(clean_engine):
    """Consumers that did not ask (HTTP streams, the CLI) never see the new event."""
    clean_engine.start()
    params = SamplingParams(temperature=0.0, n_predict=1)
    evs = list(clean_engine.generate(_long_prompt()[:20], params, cache_prompt=False))
    assert not [e for e in evs if isinstance(e, PromptProgressEvent)]


def test_chat_shows_reading_prompt_progress_for_a_long_prompt(window, qtbot, greedy):
    """A prompt read in two chunks shows the bar at the first chunk, then hides it."""
    w = window
    greedy(w, n_predict=1)
    seen = []
    text = " ".join(f"word{i}" for i in range(220))  # ~700 tokens: two prefill chunks
    assert w.chat.send(text)
    w.chat.gen.prompt_progress.connect(  # after the chat's own slot: sees its result
        lambda done, total: seen.append(
            (done, total, w.chat.prompt_bar.isVisible(), w.chat.prompt_bar.value())
        )
    )
    qtbot.waitUntil(lambda: not w.chat.generating, timeout=120000)
    assert w.chat.conversation["messages"][-1]["meta"]["stop"] == "limit"
    assert len(seen) == 2
    (d1, total, shown1, value1), (d2, _, shown2, _) = seen
    # done counts a cached prefix too (the chat template's start, from earlier tests)
    assert PREFILL_CHUNK <= d1 < total and d2 == total
    assert shown1 and value1 == d1 and w.chat.prompt_bar.maximum() == total
    assert "Reading prompt" in w.chat.prompt_bar.format()
    assert not shown2 and not w.chat.prompt_bar.isVisible()
