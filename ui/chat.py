"""Chat pane: a Markdown transcript that streams, Stop (Esc), Send (Ctrl+Enter),
regenerate, edit-and-resend, clear, and saved conversations. Under each reply:
tokens, tok/s and the mix it was generated with."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QColor,
    QKeySequence,
    QShortcut,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from core.settings import Conversations, Settings

from .bridge import EngineBridge, Generation
from .sampling import SamplingForm
from .util import format_mix

RENDER_INTERVAL_MS = 60
CODE_BG = "#eef1f8"
# GitHub Markdown without raw HTML: user and model text are never interpreted as HTML
# (a "<font color=red>" or an "<img>" would restyle or swallow the rest of the transcript).
MARKDOWN = QTextDocument.MarkdownDialectGitHub | QTextDocument.MarkdownNoHTML


def render_markdown(conv: dict, streaming: bool = False) -> str:
    """The transcript as Markdown; user messages get an "edit" link (edit:INDEX)."""
    out = []
    msgs = conv.get("messages", [])
    for i, m in enumerate(msgs):
        if m["role"] == "user":
            out.append(f"#### You  [✎ edit](edit:{i})\n\n{m['content']}\n")
        else:
            body = m["content"] or ("…" if streaming and i == len(msgs) - 1 else "*(empty reply)*")
            if body.count("```") % 2:
                body += "\n```"  # close a code fence that is still streaming
            out.append(f"#### Assistant\n\n{body}\n")
            meta = m.get("meta")
            if meta:
                stop = (
                    "" if meta.get("stop") in ("eos", "word", None) else f" · stop: {meta['stop']}"
                )
                out.append(
                    f"*{tokens_text(meta.get('tokens', 0))} · {meta.get('tps', 0.0):.1f} tok/s · "
                    f"mix: {meta.get('mix', '')}{stop}*\n"
                )
        out.append("\n---\n")
    return "\n".join(out)


def tokens_text(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def shade_code_blocks(doc) -> None:
    """Give fenced code blocks a tinted background (Qt's Markdown import sets only the font)."""
    block = doc.begin()
    while block.isValid():
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.BlockCodeFence) or fmt.hasProperty(
            QTextFormat.BlockCodeLanguage
        ):
            cur = QTextCursor(block)
            fmt.setBackground(QColor(CODE_BG))
            fmt.setLeftMargin(8)
            cur.setBlockFormat(fmt)
        block = block.next()


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

        self.history = QComboBox()
        self.history.setMinimumWidth(140)
        self.history.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.history.setMinimumContentsLength(12)
        self.history.setToolTip("Saved conversations")
        self.history.activated.connect(self._history_chosen)
        new_btn = QPushButton("New chat")
        new_btn.clicked.connect(self.new_conversation)
        del_btn = QPushButton("Delete")
        del_btn.setToolTip("Delete this saved conversation")
        del_btn.clicked.connect(self.delete_conversation)
        head = QHBoxLayout()
        title = QLabel("Chat")
        title.setObjectName("sectionTitle")
        head.addWidget(title)
        head.addStretch(1)
        head.addWidget(self.history)
        head.addWidget(new_btn)
        head.addWidget(del_btn)

        self.view = QTextBrowser()
        self.view.setObjectName("transcript")
        self.view.setOpenLinks(False)
        self.view.anchorClicked.connect(self._anchor)

        self.edit_banner = QLabel()
        self.edit_banner.setObjectName("editBanner")
        self.edit_banner.setWordWrap(True)  # a long line would widen the window
        self.edit_banner.hide()
        self.input = QPlainTextEdit()
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText("Message…   (Ctrl+Enter to send, Esc to stop)")
        self.input.setMaximumHeight(110)

        self.send_btn = QPushButton("Send")
        self.send_btn.setObjectName("primaryButton")
        self.send_btn.clicked.connect(lambda: self.send())
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setObjectName("stopButton")
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn = QPushButton("Regenerate")
        self.regen_btn.clicked.connect(self.regenerate)
        self.clear_btn = QPushButton("Clear")
        self.clear_btn.clicked.connect(self.clear)
        self.status = QLabel()
        self.status.setObjectName("hint")
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        for b in (self.clear_btn, self.regen_btn, self.stop_btn, self.send_btn):
            buttons.addWidget(b)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.view, 1)
        lay.addWidget(self.edit_banner)
        lay.addWidget(self.input)
        lay.addLayout(buttons)

        for seq in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(seq), self, self.send, context=Qt.WidgetWithChildrenShortcut)
        QShortcut(QKeySequence("Escape"), self, self.stop, context=Qt.WidgetWithChildrenShortcut)

        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._flush_stream)
        self._streamed = 0
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
        """Full Markdown render (on send, finish, open). While a reply streams, its tokens
        are appended as plain text (cheap); it is rendered as Markdown when it ends."""
        sb = self.view.verticalScrollBar()
        at_end = sb.value() >= sb.maximum() - 4
        msgs = self.conversation["messages"]
        streaming = self.generating and msgs and msgs[-1]["role"] == "assistant"
        if streaming:
            done_part = dict(self.conversation, messages=msgs[:-1])
            self.view.document().setMarkdown(
                render_markdown(done_part) + "\n#### Assistant\n", MARKDOWN
            )
            cur = QTextCursor(self.view.document())
            cur.movePosition(QTextCursor.End)
            cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
            self._streamed = 0
            self._flush_stream()
        else:
            self.view.document().setMarkdown(render_markdown(self.conversation), MARKDOWN)
        shade_code_blocks(self.view.document())
        if at_end or self.generating:
            sb.setValue(sb.maximum())

    def _flush_stream(self) -> None:
        msgs = self.conversation["messages"]
        if not self.generating or not msgs or msgs[-1]["role"] != "assistant":
            return
        text = msgs[-1]["content"]
        new, self._streamed = text[self._streamed :], len(text)
        if new:
            cur = QTextCursor(self.view.document())
            cur.movePosition(QTextCursor.End)
            cur.insertText(new, QTextCharFormat())
            sb = self.view.verticalScrollBar()
            sb.setValue(sb.maximum())

    # -- actions ---------------------------------------------------------------------------
    def send(self, text: str | None = None) -> bool:
        if self.generating:
            return False
        text = self.input.toPlainText() if text is None else text
        if not text.strip():
            return False
        msgs = self.conversation["messages"]
        if self.edit_index is not None:
            del msgs[self.edit_index :]
            self.cancel_edit()
        msgs.append({"role": "user", "content": text.strip()})
        self.input.clear()
        return self._generate()

    def regenerate(self) -> bool:
        if self.generating:
            return False
        msgs = self.conversation["messages"]
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            return False
        return self._generate()

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
            f"Editing message {index + 1}: sending resends the chat from "
            f"here (later messages are replaced). Esc cancels."
        )
        self.edit_banner.show()

    def cancel_edit(self) -> None:
        self.edit_index = None
        self.edit_banner.hide()

    def _anchor(self, url: QUrl) -> None:
        if url.scheme() == "edit":
            try:
                self.edit_message(int(url.path() or url.toString().split(":", 1)[1]))
            except ValueError:
                pass

    # -- generation --------------------------------------------------------------------------
    def _generate(self) -> bool:
        prompt_msgs = self.sampling.system_messages() + [
            {"role": m["role"], "content": m["content"]} for m in self.conversation["messages"]
        ]
        try:
            params = self.sampling.params()
        except ValueError as e:
            self.message.emit(str(e))
            return False
        gen = self.gen = self.bridge.chat(prompt_msgs, params)
        reply = {"role": "assistant", "content": ""}
        self.conversation["messages"].append(reply)
        gen.token.connect(lambda t, r=reply: self._token(r, t))
        gen.finished.connect(lambda d, r=reply: self._done(r, d))
        self.status.setText("Generating…")
        self._save()
        self._update_buttons()
        self.render()
        return True

    def _token(self, reply: dict, text: str) -> None:
        reply["content"] += text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def _done(self, reply: dict, done) -> None:
        self.gen = None
        names = {a["id"]: a["name"] for a in self.bridge.engine.adapters()}
        t = done.timings.as_dict()
        reply["content"] = (
            done.content if done.content or not reply["content"] else reply["content"]
        )
        reply["meta"] = {
            "tokens": t["predicted_n"],
            "tps": round(t["predicted_per_second"], 1),  # shown the same in both places
            "mix": format_mix(done.mix, names),
            "mix_ids": [[int(a), float(s)] for a, s in done.mix],
            "stop": done.stop_type,
        }
        if done.stop_type == "error":
            self.message.emit(f"Generation failed: {done.error}")
            reply["content"] = reply["content"] or f"*Error: {done.error}*"
        self.status.setText(
            f"{tokens_text(t['predicted_n'])} · {reply['meta']['tps']:.1f} tok/s"
            + (" · stopped" if done.stop_type == "cancel" else "")
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
        self.history.blockSignals(True)
        self.history.clear()
        for c in self.store.list():
            self.history.addItem(c["title"], c["id"])
        idx = self.history.findData(self.conversation["id"])
        if idx < 0:
            self.history.insertItem(0, "New chat (unsaved)", self.conversation["id"])
            idx = 0
        self.history.setCurrentIndex(idx)
        self.history.blockSignals(False)
        if self._started:
            for note in self.store.take_problems():
                self.problem.emit(note)

    def _history_chosen(self, index: int) -> None:
        cid = self.history.itemData(index)
        if cid and cid != self.conversation["id"]:
            self.open_conversation(cid)

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

    def delete_conversation(self) -> None:
        if self.generating:
            return
        self.store.delete(self.conversation["id"])
        self.new_conversation()
