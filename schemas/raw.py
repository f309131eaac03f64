"""The raw landing contract: profiler output as users' training jobs write it.

    {lake}/raw/kineto/date=YYYY-MM-DD/job_id={job_id}/*.json[.gz]     one torch.profiler trace per rank
    {lake}/raw/kineto/date=YYYY-MM-DD/job_id={job_id}/job.yaml        optional: what a trace cannot say
    {lake}/raw/ndtimeline/date=YYYY-MM-DD/job_id={job_id}/*.jsonl[.gz] NDTimeline records, any split
    {lake}/raw/ndtimeline/date=YYYY-MM-DD/job_id={job_id}/job.yaml    optional, same keys

`kineto`: Chrome-trace JSON exactly as `torch.profiler` (Kineto) exports it, one file per
rank (CPU-only or GPU); the rank comes from the file's `distributedInfo`, never from its
name. `ndtimeline`: veScale NDTimeline's per-(metric, step, rank) records, one JSON object
per line with fields ts, rank, metric, step, value, start_ts[], duration[], model_chunk,
stage, dp_rank, tp_rank, ip, role, trial, run_id (seconds on a calibrated global clock).

`job.yaml` (every key optional; JOB_YAML_KEYS lists them with their meaning) fills in what
the traces do not carry. The converters (transforms/ingest/) turn a raw job window into
TRACE_SCHEMA rows and a manifest; the batch pipeline does so on the worker that analyses
the window, and `strag import` writes the result into the lake as a native job.
"""
from __future__ import annotations

__all__ = [
    "RAW",
    "RAW_FORMATS",
    "JOB_YAML",
    "JOB_YAML_KEYS",
    "LAYOUT_DIMS",
    "RAW_REASONS",
    "SOURCE_KEY",
    "SOURCE_FORMATS",
    "raw_dir",
    "raw_format_of",
]

RAW = "raw"
RAW_FORMATS = ("kineto", "ndtimeline")
JOB_YAML = "job.yaml"
# Parallel dimensions of a rank layout, named as Megatron names them; `layout` in job.yaml
# orders them fastest-varying first (Megatron's default "tp-cp-dp-pp": rank = tp + TP*(cp + CP*(dp + DP*pp))).
LAYOUT_DIMS = ("tp", "cp", "dp", "pp")

JOB_YAML_KEYS: dict[str, str] = {
    "dp_size": "data-parallel size (default: from process groups, else world / (pp*tp*cp))",
    "pp_size": "pipeline stages (default: from process groups or the p2p peers, else 1)",
    "tp_size": "tensor-parallel size (default 1; TP peers are collapsed to their lowest rank)",
    "cp_size": "context-parallel size (default 1; collapsed like TP)",
    "vpp_size": "model chunks per stage (default: from the microbatch labels, else 1)",
    "layout": "rank order of the dims, fastest first, e.g. tp-cp-dp-pp (used when process groups do not say)",
    "forward_label": "regex of the per-microbatch forward annotation; group 'mb' = microbatch, optional 'chunk'",
    "backward_label": "regex of the per-microbatch backward annotation (same groups)",
    "optimizer_label": "regex of the optimizer step annotation (default ^Optimizer\\.step#)",
    "clock": "'auto' (default: one clock per host, offsets between hosts estimated from comm ends), 'align' (every "
             "rank its own clock) or 'trust' (the recorded clocks)",
    "model_family": "free text, e.g. dense or moe (default unknown)",
    "context_length": "tokens per sequence (default 0 = unknown)",
    "gpu_type": "e.g. H800 (default: the trace's deviceProperties, else cpu)",
    "hosts": "list: host name of each global rank (default: one unknown host per rank)",
    "start_time": "ISO timestamp of the window's first step (default: the trace's baseTimeNanoseconds clock)",
    "gpu_hours_scale": "sampled share of the window, 0 < s <= 1: GPU-hours = traced hours / s (default 1)",
}

# Manifest file metadata key holding the converter's source record (JSON) of an imported job.
SOURCE_KEY = "strag.source"
# Where a job window's op rows came from (job_summary.source_format, coverage.source_format):
# native lake parquet, or a raw format converted on the worker / by `strag import`.
SOURCE_FORMATS = ("lake", *RAW_FORMATS)

# Reason codes of raw input that cannot become an analysable job window (quarantine table).
# (level, human reason); the level follows schemas.expectations.REASONS.
RAW_REASONS: dict[str, tuple[str, str]] = {
    "raw_unreadable": ("file", "the raw trace is not valid JSON (truncated upload, wrong format, broken gzip); re-upload it"),
    "raw_not_a_trace": ("file", "the file parses but is not a profiler trace of this format (no traceEvents / records)"),
    "raw_bad_job_yaml": ("job", "job.yaml is not a mapping of the documented keys (schemas/raw.py JOB_YAML_KEYS)"),
    "raw_duplicate_rank": ("job", "two files hold the same global rank; upload one trace per rank"),
    "raw_mixed_jobs": ("job", "the folder holds ranks of more than one job or run (world size, backend, NCCL version, process groups, "
                              "run ids or the time their steps ran differ: over an hour apart, or a profiled window on one host)"),
    "raw_missing_rank": ("job", "ranks of the job are missing: every rank of the layout needs its trace"),
    "raw_no_steps": ("job", "no complete profiled step (ProfilerStep#N) common to all ranks"),
    "raw_steps_misaligned": ("job", "the ranks' profiled steps do not line up: profile the same steps on every rank"),
    "raw_layout_unknown": ("job", "the dp/pp layout cannot be derived from process groups or peers; give sizes and layout in job.yaml"),
    "raw_unknown_collective": ("job", "a collective the converter cannot map to an op type; see detail"),
    "raw_unmatched_comm": ("job", "communication ops do not pair up across ranks (sequence numbers or counts differ)"),
    "raw_no_microbatches": ("job", "no per-microbatch forward/backward compute found; set forward_label/backward_label in job.yaml"),
    "raw_cpu_only_rank": ("job", "a rank of a GPU job recorded no GPU kernel (profiled without ProfilerActivity.CUDA); profile "
                                 "every rank with the same activities"),
    "raw_unlinked_kernels": ("job", "most of a rank's GPU kernels have no CUDA launch in its file (no cuda_runtime / cuda_driver "
                                    "event of their correlation): its compute cannot be timed on the GPU; export the trace whole"),
    "raw_unsupported_schedule": ("job", "a pipeline schedule the dependency model cannot represent yet (zero-bubble split backwards, V-shaped stage placement)"),
}


def raw_dir(lake: str, fmt: str, date: str, job_id: str) -> str:
    """Folder holding one raw job window's uploads."""
    from schemas.lake import safe_job_id

    if fmt not in RAW_FORMATS:
        raise ValueError(f"raw format {fmt!r}: expected one of {', '.join(RAW_FORMATS)}")
    return "/".join([lake.rstrip("/"), RAW, fmt, f"date={date}", f"job_id={safe_job_id(job_id)}"])


def raw_format_of(name: str) -> str | None:
    """'kineto' for *.json / *.json.gz / *.pt.trace.json, 'ndtimeline' for *.jsonl[.gz], else None."""
    lower = name.lower()
    if lower.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "ndtimeline"
    if lower.endswith((".json", ".json.gz")):
        return "kineto"
    return None
