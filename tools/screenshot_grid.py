"""Drive the real window and grab the X/Y grid tab: docs/screenshot-grid.png (#21).

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python -m tools.screenshot_grid

As tools/screenshot.py: the window fills a 1280x800 screen, with the default model
and the demo adapters. The grid varies the scale of "pirate" (X) and of "terse"
(Y) on one prompt at temperature 0 and is grabbed once every card is done.
SHOT_OUT changes where the PNG goes; SHOT_THEME=dark takes it in the dark theme.
"""

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    # before any ui import: the shot must never touch the user's settings
    os.environ["MIXDESK_HOME"] = tempfile.mkdtemp(prefix="mixdesk-shot-")
    import qasync
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from core.settings import Settings
    from ui.app import app_icon, create_window, teardown

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Mixdesk")
    app.setWindowIcon(app_icon())
    app.setStyle("Fusion")
    dark = os.environ.get("SHOT_THEME") == "dark"
    Settings().set("theme", "dark" if dark else "light")
    out = os.environ.get("SHOT_OUT") or str(REPO / "docs" / "screenshot-grid.png")
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    args = argparse.Namespace(
        model=None,
        adapters=[],
        ctx_size=2048,
        parallel=6,  # the six cells in one batch
        host="127.0.0.1",
        port=8080,
        api_key=[],
        cors_origins=[],
    )
    win = create_window(args)
    win.resize(1280, 800)
    win.move(0, 0)
    win.show()

    def ready():
        if len(win.mixer.strips) < 3:
            return QTimer.singleShot(300, ready)
        ids = {s.info["name"]: a for a, s in win.mixer.strips.items()}
        win.sampling.set_values(
            {"temperature": 0.0, "n_predict": int(os.environ.get("N", "40")), "seed": 0}
        )
        g = win.grid
        win.tabs.setCurrentIndex(win.tabs.indexOf(g.parentWidget()))
        g.x.set_axis("scale", "0, 0.5, 1", adapter=ids["pirate"])
        g.y.set_axis("scale", "0, 0.9", adapter=ids["terse"])
        prompt = os.environ.get("P", "Describe the moon in one sentence.")
        g.prompt.setPlainText(prompt)
        g.finished.connect(lambda: QTimer.singleShot(300, grab))
        g.run()

    def grab():
        win.grab().save(out)
        print("saved", out, flush=True)
        QTimer.singleShot(500, win.close)

    QTimer.singleShot(500, ready)
    app.aboutToQuit.connect(win.shutdown)
    with loop:
        loop.run_forever()
    teardown(app, win)


if __name__ == "__main__":
    main()
