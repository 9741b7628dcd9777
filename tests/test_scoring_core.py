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
