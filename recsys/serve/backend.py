"""``recsys backend start|stop|status``: a Spark Connect server configured like the nightly job.

The server is the one that ships in the pyspark package (``sbin/start-connect-server.sh``), bound
to loopback on ``serve.backend_port`` (0: a free port), with the job's Spark settings
(``conf/spark-defaults.conf`` when present, then ``spark.conf``), ``spark.pyspark.python`` set to
this interpreter (which has ``recsys`` installed, so its Python workers can import it) and the
FAIR scheduler, so the frontend's parallel jobs share the cores instead of queueing behind each
other.

Its address and the session id the frontend uses are written to ``<serve.backend_dir>/backend.json``.
A frontend (and a second one, or a restarted one) that connects with that session id finds the
same Python workers, so the model cache stays warm across frontend restarts.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from recsys.config import Config
from recsys.errors import ConfigError, RecsysError
from recsys.fs import write_local_atomic
from recsys.processes import free_port, process_alive, stop_process
from recsys.spark.session import merged_settings, session_settings, store_settings

log = logging.getLogger(__name__)

STATE_FILE = "backend.json"
IDENT = "recsys"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
_FAIR_POOLS = """<?xml version="1.0"?>
<!-- written by recsys backend start: concurrent on-demand jobs share the cores fairly -->
<allocations>
  <pool name="default"><schedulingMode>FAIR</schedulingMode><weight>1</weight><minShare>0</minShare></pool>
</allocations>
"""


class BackendError(RecsysError):
    """The backend could not be started, found or stopped."""


@dataclass(frozen=True)
class BackendState:
    remote: str          # sc://127.0.0.1:PORT
    session_id: str      # the Connect session the frontend joins
    pid: int
    port: int
    log_dir: str
    started_at: str

    @property
    def url(self) -> str:
        """Connection string with the session id: every client joining it shares the warm workers."""
        return f"{self.remote}/;session_id={self.session_id}"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def read_state(backend_dir: str | Path) -> BackendState | None:
    path = Path(backend_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        return BackendState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise BackendError(f"{path} is not a backend state file ({exc}); remove it and run `recsys backend start`")


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _env(backend_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_PID_DIR": str(backend_dir),
        "SPARK_LOG_DIR": str(backend_dir / "logs"),
        "SPARK_IDENT_STRING": IDENT,
        "PYSPARK_PYTHON": sys.executable,
    }


def _pid_file(backend_dir: Path) -> Path:
    return backend_dir / f"spark-{IDENT}-{SERVER_CLASS}-1.pid"


def start(cfg: Config, *, properties_file: str | None = None, wait_s: float = 300.0) -> BackendState:
    """Start the server, wait until it accepts connections, write its state; refuse a second one."""
    backend_dir = Path(cfg.serve.backend_dir)
    backend_dir.mkdir(parents=True, exist_ok=True)
    current = read_state(backend_dir)
    if current is not None and process_alive(current.pid):
        raise BackendError(f"a backend is already running at {current.remote} (pid {current.pid}); "
                           f"`recsys backend stop` first")
    port = cfg.serve.backend_port or free_port()
    pools = backend_dir / "fairscheduler.xml"
    pools.write_text(_FAIR_POOLS)
    args = [str(spark_home() / "sbin" / "start-connect-server.sh"), "--master", cfg.spark.master]
    if properties_file is None and Path("conf/spark-defaults.conf").is_file():
        properties_file = "conf/spark-defaults.conf"
    if properties_file is not None:
        if not Path(properties_file).is_file():
            raise ConfigError(f"Spark properties file {properties_file!r} does not exist")
        args += ["--properties-file", str(Path(properties_file).resolve())]
    conf = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.pyspark.driver.python": sys.executable,
        "spark.python.worker.reuse": "true",
        "spark.scheduler.mode": "FAIR",
        "spark.scheduler.allocation.file": str(pools),
        # the job's own settings (scoring.arrow_batch_size included), the stores' (metastore of output.table,
        # S3A), the user's spark.conf last
        **merged_settings(store_settings(cfg.output, cfg.storage), session_settings(cfg.spark, cfg.scoring.arrow_batch_size)),
    }
    for key, value in conf.items():
        args += ["--conf", f"{key}={value}"]
    pid_file = _pid_file(backend_dir)
    pid_file.unlink(missing_ok=True)
    # The server runs in its own directory: what Spark writes relative to its working directory
    # (spark-warehouse/, derby.log, metastore_db/) belongs with the backend, not wherever
    # `recsys backend start` was typed (a checkout, whose state is the user's).
    done = subprocess.run(args, env=_env(backend_dir), cwd=backend_dir, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise BackendError(f"start-connect-server.sh failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    deadline = time.monotonic() + wait_s
    pid = None
    while time.monotonic() < deadline:
        if pid is None and pid_file.is_file() and pid_file.read_text().strip():
            pid = int(pid_file.read_text().strip())
        if pid is not None and not process_alive(pid):
            raise BackendError(f"the Spark Connect server exited while starting; see {_log_tail(backend_dir)}")
        if pid is not None and port_open(port):
            break
        time.sleep(0.2)   # polling a condition (the port) with a deadline
    else:
        if pid is not None:
            stop_process(pid)
        raise BackendError(f"the Spark Connect server did not listen on port {port} within {wait_s:.0f}s; "
                           f"see {_log_tail(backend_dir)}")
    state = BackendState(remote=f"sc://127.0.0.1:{port}", session_id=str(uuid.uuid4()), pid=pid, port=port,
                         log_dir=str(backend_dir / "logs"),
                         started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_local_atomic(backend_dir / STATE_FILE, json.dumps(asdict(state), indent=2))
    return state


def stop(cfg: Config, wait_s: float = 60.0) -> BackendState | None:
    """Stop the server named in the state file (TERM, then KILL after ``wait_s``); None if none ran."""
    backend_dir = Path(cfg.serve.backend_dir)
    state = read_state(backend_dir)
    if state is None:
        return None
    stop_process(state.pid, wait_s)
    (backend_dir / STATE_FILE).unlink(missing_ok=True)
    _pid_file(backend_dir).unlink(missing_ok=True)
    return state


@dataclass(frozen=True)
class BackendStatus:
    state: BackendState | None
    running: bool
    listening: bool

    def describe(self) -> str:
        if self.state is None:
            return "no backend: run `recsys backend start`"
        s = self.state
        health = "running" if self.running and self.listening else ("not listening" if self.running else "not running")
        return (f"backend {health}: {s.remote} pid {s.pid} session {s.session_id} since {s.started_at}; "
                f"logs {s.log_dir}")


def status(cfg: Config) -> BackendStatus:
    state = read_state(cfg.serve.backend_dir)
    if state is None:
        return BackendStatus(None, False, False)
    running = process_alive(state.pid)
    return BackendStatus(state, running, running and port_open(state.port))


def _log_tail(backend_dir: Path) -> str:
    logs = sorted((backend_dir / "logs").glob("*.out"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return f"the logs under {backend_dir / 'logs'}"
    lines = logs[-1].read_text(errors="replace").strip().splitlines()[-15:]
    return f"{logs[-1]}:\n" + "\n".join(lines)
