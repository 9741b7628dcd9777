"""The operators' rules (recommend.*, docs/rules.md) in the scoring core, the task checks and the catalog filter.
No Spark: the end-to-end cases are in test_rules_job.py.

Every list is computed by hand on a model whose ranking is plain: item index i has the embedding [1, i], a user's
vector is the mean of their items' embeddings ([1, m], m > 0), so item i scores 1 + i * m and the model ranks
the higher index first (ids are 100 + index).
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys.config import load_config
from recsys.data.contracts import RECOMMENDATION_TYPE, SOURCE_MODEL, SOURCE_POPULARITY
from recsys.errors import ConfigError
from recsys.model.repeats import MASK_KNOWN, RepeatBlend
from recsys.scoring.checks import ListRules, TaskChecks
from recsys.scoring.core import Candidates, KnownItems, Scorer, popularity_fallback
from recsys.scoring.params import DEFAULT_RULES, RuleParams
from recsys.sequences import Sequences, Vocabulary
from toy_model import MeanEmbeddingModel

N = 10
IDS = np.arange(101, 101 + N, dtype=np.int64)          # index i <-> id 100 + i
DAY_US = 86_400 * 1_000_000
REPEATS = RepeatBlend(repeat_bias=5.0, age_weight=0.0, new_rank_weight=1.0)   # known items win


def _model():
    emb = torch.zeros(N + 1, 2)
    emb[1:, 0] = 1.0
    emb[1:, 1] = torch.arange(1, N + 1, dtype=torch.float32)
    return MeanEmbeddingModel(emb, max_len=8)


def _scorer(*, blend=MASK_KNOWN, rules=DEFAULT_RULES, candidates=N, top_n=3, popularity=None):
    index = np.arange(1, candidates + 1)
    pop = np.arange(1, candidates + 1) if popularity is None else np.asarray(popularity)   # the higher id, the more popular
    return Scorer(model=_model(), vocab=Vocabulary(IDS), candidates=Candidates(index, IDS[:candidates]),
                  fallback=popularity_fallback(IDS[:candidates], pop, top_n), top_n=top_n,
                  device=torch.device("cpu"), blend=blend, rules=rules, popularity=pop)


def _lists(scorer, histories, excluded=None, counts=None):
    hist = Sequences.from_lists([np.asarray(h, dtype=np.int64) for h in histories])
    known = None
    if counts is not None:
        flat = np.concatenate([np.asarray(c, dtype=np.int64) for c in counts])
        known = KnownItems(flat, np.full(len(flat), 9 * DAY_US), 10 * DAY_US)
    ex = None if excluded is None else Sequences.from_lists([np.asarray(e, dtype=np.int64) for e in excluded])
    batch, _ = scorer.score(np.arange(len(histories)), hist, known, ex)
    rows = batch.column("recommendations").to_pylist()
    return [[r["item_id"] for r in row] for row in rows], [[r["score"] for r in row] for row in rows], batch


# --- each rule changes the lists as stated -----------------------------------------------------------------------

def test_items_excluded_by_event_never_appear_whether_or_not_the_history_holds_them():
    scorer = _scorer()
    lists, _, _ = _lists(scorer, [[101, 102], [101, 102]], excluded=[[110, 107], []])
    assert lists == [[109, 108, 106], [110, 109, 108]]       # 110 and 107 were never in the history
    # a blend that lets known items in: the excluded known item stays out, the other known one comes in
    lists, _, _ = _lists(_scorer(blend=REPEATS), [[104, 105]], excluded=[[105]], counts=[[2, 9]])
    assert lists == [[104, 110, 109]]                         # 104: 5 + log 2 = 5.69 > the new items' 0, -0.69


def test_exclude_touched_masks_every_known_item_whatever_the_blend_says():
    lists, _, _ = _lists(_scorer(blend=REPEATS), [[103, 104]], counts=[[3, 1]])
    assert lists == [[103, 104, 110]]                        # 5 + log 3, 5, then the best new item (0)
    lists, _, _ = _lists(_scorer(blend=REPEATS, rules=RuleParams(touched=True)), [[103, 104]], counts=[[3, 1]])
    assert lists == [[110, 109, 108]]


def test_min_new_items_keeps_room_for_new_items_when_known_ones_win():
    history, counts = [[101, 102, 103]], [[1, 3, 5]]
    lists, _, _ = _lists(_scorer(blend=REPEATS), history, counts=counts)
    assert lists == [[103, 102, 101]]                        # 5 + log 5, 5 + log 3, 5: every slot known
    lists, _, _ = _lists(_scorer(blend=REPEATS, rules=RuleParams(min_new_items=2)), history, counts=counts)
    assert lists == [[103, 110, 109]]                        # one known item, two new ones
    lists, _, _ = _lists(_scorer(blend=REPEATS, rules=RuleParams(min_new_items=3)), history, counts=counts)
    assert lists == [[110, 109, 108]]


def test_fill_tops_a_list_up_only_with_eligible_items_by_popularity():
    """Four candidates, three of them known: min_new_items 2 leaves room for one known item and finds one new."""
    history, counts, popularity = [[101, 102, 103]], [[1, 3, 5]], [5, 9, 1, 1]   # 102 is the most popular
    short = _scorer(blend=REPEATS, rules=RuleParams(min_new_items=2, fill="none"), candidates=4, popularity=popularity)
    assert _lists(short, history, counts=counts)[0] == [[103, 104]]
    filled = _scorer(blend=REPEATS, rules=RuleParams(min_new_items=2), candidates=4, popularity=popularity)
    lists, scores, _ = _lists(filled, history, counts=counts)
    assert lists == [[103, 104, 102]]                        # the most popular item not listed
    assert scores[0][0] == pytest.approx(5 + math.log(5)) and scores[0][1:] == [0.0, 0.0]   # capped at the score before
    # items a rule excludes are never filled in: here every known item is masked, so only 104 is eligible
    masked = _scorer(candidates=4, popularity=popularity)
    assert _lists(masked, history)[0] == [[104]]


def test_a_fallback_list_loses_the_user_s_excluded_items_and_is_filled_from_the_popularity_ranking():
    """Users the model cannot score (no history, or only unknown items) get the popularity list less their
    excluded items; with fill popularity the next most popular eligible items take their place."""
    histories, excluded = [[], [999], []], [[109], [], [110, 108]]
    lists, scores, batch = _lists(_scorer(), histories, excluded)
    assert batch.column("source").to_pylist() == [SOURCE_POPULARITY] * 3
    assert lists == [[110, 108, 107], [110, 109, 108], [109, 107, 106]]
    total = sum(range(1, N + 1))
    assert scores[0] == pytest.approx([10 / total, 8 / total, 7 / total])   # each item's share, as the fallback's
    lists, _, _ = _lists(_scorer(rules=RuleParams(fill="none")), histories, excluded)
    assert lists == [[110, 108], [110, 109, 108], [109]]


def test_without_rules_the_lists_are_what_they_were():
    """The default rules and no excluded items: a masking blend lists the model's new items, the fallback its list."""
    lists, _, batch = _lists(_scorer(), [[101, 102], []])
    assert lists == [[110, 109, 108], [110, 109, 108]]
    assert batch.column("source").to_pylist() == [SOURCE_MODEL, SOURCE_POPULARITY]


