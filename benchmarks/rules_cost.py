"""CPU time of the scoring core and the task checks on one chunk, one thread, with and without the operators'
rules (docs/rules.md): known items masked (the default), a repeat blend letting them in, the blend with
20 excluded items per user, min_new_items 30 and fill popularity, and the blend with item-to-item scores over
the ``train.repeats.item_to_item.max_items`` (2,000) items the histories hold most (recsys.model.item_to_item).

CPU time (``time.process_time``) rather than wall time, so figures taken on a shared, loaded machine stay
comparable; the variants run 3 times, interleaved, medians reported.

    python benchmarks/rules_cost.py
"""
import statistics
import time

import numpy as np
import pyarrow as pa
import torch

from recsys.bench import shapes
from recsys.config import load_config
from recsys.model.item_to_item import ItemToItem
from recsys.model.repeats import RepeatBlend
from recsys.scoring.checks import ListRules, TaskChecks
from recsys.scoring.core import KnownItems, Scorer
from recsys.scoring.params import RuleParams
from recsys.sequences import Sequences

torch.set_num_threads(1)
shape = shapes.BenchShape(users=4096, items=20000)
uids, seqs = shapes.histories(shape)
net = shapes.model(shape)
base = shapes.scorer(shape, net, torch.device("cpu"))
rng = np.random.default_rng(0)
ids = shapes.item_ids(shape)
excluded = Sequences.from_lists([rng.choice(ids, 20, replace=False) for _ in range(shape.users)])
known = KnownItems(rng.integers(1, 5, len(seqs.items)), np.zeros(len(seqs.items), np.int64), 86_400 * 10**6)
blend = RepeatBlend(repeat_bias=1.0, age_weight=0.5, new_rank_weight=1.0)
weighted = int(load_config().train.repeats.item_to_item.max_items)
i2i_weights = rng.normal(0, 0.01, (weighted, weighted)).astype(np.float32)
np.fill_diagonal(i2i_weights, 0.0)
seen, times = np.unique(seqs.items, return_counts=True)
i2i = ItemToItem(seen[np.argsort(-times, kind="stable")[:weighted]], i2i_weights, 200.0)   # the most used, as fitted
common = dict(model=net, vocab=base.vocab, candidates=base.candidates, fallback=base.fallback, device=base.device,
              **shapes.params(shape).scorer_settings())
variants = {
    "masked (default)": (base, None, None),
    "blend": (Scorer(**common, blend=blend), known, None),
    "blend + rules": (Scorer(**common, blend=blend, rules=RuleParams(min_new_items=30),
                             popularity=rng.integers(0, 100, shape.items)), known, excluded),
    "blend + item-to-item": (Scorer(**common, blend=RepeatBlend(1.0, 0.5, 1.0, item_to_item_weight=16.0),
                                    item_to_item=i2i), known, None),
}
history_arrow = pa.array(seqs.to_lists(), pa.list_(pa.int64()))
excluded_arrow = pa.array(excluded.to_lists(), pa.list_(pa.int64()))
candidates_sorted = np.sort(ids)
score_s = {n: [] for n in variants}
check_s = {n: [] for n in variants}
for rep in range(3):
    for name, (scorer, kn, ex) in variants.items():
        t = time.process_time()
        out, _ = scorer.score(uids, seqs, kn, ex)
        score_s[name].append(time.process_time() - t)
        task = TaskChecks()
        t = time.process_time()
        rules = ListRules(shape.top_n, base.fallback.name, shape.top_n, known_allowed=kn is not None,
                          min_new_items=30 if ex is not None else 0, fill=ex is not None)
        task.add_chunk(uids, history_arrow, out, candidate_ids_sorted=candidates_sorted, rules=rules,
                       excluded=excluded_arrow if ex is not None else None)
        check_s[name].append(time.process_time() - t)
        assert all(v == 0 for k, v in task.finish().items() if k != "item_counts"), name
for name in variants:
    s, c = statistics.median(score_s[name]), statistics.median(check_s[name])
    print(f"{name:20s} core {s * 1000:6.0f} ms cpu   checks {c * 1000:5.1f} ms cpu")
