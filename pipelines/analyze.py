"""`strag analyze`: what-if analysis of one job, no Beam.

    strag analyze TRACE.parquet --meta META.yaml [--job-id ID] [--json OUT.json]
                  [--timeline OUT.json.gz] [--timeline-steps N]
    strag analyze --lake URL --job-id ID [--date YYYY-MM-DD] [--json OUT.json] [--timeline ...]
    strag analyze DIR [--format kineto|ndtimeline] [--job-yaml FILE] [--job-id ID] [--json ...]

The first form reads a trace in the published format (or the lake's TRACE_SCHEMA)
plus the published meta yaml; the second reads a lake job's trace files and manifest;
the third converts raw profiler output (a folder of per-rank torch.profiler traces, or
NDTimeline records, the format told by the file names unless --format; transforms/ingest/)
and analyses it without writing anything.
Prints a short summary (S, waste, discrepancy verdict, top stages / DP ranks / op
types, M_W, M_S) and the root-cause verdict: every listed cause with its confidence, a
sentence, S after its fix and the GPU-hours it saves (when the manifest gives GPU-hours).
--json writes the reference analyzer's result-*.json fields plus M_W, M_S with their
parts (mw / ms), waste and the verdict (transforms.whatif.causes.verdict_json); --timeline
writes the original and ideal timelines as Chrome-trace JSON for Perfetto.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import pathlib
import sys
import time

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser

__all__ = ["AnalyzeOptions", "parse", "load_job", "summary", "run"]


@dataclasses.dataclass(frozen=True)
class AnalyzeOptions:
    """Validated command line of `strag analyze`."""

    trace: pathlib.Path | None
    meta: pathlib.Path | None
    lake: str | None
    job_id: str | None
    date: dt.date | None
    json_out: pathlib.Path | None
    timeline_out: pathlib.Path | None
    timeline_steps: int | None
    top: int
    fmt: str | None = None
    job_yaml: pathlib.Path | None = None
    threads: int = 1

    def __post_init__(self):
        if self.threads < 1:
            raise ValueError(f"--threads {self.threads}: need at least 1")
        if self.fmt is not None:
            if self.trace is None or self.lake is not None or self.meta is not None:
                raise ValueError(f"--format {self.fmt} reads a folder (or file) of raw traces: give DIR, without --lake or --meta")
            if not self.trace.exists():
                raise ValueError(f"no such file or folder: {self.trace}")
            if self.job_yaml is not None and not self.job_yaml.is_file():
                raise ValueError(f"no such file: {self.job_yaml}")
            return
        if self.job_yaml is not None:
            raise ValueError("--job-yaml goes with --format kineto|ndtimeline")
        if (self.trace is None) == (self.lake is None):
            raise ValueError("give TRACE.parquet --meta META.yaml, a folder of raw traces DIR [--format kineto|ndtimeline], "
                             "or --lake URL --job-id ID")
        if self.trace is not None:
            if not self.trace.exists():
                raise ValueError(f"no such file or folder: {self.trace}")
            if self.meta is None:
                raise ValueError("a trace file needs --meta META.yaml (dp_size, pp_size, ...)")
            for path in (self.trace, self.meta):
                if path.is_dir():
                    raise ValueError(f"{path} is a folder: " + ("give the meta yaml file" if path == self.meta else
                                     "a folder of raw traces (DIR [--format kineto|ndtimeline]) takes no --meta"))
                if not path.is_file():
                    raise ValueError(f"no such file: {path}")
        if self.lake is not None and not self.job_id:
            raise ValueError("--lake needs --job-id")
        if self.lake is not None:
            from schemas.lake import safe_job_id

            try:
                safe_job_id(self.job_id)   # it names the job's lake folder and manifest file
            except ValueError as error:
                raise ValueError(f"--job-id: {error}") from None
        if self.timeline_steps is not None and self.timeline_steps < 1:
            raise ValueError("--timeline-steps must be >= 1")


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def raw_format_in(path: pathlib.Path) -> str | None:
    """The raw format of a file or of a folder's files by their names ('kineto' for *.json[.gz],
    'ndtimeline' for *.jsonl[.gz]; schemas.raw.raw_format_of), None when it is not one format."""
    from schemas.raw import raw_format_of

    if path.is_dir():   # hidden names ('.', '_': a lake's _lake.json) are no traces, as in a lake's listing
        formats = {raw_format_of(entry.name) for entry in path.iterdir()
                   if entry.is_file() and not entry.name.startswith((".", "_"))} - {None}
    else:
        formats = {raw_format_of(path.name)} - {None}
    return formats.pop() if len(formats) == 1 else None


def _is_lake(path: pathlib.Path) -> bool:
    """Whether a folder holds a lake's parts (traces/, manifests/, raw/ or _lake.json)."""
    from schemas.lake import LAKE_MARKER, MANIFESTS, TRACES
    from schemas.raw import RAW

    return path.is_dir() and ((path / LAKE_MARKER).is_file() or any((path / part).is_dir() for part in (TRACES, MANIFESTS, RAW)))


