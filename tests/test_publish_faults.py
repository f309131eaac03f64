"""Listing and publishing through failing storage (ARCHITECTURE.md "Errors", transforms/batch/commit.py).

Every storage call of a publish (and of a lake listing) is failed in turn, on a local folder behind
`faulty://` (tests/faulty_storage.py) and on S3 (moto) behind FaultProxy (tests/fault_proxy.py):
- a fault once at call k is retried: the publish equals a fault-free one, byte for byte;
- storage down for good from call k: the publish raises StorageError; every partition, the rollup
  and the timelines are then wholly the old run's or wholly the new run's (never a torn file), and
  all of them are old when the run had not recorded its commit yet; the next run (over another date
  range) first completes the recorded commit, so afterwards every partition of the failed run's
  range is its, and the next run's are the next run's; no staging or commit record is left;
- a listing that fails for good raises StorageError (never returns part of the lake); one fault is
  retried and lists the same jobs;
- the same through the whole `strag batch`: a publish failing for good exits 1 saying the commit is
  recorded, and `strag batch --resume-publish` (or the next run) completes it to the fault-free bytes.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pytest

from faulty_storage import OPS, Fault, calls, faults
from schemas.tables import BATCH_TABLES, TableSpec, read_table
from transforms.batch.commit import COMMITS_DIR, CommitConfig, commit_pending, publish_run, stage_partition
from transforms.batch.elements import JobStats
from transforms.io.lake import list_jobs
from transforms.io.storage import StorageError

DATES = ("2024-03-01", "2024-03-02", "2024-03-03")
SPEC = BATCH_TABLES["step_slowdown"]
ROLLUP = TableSpec("rollup/steps", SPEC.schema, SPEC.sort_keys, partitioned=False)
TIMELINE = f"_timelines/date={DATES[0]}/a.json.gz"
STALE_TIMELINE = f"_timelines/date={DATES[1]}/z.json.gz"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setenv("STRAG_IO_ATTEMPTS", "3")
    monkeypatch.setenv("STRAG_IO_BACKOFF_S", "0")


def rollup(out: str):
    """Finalizer: the unpartitioned rollup of every published step_slowdown partition."""
    return {"rollup/steps": read_table(out, "step_slowdown").drop(["date"])}


def _steps(job: str) -> pa.Table:
    return pa.table({"job_id": [job, job], "step": [1, 2], "step_time_observed": [1.5, 1.5], "step_time": [1.4, 1.5],
                     "step_time_ideal": [1.2, 1.2], "slowdown": [1.4 / 1.2, 1.5 / 1.2],
                     "slow_ranks": pa.array([[3], []], pa.list_(pa.int32())), "fix_cause": ["individual-worker"] * 2,
                     "fix_saving": [0.2, 0.0]})


def _config(out: str, run: str, dates=DATES) -> CommitConfig:
    return CommitConfig(out, dates, f"{dates[0]}_{dates[-1]}_{run}", tables={"step_slowdown": SPEC, "rollup/steps": ROLLUP},
                        finalizers=(rollup,))


class Store:
    """The output as files: local folder or S3 prefix, read without faults."""

    def __init__(self, url: str, fs, root: str):
        self.url, self.fs, self.root = url, fs, root.rstrip("/")

    def files(self, hidden: bool = False) -> dict[str, bytes]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.root)
        except FileNotFoundError:
            return {}
        out = {}
        for path in found:
            relative = path[len(self.root) + 1:]
            if hidden or not relative.startswith(("_staging", "_runs", COMMITS_DIR)):
                out[relative] = self.fs.cat_file(path)
        return out

    def put(self, relative: str, data: bytes) -> None:
        self.fs.makedirs(f"{self.root}/{relative}".rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(f"{self.root}/{relative}", data)


def _stage(store: Store, run: str, job: str, dates=DATES, timeline: bool = False):
    config = _config(store.url, run, dates)
    staged = [stage_partition(config, "step_slowdown", date, [_steps(f"{job}-{date}")]) for date in dates]
    stats = [JobStats("a", dates[0], "analysed", ops=2, timeline=timeline)]
    if timeline:
        store.put(f"_staging/{config.run_id}/{TIMELINE}", f"timeline of {job}".encode())
    return config, staged, stats


_OLD: dict[str, Store] = {}


def _old(store: Store) -> dict[str, bytes]:
    """An earlier run's whole output (with a timeline the new run's dates no longer have): published
    once per kind of store, then copied (server-side on S3) for each scenario."""
    kind = type(store.fs).__name__
    if kind not in _OLD:
        root = store.root.rsplit("/", 1)[0] + "/old-template"
        template = _OLD[kind] = Store(store.url[: -len(store.root)] + root, store.fs, root)
        publish_run(*_stage(template, "old", "old"))
        template.put(STALE_TIMELINE, b"old timeline")
    template = _OLD[kind]
    for relative in template.files():
        store.fs.makedirs(f"{store.root}/{relative}".rsplit("/", 1)[0], exist_ok=True)
        store.fs.copy(f"{template.root}/{relative}", f"{store.root}/{relative}")
    return store.files()


def _reference(store: Store) -> dict[str, bytes]:
    publish_run(*_stage(store, "new", "new", timeline=True))
    return store.files()


def _scenario(make_store, fail, k: int, reference: dict[str, bytes], for_good: bool) -> str:
    """Old output, then the new run's publish with call k failing (once, or from k on). Returns
    "recorded" / "none" (for good: whether the commit was recorded) or "clean"."""
    store = make_store(k)
    old = _old(store)
    config, staged, stats = _stage(store, "new", "new", timeline=True)
    failed = None
    with fail(store, k, for_good):
        try:
            publish_run(config, staged, stats)
        except StorageError as error:
            failed = error
    after = store.files()
    if not for_good or failed is None:   # retried, or failing only once the publish was complete (tidying)
        assert failed is None, f"call {k}: a fault once was not retried: {failed}"
        assert after == reference, f"call {k}: a retried fault changed what was published"
        return "clean" if not for_good else "complete"
    for relative, data in after.items():   # every file wholly old or wholly new
        assert data in (old.get(relative), reference.get(relative)), f"call {k}: {relative} is torn or foreign"
    assert set(after) <= set(old) | set(reference)
    recorded = commit_pending(store.url, config.run_id)
    if not recorded:
        assert after == old, f"call {k}: the run published before recording its commit"
    # the next run, over the last date only, completes the recorded commit before its own publish
    publish_run(*_stage(store, "next", "next", dates=DATES[2:]))
    final = store.files()
    base = reference if recorded else old
    for date in DATES[:2]:
        relative = f"step_slowdown/date={date}/part-0.parquet"
        assert final[relative] == base[relative], f"call {k}: {relative} is not wholly the {'new' if recorded else 'old'} run's"
    assert sorted(read_table(store.url, "step_slowdown").column("job_id").to_pylist()) == sorted(
        [f"{'new' if recorded else 'old'}-{d}" for d in DATES[:2]] * 2 + [f"next-{DATES[2]}"] * 2)
    assert (TIMELINE in final) == recorded and (STALE_TIMELINE in final) == (not recorded)
    assert final["rollup/steps/part-0.parquet"] != old["rollup/steps/part-0.parquet"]   # rebuilt by the next run
    hidden = store.files(hidden=True)
    assert not [p for p in hidden if p.startswith(("_staging", COMMITS_DIR))], f"call {k}: left behind {sorted(hidden)}"
    if recorded:
        record = json.loads(hidden[f"_runs/{config.run_id}.json"])
        assert record["published"]["completed_by"] == f"{DATES[2]}_{DATES[2]}_next"
        assert "step_slowdown/date=2024-03-01" in record["published"]["partitions"] and TIMELINE in record["published"]["timelines"]
        assert json.loads(hidden[f"_runs/{DATES[2]}_{DATES[2]}_next.json"])["published"]["completed_runs"] == [config.run_id]
    return "recorded" if recorded else "none"


# --------------------------------------------------------------------------- local folder behind faulty://


def _local(tmp_path):
    import fsspec

    def make(k):
        root = tmp_path / f"out-{k}"
        return Store(f"faulty://{root}", fsspec.filesystem("file"), str(root))
    return make


def _local_fail(store: Store, k: int, for_good: bool):
    return faults({store.root + "/": Fault(ConnectionResetError, times=None if for_good else 1, skip=k, ops=OPS)})


def _count_local(make) -> int:
    store = make("count")
    _old(store)
    config, staged, stats = _stage(store, "new", "new", timeline=True)
    with faults({store.root + "/": Fault(ConnectionResetError, times=0, ops=OPS)}):
        publish_run(config, staged, stats)
        return len(calls())


def test_every_storage_call_of_a_local_publish_failing(tmp_path):
    make = _local(tmp_path)
    _OLD.clear()
    reference = _reference(make("reference"))
    n = _count_local(make)
    assert n > 40   # moves, listings, deletes, writes of 3 partitions, a timeline, a rollup, records
    outcomes = [_scenario(make, _local_fail, k, reference, for_good=True) for k in range(n)]
    # both sides of the commit record were hit: failures before it publish nothing, after it the next run completes
    assert "none" in outcomes and "recorded" in outcomes, outcomes
    first = outcomes.index("recorded")
    assert first > 0 and set(outcomes[:first]) == {"none"} and set(outcomes[first:]) <= {"recorded", "complete"}
    assert {_scenario(make, _local_fail, k, reference, for_good=False) for k in range(n)} == {"clean"}


def test_a_listing_failing_at_any_call_fails_loud_and_a_retried_one_lists_the_same(tmp_path):
    from batch_lake import write_batch_lake

    lake = tmp_path / "lake"
    write_batch_lake(str(lake))
    url = f"faulty://{lake}"
    clean = list_jobs(url, DATES[0], DATES[-1])
    with faults({str(lake): Fault(ConnectionResetError, times=0, ops=OPS)}):
        list_jobs(url, DATES[0], DATES[-1])
        n = len(calls())
    assert n >= 5
    for k in range(n):
        with faults({str(lake): Fault(TimeoutError, times=None, skip=k, ops=OPS)}):
            with pytest.raises(StorageError, match="storage error"):
                list_jobs(url, DATES[0], DATES[-1])
        with faults({str(lake): Fault(TimeoutError, times=1, skip=k, ops=OPS)}):
            assert list_jobs(url, DATES[0], DATES[-1]) == clean


# --------------------------------------------------------------------------- S3 (moto) behind FaultProxy

from fixtures_s3 import moto_s3  # noqa: E402,F401  (fixture)


@pytest.fixture(scope="module")
def proxied_s3(moto_s3):
    from fault_proxy import proxied

    with proxied(moto_s3) as proxy:
        yield moto_s3, proxy


@pytest.mark.slow
def test_every_storage_call_of_an_s3_publish_failing(proxied_s3):
    """500 InternalError (s3fs does not retry it itself; botocore is set to one attempt) at every sixth
    request of the publish and its last (each scenario is a whole publish against moto, ~5 s: every
    request would take 9 minutes; the local test above fails every call, and these points still
    cover listings, HEADs, PUTs, copies and deletes on both sides of the commit record)."""
    import contextlib

    from fault_proxy import OPS as PROXY_OPS, ProxyFault

    moto, proxy = proxied_s3
    fs = moto.filesystem()

    def make(k):
        return Store(moto.url(f"publish-{k}"), fs, f"{moto.bucket}/publish-{k}")

    @contextlib.contextmanager
    def fail(store, k, for_good):
        proxy.set({f"publish-{k}/": ProxyFault("error", times=None if for_good else 1, skip=k, ops=PROXY_OPS,
                                                per_key=False)})
        try:
            yield
        finally:
            proxy.set({})

    _OLD.clear()
    reference = _reference(make("reference"))
    store = make("count")
    _old(store)
    config, staged, stats = _stage(store, "new", "new", timeline=True)
    proxy.set({"publish-count/": ProxyFault("error", times=0, ops=PROXY_OPS)})
    publish_run(config, staged, stats)
    n = len(proxy.calls)
    proxy.set({})
    assert n > 20
    points = sorted({*range(0, n, 6), n - 1})
    outcomes = [_scenario(make, fail, k, reference, for_good=True) for k in points]
    assert "none" in outcomes and "recorded" in outcomes, outcomes
    assert {_scenario(make, fail, k, reference, for_good=False) for k in points} == {"clean"}


# --------------------------------------------------------------------------- the whole strag batch


@pytest.mark.slow
def test_strag_batch_publish_failing_for_good_is_completed_by_resume_publish(tmp_path, capsys):
    """Storage refuses every delete once the run has published its first partitions: exit 1 saying the
    commit is recorded, partitions whole; `strag batch --resume-publish` completes it to the bytes of a
    fault-free run; a listing failing for good exits 1 and publishes nothing."""
    from batch_lake import DATES as LAKE_DATES, write_batch_lake
    from pipelines import batch

    lake = tmp_path / "lake"
    write_batch_lake(str(lake))

    def run(out, *extra):
        return batch.run(["--lake", f"faulty://{lake}", "--from", LAKE_DATES[0], "--to", LAKE_DATES[-1],
                          "--out", f"faulty://{out}", "--running-mode", "in_memory", "--workers", "1", "--quiet", *extra])

    def tables(out):
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))
                if not str(p.relative_to(out)).startswith("_")}

    clean = tmp_path / "clean"
    with faults({}):
        assert run(clean) == 0
    out = tmp_path / "out"
    # partitions are published in (table, date) order: coverage, fleet_*, job_cause go in, then
    # every move into job_summary fails for good
    with faults({f"-> {out}/job_summary/": Fault(ConnectionResetError, times=None, ops=("move",))}):
        assert run(out) == 1
    err = capsys.readouterr().err
    assert "FAILED while publishing" in err and "--resume-publish" in err and "storage error publishing" in err
    torn = tables(out)
    assert 0 < len(torn) < len(tables(clean)) and all(torn[p] == tables(clean)[p] for p in torn)
    failure = json.loads(next((out / "_runs").glob("*.failed.json")).read_text())
    assert failure["publish"] == "recorded"
    assert batch.run(["--resume-publish", "--out", f"faulty://{out}"]) == 0
    assert "completed the publish of run" in capsys.readouterr().out
    assert tables(out) == tables(clean)
    assert not (out / "_staging").exists() and not (out / COMMITS_DIR).exists()
    assert batch.run(["--resume-publish", "--out", f"faulty://{out}"]) == 0
    assert "nothing to complete" in capsys.readouterr().out

    listed = tmp_path / "listed"
    with faults({f"{lake}/manifests": Fault(ConnectionResetError, times=None, ops=("list",))}):
        assert run(listed) == 1
    err = capsys.readouterr().err
    assert "FAILED, nothing published" in err and "storage error listing" in err and "manifests" in err
    assert tables(listed) == {}
