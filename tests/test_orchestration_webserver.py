"""The `[orchestration]` extra installs what `dagster dev` needs, and the webserver serves our code
location: its assets, daily partitions and nightly schedule, read back over the webserver's GraphQL
API (what the UI shows). The full user journey (the UI in Chromium, a 2-day backfill run by the
daemon, its tables compared with `strag batch`) is tools/dagster_ui_check.py, run by hand: minutes."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import metadata

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus locationOrLoadError {
  __typename ... on PythonError { message }
  ... on RepositoryLocation { repositories { name
    schedules { name cronSchedule executionTimezone pipelineName }
    assetNodes { assetKey { path } partitionDefinition { type description } partitionKeysByDimension { partitionKeys } } } } } } } } }"""


def test_the_extra_installs_the_webserver_and_daemon_of_the_same_release():
    assert metadata.version("dagster-webserver") == metadata.version("dagster")
    assert metadata.version("dagster-graphql") == metadata.version("dagster")
    for command in ("dagster", "dagster-webserver", "dagster-daemon"):
        assert (BIN / command).is_file(), f"{command} is not installed next to {sys.executable}"
    shown = subprocess.run([str(BIN / "dagster-daemon"), "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "run" in shown.stdout


def _graphql(base: str, query: str) -> dict:
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        body = json.loads(reply.read())
    assert not body.get("errors"), body["errors"]
    return body["data"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def webserver(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    port = _free_port()
    env = dict(os.environ, DAGSTER_HOME=str(home), STRAG_LAKE=str(tmp_path / "lake"), STRAG_OUT=str(tmp_path / "out"),
               STRAG_PARTITIONS_START="2024-01-01", PYTHONPATH=str(ROOT))
    log = (tmp_path / "webserver.log").open("w")
    process = subprocess.Popen([str(BIN / "dagster-webserver"), "-m", "orchestration.definitions", "-h", "127.0.0.1",
                                "-p", str(port)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:   # poll until the code location has loaded (bounded; the webserver's start, not a timing)
            assert process.poll() is None, (tmp_path / "webserver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the webserver did not load the code location in 120 s"
            try:
                entries = _graphql(base, QUERY)["workspaceOrError"]["locationEntries"]
                if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                    yield base, entries
                    break
            except OSError:
                pass
            time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def test_webserver_serves_the_assets_partitions_and_schedule(webserver):
    base, entries = webserver
    [entry] = entries
    location = entry["locationOrLoadError"]
    assert entry["name"] == "orchestration.definitions" and location["__typename"] == "RepositoryLocation", location
    [repository] = location["repositories"]
    assets = {tuple(n["assetKey"]["path"]): n for n in repository["assetNodes"]}
    assert {path[-1] for path in assets} == {"coverage", "dp_attribution", "job_summary", "optype_attribution", "quarantine",
                                             "stage_attribution", "step_slowdown", "worker_attribution", "fleet_report"}
    for node in assets.values():
        assert node["partitionDefinition"]["type"] == "TIME_WINDOW"
        assert node["partitionDefinition"]["description"] == "Daily, starting 2024-01-01 UTC."
        keys = node["partitionKeysByDimension"][0]["partitionKeys"]
        assert keys[:3] == ["2024-01-01", "2024-01-02", "2024-01-03"]
    [schedule] = repository["schedules"]
    assert schedule == {"name": "strag_nightly", "cronSchedule": "0 2 * * *", "executionTimezone": "UTC",
                        "pipelineName": "strag_daily"}
    with urllib.request.urlopen(f"{base}/assets", timeout=30) as reply:   # the UI's page itself
        assert reply.status == 200 and b"<div id=\"root\">" in reply.read()
