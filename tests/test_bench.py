"""The benchmark's arithmetic and its core-only path (the Spark systems are exercised by the job's own tests)."""
from __future__ import annotations

import json

import pytest

from recsys.bench.run import ALS, BARE, BARE_THREADS, JOB, PBU, BenchOptions, _report, format_table, run_bench, write_json
from recsys.bench.shapes import BenchShape


def test_ratios_are_medians_against_the_faster_bare_core_by_hand():
    opts = BenchOptions(shape=BenchShape(users=1000), repeats=3)
    seconds = {BARE: [1.0, 0.9, 5.0], BARE_THREADS: [0.5, 0.6, 0.4], JOB: [0.6, 0.55, 9.0],
               PBU: [0.8, 0.75, 0.7], ALS: [4.0, 5.0, 6.0]}
    result = _report(opts, seconds, {"device": "cpu"})

    assert result["users_per_s"][BARE] == pytest.approx(1000 / 1.0)         # medians, not means
    assert result["bare_limit_users_per_s"] == pytest.approx(1000 / 0.5)    # the faster bare row
    assert result["ratios"][f"{JOB}/bare"] == pytest.approx(0.5 / 0.6)
    # overheads in seconds per user: job 0.1/1000, pbu 0.25/1000
    assert result["overhead_us_per_user"][JOB] == pytest.approx(100.0)
    assert result["overhead_us_per_user"][PBU] == pytest.approx(250.0)
    assert result["ratios"]["job_overhead/pbu_overhead"] == pytest.approx(0.4)
    assert result["ratios"]["job/als"] == pytest.approx(5.0 / 0.6)
    assert "job / Spark ALS: 8.33x" in format_table(result)


def test_core_only_runs_without_spark_and_writes_json(tmp_path):
    shape = BenchShape(users=300, items=60, dim=8, history=6, top_n=10, layers=1, heads=1)
    result = run_bench(BenchOptions(shape=shape, repeats=2, chunk_size=64, cores=2, core_only=True), log=lambda _: None)

    assert set(result["users_per_s"]) == {BARE, BARE_THREADS}
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
    write_json(result, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text())["shape"]["users"] == 300
