"""`recsys backtest` end to end on a tiny repeat-heavy log: the replay writes only under --work, the job's
default lists score on repeats as personal frequency does while a model that masks known items scores nothing
on them, the schedule's cadence, resuming, and the exit-2 errors for ranges and work directories the data cannot replay."""
from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import jobkit
from recsys.data.contracts import EVENTS_SCHEMA, write_partition

pytestmark = [pytest.mark.spark, pytest.mark.slow]

UTC = dt.timezone.utc
FIRST_DAY, LAST_DAY = dt.date(2024, 5, 1), dt.date(2024, 5, 6)
NIGHTS = ("2024-05-05", "2024-05-06")


def _write_log(root: Path) -> None:
    """30 users, each with 3 favourite items (of jobkit's 30) they come back to on most days, and now and then
    an item new to them: most next-day (user, item) pairs are repeats."""
    rng = np.random.default_rng(3)
    rows = []
    for user in range(1, 31):
        favourites = rng.choice(np.arange(1, jobkit.N_ITEMS + 1), size=3, replace=False)
        for day in range(FIRST_DAY.day, LAST_DAY.day + 1):
            if rng.random() > 0.8:
                continue
            ts = dt.datetime(2024, 5, day, int(rng.integers(0, 23)), tzinfo=UTC)
            items = list(rng.choice(favourites, size=2, replace=False))
            if rng.random() < 0.3:
                items.append(int(rng.integers(1, jobkit.N_ITEMS + 1)))
            rows += [dict(user_id=user, item_id=int(i), event_type="view", ts=ts + dt.timedelta(minutes=j))
                     for j, i in enumerate(items)]
    for day in range(FIRST_DAY.day, LAST_DAY.day + 1):
        date = dt.date(2024, 5, day)
        write_partition(pa.Table.from_pylist([r for r in rows if r["ts"].date() == date], schema=EVENTS_SCHEMA),
                        root / "events", date)
    write_partition(jobkit.catalog_table(), root / "catalog", jobkit.CATALOG_DATE)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("backtest")
    _write_log(root / "data")
    store = jobkit.make_store(root / "store")
    return dict(root=root, data=root / "data", store=store)


def _args(world, user: Path, *extra: str) -> list[str]:
    """The user's configuration: output, work and driver scratch under ``user``, the tracking store and its
    registered model in ``world['store']``; small ALS (few blocks: a tiny log), few resamples."""
    settings = [*jobkit.overrides(user, world["store"], inputs=world["data"]),
                "evaluation.backtest.als_rank=4", "evaluation.backtest.als_max_iter=3",
                "evaluation.backtest.als_blocks=2",
                "evaluation.bootstrap_resamples=200", "progress.interval_s=0"]
    return [x for s in settings for x in ("--set", s)] + list(extra)


def _error_lines(caplog) -> list[str]:
    return jobkit.errors_logged(caplog)


TINY_TRAINING = ["train.epochs=1", "train.batch_size=8", "train.model.sasrec.dim=8", "train.model.sasrec.layers=1",
                 "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8", "train.device=cpu"]


@pytest.fixture(scope="module")
def replayed(spark, world, tmp_path_factory):
    """Two nights on the schedule (--train-every 2: the first night trains, the second is not due), through the
    CLI; then the same command again, which resumes."""
    import _pytest.monkeypatch

    root = tmp_path_factory.mktemp("replayed")
    user, work = root / "user", root / "work"
    store_before = jobkit.snapshot(world["store"].root)
    tiny = [x for s in TINY_TRAINING for x in ("--set", s)]
    argv = ["backtest", "--from", NIGHTS[0], "--to", NIGHTS[1], "--work", str(work), "--json", str(root / "bt.json"),
            "--train-every", "2", *_args(world, user, *tiny)]
    from recsys.data import readers
    from recsys.evaluation import baselines

    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        reads = jobkit.record_calls(mp, readers, "read_events_window")     # every read of a night's events window
        fits = jobkit.record_calls(mp, baselines, "als_estimator")          # every ALS the nights fit
        code = jobkit.cli(mp, spark, argv)
        window_reads, als_blocks = len(reads), [args[0].blocks for args, _ in fits]
        doc = json.loads((root / "bt.json").read_text())
        again = jobkit.cli(mp, spark, argv)
    finally:
        mp.undo()
    return dict(root=root, user=user, work=work, code=code, again=again, store_before=store_before, argv=argv,
                doc=doc, resumed=json.loads((root / "bt.json").read_text()), window_reads=window_reads,
                als_blocks=als_blocks)


