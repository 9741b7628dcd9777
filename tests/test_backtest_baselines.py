"""The backtest's measuring half on a log small enough to check by hand: who returns, each baseline's lists,
and the figures of those lists on the next day (``recsys.evaluation.backtest``, ``recsys.evaluation.baselines``)."""
from __future__ import annotations

import datetime as dt
import math

import pyarrow as pa
import pytest

from recsys.config import load_config
from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA, write_partition

pytestmark = [pytest.mark.spark]

UTC = dt.timezone.utc
NIGHT = dt.date(2024, 5, 10)
START = dt.datetime(2024, 5, 10, tzinfo=UTC)
UNAVAILABLE = 5

# (user, item, days before the night, events): the history window before NIGHT.
PAST = [
    (1, 1, 1, 1), (1, 2, 14, 3), (1, 3, 6, 1),          # weights 0.906, 3 x 0.25 = 0.75, 0.552: [1, 2, 3]
    (2, 4, 2, 1), (2, UNAVAILABLE, 1, 1), (2, 6, 3, 1),  # 0.820, unavailable, 0.743: [4, 6]
    (3, 1, 3, 1), (3, 7, 4, 1), (3, 6, 2, 1),            # 0.743, 0.673, 0.820: [6, 1, 7]
    (4, 1, 2, 1), (4, 7, 2, 1), (4, 4, 5, 1),
    (5, 1, 4, 1), (5, 7, 4, 1), (5, 4, 4, 1), (5, 8, 20, 1),
    (6, 1, 5, 1), (6, 7, 5, 1),
]
# Users per available item in the 7 days before the night: 1: 5, 7: 4, 4: 3, 6: 2, 3: 1 (2 and 8 are older).
RANKING = [1, 7, 4, 6, 3]
# (user, item) on the night itself: users 1-3 return; user 7 has no history, so is not a returning user.
NEXT_DAY = [(1, 1), (1, 9), (2, UNAVAILABLE), (2, 10), (3, 8), (7, 1)]


def _write(root):
    rows = []
    for user, item, days, times in PAST:
        for t in range(times):
            rows.append(dict(user_id=user, item_id=item, event_type="view",
                             ts=START - dt.timedelta(days=days) + dt.timedelta(seconds=t)))
    rows += [dict(user_id=u, item_id=i, event_type="view", ts=START + dt.timedelta(hours=9)) for u, i in NEXT_DAY]
    by_day: dict[dt.date, list[dict]] = {}
    for row in rows:
        by_day.setdefault(row["ts"].date(), []).append(row)
    for day, day_rows in by_day.items():
        write_partition(pa.Table.from_pylist(day_rows, schema=EVENTS_SCHEMA), root / "events", day)
    catalog = [dict(item_id=i, available=i != UNAVAILABLE, title=f"Item {i}", category="c") for i in range(1, 13)]
    write_partition(pa.Table.from_pylist(catalog, schema=CATALOG_SCHEMA), root / "catalog", dt.date(2024, 4, 1))


@pytest.fixture(scope="module")
def night(spark, tmp_path_factory):
    from recsys.evaluation import backtest

    root = tmp_path_factory.mktemp("backtest-baselines")
    _write(root)
    cfg = load_config(overrides=["history.window_days=30"])
    log = backtest.read_log(spark, str(root / "events"), NIGHT)
    inputs = backtest.night_inputs(spark, log, str(root / "catalog"), NIGHT, cfg.history, 0, str(root / "users"))
    return dict(root=root, inputs=inputs)


def _lists(frame) -> dict[int, list[int]]:
    return {r["user_id"]: list(r["items"]) for r in frame.collect()}


def test_returning_users_are_those_with_history_and_an_event_that_day(night):
    users = {r["user_id"]: (sorted(r["targets"]), sorted(r["seen"])) for r in night["inputs"].users.collect()}
    assert set(users) == {1, 2, 3}                              # user 7 touched item 1 but had no history
    assert users[1] == ([1, 9], [1, 2, 3])
    assert users[2] == ([UNAVAILABLE, 10], [4, UNAVAILABLE, 6])   # an unavailable item is still history
    assert night["inputs"].max_seen == 3


def test_personal_frequency_decays_by_the_half_life_and_skips_unavailable_items(night):
    from recsys.evaluation import baselines

    i = night["inputs"]
    lists = _lists(baselines.personal_frequency_lists(i.past, i.users, i.available, NIGHT, 3, 7.0, seed=7))
    assert lists == {1: [1, 2, 3], 2: [4, 6], 3: [6, 1, 7]}
    # without decay (a half-life of ten years) user 1's item 2, touched three times, comes first
    undecayed = _lists(baselines.personal_frequency_lists(i.past, i.users, i.available, NIGHT, 3, 3650.0, seed=7))
    assert undecayed[1][0] == 2


def test_popularity_masked_and_not_and_the_padded_lists(night):
    from recsys.evaluation import baselines

    i = night["inputs"]
    ranking = baselines.popularity_ranking(i.past, i.available, NIGHT, 7, 20, seed=7)
    assert list(ranking.first()["ranking"]) == RANKING
    assert _lists(baselines.popularity_lists(i.users, ranking, 3, masked=False)) == {u: [1, 7, 4] for u in (1, 2, 3)}
    # masked: each user's own items removed, the ranking's order kept; user 3 has seen 3 of its 5 items
    assert _lists(baselines.popularity_lists(i.users, ranking, 3, masked=True)) == {1: [7, 4, 6], 2: [1, 7, 3], 3: [4, 3]}
    personal = baselines.personal_frequency_lists(i.past, i.users, i.available, NIGHT, 3, 7.0, seed=7)
    assert _lists(baselines.padded_lists(i.users, personal, ranking, 3)) == {1: [1, 2, 3], 2: [4, 6, 1], 3: [6, 1, 7]}