_USAGE = """strag analyze TRACE.parquet --meta META.yaml [OPTIONS]
       strag analyze DIR [--format kineto|ndtimeline] [--job-yaml FILE] [OPTIONS]
       strag analyze --lake URL --job-id ID [--date YYYY-MM-DD] [OPTIONS]"""


def parse(argv: list[str]) -> AnalyzeOptions:
    """Parse and validate the command line; exits with a usage message on bad arguments.

    A trace without --meta or --format whose name (or whose folder's file names) says a raw
    format is read as that format (a folder of torch.profiler rank-*.json.gz: kineto)."""
    parser = ArgumentParser(
        prog="strag analyze", usage=_USAGE,
        description="What-if analysis of one training job (slowdown S, attribution, M_W, M_S).")
    parser.add_argument("trace", nargs="?", type=pathlib.Path,
                        help="trace parquet (published format or TRACE_SCHEMA), or a folder (or file) of raw traces: "
                             "torch.profiler *.json[.gz] per rank, NDTimeline *.jsonl[.gz] (format told by the names)")
    parser.add_argument("--format", dest="fmt", choices=("kineto", "ndtimeline"),
                        help="raw profiler output: kineto = torch.profiler JSON per rank, ndtimeline = NDTimeline JSON lines "
                             "(default: told by the file names)")
    parser.add_argument("--job-yaml", type=pathlib.Path,
                        help="with --format: job.yaml (sizes, layout, labels; default: DIR/job.yaml when present)")
    parser.add_argument("--meta", type=pathlib.Path, help="meta yaml: dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size")
    parser.add_argument("--lake", help="lake URL (folder, file://, memory://, s3://) to read the job from")
    parser.add_argument("--job-id", help="job id (required with --lake; default: the meta's trial_name or the file name)")
    parser.add_argument("--date", type=date_argument, help="date partition YYYY-MM-DD (with --lake; default: the job's only date)")
    parser.add_argument("--json", dest="json_out", type=pathlib.Path, help="write the result JSON here")
    parser.add_argument("--timeline", dest="timeline_out", type=pathlib.Path,
                        help="write original + ideal timelines as Chrome-trace JSON (.json or .json.gz) for Perfetto")
    parser.add_argument("--timeline-steps", type=int, help="only the first N steps in the timeline (large jobs)")
    parser.add_argument("--top", type=int, default=3, help="entries shown per ranking (default 3)")
    parser.add_argument("--threads", type=int, default=_usable_cpus(),
                        help="what-if scenarios replayed at once (default: the CPUs this process may use)")
    args = parser.parse_args(argv)
    if args.fmt is None and args.trace is not None and args.meta is None and args.lake is None and args.trace.exists():
        args.fmt = raw_format_in(args.trace)
        if args.fmt is None and _is_lake(args.trace):
            parser.error(f"{args.trace} is a lake: give --lake {args.trace} --job-id ID [--date YYYY-MM-DD]")
        if args.fmt is None and args.trace.is_dir():
            below = sorted(entry.name + "/" for entry in args.trace.iterdir()
                           if entry.is_dir() and not entry.name.startswith((".", "_")) and raw_format_in(entry))
            hint = (f"; its subfolders {', '.join(below[:4])}{' ...' if len(below) > 4 else ''} hold traces: "
                    "strag analyze reads one folder: the files of one profiled window, every rank's") if below else \
                ": give --format kineto|ndtimeline, or a TRACE.parquet with --meta"
            parser.error(f"{args.trace} is a folder without *.json[.gz] (torch.profiler) or *.jsonl[.gz] (NDTimeline) "
                         f"traces of one format{hint}")
    try:
        return AnalyzeOptions(trace=args.trace, meta=args.meta, lake=args.lake, job_id=args.job_id, date=args.date,
                              json_out=args.json_out, timeline_out=args.timeline_out,
                              timeline_steps=args.timeline_steps, top=args.top, fmt=args.fmt, job_yaml=args.job_yaml,
                              threads=args.threads)
    except ValueError as error:
        parser.error(str(error))


