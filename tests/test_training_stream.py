"""Training data streamed from shard files (issue 21): the same examples, held-out users and figures as in memory.

No Spark: the shards are written here with pyarrow, in the layout ``recsys.learning.shards`` writes.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys.learning.split import SplitData, StreamedHeldOut, mean_gain, split_last_item
from recsys.model.configs import SASRecConfig
from recsys.model.metrics import evaluate_ranking
from recsys.model.registry import build_model
from recsys.model.stream import (HASH_BUCKETS, Replay, ShardFiles, StreamedWindows, StreamSettings, count_users,
                                 held_out_below, held_out_chunks, ranking_sums, replay_draw)
from recsys.model.training import InMemoryWindows, TrainSettings, fit
from recsys.sequences import Sequences, Vocabulary

MAX_LEN = 6


def _histories(users: int = 90, items: int = 40, seed: int = 1) -> tuple[np.ndarray, Sequences, np.ndarray]:
    rng = np.random.default_rng(seed)
    lists = [rng.choice(np.arange(100, 100 + items), size=int(rng.integers(1, 25)), replace=False)
             for _ in range(users)]
    return np.arange(1, users + 1), Sequences.from_lists(lists), rng.integers(0, 10**12, users)


def _buckets(user_ids: np.ndarray) -> np.ndarray:
    """Stand-ins for Spark's seeded hash buckets: spread over [0, HASH_BUCKETS), fixed per user."""
    return (user_ids * 2_654_435_761) % HASH_BUCKETS


def _write(tmp_path, user_ids, seqs, first_us, files: int = 3, newest_us: np.ndarray | None = None) -> ShardFiles:
    paths = []
    newest_us = first_us if newest_us is None else newest_us
    for f in range(files):
        rows = np.arange(f, len(user_ids), files)
        table = pa.table({"user_id": pa.array(user_ids[rows], pa.int64()),
                          "history": pa.array([seqs.to_lists()[r].tolist() for r in rows], pa.list_(pa.int64())),
                          "newest_first_us": pa.array(first_us[rows], pa.int64()),
                          "newest_us": pa.array(newest_us[rows], pa.int64()),
                          "held_out_bucket": pa.array(_buckets(user_ids[rows]), pa.int64())})
        path = tmp_path / f"part-{f:05d}.parquet"
        pq.write_table(table, path, row_group_size=7)
        paths.append(str(path))
    return ShardFiles(tuple(paths))


def _window_multiset(batches) -> Counter:
    return Counter((tuple(x.tolist()), tuple(y.tolist())) for bx, by in batches for x, y in zip(bx, by))


def _spreads(batches) -> list[int]:
    """Per batch: how many more items its longest window holds than its shortest."""
    return [int((x != 0).sum(1).max() - (x != 0).sum(1).min()) for x, _ in batches]


@pytest.mark.parametrize("random_offsets", [False, True])
def test_an_epoch_streamed_holds_exactly_the_windows_of_the_in_memory_epoch(tmp_path, random_offsets):
    user_ids, seqs, first_us = _histories()
    files = _write(tmp_path, user_ids, seqs, first_us)
    vocab = Vocabulary(np.unique(seqs.items))
    held_out = split_last_item(seqs)
    mapped, _ = vocab.map_sequences(held_out.train)
    streamed = StreamedWindows(files, vocab, StreamSettings(
        max_len=MAX_LEN, batch_size=5, seed=3, hold_out_newest=True, random_offsets=False, users_per_chunk=11,
        shuffle_windows=16))
    memory = InMemoryWindows(mapped, max_len=MAX_LEN, batch_size=5, seed=3, random_offsets=False)
    assert streamed.windows_per_epoch == memory.windows_per_epoch
    assert _window_multiset(streamed.batches(1)) == _window_multiset(memory.batches(1))
    if random_offsets:   # shifted tilings: every target still labelled exactly once per epoch
        shifted = StreamedWindows(files, vocab, StreamSettings(
            max_len=MAX_LEN, batch_size=5, seed=3, hold_out_newest=True, random_offsets=True, users_per_chunk=11,
            shuffle_windows=16))
        labels = Counter(int(v) for _, y in shifted.batches(2) for v in y.flatten() if v)
        assert labels == Counter(int(v) for _, y in memory.batches(1) for v in y.flatten() if v)


