"""benchmarks/new_items.py (issue 20, part 3): the new-item figures on hand-made tables (no Spark), and the
script's main path on tiny sample data (real Spark, real sqlite MLflow store, a tiny model)."""
from __future__ import annotations

import datetime as dt
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_script():
    """The script is not a package module: loaded from its file (registered first, as dataclasses need)."""
    name = "benchmarks_new_items"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "new_items.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


D = dt.date(2024, 6, 10)


def _catalog(rows: dict[int, bool | None]) -> pa.Table:
    return pa.table({"item_id": pa.array(list(rows), pa.int64()), "available": pa.array(list(rows.values()), pa.bool_()),
                     "title": pa.array([f"Item {i}" for i in rows])})


def _recommendations(lists: dict[int, list[int]]) -> pa.Table:
    rec = pa.struct([("item_id", pa.int64()), ("score", pa.float32())])
    return pa.table({"user_id": pa.array(list(lists), pa.int64()),
                     "recommendations": pa.array([[{"item_id": i, "score": 1.0} for i in items] for items in lists.values()],
                                                 pa.list_(rec))})


def test_an_item_is_first_available_in_the_first_snapshot_that_lists_it_as_available():
    ni = _load_script()
    snapshots = [  # out of order on purpose; item 3 is listed unavailable (not yet launched) before it is available
        (dt.date(2024, 6, 5), _catalog({1: True, 2: True, 3: True, 4: None})),
        (dt.date(2024, 6, 1), _catalog({1: True, 2: False, 3: False})),
        (dt.date(2024, 6, 9), _catalog({1: True, 2: True, 3: True, 5: True})),
    ]
    firsts = dict(zip(*ni.first_available(snapshots).to_pydict().values()))
    assert firsts == {1: dt.date(2024, 6, 1), 2: dt.date(2024, 6, 5), 3: dt.date(2024, 6, 5), 5: dt.date(2024, 6, 9)}
    assert ni.first_available([]).num_rows == 0


def test_the_figures_count_known_items_and_new_items_in_slots_distinct_items_and_users():
    ni = _load_script()
    # D's snapshot: items 1-6 available, 7 retired; 4, 5 and 6 entered on or after D - 7 (6 on the last day)
    snapshot = _catalog({1: True, 2: True, 3: True, 4: True, 5: True, 6: True, 7: False})
    firsts = pa.table({"item_id": pa.array([1, 2, 3, 4, 5, 6, 7], pa.int64()),
                       "first_available": pa.array([dt.date(2024, 5, 1)] * 3 + [dt.date(2024, 6, 3),
                                                   dt.date(2024, 6, 5), dt.date(2024, 6, 9), dt.date(2024, 5, 1)],
                                                   pa.date32())})
    known = np.array([1, 2, 3, 4, 7, 99])            # 5 and 6 unknown; 7 and 99 known but not available
    recs = _recommendations({10: [1, 4, 2], 11: [4, 3], 12: [], 13: [2, 1]})
    figs = ni.new_item_figures(snapshot, firsts, known, recs, since=D - dt.timedelta(days=7),
                               interacted_items=np.array([1, 2, 3, 4, 5, 7]))
    assert figs == {
        "interacted_available_items": 5, "interacted_new_items": 2,
        "available_items": 6, "known_available_items": 4, "known_available_share": 4 / 6,
        "new_items": 3, "known_new_items": 1, "known_new_share": 1 / 3,
        "users": 4, "slots": 7, "new_slots": 2, "new_slot_share": 2 / 7,
        "distinct_recommended": 4, "distinct_new_recommended": 1, "distinct_new_share": 1 / 4,
        "users_with_new": 2, "users_with_new_share": 2 / 4,
    }
    # "entered in the newest snapshot": only item 6, which nobody could know or recommend
    newest = ni.new_item_figures(snapshot, firsts, known, recs, since=dt.date(2024, 6, 9))
    assert (newest["new_items"], newest["known_new_items"], newest["new_slots"]) == (1, 0, 0)
    assert "interacted_new_items" not in newest


def test_shares_are_none_when_there_is_nothing_to_divide_by():
    ni = _load_script()
    snapshot = _catalog({1: True})
    firsts = pa.table({"item_id": pa.array([1], pa.int64()), "first_available": pa.array([dt.date(2024, 1, 1)], pa.date32())})
    figs = ni.new_item_figures(snapshot, firsts, np.array([1]), _recommendations({}), since=D)
    assert figs["new_items"] == 0 and figs["known_new_share"] is None
    assert figs["slots"] == 0 and figs["new_slot_share"] is None and figs["users_with_new_share"] is None
    assert figs["known_available_share"] == 1.0


def test_the_script_explains_itself():
    ni = _load_script()
    with pytest.raises(SystemExit) as done:
        ni.parse_args(["--help"])
    assert done.value.code == 0
    args = ni.parse_args(["--set", "train.epochs=2"])
    assert (args.users, args.items, args.days, args.end_date) == (2000, 3000, 30, dt.date(2026, 11, 30))


@pytest.mark.spark
@pytest.mark.slow
def test_on_tiny_sample_data_the_refit_model_knows_at_least_what_the_held_out_one_knows(spark, tmp_path):
    import pyarrow.dataset as ds

    from recsys.data.sample import SampleSpec, generate_sample

    ni = _load_script()
    summary = generate_sample(tmp_path / "data", SampleSpec(users=300, items=400, days=10, seed=5,
                                                            end_date=dt.date(2024, 6, 9)))
    overrides = ["train.device=cpu", "train.epochs=1", "train.model.sasrec.dim=8", "train.model.sasrec.layers=1",
                 "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8", "scoring.top_n=5"]
    report = ni.run_benchmark(spark, tmp_path / "data", tmp_path / "work", D, overrides)

    before, after = report.variants
    assert (before.refit, after.refit) == (False, True)
    assert after.figures["known_available_items"] >= before.figures["known_available_items"]
    assert after.figures["known_new_items"] >= before.figures["known_new_items"]
    assert after.vocabulary_items >= before.vocabulary_items
    for v in report.variants:
        for figs in (v.figures, v.newest_figures):
            assert all(0.0 <= x <= 1.0 for k, x in figs.items() if k.endswith("_share") and x is not None)
            assert figs["known_available_items"] <= figs["interacted_available_items"] <= figs["available_items"]
            assert figs["known_new_items"] <= figs["interacted_new_items"] <= figs["new_items"] <= figs["available_items"]
        assert v.newest_figures["new_items"] <= v.figures["new_items"]
        partition = ds.dataset(tmp_path / "work" / v.label / "recommendations" / f"dt={D}", format="parquet",
                               partitioning=None).to_table()
        lengths = [len(r) for r in partition.column("recommendations").to_pylist()]
        assert v.figures["users"] == partition.num_rows == v.model_users + v.fallback_users
        assert v.figures["slots"] == sum(lengths) and max(lengths) <= 5
        assert v.figures["new_slots"] <= v.figures["slots"]
        assert v.catalog_snapshot == str(summary.last_date)
    table = ni.markdown_table(report)
    assert table.startswith(f"| recommend {D} |") and "`train.refit=true`" in table
