"""Light and dark themes: one table of named colours per scheme, from which both the
application palette and the stylesheet (resources/styles/mixdesk.qss, a template)
are made, so no widget is hard-coded to one palette.

The View menu chooses "system" (the default: follows the desktop's colour scheme,
``QStyleHints.colorScheme()``, live through ``colorSchemeChanged``), "light" or
"dark"; the choice is the ``theme`` setting. Widgets that draw their own colours
(the chat transcript) take them from the palette and re-render on ``changed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from string import Template

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette

from core.settings import THEMES, Settings

from .util import RESOURCES

QSS = RESOURCES / "styles" / "mixdesk.qss"


@dataclass(frozen=True)
class Theme:
    name: str
    dark: bool
    window: str  # the page behind every panel
    surface: str  # bars, inputs, buttons, the transcript
    surface_alt: str  # table headers, disabled buttons
    alt_row: str  # alternate tree rows
    code: str  # the code box
    border: str  # separators
    control: str  # input and button outlines
    menu_border: str
    text: str
    title: str  # section titles
    muted: str  # secondary text
    hint: str
    faint: str  # inactive labels
    disabled: str
    accent: str
    accent_hover: str
    accent_soft: str  # selected menu item
    accent_disabled: str
    on_accent_disabled: str  # a disabled primary button's label: muted, not on_accent
    on_accent: str  # text on an accent (or danger) background
    groove: str  # slider groove
    danger: str
    danger_border: str
    danger_soft: str
    warn: str
    warn_border: str
    ok: str
    error_bg: str
    error_border: str
    error_text: str
    edit_bg: str
    edit_text: str
    edit_border: str
    diff_bg: str  # a token where the two mixes of A/B compare disagree (under text)


LIGHT = Theme(
    name="light",
    dark=False,
    window="#f6f7fb",
    surface="#ffffff",
    surface_alt="#f0f2f7",
    alt_row="#f8f9fc",
    code="#fbfbfd",
    border="#e3e6ee",
    control="#d5d9e4",
    menu_border="#c3c8d6",
    text="#1f2430",
    title="#30374a",
    muted="#5b6275",
    hint="#6e7589",
    faint="#9aa0b2",
    disabled="#a9aebd",
    accent="#3d5afe",
    accent_hover="#3049d6",
    accent_soft="#e8ecff",
    accent_disabled="#a9b5f7",
    on_accent_disabled="#ffffff",  # on the pale fill white is already faint
    on_accent="#ffffff",
    groove="#dde1ec",
    danger="#d64545",
    danger_border="#c03a3a",
    danger_soft="#e9a3a3",
    warn="#ffb020",
    warn_border="#e09a10",
    ok="#2e9d5b",
    error_bg="#fdecec",
    error_border="#e38c8c",
    error_text="#a12b2b",
    edit_bg="#fff6e0",
    edit_text="#7a5500",
    edit_border="#f2d58b",
    diff_bg="#ffc23d",
)

DARK = Theme(
    name="dark",
    dark=True,
    window="#1c1e25",
    surface="#262932",
    surface_alt="#2e323c",
    alt_row="#2a2d37",
    code="#20232b",
    border="#353945",
    control="#444a58",
    menu_border="#505667",
    text="#e6e8ef",
    title="#d3d7e2",
    muted="#aab0c0",
    hint="#969cae",
    faint="#7d8395",
    disabled="#61677a",
    accent="#5c74ff",
    accent_hover="#7489ff",
    accent_soft="#333d6b",
    accent_disabled="#3a4270",
    on_accent_disabled="#767d99",
    on_accent="#ffffff",
    groove="#3b404e",
    danger="#d65656",
    danger_border="#b94444",
    danger_soft="#7a3a3a",
    warn="#f0a01a",
    warn_border="#c9850c",
    ok="#4cc27e",
    error_bg="#3c2125",
    error_border="#7a3a3a",
    error_text="#ffa3a3",
    edit_bg="#382f1c",
    edit_text="#f2d58b",
    edit_border="#6b5a2a",
    diff_bg="#6e4e0e",
)

_current = LIGHT


def current() -> Theme:
    """The theme in use (for the few colours set in code, e.g. adapter rows)."""
    return _current


def stylesheet(theme: Theme = LIGHT) -> str:
    if not QSS.exists():
        return ""
    # ${icons}: the folder of the stylesheet's images (the checkbox's tick)
    icons = (RESOURCES / "icons").as_posix()
    return Template(QSS.read_text(encoding="utf-8")).substitute(asdict(theme), icons=icons)


def palette(theme: Theme) -> QPalette:
    """The application palette: what widgets without a stylesheet rule use, and where the
    transcript reads its colours from."""
    c = {k: QColor(v) for k, v in asdict(theme).items() if isinstance(v, str) and v[:1] == "#"}
    pal = QPalette()
    roles = {
        QPalette.Window: c["window"],
        QPalette.WindowText: c["text"],
        QPalette.Base: c["surface"],
        QPalette.AlternateBase: c["alt_row"],
        QPalette.Text: c["text"],
        QPalette.Button: c["surface"],
        QPalette.ButtonText: c["text"],
        QPalette.BrightText: c["on_accent"],
        QPalette.Highlight: c["accent"],
        QPalette.HighlightedText: c["on_accent"],
        QPalette.ToolTipBase: c["surface"],
        QPalette.ToolTipText: c["text"],
        QPalette.PlaceholderText: c["hint"],
        QPalette.Link: c["accent_hover"] if theme.dark else c["accent"],
        QPalette.LinkVisited: c["accent_hover"] if theme.dark else c["accent"],
        QPalette.Light: c["surface"].lighter(120),
        QPalette.Midlight: c["surface_alt"],
        QPalette.Mid: c["control"],
        QPalette.Dark: c["border"].darker(130),
        QPalette.Shadow: QColor("#000000"),
    }
    for role, color in roles.items():
        pal.setColor(role, color)
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        pal.setColor(QPalette.Disabled, role, c["disabled"])
    return pal


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def resolve(mode: str, system_dark: bool | None = None) -> Theme:
    """ "light", "dark", or "system": the desktop's scheme (light when it says none)."""
    if system_dark is None:
        system_dark = system_is_dark()
    if mode == "dark" or (mode == "system" and system_dark):
        return DARK
    return LIGHT


