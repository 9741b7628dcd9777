"""What ``recsys train`` registers (issue 20): a model fitted on every interaction before the date, with
the newest items and items seen only there in its vocabulary; and a gate that judges on held-out
items neither the candidate nor the holder trained on. Real Spark, real sqlite MLflow store, tiny models.

The data: users 1..60 each view a run of consecutive items on each of days 1..6 (2024-03-01..06),
ending with one newest item per user. Item ``NEWEST_ONLY`` is viewed once, as user 1's newest
interaction, and never otherwise. User 2 first viewed its newest item on day 1 and again on day 6:
its newest item was *seen* before any later cut (the repeat collapses to day 6 in the history). Item
``NEW_ON_DAY5`` first appears on day 5 (user 3, before its run): a model trained before day 5 does not know it.
Users ``LAPSED`` view runs on days 1 and 2 only: a warm night after day 4 trains on a replayed share of them.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import jobkit
from recsys.config import load_config
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition

pytestmark = [pytest.mark.spark, pytest.mark.slow]

UTC = dt.timezone.utc
USERS, ITEMS, DAYS = 60, 40, 6
NEWEST_ONLY = 500
NEW_ON_DAY5 = 600
REPEATER = 2
LAPSED = range(USERS + 1, USERS + 11)
FIRST_TRAINING, SECOND_TRAINING = dt.date(2024, 3, 5), dt.date(2024, 3, 7)


def _write(root: Path) -> None:
    rng = np.random.default_rng(3)
    for day in range(1, DAYS + 1):
        rows = []
        for user in [*range(1, USERS + 1), *(LAPSED if day <= 2 else ())]:
            start = int(rng.integers(0, ITEMS))
            for k in range(3):
                rows.append(dict(user_id=user, item_id=1 + (start + k) % ITEMS, event_type="view",
                                 ts=dt.datetime(2024, 3, day, 8, k, tzinfo=UTC)))
        if day == 1:
            rows.append(dict(user_id=REPEATER, item_id=ITEMS + 1, event_type="view",
                             ts=dt.datetime(2024, 3, 1, 7, tzinfo=UTC)))
        if day == 5:
            rows.append(dict(user_id=3, item_id=NEW_ON_DAY5, event_type="view", ts=dt.datetime(2024, 3, 5, 7, tzinfo=UTC)))
        if day == DAYS:
            rows.append(dict(user_id=1, item_id=NEWEST_ONLY, event_type="view", ts=dt.datetime(2024, 3, day, 23, tzinfo=UTC)))
            rows.append(dict(user_id=REPEATER, item_id=ITEMS + 1, event_type="view",
                             ts=dt.datetime(2024, 3, day, 23, tzinfo=UTC)))
        write_partition(pa.Table.from_pylist(rows, schema=EVENTS_SCHEMA), root / "events", dt.date(2024, 3, day))
    catalog = [dict(item_id=i, available=True, title=f"Item {i}", category="c")
               for i in [*range(1, ITEMS + 2), NEWEST_ONLY, NEW_ON_DAY5]]
    write_partition(pa.Table.from_pylist(catalog, schema=CATALOG_SCHEMA), root / "catalog", dt.date(2024, 3, 1))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("refit")
    _write(root)
    return root


def _config(root: Path, tmp: Path, *extra: str):
    return load_config(overrides=[
        f"paths.events={root / 'events'}", f"paths.catalog={root / 'catalog'}",
        f"paths.output={tmp / 'out'}", f"paths.work={tmp / 'work'}", f"paths.driver_scratch={tmp / 'driver'}",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"mlflow.artifact_location={tmp / 'artifacts'}",
        "history.window_days=30", "train.epochs=2", "train.device=cpu", "train.model.sasrec.dim=8",
        "train.model.sasrec.layers=1", "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8",
        *extra,
    ])


def _unseen_since(root: Path, cutoff: dt.date, before: dt.date) -> int:
    """Users whose newest item before ``before`` they first touched on or after ``cutoff``, from the raw files."""
    import pyarrow.parquet as pq

    latest: dict[tuple[int, int], dt.datetime] = {}
    earliest: dict[tuple[int, int], dt.datetime] = {}
    for e in pq.read_table(root / "events").to_pylist():
        if e["ts"] < dt.datetime.combine(before, dt.time(), UTC):
            key = (e["user_id"], e["item_id"])
            latest[key] = max(latest.get(key, e["ts"]), e["ts"])
            earliest[key] = min(earliest.get(key, e["ts"]), e["ts"])
    newest: dict[int, tuple[dt.datetime, int]] = {}
    for (user, item), ts in latest.items():
        newest[user] = max(newest.get(user, (ts, item)), (ts, item))
    return sum(earliest[(u, item)] >= dt.datetime.combine(cutoff, dt.time(), UTC) for u, (_, item) in newest.items())


def _registered(cfg, version: str):
    from recsys.model.io import load_model
    from recsys.tracking import store as tracking

    return load_model(tracking.model_version_dir(cfg.mlflow.model_name, version, cfg.paths.driver_dir / "models"))


def test_each_users_newest_item_comes_with_when_it_was_first_touched(spark, data_root, tmp_path):
    from recsys.learning.shards import training_histories

    rows = training_histories(spark, _config(data_root, tmp_path), dt.date(2024, 3, 7)).toArrow().to_pylist()
    newest = {r["user_id"]: r["history"][-1] for r in rows}
    first = {r["user_id"]: dt.datetime.fromtimestamp(r["newest_first_us"] / 1e6, UTC) for r in rows}
    assert newest[1] == NEWEST_ONLY and first[1] == dt.datetime(2024, 3, 6, 23, tzinfo=UTC)
    # the repeat collapses to its latest time in the history, but was first touched on day 1
    assert newest[REPEATER] == ITEMS + 1 and first[REPEATER] == dt.datetime(2024, 3, 1, 7, tzinfo=UTC)


@pytest.fixture(scope="module")
def refits(spark, data_root, tmp_path_factory) -> dict:
    """One training at 03-07 each way, under model names of their own: the refit from scratch (the default), none
    (the selected model registered), and the refit that continues the selected model for one epoch."""
    from recsys.pipelines.train import run_training

    tmp = tmp_path_factory.mktemp("refits")
    ways = {"scratch": ["train.refit_epochs=null"], "selected": ["train.refit=false"], "continued": ["train.refit_epochs=1"]}
    out = {}
    for name, extra in ways.items():
        cfg = _config(data_root, tmp, f"mlflow.model_name=refit-{name}", "train.epochs=3", "train.patience=3", *extra)
        result = run_training(spark, cfg, SECOND_TRAINING)
        out[name] = (result, _registered(cfg, result.version))
    return out


def test_the_registered_model_knows_items_seen_only_as_someones_newest(refits):
    result, loaded = refits["scratch"]
    assert NEWEST_ONLY in set(loaded.item_ids.tolist())
    assert loaded.metadata["refit"] is True and loaded.metadata["epochs"] == result.metrics["best_epoch"]
    _, loaded = refits["selected"]
    assert NEWEST_ONLY not in set(loaded.item_ids.tolist())          # what training registered before issue 20
    assert loaded.metadata["refit"] is False


def test_the_gate_judges_on_newest_items_first_touched_after_the_holders_training(spark, data_root, tmp_path):
    """The holder trained before 03-05; the candidate at 03-07 holds out each user's newest item.
    Unseen by both: newest items first touched on 03-05 or 03-06 (not the repeater's, nor those a
    user had also viewed in an earlier day's run), counted from the raw files."""
    from mlflow import MlflowClient

    from recsys.pipelines.train import run_training

    cfg = _config(data_root, tmp_path, "mlflow.model_name=gated", "train.gate_min_users=10", "train.gate_tolerance=1")
    assert run_training(spark, cfg, FIRST_TRAINING).promoted
    unseen = _unseen_since(data_root, FIRST_TRAINING, SECOND_TRAINING)
    assert 10 < unseen < USERS - 1
    # too few unseen users: the holder stays, and the decision says why
    strict = _config(data_root, tmp_path, "mlflow.model_name=gated", f"train.gate_min_users={unseen + 1}")
    kept = run_training(spark, strict, SECOND_TRAINING)
    assert not kept.promoted and f"only {unseen} held-out user(s)" in kept.decision
    # enough of them: both models scored on exactly those users (the tolerance makes the move certain)
    second = run_training(spark, cfg, SECOND_TRAINING)
    metrics = MlflowClient(cfg.mlflow.tracking_uri).get_run(second.run_id).data.metrics
    assert second.promoted and metrics["gate_users"] == unseen
    assert f"on {unseen} held-out user(s) whose newest item was first touched on or after {FIRST_TRAINING}" \
        in second.decision
    assert {"gate_candidate_ndcg_at_10", "gate_holder_ndcg_at_10"} <= set(metrics)     # "@": "_at_" in MLflow


def _held_out_users(spark, cfg, share: float) -> set[int]:
    """The users the shards mark as held out for ``share``: Spark's own bucket and cut, from the raw histories."""
    from recsys.learning.shards import training_histories
    from recsys.model.stream import MIN_HELD_OUT_LEN, held_out_below

    rows = training_histories(spark, cfg, SECOND_TRAINING).toArrow().to_pylist()
    below = held_out_below(share, 0, sum(len(r["history"]) >= MIN_HELD_OUT_LEN for r in rows))
    return {r["user_id"] for r in rows if r["held_out_bucket"] < below and len(r["history"]) >= MIN_HELD_OUT_LEN}


def test_one_fit_holds_out_a_share_of_users_learns_everyone_elses_newest_item_and_gates_on_the_share(
        spark, data_root, tmp_path):
    """``train.held_out_share=0.5`` with ``train.refit=false``: one fit chooses its epoch count on about half the
    users' newest items and registers the model that learned every other user's newest item (user 1's item seen
    nowhere else among them: a seed is picked for which user 1 is not held out). The gate and the repeat blend
    judge on the held-out users only."""
    from mlflow import MlflowClient

    from recsys.pipelines.train import run_training

    share = ["train.held_out_share=0.5", "train.refit=false", "train.gate_min_users=1", "train.gate_tolerance=1"]
    seed = next(s for s in range(42, 80)
                if 1 not in _held_out_users(spark, _config(data_root, tmp_path, f"train.seed={s}"), 0.5))
    cfg = _config(data_root, tmp_path, "mlflow.model_name=one-fit", f"train.seed={seed}", *share)
    held_out = _held_out_users(spark, cfg, 0.5)
    everyone = USERS + len(LAPSED)
    assert 0.25 * everyone < len(held_out) < 0.75 * everyone

    assert run_training(spark, cfg, FIRST_TRAINING).promoted           # the holder, trained before 03-05
    second = run_training(spark, cfg, SECOND_TRAINING)
    run = MlflowClient(cfg.mlflow.tracking_uri).get_run(second.run_id).data
    assert int(run.params["validation_users"]) == len(held_out)
    assert float(run.params["held_out_share"]) == pytest.approx(len(held_out) / everyone, abs=1e-3)
    loaded = _registered(cfg, second.version)
    assert NEWEST_ONLY in set(loaded.item_ids.tolist())                # user 1 is not held out: learned in the one fit
    assert loaded.metadata["refit"] is False and loaded.metadata["held_out_share"] < 1

    everyone_unseen = _unseen_since(data_root, FIRST_TRAINING, SECOND_TRAINING)
    assert 0 < run.metrics["gate_users"] < everyone_unseen              # only held-out users are judged
    # the blend's rows: each held-out user on each day before 03-07 they were active with a history before it
    # (days 2..6; day 2 only for the lapsed users)
    lapsed = len(held_out & set(LAPSED))
    assert 0 < lapsed < len(LAPSED)
    assert run.metrics["repeats_validation_rows"] == 5 * (len(held_out) - lapsed) + lapsed


def _item_rows(loaded, ids):
    index = {int(i): n + 1 for n, i in enumerate(loaded.item_ids)}
    return loaded.model.item_embeddings().detach()[[index[int(i)] for i in ids]]


def test_a_refit_that_continues_the_selected_model_starts_from_its_weights_and_learns_the_newest_only_item(refits):
    """``train.refit_epochs=1``: the registered model is the selected one trained one more epoch on everything,
    its vocabulary grown by the item seen only as user 1's newest; it is not the selected model's weights
    (it trained), and it is close to them (it started there), unlike a refit from scratch."""
    import torch

    _, continued = refits["continued"]
    _, selected = refits["selected"]
    _, scratch = refits["scratch"]
    assert NEWEST_ONLY in set(continued.item_ids.tolist()) and continued.metadata["refit_epochs"] == 1

    known = selected.item_ids
    moved = (_item_rows(continued, known) - _item_rows(selected, known)).norm()
    assert moved > 0                                                           # it trained
    assert moved < 0.5 * (_item_rows(scratch, known) - _item_rows(selected, known)).norm()   # from the selected weights
    assert torch.isfinite(_item_rows(continued, [NEWEST_ONLY])).all()


WARM = ["train.warm_start=true", "train.warm_epochs=1", "train.epochs=3", "train.patience=3", "train.refit_epochs=1",
        "train.gate_min_users=1", "train.warm_replay_share=0.5"]


def test_a_warm_night_starts_from_the_holder_grows_its_vocabulary_is_gated_and_a_full_one_comes_on_the_cadence(
        spark, data_root, tmp_path, refits):
    """``train.warm_start``: the 03-05 training is full (none before it); the 03-07 one starts from its weights
    (version 1, trained before 03-05), with the item first seen on day 5 added to the vocabulary, one epoch, and
    is gated on the users whose newest item the holder never saw (counted from the raw files). Its known items
    stay near the holder's, unlike those of a full training at 03-07 with the same settings (the ``refits``
    fixture's; under another seed than this test's, so that the two cannot share their initial weights). With
    ``train.full_every_nights=3`` the 03-08 training is full again (the last full one was 3 nights before)."""
    from mlflow import MlflowClient

    from recsys.pipelines.train import run_training

    cfg = _config(data_root, tmp_path, "mlflow.model_name=warm", "train.gate_tolerance=1", "train.full_every_nights=3",
                  "train.seed=7", "output.table=null", *WARM)     # the night publishes a path only: no table of its own
    first = run_training(spark, cfg, FIRST_TRAINING)
    assert first.kind == "full" and first.promoted
    second = run_training(spark, cfg, SECOND_TRAINING)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    run = client.get_run(second.run_id).data
    assert second.kind == "warm" and run.tags["recsys.training_kind"] == "warm", run.params["training_reason"]
    assert run.params["warm_from_version"] == first.version and run.params["warm_new_items"] == "1"   # NEW_ON_DAY5
    assert second.metrics["best_epoch"] == 1 and second.promoted and run.tags["recsys.gate_verdict"] == "promoted"
    unseen = _unseen_since(data_root, FIRST_TRAINING, SECOND_TRAINING)
    assert run.metrics["gate_users"] == unseen
    assert run.metrics["val_users"] == unseen           # early stopping on them too, not on users the holder saw
    full_run = client.get_run(first.run_id).data
    assert full_run.metrics["val_users"] == int(full_run.params["validation_users"]) > unseen   # a full night: all
    assert full_run.metrics["fit_users"] == full_run.metrics["refit_users"] == int(full_run.params["users"])
    assert full_run.metrics["fit_epochs"] == 3 and run.metrics["fit_epochs"] == 1   # train.epochs, train.warm_epochs
    replayed = _replayed(spark, cfg, SECOND_TRAINING, since=FIRST_TRAINING, share=0.5)
    assert USERS < replayed < USERS + len(LAPSED)       # the active users and some, not all, of the lapsed ones
    assert run.metrics["fit_users"] == run.metrics["refit_users"] == replayed
    assert run.params["warm_replay_share"] == "0.5"

    holder, warm = _registered(cfg, first.version), _registered(cfg, second.version)
    assert NEW_ON_DAY5 not in set(holder.item_ids.tolist())
    assert {NEW_ON_DAY5, NEWEST_ONLY} <= set(warm.item_ids.tolist()) and warm.metadata["training_kind"] == "warm"
    _, full = refits["continued"]            # seed 42, trained in full at 03-07: 3 epochs and a 1-epoch refit
    known = holder.item_ids
    warm_moved = (_item_rows(warm, known) - _item_rows(holder, known)).norm()
    assert 0 < warm_moved < 0.5 * (_item_rows(full, known) - _item_rows(holder, known)).norm()

    _the_nights_lists_count_the_models_new_items(spark, cfg, warm, holder)

    third = run_training(spark, cfg, dt.date(2024, 3, 8))
    assert third.kind == "full"
    assert "3 night(s) ago (train.full_every_nights=3)" in client.get_run(third.run_id).data.params["training_reason"]


def _replayed(spark, cfg, date: dt.date, *, since: dt.date, share: float) -> int:
    """Users a warm night for ``date`` trains on: those with an event on or after ``since`` (from the raw
    histories) and those of the others whose draw for the night is below ``share``."""
    from recsys.data.contracts import start_of_day_us
    from recsys.learning.shards import training_histories
    from recsys.model.stream import replay_draw

    rows = training_histories(spark, cfg, date).toArrow()
    active = rows.column("newest_us").to_numpy() >= start_of_day_us(since)
    assert (~active).sum() == len(LAPSED)
    drawn = replay_draw(rows.column("held_out_bucket").to_numpy(), date.toordinal()) < share
    return int((active | drawn).sum())


def _the_nights_lists_count_the_models_new_items(spark, cfg, model, previous) -> None:
    """The registered model records the items its predecessor lacked; the night it serves counts them in the
    manifest, as found in the published lists."""
    import pyarrow.parquet as pq

    from recsys.model.io import read_new_item_ids
    from recsys.pipelines.nightly import run_nightly
    from recsys.tracking import store as tracking

    version = tracking.alias_holder(cfg.mlflow.model_name, cfg.mlflow.alias)[0]
    new = read_new_item_ids(tracking.model_version_dir(cfg.mlflow.model_name, version, cfg.paths.driver_dir / "models"))
    assert new.tolist() == sorted(set(model.item_ids.tolist()) - set(previous.item_ids.tolist()))
    assert {NEW_ON_DAY5, NEWEST_ONLY} <= set(new.tolist())
    result = run_nightly(spark, cfg, SECOND_TRAINING)
    lists = pq.read_table(result.output_dir).column("recommendations").to_pylist()
    slots = [r["item_id"] for recs in lists for r in recs if r["item_id"] in set(new.tolist())]
    assert slots, "no list holds a new item: the figures below would not be tested"
    figures = result.manifest.metrics
    assert figures["model_new_items"] == len(new)
    assert figures["new_items_recommended"] == len(set(slots)) and figures["new_item_slots"] == len(slots)


def test_a_warm_night_the_gate_finds_worse_keeps_the_holder_and_the_next_night_trains_in_full(
        spark, data_root, tmp_path):
    """A warm night whose fit diverges (a learning rate of 1000) scores worse than the holder on the users neither
    trained on: the alias stays, the run says ``worse``, and the next night trains from scratch and says why."""
    from mlflow import MlflowClient

    from recsys.pipelines.train import run_training
    from recsys.tracking import store as tracking

    cfg = _config(data_root, tmp_path, "mlflow.model_name=warm-worse", *WARM)
    first = run_training(spark, cfg, FIRST_TRAINING)
    worse = run_training(spark, _config(data_root, tmp_path, "mlflow.model_name=warm-worse", *WARM,
                                        "train.learning_rate=1000"), dt.date(2024, 3, 6))
    assert worse.kind == "warm" and not worse.promoted and "scores worse" in worse.decision
    assert tracking.alias_holder(cfg.mlflow.model_name, cfg.mlflow.alias)[0] == first.version
    assert [t.gate_verdict for t in tracking.finished_trainings(cfg.mlflow)] == ["worse", "promoted"]
    after = run_training(spark, _config(data_root, tmp_path, "mlflow.model_name=warm-worse", *WARM,
                                        "train.gate_tolerance=1"), SECOND_TRAINING)
    reason = MlflowClient(cfg.mlflow.tracking_uri).get_run(after.run_id).data.params["training_reason"]
    assert after.kind == "full" and reason == "the warm training for 2024-03-06 scored worse than the holder at the gate"
    assert after.promoted


def test_training_reads_the_events_window_once_for_its_shards_and_the_repeat_blend_s_days(spark, data_root, tmp_path,
                                                                                        monkeypatch):
    """The histories' shards and the repeat blend's held-out days come from one read of the window (listed, every
    footer checked, read by Spark, kept for the stage): on a log of many small daily partitions a second read cost
    as much as the first."""
    from recsys.data import readers
    from recsys.pipelines.train import run_training

    reads = jobkit.record_calls(monkeypatch, readers, "read_events")    # every listing and read of the events
    cfg = _config(data_root, tmp_path, "mlflow.model_name=read-once", "train.epochs=1")
    result = run_training(spark, cfg, SECOND_TRAINING)
    blend = _registered(cfg, result.version).blend
    assert blend is not None and blend.figures["validation_rows"] > 0      # the blend was chosen, on its rows
    assert [args[1] for args, _ in reads] == [cfg.paths.events]        # (spark, root, ...): one read, of the events
