"""`strag land`: torch.profiler traces already on disk -> the lake's raw landing, as the collector writes them.

    strag land DIR --lake URL --job-id ID [--date YYYY-MM-DD] [--live [--session NAME]]

DIR: a local folder of rank traces (`*.json`, `*.json.gz`: `export_chrome_trace` or
`tensorboard_trace_handler` output, one per rank) and an optional job.yaml. Each trace is
written to `{lake}/raw/kineto/date=D/job_id=ID/` under its own name, gzipped when it is plain
JSON, atomically and with retries (strag_collect.land_file); job.yaml is checked against
schemas/raw.py JOB_YAML_KEYS first. JSON files that are not torch.profiler traces (a run's
notes, truth.json) and hidden names are left out and listed. `strag batch` then analyses
the window, or `strag import` makes it a native lake job.

`--live` also lands the traces, first, as a live session of `strag watch`
(`{lake}/landing/ID/SESSION/rank-R-of-W.json.gz` and job.yaml, transforms/live/landing.py), as
`kineto_handler(..., live=True)` does; each trace's rank and world size come from its own
`distributedInfo`. SESSION defaults to `landed-{UTC time}`, so landing again is a new session.

Exit 2 with one line on a usage error (no DIR, no traces in it, a bad job id or job.yaml,
a trace cut short or damaged, with --live a trace without distributedInfo, two traces of one
rank, or ranks of different world sizes, or a window folder another run of the job id already
landed in on that date: two runs never make one window); exit 1 when storage fails. A trace cut short is refused
before anything lands rather than landed for the batch to quarantine: landing the other ranks
would publish a window missing a rank (the batch quarantines it as a whole, `incomplete_window`,
and the watcher would wait for the rank), while the user still holds the folder and can copy the
file again now; a local read that fails (not bad bytes) is an OSError, exit 1.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import gzip
import json
import pathlib
import sys

from pipelines.cli import date_argument
from pipelines.usage import ArgumentParser
from schemas.lake import LANDING
from schemas.raw import JOB_YAML, raw_dir, raw_format_of

__all__ = ["LandOptions", "parse", "trace_files", "land", "run"]

# Kineto's export starts `{"schemaVersion": 1, "deviceProperties": [...], ...`: a few KB on a GPU
# node before the events, well inside this much of the decompressed head.
_SNIFF_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class LandOptions:
    folder: pathlib.Path
    lake: str
    job_id: str
    date: dt.date
    session: str | None = None   # --live: the live session's name


def _is_kineto_trace(path: pathlib.Path) -> bool:
    """Whether the file's head looks like a torch.profiler Chrome trace (unreadable gzip: no)."""
    try:
        with (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) as handle:
            head = handle.read(_SNIFF_BYTES)
    except (OSError, EOFError):
        return False
    return b'"schemaVersion"' in head or b'"traceEvents"' in head


