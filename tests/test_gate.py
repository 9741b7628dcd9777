"""The training gate on real registered versions in a throw-away sqlite MLflow store.

Two real models are registered: one trained on a plain pattern (good) and one untrained (bad). The
gate scores both the candidate and the alias holder itself (from its registered files) on the same
held-out users, so the decisions below come from real scores, not from numbers the test made up.
A holder that records its training date is judged only on held-out items first touched on or
after that date: the items neither model trained on.
"""
from __future__ import annotations

import datetime as dt

import mlflow
import numpy as np
import pytest

from recsys.tracking import store as tracking
from recsys.config import load_config
from recsys.model.io import save_model
from recsys.model.sasrec import SASRec, SASRecConfig
from recsys.model.training import TrainSettings, fit
from recsys.sequences import Sequences, Vocabulary
from recsys.learning.split import mean_gain, split_last_item
from recsys.pipelines.train import GateCandidate, _gate

pytestmark = pytest.mark.slow   # the module's fixture trains a model and creates a sqlite MLflow store: 10-20 s

NUM_ITEMS = 30
ITEM_IDS = np.arange(1, NUM_ITEMS + 1) * 10           # external ids differ from model indices on purpose
CONFIG = SASRecConfig(num_items=NUM_ITEMS, dim=16, layers=1, heads=1, max_len=8, dropout=0.0)


