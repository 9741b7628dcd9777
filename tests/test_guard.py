"""The guard's judgement and the scoring tasks' comparison, without Spark (recsys.pipelines.guard,
recsys.scoring.compare)."""
import datetime as dt
import math

import numpy as np
import pyarrow as pa
import pytest

from recsys.config import load_config
from recsys.data.contracts import (HISTORY_COLUMN, PERSONAL_FREQUENCY_COLUMN, PREVIOUS_COLUMN, RECOMMENDATION_TYPE,
                                   TOUCHED_COLUMN, TOUCHED_KNOWN_COLUMN)
from recsys.errors import ConfigError, ExitCode, GuardRefused
from recsys.pipelines import guard
from recsys.scoring.compare import CompareSpec, TaskComparison, merge

DATE = dt.date(2024, 5, 9)


def _guard(*overrides):
    return load_config(overrides=["guard.min_users=10", *overrides]).guard


def _figures(**changes):
    base = {"rows": 1000.0, "overlap_users": 900.0, "previous_rows": 950.0, "realized_users": 300.0,
            "jaccard_at_n_mean": 0.8, "first_item_changed_share": 0.2, "catalog_coverage_ratio": 1.0,
            "head_slot_share": 0.2, "fallback_share": 0.01, "users_lost_share": 0.05, "score_psi": 0.02,
            "realized_hr_ratio_at_n": 1.4, "realized_pfreq_users": 300.0, "realized_hr_pfreq_ratio_at_n": 1.1,
            "realized_hr_pfreq_ratio_at_10": 1.05}
    return {**base, **changes}


def test_a_normal_night_passes_every_default_threshold():
    verdict = guard.judge(_figures(), _guard(), first_night=False)
    assert verdict.verdict == "pass"
    assert {c.level for c in verdict.checks} == {"pass"}
    guard.enforce(verdict, DATE)   # does not raise


def test_a_fail_names_the_figure_the_threshold_and_the_margin_and_exits_3():
    verdict = guard.judge(_figures(jaccard_at_n_mean=0.01, head_slot_share=0.97), _guard(), first_night=False)
    assert verdict.verdict == "fail"
    fails = {c.figure: c for c in verdict.crossed("fail")}
    assert set(fails) == {"jaccard_at_n_mean", "head_slot_share"}
    assert fails["jaccard_at_n_mean"].margin == pytest.approx(0.04)
    assert fails["head_slot_share"].margin == pytest.approx(0.07)
    assert "jaccard_at_n_mean = 0.01 is below the fail threshold 0.05 by 0.04" in fails["jaccard_at_n_mean"].why
    with pytest.raises(GuardRefused) as refused:
        guard.enforce(verdict, DATE)
    assert refused.value.exit_code == ExitCode.VALIDATION_FAILED
    message = str(refused.value)
    assert "refused the night of 2024-05-09, nothing published" in message
    assert "head_slot_share = 0.97 is above the fail threshold 0.9 by 0.07" in message and "--accept-guard" in message
    assert {c["figure"] for c in refused.value.report["checks"] if c["level"] == "fail"} == set(fails)


def test_a_warn_publishes_and_an_accepted_fail_is_recorded_as_accepted():
    warned = guard.judge(_figures(score_psi=0.4), _guard(), first_night=False)
    assert warned.verdict == "warn" and [c.figure for c in warned.crossed("warn")] == ["score_psi"]
    guard.enforce(warned, DATE)
    accepted = guard.judge(_figures(jaccard_at_n_mean=0.0), _guard(), first_night=False, accepted=True)
    assert accepted.verdict == "accepted" and accepted.accepted
    guard.enforce(accepted, DATE)
    assert "accepted on purpose" in accepted.summary()
    # accepting a night the guard would pass changes nothing
    assert not guard.judge(_figures(), _guard(), first_night=False, accepted=True).accepted


