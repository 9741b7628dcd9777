"""Training data streamed from Parquet shards of histories: what a training process reads, a chunk at a time.

Spark writes every user's history before the training date as Parquet files (``recsys.learning.shards``;
columns ``user_id``, ``history``: external item ids, oldest first, ``newest_first_us``, ``newest_us`` and
``held_out_bucket``). No process ever holds all of them: a training process reads its files in batches of
``users_per_chunk`` users (on a warm night only those :class:`Replay` keeps), maps each chunk to the model's
vocabulary, cuts it into training windows and passes the windows through a shuffle buffer of bounded size.
Memory is set by the chunk, the buffer and the model, not by the number of users: the same at 250k users as at 10M.

The examples are the ones the in-memory path makes (``recsys.model.training``): the same held-out
split (:meth:`Sequences.split_newest`), the same window tiling with the same per-epoch offsets
rule, the same labels. What differs is the order: a user's windows are shuffled within a buffer of
``shuffle_windows`` windows, the files in a seeded order per epoch, instead of one global
permutation. Spark writes users to files by hash, so a buffer holds a random sample of users.

Validation and the gate stream the same files: each held-out user with at least ``MIN_HELD_OUT_LEN``
items holds out their newest item, and metrics are accumulated as sums over chunks (so that several
processes can add theirs). Which users are held out is written into the shards as a seeded hash bucket
of the user id (``held_out_bucket``): every user (``HASH_BUCKETS``) or a share of them
(:func:`held_out_below`), so that one fit can both choose its epoch count on the held-out users and
learn every other user's newest item.

Pure pyarrow/numpy/torch: runs wherever a training process runs (an executor, a GPU box).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys import fs as rfs
from recsys.sequences import Sequences, Vocabulary

HISTORY = "history"
NEWEST_FIRST_US = "newest_first_us"
NEWEST_US = "newest_us"            # when the user's newest event happened (epoch us): who was active since a date
USER_ID = "user_id"
HELD_OUT_BUCKET = "held_out_bucket"  # a seeded hash of the user id in [0, HASH_BUCKETS): held out when below the cut
HASH_BUCKETS = 1 << 30
MIN_HELD_OUT_LEN = 3           # users with fewer items keep all of them for training (split_last_item's rule)
USERS_PER_CHUNK = 4096         # users read, mapped and cut into windows at a time
SHUFFLE_WINDOWS = 32768        # windows shuffled together: [32768, 51] int64 inputs + labels, about 27 MB


@dataclass(frozen=True)
class ShardFiles:
    """The Parquet files one process reads (paths or URIs that ``recsys.fs.resolve`` understands)."""

    paths: tuple[str, ...]

    def for_rank(self, rank: int, world: int) -> "ShardFiles":
        """Files ``rank, rank + world, ...``: each process of a data-parallel training reads its own."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        if len(self.paths) < world:
            raise ValueError(f"{len(self.paths)} shard file(s) for {world} training processes: every process "
                             "needs at least one (write more shards, or train with fewer processes)")
        return ShardFiles(self.paths[rank::world])


def read_batches(paths: Sequence[str], columns: Sequence[str], users_per_chunk: int = USERS_PER_CHUNK
                 ) -> Iterator[pa.RecordBatch]:
    """Record batches of at most ``users_per_chunk`` rows, file after file, never a whole file at once."""
    for path in paths:
        fs, local = rfs.resolve(path)
        with fs.open_input_file(local) as handle:
            yield from pq.ParquetFile(handle).iter_batches(batch_size=users_per_chunk, columns=list(columns))


