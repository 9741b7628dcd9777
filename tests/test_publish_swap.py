"""Publishing a night without a table: old or new, never a mix, even when killed; rollback and retention.

Every test marked with the ``store`` fixture runs twice: on the local file system and on a real S3
endpoint (moto's server on loopback), through the same pyarrow layer as the job. The kill tests run
``publish`` (or retention) in a child Python process held at a named pause point (``RECSYS_PAUSE_AT``),
kill it with SIGKILL once it says it is there, and look at what a reader would see. The steps that
need the catalog table are in tests/test_output_table.py. No Spark here.
"""
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import storekit
from recsys import fs as rfs
from recsys.config import load_config
from recsys.errors import ConfigError
from recsys.publish import publisher, retention, swap
from recsys.publish.manifest import Manifest, ModelRef, to_text
from recsys.publish.manifest import read as read_manifest
from recsys.publish.published import (kept_runs, new_run_key, published as published_night, published_dates,
                                     read_pointer)
from recsys.publish.publisher import (PartitionLayout, check_output_location, discard_staging, publish, recover,
                                      roll_back)

DATE = dt.date(2024, 5, 8)
REPO = Path(__file__).resolve().parent.parent

needs_exchange = pytest.mark.skipif(swap.method_for("/tmp") != "exchange", reason="needs renameat2 (Linux)")


def _partition(store: storekit.Store, directory: str, tag: str, files: int = 3) -> None:
    """A complete run directory as Spark leaves it: data files and _SUCCESS."""
    for i in range(files):
        store.write(f"{directory}/part-{i:05d}-{tag}.parquet", os.urandom(64) + tag.encode())
    store.write(f"{directory}/_SUCCESS", b"")


def _manifest(run: str) -> Manifest:
    return Manifest(run_id=f"mlflow-{run}", job_run=run, model=ModelRef(version="1"), config_digest="d")


def _data(snapshot: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in snapshot.items() if k != "_manifest.json"}


def _leftovers(store: storekit.Store, out: str) -> list[str]:
    """Files under the output root outside the path views and the run directories (staging, trash)."""
    return sorted(k for k in store.snapshot(out) if not k.startswith(("dt=", "_runs/", "_locks/")))


def _published_with_old(store: storekit.Store, method: str | None = None) -> tuple[str, dict[str, bytes]]:
    out = store.root()
    old = PartitionLayout(out, DATE, "old-run")
    _partition(store, old.run_dir, "old")
    publish(old, _manifest("old-run"), method)
    return out, _data(store.snapshot(old.final_dir))


def _new_staged(store: storekit.Store, out: str, run: str = "new-run") -> tuple[PartitionLayout, dict[str, bytes]]:
    layout = PartitionLayout(out, DATE, run)
    _partition(store, layout.run_dir, "new")
    return layout, store.snapshot(layout.run_dir)


def _method(store: storekit.Store, local_method: str = "exchange") -> str:
    return "copy" if store.name == "s3" else local_method


def _seen(out: str) -> str | None:
    """What a reader that follows the date's pointer reads: the run whose files it gets."""
    found = published_night(out, DATE)
    return found.run if found else None


def test_publish_points_at_the_run_directory_and_swaps_the_path_view(store):
    out, old = _published_with_old(store, _method(store))
    layout, new = _new_staged(store, out)
    night = publish(layout, _manifest("new-run"), _method(store))
    assert (night.run, night.location) == ("new-run", layout.run_dir)
    got = store.snapshot(layout.final_dir)
    assert json.loads(got.pop("_manifest.json"))["job_run"] == "new-run"
    assert got == new                                              # the path view: the new run's files
    assert _data(store.snapshot(PartitionLayout(out, DATE, "old-run").run_dir)) == old   # the old run kept
    assert _seen(out) == "new-run" and read_pointer(out, DATE).published_runs() == ["new-run", "old-run"]
    assert _leftovers(store, out) == []                            # no staging, no trash
    assert read_manifest(out, DATE).job_run == "new-run"        # readers of the path view's manifest


@needs_exchange
def test_the_exchange_publish_replaces_the_path_view_with_one_swap_of_hard_links(tmp_path, monkeypatch):
    store = storekit.Store("local", str(tmp_path))
    out, _ = _published_with_old(store)
    layout, _ = _new_staged(store, out)
    seen, real = [], swap.exchange

    def spy(a, b):   # both complete directories exist up to the instant of the one call that swaps them
        part = next(Path(a).glob("part-*"))
        seen.append((Path(a).name, Path(b).name, (Path(a) / "_manifest.json").is_file(), (Path(b) / "_SUCCESS").is_file(),
                     part.stat().st_ino == (Path(layout.run_dir) / part.name).stat().st_ino))
        real(a, b)

    assert publisher.publish_method(layout) == "exchange"      # what the job picks on this filesystem
    monkeypatch.setattr(swap, "exchange", spy)
    publish(layout, _manifest("new-run"), "exchange")
    assert seen == [("new-run", f"dt={DATE}", True, True, True)]   # no data byte copied: hard links


