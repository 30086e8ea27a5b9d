"""The web chat page at ``/`` in a real browser (issue #36): Debian's chromium driven by
Playwright (tests/web/conftest.py) against real servers on 127.0.0.1 over SmolLM2.

What a user of llama-server's web UI expects, each through the real page: replies
rendered as Markdown with highlighted code and nothing in them run as markup; a
max-tokens setting sent and honoured; the chat's mix and the replies' labels kept
over a reload (and the next request carrying that mix); a foldable Mix panel and the
whole model name on a phone; a key checked before it is stored, and the message it
held back sent after a good one; Regenerate; a reply picked up again after a reload
mid-stream, Stop, New chat; and never a console error. Replies are kept a few tokens
long (the whole module takes seconds).

``MIXDESK_WEB_SHOTS=DIR`` saves screenshots of the page (1280x800 and 390x844) there.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture says so, in one line (conftest.py)
    expect = None


KEY = "browser-test-key"
WIDE = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
CHAT = "/v1/chat/completions"
# a reply made certain by a grammar: Markdown, and markup that must stay text
MARKDOWN_REPLY = "**Bold** and `tick` <script>window.pwned=1</script>\n\n```python\nx = 1\n```"
SHOTS = os.environ.get("MIXDESK_WEB_SHOTS")


@pytest.fixture(scope="module")
def api_key():
    """The key of this module's ``locked`` server (tests/web/conftest.py)."""
    return KEY


class Page:
    """One browser tab on a fresh profile (its own storage), with every console error
    and every chat request body it sent."""

    def __init__(self, browser, url: str, viewport: dict):
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.url = url
        self.errors: list[str] = []
        self.requests: list[dict] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", self._request)

    def _console(self, msg) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def _request(self, request) -> None:
        if request.method == "POST" and request.url.endswith(CHAT):
            self.requests.append(json.loads(request.post_data))

    def open(self) -> Page:
        self.page.goto(self.url + "/")
        return self

    def ready(self) -> Page:
        """The adapters are on the sliders."""
        self.page.wait_for_selector("#adapters .adapter", state="attached")
        return self

    def ask(self, text: str, max_tokens: int | None = 3) -> str:
        """Sends ``text`` and waits for the reply to finish and be rendered; its label."""
        p = self.page
        if max_tokens is not None:
            p.fill("#max-tokens", str(max_tokens))
        n = p.locator(".msg.assistant .label").count()
        p.fill("#input", text)
        p.click("#send")
        return self.reply_done(n)

    def reply_done(self, before: int = 0) -> str:
        p = self.page
        label = p.locator(".msg.assistant .label").nth(before)
        label.wait_for(state="attached", timeout=60_000)
        p.wait_for_selector("#stop", state="hidden")
        p.wait_for_selector('.msg.assistant[data-rendered="false"]', state="detached")
        return label.text_content()

    def js(self, expression: str, arg=None):
        return self.page.evaluate(expression, arg)

    def saved(self) -> dict:
        return self.js("() => JSON.parse(sessionStorage.getItem('mixdesk.chat'))")

    def shot(self, name: str) -> None:
        if SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(SHOTS) / name))

    def close(self, allowed: tuple[str, ...] = ()) -> None:
        self.context.close()
        errors = [e for e in self.errors if not any(a in e for a in allowed)]
        assert errors == [], f"console errors: {errors}"


@pytest.fixture
def tab(browser, srv):
    t = Page(browser, srv.url, WIDE).open()
    yield t
    t.close()


CANNED_SSE = (
    "".join(
        f"data: {json.dumps(event)}\n\n"
        for event in (
            {"choices": [{"index": 0, "delta": {"content": "A *canned* reply."}}]},
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "timings": {"predicted_n": 4, "predicted_per_second": 40.0},
            },
        )
    )
    + "data: [DONE]\n\n"
)


