"""The repeat blend: known items competing with new ones in the core, and the weights chosen on held-out days.

Each expected list is computed by hand from the blend's definition (recsys.model.repeats): a known item
scores ``repeat_bias + log(count) - age_weight * log1p(age_days)``, a new item at rank r
``-new_rank_weight * log1p(r)``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys.data.contracts import SOURCE_POPULARITY
from recsys.model.io import load_model, save_model
from recsys.model.repeats import (MASK_KNOWN, BlendValidation, RecentUsers, RepeatBlend, ValidationDays, fit_blend,
                                  merge_known, rank_validation_days)
from recsys.scoring.core import Candidates, Fallback, KnownItems, Scorer
from recsys.sequences import Sequences, Vocabulary
from toy_model import random_model

NUM_ITEMS = 30
ITEM_IDS = np.arange(500, 500 + NUM_ITEMS, dtype=np.int64)
DAY_US = 86_400 * 1_000_000


def _scorer(model, blend, top_n=5, recent_users=None, cls=Scorer, dtype="float32"):
    index = np.arange(1, NUM_ITEMS + 1)
    return cls(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(index, ITEM_IDS),
               fallback=Fallback(SOURCE_POPULARITY, ITEM_IDS[:top_n], np.ones(top_n, np.float32)),
               top_n=top_n, device=torch.device("cpu"), blend=blend, recent_users=recent_users, dtype=dtype)


def test_merge_puts_each_known_item_where_its_blended_score_ranks_it_among_the_new_ones():
    new_vals = torch.tensor([[0.0, -1.0, -2.0, -3.0], [0.0, -1.0, float("-inf"), float("-inf")]])
    new_cols = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 0]])
    rows, cols = torch.tensor([0, 0, 1]), torch.tensor([5, 6, 7])
    scores = torch.tensor([-1.5, 5.0, -9.0])
    vals, out = merge_known(new_vals, new_cols, rows, cols, scores, 4)
    assert out.tolist() == [[6, 10, 11, 5], [20, 21, 7, 0]]
    assert vals[1, 3].item() == float("-inf")                       # nothing left to fill the last slot
    _, capped = merge_known(new_vals, new_cols, rows, cols, scores, 4, max_known=0)
    assert capped.tolist()[0] == [10, 11, 12, 13]                   # a rule keeping every slot for new items


def test_a_masking_blend_lists_what_the_core_listed_before_and_a_repeat_favouring_one_lists_known_items_first():
    model = random_model(NUM_ITEMS, seed=3)
    hist = Sequences.from_lists([ITEM_IDS[[2, 7, 4]], ITEM_IDS[[9]]])
    known = KnownItems(counts=np.array([5, 1, 2, 1]), last_us=np.array([9, 2, 9, 9]) * DAY_US, now_us=10 * DAY_US)
    masked_ids, masked_vals, _, _ = _scorer(model, MASK_KNOWN).topn(hist, known)
    assert not set(masked_ids[0]) & set(ITEM_IDS[[2, 7, 4]])
    blend = RepeatBlend(repeat_bias=2.0, age_weight=1.0, new_rank_weight=1.0)
    ids, vals, _, _ = _scorer(model, blend).topn(hist, known)
    # user 0: known 502 (2 + log 5 - log1p(1) = 2.92), 504 (2 + log 2 - log1p(1) = 2.0), 507 (2 + 0 - log1p(8) = -0.20);
    # new items at ranks 0, 1, 2 score 0, -0.69, -1.10: the model's best new item comes third, after 502 and 504
    assert ids[0].tolist()[:3] == [502, 504, masked_ids[0][0]]
    assert ids[0].tolist()[3] == 507 and ids[0].tolist()[4] == masked_ids[0][1]
    assert np.allclose(vals[0][:2], [2 + math.log(5) - math.log(2), 2 + math.log(2) - math.log(2)], atol=1e-5)
    assert np.all(np.diff(vals, axis=1) <= 1e-6)                    # best first
    assert ids[1].tolist()[0] == 509                                # 2 + 0 - log1p(1) = 1.31 > 0


def test_a_blend_survives_saving_and_loading_with_the_model_and_an_old_model_masks(tmp_path):
    model = random_model(NUM_ITEMS, seed=1)
    from recsys.model.sasrec import SASRec, SASRecConfig

    sasrec = SASRec(SASRecConfig(num_items=NUM_ITEMS, dim=8, layers=1, heads=1, max_len=4, dropout=0.0))
    blend = RepeatBlend(1.5, 0.5, 2.0, 0.25, figures={"validation_rows": 10})
    loaded = load_model(save_model(sasrec, ITEM_IDS, tmp_path / "m", blend=blend))
    assert loaded.blend == blend and loaded.blend.figures == {"validation_rows": 10}
    assert load_model(save_model(sasrec, ITEM_IDS, tmp_path / "old")).blend.masks_known
    masked = RepeatBlend.from_json(MASK_KNOWN.to_json())
    assert masked.masks_known and masked == MASK_KNOWN
    saved_before_the_prior = '{"age_weight": 0.5, "new_rank_weight": 2.0, "repeat_bias": 1.5}'
    assert RepeatBlend.from_json(saved_before_the_prior) == RepeatBlend(1.5, 0.5, 2.0, popularity_weight=0.0)
    del model


def _validation(known_counts, known_target, new_ranks, targets, ages=None):
    known_counts = np.asarray(known_counts, dtype=float)
    return BlendValidation(known_counts, np.zeros_like(known_counts) if ages is None else np.asarray(ages, float),
                           np.asarray(known_target, bool), np.asarray(new_ranks, float)[None], np.asarray(targets))


def test_the_fit_masks_known_items_on_a_log_without_repeats_and_lets_them_in_on_a_log_of_repeats():
    rng = np.random.default_rng(0)
    n = 400
    counts = rng.integers(1, 6, size=(n, 3)).astype(float)
    # no repeats: every day's item is new, found by the model at rank 0..4
    no_repeats = _validation(counts, np.zeros((n, 3), bool), rng.integers(0, 5, size=(n, 1)), np.ones(n, int))
    assert fit_blend(no_repeats).masks_known
    # repeats: the day's item is the user's most frequent known item; new items the model ranks far down
    target = counts == counts.max(1, keepdims=True)
    target &= np.cumsum(target, 1) == 1
    repeats = _validation(counts, target, np.full((n, 1), np.inf), np.ones(n, int))
    blend = fit_blend(repeats)
    assert not blend.masks_known
    assert blend.figures["hr_at_10"] == 1.0 and blend.figures["masked_hr_at_10"] == 0.0
    assert blend.figures["known_target_share"] == 1.0


def test_the_fit_balances_known_and_new_items_by_what_the_days_say():
    """Half the users redo their most frequent item, half take the model's first new item: the best
    blend puts one of each first, so both halves are hit, which neither extreme does."""
    n = 200
    counts = np.tile([[3.0, 1.0]], (n, 1))
    target = np.zeros((n, 2), bool)
    target[: n // 2, 0] = True
    ranks = np.full((n, 1), np.inf)
    ranks[n // 2:, 0] = 0
    blend = fit_blend(_validation(counts, target, ranks, np.ones(n, int)))
    assert blend.figures["hr_at_10"] == 1.0
    assert blend.figures["masked_hr_at_10"] == 0.5


def test_the_hr_objective_leaves_a_place_to_a_new_item_where_ndcg_fills_the_list_with_known_ones():
    """Nine users in ten redo all ten of their known items, one in ten takes the model's first new item. NDCG@10
    keeps all ten known items (each one pushed out costs the many more than the new item gains the few); HR@10 needs
    only one known item in the list, so it lets the new one in, low in the list (ties by NDCG@10), and hits
    everyone."""
    n = 100
    counts = np.tile(np.arange(20.0, 10.0, -1.0), (n, 1))
    target = np.zeros((n, 10), bool)
    target[: 9 * n // 10] = True
    ranks = np.full((n, 1), np.inf)
    ranks[9 * n // 10:, 0] = 0
    targets = np.where(np.arange(n) < 9 * n // 10, 10, 1)
    valid = _validation(counts, target, ranks, targets)
    by_ndcg = fit_blend(valid)
    by_hr = fit_blend(valid, objective="hr_at_10")
    assert by_ndcg.figures["objective"] == "ndcg_at_10" and by_hr.figures["objective"] == "hr_at_10"
    assert by_ndcg.figures["hr_at_10"] == pytest.approx(0.9) and by_ndcg.figures["ndcg_at_10"] == pytest.approx(0.9)
    assert by_hr.figures["hr_at_10"] == 1.0
    # ties by NDCG@10 put the new item as low as the grid's biases allow (9th: 9 known items above it would take a
    # bias between -log 12 and -log 11): the redoing users lose only the 9th place's gain, not their first ones
    ideal = sum(1 / np.log2(np.arange(2, 12)))
    assert by_hr.figures["ndcg_at_10"] == pytest.approx(0.9 * (1 - 1 / np.log2(10) / ideal) + 0.1 / np.log2(10),
                                                        abs=1e-6)
    with pytest.raises(ValueError, match="unknown blend objective 'recall'"):
        fit_blend(valid, objective="recall")


def test_validation_ranks_are_the_model_s_ranks_among_the_items_the_user_does_not_know():
    """Rows 1 and 2 have nothing new to rank (a known item; an item the model does not know): their ranks stay
    unranked (inf), and each other target's rank is its own row's, counted by hand."""
    model = random_model(NUM_ITEMS, seed=5)
    histories = Sequences.from_lists([ITEM_IDS[[1, 2]], ITEM_IDS[[5, 6]], ITEM_IDS[[7]], ITEM_IDS[[3]]])
    days = ValidationDays(histories=histories, counts=np.array([4, 1, 1, 1, 1, 2]),
                          last_us=np.array([8, 9, 9, 9, 9, 7]) * DAY_US, day_start_us=np.array([10] * 4) * DAY_US,
                          targets=Sequences.from_lists([ITEM_IDS[[2, 10]], ITEM_IDS[[5]], np.array([99999]),
                                                        np.array([99999, ITEM_IDS[20]])]))
    valid = rank_validation_days(model, ITEM_IDS, days)
    assert valid.known_target.tolist() == [[False, True], [True, False], [False, False], [False, False]]
    assert valid.known_counts.tolist() == [[4, 1], [1, 1], [1, 0], [2, 0]]
    assert valid.known_ages[0].tolist() == [2.0, 1.0] and valid.targets.tolist() == [2, 1, 1, 2]
    assert np.isinf(valid.new_target_ranks[:, [1, 2]]).all()
    # by hand: score every item the user does not know, count those above the target
    from recsys.sequences import pad_left

    emb = model.item_embeddings()
    for row, hist_idx, target_idx in ((0, [2, 3], 11), (3, [4], 21)):
        user = model.encode(torch.as_tensor(pad_left(Sequences.from_lists([hist_idx]), model.max_len)))[0]
        scores = (emb @ user).detach().numpy()
        others = [i for i in range(1, NUM_ITEMS + 1) if i not in hist_idx]
        expected = sum(scores[i] > scores[target_idx] for i in others)
        for ranks in valid.new_target_ranks:   # no recent popularity given: every weight ranks as the model alone
            assert ranks[row][np.isfinite(ranks[row])].tolist() == [expected]


@pytest.mark.parametrize("targets_per_day", [2, 14])
def test_every_list_the_blend_makes_is_exactly_what_the_fit_scored(targets_per_day):
    """The fit's positions without lists and the core's merge agree: HR@10 from both is the same, for each bias
    and popularity weight of a grid scored at once (14 items a day: most of them new and ranked past 10, which the
    fit leaves out). The fit's prior comes from the day before's users per item, the core's from the counts the
    night passes it: the same counts, so the same lists."""
    from recsys.model.repeats import blend_grid, blend_sums

    rng = np.random.default_rng(1)
    model = random_model(NUM_ITEMS, seed=2, max_len=8)
    lists = [ITEM_IDS[rng.choice(NUM_ITEMS, size=rng.integers(1, 6), replace=False)] for _ in range(60)]
    hist = Sequences.from_lists(lists)
    # counts 1-4: known items tie often, and the fit must break the ties as the core's lists do (by column) for
    # the NDCG to agree (none of these biases ties a known item with a new one: -w log1p(r) is never bias + log(n))
    counts = rng.integers(1, 5, size=len(hist.items))
    days = ValidationDays(hist, counts, np.full(len(counts), 5 * DAY_US), np.full(len(lists), 10 * DAY_US),
                          Sequences.from_lists([ITEM_IDS[rng.choice(NUM_ITEMS, size=targets_per_day, replace=False)]
                                                for _ in lists]))
    users = rng.integers(0, 30, size=NUM_ITEMS)
    recent = RecentUsers(np.full(NUM_ITEMS + 2, 9 * DAY_US), np.r_[ITEM_IDS, 1, 2], np.r_[users, 99, 99])
    # the day before the day before: must not count
    recent = RecentUsers(np.r_[recent.day_us, 8 * DAY_US], np.r_[recent.item_ids, ITEM_IDS[0]],
                         np.r_[recent.users, 999])
    valid = rank_validation_days(model, ITEM_IDS, days, recent=recent, popularity_weights=(0.0, 1.0))
    sums = blend_sums(valid, blend_grid((-math.inf, -1.0, 0.5, 3.0), (0.0,), (1.0,), (0.0, 1.0)))
    assert len(sums.candidates) == 8
    assert not np.array_equal(valid.new_target_ranks[0], valid.new_target_ranks[1])
    for g, candidate in enumerate(sums.candidates):
        blend = RepeatBlend(candidate.repeat_bias, 0.0, 1.0, candidate.popularity_weight)
        ids, _, _, _ = _scorer(model, blend, top_n=10, recent_users=users).topn(
            hist, KnownItems(counts, np.full(len(counts), 5 * DAY_US), 10 * DAY_US))
        day = [set(days.targets.items[days.targets.offsets[r]:days.targets.offsets[r + 1]]) for r in range(len(lists))]
        hits = [bool(set(ids[r]) & day[r]) for r in range(len(lists))]
        ndcg = [sum(1 / np.log2(p + 2) for p, item in enumerate(ids[r][:10]) if item in day[r]) /
                sum(1 / np.log2(p + 2) for p in range(min(len(day[r]), 10))) for r in range(len(lists))]
        assert sums.hits[g] / sums.rows == pytest.approx(np.mean(hits)), candidate
        assert sums.ndcg[g] / sums.rows == pytest.approx(np.mean(ndcg)), candidate


def test_rows_ranked_a_chunk_at_a_time_add_up_to_the_fit_on_all_of_them():
    """Training streams the validation rows in chunks and adds their sums: the choice and its figures are
    those of the fit over every row at once (and different grids refuse to be added)."""
    from recsys.model.repeats import blend_grid, blend_sums, choose_blend

    rng = np.random.default_rng(4)
    model = random_model(NUM_ITEMS, seed=3, max_len=8)
    lists = [ITEM_IDS[rng.choice(NUM_ITEMS, size=rng.integers(1, 6), replace=False)] for _ in range(90)]
    targets = [np.concatenate([h[:1], ITEM_IDS[rng.choice(NUM_ITEMS, size=1)]]) if r % 2 else
               ITEM_IDS[rng.choice(NUM_ITEMS, size=2, replace=False)] for r, h in enumerate(lists)]
    counts = rng.integers(1, 5, size=sum(len(h) for h in lists))
    last = rng.integers(1, 9, size=len(counts)) * DAY_US

    def days(rows: slice) -> ValidationDays:
        hist = Sequences.from_lists(lists[rows])
        lo, hi = (sum(len(h) for h in lists[:b]) for b in (rows.start, rows.stop))
        return ValidationDays(hist, counts[lo:hi], last[lo:hi], np.full(len(lists[rows]), 10 * DAY_US),
                              Sequences.from_lists(targets[rows]))

    whole = fit_blend(rank_validation_days(model, ITEM_IDS, days(slice(0, 90))))
    grid = blend_grid()
    sums = blend_sums(BlendValidation.empty(), grid)
    for lo in range(0, 90, 32):
        sums = sums.add(blend_sums(rank_validation_days(model, ITEM_IDS, days(slice(lo, min(lo + 32, 90)))), grid))
    chunked = choose_blend(sums)
    assert chunked == whole and not whole.masks_known
    assert chunked.figures == pytest.approx(whole.figures)
    with pytest.raises(ValueError, match="different grids"):
        sums.add(blend_sums(BlendValidation.empty(), grid[:3]))


def _merged_list_figures(blend: RepeatBlend, counts, ages, known_target, new_ranks, targets) -> tuple[float, bool]:
    """One row's NDCG@10 and hit, its list built item by item: every known item at its blended score, a new item at
    each rank 0-9 at ``-w log1p(r)``, best first, a known item before a new one of the same score."""
    known = [(blend.repeat_bias + math.log(c) - blend.age_weight * math.log1p(a), 0, hit)
             for c, a, hit in zip(counts, ages, known_target) if c > 0]
    new = [(-blend.new_rank_weight * math.log1p(r), 1, r in set(new_ranks)) for r in range(10)]
    listed = sorted(known + new, key=lambda entry: (-entry[0], entry[1]))[:10]
    ideal = sum(1 / math.log2(p + 2) for p in range(min(targets, 10)))
    gains = [1 / math.log2(p + 2) for p, (_, _, hit) in enumerate(listed) if hit]
    return (sum(gains) / ideal if ideal else 0.0), bool(gains)


def test_the_fit_s_sums_are_those_of_lists_built_item_by_item_ties_included():
    """The fit places items without building lists; built one by one they give the same NDCG@10 and hits for every
    candidate, on rows where a known item's score equals a new rank's exactly (count 1, age 0 and bias 0 tie with
    rank 0; count 2 and bias -2 log 2 with rank 1 at weight 1) and on random ones."""
    from recsys.model.repeats import blend_grid, blend_sums

    rng = np.random.default_rng(7)
    rows, width, new_width = 300, 12, 4
    lengths = rng.integers(1, width + 1, rows)
    present = np.arange(width)[None, :] < lengths[:, None]
    counts = np.where(present, rng.integers(1, 4, (rows, width)), 0).astype(float)
    ages = np.where(present, rng.choice([0.0, 0.0, 1.0, 2.5, 7.0], (rows, width)), 0.0)
    known_target = present & (rng.random((rows, width)) < 0.2)
    new_counts = rng.integers(0, new_width + 1, rows)
    distinct = np.argsort(rng.random((2, rows, 14)), axis=2)[:, :, :new_width].astype(float)   # a rank per item
    ranks = np.sort(np.where(np.arange(new_width)[None, None] < new_counts[None, :, None], distinct, np.inf), axis=2)
    targets = known_target.sum(1) + (ranks[0] < np.inf).sum(1)
    valid = BlendValidation(counts, ages, known_target, ranks, targets.astype(np.int64), popularity_weights=(0.0, 1.0))
    grid = blend_grid((-math.inf, -2 * math.log(2), 0.0, 1.5), (0.0, 1.0), (1.0, 2.0), (0.0, 1.0))
    sums = blend_sums(valid, grid)
    ties = 0
    for g, blend in enumerate(grid):
        ranking = valid.new_target_ranks[int(blend.popularity_weight)]
        figures = [_masked_figures(ranking[r], targets[r]) if blend.masks_known else
                   _merged_list_figures(blend, counts[r], ages[r], known_target[r],
                                        ranking[r][ranking[r] < np.inf].astype(int).tolist(), targets[r])
                   for r in range(rows)]
        assert sums.ndcg[g] == pytest.approx(sum(n for n, _ in figures), abs=1e-9), blend
        assert sums.hits[g] == sum(h for _, h in figures), blend
        if not blend.masks_known:
            known_scores = blend.repeat_scores(np.maximum(counts[present], 1), ages[present])
            ties += int(np.isin(known_scores, -blend.new_rank_weight * np.log1p(np.arange(10))).sum())
    assert ties > 100   # the rows hold exact ties: the order between a known item and a new one is tested there


def _masked_figures(ranks: np.ndarray, targets: int) -> tuple[float, bool]:
    """A masking blend's row: the new items alone, at their ranks."""
    ideal = sum(1 / math.log2(p + 2) for p in range(min(targets, 10)))
    gains = [1 / math.log2(r + 2) for r in ranks if r < 10]
    return (sum(gains) / ideal if ideal else 0.0), bool(gains)


