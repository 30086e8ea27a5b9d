"""The mixing desk: one channel strip per adapter and per control vector, a master
bypass and named presets.

A strip (ui/strip.py) holds a fader value (−2…2), an on/mute toggle and a solo
button. The engine mix is derived from them (bypass → all 0; any solo → only soloed
strips, adapters and vectors alike; muted → 0) and pushed to the engine on every
change: the adapters' scales with ``set_mix``, the vectors' with
``set_control_vectors``; the next request uses it, no reload. Mixes set elsewhere
(HTTP ``POST /lora-adapters``, ``POST /control-vectors``) come back through
``bridge.mix_changed`` and ``bridge.vectors_changed`` and move the faders.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMenu,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from core.errors import UserError
from core.lora import merge as M
from core.lora.merge import LINEAR, MergeSpec
from core.lora.mix import Mix
from core.serve.events import (
    ChannelMeter,
    MixBuilding,
    MixChanged,
    RequestFinished,
    RequestStarted,
    VectorsChanged,
)
from core.settings import Settings, read_presets_file

from .bridge import EngineBridge
from .desk import (
    Channel,
    VecKey,
    desk_merge,
    desk_mix,
    flat,
    merge_fields,
    saved_merge,
    silenced,
)
from .mix_history import MixHistory
from .strip import (  # noqa: F401 (FADER_MIN_WIDTH, TICKS: the desk's, tests read them)
    FADER_MIN_WIDTH,
    TICKS,
    Strip,
    VectorStrip,
)
from .util import UndoBar


class MixerPanel(QWidget):
    """Channel strips for ``bridge.engine``'s adapters, kept in sync both ways."""

    mix_applied = Signal(object)  # the engine mix the desk just set
    presets_changed = Signal()
    message = Signal(str)

    def __init__(self, bridge: EngineBridge, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        # adapter id -> its strip, VecKey(vector id) -> a control vector's (ui/desk.py)
        self.strips: dict[int | VecKey, Strip] = {}
        self._adapter_infos: list[dict] = []
        self._vector_infos: list[dict] = []
        self._syncing = False
        # desk entries (path -> scale, mute, solo) waiting for their adapter to load:
        # a restart or a model reload puts them back on the strips as they were
        self._pending: dict[str, dict] = {}
        self._pending_vectors: dict[str, dict] = {}  # the same for control vectors
        self._pending_bypass: bool | None = None
        self._ready = False
        # View → Unity faders: faders in effective units (× α / r); the mix stays in scale
        self.unity = bool(settings.get("unity"))
        # undo/redo of the desk: named steps (a drag is one), the Edit menu's
        self.steps = MixHistory(self)

        self.bypass = QPushButton("Bypass all", checkable=True)
        self.bypass.setObjectName("bypassButton")
        self.bypass.setToolTip(
            "Master bypass: run the base model, every adapter and control vector at 0"
        )
        self.bypass.toggled.connect(lambda _: self._apply())
        reset = self.zero_btn = QPushButton("Zero all")
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
        more.setToolTip("Rename, delete, import or export presets")
        more.setPopupMode(QToolButton.InstantPopup)
        menu = QMenu(more)
        self.rename_action = menu.addAction("Rename…", self._rename_clicked)
        self.delete_action = menu.addAction("Delete", self._delete_clicked)
        self.delete_action.setToolTip("Delete the selected preset (Undo or Ctrl+Z brings it back)")
        menu.addSeparator()
        # presets travel as JSON files, in presets.json's own shape
        self.import_action = menu.addAction("Import presets…", self._import_clicked)
        self.export_action = menu.addAction(
            "Export selected preset…", lambda: self._export_clicked(selected=True)
        )
        self.export_all_action = menu.addAction("Export all presets…", self._export_clicked)
        more.setMenu(menu)
        self.preset_box.activated.connect(lambda _: self._load_clicked())
        # Rename and Delete act on the selected preset: with none, they cannot act
        self.preset_box.currentTextChanged.connect(lambda _: self._enable_preset_actions())
        # the selected preset is part of the desk a restart brings back
        self.preset_box.currentTextChanged.connect(self._remember_preset)
        self.preset_undo = UndoBar()
        self.preset_undo.undo.connect(self.undo_preset_delete)

        top = QHBoxLayout()
        title = QLabel("Mix")
        title.setObjectName("sectionTitle")
        top.addWidget(title)
        top.addStretch(1)
        top.addWidget(reset)
        top.addWidget(self.bypass)
        self.modified = QLabel("•")
        self.modified.setObjectName("presetModified")
        self.modified.setToolTip("The desk no longer matches this preset (Save… to keep it)")
        self.modified.setFixedWidth(10)
        self.modified.setVisible(False)
        self.preset_box.currentTextChanged.connect(lambda _: self._mark_modified())
        presets = QHBoxLayout()
        presets.addWidget(QLabel("Preset"))
        presets.addWidget(self.preset_box, 1)
        presets.addWidget(self.modified)
        for b in buttons.values():
            presets.addWidget(b)

        merge_row = self._merge_row()

        self.grid_host = QWidget()
        self.grid = QGridLayout(self.grid_host)
        # narrow margins and spacing: at 1024 px (and with a vertical scroll bar) the
        # rows must fit the desk's ~400 px without a sideways scroll
        self.grid.setContentsMargins(2, 4, 2, 4)
        self.grid.setHorizontalSpacing(6)
        self.grid.setColumnStretch(3, 1)
        self.headers = []
        # "Name", not "Adapter": that header alone set the column 15 px wider than its names
        for text in ("Mute", "Solo", "Name", "Scale", "", "", "Effective"):
            h = QLabel(text)
            h.setObjectName("gridHeader")
            if text == "Effective":
                h.setToolTip(
                    "The scale the engine applies: scale × α / r (the adapter's LoRA alpha "
                    "over its rank; 1.0 × α / r is the adapter as trained). Hover a value "
                    "for its ratio."
                )
            self.headers.append(h)
        self._label_scale_header()
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
        lay.addWidget(self.preset_undo)
        lay.addLayout(merge_row)
        lay.addWidget(scroll, 1)

        # Events from several threads can arrive out of order: always read the engine's
        # current state rather than the (possibly stale) payload.
        bridge.adapters_changed.connect(lambda _: self.set_adapters(bridge.engine.adapters()))
        bridge.mix_changed.connect(self._engine_mix_changed)
        bridge.vectors_changed.connect(self._engine_vectors_changed)
        bridge.model_loaded.connect(self.load_saved_vectors)
        bridge.mix_building.connect(self._mix_building)
        self._running: dict[int, set[int]] = {}  # request id -> adapter ids it uses
        bridge.request_started.connect(self._request_started)
        bridge.request_finished.connect(self._request_finished)
        bridge.channel_meter.connect(self._channel_meter)
        bridge.engine.meters = True  # requests from now on are metered (core/lora/meter.py)
        bridge.adapter_error.connect(lambda path, _: self._pending.pop(path, None))
        self.refresh_presets(select=settings.get("preset") or None)
        self._vector_infos = self._vector_strip_infos(bridge.engine.control_vectors())
        self.set_adapters(bridge.engine.adapters())
        self._ready = True
        # Ctrl+Z and the Redo keys are the Edit menu's (ui/mix_history.py)

    # -- activity ------------------------------------------------------------------
    def _request_started(self, ev: RequestStarted) -> None:
        self._running[ev.id] = {int(a) for a, scale in ev.mix.items() if scale}
        self._show_activity()

    def _request_finished(self, ev: RequestFinished) -> None:
        self._running.pop(ev.id, None)
        self._show_activity()

    def _channel_meter(self, ev: ChannelMeter) -> None:
        readings = [(int(aid), r) for aid, r in ev.values.items()]
        readings += [(VecKey(int(vid)), r) for vid, r in ev.vectors.items()]
        for key, ratio in readings:
            strip = self.strips.get(key)
            if strip is not None:
                strip.meter.show_value(ratio)

    def _show_activity(self) -> None:
        busy = set().union(*self._running.values()) if self._running else set()
        for aid, strip in self.strips.items():
            strip.set_busy(aid in busy)

    # -- building -----------------------------------------------------------------
    def set_adapters(self, adapters: list[dict]) -> None:
        """A strip per adapter (the engine's listing), above the vectors' strips."""
        self._adapter_infos = list(adapters)
        self._build()

    def set_vectors(self, vectors: list[dict]) -> None:
        """A strip per control vector (``Engine.control_vectors()``), below the adapters."""
        self._vector_infos = self._vector_strip_infos(vectors)
        self._build()

    @staticmethod
    def _vector_strip_infos(vectors: list[dict]) -> list[dict]:
        return [{**v, "id": VecKey(v["id"]), "vid": v["id"]} for v in vectors]

    def _build(self) -> None:
        adapters = self._adapter_infos + self._vector_infos
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
                kind = VectorStrip if isinstance(info["id"], VecKey) else Strip
                strip = kind(info, self._apply, self.unity)
                restored |= self._restore_strip(strip)
            strip.info = info
            strip.set_unity(self.unity)  # a reloaded adapter may have another α / r
            self.strips[info["id"]] = strip
            for col, w in enumerate(strip.widgets()):
                self.grid.addWidget(w, row, col)
                w.show()
        self.empty.setVisible(not adapters)
        self._show_activity()
        if not adapters:
            self.grid.addWidget(self.empty, 1, 0, 1, len(self.headers))
        for r in range(self.grid.rowCount()):
            self.grid.setRowStretch(r, 0)
        self.grid.setRowStretch(len(adapters) + 2, 1)
        if restored:
            self._apply()  # the desk as it was wins over the scales it was loaded with
        else:
            self._reconcile(self._engine_mix())

    # -- unity mode -----------------------------------------------------------------------
    def set_unity(self, on: bool) -> None:
        """Faders and boxes in effective units (1.0 = the adapter as trained) or in
        llama-server's scale. Only the display changes: the mix, presets and undo keep
        the scale."""
        self.unity = bool(on)
        if self.settings.get("unity") != self.unity:
            self.settings.set("unity", self.unity)
        for s in self.strips.values():
            s.set_unity(self.unity)
        self._label_scale_header()

    def _label_scale_header(self) -> None:
        h = self.headers[3]
        h.setText("Unity" if self.unity else "Scale")
        h.setToolTip(
            "Faders in effective units, scale × α / r: 1.0 is the adapter as trained "
            "(the mix sent to the engine is still llama-server's scale)"
            if self.unity
            else "llama-server's scale; View → Unity faders shows effective units, where "
            "1.0 is the adapter as trained"
        )

    # -- the merge method (#21) -------------------------------------------------------------
    def _merge_row(self) -> QHBoxLayout:
        """Method [combo], and density / rank / seed where the method uses them."""
        self.method = QComboBox()
        self.method.addItems(M.METHODS)
        self.method.setToolTip(
            "How the adapters combine: linear is the weighted sum (llama-server's); svd, "
            "ties, dare_* and magnitude_prune build a merged adapter on first use"
        )
        self.density = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05)
        self.density.setValue(M.DEFAULT_DENSITY)
        self.density.setToolTip("Fraction of each adapter's weight change kept (trim / drop)")
        self.rank = QSpinBox(minimum=0, maximum=M.MAX_RANK)
        self.rank.setSpecialValueText("auto")
        self.rank.setToolTip("Rank of the merged adapter (auto: the sum of ranks, at most 64)")
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1)
        self.seed.setToolTip("Seed of DARE's random drop: the same seed, the same merge")
        self.merge_status = QLabel()
        self.merge_status.setObjectName("hint")
        self._merge_widgets = {"density": self.density, "rank": self.rank, "seed": self.seed}
        row = QHBoxLayout()
        row.addWidget(QLabel("Method"))
        row.addWidget(self.method)
        self._merge_labels = {}
        for name, w in self._merge_widgets.items():
            label = self._merge_labels[name] = QLabel(name.capitalize())
            row.addWidget(label)
            row.addWidget(w)
        row.addWidget(self.merge_status, 1)
        self.method.currentTextChanged.connect(lambda _: self._merge_changed())
        for w in self._merge_widgets.values():
            w.valueChanged.connect(lambda _: self._merge_changed())
        self._show_merge_fields()
        return row

    def merge_spec(self) -> MergeSpec:
        """The desk's merge method as the engine takes it (ui.desk's rule)."""
        return desk_merge(
            self.method.currentText(), self.density.value(), self.rank.value(), self.seed.value()
        )

    def _show_merge_fields(self) -> None:
        shown = merge_fields(self.method.currentText())
        for name, w in self._merge_widgets.items():
            w.setVisible(name in shown)
            self._merge_labels[name].setVisible(name in shown)

    def _set_merge(self, spec: MergeSpec | None) -> None:
        """Show ``spec`` on the desk without applying it (a preset, a restore, the API)."""
        spec = spec or LINEAR
        widgets = (self.method, *self._merge_widgets.values())
        for w in widgets:
            w.blockSignals(True)
        try:
            self.method.setCurrentText(spec.method)
            if spec.density is not None:
                self.density.setValue(spec.density)
            self.rank.setValue(spec.rank or 0)
            if spec.seed is not None:
                self.seed.setValue(spec.seed)
        finally:
            for w in widgets:
                w.blockSignals(False)
        self._show_merge_fields()

    def _merge_changed(self) -> None:
        self._show_merge_fields()
        self._apply()

    def _mix_building(self, ev: MixBuilding) -> None:
        """A merged mix's first build: its progress, then nothing once it is done."""
        done = ev.progress >= 1.0
        self.merge_status.setText("" if done else f"{ev.message} · {ev.progress:.0%}")

    # -- the desk across restarts and model reloads -----------------------------------
    def desk_state(self) -> dict[str, Any]:
        """What settings' "desk" keeps: bypass, each adapter and each control vector by
        path, in order."""

        def entries(vectors: bool) -> list[dict[str, Any]]:
            return [
                {
                    "path": s.info.get("path", ""),
                    "scale": s.value,
                    "muted": s.muted,
                    "solo": s.solo.isChecked(),
                }
                for s in self.strips.values()
                if s.info.get("path") and isinstance(s, VectorStrip) == vectors
            ]

        return {
            "bypass": self.bypass.isChecked(),
            "merge": self.merge_spec().as_dict(),
            "adapters": entries(vectors=False),
            "vectors": entries(vectors=True),
        }

    def expect(self, desk: dict) -> list[tuple[str, float]]:
        """Remember ``desk`` until its adapters load; the (path, scale) pairs to load.
        They load at scale 0 and the desk then applies its own mix (mutes included)."""
        entries = [e for e in desk.get("adapters", []) if e.get("path")]
        self._pending = {e["path"]: e for e in entries}
        # the vectors load once the model has (load_saved_vectors), at 0, and their
        # strips then take the saved fader and buttons as the adapters' do
        self._pending_vectors = {e["path"]: e for e in desk.get("vectors", []) if e.get("path")}
        self._pending_bypass = bool(desk.get("bypass"))
        self._set_merge(saved_merge(desk.get("merge")))
        return [(e["path"], 0.0) for e in entries]

    def load_saved_vectors(self, *_: Any) -> None:
        """Load the saved desk's control vectors (after the model: a vector must fit it).
        One that no longer loads is said in the status line and dropped from the desk."""
        pending = dict(self._pending_vectors)
        have = {v.get("path") for v in self.bridge.engine.control_vectors()}
        for path in pending:
            if path in have:
                continue
            try:
                self.bridge.engine.add_control_vector(path, 0.0)
            except UserError as e:
                self._pending_vectors.pop(path, None)
                text = f"Control vector {Path(path).name} not loaded: {e}"
                # after the window's own "Loaded <model>" line, which would hide it
                QTimer.singleShot(0, lambda t=text: self.message.emit(t))
        if self._pending_vectors:  # already loaded (a flag): restore their strips now
            for strip in self.strips.values():
                if isinstance(strip, VectorStrip) and self._restore_strip(strip):
                    self._apply()
        self._remember()  # the desk as restored, without what did not load

    def _restore_strip(self, strip: Strip) -> bool:
        pending = self._pending_vectors if isinstance(strip, VectorStrip) else self._pending
        entry = pending.pop(strip.info.get("path", ""), None)
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
        if self._ready and not self._pending and not self._pending_vectors:
            self.settings.set("desk", self.desk_state())

    # -- the mix ------------------------------------------------------------------------
    def channels(self) -> dict[int, Channel]:
        return {aid: s.channel() for aid, s in self.strips.items()}

    def desk_mix(self) -> dict[int, float]:
        """The engine scales implied by faders, mutes, solos and bypass (ui.desk's rule),
        as a Mix carrying the desk's merge method."""
        return desk_mix(self.channels(), self.bypass.isChecked(), self.merge_spec())

    def _apply(self, record: bool = True) -> None:
        if self._syncing:
            return
        if record:
            self._record()
        mix = self.desk_mix()
        self._show(mix)
        if self.strips:
            self.bridge.set_mix(mix)
        self.mix_applied.emit(mix)
        self._remember()

    def _show(self, mix: dict[int, float]) -> None:
        """Effective scales, dimmed silent strips and the preset's modified mark."""
        quiet = silenced(self.channels(), self.bypass.isChecked())
        scales = flat(mix)
        for aid, s in self.strips.items():
            s.show_effective(scales.get(aid, 0.0))
            s.show_silenced(aid in quiet)
        self._mark_modified()

    # -- undo / redo ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "bypass": self.bypass.isChecked(),
            "merge": self.merge_spec(),
            "strips": {
                aid: (s.value, s.muted, s.solo.isChecked()) for aid, s in self.strips.items()
            },
        }

    def _record(self) -> None:
        """Called on each change the user makes: a step of the undo history."""
        names = {aid: st.info["name"] for aid, st in self.strips.items()}
        self.steps.record(self.snapshot(), names)

    def _restore(self, snap: dict) -> None:
        self._syncing = True
        try:
            self.bypass.setChecked(snap["bypass"])
            self._set_merge(snap.get("merge"))
            for aid, (value, muted, solo) in snap["strips"].items():
                if aid in self.strips:
                    self.strips[aid].set_value(value, notify=False)
                    self.strips[aid].set_flags(muted=muted, solo=solo)
        finally:
            self._syncing = False
        self.steps.settle(self.snapshot())
        self._apply(record=False)

    def undo(self) -> bool:
        if not self.steps.undo_steps:
            return False
        step = self.steps.pop_undo(self.snapshot())
        if "deleted_preset" in step:  # a preset's deletion is a step too
            self._put_back_preset(step)
        else:
            self._restore(step["before"])
            self.message.emit(f"Undo {step['label']}")
        return True

    def redo(self) -> bool:
        if not self.steps.redo_steps:
            return False
        step = self.steps.pop_redo(self.snapshot())
        if "deleted_preset" in step:
            self.settings.presets.delete(step["deleted_preset"])
            self.refresh_presets()
            self.message.emit(f"Redo: preset “{step['deleted_preset']}” deleted")
        else:
            self._restore(step["after"])
            self.message.emit(f"Redo {step['label']}")
        return True

    def history(self) -> list[tuple[str, bool]]:
        """The Edit menu's Mix history: (label, is now), oldest first ("start" first)."""
        return self.steps.entries()

    def jump_to(self, position: int) -> None:
        """Undo or redo until the desk is as it was after ``position`` steps."""
        while len(self.steps.undo_steps) > position and self.undo():
            pass
        while len(self.steps.undo_steps) < position and self.redo():
            pass

    # -- presets: modified mark ----------------------------------------------------------
    def matches_preset(self, name: str) -> bool:
        preset = self.settings.presets.get(name) if name else None
        if preset is None:
            return True
        if bool(preset.get("bypass")) != self.bypass.isChecked():
            return False
        if saved_merge(preset.get("merge")) != self.merge_spec():
            return False
        for s in self.strips.values():
            e = self._entry_for(preset, s) or {}
            if Channel.from_entry(e) != s.channel():
                return False
        return True

    def _mark_modified(self) -> None:
        name = self.preset_box.currentText()
        self.modified.setVisible(bool(name) and not self.matches_preset(name))
        preset = self.settings.presets.get(name) if name else None
        for s in self.strips.values():
            if preset is None:
                s.mark_differs(None)
                continue
            e = self._entry_for(preset, s)
            want = Channel.from_entry(e)
            s.mark_differs(None if want == s.channel() else (name, want))

    def _engine_mix_changed(self, ev: MixChanged) -> None:
        if ev.source != "gui":
            self._reconcile(self._engine_mix())

    def _engine_vectors_changed(self, ev: VectorsChanged) -> None:
        """A vector loaded or unloaded (File ▸ New control vector, --control-vector, HTTP)
        gets or loses its strip; one rescaled elsewhere moves its fader."""
        vectors = self.bridge.engine.control_vectors()
        if [v["id"] for v in vectors] != [i["vid"] for i in self._vector_infos]:
            self.set_vectors(vectors)
        elif ev.source != "gui":
            self._reconcile(self._engine_mix())

    def _engine_mix(self) -> Mix:
        """The engine's global mix with its global vectors (what a chat request runs)."""
        mix = self.bridge.engine.get_mix()
        vectors = {v["id"]: v["scale"] for v in self.bridge.engine.control_vectors()}
        return Mix(mix, mix.merge, vectors=vectors)

    def _reconcile(self, mix: dict[int, float]) -> None:
        """Move the desk so that it implies ``mix`` (set from outside), keeping mute,
        solo and bypass where they still agree with it."""
        if getattr(mix, "merge", None) is not None:
            self._set_merge(mix.merge)  # the method set from outside (the API, the grid)
        if getattr(mix, "vectors", None) is None:  # a mix that says nothing of vectors
            mix = Mix(
                mix,
                vectors={k.id: s.value for k, s in self.strips.items() if isinstance(k, VecKey)}
                or None,
            )
        given = flat(mix)
        mix = {aid: float(given.get(aid, 0.0)) for aid in self.strips}
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
            desk = flat(self.desk_mix())
            for aid, s in self.strips.items():
                if not math.isclose(desk[aid], mix[aid], abs_tol=1e-9):
                    if mix[aid] != 0.0:
                        s.set_flags(muted=False)
                    s.set_value(mix[aid], notify=False)
            desk = self.desk_mix()
        finally:
            self._syncing = False
        self.steps.settle(self.snapshot())  # a change from outside is not an undo step
        self._show(desk)
        if flat(desk) != mix and self.strips:  # e.g. solo still hides a fader: make it true
            self.bridge.set_mix(desk)
        self._remember()

    def use_mix(self, mix: dict[int, float]) -> None:
        """Put an engine mix on the desk (the X/Y grid's "Use this mix") and apply it, as
        one undo step: the faders move to it as for a mix set from outside."""
        before = self.snapshot()
        self._reconcile(mix)
        self.steps.last = before  # _reconcile takes a change from outside as no undo step
        self._apply()

    def zero_all(self) -> None:
        self._syncing = True
        for s in self.strips.values():
            s.set_value(0.0, notify=False)
        self._syncing = False
        self._apply()

    # -- presets ---------------------------------------------------------------------------
    def preset_state(self) -> dict[str, Any]:
        """Bypass, method, and each strip by its file's path: adapters under "adapters",
        control vectors under "vectors" (a preset saved before vectors has none)."""

        def entries(vectors: bool) -> dict[str, dict]:
            return {
                s.info["path"]: {
                    "name": s.info["name"],
                    "scale": s.value,
                    "muted": s.muted,
                    "solo": s.solo.isChecked(),
                }
                for s in self.strips.values()
                if isinstance(s, VectorStrip) == vectors
            }

        state = {
            "bypass": self.bypass.isChecked(),
            "merge": self.merge_spec().as_dict(),
            "adapters": entries(False),
        }
        if self._vector_infos:
            state["vectors"] = entries(True)
        return state

    def _entry_for(self, preset: dict, strip: Strip) -> dict | None:
        entries = preset.get("vectors" if isinstance(strip, VectorStrip) else "adapters", {})
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
        return desk_mix(channels, bool(preset.get("bypass")), saved_merge(preset.get("merge")))

    def save_preset(self, name: str) -> None:
        self.settings.presets.save(name, self.preset_state())
        self.refresh_presets(select=name.strip())
        self._mark_modified()
        self.message.emit(f"Saved preset “{name.strip()}”")

    def load_preset(self, name: str) -> bool:
        preset = self.settings.presets.get(name)
        if preset is None:
            self.message.emit(f"No preset named “{name}”")
            return False
        self._syncing = True
        try:
            self.bypass.setChecked(bool(preset.get("bypass")))
            self._set_merge(saved_merge(preset.get("merge")))
            missing = 0
            for s in self.strips.values():
                e = self._entry_for(preset, s)
                if e is None:
                    s.set_value(0.0, notify=False)
                    s.set_flags(muted=False, solo=False)
                    continue
                s.set_value(float(e.get("scale", 0.0)), notify=False)
                s.set_flags(muted=bool(e.get("muted")), solo=bool(e.get("solo")))
            missing = (
                len(preset.get("adapters", {}))
                + len(preset.get("vectors", {}))
                - sum(self._entry_for(preset, s) is not None for s in self.strips.values())
            )
        finally:
            self._syncing = False
        self._apply()
        self.preset_box.setCurrentText(name)
        self._mark_modified()
        note = f" ({missing} of its adapters or vectors are not loaded)" if missing > 0 else ""
        self.message.emit(f"Loaded preset “{name}”{note}")
        return True

    def rename_preset(self, old: str, new: str) -> None:
        self.settings.presets.rename(old, new)
        self.refresh_presets(select=new.strip())

    def delete_preset(self, name: str) -> None:
        """Delete ``name``; the Undo bar (or Ctrl+Z, as one step of the mix's undo list)
        brings it back."""
        preset = self.settings.presets.get(name)
        if preset is None:
            return
        self.settings.presets.delete(name)
        self.refresh_presets()
        label = f"delete preset “{name}”"
        self.steps.push({"label": label, "deleted_preset": name, "preset": preset})
        self.preset_undo.say(f"Deleted preset “{name}”")

    def undo_preset_delete(self) -> bool:
        """The Undo bar: bring back the last deleted preset, wherever it is in the list."""
        step = self.steps.take_preset_step()
        if step is not None:
            self._put_back_preset(step)
        return step is not None

    def _put_back_preset(self, step: dict) -> None:
        self.preset_undo.dismiss()
        self.settings.presets.save(step["deleted_preset"], step["preset"])
        self.refresh_presets(select=step["deleted_preset"])
        self._mark_modified()
        self.message.emit(f"Undo: preset “{step['deleted_preset']}” is back")

    def _remember_preset(self, name: str) -> None:
        if self._ready and self.settings.get("preset") != name:
            self.settings.set("preset", name)

    def _enable_preset_actions(self) -> None:
        on = bool(self.preset_box.currentText())
        for action in (self.rename_action, self.delete_action, self.export_action):
            action.setEnabled(on)
        self.export_all_action.setEnabled(bool(self.settings.presets.names()))

    def refresh_presets(self, select: str | None = None) -> None:
        cur = select or self.preset_box.currentText()
        self.preset_box.blockSignals(True)
        self.preset_box.clear()
        self.preset_box.addItems(self.settings.presets.names())
        idx = self.preset_box.findText(cur)
        self.preset_box.setCurrentIndex(idx)
        self.preset_box.blockSignals(False)
        self._enable_preset_actions()
        self.presets_changed.emit()

    def _load_clicked(self) -> None:
        if self.preset_box.currentText():
            self.load_preset(self.preset_box.currentText())

    def _save_clicked(self) -> None:
        name, ok = QInputDialog.getText(
            self, "Save preset", "Preset name:", text=self.preset_box.currentText()
        )
        if ok and name.strip():
            if name.strip() in self.settings.presets.names() and not self.confirm_overwrite(
                name.strip()
            ):
                return
            self.save_preset(name)

    def confirm_overwrite(self, name: str) -> bool:
        answer = QMessageBox.question(
            self,
            "Overwrite preset",
            f"A preset named “{name}” exists. Replace it with the desk as it is now?",
            QMessageBox.Yes | QMessageBox.No,
            QMessageBox.No,
        )
        return answer == QMessageBox.Yes

    def _rename_clicked(self) -> None:
        old = self.preset_box.currentText()
        if not old:
            return
        new, ok = QInputDialog.getText(self, "Rename preset", f"New name for “{old}”:", text=old)
        if ok and new.strip():
            try:
                self.rename_preset(old, new)
            except UserError as e:
                self.message.emit(str(e))

    # -- presets travel: JSON files --------------------------------------------------------
    def export_presets(self, path, selected: bool = False) -> list[str]:
        """Write the selected preset (or all) to ``path``; the names written."""
        names = [self.preset_box.currentText()] if selected else self.settings.presets.names()
        written = self.settings.presets.export(path, [n for n in names if n])
        self.message.emit(f"Exported {len(written)} preset(s) to {path}")
        return written

    def import_presets(self, path) -> list[str]:
        """Merge the presets of ``path`` in (a clash asks: replace, keep both or skip).
        A bad file raises UserError before anything changes."""
        incoming = read_presets_file(path)
        added = self.settings.presets.merge(incoming, self.ask_clash)
        self.refresh_presets()
        self._mark_modified()
        self.message.emit(f"Imported {len(added)} preset(s) from {Path(path).name}")
        return added

    def ask_clash(self, name: str) -> str:
        """A preset of this name exists: "replace", "rename" (keep both) or "skip"."""
        box = QMessageBox(self)
        box.setWindowTitle("Import presets")
        box.setIcon(QMessageBox.Question)
        box.setText(f"A preset named “{name}” exists.")
        box.setInformativeText("Replace it, keep both (the imported one renamed), or skip it?")
        buttons = {
            box.addButton("Replace", QMessageBox.DestructiveRole): "replace",
            box.addButton("Keep both", QMessageBox.AcceptRole): "rename",
            box.addButton("Skip", QMessageBox.RejectRole): "skip",
        }
        box.exec()
        return buttons.get(box.clickedButton(), "skip")

    def _import_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Import presets", "", "Presets (*.json);;All files (*)"
        )
        if not path:
            return
        try:
            self.import_presets(path)
        except UserError as e:
            QMessageBox.warning(self, "Import presets", f"Nothing was imported: {e}")

    def _export_clicked(self, selected: bool = False) -> None:
        first = self.preset_box.currentText() if selected else "presets"
        path, _ = QFileDialog.getSaveFileName(
            self, "Export presets", f"{first}.json", "Presets (*.json)"
        )
        if not path:
            return
        try:
            self.export_presets(path, selected=selected)
        except OSError as e:
            QMessageBox.warning(self, "Export presets", f"Could not write {path}: {e}")

    def _delete_clicked(self) -> None:
        if self.preset_box.currentText():
            self.delete_preset(self.preset_box.currentText())
