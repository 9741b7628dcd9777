"""What schedulers rely on: skip what is already published, one run per date at a time, ordered backfills."""
import datetime as dt
import json
import os
import socket
from types import SimpleNamespace

import pytest

import jobkit
from jobkit import RUN_DATE
from recsys.errors import ExitCode
from recsys.pipelines.nightly import NightlyResult, overall_exit_code, skip_reason
from recsys.publish.manifest import Manifest

pytestmark = [pytest.mark.spark, pytest.mark.slow]
PART = f"dt={RUN_DATE}"


@pytest.fixture(scope="module")
def base(spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly

    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = jobkit.write_dataset(tmp_path_factory.mktemp("data"))
    cfg = jobkit.config(data, store)
    result = run_nightly(spark, cfg, RUN_DATE)
    return SimpleNamespace(store=store, data=data, cfg=cfg, result=result)


def _runs(store) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(store.tracking_uri)
    return len(client.search_runs([client.get_experiment_by_name("recsys").experiment_id]))


def test_a_date_published_with_the_same_model_and_config_is_skipped_without_an_mlflow_run(spark, base, caplog):
    from recsys.pipelines.nightly import run_nightly

    part = base.data / "recommendations" / PART
    before, runs = jobkit.snapshot(part), _runs(base.store)
    with caplog.at_level("INFO"):
        again = run_nightly(spark, base.cfg, RUN_DATE)
    assert again.status == "skipped" and again.exit_code == ExitCode.OK
    assert again.run_id == base.result.run_id
    assert f"recommend {RUN_DATE}: skipped: already published" in caplog.text and "pass --force" in caplog.text
    assert f"model version {base.store.version}" in caplog.text
    assert jobkit.snapshot(part) == before and _runs(base.store) == runs
    # (a forced rerun replaces the partition: tests/test_nightly_job.py::test_a_rerun_replaces_its_date...)


def test_the_skip_decision_compares_model_version_and_config_digest():
    published = Manifest.from_dict({"model": {"version": "3"}, "config_digest": "abc", "run_id": "r1",
                                    "published_at": "t"})
    assert "model version 3 and config digest abc" in skip_reason(published, "3", "abc")
    assert skip_reason(published, "4", "abc") is None        # the alias moved: recompute
    assert skip_reason(published, "3", "abd") is None        # the configuration changed: recompute
    assert skip_reason(None, "3", "abc") is None             # nothing published


def test_force_and_accept_guard_on_the_command_line_reach_the_job(monkeypatch):
    import recsys.pipelines.nightly
    import recsys.spark.session
    from recsys.cli import main as cli

    seen = {}

    def fake_run_dates(spark, cfg, dates, *, force=False, hooks=None, accept_guard=None):
        seen.update(dates=dates, force=force, accept_guard=accept_guard)
        return [NightlyResult(d, None, "out", Manifest(), status="skipped", reason="r") for d in dates]

    monkeypatch.setattr(recsys.pipelines.nightly, "run_dates", fake_run_dates)
    monkeypatch.setattr(recsys.spark.session, "build_session", lambda *a, **k: SimpleNamespace(stop=lambda: None))
    assert cli.main(["recommend", "--date", "2024-05-08", "--force"]) == 0
    assert seen == {"dates": [dt.date(2024, 5, 8)], "force": True, "accept_guard": None}
    assert cli.main(["recommend", "--start-date", "2024-05-30", "--end-date", "2024-06-02"]) == 0
    assert seen == {"dates": [dt.date(2024, 5, 30) + dt.timedelta(days=i) for i in range(4)], "force": False,
                    "accept_guard": None}
    assert cli.main(["recommend", "--date", "2024-05-08", "--accept-guard"]) == 0     # the one date it accepts
    assert seen == {"dates": [dt.date(2024, 5, 8)], "force": False, "accept_guard": dt.date(2024, 5, 8)}


def test_a_second_run_while_the_first_holds_the_date_exits_4_and_leaves_its_lock(spark, base, tmp_path,
                                                                               monkeypatch, caplog):
    lock = tmp_path / "recommendations" / "_locks" / f"{PART}.lock"
    lock.parent.mkdir(parents=True)
    holder = {"run": "the-first-run", "token": "t1", "host": socket.gethostname(), "pid": os.getpid(),
              "pid_started": None, "started_at": "2024-05-08T02:15:00+00:00", "ttl_s": 600}
    lock.write_text(json.dumps(holder))
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(tmp_path, base.store, inputs=base.data)])
    errors = jobkit.errors_logged(caplog)
    assert code == ExitCode.LOCK_HELD == 4
    assert len(errors) == 1 and f"{PART} is locked by run the-first-run (pid {os.getpid()}" in errors[0]
    assert "Traceback" not in caplog.text
    assert json.loads(lock.read_text()) == holder                       # the holder keeps its lock
    assert jobkit.partitions(tmp_path / "recommendations") == []