def test_the_first_night_says_so_and_judges_only_tonight_s_own_figures():
    figures = {"rows": 1000.0, "head_slot_share": 0.2, "fallback_share": 0.0}
    verdict = guard.judge(figures, _guard(), first_night=True)
    assert verdict.verdict == "pass" and verdict.first_night
    assert "first night" in verdict.note
    by_figure = {c.figure: c.level for c in verdict.checks}
    assert by_figure["jaccard_at_n_mean"] == "not judged" and by_figure["head_slot_share"] == "pass"
    # a degenerate model is refused even on the first night: its own concentration gives it away
    assert guard.judge({**figures, "head_slot_share": 1.0}, _guard(), first_night=True).verdict == "fail"


def test_figures_over_too_few_users_or_not_measured_are_reported_not_judged():
    verdict = guard.judge(_figures(realized_users=3.0, realized_hr_ratio_at_n=0.1, score_psi=math.nan),
                          _guard(), first_night=False)
    levels = {c.figure: c for c in verdict.checks}
    assert levels["realized_hr_ratio_at_n"].level == "not judged" and "fewer than guard.min_users" in \
        levels["realized_hr_ratio_at_n"].why
    assert levels["score_psi"].level == "not judged"
    assert verdict.verdict == "pass" and "not judged: score_psi, realized_hr_ratio_at_n" in verdict.note


def test_thresholds_live_in_one_config_section_and_are_checked_when_loaded():
    cfg = load_config(overrides=["guard.thresholds.exposure_gini={warn: 0.95, fail: 0.999}",
                                 "guard.thresholds.score_psi.fail=2"])
    assert cfg.guard.thresholds["exposure_gini"].fail == 0.999 and cfg.guard.thresholds["score_psi"].fail == 2
    with pytest.raises(ConfigError, match="unknown guard figure"):
        load_config(overrides=["guard.thresholds.happiness.warn=1"])
    with pytest.raises(ConfigError, match="warn must come first"):
        load_config(overrides=["guard.thresholds.jaccard_at_n_mean.warn=0.01"])
    # where the guard draws its lines changes no published row: not part of the config digest
    assert load_config(overrides=["guard.min_users=7"]).digest() == load_config().digest()


def _list(rows, value_type=pa.int64()):
    return pa.array(rows, type=pa.list_(value_type))


def test_a_task_adds_up_overlap_and_realized_hits_as_worked_out_by_hand():
    """Three users: u1 kept two of four items and touched one of its previous list; u2 is new tonight; u3's
    list is unchanged and it touched an item only the popularity baseline showed."""
    candidates = np.arange(1, 21, dtype=np.int64)
    chunk = pa.RecordBatch.from_pydict({
        "user_id": pa.array([1, 2, 3], pa.int64()),
        HISTORY_COLUMN: _list([[20, 19, 7], [5], [17, 16]]),
        TOUCHED_COLUMN: _list([[7], [], [16]]),
        PREVIOUS_COLUMN: _list([[1, 7, 3, 4], None, [9, 10, 11, 12]]),
    })
    new = [[(1, 4.0), (2, 3.0), (3, 2.0), (9, 1.0)], [(5, 2.0), (6, 1.0), (8, 0.5), (9, 0.1)],
           [(9, 4.0), (10, 3.0), (11, 2.0), (12, 1.0)]]
    recs = pa.array([[{"item_id": i, "score": s} for i, s in row] for row in new], type=RECOMMENDATION_TYPE)
    out = pa.RecordBatch.from_arrays([pa.array([1, 2, 3], pa.int64()), recs, pa.array(["model"] * 3)],
                                     names=["user_id", "recommendations", "source"])
    ranking = np.array([16, 1, 2, 3, 4, 5, 6, 7, 8])   # the popularity ranking the previous night kept
    task = TaskComparison(CompareSpec(top_n=4, popularity_ranking=ranking, score_edges=np.array([1.5, 2.5])),
                          candidates)
    task.add_chunk(chunk, out)
    t = merge([task.finish()])
    assert t["both"] == 2 and t["first_changed"] == 0 and t["identical"] == 1
    assert t["jaccard_n_sum"] == pytest.approx(2 / 6 + 1.0)          # u1: {1, 3} shared of {1, 2, 3, 4, 7, 9}
    assert t["touched_users"] == 2 and t["realized_users"] == 2
    # u1 touched 7 at position 1 of its previous list: a hit, NDCG 1/log2(3); u3 touched 16, not in its list
    assert t["hr_n"] == 1 and t["ndcg_n"] == pytest.approx(1 / math.log2(3))
    # popularity without the items each user had before (u1: 20, 19; u3: 17): u1 gets 16, 1, 2, 3 (no 7),
    # u3 gets 16 first: a hit at position 0
    assert t["pop_hr_n"] == 1 and t["pop_ndcg_n"] == pytest.approx(1.0)
    # scores of the 12 model slots in the previous night's bins (< 1.5, [1.5, 2.5), >= 2.5)
    assert t["score_bins"].tolist() == [5, 3, 4] and t["score_count"] == 12
    assert t["jaccard_n_hist"][33] == 1 and t["jaccard_n_hist"][100] == 1


