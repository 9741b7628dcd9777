"""A test and game-day hook: hold the job at a named point, so it can be killed exactly there.

``RECSYS_PAUSE_AT=<point>`` makes the job print ``recsys-pause: <point> pid=<pid>`` on stderr when
it gets there, then wait (at most ``RECSYS_PAUSE_MAX_S`` seconds, default 600, then carry on;
a point reached on the driver's main thread also carries on at once on ``SIGUSR1``).
A test reads the job's stderr until the line appears and sends SIGKILL: the kill lands at a
known point without sleeping and hoping. Unset (the normal case), every call is a no-op.

Points, in the order a run reaches them:

- ``writing``: inside a scoring task on the workers, after its first rows went to the Parquet
  writer of the staging directory (other tasks keep writing): a kill in the middle of the write;
- ``staged``: the staged output is written, not yet validated;
- ``before_swap``: validated, ``_manifest.json`` written into staging, the partition not yet replaced;
- ``between_renames``: only with the two-rename publish (no ``renameat2``): the old partition is in
  ``_trash/``, the new one not yet in place;
- ``after_swap``: the new partition is in place, the old copy not yet deleted, the lock not released.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Iterator

from recsys.errors import ConfigError

PAUSE_ENV = "RECSYS_PAUSE_AT"
PAUSE_MAX_ENV = "RECSYS_PAUSE_MAX_S"
POINTS = ("writing", "staged", "before_swap", "between_renames", "after_swap")


def requested() -> str | None:
    """The point named in the environment (validated), or None."""
    point = os.environ.get(PAUSE_ENV, "").strip() or None
    if point is not None and point not in POINTS:
        raise ConfigError(f"{PAUSE_ENV}={point!r} is not a pause point; known: {', '.join(POINTS)}")
    return point


def pause_point(name: str) -> None:
    """Hold here if the environment asks for this point."""
    if os.environ.get(PAUSE_ENV, "").strip() == name:
        _hold(name)


def _hold(name: str) -> None:
    resume = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGUSR1, lambda *_: resume.set()) if on_main else None
    print(f"recsys-pause: {name} pid={os.getpid()}", file=sys.stderr, flush=True)
    try:
        resume.wait(float(os.environ.get(PAUSE_MAX_ENV, "600")))
    finally:
        if on_main:
            signal.signal(signal.SIGUSR1, previous)


def hold_first_task_while_writing(name: str = "writing") -> Callable:
    """A ``mapInArrow`` pass-through that holds partition 0's first attempt after its first batch.

    Added to the plan only when the pause is requested, so normal runs do not carry it.
    """

    def passthrough(batches: Iterator) -> Iterator:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        hold = ctx is not None and ctx.partitionId() == 0 and ctx.attemptNumber() == 0
        for batch in batches:
            yield batch
            if hold:
                _hold(name)
                hold = False
        if hold:   # an empty partition: hold anyway, the other tasks are writing
            _hold(name)

    return passthrough
