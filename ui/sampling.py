"""System prompt and sampling settings (temperature, top-k, top-p, min-p, max tokens,
repeat penalty, seed), saved to settings on every change."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from core.serve.sampling import SamplingParams
from core.settings import DEFAULTS, Settings


class SamplingForm(QWidget):
    changed = Signal()

    def __init__(self, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        saved = {**DEFAULTS["sampling"], **(settings.get("sampling") or {})}

        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.system_prompt.setPlainText(settings.get("system_prompt") or "")
        self.system_prompt.setMaximumHeight(110)
        self.system_prompt.textChanged.connect(
            lambda: self.settings.set("system_prompt", self.system_prompt.toPlainText())
        )

        def dspin(lo, hi, step, dec=2):
            w = QDoubleSpinBox(minimum=lo, maximum=hi, singleStep=step, decimals=dec)
            w.valueChanged.connect(self._save)
            return w

        def ispin(lo, hi, special=None):
            w = QSpinBox(minimum=lo, maximum=hi)
            if special:
                w.setSpecialValueText(special)
            w.valueChanged.connect(self._save)
            return w

        self.temperature = dspin(0.0, 5.0, 0.05)
        self.temperature.setToolTip("0 = greedy (deterministic)")
        self.top_k = ispin(0, 1000, "off")
        self.top_p = dspin(0.0, 1.0, 0.01)
        self.min_p = dspin(0.0, 1.0, 0.01)
        self.n_predict = ispin(1, 32768)
        self.repeat_penalty = dspin(0.5, 3.0, 0.05)
        self.seed = ispin(-1, 2**31 - 1, "random")
        self.fields = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "n_predict": self.n_predict,
            "repeat_penalty": self.repeat_penalty,
            "seed": self.seed,
        }
        self.set_values(saved)

        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.AllNonFixedFieldsGrow)
        form.setRowWrapPolicy(QFormLayout.WrapLongRows)  # label above field when narrow
        for label, w in (
            ("Temperature", self.temperature),
            ("Top-k", self.top_k),
            ("Top-p", self.top_p),
            ("Min-p", self.min_p),
            ("Max tokens", self.n_predict),
            ("Repeat penalty", self.repeat_penalty),
            ("Seed", self.seed),
        ):
            form.addRow(label, w)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        t1 = QLabel("System prompt")
        t1.setObjectName("sectionTitle")
        t2 = QLabel("Sampling")
        t2.setObjectName("sectionTitle")
        lay.addWidget(t1)
        lay.addWidget(self.system_prompt)
        lay.addWidget(t2)
        lay.addLayout(form)
        lay.addStretch(1)

    def set_values(self, values: dict) -> None:
        for k, w in self.fields.items():
            if k in values and values[k] is not None:
                w.blockSignals(True)
                w.setValue(values[k])
                w.blockSignals(False)
        self._save()

    def values(self) -> dict:
        return {k: w.value() for k, w in self.fields.items()}

    def _save(self) -> None:
        self.settings.set("sampling", self.values())
        self.changed.emit()

    def params(self) -> SamplingParams:
        v = self.values()
        return SamplingParams(
            temperature=float(v["temperature"]),
            top_k=int(v["top_k"]),
            top_p=float(v["top_p"]),
            min_p=float(v["min_p"]),
            n_predict=int(v["n_predict"]),
            repeat_penalty=float(v["repeat_penalty"]),
            seed=None if v["seed"] < 0 else int(v["seed"]),
        )

    def system_messages(self) -> list[dict]:
        text = self.system_prompt.toPlainText().strip()
        return [{"role": "system", "content": text}] if text else []
