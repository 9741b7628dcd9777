"""Test and game-day hooks: pause points and injected faults, as one explicit value, off by default.

A :class:`Hooks` value is built once at the entry point (``recsys.config.load_hooks`` reads the
environment variables below; nothing else does) and passed down to the stages that honour it.
``Hooks()`` does nothing, which is what every production run and every library caller gets.
The reference is docs/faults.md.

Pause points (``RECSYS_PAUSE_AT=<point>``): the job prints ``recsys-pause: <point> pid=<pid>`` on
stderr when it gets there, then waits (at most ``RECSYS_PAUSE_MAX_S`` seconds, default 600, then
carries on; a point reached on the driver's main thread also carries on at once on ``SIGUSR1``, so a
test can act while the job is held, e.g. stop a server, and then let it go on). A test reads the job's stderr until the line appears and sends SIGKILL: the kill lands
at a known point without sleeping and hoping. Points, in the order a run reaches them:

- ``fitting``: training (``recsys train``, and ``recsys night``'s), its shards written and its MLflow run open,
  before the first fit: a training process that dies, as one the kernel kills for its memory would;
- ``writing``: inside a scoring task on the workers, after its first rows went to the Parquet
  writer of the staging directory (other tasks keep writing): a kill in the middle of the write;
- ``staged``: the staged output is written, not yet validated;
- ``before_swap``: validated, ``_manifest.json`` written into the run directory, nothing switched yet;
- ``after_table``: only with ``output.table``: the table's partition points at the new run (the commit),
  the pointer and the path view not yet;
- ``after_pointer``: the pointer names the new run (the commit without a table), the path view not yet;
- ``between_renames``: only with the two-rename swap of the path view (no ``renameat2``): the old view
  is in ``_trash/``, the new one not yet in place;
- ``after_swap``: the new path view is in place (on object stores: copied, ``_SUCCESS`` not yet
  written), the old copy not yet deleted, the lock not released;
- ``retention``: after retention removed its first run directory or dropped its first partition.

``recsys export`` (docs/export.md) has two of its own:

- ``export_writing``: inside the export task of the first data file, after its first batch of users went
  to Redis (the other tasks keep writing): a kill, or Redis stopped, in the middle of writing a version;
- ``before_switch``: every key of the new version is written and counted, the pointer not yet moved.

Faults (``RECSYS_FAULT_INJECTION=<name>[,<name>]``), run inside the scoring tasks:

- ``fail_first_attempt``: every scoring task fails on its first attempt, so Spark retries it;
- ``kill_worker_first_attempt``: the Python worker exits abruptly on a task's first attempt;
- ``kill_worker_every_attempt``: the Python worker exits abruptly on every attempt (a worker that a memory limit
  kills each time), so Spark gives up on the task and the job fails;
- ``kill_training_process`` (``recsys train`` with ``train.processes`` > 1): the last data-parallel
  training process SIGKILLs itself in the second step of the first epoch.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Mapping

from recsys.errors import ConfigError

PAUSE_ENV = "RECSYS_PAUSE_AT"
PAUSE_MAX_ENV = "RECSYS_PAUSE_MAX_S"
FAULT_ENV = "RECSYS_FAULT_INJECTION"
POINTS = ("fitting", "writing", "staged", "before_swap", "after_table", "after_pointer", "between_renames",
          "after_swap", "retention", "export_writing", "before_switch")
FAULTS = ("fail_first_attempt", "kill_worker_first_attempt", "kill_worker_every_attempt", "kill_training_process")


@dataclass(frozen=True)
class Hooks:
    """Which pause point to hold at (if any), for how long, and which faults to inject (if any).

    Small and picklable: the scoring tasks receive it inside their closure, so workers on a
    cluster see the same hooks as the driver without reading their own environment.
    """

    pause_at: str | None = None
    pause_max_s: float = 600.0
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.pause_at is not None and self.pause_at not in POINTS:
            raise ConfigError(f"{PAUSE_ENV}={self.pause_at!r} is not a pause point; known: {', '.join(POINTS)}")
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ConfigError(f"{FAULT_ENV} holds unknown faults {unknown}; known: {sorted(FAULTS)}")
        if not self.pause_max_s >= 0:
            raise ConfigError(f"{PAUSE_MAX_ENV}={self.pause_max_s!r} must be a number of seconds >= 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Hooks":
        """The hooks the variables in ``environ`` ask for (``recsys.config.load_hooks`` passes ``os.environ``)."""
        raw_max = environ.get(PAUSE_MAX_ENV, "").strip() or "600"
        try:
            pause_max_s = float(raw_max)
        except ValueError:
            raise ConfigError(f"{PAUSE_MAX_ENV}={raw_max!r} must be a number of seconds") from None
        return cls(
            pause_at=environ.get(PAUSE_ENV, "").strip() or None,
            pause_max_s=pause_max_s,
            faults=tuple(f.strip() for f in environ.get(FAULT_ENV, "").split(",") if f.strip()),
        )

    def pause(self, point: str) -> None:
        """Hold here if these hooks ask for ``point``; a no-op otherwise."""
        if point == self.pause_at:
            hold(point, self.pause_max_s)

    def holds_while_writing(self) -> bool:
        """Whether a scoring task should hold at ``writing`` (the Spark glue adds the pass-through that does)."""
        return self.pause_at == "writing"

    def inject_faults(self, attempt: int) -> None:
        """Called by each scoring task, on the worker, with its attempt number."""
        if attempt == 0 and "fail_first_attempt" in self.faults:
            raise RuntimeError(f"injected fault: fail_first_attempt ({FAULT_ENV}); Spark should retry this task")
        if (attempt == 0 and "kill_worker_first_attempt" in self.faults) or "kill_worker_every_attempt" in self.faults:
            os._exit(137)


NO_HOOKS = Hooks()


def hold(name: str, max_s: float) -> None:
    """Say where the job is on stderr, then wait up to ``max_s`` seconds (a test kills it meanwhile).

    Held on the driver's main thread, ``SIGUSR1`` ends the wait at once: a test can act while the job
    is held (stop a server, say) and then let it carry on.
    """
    resume = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGUSR1, lambda *_: resume.set()) if on_main else None
    print(f"recsys-pause: {name} pid={os.getpid()}", file=sys.stderr, flush=True)
    try:
        resume.wait(max_s)
    finally:
        if on_main:
            signal.signal(signal.SIGUSR1, previous)
