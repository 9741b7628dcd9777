"""The CPU cores one test process may use: all of them, or its share when pytest-xdist runs several.

``make test`` runs two workers on the 2-core CI machine. torch's default (and ``num_threads=2`` in a
test) then puts four OpenMP threads on two cores, and each parallel region waits for a thread that is
not running: the same training took about twice the CPU and five times as long in a worker (measured
on the 2-core machine when this module was written). So every test process runs torch on its share (conftest sets it at start-up; tests
that choose a thread count pass ``SHARE``), and the processes it starts inherit ``OMP_NUM_THREADS``.
A single process (``-p no:xdist``, ``TEST_WORKERS=1``) keeps every core.
"""
from __future__ import annotations

import os


def share() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, (os.cpu_count() or 1) // workers)


SHARE = share()


def apply() -> None:
    """torch in this process, and OpenMP in the processes it starts, on this process's share of the cores."""
    if SHARE >= (os.cpu_count() or 1):
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(SHARE))
    import torch

    torch.set_num_threads(SHARE)
