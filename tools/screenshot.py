"""Drive the real window (run_gui's setup) and grab the screenshots of the README and docs/.

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python -m tools.screenshot
    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python -m tools.screenshot --grid

The window fills a 1280x800 screen (a common laptop size it must fit), with the
default model and the demo adapters, in a throw-away MIXDESK_HOME. SHOT_OUT changes
where the PNG goes (to look at it before replacing the one in docs/); SHOT_THEME=dark
takes it in the dark theme; SHOT_SIZE=1024x700 sizes the window (with a screen that
large: -screen 0 1024x700x24).

The chat scene (docs/screenshot.png, docs/screenshot-dark.png): loads the demo control
vector (a vector strip, at 0.3), sets a mix, saves two
presets, chats at temperature 0 (a code block), regenerates the reply twice and shows
the second version (‹ 2/3 ›), asks again and grabs the window while that reply streams.

The grid scene (``--grid``, docs/screenshot-grid.png, issue #21): varies the scale of
"pirate" (X) and of "terse" (Y) on one prompt at temperature 0 and grabs the tab once
every card is done.
"""

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_window(parallel: int, default_name: str, scene) -> None:
    """Open the window as ``main.py`` would (its own flags, parsed by core.cli), call
    ``scene(win, grab)`` once the demo adapters are on the desk, and run until the
    scene calls ``grab()``: the window is saved to SHOT_OUT (or docs/<default_name>)
    and closed."""
    # before any ui import: the shot must never touch the user's settings
    os.environ["MIXDESK_HOME"] = tempfile.mkdtemp(prefix="mixdesk-shot-")
    import qasync
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from core.cli import parse_args
    from core.settings import Settings
    from ui.app import app_icon, create_window, teardown

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Mixdesk")
    app.setWindowIcon(app_icon())
    app.setStyle("Fusion")
    dark = os.environ.get("SHOT_THEME") == "dark"
    Settings().set("theme", "dark" if dark else "light")  # the window applies it
    if dark:
        default_name = default_name.replace(".png", "-dark.png")
    out = os.environ.get("SHOT_OUT") or str(REPO / "docs" / default_name)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    # -c is the total, shared by the slots (llama-server's rule): 2048 tokens each
    argv = ["--ctx-size", str(2048 * parallel), "--parallel", str(parallel)]
    win = create_window(parse_args(argv))
    width, height = (int(n) for n in os.environ.get("SHOT_SIZE", "1280x800").split("x"))
    win.resize(width, height)
    win.move(0, 0)
    win.show()

    def grab():
        win.grab().save(out)
        print("saved", out, flush=True)
        QTimer.singleShot(500, win.close)

    def ready():
        if len(win.mixer.strips) < 3:
            return QTimer.singleShot(300, ready)
        scene(win, grab)

    QTimer.singleShot(500, ready)
    app.aboutToQuit.connect(win.shutdown)
    with loop:
        loop.run_forever()
    teardown(app, win)


def chat_scene(win, grab) -> None:
    from PySide6.QtCore import QTimer

    # the demo control vector beside the demo adapters: a vector strip on the desk
    win.engine.add_control_vector(REPO / "resources" / "vectors" / "happy.gguf", 0.0)
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
    vec = next(st for st in m.strips.values() if st.info.get("path", "").endswith("happy.gguf"))
    vec.spin.setValue(0.3)
    win.sampling.set_values(
        {"temperature": 0.0, "n_predict": int(os.environ.get("N1", "70")), "repeat_penalty": 1.1}
    )
    win.sampling.system_prompt.setPlainText("You are a helpful assistant.")
    state = {"n": 0, "versions": 2}

    def after_first(_):
        win.chat.reply_finished.disconnect(after_first)
        win.chat.reply_finished.connect(after_regenerate)
        win.chat.regenerate()  # the reply keeps its versions

    def after_regenerate(_):
        state["versions"] += 1
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
            QTimer.singleShot(200, grab_streaming)

    def grab_streaming():
        grab()
        win.chat.stop()

    win.chat.reply_finished.connect(after_first)
    win.chat.send(os.environ.get("P1", "Write a Python code block that prints a list."))


def grid_scene(win, grab) -> None:
    from PySide6.QtCore import QTimer

    ids = {s.info["name"]: a for a, s in win.mixer.strips.items()}
    win.sampling.set_values(
        {"temperature": 0.0, "n_predict": int(os.environ.get("N", "40")), "seed": 0}
    )
    g = win.grid
    win.tabs.setCurrentIndex(win.tabs.indexOf(g.parentWidget()))
    g.x.set_axis("scale", "0, 0.5, 1", adapter=ids["pirate"])
    g.y.set_axis("scale", "0, 0.9", adapter=ids["terse"])
    g.prompt.setPlainText(os.environ.get("P", "Describe the moon in one sentence."))
    g.finished.connect(lambda: QTimer.singleShot(300, grab))
    g.run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", action="store_true", help="the X/Y grid tab, not the chat")
    a = ap.parse_args()
    if a.grid:
        run_window(6, "screenshot-grid.png", grid_scene)  # the six cells in one batch
    else:
        run_window(4, "screenshot.png", chat_scene)


if __name__ == "__main__":
    main()
