"""The desk's undo history: named steps (a fader move, a mute, a deleted preset), the
Edit menu over them (Undo/Redo naming the step, History to jump back), and Ctrl+Z
reaching the mix when the focused text box has nothing of its own to undo.

A step is {"label", "before": desk snapshot} on the undo list and {"label", "after"}
on the redo list, so its name travels with it; a deleted preset is a step
{"label", "deleted_preset", "preset"} on either list. Snapshots are the mixer's
(``MixerPanel.snapshot``): bypass, merge spec, and (value, muted, solo) per strip.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QEvent, QObject, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QAbstractSpinBox,
    QApplication,
    QLineEdit,
    QMainWindow,
    QPlainTextEdit,
    QTextEdit,
)

HISTORY = 200  # undo steps kept
COALESCE_S = 1.0  # one fader moving again within this long is still the same step


def describe(before: dict, after: dict, names: dict[int, str]) -> str:
    """What changed from one desk snapshot to the next, in a few words."""
    if before["bypass"] != after["bypass"]:
        return f"Bypass all {'on' if after['bypass'] else 'off'}"
    if before.get("merge") != after.get("merge"):
        b, a = before.get("merge"), after.get("merge")
        return f"method {getattr(b, 'method', 'linear')} → {getattr(a, 'method', 'linear')}"
    changed = [aid for aid in after["strips"] if before["strips"].get(aid) != after["strips"][aid]]
    if len(changed) == 1:
        aid = changed[0]
        (v0, m0, _), (v1, m1, s1) = before["strips"][aid], after["strips"][aid]
        name = names.get(aid, f"#{aid}")
        if v0 != v1:
            return f"{name} {v0:.2f} → {v1:.2f}"
        if m0 != m1:
            return f"{'mute' if m1 else 'unmute'} {name}"
        return f"{'solo' if s1 else 'unsolo'} {name}"
    if changed and all(after["strips"][a][0] == 0.0 for a in changed):
        return "Zero all"
    return f"{len(changed)} strips"


class MixHistory(QObject):
    """The undo and redo lists of the desk; ``changed`` after every change to them."""

    changed = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.undo_steps: list[dict] = []
        self.redo_steps: list[dict] = []
        self.last: dict | None = None  # the desk as the last step (or a sync) left it
        self._last_change: tuple[object, float] = (None, 0.0)

    def settle(self, now: dict) -> None:
        """The desk is ``now`` without a step (a change from outside, a restore)."""
        self.last, self._last_change = now, (None, 0.0)

    def record(self, now: dict, names: dict[int, str]) -> None:
        """A change the user made: the state before it becomes a step, except while one
        fader keeps moving (a drag, a wheel) within COALESCE_S: then the step grows."""
        before, self.last = self.last, now
        if before is None or before == now or before["strips"].keys() != now["strips"].keys():
            return
        moved = [a for a in now["strips"] if now["strips"][a][0] != before["strips"][a][0]]
        key = moved[0] if len(moved) == 1 and before["bypass"] == now["bypass"] else None
        last_key, at = self._last_change
        t = time.monotonic()
        self._last_change = (key, t)
        top = self.undo_steps[-1] if self.undo_steps else None
        if key is not None and key == last_key and t - at < COALESCE_S and top and "before" in top:
            top["label"] = describe(top["before"], now, names)  # the same fader still moving
        else:
            self.push({"label": describe(before, now, names), "before": before})
        self.changed.emit()

    def push(self, step: dict) -> None:
        self.undo_steps.append(step)
        del self.undo_steps[:-HISTORY]
        self.redo_steps.clear()
        self.changed.emit()

    def pop_undo(self, now: dict) -> dict:
        """The step to undo; the redo list gets it back with ``now`` as its after."""
        step = self.undo_steps.pop()
        back = step if "deleted_preset" in step else {"label": step["label"], "after": now}
        self.redo_steps.append(back)
        self.changed.emit()
        return step

    def pop_redo(self, now: dict) -> dict:
        step = self.redo_steps.pop()
        back = step if "deleted_preset" in step else {"label": step["label"], "before": now}
        self.undo_steps.append(back)
        self.changed.emit()
        return step

    def take_preset_step(self) -> dict | None:
        """The last deleted preset's step, out of the undo list (the Undo bar's)."""
        for i in range(len(self.undo_steps) - 1, -1, -1):
            if "deleted_preset" in self.undo_steps[i]:
                step = self.undo_steps.pop(i)
                self.changed.emit()
                return step
        return None

    def undo_label(self) -> str:
        return self.undo_steps[-1]["label"] if self.undo_steps else ""

    def redo_label(self) -> str:
        return self.redo_steps[-1]["label"] if self.redo_steps else ""

    def entries(self) -> list[tuple[str, bool]]:
        """(label, is where the desk is now), oldest first: "start", the steps that can
        be undone, then those that can be redone. Entry i is the desk after i steps."""
        labels = ["start"] + [s["label"] for s in self.undo_steps]
        labels += [s["label"] for s in reversed(self.redo_steps)]
        now = len(self.undo_steps)
        return [(label, i == now) for i, label in enumerate(labels)]


def build_edit_menu(window: QMainWindow, mixer) -> None:
    """Edit ▸ Undo/Redo (naming the step), History (jump to any step). Sets
    ``window.undo_action``, ``window.redo_action`` and ``window.history_menu``."""
    menu = window.menuBar().addMenu("&Edit")
    undo = QAction("&Undo", window, shortcut=QKeySequence("Ctrl+Z"))
    undo.triggered.connect(mixer.undo)
    # explicit keys: the platform's Redo may also be Ctrl+Shift+Z, and two shortcuts
    # on one key are ambiguous (neither fires)
    redo = QAction("&Redo", window)
    redo.setShortcuts([QKeySequence("Ctrl+Shift+Z"), QKeySequence("Ctrl+Y")])
    redo.triggered.connect(mixer.redo)
    menu.addAction(undo)
    menu.addAction(redo)
    menu.addSeparator()
    history = menu.addMenu("Mix &history")

    def fill() -> None:
        history.clear()
        for i, (label, now) in enumerate(mixer.history()):
            act = history.addAction(label, lambda i=i: mixer.jump_to(i))
            act.setCheckable(True)
            act.setChecked(now)

    history.aboutToShow.connect(fill)

    def update() -> None:
        u, r = mixer.steps.undo_label(), mixer.steps.redo_label()
        undo.setText(f"&Undo {u}" if u else "&Undo")
        redo.setText(f"&Redo {r}" if r else "&Redo")
        undo.setEnabled(bool(u))
        redo.setEnabled(bool(r))

    mixer.steps.changed.connect(update)
    update()
    window.undo_action, window.redo_action, window.history_menu = undo, redo, history
    UndoPassThrough(window)


class UndoPassThrough(QObject):
    """Ctrl+Z (and the Redo keys) in a text box of ``window`` with nothing of its own to
    undo (redo) reach the window's Edit menu, that is the mix: a text box otherwise
    takes the key even when empty. Installed on the application, it looks only at
    shortcut overrides."""

    def __init__(self, window: QMainWindow):
        super().__init__(window)
        self.window = window
        # a child of the window: Qt drops the filter when the window goes
        QApplication.instance().installEventFilter(self)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 (Qt's name)
        if event.type() != QEvent.ShortcutOverride or not isinstance(obj, QObject):
            return False
        kind = self._kind(event)
        if kind is None or not self.window.isAncestorOf(obj):
            return False
        box = text_box(obj)
        if box is None or box_can(box, kind):
            return False
        return True  # not overridden: the Edit menu's shortcut fires

    @staticmethod
    def _kind(event) -> str | None:
        seq = QKeySequence(event.keyCombination())
        if seq == QKeySequence("Ctrl+Z"):
            return "undo"
        if seq in (QKeySequence("Ctrl+Shift+Z"), QKeySequence("Ctrl+Y")):
            return "redo"
        return None


def text_box(obj: QObject):
    """The editable text under ``obj`` (a line edit, a text box, a spin box's line)."""
    if isinstance(obj, QAbstractSpinBox):
        obj = obj.findChild(QLineEdit)
    if isinstance(obj, QLineEdit) and not obj.isReadOnly():
        return obj
    if isinstance(obj, (QPlainTextEdit, QTextEdit)) and not obj.isReadOnly():
        return obj
    return None


def box_can(box, kind: str) -> bool:
    if isinstance(box, QLineEdit):
        return box.isUndoAvailable() if kind == "undo" else box.isRedoAvailable()
    doc = box.document()
    return doc.isUndoAvailable() if kind == "undo" else doc.isRedoAvailable()
