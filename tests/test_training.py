"""Training: windows cover every interaction once, the model learns a plain pattern, runs repeat."""
from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch

from cores import SHARE
from recsys.model.metrics import evaluate_ranking
from recsys.model.sasrec import SASRec, SASRecConfig
from recsys.model.training import WIDTH_MULTIPLE, FitCallbacks, TrainSettings, ValidationSet, fit, training_windows
from recsys.sequences import Sequences

NUM_ITEMS = 40


def successor_task(users: int = 150, seed: int = 0) -> tuple[Sequences, ValidationSet]:
    """Item i is always followed by item i + 1 (cyclically): runs of 4..14 items from a random start.

    Validation target: the item after each user's last; it is never in the history (runs are
    shorter than the cycle), so exclusion cannot hide it.
    """
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, NUM_ITEMS, users)
    lengths = rng.integers(4, 15, users)
    runs = [(s + np.arange(n)) % NUM_ITEMS + 1 for s, n in zip(starts, lengths)]
    targets = np.array([r[-1] % NUM_ITEMS + 1 for r in runs], dtype=np.int64)
    train = Sequences.from_lists(runs)
    return train, ValidationSet(train, targets)


CONFIG = SASRecConfig(num_items=NUM_ITEMS, dim=32, layers=1, heads=2, max_len=10, dropout=0.1)
FAST = TrainSettings(epochs=12, batch_size=32, learning_rate=5e-3, patience=3, seed=3, num_threads=SHARE)


def test_windows_tile_each_sequence_backwards_from_the_newest_item():
    seqs = Sequences.from_lists([[1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18], [9], [], [21, 22]])
    windows = training_windows(seqs, max_len=3)
    assert windows.tolist() == [
        [4, 5, 6, 7], [1, 2, 3, 4],                        # 7 items: two full windows sharing item 4
        [15, 16, 17, 18], [12, 13, 14, 15], [0, 0, 11, 12],  # 8 items: the oldest window is left-padded
        [0, 0, 21, 22],                                      # users with < 2 items give nothing
    ]


def test_every_interaction_but_each_users_first_is_a_target_exactly_once():
    rng = np.random.default_rng(5)
    lists = [rng.integers(1, 10_000, n) for n in rng.integers(0, 300, 60)]
    # make item values unique so a target can be traced back to one interaction
    flat = rng.permutation(sum(len(x) for x in lists)) + 1
    cut = np.cumsum([0] + [len(x) for x in lists])
    lists = [flat[a:b] for a, b in zip(cut[:-1], cut[1:])]
    windows = training_windows(Sequences.from_lists(lists), max_len=50)
    inputs, labels = windows[:, :-1], windows[:, 1:]
    trained = labels[inputs != 0]
    expected = np.concatenate([x[1:] for x in lists])
    assert len(trained) == len(expected)
    assert np.array_equal(np.sort(trained), np.sort(expected))


def test_learns_that_each_item_is_followed_by_the_next():
    train, valid = successor_task()
    torch.manual_seed(123)
    untrained = SASRec(CONFIG)
    nothing = Sequences.from_lists([[]] * len(train))
    seen = []
    result = fit(train, CONFIG, FAST, valid=valid, callbacks=FitCallbacks(progress=seen.append))
    assert result.best_metrics["ndcg@10"] > 0.8
    assert evaluate_ranking(untrained, valid.histories, valid.targets)["ndcg@10"] < 0.3
    # Stricter than validation: with nothing excluded, the next item must also beat the history.
    assert evaluate_ranking(result.model, valid.histories, valid.targets, exclude=nothing)["ndcg@10"] > 0.8
    assert evaluate_ranking(untrained, valid.histories, valid.targets, exclude=nothing)["ndcg@10"] < 0.3
    assert evaluate_ranking(result.model, valid.histories, valid.targets) == result.best_metrics
    assert seen == result.curve
    assert [row["epoch"] for row in result.curve] == list(range(1, len(result.curve) + 1))
    assert set(result.curve[0]) == {"epoch", "train_loss", "ndcg@10", "hr@10", "mrr", "seconds"}
    assert result.curve[-1]["train_loss"] < result.curve[0]["train_loss"]


