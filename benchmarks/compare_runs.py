"""Two nightly partitions of one date, compared row by row, and the keys of their MLflow runs.

What a refactor that must change nothing a user sees is checked with (issue 19): run the job
before and after on the same data (and model), then

    python benchmarks/compare_runs.py BEFORE/recommendations/dt=D AFTER/recommendations/dt=D \
        [sqlite:///BEFORE/mlflow.db sqlite:///AFTER/mlflow.db]

prints whether the rows (user, lists with scores, source, model version) are identical, whether
the manifests have the same keys and counts, and, given the two tracking URIs, whether the runs
have the same parameter, metric and tag keys and artifacts. Exits 1 when the rows differ.
"""
from __future__ import annotations

import json
import sys

import pyarrow.dataset as ds

COLUMNS = ["user_id", "recommendations", "source", "model_version"]


def _rows(partition: str):
    return ds.dataset(partition, format="parquet", partitioning=None).to_table().sort_by("user_id")


def _keys(doc: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in doc.items():
        out.add(prefix + key)
        if isinstance(value, dict) and key not in ("metrics", "timings"):
            out |= _keys(value, f"{prefix}{key}.")
    return out


def _run(uri: str, run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    return (set(run.data.params), set(run.data.metrics), set(run.data.tags),
            sorted(a.path for a in client.list_artifacts(run_id)))


def main(argv: list[str]) -> int:
    before, after = argv[:2]
    a, b = _rows(before), _rows(after)
    same = a.num_rows == b.num_rows and all(a.column(c).equals(b.column(c)) for c in COLUMNS)
    print(f"rows: {a.num_rows} and {b.num_rows}; identical ({', '.join(COLUMNS)}): {same}")
    ma = json.loads(open(f"{before}/_manifest.json").read())
    mb = json.loads(open(f"{after}/_manifest.json").read())
    print(f"manifest keys differing: {sorted(_keys(ma) ^ _keys(mb)) or 'none'}; counts equal: {ma['counts'] == mb['counts']}")
    if len(argv) >= 4:
        for what, x, y in zip(("parameter", "metric", "tag"), _run(argv[2], ma["run_id"]), _run(argv[3], mb["run_id"])):
            print(f"{what} keys: {len(x)} and {len(y)}; differing: {sorted(x ^ y) or 'none'}")
        arts = _run(argv[2], ma["run_id"])[3], _run(argv[3], mb["run_id"])[3]
        print(f"artifacts equal: {arts[0] == arts[1]} ({', '.join(arts[0])})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