def _read_meta(path: pathlib.Path) -> dict:
    """The fields of a meta yaml (transforms/io/meta_yaml.py); ValueError naming the file when it is not a YAML mapping."""
    from transforms.io.meta_yaml import MetaYamlError, read_meta_yaml

    try:
        return read_meta_yaml(path.read_bytes())
    except MetaYamlError as error:
        raise ValueError(f"--meta {path}: {error}; give the job's meta yaml (dp_size: N, pp_size: N, ...)") from None


def load_job(opts: AnalyzeOptions):
    """(trace table, JobMeta, job id, source description, ConvertedJob or None, GPU-hours or None, recorded)
    for the options' job; GPU-hours (GPUs x manifest end - start, as the batch counts them) need a lake
    manifest; recorded: the source record of raw traces (converted or imported; {} else), whose device
    ('cpu' or the GPU's name) and grads_collective the lines for people read."""
    import pyarrow.parquet as pq

    from transforms.whatif.result import JobMeta

    if opts.fmt is not None:
        from pipelines.ingest import _options, raw_files
        from transforms.ingest import convert_window, describe_source

        job_id = opts.job_id or opts.trace.resolve().name.removesuffix(".gz").removesuffix(".json")
        converted = convert_window(opts.fmt, raw_files([str(opts.trace)], opts.fmt), job_id,
                                   dt.datetime.now(dt.timezone.utc).date().isoformat(),
                                   job_yaml=_options(str(opts.job_yaml) if opts.job_yaml else None))
        return (converted.trace, converted.job_meta(), job_id,
                f"{opts.trace} ({describe_source(converted.source)})", converted, None, converted.source)
    if opts.trace is not None:
        fields = _read_meta(opts.meta)
        missing = [name for name in ("dp_size", "pp_size") if name not in fields]
        if missing:
            raise ValueError(f"{opts.meta}: meta yaml lacks {missing}")
        meta = JobMeta.from_mapping(fields)
        job_id = opts.job_id or str(fields.get("trial_name") or opts.trace.stem)
        # ParquetFile, not pq.read_table: the latter imports pyarrow.dataset and pandas (~0.5 s)
        return pq.ParquetFile(opts.trace, memory_map=True).read(), meta, job_id, str(opts.trace), None, None, {}
    from schemas.raw import SOURCE_KEY
    from transforms.io.lake import find_job, read_manifest_table, read_trace_files

    job = find_job(opts.lake, opts.job_id, opts.date)
    if job.manifest_path is None:
        raise ValueError(f"lake job {opts.job_id!r} on {job.date} has no manifest: its parallelism is unknown")
    manifest_table = read_manifest_table(job.manifest_path)
    manifest = manifest_table.to_pylist()[0]
    stored = (manifest_table.schema.metadata or {}).get(SOURCE_KEY.encode())   # an imported raw job's source
    if stored:
        manifest["source"] = json.loads(stored)
    meta = JobMeta.from_mapping(manifest)
    hours = int(manifest["gpus"]) * (manifest["end_time"] - manifest["start_time"]).total_seconds() / 3600.0
    return (read_trace_files(job.trace_files), meta, job.job_id, f"{opts.lake} (date {job.date}, {len(job.trace_files)} files)",
            None, hours, manifest.get("source") or {})


def _lake_errors(opts: AnalyzeOptions) -> tuple[type[Exception], ...]:
    """LakeError when the job comes from a lake or raw files; a published trace file never
    raises it, and importing it costs fsspec on the one-job path."""
    if opts.lake is None and opts.fmt is None:
        return ()
    from transforms.io.lake import LakeError

    return (LakeError,)


