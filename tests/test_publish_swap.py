"""Publishing a partition: old or new, never a mix and never neither, even when killed. No Spark.

The kill tests run ``publish`` in a child Python process held at a named pause point
(``RECSYS_PAUSE_AT``), kill it with SIGKILL once it says it is there, and look at what a reader
would see.
"""
import datetime as dt
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.errors import ConfigError
from recsys.publish import publisher, swap
from recsys.publish.manifest import read as read_manifest
from recsys.publish.publisher import PartitionLayout, check_output_location, publish, recover

DATE = dt.date(2024, 5, 8)
REPO = Path(__file__).resolve().parent.parent

needs_exchange = pytest.mark.skipif(swap.method_for("/tmp") != "exchange", reason="needs renameat2 (Linux)")


def _partition(directory: Path, tag: str, files: int = 3) -> None:
    """A complete partition as Spark leaves it in staging: data files and _SUCCESS."""
    directory.mkdir(parents=True)
    for i in range(files):
        (directory / f"part-{i:05d}-{tag}.parquet").write_bytes(os.urandom(64) + tag.encode())
    (directory / "_SUCCESS").write_bytes(b"")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _leftovers(out: str) -> list[str]:
    """Files anywhere under the output root outside published partitions (staging, trash)."""
    return [str(p) for p in Path(out).rglob("*") if p.is_file() and not p.relative_to(out).parts[0].startswith("dt=")]


def _published_with_old(tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    out = tmp_path / "recommendations"
    old = PartitionLayout(str(out), DATE, "old-run")
    _partition(Path(old.staging_dir), "old")
    publish(old, {"run_id": "old-run", "model": {"version": "1"}, "config_digest": "d"})
    snapshot = _snapshot(out / f"dt={DATE}")
    snapshot.pop("_manifest.json")
    return str(out), snapshot


def _new_staged(out: str, run: str = "new-run") -> tuple[PartitionLayout, dict[str, bytes]]:
    layout = PartitionLayout(out, DATE, run)
    _partition(Path(layout.staging_dir), "new")
    return layout, _snapshot(Path(layout.staging_dir))


@needs_exchange
def test_publish_swaps_the_partition_in_one_step_and_leaves_nothing_behind(tmp_path):
    out, old = _published_with_old(tmp_path)
    layout, new = _new_staged(out)
    publish(layout, {"run_id": "new-run"}, "exchange")
    got = _snapshot(Path(out) / f"dt={DATE}")
    assert json.loads(got.pop("_manifest.json")) == {"run_id": "new-run"}
    assert got == new
    assert _leftovers(out) == []                                # no staging, no trash, no old copy


@needs_exchange
def test_the_exchange_publish_replaces_a_partition_with_one_swap_and_no_intermediate_state(tmp_path, monkeypatch):
    out, _ = _published_with_old(tmp_path)
    layout, _ = _new_staged(out)
    seen, real = [], swap.exchange

    def spy(a, b):   # both complete directories exist up to the instant of the one call that swaps them
        seen.append((Path(a).name, Path(b).name, (Path(a) / "_manifest.json").is_file(), (Path(b) / "_SUCCESS").is_file()))
        real(a, b)

    assert publisher.publish_method(layout) == "exchange"      # what the job picks on this filesystem
    monkeypatch.setattr(swap, "exchange", spy)
    publish(layout, {"run_id": "new-run"}, "exchange")
    assert seen == [("new-run", f"dt={DATE}", True, True)]


@pytest.mark.parametrize("method", ["rename", "copy"])
def test_the_other_publish_methods_give_the_same_result(tmp_path, method):
    out, _ = _published_with_old(tmp_path)
    layout, new = _new_staged(out)
    publish(layout, {"run_id": "new-run"}, method)
    got = _snapshot(Path(out) / f"dt={DATE}")
    assert json.loads(got.pop("_manifest.json")) == {"run_id": "new-run"}
    assert got == new
    assert read_manifest(out, DATE) == {"run_id": "new-run"}
    assert _leftovers(out) == []


def test_staging_without_success_marker_is_never_published(tmp_path):
    out, old = _published_with_old(tmp_path)
    layout, _ = _new_staged(out)
    (Path(layout.staging_dir) / "_SUCCESS").unlink()
    with pytest.raises(RuntimeError, match="has no _SUCCESS"):
        publish(layout, {"run_id": "new-run"})
    seen = _snapshot(Path(out) / f"dt={DATE}")
    assert json.loads(seen.pop("_manifest.json"))["run_id"] == "old-run" and seen == old


_CHILD = """
import sys
from recsys.config import load_hooks
from recsys.publish.publisher import PartitionLayout, publish
publish(PartitionLayout(sys.argv[1], __import__("datetime").date.fromisoformat(sys.argv[2]), sys.argv[3]),
        {"run_id": sys.argv[3]}, sys.argv[4], load_hooks())
print("published", flush=True)
"""


def _publish_killed_at(layout: PartitionLayout, method: str, point: str) -> None:
    """Run publish in a child process, SIGKILL it when it reports reaching ``point``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RECSYS_PAUSE_AT": point, "RECSYS_PAUSE_MAX_S": "120"}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, layout.output_root, str(DATE), layout.run_key, method],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:                       # blocks until the child writes, or EOF if it dies
            if line.startswith(f"recsys-pause: {point}"):
                os.kill(proc.pid, signal.SIGKILL)
                break
        else:
            pytest.fail(f"the child never reached {point}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("method, point, expect", [
    pytest.param("exchange", "before_swap", "old", marks=needs_exchange),
    pytest.param("exchange", "after_swap", "new", marks=needs_exchange),
    ("rename", "before_swap", "old"),
    ("rename", "between_renames", "old"),   # the one moment with no partition: recovery puts the old one back
    ("rename", "after_swap", "new"),
])
def test_a_publish_killed_at_any_point_leaves_the_old_or_the_new_partition_and_the_next_run_recovers(
        tmp_path, method, point, expect):
    out, old = _published_with_old(tmp_path)
    layout, new = _new_staged(out)
    final = Path(out) / f"dt={DATE}"
    _publish_killed_at(layout, method, point)

    if method == "exchange":   # a reader at this instant: one complete partition
        seen = _snapshot(final)
        seen.pop("_manifest.json")
        assert seen == (old if expect == "old" else new)

    # the next run of the date (holding the lock) recovers first, then publishes its own output
    notes = recover(PartitionLayout(out, DATE, "next-run"))
    seen = _snapshot(final)
    manifest = json.loads(seen.pop("_manifest.json"))
    assert (seen, manifest["run_id"]) == ((old, "old-run") if expect == "old" else (new, "new-run"))
    assert _leftovers(out) == []
    if point == "between_renames":
        assert any("restored" in n for n in notes)
    again, fresh = _new_staged(out, "next-run")
    publish(again, {"run_id": "next-run"})
    seen = _snapshot(final)
    seen.pop("_manifest.json")
    assert seen == fresh


def test_an_object_store_copy_killed_before_success_counts_as_not_published(tmp_path):
    out, _ = _published_with_old(tmp_path)
    layout, _ = _new_staged(out)
    _publish_killed_at(layout, "copy", "after_swap")          # data and manifest copied, _SUCCESS not yet
    assert not (Path(out) / f"dt={DATE}" / "_SUCCESS").exists()
    assert read_manifest(out, DATE) is None                    # so the next run will not skip the date
    notes = recover(PartitionLayout(out, DATE, "next-run"))
    assert any("has no _SUCCESS" in n for n in notes)


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
