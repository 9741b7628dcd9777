"""Two nightly partitions of one date, compared row by row, and the keys of their MLflow runs.

What a refactor that must change nothing a user sees is checked with (issue 19): run the job
before and after on the same data (and model), then

    python benchmarks/compare_runs.py BEFORE/recommendations/dt=D AFTER/recommendations/dt=D \
        [sqlite:///BEFORE/mlflow.db sqlite:///AFTER/mlflow.db]

prints whether the rows (user, lists with scores, source, model version) are identical, whether
the manifests have the same keys and counts, and which manifest values differ beyond what differs
from run to run anyway (run ids and keys, times, and how tasks landed on Python workers: see
``VOLATILE``); given the two tracking URIs, whether the runs have the same parameter, metric and tag
keys, parameter values and artifacts. Exits 1 when the rows or the manifests' values differ.
Run both jobs with the same relative paths (each in its own directory) for the values to be comparable.
"""
from __future__ import annotations

import fnmatch
import json
import math
import sys

import pyarrow.dataset as ds

COLUMNS = ["user_id", "recommendations", "source", "model_version"]

# manifest values that differ between two runs of the same code on the same input: which run, when, how
# long, and the Python workers the tasks happened to land on (worker reuse decides the cache hits)
VOLATILE = ("run_id", "job_run", "published_at", "timings.*", "workers", "quality.previous.run",
            "quality.previous.run_id", "quality.guard.figures.*_s", "metrics.*_s", "metrics.*_share", "metrics.*_per_s", "metrics.*_s_max",
            "metrics.worker_rss_mb_max", "metrics.workers", "metrics.model_hits", "metrics.model_misses",
            "metrics.scorer_hits", "metrics.scorer_misses", "metrics.int8_hits", "metrics.int8_misses",
            "metrics.model_loads_per_worker_max", "metrics.task_retries")


def _rows(partition: str):
    return ds.dataset(partition, format="parquet", partitioning=None).to_table().sort_by("user_id")


def _keys(doc: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in doc.items():
        out.add(prefix + key)
        if isinstance(value, dict) and key not in ("metrics", "timings"):
            out |= _keys(value, f"{prefix}{key}.")
    return out


def _leaves(doc, prefix: str = "") -> dict[str, object]:
    """path -> value for every leaf of a JSON document (lists of scalars are one leaf)."""
    if isinstance(doc, dict):
        out: dict[str, object] = {}
        for key, value in doc.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: doc}


def _volatile(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") or fnmatch.fnmatchcase(path, p) for p in VOLATILE)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def value_differences(a: dict, b: dict) -> list[str]:
    """Paths whose values differ (or exist on one side only), volatile ones aside."""
    la, lb = _leaves(a), _leaves(b)
    return sorted(p for p in set(la) | set(lb)
                  if not _volatile(p) and (p not in la or p not in lb or not _same(la[p], lb[p])))


def _run(uri: str, run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    return (run.data.params, set(run.data.metrics), set(run.data.tags),
            sorted(a.path for a in client.list_artifacts(run_id)))


def main(argv: list[str]) -> int:
    before, after = argv[:2]
    a, b = _rows(before), _rows(after)
    same = a.num_rows == b.num_rows and all(a.column(c).equals(b.column(c)) for c in COLUMNS)
    print(f"rows: {a.num_rows} and {b.num_rows}; identical ({', '.join(COLUMNS)}): {same}")
    ma = json.loads(open(f"{before}/_manifest.json").read())
    mb = json.loads(open(f"{after}/_manifest.json").read())
    print(f"manifest keys differing: {sorted(_keys(ma) ^ _keys(mb)) or 'none'}; counts equal: {ma['counts'] == mb['counts']}")
    values = value_differences(ma, mb)
    compared = len([p for p in _leaves(ma) if not _volatile(p)])
    print(f"manifest values differing ({compared} compared; run ids, times and worker placement aside): "
          f"{values or 'none'}")
    if len(argv) >= 4:
        ra, rb = _run(argv[2], ma["run_id"]), _run(argv[3], mb["run_id"])
        params = sorted(k for k in set(ra[0]) | set(rb[0]) if ra[0].get(k) != rb[0].get(k))
        print(f"parameter keys: {len(ra[0])} and {len(rb[0])}; values differing: {params or 'none'}")
        for what, x, y in zip(("metric", "tag"), ra[1:3], rb[1:3]):
            print(f"{what} keys: {len(x)} and {len(y)}; differing: {sorted(x ^ y) or 'none'}")
        print(f"artifacts equal: {ra[3] == rb[3]} ({', '.join(ra[3])})")
    return 0 if same and not values else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