def canned_replies(tab: Page) -> None:
    """The tab's chat requests are answered by a fixed stream instead of the model: for
    the checks of what a request carries under a mix the server never saw (the
    server would build that mix first, seconds on this machine; that it honours a
    request's mix is test_webui.py's). The request is still captured as sent."""
    tab.page.route(
        "**" + CHAT,
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=CANNED_SSE),
    )


def slots_busy(srv) -> int:
    with urllib.request.urlopen(srv.url + "/slots", timeout=10) as r:
        return sum(1 for s in json.load(r) if s.get("is_processing"))


# ---- 1. Markdown ------------------------------------------------------------------------


def test_a_reply_is_rendered_as_markdown_and_its_markup_stays_text(tab):
    """A known reply, put in the tab's saved chat, goes through the page's own path: a
    reload shows the saved chat, each reply rendered by the server (a grammar would
    make the model write it too, at ~2 tokens/s; the model's own replies are checked
    as rendered below and in the other tests)."""
    chat = {
        "conv": "webui-markdown",
        "messages": [
            {"role": "user", "content": "**not rendered** <b>x</b>"},
            {"role": "assistant", "content": MARKDOWN_REPLY, "meta": "9 tokens"},
        ],
    }
    tab.ready()  # the page saved its own (empty) chat by now: this one replaces it
    tab.js("(c) => sessionStorage.setItem('mixdesk.chat', JSON.stringify(c))", chat)
    tab.page.reload()
    tab.ready().reply_done()
    p = tab.page
    assert p.locator(".msg.user .text").text_content() == "**not rendered** <b>x</b>"
    reply = p.locator(".msg.assistant .text")
    assert reply.get_attribute("class") == "text md"
    assert p.locator(".msg.assistant strong").text_content() == "Bold"
    assert p.locator(".msg.assistant p code").text_content() == "tick"
    code = p.locator(".msg.assistant pre.code")
    assert code.get_attribute("data-lang") == "python"
    assert code.locator("code").text_content() == "x = 1"
    assert code.locator("span.n").count() >= 1  # pygments' classes ...
    color = code.locator("span.mi").evaluate("e => getComputedStyle(e).color")
    assert color != p.locator("body").evaluate("e => getComputedStyle(e).color")  # coloured
    text = reply.text_content()
    assert "<script>window.pwned=1</script>" in text and "**" not in text and "```" not in text
    assert tab.js("() => document.querySelectorAll('.transcript script').length") == 0
    assert tab.js("() => window.pwned") is None
    tab.ask("Write a line of Python in a code block.", max_tokens=3)
    assert p.locator(".msg.assistant .text").nth(1).get_attribute("class") == "text md"
    tab.shot("wide-markdown.png")
    # the allow-list the server's HTML goes through: no handler, script, image, URL
    # scheme or attribute outside it survives, whatever the HTML
    cleaned = tab.js(
        """(html) => { const d = document.createElement('div');
           d.append(markdownNodes(html)); return d.innerHTML; }""",
        '<p onclick="x()" style="color:red">a<script>window.pwned=2</script>'
        '<img src="/icon-256.png" onerror="window.pwned=3" alt="pic">'
        '<a href="javascript:alert(1)">j</a><a href="https://example.org/">h</a>'
        '<iframe src="/"></iframe><span class="k" data-x="1">k</span></p>',
    )
    assert cleaned == (
        '<p>awindow.pwned=2pic<a target="_blank" rel="noopener noreferrer">j</a>'
        '<a href="https://example.org/" target="_blank" rel="noopener noreferrer">h</a>'
        '<span class="k">k</span></p>'
    )
    assert tab.js("() => window.pwned") is None


# ---- 2. max tokens ----------------------------------------------------------------------


def test_max_tokens_is_sent_honoured_and_kept(tab):
    tab.ready()
    assert tab.page.input_value("#max-tokens") == "1024"  # the default
    label = tab.ask("Tell me a long story.", max_tokens=3)
    assert tab.requests[-1]["max_tokens"] == 3
    assert label.startswith("3 tokens") and "stopped at the length limit" in label
    tab.page.reload()
    tab.ready()
    assert tab.page.input_value("#max-tokens") == "3"  # kept in this browser


