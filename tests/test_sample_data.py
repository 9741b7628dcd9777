"""The synthetic dataset: layout, contracts and each planted property, read back from Parquet."""
from __future__ import annotations

import datetime as dt
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from recsys.data.contracts import CATALOG_SCHEMA, EVENTS_SCHEMA
from recsys.data.sample import REPEAT_RATE, SampleSpec, generate_sample
from recsys.errors import InputDataError

END = dt.date(2024, 5, 10)
DAYS = 10
USERS = 4000
ITEMS = 1500


def _read_dataset(root: Path) -> pd.DataFrame:
    frames = []
    for part in sorted(root.glob("dt=*")):
        table = pq.read_table(part)
        frame = table.to_pandas()
        frame["dt"] = dt.date.fromisoformat(part.name[3:])
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    messages: list[str] = []
    summary = generate_sample(out, SampleSpec(users=USERS, items=ITEMS, days=DAYS, seed=7, end_date=END),
                              progress=messages.append)
    events = _read_dataset(out / "events")
    catalog = _read_dataset(out / "catalog")
    return summary, events, catalog, out, messages


def _total_variation(a: pd.Series, b: pd.Series) -> float:
    p = a.value_counts(normalize=True)
    q = b.value_counts(normalize=True)
    return 0.5 * p.sub(q, fill_value=0).abs().sum()


# ----------------------------------------------------------------------------- layout & contracts


def test_writes_one_events_and_one_catalog_partition_per_day_ending_at_end_date(sample):
    summary, _, _, out, _ = sample
    expected = [f"dt={END - dt.timedelta(days=k)}" for k in range(DAYS - 1, -1, -1)]
    assert sorted(p.name for p in (out / "events").iterdir()) == expected
    assert sorted(p.name for p in (out / "catalog").iterdir()) == expected
    assert (summary.first_date, summary.last_date) == (dt.date(2024, 5, 1), END)
    for part in (out / "events").iterdir():
        assert [f.name for f in part.iterdir()][0].startswith("part-")


def test_files_follow_the_events_and_catalog_schemas(sample):
    _, _, _, out, _ = sample
    for part in (out / "events").iterdir():
        assert pq.read_schema(next(part.glob("*.parquet"))).remove_metadata() == EVENTS_SCHEMA
    for part in (out / "catalog").iterdir():
        assert pq.read_schema(next(part.glob("*.parquet"))).remove_metadata() == CATALOG_SCHEMA


def test_summary_counts_match_the_files(sample):
    summary, events, catalog, out, _ = sample
    assert summary.events == len(events)
    assert summary.events_per_day == tuple(events.groupby("dt").size().sort_index())
    assert summary.available_items_per_day == tuple(catalog.groupby("dt")["available"].sum().sort_index())
    assert summary.listed_items_per_day == tuple(catalog.groupby("dt").size().sort_index())
    assert summary.active_users == events["user_id"].nunique()
    assert (summary.users, summary.items, summary.days) == (USERS, ITEMS, DAYS)
    assert (summary.events_dir, summary.catalog_dir) == (out / "events", out / "catalog")
    line = str(summary)
    assert "\n" not in line and f"{len(events):,} events" in line


def test_mean_daily_events_per_user_is_close_to_the_requested_rate(sample):
    _, events, _, _, _ = sample
    rate = len(events) / (USERS * DAYS)
    assert 1.2 < rate < 1.8                                   # requested 1.5


def test_progress_reports_each_day_in_order(sample):
    _, _, _, _, messages = sample
    assert [m[:10] for m in messages] == [str(END - dt.timedelta(days=k)) for k in range(DAYS - 1, -1, -1)]


def test_event_timestamps_fall_inside_their_partition_day(sample):
    _, events, _, _, _ = sample
    assert (events["ts"].dt.tz is not None) and str(events["ts"].dt.tz) == "UTC"
    assert (events["ts"].dt.date == events["dt"]).all()
    seconds = events["ts"].dt.hour * 3600 + events["ts"].dt.minute * 60
    assert seconds.min() < 3 * 3600 and seconds.max() > 21 * 3600  # spread over the whole day


def test_a_users_events_never_share_a_timestamp(sample):
    _, events, _, _, _ = sample
    assert not events.duplicated(["user_id", "ts"]).any()


def test_end_date_defaults_to_yesterday_utc(tmp_path):
    summary = generate_sample(tmp_path, SampleSpec(users=20, items=30, days=1, seed=1))
    yesterday = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)
    assert summary.last_date == yesterday
    assert [p.name for p in (tmp_path / "events").iterdir()] == [f"dt={yesterday}"]


