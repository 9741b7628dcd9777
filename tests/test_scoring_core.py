"""The scoring core against a plain numpy reference: masking, availability, top-N, fallback, tiling."""
import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys.data.contracts import OUTPUT_SCHEMA, SOURCE_MODEL, SOURCE_POPULARITY
from recsys.scoring.core import Candidates, Fallback, Scorer, popularity_fallback
from recsys.scoring.udf import _chunks
from recsys.sequences import Sequences, Vocabulary, pad_left
from toy_model import random_model

NUM_ITEMS = 60
ITEM_IDS = np.arange(1000, 1000 + NUM_ITEMS, dtype=np.int64)   # external ids; index i+1 <-> 1000+i


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # the GPU path runs where there is one


def make_scorer(model, available_index, top_n=5, item_tile=0, fallback=None, device="cpu"):
    available_index = np.sort(np.asarray(available_index))
    fb = fallback or Fallback(SOURCE_POPULARITY, ITEM_IDS[:top_n], np.linspace(1, 0.5, top_n).astype(np.float32))
    return Scorer(model=model.to(device), vocab=Vocabulary(ITEM_IDS),
                  candidates=Candidates(available_index, ITEM_IDS[available_index - 1]),
                  fallback=fb, top_n=top_n, device=torch.device(device), item_tile=item_tile)


def reference_topn(model, histories_idx, available_index, top_n):
    """Plain fp32 numpy: score every available item, drop seen ones, sort."""
    model = model.cpu()
    emb = model.item_embeddings().numpy()
    out = []
    for hist in histories_idx:
        seq = torch.as_tensor(pad_left(Sequences.from_lists([hist]), model.max_len))
        user = model.encode(seq).numpy()[0]
        cands = [i for i in available_index if i not in set(hist)]
        scores = {i: float(emb[i] @ user) for i in cands}
        ranked = sorted(scores, key=lambda i: -scores[i])[:top_n]
        out.append([int(ITEM_IDS[i - 1]) for i in ranked])
    return out


def random_histories(rng, users, max_len=12):
    return [list(rng.choice(np.arange(1, NUM_ITEMS + 1), size=rng.integers(1, max_len), replace=False)) for _ in range(users)]


def to_ids(histories_idx):
    return Sequences.from_lists([[int(ITEM_IDS[i - 1]) for i in h] for h in histories_idx])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("item_tile", [0, 7, 16])
def test_topn_matches_the_numpy_reference_with_and_without_tiling(item_tile, device):
    rng = np.random.default_rng(1)
    model = random_model(NUM_ITEMS)
    available = np.arange(1, NUM_ITEMS + 1)[rng.random(NUM_ITEMS) < 0.7]
    hists = random_histories(rng, 40)
    batch, stats = make_scorer(model, available, top_n=5, item_tile=item_tile, device=device).score(
        np.arange(40), to_ids(hists))
    got = [[r["item_id"] for r in row] for row in batch.column("recommendations").to_pylist()]
    assert got == reference_topn(model, hists, available, 5)
    assert stats.model_users == 40 and stats.fallback_users == 0


@pytest.mark.parametrize("device", DEVICES)
def test_no_seen_or_unavailable_item_is_recommended_and_scores_descend(device):
    rng = np.random.default_rng(2)
    model = random_model(NUM_ITEMS)
    available = np.arange(1, NUM_ITEMS + 1, 2)
    hists = random_histories(rng, 30)
    batch, _ = make_scorer(model, available, top_n=10, item_tile=9, device=device).score(np.arange(30), to_ids(hists))
    available_ids = set(ITEM_IDS[available - 1].tolist())
    for hist, row in zip(hists, batch.column("recommendations").to_pylist()):
        items = [r["item_id"] for r in row]
        scores = [r["score"] for r in row]
        assert len(items) == len(set(items)) == 10
        assert not set(items) & {int(ITEM_IDS[i - 1]) for i in hist}
        assert set(items) <= available_ids
        assert scores == sorted(scores, reverse=True)


def test_lists_are_shorter_only_when_fewer_unseen_items_are_available():
    model = random_model(NUM_ITEMS)
    available = np.array([1, 2, 3, 4])
    hists = [[1, 2], [10]]
    batch, stats = make_scorer(model, available, top_n=5).score(np.arange(2), to_ids(hists))
    lengths = [len(r) for r in batch.column("recommendations").to_pylist()]
    assert lengths == [2, 4]
    assert stats.short_lists == 2