def test_the_backtest_writes_nothing_where_the_configured_job_writes(replayed, world):
    assert replayed["code"] == 0
    assert not replayed["user"].exists()                              # no output, work, driver scratch, metastore
    assert jobkit.snapshot(world["store"].root) == replayed["store_before"]   # registry, alias and runs untouched
    work = replayed["work"]
    assert jobkit.partitions(work / "output") == [f"dt={n}" for n in NIGHTS]
    assert (work / "mlflow.db").is_file() and (work / "figures").is_dir()


def test_the_schedule_trains_when_due_and_the_nights_use_the_alias_holder(replayed):
    first, second = (n["replay"] for n in replayed["doc"]["nights"])
    assert first["trained_version"] == "1" and first["model_version"] == "1"
    assert "trained_version" not in second and second["training"].startswith("not due")
    assert second["model_version"] == "1"
    assert replayed["doc"]["settings"]["train_every"] == 2
    # the night that trained read its window once for training and its lists, as `recsys night` does; the
    # second night (not due) read its own
    assert replayed["window_reads"] == 2
    assert "trained every 2 night(s)" in " ".join(replayed["doc"]["notes"])
    assert replayed["als_blocks"] == [2, 2]          # each night's ALS in the configured blocks, not Spark's 10


def test_the_default_job_lists_the_repeats_personal_frequency_lists(replayed):
    """The blend learned at training lets the known items in: on a repeat-heavy log the job's lists do what
    the strongest baseline does on repeats, and the interval of the difference does not say it loses."""
    doc = replayed["doc"]
    figures, counts = doc["figures"], doc["counts"]
    assert list(doc["systems"]) == ["job", "pfreq", "pfreq+pop", "pop-masked", "pop", "als-masked", "als"]
    assert counts["repeat_targets"] / counts["targets"] > 0.6         # the log is repeat-heavy
    assert figures["pfreq"]["hr@10.repeat"] > 0.9                     # three favourites, at most three items a day
    assert figures["pfreq"]["hr@10.new"] == 0                         # it lists only what the user had
    assert figures["job"]["hr@10.repeat"] > 0.9 and figures["job"]["repeat_share@10"] > 0.5
    assert figures["job"]["hr@10"] > figures["pop-masked"]["hr@10"] + 0.5
    low, high = doc["differences"]["job - pfreq"]["hr@10"][1:]
    assert high >= 0                                                  # not shown to lose to personal frequency
    assert "recall@5" in figures["job"]                               # recall at scoring.top_n
    nights = doc["nights"]
    assert [n["date"] for n in nights] == list(NIGHTS)
    assert sum(n["user_nights"] for n in nights) == counts["user_nights"]


def test_a_model_that_masks_known_items_loses_the_same_backtest(spark, world, tmp_path):
    """The same log, one night, the blend switched off at training (``train.repeats.learn=false``): the job
    masks every item the user knows, scores nothing on repeats, and the interval says it loses."""
    import _pytest.monkeypatch

    tiny = [x for s in [*TINY_TRAINING, "train.repeats.learn=false"] for x in ("--set", s)]
    argv = ["backtest", "--from", NIGHTS[0], "--to", NIGHTS[0], "--work", str(tmp_path / "work"),
            "--json", str(tmp_path / "bt.json"), "--train-every", "1", *_args(world, tmp_path / "user", *tiny)]
    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        assert jobkit.cli(mp, spark, argv) == 0
    finally:
        mp.undo()
    doc = json.loads((tmp_path / "bt.json").read_text())
    figures = doc["figures"]
    assert figures["job"]["hr@10.repeat"] == 0 and figures["job"]["repeat_share@10"] == 0
    assert figures["pfreq"]["hr@10"] > figures["job"]["hr@10"] + 0.3
    low, high = doc["differences"][f"job - {doc['best_baseline']}"]["hr@10"][1:]
    assert low <= high < 0                                            # the job loses, and the interval says so


