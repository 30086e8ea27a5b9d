"""Server panel: turn the llama-server-compatible HTTP API on and off from the GUI.

The aiohttp app (``core.http.app.create_app``) runs on the qasync event loop, so
it shares the GUI's engine (one model, one batch). It is built from main.py's
flags with the same ``ServerSettings.from_args`` as --headless (so --temp, -n,
--alias, --metrics, ... mean the same), then this tab's own fields: host, port, an
optional API key and adapter loading, which persist in settings. The base URL and a
curl example are copyable; a live log shows every HTTP request and every generation
the engine starts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import time
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from core.cli import parse_args
from core.options import DEFAULT_HOST, DEFAULT_PORT
from core.paths import data_dir
from core.serve.events import RequestFinished, RequestStarted
from core.settings import Settings

from .bridge import EngineBridge
from .util import ElidedLabel

log = logging.getLogger(__name__)
MAX_LOG_LINES = 2000


class ServerPanel(QWidget):
    state_changed = Signal(bool)
    log_line = Signal(str)
    message = Signal(str)

    def __init__(
        self,
        bridge: EngineBridge,
        settings: Settings,
        args: argparse.Namespace | None = None,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        self.args = args if args is not None else parse_args([])  # main.py's flags
        self.runner = None
        self.site = None
        self.bound_port: int | None = None
        self._busy = False
        cfg = settings.get("server") or {}

        self.toggle = QPushButton("Start server", checkable=True)
        self.toggle.setObjectName("primaryButton")
        self.toggle.toggled.connect(self._toggled)
        # elided, its whole text in the tooltip: a long error ("[Errno 98] error while
        # attempting to bind on address …") widened the tab and squeezed the desk
        self.state = ElidedLabel("Stopped")
        self.state.setObjectName("serverState")
        self.host = QLineEdit(cfg.get("host", DEFAULT_HOST))
        self.port = QSpinBox(minimum=1, maximum=65535, value=int(cfg.get("port", DEFAULT_PORT)))
        self.api_key = QLineEdit(cfg.get("api_key", ""))
        self.api_key.setPlaceholderText("optional: clients must send Authorization: Bearer KEY")
        self.api_key.setEchoMode(QLineEdit.PasswordEchoOnEdit)
        for w in (self.host, self.api_key):
            w.editingFinished.connect(self._save)
        self.port.valueChanged.connect(self._save)
        # Loading an adapter by path over HTTP opens files a client names: off unless
        # asked for, and then only inside the adapter folders this desk already uses.
        self.allow_lora = QCheckBox("Allow loading adapters over HTTP")
        self.allow_lora.setChecked(bool(cfg.get("allow_runtime_lora", False)))
        self.allow_lora.setToolTip(
            "POST /lora-adapters/load and /v1/load_lora_adapter, limited to the folders of "
            "the adapters on the desk, the recent ones and the Mixdesk adapters folder "
            "(applies when the server starts)"
        )
        self.allow_lora.toggled.connect(lambda _: self._save())
        # what the server is built with at start: locked while it runs (a change would
        # silently wait for the next start), with each field's own tooltip kept
        self._start_fields = {
            w: w.toolTip() for w in (self.host, self.port, self.api_key, self.allow_lora)
        }

        self.url = QLineEdit(readOnly=True)
        copy_url = QPushButton("Copy")
        copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        self.curl = QPlainTextEdit(readOnly=True)
        self.curl.setObjectName("codeBox")
        self.curl.setMaximumHeight(96)
        copy_curl = QPushButton("Copy curl")
        copy_curl.clicked.connect(
            lambda: QGuiApplication.clipboard().setText(self.curl_command(reveal=True))
        )

        form = QFormLayout()
        top = QHBoxLayout()
        top.addWidget(self.toggle)
        top.addWidget(self.state, 1)
        form.addRow(top)
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", self.api_key)
        form.addRow("", self.allow_lora)
        url_row = QHBoxLayout()
        url_row.addWidget(self.url, 1)
        url_row.addWidget(copy_url)
        form.addRow("Base URL", url_row)
        curl_row = QHBoxLayout()
        curl_row.addWidget(self.curl, 1)
        curl_row.addWidget(copy_curl)
        form.addRow("Example", curl_row)

        self.log_view = QPlainTextEdit(readOnly=True)
        self.log_view.setObjectName("codeBox")
        self.log_view.setMaximumBlockCount(MAX_LOG_LINES)
        title = QLabel("Request log")
        title.setObjectName("sectionTitle")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(form)
        lay.addWidget(title)
        lay.addWidget(self.log_view, 1)

        self.log_line.connect(self._append)
        bridge.request_started.connect(self._request_started)
        bridge.request_finished.connect(self._request_finished)
        self._update_texts()

    # -- settings ------------------------------------------------------------------------
    def _save(self) -> None:
        self.settings.update(
            "server",
            host=self.host.text().strip() or DEFAULT_HOST,
            port=self.port.value(),
            api_key=self.api_key.text(),
            allow_runtime_lora=self.allow_lora.isChecked(),
        )
        self._update_texts()

    def server_settings(self):
        """What the server starts with: ``ServerSettings.from_args`` of main.py's flags,
        exactly as --headless builds it, then the fields this tab owns. The tab's API
        key replaces the first --api-key (the others stay); adapter loading over HTTP
        is the checkbox, limited to --lora-dir if given, else to the desk's folders.
        Raises UserError naming a flag value the server cannot use."""
        from core.http import ServerSettings

        flags = ServerSettings.from_args(self.args)
        key = self.api_key.text()
        allow = self.allow_lora.isChecked()
        given_dirs = [Path(d) for d in getattr(self.args, "lora_dir", None) or []]
        return dataclasses.replace(
            flags,
            host=self.host.text().strip() or DEFAULT_HOST,
            port=self.port.value(),
            api_keys=([key] if key else []) + flags.api_keys[1:],
            on_log=self.log_line.emit,
            allow_runtime_lora=allow,
            lora_dirs=(given_dirs or self.lora_dirs()) if allow else [],
        )

    def base_url(self) -> str:
        host = self.host.text().strip() or DEFAULT_HOST
        shown = DEFAULT_HOST if host in ("0.0.0.0", "") else host
        if ":" in shown and not shown.startswith("["):
            shown = f"[{shown}]"
        return f"http://{shown}:{self.bound_port or self.port.value()}"

    def curl_command(self, reveal: bool = False) -> str:
        """The example request; the API key is masked on screen (anyone looking at or
        screen-sharing the window would read it) and only put in by "Copy curl"."""
        key = self.api_key.text()
        shown = key if reveal else "•" * 8
        auth = f' \\\n  -H "Authorization: Bearer {shown}"' if key else ""
        return (
            f"curl {self.base_url()}/v1/chat/completions "
            f"-H 'Content-Type: application/json'{auth} \\\n"
            '  -d \'{"messages": [{"role": "user", "content": "Hello!"}]}\''
        )

    def lora_dirs(self) -> list[Path]:
        """The folders HTTP clients may load adapters from (see allow_lora)."""
        paths = [a.get("path", "") for a in self.bridge.engine.adapters()]
        paths += self.settings.get("recent_adapters") or []
        out: list[Path] = []
        for p in [*(Path(x).parent for x in paths if x), data_dir() / "adapters"]:
            if p not in out:
                out.append(p)
        return out

    def _update_texts(self) -> None:
        self.url.setText(self.base_url() + "/v1")
        self.curl.setPlainText(self.curl_command())

    # -- log ---------------------------------------------------------------------------------
    def _append(self, line: str) -> None:
        self.log_view.appendPlainText(f"{time.strftime('%H:%M:%S')}  {line}")

    def _request_started(self, ev: RequestStarted) -> None:
        names = {a["id"]: a["name"] for a in self.bridge.engine.adapters()}
        mix = ", ".join(f"{names.get(a, f'#{a}')}×{s:g}" for a, s in ev.mix.items())
        self.log_line.emit(
            f"generation #{ev.id} from {ev.source or '?'}: "
            f"{ev.prompt_n} prompt tokens, mix {mix or 'no adapters'}"
        )

    def _request_finished(self, ev: RequestFinished) -> None:
        self.log_line.emit(
            f"generation #{ev.id} done: {ev.predicted_n} tokens, "
            f"{ev.timings.get('predicted_per_second', 0.0):.1f} tok/s, stop {ev.stop_type}"
        )

    # -- on / off ---------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.site is not None

    def _toggled(self, on: bool) -> None:
        if self._busy:
            return
        coro = self.start() if on else self.stop()
        asyncio.ensure_future(coro)

    def _lock_start_fields(self, running: bool) -> None:
        for w, tip in self._start_fields.items():
            w.setEnabled(not running)
            locked = "Stop the server to change this: it applies when the server starts"
            w.setToolTip(f"{tip}\n\n{locked}" if running and tip else locked if running else tip)

    def _set_toggle(self, on: bool) -> None:
        self._lock_start_fields(on)
        self._busy = True
        self.toggle.setChecked(on)
        self.toggle.setText("Stop server" if on else "Start server")
        self._busy = False

    async def start(self) -> bool:
        if self.runner is not None:
            return True
        self._save()
        try:
            from core.http import create_app, exposure_warnings, start_site

            settings = self.server_settings()
            host, port = settings.host, settings.port
            app = create_app(self.bridge.engine, settings)
            runner, bound = await start_site(app, host, port)
        except Exception as e:  # port in use, bad host, missing module...
            log.warning("server did not start: %s", e)
            reason = start_failure(e, self.port.value())
            self.set_state(f"Not running: {reason}", detail=str(e))
            self.log_line.emit(f"server did not start: {reason} ({e})")
            self.message.emit(f"The API server did not start: {reason}")
            self._set_toggle(False)
            return False
        for w in exposure_warnings(settings):
            self.log_line.emit(w)
            self.message.emit(w)
        site = True
        self.bound_port = bound
        self._update_texts()
        self.runner, self.site = runner, site
        self.set_state(f"Listening on {self.base_url()}")
        self.state.setProperty("on", True)
        self._repolish(self.state)
        self._set_toggle(True)
        self.settings.update("server", enabled=True)
        self.log_line.emit(f"server started on {host}:{bound}")
        self.state_changed.emit(True)
        return True

    async def stop(self, remember: bool = True) -> None:
        runner, self.runner, self.site = self.runner, None, None
        self.bound_port = None
        self._update_texts()
        if runner is not None:
            await runner.cleanup()
            self.log_line.emit("server stopped")
        self.set_state("Stopped")
        self.state.setProperty("on", False)
        self._repolish(self.state)
        self._set_toggle(False)
        if remember:
            self.settings.update("server", enabled=False)
        self.state_changed.emit(False)

    def set_state(self, text: str, detail: str = "") -> None:
        """The line beside the button, elided to its room; the tooltip has all of it."""
        self.state.setText(text)
        self.state.setToolTip(text + (f"\n\n{detail}" if detail and detail not in text else ""))

    @staticmethod
    def _repolish(w: QWidget) -> None:
        w.style().unpolish(w)
        w.style().polish(w)


def start_failure(e: Exception, port: int) -> str:
    """Why the server did not start, in the user's words: a busy port says what to do."""
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return f"Port {port} is already in use — pick another port or stop the program using it"
    return str(e) or type(e).__name__
