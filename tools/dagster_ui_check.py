"""Try the Dagster deployment as a user does, end to end (run by hand: several minutes, not in `make test`).

    .venv/bin/python tools/dagster_ui_check.py [--work DIR] [--screenshots docs] [--port 3777]

1. writes a 2-day synthetic lake (2024-01-01, 2024-01-02; 2 jobs a day);
2. starts `dagster dev -m orchestration.definitions -h 127.0.0.1` (webserver + daemon) with
   STRAG_LAKE / STRAG_OUT set, in a fresh DAGSTER_HOME with telemetry off;
3. opens the UI in headless Chromium (Debian's, over DevTools: dashboards/browser.py) and waits for
   what a user looks for: the asset catalog lists the `strag` assets, an asset's partitions view shows
   the daily partitions, the schedules list shows `strag_nightly` at 02:00 UTC; a screenshot of each;
4. launches a backfill of the `strag` assets over the 2 days from the UI's own page (the GraphQL
   mutation the UI's "Materialize" dialog sends, posted by the page to its server), waits for the
   daemon to run it, and shoots the backfill's page;
5. runs `strag batch` over the same 2 days into another folder and compares every published file
   (tables and fleet tables, byte for byte) with what the backfill published.

Exits 0 when every check holds, 1 with the reason otherwise. Every wait is bounded and polls an
event or a status (no fixed sleeps decide anything).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dashboards.browser import CHROMIUM_FLAGS, BrowserError, _devtools_port, _Session, find_chromium  # noqa: E402

DAYS = ("2024-01-01", "2024-01-02")
LOCATION = "orchestration.definitions"
ASSET_KEYS = ("coverage", "dp_attribution", "job_summary", "optype_attribution", "quarantine", "stage_attribution",
              "step_slowdown", "worker_attribution", "fleet_report")


class CheckFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(base: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        body = json.loads(reply.read())
    if body.get("errors"):
        raise CheckFailed(f"GraphQL error: {body['errors']}")
    return body["data"]


def wait_for_server(base: str, process: subprocess.Popen, log: pathlib.Path, limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CheckFailed(f"`dagster dev` exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/server_info", timeout=5) as reply:
                if reply.status == 200:
                    data = graphql(base, "{ workspaceOrError { ... on Workspace { locationEntries { name "
                                         "loadStatus locationOrLoadError { __typename } } } } }")
                    entries = data["workspaceOrError"]["locationEntries"]
                    if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                        kinds = {e["name"]: e["locationOrLoadError"]["__typename"] for e in entries}
                        if kinds.get(LOCATION) != "RepositoryLocation":
                            raise CheckFailed(f"code location did not load: {kinds}")
                        return
        except OSError:
            pass
        time.sleep(1.0)   # polling interval of the readiness probe, not a wait that decides anything
    raise CheckFailed(f"the webserver did not answer within {limit:.0f} s:\n{log.read_text()[-3000:]}")


_WAIT_TEXT = """(async (needles, limit) => {
  const start = Date.now();
  for (;;) {
    const text = document.body ? document.body.innerText : '';
    const missing = needles.filter(n => !new RegExp(n).test(text));
    if (missing.length === 0) return JSON.stringify({ok: true});
    if (Date.now() - start > limit) return JSON.stringify({ok: false, missing, text: text.slice(0, 3000)});
    await new Promise(r => setTimeout(r, 250));
  }
})"""


class Browser:
    """One headless Chromium page driven over DevTools."""

    def __init__(self, session: _Session):
        self.session = session

    async def open(self, url: str, needles: list[str], screenshot: pathlib.Path | None, limit_ms: int = 60000) -> str:
        loaded = self.session.expect("Page.loadEventFired")
        await self.session.call("Page.navigate", url=url)
        await loaded
        return await self.wait_text(needles, screenshot, limit_ms, url)

    async def wait_text(self, needles: list[str], screenshot: pathlib.Path | None, limit_ms: int, what: str) -> str:
        reply = await self.session.call("Runtime.evaluate", expression=f"{_WAIT_TEXT}({json.dumps(needles)}, {limit_ms})",
                                        awaitPromise=True, returnByValue=True)
        result = json.loads(reply["result"]["value"])
        if not result["ok"]:
            raise CheckFailed(f"{what}: the page never showed {result['missing']}; it shows:\n{result['text']}")
        if screenshot is not None:
            await self.session.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
            shot = await self.session.call("Page.captureScreenshot", format="png")
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            print(f"  screenshot {screenshot}")
        text = await self.session.call("Runtime.evaluate", expression="document.body.innerText", returnByValue=True)
        return text["result"]["value"]

    async def post_graphql(self, query: str, variables: dict) -> dict:
        """POST a GraphQL request from the page (same origin as the UI's own requests)."""
        expression = ("fetch('/graphql', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: "
                      + json.dumps(json.dumps({"query": query, "variables": variables}))
                      + "}).then(r => r.text())")
        reply = await self.session.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        body = json.loads(reply["result"]["value"])
        if body.get("errors"):
            raise CheckFailed(f"GraphQL error from the page: {body['errors']}")
        return body["data"]


async def with_browser(fn):
    import aiohttp

    with tempfile.TemporaryDirectory(prefix="strag-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            port = await _devtools_port(process)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                    targets = await response.json(content_type=None)
                target = next(t for t in targets if t.get("type") == "page")
                async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as socket_:
                    session = _Session(socket_)
                    for domain in ("Runtime", "Page"):
                        await session.call(f"{domain}.enable")
                    return await fn(Browser(session))
        finally:
            if process.returncode is None:
                process.terminate()
                await process.wait()


LAUNCH_BACKFILL = """mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
  }
}"""

BACKFILL_STATUS = """query Status($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status numCancelable runs(limit: 50) { runId status tags { key value } } }
    ... on PythonError { message }
  }
}"""


def published(out: pathlib.Path) -> dict[str, bytes]:
    """Every published table file (staging, run records and reports excluded) -> bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
            if not p.relative_to(out).parts[0].startswith("_")}


def wait_backfill(base: str, backfill_id: str, limit: float = 900.0) -> dict:
    deadline = time.monotonic() + limit
    last = None
    while time.monotonic() < deadline:
        data = graphql(base, BACKFILL_STATUS, {"id": backfill_id})["partitionBackfillOrError"]
        if data["__typename"] != "PartitionBackfill":
            raise CheckFailed(f"backfill {backfill_id}: {data}")
        state = (data["status"], tuple(r["status"] for r in data["runs"]))
        if state != last:
            print(f"  backfill {backfill_id}: {data['status']}, runs {list(state[1])}")
            last = state
        runs_done = data["runs"] and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in data["runs"])
        if data["status"] in ("COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED") and runs_done:
            return data
        time.sleep(2.0)   # polling interval of the status probe
    raise CheckFailed(f"backfill {backfill_id} did not finish within {limit:.0f} s (last state {last})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=pathlib.Path, help="working folder (default: a new temporary one)")
    parser.add_argument("--screenshots", type=pathlib.Path, default=ROOT / "docs", help="where the UI screenshots go")
    parser.add_argument("--port", type=int, default=0, help="webserver port (default: a free one)")
    args = parser.parse_args(argv)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="strag-dagster-"))
    work.mkdir(parents=True, exist_ok=True)
    lake, out, direct, home = work / "lake", work / "tables", work / "direct", work / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    bin_dir = pathlib.Path(sys.executable).parent

    print(f"1. a 2-day lake under {lake}")
    if not (lake / "manifests").exists():
        subprocess.run([str(bin_dir / "strag"), "generate", "--lake", str(lake), "--days", "2", "--jobs-per-day", "2",
                        "--seed", "7", "--bad-fraction", "0", "--max-records", "20000", "--processes", "1"],
                       check=True, stdout=subprocess.DEVNULL)

    port = args.port or _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, DAGSTER_HOME=str(home), STRAG_LAKE=str(lake), STRAG_OUT=str(out),
               STRAG_PARTITIONS_START=DAYS[0], PYTHONPATH=str(ROOT))
    log = work / "dagster-dev.log"
    print(f"2. dagster dev -m {LOCATION} -h 127.0.0.1 -p {port} (log {log})")
    with open(log, "w") as handle:
        process = subprocess.Popen([str(bin_dir / "dagster"), "dev", "-m", LOCATION, "-h", "127.0.0.1", "-p", str(port)],
                                   cwd=work, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_server(base, process, log)
        backfill_id = asyncio.run(asyncio.wait_for(with_browser(lambda page: ui_checks(page, base, args.screenshots)), 600))
        print("4. the daemon runs the backfill")
        state = wait_backfill(base, backfill_id)
        failed = [r for r in state["runs"] if r["status"] != "SUCCESS"]
        if failed or state["status"] not in ("COMPLETED", "COMPLETED_SUCCESS"):
            raise CheckFailed(f"backfill {backfill_id} ended {state['status']} with runs {state['runs']} (log {log})")
        ranges = [{t["key"]: t["value"] for t in r["tags"]} for r in state["runs"]]
        print(f"  {len(state['runs'])} run(s): " + ", ".join(f"{t.get('dagster/asset_partition_range_start')}.."
                                                            f"{t.get('dagster/asset_partition_range_end')}" for t in ranges))
        async def after(page: Browser) -> None:
            await page.open(f"{base}/runs/b/{backfill_id}", [r"Succeeded", r"2024-01-01.*2024-01-02"],
                            args.screenshots / "dagster-backfill.png")
            await page.open(f"{base}/assets/strag/job_summary?view=partitions", [r"Materialized \(2\)"],
                            args.screenshots / "dagster-partitions.png")
            print("  backfill page: Succeeded; job_summary: 2 partitions materialized")

        asyncio.run(asyncio.wait_for(with_browser(after), 120))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    print(f"5. strag batch over {DAYS[0]}..{DAYS[-1]} into {direct}, compared with the backfill's tables")
    subprocess.run([str(bin_dir / "strag"), "batch", "--lake", str(lake), "--from", DAYS[0], "--to", DAYS[-1], "--out", str(direct),
                    "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)
    mine, theirs = published(out), published(direct)
    if not theirs:
        raise CheckFailed("strag batch published nothing")
    if mine != theirs:
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise CheckFailed(f"the backfill's tables differ from strag batch's: {differ[:10]}")
    tables = sorted({k.split("/")[0] for k in mine})
    for day in DAYS:
        for table in tables:
            if not any(k.startswith(f"{table}/date={day}/") for k in mine) and "rollup" not in table:
                raise CheckFailed(f"table {table} has no partition for {day}")
    report = pathlib.Path(str(out)) / "_reports" / "index.html"
    if not report.is_file():
        raise CheckFailed(f"the backfill wrote no fleet report at {report}")
    print(f"OK: {len(mine)} files in {len(tables)} tables byte-identical to strag batch; fleet report {report}")
    return 0


async def ui_checks(page: Browser, base: str, shots: pathlib.Path) -> str:
    print("3. the UI in headless Chromium")
    await page.open(f"{base}/assets", [re.escape(k) for k in ASSET_KEYS], shots / "dagster-assets.png")
    print("  asset catalog: the 9 strag assets")
    await page.open(f"{base}/assets/strag/job_summary?view=partitions", [r"2024-01-01", r"Missing \(\d+\)"], None)
    print("  job_summary: daily partitions from 2024-01-01, all missing")
    await page.open(f"{base}/locations/{LOCATION}/schedules/strag_nightly", ["strag_nightly", r"0 2 \* \* \*|02:00|2:00"],
                    shots / "dagster-schedule.png")
    print("  schedule strag_nightly: 0 2 * * * UTC")
    params = {"assetSelection": [{"path": ["strag", k]} for k in ASSET_KEYS], "partitionNames": list(DAYS),
              "fromFailure": False}
    launched = (await page.post_graphql(LAUNCH_BACKFILL, {"params": params}))["launchPartitionBackfill"]
    if launched["__typename"] != "LaunchBackfillSuccess":
        raise CheckFailed(f"backfill not launched: {launched}")
    print(f"  backfill {launched['backfillId']} launched over {DAYS[0]}..{DAYS[-1]}")
    return launched["backfillId"]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CheckFailed, BrowserError, subprocess.CalledProcessError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        sys.exit(1)
