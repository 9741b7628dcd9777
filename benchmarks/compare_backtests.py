"""Two backtests of the job on the same data and nights, compared pair by pair: is B worse than A by more than the noise?

    python benchmarks/compare_backtests.py --a WORK_A --b WORK_B [--label-a full] [--label-b one-fit]
        [--system job] [--resamples 2000] [--seed 0] [--json PATH]

``WORK_A`` and ``WORK_B`` are the ``--work`` directories of two ``recsys backtest`` runs over the same nights of
the same data that differ in a setting (how training fits, warm or full nights, a rule). Each holds the per-user
figures of every night (``figures/dt=NIGHT/``). The returning users of a night are the same in both (they come
from the events, not from the lists), so the comparison is paired: for every figure, the mean of A, the mean
of B, and B - A with a 95% interval from the same two-way bootstrap over users and nights that the backtest's
own intervals use (:class:`recsys.evaluation.report.TwoWayDraws`). An interval that holds 0 means the two
cannot be told apart on these nights; one below 0 means B is worse.

Reads Parquet with pyarrow only: no Spark session, seconds to run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recsys.evaluation.backtest import figure_column  # noqa: E402
from recsys.evaluation.report import TwoWayDraws, interval  # noqa: E402

KEYS = ["user_id", "dt"]


def read_figures(work: Path, system: str) -> pa.Table:
    """user_id, dt and the system's figure columns of every night under ``work/figures``."""
    root = work / "figures"
    if not root.is_dir():
        raise SystemExit(f"{work} holds no backtest figures ({root} is missing): give the --work of a finished "
                         "`recsys backtest` run")
    data = ds.dataset(str(root), format="parquet", partitioning="hive")
    prefix = figure_column(system, "")
    columns = [c for c in data.schema.names if c.startswith(prefix)]
    if not columns:
        raise SystemExit(f"no figures of system {system!r} under {root}; its columns start with the system's name")
    table = data.to_table(columns=["user_id", "dt", *columns])
    return table.set_column(table.schema.get_field_index("dt"), "dt", table.column("dt").cast(pa.string()))


def compare(a: pa.Table, b: pa.Table, resamples: int, seed: int) -> dict:
    """Means of A and B over the (user, night) pairs both measured, and B - A with its interval, per figure."""
    # two runs with a different scoring.top_n measure recall@N at different N: the figures both hold are compared,
    # the others named
    in_a, in_b = set(a.column_names) - set(KEYS), set(b.column_names) - set(KEYS)
    figures = sorted(in_a & in_b)
    if not figures:
        raise SystemExit("the two backtests share no figure: were they run by the same version of recsys?")
    a, b = a.select([*KEYS, *figures]), b.select([*KEYS, *figures])
    joined = a.join(b, KEYS, join_type="inner", left_suffix="_a", right_suffix="_b")
    draws = TwoWayDraws(joined.column("user_id").to_numpy(), joined.column("dt").to_numpy(zero_copy_only=False),
                        resamples, seed)

    def values(name: str) -> np.ndarray:
        return joined.column(name).to_numpy(zero_copy_only=False).astype(np.float64)

    out = {"pairs": joined.num_rows, "only_a": a.num_rows - joined.num_rows, "only_b": b.num_rows - joined.num_rows,
           "users": len(np.unique(joined.column("user_id").to_numpy())),
           "nights": sorted(set(joined.column("dt").to_pylist())), "figures": {},
           "figures_only_a": sorted(in_a - in_b), "figures_only_b": sorted(in_b - in_a)}
    for figure in figures:
        va, vb = values(f"{figure}_a"), values(f"{figure}_b")
        both = np.isfinite(va) & np.isfinite(vb)
        if not both.any():
            continue
        diff = np.where(both, vb - va, np.nan)
        stacked = draws.means_many(np.column_stack([np.where(both, va, np.nan), np.where(both, vb, np.nan), diff]))
        out["figures"][figure] = {"a": float(np.nanmean(va[both])), "b": float(np.nanmean(vb[both])),
                                  "b_minus_a": float(np.nanmean(diff)), "interval": list(interval(stacked[:, 2])),
                                  "pairs": int(both.sum())}
    night_col = joined.column("dt").to_numpy(zero_copy_only=False)
    main = next((f for f in figures if f.endswith("__hr_10")), figures[0])
    out["by_night"] = {night: {"a": float(np.nanmean(values(f"{main}_a")[night_col == night])),
                               "b": float(np.nanmean(values(f"{main}_b")[night_col == night]))}
                       for night in out["nights"]}
    out["by_night_figure"] = main
    return out


def table(result: dict, label_a: str, label_b: str) -> str:
    lines = [f"{result['pairs']:,} (user, night) pairs measured in both ({result['users']:,} users, "
             f"{len(result['nights'])} nights); only in A: {result['only_a']}, only in B: {result['only_b']}", "",
             f"| figure | {label_a} | {label_b} | {label_b} - {label_a} [95%] | pairs |", "|---|---|---|---|---|"]
    for name, f in result["figures"].items():
        lo, hi = f["interval"]
        lines.append(f"| {name} | {f['a']:.4f} | {f['b']:.4f} | {f['b_minus_a']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     f"{f['pairs']:,} |")
    for side, label in (("a", label_a), ("b", label_b)):
        if result[f"figures_only_{side}"]:
            lines.append(f"\nonly {label} measured: {', '.join(result[f'figures_only_{side}'])}")
    lines += ["", f"{result['by_night_figure']} by night ({label_a} / {label_b}): " + ", ".join(
        f"{n} {v['a']:.3f} / {v['b']:.3f}" for n, v in result["by_night"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="--work of the first backtest (the reference)")
    parser.add_argument("--b", type=Path, required=True, help="--work of the second backtest (the change)")
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    parser.add_argument("--system", default="job", help="whose figures to compare (default: the job's)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = compare(read_figures(args.a, args.system), read_figures(args.b, args.system), args.resamples, args.seed)
    if not result["pairs"]:
        raise SystemExit("the two backtests share no (user, night) pair: were they run over the same nights and data?")
    print(table(result, args.label_a, args.label_b))
    if args.json:
        args.json.write_text(json.dumps(_plain({"a": str(args.a), "b": str(args.b), **result}), indent=1,
                                        allow_nan=False))
    return 0


def _plain(value):
    """NaN as null, tuples as lists: JSON any reader takes."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    raise SystemExit(main())
