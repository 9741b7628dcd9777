"""One fit of a model on training shards: in this process, or data-parallel in ``train.processes`` processes.

``train.processes: 1`` (the default) trains in the driver's process, streaming the shards: on data
that fits a few minutes of one machine (MovieLens, the sample data) nothing is faster. With
``train.processes: N`` (N > 1) the fit runs in N processes started by Spark's own
``pyspark.ml.torch.distributor.TorchDistributor``: on the executors when the session has a cluster
master (a barrier stage, one task per process), on the driver's machine with a ``local[...]``
master. Each process reads its own shard files (``ShardFiles.for_rank``), gradients are averaged
with DistributedDataParallel (gloo on CPUs, NCCL on GPUs Spark assigns), validation sums are added
across processes, and process 0 returns the weights to the driver (the model is catalog-sized; the
data never comes back).

A process that dies mid-epoch (killed, out of memory) brings the others down with it (torchrun stops
the group, gloo raises on the lost peer) and the fit raises :class:`TrainingProcessFailed` with the
last lines the processes printed: the caller registers nothing.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from recsys.config import torchrun_place
from recsys.errors import TrainingProcessFailed

log = logging.getLogger(__name__)

KILL_FAULT = "kill_training_process"    # recsys.hooks: the last process SIGKILLs itself in epoch 1, step 2


@dataclass(frozen=True)
class FitJob:
    """Everything a training process needs, picklable: it travels to the processes TorchDistributor starts."""

    label: str                       # "[train 2024-03-11] select": the progress lines' prefix
    files: tuple[str, ...]           # every shard file; each process reads its share
    vocab_ids: np.ndarray            # the model's vocabulary (item ids, index i + 1)
    model_config: Any                # the model type's config dataclass
    settings: Any                    # recsys.model.training.TrainSettings
    hold_out_newest: bool            # the fit that chooses the epoch count (True) or the refit on everything (False)
    validate: bool                   # early stopping on the held-out newest items
    stop_after: int | None = None    # the refit's epoch count
    held_out_below: int | None = None  # the held-out users' bucket cut (recsys.model.stream.held_out_below); None: all
    init_state: dict | None = None   # start from these weights (a refit that continues the selected model, a warm night)
    validate_since_us: int | None = None  # validate only on held-out items first touched at or after this instant
                                     # (epoch us): a warm night's, which the holder it starts from never saw
    replay_since_us: int | None = None  # train only on users active at or after this instant (epoch us) and a
    replay_share: float = 1.0        # share of the others drawn by replay_salt (recsys.model.stream.Replay);
    replay_salt: int = 0             # None: every user
    device: str = "cpu"
    faults: tuple[str, ...] = ()
    progress_every_s: float = 30.0
    users_per_chunk: int = 4096
    shuffle_windows: int = 32768
    log_dir: str | None = None       # each process writes its lines to rank-<r>.log here (the driver reads them
                                     # back when a process fails: on a cluster its stdout is on another host)


    def to_plain(self) -> dict:
        """The job as plain values (no recsys class inside): what the bootstrap carries to processes that
        cannot import recsys until it has set their path (``recsys.learning.bootstrap``)."""
        from recsys.model.registry import MODEL_TYPES

        model_type = next(name for name, (config_cls, _) in MODEL_TYPES.items()
                          if type(self.model_config) is config_cls)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(model_config=(model_type, dataclasses.asdict(self.model_config)),
                      settings=dataclasses.asdict(self.settings))
        return fields

    @classmethod
    def from_plain(cls, fields: dict) -> "FitJob":
        from recsys.model.registry import MODEL_TYPES
        from recsys.model.training import TrainSettings

        model_type, model_fields = fields["model_config"]
        config_cls, _ = MODEL_TYPES[model_type]
        return cls(**{**fields, "model_config": config_cls(**model_fields),
                      "settings": TrainSettings(**fields["settings"])})


@dataclass
class FitOutput:
    """What process 0 returns: the best epoch's weights (on the CPU), the learning curve and the best epoch."""

    state: dict
    curve: list[dict]
    best_epoch: int
    best_metrics: dict = field(default_factory=dict)
    processes: int = 1
    users: int = 0                   # users an epoch trained on, over every process (a warm night: active + replayed)

    def to_plain(self) -> dict:
        """Every field, as the bootstrap returns it to the driver (``FitOutput(**plain)`` reads it back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def model(self, model_config: Any):
        from recsys.model.registry import build_model

        model = build_model(model_config)
        model.load_state_dict(self.state)
        return model.eval()


def run_fit(job: FitJob, on_epoch: Callable[[dict], None] | None = None) -> FitOutput:
    """Train as one process of ``WORLD_SIZE`` (torchrun's environment), or alone without one.

    Every process returns; only process 0's output is used (TorchDistributor returns rank 0's).
    """
    rank, world, local_rank = torchrun_place()
    journal = _Journal(job.log_dir, rank)
    previous = _raise_on_sigterm() if world > 1 else None
    try:
        output = _run_fit(job, on_epoch, world, rank, local_rank, journal)
    except BaseException as exc:
        journal.write(f"FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    journal.write("DONE")
    return output


class Terminated(Exception):
    """SIGTERM in a training process: torchrun's agent stops the others when one process fails."""


