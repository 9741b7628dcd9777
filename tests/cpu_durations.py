"""``--cpu-durations=N``: the N tests that cost the most CPU, next to their wall time.

Wall time on a shared 2-core machine measures the neighbours as much as the test (pytest's own
``--durations`` doubled between two runs of the same tree here). The CPU seconds a test's process
tree spends do not depend on the load: this process, the Spark JVM and Python workers it started,
and any subprocess (spark-submit, the CLI, a server) while it runs or after it was reaped. A process
that a test starts and leaves to someone else to reap (a daemon) is not counted.

Each phase (setup, call, teardown) is measured apart, as ``--durations`` does, so a module fixture's
cost shows on the test that set it up. Under pytest-xdist each worker measures its own tests and the
figures travel to the controller in the reports (``user_properties``).
"""
from __future__ import annotations

import time

import psutil
import pytest

KEY = "cpu_seconds"


def add_option(parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that took the most CPU seconds (their process tree's), with wall seconds")


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, the children it reaped, and every live descendant (and what they reaped)."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:4])
        except psutil.Error:   # ended while we looked: counted by its parent once reaped
            pass
    return total


class Recorder:
    """Measures every phase where the tests run (also an xdist worker) and tabulates where the reports end up."""

    def __init__(self, count: int):
        self.count = count
        self.rows: list[tuple[float, float, str, str]] = []   # cpu, wall, phase, nodeid

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        started = getattr(item, "_cpu_started", None)
        if started is not None:
            report = outcome.get_result()
            report.user_properties.append((KEY, (tree_cpu_seconds() - started[0], time.monotonic() - started[1])))

    def _start(self, item) -> None:
        item._cpu_started = (tree_cpu_seconds(), time.monotonic())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        self._start(item)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self._start(item)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        self._start(item)
        yield

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == KEY:
                self.rows.append((value[0], value[1], report.when, report.nodeid))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        rows = sorted(self.rows, reverse=True)
        terminalreporter.write_sep("=", f"slowest {min(self.count, len(rows))} by CPU (process tree)")
        for cpu, wall, when, nodeid in rows[:self.count]:
            terminalreporter.write_line(f"{cpu:8.2f}s cpu {wall:8.2f}s wall  {when:<8} {nodeid}")
        terminalreporter.write_line(f"all phases: {sum(r[0] for r in rows):.0f} CPU seconds, "
                                    f"{sum(r[1] for r in rows):.0f} wall seconds summed over the test processes")


def configure(config) -> None:
    count = config.getoption("--cpu-durations")
    if count:
        config.pluginmanager.register(Recorder(count), "cpu-durations")