def test_a_warm_nights_epoch_holds_the_active_users_and_a_share_of_the_others_drawn_anew_each_night(tmp_path):
    """``Replay``: every user whose newest event is at or after the instant trains, and about ``share`` of the
    others; the epoch holds exactly those users' windows (newest items held out as without a replay), the same
    users in every epoch of a night, other inactive ones under another salt (night)."""
    user_ids, seqs, first_us = _histories(users=600, seed=5)
    newest_us = first_us + np.random.default_rng(6).integers(0, 10**12, len(user_ids))
    since = int(np.median(newest_us))
    files = _write(tmp_path, user_ids, seqs, first_us, newest_us=newest_us)
    vocab = Vocabulary(np.unique(seqs.items))
    below = held_out_below(0.5, 0, len(user_ids))

    def stream(share: float, salt: int) -> StreamedWindows:
        return StreamedWindows(files, vocab, StreamSettings(
            max_len=MAX_LEN, batch_size=5, seed=3, hold_out_newest=True, random_offsets=False, users_per_chunk=11,
            shuffle_windows=16, held_out_below=below, replay=Replay(since, share, salt)))

    def kept(share: float, salt: int) -> np.ndarray:   # who should train, from the raw columns
        return (newest_us >= since) | (replay_draw(_buckets(user_ids), salt) < share)

    active = newest_us >= since
    for salt in (1, 2):
        users = kept(0.25, salt)
        assert 0.15 < users[~active].mean() < 0.35 and users[active].all()
        mapped, _ = vocab.map_sequences(seqs.split_newest(3, _buckets(user_ids) < below)[0].take(np.flatnonzero(users)))
        memory = InMemoryWindows(mapped, max_len=MAX_LEN, batch_size=5, seed=3, random_offsets=False)
        source = stream(0.25, salt)
        assert source.users_per_epoch == users.sum()
        assert _window_multiset(source.batches(1)) == _window_multiset(memory.batches(1))
        assert _window_multiset(source.batches(2)) == _window_multiset(memory.batches(1))
    assert (kept(0.25, 1) != kept(0.25, 2)).any()
    assert stream(1.0, 1).users_per_epoch == len(user_ids)


def test_batches_are_shuffled_reproducible_and_differ_by_epoch_and_rank(tmp_path):
    user_ids, seqs, first_us = _histories()
    files = _write(tmp_path, user_ids, seqs, first_us)
    vocab = Vocabulary(np.unique(seqs.items))

    def first_batches(epoch, rank=0):
        source = StreamedWindows(files, vocab, StreamSettings(
            max_len=MAX_LEN, batch_size=4, seed=3, hold_out_newest=False, random_offsets=True, rank=rank,
            users_per_chunk=11, shuffle_windows=32))
        return [x.tolist() for x, _ in source.batches(epoch)][:3]

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)
    assert first_batches(1) != first_batches(1, rank=1)


def test_each_process_reads_its_own_files_and_too_few_files_are_refused():
    files = ShardFiles(tuple(f"f{i}" for i in range(5)))
    assert files.for_rank(0, 2).paths == ("f0", "f2", "f4") and files.for_rank(1, 2).paths == ("f1", "f3")
    with pytest.raises(ValueError, match="5 shard file.*6 training processes"):
        files.for_rank(0, 6)