def test_a_run_whose_lock_was_taken_over_meanwhile_publishes_nothing(spark, base, tmp_path, monkeypatch):
    from recsys.pipelines import nightly
    from recsys.pipelines import nightly_stages as stages
    from recsys.errors import LockHeld

    real = stages.in_pass_report
    lock = tmp_path / "recommendations" / "_locks" / f"{PART}.lock"

    def validate_then_lose_the_lock(*args, **kwargs):   # e.g. the run stalled past its ttl and was replaced
        report = real(*args, **kwargs)
        lock.unlink()
        lock.write_text(json.dumps({"run": "the-new-holder", "token": "t2", "host": socket.gethostname(),
                                    "pid": os.getpid(), "ttl_s": 600}))
        return report

    monkeypatch.setattr(stages, "in_pass_report", validate_then_lose_the_lock)
    with pytest.raises(LockHeld, match="lost the lock on dt=2024-05-08 .*the-new-holder.*nothing was published"):
        nightly.run_nightly(spark, jobkit.config(tmp_path, base.store, inputs=base.data), RUN_DATE)
    assert jobkit.partitions(tmp_path / "recommendations") == []
    assert json.loads(lock.read_text())["run"] == "the-new-holder"      # and it left the new holder's lock alone


def test_a_backfill_runs_dates_in_order_in_one_session_and_stops_at_the_first_failure(spark, base, tmp_path,
                                                                                      monkeypatch, caplog):
    import recsys.spark.session

    import matplotlib.pyplot as plt

    sessions = []
    figures_before = set(plt.get_fignums())
    with caplog.at_level("INFO"):
        monkeypatch.setattr(spark, "stop", lambda: None)
        monkeypatch.setattr(recsys.spark.session, "build_session", lambda *a, **k: sessions.append(1) or spark)
        from recsys.cli import main as cli

        # the catalog snapshot (05-01) is 7, 8, 9 days old on 05-08, 05-09, 05-10: the last is refused
        code = cli.main(["recommend", "--start-date", "2024-05-08", "--end-date", "2024-05-10",
                         *jobkit.recommend_args(tmp_path, base.store, "catalog.max_age_days=8", inputs=base.data)])
    out = tmp_path / "recommendations"
    assert code == ExitCode.BAD_INPUT                                    # the failing date's code
    assert jobkit.partitions(out) == ["dt=2024-05-08", "dt=2024-05-09"]  # the dates before it are published
    assert sessions == [1]                                               # one Spark session for the range
    published = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("recommend ") and ": published " in r.getMessage()]
    assert [m.split(":")[0] for m in published] == ["recommend 2024-05-08", "recommend 2024-05-09"]   # in order
    assert "backfill 2024-05-08..2024-05-10 stopped at 2024-05-10" in caplog.text
    assert "9 days old, older than catalog.max_age_days=8" in jobkit.errors_logged(caplog)[-1]
    second = json.loads((out / "dt=2024-05-09" / "_manifest.json").read_text())["metrics"]
    # the model cache stayed warm: some worker of the second date had the model loaded already
    assert second["model_misses"] < second["workers"]
    assert second["model_hits"] >= 1
    assert set(plt.get_fignums()) == figures_before                     # run plots are closed, not piled up


def test_the_exit_code_of_a_completed_backfill_is_its_worst_date():
    day = dt.date(2024, 5, 8)
    ok = NightlyResult(day, "r", "out", Manifest())
    untracked = NightlyResult(day, None, "out", Manifest(), exit_code=ExitCode.TRACKING_FAILED)
    assert overall_exit_code([ok, ok]) == ExitCode.OK
    assert overall_exit_code([ok, untracked, ok]) == ExitCode.TRACKING_FAILED
    assert overall_exit_code([]) == ExitCode.OK
