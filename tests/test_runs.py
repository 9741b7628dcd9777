"""``recsys runs`` on the sqlite default store, the run's note/inputs/model link, and live progress lines.

One published run (with a progress line every 0.2 s) and one run failing on bad input are recorded
in the module's store; the tests read them back the way an operator would.
"""
import datetime as dt
import json
import logging
import re

import pytest

import jobkit
from jobkit import N_USERS, RUN_DATE
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark, pytest.mark.slow]
USERS_PER_TASK = 5                  # automatic task sizing: N_USERS users in tasks of at most 5
BAD_DATE = dt.date(2024, 4, 20)     # before the only catalog snapshot: exit code 2 after the MLflow run started


@pytest.fixture(scope="module")
def recorded(spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly

    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = jobkit.write_dataset(tmp_path_factory.mktemp("data"))
    cfg = jobkit.config(data, store, "progress.interval_s=0.2", "scoring.partitions=0",
                        f"scoring.users_per_task={USERS_PER_TASK}", "scoring.chunk_size=1")
    progress, logger = _Capture(), logging.getLogger("recsys")
    level = logger.level
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        result = run_nightly(spark, cfg, RUN_DATE)
    finally:
        logger.removeHandler(progress)
        logger.setLevel(level)
    with pytest.raises(Exception) as failed:
        run_nightly(spark, cfg, BAD_DATE)
    return store, data, result, progress.lines, failed.value


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _runs(monkeypatch, spark, capsys, recorded, *args: str) -> tuple[int, str]:
    store, data, *_ = recorded
    capsys.readouterr()
    code = jobkit.cli(monkeypatch, spark, ["runs", *args, *jobkit.recommend_args(data, store)])
    return code, capsys.readouterr().out


def test_runs_lists_published_and_failed_runs_newest_first_with_their_figures(recorded, spark, monkeypatch, capsys):
    _, _, result, _, failure = recorded
    code, out = _runs(monkeypatch, spark, capsys, recorded, "--json")
    assert code == ExitCode.OK
    rows = json.loads(out)
    assert [(r["date"], r["status"], r["exit_code"]) for r in rows] == [
        (str(BAD_DATE), "failed", 2), (str(RUN_DATE), "published", 0)]
    failed, published = rows
    assert "catalog" in failed["error"] and failed["note"].startswith(f"Failed for {BAD_DATE} with exit code 2")
    assert published["run_id"] == result.run_id and published["model_version"] == "1"
    assert published["users"] == N_USERS and published["users_per_s"] > 0 and published["wall_s"] > 0
    assert {"read_catalog", "histories", "score", "validate", "publish"} <= set(published["stages_s"])
    assert published["problems"] == {}                     # nothing dropped, no fallback users in this dataset

    code, out = _runs(monkeypatch, spark, capsys, recorded, "--last", "1")
    lines = out.splitlines()
    assert code == ExitCode.OK and len(lines) == 2 and lines[0].split()[:4] == ["date", "status", "exit", "guard"]
    assert lines[1].split()[:3] == [str(BAD_DATE), "failed", "2"]

    code, out = _runs(monkeypatch, spark, capsys, recorded, "--date", str(RUN_DATE), "--json")
    assert [r["run_id"] for r in json.loads(out)] == [result.run_id]


def test_runs_show_prints_the_note_inputs_plots_and_manifest(recorded, spark, monkeypatch, capsys):
    _, data, result, _, _ = recorded
    code, out = _runs(monkeypatch, spark, capsys, recorded, "show", str(RUN_DATE))
    assert code == ExitCode.OK
    assert out.startswith(f"run {result.run_id} (recommend {RUN_DATE}), date {RUN_DATE}: published, exit code 0")
    assert f"Published recommendations for {RUN_DATE}: {N_USERS} users" in out
    assert re.search(r"events window: events 2024-05-01\.\.2024-05-07 digest [0-9a-f]{16} from .*/events", out)
    assert re.search(r"catalog snapshot: catalog 2024-05-01 digest [0-9a-f]{16} from .*/catalog/dt=2024-05-01", out)
    assert "plots/score_distribution.png" in out and "plots/popularity_long_tail.png" in out
    assert f'"run_id": "{result.run_id}"' in out           # the manifest

    code, out = _runs(monkeypatch, spark, capsys, recorded, "show", result.run_id, "--json")
    shown = json.loads(out)
    assert shown["manifest"]["run_id"] == result.run_id and len(shown["inputs"]) == 2
    assert all(p.endswith(".png") for p in shown["plots"]) and len(shown["plots"]) == 3


def test_runs_show_of_an_unknown_date_says_what_to_do(recorded, spark, monkeypatch, capsys, caplog):
    code, _ = _runs(monkeypatch, spark, capsys, recorded, "show", "2030-01-01")
    errors = jobkit.errors_logged(caplog)
    assert code == ExitCode.BAD_INPUT and len(errors) == 1 and "no nightly run for 2030-01-01" in errors[0]


def test_the_model_version_links_to_the_runs_that_used_it(recorded):
    from mlflow import MlflowClient

    store, _, result, _, _ = recorded
    mv = MlflowClient(store.tracking_uri, store.tracking_uri).get_model_version(store.model_name, store.version)
    assert mv.tags == {f"recsys.used_by.{RUN_DATE}": result.run_id}


def test_a_long_stage_logs_progress_lines_with_tasks_and_time_left(recorded):
    lines = [line for line in recorded[3] if "score users:" in line]
    assert lines, "no progress line while scoring"
    pattern = re.compile(r"^\[recommend 2024-05-08\] score users: (no tasks started yet|(\d+)/(\d+) tasks), "
                         r".*(about \S+ left|time left unknown yet), \S+ so far$")
    counted = []
    for line in lines:
        match = pattern.match(line)
        assert match, line
        if match.group(2):
            assert int(match.group(2)) <= int(match.group(3))
            counted.append(line)
    assert counted, f"no line counted tasks: {lines}"


def test_automatic_task_sizing_splits_scoring_by_users_per_task_in_whole_waves(recorded, spark):
    import math

    result = recorded[2]
    cores = spark.sparkContext.defaultParallelism
    expected = math.ceil(math.ceil(N_USERS / USERS_PER_TASK) / cores) * cores
    assert result.manifest.metrics["tasks"] == expected
    assert result.manifest.counts.rows == N_USERS   # hash-split by user: every user once


def test_progress_line_reads_tasks_users_rate_and_time_left():
    from recsys.spark.task_progress import Snapshot, format_line

    line = format_line("[recommend 2024-05-08] score users", Snapshot(tasks_done=10, tasks_total=40, rows=250_000),
                       elapsed=30.0, expected_users=1_000_000, users_per_s=10_000.0)
    assert line == ("[recommend 2024-05-08] score users: 10/40 tasks, 250,000 of 1,000,000 users (25%), "
                    "10,000 users/s, about 1m15s left, 30s so far")
    connect = format_line("x", Snapshot(tasks_done=1, tasks_total=4, bytes_read=2_000_000,
                                        note="user counts are not available over Spark Connect"),
                          elapsed=10.0, expected_users=100, users_per_s=None)
    assert connect == ("x: 1/4 tasks, 2.0 MB read, about 30s left, 10s so far, "
                       "user counts are not available over Spark Connect")
    shuffle = format_line("x", Snapshot(tasks_done=2, tasks_total=9, bytes_read=0,
                                        note="user counts are not available over Spark Connect"),
                          elapsed=15.0, expected_users=100, users_per_s=None)
    assert shuffle == "x: 2/9 tasks, about 52s left, 15s so far, user counts are not available over Spark Connect"


def test_the_pace_behind_the_time_left_starts_at_the_first_counted_line():
    """The 1M-user scale test's own figures: the first line's 30 s include the shuffle's read and the
    model's load, so later lines take the pace from the first counted line on, not from the start."""
    from recsys.spark.task_progress import Pace, Snapshot, format_line

    pace = Pace(started=0.0)
    assert pace.users_per_s(30.0, None) is None and pace.users_per_s(30.0, 0) is None   # nothing counted yet
    assert pace.users_per_s(30.0, 96_237) == pytest.approx(96_237 / 30)                 # one line: the average
    assert pace.users_per_s(45.0, 96_237) == pytest.approx(96_237 / 45)                 # no task since: the average
    rate = pace.users_per_s(60.0, 288_072)
    assert rate == pytest.approx((288_072 - 96_237) / 30)
    line = format_line("score users", Snapshot(tasks_done=6, tasks_total=20, rows=288_072), elapsed=60.0,
                       expected_users=864_120, users_per_s=rate)
    assert "6,394 users/s, about 1m30s left" in line                                    # it took 1m38s
