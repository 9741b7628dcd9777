"""Training sequence models (SASRec, GRU4Rec) on users' item sequences: next-item prediction, full softmax.

Every position of a sequence is a training example (the model reads items up to t and is scored on
item t + 1), against all items at once: full-softmax cross-entropy is markedly better for SASRec than
the original paper's one-sampled-negative BCE, and at tens of thousands of items it is affordable.

Sequences longer than ``max_len + 1`` are cut into windows that tile them backwards from the newest
item: window 0 is the most recent ``max_len + 1`` items (exactly what the model reads when scoring),
window 1 ends where window 0's first target is, and so on; the oldest window is left-padded. Every
interaction except a user's first is a target exactly once per epoch, so an epoch costs time linear
in the interactions, and long histories, which hold most of the data in typical logs, are used
whole (in ml-latest-small a quarter of the users hold 71% of the ratings, and 74% of the ratings
are older than their user's latest 51: training on the latest window only would discard them).

By default the windows are fixed and only their order varies between epochs (seeded). With
``window_offsets="random"`` each epoch shifts every long user's tiling by a seeded random offset:
a partial window ends at the newest item with only its newest ``offset`` positions as targets, and
the full windows tile backwards from there. Every interaction is still a target exactly once per
epoch, but from epoch to epoch it is predicted at different positions, with different contexts,
including the last position with a full window of context, which is the one scoring reads.

Pure torch/numpy: runs on any machine the models run on.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from recsys.model.base import drop_padding_columns
from recsys.model.losses import LOSSES, training_loss, vocabulary_counts
from recsys.model.metrics import SELECTION_K, SELECTION_METRIC, evaluate_ranking
from recsys.model.precision import PRECISIONS, resolve_precision
from recsys.model.registry import build_model
from recsys.model.stream import StreamedWindows, batch_rows, target_count, window_examples
from recsys.sequences import Sequences, pad_left


LR_DECAYS = ("constant", "cosine")
WINDOW_OFFSETS = ("fixed", "random")
BATCHINGS = ("random", "by_length")
# Batches by length are encoded at their longest window's width rounded up to this: a handful of widths the CPU's
# matrix kernels tile evenly instead of every width from 1 to max_len (about as fast as random batches on
# MovieLens's long histories, where exact widths were at times slower: docs/quality.md, "Batches by length")
WIDTH_MULTIPLE = 8
FUSED_ADAMW_DEVICES = ("cpu", "cuda")   # where torch (>= 2.4) has a fused AdamW kernel


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 30
    batch_size: int = 128        # windows per step
    learning_rate: float = 1e-3
    weight_decay: float = 0.0    # AdamW, on matrices and embeddings only (not norms or biases)
    patience: int = 5            # stop after this many epochs without a better validation NDCG@10
    patience_windows: int | None = None  # or once this many training windows passed without one; None: epochs only
    seed: int = 42
    eval_every: int = 1          # validate every this many epochs (and after the last one)
    num_threads: int | None = None  # torch CPU threads during fit (restored afterwards); None: unchanged
    warmup_epochs: float = 0.0   # learning rate rises linearly from 0 over this many epochs' steps
    lr_decay: str = "constant"   # constant | cosine: to 0 at the end of ``epochs`` (the schedule's horizon)
    window_offsets: str = "fixed"   # fixed | random: each epoch shifts long users' window tiling (see above)
    loss: str = "full"           # full | sampled: softmax over this many negatives, log-q corrected (model/losses.py)
    negatives: int = 8192        # with loss "sampled"; at or above the item count, the full softmax is used
    precision: str = "fp32"      # fp32 | bf16 | auto: bf16 autocast for the model and logits (see _autocast)
    batching: str = "by_length"  # by_length | random: batches of windows of similar length (see _fit)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "patience", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainSettings.{name} must be at least 1, got {getattr(self, name)}")
        if not self.learning_rate > 0 or self.weight_decay < 0:
            raise ValueError("TrainSettings.learning_rate must be > 0 and weight_decay >= 0")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ValueError(f"TrainSettings.warmup_epochs must be in [0, epochs={self.epochs}), got {self.warmup_epochs}")
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"TrainSettings.lr_decay must be one of {', '.join(LR_DECAYS)}, got {self.lr_decay!r}")
        if self.window_offsets not in WINDOW_OFFSETS:
            raise ValueError(f"TrainSettings.window_offsets must be one of {', '.join(WINDOW_OFFSETS)}, "
                             f"got {self.window_offsets!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"TrainSettings.loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.negatives < 1:
            raise ValueError(f"TrainSettings.negatives must be at least 1 (items sampled a step), got {self.negatives}")
        if self.patience_windows is not None and self.patience_windows < 1:
            raise ValueError(f"TrainSettings.patience_windows must be at least 1 or None, got {self.patience_windows}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"TrainSettings.num_threads must be at least 1 or None, got {self.num_threads}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"TrainSettings.batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainSettings.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass(frozen=True)
class ValidationSet:
    """Leave-one-out validation: the model reads ``histories[u]`` and should rank ``targets[u]`` high.

    History items are excluded from the ranking, as the nightly job excludes seen items.
    """

    histories: Sequences
    targets: np.ndarray  # [U] int64 item index (1..num_items)

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.histories):
            raise ValueError(f"ValidationSet has {len(self.histories)} histories but {len(self.targets)} targets")


@dataclass
class FitResult:
    model: torch.nn.Module        # the best epoch's weights (the last epoch's without validation)
    curve: list[dict]             # per epoch: epoch, train_loss, [ndcg@10, hr@10, mrr], seconds
    best_epoch: int
    best_metrics: dict = field(default_factory=dict)  # validation metrics of best_epoch; {} without validation


def training_windows(train: Sequences, max_len: int) -> np.ndarray:
    """[W, max_len + 1] int64 windows tiling each sequence backwards from its newest item.

    Consecutive windows of one user share one item (the last input of the older window is the
    first input of the newer), so each item but the first is a target once. Left-padded with 0.
    Users with fewer than two items give no window. Vectorised: no per-user Python.
    """
    windows, _ = offset_windows(train, max_len, np.zeros(len(train), dtype=np.int64))
    return windows


def offset_windows(train: Sequences, max_len: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows as :func:`training_windows`, with each long user's tiling shifted by ``offsets[u]``.

    For a user with more targets than ``max_len`` and an offset ``s`` in ``1..max_len - 1``, the first
    window ends at the newest item with only its last ``s`` positions as targets, and full windows
    tile backwards from ``s`` items before the newest. Returns the windows and, per window, the first
    position whose label counts (earlier labels belong to the next window). Offsets of users whose
    targets fit one window are ignored: left-padding fixes their positions anyway.
    """
    L = max_len
    n = train.lengths                                                     # [U]
    shift = np.where(n - 1 > L, np.asarray(offsets, dtype=np.int64) % L, 0)       # [U]
    partial = (shift > 0) & (n >= 2)                                      # [U] a partial newest window
    count = np.where(n >= 2, -(-(n - 1 - shift) // L), 0) + partial       # [U] windows per user
    user = np.repeat(np.arange(len(n)), count)                            # [W]
    first_of_user = np.repeat(np.cumsum(count) - count, count)            # [W]
    k = np.arange(len(user)) - first_of_user                              # [W] 0 = newest window
    has_partial, s = partial[user], shift[user]
    end = np.where(has_partial, np.where(k == 0, n[user], n[user] - s - (k - 1) * L), n[user] - k * L)
    label_from = np.where(has_partial & (k == 0), L - s, 0)               # [W]
    start = np.maximum(end - L - 1, 0)                                    # [W]
    base = train.offsets[:-1][user]                                       # [W]
    offsets_out = np.zeros(len(user) + 1, dtype=np.int64)
    np.cumsum(end - start, out=offsets_out[1:])
    idx = np.repeat(base + start - offsets_out[:-1], end - start) + np.arange(offsets_out[-1], dtype=np.int64)
    return pad_left(Sequences(offsets_out, train.items[idx]), L + 1), label_from


class InMemoryWindows:
    """An epoch's batches from sequences held in memory: one global seeded permutation of the windows.

    What ``recsys evaluate`` and the tests train on; ``recsys train`` streams the same examples from
    shard files (:class:`recsys.model.stream.StreamedWindows`), which share this interface.
    """

    def __init__(self, train: Sequences, *, max_len: int, batch_size: int, seed: int, random_offsets: bool,
                 by_length: bool = False):
        self.train, self.max_len, self.batch_size, self.seed = train, max_len, batch_size, seed
        self.random_offsets, self.by_length = random_offsets, by_length
        self._order_rng: torch.Generator | None = None
        self._epoch1 = self._windows(1)
        self.windows_per_epoch = len(self._epoch1[0])

    def _windows(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, L] inputs and labels (0: no loss) for one epoch: the fixed tiling, or a seeded random shift."""
        if self.random_offsets:
            shift = np.random.default_rng([self.seed, epoch]).integers(0, self.max_len, len(self.train))
        else:
            shift = np.zeros(len(self.train), dtype=np.int64)
        return window_examples(*offset_windows(self.train, self.max_len, shift), self.max_len)

    @property
    def item_counts(self) -> np.ndarray:
        return np.bincount(self.train.items)

    @property
    def targets_per_window(self) -> float:
        return target_count(self.train) / max(self.windows_per_epoch, 1)

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._order_rng is None:   # created when training starts, after the caller seeds torch
            self._order_rng = torch.Generator().manual_seed(self.seed)
        inputs, labels = self._epoch1 if epoch == 1 or not self.random_offsets else self._windows(epoch)
        order = torch.randperm(len(inputs), generator=self._order_rng)
        for rows in batch_rows(inputs, order, self.batch_size, self.by_length,
                               lambda n: torch.randperm(n, generator=self._order_rng)):
            yield inputs[rows], labels[rows]


def _held_out_ndcg(valid: ValidationSet, device: torch.device) -> Callable[[torch.nn.Module], dict[str, float]]:
    def validate(model: torch.nn.Module) -> dict[str, float]:
        return evaluate_ranking(model, valid.histories, valid.targets, ks=(SELECTION_K,), device=device)

    return validate


@dataclass(frozen=True)
class FitCallbacks:
    """The caller's hooks into the training loop: per-epoch rows, progress lines within an epoch, per-step faults.

    ``progress`` receives each epoch's curve row as soon as the epoch ends; ``steps_progress``, every
    ``progress_every_s`` seconds within an epoch, the step, the steps expected, windows/s and the seconds
    left in the epoch; ``on_step(epoch, step)`` runs after each optimizer step (fault injection).
    """

    progress: Callable[[dict], None] | None = None
    steps_progress: Callable[[dict], None] | None = None
    progress_every_s: float = 30.0
    on_step: Callable[[int, int], None] | None = None


NO_CALLBACKS = FitCallbacks()


def fit(train: Sequences | StreamedWindows, model_config, settings: TrainSettings, *,
        valid: ValidationSet | Callable[[torch.nn.Module], dict[str, float]] | None = None,
        device: str | torch.device = "cpu", stop_after: int | None = None,
        callbacks: FitCallbacks = NO_CALLBACKS) -> FitResult:
    """Train a model from scratch, or continue one; with ``valid``, keep the epoch with the best validation NDCG@10.

    ``train`` is either sequences in memory (model indices) or a :class:`StreamedWindows` reading
    shard files; ``model_config`` is the config dataclass of a registered model type
    (``recsys.model.registry``), or a model of one (trained on in place from its weights: a refit that
    continues the selected model); the model must return a hidden state per position (``model(seq)`` [B, L, D]).

    Data-parallel when ``torch.distributed`` is initialised with more than one process (the
    processes that ``recsys.learning.distributed`` starts): each process trains on its own data with
    ``settings.batch_size`` divided among the processes, gradients are averaged (DDP), and an epoch
    ends for all when the first runs out of batches. A ``valid`` function must then return the same
    figures on every process (sum across them first).

    Reproducible: the same data, config and settings give the same weights on CPU (on CUDA, up to
    the nondeterminism of its kernels). The caller's global torch RNG state is left untouched.
    ``valid``: a held-out :class:`ValidationSet` (NDCG@10 of its targets), or a function that measures
    the model (in eval mode) by any protocol, e.g. several targets per user or a ranking restricted to
    a catalog; it must return ``SELECTION_METRIC`` (``ndcg@10``) among its metrics. ``callbacks``: what
    the caller hears from the loop (:class:`FitCallbacks`).

    Early stopping ends training ``settings.patience`` epochs after the best, or sooner once
    ``settings.patience_windows`` training windows (of all processes) have passed since it: the epoch
    is a poor clock across data sizes, short on a small log where a curve climbs for dozens of them,
    long on a large one whose curve is flat a few epochs past its best.

    ``stop_after`` ends training after that many epochs while the learning-rate schedule keeps its
    horizon of ``settings.epochs``: how a refit repeats the first epochs of a run that early stopping
    chose, step for step, on more data.
    """
    if stop_after is not None and not 1 <= stop_after <= settings.epochs:
        raise ValueError(f"stop_after must be in 1..{settings.epochs} (settings.epochs), got {stop_after}")
    device = torch.device(device)
    start: torch.nn.Module | None = None
    if isinstance(model_config, torch.nn.Module):
        start, model_config = model_config, model_config.config
    if isinstance(train, Sequences):
        _check_items(train.items, model_config.num_items, "train")
        if not (train.lengths >= 2).any():
            raise ValueError("no training sequence has two or more items: there is nothing to learn from")
        source = InMemoryWindows(train, max_len=model_config.max_len, batch_size=settings.batch_size,
                                 seed=settings.seed, random_offsets=settings.window_offsets == "random",
                                 by_length=settings.batching == "by_length")
    else:
        source = train
        if len(source.vocab) != model_config.num_items:
            raise ValueError(f"the streamed data's vocabulary has {len(source.vocab)} items, the model "
                             f"{model_config.num_items}")
    if isinstance(valid, ValidationSet):
        _check_items(np.asarray(valid.targets), model_config.num_items, "valid.targets", allow_empty=False)
        _check_items(valid.histories.items, model_config.num_items, "valid.histories")

    previous_threads = torch.get_num_threads()
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    try:
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(settings.seed)
            validate = _held_out_ndcg(valid, device) if isinstance(valid, ValidationSet) else valid
            return _fit(source, model_config if start is None else start, settings, validate, device, callbacks,
                        stop_after or settings.epochs)
    finally:
        torch.set_num_threads(previous_threads)


def _world() -> tuple[int, int]:
    """(rank, world size) of the data-parallel training this process is part of; (0, 1) alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or min/max) ``values`` over the processes of a data-parallel training; unchanged alone. The one
    place a training process adds its figures to the others' (the loop's counts, validation sums, users)."""
    import torch.distributed as dist

    if _world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def freed_memory_releaser() -> Callable[[], None]:
    """What hands the allocator's free pages back to the system after an epoch: glibc's ``malloc_trim(0)``
    (elsewhere, nothing). A step's largest tensors (the logits, ``T x N``, tens of MB) stay under glibc's
    mmap threshold once it has adapted, so they come from its heaps, which keep their free pages: between epochs
    and after training, a training process held about a gigabyte that nothing used (benchmarks/train_memory.py,
    docs/performance.md "Training's memory"). Trimming once an epoch costs milliseconds and changes no number."""
    import ctypes

    try:     # the process's own symbols, the C library's among them: no search for its file
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        trim = None
    if trim is None:     # not glibc (musl, macOS): their allocators give memory back themselves
        return lambda: None
    return lambda: trim(0) and None


def _fit(source, model_config, settings: TrainSettings,
         validate: Callable[[torch.nn.Module], dict[str, float]] | None, device: torch.device,
         loop: FitCallbacks, last_epoch: int) -> FitResult:
    rank, world = _world()
    autocast = _autocast(settings.precision, device)
    if isinstance(model_config, torch.nn.Module):     # continue it: trained in place
        model, model_config = model_config, model_config.config
    else:
        model = build_model(model_config)
    model = model.to(device)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        # every process starts from rank 0's weights (DDP broadcasts them); dropout differs per process
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        torch.manual_seed(settings.seed + 1000 * rank)
    optimizer = _optimizer(model, settings)
    # one horizon for every process: the smallest share of windows (an epoch ends when the first runs out)
    windows = int(all_reduce([float(source.windows_per_epoch)], "min")[0])
    steps_per_epoch = max(1, -(-windows // source.batch_size))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(settings, steps_per_epoch))
    counts = vocabulary_counts(source.item_counts, model_config.num_items)           # this process's data
    loss_of = training_loss(settings.loss, settings.negatives, counts, seed=settings.seed + 1000 * rank, device=device)
    # Batches by length hold few targets when short and many when long; weighing each step's mean by its share of
    # a typical batch's targets gives every target the weight it has in random batches (the same expected gradient)
    by_length = settings.batching == "by_length"
    typical_targets = source.batch_size * source.targets_per_window if by_length else 0.0
    curve: list[dict] = []
    release = freed_memory_releaser()
    best_score, best_epoch, best_metrics, best_state = -1.0, 0, {}, None
    windows_since_best = 0.0     # training windows (all processes') since the best epoch's validation

    for epoch in range(1, last_epoch + 1):
        started = time.perf_counter()
        net.train()
        loss_sum = torch.zeros((), device=device)
        targets_seen = 0
        step, windows_seen, last_report = 0, 0, started
        batches = iter(source.batches(epoch))
        while True:
            batch = next(batches, None)
            if world > 1 and all_reduce([float(batch is not None)], "min")[0] == 0.0:
                break                     # another process ran out: DDP needs every process in every step
            if batch is None:
                break
            x = batch[0].to(device, non_blocking=True)                           # [b, L]
            y = batch[1].to(device, non_blocking=True)                           # [b, L]
            if by_length:
                # [b, L'] the batch's longest window, rounded up to WIDTH_MULTIPLE: the same outputs
                x, y = drop_padding_columns(x, y, multiple=WIDTH_MULTIPLE)
            keep = y != 0                                                        # [b, L] (L' by length)
            with autocast:                                                       # bf16 products where chosen
                hidden = net(x)[keep]                                            # [T, D] fp32 (final LayerNorm)
                loss = loss_of(hidden, model.item_embeddings()[1:], y[keep] - 1) # padding row left out; autocast
                # runs the loss's cross-entropy in fp32 (logits cast up), whatever the precision
            step_loss = loss * (len(hidden) / typical_targets) if by_length else loss
            optimizer.zero_grad(set_to_none=True)
            step_loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += loss.detach() * len(hidden)
            targets_seen += len(hidden)
            step += 1
            windows_seen += len(x)
            if loop.on_step is not None:
                loop.on_step(epoch, step)
            now = time.perf_counter()
            if loop.steps_progress is not None and now - last_report >= loop.progress_every_s:
                last_report = now
                rate = windows_seen * world / (now - started)
                loop.steps_progress({"epoch": epoch, "epochs": last_epoch, "step": step, "steps": steps_per_epoch,
                                     "windows_per_s": rate,
                                     "epoch_seconds_left": max(0.0, (steps_per_epoch - step) * (now - started) / step)})
        release()
        loss_total, targets_total, windows_total = all_reduce([float(loss_sum), float(targets_seen),
                                                               float(windows_seen)])
        windows_since_best += windows_total
        row: dict = {"epoch": epoch, "train_loss": loss_total / max(targets_total, 1.0)}

        stop = False
        if validate is not None and (epoch % settings.eval_every == 0 or epoch == last_epoch):
            model.eval()
            with torch.no_grad():
                metrics = dict(validate(model))
            model.train()
            row.update(metrics)
            if metrics[SELECTION_METRIC] > best_score:
                best_score, best_epoch, best_metrics = metrics[SELECTION_METRIC], epoch, metrics
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                windows_since_best = 0.0
            stop = epoch - best_epoch >= settings.patience or (
                settings.patience_windows is not None and windows_since_best >= settings.patience_windows)
        row["seconds"] = time.perf_counter() - started
        curve.append(row)
        if loop.progress is not None:
            loop.progress(dict(row))
        if stop:
            break

    if best_state is not None:
        model.load_state_dict(best_state)
    else:
        best_epoch = curve[-1]["epoch"]
    return FitResult(model=model.eval(), curve=curve, best_epoch=best_epoch, best_metrics=best_metrics)


def lr_factor(settings: TrainSettings, steps_per_epoch: int) -> Callable[[int], float]:
    """The learning rate's multiplier at optimizer step ``s`` (0-based): a linear warm-up over
    ``warmup_epochs`` epochs of steps, then constant or a cosine to 0 at the end of ``epochs``."""
    total = settings.epochs * steps_per_epoch
    warmup = int(round(settings.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if settings.lr_decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
        return 1.0

    return factor


def _autocast(precision: str, device: torch.device) -> torch.autocast:
    """The forward pass's autocast: bf16 matrix products where ``precision`` resolves to bf16, else off.

    Weights, optimizer state and the softmax stay fp32 (autocast's own policy runs cross-entropy in fp32,
    casting the logits up, and the final LayerNorm's output is fp32); only the products run in bf16, which
    makes an epoch much faster on a CPU with native bf16, at the same validation curve (measured with
    benchmarks/train_speed.py: docs/performance.md, "Training speed on one machine"). Raises
    ValueError for bf16 on a device without native bf16 (emulated bf16 is slower than fp32).
    """
    bf16 = resolve_precision(precision, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def _optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW with decay on matrices and embeddings only, as in nanoGPT; betas as in SASRec.

    Fused (one kernel over all parameters) on CPU and CUDA: torch's default on the CPU is a Python
    loop over the tensors, so fused saves a little of every epoch (measured with benchmarks/train_speed.py:
    docs/performance.md, "Training speed on one machine").
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0].device.type in FUSED_ADAMW_DEVICES
    return torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.98), fused=fused or None)


def _check_items(items: np.ndarray, num_items: int, what: str, allow_empty: bool = True) -> None:
    if len(items) == 0:
        if allow_empty:
            return
        raise ValueError(f"{what} is empty")
    low, high = int(np.min(items)), int(np.max(items))
    if low < 1 or high > num_items:
        raise ValueError(f"{what} holds item indices {low}..{high}, but they must be in 1..{num_items} "
                         "(0 is padding; map external ids to 1..num_items first)")