# ----------------------------------------------------------------------------- determinism


def test_same_seed_gives_identical_content_and_another_seed_does_not(tmp_path):
    def make(name: str, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        generate_sample(tmp_path / name, SampleSpec(users=300, items=200, days=3, seed=seed, end_date=END))
        return _read_dataset(tmp_path / name / "events"), _read_dataset(tmp_path / name / "catalog")

    first, again, other = make("a", 11), make("b", 11), make("c", 12)
    pd.testing.assert_frame_equal(first[0], again[0])
    pd.testing.assert_frame_equal(first[1], again[1])
    assert len(first[0]) != len(other[0]) or not first[0].equals(other[0])


# ----------------------------------------------------------------------------- items


def test_item_popularity_has_a_small_head_and_a_long_tail(sample):
    _, events, _, _, _ = sample
    counts = events["item_id"].value_counts().to_numpy()          # descending
    share = counts.cumsum() / counts.sum()
    head = ITEMS // 20                                            # top 5% of the catalog
    assert share[head - 1] > 0.40
    assert counts[0] / counts.sum() < 0.10                        # a head, not a single item
    ranks = np.arange(5, 300)
    slope = np.polyfit(np.log(ranks + 1), np.log(counts[ranks]), 1)[0]
    assert -1.6 < slope < -0.5                                    # Zipf-like rank-frequency


def test_items_have_named_categories_and_readable_titles_derived_from_the_id(sample, tmp_path):
    _, _, catalog, _, _ = sample
    categories = catalog["category"].unique()
    assert 10 <= len(categories) <= 30
    assert all(re.fullmatch(r"[a-z]+", c) for c in categories)
    titles = catalog.drop_duplicates(["item_id", "title"])
    assert titles["item_id"].is_unique                            # one title per item in every snapshot
    match = titles["title"].str.extract(r"^([A-Z][a-z]+(?: [A-Z][\w'-]*)+) #(\d+)$")
    assert match.notna().all().all()
    assert (match[1].astype(int) == titles["item_id"]).all()
    # the same item id has the same title and category whatever the seed
    generate_sample(tmp_path, SampleSpec(users=50, items=ITEMS, days=1, seed=999, end_date=END))
    other = _read_dataset(tmp_path / "catalog").set_index("item_id")
    mine = catalog[catalog["dt"] == END].set_index("item_id")
    joined = mine.join(other, rsuffix="_other", how="inner")
    assert len(joined) > 0.8 * ITEMS
    assert (joined["title"] == joined["title_other"]).all()
    assert (joined["category"] == joined["category_other"]).all()


# ----------------------------------------------------------------------------- users


def _with_category(events: pd.DataFrame, catalog: pd.DataFrame) -> pd.DataFrame:
    cats = catalog.drop_duplicates("item_id").set_index("item_id")["category"]
    views = events[events["event_type"] == "view"].copy()
    views["category"] = views["item_id"].map(cats)
    return views


def test_users_concentrate_on_a_few_taste_categories(sample):
    _, events, catalog, _, _ = sample
    views = _with_category(events, catalog)
    heavy = views.groupby("user_id").filter(lambda g: len(g) >= 30)
    top3 = heavy.groupby("user_id")["category"].agg(
        lambda c: c.value_counts(normalize=True).iloc[:3].sum())
    overall_top3 = views["category"].value_counts(normalize=True).iloc[:3].sum()
    assert heavy["user_id"].nunique() > 100
    assert top3.median() > 0.75
    assert overall_top3 < 0.5


def test_user_tastes_drift_so_recent_behaviour_differs_from_old(sample):
    _, events, catalog, _, _ = sample
    views = _with_category(events, catalog)
    day = (views["dt"] - min(views["dt"])).map(lambda d: d.days)
    views = views.assign(early=day < DAYS // 2, even=day % 2 == 0)
    heavy = views.groupby("user_id").filter(lambda g: g["early"].sum() >= 15 and (~g["early"]).sum() >= 15)
    def split_distance(column: str) -> pd.Series:
        return heavy.groupby("user_id").apply(
            lambda g: _total_variation(g.loc[g[column], "category"], g.loc[~g[column], "category"]))

    drift, noise = split_distance("early"), split_distance("even")     # old vs recent; interleaved days
    assert len(drift) > 50
    assert drift.mean() > 1.4 * noise.mean()


def test_user_activity_is_heterogeneous_and_users_skip_days(sample):
    summary, events, _, _, _ = sample
    per_user = events.groupby("user_id").size().sort_values(ascending=False).to_numpy()
    assert per_user[: len(per_user) // 10].sum() / per_user.sum() > 0.35   # top 10% of users
    assert per_user[0] > 10 * np.median(per_user)
    days_active = events.groupby("user_id")["dt"].nunique()
    assert days_active.median() < DAYS / 2
    assert (days_active == DAYS).sum() > 0                                 # and some come every day
    assert summary.active_users < USERS


# ----------------------------------------------------------------------------- order and funnel


def test_next_item_is_predictable_from_the_previous_one(sample):
    """A successor table learnt on half the users predicts the other half's next item, in time order only."""
    _, events, _, _, _ = sample
    views = events[events["event_type"] == "view"].sort_values(["user_id", "ts"])
    rng = np.random.default_rng(0)
    shuffled = views.assign(ts=rng.permutation(len(views))).sort_values(["user_id", "ts"])

    def hit_rate(frame: pd.DataFrame) -> float:
        pairs = frame.assign(prev=frame.groupby("user_id")["item_id"].shift()).dropna()
        pairs = pairs.astype({"prev": "int64"})
        train, test = pairs[pairs["user_id"] % 2 == 0], pairs[pairs["user_id"] % 2 == 1]
        top = (train.groupby(["prev", "item_id"]).size().rename("n").reset_index()
               .sort_values(["prev", "n"], ascending=[True, False]).drop_duplicates("prev")
               .set_index("prev")["item_id"])
        return float((test["prev"].map(top) == test["item_id"]).mean())

    ordered, control = hit_rate(views), hit_rate(shuffled)
    assert ordered > 0.2
    assert ordered > 2 * control


def test_event_types_form_a_funnel_from_views_to_purchases(sample):
    _, events, _, _, _ = sample
    counts = events["event_type"].value_counts()
    assert set(counts.index) == {"view", "click", "add_to_cart", "purchase"}
    assert counts["view"] > counts["click"] > counts["add_to_cart"] > counts["purchase"] > 0
    assert counts["purchase"] / counts["view"] < 0.1


def test_every_purchase_follows_a_view_click_and_cart_of_the_same_item(sample):
    _, events, _, _, _ = sample
    first = events.pivot_table(index=["user_id", "item_id"], columns="event_type", values="ts", aggfunc="min")
    bought = first[first["purchase"].notna()]
    assert len(bought) > 0
    assert (bought["view"] < bought["click"]).all()
    assert (bought["click"] < bought["add_to_cart"]).all()
    assert (bought["add_to_cart"] < bought["purchase"]).all()


# ----------------------------------------------------------------------------- catalog


def test_catalog_gains_new_items_and_keeps_retired_ones_listed_as_unavailable(sample):
    _, _, catalog, _, _ = sample
    wide = catalog.pivot(index="item_id", columns="dt", values="available")   # NaN: not listed yet
    listed = wide.notna()
    first, last = wide.columns[0], wide.columns[-1]
    launched = wide.index[~listed[first] & listed[last]]
    assert len(launched) > 0.03 * ITEMS
    assert launched.min() > wide.index[listed[first]].max()      # newer items have higher ids
    assert not (listed.astype(int).diff(axis=1).fillna(0) < 0).any().any()   # never delisted
    unavailable = wide.eq(False)
    assert not (unavailable.astype(int).cummax(axis=1).astype(bool) & wide.eq(True)).any().any()
    retired = wide.index[wide[first].eq(True) & wide[last].eq(False)]
    assert len(retired) > 0.02 * ITEMS
    assert unavailable[first].sum() > 0                          # listed-but-unavailable from day one


def test_events_only_reference_items_available_in_that_days_snapshot(sample):
    _, events, catalog, _, _ = sample
    available = catalog.loc[catalog["available"], ["dt", "item_id"]]
    joined = events.merge(available, on=["dt", "item_id"], how="left", indicator=True)
    assert (joined["_merge"] == "both").all()


def test_items_launched_during_the_window_get_events(sample):
    _, events, catalog, _, _ = sample
    first_listed = catalog.loc[catalog["dt"] == catalog["dt"].min(), "item_id"]
    new_items = events.loc[~events["item_id"].isin(first_listed), "item_id"].nunique()
    assert new_items > 0.02 * ITEMS


# ----------------------------------------------------------------------------- resources and inputs


def test_memory_does_not_grow_with_the_number_of_days(tmp_path):
    """Peak traced (numpy/Python) memory for 20 days stays at the 2-day level: days are not accumulated."""
    def peak(days: int) -> int:
        tracemalloc.start()
        generate_sample(tmp_path / str(days), SampleSpec(users=2000, items=300, days=days, seed=3, end_date=END))
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    peak(1)                                   # warm-up: lazy imports inside pyarrow count once
    assert peak(20) < 1.5 * peak(2)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"users": 0}, "users"),
        ({"items": -5}, "items"),
        ({"days": 0}, "days"),
        ({"seed": -1}, "seed"),
        ({"events_per_user_day": 0.0}, "events_per_user_day"),
        ({"events_per_user_day": float("nan")}, "events_per_user_day"),
    ],
)
def test_rejects_impossible_arguments_naming_them(tmp_path, kwargs, word):
    args = {"users": 10, "items": 10, "days": 1, "seed": 0, **kwargs}
    with pytest.raises(InputDataError, match=word):
        generate_sample(tmp_path, SampleSpec(end_date=END, **args))
    assert not (tmp_path / "events").exists()