def test_users_without_known_history_get_the_fallback_marked_as_such():
    model = random_model(NUM_ITEMS)
    available = np.arange(1, NUM_ITEMS + 1)
    fb = popularity_fallback(ITEM_IDS[:10], np.arange(10, 0, -1), top_n=3)
    scorer = make_scorer(model, available, top_n=3, fallback=fb)
    history_ids = Sequences.from_lists([[int(ITEM_IDS[4])], [], [999_999]])  # known, empty, unknown-only
    batch, stats = scorer.score(np.array([7, 8, 9]), history_ids)
    sources = batch.column("source").to_pylist()
    assert sources == [SOURCE_MODEL, SOURCE_POPULARITY, SOURCE_POPULARITY]
    fallback_lists = batch.column("recommendations").to_pylist()[1:]
    assert all([r["item_id"] for r in row] == ITEM_IDS[:3].tolist() for row in fallback_lists)
    assert (stats.fallback_users, stats.unknown_items) == (2, 1)


def test_a_non_finite_user_vector_falls_back_instead_of_ranking_nan_first():
    model = random_model(NUM_ITEMS)
    with torch.no_grad():
        model.emb[5] = float("nan")
    batch, stats = make_scorer(model, np.arange(1, NUM_ITEMS + 1)).score(
        np.array([1, 2]), to_ids([[5], [6]]))
    assert batch.column("source").to_pylist() == [SOURCE_POPULARITY, SOURCE_MODEL]
    assert stats.nonfinite_users == 1
    for row in batch.column("recommendations").to_pylist():
        assert all(np.isfinite(r["score"]) for r in row)


def test_output_matches_the_published_contract_types():
    model = random_model(NUM_ITEMS)
    batch, _ = make_scorer(model, np.arange(1, NUM_ITEMS + 1)).score(np.array([1]), to_ids([[3]]))
    for name in ("user_id", "recommendations", "source"):
        assert batch.schema.field(name).type == OUTPUT_SCHEMA.field(name).type


def test_popularity_fallback_orders_by_count_then_id():
    fb = popularity_fallback(np.array([5, 3, 9, 1]), np.array([2, 7, 7, 1]), top_n=3)
    assert fb.item_ids.tolist() == [3, 9, 5]
    assert fb.scores[0] == pytest.approx(7 / 17)


def test_chunks_are_assembled_across_arrow_batches():
    batches = [pa.RecordBatch.from_pydict({"x": list(range(s, s + n))}) for s, n in ((0, 3), (3, 5), (8, 1), (9, 4))]
    chunks = list(_chunks(iter(batches), 4))
    assert [c.num_rows for c in chunks] == [4, 4, 4, 1]
    assert sum((c.column("x").to_pylist() for c in chunks), []) == list(range(13))


def test_a_chunk_where_nobody_has_known_history_is_all_fallback():
    model = random_model(NUM_ITEMS)
    fb = popularity_fallback(ITEM_IDS[:10], np.arange(10, 0, -1), top_n=4)
    batch, stats = make_scorer(model, np.arange(1, NUM_ITEMS + 1), top_n=4, fallback=fb).score(
        np.array([1, 2]), Sequences.from_lists([[], [123456]]))
    assert batch.column("source").to_pylist() == [SOURCE_POPULARITY] * 2
    assert (stats.fallback_users, stats.unknown_items, stats.model_users) == (2, 1, 0)


def test_only_the_newest_max_len_known_items_feed_the_model_but_all_are_masked():
    model = random_model(NUM_ITEMS, max_len=2)
    hist = [3, 4, 5, 6]                        # the model reads [5, 6]; all four are masked
    scorer = make_scorer(model, np.arange(1, NUM_ITEMS + 1), top_n=NUM_ITEMS)
    batch, _ = scorer.score(np.array([1]), to_ids([hist]))
    items = [r["item_id"] for r in batch.column("recommendations").to_pylist()[0]]
    assert len(items) == NUM_ITEMS - 4 and not set(items) & {int(ITEM_IDS[i - 1]) for i in hist}
    # the user vector depends only on the newest max_len items: an item ranked for both histories
    # gets the same score from both
    short, _ = make_scorer(model, np.arange(1, NUM_ITEMS + 1), top_n=10).score(np.array([1]), to_ids([[5, 6]]))
    full, _ = make_scorer(model, np.arange(1, NUM_ITEMS + 1), top_n=10).score(np.array([1]), to_ids([hist]))
    short_scores = {r["item_id"]: r["score"] for r in short.column("recommendations").to_pylist()[0]}
    full_scores = {r["item_id"]: r["score"] for r in full.column("recommendations").to_pylist()[0]}
    common = set(short_scores) & set(full_scores)
    assert len(common) >= 8
    assert all(short_scores[i] == pytest.approx(full_scores[i]) for i in common)


