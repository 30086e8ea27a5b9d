"""A channel meter for a mixer strip: how much its adapter changes the model right now.

The engine measures (core/lora/meter.py): ‖Δ_a x‖ / ‖W x‖ over a decode step's
products, at most ten times a second per request. The bar shows that ratio on a log
scale from 0.1% (empty) to 100% (full), rises at once and falls back over about a
second, as a desk's meter does, so a reply that stops leaves no frozen level.
"""

from __future__ import annotations

import math
import time

from PySide6.QtCore import QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QPainter, QPalette
from PySide6.QtWidgets import QSizePolicy, QWidget

FLOOR = 1e-3  # the ratio at the bottom of the bar (0.1%); 1.0 fills it
FALL_PER_S = 1.2  # the bar falls this much of its height per second
HOLD_S = 0.35  # a level is held this long after the last reading (3 readings' gap)
TICK_MS = 33  # redraws while falling (30 a second)


def level_of(ratio: float) -> float:
    """The bar's height 0..1 for a meter ratio: log10 from FLOOR to 1."""
    if not ratio > FLOOR:  # also NaN
        return 0.0
    return min(1.0, math.log10(ratio / FLOOR) / -math.log10(FLOOR))


class Meter(QWidget):
    """A thin vertical bar beside the fader: ``show_value(ratio)`` per reading."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("channelMeter")
        self.setSizePolicy(QSizePolicy.Fixed, QSizePolicy.Preferred)
        self.level = 0.0  # what is drawn, 0..1
        self.value: float | None = None  # the last reading (ratio)
        self._at = 0.0  # monotonic time of the last reading
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._fall)
        self.setToolTip(self._tip())

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(6, 20)  # 8 px pushed 8 strips at 1024x700 1 px past the desk

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        return QSize(5, 12)

    def show_value(self, ratio: float) -> None:
        """A new reading: the bar jumps up to it (or starts falling toward it)."""
        self.value = float(ratio)
        self._at = time.monotonic()
        self.level = max(self.level, level_of(self.value))
        self.setToolTip(self._tip())
        self.update()
        if not self._timer.isActive():
            self._timer.start()

    def clear(self) -> None:
        self.level, self.value = 0.0, None
        self._timer.stop()
        self.setToolTip(self._tip())
        self.update()

    def _fall(self) -> None:
        held = time.monotonic() - self._at < HOLD_S
        target = level_of(self.value or 0.0) if held else 0.0
        self.level = max(target, self.level - FALL_PER_S * TICK_MS / 1000)
        if self.level <= 0.0 and not held:
            self.level = 0.0
            self._timer.stop()
        self.update()

    def _tip(self) -> str:
        now = (
            f"Last reading: {self.value:.1%} of the base products' size"
            if self.value is not None
            else "No reading yet: it moves while a reply uses this adapter"
        )
        return (
            "Meter: how much this adapter changes the model right now, ‖Δx‖ / ‖Wx‖ over "
            "a decode step's products (log scale, 0.1% to 100%)\n" + now
        )

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        r = QRectF(self.rect()).adjusted(1, 2, -1, -2)
        pal = self.palette()
        p.setPen(Qt.NoPen)
        p.setBrush(pal.color(QPalette.Mid))
        p.drawRoundedRect(r, 2, 2)
        if self.level > 0.0:
            h = r.height() * self.level
            p.setBrush(pal.color(QPalette.Highlight))
            p.drawRoundedRect(QRectF(r.left(), r.bottom() - h, r.width(), h), 2, 2)
        p.end()
