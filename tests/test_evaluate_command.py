"""`recsys evaluate` end to end on tiny data: both protocols, the JSON, the MLflow run, and no leakage."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recsys.config import load_config
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition

pytestmark = [pytest.mark.spark, pytest.mark.slow]

UTC = dt.timezone.utc
N_ITEMS = 30
UNAVAILABLE = (31, 32)           # in the catalog, never available: never ranked
START = dt.datetime(2024, 3, 1, tzinfo=UTC)
TIED_USER = 1                     # all of this user's events share one timestamp


def _write_dataset(root: Path) -> list[dict]:
    """Users walk the items in order (i is followed by i + 1), about one item a day from their own start."""
    rng = np.random.default_rng(0)
    rows = []
    for user in range(1, 41):
        start, n = int(rng.integers(0, N_ITEMS)), int(rng.integers(4, 12))
        first = START + dt.timedelta(days=int(rng.integers(0, 10)), hours=int(rng.integers(0, 24)))
        for t in range(n):
            ts = first if user == TIED_USER else first + dt.timedelta(days=t, minutes=int(rng.integers(0, 600)))
            rows.append(dict(user_id=user, item_id=(start + t) % N_ITEMS + 1, event_type="rating", ts=ts))
    rows.append(dict(user_id=999, item_id=5, event_type="rating", ts=START))       # one interaction: never tested
    by_day: dict[dt.date, list[dict]] = {}
    for row in rows:
        by_day.setdefault(row["ts"].date(), []).append(row)
    for day, day_rows in by_day.items():
        write_partition(pa.Table.from_pylist(day_rows, schema=EVENTS_SCHEMA), root / "events", day)
    catalog = [dict(item_id=i, available=i not in UNAVAILABLE, title=f"Item {i}", category="c")
               for i in range(1, N_ITEMS + 3)]
    write_partition(pa.Table.from_pylist(catalog, schema=CATALOG_SCHEMA), root / "catalog", START.date())
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    rows = _write_dataset(root / "data")
    cfg = load_config(overrides=[
        f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}", f"mlflow.artifact_location={root / 'artifacts'}",
        f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}", "train.device=cpu",
        "train.epochs=3", "train.batch_size=16", "train.learning_rate=0.005",
        "train.model.sasrec.dim=16", "train.model.sasrec.layers=1", "train.model.sasrec.heads=1",
        "train.model.sasrec.max_len=8", "train.model.gru4rec.dim=16", "train.model.gru4rec.max_len=8",
        "evaluation.als.ranks=[4]", "evaluation.als.reg_params=[0.1, 1.0]", "evaluation.als.alphas=[1.0]",
        "evaluation.als.max_iter=3", "evaluation.als.blocks=2", "evaluation.bootstrap_resamples=200",
    ])
    return dict(root=root, data=root / "data", rows=rows, cfg=cfg)


@pytest.fixture(scope="module")
def loo(spark, dataset):
    import _pytest.monkeypatch
    import torch

    import jobkit
    from recsys.evaluation import baselines
    from recsys.evaluation.evaluate import EvaluationRequest, run_evaluation

    torch.set_num_threads(1)
    out = dataset["root"] / "loo.json"
    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        fits = jobkit.record_calls(mp, baselines, "als_estimator")          # every ALS of the grid and its refit
        result = run_evaluation(spark, dataset["cfg"], EvaluationRequest(dataset["data"], "loo", ks=(5, 10),
                                                                         json_path=out))
    finally:
        mp.undo()
    return dict(result=result, json=json.loads(out.read_text()), als_blocks=[args[0].blocks for args, _ in fits])


def test_loo_writes_the_json_as_specified(loo):
    doc = loo["json"]
    assert doc["protocol"] == "loo" and doc["k"] == [5, 10]
    assert list(doc["models"]) == ["popularity", "als", "sasrec", "sasrec-heldout", "gru4rec"]
    assert doc["default_model"] == "sasrec"
    for name, metrics in doc["models"].items():
        for k in (5, 10):
            for m in ("ndcg", "hr", "recall", "mrr", "coverage"):
                assert 0.0 <= metrics[f"{m}@{k}"] <= 1.0, (name, m, k)
            assert 0.0 <= metrics[f"pop_pct@{k}"] <= 100.0
        assert metrics["hr@10"] >= metrics["hr@5"]
        assert metrics["recall@10"] == metrics["hr@10"]          # one target per user
    # the pattern is sequential: a sequence model must beat popularity on it even after 3 epochs
    assert doc["models"]["sasrec"]["hr@10"] > doc["models"]["popularity"]["hr@10"]


def test_every_als_fit_of_the_grid_and_the_refit_is_in_the_configured_blocks(loo):
    assert loo["als_blocks"] == [2, 2, 2]          # two grid points and the chosen one's refit; Spark's default: 10


def test_loo_table_has_intervals_and_differences_to_als(loo):
    table = loo["result"].table
    assert "| sasrec (default) |" in table and "| als |" in table
    assert "Paired difference to als" in table and "NDCG ratio to als" in table
    assert "40 test users" in table                              # user 999 has one interaction: not tested
    assert "chosen on validation" in table
    # the default model is refitted on the test-phase histories (as `recsys train` does); the fit on the
    # validation phase alone, what training registered before, is the row after it
    notes = loo["result"].comparison.notes
    epoch = loo["result"].details["sasrec"]["best_epoch"]
    refit = loo["result"].details["sasrec"]["refit_epochs"]
    assert refit == min(2, 3)          # the default continued refit: train.refit_epochs 2, train.epochs 3 here
    assert f"epoch {epoch} of" in notes["sasrec"]
    assert f"refitted for {refit} epochs on the test-phase histories" in notes["sasrec"]
    assert "before its refit" in notes["sasrec-heldout"] and "refitted" not in notes["sasrec-heldout"]
    comparison = loo["result"].comparison
    for name in ("popularity", "sasrec", "gru4rec"):
        diff, lo, hi = comparison.differences[name]["ndcg@10"]
        assert lo <= diff <= hi


def test_loo_run_is_logged_to_mlflow_with_protocol_and_seeds(loo, dataset):
    from mlflow import MlflowClient

    client = MlflowClient(dataset["cfg"].mlflow.tracking_uri)
    run = client.get_run(loo["result"].run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "recsys-evaluation"
    params = run.data.params
    assert params["protocol"] == "loo" and params["tie_break_seed"] == "7" and params["bootstrap_seed"] == "0"
    assert params["train_seed"] == "42" and params["als_chosen"].startswith("rank=4")
    assert run.data.metrics["sasrec.ndcg_at_10"] == pytest.approx(loo["json"]["models"]["sasrec"]["ndcg@10"], abs=1e-6)
    assert "als.ndcg_at_10.lo" in run.data.metrics and "sasrec.ndcg_at_10.diff_to_als" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"evaluation.md", "evaluation.json", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/learning_curve_sasrec.png", "plots/learning_curve_gru4rec.png"}


def test_loo_split_never_tests_what_models_train_on_and_breaks_time_ties_by_a_seeded_hash(spark, dataset):
    from recsys.evaluation.protocols import load_loo

    splits = {seed: load_loo(spark, str(dataset["data"]), tie_break_seed=seed) for seed in (1, 2, 3)}
    split = splits[1]
    assert split.test.candidates.tolist() == list(range(1, N_ITEMS + 1))        # unavailable items are not ranked
    assert 999 not in split.user_ids[split.test.rows]
    for e, row in enumerate(split.test.rows):
        target = split.test.targets.items[e]
        assert target not in split.valid.history.to_lists()[row]               # not trained on
        assert target not in split.test.history.to_lists()[row]                # not read at test time
    # the tied user's test item depends on the seed, not on item ids; the same seed repeats itself
    row = int(np.flatnonzero(split.user_ids == TIED_USER)[0])
    tested = {seed: int(s.test.targets.items[list(s.test.rows).index(row)]) for seed, s in splits.items()}
    assert len(set(tested.values())) > 1
    again = load_loo(spark, str(dataset["data"]), tie_break_seed=1)
    assert np.array_equal(again.test.targets.items, split.test.targets.items)


def test_temporal_tests_the_following_days_on_items_new_to_each_user(spark, dataset):
    from recsys.evaluation.protocols import load_temporal

    split_date = dt.date(2024, 3, 15)
    split = load_temporal(spark, str(dataset["data"]), split_date=split_date, test_days=5, tie_break_seed=7)
    cut = dt.datetime.combine(split_date, dt.time(), tzinfo=UTC)
    valid_cut = cut - dt.timedelta(days=5)
    events = dataset["rows"]
    for e, row in enumerate(split.test.rows):
        user = int(split.user_ids[row])
        before = {r["item_id"] for r in events if r["user_id"] == user and r["ts"] < cut}
        window = {r["item_id"] for r in events if r["user_id"] == user and cut <= r["ts"] < cut + dt.timedelta(days=5)}
        assert set(split.test.history.to_lists()[row].tolist()) == before
        assert set(split.test.targets.to_lists()[e].tolist()) == window - before
    for row in range(len(split.user_ids)):
        user = int(split.user_ids[row])
        assert set(split.valid.history.to_lists()[row].tolist()) == \
            {r["item_id"] for r in events if r["user_id"] == user and r["ts"] < valid_cut}
    assert split.info["split_date"] == "2024-03-15" and split.test.users > 0 and split.valid.users > 0


def test_temporal_end_to_end(spark, dataset):
    from recsys.evaluation.evaluate import EvaluationRequest, run_evaluation

    cfg = load_config(overrides=[
        f"mlflow.tracking_uri={dataset['cfg'].mlflow.tracking_uri}", f"paths.work={dataset['root'] / 'work'}", f"paths.driver_scratch={dataset['root'] / 'driver'}",
        f"mlflow.artifact_location={dataset['root'] / 'artifacts'}", "train.device=cpu", "train.epochs=2",
        "train.model.sasrec.dim=16", "train.model.sasrec.layers=1", "train.model.sasrec.max_len=8",
        "evaluation.models=[popularity, sasrec]", "evaluation.bootstrap_resamples=50",
    ])
    out = dataset["root"] / "temporal.json"
    result = run_evaluation(spark, cfg, EvaluationRequest(dataset["data"], "temporal", split_date=dt.date(2024, 3, 15),
                                                          test_days=5, json_path=out, seeds=2))
    doc = json.loads(out.read_text())
    assert doc["protocol"] == "temporal" and doc["k"] == [10]
    assert list(doc["models"]) == ["popularity", "sasrec", "sasrec-heldout"]
    assert result.comparison.reference is None and "Paired difference to" not in result.table   # no ALS, no reference
    # --seeds 2: each sequence row is the mean of two trainings (seeds 42 and 43), both shown
    for row in ("sasrec", "sasrec-heldout"):
        by_seed = result.details[row]["seed_ndcg@10"]
        assert len(by_seed) == 2 and doc["models"][row]["ndcg@10"] == pytest.approx(np.mean(by_seed), abs=1e-4)
        assert "2 trainings, seeds 42, 43" in result.comparison.notes[row]
    assert "seeds" not in result.details["popularity"]
    # the refit against its own held-out fit, paired over users and seeds: in the table and in MLflow
    diff, lo, hi = result.comparison.pair_differences["sasrec - sasrec-heldout"]["ndcg@10"]
    assert lo <= diff <= hi and "| sasrec - sasrec-heldout |" in result.table
    from mlflow import MlflowClient
    logged = MlflowClient(cfg.mlflow.tracking_uri).get_run(result.run_id).data.metrics
    assert logged["sasrec.ndcg_at_10.diff_to_sasrec-heldout"] == pytest.approx(diff, abs=1e-6)


def test_evaluate_command_line_and_its_errors(tmp_path):
    from recsys.cli.main import build_parser, main
    from recsys.errors import ExitCode

    args = build_parser().parse_args(["evaluate", "--data", "d", "--protocol", "temporal", "--k", "5", "--k", "20",
                                      "--split-date", "2024-01-02", "--test-days", "7", "--json", "o.json"])
    assert (args.protocol, args.k, args.test_days, str(args.split_date)) == ("temporal", [5, 20], 7, "2024-01-02")
    assert build_parser().parse_args(["evaluate", "--data", "d"]).protocol == "loo"
    # a directory that is not a dataset fails with exit code 2 and says what --data must be
    assert main(["evaluate", "--data", str(tmp_path), "--set", "spark.master=local[1]"]) == ExitCode.BAD_INPUT
    # loo and temporal need --data (the backtest reads the configured paths instead), --from/--to are the backtest's
    assert main(["evaluate", "--protocol", "loo"]) == ExitCode.BAD_INPUT
    assert main(["evaluate", "--data", "d", "--from", "2024-01-02", "--to", "2024-01-03"]) == ExitCode.BAD_INPUT


def test_a_bf16_row_ranks_the_same_model_through_the_jobs_core(spark, dataset):
    """``--set scoring.dtype=bfloat16`` adds ``sasrec@bfloat16`` right after ``sasrec``: the model
    that row trained, ranked by the job's core in bf16 (refused on CPUs without bf16 support)."""
    from recsys.evaluation.evaluate import EvaluationRequest, run_evaluation
    from recsys.scoring.core import cpu_bf16_supported

    if not cpu_bf16_supported():
        pytest.skip("this CPU has neither AVX-512-BF16 nor AMX-BF16: the core refuses bf16 here")
    cfg = load_config(overrides=[
        f"mlflow.tracking_uri={dataset['cfg'].mlflow.tracking_uri}", f"paths.work={dataset['root'] / 'work'}",
        f"paths.driver_scratch={dataset['root'] / 'driver'}", f"mlflow.artifact_location={dataset['root'] / 'artifacts'}",
        "train.device=cpu", "train.epochs=2", "train.model.sasrec.dim=16", "train.model.sasrec.layers=1",
        "train.model.sasrec.max_len=8", "evaluation.models=[popularity, sasrec]", "evaluation.bootstrap_resamples=50",
        "scoring.dtype=bfloat16", "scoring.top_n=10", "train.refit=false",
    ])
    out = dataset["root"] / "bf16.json"
    result = run_evaluation(spark, cfg, EvaluationRequest(dataset["data"], "loo", ks=(10,), json_path=out))
    doc = json.loads(out.read_text())
    assert list(doc["models"]) == ["popularity", "sasrec", "sasrec@bfloat16"]     # train.refit=false: no -heldout row
    assert "ranked by recsys.scoring.core in bfloat16" in result.comparison.notes["sasrec@bfloat16"]
    fp32, bf16 = (doc["models"][m]["ndcg@10"] for m in ("sasrec", "sasrec@bfloat16"))
    assert abs(fp32 - bf16) < 0.05          # the same model: bf16 moves a rank here and there, not the figure