def test_refuses_to_mix_with_existing_partitions_unless_asked_to_overwrite(tmp_path):
    generate_sample(tmp_path, SampleSpec(users=30, items=20, days=3, seed=1, end_date=END))
    with pytest.raises(InputDataError, match="already holds"):
        generate_sample(tmp_path, SampleSpec(users=30, items=20, days=2, seed=1, end_date=END))
    generate_sample(tmp_path, SampleSpec(users=30, items=20, days=2, seed=1, end_date=END), overwrite=True)
    assert len(list((tmp_path / "events").iterdir())) == 2
    assert len(list((tmp_path / "catalog").iterdir())) == 2


# ----------------------------------------------------------------------------- returns (repeats)


def _views_with_earlier_days(events: pd.DataFrame) -> pd.DataFrame:
    """Views of returning users (active on an earlier day), flagged ``repeat`` when the user had the item
    on an earlier day."""
    views = events[events["event_type"] == "view"]
    first_day_of_user = views.groupby("user_id")["dt"].transform("min")
    first_day_of_pair = views.groupby(["user_id", "item_id"])["dt"].transform("min")
    returning = views["dt"] > first_day_of_user
    return views[returning].assign(repeat=first_day_of_pair[returning] < views.loc[returning, "dt"])


def test_returning_users_come_back_to_earlier_items_at_the_default_rate(sample):
    _, events, _, _, _ = sample
    views = _views_with_earlier_days(events)
    assert len(views) > 10_000
    # a little below the rate: a user whose only earlier item is the one on screen discovers instead
    assert REPEAT_RATE - 0.05 < views["repeat"].mean() <= REPEAT_RATE + 0.01


