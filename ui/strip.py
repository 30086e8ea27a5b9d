"""One channel strip of the desk (ui/mixer.py lays them out): an adapter's, or a
control vector's.

A strip holds a fader value (−2…2), an on/mute toggle and a solo button; the desk's
rule (ui/desk.py) turns the strips into the engine mix. A control vector's strip
(:class:`VectorStrip`) is the same channel with its name in italics and a "vec" tag
(the layers it steers in its tooltip) where an adapter shows its effective scale (a vector has no
α / r); an aLoRA adapter's strip says
"aLoRA" before its name and shows its invocation text in the tooltip.
"""

from __future__ import annotations

import math

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QLabel,
    QSizePolicy,
    QSlider,
    QStyle,
    QToolButton,
    QWidget,
)

from core.lora.adapter import effective_scale

from .desk import Channel
from .meter import Meter
from .util import ElidedLabel

SCALE_MIN, SCALE_MAX = -2.0, 2.0
TICKS = 100  # slider steps per 1.0
DETENTS = (-1.0, 0.0, 1.0)  # a drag that comes this close to them stops there
# a drag that ends within this many pixels of a detent lands on it, whatever the fader's
# width (a pull of 0.04 in scale made ±1 about 3 px wide: drags landed on 1.05 or 1.08)
DETENT_PX = 6
FINE = 0.1  # Shift+drag moves the fader this much per pixel of a normal drag
# the throw: 4.0 of scale over at least 100 px (0.04 a pixel; the detents still catch
# 0 and ±1, Shift+drag and the number box are finer). 160 px made the rows ~75 px too
# wide for a 1024 px window's desk, which then scrolled sideways.
FADER_MIN_WIDTH = 100


def detent(value: float, pull: float) -> float:
    """A fader value pulled onto 0 or ±1 when it is within ``pull`` (in scale) of one."""
    for d in DETENTS:
        if abs(value - d) <= pull:
            return d
    return value


class Fader(QSlider):
    """A channel fader as on a mixing desk: double-click or Alt+click resets it to 0,
    Shift+drag moves it finely, Home goes to 0 (not to the −2 end)."""

    reset = Signal()

    def __init__(self):
        super().__init__(Qt.Horizontal)
        self._fine_from: tuple[int, int] | None = None  # (x at press, value at press)

    def pull(self) -> float:
        """DETENT_PX in the fader's units (scale, or effective in unity mode; a
        Shift+drag's pixels are finer)."""
        groove = max(self.width() - self.style().pixelMetric(QStyle.PM_SliderLength, None, self), 1)
        per_px = (self.maximum() - self.minimum()) / TICKS / groove
        return DETENT_PX * per_px * (FINE if self._fine_from is not None else 1.0)

    def mouseDoubleClickEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self.reset.emit()

    def mousePressEvent(self, event) -> None:  # noqa: N802
        mods = event.modifiers()
        if mods & Qt.AltModifier:
            self.reset.emit()
            return
        if mods & Qt.ShiftModifier:
            self._fine_from = (int(event.position().x()), self.value())
            self.setSliderDown(True)
            return
        super().mousePressEvent(event)

    def mouseMoveEvent(self, event) -> None:  # noqa: N802
        if self._fine_from is not None:
            x0, v0 = self._fine_from
            per_px = (self.maximum() - self.minimum()) / max(self.width(), 1)
            self.setValue(int(round(v0 + (event.position().x() - x0) * per_px * FINE)))
            return
        super().mouseMoveEvent(event)

    def mouseReleaseEvent(self, event) -> None:  # noqa: N802
        if self._fine_from is not None:
            self._fine_from = None
            self.setSliderDown(False)
            return
        super().mouseReleaseEvent(event)

    def keyPressEvent(self, event) -> None:  # noqa: N802
        if event.key() == Qt.Key_Home:
            self.reset.emit()
            return
        super().keyPressEvent(event)


def unity_ratio(info: dict) -> float:
    """α / r: effective = scale × this (1 for an adapter without alpha, as llama.cpp)."""
    return effective_scale(1.0, info.get("alpha"), info.get("rank") or 1) or 1.0