def _raise_on_sigterm():
    """SIGTERM raises :class:`Terminated`, so a process stopped by the launcher says so in its journal
    (``FAILED Terminated``) instead of reading as killed: when one process dies, the agent may stop the
    others before their own collective call notices (seen on a loaded machine). Returns the previous
    handler, or None where no handler can be installed (not the main thread)."""
    def terminated(signum, frame):
        raise Terminated("stopped by the launcher (SIGTERM): another training process failed, or the job was stopped")

    try:
        return signal.signal(signal.SIGTERM, terminated)
    except ValueError:
        return None


def _run_fit(job: FitJob, on_epoch, world: int, rank: int, local_rank: int, journal: "_Journal") -> FitOutput:
    import torch
    import torch.distributed as dist

    from recsys.model.metrics import SELECTION_K
    from recsys.model.stream import (Replay, ShardFiles, StreamedWindows, StreamSettings, held_out_chunks,
                                     ranking_sums)
    from recsys.model.training import FitCallbacks, all_reduce, fit
    from recsys.sequences import Vocabulary

    device = job.device
    if world > 1:
        if device.startswith("cuda"):
            device = f"cuda:{local_rank % max(1, torch.cuda.device_count())}"
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        files = ShardFiles(job.files).for_rank(rank, world)
        vocab = Vocabulary(job.vocab_ids)
        batch_size = max(1, job.settings.batch_size // world)
        source = StreamedWindows(files, vocab, StreamSettings(
            max_len=job.model_config.max_len, batch_size=batch_size, seed=job.settings.seed,
            hold_out_newest=job.hold_out_newest, random_offsets=job.settings.window_offsets == "random",
            held_out_below=job.held_out_below, rank=rank,
            users_per_chunk=job.users_per_chunk, shuffle_windows=max(job.shuffle_windows, batch_size),
            replay=None if job.replay_since_us is None else Replay(job.replay_since_us, job.replay_share,
                                                                    job.replay_salt),
            by_length=job.settings.batching == "by_length"))

        def validate(model) -> dict[str, float]:
            part = ranking_sums(model, vocab, held_out_chunks(files, held_out_below=job.held_out_below,
                                                              since_us=job.validate_since_us,
                                                              users_per_chunk=job.users_per_chunk),
                                ks=(SELECTION_K,), device=device)
            keys = (f"ndcg@{SELECTION_K}", f"hr@{SELECTION_K}", "mrr")   # the same on every process, known users or not
            if world > 1:
                values = all_reduce([part.sums.get(k, 0.0) for k in keys] + [float(part.known), float(part.total)])
                part.sums = dict(zip(keys, values[:len(keys)]))
                part.known, part.total = int(values[len(keys)]), int(values[len(keys) + 1])
            users = {"users": float(part.total)}   # the held-out users validated on (val_users in MLflow)
            if not part.known:   # no held-out item is in the vocabulary: nothing ranks, nothing is learned yet
                return {f"ndcg@{SELECTION_K}": 0.0, f"hr@{SELECTION_K}": 0.0, "mrr": 0.0, **users}
            return {**part.means_over_known(), **users}

        def epoch_done(row: dict) -> None:
            journal.write(f"epoch {row['epoch']}: train_loss={row['train_loss']:.4f}")
            if rank == 0:
                _print(f"{job.label} epoch {row['epoch']}: " + ", ".join(
                    f"{k}={v:.0f}" if k == "users" else f"{k}={v:.4f}"
                    for k, v in row.items() if k != "epoch" and isinstance(v, float)))
                if on_epoch is not None:
                    on_epoch(row)

        def steps(row: dict) -> None:
            journal.write(f"epoch {row['epoch']}: step {row['step']}")
            if rank == 0:
                _print(f"{job.label} epoch {row['epoch']}/{row['epochs']}: step {row['step']:,} of about "
                       f"{row['steps']:,}, {row['windows_per_s']:,.0f} windows/s, about "
                       f"{row['epoch_seconds_left']:.0f}s left in the epoch")

        def kill_mid_epoch(epoch: int, step: int) -> None:
            if epoch == 1 and step == 2:
                _print(f"{job.label} fault injection: training process {rank} of {world} kills itself")
                journal.write("fault injection: SIGKILL to itself")
                os.kill(os.getpid(), signal.SIGKILL)

        on_step = kill_mid_epoch if KILL_FAULT in job.faults and rank == world - 1 else None

        journal.write(f"started: process {rank} of {world}, files {', '.join(p.rsplit('/', 1)[-1] for p in files.paths)}")
        if rank == 0:
            replayed = ("" if job.replay_since_us is None else
                        f" (active since the start model's data, and {job.replay_share:.0%} of the others replayed)")
            _print(f"{job.label} {world} process(es), {len(files.paths)} of {len(job.files)} shard file(s) here, "
                   f"{source.windows_per_epoch:,} windows of {source.users_per_epoch:,} users{replayed} an epoch "
                   f"in this process, batches of {batch_size}")
        start = job.model_config
        if job.init_state is not None:
            from recsys.model.registry import build_model

            start = build_model(job.model_config)
            start.load_state_dict(job.init_state)
        result = fit(source, start, job.settings, device=device,
                     valid=validate if job.validate else None, stop_after=job.stop_after,
                     callbacks=FitCallbacks(progress=epoch_done, steps_progress=steps,
                                            progress_every_s=job.progress_every_s, on_step=on_step))
        users = int(all_reduce([float(source.users_per_epoch)])[0])   # every process's
        state = {k: v.detach().cpu().clone() for k, v in result.model.state_dict().items()}
        return FitOutput(state, result.curve, result.best_epoch, result.best_metrics, world, users)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _print(line: str) -> None:
    """Progress from a training process: the job's log in the driver's process; on stdout in a process
    TorchDistributor started (it streams their output to the driver)."""
    if torchrun_place()[1] == 1:
        log.info("%s", line)
    else:
        print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stdout, flush=True)


