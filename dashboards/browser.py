"""Open a report page in headless Chromium and say whether it really rendered.

Drives Debian's `chromium` over the DevTools protocol (a websocket; aiohttp's client,
already a dependency through s3fs): navigate to the file, wait for the page's own
`window.stragReady` promise (resolved when every vega-embed call has finished), then
count the drawn charts, collect console errors, uncaught exceptions and any request
that left the machine (a CDN), and optionally take a full-page PNG screenshot.

    check = check_page(Path("out/fleet/index.html"), screenshot=Path("docs/fleet-report.png"))
    check.raise_for_problems()

No sleeps: every wait is on an event (DevTools line on stderr, load event, promise),
bounded by `timeout` seconds.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import pathlib
import re
import shutil
import subprocess
import tempfile

__all__ = ["PageCheck", "BrowserError", "find_chromium", "check_page", "main", "CHROMIUM_FLAGS"]

# Flags for a sandbox with no network: without the background-networking ones Chromium
# keeps trying (and failing) to reach Google's services at every start.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--window-size=1280,900",
)

_LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:", "chrome:", "devtools:")


class BrowserError(RuntimeError):
    """Chromium is missing, did not start, or the page did not render cleanly."""


@dataclasses.dataclass
class PageCheck:
    """What headless Chromium saw on one page."""

    url: str
    chart_slots: int                 # elements with class chart-slot on the page
    charts_drawn: int                # slots holding an <svg> or <canvas> with marks
    marks: int                       # drawn SVG marks (path/rect/line/text/symbol) over all charts
    ready: str                       # value the page's stragReady promise resolved to, or the error
    console_errors: list[str]
    exceptions: list[str]
    external_requests: list[str]
    screenshot: bytes | None = None

    @property
    def problems(self) -> list[str]:
        out = []
        if self.chart_slots == 0:
            out.append("no chart slots on the page")
        if self.charts_drawn < self.chart_slots:
            out.append(f"only {self.charts_drawn} of {self.chart_slots} charts drawn")
        out += [f"console error: {m}" for m in self.console_errors]
        out += [f"uncaught exception: {m}" for m in self.exceptions]
        out += [f"network request: {u}" for u in self.external_requests]
        return out

    def raise_for_problems(self) -> None:
        if self.problems:
            raise BrowserError(f"{self.url} did not render cleanly:\n  " + "\n  ".join(self.problems))


def find_chromium() -> str:
    """Path of a Chromium binary, or a BrowserError saying how to install one."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise BrowserError("no Chromium found on PATH: run `make browser` (installs Debian's chromium package)")


def check_page(page: pathlib.Path, screenshot: pathlib.Path | None = None, timeout: float = 90.0) -> PageCheck:
    """Open `page` (a local HTML file) in headless Chromium and report what rendered.

    screenshot: where to write a full-page PNG (None: no screenshot).
    timeout: seconds for the whole visit, from start to screenshot.
    """
    page = pathlib.Path(page).resolve()
    if not page.is_file():
        raise BrowserError(f"page {page} does not exist")
    check = asyncio.run(asyncio.wait_for(_visit(page.as_uri(), screenshot is not None), timeout))
    if screenshot is not None and check.screenshot:
        pathlib.Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(screenshot).write_bytes(check.screenshot)
    return check


_PROBE = """(() => {
  const slots = [...document.querySelectorAll('.chart-slot')];
  let drawn = 0, marks = 0;
  for (const slot of slots) {
    const svg = slot.querySelector('svg');
    const canvas = slot.querySelector('canvas');
    const n = svg ? svg.querySelectorAll('path, rect, line, text, symbol').length : 0;
    if ((svg && n > 0) || (canvas && canvas.width > 0)) drawn += 1;
    marks += n;
  }
  return JSON.stringify({slots: slots.length, drawn, marks});
})()"""


async def _visit(url: str, want_screenshot: bool) -> PageCheck:
    import aiohttp

    with tempfile.TemporaryDirectory(prefix="strag-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            port = await _devtools_port(process)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                    targets = await response.json(content_type=None)
                page_target = next((t for t in targets if t.get("type") == "page"), None)
                if page_target is None:
                    raise BrowserError("Chromium started without a page target")
                async with http.ws_connect(page_target["webSocketDebuggerUrl"], max_msg_size=0) as socket:
                    return await _drive(_Session(socket), url, want_screenshot)
        finally:
            if process.returncode is None:
                process.terminate()
                await process.wait()


async def _devtools_port(process) -> int:
    """Read Chromium's stderr until it announces its DevTools websocket."""
    lines = []
    while True:
        line = await process.stderr.readline()
        if not line:
            raise BrowserError("Chromium exited before opening DevTools:\n" + "".join(lines[-20:]))
        text = line.decode(errors="replace")
        lines.append(text)
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", text)
        if found:
            # keep draining stderr so Chromium never blocks on a full pipe
            asyncio.get_running_loop().create_task(_drain(process.stderr))
            return int(found.group(1))


async def _drain(stream) -> None:
    while await stream.readline():
        pass


class _Session:
    """Minimal DevTools client: numbered commands, events fanned out to a list."""

    def __init__(self, socket):
        self.socket = socket
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        self.waiting: dict[int, asyncio.Future] = {}
        self.event_waiters: list[tuple[str, asyncio.Future]] = []
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self):
        async for message in self.socket:
            data = json.loads(message.data)
            if "id" in data:
                future = self.waiting.pop(data["id"], None)
                if future and not future.done():
                    future.set_result(data)
            else:
                self.events.append(data)
                for method, future in list(self.event_waiters):
                    if data.get("method") == method and not future.done():
                        future.set_result(data)

    async def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.waiting[ident] = future
        await self.socket.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        reply = await future
        if "error" in reply:
            raise BrowserError(f"DevTools {method} failed: {reply['error']}")
        return reply.get("result", {})

    def expect(self, method: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.event_waiters.append((method, future))
        return future


async def _drive(session: _Session, url: str, want_screenshot: bool) -> PageCheck:
    for domain in ("Runtime", "Log", "Page", "Network"):
        await session.call(f"{domain}.enable")
    loaded = session.expect("Page.loadEventFired")
    await session.call("Page.navigate", url=url)
    await loaded
    ready = await session.call(
        "Runtime.evaluate",
        expression="(window.stragReady ? window.stragReady.then(String, e => 'error: ' + e) : Promise.resolve('no stragReady promise'))",
        awaitPromise=True,
        returnByValue=True,
    )
    ready_value = str(ready.get("result", {}).get("value"))
    probe = await session.call("Runtime.evaluate", expression=_PROBE, returnByValue=True)
    counts = json.loads(probe["result"]["value"])
    shot = None
    if want_screenshot:
        metrics = await session.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        width, height = int(max(size["width"], 1280)), int(min(size["height"], 16000))
        await session.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        result = await session.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        shot = base64.b64decode(result["data"])
    errors, exceptions, external = _collect(session.events)
    if ready_value.startswith("error") or ready_value == "no stragReady promise":
        errors.append(f"stragReady: {ready_value}")
    return PageCheck(url, counts["slots"], counts["drawn"], counts["marks"], ready_value, errors, exceptions, external, shot)


def _collect(events: list[dict]) -> tuple[list[str], list[str], list[str]]:
    errors, exceptions, external = [], [], []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            errors.append(f"{params['entry'].get('text')} ({params['entry'].get('url', '')})")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exceptions.append(details.get("exception", {}).get("description") or details.get("text", "?"))
        elif method == "Network.requestWillBeSent":
            request_url = params.get("request", {}).get("url", "")
            if not request_url.startswith(_LOCAL_SCHEMES):
                external.append(request_url)
    return errors, exceptions, external


def main(argv: list[str] | None = None) -> int:
    """`python -m dashboards.browser PAGE.html [--screenshot OUT.png]`: check a page, print what rendered."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dashboards.browser", description=main.__doc__)
    parser.add_argument("page", type=pathlib.Path)
    parser.add_argument("--screenshot", type=pathlib.Path)
    args = parser.parse_args(argv)
    check = check_page(args.page, screenshot=args.screenshot)
    print(f"{check.url}: {check.charts_drawn}/{check.chart_slots} charts drawn, {check.marks} marks"
          + (f", screenshot {args.screenshot}" if args.screenshot else ""))
    for problem in check.problems:
        print(f"  problem: {problem}")
    return 1 if check.problems else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