def test_the_streamed_held_out_users_are_split_last_items(tmp_path):
    user_ids, seqs, first_us = _histories()
    files = _write(tmp_path, user_ids, seqs, first_us)
    split = split_last_item(seqs, first_us=first_us)
    chunks = list(held_out_chunks(files, users_per_chunk=8))
    streamed = {tuple(h.tolist()) + (int(t), int(f)) for c in chunks
                for h, t, f in zip(c.histories.to_lists(), c.targets, c.first_us)}
    expected = {tuple(h.tolist()) + (int(t), int(f)) for h, t, f in
                zip(split.valid_histories.to_lists(), split.valid_targets, split.valid_first_us)}
    assert streamed == expected and len(streamed) == split.users
    cutoff = int(np.median(first_us))
    assert StreamedHeldOut(files).since(cutoff).users == split.since(cutoff).users
    assert count_users(files) == len(user_ids)


def test_streamed_scores_equal_the_in_memory_ones(tmp_path):
    user_ids, seqs, first_us = _histories()
    files = _write(tmp_path, user_ids, seqs, first_us)
    split: SplitData = split_last_item(seqs, first_us=first_us)
    vocab = Vocabulary(np.unique(split.train.items))          # some targets unknown: they count as misses
    torch.manual_seed(0)
    model = build_model(SASRecConfig(num_items=len(vocab), dim=8, layers=1, heads=1, max_len=MAX_LEN)).eval()
    # the gate's per-user figures: the same users' values, in the files' order, averaging to training's metric
    streamed_gains = StreamedHeldOut(files).user_gains(model, vocab.item_ids, "cpu")
    assert sorted(streamed_gains.round(9)) == sorted(split.user_gains(model, vocab.item_ids, "cpu").round(9))
    from recsys.learning.split import validation_set

    valid = validation_set(vocab, split)
    expected = evaluate_ranking(model, valid.histories, valid.targets, ks=(10,))
    assert mean_gain(streamed_gains) == pytest.approx(expected["ndcg@10"] * len(valid.targets) / split.users, abs=1e-6)

    sums = ranking_sums(model, vocab, held_out_chunks(files, users_per_chunk=7), ks=(10,), device="cpu")
    assert sums.known == len(valid.targets) and sums.total == split.users
    for key, value in expected.items():
        assert sums.means_over_known()[key] == pytest.approx(value, abs=1e-9)


def test_fit_trains_from_streamed_shards(tmp_path):
    """Not a toy loop: a streamed fit learns (loss falls) and is reproducible for a seed."""
    user_ids, seqs, first_us = _histories(users=120)
    files = _write(tmp_path, user_ids, seqs, first_us)
    vocab = Vocabulary(np.unique(seqs.items))
    config = SASRecConfig(num_items=len(vocab), dim=8, layers=1, heads=1, max_len=MAX_LEN)
    settings = TrainSettings(epochs=4, batch_size=8, seed=5, window_offsets="random")

    def run():
        source = StreamedWindows(files, vocab, StreamSettings(
            max_len=MAX_LEN, batch_size=8, seed=5, hold_out_newest=False, random_offsets=True, users_per_chunk=16,
            shuffle_windows=64))
        return fit(source, config, settings)

    first, second = run(), run()
    assert first.curve[-1]["train_loss"] < first.curve[0]["train_loss"]
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[key]), key