def fit_with_processes(spark, job: FitJob, processes: int, on_epoch: Callable[[dict], None] | None = None) -> FitOutput:
    """``run_fit`` in this process (``processes == 1``) or in ``processes`` processes via TorchDistributor:
    on the executors when the session's master is a cluster, on this machine with a local master."""
    if processes == 1:
        return run_fit(job, on_epoch)
    from pyspark.ml.torch.distributor import TorchDistributor

    local = _local_master(spark)
    use_gpu = job.device.startswith("cuda")
    log.info("%s training in %d processes with TorchDistributor (%s, %s)", job.label, processes,
             "on this machine" if local else "on the executors", "NCCL on GPUs" if use_gpu else "gloo on CPUs")
    from pyspark import cloudpickle

    from recsys.learning import bootstrap

    cloudpickle.register_pickle_by_value(bootstrap)   # unpickled where recsys is not importable yet
    recsys_home = str(Path(sys.modules["recsys"].__file__).resolve().parents[1])
    try:
        output = TorchDistributor(num_processes=processes, local_mode=local, use_gpu=use_gpu).run(
            bootstrap.run_fit_anywhere, [recsys_home], job.to_plain())
    except Exception as exc:
        raise TrainingProcessFailed(
            f"{job.label} a data-parallel training process failed ({processes} processes, "
            f"{'on this machine' if local else 'on the executors'}); nothing was registered, a rerun starts clean. "
            f"{_journals(job.log_dir, processes) or 'TorchDistributor: ' + _tail(exc)}") from None
    if not isinstance(output, dict) or "state" not in output:
        raise TrainingProcessFailed(f"{job.label} the training processes returned {type(output).__name__}, "
                                    "not the trained weights; nothing was registered")
    return FitOutput(**output)


class _Journal:
    """A training process's own lines in ``<log_dir>/rank-<r>.log``, flushed line by line: what the driver
    reads back to say which process failed and how (a killed process's file ends without DONE or FAILED)."""

    def __init__(self, log_dir: str | None, rank: int):
        self.path = None if log_dir is None else f"{log_dir.rstrip('/')}/rank-{rank}.log"
        self._stream = None

    def write(self, line: str) -> None:
        if self.path is None:
            return
        try:
            if self._stream is None:
                from recsys import fs as rfs

                fs, local = rfs.resolve(self.path)
                fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
                self._stream = fs.open_output_stream(local)
            self._stream.write(f"{time.strftime('%H:%M:%S')} {line}\n".encode())
            self._stream.flush()
            if line.startswith(("DONE", "FAILED")):
                self._stream.close()
                self._stream = None
        except OSError:   # the journal is for the error message; it never fails the training
            self.path = None


def _journals(log_dir: str | None, processes: int) -> str:
    """What each process's journal says about how it ended: one clause per process."""
    if log_dir is None:
        return ""
    from recsys import fs as rfs

    parts = []
    for rank in range(processes):
        try:
            fs, local = rfs.resolve(f"{log_dir.rstrip('/')}/rank-{rank}.log")
            lines = [ln.split(" ", 1)[-1] for ln in rfs.read_text(fs, local).splitlines() if ln.strip()]
        except (OSError, FileNotFoundError):
            lines = []
        if not lines:
            parts.append(f"process {rank}: never started (no line written)")
        elif lines[-1].startswith("FAILED"):
            parts.append(f"process {rank}: {lines[-1]}")
        elif lines[-1] == "DONE":
            parts.append(f"process {rank}: finished")
        else:
            parts.append(f"process {rank}: died without an error (killed, or out of memory?) after: {lines[-1]}")
    return "; ".join(parts)


def _local_master(spark) -> bool:
    try:
        master = spark.conf.get("spark.master")
    except Exception:   # Spark Connect may not expose it: its server runs the processes where it is
        return True
    return str(master).startswith("local")


def _tail(exc: BaseException, lines: int = 15) -> str:
    text = str(exc)
    marker = "included below:"
    if marker in text:
        text = text.split(marker, 1)[1]
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept)[-3000:] or type(exc).__name__