def summary(result, n_ops: int, seconds: float, top: int = 3, device: str | None = None,
            grads_collective: str | None = None, timings: dict | None = None) -> str:
    """A few lines for a person: S, waste, verdicts, rankings, M_W, M_S. device: 'cpu' when the
    ranks ran on CPUs (torch.profiler traces say so), else they are called GPUs; grads_collective:
    "all_reduce" names DDP's gradient all-reduce so (schemas.trace.optype_words).

    M_W and M_S are shares of the straggling time (T - T_ideal): shown only for a straggling job
    (S >= 1.1), where that time is big enough to share out."""
    from schemas.trace import optype_words
    from transforms.whatif.result import ATTRIBUTION_THRESHOLD, DISCREPANCY_LIMIT

    meta = result.meta
    slowdown = result.model_slowdown
    waste = (f"waste {100 * result.waste:.1f}% of {_unit(device)} time" if slowdown >= 1.0 else
             f"no {_unit(device)} time lost (S < 1: the ideal replay is slower than the replay, within its noise)")
    untraced = result.untraced
    named = "" if untraced is None else ", ".join(f"dp {d} / stage {p}" for d, p in untraced.workers)
    lines = [
        f"job {result.job_id}: {len(result.steps)} step{'s' if len(result.steps) != 1 else ''}, dp {meta.dp_size} x pp {meta.pp_size} workers "
        f"(tp {meta.tp_size}, cp {meta.dsp_size}, vpp {meta.vpp_size}; {meta.world_size} {_unit(device)}s), {n_ops:,} ops, "
        f"analysed in {seconds:.2f} s" + ("" if not timings or "compile" not in timings else
                                          f" (compile {timings['compile']:.2f}, replay {timings['replay']:.2f}, "
                                          f"causes {timings['causes']:.2f})"),
        *([] if result.evidence is None else
          [f"evidence: {result.evidence.describe()}"] + [f"  cannot show: {limit}" for limit in result.evidence.limits]),
        f"S = {slowdown:.4f}: {waste}; "
        + ("straggling (S >= 1.1)" if result.straggling else "not straggling (S < 1.1)")
        + ("" if untraced is None else f" (with the untraced CPU time of {named}; over the traced ops alone S = "
                                       f"{result.slowdown:.4f})"),
        f"step time {result.model_step_t.mean():.3f} s replayed, {result.step_t_noblk.mean():.3f} s ideal; "
        f"per-step S {result.model_step_slowdown.min():.3f} .. {result.model_step_slowdown.max():.3f}",
        f"replay discrepancy {result.replay_discrepancy:.4f}: "
        + (f"DISCARDED from fleet statistics (outside 1/{DISCREPANCY_LIMIT} .. {DISCREPANCY_LIMIT}): the replay does not "
           "match the trace, so S, the attribution and the what-if savings below are not trustworthy; what the trace "
           "measured (per-worker compute against DP peers) still holds" if result.discarded
           else f"ok (within 1/{DISCREPANCY_LIMIT} .. {DISCREPANCY_LIMIT})")
        + ("" if untraced is None else f"; the replay gives back the untraced CPU time of {named}, which the "
                                       f"no-delay replay of METHOD.md leaves out (its discrepancy: {result.launch_slowdown:.4f})")
        + ("" if result.kept_by != "arrivals-model" else
           f"; the replay starts each rank when it arrived, as late as it finished the previous step (ranks end a step "
           f"apart; METHOD.md's replay starts them together and is off by {result.launch_slowdown:.4f}); S is METHOD's"),
    ]
    if result.by_stage is None:
        lines.append(f"no attribution: S < {ATTRIBUTION_THRESHOLD}" if untraced is None else
                     f"no attribution of the traced ops: their S < {ATTRIBUTION_THRESHOLD}")
    else:
        def ranking(values: dict, label) -> str:
            best = sorted(values.items(), key=lambda item: -item[1])[:top]
            return ", ".join(f"{label(key)} {value:.3f}" for key, value in best)

        lines.append("top stages:   " + ranking(result.by_stage, lambda k: f"stage {k}"))
        lines.append("top DP ranks: " + ranking(result.by_dp_rank, lambda k: f"dp {k}"))
        lines.append("top op types: " + ranking(result.by_optype, lambda k: optype_words(k, grads_collective)))
    if not result.straggling:
        if result.mw is not None or result.ms is not None:
            lines.append("M_W, M_S: not shown: they share out the straggling time, and S < 1.1 leaves too little of it "
                         "(see --json)")
        return "\n".join(lines)
    shares = []
    if result.mw is not None:
        workers = ", ".join(f"(dp {d}, stage {p})" for d, p in result.mw.workers)
        lines.append(f"M_W = {result.mw.rem:.3f}: idealising the top {len(result.mw.workers)} worker(s) {workers} removes "
                     f"{share_words(result.mw.rem)} of the straggling time; {_add_form(result.mw.add, 'them')}")
        shares += [result.mw.rem, result.mw.add]
    if result.ms is not None and not result.ms.workers:
        lines.append("M_S = 0: no pipeline parallelism, so no last stage")
    elif result.ms is not None:
        lines.append(f"M_S = {result.ms.rem:.3f}: idealising the last stage removes {share_words(result.ms.rem)} of the straggling "
                     f"time; {_add_form(result.ms.add, 'the last stage')}")
        shares += [result.ms.rem, result.ms.add]
    if any(round(100 * share) > 100 or round(100 * share) < 0 for share in shares):
        lines.append("  (above 100%: with only these idealised the step beats the ideal, as the other workers run faster "
                     "than their op types' ideal means; below 0: these ran faster than the ideal means, so idealising them "
                     "slows the step)")
    return "\n".join(lines)


