"""CPU time of the scoring cores on one chunk, one thread: the reference core, the fast fp32 core and
bf16 variants (preselection width, bf16 or fp32 encoder), with each one's top-N overlap against fp32.

CPU time (``time.process_time``) rather than wall time, so figures taken on a shared, loaded
machine stay comparable; each variant runs 3 times, interleaved, medians reported.

    python benchmarks/core_variants.py
"""
import time, torch, statistics, numpy as np
from recsys.bench import shapes
from recsys.scoring import core
torch.set_num_threads(1)
shape = shapes.BenchShape(users=4096, items=20000)
uids, seqs = shapes.histories(shape)
net = shapes.model(shape)
dev = torch.device("cpu")
ref = shapes.scorer(shape, net, dev, reference=True); f32 = shapes.scorer(shape, net, dev); b16 = shapes.scorer(shape, net, dev, shapes.params(shape, dtype="bfloat16"))
variants = {"ref": (ref, 2, True), "fp32": (f32, 2, True), "bf16 pre2": (b16, 2, True), "bf16 pre1.5": (b16, 1.5, True),
            "bf16 pre2 fp32enc": (b16, 2, False), "bf16 pre1.5 fp32enc": (b16, 1.5, False)}
base_ids = None
res = {n: [] for n in variants}; ov = {}
for rep in range(3):
    for n, (sc, pre, enc) in variants.items():
        core.BF16_PRESELECT = pre; core.ENCODE_BF16_ON_CPU = enc
        t = time.process_time(); ids, _, _, _ = sc.topn(seqs); res[n].append(time.process_time() - t)
        if n == "fp32": base_ids = ids
        if rep == 0 and n != "ref": ov[n] = ids
for n in variants:
    o = np.mean([len(np.intersect1d(a, b)) / 100 for a, b in zip(base_ids, ov[n])]) if n in ov else float("nan")
    print(f"{n:22s} {statistics.median(res[n])*1000:8.0f} ms cpu  x ref {statistics.median(res['ref'])/statistics.median(res[n]):5.2f}  overlap {o:.4f}")
