"""The guard on real runs of the nightly job over consecutive dates (issue 22).

Two datasets: the tiny fixture of ``tests/jobkit.py`` (24 users, 30 items), where the previous night's
realized hit rate and the overlap are worked out by hand from the published files and the events; and
the sample generator's data (``recsys.data.sample``: 300 users, 400 items, 10 days) with a small model
fitted in the test, over three consecutive nights: the first (nothing to compare with), a normal next night,
and a third night broken two ways, by a model that gives every user the same list and by a catalog
export that re-keyed its items.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from recsys.config import load_config
from recsys.data.contracts import CATALOG_SCHEMA, write_partition
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark, pytest.mark.slow]

UTC = dt.timezone.utc


# ------------------------------------------------------------------------------------------------
# the tiny fixture: the realized hit rate by hand


@pytest.fixture(scope="module")
def tiny(spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly

    root = tmp_path_factory.mktemp("guard-tiny")
    store = jobkit.make_store(root / "store")
    jobkit.write_dataset(root)                                                  # events 05-01..05-07
    write_partition(jobkit.events_table(8, seed=3), root / "events", dt.date(2024, 5, 8))   # while P's lists were live
    cfg = jobkit.config(root, store, "guard.min_users=1")
    first = run_nightly(spark, cfg, dt.date(2024, 5, 8))
    second = run_nightly(spark, cfg, dt.date(2024, 5, 9))
    # a third night scored by a version of the same weights whose repeat blend lets known items compete (published
    # whatever the guard says: its lists differ from the masked ones by design)
    _register_blended_version(store, root / "blended")
    third = run_nightly(spark, cfg, dt.date(2024, 5, 10), accept_guard=True)
    return dict(root=root, cfg=cfg, store=store, first=first, second=second, third=third)


def _register_blended_version(store: jobkit.Store, model_dir: Path) -> None:
    from recsys.model.io import REPEATS_FILE
    from recsys.model.repeats import RepeatBlend

    shutil.copytree(store.model_dir, model_dir)
    (model_dir / REPEATS_FILE).write_text(RepeatBlend(repeat_bias=0.0, age_weight=0.5, new_rank_weight=1.0).to_json())
    jobkit.register_version(store.tracking_uri, store.model_name, model_dir)


def _lists(partition: Path) -> dict[int, list[int]]:
    return {r["user_id"]: [x["item_id"] for x in r["recommendations"]] for r in pq.read_table(partition).to_pylist()}


def _touched(events: Path, start: dt.datetime, end: dt.datetime) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for e in pq.read_table(events).to_pylist():
        if start <= e["ts"] < end:
            out.setdefault(e["user_id"], set()).add(e["item_id"])
    return out


def _dcg(items: list[int], relevant: set[int], k: int) -> float:
    return sum(1 / math.log2(i + 2) for i, item in enumerate(items[:k]) if item in relevant)


def _ndcg(items: list[int], relevant: set[int], k: int) -> float:
    return _dcg(items, relevant, k) / sum(1 / math.log2(i + 2) for i in range(min(k, len(relevant))))


def test_the_realized_hit_rate_equals_a_hand_computation_from_the_published_lists_and_the_events(tiny):
    out, events = Path(tiny["cfg"].paths.output), Path(tiny["cfg"].paths.events)
    previous = _lists(out / "dt=2024-05-08")
    touched = _touched(events, dt.datetime(2024, 5, 8, tzinfo=UTC), dt.datetime(2024, 5, 9, tzinfo=UTC))
    before = _touched(events, dt.datetime(2024, 4, 1, tzinfo=UTC), dt.datetime(2024, 5, 8, tzinfo=UTC))
    users = sorted(set(touched) & set(previous))
    n = jobkit.TOP_N
    hr = np.mean([bool(set(previous[u][:n]) & touched[u]) for u in users])
    ndcg = np.mean([_ndcg(previous[u], touched[u], n) for u in users])
    # the popularity baseline: the ranking the previous night kept, without each user's items from before it
    manifest = json.loads((out / "dt=2024-05-08" / "_manifest.json").read_text())
    ranking = manifest["quality"]["for_next_night"]["popularity_ranking"]
    pop = {u: [i for i in ranking if i not in (before.get(u, set()) - touched[u])][:n] for u in users}
    pop_hr = np.mean([bool(set(pop[u]) & touched[u]) for u in users])
    pop_ndcg = np.mean([_ndcg(pop[u], touched[u], n) for u in users])

    m = tiny["second"].metrics
    assert m["realized_users"] == len(users) == jobkit.N_USERS
    assert m["realized_hr_at_n"] == pytest.approx(hr) and m["realized_ndcg_at_n"] == pytest.approx(ndcg)
    assert m["realized_pop_hr_at_n"] == pytest.approx(pop_hr) and m["realized_pop_ndcg_at_n"] == pytest.approx(pop_ndcg)
    assert m["realized_hr_ratio_at_n"] == pytest.approx(hr / pop_hr)
    assert m["realized_hr_at_10"] == pytest.approx(hr)            # top_n 5: the @10 figures are the @N ones
    assert 0 < hr < 1 and 0 < pop_hr <= 1                         # the fixture has both hits and misses


def test_the_repeat_and_new_split_and_the_personal_frequency_baseline_equal_a_hand_computation(tiny):
    """The same night, its targets split by whether the user had touched the item before P, and each user's
    personal-frequency list as of P (most events before P first, ties by the latest of them, then item id)."""
    out, events = Path(tiny["cfg"].paths.output), Path(tiny["cfg"].paths.events)
    since = dt.datetime(2024, 5, 8, tzinfo=UTC)
    previous = _lists(out / "dt=2024-05-08")
    touched = _touched(events, since, dt.datetime(2024, 5, 9, tzinfo=UTC))
    counts: dict[int, dict[int, int]] = {}
    latest: dict[int, dict[int, dt.datetime]] = {}
    for e in pq.read_table(events).to_pylist():
        if e["ts"] < since:
            u, i = e["user_id"], e["item_id"]
            counts.setdefault(u, {})[i] = counts.get(u, {}).get(i, 0) + 1
            latest.setdefault(u, {})[i] = max(latest.get(u, {}).get(i, e["ts"]), e["ts"])
    n = jobkit.TOP_N
    users = sorted(set(touched) & set(previous))
    repeat = {u: touched[u] & set(counts.get(u, {})) for u in users}
    new = {u: touched[u] - repeat[u] for u in users}
    pfreq = {u: sorted(counts.get(u, {}), key=lambda i: (-counts[u][i], -latest[u][i].timestamp(), i))[:n] for u in users}
    with_repeats, with_new = [u for u in users if repeat[u]], [u for u in users if new[u]]
    assert with_repeats and with_new                               # the fixture's day holds both kinds

    def hr(lists, targets, who):
        return np.mean([bool(set(lists[u][:n]) & targets[u]) for u in who])

    m = tiny["second"].metrics
    assert m["realized_repeat_users"] == len(with_repeats) and m["realized_new_users"] == len(with_new)
    assert m["realized_hr_at_n_repeat"] == pytest.approx(hr(previous, repeat, with_repeats))
    assert m["realized_ndcg_at_n_repeat"] == pytest.approx(np.mean([_ndcg(previous[u], repeat[u], n) for u in with_repeats]))
    assert m["realized_hr_at_n_new"] == pytest.approx(hr(previous, new, with_new))
    assert m["realized_ndcg_at_10_new"] == pytest.approx(np.mean([_ndcg(previous[u], new[u], n) for u in with_new]))
    assert m["realized_pfreq_users"] == len(users)
    pfreq_hr = hr(pfreq, touched, users)
    assert m["realized_pfreq_hr_at_n"] == pytest.approx(pfreq_hr) == m["realized_pfreq_hr_at_10"]
    assert m["realized_pfreq_ndcg_at_n"] == pytest.approx(np.mean([_ndcg(pfreq[u], touched[u], n) for u in users]))
    assert m["realized_hr_pfreq_ratio_at_n"] == pytest.approx(m["realized_hr_at_n"] / pfreq_hr)
    assert 0 < pfreq_hr < 1
    # the figures reach the manifest and the guard's report, the ratio judged over realized_pfreq_users
    assert tiny["second"].manifest.metrics["realized_pfreq_hr_at_n"] == pytest.approx(pfreq_hr)
    checks = {c["figure"]: c for c in tiny["second"].manifest.quality.guard["checks"]}
    assert checks["realized_hr_pfreq_ratio_at_n"]["users"] == len(users)
    assert checks["realized_hr_pfreq_ratio_at_n"]["value"] == pytest.approx(m["realized_hr_pfreq_ratio_at_n"])


def test_the_overlap_with_the_previous_night_equals_a_hand_computation(tiny):
    out = Path(tiny["cfg"].paths.output)
    previous, tonight = _lists(out / "dt=2024-05-08"), _lists(out / "dt=2024-05-09")
    both = sorted(set(previous) & set(tonight))
    jaccard = [len(set(previous[u]) & set(tonight[u])) / len(set(previous[u]) | set(tonight[u])) for u in both]
    m = tiny["second"].metrics
    assert m["overlap_users"] == len(both)
    assert m["jaccard_at_n_mean"] == pytest.approx(np.mean(jaccard))
    assert m["first_item_changed_share"] == pytest.approx(np.mean([previous[u][0] != tonight[u][0] for u in both]))
    assert m["users_gained"] == len(set(tonight) - set(previous)) and m["users_lost"] == len(set(previous) - set(tonight))


def test_the_score_shift_is_measured_on_the_model_s_scores_and_not_on_a_repeat_blend_s(tiny):
    """Where known items compete, a list's scores are the repeat blend's (known items' counts and ages, new items'
    ranks), not the model's, and each training's blend sets their scale: their PSI would measure the blend. The
    masked second night measures it; the blended third neither measures it nor keeps deciles for the next night."""
    second, third = tiny["second"], tiny["third"]
    assert second.metrics["score_psi"] >= 0 and second.manifest.quality.for_next_night.score_deciles
    assert any(r["recommendations"][0]["item_id"] in h for r, h in _first_items_and_histories(tiny))   # it competes
    assert "score_psi" not in third.metrics and "score_psi" not in third.manifest.metrics
    checks = {c["figure"]: c for c in third.manifest.quality.guard["checks"]}
    assert checks["score_psi"]["level"] == "not judged"
    assert third.manifest.quality.for_next_night.score_deciles is None


def _first_items_and_histories(tiny) -> list[tuple[dict, set[int]]]:
    """The third night's rows, each with the items its user had before it."""
    before = _touched(Path(tiny["cfg"].paths.events), dt.datetime(2024, 4, 1, tzinfo=UTC),
                      dt.datetime(2024, 5, 10, tzinfo=UTC))
    rows = pq.read_table(Path(tiny["cfg"].paths.output) / "dt=2024-05-10").to_pylist()
    return [(r, before.get(r["user_id"], set())) for r in rows]