def _chunk_and_lists(users, history, touched, known, frequent, previous):
    chunk = pa.RecordBatch.from_pydict({
        "user_id": pa.array(users, pa.int64()), HISTORY_COLUMN: _list(history), TOUCHED_COLUMN: _list(touched),
        TOUCHED_KNOWN_COLUMN: _list(known), PERSONAL_FREQUENCY_COLUMN: _list(frequent), PREVIOUS_COLUMN: _list(previous),
    })
    recs = pa.array([[{"item_id": i, "score": 1.0 / (1 + p)} for p, i in enumerate(range(1, 13))]] * len(users),
                    type=RECOMMENDATION_TYPE)
    out = pa.RecordBatch.from_arrays([pa.array(users, pa.int64()), recs, pa.array(["model"] * len(users))],
                                     names=["user_id", "recommendations", "source"])
    return chunk, out


def test_a_task_counts_a_repeat_blend_s_scores_but_neither_bins_nor_samples_them():
    """A list ranked by the repeat blend carries the blend's scores, not the model's: no PSI bins, no deciles."""
    chunk, out = _chunk_and_lists([1, 2], history=[[7], [40]], touched=[[7], []], known=[[7], []], frequent=[[7], []],
                                  previous=[list(range(1, 13)), None])
    spec = CompareSpec(top_n=12, popularity_ranking=np.zeros(0, np.int64), score_edges=np.array([0.2, 0.5]))
    for model_scores, binned in ((True, 24), (False, 0)):
        task = TaskComparison(spec, np.arange(1, 100, dtype=np.int64), model_scores=model_scores)
        task.add_chunk(chunk, out)
        payload = task.finish()
        t = merge([payload])
        assert t["score_count"] == binned and t["blend_score_count"] == 24 - binned
        assert (t["score_bins"] is None) == (not model_scores) and bool(payload["score_sample"]) == model_scores
        assert t["both"] == 1 and t["realized_users"] == 1        # the rest is compared either way


