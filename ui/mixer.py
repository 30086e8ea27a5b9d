"""The mixing desk: one channel strip per adapter, a master bypass and named presets.

A strip holds a fader value (−2…2), an on/mute toggle and a solo button. The
engine mix is derived from them (bypass → all 0; any solo → only soloed
strips; muted → 0) and pushed to the engine on every change; the next request
uses it, no reload. Mixes set elsewhere (HTTP ``POST /lora-adapters``) come back
through ``bridge.mix_changed`` and move the faders.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMenu,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSlider,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from core.lora.adapter import effective_scale
from core.settings import Settings

from .bridge import EngineBridge
from .desk import Channel, desk_mix
from .util import ElidedLabel

SCALE_MIN, SCALE_MAX = -2.0, 2.0
TICKS = 100  # slider steps per 1.0


class Strip:
    """The widgets of one mixer row."""

    def __init__(self, info: dict, on_change):
        self.info = info
        self.id = info["id"]
        self.on = QToolButton(checkable=True, checked=True, text="ON")
        self.on.setObjectName("muteButton")
        self.on.setToolTip("On / mute this adapter")
        self.solo = QToolButton(checkable=True, text="S")
        self.solo.setObjectName("soloButton")
        self.solo.setToolTip("Solo: hear only soloed adapters")
        self.name = ElidedLabel(info["name"])
        self.name.setObjectName("stripName")
        self.name.setMinimumWidth(48)
        self.name.setToolTip(info.get("path", ""))
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setRange(int(SCALE_MIN * TICKS), int(SCALE_MAX * TICKS))
        self.slider.setTickPosition(QSlider.TicksBelow)
        self.slider.setTickInterval(TICKS // 2)
        self.slider.setMinimumWidth(60)
        self.slider.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.spin = QDoubleSpinBox(
            decimals=3, singleStep=0.05, minimum=SCALE_MIN, maximum=SCALE_MAX
        )
        self.spin.setKeyboardTracking(False)
        self.spin.setFixedWidth(78)
        self.eff = QLabel()
        self.eff.setObjectName("effLabel")
        self.eff.setMinimumWidth(84)
        self._on_change = on_change
        self.slider.valueChanged.connect(lambda v: self._set(v / TICKS, from_slider=True))
        self.spin.valueChanged.connect(lambda v: self._set(v, from_slider=False))
        self.on.toggled.connect(self._toggled)
        self.solo.toggled.connect(lambda _: on_change())
        self.value = 0.0
        self.set_value(float(info.get("scale", 0.0)), notify=False)

    def widgets(self) -> list[QWidget]:
        return [self.on, self.solo, self.name, self.slider, self.spin, self.eff]

    def _toggled(self, on: bool) -> None:
        self.on.setText("ON" if on else "MUTE")
        self._on_change()

    def _set(self, value: float, from_slider: bool) -> None:
        if from_slider and abs(round(self.value * TICKS) - value * TICKS) < 0.5:
            return  # the slider is coarser than the spin box: keep the precise value
        self.set_value(value)

    def set_value(self, value: float, notify: bool = True) -> None:
        value = max(SCALE_MIN, min(SCALE_MAX, float(value)))
        self.value = value
        for w, v in ((self.slider, int(round(value * TICKS))), (self.spin, value)):
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
        self.on.setText("ON" if self.on.isChecked() else "MUTE")

    def show_effective(self, engine_scale: float) -> None:
        a, r = self.info.get("alpha"), self.info.get("rank") or 1
        eff = effective_scale(engine_scale, a, r)
        ratio = f"α{a:g}/r{r}" if a else f"r{r}"
        self.eff.setText(f"{eff:+.3f} {ratio}")
        self.eff.setProperty("active", engine_scale != 0.0)
        self.eff.style().unpolish(self.eff)
        self.eff.style().polish(self.eff)
        self.eff.setToolTip(
            "effective scale = scale × alpha / rank"
            if a
            else "no alpha in the adapter: effective scale = scale"
        )


class MixerPanel(QWidget):
    """Channel strips for ``bridge.engine``'s adapters, kept in sync both ways."""

    mix_applied = Signal(object)  # the engine mix the desk just set
    presets_changed = Signal()
    message = Signal(str)

    def __init__(self, bridge: EngineBridge, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        self.strips: dict[int, Strip] = {}
        self._syncing = False
        # desk entries (path -> scale, mute, solo) waiting for their adapter to load:
        # a restart or a model reload puts them back on the strips as they were
        self._pending: dict[str, dict] = {}
        self._pending_bypass: bool | None = None
        self._ready = False

        self.bypass = QPushButton("Bypass all", checkable=True)
        self.bypass.setObjectName("bypassButton")
        self.bypass.setToolTip("Master bypass: run the base model with every adapter at 0")
        self.bypass.toggled.connect(lambda _: self._apply())
        reset = QPushButton("Zero all")
        reset.setToolTip("Set every fader to 0")
        reset.clicked.connect(self.zero_all)

        self.preset_box = QComboBox()
        self.preset_box.setMinimumWidth(90)
        self.preset_box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.preset_box.setMinimumContentsLength(8)
        self.preset_box.setPlaceholderText("Presets…")
        buttons = {}
        for label, slot in (("Load", self._load_clicked), ("Save…", self._save_clicked)):
            b = buttons[label] = QPushButton(label)
            b.clicked.connect(slot)
        # Rename and Delete are rarer: a menu keeps the row narrow enough for 1024 px
        more = buttons["more"] = QToolButton(text="⋯")
        more.setToolTip("Rename or delete the selected preset")
        more.setPopupMode(QToolButton.InstantPopup)
        menu = QMenu(more)
        menu.addAction("Rename…", self._rename_clicked)
        menu.addAction("Delete", self._delete_clicked)
        more.setMenu(menu)
        self.preset_box.activated.connect(lambda _: self._load_clicked())

        top = QHBoxLayout()
        title = QLabel("Mix")
        title.setObjectName("sectionTitle")
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(reset)
        top.addWidget(self.bypass)
        presets = QHBoxLayout()
        presets.addWidget(QLabel("Preset"))
        presets.addWidget(self.preset_box, 1)
        for b in buttons.values():
            presets.addWidget(b)

        self.grid_host = QWidget()
        self.grid = QGridLayout(self.grid_host)
        self.grid.setContentsMargins(4, 4, 4, 4)
        self.grid.setHorizontalSpacing(8)
        self.grid.setColumnStretch(3, 1)
        self.headers = []
        for text in ("On", "Solo", "Adapter", "Scale", "", "Effective"):
            h = QLabel(text)
            h.setObjectName("gridHeader")
            self.headers.append(h)
        self.empty = QLabel(
            "No adapters loaded. Add a LoRA (GGUF or PEFT folder) below, or drop one on the window."
        )
        self.empty.setObjectName("hint")
        self.empty.setWordWrap(True)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.grid_host)
        scroll.setFrameShape(QScrollArea.NoFrame)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addLayout(presets)
        lay.addWidget(scroll, 1)

        # Events from several threads can arrive out of order: always read the engine's
        # current state rather than the (possibly stale) payload.
        bridge.adapters_changed.connect(lambda _: self.set_adapters(bridge.engine.adapters()))
        bridge.mix_changed.connect(self._engine_mix_changed)
        bridge.adapter_error.connect(lambda path, _: self._pending.pop(path, None))
        self.refresh_presets()
        self.set_adapters(bridge.engine.adapters())
        self._ready = True

    # -- building -----------------------------------------------------------------
    def set_adapters(self, adapters: list[dict]) -> None:
        old = self.strips
        self.strips = {}
        keep = {info["id"] for info in adapters}
        while self.grid.count():
            self.grid.takeAt(0)
        for aid, strip in old.items():
            if aid not in keep:
                for w in strip.widgets():
                    w.deleteLater()
        for col, h in enumerate(self.headers):
            self.grid.addWidget(h, 0, col)
        restored = False
        for row, info in enumerate(adapters, start=1):
            strip = old.get(info["id"])
            if strip is None:
                strip = Strip(info, self._apply)
                restored |= self._restore_strip(strip)
            strip.info = info
            self.strips[info["id"]] = strip
            for col, w in enumerate(strip.widgets()):
                self.grid.addWidget(w, row, col)
                w.show()
        self.empty.setVisible(not adapters)
        if not adapters:
            self.grid.addWidget(self.empty, 1, 0, 1, 6)
        for r in range(self.grid.rowCount()):
            self.grid.setRowStretch(r, 0)
        self.grid.setRowStretch(len(adapters) + 2, 1)
        if restored:
            self._apply()  # the desk as it was wins over the scales it was loaded with
        else:
            self._reconcile(self.bridge.engine.get_mix())

    # -- the desk across restarts and model reloads -----------------------------------
    def desk_state(self) -> dict[str, Any]:
        """What settings' "desk" keeps: bypass and each adapter by path, in order."""
        return {
            "bypass": self.bypass.isChecked(),
            "adapters": [
                {
                    "path": s.info.get("path", ""),
                    "scale": s.value,
                    "muted": s.muted,
                    "solo": s.solo.isChecked(),
                }
                for s in self.strips.values()
                if s.info.get("path")
            ],
        }

    def expect(self, desk: dict) -> list[tuple[str, float]]:
        """Remember ``desk`` until its adapters load; the (path, scale) pairs to load.
        They load at scale 0 and the desk then applies its own mix (mutes included)."""
        entries = [e for e in desk.get("adapters", []) if e.get("path")]
        self._pending = {e["path"]: e for e in entries}
        self._pending_bypass = bool(desk.get("bypass"))
        return [(e["path"], 0.0) for e in entries]

    def _restore_strip(self, strip: Strip) -> bool:
        entry = self._pending.pop(strip.info.get("path", ""), None)
        if entry is None:
            return False
        strip.set_value(float(entry.get("scale", 0.0)), notify=False)
        strip.set_flags(muted=bool(entry.get("muted")), solo=bool(entry.get("solo")))
        if self._pending_bypass is not None:
            self.bypass.blockSignals(True)
            self.bypass.setChecked(self._pending_bypass)
            self.bypass.blockSignals(False)
            self._pending_bypass = None
        return True

    def _remember(self) -> None:
        """Save the desk, except while one is being restored (it would save it half)."""
        if self._ready and not self._pending:
            self.settings.set("desk", self.desk_state())

    # -- the mix ------------------------------------------------------------------------
    def channels(self) -> dict[int, Channel]:
        return {aid: s.channel() for aid, s in self.strips.items()}

    def desk_mix(self) -> dict[int, float]:
        """The engine scales implied by faders, mutes, solos and bypass (ui.desk's rule)."""
        return desk_mix(self.channels(), self.bypass.isChecked())

    def _apply(self) -> None:
        if self._syncing:
            return
        mix = self.desk_mix()
        for aid, s in self.strips.items():
            s.show_effective(mix[aid])
        if self.strips:
            self.bridge.set_mix(mix)
        self.mix_applied.emit(mix)
        self._remember()

    def _engine_mix_changed(self, mix: dict, source: str) -> None:
        if source != "gui":
            self._reconcile(self.bridge.engine.get_mix())

    def _reconcile(self, mix: dict[int, float]) -> None:
        """Move the desk so that it implies ``mix`` (set from outside), keeping mute,
        solo and bypass where they still agree with it."""
        mix = {aid: float(mix.get(aid, 0.0)) for aid in self.strips}
        self._syncing = True
        try:
            if any(mix.values()):
                if self.bypass.isChecked():
                    self.bypass.setChecked(False)
                soloing = any(s.solo.isChecked() for s in self.strips.values())
                if soloing and any(
                    mix[a] and not s.solo.isChecked() for a, s in self.strips.items()
                ):
                    for s in self.strips.values():
                        s.set_flags(solo=False)
            desk = self.desk_mix()
            for aid, s in self.strips.items():
                if not math.isclose(desk[aid], mix[aid], abs_tol=1e-9):
                    if mix[aid] != 0.0:
                        s.set_flags(muted=False)
                    s.set_value(mix[aid], notify=False)
            desk = self.desk_mix()
        finally:
            self._syncing = False
        for aid, s in self.strips.items():
            s.show_effective(desk[aid])
        if desk != mix and self.strips:  # e.g. solo still hides a fader: make it true
            self.bridge.set_mix(desk)
        self._remember()

    def zero_all(self) -> None:
        self._syncing = True
        for s in self.strips.values():
            s.set_value(0.0, notify=False)
        self._syncing = False
        self._apply()

    # -- presets ---------------------------------------------------------------------------
    def preset_state(self) -> dict[str, Any]:
        return {
            "bypass": self.bypass.isChecked(),
            "adapters": {
                s.info["path"]: {
                    "name": s.info["name"],
                    "scale": s.value,
                    "muted": s.muted,
                    "solo": s.solo.isChecked(),
                }
                for s in self.strips.values()
            },
        }

    def _entry_for(self, preset: dict, strip: Strip) -> dict | None:
        entries = preset.get("adapters", {})
        if strip.info["path"] in entries:
            return entries[strip.info["path"]]
        by_name = [e for e in entries.values() if e.get("name") == strip.info["name"]]
        return by_name[0] if len(by_name) == 1 else None

    def mix_for_preset(self, name: str) -> dict[int, float] | None:
        """The engine mix a preset gives with the adapters loaded now (A/B compare)."""
        if not name:
            return self.desk_mix()
        preset = self.settings.presets.get(name)
        if preset is None:
            return None
        channels = {
            aid: Channel.from_entry(self._entry_for(preset, s)) for aid, s in self.strips.items()
        }
        return desk_mix(channels, bool(preset.get("bypass")))

    def save_preset(self, name: str) -> None:
        self.settings.presets.save(name, self.preset_state())
        self.refresh_presets(select=name.strip())
        self.message.emit(f"Saved preset “{name.strip()}”")

    def load_preset(self, name: str) -> bool:
        preset = self.settings.presets.get(name)
        if preset is None:
            self.message.emit(f"No preset named “{name}”")
            return False
        self._syncing = True
        try:
            self.bypass.setChecked(bool(preset.get("bypass")))
            missing = 0
            for s in self.strips.values():
                e = self._entry_for(preset, s)
                if e is None:
                    s.set_value(0.0, notify=False)
                    s.set_flags(muted=False, solo=False)
                    continue
                s.set_value(float(e.get("scale", 0.0)), notify=False)
                s.set_flags(muted=bool(e.get("muted")), solo=bool(e.get("solo")))
            missing = len(preset.get("adapters", {})) - sum(
                self._entry_for(preset, s) is not None for s in self.strips.values()
            )
        finally:
            self._syncing = False
        self._apply()
        self.preset_box.setCurrentText(name)
        note = f" ({missing} of its adapters are not loaded)" if missing > 0 else ""
        self.message.emit(f"Loaded preset “{name}”{note}")
        return True

    def rename_preset(self, old: str, new: str) -> None:
        self.settings.presets.rename(old, new)
        self.refresh_presets(select=new.strip())

    def delete_preset(self, name: str) -> None:
        self.settings.presets.delete(name)
        self.refresh_presets()

    def refresh_presets(self, select: str | None = None) -> None:
        cur = select or self.preset_box.currentText()
        self.preset_box.blockSignals(True)
        self.preset_box.clear()
        self.preset_box.addItems(self.settings.presets.names())
        idx = self.preset_box.findText(cur)
        self.preset_box.setCurrentIndex(idx)
        self.preset_box.blockSignals(False)
        self.presets_changed.emit()

    def _load_clicked(self) -> None:
        if self.preset_box.currentText():
            self.load_preset(self.preset_box.currentText())

    def _save_clicked(self) -> None:
        name, ok = QInputDialog.getText(
            self, "Save preset", "Preset name:", text=self.preset_box.currentText()
        )
        if ok and name.strip():
            self.save_preset(name)

    def _rename_clicked(self) -> None:
        old = self.preset_box.currentText()
        if not old:
            return
        new, ok = QInputDialog.getText(self, "Rename preset", f"New name for “{old}”:", text=old)
        if ok and new.strip():
            try:
                self.rename_preset(old, new)
            except (KeyError, ValueError) as e:
                self.message.emit(str(e))

    def _delete_clicked(self) -> None:
        if self.preset_box.currentText():
            self.delete_preset(self.preset_box.currentText())