def test_a_score_matrix_budget_tiles_the_catalog_and_keeps_the_top_n():
    """max_tile_mb bounds the [chunk, tile] score matrix (GPU memory) without changing the result."""
    rng = np.random.default_rng(4)
    model = random_model(NUM_ITEMS)
    available = np.arange(1, NUM_ITEMS + 1)
    hists = random_histories(rng, 40)
    scorer = make_scorer(model, available, top_n=5)
    scorer.max_tile_mb = 40 * 4 * 9 / 2**20              # room for 9 fp32 columns of 40 users
    assert scorer.tile_size(40, 4) == 9 < scorer.num_candidates
    assert scorer.tile_size(40, 2) == 18                  # half-precision scores: twice the items
    batch, _ = scorer.score(np.arange(40), to_ids(hists))
    got = [[r["item_id"] for r in row] for row in batch.column("recommendations").to_pylist()]
    assert got == reference_topn(model, hists, available, 5)
    scorer.max_tile_mb = 0
    assert scorer.tile_size(40, 4) == scorer.num_candidates


# --- exact top-N without sorting the matrix ---------------------------------------------------

from recsys.scoring import core as core_module  # noqa: E402
from recsys.scoring.core import ReferenceScorer, exact_topk  # noqa: E402


def stable_reference(scores: torch.Tensor, k: int):
    """The documented order by brute force: score descending, ties by column ascending."""
    vals, cols = torch.sort(scores, dim=1, descending=True, stable=True)
    return vals[:, :k], cols[:, :k]


def tie_heavy_scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere, also across the k-th place), -inf masks, -0.0 and +0.0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-6, 7, (rows, cols), generator=g).float() / 4
    scores[torch.rand(rows, cols, generator=g) < 0.1] = float("-inf")
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    scores[0] = 1.0                                           # a row of one value
    scores[1, 5:] = float("-inf")                             # a row with fewer finite scores than k
    return scores


def grouped(layout: str):
    """The grouped selection of one layout, forced even where exact_topk would answer directly: groups
    small enough for at least 2 (k + 1) of them, so a partial last group is common; exact_topk itself
    where the row is too short for any grouping."""
    impl = {"contiguous": core_module._topk_over_contiguous_groups,
            "strided": core_module._topk_over_strided_groups}[layout]

    def select(scores: torch.Tensor, k: int, exact: bool = True):
        group = scores.shape[1] // (2 * (k + 1))
        return impl(scores, k, group, exact) if k and group > 1 else exact_topk(scores, k, exact=exact)
    return select


SELECTIONS = {"exact_topk": exact_topk, "contiguous": grouped("contiguous"), "strided": grouped("strided")}


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("cols, k", [(5000, 100), (5000, 1), (3001, 37), (400, 50), (60, 60)])
def test_exact_topk_returns_torch_topk_values_in_the_documented_tie_order(cols, k, selection):
    for seed in range(3):
        scores = tie_heavy_scores(70, cols, seed)
        vals, idx = SELECTIONS[selection](scores, k)
        assert torch.equal(vals, torch.topk(scores, k, dim=1).values)
        ref_vals, ref_cols = stable_reference(scores, k)
        assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_cols)
        assert torch.equal(torch.gather(scores, 1, idx), vals)
        # the bf16 preselection's mode: the k best values in any order, ties broken as it happens
        any_vals, any_idx = SELECTIONS[selection](scores, k, exact=False)
        assert torch.equal(any_vals.sort(dim=1, descending=True).values, ref_vals)
        assert torch.equal(torch.gather(scores, 1, any_idx), any_vals)


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("cols", [20_000, 20_011])
def test_exact_topk_on_continuous_scores_takes_the_filtered_path_and_matches_torch_topk(selection, cols):
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(300, cols, generator=g)
    k = 100
    assert cols // core_module.CPU_GROUP >= core_module.CPU_MIN_GROUPS_PER_ITEM * k   # the grouped path, not the direct one
    vals, idx = SELECTIONS[selection](scores, k)
    ref_vals, ref_idx = torch.topk(scores, k, dim=1)
    assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)          # no ties: the same columns, in order
    any_vals, any_idx = SELECTIONS[selection](scores, k, exact=False)        # the bf16 preselection's mode
    assert torch.equal(any_vals.sort(dim=1, descending=True).values, ref_vals)
    assert torch.equal(torch.gather(scores, 1, any_idx), any_vals)


