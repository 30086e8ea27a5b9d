"""The sidebar of saved chats (as in LM Studio and Jan): newest first, a search field
that matches titles and message text, rename in place (F2 or the context menu),
delete (Delete key, context menu or the button) with an Undo bar, and New chat.

It only shows and asks: the ChatPane owns the store and the open conversation and
does what the signals ask for.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from core.conversation import every_message
from core.settings import Conversations

from .util import UndoBar

ID_ROLE = Qt.UserRole


class ChatList(QWidget):
    open_requested = Signal(str)  # conversation id
    new_requested = Signal()
    rename_requested = Signal(str, str)  # id, new title
    delete_requested = Signal(str)
    undo_requested = Signal()

    def __init__(self, store: Conversations, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatSidebar")
        self.store = store
        self._text: dict[str, str] = {}  # id -> its messages' text, for search
        self._filling = False

        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.apply_filter)
        self.list = QListWidget()
        self.list.setObjectName("chatList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)  # long titles elide
        self.list.setTextElideMode(Qt.ElideRight)
        self.list.setEditTriggers(QAbstractItemView.EditKeyPressed)  # F2 renames
        self.list.itemClicked.connect(self._clicked)
        self.list.itemActivated.connect(self._clicked)
        self.list.itemChanged.connect(self._edited)
        self.list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        QShortcut(QKeySequence.Delete, self.list, self._delete_current, context=Qt.WidgetShortcut)
        new_btn = QPushButton("New")
        new_btn.setToolTip("Start a new chat (Ctrl+N)")
        new_btn.clicked.connect(self.new_requested)
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.setToolTip("Delete the selected chat (Del); Undo brings it back")
        self.delete_btn.clicked.connect(self._delete_current)

        self.undo_bar = UndoBar()
        self.undo_bar.undo.connect(self.undo_requested)
        self.undo_btn = self.undo_bar.button

        buttons = QHBoxLayout()
        buttons.setSpacing(4)
        buttons.addWidget(new_btn, 1)
        buttons.addWidget(self.delete_btn, 1)
        title = QLabel("Chats")
        title.setObjectName("sectionTitle")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(title)
        lay.addWidget(self.search)
        lay.addWidget(self.list, 1)
        lay.addWidget(self.undo_bar)
        lay.addLayout(buttons)

    # -- showing -------------------------------------------------------------------------
    def refresh(self, current: str, unsaved: bool) -> None:
        """The saved chats, newest first; ``unsaved``: the open chat has no file yet."""
        self._filling = True
        self.list.clear()
        rows = self.store.list()
        if unsaved:
            rows.insert(0, {"id": current, "title": "New chat (unsaved)", "updated": 0.0})
        for c in rows:
            item = QListWidgetItem(c["title"])
            item.setData(ID_ROLE, c["id"])
            item.setToolTip(c["title"])
            if not (unsaved and c["id"] == current):
                item.setFlags(item.flags() | Qt.ItemIsEditable)
            self.list.addItem(item)
            if c["id"] == current:
                self.list.setCurrentItem(item)
        self._filling = False
        self.apply_filter()

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def visible_titles(self) -> list[str]:
        return [
            self.list.item(i).text()
            for i in range(self.list.count())
            if not self.list.item(i).isHidden()
        ]

    def apply_filter(self, *_) -> None:
        """Hide the chats whose title and messages do not contain every search word."""
        words = self.search.text().lower().split()
        for i in range(self.list.count()):
            item = self.list.item(i)
            if not words:
                item.setHidden(False)
                continue
            text = item.text().lower() + "\n" + self._content(item.data(ID_ROLE))
            item.setHidden(not all(w in text for w in words))

    def _content(self, cid: str) -> str:
        """A chat's message text (every branch), lower-cased, read once (forget() when
        it changes)."""
        if cid not in self._text:
            conv = self.store.load(cid)
            msgs = every_message(conv["messages"]) if conv else []  # every branch's
            self._text[cid] = "\n".join(m["content"] for m in msgs).lower()
        return self._text[cid]

    def forget(self, cid: str) -> None:
        """The chat changed: read its text again at the next search."""
        self._text.pop(cid, None)

    def show_undo(self, title: str) -> None:
        self.undo_bar.say(f"Deleted “{title}”")

    def hide_undo(self) -> None:
        self.undo_bar.dismiss()

    # -- asking --------------------------------------------------------------------------
    def _clicked(self, item: QListWidgetItem) -> None:
        self.open_requested.emit(item.data(ID_ROLE))

    def _edited(self, item: QListWidgetItem) -> None:
        if self._filling:
            return
        self.rename_requested.emit(item.data(ID_ROLE), item.text())

    def _delete_current(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.delete_requested.emit(item.data(ID_ROLE))

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        menu = QMenu(self)
        ren = menu.addAction("Rename")
        ren.setEnabled(bool(item.flags() & Qt.ItemIsEditable))
        ren.triggered.connect(lambda: self.list.editItem(item))
        menu.addAction("Delete").triggered.connect(
            lambda: self.delete_requested.emit(item.data(ID_ROLE))
        )
        menu.exec(self.list.viewport().mapToGlobal(pos))
