"""``recsys train`` at scale (issue 21): nothing per user collected to the driver, data-parallel training in two
processes through Spark's TorchDistributor (local mode; the cluster run is in tests/test_cluster.py), a
process killed mid-epoch failing the job with nothing registered, and a rerun that starts clean.

Real Spark (the shared session), a real sqlite MLflow store, the sample generator's data, tiny models.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import mlflow
import pytest

import jobkit
from recsys.config import load_config
from recsys.errors import TrainingProcessFailed
from recsys.hooks import Hooks
from recsys.learning.item_to_item import COUNTS_DDL

pytestmark = [pytest.mark.spark, pytest.mark.slow]

END = dt.date(2024, 3, 10)
DATE = END + dt.timedelta(days=1)
USERS, ITEMS = 400, 60


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    from recsys.data.sample import SampleSpec, generate_sample

    root = tmp_path_factory.mktemp("train-scale")
    generate_sample(root, SampleSpec(users=USERS, items=ITEMS, days=10, seed=11, end_date=END))
    return root


def _config(root: Path, tmp: Path, *extra: str):
    return load_config(overrides=[
        f"paths.events={root / 'events'}", f"paths.catalog={root / 'catalog'}",
        f"paths.output={tmp / 'out'}", f"paths.work={tmp / 'work'}", f"paths.driver_scratch={tmp / 'driver'}",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"mlflow.artifact_location={tmp / 'artifacts'}",
        "history.window_days=30", "train.epochs=4", "train.patience=4", "train.device=cpu",
        "train.model.sasrec.dim=16", "train.model.sasrec.layers=1", "train.model.sasrec.heads=1",
        "train.model.sasrec.max_len=10", "train.batch_size=16", *extra,
    ])


PAIR_COUNTS = [field.split()[0] for field in COUNTS_DDL.split(",")]   # the item-to-item counts' columns: a pair a row


@pytest.fixture
def no_histories_on_the_driver(monkeypatch):
    """Every way a DataFrame reaches the driver refuses a history column, or more rows than the catalog has
    items: what training may collect is catalog-sized (item counts) or a row of totals, never per user. The one
    exception is the item-to-item weights' co-occurrence counts (columns ``PAIR_COUNTS``): a pair of items a row, at
    most the catalog squared and halved (``train.repeats.item_to_item.max_items`` caps it), still never per user."""
    from pyspark.sql.classic.dataframe import DataFrame

    collected: list[tuple[str, list[str], int]] = []

    def guard(name):
        original = getattr(DataFrame, name)

        def guarded(self, *args, **kwargs):
            if "history" in self.columns:
                raise AssertionError(f"DataFrame.{name} of the histories {self.columns}: collected to the driver")
            result = original(self, *args, **kwargs)
            rows = result.num_rows if hasattr(result, "num_rows") else len(result) if hasattr(result, "__len__") else 0
            limit = ITEMS * (ITEMS + 1) // 2 if self.columns == PAIR_COUNTS else ITEMS + 10
            if rows > limit:
                raise AssertionError(f"DataFrame.{name} brought {rows} rows of {self.columns} to the driver")
            collected.append((name, list(self.columns), rows))
            return result

        monkeypatch.setattr(DataFrame, name, guarded)

    for name in ("collect", "toArrow", "toPandas", "_collect_as_arrow", "take", "tail"):
        guard(name)
    return collected


def test_the_guard_catches_a_collect_of_the_histories(spark, data_root, tmp_path, no_histories_on_the_driver):
    """The guard below is live: collecting the histories the way training used to (``toArrow``) trips it."""
    from recsys.learning.shards import training_histories

    with pytest.raises(AssertionError, match="collected to the driver"):
        training_histories(spark, _config(data_root, tmp_path), DATE).toArrow()


def test_training_never_collects_the_histories_to_the_driver(spark, data_root, tmp_path, no_histories_on_the_driver):
    from recsys.pipelines.train import run_training

    result = run_training(spark, _config(data_root, tmp_path, "train.refit=true"), DATE)
    assert result.promoted and result.metrics["val_ndcg@10"] > 0.0
    assert no_histories_on_the_driver, "the guard saw no collect at all: it is not wired"
    assert max(rows for _, columns, rows in no_histories_on_the_driver if columns != PAIR_COUNTS) <= ITEMS + 10
    assert PAIR_COUNTS in [columns for _, columns, _ in no_histories_on_the_driver]   # the weights were fitted


def test_max_users_trains_on_a_seeded_sample_and_builds_only_its_histories(spark, data_root, tmp_path,
                                                                           monkeypatch):
    from recsys.data import history
    from recsys.learning.shards import write_training_shards

    cfg = _config(data_root, tmp_path, "train.max_users=100")
    kept_before = spark.sparkContext._jsc.getPersistentRDDs().size()
    built = jobkit.record_calls(monkeypatch, history, "build_histories")
    first = write_training_shards(spark, cfg, DATE, str(tmp_path / "a"), shards=4)
    again = write_training_shards(spark, cfg, DATE, str(tmp_path / "b"), shards=4)
    assert first.sampled_from > 300 and 70 <= first.users <= 130
    assert (first.users, first.interactions) == (again.users, again.interactions)   # the same users, seeded
    # histories are built from the sample's events only, not every user's, and nothing is left kept
    assert len(built) == 2 and built[0][0][0].select("user_id").distinct().count() == first.users
    assert spark.sparkContext._jsc.getPersistentRDDs().size() == kept_before


def test_the_shards_rows_do_not_depend_on_how_spark_partitioned_the_work(spark, data_root, tmp_path):
    """Training reads the shards' rows in order (each user's window offsets and the shuffle buffer follow it),
    so the same data must give the same files whatever Spark's partitioning upstream of the write: here the
    shuffle partitions (4 in the tests' session, 7), as on a cluster the order its executors' shuffle blocks
    arrive in. Without the sort within each file the two writes hold the same users in another order."""
    import pyarrow.parquet as pq

    from recsys.learning.shards import write_training_shards

    cfg = _config(data_root, tmp_path)
    keys = ("spark.sql.shuffle.partitions", "spark.sql.adaptive.coalescePartitions.enabled")
    before = {key: spark.conf.get(key) for key in keys}
    first = write_training_shards(spark, cfg, DATE, str(tmp_path / "a"), shards=3)
    spark.conf.set(keys[0], "7")
    spark.conf.set(keys[1], "false")     # as a larger input would: adaptive execution keeps the 7
    try:
        second = write_training_shards(spark, cfg, DATE, str(tmp_path / "b"), shards=3)
    finally:
        for key, value in before.items():
            spark.conf.set(key, value)
    assert before[keys[0]] != "7" and len(first.files.paths) == len(second.files.paths) == 3
    for a, b in zip(first.files.paths, second.files.paths):
        left, right = pq.read_table(a), pq.read_table(b)
        assert left.num_rows > 50
        assert left.column("user_id").to_pylist() == right.column("user_id").to_pylist()
        assert left.equals(right)


def test_a_sample_of_users_trains_with_the_whole_populations_vocabulary(spark, data_root, tmp_path):
    """An item only users outside the sample touched stays in the vocabularies: a user's own items stay
    recommendable to them (a repeat), whoever the model trained on."""
    from recsys.learning.shards import write_training_shards

    sample = write_training_shards(spark, _config(data_root, tmp_path, "train.max_users=8"), DATE,
                                   str(tmp_path / "sample"), shards=2)
    everyone = write_training_shards(spark, _config(data_root, tmp_path), DATE, str(tmp_path / "all"), shards=2)
    trained_on = {i for (i,) in spark.read.parquet(str(tmp_path / "sample")).selectExpr("explode(history)").collect()}
    assert sample.users < 20 and len(trained_on) < len(everyone.items.item_ids), "the sample touches every item"
    assert sample.items.item_ids.tolist() == everyone.items.item_ids.tolist()
    assert (sample.items.vocabulary(1, held_out=False).item_ids.tolist()
            == everyone.items.vocabulary(1, held_out=False).item_ids.tolist())
    # only the sample's users hold their newest item out
    assert 0 < sample.held_out_users <= sample.users < everyone.held_out_users

    # a minimum above 1 counts every item's users exactly, as every user's histories do; at 1 the counts are lower
    # bounds (only the ids outside the sample are read) that give the same vocabularies as the exact counts
    exact = write_training_shards(spark, _config(data_root, tmp_path, "train.max_users=8", "train.min_item_count=2"),
                                  DATE, str(tmp_path / "exact"), shards=2)
    assert exact.items.all_events.tolist() == everyone.items.all_events.tolist()
    assert (sample.items.all_events <= exact.items.all_events).all()
    assert (sample.items.all_events < exact.items.all_events).any()
    for held_out in (False, True):
        assert (sample.items.vocabulary(1, held_out=held_out).item_ids.tolist()
                == exact.items.vocabulary(1, held_out=held_out).item_ids.tolist())
    assert set(sample.items.vocabulary(1, held_out=True).item_ids.tolist()) - trained_on     # widened there too


def test_two_processes_train_to_the_validation_ndcg_of_one(spark, data_root, tmp_path):
    """Data-parallel (2 processes, gloo, TorchDistributor local mode) against one process: same data, seed and
    global batch; the model is registered and gated as today."""
    from recsys.pipelines.train import run_training

    one = run_training(spark, _config(data_root, tmp_path / "one", "train.refit=false"), DATE)
    two_cfg = _config(data_root, tmp_path / "two", "train.processes=2")
    two = run_training(spark, two_cfg, DATE)
    assert two.promoted and two.version == "1"
    assert abs(two.metrics["val_ndcg@10"] - one.metrics["val_ndcg@10"]) < 0.05, (one.metrics, two.metrics)
    assert two.metrics["val_ndcg@10"] > 0.1          # far above chance over ~60 items
    run = mlflow.MlflowClient(two_cfg.mlflow.tracking_uri).get_run(two.run_id)
    assert run.data.params["processes"] == "2" and run.info.status == "FINISHED"
    assert len(run.data.metrics) and "refit_epochs" in run.data.metrics
    # each process counts the users of its own shards; the figures are the sum over both
    assert run.data.metrics["fit_users"] == run.data.metrics["refit_users"] == int(run.data.params["users"])
    curve = mlflow.MlflowClient(two_cfg.mlflow.tracking_uri).get_metric_history(two.run_id, "val_ndcg_at_10")
    assert len([m for m in curve if m.step >= 1]) == len(two.curve)   # the processes' learning curve, logged by the driver
    assert not list((tmp_path / "two" / "work" / "train").glob("*/*")), "the shards were not removed"


def test_a_training_process_killed_mid_epoch_fails_the_job_and_registers_nothing(spark, data_root, tmp_path):
    from recsys.pipelines.train import run_training

    cfg = _config(data_root, tmp_path, "train.processes=2")
    with pytest.raises(TrainingProcessFailed, match="nothing was registered") as failure:
        run_training(spark, cfg, DATE, hooks=Hooks(faults=("kill_training_process",)))
    message = str(failure.value)
    assert "process 1: died without an error (killed, or out of memory?)" in message, message
    assert "SIGKILL to itself" in message and "process 0: FAILED" in message, message
    client = mlflow.MlflowClient(cfg.mlflow.tracking_uri)
    assert not client.search_model_versions(f"name='{cfg.mlflow.model_name}'")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FAILED"]

    # the rerun starts clean: the dead attempt's shards are gone, the new one registers version 1
    rerun = run_training(spark, cfg, DATE)
    assert rerun.version == "1" and rerun.promoted
    assert not list((tmp_path / "work" / "train").glob("*/*"))
