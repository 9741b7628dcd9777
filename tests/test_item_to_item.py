"""Item-to-item (EASE) scores beside the model: the fit, the core's lists, the blend's choice, saving with the model.

Each expected list is computed by hand from the definition: a new item's score is the model's plus
``item_to_item_weight`` times the sum of the weights' rows of the user's known items (recsys.model.item_to_item).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from recsys.data.contracts import SOURCE_POPULARITY
from recsys.model.io import load_model, save_model
from recsys.model.item_to_item import ItemToItem, ease_weights, from_co_counts
from recsys.model.repeats import MASK_KNOWN, RepeatBlend, ValidationDays, fit_blend, rank_validation_days
from recsys.scoring.core import Candidates, Fallback, ReferenceScorer, Scorer, cpu_bf16_supported
from recsys.sequences import Sequences, Vocabulary, pad_left
from toy_model import random_model

NUM_ITEMS = 30
ITEM_IDS = np.arange(500, 500 + NUM_ITEMS, dtype=np.int64)
DAY_US = 86_400 * 1_000_000


def _weights(seed: int, items: np.ndarray) -> ItemToItem:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(len(items), len(items))).astype(np.float32)
    np.fill_diagonal(w, 0.0)
    return ItemToItem(np.asarray(items, dtype=np.int64), w, 1.0)


def test_the_fit_is_ease_s_closed_form_from_the_users_item_matrix():
    """B = -P / diag(P), P = (X'X + l2 I)^-1, zero diagonal: from a random binary users x items matrix, both from the
    dense Gram and from its upper triangle's sparse counts."""
    rng = np.random.default_rng(0)
    x = (rng.random((40, 6)) < 0.4).astype(float)
    gram = x.T @ x
    p = np.linalg.inv(gram + 5.0 * np.eye(6))
    expected = -p / np.diag(p)[None, :]
    np.fill_diagonal(expected, 0.0)
    assert np.allclose(ease_weights(gram, 5.0), expected, atol=1e-6)
    i, j = np.triu_indices(6)
    fit = from_co_counts(np.arange(10, 16), i, j, gram[i, j], 5.0)
    assert np.allclose(fit.weights, expected, atol=1e-6)
    with pytest.raises(ValueError, match="l2 must be positive"):
        ease_weights(gram, 0.0)


def _scorer(model, blend, i2i, cls=Scorer, dtype="float32", candidates=NUM_ITEMS, item_tile=0):
    index = np.arange(1, candidates + 1)
    return cls(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(index, ITEM_IDS[:candidates]),
               fallback=Fallback(SOURCE_POPULARITY, ITEM_IDS[:5], np.ones(5, np.float32)), top_n=5,
               device=torch.device("cpu"), blend=blend, item_to_item=i2i, dtype=dtype, item_tile=item_tile)


@pytest.mark.parametrize("variant", ["float32", "tiled", "reference", "bfloat16", "int8"])
def test_the_core_ranks_new_items_by_the_model_s_score_plus_the_weighted_item_to_item_scores(variant):
    """By hand: the model's score plus weight x the sum of the weights' rows of the user's known items, over the
    weighted items (a third of the catalog has none: the model's score alone), known items masked; every variant
    of the core lists exactly that (bf16's and int8's preselection rescored in fp32). Weight 0: the model's lists."""
    from recsys.scoring.core import cpu_int8_refusal

    if variant == "bfloat16" and not cpu_bf16_supported():
        pytest.skip("this CPU has no native bf16")
    if variant == "int8" and cpu_int8_refusal():
        pytest.skip(f"int8 scoring unavailable: {cpu_int8_refusal()}")
    model = random_model(NUM_ITEMS, seed=6)
    weighted = ITEM_IDS[::3].tolist() + ITEM_IDS[1::3].tolist()            # 20 of the 30 items, not in id order
    i2i = ItemToItem(np.array(weighted), _weights(1, weighted).weights * 0.5, 1.0)
    hist = Sequences.from_lists([ITEM_IDS[[2, 7, 4]], ITEM_IDS[[9]], ITEM_IDS[[0, 1, 3, 5, 6]], ITEM_IDS[[29]]])
    emb = model.item_embeddings().detach().numpy()
    cls = ReferenceScorer if variant == "reference" else Scorer
    dtype = variant if variant in ("bfloat16", "int8") else "float32"
    tile = 7 if variant == "tiled" else 0
    position = {item: p for p, item in enumerate(weighted)}

    def expected(weight: float) -> list[list[int]]:
        out = []
        for r in range(len(hist)):
            known = hist.items[hist.offsets[r]:hist.offsets[r + 1]]
            seq = torch.as_tensor(pad_left(Sequences.from_lists([known - 499]), model.max_len))
            scores = (emb[1:] @ model.encode(seq)[0].detach().numpy()).astype(np.float64)
            for item in known:
                if item in position:
                    for other, p in position.items():
                        scores[other - 500] += weight * i2i.weights[position[item], p]
            scores[known - 500] = -np.inf
            out.append(ITEM_IDS[np.argsort(-scores, kind="stable")[:5]].tolist())
        return out

    blend = RepeatBlend(item_to_item_weight=2.0)
    listed = _scorer(model, blend, i2i, cls=cls, dtype=dtype, item_tile=tile).topn(hist)[0].tolist()
    assert listed == expected(2.0)
    assert expected(2.0) != expected(0.0)
    assert _scorer(model, MASK_KNOWN, i2i, cls=cls, dtype=dtype, item_tile=tile).topn(hist)[0].tolist() == expected(0.0)


def test_a_blend_that_weighs_item_to_item_scores_without_weights_is_refused():
    with pytest.raises(ValueError, match="no item-to-item weights came with the model"):
        _scorer(random_model(NUM_ITEMS, seed=1), RepeatBlend(item_to_item_weight=1.0), None)


def test_the_fit_takes_item_to_item_scores_where_they_say_what_comes_next_and_not_where_they_mislead():
    """Each day's new item is the one the weights tie most strongly to the user's items (the model has no idea:
    random weights): an item-to-item weight wins. With the weights' sign turned (they point away): none."""
    rng = np.random.default_rng(7)
    model = random_model(NUM_ITEMS, seed=7, max_len=8)
    i2i = _weights(3, ITEM_IDS)
    n = 120
    lists = [ITEM_IDS[rng.choice(NUM_ITEMS, size=3, replace=False)] for _ in range(n)]
    targets = []
    for h in lists:
        said = i2i.weights[h - 500].sum(0)
        said[h - 500] = -np.inf
        targets.append([ITEM_IDS[int(np.argmax(said))]])
    hist = Sequences.from_lists(lists)
    days = ValidationDays(hist, np.ones(len(hist.items), int), np.full(len(hist.items), 5 * DAY_US),
                          rng.integers(10, 14, size=n) * DAY_US, Sequences.from_lists(targets))
    weights = (0.0, 1.0, 16.0)
    chosen = fit_blend(rank_validation_days(model, ITEM_IDS, days, item_to_item=i2i, item_to_item_weights=weights))
    assert chosen.item_to_item_weight > 0 and chosen.masks_known
    assert chosen.figures["hr_at_10"] == 1.0
    assert chosen.figures["no_item_to_item_ndcg_at_10"] < chosen.figures["ndcg_at_10"]
    away = ItemToItem(i2i.item_ids, -i2i.weights, 1.0)
    assert fit_blend(rank_validation_days(model, ITEM_IDS, days, item_to_item=away,
                                          item_to_item_weights=weights)).item_to_item_weight == 0.0


def test_the_weights_are_saved_with_the_model_and_a_blend_that_needs_missing_ones_is_refused(tmp_path):
    from recsys.model.sasrec import SASRec, SASRecConfig

    model = SASRec(SASRecConfig(num_items=NUM_ITEMS, dim=8, layers=1, heads=1, max_len=4, dropout=0.0))
    i2i = _weights(4, ITEM_IDS[:10])
    blend = RepeatBlend(item_to_item_weight=16.0)
    loaded = load_model(save_model(model, ITEM_IDS, tmp_path / "m", blend=blend, item_to_item=i2i))
    assert loaded.blend == blend
    assert np.array_equal(loaded.item_to_item.item_ids, i2i.item_ids)
    assert np.array_equal(loaded.item_to_item.weights, i2i.weights) and loaded.item_to_item.l2 == 1.0
    assert load_model(save_model(model, ITEM_IDS, tmp_path / "plain")).item_to_item is None
    (tmp_path / "m" / "item_to_item.npz").unlink()
    with pytest.raises(ValueError, match="item_to_item.npz is missing"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "item_to_item.npz").write_bytes(b"not numbers")
    with pytest.raises(ValueError, match="is not a recsys item-to-item file"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("dense", [True, False])
def test_a_task_s_pair_counts_are_every_user_s_pairs_however_they_are_chunked_and_sent(dense):
    """Each user's distinct items (positions) with the held-out newest flagged, in two Arrow batches: the task's
    counts, summed by key, equal the users x items matrix's Gram's upper triangle (all pairs; pairs without a held
    item), whether added up in the task or sent chunk by chunk, in chunks of 7 pairs or of millions."""
    import pyarrow as pa

    from recsys.learning.item_to_item import _partition_counts

    rng = np.random.default_rng(3)
    n_items, users = 9, 40
    lists = [rng.choice(n_items, rng.integers(1, 7), replace=False) for _ in range(users)]
    helds = [np.arange(len(x)) == rng.integers(0, len(x) + 1) for x in lists]     # at most one held item a user
    entry = pa.struct([("pos", pa.int32()), ("held", pa.bool_())])
    items = pa.array([[{"pos": int(p), "held": bool(h)} for p, h in zip(x, hh)] for x, hh in zip(lists, helds)],
                     pa.list_(entry))
    batches = [pa.RecordBatch.from_arrays([items.slice(0, 15)], ["items"]),
               pa.RecordBatch.from_arrays([items.slice(15)], ["items"])]
    x = np.zeros((users, n_items))
    kept = np.zeros((users, n_items))
    for u, (items_u, held_u) in enumerate(zip(lists, helds)):
        x[u, items_u] = 1
        kept[u, items_u[~held_u]] = 1
    upper = np.triu_indices(n_items)
    for max_pairs in (7, 1 << 24):
        every, trained = np.zeros(n_items * n_items), np.zeros(n_items * n_items)
        for out in _partition_counts(n_items, dense, iter(batches), max_pairs):
            np.add.at(every, out.column(0).to_numpy(), out.column(1).to_numpy())
            np.add.at(trained, out.column(0).to_numpy(), out.column(2).to_numpy())
        every, trained = every.reshape(n_items, n_items), trained.reshape(n_items, n_items)
        assert np.array_equal(every[upper], (x.T @ x)[upper]) and not np.tril(every, -1).any()
        assert np.array_equal(trained[upper], (kept.T @ kept)[upper])


def test_spark_counts_each_pair_of_the_users_items_and_leaves_out_the_held_out_newest_for_the_blend_s_fit(spark):
    """The co-occurrence counts by Spark equal the users x items matrix's Gram: over the whole window (the night's
    weights) and without each held-out user's newest item (the blend's, fitted as the selection model trained: users
    with fewer than three items hold none out); only the max_items items with the most users take part."""
    import pandas as pd

    from recsys.config import load_config
    from recsys.learning.item_to_item import fit_item_to_item
    from recsys.learning.shards import HASH_BUCKETS

    rng = np.random.default_rng(5)
    n = 400
    events = pd.DataFrame({"user_id": rng.integers(0, 60, n), "item_id": rng.integers(100, 112, n),
                           "ts": pd.Timestamp("2024-01-01", tz="UTC") + pd.to_timedelta(rng.integers(0, 10 * 86400, n),
                                                                                         unit="s")})
    cfg = load_config(overrides=["train.repeats.item_to_item.max_items=10", "train.repeats.item_to_item.l2=3"])
    frame = spark.createDataFrame(events)
    fits = fit_item_to_item(frame, cfg, held_out_below=HASH_BUCKETS)
    users = events.groupby("item_id").user_id.nunique()
    top = users.reset_index().sort_values(["user_id", "item_id"], ascending=[False, True]).item_id[:10]
    assert fits.night.item_ids.tolist() == sorted(top.tolist())

    def gram(pairs: pd.DataFrame) -> np.ndarray:
        x = pd.crosstab(pairs.user_id, pairs.item_id).reindex(columns=fits.night.item_ids, fill_value=0).clip(0, 1)
        return x.to_numpy(float).T @ x.to_numpy(float)

    last = events.groupby(["user_id", "item_id"]).ts.max().reset_index()
    assert np.allclose(fits.night.weights, ease_weights(gram(last), 3.0), atol=1e-5)
    ordered = last.sort_values(["user_id", "ts", "item_id"])
    newest = ordered.groupby("user_id").tail(1)
    newest = newest[newest.user_id.map(last.groupby("user_id").size()) >= 3]
    trained = last.drop(newest.index)
    assert 30 < len(newest) < 60
    assert np.allclose(fits.validation.weights, ease_weights(gram(trained), 3.0), atol=1e-5)
    nobody = fit_item_to_item(frame, cfg, held_out_below=0)      # no user held out: both fits alike
    assert np.allclose(nobody.validation.weights, nobody.night.weights)


def _paired_log():
    """300 users over 20 days; the 40 items come in 20 pairs. Each user had both items of two pairs before day 11,
    the first item of a third pair on day 11-13, and its partner on one day of the last week (day 14-20): who had
    one item of a pair had the other, and the last week's new item is the partner of a known one."""
    import pandas as pd

    rng = np.random.default_rng(11)
    rows = []
    for user in range(300):
        pairs = rng.choice(20, 3, replace=False)
        for p in pairs[:2]:
            for item in (2 * p, 2 * p + 1):
                rows.append((user, 500 + item, int(rng.integers(1, 11))))
        first, partner = (2 * pairs[2], 2 * pairs[2] + 1)[::1 if rng.random() < 0.5 else -1]
        rows.append((user, 500 + first, int(rng.integers(11, 14))))
        rows.append((user, 500 + partner, int(rng.integers(14, 21))))
    frame = pd.DataFrame(rows, columns=["user_id", "item_id", "day"])
    frame["ts"] = pd.Timestamp("2024-01-01", tz="UTC") + pd.to_timedelta(frame.day - 1, unit="D") + pd.Timedelta(
        hours=12)
    return frame.drop(columns="day")


@pytest.mark.parametrize("min_rows, chosen", [(0, True), (100_000, False)])
def test_training_s_fit_weighs_item_to_item_scores_that_name_the_next_item_when_it_has_rows_enough(spark, tmp_path,
                                                                                                   min_rows, chosen):
    """Through training's own code (Spark writes the validation days and fits the weights; the blend is chosen on
    them): on the paired log, with a model that knows nothing (random weights), the blend takes item-to-item scores;
    with fewer validation rows than train.repeats.min_rows it takes neither them nor the popularity prior."""
    import datetime as dt

    from recsys.config import load_config
    from recsys.learning.repeats import fit_repeat_blend, write_validation_days

    cfg = load_config(overrides=[f"train.repeats.min_rows={min_rows}", "train.repeats.item_to_item.l2=10",
                                 "history.window_days=60"])
    date = dt.date(2024, 1, 21)
    days = write_validation_days(spark.createDataFrame(_paired_log()), cfg, date, str(tmp_path / "rows"))
    assert days.validation_rows == 300
    ranker = SimpleNamespace(model=random_model(40, seed=4, max_len=8), item_ids=np.arange(500, 540))   # a Ranker
    blend = fit_repeat_blend(cfg, date, ranker, torch.device("cpu"), days)
    if chosen:
        assert days.item_to_item is not None and blend.item_to_item_weight > 0
        assert blend.figures["no_item_to_item_ndcg_at_10"] < blend.figures["ndcg_at_10"]
    else:
        assert days.item_to_item is None and blend.item_to_item_weight == 0 and blend.popularity_weight == 0


def test_dense_pair_counts_refuse_arrays_of_another_catalog_size():
    """The dense counts are indexed ``i * n_items + j``: arrays sized for another catalog would misplace them."""
    from recsys.model.item_to_item import add_pair_counts

    every, trained = np.zeros(9, dtype=np.int64), np.zeros(9, dtype=np.int64)
    with pytest.raises(ValueError, match="2 items need two arrays of 4 counts"):
        add_pair_counts(np.array([0, 2]), np.array([0, 1]), np.array([False, False]), 2, every, trained)
    assert not every.any() and not trained.any()