@pytest.mark.parametrize("method", ["rename", "copy"])
def test_the_other_path_view_methods_give_the_same_result(tmp_path, method):
    store = storekit.Store("local", str(tmp_path))
    out, _ = _published_with_old(store, method)
    layout, new = _new_staged(store, out)
    publish(layout, _manifest("new-run"), method)
    got = store.snapshot(layout.final_dir)
    assert json.loads(got.pop("_manifest.json"))["job_run"] == "new-run"
    assert got == new and _leftovers(store, out) == []


def test_a_run_directory_without_success_marker_is_never_published(store):
    out, old = _published_with_old(store, _method(store))
    layout, _ = _new_staged(store, out)
    fs, path = rfs.resolve(f"{layout.run_dir}/_SUCCESS")
    fs.delete_file(path)
    with pytest.raises(RuntimeError, match="has no _SUCCESS"):
        publish(layout, _manifest("new-run"), _method(store))
    assert _data(store.snapshot(layout.final_dir)) == old and _seen(out) == "old-run"


_CHILD = """
import datetime, sys
import storekit
storekit.install_from_env()
from recsys.config import load_hooks
from recsys.publish.manifest import Manifest
from recsys.publish.publisher import PartitionLayout, publish
from recsys.publish import retention
root, date, run, method = sys.argv[1], datetime.date.fromisoformat(sys.argv[2]), sys.argv[3], sys.argv[4]
if method == "retention":
    retention.trim_runs(root, date, 1, load_hooks())
    retention.retire_dates(root, date, 1, None, "retention", load_hooks())
else:
    publish(PartitionLayout(root, date, run), Manifest(run_id=run, job_run=run), method, load_hooks())
print("done", flush=True)
"""