@pytest.mark.parametrize("dtype", ["float32", "reference", "bfloat16"])
def test_the_core_ranks_new_items_by_the_model_s_score_plus_the_weighted_popularity_of_the_day_before(dtype):
    """By hand: score = the model's + popularity_weight * log1p(users of the last day), known items masked; the
    fast core (fp32, and bf16's preselection rescored in fp32) and the reference core list exactly that. No counts
    given, or a weight of 0: the model's lists."""
    from recsys.scoring.core import ReferenceScorer, cpu_bf16_supported
    from recsys.sequences import pad_left

    if dtype == "bfloat16" and not cpu_bf16_supported():
        pytest.skip("this CPU has no native bf16")
    model = random_model(NUM_ITEMS, seed=6)
    users = np.random.default_rng(6).integers(0, 50, size=NUM_ITEMS)
    hist = Sequences.from_lists([ITEM_IDS[[2, 7, 4]], ITEM_IDS[[9]], ITEM_IDS[[0, 1]]])
    emb = model.item_embeddings().detach().numpy()
    cls, run_dtype = (ReferenceScorer, "float32") if dtype == "reference" else (Scorer, dtype)

    def expected(weight: float) -> list[list[int]]:
        out = []
        for r in range(len(hist)):
            known = hist.items[hist.offsets[r]:hist.offsets[r + 1]]
            seq = torch.as_tensor(pad_left(Sequences.from_lists([known - 499]), model.max_len))
            scores = emb[1:] @ model.encode(seq)[0].detach().numpy() + weight * np.log1p(users)
            scores[known - 500] = -np.inf
            out.append(ITEM_IDS[np.argsort(-scores, kind="stable")[:5]].tolist())
        return out

    blend = RepeatBlend(popularity_weight=3.0)
    with_prior, _, _, _ = _scorer(model, blend, recent_users=users, cls=cls, dtype=run_dtype).topn(hist)
    assert with_prior.tolist() == expected(3.0)
    assert expected(3.0) != expected(0.0)
    for scorer in (_scorer(model, blend, cls=cls, dtype=run_dtype),
                   _scorer(model, MASK_KNOWN, recent_users=users, cls=cls, dtype=run_dtype)):
        assert scorer.topn(hist)[0].tolist() == expected(0.0)


