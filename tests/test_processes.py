"""Whether a recorded process still runs: the one answer the locks, the backend and the metastore server use."""
import os
import socket
import subprocess
import sys
import time

import psutil

from recsys.processes import free_port, process_alive, process_start_time, stop_process


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_running_process_is_alive_and_the_same_one_only_with_its_own_start_time():
    started = process_start_time()
    assert started is not None
    assert process_alive(os.getpid(), started)
    assert not process_alive(os.getpid(), started - 5)   # the pid reused by another program
    assert not process_alive(0) and not process_alive(-1)            # process groups, never one process


def test_an_exited_process_is_dead_whether_or_not_its_parent_has_reaped_it():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()                                                       # reaped: the pid is gone
    assert not process_alive(child.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:   # exited, not yet reaped (no wait())
        assert time.monotonic() < deadline, "the child did not exit within 60 s"
        time.sleep(0.05)
    assert not process_alive(zombie.pid)
    zombie.wait()


def test_stop_process_ends_a_running_process_and_says_when_there_was_none():
    child = _sleeper()
    try:
        assert process_alive(child.pid)
        assert stop_process(child.pid, wait_s=30) is True
        assert not process_alive(child.pid)
        assert child.wait(timeout=30) != 0
    finally:
        child.kill()
        child.wait()
    assert stop_process(child.pid) is False


def test_a_free_port_can_be_listened_on():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