def trace_files(folder: pathlib.Path) -> tuple[list[pathlib.Path], pathlib.Path | None, list[str]]:
    """(rank traces, job.yaml or None, names left out with why) of a folder, one level deep.

    ValueError when the folder is missing or holds no torch.profiler trace."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (give the folder holding the rank traces)")
    traces, job_yaml, left_out = [], None, []
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if path.name == JOB_YAML:
            job_yaml = path
        elif raw_format_of(path.name) != "kineto":
            continue
        elif path.name.startswith((".", "_")):
            left_out.append(f"{path.name} (hidden name)")
        elif not _is_kineto_trace(path):
            left_out.append(f"{path.name} (not a torch.profiler trace)")
        else:
            traces.append(path)
    if not traces:
        raise ValueError(f"{folder}: no torch.profiler traces (*.json or *.json.gz, one per rank)"
                         + (f"; left out: {', '.join(left_out)}" if left_out else ""))
    return traces, job_yaml, left_out


class NoDistributedInfo(ValueError):
    """The trace names no rank and world size: torch wrote it without a process group."""


def distributed_info(path: pathlib.Path) -> tuple[int, int]:
    """(rank, world size) of a torch.profiler trace, from its `distributedInfo` (near the head: read
    in growing pieces, the whole file at worst). ValueError when the trace has none."""
    size = 1 << 16
    while True:
        with (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) as handle:
            head = handle.read(size)
            whole = len(head) < size
        text = head.decode("utf-8", errors="replace")
        at = text.find('"distributedInfo"')
        if at >= 0:
            start = text.find("{", at)
            try:
                info, _ = json.JSONDecoder().raw_decode(text, start) if start >= 0 else (None, 0)
            except json.JSONDecodeError:
                info = None   # cut by the head: read more
            if isinstance(info, dict):
                try:
                    rank, world = int(info["rank"]), int(info["world_size"])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"{path}: distributedInfo has no integer rank and world_size") from None
                if not 0 <= rank < world:
                    raise ValueError(f"{path}: distributedInfo says rank {rank} of world size {world}")
                return rank, world
        if whole:
            raise NoDistributedInfo(f"{path}: no distributedInfo (rank, world_size) in the trace: a live session needs it "
                             "to know when every rank is in (profile a torch.distributed process)")
        size *= 8


def live_files(traces: list[pathlib.Path]) -> dict[int, tuple[pathlib.Path, int]]:
    """{rank: (trace, world size)} of a folder's traces; ValueError on two traces of one rank or mixed world sizes.
    A folder of one trace without distributedInfo is a one-process job (torch writes none without a
    process group: where most users start): rank 0 of world 1, as the collector lands it."""
    ranks: dict[int, tuple[pathlib.Path, int]] = {}
    for path in traces:
        try:
            rank, world = distributed_info(path)
        except NoDistributedInfo:
            if len(traces) == 1:
                return {0: (path, 1)}
            raise
        if rank in ranks:
            raise ValueError(f"{ranks[rank][0].name} and {path.name} are both rank {rank}: land one trace per rank")
        ranks[rank] = (path, world)
    worlds = sorted({world for _, world in ranks.values()})
    if len(worlds) > 1:
        raise ValueError(f"the traces name different world sizes ({', '.join(map(str, worlds))}): ranks of more than one run")
    return dict(sorted(ranks.items()))


def _check_whole(path: pathlib.Path) -> None:
    """ValueError naming the file when a trace is cut short (a copy interrupted, a profiler killed while
    writing): a gzip stream that ends early or is damaged, a JSON document that does not end with `}`."""
    import zlib

    if path.name.lower().endswith(".gz"):
        try:
            from isal import igzip as gz
        except ImportError:   # pragma: no cover - isal is a declared dependency
            import gzip as gz
        try:
            with gz.open(path, "rb") as stream:
                tail = b""
                while chunk := stream.read(1 << 22):
                    tail = chunk[-64:]
        except (EOFError, OSError, zlib.error) as error:
            if isinstance(error, OSError) and error.errno is not None:
                raise
            raise ValueError(f"{path} is cut short or damaged ({type(error).__name__}: {error}): its rank would be "
                             "missing from the window; copy the file again, nothing was landed") from None
    else:
        with open(path, "rb") as stream:
            stream.seek(max(0, path.stat().st_size - 64))
            tail = stream.read()
    if not tail.rstrip().endswith(b"}"):
        raise ValueError(f"{path} is cut short (its JSON does not end with '}}'): its rank would be missing from the "
                         "window; copy the file again, nothing was landed")


def land(options: LandOptions) -> tuple[str, list[str], list[str]]:
    """Write the folder's traces (and job.yaml) into the raw window; returns (window URL, URLs written,
    names left out). ValueError / RawInputError on bad input, OSError when storage fails after retries."""
    from strag_collect import land_file
    from transforms.ingest.common import read_job_yaml
    from transforms.io.storage import RetryPolicy

    traces, job_yaml, left_out = trace_files(options.folder)
    if job_yaml is not None:
        read_job_yaml(job_yaml.read_bytes(), job_id=options.job_id, path=str(job_yaml))
    for path in traces:   # a window missing a rank is no window: nothing lands unless every trace is whole
        _check_whole(path)
    window = raw_dir(options.lake, "kineto", options.date.isoformat(), options.job_id)
    policy = RetryPolicy.from_env()
    plan: list[tuple[pathlib.Path, str]] = []   # (local file, URL), in landing order
    if options.session is not None:   # the live session first (job.yaml before the traces): the watcher starts sooner
        from schemas.lake import landing_dir
        from strag_collect import live_trace_name   # the collector's names: transforms/live/landing.py reads them

        session = landing_dir(options.lake, options.job_id, options.session)
        plan += [(job_yaml, f"{session}/{JOB_YAML}")] if job_yaml else []
        plan += [(path, f"{session}/{live_trace_name(rank, world)}") for rank, (path, world) in live_files(traces).items()]
    for path in ([job_yaml] if job_yaml else []) + traces:
        plan.append((path, f"{window}/{path.name}" + (".gz" if path.name.lower().endswith(".json") else "")))
    _never_mix(options, window, [(path, url) for path, url in plan if url.startswith(window + "/")])
    written = []
    for path, url in plan:
        compress = url.endswith(".gz") and not path.name.lower().endswith(".gz")
        try:
            land_file(str(path), url, compress=compress, retries=policy.attempts - 1, backoff=policy.backoff,
                      backoff_max=policy.backoff_max)
        except OSError as error:
            raise OSError(f"{url} not written after {policy.attempts} attempt(s) ({type(error).__name__}: {error})") from error
        written.append(url)
    return window, written, left_out


def _never_mix(options: LandOptions, window: str, plan: list[tuple[pathlib.Path, str]]) -> None:
    """Refuse (ValueError) to land into a window folder another run already landed in: a trace there
    that this run does not have, or one of the same name with other content (a rerun of the job id the
    same day), would make one window of two runs. Landing the same files again (the command rerun after
    a storage failure) is fine. Content is compared by the gzip trailer (CRC-32 and size of the
    uncompressed trace: 8 bytes read per file)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(window)
    if not fs.exists(root):
        return
    ours = {url.rsplit("/", 1)[-1]: path for path, url in plan}
    there = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    foreign = sorted(name for name in there if not name.startswith(".") and name != JOB_YAML and name not in ours)
    changed = sorted(name for name in there if name in ours and name != JOB_YAML
                     and _trailer(ours[name]) != _remote_trailer(fs, f"{root}/{name}"))
    if foreign or changed:
        what = (f"{', '.join(foreign[:3])} {'is' if len(foreign) == 1 else 'are'} not in this folder" if foreign else
                f"{', '.join(changed[:3])} {'differs' if len(changed) == 1 else 'differ'} from this folder's")
        raise ValueError(f"job {options.job_id} already has a window of another run landed on {options.date} ({window}: "
                         f"{what}); land this run under its own job id (e.g. --job-id {options.job_id}-run2) or date, "
                         "so two runs never make one window")