def test_the_repeat_rate_can_be_set(tmp_path):
    generate_sample(tmp_path, SampleSpec(users=1000, items=500, days=6, seed=3, end_date=END, repeat_rate=0.3))
    views = _views_with_earlier_days(_read_dataset(tmp_path / "events"))
    assert len(views) > 2000
    assert 0.25 < views["repeat"].mean() <= 0.31


def test_with_repeat_rate_zero_no_user_looks_at_an_item_twice(tmp_path):
    generate_sample(tmp_path, SampleSpec(users=1000, items=500, days=6, seed=3, end_date=END, repeat_rate=0.0))
    events = _read_dataset(tmp_path / "events")
    views = events[events["event_type"] == "view"]
    assert len(views) > 5000 and views.groupby("user_id")["dt"].nunique().max() > 1
    assert not views.duplicated(["user_id", "item_id"]).any()


def test_users_come_back_more_to_items_they_used_recently_and_often(sample):
    """On the last day, of the items each active user had before: the share they came back to, by how many
    days ago they last used it and by how often."""
    _, events, _, _, _ = sample
    views = events[events["event_type"] == "view"]
    last = views["dt"].max()
    before, today = views[views["dt"] < last], views[views["dt"] == last]
    had = (before[before["user_id"].isin(today["user_id"])].groupby(["user_id", "item_id"])
           .agg(uses=("dt", "size"), last_used=("dt", "max")).reset_index())
    came_back = today[["user_id", "item_id"]].drop_duplicates().assign(back=True)
    had = had.merge(came_back, on=["user_id", "item_id"], how="left").fillna({"back": False})
    days_ago = had["last_used"].map(lambda d: (last - d).days)
    assert had.loc[days_ago == 1, "back"].mean() > 2 * had.loc[days_ago > 3, "back"].mean()
    assert had.loc[had["uses"] > 3, "back"].mean() > 2 * had.loc[had["uses"] == 1, "back"].mean()


