"""benchmarks/compare_backtests.py: two backtests' per-user figures compared pair by pair (no Spark: the figures
are written here in the layout ``recsys backtest`` writes under its work directory)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_backtests.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_backtests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _work(root: Path, hits: dict[str, np.ndarray], recall_at: int = 20) -> Path:
    """A backtest work directory: per night, users 1..U with the job's hr@10 (and a new-item figure, NaN for half),
    and its recall at ``recall_at`` (the backtest's N is ``scoring.top_n``'s, up to 20)."""
    for night, hr in hits.items():
        users = np.arange(1, len(hr) + 1)
        new = np.where(users % 2 == 0, hr, np.nan)
        part = root / "figures" / f"dt={night}"
        part.mkdir(parents=True)
        pq.write_table(pa.table({"user_id": pa.array(users, pa.int64()), "targets": pa.array(np.ones(len(hr), np.int32)),
                                 "job__hr_10": pa.array(hr.astype(np.float64)),
                                 "job__hr_10_new": pa.array(new.astype(np.float64), from_pandas=True),
                                 f"job__recall_{recall_at}": pa.array(hr.astype(np.float64)),
                                 "als__hr_10": pa.array(np.zeros(len(hr)))}), part / "part-0.parquet")
    return root


def test_the_same_figures_differ_by_nothing_and_lost_hits_show_as_an_interval_below_zero(tmp_path, capsys):
    rng = np.random.default_rng(0)
    nights = {f"2024-01-{d:02d}": (rng.random(400) < 0.6).astype(float) for d in (25, 26, 27)}
    a = _work(tmp_path / "a", nights)
    same = _work(tmp_path / "same", nights)
    worse = _work(tmp_path / "worse", {n: np.where(np.arange(len(h)) % 5 == 0, 0.0, h) for n, h in nights.items()})
    module = _module()

    result = module.compare(module.read_figures(a, "job"), module.read_figures(same, "job"), 500, 1)
    assert result["pairs"] == 1200 and result["users"] == 400 and len(result["nights"]) == 3
    assert result["figures"]["job__hr_10"]["b_minus_a"] == 0 and result["figures"]["job__hr_10"]["interval"] == [0, 0]
    assert result["figures"]["job__hr_10_new"]["pairs"] == 600            # NaN pairs are left out, not counted as 0

    out = tmp_path / "cmp.json"
    assert module.main(["--a", str(a), "--b", str(worse), "--resamples", "500", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())["figures"]["job__hr_10"]
    lost = float(np.mean([np.mean(np.where(np.arange(len(h)) % 5 == 0, h, 0.0)) for h in nights.values()]))
    assert abs(doc["b_minus_a"] + lost) < 1e-9 and doc["interval"][1] < 0
    assert "job__hr_10 |" in capsys.readouterr().out


def test_runs_at_different_list_lengths_compare_the_figures_both_hold_and_name_the_others(tmp_path, capsys):
    rng = np.random.default_rng(1)
    nights = {f"2024-01-{d:02d}": (rng.random(100) < 0.5).astype(float) for d in (25, 26)}
    top20 = _work(tmp_path / "top20", nights)
    top10 = _work(tmp_path / "top10", nights, recall_at=10)             # a run with scoring.top_n=10
    module = _module()

    assert module.main(["--a", str(top20), "--b", str(top10), "--label-a", "top20", "--label-b", "top10",
                        "--resamples", "200", "--json", str(tmp_path / "cmp.json")]) == 0
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert sorted(doc["figures"]) == ["job__hr_10", "job__hr_10_new"]
    assert doc["figures_only_a"] == ["job__recall_20"] and doc["figures_only_b"] == ["job__recall_10"]
    out = capsys.readouterr().out
    assert "only top20 measured: job__recall_20" in out and "only top10 measured: job__recall_10" in out