# --- the task checks -----------------------------------------------------------------------------------------

def _out(users, lists, sources=None):
    return pa.RecordBatch.from_arrays(
        [pa.array(users, pa.int64()),
         pa.array([[{"item_id": i, "score": 1.0 - 0.01 * n} for n, i in enumerate(items)] for items in lists],
                  RECOMMENDATION_TYPE),
         pa.array(sources or [SOURCE_MODEL] * len(users), pa.string())], names=["user_id", "recommendations", "source"])


def _check(lists, *, histories, excluded=None, sources=None, **rules):
    task = TaskChecks()
    users = list(range(len(histories)))
    task.add_chunk(np.array(users), pa.array(histories, pa.list_(pa.int64())), _out(users, lists, sources),
                   candidate_ids_sorted=IDS, rules=ListRules(3, SOURCE_POPULARITY, 3, **rules),
                   excluded=None if excluded is None else pa.array(excluded, pa.list_(pa.int64())))
    figures = task.finish()
    return {k: v for k, v in figures.items() if k != "item_counts" and v}


def test_the_checks_flag_a_list_holding_an_excluded_item():
    assert _check([[109, 108, 106]], histories=[[101]], excluded=[[110, 107]]) == {}
    assert _check([[110, 108, 106]], histories=[[101]], excluded=[[110, 107]]) == {"excluded_items": 1}
    # known items allowed by the blend: a known item is fine, an excluded one is not
    assert _check([[101, 110, 109]], histories=[[101, 102]], excluded=[[102]], known_allowed=True) == {}
    assert _check([[102, 110, 109]], histories=[[101, 102]], excluded=[[102]],
                  known_allowed=True) == {"excluded_items": 1}
    # known items masked (a masking blend, or exclude.touched): a known item is excluded
    assert _check([[101, 110, 109]], histories=[[101, 102]]) == {"excluded_items": 1}