def test_the_previous_night_is_the_run_the_output_table_names(tiny):
    """With ``output.table`` (the tiny fixture's config has one), the night compared with is the run
    directory the table's partition points at, the one the first night published."""
    from recsys.publish.published import latest_published, run_of

    first, second = tiny["first"], tiny["second"]
    assert "/_runs/dt=2024-05-08/run=" in first.location
    assert second.manifest.quality.previous.run == run_of(first.location)
    found = latest_published(tiny["cfg"].paths.output, before=dt.date(2024, 5, 9))
    assert found is not None and found.path == first.location


# ------------------------------------------------------------------------------------------------
# the sample data, three consecutive nights

D1, D2, D3 = dt.date(2024, 6, 9), dt.date(2024, 6, 10), dt.date(2024, 6, 11)
TOP_N = 10
ITEMS = 400


def _overrides(root: Path, data: Path, tracking_uri: str, *extra: str) -> list[str]:
    return [*jobkit.metastore_overrides(root),   # output.table: one per root, in the session's metastore service
            f"paths.events={data / 'events'}", f"paths.catalog={data / 'catalog'}", f"paths.output={root / 'out'}",
            f"paths.work={root / 'work'}", f"paths.driver_scratch={root / 'driver'}",
            f"mlflow.tracking_uri={tracking_uri}", f"mlflow.artifact_location={root / 'artifacts'}",
            f"scoring.top_n={TOP_N}", "scoring.partitions=2", *extra]


