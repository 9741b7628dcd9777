"""On a CUDA machine: does the core's GPU path (tiling, merge, bf16) agree with the CPU fp32 reference?

fp32 on CUDA must give the same top-N as fp32 on the CPU up to ties (float summation order differs,
so near-ties may swap); bf16 is reported as overlap@N, the share of the reference's items kept.
"""
import numpy as np
import torch

from recsys.bench import shapes


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b)]))


shape = shapes.BenchShape(users=4096, items=50_000, top_n=100, seed=3)
uids, seqs = shapes.histories(shape)
net = shapes.model(shape)
ref_ids, ref_scores, _, _ = shapes.scorer(shape, net, torch.device("cpu")).topn(seqs)
for dtype, tile in (("float32", 0), ("float32", 7_000), ("bfloat16", 0), ("bfloat16", 7_000)):
    ids, scores, _, _ = shapes.scorer(shape, net, torch.device("cuda"),
                                   shapes.params(shape, dtype=dtype, item_tile=tile, max_tile_mb=0)).topn(seqs)
    exact = float(np.mean(np.all(ids == ref_ids, axis=1)))
    print(f"cuda {dtype:9s} tile {tile:6d}: overlap@{shape.top_n} {overlap(ids, ref_ids):.4f}, "
          f"identical lists {exact:.4f}, max |score diff| {np.max(np.abs(scores - ref_scores)):.2e}")
