"""Chat pane: a Markdown transcript (markdown-it-py + pygments, see ui/markdown.py)
rendered live while a reply streams, Stop (Esc), Send (Ctrl+Enter), Regenerate
(Ctrl+R; earlier replies are kept as versions, ‹ 2/3 ›), edit-and-resend (a new
branch: what followed the edited message stays as another, ‹ 1/2 ›), New chat
(Ctrl+N), focus the input (Ctrl+L), Copy per message and per code block, and saved
conversations. While the prompt is read the status says so; then time to first
token and live tok/s. Under each reply: tokens, tok/s and the mix it used."""

from __future__ import annotations

import html
import time

from PySide6.QtCore import QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from core import conversation as branching
from core.errors import UserError
from core.settings import Conversations, Settings

from .bridge import EngineBridge, Generation
from .chat_list import ChatList
from .desk import VecKey, mix_label
from .markdown import Colors
from .markdown import render as render_md
from .sampling import SamplingForm
from .util import ElidedLabel, ScrollPlace, run_controls

RENDER_INTERVAL_MS = 60  # live Markdown while streaming: at most ~16 renders a second


def tokens_text(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def meta_text(meta: dict) -> str:
    stop = "" if meta.get("stop") in ("eos", "word", None) else f" · stop: {meta['stop']}"
    return (
        f"{tokens_text(meta.get('tokens', 0))} · {meta.get('tps', 0.0):.1f} tok/s · "
        f"mix: {meta.get('mix', '')}{stop}"
    )


def palette_colors(widget: QWidget) -> Colors:
    """The transcript's colours from the widget's palette (light or dark theme)."""
    pal = widget.palette()
    base, text = pal.color(QPalette.Base), pal.color(QPalette.Text)
    dark = base.lightness() < 128
    code = base.lighter(135) if dark else base.darker(106)
    muted = pal.color(QPalette.PlaceholderText)
    return Colors(
        code_bg=code.name(),
        muted=muted.name() if muted.isValid() else text.name(),
        dark=dark,
        text=text.name(),
    )


VERSION_ARROW_PX = 18  # the ‹ › glyphs' size: with the spaces around, a ≥20 px target


def version_button(i: int, step: int, enabled: bool, colors: Colors, scheme: str = "ver") -> str:
    """‹ or › as a button: the arrow in the text colour on the code blocks' face, with
    room around it (a bare 6 px link was hard to hit, and dark blue on dark grey).
    scheme "ver" steps a reply's versions, "br" the branches at a user message."""
    glyph = "‹" if step < 0 else "›"
    color = colors.text if enabled else colors.muted
    style = f"color:{color}; background-color:{colors.code_bg}; text-decoration:none"
    face = f"&nbsp;&nbsp;{glyph}&nbsp;&nbsp;"
    inner = (
        f'<a href="{scheme}:{i}:{step}" style="{style}">{face}</a>'
        if enabled
        else f'<span style="{style}">{face}</span>'
    )
    # the size on a span around the link: Qt's rich text drops it on the <a> itself
    return f'<span style="font-size:{VERSION_ARROW_PX}px">{inner}</span>'


def stepper_html(
    i: int, shown: int, count: int, colors: Colors, scheme: str, label: str = ""
) -> str:
    """‹ k/n ›: the buttons and the count between them (‹ branch 2/2 › with a label)."""
    prev = version_button(i, -1, shown > 0, colors, scheme)
    nxt = version_button(i, 1, shown < count - 1, colors, scheme)
    mid = f'<span style="font-size:small">&nbsp;{label}{shown + 1}/{count}&nbsp;</span>'
    return f"<span>{prev}{mid}{nxt}</span>"


def message_html(i: int, m: dict, colors: Colors, codes: list[str], streaming: bool) -> str:
    """One message: heading with its actions, the Markdown body, then a user message's
    branches (‹ branch 1/2 ›) or a reply's versions (‹ 2/3 ›) and meta line."""
    small = f'style="color:{colors.muted}; font-size:small"'
    if m["role"] == "user":
        head = (
            f'<h4>You&nbsp;&nbsp;<a href="edit:{i}" {small}>✎ edit</a>'
            f'&nbsp;&nbsp;<a href="copy:msg:{i}" {small}>Copy</a></h4>'
        )
        body = render_md(m["content"], colors, codes, str(i))
        shown, count = branching.branch_of(m)
        if count > 1:
            step = stepper_html(i, shown, count, colors, "br", "branch ")
            body += f'<p style="color:{colors.muted}">{step}</p>'
        return head + body
    body = m["content"] or ("…" if streaming else "*(empty reply)*")
    out = [f'<h4>Assistant&nbsp;&nbsp;<a href="copy:msg:{i}" {small}>Copy</a></h4>']
    out.append(render_md(body, colors, codes, str(i)))
    line = []
    versions = m.get("versions") or []
    if len(versions) > 1:
        v = int(m.get("version", len(versions) - 1))
        line.append(stepper_html(i, v, len(versions), colors, "ver"))
    if m.get("meta"):
        line.append(f"<i>{html.escape(meta_text(m['meta']))}</i>")
    if line:
        # font-size on the paragraph would override the ‹ › buttons' own: each part
        # carries its size
        parts = [
            p if p.startswith("<span") else f'<span style="font-size:small">{p}</span>'
            for p in line
        ]
        sep = '<span style="font-size:small"> &nbsp;·&nbsp; </span>'
        out.append(f'<p style="color:{colors.muted}">{sep.join(parts)}</p>')
    return "".join(out)


def transcript_html(conv: dict, colors: Colors, streaming: bool = False) -> tuple[str, dict]:
    """(HTML, {"I.N": code text}) for the whole conversation."""
    parts, codes = [], {}
    msgs = conv.get("messages", [])
    for i, m in enumerate(msgs):
        found: list[str] = []
        parts.append(message_html(i, m, colors, found, streaming and i == len(msgs) - 1))
        codes.update({f"{i}.{n}": c for n, c in enumerate(found)})
        parts.append("<hr/>")
    return "".join(parts), codes


class ChatPane(QWidget):
    reply_finished = Signal(object)  # the assistant message, with meta
    message = Signal(str)
    problem = Signal(str)  # a saved chat could not be read and was moved aside

    def __init__(
        self,
        bridge: EngineBridge,
        settings: Settings,
        sampling: SamplingForm,
        conversations: Conversations | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        self.sampling = sampling
        self.store = conversations or Conversations()
        self.gen: Generation | None = None
        self.edit_index: int | None = None
        self.conversation = self.store.new()

        # the sidebar of saved chats (the window places it left of the transcript)
        self.sidebar = ChatList(self.store)
        self.sidebar.open_requested.connect(self._history_chosen)
        self.sidebar.new_requested.connect(self.new_conversation)
        self.sidebar.rename_requested.connect(self.rename_conversation)
        self.sidebar.delete_requested.connect(self.delete_conversation)
        self.sidebar.undo_requested.connect(self.undo_delete)
        self._deleted: dict | None = None  # the last deleted chat, for Undo
        head = QHBoxLayout()
        title = QLabel("Chat")
        title.setObjectName("sectionTitle")
        head.addWidget(title)
        head.addStretch(1)
        # the context this chat uses (prompt + reply so far), as LM Studio shows it
        self.context_bar = QProgressBar()
        self.context_bar.setObjectName("contextBar")
        self.context_bar.setFormat("Context %v / %m")
        self.context_bar.setFixedWidth(170)
        self.context_bar.setRange(0, 1)
        self.context_bar.setValue(0)
        head.addWidget(self.context_bar)

        self.view = QTextBrowser()
        self.view.setObjectName("transcript")
        self.view.setOpenLinks(False)
        self.view.anchorClicked.connect(self._anchor)
        self.place = ScrollPlace(self.view)  # where the reader is, kept across re-renders

        self.edit_banner = QLabel()
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.setWordWrap(True)  # a long line would widen the window
        self.edit_banner.hide()
        self.input = QPlainTextEdit()
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText("Message…   (Ctrl+Enter to send, Esc to stop)")
        self.input.setMaximumHeight(110)

        self.send_btn, self.stop_btn = run_controls(self, "Send", self.send, self.stop)
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.setToolTip("A new reply; the earlier ones stay as versions (Ctrl+R)")
        self.regen_btn.clicked.connect(self.regenerate)
        self.clear_btn = QPushButton("Clear")
        self.clear_btn.clicked.connect(self.clear)
        # elided to the room it has: a long "First token after … tok/s" must not
        # widen the chat column (the splitter took that width from the desk)
        self.status = ElidedLabel()
        self.status.setObjectName("hint")
        # "Reading prompt… N / M tokens" while a long prompt (several chunks) is read
        self.prompt_bar = QProgressBar()
        self.prompt_bar.setObjectName("promptProgress")
        self.prompt_bar.setFormat("Reading prompt… %v / %m tokens")
        self.prompt_bar.hide()
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.clear_btn, self.regen_btn, self.stop_btn, self.send_btn):
            buttons.addWidget(b)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.view, 1)
        lay.addWidget(self.prompt_bar)
        # its own line: beside the four buttons a 1280 px window left it ~80 px
        lay.addWidget(self.status)
        lay.addWidget(self.edit_banner)
        lay.addWidget(self.input)
        lay.addLayout(buttons)

        # window-wide, as in LM Studio and Jan
        QShortcut(QKeySequence("Ctrl+N"), self, self.new_conversation, context=Qt.WindowShortcut)
        QShortcut(QKeySequence("Ctrl+R"), self, self.regenerate, context=Qt.WindowShortcut)
        QShortcut(QKeySequence("Ctrl+L"), self, self.focus_input, context=Qt.WindowShortcut)
        self.codes: dict[str, str] = {}
        self._sent_at = self._first_at = 0.0

        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._live)
        self._started = False  # the window reports the files moved aside at start
        self.refresh_history()
        last = settings.get("last_conversation")
        if last:  # the saved system prompt is the user's latest: the chat's may be older
            self.open_conversation(last, apply_prompt=False)
        self._update_buttons()
        self.render()
        self._started = True

    # -- state ---------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        return self.gen is not None

    def _update_buttons(self) -> None:
        busy = self.generating
        self.stop_btn.setEnabled(busy)
        self.send_btn.setEnabled(not busy)
        msgs = self.conversation["messages"]
        self.regen_btn.setEnabled(not busy and any(m["role"] == "user" for m in msgs))
        self.clear_btn.setEnabled(not busy and bool(msgs))

    def render(self) -> None:
        """The transcript as HTML from Markdown; while a reply streams it is rendered
        the same way every RENDER_INTERVAL_MS, so the text never jumps at the end."""
        msgs = self.conversation["messages"]
        streaming = bool(self.generating and msgs and msgs[-1]["role"] == "assistant")
        body, self.codes = transcript_html(self.conversation, palette_colors(self.view), streaming)
        self.place.replace(lambda: self.view.setHtml(body), to_end=self.generating)
        if not self.generating:  # the last reply's count (a chat opened, a version chosen)
            last = next((m for m in reversed(msgs) if m.get("meta")), None)
            self.show_context((last or {}).get("meta", {}).get("context", 0) if msgs else 0)

    def show_context(self, used: int) -> None:
        """Tokens of the context in use: the engine's counts of the prompt and of the
        tokens generated (no second tokenizer); the tooltip says what a full one does."""
        engine = self.bridge.engine
        n_ctx = max(int(engine.ctx_size or 0), 1)
        if self.context_bar.maximum() != n_ctx:
            self.context_bar.setRange(0, n_ctx)
        self.context_bar.setValue(min(int(used), n_ctx))
        when_full = (
            "the engine runs with context shift: it drops the older half of what it holds "
            "and the reply goes on"
            if engine.context_shift
            else "the reply stops there (start the engine with --context-shift to drop "
            "old tokens instead); a prompt that is itself too long is refused"
        )
        self.context_bar.setToolTip(
            f"{used} of {n_ctx} tokens of context: the prompt (system prompt and the "
            f"whole chat so far) plus the reply. When it fills, {when_full}."
        )

    def _live(self) -> None:
        self.render()
        gen = self.gen
        if gen is not None and self._first_at:
            dt = time.monotonic() - self._first_at
            rate = f" · {(gen.n_tokens - 1) / dt:.1f} tok/s" if dt > 0 and gen.n_tokens > 1 else ""
            self.status.setText(f"First token after {self._first_at - self._sent_at:.2f} s{rate}")
        if gen is not None and gen.prompt_n:
            self.show_context(gen.prompt_n + gen.n_tokens)

    def focus_input(self) -> None:
        self.input.setFocus()
        self.input.selectAll()

    # -- actions ---------------------------------------------------------------------------
    def send(self, text: str | None = None) -> bool:
        if self.generating:
            return False
        text = self.input.toPlainText() if text is None else text
        if not text.strip():
            return False
        msgs = self.conversation["messages"]
        message = {"role": "user", "content": text.strip()}
        if self.edit_index is not None and self.edit_index < len(msgs):
            # a new branch: the edited message and all that followed stay as another
            branching.fork(msgs, self.edit_index, message)
        else:
            msgs.append(message)
        self.cancel_edit()
        self.input.clear()
        return self._generate()

    def regenerate(self) -> bool:
        """A new reply to the last message; the replaced one stays as a version."""
        if self.generating:
            return False
        msgs = self.conversation["messages"]
        previous = None
        if msgs and msgs[-1]["role"] == "assistant":
            previous = msgs.pop()
        if not any(m["role"] == "user" for m in msgs):
            if previous is not None:
                msgs.append(previous)
            return False
        return self._generate(previous)

    def stop(self) -> None:
        if self.gen is None and self.edit_index is not None:
            self.cancel_edit()
        if self.gen is not None:
            self.gen.cancel()
            self.status.setText("Stopping…")

    def clear(self) -> None:
        if self.generating:
            return
        self.conversation["messages"] = []
        self.cancel_edit()
        self._save()
        self.render()
        self._update_buttons()

    def edit_message(self, index: int) -> None:
        msgs = self.conversation["messages"]
        if self.generating or not (0 <= index < len(msgs)) or msgs[index]["role"] != "user":
            return
        self.edit_index = index
        self.input.setPlainText(msgs[index]["content"])
        self.input.setFocus()
        self.edit_banner.setText(
            f"Editing message {index + 1}: sending starts a new branch here; the "
            f"current one stays (‹ › switches). Esc cancels."
        )
        self.edit_banner.show()

    def cancel_edit(self) -> None:
        self.edit_index = None
        self.edit_banner.hide()

    def _anchor(self, url: QUrl) -> None:
        scheme, _, rest = url.toString().partition(":")
        try:
            if scheme == "edit":
                self.edit_message(int(rest))
            elif scheme == "copy":
                what, _, key = rest.partition(":")
                self.copy(what, key)
            elif scheme == "ver":
                i, step = rest.split(":")
                self.show_version(int(i), int(step))
            elif scheme == "br":
                i, step = rest.split(":")
                self.show_branch(int(i), int(step))
        except ValueError:
            pass

    def copy(self, what: str, key: str) -> None:
        """Copy a message's Markdown (what="msg", key=index) or a code block's text."""
        if what == "code":
            text = self.codes.get(key)
        else:
            msgs = self.conversation["messages"]
            i = int(key)
            text = msgs[i]["content"] if 0 <= i < len(msgs) else None
        if text is not None:
            QGuiApplication.clipboard().setText(text)
            self.message.emit("Copied the code" if what == "code" else "Copied the message")

    def show_version(self, index: int, step: int) -> None:
        """‹ / ›: show another version of a reply (the one shown is the one kept)."""
        msgs = self.conversation["messages"]
        if self.generating or not (0 <= index < len(msgs)):
            return
        m = msgs[index]
        versions = m.get("versions") or []
        v = int(m.get("version", len(versions) - 1)) + step
        if not (0 <= v < len(versions)):
            return
        m["version"] = v
        m["content"], m["meta"] = versions[v]["content"], versions[v].get("meta")
        self._save()
        self.render()
        self._reply_status()

    def show_branch(self, index: int, step: int) -> bool:
        """‹ / › on an edited message: show another branch from there (that message and
        all that followed it). Not while a reply streams, as for versions."""
        if self.generating:
            return False
        msgs = self.conversation["messages"]
        if not branching.switch(msgs, index, step):
            return False
        if self.edit_index is not None and self.edit_index >= index:
            self.cancel_edit()  # the message being edited is no longer shown
        if self.place.top == ScrollPlace.END:
            # stay put, not at the new branch's end: the arrows stay under the pointer
            # and the branch reads on from where it starts
            self.place.top = self.view.cursorForPosition(QPoint(4, 4)).position()
        self._save()
        self.render()
        self._update_buttons()
        self._reply_status()
        return True

    def _reply_status(self) -> None:
        """The line under the transcript: the shown path's last reply (after a switch of
        branch or version it would otherwise name a reply no longer shown)."""
        last = next((m for m in reversed(self.conversation["messages"]) if m.get("meta")), None)
        if last is None:
            self.status.setText("")
            return
        meta = last["meta"]
        stopped = " · stopped" if meta.get("stop") == "cancel" else ""
        tokens, tps = meta.get("tokens", 0), meta.get("tps", 0.0)
        self.status.setText(f"{tokens_text(tokens)} · {tps:.1f} tok/s{stopped}")

    # -- generation --------------------------------------------------------------------------
    def _generate(self, previous: dict | None = None) -> bool:
        prompt_msgs = self.sampling.system_messages() + [
            {"role": m["role"], "content": m["content"]} for m in self.conversation["messages"]
        ]
        try:
            params = self.sampling.params()
        except UserError as e:
            self.message.emit(str(e))
            return False
        gen = self.gen = self.bridge.chat(prompt_msgs, params)
        versions = []
        if previous is not None:  # regenerate: the earlier replies stay as versions
            versions = previous.get("versions") or [
                {"content": previous["content"], "meta": previous.get("meta")}
            ]
        reply = {"role": "assistant", "content": "", "versions": versions}
        self.conversation["messages"].append(reply)
        gen.token.connect(lambda t, r=reply: self._token(r, t))
        gen.finished.connect(lambda d, r=reply: self._done(r, d))
        gen.prompt_progress.connect(self._prompt_progress)
        gen.prompt_size.connect(self.show_context)
        self._sent_at, self._first_at = time.monotonic(), 0.0
        self.status.setText("Reading prompt…")
        self._save()
        self._update_buttons()
        self.render()
        return True

    def _prompt_progress(self, done: int, total: int) -> None:
        """One more prompt chunk read: the bar shows while some of the prompt is left
        (a prompt read in one chunk never shows it), then the tokens take over."""
        if self.gen is None or done >= total:
            self.prompt_bar.hide()
            return
        self.prompt_bar.setRange(0, total)
        self.prompt_bar.setValue(done)
        self.prompt_bar.show()
        self.status.setText(f"Reading prompt… {100 * done // total}%")

    def _token(self, reply: dict, text: str) -> None:
        self.prompt_bar.hide()
        if not self._first_at:
            self._first_at = time.monotonic()
        reply["content"] += text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def _done(self, reply: dict, done) -> None:
        gen, self.gen = self.gen, None
        prompt_n = gen.prompt_n if gen is not None else 0  # the engine's count
        self.prompt_bar.hide()
        eng = self.bridge.engine
        names = {a["id"]: a["name"] for a in eng.adapters()}  # by strip key (ui/desk.py)
        names.update({VecKey(v["id"]): v["name"] for v in eng.control_vectors()})
        t = done.timings.as_dict()
        reply["content"] = (
            done.content if done.content or not reply["content"] else reply["content"]
        )
        reply["meta"] = {
            "tokens": t["predicted_n"],
            "tps": round(t["predicted_per_second"], 1),  # shown the same in both places
            "mix": mix_label(done.mix, names),  # the vectors it ran under too
            "mix_ids": [[int(a), float(s)] for a, s in done.mix],
            "stop": done.stop_type,
            "context": prompt_n + t["predicted_n"],  # the context bar's, kept with the chat
        }
        if done.stop_type == "error":
            self.message.emit(f"Generation failed: {done.error}")
            reply["content"] = reply["content"] or f"*Error: {done.error}*"
        versions = reply.setdefault("versions", [])
        versions.append({"content": reply["content"], "meta": reply["meta"]})
        reply["version"] = len(versions) - 1
        full = ""
        if done.truncated:
            shifted = self.bridge.engine.context_shift
            full = " · context full: " + ("older tokens dropped" if shifted else "reply stopped")
        self.status.setText(
            f"{tokens_text(t['predicted_n'])} · {reply['meta']['tps']:.1f} tok/s"
            + (" · stopped" if done.stop_type == "cancel" else "")
            + full
        )
        self._render_timer.stop()
        self._save()
        self.render()
        self._update_buttons()
        self.reply_finished.emit(reply)

    # -- conversations --------------------------------------------------------------------------
    def _save(self) -> None:
        if not self.conversation["messages"] and not self.store.load(self.conversation["id"]):
            return
        self.conversation["system_prompt"] = self.sampling.system_prompt.toPlainText()
        try:
            self.store.save(self.conversation)
            self.settings.set("last_conversation", self.conversation["id"])
        except OSError as e:
            self.message.emit(f"Could not save the conversation: {e}")
        self.refresh_history()

    def refresh_history(self) -> None:
        cid = self.conversation["id"]
        self.sidebar.forget(cid)
        self.sidebar.refresh(cid, unsaved=self.store.load(cid) is None)
        if self._started:
            for note in self.store.take_problems():
                self.problem.emit(note)

    def _history_chosen(self, cid: str) -> None:
        if cid and cid != self.conversation["id"]:
            if not self.open_conversation(cid):  # busy: keep showing the open one
                self.refresh_history()

    def open_conversation(self, cid: str, apply_prompt: bool = True) -> bool:
        """Show a saved chat; switching to it also brings back its system prompt
        (when it had one: an empty one would wipe the prompt being written)."""
        if self.generating:
            return False
        conv = self.store.load(cid)
        if conv is None:
            return False
        self.conversation = conv
        if apply_prompt and conv.get("system_prompt"):
            self.sampling.system_prompt.setPlainText(conv["system_prompt"])
        self.settings.set("last_conversation", cid)
        self.cancel_edit()
        self.refresh_history()
        self.place.top = ScrollPlace.END  # a chat opens at its last message
        self.render()
        self._update_buttons()
        return True

    def new_conversation(self) -> None:
        if self.generating:
            return
        self.conversation = self.store.new(self.sampling.system_prompt.toPlainText())
        self.cancel_edit()
        self.refresh_history()
        self.render()
        self._update_buttons()

    def rename_conversation(self, cid: str, title: str) -> bool:
        title = " ".join(title.split())[:200]
        conv = self.conversation if cid == self.conversation["id"] else self.store.load(cid)
        if not title or conv is None or self.store.load(cid) is None:
            self.refresh_history()  # an empty name, or an unsaved chat: put the row back
            return False
        conv["title"] = title
        try:
            self.store.save(conv)
        except OSError as e:
            self.message.emit(f"Could not rename the conversation: {e}")
        self.refresh_history()
        return True

    def delete_conversation(self, cid: str | None = None) -> None:
        """Delete a saved chat (the open one by default); Undo in the sidebar brings it
        back. Deleting the open chat starts a new one."""
        if self.generating and cid in (None, self.conversation["id"]):
            return
        cid = cid or self.conversation["id"]
        conv = self.store.load(cid)
        self.store.delete(cid)
        self._deleted = conv
        if cid == self.conversation["id"]:
            self.new_conversation()
        else:
            self.refresh_history()
        if conv is not None:
            self.sidebar.show_undo(conv["title"])

    def undo_delete(self) -> bool:
        conv, self._deleted = self._deleted, None
        self.sidebar.hide_undo()
        if conv is None:
            return False
        try:
            self.store.save(conv)
        except OSError as e:
            self.message.emit(f"Could not restore the conversation: {e}")
            return False
        if self.generating or self.conversation["messages"]:
            self.refresh_history()
        else:  # nothing written in the chat that replaced it: show the restored one
            self.open_conversation(conv["id"])
        return True
