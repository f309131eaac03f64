"""Inspect the committed torch.profiler traces (stdlib only, no torch needed).

    python tools/real_traces/inspect_traces.py tests/data/real_traces/pp2dp2-1f1b          # summary
    python tools/real_traces/inspect_traces.py tests/data/real_traces/pp2dp2-1f1b --segments
    python tools/real_traces/inspect_traces.py tests/data/real_traces/pp2dp2-1f1b --examples
    python tools/real_traces/inspect_traces.py tests/data/real_traces/pp2dp2-1f1b --p2p
    python tools/real_traces/inspect_traces.py tests/data/real_traces/* --report

--segments: per rank and step, the per-microbatch compute runs on the main thread.  A run is a
maximal sequence of top-level cpu_ops (nesting computed among cpu_ops only: the gloo:* and
schedule annotations overlap compute and are ignored) of one kind: forward = aten ops, a run
that contains an aten::linear; backward = `autograd::engine::evaluate_function: ...` ops.  A
c10d::* op or a change of kind ends a run; ops inside Optimizer.* annotations are skipped.
"span" is first start to last end, "busy" the sum of the top-level op durations.

--p2p: pairs each c10d::send with the matching c10d::recv_ on the peer (k-th send from a to b
<-> k-th recv on b from a; peers are group ranks of the `mesh_pp` group of distributedInfo)
and checks causality across ranks (recv's gloo:recv must end after the send was issued).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys


def load(run_dir: str, rank: int) -> dict:
    path = os.path.join(run_dir, f"rank-{rank}.json.gz")
    if not os.path.exists(path):
        path = os.path.join(run_dir, f"rank-{rank}.json")
        with open(path) as f:
            return json.load(f)
    with gzip.open(path, "rt") as f:
        return json.load(f)


def ranks_in(run_dir: str) -> list[int]:
    out = []
    for name in os.listdir(run_dir):
        if name.startswith("rank-") and name.split(".")[0][5:].isdigit():
            out.append(int(name.split(".")[0][5:]))
    return sorted(out)


def xs(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def main_tid(trace: dict):
    steps = [e for e in xs(trace) if e["name"].startswith("ProfilerStep#")]
    return steps[0]["tid"]


def thread_names(trace: dict) -> dict:
    names = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            if e["args"]["name"] not in names[e["tid"]]:
                names[e["tid"]].append(e["args"]["name"])
    return dict(names)


def summary(run_dir: str) -> None:
    for r in ranks_in(run_dir):
        t = load(run_dir, r)
        path = [p for p in (f"rank-{r}.json.gz", f"rank-{r}.json") if os.path.exists(os.path.join(run_dir, p))][0]
        size = os.path.getsize(os.path.join(run_dir, path))
        ev = t["traceEvents"]
        x = xs(t)
        steps = sorted((e for e in x if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
        last = steps[-1]
        after = [e for e in x if e["ts"] > last["ts"] + last["dur"] and e.get("cat") != "Trace"]
        opt_in_last = any(e["name"].startswith("Optimizer.step#") and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]
                          for e in x)
        print(f"rank {r}: {path} {size} bytes, {len(ev)} events, keys {[k for k in t if k != 'traceEvents']}")
        print(f"  distributedInfo: {json.dumps(t.get('distributedInfo'))}")
        print(f"  baseTimeNanoseconds {t.get('baseTimeNanoseconds')}, displayTimeUnit {t.get('displayTimeUnit')}, "
              f"deviceProperties {t.get('deviceProperties')}")
        print(f"  (ph, cat): {dict(collections.Counter((e.get('ph'), e.get('cat')) for e in ev))}")
        print(f"  threads: {thread_names(t)}  main tid {main_tid(t)}")
        print(f"  steps: {[(s['name'], round(s['dur'] / 1e3, 1)) for s in steps]} (ms); "
              f"last step has Optimizer.step: {opt_in_last}; X events after last step end: {len(after)}")
        names = collections.Counter(e["name"] for e in x if e.get("cat") == "user_annotation"
                                    and not e["name"].startswith("ProfilerStep#"))
        print(f"  user_annotation names: {dict(sorted(names.items()))}")
        comm = collections.Counter((e["name"], e["tid"]) for e in x if e["name"].startswith(("c10d::", "gloo:", "record_param_comms", "nccl")))
        print(f"  comm events (name, tid): {dict(comm)}")


def top_level_ops(trace: dict, tid) -> list[dict]:
    """Top-level cpu_ops of a thread, nesting computed among cpu_ops only."""
    ops = sorted((e for e in xs(trace) if e["tid"] == tid and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))
    out, end = [], -1.0
    for e in ops:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def segments(trace: dict) -> dict:
    """{step name: [(kind, start_us, span_us, busy_us, n_linear)]} for the main thread."""
    tid = main_tid(trace)
    x = xs(trace)
    steps = sorted((e for e in x if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    opt = [(e["ts"], e["ts"] + e["dur"]) for e in x if e["tid"] == tid and e["name"].startswith("Optimizer.")]
    linear_parents = {}
    all_ops = [e for e in x if e["tid"] == tid and e.get("cat") == "cpu_op"]
    top = top_level_ops(trace, tid)
    # count aten::linear / aten::addmm inside each top-level op
    top_sorted = sorted(top, key=lambda e: e["ts"])
    starts = [e["ts"] for e in top_sorted]
    import bisect
    for e in all_ops:
        if e["name"] == "aten::linear":
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i >= 0 and e["ts"] <= top_sorted[i]["ts"] + top_sorted[i]["dur"]:
                linear_parents[id(top_sorted[i])] = linear_parents.get(id(top_sorted[i]), 0) + 1
    res = {}
    for s in steps:
        s0, s1 = s["ts"], s["ts"] + s["dur"]
        runs, cur = [], None
        for e in top_sorted:
            if not (s0 <= e["ts"] < s1):
                continue
            if any(a <= e["ts"] < b for a, b in opt):
                continue
            n = e["name"]
            kind = "C" if n.startswith("c10d::") else "B" if n.startswith("autograd::engine::evaluate_function") else "F"
            if kind == "C":
                cur = None
                continue
            if cur is None or cur["kind"] != kind:
                cur = {"kind": kind, "start": e["ts"], "end": e["ts"] + e["dur"], "busy": 0.0, "lin": 0}
                runs.append(cur)
            cur["end"] = max(cur["end"], e["ts"] + e["dur"])
            cur["busy"] += e["dur"]
            cur["lin"] += linear_parents.get(id(e), 0)
        res[s["name"]] = [(r["kind"], r["start"] - s0, r["end"] - r["start"], r["busy"], r["lin"])
                          for r in runs if r["kind"] == "B" or r["lin"] > 0]
    return res


def print_segments(run_dir: str) -> None:
    per_rank = {}
    for r in ranks_in(run_dir):
        t = load(run_dir, r)
        segs = segments(t)
        per_rank[r] = segs
        print(f"rank {r}:")
        for step, runs in segs.items():
            desc = " ".join(f"{k}{span / 1e3:.1f}" for k, _, span, _, _ in runs)
            print(f"  {step}: {desc}")
    print("median span / busy per rank (ms), over all profiled steps:")
    for r, segs in per_rank.items():
        out = []
        for kind in "FB":
            spans = [span / 1e3 for runs in segs.values() for k, _, span, _, _ in runs if k == kind]
            busy = [b / 1e3 for runs in segs.values() for k, _, _, b, _ in runs if k == kind]
            if spans:
                out.append(f"{kind}: n={len(spans)} span {statistics.median(spans):.1f} busy {statistics.median(busy):.1f}")
        print(f"  rank {r}: " + "; ".join(out))


def examples(run_dir: str, rank: int = 0) -> None:
    t = load(run_dir, rank)
    seen = set()
    for e in t["traceEvents"]:
        n = e.get("name", "")
        key = None
        if e.get("ph") != "X":
            key = (e.get("ph"), e.get("cat"), n if e.get("ph") in ("M", "i") else "")
        elif n.startswith(("ProfilerStep#", "c10d::", "gloo:", "Optimizer.", "PP:", "Forward ", "Backward ",
                           "DistributedDataParallel", "autograd::engine::evaluate_function: AddmmBackward0",
                           "aten::linear", "aten::addmm", "aten::mm", "record_param_comms")):
            key = ("X", e.get("cat"), n.split("#")[0] if n.startswith(("ProfilerStep", "Optimizer")) else
                   ("PP:" if n.startswith("PP:") else "Forward" if n.startswith("Forward") else
                    "Backward" if n.startswith("Backward ") else n))
        elif e.get("cat") == "Trace":
            key = ("X", "Trace", "")
        if key is not None and key not in seen:
            seen.add(key)
            print(json.dumps(e))


def p2p(run_dir: str) -> None:
    traces = {r: load(run_dir, r) for r in ranks_in(run_dir)}
    sends, recvs = collections.defaultdict(list), collections.defaultdict(list)
    for r, t in traces.items():
        pg = [g for g in t["distributedInfo"]["pg_config"] if g["pg_desc"] == "mesh_pp"]
        if not pg:
            print("no mesh_pp group: no p2p")
            return
        ranks = pg[0]["ranks"]
        x = sorted(xs(t), key=lambda e: e["ts"])
        # the gloo:* annotation that follows a c10d op has External id + 1 on the same thread
        by_ext = {(e["tid"], e["args"].get("External id")): e for e in x if e["name"].startswith("gloo:")}
        for e in x:
            if e["name"] in ("c10d::send", "c10d::recv_"):
                peer = ranks[int(e["args"]["Concrete Inputs"][2])]
                g = by_ext.get((e["tid"], e["args"]["External id"] + 1))
                item = (e, g)
                (sends[(r, peer)] if e["name"] == "c10d::send" else recvs[(peer, r)]).append(item)
    worst = None
    n = 0
    for ch in sorted(set(sends) | set(recvs)):
        s, rv = sends.get(ch, []), recvs.get(ch, [])
        print(f"channel {ch[0]}->{ch[1]}: {len(s)} c10d::send, {len(rv)} c10d::recv_")
        for (se, sg), (re_, rg) in zip(s, rv):
            n += 1
            assert se["args"]["Input Dims"] == re_["args"]["Input Dims"]
            slack = (rg["ts"] + rg["dur"]) - se["ts"]  # recv must end after the send was issued
            worst = slack if worst is None else min(worst, slack)
    print(f"{n} pairs; min over pairs of (gloo:recv end - c10d::send start) = {worst / 1e3:.3f} ms "
          f"({'causal: ranks share the clock' if worst >= 0 else 'NEGATIVE: clocks differ'})")


def report(run_dirs: list[str]) -> None:
    """One markdown table row per run and rank (used for FINDINGS.md)."""
    print("| run | rank | coords | events | .json.gz bytes | steps (ProfilerStep#N: ms) | fwd runs: n, median span ms | "
          "bwd runs: n, median span ms |")
    print("|---|---|---|---|---|---|---|---|")
    for d in run_dirs:
        prov = {}
        if os.path.exists(os.path.join(d, "PROVENANCE.json")):
            with open(os.path.join(d, "PROVENANCE.json")) as f:
                prov = json.load(f)
        for r in ranks_in(d):
            t = load(d, r)
            path = os.path.join(d, f"rank-{r}.json.gz")
            size = os.path.getsize(path) if os.path.exists(path) else -1
            steps = sorted((e for e in xs(t) if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
            segs = segments(t)
            cells = []
            for kind in "FB":
                spans = [span / 1e3 for runs in segs.values() for k, _, span, _, _ in runs if k == kind]
                cells.append(f"{len(spans)}, {statistics.median(spans):.1f}" if spans else "-")
            c = prov.get("rank_coords", {}).get(str(r), {})
            coords = ", ".join(f"{k}={v}" for k, v in c.items() if v is not None)
            slow = " **slow**" if prov.get("slow_rank") == r else ""
            st = " ".join(f"#{s['name'].split('#')[1]}:{s['dur'] / 1e3:.0f}" for s in steps)
            print(f"| {os.path.basename(d.rstrip('/'))} | {r}{slow} | {coords} | {len(t['traceEvents'])} | {size} | {st} | "
                  f"{cells[0]} | {cells[1]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="+")
    ap.add_argument("--segments", action="store_true")
    ap.add_argument("--examples", action="store_true")
    ap.add_argument("--rank", type=int, default=0, help="rank for --examples")
    ap.add_argument("--p2p", action="store_true")
    ap.add_argument("--report", action="store_true", help="markdown table over all given run dirs")
    a = ap.parse_args()
    if a.report:
        report(a.run_dir)
        return
    a.run_dir = a.run_dir[0]
    if a.segments:
        print_segments(a.run_dir)
    elif a.examples:
        examples(a.run_dir, a.rank)
    elif a.p2p:
        p2p(a.run_dir)
    else:
        summary(a.run_dir)


if __name__ == "__main__":
    sys.exit(main())