def window_examples(windows: np.ndarray, label_from: np.ndarray, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, L+1] windows -> [W, L] inputs and labels (0: no loss), labels before ``label_from`` masked
    (they belong to another window of the same user)."""
    windows_t = torch.from_numpy(windows)
    inputs = windows_t[:, :-1].contiguous()
    before = torch.arange(max_len)[None, :] < torch.from_numpy(label_from)[:, None]
    labels = windows_t[:, 1:].masked_fill((inputs == 0) | before, 0).contiguous()
    return inputs, labels


def window_count(seqs: Sequences, max_len: int) -> int:
    """Windows of the fixed tiling (what an epoch holds, give or take one per long user with random offsets)."""
    n = seqs.lengths
    return int(np.where(n >= 2, -(-(n - 1) // max_len), 0).sum())


def target_count(seqs: Sequences) -> int:
    """Training targets: every item but each user's first (each is a target exactly once, whatever the tiling)."""
    return int(np.maximum(seqs.lengths - 1, 0).sum())


def batch_rows(inputs: torch.Tensor, order: torch.Tensor, batch_size: int, by_length: bool,
               permute: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """Each batch's rows of ``inputs`` [W, L], in training order; ``order`` is the shuffled rows.

    By length (``train.batching: by_length``): the shuffled rows ordered by how many real items they hold
    (stable, so rows of one length stay shuffled), cut into batches, and the batches shuffled with
    ``permute``. A batch of short windows is then encoded at its own width instead of ``max_len``: most
    users hold far fewer items than ``max_len``, but a random batch of 16 usually holds one long window.

    >>> rows = batch_rows(torch.tensor([[0, 0, 1], [2, 3, 4], [0, 5, 6], [0, 0, 7]]), torch.tensor([3, 1, 0, 2]), 2,
    ...                   True, lambda n: torch.arange(n))
    >>> [r.tolist() for r in rows]
    [[3, 0], [2, 1]]
    """
    if by_length:
        lengths = (inputs[order] != 0).sum(dim=1)
        order = order[torch.argsort(lengths, stable=True)]
        groups = order.split(batch_size)
        return [groups[int(g)] for g in permute(len(groups))]
    return list(order.split(batch_size))


def held_out_below(share: float, min_users: int, users: int) -> int:
    """The bucket cut that holds out about ``share`` of ``users``, and at least ``min_users`` of them (every
    user when there are no more): a user is held out when their ``held_out_bucket`` is below it.

    >>> held_out_below(1.0, 0, 5000) == HASH_BUCKETS          # every user
    True
    >>> round(held_out_below(0.2, 1000, 20000) / HASH_BUCKETS, 6)   # a fifth of 20k users: 4k, above the floor
    0.2
    >>> round(held_out_below(0.2, 1000, 2000) / HASH_BUCKETS, 6)    # a fifth would be 400: the floor's 1000 instead
    0.5
    >>> held_out_below(0.2, 1000, 800) == HASH_BUCKETS        # fewer users than the floor: every one
    True
    """
    if not 0 < share <= 1:
        raise ValueError(f"the held-out share must be in (0, 1], got {share}")
    wanted = max(share, min_users / users) if users > 0 else 1.0
    return HASH_BUCKETS if wanted >= 1 else int(HASH_BUCKETS * wanted)


def bucket_columns(below: int | None) -> list[str]:
    """The shard columns :func:`held_out_rows` reads for the cut ``below``: the bucket when the cut holds out a
    share of the users, none when every user is held out (shards written without buckets still read).

    >>> bucket_columns(None), bucket_columns(HASH_BUCKETS), bucket_columns(100)
    ([], [], ['held_out_bucket'])
    """
    return [HELD_OUT_BUCKET] if below is not None and below < HASH_BUCKETS else []


def held_out_rows(batch: pa.RecordBatch, below: int | None) -> np.ndarray | None:
    """Which rows of ``batch`` may hold out their newest item: those whose bucket is below the cut (None: every
    row). ``batch`` holds the :func:`bucket_columns` of ``below``."""
    if not bucket_columns(below):
        return None
    return batch.column(HELD_OUT_BUCKET).to_numpy(zero_copy_only=False).astype(np.int64) < below


def replay_draw(buckets: np.ndarray, salt: int) -> np.ndarray:
    """A uniform number in [0, 1) per user from their ``held_out_bucket`` and ``salt``: the same for a user
    within a night (every epoch and process agrees on who is replayed), another draw each night (another salt),
    and unrelated to whether the user is held out (the bucket is mixed by splitmix64's finaliser first).

    >>> draws = replay_draw(np.arange(0, HASH_BUCKETS, HASH_BUCKETS // 20000), salt=738900)
    >>> bool(abs((draws < 0.25).mean() - 0.25) < 0.02), bool(((draws >= 0) & (draws < 1)).all())
    (True, True)
    >>> bool((replay_draw(np.arange(1000), 1) != replay_draw(np.arange(1000), 2)).any())
    True
    """
    with np.errstate(over="ignore"):
        x = np.asarray(buckets, dtype=np.uint64) + np.uint64(salt % (1 << 63)) * np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass(frozen=True)
class Replay:
    """Which users a warm night trains on: every user with an event at or after ``active_since_us`` (what the
    model it starts from has not seen), and of the others a ``share`` drawn anew each night (``salt``), so that
    what the model knew is rehearsed, not forgotten, at a fraction of a full pass (docs/training.md, "Warm
    nights"). ``share`` 1 trains on every user."""

    active_since_us: int
    share: float
    salt: int = 0

    COLUMNS = (NEWEST_US, HELD_OUT_BUCKET)

    def rows(self, batch: pa.RecordBatch) -> np.ndarray:
        """Which rows of ``batch`` (holding :attr:`COLUMNS`) are trained on."""
        if self.share >= 1:
            return np.ones(batch.num_rows, dtype=bool)
        active = batch.column(NEWEST_US).to_numpy(zero_copy_only=False).astype(np.int64) >= self.active_since_us
        buckets = batch.column(HELD_OUT_BUCKET).to_numpy(zero_copy_only=False).astype(np.int64)
        return active | (replay_draw(buckets, self.salt) < self.share)


@dataclass(frozen=True)
class StreamSettings:
    """How an epoch's windows are cut from the shards and batched.

    ``hold_out_newest``: drop each held-out user's newest item (the fit that chooses the epoch count) or
    train on everything (the refit); ``held_out_below``: the held-out users' bucket cut (None: every user,
    as with shards written without buckets); ``random_offsets``: shift each long user's window tiling every
    epoch; ``rank``: this process's place in a data-parallel training (its shuffle differs);
    ``users_per_chunk`` users are read at a time and ``shuffle_windows`` windows shuffled together;
    ``replay``: train only on the users it keeps (a warm night's active users and replayed sample; None: all).
    """

    max_len: int
    batch_size: int
    seed: int
    hold_out_newest: bool
    random_offsets: bool
    held_out_below: int | None = None
    rank: int = 0
    users_per_chunk: int = USERS_PER_CHUNK
    shuffle_windows: int = SHUFFLE_WINDOWS
    replay: Replay | None = None
    by_length: bool = False


class StreamedWindows:
    """An epoch's training batches, streamed from shard files: ``batches(epoch)`` yields (inputs, labels).

    Items outside ``vocab`` are dropped from the sequences, as ``Vocabulary.map_sequences`` does.
    """

    def __init__(self, files: ShardFiles, vocab: Vocabulary, settings: StreamSettings):
        s = settings
        if s.batch_size < 1 or s.shuffle_windows < s.batch_size:
            raise ValueError(f"need 1 <= batch_size ({s.batch_size}) <= shuffle_windows ({s.shuffle_windows})")
        self.files, self.vocab = files, vocab
        self.max_len, self.batch_size, self.seed, self.rank = s.max_len, s.batch_size, s.seed, s.rank
        self.hold_out_newest, self.random_offsets = s.hold_out_newest, s.random_offsets
        self.held_out_below = s.held_out_below
        self.users_per_chunk, self.shuffle_windows = s.users_per_chunk, s.shuffle_windows
        self.replay, self.by_length = s.replay, s.by_length
        self._windows: int | None = None
        self._targets: int | None = None
        self._users: int | None = None
        self._item_counts: np.ndarray | None = None

    def sequences(self, paths: Sequence[str] | None = None) -> Iterator[Sequences]:
        """Index-space training sequences, a chunk of users at a time (with ``replay``, only the users it keeps)."""
        columns = [HISTORY] + (bucket_columns(self.held_out_below) if self.hold_out_newest else [])
        if self.replay is not None:
            columns += [c for c in Replay.COLUMNS if c not in columns]
        for batch in read_batches(self.files.paths if paths is None else paths, columns, self.users_per_chunk):
            if self.replay is not None:
                batch = batch.filter(pa.array(self.replay.rows(batch)))
            seqs = Sequences.from_arrow(batch.column(0))
            if self.hold_out_newest:
                seqs = seqs.split_newest(MIN_HELD_OUT_LEN, held_out_rows(batch, self.held_out_below))[0]
            yield self.vocab.map_sequences(seqs)[0]

    def _count(self) -> None:
        windows, targets, users, counts = 0, 0, 0, np.zeros(len(self.vocab) + 1, dtype=np.int64)
        for seqs in self.sequences():
            windows += window_count(seqs, self.max_len)
            targets += target_count(seqs)
            users += len(seqs)
            counts += np.bincount(seqs.items, minlength=len(counts))
        self._windows, self._targets, self._users, self._item_counts = windows, targets, users, counts

    @property
    def users_per_epoch(self) -> int:
        """Users an epoch trains on (every user in the files, or those ``replay`` keeps)."""
        if self._users is None:
            self._count()
        return self._users

    @property
    def windows_per_epoch(self) -> int:
        """Windows in one epoch of the fixed tiling: one pass over the files, once, for the schedule's horizon."""
        if self._windows is None:
            self._count()
        return self._windows

    @property
    def targets_per_window(self) -> float:
        """Mean training targets a window of the fixed tiling holds (the loss's scale with batches by length)."""
        if self._windows is None:
            self._count()
        return self._targets / max(self._windows, 1)

    @property
    def item_counts(self) -> np.ndarray:
        """[num_items + 1] occurrences of each index in these files' sequences (0: padding, always 0)."""
        if self._item_counts is None:
            self._count()
        return self._item_counts

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches: files in a seeded order, windows shuffled a buffer at a time.

        Seeded by (seed, epoch, rank): the same data and seed give the same batches, and the
        processes of a data-parallel training see different orders of their different files.
        """
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        batch_order = np.random.default_rng([self.seed, epoch, self.rank, 1])   # its own: the windows stay the same

        def permute(n: int) -> torch.Tensor:
            return torch.from_numpy(batch_order.permutation(n))

        paths = [self.files.paths[i] for i in rng.permutation(len(self.files.paths))]
        inputs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        held = 0
        for seqs in self.sequences(paths):
            shift = (rng.integers(0, self.max_len, len(seqs)) if self.random_offsets
                     else np.zeros(len(seqs), dtype=np.int64))
            x, y = window_examples(*_offset_windows(seqs, self.max_len, shift), self.max_len)
            inputs.append(x)
            labels.append(y)
            held += len(x)
            if held >= self.shuffle_windows:
                x, y = torch.cat(inputs), torch.cat(labels)
                order = torch.from_numpy(rng.permutation(len(x)))
                full = len(x) // self.batch_size * self.batch_size
                for rows in batch_rows(x, order[:full], self.batch_size, self.by_length, permute):
                    yield x[rows], y[rows]
                rest = order[full:]
                inputs, labels, held = [x[rest]], [y[rest]], len(rest)
        if held:
            x, y = torch.cat(inputs), torch.cat(labels)
            for rows in batch_rows(x, torch.from_numpy(rng.permutation(len(x))), self.batch_size, self.by_length,
                                   permute):
                yield x[rows], y[rows]


def _offset_windows(seqs: Sequences, max_len: int, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from recsys.model.training import offset_windows   # one tiling, defined with the training loop

    return offset_windows(seqs, max_len, shift)


@dataclass(frozen=True)
class HeldOutChunk:
    """One chunk's held-out users: id-space histories (newest item removed), the removed items, and when
    each user first touched it (epoch microseconds, UTC)."""

    histories: Sequences
    targets: np.ndarray
    first_us: np.ndarray


def held_out_chunks(files: ShardFiles, *, since_us: int | None = None, held_out_below: int | None = None,
                    users_per_chunk: int = USERS_PER_CHUNK) -> Iterator[HeldOutChunk]:
    """Each held-out user's newest item (users with at least ``MIN_HELD_OUT_LEN`` items and, with
    ``held_out_below``, a bucket below it), a chunk at a time; with ``since_us``, only the users who first
    touched it at or after that instant."""
    for batch in read_batches(files.paths, [HISTORY, NEWEST_FIRST_US, *bucket_columns(held_out_below)],
                              users_per_chunk):
        seqs = Sequences.from_arrow(batch.column(0))
        first_us = batch.column(1).to_numpy(zero_copy_only=False).astype(np.int64)
        left, rows, targets = seqs.split_newest(MIN_HELD_OUT_LEN, held_out_rows(batch, held_out_below))
        first_us = first_us[rows]
        keep = np.arange(len(rows)) if since_us is None else np.flatnonzero(first_us >= since_us)
        if len(keep):
            yield HeldOutChunk(left.take(rows[keep]), targets[keep], first_us[keep])


@dataclass
class RankingSums:
    """Sums of per-user ranking metrics and the users behind them: what processes add up before dividing."""

    sums: dict[str, float]
    known: int           # users whose target the model knows (the metrics' users)
    total: int           # every held-out user (unknown targets count as misses)

    def add(self, other: "RankingSums") -> "RankingSums":
        """Both added up, the metrics in the order they first appear (not a set's: the epoch lines and the logged
        metrics then read the same from one run to the next).

        >>> RankingSums({"ndcg@10": 1.0, "mrr": 0.5}, 1, 2).add(RankingSums({"mrr": 0.5, "hr@10": 1.0}, 1, 1)).sums
        {'ndcg@10': 1.0, 'mrr': 1.0, 'hr@10': 1.0}
        """
        keys = dict.fromkeys([*self.sums, *other.sums])
        return RankingSums({k: self.sums.get(k, 0.0) + other.sums.get(k, 0.0) for k in keys},
                           self.known + other.known, self.total + other.total)

    def means_over_known(self) -> dict[str, float]:
        """What early stopping reads: metrics over users whose target the model can rank."""
        return {k: v / self.known for k, v in self.sums.items()} if self.known else {}


def ranking_sums(model: torch.nn.Module, vocab: Vocabulary, chunks: Iterator[HeldOutChunk], *,
                 ks: Sequence[int], device: torch.device | str) -> RankingSums:
    """Leave-one-out metrics of ``model`` over streamed held-out users, as sums (``evaluate_ranking`` per chunk)."""
    from recsys.model.metrics import evaluate_ranking

    total = RankingSums({}, 0, 0)
    for chunk in chunks:
        histories, _ = vocab.map_sequences(chunk.histories)
        targets = vocab.index_of(chunk.targets)
        keep = np.flatnonzero(targets > 0)
        part = RankingSums({}, len(keep), len(chunk.targets))
        if len(keep):
            means = evaluate_ranking(model, histories.take(keep), targets[keep], ks=ks, device=device)
            part.sums = {k: v * len(keep) for k, v in means.items()}
        total = total.add(part)
    return total


def count_users(files: ShardFiles) -> int:
    """Users in the files, from the Parquet footers (no data read)."""
    count = 0
    for path in files.paths:
        fs, local = rfs.resolve(path)
        with fs.open_input_file(local) as handle:
            count += pq.ParquetFile(handle).metadata.num_rows
    return count


__all__ = ["HISTORY", "NEWEST_FIRST_US", "NEWEST_US", "USER_ID", "HELD_OUT_BUCKET", "HASH_BUCKETS",
           "MIN_HELD_OUT_LEN", "Replay", "replay_draw", "held_out_below", "held_out_rows", "bucket_columns", "ShardFiles", "StreamedWindows",
           "HeldOutChunk", "RankingSums", "count_users", "held_out_chunks", "ranking_sums", "read_batches",
           "window_count", "window_examples"]
