"""Can Qt open a window here? Asked before the QApplication exists.

When Qt cannot initialise its platform plugin it aborts the whole process with
"no Qt platform plugin could be initialized", which names neither the cause nor
the fix. The two causes seen on Linux are no display at all (an SSH session, a
container) and the X11 plugin missing a system library: since Qt 6.5 it needs
libxcb-cursor0, which many desktop installs lack. Both get one clear line here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from pathlib import Path

# What Qt's xcb plugin needs beyond a basic X11 desktop (Qt's "X11 requirements").
XCB_PACKAGES = (
    "libxcb-cursor0 libxkbcommon-x11-0 libxcb-icccm4 libxcb-keysyms1 "
    "libxcb-shape0 libxcb-render-util0 libxcb-image0"
)


def display_problem(
    env: Mapping[str, str] | None = None, platform: str | None = None
) -> str | None:
    """Why Qt would fail to open a window, in words a user can act on; None when
    nothing is known to be wrong (any other platform, or a Qt platform the user chose)."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        return None
    qpa = env.get("QT_QPA_PLATFORM", "")
    if qpa and not qpa.startswith("xcb"):
        return None  # offscreen, wayland, vnc, ...: the user's choice
    if not qpa and env.get("WAYLAND_DISPLAY"):
        return None  # a Wayland session: Qt takes its wayland plugin
    if not env.get("DISPLAY"):
        return (
            "no display to open the window on (DISPLAY is not set). Run Mixdesk in a "
            "desktop session, or `make serve` (main.py --headless) for the HTTP API "
            "without a window."
        )
    missing = xcb_plugin_error()
    if missing:
        return (
            f"Qt cannot use the X11 display: {missing}. On Debian or Ubuntu install "
            f"what its X11 plugin needs: sudo apt-get install {XCB_PACKAGES}"
        )
    return None


def xcb_plugin_error(plugin: Path | None = None) -> str | None:
    """The loader's error for Qt's X11 platform plugin (it names the missing
    library), or None when it loads. Loading it is what Qt does next anyway."""
    if plugin is None:
        try:
            import PySide6
        except ImportError:
            return None  # main.py reports a missing PySide6 itself
        plugin = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    if not plugin.exists():
        return None
    try:
        ctypes.CDLL(str(plugin))
    except OSError as e:
        return str(e)
    return None