def test_exact_topk_reads_a_view_whose_rows_are_strided_and_offset():
    """A block cut out of a wider matrix (row stride > columns, storage offset > 0), as a tile is."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(50, 9_000, generator=g)
    view = wide[3:40, 517:517 + 7_003]
    vals, idx = exact_topk(view, 50)
    ref_vals, ref_idx = torch.topk(view.contiguous(), 50, dim=1)
    assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)


def test_exact_topk_ranks_a_nan_in_the_columns_past_the_last_group_first():
    scores = torch.randn(3, 32 * 40 + 7)                       # 40 whole groups of 32, 7 columns after them
    scores[1, -2] = float("nan")
    vals, idx = exact_topk(scores, 5)
    assert idx[1, 0] == scores.shape[1] - 2
    assert torch.equal(idx, torch.topk(scores, 5, dim=1).indices)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_exact_topk_orders_ties_inside_the_top_k_by_column_on_the_fast_path(selection):
    """Continuous scores (so the k-th place is untied and the float top-k path answers), with equal
    scores planted inside the top k: the same items as torch.topk, ties by column ascending."""
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(200, 20_000, generator=g)
    k = 100
    for row in range(200):
        best = torch.topk(scores[row], 10).indices
        scores[row, best[5]] = scores[row, best[2]]          # a tie among the best
        scores[row, 19_999 - row] = scores[row, best[0]]     # a tie at the top, in a late column
    vals, idx = SELECTIONS[selection](scores, k)
    ref_vals, ref_cols = stable_reference(scores, k)
    assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_cols)
    assert torch.equal(vals, torch.topk(scores, k, dim=1).values)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_exact_topk_ranks_nan_first_like_torch_topk(selection):
    scores = torch.randn(4, 4000)
    scores[2, 17] = float("nan")
    scores[3, 4] = -float("nan")                              # a NaN with the sign bit set
    vals, idx = SELECTIONS[selection](scores, 5)
    assert idx[2, 0] == 17 and idx[3, 0] == 4
    assert torch.equal(idx, torch.topk(scores, 5, dim=1).indices)


def trained_sasrec(num_items: int = NUM_ITEMS, max_len: int = 8):
    """A small SASRec trained a few epochs on a next-item pattern (trained weights, not random ones)."""
    from recsys.model.sasrec import SASRecConfig
    from recsys.model.training import TrainSettings, fit

    rng = np.random.default_rng(0)
    runs = [list((s + np.arange(n)) % num_items + 1) for s, n in zip(rng.integers(0, num_items, 200),
                                                                    rng.integers(3, 15, 200))]
    config = SASRecConfig(num_items=num_items, dim=16, layers=2, heads=2, max_len=max_len, dropout=0.1)
    return fit(Sequences.from_lists(runs), config, TrainSettings(epochs=3, batch_size=32, learning_rate=5e-3,
                                                                  seed=1, num_threads=1)).model.eval()


def test_fast_core_gives_the_reference_cores_lists_on_a_trained_model(monkeypatch):
    """Row blocks, the grouped selection and the last-position encoder against the reference core:
    full forward, one product, torch.topk, fp32."""
    model = trained_sasrec()
    rng = np.random.default_rng(3)
    available = np.arange(1, NUM_ITEMS + 1)[rng.random(NUM_ITEMS) < 0.8]
    hists = [list(rng.choice(np.arange(1, NUM_ITEMS + 1), size=n, replace=False)) for n in rng.integers(0, 20, 300)]
    monkeypatch.setattr(core_module, "CPU_BLOCK_BYTES", 40 * 4 * len(available))   # blocks of 40 users
    monkeypatch.setattr(core_module, "CPU_GROUP", 2)                                 # grouped path at 48 items
    monkeypatch.setattr(core_module, "CPU_MIN_GROUPS_PER_ITEM", 1)
    fb = Fallback(SOURCE_POPULARITY, ITEM_IDS[:10], np.linspace(1, 0.5, 10).astype(np.float32))
    common = dict(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(available, ITEM_IDS[available - 1]),
                  fallback=fb, top_n=10, device=torch.device("cpu"))
    fast, ref = Scorer(**common), ReferenceScorer(**common)
    assert fast.row_block(300) == 40
    ids_f, vals_f, fb_f, _ = fast.topn(to_ids(hists))
    ids_r, vals_r, fb_r, _ = ref.topn(to_ids(hists))
    assert np.array_equal(fb_f, fb_r)
    np.testing.assert_allclose(vals_f, vals_r, rtol=1e-5, atol=1e-5)
    assert np.array_equal(ids_f, ids_r)


# --- dtype --------------------------------------------------------------------------------------

def test_bf16_is_refused_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(core_module, "cpu_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="scoring.dtype=bfloat16 needs a CPU with AVX-512-BF16 or AMX-BF16.*float32"):
        Scorer(model=random_model(NUM_ITEMS), vocab=Vocabulary(ITEM_IDS),
               candidates=Candidates(np.arange(1, 11), ITEM_IDS[:10]), fallback=popularity_fallback(ITEM_IDS, np.ones(60), 3),
               top_n=3, device=torch.device("cpu"), dtype="bfloat16")


def test_float16_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="float16 is for CUDA"):
        Scorer(model=random_model(NUM_ITEMS), vocab=Vocabulary(ITEM_IDS),
               candidates=Candidates(np.arange(1, 11), ITEM_IDS[:10]), fallback=popularity_fallback(ITEM_IDS, np.ones(60), 3),
               top_n=3, device=torch.device("cpu"), dtype="float16")


def test_the_capability_check_reads_the_cpu_flags():
    """Where /proc/cpuinfo lists avx512_bf16 or amx_bf16, the check must agree (and disagree where neither is)."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert core_module.cpu_bf16_supported({}) == (("avx512_bf16" in flags or "amx_bf16" in flags)
                                                  and torch.backends.mkldnn.is_available())


