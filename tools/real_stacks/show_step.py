"""Print the span tree of one profiled step of a trace (stdlib only): where forward, backward,
optimizer, data loading, collectives and the ProfilerStep boundaries sit.

    python3 tools/real_stacks/show_step.py RUN_DIR [--rank 0] [--step 1] [--depth 4] [--min-ms 0.5]
    python3 tools/real_stacks/show_step.py RUN_DIR --names        # annotation / c10d / gloo names + counts

Main thread only (the thread of the ProfilerStep spans; with no ProfilerStep, the thread with the
most cpu_ops).  Events are nested by time containment.  Runs of consecutive siblings with the same
name are folded into one line "name x N".  aten ops below --depth are not shown; spans shorter than
--min-ms are folded into their parent's "(+N short)" count.  The `--step` index is among the
ProfilerStep#k spans of the trace (0 = first); -1 shows the whole trace as one window.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import signal


def load(run: str, rank: int) -> dict:
    for name in (f"rank-{rank}.json.gz", f"rank-{rank}.json"):
        p = os.path.join(run, name)
        if os.path.exists(p):
            opener = gzip.open if p.endswith(".gz") else open
            with opener(p, "rt") as f:
                return json.load(f)
    raise SystemExit(f"no rank-{rank} trace in {run}")


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--min-ms", type=float, default=0.3)
    ap.add_argument("--names", action="store_true")
    ap.add_argument("--all-threads", action="store_true")
    a = ap.parse_args()
    t = load(a.run, a.rank)
    xs = [e for e in t["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in xs if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if steps:
        tid = steps[0]["tid"]
    else:
        tid = collections.Counter(e["tid"] for e in xs if e.get("cat") == "cpu_op").most_common(1)[0][0]
    if a.names:
        c = collections.Counter()
        for e in xs:
            if e.get("cat") in ("user_annotation", "gpu_user_annotation") or e["name"].startswith(("c10d::", "gloo:", "nccl:", "record_param_comms", "PP:", "FSDP")):
                c[(e["name"], e.get("cat"), "main" if e["tid"] == tid else "other")] += 1
        for (n, cat, th), k in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"{k:6d}  {cat:16s} {th:5s}  {n}")
        print("steps:", [(s["name"], round(s["dur"] / 1e3, 1)) for s in steps])
        return
    if a.step >= 0 and steps:
        w = steps[a.step]
        t0, t1 = w["ts"], w["ts"] + w["dur"]
    else:
        t0 = min(e["ts"] for e in xs)
        t1 = max(e["ts"] + e["dur"] for e in xs)
    ev = [e for e in xs if (a.all_threads or e["tid"] == tid) and e["ts"] >= t0 - 1 and e["ts"] + e["dur"] <= t1 + 1
          and e.get("cat") != "Trace"]
    ev.sort(key=lambda e: (e["ts"], -e["dur"]))
    # build tree
    root = {"name": "<window>", "ts": t0, "dur": t1 - t0, "children": []}
    stack = [root]
    for e in ev:
        node = {"name": e["name"], "ts": e["ts"], "dur": e["dur"], "cat": e.get("cat"), "children": []}
        while len(stack) > 1 and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        stack[-1]["children"].append(node)
        stack.append(node)

    def show(node, depth):
        kids = node["children"]
        short = [k for k in kids if k["dur"] / 1e3 < a.min_ms]
        long = [k for k in kids if k["dur"] / 1e3 >= a.min_ms]
        i = 0
        while i < len(long):
            j = i
            while j + 1 < len(long) and long[j + 1]["name"] == long[i]["name"]:
                j += 1
            k = long[i]
            n = j - i + 1
            tot = sum(x["dur"] for x in long[i:j + 1]) / 1e3
            rel = (k["ts"] - t0) / 1e3
            label = f"{k['name']}" + (f" x{n}" if n > 1 else "")
            print(f"{'  ' * depth}{label}  [{k.get('cat')}] @{rel:.1f} ms, {tot:.2f} ms")
            if depth < a.depth and n == 1:
                show(k, depth + 1)
            elif depth < a.depth and n > 1 and k["children"]:
                show(k, depth + 1)
            i = j + 1
        if short:
            print(f"{'  ' * depth}(+{len(short)} short, {sum(x['dur'] for x in short) / 1e3:.2f} ms)")

    print(f"rank {a.rank} tid {tid} window {(t1 - t0) / 1e3:.1f} ms; steps {[s['name'] for s in steps]}")
    show(root, 0)


if __name__ == "__main__":
    main()