# ---- 3 and 4. the mix and the labels over a reload -------------------------------------


def test_a_reload_keeps_the_chats_mix_and_the_reply_labels(tab, engine):
    before = engine.get_mix()
    tab.ready()
    label = tab.ask("Hi")
    assert tab.requests[-1]["lora"] == [{"id": 0, "scale": 0}]
    tab.page.fill("#scale-0", "0.75")  # kept with the chat at once
    canned_replies(tab)
    tab.page.reload()
    tab.ready()
    assert tab.page.input_value("#scale-0") == "0.75"
    assert tab.page.locator("#adapters input[type=range]").input_value() == "0.75"
    assert tab.page.locator(".msg.assistant .label").text_content() == label
    assert "tokens/s" in label
    assert tab.ask("And again?") == "4 tokens \u00b7 40.0 tokens/s"
    assert tab.requests[-1]["lora"] == [{"id": 0, "scale": 0.75}]  # the user's mix
    assert [m["role"] for m in tab.requests[-1]["messages"]] == ["user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in tab.requests[-1]["messages"])
    # Reset starts from the server's scales again (the page never changed them)
    assert engine.get_mix() == before
    tab.page.click("#mix-reset")
    expect(tab.page.locator("#scale-0")).to_have_value("0")
    assert tab.saved()["mix"][0]["scale"] == 0


# ---- 5. a phone -------------------------------------------------------------------------


def test_on_a_phone_the_mix_folds_and_the_model_name_is_whole(browser, srv):
    tab = Page(browser, srv.url, PHONE).open().ready()
    p = tab.page
    try:
        height = PHONE["height"]
        folded = p.locator(".mix").bounding_box()["height"]
        assert folded < 0.15 * height, folded  # folded by default on a narrow screen
        assert not p.locator(".adapter").is_visible()
        assert "0/1 on" in p.locator("#mix-summary").text_content()
        model = p.locator("#model")
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
            assert model.text_content() == json.load(r)["data"][0]["id"]
        name = model.evaluate(
            "e => [e.scrollWidth <= e.clientWidth, e.getBoundingClientRect().right,"
            " getComputedStyle(e).textOverflow]"
        )
        assert name[0] and name[1] <= PHONE["width"] and name[2] != "ellipsis", name
        p.click("#mix-toggle")
        assert p.locator(".adapter").is_visible() and p.locator("#max-tokens").is_visible()
        assert p.get_attribute("#mix-toggle", "aria-expanded") == "true"
        tab.ask("Hi")  # its max tokens set in the open panel
        tab.shot("phone-open.png")
        p.reload()
        tab.ready()
        assert p.locator(".adapter").is_visible()  # the user's choice is kept
        p.click("#mix-toggle")
        assert not p.locator(".adapter").is_visible()
        assert p.locator(".mix").bounding_box()["height"] < 0.15 * height
        assert p.get_attribute("#mix-toggle", "aria-expanded") == "false"
        tab.shot("phone-folded.png")
    finally:
        tab.close()
    wide = Page(browser, srv.url, WIDE).open().ready()
    try:  # a wide screen always shows the panel, and no fold button
        assert wide.page.locator(".adapter").is_visible()
        assert not wide.page.locator("#mix-toggle").is_visible()
        wide.shot("wide-empty.png")
    finally:
        wide.close()


# ---- 6. the API key ---------------------------------------------------------------------


def test_a_key_is_checked_before_it_is_kept_and_the_held_message_is_sent(browser, locked):
    tab = Page(browser, locked.url, WIDE).open()
    p = tab.page
    try:
        p.wait_for_selector("#keybar", state="visible")
        p.fill("#max-tokens", "3")
        p.fill("#input", "Hi")
        p.click("#send")
        p.wait_for_selector(".msg.user.unsent")
        p.fill("#api-key", "wrong-key")
        p.click("#key-save")
        expect(p.locator("#key-note")).to_contain_text("refused this key")
        assert tab.js("() => localStorage.getItem('mixdesk.apiKey')") is None
        assert p.locator("#keybar").is_visible()
        p.fill("#api-key", KEY)
        p.click("#key-save")
        tab.reply_done()
        assert not p.locator("#keybar").is_visible()
        assert tab.js("() => localStorage.getItem('mixdesk.apiKey')") == KEY
        assert p.locator(".msg.unsent").count() == 0 and p.locator(".msg.error").count() == 0
        assert p.locator(".msg.user").count() == 1 and p.input_value("#input") == ""
        assert [m["role"] for m in tab.saved()["messages"]] == ["user", "assistant"]
        assert p.locator("#adapters .adapter").count() == 1  # read once the key is known
    finally:
        # the browser logs each refused request (the 401s this test asks for)
        tab.close(allowed=("status of 401",))


# ---- 7. Regenerate ----------------------------------------------------------------------


def test_regenerate_asks_the_last_question_again_under_the_current_mix(tab):
    tab.ready()
    tab.ask("Hi")
    first = tab.requests[-1]
    assert tab.page.locator(".msg.assistant .regenerate").count() == 1
    tab.page.fill("#scale-0", "0.75")
    canned_replies(tab)
    tab.page.click(".regenerate")
    tab.reply_done()
    again = tab.requests[-1]
    assert len(tab.requests) == 2
    assert again["messages"] == first["messages"] == [{"role": "user", "content": "Hi"}]
    assert again["lora"] == [{"id": 0, "scale": 0.75}]
    assert first["lora"] == [{"id": 0, "scale": 0}]
    assert tab.page.locator(".msg.user").count() == 1
    assert tab.page.locator(".msg.assistant").count() == 1  # the reply was replaced
    assert tab.page.locator(".msg.assistant .text").inner_text() == "A canned reply."
    assert tab.page.locator(".msg.assistant em").text_content() == "canned"
    assert [m["role"] for m in tab.saved()["messages"]] == ["user", "assistant"]
    tab.ask("Next")  # only the last reply has the button
    assert tab.page.locator(".regenerate").count() == 1
    assert tab.page.locator(".msg.assistant").last.locator(".regenerate").count() == 1


# ---- a reply over a reload, Stop, New chat ---------------------------------------------


def test_a_reload_mid_reply_picks_it_up_and_stop_and_new_chat_work(tab, srv):
    tab.ready()
    p = tab.page
    p.fill("#max-tokens", "24")
    p.fill("#input", "Write a story about a lighthouse keeper.")
    p.click("#send")
    expect(p.locator(".msg.assistant .text")).not_to_be_empty()
    conv = tab.saved()["conv"]
    assert tab.saved()["pending"] is True
    p.reload()
    label = tab.reply_done()  # read again from the server (GET /v1/stream)
    assert label.startswith("24 tokens")
    saved = tab.saved()
    assert saved["conv"] == conv and saved["pending"] is False
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    # Stop: the server's slot is freed, the reply so far is kept and labelled
    busy = slots_busy(srv)
    p.fill("#max-tokens", "1000")
    p.fill("#input", "Another long story, please.")
    p.click("#send")
    expect(p.locator(".msg.assistant .text").nth(1)).not_to_be_empty()
    p.click("#stop")
    assert tab.reply_done(1) == "stopped"
    deadline = time.monotonic() + 10
    while slots_busy(srv) > busy:
        assert time.monotonic() < deadline, "Stop did not free the server's slot"
        time.sleep(0.05)
    p.click("#new-chat")
    assert p.locator(".msg").count() == 0
    saved = tab.saved()
    assert saved["conv"] != conv and saved["messages"] == []
    assert saved["mix"] == [{"id": 0, "path": saved["mix"][0]["path"], "scale": 0}]