def test_the_checks_expect_lists_as_long_as_the_rules_allow():
    """Ten candidates: a list is short only when the user's off-limits items leave fewer than top_n."""
    nine_off = [list(IDS[:9])]
    assert _check([[110]], histories=[[]], excluded=nine_off) == {}                      # one item is all there is
    assert _check([[110]], histories=[[101]], excluded=[[102]]) == {"short_lists_unexplained": 1}
    # a fallback list less the user's excluded items, without fill; with fill it must be full again
    assert _check([[110, 108]], histories=[[]], excluded=[[109]], sources=[SOURCE_POPULARITY]) == {}
    assert _check([[110, 108]], histories=[[]], excluded=[[109]], sources=[SOURCE_POPULARITY],
                  fill=True) == {"short_lists_unexplained": 1}
    # min_new_items without fill: known items capped, so a list may stop short when new items run out
    seven_known = [list(IDS[:7])]
    assert _check([[101, 108, 109]], histories=seven_known, known_allowed=True, min_new_items=2) == {}
    assert _check([[101, 110]], histories=seven_known, known_allowed=True,
                  min_new_items=2) == {"short_lists_unexplained": 1}


@pytest.mark.parametrize("blend", [MASK_KNOWN, REPEATS])
@pytest.mark.parametrize("rules", [DEFAULT_RULES, RuleParams(touched=True), RuleParams(min_new_items=2),
                                   RuleParams(min_new_items=2, fill="none"), RuleParams(fill="none")])
def test_the_core_s_lists_pass_the_task_checks_under_every_rule(blend, rules):
    """Random histories and exclusions: whatever the rules, what the core lists is what the checks accept."""
    rng = np.random.default_rng(7)
    users = 60
    histories = [list(rng.choice(IDS, size=rng.integers(0, 9), replace=False)) for _ in range(users)]
    histories[:3] = [[], [999], list(IDS[:9])]                       # fallback users, one with nearly everything seen
    excluded = [list(rng.choice(IDS, size=rng.integers(0, 5), replace=False)) for _ in range(users)]
    counts = [list(rng.integers(1, 6, size=len(h))) for h in histories]
    scorer = _scorer(blend=blend, rules=rules, top_n=5, popularity=rng.integers(0, 50, N))
    hist = Sequences.from_lists([np.asarray(h, dtype=np.int64) for h in histories])
    known = KnownItems(np.concatenate([np.asarray(c, dtype=np.int64) for c in counts]),
                       np.full(len(hist.items), 9 * DAY_US), 10 * DAY_US)
    ex_arrow = pa.array(excluded, pa.list_(pa.int64()))
    out, _ = scorer.score(np.arange(users), hist, known, Sequences.from_arrow(ex_arrow))
    task = TaskChecks()
    list_rules = ListRules(5, SOURCE_POPULARITY, 5, known_allowed=not (blend.masks_known or rules.touched),
                           min_new_items=rules.min_new_items, fill=rules.fill == "popularity")
    task.add_chunk(np.arange(users), pa.array(histories, pa.list_(pa.int64())), out, candidate_ids_sorted=IDS,
                   rules=list_rules, excluded=ex_arrow)
    figures = task.finish()
    assert {k: v for k, v in figures.items() if k != "item_counts" and v} == {}
    lists = [[r["item_id"] for r in row] for row in out.column("recommendations").to_pylist()]
    for items, history, ex in zip(lists, histories, excluded):
        assert not set(items) & set(ex)
        new = [i for i in items if i not in set(history)]
        eligible_new = [i for i in IDS if i not in set(history) | set(ex)]
        assert len(new) >= min(rules.min_new_items, len(eligible_new))   # min_new_items holds when it can
    scores = [[r["score"] for r in row] for row in out.column("recommendations").to_pylist()]
    assert all(np.all(np.diff(s) <= 0) and np.all(np.isfinite(s)) for s in scores)


