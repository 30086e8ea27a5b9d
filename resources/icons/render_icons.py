"""Render mixdesk.svg to the PNG sizes the desktop wants: python resources/icons/render_icons.py"""

import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QGuiApplication, QImage, QPainter  # noqa: E402
from PySide6.QtSvg import QSvgRenderer  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = (16, 32, 48, 128, 256)

if __name__ == "__main__":
    app = QGuiApplication([])
    renderer = QSvgRenderer(str(HERE / "mixdesk.svg"))
    assert renderer.isValid(), "mixdesk.svg did not parse"
    for size in SIZES:
        img = QImage(size, size, QImage.Format_ARGB32)
        img.fill(Qt.transparent)
        p = QPainter(img)
        p.setRenderHint(QPainter.Antialiasing)
        renderer.render(p)
        p.end()
        assert img.save(str(HERE / f"mixdesk-{size}.png"))
        print(HERE / f"mixdesk-{size}.png")
