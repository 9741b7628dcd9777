"""The session-wide check that no test writes into the checkout (tests/checkout_guard.py, tests/conftest.py)."""
from __future__ import annotations

import os

import checkout_guard


def _demo_state(root):
    """What a user's ``make demo`` leaves: the guard's baseline, never a failure."""
    (root / ".recsys" / "driver" / "models" / "recsys-default").mkdir(parents=True)
    (root / ".recsys" / "mlflow.db").write_bytes(b"demo store")
    memo = root / ".recsys" / "driver" / "models" / "recsys-default" / "last-resolved@champion.json"
    memo.write_text('{"version": "1"}')
    (root / ".recsys" / "stale.lock").write_text("x")
    (root / "README.md").write_text("not watched")
    return memo


def test_files_left_changed_or_removed_under_the_watched_places_are_named(tmp_path):
    memo = _demo_state(tmp_path)
    before = checkout_guard.snapshot(tmp_path)
    assert ".recsys/mlflow.db" in before and ".recsys/driver/" in before and "README.md" not in before
    assert checkout_guard.differences(before, checkout_guard.snapshot(tmp_path)) == []   # the demo alone: fine

    memo.write_text('{"version": "1", "from": "a test store"}')                          # a test's memo over the demo's
    (tmp_path / ".recsys" / "work").mkdir()
    (tmp_path / ".recsys" / "work" / "histories.parquet").write_bytes(b"PAR1")
    (tmp_path / ".recsys" / "stale.lock").unlink()
    (tmp_path / "mlruns" / "0").mkdir(parents=True)
    (tmp_path / "mlruns" / "0" / "meta.yaml").write_text("x")
    (tmp_path / "README.md").write_text("edited by hand: not the guard's business")
    (tmp_path / "spark-warehouse").mkdir()                                               # empty, but new
    lines = checkout_guard.differences(before, checkout_guard.snapshot(tmp_path))
    assert lines == [
        "changed:     .recsys/driver/models/recsys-default/last-resolved@champion.json",
        "removed:     .recsys/stale.lock",
        "left behind: .recsys/work/histories.parquet",
        "left behind: mlruns/0/meta.yaml",
        "left behind: spark-warehouse/",
    ]
    message = checkout_guard.report(tmp_path, lines)
    assert str(tmp_path) in message and "last-resolved@champion.json" in message and "tmp_path" in message


def test_a_rewrite_of_the_same_size_is_seen_by_its_modification_time(tmp_path):
    memo = _demo_state(tmp_path)
    before = checkout_guard.snapshot(tmp_path)
    memo.write_text('{"version": "2"}')                       # same length, other bytes
    st = memo.stat()
    os.utime(memo, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))   # coarse clocks: make the new write's time differ
    assert checkout_guard.differences(before, checkout_guard.snapshot(tmp_path)) == [
        "changed:     .recsys/driver/models/recsys-default/last-resolved@champion.json"]


def test_the_guard_runs_around_every_session(request):
    assert "checkout_untouched" in request.fixturenames            # autouse, session-wide (tests/conftest.py)
    assert (checkout_guard.CHECKOUT / "spark-submit.sh").is_file()   # it watches this checkout, not tests/
