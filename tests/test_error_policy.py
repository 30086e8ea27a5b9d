"""Only a UserError is the user's fault. A plain ValueError from inside Mixdesk (numpy,
a bug) must not pass for a bad request: the HTTP API answers 500 (and logs the
traceback), the command line shows a traceback instead of a tidy one-line "error"."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

import main
from core.cli import read_api_key_file
from core.errors import UserError
from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine


@pytest.fixture(scope="module")
def server(smollm_path):
    eng = Engine(EngineOptions(ctx_size=128, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, on_log=lambda line: None)).start()
    yield srv, eng
    srv.stop()
    eng.stop()


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=json.dumps(body)) as r:
            return r.status, await r.json()


def test_internal_value_error_is_a_500_not_a_400(server, monkeypatch):
    srv, eng = server

    def broken(*a, **kw):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(eng.tokenizer, "encode", broken)
    status, body = asyncio.run(_post(srv.url + "/tokenize", {"content": "hi"}))
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "broadcast" not in body["error"]["message"]  # internals are logged, not sent


def test_a_user_error_is_still_a_400(server):
    srv, _ = server
    status, body = asyncio.run(_post(srv.url + "/completion", {"prompt": "x", "top_k": "many"}))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_api_key_file_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="holds no key"):
        read_api_key_file((tmp_path / "k").write_text("\n") and tmp_path / "k")


def test_main_lets_an_internal_value_error_through(monkeypatch, tmp_path):
    """A plain ValueError is a bug: main() must not turn it into 'error: ...' + exit 1."""
    import core.export_cli

    def broken(args):
        raise ValueError("internal")

    monkeypatch.setattr(core.export_cli, "run_exports", broken)
    with pytest.raises(ValueError, match="internal"):
        main.main(["--export-lora", str(tmp_path / "x.gguf"), "--lora", "a.gguf"])


def test_main_prints_a_user_error_in_one_line(monkeypatch, tmp_path, capsys):
    import core.export_cli

    def refused(args):
        raise UserError("nothing to export")

    monkeypatch.setattr(core.export_cli, "run_exports", refused)
    assert main.main(["--export-lora", str(tmp_path / "x.gguf"), "--lora", "a.gguf"]) == 1
    assert capsys.readouterr().err.strip() == "mixdesk: error: nothing to export"


def test_an_internal_error_while_loading_an_adapter_is_a_500(smollm_path, ref_dir, monkeypatch):
    """The runtime-load route caught ValueError as "the adapter's fault": an internal
    ValueError during a load must be a 500, an AdapterError still a 400."""
    eng = Engine(EngineOptions(ctx_size=128, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    settings = ServerSettings(
        port=0,
        on_log=lambda line: None,
        allow_runtime_lora=True,
        lora_dirs=[ref_dir / "adapters"],
    )
    srv = ServerThread(eng, settings).start()
    try:
        path = str(ref_dir / "adapters" / "lora_attn.gguf")
        real = eng.add_adapter

        def broken(*a, **kw):
            raise ValueError("operands could not be broadcast together")

        monkeypatch.setattr(eng, "add_adapter", broken)
        status, body = asyncio.run(_post(srv.url + "/lora-adapters/load", {"path": path}))
        assert status == 500 and body["error"]["type"] == "server_error"
        monkeypatch.setattr(eng, "add_adapter", real)
        bad = str(ref_dir / "adapters" / "qwen2_lora_qv.gguf")  # another model's adapter
        status, body = asyncio.run(_post(srv.url + "/lora-adapters/load", {"path": bad}))
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
    finally:
        srv.stop()
        eng.stop()
