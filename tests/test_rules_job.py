"""The operators' rules end to end, on the shared Spark session and jobkit's tiny store: the histories' excluded
items (beyond history.max_items), a night published under every kind of rule, the same rules on demand, and each
rule the inputs cannot honour stopping ``recsys recommend`` with exit 2 and one line naming it.

The data: jobkit's views (24 users, 30 items, two a day on 2024-05-01..07), plus per user ten purchases on 05-06
(within the rule's 3 days before the night of 05-08) and two on 05-02 (older: not excluded); items 21-25 are in the
catalog's category ``b`` (excluded). With history.max_items=2 the histories hold only the two newest items, so the
purchases are excluded by the rule alone. 22 of 30 items are off limits to each user: a list that honoured none of
the rules would almost surely hold one.
"""
from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import N_ITEMS, N_USERS, RUN_DATE, UTC
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark]

EXCLUDED_CATEGORY = set(range(21, 26))
RULES = ("history.max_items=2", "recommend.exclude.events=[{event_type: purchase, within_days: 3}]",
         "recommend.exclude.catalog.category=[b]")
TODAY_USER = 1


def _purchases(user: int) -> tuple[list[int], list[int]]:
    """(ten items bought on 05-06, two bought on 05-02) by ``user``, from items 1-20."""
    rng = np.random.default_rng(100 + user)
    items = rng.permutation(np.arange(1, 21)).tolist()
    return items[:10], items[10:12]


def _write(root: Path) -> Path:
    jobkit.write_dataset(root)
    rows = []
    for user in range(1, N_USERS + 1):
        recent, old = _purchases(user)
        rows += [dict(user_id=user, item_id=i, event_type="purchase", ts=dt.datetime(2024, 5, 6, 0, 30, tzinfo=UTC))
                 for i in recent]
        rows += [dict(user_id=user, item_id=i, event_type="purchase", ts=dt.datetime(2024, 5, 2, 0, 30, tzinfo=UTC))
                 for i in old]
    for day in (2, 6):   # a file beside the day's views
        write_partition(pa.Table.from_pylist([r for r in rows if r["ts"].day == day], schema=EVENTS_SCHEMA),
                        root / "events", dt.date(2024, 5, day), replace=False)
    catalog = [dict(item_id=i, available=True, title=f"Item {i}", category="b" if i in EXCLUDED_CATEGORY else "a")
               for i in range(1, N_ITEMS + 1)]
    write_partition(pa.Table.from_pylist(catalog, schema=CATALOG_SCHEMA), root / "catalog", jobkit.CATALOG_DATE)
    return root


def _window(root: Path) -> dict[int, list[tuple[int, str, dt.datetime]]]:
    """Each user's events before the night, read straight from the files."""
    out: dict[int, list] = {}
    for e in pq.read_table(root / "events").to_pylist():
        if e["ts"] < dt.datetime(2024, 5, 8, tzinfo=UTC):
            out.setdefault(e["user_id"], []).append((e["item_id"], e["event_type"], e["ts"]))
    return out