# --- the catalog rules and the configuration -------------------------------------------------------------------

def _rules(*overrides):
    return load_config(overrides=list(overrides)).recommend


CATALOG = pa.table({"item_id": pa.array([1, 2, 3, 4, 5], pa.int64()), "available": [True] * 5,
                    "category": ["news", "news", "sport", None, "news"], "in_stock": [True, False, True, True, None],
                    "brand_id": pa.array([7, 7, 8, 9, 9], pa.int32())})


def test_catalog_rules_keep_only_included_items_and_drop_excluded_ones():
    from recsys.data.rules import catalog_rule_mask

    def kept(*overrides):
        return CATALOG.column("item_id").to_numpy()[catalog_rule_mask(CATALOG, _rules(*overrides), "the snapshot")].tolist()

    assert kept() == [1, 2, 3, 4, 5]
    assert kept("recommend.include.catalog.category=[news]") == [1, 2, 5]             # a null matches no value
    assert kept("recommend.exclude.catalog.in_stock=[false]") == [1, 3, 4, 5]
    assert kept("recommend.include.catalog.category=[news]", "recommend.exclude.catalog.in_stock=[false]") == [1, 5]
    assert kept("recommend.include.catalog.category=[news, sport]", "recommend.include.catalog.brand_id=[7, 8]") == [1, 2, 3]


def test_an_unknown_catalog_column_or_a_value_its_type_cannot_hold_is_one_line_naming_it():
    from recsys.data.rules import catalog_rule_mask, check_catalog_columns

    with pytest.raises(ConfigError, match=r"recommend\.exclude\.catalog names column 'stock'.*it has available, "
                                          r"brand_id, category, in_stock, item_id") as err:
        check_catalog_columns(_rules("recommend.exclude.catalog.stock=[out]"), CATALOG.column_names, "the snapshot")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"recommend\.include\.catalog\.brand_id: value 'acme' cannot be a int32"):
        catalog_rule_mask(CATALOG, _rules("recommend.include.catalog.brand_id=[acme]"), "the snapshot")


@pytest.mark.parametrize("override, message", [
    ("recommend.exclude.events=[{event_type: purchase, within_days: 0}]", r"within_days.*greater than or equal to 1"),
    ("recommend.exclude.events=[{event_type: purchase, within_days: 20000}]", r"within_days=20000 reaches before"),
    ("recommend.exclude.events=[{event_type: '', within_days: 3}]", r"event_type"),
    ("recommend.exclude.catalog.category=[]", r"category: give a non-empty list"),
    ("recommend.include.catalog.category=[null]", r"category: values must be strings, numbers or booleans"),
    ("recommend.min_new_items=25", r"recommend.min_new_items=25 is more than scoring.top_n=20"),
    ("recommend.fill=random", r"recommend.fill"),
    ("recommend.exclude.touched=maybe", r"recommend.exclude.touched"),
])
def test_a_bad_rule_is_one_configuration_error_naming_it(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(overrides=[override])
    assert "\n" not in str(err.value)


def test_an_event_rule_must_name_a_type_the_history_reads():
    with pytest.raises(ConfigError, match=r"event_type 'purchase' is not among history.event_types \['view'\]"):
        load_config(overrides=["history.event_types=[view]",
                               "recommend.exclude.events=[{event_type: purchase, within_days: 3}]"])


def test_the_rules_params_defaults_are_the_embedded_configuration_s():
    assert RuleParams.from_config(load_config().recommend) == DEFAULT_RULES == RuleParams()


def test_changing_a_rule_changes_the_config_digest():
    base = load_config().digest()
    for override in ("recommend.exclude.touched=true", "recommend.min_new_items=1", "recommend.fill=none",
                     "recommend.exclude.catalog.category=[x]", "recommend.include.catalog.category=[x]",
                     "recommend.exclude.events=[{event_type: purchase, within_days: 3}]"):
        assert load_config(overrides=[override]).digest() != base, override