def contrast(a: QColor | str, b: QColor | str) -> float:
    """WCAG 2 contrast ratio of two colours (1..21; body text wants >= 4.5)."""

    def lum(c: QColor) -> float:
        def ch(v: float) -> float:
            return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4

        return 0.2126 * ch(c.redF()) + 0.7152 * ch(c.greenF()) + 0.0722 * ch(c.blueF())

    la, lb = sorted((lum(QColor(a)), lum(QColor(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


class ThemeController(QObject):
    """Applies the chosen theme to the application and keeps following the system
    while the choice is "system". ``changed(Theme)`` after every change."""

    changed = Signal(object)

    def __init__(self, settings: Settings, parent: QObject | None = None):
        super().__init__(parent)
        self.settings = settings
        self.mode = settings.get("theme") if settings.get("theme") in THEMES else "system"
        self.theme = LIGHT
        self.system_dark = system_is_dark()
        hints = QGuiApplication.styleHints()
        if hints is not None:
            hints.colorSchemeChanged.connect(self._system_changed)
        self.apply()

    def set_mode(self, mode: str) -> None:
        if mode not in THEMES:
            return
        self.mode = mode
        self.settings.set("theme", mode)
        self.apply()

    def _system_changed(self, scheme: Qt.ColorScheme) -> None:
        """The desktop switched between light and dark (the signal carries the new one)."""
        self.system_dark = scheme == Qt.ColorScheme.Dark
        if self.mode == "system":
            self.apply()

    def apply(self) -> None:
        global _current
        app = QGuiApplication.instance()
        theme = resolve(self.mode, self.system_dark)
        self.theme = _current = theme
        if app is not None:
            # only when it changes: setting either re-polishes every widget of the
            # application (another window's included), which a new window must not cost
            pal = palette(theme)
            if app.palette() != pal:
                app.setPalette(pal)
            qss = stylesheet(theme)
            if hasattr(app, "setStyleSheet") and app.styleSheet() != qss:  # not a bare GUI app
                app.setStyleSheet(qss)
        self.changed.emit(theme)