def test_a_refit_that_continues_the_selected_model_is_what_evaluate_tests_when_training_would(spark, dataset, caplog):
    """``train.refit_epochs``: evaluate refits as ``recsys train`` would, continuing the model chosen on validation
    for that many epochs on the test phase's histories (not training again from scratch)."""
    import logging

    from recsys.evaluation.evaluate import EvaluationRequest, run_evaluation

    cfg = load_config(overrides=[
        f"mlflow.tracking_uri={dataset['cfg'].mlflow.tracking_uri}", f"paths.work={dataset['root'] / 'work'}",
        f"paths.driver_scratch={dataset['root'] / 'driver'}", f"mlflow.artifact_location={dataset['root'] / 'artifacts'}",
        "train.device=cpu", "train.epochs=3", "train.refit_epochs=1", "train.model.sasrec.dim=16",
        "train.model.sasrec.layers=1", "train.model.sasrec.max_len=8", "evaluation.models=[sasrec]",
        "evaluation.bootstrap_resamples=20",
    ])
    with caplog.at_level(logging.INFO, logger="recsys.evaluation.evaluate"):
        result = run_evaluation(spark, cfg, EvaluationRequest(dataset["data"], "temporal", split_date=dt.date(2024, 3, 15),
                                                              test_days=5))
    assert result.details["sasrec"]["refit_epochs"] == 1
    assert "refitted for 1 epochs on the test-phase histories" in result.comparison.notes["sasrec"]
    assert any("for 1 epochs, continuing the selected model" in r.getMessage() for r in caplog.records)
