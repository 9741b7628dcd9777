"""Local processes and ports: whether a process still runs, stopping one, a free port.

The one answer to "is this process alive" for everything that records a pid and later acts on it: the
per-date lock and the export lock (may a dead holder's lock be taken over?), the Spark Connect backend
and the Derby metastore server (is the recorded server still running, stop it), and the tests' services.
A pid alone is not enough: a process that has exited but is not yet reaped (a zombie) still has its pid,
and after a reboot or a long time another program may have the same pid; :func:`process_alive` answers
for both.
"""
from __future__ import annotations

import os
import signal
import socket
import time

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, on ``host`` (the system picks it).

    Another process may take it before the caller binds it: a server started on it must fail clearly
    when the port is taken, never wait forever.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process ``pid`` runs on this host: it exists and is not a zombie and, given ``started``
    (its :func:`process_start_time`, recorded while it ran), it is still that process and not another
    that reuses the pid. Another user's process counts as alive: it exists, its details are not ours to read.
    """
    if pid <= 0:   # 0 and negative pids name process groups to os.kill, never one process
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def process_start_time(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, as :func:`process_alive` compares it; None if unknown."""
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).create_time()
    except (psutil.Error, OSError):
        return None


def stop_process(pid: int, wait_s: float = 60.0) -> bool:
    """SIGTERM, then SIGKILL if it still runs after ``wait_s``; False if there was no such process.

    Returns once the process has exited (a zombie left for its parent to reap counts as exited).
    """
    if not process_alive(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and process_alive(pid):
        time.sleep(0.1)   # polling the process's state with a deadline
    if process_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True
