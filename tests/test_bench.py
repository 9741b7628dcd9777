"""The benchmark's arithmetic and its core-only path (the Spark systems are exercised by the job's own tests)."""
from __future__ import annotations

import json

import pytest

from recsys.bench.run import (ALS, BARE, BARE_THREADS, BF16, INT8, JOB, JOB_INT8, PBU, REF, BenchOptions, _report,
                              format_table, run_bench, write_json)
from recsys.model import precision
from recsys.scoring import core as core_module
from recsys.bench.shapes import BenchShape, params


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


def test_reference_and_bf16_rows_are_ratios_in_the_same_mode_by_hand():
    opts = BenchOptions(shape=BenchShape(users=1000), repeats=1)
    seconds = {REF: [2.0], BARE: [0.8], BARE_THREADS: [0.5], BF16: [0.4]}
    result = _report(opts, seconds, {"device": "cpu", "reference_identical_lists": 1.0, "bf16_overlap": 0.995})
    assert result["ratios"]["bare/reference"] == pytest.approx(4.0)          # threads row vs reference
    assert result["ratios"]["bf16/reference"] == pytest.approx(5.0)
    assert result["bare_limit_users_per_s"] == pytest.approx(2000)            # reference and bf16 are not the limit
    table = format_table(result)
    assert "fp32 core / reference core: 4.00x" in table and "overlap with fp32: 0.9950" in table


def test_core_only_runs_without_spark_and_writes_json(tmp_path, monkeypatch):
    shape = BenchShape(users=300, items=60, dim=8, history=6, top_n=10, layers=1, heads=1)
    monkeypatch.setattr(core_module, "cpu_bf16_supported", lambda: True)   # the bf16 row runs (emulated if need be)
    monkeypatch.setattr(core_module, "cpu_int8_refusal", lambda: "")      # and the int8 row (oneDNN runs it anywhere)
    result = run_bench(BenchOptions(shape=shape, repeats=2, cores=2, scoring=params(shape, chunk_size=64, device="cpu"),
                                    core_only=True), log=lambda _: None)

    assert set(result["users_per_s"]) == {REF, BARE, BARE_THREADS, BF16, INT8}
    assert result["reference_identical_lists"] > 0.9 and result["bf16_overlap"] > 0.9 and result["int8_overlap"] > 0.9
    assert all(len(s) == 2 and min(s) > 0 for s in result["seconds"].values())
    write_json(result, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text())["shape"]["users"] == 300


def test_bf16_and_int8_rows_are_skipped_with_the_reason_on_an_avx2_only_cpu(monkeypatch):
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: {"avx2": True, "fma3": True})   # the checks' seam
    shape = BenchShape(users=100, items=60, dim=8, history=6, top_n=10, layers=1, heads=1)
    result = run_bench(BenchOptions(shape=shape, repeats=1, cores=1, scoring=params(shape, chunk_size=64, device="cpu"),
                                    core_only=True, skip=(REF,)), log=lambda _: None)
    assert set(result["users_per_s"]) == {BARE}
    assert "AVX-512-BF16" in result["bf16_skipped"] and "AVX-512-VNNI" in result["int8_skipped"]
    table = format_table(result)
    assert "bf16 row skipped" in table and "int8 rows skipped: scoring.dtype=int8 needs" in table


def test_int8_rows_are_ratios_to_their_own_core_and_to_als_by_hand():
    opts = BenchOptions(shape=BenchShape(users=1000), repeats=1)
    seconds = {BARE: [1.0], BARE_THREADS: [0.5], INT8: [0.25], JOB: [0.6], JOB_INT8: [0.3125], ALS: [5.0]}
    result = _report(opts, seconds, {"device": "cpu", "int8_overlap": 0.995})
    r = result["ratios"]
    assert r["int8/bare"] == pytest.approx(2.0)                              # against the N-threads fp32 row
    assert r["job_int8/bare_int8"] == pytest.approx(0.8)                     # the int8 job against its own core
    assert r["job_int8/als"] == pytest.approx(16.0) and r["job/als"] == pytest.approx(5.0 / 0.6)
    assert result["overhead_us_per_user"][JOB_INT8] == pytest.approx(62.5)   # (0.3125 - 0.25) s / 1000 users
    assert result["bare_limit_users_per_s"] == pytest.approx(2000)           # the fp32 rows stay the limit
    table = format_table(result)
    assert "int8 core / fp32 core: 2.00x (same mode); top-N overlap with fp32: 0.9950" in table
    assert "int8 job / int8 bare core: 0.80" in table and "int8 job / Spark ALS: 16.00x" in table


def test_the_bench_scores_with_the_job_s_settings_unless_told_otherwise():
    from recsys.config import load_config
    from recsys.scoring.params import ScoringParams

    job = ScoringParams.from_config(load_config().scoring)
    opts = BenchOptions(shape=BenchShape(users=100, top_n=job.top_n))
    assert opts.scoring == ScoringParams(**{**job.__dict__, "device": "cpu"})   # max_tile_mb included


def test_scoring_params_defaults_are_the_embedded_configuration_s():
    import dataclasses

    from recsys.config import load_config
    from recsys.scoring.params import ScoringParams

    scoring = load_config().scoring
    defaults = {f.name: f.default for f in dataclasses.fields(ScoringParams) if f.default is not dataclasses.MISSING}
    assert defaults == {name: getattr(scoring, name) for name in defaults}