def test_a_task_splits_realized_hits_into_repeats_and_new_items_and_scores_personal_frequency_by_hand():
    """top_n 12 (k = 10). u1 repeated 3 and 50 and found 12 (place 11 of its previous list: a hit at n only);
    its personal-frequency list held 50 and 3 first. u2 found only 40, new to it, and has no personal-frequency
    list (new since). u3 had no previous list, u4 touched nothing: neither is counted. A second chunk whose one
    user has no personal-frequency list either (an empty column of lists)."""
    twelve = list(range(1, 13))
    chunk, out = _chunk_and_lists(
        [1, 2, 3, 4], history=[[7, 3, 50, 12], [40], [5], [1]], touched=[[3, 12, 50], [40], [5], []],
        known=[[3, 50], [], [5], []], frequent=[[50, 3, 7], [], [5], [1]],
        previous=[twelve, list(range(20, 32)), None, twelve])
    alone, alone_out = _chunk_and_lists([5], history=[[60]], touched=[[60]], known=[[]], frequent=[[]],
                                        previous=[twelve])
    task = TaskComparison(CompareSpec(top_n=12, popularity_ranking=np.zeros(0, np.int64), score_edges=np.zeros(0)),
                          np.arange(1, 100, dtype=np.int64))
    task.add_chunk(chunk, out)
    task.add_chunk(alone, alone_out)
    t = merge([task.finish()])
    assert t["realized_users"] == 3 and t["realized_pfreq_users"] == 3
    assert t["realized_repeat_users"] == 1 and t["realized_new_users"] == 3      # u1; u1, u2, u5
    # repeats: u1's 3 at place 2 of 12, over the ideal of two targets
    ideal2 = 1 + 1 / math.log2(3)
    assert t["repeat_hr_k"] == 1 and t["repeat_hr_n"] == 1
    assert t["repeat_ndcg_k"] == pytest.approx((1 / math.log2(4)) / ideal2) == t["repeat_ndcg_n"]
    # new: u1's 12 at place 11, past k; u2's 40 and u5's 60 missed
    assert t["new_hr_k"] == 0 and t["new_ndcg_k"] == 0
    assert t["new_hr_n"] == 1 and t["new_ndcg_n"] == pytest.approx(1 / math.log2(13))
    # personal frequency over all of u1's three targets: 50 and 3 at places 0 and 1; u2 and u5 had no list
    assert t["pfreq_hr_k"] == 1 and t["pfreq_hr_n"] == 1
    assert t["pfreq_ndcg_k"] == pytest.approx(ideal2 / (ideal2 + 1 / math.log2(4)))

    from recsys.pipelines.nightly_compare import repeat_and_personal_figures

    model = {"realized_hr_at_10": t["hr_k"] / 3, "realized_hr_at_n": t["hr_n"] / 3}
    figs = repeat_and_personal_figures(t, model)
    assert figs["realized_repeat_users"] == 1 and figs["realized_new_users"] == 3
    assert figs["realized_hr_at_10_repeat"] == 1 and figs["realized_hr_at_10_new"] == 0
    assert figs["realized_hr_at_n_new"] == pytest.approx(1 / 3)
    assert figs["realized_ndcg_at_n_new"] == pytest.approx(1 / math.log2(13) / 3)
    assert figs["realized_pfreq_hr_at_10"] == pytest.approx(1 / 3) == figs["realized_pfreq_hr_at_n"]
    assert figs["realized_hr_pfreq_ratio_at_10"] == pytest.approx(model["realized_hr_at_10"] / (1 / 3))
    # no personal-frequency hit at all: no ratio (nothing to divide by), and no repeat users: no repeat figures
    none = repeat_and_personal_figures({**t, "pfreq_hr_k": 0.0, "pfreq_hr_n": 0.0, "realized_repeat_users": 0.0}, model)
    assert "realized_hr_pfreq_ratio_at_10" not in none and "realized_hr_at_10_repeat" not in none
    assert none["realized_pfreq_hr_at_10"] == 0 and none["realized_repeat_users"] == 0


def test_the_personal_frequency_ratio_is_judged_only_over_enough_users_and_only_warns_by_default():
    figures = _figures(realized_pfreq_users=300.0, realized_hr_pfreq_ratio_at_n=0.2, realized_hr_pfreq_ratio_at_10=0.9)
    verdict = guard.judge(figures, _guard(), first_night=False)
    levels = {c.figure: c for c in verdict.checks}
    assert verdict.verdict == "warn" and [c.figure for c in verdict.crossed("warn")] == ["realized_hr_pfreq_ratio_at_n"]
    assert "below the warn threshold 0.5 by 0.3" in levels["realized_hr_pfreq_ratio_at_n"].why
    assert levels["realized_hr_pfreq_ratio_at_10"].level == "pass" and levels["realized_hr_pfreq_ratio_at_n"].users == 300
    few = guard.judge({**figures, "realized_pfreq_users": 3.0}, _guard(), first_night=False)
    assert {c.figure: c.level for c in few.checks}["realized_hr_pfreq_ratio_at_n"] == "not judged"
    assert few.verdict == "pass"
    assert {c.figure: c.level for c in guard.judge(figures, _guard(), first_night=True).checks}[
        "realized_hr_pfreq_ratio_at_n"] == "not judged"
