"""Drive the real window (run_gui's setup) and grab docs/screenshot.png.

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python -m tools.screenshot

The window fills a 1280x800 screen (a common laptop size it must fit). SHOT_OUT
changes where the PNG goes (to look at it before replacing docs/screenshot.png);
SHOT_THEME=dark takes it in the dark theme (docs/screenshot-dark.png).

Loads the default model and the demo adapters, sets a mix, saves two presets,
chats at temperature 0 (a code block), regenerates the reply twice and shows the
second version (‹ 2/3 ›), asks again and grabs the window while that reply streams.
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
    Settings().set("theme", "dark" if dark else "light")  # the window applies it
    default_out = REPO / "docs" / ("screenshot-dark.png" if dark else "screenshot.png")
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    args = argparse.Namespace(
        model=None,
        adapters=[],
        ctx_size=2048,
        parallel=4,
        host="127.0.0.1",
        port=8080,
        api_key=[],
        cors_origins=[],
    )
    win = create_window(args)
    win.resize(1280, 800)
    win.move(0, 0)
    win.show()
    state = {"n": 0}

    def ready():
        if len(win.mixer.strips) < 3:
            return QTimer.singleShot(300, ready)
        ids = {s.info["name"]: a for a, s in win.mixer.strips.items()}
        m = win.mixer
        m.strips[ids["terse"]].spin.setValue(0.9)
        m.save_preset("Terse")
        m.zero_all()
        m.strips[ids["pirate"]].spin.setValue(1.0)
        m.strips[ids["hype"]].spin.setValue(0.35)
        m.save_preset("Pirate + a little hype")
        m.strips[ids["terse"]].spin.setValue(0.5)
        m.strips[ids["terse"]].on.setChecked(False)
        win.sampling.set_values(
            {
                "temperature": 0.0,
                "n_predict": int(os.environ.get("N1", "70")),
                "repeat_penalty": 1.1,
            }
        )
        win.sampling.system_prompt.setPlainText("You are a helpful assistant.")
        win.chat.reply_finished.connect(after_first)
        win.chat.send(os.environ.get("P1", "Write a Python code block that prints a list."))

    def after_first(_):
        win.chat.reply_finished.disconnect(after_first)
        win.chat.reply_finished.connect(after_regenerate)
        win.chat.regenerate()  # the reply keeps its versions

    def after_regenerate(_):
        state["versions"] = state.get("versions", 2) + 1
        if state["versions"] <= 3:  # a third version, then show the second: ‹ 2/3 ›
            win.chat.regenerate()
            return
        win.chat.reply_finished.disconnect(after_regenerate)
        win.chat.show_version(len(win.chat.conversation["messages"]) - 1, -1)
        win.sampling.set_values({"n_predict": 60})
        win.chat.input.setPlainText("")
        win.chat.send(os.environ.get("P2", "And how do I sort it first?"))
        win.chat.gen.token.connect(count)

    def count(_t):
        state["n"] += 1
        if state["n"] == int(os.environ.get("N2", "14")):
            QTimer.singleShot(200, grab)

    def grab():
        win.grab().save(os.environ.get("SHOT_OUT") or str(default_out))
        print("saved", flush=True)
        win.chat.stop()
        QTimer.singleShot(500, win.close)

    QTimer.singleShot(500, ready)
    app.aboutToQuit.connect(win.shutdown)
    with loop:
        loop.run_forever()
    print("loop done", flush=True)
    teardown(app, win)
    print("teardown done", flush=True)


if __name__ == "__main__":
    main()