class Strip:
    """The widgets of one mixer row. ``value`` is always llama-server's scale; in unity
    mode the fader and number box show and take it in effective units (× α / r)."""

    KIND = "adapter"

    def __init__(self, info: dict, on_change, unity: bool = False):
        self.info = info
        self.id = info["id"]
        self.unity = unity
        # checked = on; lit (the DAW convention for a mute) while it is off
        self.on = QToolButton(checkable=True, checked=True, text="M")
        self.on.setObjectName("muteButton")
        self.on.setToolTip(f"Mute this {self.KIND} (lit while muted)")
        self.solo = QToolButton(checkable=True, text="S")
        self.solo.setObjectName("soloButton")
        self.solo.setToolTip("Solo: hear only soloed strips (adapters and vectors)")
        self.name = TaggedLabel(info["name"])
        self.name.setObjectName("stripName")
        self.name.setMinimumWidth(44)  # elided ("lora_a…") where the desk is narrow
        self.mark_differs(None)
        self.slider = Fader()
        self.slider.setTickPosition(QSlider.TicksBelow)
        self.slider.setTickInterval(TICKS // 2)
        self.slider.setMinimumWidth(FADER_MIN_WIDTH)
        self.slider.setToolTip(
            "Double-click or Alt+click: 0 · Shift+drag: fine · stops at 0 and ±1 · Home: 0"
        )
        self.slider.reset.connect(lambda: self.set_value(0.0))
        self.slider.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.meter = Meter()  # how much the adapter changes the model, live
        self.spin = QDoubleSpinBox(decimals=3, singleStep=0.05)
        self.spin.setKeyboardTracking(False)
        self.spin.setFixedWidth(70)  # "-2.000" and the arrows, as Fusion measures it
        self.eff = QLabel()
        self.eff.setObjectName("effLabel")
        self.eff.setMinimumWidth(56)  # "+1.500" to "-12.000" without the column jumping
        self._on_change = on_change
        self.slider.valueChanged.connect(lambda v: self._set(v / TICKS, from_slider=True))
        self.spin.valueChanged.connect(lambda v: self._set(v, from_slider=False))
        self._set_ranges()
        self.on.toggled.connect(self._toggled)
        self.solo.toggled.connect(lambda _: on_change())
        self.value = 0.0
        self.set_value(float(info.get("scale", 0.0)), notify=False)

    def widgets(self) -> list[QWidget]:
        return [self.on, self.solo, self.name, self.slider, self.meter, self.spin, self.eff]

    def _toggled(self, on: bool) -> None:
        self._on_change()

    def ratio(self) -> float:
        """Displayed units per unit of scale: α / r in unity mode, else 1."""
        return unity_ratio(self.info) if self.unity else 1.0

    def _set_ranges(self) -> None:
        """The fader and box span the scale's −2…2 in the displayed unit, so switching
        units never clamps (and so never changes) the mix."""
        lo, hi = sorted((SCALE_MIN * self.ratio(), SCALE_MAX * self.ratio()))
        for w in (self.slider, self.spin):
            w.blockSignals(True)
        self.slider.setRange(math.floor(lo * TICKS), math.ceil(hi * TICKS))
        self.spin.setRange(lo, hi)
        for w in (self.slider, self.spin):
            w.blockSignals(False)
        self.spin.setToolTip(
            "Effective scale (scale × α / r): 1.0 is the adapter as trained; "
            "View → Unity faders switches back to llama-server's scale"
            if self.unity
            else "llama-server's scale (the Effective column multiplies it by α / r)"
        )

    def set_unity(self, on: bool) -> None:
        """Show the fader and box in effective units (on) or scale units; the value stays."""
        self.unity = on
        self._set_ranges()
        self.set_value(self.value, notify=False)

    def _set(self, shown: float, from_slider: bool) -> None:
        """A value the user set on the fader or box, in the displayed unit."""
        ratio = self.ratio()
        if from_slider and abs(round(self.value * ratio * TICKS) - shown * TICKS) < 0.5:
            return  # the slider is coarser than the spin box: keep the precise value
        if from_slider and self.slider.isSliderDown():
            shown = detent(shown, self.slider.pull())  # 0 and ±1 in the unit shown
        self.set_value(shown / ratio)

    def mark_differs(self, preset: tuple[str, Channel] | None) -> None:
        """● before the name while this strip differs from the selected preset (name,
        what the preset has for it); the tooltip says what the preset has."""
        self.differs = preset is not None
        name, path = self.info["name"], self.info.get("path", "")
        tip = f"{name}\n{path}" if path else name
        if preset is not None:
            pname, ch = preset
            flags = ", ".join(f for f, on in (("muted", ch.muted), ("solo", ch.solo)) if on)
            unit = "unity" if self.unity else "scale"  # as the fader shows it
            there = ch.scale * self.ratio()
            tip += f"\n● differs from preset “{pname}”: {unit} {there:.3f} there" + (
                f" ({flags})" if flags else ""
            )
        tag, about = self.tag()
        if bool(tag) != self.name.font().underline():
            font = self.name.font()
            font.setUnderline(bool(tag))
            self.name.setFont(font)
        self.name.tag = f"[{tag}] " if tag else ""
        self.name.setText(f"● {name}" if preset is not None else name)
        self.name.setToolTip(f"{about}\n{tip}" if about else tip)

    def tag(self) -> tuple[str, str]:
        """The mark before the name and what it means (the tooltip's first line): an
        activated LoRA says "aLoRA" and the text that switches it on."""
        invocation = self.info.get("alora_invocation_string")
        if invocation is None and not self.info.get("alora_invocation_tokens"):
            return "", ""
        return "aLoRA", (
            "Activated LoRA (aLoRA): applies only to tokens after its invocation text "
            f"{visible(invocation or '')} (its {len(self.info.get('alora_invocation_tokens') or ())}"
            " tokens), so the prompt before it keeps the base model's cache"
        )

    def set_busy(self, busy: bool) -> None:
        """Light the name while a request that uses this adapter runs (chat or HTTP)."""
        if bool(self.name.property("busy")) == busy:
            return
        self.name.setProperty("busy", busy)
        self.name.style().unpolish(self.name)
        self.name.style().polish(self.name)

    def show_silenced(self, silent: bool) -> None:
        """Dim a strip that the desk's buttons keep silent (mute, solo, bypass)."""
        for w in (self.name, self.eff):
            w.setEnabled(not silent)

    def set_value(self, value: float, notify: bool = True) -> None:
        value = max(SCALE_MIN, min(SCALE_MAX, float(value)))
        self.value = value
        shown = value * self.ratio()
        for w, v in ((self.slider, int(round(shown * TICKS))), (self.spin, shown)):
            w.blockSignals(True)
            w.setValue(v)
            w.blockSignals(False)
        if notify:
            self._on_change()

    @property
    def muted(self) -> bool:
        return not self.on.isChecked()

    def channel(self) -> Channel:
        return Channel(self.value, self.muted, self.solo.isChecked())

    def set_flags(self, muted: bool | None = None, solo: bool | None = None) -> None:
        for btn, val in ((self.on, None if muted is None else not muted), (self.solo, solo)):
            if val is not None and btn.isChecked() != val:
                btn.blockSignals(True)
                btn.setChecked(val)
                btn.blockSignals(False)

    def show_effective(self, engine_scale: float) -> None:
        a, r = self.info.get("alpha"), self.info.get("rank") or 1
        eff = effective_scale(engine_scale, a, r)
        # the number only: with "α16/r8" beside it the column pushed the desk past a
        # 1280 px window's left pane; the ratio is in the tooltip (and the adapter list)
        self._show_eff(
            f"{eff:+.3f}",
            engine_scale != 0.0,
            f"effective scale = scale × α / r = {engine_scale:+.3f} × α{a:g}/r{r}\n"
            f"α/r = {a:g}/{r} = {a / r:g}"
            if a
            else f"no alpha in the adapter (rank {r}): effective scale = scale",
        )

    def _show_eff(self, text: str, active: bool, tip: str) -> None:
        """The Effective column: its text, its "active" style, its tooltip."""
        self.eff.setText(text)
        self.eff.setProperty("active", active)
        self.eff.style().unpolish(self.eff)
        self.eff.style().polish(self.eff)
        self.eff.setToolTip(tip)


class TaggedLabel(ElidedLabel):
    """A strip's name with an optional tag before it ("[aLoRA] "): the tag shows while
    the name keeps a few letters beside it, and gives way to the name where the column
    is narrow (at 1024 px "[aLo…" left nothing of the name; the strip's underlined
    name and its tooltip still say it)."""

    MIN_NAME = 4  # letters of the name the tag must leave room for ("lora…")

    def __init__(self, text: str = "", parent: QWidget | None = None):
        self.tag = ""
        super().__init__(text, parent)

    def sizeHint(self):  # noqa: N802
        hint = super().sizeHint()
        hint.setWidth(hint.width() + self.fontMetrics().horizontalAdvance(self.tag))
        return hint

    def _elide(self) -> None:
        if not self.tag:
            return super()._elide()
        fm = self.fontMetrics()
        room = max(self.contentsRect().width(), 0)
        name = self.full_text
        tagged = self.tag + name
        if self.width() <= 0 or fm.horizontalAdvance(tagged) <= room:
            QLabel.setText(self, tagged)
            return
        left = room - fm.horizontalAdvance(self.tag)
        if left >= fm.horizontalAdvance(name[: self.MIN_NAME] + "…"):
            QLabel.setText(self, self.tag + fm.elidedText(name, Qt.ElideRight, left))
        else:
            QLabel.setText(self, fm.elidedText(name, Qt.ElideRight, room))


def visible(text: str) -> str:
    """``text`` quoted with its invisible characters written out: a newline as \\n, a
    tab as \\t, other control characters as \\xNN ("<|im_start|>assistant\\n")."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "“" + "".join(out) + "”"


def layer_span(layers) -> str:
    """A vector's steered layers as a range ("1–29"), or a count when it skips some."""
    layers = sorted(int(n) for n in layers or ())
    if not layers:
        return "none"
    lo, hi = layers[0], layers[-1]
    if hi - lo + 1 == len(layers):
        return f"{lo}–{hi}" if hi != lo else f"{lo}"
    return f"{lo}–{hi} ({len(layers)} of them)"


class VectorStrip(Strip):
    """A control vector's strip: fader, box, mute and solo as an adapter's, in the
    vector's own scale (llama.cpp's ``--control-vector-scaled``: it adds scale ×
    direction to the hidden state after each steered layer). No α / r, so no unity
    unit and no Effective value: the column shows the layers it steers. Its meter is
    what it adds against the hidden state it is added to (core/lora/meter.py)."""

    KIND = "vector"

    def __init__(self, info: dict, on_change, unity: bool = False):
        super().__init__(info, on_change, unity)
        # its name in italics, its "vec" tag in the Effective column: a tag before the
        # name left nothing of the name ("[vec…") in a 1024 px window's narrow column
        font = self.name.font()
        font.setItalic(True)
        self.name.setFont(font)

    def ratio(self) -> float:
        return 1.0  # a vector's scale is its only unit

    def _set_ranges(self) -> None:
        super()._set_ranges()
        self.spin.setToolTip("The vector's scale: adds scale × its direction to each layer")

    def about(self) -> str:
        return (
            f"Control vector: adds scale × direction to layers "
            f"{layer_span(self.info.get('layers'))}"
        )

    def tag(self) -> tuple[str, str]:
        return "", self.about()  # the tag is in the Effective column

    def set_busy(self, busy: bool) -> None:
        pass  # requests report their adapters, not their vectors

    def show_effective(self, engine_scale: float) -> None:
        # the tag alone: "vec 1–29" was wider than "+2.000" and took the width from the
        # names at 1024 px ("pirate" touched its fader); the layers are in the tooltip
        self._show_eff(
            "vec",
            engine_scale != 0.0,
            f"{self.about()} (no α / r: the scale is what is applied)\n"
            f"scale now {engine_scale:+.3f}",
        )
