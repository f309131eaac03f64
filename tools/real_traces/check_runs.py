"""Sanity check of generated runs (stdlib only): per rank, the mean profiled step split into
compute (top-level non-comm cpu_ops on the main thread), comm (top-level c10d::* / gloo:* events on
the main thread: p2p waits, all-reduce issue / wait) and untraced (step time covered by no cpu_op;
user annotations and python_function events do not count as covering).

    python3 tools/real_traces/check_runs.py /work/corpus/*          # one block per run
    python3 tools/real_traces/check_runs.py --brief /work/corpus/*  # one line per run

Reads truth.json for the trace file names and marks the ground-truth slow ranks with '*'.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys


def load(path: str) -> dict:
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def is_comm(name: str) -> bool:
    return name.startswith(("gloo:", "c10d::", "nccl:", "record_param_comms")) or "wait" in name.lower()


def breakdown(trace: dict) -> dict:
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in ev if e["name"].startswith("ProfilerStep#")]
    if not steps:
        return {"steps": 0}
    tid = steps[0]["tid"]
    main = [e for e in ev if e["tid"] == tid and e.get("cat") in ("cpu_op", "user_annotation")
            and not e["name"].startswith("ProfilerStep#")]
    main.sort(key=lambda e: (e["ts"], -e["dur"]))
    out = {"steps": len(steps), "step": 0.0, "compute": 0.0, "comm": 0.0, "untraced": 0.0, "dataloader": 0.0}
    for s in steps:
        s0, s1 = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in main if s0 <= e["ts"] < s1]
        # top-level among cpu_ops (annotations like "Forward 3" / "PP:..." wrap waits and compute: skip
        # them for the split, but count their time as covered)
        end = -1.0
        comp = comm = 0.0
        for e in inside:
            if e.get("cat") != "cpu_op":
                continue
            if e["ts"] >= end:
                if is_comm(e["name"]):
                    comm += e["dur"]
                else:
                    comp += e["dur"]
                end = e["ts"] + e["dur"]
        # union of the cpu_ops -> untraced (time in no op; annotations such as "Forward 3" or
        # "PP:1F1" are not counted as covering: they wrap waits, sleeps and Python work)
        cov, cur0, cur1 = 0.0, None, None
        for e in inside:
            if e.get("cat") != "cpu_op":
                continue
            a, b = e["ts"], min(e["ts"] + e["dur"], s1)
            if cur1 is None or a > cur1:
                if cur1 is not None:
                    cov += cur1 - cur0
                cur0, cur1 = a, b
            else:
                cur1 = max(cur1, b)
        if cur1 is not None:
            cov += cur1 - cur0
        dl = sum(e["dur"] for e in inside if "DataLoader" in e["name"])
        out["step"] += s["dur"]
        out["compute"] += comp
        out["comm"] += comm
        out["untraced"] += s["dur"] - cov
        out["dataloader"] += dl
    n = len(steps)
    for k in ("step", "compute", "comm", "untraced", "dataloader"):
        out[k] = round(out[k] / n / 1000.0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--brief", action="store_true")
    a = ap.parse_args()
    for run in a.runs:
        tp = os.path.join(run, "truth.json")
        if not os.path.exists(tp):
            continue
        truth = json.load(open(tp))
        slow = set(truth["expected"]["slow_ranks"])
        rows = []
        for r, f in enumerate(truth["trace_files"]):
            try:
                rows.append((r, breakdown(load(os.path.join(run, f)))))
            except Exception as exc:  # noqa: BLE001
                rows.append((r, {"error": str(exc)}))
        sd = " ".join(f"{s['kind']}:{s['rank']}:{s['amount']}" for s in truth["slowdowns"]) or "clean"
        if a.brief:
            cells = " | ".join(f"{'*' if r in slow else ' '}r{r} c{b.get('compute')} m{b.get('comm')} "
                               f"u{b.get('untraced')}" for r, b in rows)
            print(f"{truth['run']:<44} {sd:<28} step {rows[0][1].get('step')} | {cells}")
            continue
        print(f"== {truth['run']}  [{sd}]  {truth['schedule']} {truth['layout']} {truth['grad_sync']} "
              f"{truth['model']} {truth['noise']} mb{truth['microbatches']}")
        for r, b in rows:
            print(f"  {'*' if r in slow else ' '}rank {r} {b}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