def _newest_two(events) -> set[int]:
    latest: dict[int, dt.datetime] = {}
    for item, _, ts in events:
        latest[item] = max(ts, latest.get(item, ts))
    return {item for item, _ in sorted(latest.items(), key=lambda kv: kv[1], reverse=True)[:2]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = _write(tmp_path_factory.mktemp("data"))
    return store, data


def test_the_histories_hold_every_excluded_item_of_the_rules_window_beyond_max_items(spark):
    from recsys.data.history import build_histories

    rows = [(1, 5, "purchase", dt.datetime(2024, 5, 1, 9)),      # 7 days before the night: excluded
            (1, 6, "purchase", dt.datetime(2024, 4, 1, 9)),      # too old for the rule
            (1, 7, "refund", dt.datetime(2024, 5, 7, 9)),        # another type
            *[(1, i, "view", dt.datetime(2024, 5, 7, 10 + i)) for i in (1, 2, 3)],
            (2, 5, "view", dt.datetime(2024, 5, 7, 9))]
    events = spark.createDataFrame(rows, "user_id bigint, item_id bigint, event_type string, ts timestamp")
    since = dt.datetime(2024, 5, 8) - dt.timedelta(days=10)
    got = {r["user_id"]: (r["history"], sorted(r["excluded_items"])) for r in
           build_histories(events, max_items=2, tie_break_seed=7, exclude=[("purchase", since)]).collect()}
    assert got == {1: ([2, 3], [5]), 2: ([5], [])}               # item 5 is long gone from user 1's history


@pytest.fixture(scope="module")
def night(env, spark, tmp_path_factory):
    from recsys.pipelines.nightly import run_nightly

    store, data = env
    root = tmp_path_factory.mktemp("night")
    cfg = jobkit.config(root, store, *RULES, inputs=data)
    return cfg, run_nightly(spark, cfg, RUN_DATE), data, root, store


@pytest.mark.slow
def test_a_night_under_the_rules_lists_no_excluded_item_and_records_the_rules(night):
    from mlflow import MlflowClient

    cfg, result, data, _, _ = night
    window = _window(data)
    rows = pq.read_table(Path(cfg.paths.output) / f"dt={RUN_DATE}").to_pylist()
    assert len(rows) == N_USERS
    for row in rows:
        items = [r["item_id"] for r in row["recommendations"]]
        recent, old = _purchases(row["user_id"])
        off = set(recent) | EXCLUDED_CATEGORY | _newest_two(window[row["user_id"]])
        assert not set(items) & off, (row["user_id"], items)
        assert len(items) == jobkit.TOP_N                        # 8 eligible items: every list is full
    assert result.manifest.rules == cfg.recommend.summary()
    assert result.manifest.rules["exclude"]["events"] == [{"event_type": "purchase", "within_days": 3}]
    assert result.metrics["rule_excluded_pairs"] == sum(len(set(_purchases(u)[0])) for u in range(1, N_USERS + 1))
    assert result.metrics["rule_excluded_users"] == N_USERS
    assert result.metrics["catalog_rule_excluded_items"] == len(EXCLUDED_CATEGORY)
    assert result.manifest.validation["excluded_items"] == 0
    params = MlflowClient(cfg.mlflow.tracking_uri).get_run(result.run_id).data.params
    assert (params["rules_exclude_events"], params["rules_exclude_catalog"]) == ("purchase:3d", "category=b")
    assert (params["rules_exclude_touched"], params["rules_fill"], params["rules_min_new_items"]) == ("false", "popularity", "0")


@pytest.mark.slow
def test_on_demand_scoring_applies_the_same_rules_and_today_s_purchases(night, spark, tmp_path):
    """As of the night's date, a user without events that day gets the row the job published; a user who bought
    ten more items today (and viewed two after) gets none of them, though the history keeps only the views."""
    from recsys.serve.ondemand import OnDemand

    cfg, _, data, root, store = night
    bought_before = set(_purchases(TODAY_USER)[0])
    today = [dict(user_id=TODAY_USER, item_id=i, event_type="purchase", ts=dt.datetime(2024, 5, 8, 1, tzinfo=UTC))
             for i in range(1, 21) if i not in bought_before]
    today += [dict(user_id=TODAY_USER, item_id=i, event_type="view", ts=dt.datetime(2024, 5, 8, h, tzinfo=UTC))
              for i, h in ((26, 2), (27, 3))]
    inputs = jobkit.copy_dataset(data, tmp_path / "inputs")
    write_partition(pa.Table.from_pylist(today, schema=EVENTS_SCHEMA), inputs / "events", RUN_DATE)
    od_cfg = jobkit.config(root, store, *RULES, f"serve.as_of={RUN_DATE}", inputs=inputs)
    od = OnDemand(od_cfg, url="sc://unused")
    od.spark = spark                                             # the shared session stands in for the backend
    try:
        od.refresh()
        users = [TODAY_USER, 2, 3]
        got = od.score(users).rows
    finally:
        if od.window is not None:
            spark.catalog.uncacheTable(od.window.name)
            spark.catalog.dropTempView(od.window.name)
    published = {r["user_id"]: r for r in pq.read_table(Path(cfg.paths.output) / f"dt={RUN_DATE}").to_pylist()}
    for user in (2, 3):   # the same items; scores as fp32 products in chunks of another size may differ in the last bits
        assert [r["item_id"] for r in got[user]["recommendations"]] == \
            [r["item_id"] for r in published[user]["recommendations"]]
        assert [r["score"] for r in got[user]["recommendations"]] == pytest.approx(
            [r["score"] for r in published[user]["recommendations"]], rel=1e-5, abs=1e-6)
    items = {r["item_id"] for r in got[TODAY_USER]["recommendations"]}
    assert items == {28, 29, 30}                                 # 1-20 bought, 21-25 category b, 26-27 the history


def _recommend_fails(monkeypatch, spark, caplog, capsys, env, tmp_path, *extra: str, match: str) -> str:
    """``recsys recommend`` with these overrides: exit 2, exactly one error line matching ``match``, no traceback,
    nothing published."""
    store, data = env
    caplog.clear()
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(tmp_path, store, *extra, inputs=data)])
    errors = jobkit.errors_logged(caplog)
    out = capsys.readouterr()
    assert code == ExitCode.BAD_INPUT == 2, errors
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert re.search(match, errors[0]), errors[0]
    assert "Traceback" not in caplog.text and "Traceback" not in out.err
    assert jobkit.partitions(tmp_path / "recommendations") == []
    return errors[0]


def test_an_event_type_the_window_does_not_hold_stops_the_night_naming_it(monkeypatch, spark, caplog, capsys, env,
                                                                           tmp_path):
    message = _recommend_fails(monkeypatch, spark, caplog, capsys, env, tmp_path,
                               "recommend.exclude.events=[{event_type: purchases, within_days: 3}]",
                               match=r"recommend.exclude.events: no event of type 'purchases' in the events between "
                                     r"2024-04-08 and 2024-05-08")
    assert "the types there: 'purchase', 'view'" in message


def test_a_catalog_column_the_snapshot_lacks_or_a_value_it_cannot_hold_stops_the_night_naming_it(
        monkeypatch, spark, caplog, capsys, env, tmp_path):
    _recommend_fails(monkeypatch, spark, caplog, capsys, env, tmp_path / "a", "recommend.exclude.catalog.stock=[out]",
                     match=r"recommend.exclude.catalog names column 'stock', which catalog snapshot 2024-05-01 .* does "
                           r"not have \(it has available, category, item_id, title\)")
    _recommend_fails(monkeypatch, spark, caplog, capsys, env, tmp_path / "b",
                     "recommend.include.catalog.available=[sometimes]",
                     match=r"recommend.include.catalog.available: value 'sometimes' cannot be a bool")


def test_a_bad_rule_value_stops_the_night_before_anything_is_read(monkeypatch, spark, caplog, capsys, env, tmp_path):
    _recommend_fails(monkeypatch, spark, caplog, capsys, env, tmp_path,
                     "recommend.exclude.events=[{event_type: purchase, within_days: 0}]",
                     match=r"config key 'recommend.exclude.events.0.within_days' = 0")