def _register(root: Path, uri: str, name: str, model, item_ids: np.ndarray) -> str:
    from mlflow import MlflowClient

    from recsys.model.io import save_model
    from recsys.tracking import store as tracking

    model_dir = save_model(model, item_ids, root / f"model-{name}")
    tracking.point_at(load_config(overrides=[f"mlflow.tracking_uri={uri}"]).mlflow)
    MlflowClient().create_registered_model(name)
    return jobkit.register_version(uri, name, model_dir)


def _trained_model(data: Path, before: dt.date):
    """A small SASRec fitted in this process on each user's items before ``before`` (the model trains on
    what the job would read; the training pipeline itself is tested elsewhere): 15 epochs in seconds, a
    model that is personal enough to pass the guard, as the demo's does."""
    from recsys.model.sasrec import SASRecConfig
    from recsys.model.training import TrainSettings, fit
    from recsys.sequences import Sequences

    events = pq.read_table(data / "events").to_pandas()
    events = events[events.ts < dt.datetime.combine(before, dt.time(), UTC)]
    events = events.sort_values(["user_id", "ts"]).drop_duplicates(["user_id", "item_id"], keep="last")
    sequences = Sequences.from_lists([g.item_id.to_numpy() for _, g in events.groupby("user_id")])
    config = SASRecConfig(num_items=ITEMS, dim=32, layers=1, heads=1, max_len=20, dropout=0.1)
    settings = TrainSettings(epochs=15, batch_size=16, weight_decay=0.1, window_offsets="random", num_threads=1)
    return fit(sequences, config, settings).model.eval()