def share_words(share: float) -> str:
    """A share of the straggling time in words (transforms.whatif.causes.explain.share_words)."""
    from transforms.whatif.causes.explain import share_words as words   # loaded with the engine already

    return words(share)


def _unit(device: str | None) -> str:
    """What a rank is called: 'GPU', or 'CPU rank' for traces of CPU processes."""
    return "CPU rank" if device == "cpu" else "GPU"


def _add_form(add: float, subject: str) -> str:
    """The "add" form of M_W / M_S in words: the straggling time that remains with only that set slow."""
    return f"with only {subject} slow, {share_words(add)} of it remains (add form {add:.3f})"


def _hours(hours: float, unit: str) -> str:
    """Hours of `unit` (GPU, CPU rank) for people: seconds when under a tenth of an hour."""
    return f"{hours:,.1f} {unit}-h" if hours >= 0.1 else f"{hours * 3600:,.1f} {unit}-s"


def verdict_lines(verdict, result, gpu_hours: float | None = None, device: str | None = None) -> str:
    """The root-cause verdict for people: each listed cause with its confidence, sentence, fix
    (S after it, share of the straggling time, GPU-hours saved when known), the joint fix,
    the workers blamed (global ranks)."""
    from schemas.causes import CAUSE_TITLES

    # a confidence is a cause's: "none", "unexplained" and "insufficient-evidence" name none
    named = verdict.cause not in ("none", "unexplained", "insufficient-evidence")
    lines = [f"verdict: {verdict.cause} ({CAUSE_TITLES[verdict.cause]})"
             + (f", confidence {verdict.confidence:.2f}" if named else "")]
    if not verdict.causes:
        lines.append(f"  {verdict.explanation}")
    for rank, cause in enumerate(verdict.causes, 1):
        lines.append(f"  {rank}. {cause} ({CAUSE_TITLES[cause]}), confidence {verdict.confidences[cause]:.2f}: "
                     f"{verdict.explanations[cause]}")
        if cause in verdict.fixes:
            lines.append("     " + _fix_line(verdict.fixes[cause], verdict.slowdown, gpu_hours, device))
    if verdict.joint_fix is not None:
        lines.append("  " + _fix_line(verdict.joint_fix, verdict.slowdown, gpu_hours, device))
    if verdict.implicated_workers:
        ranks = result.worker_rank
        blamed = ", ".join(f"dp {d} / stage {p}" + (f" (rank {int(ranks[d, p])})" if ranks is not None else "")
                           for d, p in verdict.implicated_workers)
        lines.append(f"  workers blamed: {blamed}")
    test = verdict.evidence.get("worker_test")
    if test and test.get("tests"):
        against = "its DP peers" if test.get("peers", True) else \
            "what its other kind of work implies (no DP peers: a stage against the other stages' balance of backward to forward)"
        lines.append(f"  worker test: this job's own jitter is {100 * (math.exp(test['sigma']) - 1):.0f}% per {test['unit']} "
                     f"({test['df']} degrees of freedom); a worker is blamed at a {100 * test['alpha']:g}% false-alarm rate "
                     f"per job, when at least {test['ratio_floor']:.2f}x {against}")
        from transforms.whatif.causes.explain import counted, what_would_decide, where_undecided

        for w in test.get("undecided", []):
            lines.append(f"  undecided: dp {w['dp_rank']} / stage {w['stage']} {w['kind']} {w['ratio']:.2f}x "
                         f"{'its peers' if test.get('peers', True) else 'its balance'} over "
                         f"{counted(w['samples'], test['unit'])}{where_undecided(w) if test.get('peers', True) else ''}, "
                         "within this job's jitter; "
                         f"{what_would_decide(w, test['unit'])}")
    return "\n".join(lines)