def test_the_run_is_recorded_in_the_backtest_store_with_the_per_night_plot(replayed):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{replayed['work'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("recsys-backtest")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert len(runs) == 2                                             # the first run and the resumed one
    run = runs[0]
    assert run.data.tags["recsys.job"] == "backtest" and run.data.params["from"] == NIGHTS[0]
    assert run.data.metrics["job.hr_at_10"] == pytest.approx(replayed["doc"]["figures"]["job"]["hr@10"], abs=1e-6)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"backtest.md", "backtest.json", "plots/backtest_nights.png"} <= artifacts
    # the replayed nights and the training are runs of that store, beside it: not of the user's
    nightly = client.search_runs([client.get_experiment_by_name("recsys").experiment_id])
    assert sorted(r.data.tags["recsys.date"] for r in nightly) == list(NIGHTS)
    assert len(client.search_runs([client.get_experiment_by_name("recsys-training").experiment_id])) == 1


def test_a_second_run_with_the_same_work_resumes_and_one_with_other_settings_is_refused(replayed, spark, world,
                                                                                       monkeypatch, caplog):
    assert replayed["again"] == 0
    resumed = replayed["resumed"]
    # no training again, the published nights kept (the job's own skip rule), their figures kept
    assert [n["replay"]["published"] for n in resumed["nights"]] == ["skipped", "skipped"]
    assert all("trained_version" not in n["replay"] for n in resumed["nights"])
    assert all(n["replay"]["measured"] == "kept from the earlier run" for n in resumed["nights"])
    assert len(jobkit.runs(replayed["work"] / "output")) == 2
    assert resumed["figures"] == replayed["doc"]["figures"]
    caplog.set_level(logging.ERROR)
    argv = [a if a != "2" else "3" for a in replayed["argv"]]          # --train-every 3
    assert jobkit.cli(monkeypatch, spark, argv) == 2
    [line] = _error_lines(caplog)
    assert "holds a backtest with other settings" in line and "train_every 2 -> 3" in line and "--overwrite" in line


def test_one_registered_model_for_every_night_is_imported_not_borrowed(spark, world, tmp_path, monkeypatch):
    """--model-uri: the user's registered version scores the night from the backtest's own registry, no training;
    the user's store is read, never written; a model that records no training date is flagged."""
    before = jobkit.snapshot(world["store"].root)
    argv = ["backtest", "--from", NIGHTS[1], "--to", NIGHTS[1], "--work", str(tmp_path / "work"), "--json",
            str(tmp_path / "bt.json"), "--model-uri", f"models:/{world['store'].model_name}@champion",
            *_args(world, tmp_path / "user")]
    assert jobkit.cli(monkeypatch, spark, argv) == 0
    doc = json.loads((tmp_path / "bt.json").read_text())
    [night] = doc["nights"]
    assert night["replay"]["model_version"] == "1" and "trained_version" not in night["replay"]
    assert "records no training date" in " ".join(doc["notes"])
    assert doc["settings"]["train_every"] is None
    assert jobkit.snapshot(world["store"].root) == before and not (tmp_path / "user").exists()
    assert (tmp_path / "work" / "models" / "imported" / "config.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--from", "2024-05-06", "--to", "2024-05-05"], "--to 2024-05-05 is before --from 2024-05-06"),
    (["--from", "2024-05-01", "--to", "2024-05-02"], "no events before --from 2024-05-01"),
    (["--from", "2024-05-05", "--to", "2024-05-07"], "--to 2024-05-07 is beyond the data"),
    (["--from", "2024-05-05", "--to", "2024-05-06", "--train-every", "0"], "--train-every must be at least 1"),
    (["--from", "2024-05-05", "--to", "2024-05-06", "--train-every", "2", "--model-uri", "models:/x@y"],
     "exclude each other"),
])
def test_ranges_and_options_the_data_cannot_replay_exit_2_in_one_line(spark, world, tmp_path, monkeypatch, caplog,
                                                                       args, message):
    caplog.set_level(logging.ERROR)
    code = jobkit.cli(monkeypatch, spark, ["backtest", *args, "--work", str(tmp_path / "work"),
                                           *_args(world, tmp_path / "user")])
    assert code == 2
    [line] = _error_lines(caplog)
    assert message in line
    assert not (tmp_path / "work").exists() and not (tmp_path / "user").exists()


def test_a_work_directory_over_the_configured_output_or_holding_other_files_is_refused(spark, world, tmp_path,
                                                                                       monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    user = tmp_path / "user"
    nights = ["--from", NIGHTS[0], "--to", NIGHTS[1]]
    assert jobkit.cli(monkeypatch, spark, ["backtest", *nights, "--work", str(user / "recommendations" / "bt"),
                                           *_args(world, user)]) == 2
    assert "overlaps paths.output" in _error_lines(caplog)[-1]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert jobkit.cli(monkeypatch, spark, ["backtest", *nights, "--work", str(foreign), "--overwrite",
                                           *_args(world, user)]) == 2
    assert "holds no backtest" in _error_lines(caplog)[-1]
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_evaluate_reaches_the_backtest_and_asks_for_its_nights(spark, world, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    assert jobkit.cli(monkeypatch, spark, ["evaluate", "--protocol", "backtest", "--work", str(tmp_path / "w"),
                                           *_args(world, tmp_path / "user")]) == 2
    assert "needs --from D1 and --to D2" in _error_lines(caplog)[-1]
    assert jobkit.cli(monkeypatch, spark, ["evaluate", "--protocol", "backtest", "--from", "2024-05-01", "--to",
                                           "2024-05-02", "--work", str(tmp_path / "w"),
                                           *_args(world, tmp_path / "user")]) == 2
    assert "no events before --from 2024-05-01" in _error_lines(caplog)[-1]
