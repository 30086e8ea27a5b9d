"""Small helpers shared by the widgets (formatting, dropped files, resources)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QObject, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from core.paths import resources_dir

RESOURCES = resources_dir()
UNDO_MS = 15000  # how long an Undo bar ("Deleted … Undo") stays
PROMPT_BOX_HEIGHT = 70  # A/B compare's and the grid's prompt: a few lines, the rest for replies


def human_bytes(n: float) -> str:
    """Binary units, named as such (a 4,917,000-byte file is "4.69 MiB", as file
    managers and ls -h show it), two decimals below 10 and one above."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.2f} {unit}" if n < 10 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def file_size(path: str | Path) -> int:
    """Bytes on disk of a file, or of the files directly in a folder (a PEFT adapter)."""
    p = Path(path)
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        return p.stat().st_size
    except OSError:
        return 0


def human_count(n: float) -> str:
    n = float(n or 0)
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def local_paths(mime: QMimeData) -> list[str]:
    if not mime.hasUrls():
        return []
    return [u.toLocalFile() for u in mime.urls() if u.isLocalFile()]


class FileDropMixin:
    """Accept dropped local files/folders and hand them to ``files_dropped(paths)``.
    Mix into a QWidget (before QWidget in the bases) and call setAcceptDrops(True)."""

    def files_dropped(self, paths: list[str]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def dragEnterEvent(self, event) -> None:
        if local_paths(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = local_paths(event.mimeData())
        if paths:
            self.files_dropped(paths)
            event.acceptProposedAction()


def is_adapter_path(path: str | Path) -> bool:
    """A folder or a GGUF whose general.type is "adapter" is a LoRA; other GGUFs are models."""
    p = Path(path)
    if p.is_dir() or p.suffix in (".safetensors", ".json"):
        return True
    try:
        from core.gguf.reader import GGUFFile

        return str(GGUFFile(p).metadata.get("general.type", "")) == "adapter"
    except Exception:
        return False


def is_model_gguf(path: str | Path) -> bool:
    """A readable GGUF that holds a whole model (general.type is not "adapter" and it
    has the token embeddings): added as an adapter by mistake, it can be opened as
    the model instead."""
    p = Path(path)
    if p.is_dir():
        return False
    try:
        from core.gguf.reader import GGUFFile

        gf = GGUFFile(p)
    except Exception:
        return False
    return gf.metadata.get("general.type") != "adapter" and "token_embd.weight" in gf.tensors


def run_controls(pane: QWidget, run_label: str, run, stop) -> tuple[QPushButton, QPushButton]:
    """A pane's primary button and its Stop button, with the keys every pane shares:
    Ctrl+Enter (either Enter key) runs, Esc stops, while focus is inside the pane.
    Stop starts disabled; the pane enables it while something runs."""
    run_btn = QPushButton(run_label)
    run_btn.setObjectName("primaryButton")
    run_btn.clicked.connect(lambda: run())  # clicked's bool must not reach run()
    stop_btn = QPushButton("Stop")
    stop_btn.setObjectName("stopButton")
    stop_btn.clicked.connect(stop)
    stop_btn.setEnabled(False)
    within = Qt.WidgetWithChildrenShortcut
    for seq in ("Ctrl+Return", "Ctrl+Enter"):  # the main Enter key and the keypad's
        QShortcut(QKeySequence(seq), pane, lambda: run(), context=within)
    QShortcut(QKeySequence("Escape"), pane, stop, context=within)
    return run_btn, stop_btn


def prompt_row(
    pane: QWidget, placeholder: str, run_label: str, run, stop, *extra: QWidget
) -> tuple[QPlainTextEdit, QPushButton, QPushButton, QHBoxLayout]:
    """The prompt box of a pane that runs one prompt several ways (A/B compare, the
    grid), with its buttons in a column beside it: Run, Stop (run_controls' keys),
    then ``extra``. Returns (prompt, run button, Stop button, the row to lay out)."""
    prompt = QPlainTextEdit()
    prompt.setPlaceholderText(f"{placeholder}…   (Ctrl+Enter to run)")
    prompt.setMaximumHeight(PROMPT_BOX_HEIGHT)
    run_btn, stop_btn = run_controls(pane, run_label, run, stop)
    col = QVBoxLayout()
    for w in (run_btn, stop_btn, *extra):
        col.addWidget(w)
    row = QHBoxLayout()
    row.addWidget(prompt, 1)
    row.addLayout(col)
    return prompt, run_btn, stop_btn, row


class ElidedLabel(QLabel):
    """A one-line label that asks for no minimum width: it elides its text ("…") to
    the space it gets, so a long name or facts line never widens the window."""

    def __init__(self, text: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.full_text = ""
        self.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Preferred)
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        self.full_text = text
        self._elide()

    def sizeHint(self):  # noqa: N802
        hint = super().sizeHint()
        # the stylesheet's padding (the mixer's #stripName) is in the contents margins
        m = self.contentsMargins()
        text = self.fontMetrics().horizontalAdvance(self.full_text) + 4
        hint.setWidth(text + m.left() + m.right())
        return hint

    def minimumSizeHint(self):  # noqa: N802
        hint = super().minimumSizeHint()
        hint.setWidth(min(40, self.sizeHint().width()))  # room for a few letters and "…"
        return hint

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        # the room inside the padding: elided to the width, a padded label clipped its text
        room = self.contentsRect().width()
        shown = self.fontMetrics().elidedText(self.full_text, Qt.ElideRight, max(room, 0))
        super().setText(shown if self.width() > 0 else self.full_text)


class FactsLabel(ElidedLabel):
    """A line of facts joined by " · " that drops whole facts, least wanted first,
    when the room is short (at 1024 px the model bar's RAM and load time were the
    ones cut); only a single fact left too long is elided."""

    SEP = "  ·  "

    def __init__(self, parent: QWidget | None = None):
        self.parts: list[str] = []
        self.drop_order: list[int] = []  # indexes into parts, the first dropped first
        super().__init__("", parent)

    def set_parts(self, parts: list[str], drop_order: list[int]) -> None:
        self.parts, self.drop_order = list(parts), list(drop_order)
        self.setText(self.SEP.join(parts))

    def _elide(self) -> None:
        if not self.parts or self.width() <= 0:
            super()._elide()
            return
        room = self.contentsRect().width()
        keep = list(range(len(self.parts)))
        fm = self.fontMetrics()
        for i in self.drop_order:
            if fm.horizontalAdvance(self.SEP.join(self.parts[k] for k in keep)) <= room:
                break
            if len(keep) > 1:
                keep.remove(i)
        shown = self.SEP.join(self.parts[k] for k in keep)
        QLabel.setText(self, fm.elidedText(shown, Qt.ElideRight, max(room, 0)))


class ScrollPlace(QObject):
    """Keeps a text view where the reader left it: the text at the top stays at the top
    (or the view stays at the end) when the document is replaced or laid out again —
    a re-render, a theme's re-polish, the window's first show. In pixels alone a
    theme switch moved a long chat by a screen or more."""

    END = -1

    def __init__(self, view):
        super().__init__(view)
        self.view = view
        self.top = self.END  # the text position at the top of the view, or END
        self._busy = False
        sb = view.verticalScrollBar()
        sb.rangeChanged.connect(lambda *_: self.apply())
        # the reader's own scrolling only (wheel, keys, the bar): the view also moves
        # itself while it lays out (to the top on show), which is no place to keep
        sb.actionTriggered.connect(lambda _: QTimer.singleShot(0, self, self.note))
        sb.sliderReleased.connect(self.note)

    def note(self) -> None:
        """The reader scrolled: remember where to."""
        if self._busy:
            return
        sb = self.view.verticalScrollBar()
        at_end = sb.value() >= sb.maximum() - 4
        self.top = self.END if at_end else self.view.cursorForPosition(QPoint(4, 4)).position()

    def apply(self) -> None:
        sb = self.view.verticalScrollBar()
        self._busy = True
        try:
            if self.top == self.END:
                sb.setValue(sb.maximum())
                return
            cursor = QTextCursor(self.view.document())
            cursor.setPosition(min(self.top, max(self.view.document().characterCount() - 1, 0)))
            sb.setValue(sb.value() + self.view.cursorRect(cursor).top())
        finally:
            self._busy = False

    def replace(self, set_content, to_end: bool = False) -> None:
        """Run ``set_content`` (a setHtml) and come back to the same place (or the end)."""
        if to_end:
            self.top = self.END
        self._busy = True
        try:
            set_content()
        finally:
            self._busy = False
        self.apply()


class UndoBar(QWidget):
    """ "Deleted “x”  [Undo]" under what was deleted (a chat, a preset), for UNDO_MS;
    ``undo`` is emitted by its button."""

    undo = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setObjectName("hint")
        self.button = QPushButton("Undo")
        self.button.clicked.connect(self.undo)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.button)
        self._timer = QTimer(self, singleShot=True, interval=UNDO_MS)
        self._timer.timeout.connect(self.hide)
        self.hide()

    def say(self, text: str) -> None:
        self.label.setText(text)
        self.show()
        self._timer.start()

    def dismiss(self) -> None:
        self.hide()
        self._timer.stop()