def _fix_line(fix, slowdown: float, gpu_hours: float | None, device: str | None = None) -> str:
    unit = _unit(device)
    saved = f"{100 * max(fix.savings_fraction, 0.0):.1f}% of the {unit}-hours"
    if gpu_hours is not None:
        saved += f" ({_hours(gpu_hours * max(fix.savings_fraction, 0.0), unit)} of {_hours(gpu_hours, unit)})"
    if fix.measured:   # measured against what ran, not against the ideal
        return f"fix: {fix.description}: saves {saved} (measured against what ran, not replayed against the ideal)"
    below = " (S < 1 after it: what stays runs faster than the ideal means)" if fix.fixed_slowdown < 1.0 else ""
    return (f"fix: {fix.description}: S {slowdown:.3f} -> {fix.fixed_slowdown:.3f}, "
            f"{share_words(fix.explained)} of the straggling time removed{below}, saves {saved}")


def run(argv: list[str]) -> int:
    """Analyse the job, print the summary, write the requested outputs. Returns the exit code."""
    opts = parse(argv)
    from transforms.whatif.causes import analyze_and_classify, verdict_json
    from transforms.whatif.errors import WhatIfError
    from transforms.whatif.replay import replay_threads

    try:
        trace, meta, job_id, source, converted, gpu_hours, recorded = load_job(opts)
        device = recorded.get("device")
    except (OSError, ValueError, *_lake_errors(opts)) as error:
        # a RawInputError (raw traces) says the cause first: the file set aside, then what that left
        lines = error.lines() if hasattr(error, "lines") else [str(error)]
        print(f"strag analyze: cannot read the job: {lines[0]}", *lines[1:], sep="\n", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        with replay_threads(opts.threads):
            result, verdict = analyze_and_classify(trace, meta, job_id, timeline=opts.timeline_out is not None)
    except WhatIfError as error:
        print(f"strag analyze: {source}: {error}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    if converted is not None:
        print(f"source: {source}")
    print(summary(result, trace.num_rows, seconds, opts.top, device, recorded.get("grads_collective"), verdict.timings))
    print(verdict_lines(verdict, result, gpu_hours, device))
    if opts.json_out is not None:
        opts.json_out.parent.mkdir(parents=True, exist_ok=True)
        written = result.to_json()
        written["verdict"] = verdict_json(verdict, gpu_hours)
        if converted is not None:
            written["source"] = converted.source
        opts.json_out.write_text(json.dumps(written, indent=2, default=float))
        print(f"result JSON: {opts.json_out}")
    if opts.timeline_out is not None:
        from transforms.whatif.timeline import first_steps, write_chrome_trace

        steps = opts.timeline_steps
        if steps is None and (steps := first_steps(result.timeline)) is not None:
            per_step = len(result.timeline.op_optype) * result.meta.dp_size
            print(f"timeline: first {steps} of {len(result.steps)} steps ({per_step:,} ops per step); "
                  "--timeline-steps N to choose")
        opts.timeline_out.parent.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(result.timeline, opts.timeline_out, steps)
        print(f"timeline (open in ui.perfetto.dev): {opts.timeline_out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