def test_the_fit_takes_the_popularity_prior_where_tomorrow_s_new_items_were_popular_the_day_before_and_not_else():
    """Each day's new item is the most popular of the day before (the model has no idea: random weights): a
    prior weight wins. The same days with the counts turned upside down (the new item the least popular): none."""
    rng = np.random.default_rng(7)
    model = random_model(NUM_ITEMS, seed=7, max_len=8)
    n = 120
    lists = [ITEM_IDS[rng.choice(NUM_ITEMS, size=3, replace=False)] for _ in range(n)]
    day = rng.integers(10, 14, size=n)
    users = {d: 2 ** rng.permutation(NUM_ITEMS) for d in range(9, 14)}   # a ranking of the items per day, far apart
    targets = [[ITEM_IDS[[i for i in np.argsort(-users[d - 1]) if ITEM_IDS[i] not in h][0]]]   # the most popular new
               for h, d in zip(lists, day)]
    hist = Sequences.from_lists(lists)
    days = ValidationDays(hist, np.ones(len(hist.items), int), np.full(len(hist.items), 5 * DAY_US), day * DAY_US,
                          Sequences.from_lists(targets))
    per_day = np.repeat(np.arange(9, 14), NUM_ITEMS) * DAY_US
    popular = RecentUsers(per_day, np.tile(ITEM_IDS, 5), np.concatenate([users[d] for d in range(9, 14)]))
    weights = (0.0, 0.25, 0.5, 1.0, 2.0)
    chosen = fit_blend(rank_validation_days(model, ITEM_IDS, days, recent=popular, popularity_weights=weights))
    assert chosen.popularity_weight > 0 and chosen.masks_known
    assert chosen.figures["hr_at_10"] == 1.0 and chosen.figures["no_prior_ndcg_at_10"] < chosen.figures["ndcg_at_10"]
    unpopular = RecentUsers(per_day, popular.item_ids, 2 ** (NUM_ITEMS - 1) // popular.users)
    unranked = rank_validation_days(model, ITEM_IDS, days, recent=unpopular, popularity_weights=weights)
    assert fit_blend(unranked).popularity_weight == 0.0


def test_the_ranks_are_the_same_however_many_rows_a_large_catalog_leaves_to_a_batch(monkeypatch):
    """Rows are ranked in batches whose [rows, items] scores stay near RANK_BYTES: a byte budget of three rows (as
    a catalog of millions of items would leave) gives the ranks of one batch of them all, with the prior too."""
    from recsys.model import repeats as repeats_module

    rng = np.random.default_rng(8)
    model = random_model(NUM_ITEMS, seed=8, max_len=8)
    lists = [ITEM_IDS[rng.choice(NUM_ITEMS, size=3, replace=False)] for _ in range(20)]
    hist = Sequences.from_lists(lists)
    days = ValidationDays(hist, np.ones(len(hist.items), int), np.full(len(hist.items), 5 * DAY_US),
                          rng.integers(10, 12, size=20) * DAY_US,
                          Sequences.from_lists([ITEM_IDS[rng.choice(NUM_ITEMS, size=4, replace=False)] for _ in lists]))
    recent = RecentUsers(np.repeat([9, 10], NUM_ITEMS) * DAY_US, np.tile(ITEM_IDS, 2),
                         rng.integers(0, 9, 2 * NUM_ITEMS))
    whole = rank_validation_days(model, ITEM_IDS, days, recent=recent, popularity_weights=(0.0, 1.0))
    monkeypatch.setattr(repeats_module, "RANK_BYTES", 3 * 4 * (NUM_ITEMS + 1))
    batched = rank_validation_days(model, ITEM_IDS, days, recent=recent, popularity_weights=(0.0, 1.0))
    assert np.isfinite(whole.new_target_ranks).sum() > 20
    assert np.array_equal(whole.new_target_ranks, batched.new_target_ranks)