def test_with_a_share_held_out_only_those_users_give_up_their_newest_item_and_everyone_else_trains_on_it(tmp_path):
    """One fit: the held-out users' newest items are validation and the gate's, every other user's are trained on."""
    user_ids, seqs, first_us = _histories(users=300)
    files = _write(tmp_path, user_ids, seqs, first_us)
    below = held_out_below(0.3, 0, len(user_ids))
    chosen = _buckets(user_ids) < below
    split = split_last_item(seqs, first_us=first_us)
    expected_users = {int(user_ids[r]) for r in np.flatnonzero(seqs.lengths >= 3) if chosen[r]}
    assert 0.2 * len(user_ids) < len(expected_users) < 0.4 * len(user_ids) and len(expected_users) < split.users

    targets = [int(t) for c in held_out_chunks(files, held_out_below=below, users_per_chunk=8) for t in c.targets]
    newest = {int(user_ids[r]): int(seqs.to_lists()[r][-1]) for r in range(len(user_ids))}
    assert sorted(targets) == sorted(newest[u] for u in expected_users)
    assert StreamedHeldOut(files, held_out_below=below).users == len(expected_users)
    assert StreamedHeldOut(files, held_out_below=below).since(0).users == len(expected_users)
    assert StreamedHeldOut(files).users == split.users      # no cut: every user with enough items, as before

    vocab = Vocabulary(np.unique(seqs.items))
    streamed = StreamedWindows(files, vocab, StreamSettings(
        max_len=MAX_LEN, batch_size=5, seed=3, hold_out_newest=True, random_offsets=False, held_out_below=below,
        users_per_chunk=11, shuffle_windows=16))
    labels = Counter(int(v) for _, y in streamed.batches(1) for v in y.flatten() if v)
    left, _, _ = seqs.split_newest(3, eligible=chosen)
    trained = vocab.map_sequences(left)[0]
    expected = Counter(int(v) for row in trained.to_lists() for v in row[1:])   # every item after a user's first
    assert labels == expected
    everything = vocab.map_sequences(seqs)[0]
    assert sum(labels.values()) == sum(max(0, len(r) - 1) for r in everything.to_lists()) - len(expected_users)


def test_batches_by_length_hold_the_same_windows_each_batch_of_similar_length(tmp_path):
    """``train.batching: by_length``: the epoch's windows are those of random batches, each exactly once, but a
    batch's windows hold about as many items as each other, so its width is its own, not max_len's."""
    user_ids, seqs, first_us = _histories(users=200)
    files = _write(tmp_path, user_ids, seqs, first_us)
    vocab = Vocabulary(np.unique(seqs.items))

    def stream(by_length: bool) -> StreamedWindows:
        return StreamedWindows(files, vocab, StreamSettings(
            max_len=MAX_LEN, batch_size=8, seed=3, hold_out_newest=False, random_offsets=True, users_per_chunk=11,
            shuffle_windows=64, by_length=by_length))

    by_length, shuffled = list(stream(True).batches(2)), list(stream(False).batches(2))
    assert _window_multiset(by_length) == _window_multiset(shuffled)
    assert len(by_length) == len(shuffled)                               # the same steps an epoch
    assert sum(_spreads(by_length)) < sum(_spreads(shuffled)) / 4      # sorted within each shuffle buffer
    widths = [int((x != 0).sum(1).max()) for x, _ in by_length]
    assert widths != sorted(widths), "the batches must still come in a shuffled order"
    # the loss's scale: targets per window of the fixed tiling, counted in the pass that counts the windows
    fixed = list(StreamedWindows(files, vocab, StreamSettings(
        max_len=MAX_LEN, batch_size=8, seed=3, hold_out_newest=False, random_offsets=False)).batches(1))
    assert stream(True).targets_per_window == pytest.approx(
        sum(int((y != 0).sum()) for _, y in fixed) / sum(len(x) for x, _ in fixed))


def test_in_memory_batches_by_length_match_the_streamed_kind(tmp_path):
    _, seqs, _ = _histories(users=120)
    vocab = Vocabulary(np.unique(seqs.items))
    mapped, _ = vocab.map_sequences(seqs)
    memory = InMemoryWindows(mapped, max_len=MAX_LEN, batch_size=8, seed=3, random_offsets=False, by_length=True)
    shuffled = InMemoryWindows(mapped, max_len=MAX_LEN, batch_size=8, seed=3, random_offsets=False)
    batches = list(memory.batches(1))
    assert _window_multiset(batches) == _window_multiset(shuffled.batches(1))
    assert sum(_spreads(batches)) < sum(_spreads(shuffled.batches(1))) / 4
    targets = sum(int((y != 0).sum()) for _, y in batches)
    assert memory.targets_per_window == pytest.approx(targets / memory.windows_per_epoch)