def test_each_users_most_used_item_is_a_good_guess_for_tomorrow_but_not_a_sure_one(sample):
    """Personal frequency is a real baseline on this data (a learned model has to beat it), yet it misses often."""
    _, events, _, _, _ = sample
    views = events[events["event_type"] == "view"]
    last = views["dt"].max()
    before, today = views[views["dt"] < last], views[views["dt"] == last]
    counts = before.groupby(["user_id", "item_id"]).size().rename("uses").reset_index()
    counts = counts[counts["user_id"].isin(today["user_id"])]
    rng = np.random.default_rng(0)
    counts["noise"] = rng.random(len(counts))
    tomorrow = set(map(tuple, today[["user_id", "item_id"]].to_numpy()))

    def hit_rate(order: list[str]) -> float:
        top = counts.sort_values(["user_id", *order], ascending=False).drop_duplicates("user_id")
        return float(np.mean([(u, i) in tomorrow for u, i in zip(top["user_id"], top["item_id"])]))

    most_used, any_known = hit_rate(["uses", "noise"]), hit_rate(["noise"])
    assert most_used > 1.3 * any_known
    assert most_used < 0.8


def test_items_new_to_the_user_still_follow_the_previous_item(sample):
    """Discoveries keep the order a sequence model learns: the successor table of the order test, scored on
    the steps to an item new to the user only."""
    _, events, _, _, _ = sample
    views = events[events["event_type"] == "view"].sort_values(["user_id", "ts"])
    shuffled = views.assign(ts=np.random.default_rng(0).permutation(len(views))).sort_values(["user_id", "ts"])

    def hit_rate(frame: pd.DataFrame) -> float:
        pairs = frame.assign(prev=frame.groupby("user_id")["item_id"].shift(),
                             new=~frame.duplicated(["user_id", "item_id"])).dropna()
        pairs = pairs[pairs["new"]].astype({"prev": "int64"})
        train, test = pairs[pairs["user_id"] % 2 == 0], pairs[pairs["user_id"] % 2 == 1]
        top = (train.groupby(["prev", "item_id"]).size().rename("n").reset_index()
               .sort_values(["prev", "n"], ascending=[True, False]).drop_duplicates("prev")
               .set_index("prev")["item_id"])
        return float((test["prev"].map(top) == test["item_id"]).mean())

    ordered, control = hit_rate(views), hit_rate(shuffled)
    assert ordered > 0.15
    assert ordered > 2 * control


def test_without_a_repeat_rate_users_meet_items_again_by_chance_only(tmp_path):
    """``repeat_rate=None``: the generator before returns were planted (its data reproduces figures measured
    then): discoveries may fall on items the user had, and nothing else brings users back."""
    generate_sample(tmp_path / "chance",
                    SampleSpec(users=1000, items=500, days=6, seed=3, end_date=END, repeat_rate=None))
    generate_sample(tmp_path / "planted", SampleSpec(users=1000, items=500, days=6, seed=3, end_date=END))
    chance = _views_with_earlier_days(_read_dataset(tmp_path / "chance" / "events"))["repeat"].mean()
    planted = _views_with_earlier_days(_read_dataset(tmp_path / "planted" / "events"))["repeat"].mean()
    assert 0.05 < chance < planted - 0.2


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), True])
def test_rejects_a_repeat_rate_outside_0_to_1(tmp_path, rate):
    with pytest.raises(InputDataError, match="repeat_rate"):
        generate_sample(tmp_path, SampleSpec(users=10, items=10, days=1, seed=0, end_date=END, repeat_rate=rate))
    assert not (tmp_path / "events").exists()


def test_the_command_refuses_a_bad_repeat_rate_with_exit_2(tmp_path, caplog):
    from recsys.cli.main import main
    from recsys.errors import ExitCode

    code = main(["sample-data", "--out", str(tmp_path), "--users", "10", "--items", "10", "--days", "1",
                 "--repeat-rate", "1.5"])
    assert code == ExitCode.BAD_INPUT
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"repeat_rate must be a share from 0 to 1 (default {REPEAT_RATE}), got 1.5"]
