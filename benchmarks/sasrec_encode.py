"""Users/s of SASRec.encode on CPU: the straightforward ``forward(seq)[:, -1]`` against ``encode``.

    PYTHONPATH=. python benchmarks/sasrec_encode.py [--threads 2] [--batch 4096] [--reps 5]

Full-length random histories (no padding to trim), so the figure is the hot path's worst case;
``--short N`` times histories of N items instead. ``--only`` times one of the two: the glibc
allocator keeps state between calls (a run with big intermediates raises its mmap threshold, and
later calls page-fault less), so the fairest comparison is one process per measurement.
"""
from __future__ import annotations

import argparse
import time

import torch

from recsys.model.sasrec import SASRec, SASRecConfig


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--short", type=int, default=0, help="histories of this many items (0: max_len)")
    p.add_argument("--only", choices=("forward", "encode"), default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = SASRec(SASRecConfig(num_items=a.items, dim=a.dim, max_len=a.max_len)).eval()
    seq = torch.randint(1, a.items + 1, (a.batch, a.max_len))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={a.batch} L={a.max_len} D={a.dim}")
    if a.short:
        seq[:, : a.max_len - a.short] = 0
    with torch.inference_mode():
        diff = (model(seq)[:, -1] - model.encode(seq)).abs().max().item() if a.only is None else float("nan")
        for name, fn in (("encode(seq)", lambda: model.encode(seq)), ("forward(seq)[:, -1]", lambda: model(seq)[:, -1])):
            if a.only and not name.startswith(a.only):
                continue
            dt = timed(fn, a.reps)
            print(f"{name:20s} {a.batch / dt:10,.0f} users/s ({dt * 1e3:.1f} ms/batch)")
    if a.only is None:
        print(f"max |encode - forward[:, -1]| = {diff:.2e}")


if __name__ == "__main__":
    main()
