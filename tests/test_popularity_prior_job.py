"""The new items' recent-popularity prior in a real night: the counts the job takes are the users of each item on
the day before the night, and the lists rank new items by them when the model's blend weighs them heavily.

jobkit's tiny data (24 users, 30 items, two views a user a day on 2024-05-01..07) and its random model, saved with
a blend whose popularity weight (1000) drowns the model's scores: every model user's list must then be the items
they never had, in the order of how many users had each on 05-07 (the model only breaks ties). The same night
with the whole window's counts instead would list other items (checked, so the test can tell the two apart).
"""
from __future__ import annotations

import datetime as dt
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import RUN_DATE, TOP_N, UTC

pytestmark = [pytest.mark.spark]


def _users_per_item(events: list[dict], since: dt.datetime) -> Counter:
    return Counter(item for _, item in {(e["user_id"], e["item_id"]) for e in events if since <= e["ts"]})


def test_a_night_ranks_new_items_by_the_users_who_had_them_the_day_before(spark, tmp_path):
    from recsys.model.repeats import RepeatBlend
    from recsys.pipelines.nightly import run_nightly

    store = jobkit.make_store(tmp_path / "store", blend=RepeatBlend(popularity_weight=1000.0))
    jobkit.write_dataset(tmp_path)
    cfg = jobkit.config(tmp_path, store)
    assert run_nightly(spark, cfg, RUN_DATE).exit_code == 0

    night = dt.datetime.combine(RUN_DATE, dt.time(), UTC)
    events = [e for e in pq.read_table(tmp_path / "events").to_pylist() if e["ts"] < night]
    last_day = _users_per_item(events, night - dt.timedelta(days=1))
    window = _users_per_item(events, dt.datetime(2024, 1, 1, tzinfo=UTC))
    rows = pq.read_table(Path(cfg.paths.output) / f"dt={RUN_DATE}").to_pylist()
    told_apart = 0
    for row in rows:
        assert row["source"] == "model"
        known = {e["item_id"] for e in events if e["user_id"] == row["user_id"]}
        new = [i for i in range(1, jobkit.N_ITEMS + 1) if i not in known]
        listed = [r["item_id"] for r in row["recommendations"]]
        assert not set(listed) & known
        assert [last_day[i] for i in listed] == sorted((last_day[i] for i in new), reverse=True)[:TOP_N]
        told_apart += [window[i] for i in listed] != sorted((window[i] for i in new), reverse=True)[:TOP_N]
    assert told_apart > len(rows) // 2