@pytest.mark.skipif(not core_module.cpu_bf16_supported(), reason="this CPU has no native bf16")
def test_bf16_lists_overlap_fp32_and_carry_fp32_scores():
    model = trained_sasrec()
    rng = np.random.default_rng(5)
    hists = [list(rng.choice(np.arange(1, NUM_ITEMS + 1), size=n, replace=False)) for n in rng.integers(1, 20, 200)]
    available = np.arange(1, NUM_ITEMS + 1)
    fb = Fallback(SOURCE_POPULARITY, ITEM_IDS[:10], np.linspace(1, 0.5, 10).astype(np.float32))
    common = dict(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(available, ITEM_IDS[available - 1]),
                  fallback=fb, top_n=10, device=torch.device("cpu"))
    ids32, vals32, _, _ = Scorer(**common).topn(to_ids(hists))
    ids16, vals16, _, _ = Scorer(**common, dtype="bfloat16").topn(to_ids(hists))
    overlap = np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(ids32, ids16)])
    assert overlap >= 0.95
    assert np.all(np.diff(vals16, axis=1) <= 0)                                   # fp32-rescored, best first
    assert vals16.dtype == np.float32 and len(np.unique(vals16)) > 0.9 * vals16.size   # not bf16-rounded


@pytest.mark.skipif(not core_module.cpu_bf16_supported(), reason="this CPU has no native bf16")
def test_bf16_over_tiles_narrower_than_its_preselection_gives_the_untiled_lists():
    """1.5 N = 15 candidates from tiles of 7 items: the running merge holds fewer than 15 after two tiles."""
    model = trained_sasrec()
    rng = np.random.default_rng(9)
    hists = [list(rng.choice(np.arange(1, NUM_ITEMS + 1), size=n, replace=False)) for n in rng.integers(1, 20, 100)]
    available = np.arange(1, NUM_ITEMS + 1)
    common = dict(model=model, vocab=Vocabulary(ITEM_IDS), candidates=Candidates(available, ITEM_IDS[available - 1]),
                  fallback=Fallback(SOURCE_POPULARITY, ITEM_IDS[:10], np.linspace(1, 0.5, 10).astype(np.float32)),
                  top_n=10, device=torch.device("cpu"), dtype="bfloat16")
    whole = Scorer(**common).topn(to_ids(hists))
    tiled = Scorer(**common, item_tile=7).topn(to_ids(hists))
    assert np.array_equal(whole[0], tiled[0])
    np.testing.assert_allclose(whole[1], tiled[1], rtol=1e-6)