def _day_us(day: int) -> int:
    return int(dt.datetime(2025, 1, day, 12, tzinfo=dt.timezone.utc).timestamp()) * 1_000_000


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A split, a good and a bad model, and a store; versions are registered per test."""
    root = tmp_path_factory.mktemp("gate")
    rng = np.random.default_rng(0)
    runs = [((s + np.arange(n)) % NUM_ITEMS) for s, n in zip(rng.integers(0, NUM_ITEMS, 120), rng.integers(5, 12, 120))]
    # each user first touched their newest item on day (user % 10) of January 2025, UTC
    first_us = np.array([_day_us(1 + u % 10) for u in range(len(runs))])
    split = split_last_item(Sequences.from_lists([ITEM_IDS[r] for r in runs]), first_us=first_us)
    vocab = Vocabulary(ITEM_IDS)
    train, _ = vocab.map_sequences(split.train)
    good = fit(train, CONFIG, TrainSettings(epochs=8, batch_size=16, learning_rate=5e-3, seed=1, num_threads=1)).model
    bad = SASRec(CONFIG).eval()
    scores = {which: mean_gain(split.user_gains(model, ITEM_IDS, "cpu")) for which, model in (("good", good), ("bad", bad))}
    assert scores["good"] > scores["bad"] + 0.2          # the premise of the tests below
    return dict(root=root, split=split, models={"good": good, "bad": bad}, scores=scores)


@pytest.fixture
def store(world, request, tmp_path):
    """A registered model of its own per test, in the module's store (creating a sqlite store costs
    seconds): (config factory, register(which) -> version)."""
    root = world["root"]
    model_name = f"gate-{request.node.name[5:40]}"

    def config(tolerance: float = 0.0, min_users: int = 10):
        return load_config(overrides=[
            f"mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}", f"mlflow.artifact_location={root / 'art'}",
            f"paths.work={tmp_path / 'work'}", f"paths.driver_scratch={tmp_path / 'driver'}", f"mlflow.model_name={model_name}", f"train.gate_tolerance={tolerance}",
            f"train.gate_min_users={min_users}",
        ])

    cfg = config()
    experiment = tracking.setup(cfg.mlflow, "gate-test")

    def register(which: str, trained_before: str | None = None) -> str:
        metadata = {"trained_before": trained_before} if trained_before else None
        model_dir = save_model(world["models"][which], ITEM_IDS, tmp_path / f"model-{which}", metadata=metadata)
        with mlflow.start_run(experiment_id=experiment) as run:
            mlflow.log_artifacts(str(model_dir), "model")
            uri = mlflow.get_artifact_uri("model")
        return tracking.register_version(cfg.mlflow.model_name, run.info.run_id, uri)

    return config, register


def _candidate(world, which: str) -> GateCandidate:
    return GateCandidate(world["models"][which], ITEM_IDS)


def _holder(cfg) -> str | None:
    holder = tracking.alias_holder(cfg.mlflow.model_name, cfg.mlflow.alias)
    return holder[0] if holder else None


def test_the_first_version_takes_the_free_alias(world, store):
    config, register = store
    cfg = config()
    version = register("bad")
    gate = _gate(cfg, version, _candidate(world, "bad"), world["split"], False, "cpu")
    assert gate.promoted and _holder(cfg) == version
    assert "no version held the alias" in gate.decision


def test_a_better_version_takes_the_alias_and_a_worse_one_does_not(world, store):
    config, register = store
    cfg = config()
    bad = register("bad")
    _gate(cfg, bad, _candidate(world, "bad"), world["split"], False, "cpu")
    good = register("good")
    gate = _gate(cfg, good, _candidate(world, "good"), world["split"], False, "cpu")
    assert gate.promoted and _holder(cfg) == good
    assert f"holder version {bad} {world['scores']['bad']:.4f}" in gate.decision     # the holder was scored for real

    worse = register("bad")
    gate = _gate(cfg, worse, _candidate(world, "bad"), world["split"], False, "cpu")
    assert not gate.promoted and _holder(cfg) == good
    assert gate.decision.startswith(f"kept @{cfg.mlflow.alias} on version {good}") and "--force" in gate.decision
    assert f"{world['scores']['good']:.4f}" in gate.decision and f"{world['scores']['bad']:.4f}" in gate.decision


def test_an_equally_good_version_takes_the_alias(world, store):
    config, register = store
    cfg = config()
    first = register("good")
    _gate(cfg, first, _candidate(world, "good"), world["split"], False, "cpu")
    again = register("good")
    gate = _gate(cfg, again, _candidate(world, "good"), world["split"], False, "cpu")
    assert gate.promoted and _holder(cfg) == again


def test_a_worse_version_within_the_tolerance_takes_the_alias(world, store):
    config, register = store
    gap = world["scores"]["good"] - world["scores"]["bad"]
    good = register("good")
    _gate(config(), good, _candidate(world, "good"), world["split"], False, "cpu")
    worse = register("bad")
    gate = _gate(config(tolerance=gap / 2), worse, _candidate(world, "bad"), world["split"], False, "cpu")
    assert not gate.promoted and _holder(config()) == good
    gate = _gate(config(tolerance=gap + 0.01), worse, _candidate(world, "bad"), world["split"], False, "cpu")
    assert gate.promoted and _holder(config()) == worse
    assert "not worse than the holder" in gate.decision


def test_force_moves_the_alias_to_a_worse_version_and_says_so(world, store):
    config, register = store
    cfg = config()
    good = register("good")
    _gate(cfg, good, _candidate(world, "good"), world["split"], False, "cpu")
    worse = register("bad")
    gate = _gate(cfg, worse, _candidate(world, "bad"), world["split"], True, "cpu")
    assert gate.promoted and _holder(cfg) == worse
    assert "--force" in gate.decision


def test_a_holder_with_a_training_date_is_judged_only_on_items_it_never_saw(world, store):
    """Trained before 2025-01-06: the users whose newest item came on days 6-10 are the unseen half;
    both scores in the decision are those of that half, not of all users."""
    config, register = store
    cfg = config()
    holder = register("bad", trained_before="2025-01-06")
    _gate(cfg, holder, _candidate(world, "bad"), world["split"], False, "cpu")
    unseen = world["split"].since(_day_us(6) - 12 * 3600 * 1_000_000)   # midnight of 2025-01-06
    assert 0 < unseen.users < world["split"].users
    gate = _gate(cfg, register("good"), _candidate(world, "good"), world["split"], False, "cpu")
    assert gate.promoted and gate.figures["gate_users"] == unseen.users
    assert f"on {unseen.users} held-out user(s) whose newest item was first touched on or after 2025-01-06" in gate.decision
    for which in ("good", "bad"):
        assert f"{mean_gain(unseen.user_gains(world['models'][which], ITEM_IDS, 'cpu')):.4f}" in gate.decision


def test_too_few_unseen_items_keep_the_holder_and_force_still_moves_it(world, store):
    config, register = store
    holder = register("bad", trained_before="2025-01-10")          # only users of day 10 are unseen
    _gate(config(), holder, _candidate(world, "bad"), world["split"], False, "cpu")
    unseen = sum(1 for u in range(world["split"].users) if u % 10 == 9)
    new = register("good")
    gate = _gate(config(min_users=unseen + 1), new, _candidate(world, "good"), world["split"], False, "cpu")
    assert not gate.promoted and _holder(config()) == holder
    assert f"only {unseen} held-out user(s)" in gate.decision and f"gate_min_users={unseen + 1}" in gate.decision
    gate = _gate(config(min_users=unseen + 1), new, _candidate(world, "good"), world["split"], True, "cpu")
    assert gate.promoted and _holder(config()) == new and "--force" in gate.decision


def test_a_holder_trained_after_every_held_out_item_leaves_nothing_to_judge(world, store):
    config, register = store
    cfg = config()
    holder = register("bad", trained_before="2025-02-01")
    _gate(cfg, holder, _candidate(world, "bad"), world["split"], False, "cpu")
    gate = _gate(cfg, register("good"), _candidate(world, "good"), world["split"], False, "cpu")
    assert not gate.promoted and _holder(cfg) == holder and "only 0 held-out user(s)" in gate.decision


def test_force_works_even_when_the_holder_cannot_be_scored(world, store):
    """A broken holder (its files gone) is exactly when an operator reaches for --force."""
    import shutil

    from mlflow import MlflowClient

    config, register = store
    cfg = config()
    good = register("good")
    _gate(cfg, good, _candidate(world, "good"), world["split"], False, "cpu")
    run_id = MlflowClient().get_model_version(cfg.mlflow.model_name, good).run_id
    shutil.rmtree(world["root"] / "art" / run_id)      # the holder's registered files are gone
    new = register("bad")
    from recsys.errors import RecsysError

    with pytest.raises(RecsysError, match=f"version {good}.*--force"):
        _gate(cfg, new, _candidate(world, "bad"), world["split"], False, "cpu")
    assert _holder(cfg) == good
    gate = _gate(cfg, new, _candidate(world, "bad"), world["split"], True, "cpu")
    assert gate.promoted and _holder(cfg) == new and "could not be scored" in gate.decision
