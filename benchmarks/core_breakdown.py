"""Where one user's scoring time goes, on one thread: the CPU budget behind the "10x Spark ALS" target.

Profiles the bare core (``Scorer.score`` through the bench's ``score_chunks``, the code the job
runs) over synthetic chunks of the bench's shape and sorts torch's own per-operation time into what
the model and the task cannot do without (the matrix products of the encoder and of the scores, and
attention) and everything else
(top-N selection, layer norms, GELU, residual adds, dtype conversions, id mapping, masking). With a
``recsys bench --json`` file it also prints what the job would need per user to reach a given multiple
of that run's Spark ALS row, and what the products and attention alone would allow if every other
operation cost nothing.

    python benchmarks/core_breakdown.py --bench-json /work/runs/bench_200k.json

Profiler times are torch's "self CPU" per operation; the profiler adds a little per call, so the
total is printed beside the unprofiled time of the same work.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from recsys.bench import core_bench, shapes
from recsys.bench.run import ALS, BARE, BARE_THREADS, JOB, JOB_INT8, dtype_refusal

# torch operator name -> category; first match wins, anything unmatched is "other"
CATEGORIES = (
    ("matrix products", ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "mkldnn", "aten::_addmm",
                         "quantized::linear_dynamic")),   # int8: the kernel quantizes its input itself
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("top-N selection", ("aten::topk", "aten::gather", "aten::amax", "aten::amin", "aten::nonzero", "aten::ge")),
    ("layer norm, GELU, adds", ("layer_norm", "aten::gelu", "aten::add")),
    ("copies and dtype conversions", ("aten::copy_", "aten::_to_copy")),
    ("indexing: ids, padding, masks, compaction", ("searchsorted", "aten::index", "index_put", "index_select",
                                                  "repeat_interleave", "cumsum", "embedding")),
)
FLOOR = ("matrix products", "attention")


def category(op: str) -> str:
    for name, needles in CATEGORIES:
        if any(n in op for n in needles):
            return name
    return "other"


def breakdown(dtype: str, shape: shapes.BenchShape, chunk: int) -> tuple[dict[str, float], float]:
    """Per-user microseconds by category (profiled) and the unprofiled per-user time, one thread."""
    torch.set_num_threads(1)
    user_ids, seqs = shapes.histories(shape)
    scorer = shapes.scorer(shape, shapes.model(shape), torch.device("cpu"), shapes.params(shape, dtype=dtype))
    chunks = core_bench.contiguous_chunks(seqs, chunk)
    core_bench.score_chunks(scorer, user_ids, chunks[:1])        # warm-up
    best = min(core_bench.score_chunks(scorer, user_ids, chunks)[0] for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        core_bench.score_chunks(scorer, user_ids, chunks)
    per_user: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_user[category(event.key)] += event.self_cpu_time_total / shape.users   # us per user
    return dict(per_user), best / shape.users * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=16_384)
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--history", type=int, default=50)
    ap.add_argument("--top-n", type=int, default=100)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                    help="scoring dtypes to profile; those this CPU refuses are left out with the reason")
    ap.add_argument("--bench-json", type=Path, help="a `recsys bench --json` file of the same shape, for the ALS row")
    ap.add_argument("--target", type=float, default=10.0, help="the multiple of Spark ALS to budget for")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shape = shapes.BenchShape(users=args.users, items=args.items, dim=args.dim, history=args.history, top_n=args.top_n)
    refused = {d: r for d in args.dtypes if (r := dtype_refusal(d, torch.device("cpu")))}
    for d, reason in refused.items():
        print(f"{d} left out: {reason}")
    rows = {d: breakdown(d, shape, args.chunk_size) for d in args.dtypes if d not in refused}

    print(f"one user's scoring time on one thread (us), {shape.items:,} items, d{shape.dim}, history "
          f"{shape.history}, top {shape.top_n}, {shape.users:,} users in chunks of {args.chunk_size:,}")
    names = [n for n, _ in CATEGORIES] + ["other"]
    print(f"{'':42s}" + "".join(f"{d:>12s}" for d in rows))
    for n in names:
        print(f"{n:42s}" + "".join(f"{rows[d][0].get(n, 0.0):12.1f}" for d in rows))
    print(f"{'total (profiled)':42s}" + "".join(f"{sum(rows[d][0].values()):12.1f}" for d in rows))
    print(f"{'total (not profiled)':42s}" + "".join(f"{rows[d][1]:12.1f}" for d in rows))
    floor = {d: sum(rows[d][0].get(n, 0.0) for n in FLOOR) for d in rows}
    print(f"{'products + attention':42s}" + "".join(f"{floor[d]:12.1f}" for d in rows))
    out: dict = {"shape": shape.as_dict(), "per_user_us": {d: r[0] for d, r in rows.items()},
                 "unprofiled_us": {d: r[1] for d, r in rows.items()}}
    if args.bench_json:
        bench = json.loads(args.bench_json.read_text())
        ups, cores = bench["users_per_s"], bench["cores"]
        als = ups[ALS]
        need = args.target * als
        threads = ups.get(BARE_THREADS, ups[BARE])
        # the bench's N-thread row against N x one thread: what running side by side costs on these cores
        scaling = threads / (cores * 1e6 / rows["float32"][1]) if "float32" in rows else 1.0
        budget = cores * 1e6 / need * scaling
        print()
        int8_job = f", int8 job {ups[JOB_INT8]:,.0f} ({ups[JOB_INT8] / als:.2f}x)" if JOB_INT8 in ups else ""
        print(f"bench {args.bench_json.name}: Spark ALS {als:,.0f} users/s, job {ups[JOB]:,.0f} "
              f"({ups[JOB] / als:.2f}x){int8_job}, {cores} cores; {cores} threads ran at {scaling:.2f} of {cores} x one thread")
        print(f"{args.target:g}x ALS = {need:,.0f} users/s: at most {budget:.0f} us per user on one thread "
              f"(at that scaling, job overhead not counted)")
        for d in rows:
            ceiling = cores * 1e6 / floor[d] * scaling
            print(f"  {d}: now {rows[d][1]:.0f} us; products + attention alone {floor[d]:.0f} us -> at most "
                  f"{ceiling:,.0f} users/s ({ceiling / als:.1f}x ALS) if every other operation cost nothing; "
                  f"{args.target:g}x leaves {budget - floor[d]:.0f} us for the rest, which takes "
                  f"{rows[d][1] - floor[d]:.0f} us now")
        out.update({"als_users_per_s": als, "budget_us": budget, "scaling": scaling})
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