@pytest.mark.slow   # trains a 2-layer model for 8 epochs: 7-10 s on 2 cores
def test_learns_a_pattern_that_needs_more_than_the_last_item():
    """Two interleaved chains, a, b, a+1, b+1, ...: the next item follows the one two steps back,
    and the last item says nothing about it, so this needs attention over the history."""
    rng = np.random.default_rng(1)
    runs, targets = [], []
    for a, b, n in zip(rng.integers(0, NUM_ITEMS, 400), rng.integers(0, NUM_ITEMS, 400), rng.integers(6, 15, 400)):
        seq = [((a if t % 2 == 0 else b) + t // 2) % NUM_ITEMS + 1 for t in range(n + 1)]
        runs.append(seq[:-1])
        targets.append(seq[-1])
    train = Sequences.from_lists(runs)
    config = SASRecConfig(num_items=NUM_ITEMS, dim=32, layers=2, heads=2, max_len=10, dropout=0.1)
    result = fit(train, config, TrainSettings(epochs=8, batch_size=32, learning_rate=5e-3, seed=3, num_threads=SHARE))
    nothing = Sequences.from_lists([[]] * len(train))
    assert evaluate_ranking(result.model, train, np.array(targets), exclude=nothing)["ndcg@10"] > 0.8


def test_same_seed_same_weights_and_a_different_seed_differs():
    train, _ = successor_task(users=40)
    settings = TrainSettings(epochs=2, batch_size=16, seed=11, num_threads=SHARE)
    a = fit(train, CONFIG, settings).model.state_dict()
    b = fit(train, CONFIG, settings).model.state_dict()
    c = fit(train, CONFIG, TrainSettings(epochs=2, batch_size=16, seed=12, num_threads=SHARE)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_early_stopping_keeps_the_best_epochs_weights():
    """Once validation NDCG stops improving, training stops after `patience` epochs and the model
    is exactly the one a run stopped at the best epoch would give (validation consumes no randomness)."""
    train, valid = successor_task()
    settings = TrainSettings(epochs=30, batch_size=32, learning_rate=5e-3, patience=2, seed=3, num_threads=SHARE)
    result = fit(train, CONFIG, settings, valid=valid)
    scores = [row["ndcg@10"] for row in result.curve]
    assert result.best_epoch == 1 + int(np.argmax(scores))
    assert len(result.curve) == result.best_epoch + 2 < 30
    assert max(scores[result.best_epoch:]) <= scores[result.best_epoch - 1]
    shorter = fit(train, CONFIG, TrainSettings(epochs=result.best_epoch, batch_size=32, learning_rate=5e-3,
                                               seed=3, num_threads=SHARE))
    best, again = result.model.state_dict(), shorter.model.state_dict()
    assert all(torch.equal(best[k], again[k]) for k in best)


def test_early_stopping_also_counts_the_training_windows_since_the_best_epoch():
    """``patience_windows`` stops sooner than ``patience`` once that many windows (not epochs) passed without a
    better validation NDCG; a better epoch starts the count again; None leaves the epoch count alone."""
    train, _ = successor_task(users=40)
    per_epoch = len(training_windows(train, CONFIG.max_len))      # fixed offsets: the same windows every epoch
    scores = [0.1, 0.5, 0.4, 0.6, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]   # the best at epoch 2, then at epoch 4

    def scripted(model) -> dict[str, float]:
        """The validation figure of each epoch in turn (what early stopping reads, set by the test)."""
        calls.append(1)
        return {"ndcg@10": scores[len(calls) - 1]}

    def epochs_run(**stop) -> tuple[int, int]:
        calls.clear()
        result = fit(train, CONFIG, TrainSettings(epochs=10, batch_size=32, seed=3, num_threads=SHARE, **stop),
                     valid=scripted)
        return len(result.curve), result.best_epoch

    calls: list[int] = []
    assert epochs_run(patience=5, patience_windows=per_epoch) == (3, 2)          # one epoch of windows
    # epoch 4 beats epoch 2 before two epochs of windows passed, and the count starts again from it
    assert epochs_run(patience=5, patience_windows=2 * per_epoch) == (6, 4)
    assert epochs_run(patience=5, patience_windows=2 * per_epoch + 1) == (7, 4)
    assert epochs_run(patience=1, patience_windows=None) == (3, 2)               # the epoch count alone
    assert epochs_run(patience=2, patience_windows=10 * per_epoch) == (6, 4)     # whichever comes first


def test_without_validation_the_last_epoch_is_kept():
    train, _ = successor_task(users=20)
    result = fit(train, CONFIG, TrainSettings(epochs=2, batch_size=16, num_threads=SHARE))
    assert result.best_epoch == 2 and result.best_metrics == {}
    assert [set(row) for row in result.curve] == [{"epoch", "train_loss", "seconds"}] * 2


def test_fit_leaves_the_callers_random_state_and_threads_alone():
    train, _ = successor_task(users=20)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    expected = torch.rand(3)
    torch.manual_seed(0)
    fit(train, CONFIG, TrainSettings(epochs=1, batch_size=16, num_threads=1))
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


def test_fit_rejects_items_outside_the_vocabulary_and_empty_data():
    with pytest.raises(ValueError, match=r"1\.\.40"):
        fit(Sequences.from_lists([[1, 41]]), CONFIG, FAST)
    with pytest.raises(ValueError, match="nothing to learn"):
        fit(Sequences.from_lists([[1], []]), CONFIG, FAST)


def test_the_learning_rate_warms_up_linearly_then_stays_or_falls_to_zero_by_a_cosine():
    from recsys.model.training import lr_factor

    constant = lr_factor(TrainSettings(epochs=4, warmup_epochs=1), steps_per_epoch=10)
    assert [constant(s) for s in (0, 4, 9, 10, 39)] == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0])
    cosine = lr_factor(TrainSettings(epochs=4, warmup_epochs=1, lr_decay="cosine"), steps_per_epoch=10)
    assert cosine(9) == pytest.approx(1.0) and cosine(10) == pytest.approx(1.0)
    assert cosine(25) == pytest.approx(0.5) and cosine(40) == pytest.approx(0.0)     # halfway; the horizon
    falling = [cosine(s) for s in range(10, 41)]
    assert all(a >= b for a, b in zip(falling, falling[1:]))
    with pytest.raises(ValueError, match="warmup_epochs"):
        TrainSettings(epochs=2, warmup_epochs=2)
    with pytest.raises(ValueError, match="lr_decay"):
        TrainSettings(lr_decay="linear")


def test_stop_after_repeats_the_first_epochs_of_the_full_schedule_step_for_step():
    """What a refit relies on: stopping after 2 of 5 cosine epochs trains exactly as the first 2 epochs
    of the 5-epoch run (same losses), which is not what a 2-epoch schedule would do."""
    train, _ = successor_task(users=40)
    settings = TrainSettings(epochs=5, batch_size=16, learning_rate=5e-3, seed=11, num_threads=SHARE,
                             warmup_epochs=1, lr_decay="cosine")
    full = fit(train, CONFIG, settings)
    stopped = fit(train, CONFIG, settings, stop_after=2)
    short = fit(train, CONFIG, TrainSettings(epochs=2, batch_size=16, learning_rate=5e-3, seed=11, num_threads=SHARE,
                                             warmup_epochs=1, lr_decay="cosine"))
    assert len(stopped.curve) == 2 and stopped.best_epoch == 2
    assert [r["train_loss"] for r in stopped.curve] == [r["train_loss"] for r in full.curve[:2]]
    assert stopped.curve[1]["train_loss"] != short.curve[1]["train_loss"]
    with pytest.raises(ValueError, match="stop_after"):
        fit(train, CONFIG, settings, stop_after=6)


def test_offset_windows_keep_every_target_once_and_move_it_between_positions():
    from recsys.model.training import offset_windows

    seqs = Sequences.from_lists([[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13], [21, 22, 23, 24, 25]])
    windows, label_from = offset_windows(seqs, max_len=3, offsets=np.array([2, 1, 1]))
    # user 0 (7 targets > 3): a partial window ending at 8 whose last 2 positions are targets, then full
    # windows tiling back from 6; user 1 fits one window (its offset is ignored); user 2 shifted by 1
    assert windows.tolist() == [[5, 6, 7, 8], [3, 4, 5, 6], [0, 1, 2, 3],
                                [0, 11, 12, 13],
                                [22, 23, 24, 25], [21, 22, 23, 24]]
    assert label_from.tolist() == [1, 0, 0, 0, 2, 0]       # user 0's newest window: targets 7 and 8 only
    # the property that matters, on random data and random offsets: each target exactly once
    rng = np.random.default_rng(0)
    lists = [list(rng.integers(1, 99, rng.integers(0, 40))) for _ in range(200)]
    seqs = Sequences.from_lists(lists)
    for seed in range(3):
        offsets = np.random.default_rng(seed).integers(0, 7, len(lists))
        windows, label_from = offset_windows(seqs, max_len=7, offsets=offsets)
        labelled = [w[j + 1] for w, f in zip(windows.tolist(), label_from.tolist()) for j in range(7)
                    if j >= f and w[j] != 0]
        assert sorted(labelled) == sorted(int(i) for x in lists for i in x[1:])


def test_random_window_offsets_with_a_cosine_schedule_still_learn_the_pattern():
    """The tuning grid's options together (issue 20): shifted windows each epoch, warm-up, cosine decay.
    Runs of up to 14 items with max_len 10, so the longer users' windows do shift."""
    from dataclasses import replace

    train, valid = successor_task()
    settings = replace(FAST, window_offsets="random", warmup_epochs=1, lr_decay="cosine")
    result = fit(train, CONFIG, settings, valid=valid)
    assert result.best_metrics["ndcg@10"] > 0.8
    again = fit(train, CONFIG, settings, valid=valid)               # seeded: the shifts repeat too
    assert [r["train_loss"] for r in again.curve] == [r["train_loss"] for r in result.curve]


def test_batches_by_length_encode_short_windows_narrow_and_still_learn_the_pattern():
    """``batching="by_length"``: a batch of short windows is encoded at its own width (the all-padding columns
    dropped, up to a width of a multiple of WIDTH_MULTIPLE: exact, tests/test_model.py's padding tests), and the
    model learns as with random batches."""
    train, valid = successor_task(users=200)
    widths: dict[str, list[int]] = {}
    for batching in ("random", "by_length"):
        seen: list[int] = widths.setdefault(batching, [])
        model = SASRec(CONFIG)
        model.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].shape[1]) if model.training
                                        else None)
        result = fit(train, model, TrainSettings(epochs=12, batch_size=32, learning_rate=5e-3, patience=3, seed=3,
                                                 num_threads=SHARE, batching=batching), valid=valid)
        assert result.best_metrics["ndcg@10"] > 0.5, (batching, result.best_metrics)
    assert set(widths["random"]) == {CONFIG.max_len}         # runs of 4..14 items: some window is always full
    assert min(widths["by_length"]) == WIDTH_MULTIPLE < CONFIG.max_len          # batches of short runs
    assert all(w % WIDTH_MULTIPLE == 0 or w == CONFIG.max_len for w in widths["by_length"])
    # narrower on average (not in sum: the two runs may early-stop after different epoch counts)
    assert sum(widths["by_length"]) / len(widths["by_length"]) < sum(widths["random"]) / len(widths["random"])


_FREED = """
import sys
from recsys.model.training import freed_memory_releaser

def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

release = freed_memory_releaser()
chunks = [bytearray(64 * 1024) for _ in range(3000)]     # 190 MB from the allocator's heap, as a step's tensors
pin = bytearray(64 * 1024)                                # allocated last: the heap's top stays in use
held = rss_mb()
del chunks
if sys.argv[1] == "release":
    release()
print(held, rss_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heaps and malloc_trim (and /proc)")
def test_what_an_epoch_freed_goes_back_to_the_system():
    """glibc keeps freed heap pages (a training process held a gigabyte nobody used between epochs); the releaser the
    training loop calls after each epoch hands them back. The control frees the same and keeps them."""
    import subprocess

    def run(arm: str) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", _FREED, arm], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        held, after = map(int, done.stdout.split())
        return held, after

    held, kept = run("control")
    assert kept > held - 50                       # freed, yet still resident: what the releaser is for
    held, released = run("release")
    assert released < held - 150