def _killed_at(store: storekit.Store, layout: PartitionLayout, method: str, point: str) -> None:
    env = {**store.child_env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    storekit.kill_at([sys.executable, "-c", _CHILD, layout.output_root, str(layout.date), layout.run_key, method],
                     point, env)


_POINTS = [   # (point, local method, what is published once the job is killed there)
    ("before_swap", "exchange", "old"),      # manifest in the run directory, nothing switched
    ("after_pointer", "exchange", "new"),    # the commit: the pointer names the new run; the path view still old
    ("after_swap", "exchange", "new"),       # the path view swapped (S3: copied, _SUCCESS not yet written)
    ("between_renames", "rename", "new"),    # two-rename swap: the old view in _trash/, the new one not in place
]


@pytest.mark.parametrize("point, local_method, expect", _POINTS, ids=[p[0] for p in _POINTS])
def test_a_publish_killed_at_any_step_leaves_the_old_or_the_new_night_and_the_next_run_recovers(
        store, point, local_method, expect):
    if store.name == "s3" and point == "between_renames":
        pytest.skip("object stores copy the path view: there is no rename")
    if local_method == "exchange" and store.name == "local" and swap.method_for(store.base) != "exchange":
        pytest.skip("needs renameat2 (Linux)")
    method = _method(store, local_method)
    out, old = _published_with_old(store, method)
    layout, new = _new_staged(store, out)
    _killed_at(store, layout, method, point)
    wanted = "new-run" if expect == "new" else "old-run"
    assert _seen(out) == wanted                                    # readers of the pointer: old or new, complete
    assert _data(store.snapshot(published_night(out, DATE).location)) == (new if expect == "new" else old)
    if method == "exchange" or point == "before_swap":             # readers of the path view at this instant
        view = _data(store.snapshot(layout.final_dir))
        assert view == (new if point == "after_swap" else old)

    # the next run of the date (holding the lock) recovers first: everything in line with the commit point
    notes = recover(PartitionLayout(out, DATE, "next-run"), method=method)
    seen = store.snapshot(layout.final_dir)
    assert json.loads(seen.pop("_manifest.json"))["job_run"] == wanted
    assert seen == (new if expect == "new" else old) and _leftovers(store, out) == []
    if expect == "old":
        assert not store.exists(layout.run_dir) and any("never published" in n for n in notes)
    if point == "between_renames":
        assert any("restored" in n for n in notes)
    again, fresh = _new_staged(store, out, "next-run")
    publish(again, _manifest("next-run"), method)
    assert _data(store.snapshot(again.final_dir)) == fresh and _seen(out) == "next-run"


def test_a_reader_following_the_pointer_through_a_publish_sees_the_old_or_the_new_night(store):
    """A reader in a loop (where is the night of D? read its files) while another process publishes."""
    import threading

    method = _method(store)
    out, old = _published_with_old(store, method)
    layout, new = _new_staged(store, out)
    old_files = _data(store.snapshot(PartitionLayout(out, DATE, "old-run").run_dir))
    new_files = _data(new)
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set() and len(seen) < 5000:
            found = published_night(out, DATE)
            files = _data(store.snapshot(found.location))
            seen.append("old" if files == old_files else "new" if files == new_files else f"mix: {sorted(files)}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    env = {**store.child_env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    child = subprocess.run([sys.executable, "-c", _CHILD, out, str(DATE), layout.run_key, method], env=env,
                           capture_output=True, text=True, timeout=300)
    done.set()
    reader.join(timeout=60)
    assert child.returncode == 0, child.stderr
    assert seen and set(seen) <= {"old", "new"}, seen[:5]
    assert seen[0] == "old"                                     # it read before the child's commit, and after
    assert seen == sorted(seen, key=lambda s: s != "old")       # old, then new: never back
    assert _seen(out) == "new-run" and old == _data(store.snapshot(PartitionLayout(out, DATE, "old-run").run_dir))


def test_an_object_store_copy_killed_before_success_is_refreshed_by_the_next_run(tmp_path):
    store = storekit.Store("local", str(tmp_path))
    out, _ = _published_with_old(store, "copy")
    layout, new = _new_staged(store, out)
    _killed_at(store, layout, "copy", "after_swap")          # data and manifest copied, _SUCCESS not yet
    assert not store.exists(f"{layout.final_dir}/_SUCCESS")
    assert read_manifest(out, DATE) is None                    # readers of the path view wait for _SUCCESS
    assert _seen(out) == "new-run"                             # the pointer was the commit
    notes = recover(PartitionLayout(out, DATE, "next-run"), method="copy")
    assert any("refreshed from run new-run" in n for n in notes)
    assert _data(store.snapshot(layout.final_dir)) == new


def _published_runs(store: storekit.Store, out: str, date: dt.date, runs: list[str], method: str) -> None:
    for run in runs:
        layout = PartitionLayout(out, date, run)
        _partition(store, layout.run_dir, run)
        publish(layout, _manifest(run), method)


def test_keep_runs_keeps_the_newest_published_runs_and_never_the_one_pointed_at(store):
    out = store.root()
    method = _method(store)
    _published_runs(store, out, DATE, ["r1", "r2", "r3"], method)
    removed = retention.trim_runs(out, DATE, 2)
    assert kept_runs(out, DATE) == ["r2", "r3"] and len(removed) == 1
    roll_back(PartitionLayout(out, DATE, "rollback"), None, method=method)     # back to r2
    _published_runs(store, out, DATE, ["r4"], method)
    retention.trim_runs(out, DATE, 1)
    assert kept_runs(out, DATE) == ["r4"] and _seen(out) == "r4"
    with pytest.raises(ConfigError, match="no earlier published run is kept"):
        roll_back(PartitionLayout(out, DATE, "rollback"), None, method=method)


def test_rollback_points_the_date_back_at_a_kept_run_and_can_go_forward_again(store):
    out = store.root()
    method = _method(store)
    _published_runs(store, out, DATE, ["r1", "r2"], method)
    layout = PartitionLayout(out, DATE, "rollback")
    assert roll_back(layout, None, method=method) == ("r2", "r1")
    assert _seen(out) == "r1" and read_manifest(out, DATE).job_run == "r1"
    assert _data(store.snapshot(layout.final_dir)) == _data(store.snapshot(PartitionLayout(out, DATE, "r1").run_dir))
    assert roll_back(layout, "r2", method=method) == ("r1", "r2") and _seen(out) == "r2"
    with pytest.raises(ConfigError, match="not a kept earlier run"):
        roll_back(layout, "r9", method=method)
    with pytest.raises(ConfigError, match="already is the published one"):
        roll_back(layout, "r2", method=method)
    assert [e.how for e in read_pointer(out, DATE).history] == ["publish", "publish", "rollback", "rollback"]


def test_retention_days_retire_old_dates_whole_and_keep_the_rest(store):
    out = store.root()
    method = _method(store)
    for day in (1, 5, 8):
        _published_runs(store, out, dt.date(2024, 5, day), [f"d{day}"], method)
    notes = retention.retire_dates(out, DATE, 3)
    assert notes == ["retired dt=2024-05-01 (output.retention_days)"]
    assert published_dates(out) == [dt.date(2024, 5, 5), DATE]
    assert not store.snapshot(f"{out}/dt=2024-05-01") and not store.snapshot(f"{out}/_runs/dt=2024-05-01")
    assert published_night(out, dt.date(2024, 5, 5)).run == "d5"


def test_retention_killed_midway_leaves_every_date_old_or_new_and_the_next_pass_finishes(store):
    out = store.root()
    method = _method(store)
    _published_runs(store, out, DATE, ["r1", "r2", "r3"], method)
    for day in (1, 2):
        _published_runs(store, out, dt.date(2024, 5, day), [f"d{day}"], method)
    _killed_at(store, PartitionLayout(out, DATE, "x"), "retention", "retention")   # after its first removal
    assert _seen(out) == "r3" and store.snapshot(published_night(out, DATE).location)
    for day in (1, 2):                     # each old date: still published in full, or not at all
        found = published_night(out, dt.date(2024, 5, day))
        assert found is None or _data(store.snapshot(found.location))
    retention.trim_runs(out, DATE, 1)
    retention.retire_dates(out, DATE, 1)
    assert kept_runs(out, DATE) == ["r3"] and published_dates(out) == [DATE] and _seen(out) == "r3"


def test_a_failed_run_discards_its_directory_but_never_a_published_one(store):
    out, _ = _published_with_old(store, _method(store))
    failed, _ = _new_staged(store, out, "failed-run")
    discard_staging(failed)
    assert not store.exists(failed.run_dir)
    discard_staging(PartitionLayout(out, DATE, "old-run"))     # e.g. a failure after the commit
    assert _seen(out) == "old-run" and store.exists(f"{PartitionLayout(out, DATE, 'old-run').run_dir}/_SUCCESS")


def test_a_path_view_published_before_run_directories_is_adopted_without_a_copy(tmp_path):
    store = storekit.Store("local", str(tmp_path))
    out = store.root()
    view = f"{out}/dt={DATE}"
    _partition(store, view, "legacy")
    store.write(f"{view}/_manifest.json", to_text(_manifest("legacy-run")).encode())
    assert published_night(out, DATE).source == "path view"
    notes = recover(PartitionLayout(out, DATE, "next-run"))
    assert any("adopted" in n for n in notes)
    found = published_night(out, DATE)
    assert (found.run, found.source) == ("legacy-run", "pointer")
    part = next(Path(view).glob("part-*"))
    assert part.stat().st_ino == (Path(found.location) / part.name).stat().st_ino


def test_the_exchange_probe_matches_the_filesystem(tmp_path):
    assert swap.exchange_supported(str(tmp_path)) == (swap.method_for(str(tmp_path)) == "exchange")
    assert swap.method_for("s3://bucket/recs") == "copy"
    assert swap.method_for("hdfs://nn/recs") == "rename"


@pytest.mark.parametrize("output, other", [
    ("{root}/events", "events"),
    ("{root}/events/recommendations", "events"),
    ("{root}/catalog", "catalog"),
    ("{root}/work", "work"),
])
def test_an_output_root_overlapping_an_input_or_the_work_dir_is_refused(tmp_path, output, other):
    cfg = load_config(overrides=[f"paths.events={tmp_path}/events", f"paths.catalog={tmp_path}/catalog",
                                 f"paths.work={tmp_path}/work", f"paths.output={output.format(root=tmp_path)}"])
    with pytest.raises(ConfigError, match=f"overlaps paths.{other}"):
        check_output_location(cfg.paths)


def test_separate_directories_are_accepted(tmp_path):
    cfg = load_config(overrides=[f"paths.events={tmp_path}/in/events", f"paths.catalog={tmp_path}/in/catalog",
                                 f"paths.work={tmp_path}/work", f"paths.output={tmp_path}/recommendations"])
    check_output_location(cfg.paths)
    assert publisher.STAGING_DIR.startswith("_") and publisher.TRASH_DIR.startswith("_")  # skipped by readers


def test_run_keys_start_with_their_utc_start_time_name_their_kind_and_never_repeat():
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    nightly, rollback = new_run_key(), new_run_key("rollback")
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", nightly)
    assert re.fullmatch(r"\d{8}T\d{6}Z-rollback-[0-9a-f]{8}", rollback)
    started = dt.datetime.strptime(nightly[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    assert before <= started <= dt.datetime.now(dt.timezone.utc)
    assert len({new_run_key() for _ in range(100)}) == 100