def _trailer(path: pathlib.Path) -> bytes:
    """The gzip trailer (CRC-32, size mod 2**32) the landed copy of a local trace has."""
    import zlib

    if path.name.lower().endswith(".gz"):
        with open(path, "rb") as handle:
            handle.seek(-8, 2)
            return handle.read(8)
    crc, size = 0, 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return crc.to_bytes(4, "little") + (size & 0xFFFFFFFF).to_bytes(4, "little")


def _remote_trailer(fs, path: str) -> bytes:
    size = fs.size(path)
    with fs.open(path, "rb") as handle:
        handle.seek(max(0, size - 8))
        return handle.read(8)


def parse(argv: list[str]) -> LandOptions:
    parser = ArgumentParser(
        prog="strag land",
        description="Copy torch.profiler traces already on disk (one per rank, and job.yaml) into the lake's raw "
                    "landing {lake}/raw/kineto/date=D/job_id=ID/, gzipped and atomically, as strag_collect writes them.")
    parser.add_argument("folder", metavar="DIR", type=pathlib.Path,
                        help="local folder of rank traces (*.json, *.json.gz) and an optional job.yaml")
    parser.add_argument("--lake", required=True, help="lake URL (folder, file://, s3://)")
    parser.add_argument("--job-id", required=True, help="job id in the lake")
    parser.add_argument("--date", type=date_argument, default=None, help="date partition YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--live", action="store_true",
                        help="also land the traces, first, as a live session {lake}/landing/ID/SESSION/ that `strag watch` "
                             "analyses as soon as every rank is in")
    parser.add_argument("--session", default=None, metavar="NAME",
                        help="with --live: the live session's name (default landed-YYYYMMDDTHHMMSSZ, now in UTC)")
    args = parser.parse_args(argv)
    from schemas.lake import safe_job_id

    try:
        safe_job_id(args.job_id)
    except ValueError as error:
        parser.error(f"--job-id: {error}")
    session = None
    if args.session is not None and not args.live:
        parser.error("--session names a live session: give --live too")
    if args.live:
        session = args.session or "landed-" + dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        try:
            safe_job_id(session, "session")
        except ValueError as error:
            parser.error(f"--session: {error}")
    date = args.date or dt.datetime.now(dt.timezone.utc).date()
    return LandOptions(args.folder, args.lake, args.job_id, date, session)


def run(argv: list[str]) -> int:
    options = parse(argv)
    from transforms.ingest import RawInputError

    try:
        window, written, left_out = land(options)
    except (RawInputError, ValueError) as error:
        code = f" [{error.reason_code}]" if isinstance(error, RawInputError) else ""
        print(f"strag land: {error}{code}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"strag land: storage failed, the window is incomplete: {error}; "
              "fix the storage or credentials and run the same command again", file=sys.stderr)
        return 1
    live = [url for url in written if f"/{LANDING}/" in url]
    written = [url for url in written if url not in live]
    traces = sum(not url.endswith("/" + JOB_YAML) for url in written)
    if live:
        print(f"landed live session {options.session} of job {options.job_id} ({len(live)} file(s)): "
              f"{live[0].rsplit('/', 1)[0]}\n  watch   strag watch --lake {options.lake} --out LIVE_TABLES")
    print(f"landed {traces} rank trace{'s' if traces != 1 else ''}"
          + (" and job.yaml" if traces != len(written) else "") + f" of job {options.job_id} on {options.date}\n"
          f"  window  {window}\n"
          f"  next    strag batch --lake {options.lake} --from {options.date} --to {options.date} --out TABLES"
          f"  (or strag import --format kineto {window} --lake {options.lake} --job-id {options.job_id} --date {options.date})")
    if left_out:
        print(f"  left out: {', '.join(left_out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