@pytest.fixture(scope="module")
def nights(spark, tmp_path_factory):
    from recsys.data.sample import SampleSpec, generate_sample
    from recsys.pipelines.nightly import run_nightly

    root = tmp_path_factory.mktemp("guard-sample")
    data = root / "data"
    # The data this test was written on (repeat_rate=None: repeats by chance only, no planted returns). The
    # model trained here masks every item a user had, as the job's scoring does, and the guard judges it
    # against popularity: on the sample's default returns masked lists fall below popularity and warn.
    generate_sample(data, SampleSpec(users=300, items=ITEMS, days=10, seed=5, end_date=D2, repeat_rate=None))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = load_config(overrides=_overrides(root, data, uri))
    _register(root, uri, cfg.mlflow.model_name, _trained_model(data, D1), np.arange(1, ITEMS + 1))
    first = run_nightly(spark, cfg, D1)
    second = run_nightly(spark, cfg, D2)
    return dict(root=root, data=data, uri=uri, cfg=cfg, first=first, second=second)


def _guard_section(result) -> dict:
    return result.manifest.quality.guard


def test_the_first_night_passes_and_says_it_has_nothing_to_compare_with(nights):
    from mlflow import MlflowClient

    quality = nights["first"].manifest.quality.as_dict()
    assert quality["previous"] is None and quality["realized_for"] is None
    assert quality["guard"]["verdict"] == "pass" and quality["guard"]["first_night"]
    assert "first night: no published partition before it" in quality["guard"]["note"]
    assert "jaccard_at_n_mean" not in nights["first"].metrics and "realized_hr_at_10" not in nights["first"].metrics
    assert len(quality["for_next_night"]["popularity_ranking"]) > TOP_N and len(quality["for_next_night"]["score_deciles"]) == 9
    run = MlflowClient(nights["uri"]).get_run(nights["first"].run_id)
    assert run.data.tags["recsys.guard"] == "pass"


