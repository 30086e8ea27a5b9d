"""The web chat page in a real browser: headless Chromium driven through the DevTools
protocol (aiohttp's websocket client, no extra package), against a running server.

    python main.py --headless --port 8080 &
    python -m tools.webui_check http://127.0.0.1:8080/ [--shots DIR]

Checks what the unit tests cannot (they have no browser): a reply survives a reload
1.5 s into it and finishes; the chat comes back from sessionStorage after a second
reload with nothing pending; Stop frees the server's slot; New chat starts a new
conversation id. Prints each step and exits 1 on the first failed check. Needs
Debian's ``chromium`` (not a dependency of Mixdesk; a dev check, like tools/screenshot).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

PORT = 9334
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

SEND = """(async (text, wait) => {
  const i = document.getElementById('input'); i.value = text;
  document.getElementById('send').click();
  await new Promise(r => setTimeout(r, wait));
  const reply = document.querySelector('.msg.assistant:last-of-type .text');
  return reply ? reply.textContent.length : -1;
})"""
STATE = """(() => ({
  msgs: document.querySelectorAll('.msg').length,
  busy: !document.getElementById('stop').hidden,
  reply: [...document.querySelectorAll('.msg.assistant .text')].map(t => t.textContent),
  meta: [...document.querySelectorAll('.msg.assistant .meta')].map(m => m.textContent),
  saved: JSON.parse(sessionStorage.getItem('mixdesk.chat') || 'null'),
}))()"""
UNTIL_IDLE = """(async () => {
  for (let k = 0; k < 1200 && !document.getElementById('stop').hidden; k++)
    await new Promise(r => setTimeout(r, 500));
})()"""
STOP = """(async (before) => {
  document.getElementById('stop').click();
  const busy = async () => (await (await fetch('/slots')).json()).filter(s => s.is_processing).length;
  const t0 = performance.now();
  while (await busy() > before && performance.now() - t0 < 10000)
    await new Promise(r => setTimeout(r, 100));
  return [await busy(), Math.round(performance.now() - t0)];
})"""
BUSY = "(async () => (await (await fetch('/slots')).json()).filter(s => s.is_processing).length)()"


class Check(Exception):
    pass


def expect(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        raise Check(what)


async def drive(url: str, shots: Path | None) -> None:
    profile = tempfile.mkdtemp(prefix="mixdesk-chromium-")
    browser = subprocess.Popen(
        ["chromium", *FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={PORT}",
         "--window-size=1000,800", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            tabs = None
            for _ in range(200):
                try:
                    async with http.get(f"http://127.0.0.1:{PORT}/json") as r:
                        tabs = await r.json()
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            page = next(t for t in tabs or [] if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                seq = 0
                errors: list[str] = []

                async def call(method: str, **params):
                    nonlocal seq
                    seq += 1
                    await ws.send_json({"id": seq, "method": method, "params": params})
                    while True:
                        msg = await ws.receive_json()
                        if msg.get("method") == "Runtime.exceptionThrown":
                            errors.append(json.dumps(msg["params"]["exceptionDetails"])[:300])
                        if msg.get("id") == seq:
                            return msg

                async def js(expr: str):
                    r = await call(
                        "Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True
                    )
                    return r["result"]["result"].get("value")

                async def shot(name: str) -> None:
                    if shots is not None:
                        d = await call("Page.captureScreenshot", format="png")
                        (shots / name).write_bytes(base64.b64decode(d["result"]["data"]))

                await call("Runtime.enable")
                await call("Page.enable")
                await call("Page.navigate", url=url)
                await asyncio.sleep(1.5)
                story = "Write a story about a lighthouse keeper in three paragraphs."
                started = await js(f"{SEND}({json.dumps(story)}, 1500)")
                expect(started > 0, f"a reply is streaming ({started} characters after 1.5 s)")
                conv = (await js(STATE))["saved"]["conv"]
                await call("Page.reload")
                await asyncio.sleep(1.0)
                st = await js(STATE)
                await shot("webui_reload_mid.png")
                expect(st["msgs"] == 2 and st["busy"], "after a reload the reply is picked up")
                await js(UNTIL_IDLE)
                st = await js(STATE)
                await shot("webui_reload_done.png")
                expect(
                    not st["busy"] and len(st["reply"][0]) > started and "tokens" in st["meta"][0],
                    f"the reply finished: {len(st['reply'][0])} characters, {st['meta'][0]!r}",
                )
                saved = st["saved"]
                expect(
                    saved["conv"] == conv
                    and not saved["pending"]
                    and [m["role"] for m in saved["messages"]] == ["user", "assistant"],
                    "the finished chat is saved with the same conversation id",
                )
                await call("Page.reload")
                await asyncio.sleep(1.5)
                st = await js(STATE)
                expect(st["msgs"] == 2 and not st["busy"], "a second reload: the chat, idle")
                before = await js(BUSY)  # other clients' generations, if any
                await js(f"{SEND}({json.dumps('Another long story, please.')}, 1200)")
                busy, ms = await js(f"{STOP}({before})")
                expect(busy <= before, f"Stop frees the server's slot (in {ms} ms)")
                await js("document.getElementById('new-chat').click()")
                st = await js(STATE)
                expect(
                    st["msgs"] == 0 and st["saved"]["conv"] != conv and not st["saved"]["messages"],
                    "New chat: an empty chat under a new conversation id",
                )
                expect(not errors, f"no script errors ({errors})")
    finally:
        browser.kill()
        browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the page, e.g. http://127.0.0.1:8080/")
    ap.add_argument("--shots", type=Path, help="a folder for screenshots")
    a = ap.parse_args(argv)
    if shutil.which("chromium") is None:
        print("webui_check: needs chromium (apt-get install chromium)")
        return 2
    if a.shots:
        a.shots.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(drive(a.url, a.shots))
    except Check:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