@pytest.mark.slow
def test_als_lists_drop_unavailable_items_and_mask_only_when_asked(night, tmp_path):
    from recsys.evaluation import baselines

    i = night["inputs"]
    params = baselines.ALSParams(rank=4, reg_param=0.1, alpha=1.0, max_iter=3, seed=1, blocks=2)
    als = baselines.als_lists(i.past, i.users, i.available, 3, params, i.max_seen, str(tmp_path / "als"))
    unmasked, masked = _lists(als.unmasked), _lists(als.masked)
    seen = {r["user_id"]: set(r["seen"]) for r in i.users.collect()}
    assert set(unmasked) == {1, 2, 3} and set(masked) == {1, 2, 3}   # every returning user is known to ALS
    for user in (1, 2, 3):
        assert UNAVAILABLE not in unmasked[user] and UNAVAILABLE not in masked[user]
        assert not set(masked[user]) & seen[user]
        assert len(unmasked[user]) == 3 and len(set(unmasked[user])) == 3
    assert als.fetched == 3 + 3 and not als.ids_remapped
    # ALS only ranks items it saw: 7 distinct available items were touched before the night
    assert set().union(*unmasked.values()) <= {1, 2, 3, 4, 6, 7, 8}


def test_als_fits_in_the_configured_blocks_spark_s_ten_unless_told():
    """The blocks decide the factors' random start, not only the speed: they are a setting, Spark's default
    unless the configuration says otherwise (the tests' tiny logs use 2; that the backtest's nights fit in the
    configured blocks is tests/test_backtest.py's)."""
    from recsys.evaluation import baselines

    evaluation = load_config().evaluation
    assert evaluation.backtest.als_blocks == evaluation.als.blocks == 10
    als = baselines.als_estimator(baselines.ALSParams(4, 0.1, 1.0, blocks=3))
    assert (als.getNumUserBlocks(), als.getNumItemBlocks()) == (3, 3)
    grid = baselines.als_grid([4, 8], [0.1], [1.0], 3, 0, blocks=5)
    assert [baselines.als_estimator(p).getNumItemBlocks() for p in grid] == [5, 5]


def test_measured_figures_match_the_hand_computed_ones(spark, night, tmp_path):
    """k = 2, N = 3. Personal frequency: user 1's list [1, 2, 3] holds the repeat target 1 first; user 2's
    targets are an unavailable item and a new one; user 3 touched only a new item. Masked popularity never
    lists a user's own item, so it scores 0 on every repeat figure."""
    from recsys.evaluation import backtest, baselines
    from recsys.evaluation.report import Bootstrap

    i = night["inputs"]
    ranking = baselines.popularity_ranking(i.past, i.available, NIGHT, 7, 20, seed=7)
    lists = {backtest.PERSONAL: baselines.personal_frequency_lists(i.past, i.users, i.available, NIGHT, 3, 7.0, 7),
             backtest.POPULAR_MASKED: baselines.popularity_lists(i.users, ranking, 3, masked=True),
             backtest.POPULAR: baselines.popularity_lists(i.users, ranking, 3, masked=False)}
    out = tmp_path / "figures"
    backtest.measure(i.users, lists, 2, 3).write.parquet(str(out / f"dt={NIGHT}"))
    summary = backtest.summarize(spark, str(out), backtest.Measurement(tuple(lists), NIGHT, NIGHT, k=2, n=3),
                                 bootstrap=Bootstrap(200, 0), settings=load_config().evaluation.backtest)
    assert summary.counts == {"user_nights": 3, "users": 3, "repeat_user_nights": 2, "new_user_nights": 3,
                              "targets": 5, "repeat_targets": 2}
    ideal = 1 + 1 / math.log2(3)                                  # two targets within k = 2
    pf = summary.means[backtest.PERSONAL]
    assert pf["hr@2"] == pytest.approx(1 / 3)
    assert pf["ndcg@2"] == pytest.approx((1 / ideal) / 3)
    assert pf["recall@3"] == pytest.approx((1 / 2) / 3)
    assert pf["hr@2.repeat"] == pytest.approx(1 / 2)              # over users 1 and 2, who had repeat targets
    assert pf["ndcg@2.repeat"] == pytest.approx(1 / 2)
    assert pf["hr@2.new"] == 0 and pf["recall@3.new"] == 0
    assert pf["repeat_share@2"] == 1.0
    masked = summary.means[backtest.POPULAR_MASKED]
    assert masked["hr@2.repeat"] == 0 and masked["ndcg@2.repeat"] == 0 and masked["repeat_share@2"] == 0
    assert masked["hr@2"] == 0                                    # [7, 4], [1, 7], [4, 3]: no target among them
    popular = summary.means[backtest.POPULAR]
    assert popular["hr@2"] == pytest.approx(1 / 3)                # user 1's item 1 tops the ranking
    assert popular["repeat_share@2"] == pytest.approx((1 / 2 + 0 + 1) / 3)   # [1, 7]: 1/2, 0, 2/2
    assert summary.best_baseline == backtest.PERSONAL           # ties with pop on HR@2; the first listed wins
    # the table names what each figure covers
    table = backtest.format_table(summary)
    assert "3 user-nights of returning users" in table
    assert "Repeat items, which the user had touched before the night, 2 user-nights" in table