def test_a_normal_next_night_passes_with_figures_in_a_plausible_range(nights):
    from mlflow import MlflowClient

    m, guard = nights["second"].metrics, _guard_section(nights["second"])
    # The model fitted here masks every item its user had (it has no repeat blend): where users come back to
    # items even by chance, their own most touched items hit about twice as often, and the guard may warn on
    # that ratio (warn only, by design); nothing else crosses a threshold on a normal night.
    crossed = {c["figure"] for c in guard["checks"] if c["level"] in ("warn", "fail")}
    assert crossed <= {"realized_hr_pfreq_ratio_at_n", "realized_hr_pfreq_ratio_at_10"}, guard["summary"]
    assert guard["verdict"] == ("warn" if crossed else "pass")
    assert nights["second"].manifest.quality.previous.date == str(D1)
    assert nights["second"].manifest.quality.previous.run == nights["first"].manifest.job_run
    assert nights["second"].manifest.quality.realized_for == str(D1)
    # the previous night's lists against what users did on D1
    assert 30 <= m["realized_users"] <= m["realized_touched_users"] <= m["rows"]
    assert 0 < m["realized_hr_at_10"] <= m["realized_hr_at_n"] <= 1
    assert 0 < m["realized_ndcg_at_10"] <= m["realized_hr_at_10"]
    assert 0 < m["realized_pop_hr_at_10"] <= m["realized_pop_hr_at_n"] <= 1 and m["realized_pop_users"] == m["realized_users"]
    assert m["realized_hr_ratio_at_n"] > 0.3
    # repeats apart from new items, and personal frequency on the same users (the data repeats by chance only)
    assert m["realized_pfreq_users"] == m["realized_users"]
    assert 0 < m["realized_repeat_users"] <= m["realized_users"] and 0 < m["realized_new_users"] <= m["realized_users"]
    assert m["realized_repeat_users"] + m["realized_new_users"] >= m["realized_users"]
    assert 0 < m["realized_hr_at_10_new"] <= 1 and 0 < m["realized_pfreq_hr_at_10"] <= m["realized_pfreq_hr_at_n"] <= 1
    assert m["realized_hr_at_10_repeat"] == 0          # masked lists hold no item the user had: no repeat is hit
    assert m["realized_hr_pfreq_ratio_at_n"] < 1       # and personal frequency, which holds only those, does better
    # one more day of events: most lists barely move, the active users' change
    assert 0.4 < m["jaccard_at_n_mean"] < 1 and m["jaccard_at_n_p10"] <= m["jaccard_at_n_p50"] <= m["jaccard_at_n_p90"]
    assert 0 < m["first_item_changed_share"] < 0.8
    assert m["overlap_users"] + m["users_lost"] == nights["first"].manifest.counts.rows
    assert 0.7 < m["catalog_coverage_ratio"] < 1.4
    assert m["head_slot_share"] < 0.5 and 0 < m["exposure_gini"] < 1 and m["fallback_share"] < 0.1
    assert 0 <= m["score_psi"] < 0.25
    client = MlflowClient(nights["uri"])
    run = client.get_run(nights["second"].run_id)
    assert run.data.tags["recsys.guard"] == guard["verdict"]
    assert run.data.metrics["realized_hr_at_10"] == pytest.approx(m["realized_hr_at_10"])
    assert run.data.metrics["jaccard_at_n_mean"] == pytest.approx(m["jaccard_at_n_mean"])
    assert run.data.metrics["realized_pfreq_hr_at_10"] == pytest.approx(m["realized_pfreq_hr_at_10"])
    assert run.data.metrics["realized_hr_at_10_new"] == pytest.approx(m["realized_hr_at_10_new"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"guard_report.json", "guard_trend.json", "plots/guard_trend.png"} <= names
    trend = json.loads(Path(client.download_artifacts(run.info.run_id, "guard_trend.json",
                                                      str(nights["root"]))).read_text())["nights"]
    assert [n["date"] for n in trend] == [str(D1), str(D2)] and trend[-1]["realized_for"] == str(D1)


def _same_list_model():
    """A SASRec whose user vector is a constant (its final layer norm: weight 0, a fixed bias): every user's
    scores are the same ranking, only the seen items are masked."""
    import torch

    from recsys.model.sasrec import SASRec, SASRecConfig

    torch.manual_seed(1)
    model = SASRec(SASRecConfig(num_items=ITEMS, dim=16, layers=1, heads=1, max_len=20, dropout=0.0)).eval()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(torch.randn(16))
    return model


def _recommend(monkeypatch, spark, root, data, uri, date, *flags, extra=()):
    args = ["recommend", "--date", str(date), *flags]
    for item in _overrides(root, data, uri, *extra):
        args += ["--set", item]
    return jobkit.cli(monkeypatch, spark, args)


def test_a_model_giving_every_user_the_same_list_is_refused_with_exit_3_and_the_last_night_stays_published(
        nights, spark, monkeypatch, caplog):
    from mlflow import MlflowClient

    root, data, uri = nights["root"], nights["data"], nights["uri"]
    _register(root, uri, "recsys-same-list", _same_list_model(), np.arange(1, ITEMS + 1))
    from recsys.publish.published import find_published, read_pointer

    out = root / "out"
    before = jobkit.snapshot(out / f"dt={D2}")
    night = find_published(str(out), D2)
    assert night is not None and night.run == nights["second"].manifest.job_run
    same = ("mlflow.model_name=recsys-same-list",)
    with caplog.at_level(logging.INFO):
        assert _recommend(monkeypatch, spark, root, data, uri, D3, extra=same) == ExitCode.VALIDATION_FAILED
        # --force recomputes published dates; it never overrides the guard
        assert _recommend(monkeypatch, spark, root, data, uri, D3, "--force", extra=same) == ExitCode.VALIDATION_FAILED
    assert jobkit.partitions(out) == [f"dt={D1}", f"dt={D2}"]
    assert jobkit.snapshot(out / f"dt={D2}") == before                # the previous night untouched, still published
    assert read_pointer(str(out), D2).run == night.run and jobkit.snapshot(Path(night.path)) == jobkit.snapshot(out / f"dt={D2}")
    assert find_published(str(out), D3) is None
    errors = jobkit.errors_logged(caplog)
    assert errors and all("refused the night of 2024-06-11, nothing published" in e for e in errors)
    assert "head_slot_share = " in errors[0] and "is above the fail threshold 0.9 by " in errors[0]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(nights["cfg"].mlflow.experiment).experiment_id
    refused = client.search_runs([experiment], f"tags.`recsys.date` = '{D3}'", order_by=["attributes.start_time DESC"])
    assert [r.info.status for r in refused] == ["FAILED", "FAILED"]
    run = refused[0]
    assert run.data.tags["recsys.guard"] == "fail" and run.data.tags["recsys.exit_code"] == "3"
    assert "head_slot_share" in run.data.tags["recsys.guard_crossed"]
    assert run.data.metrics["head_slot_share"] > 0.9
    report = json.loads(Path(client.download_artifacts(run.info.run_id, "guard_report.json", str(root))).read_text())
    failed = {c["figure"]: c for c in report["checks"] if c["level"] == "fail"}
    assert failed["head_slot_share"]["fail"] == 0.9 and failed["head_slot_share"]["margin"] > 0
    assert report["previous"]["date"] == str(D2)

    # an operator who decides the night is right publishes it on purpose, and the run says so
    assert _recommend(monkeypatch, spark, root, data, uri, D3, "--accept-guard", extra=same) == ExitCode.OK
    manifest = json.loads((out / f"dt={D3}" / "_manifest.json").read_text())
    assert manifest["quality"]["guard"]["verdict"] == "accepted" and manifest["quality"]["guard"]["accepted"]
    accepted = client.get_run(manifest["run_id"])
    assert accepted.data.tags["recsys.guard"] == "accepted" and accepted.data.tags["recsys.guard_accepted"] == "true"


def test_a_catalog_export_that_re_keyed_its_items_changes_every_list_and_trips_the_drift_threshold(
        nights, spark, monkeypatch, tmp_path, caplog):
    """The export switched 95% of its rows to another id scheme (item_id + 1,000,000): every list still
    holds available, unseen items the model knows, so validation passes, but the candidates are now the
    5% the model still recognises and every list changes."""
    data = jobkit.copy_dataset(nights["data"], tmp_path / "data")
    snapshot = data / "catalog" / f"dt={D2}"
    table = pq.read_table(next(snapshot.glob("*.parquet")))
    keep = np.random.default_rng(0).random(table.num_rows) < 0.05
    ids = np.where(keep, table.column("item_id").to_numpy(), table.column("item_id").to_numpy() + 1_000_000)
    rekeyed = table.set_column(0, "item_id", pa.array(ids, pa.int64())).cast(CATALOG_SCHEMA)
    write_partition(rekeyed, data / "catalog", D2)
    for published in (f"dt={D2}", f"_runs/dt={D2}"):                  # last night, as published: view and run
        shutil.copytree(nights["root"] / "out" / published, tmp_path / "out" / published)
    with caplog.at_level(logging.INFO):
        code = _recommend(monkeypatch, spark, tmp_path, data, nights["uri"], D3)
    assert code == ExitCode.VALIDATION_FAILED
    assert jobkit.partitions(tmp_path / "out") == [f"dt={D2}"]
    assert [r.split("/")[0] for r in jobkit.runs(tmp_path / "out")] == [f"dt={D2}"]   # no run directory of D3 left
    error = jobkit.errors_logged(caplog)[-1]
    assert "jaccard_at_n_mean = " in error and "is below the fail threshold 0.05 by " in error


def test_recsys_runs_prints_the_guard_s_verdict_and_the_trend(nights):
    from recsys.cli import runs

    cfg = nights["cfg"]
    rows = {r["date"]: r for r in runs.list_runs(cfg, last=50) if r["status"] == "published"}
    assert rows[str(D2)]["guard"] == _guard_section(nights["second"])["verdict"] and rows[str(D1)]["guard"] == "pass"
    assert rows[str(D2)]["realized_hr_at_10"] == pytest.approx(nights["second"].metrics["realized_hr_at_10"], abs=1e-4)
    table = runs.format_table(list(rows.values()))
    assert "guard" in table.splitlines()[0] and "HR@10 model/pop/pfreq" in table.splitlines()[0]
    assert "rep/new" in table.splitlines()[0]
    second = rows[str(D2)]
    assert second["realized_pfreq_hr_at_10"] == pytest.approx(nights["second"].metrics["realized_pfreq_hr_at_10"],
                                                             abs=1e-4)
    line = next(x for x in table.splitlines() if x.startswith(str(D2)))
    assert f"{second['realized_hr_at_10']:.3f}/{second['realized_pop_hr_at_10']:.3f}/" \
           f"{second['realized_pfreq_hr_at_10']:.3f}" in line, table
    assert f"{second['realized_hr_at_10_repeat']:.3f}/{second['realized_hr_at_10_new']:.3f}" in line, table
    shown = runs.format_run(runs.show_run(cfg, str(D2)))
    assert f"guard: {rows[str(D2)]['guard']}" in shown
    trend = shown.split("last nights", 1)[1]
    assert str(D1) in trend and str(D2) in trend
