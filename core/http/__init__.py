"""Mixdesk's HTTP API: llama-server compatible, OpenAI and vLLM extras, LoRA mixing.

    from core.http import create_app, ServerSettings
    app = create_app(engine, ServerSettings(port=8080, on_log=print))

See the README section "HTTP API" for the endpoints and the differences from llama-server.
"""

from .app import ServerSettings, create_app, set_engine
from .server import ServerThread, exposure_warnings, run_headless, start_site

__all__ = [
    "ServerSettings",
    "create_app",
    "set_engine",
    "ServerThread",
    "exposure_warnings",
    "run_headless",
    "start_site",
]
