"""Apache Airflow in a virtualenv of its own, cached across test runs and fresh clones of this machine.

Airflow pins much of what the job's own environment also uses (SQLAlchemy, pydantic, ...), so it
never goes into the project's .venv. The virtualenv is built once, from PyPI only, with the pins
of ``conf/schedulers/airflow-constraints-<version>.txt`` (Airflow's own constraints files live on
GitHub), under ``$RECSYS_AIRFLOW_CACHE`` (default ``~/.cache/recsys-airflow``), keyed by the
version and the constraints' digest. A cold install took 2 min 41 s here on a busy 2-core machine;
it is bounded by ``INSTALL_TIMEOUT_S`` and serialised by a file lock, so concurrent test runs
build it once. A half-built environment is never used: it counts only once a stamp file is written
after pip succeeded.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AIRFLOW_VERSION = "3.3.2"
CONSTRAINTS = REPO / "conf" / "schedulers" / f"airflow-constraints-{AIRFLOW_VERSION}.txt"
INSTALL_TIMEOUT_S = 900


def cache_root() -> Path:
    return Path(os.environ.get("RECSYS_AIRFLOW_CACHE") or Path.home() / ".cache" / "recsys-airflow")


def ensure_airflow() -> Path:
    """The ``airflow`` executable of the cached virtualenv, installing it first if needed."""
    digest = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()[:12]
    root = cache_root()
    target = root / f"{AIRFLOW_VERSION}-{digest}"
    airflow, done = target / "bin" / "airflow", target / ".installed"
    if done.is_file():
        return airflow
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # another run may be building it right now
        if done.is_file():
            return airflow
        shutil.rmtree(target, ignore_errors=True)  # a build that was killed half-way
        subprocess.run([_base_python(), "-m", "venv", str(target)], check=True, timeout=120)
        subprocess.run([str(target / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", "-c", str(CONSTRAINTS), f"apache-airflow=={AIRFLOW_VERSION}"],
                       check=True, timeout=INSTALL_TIMEOUT_S)
        done.write_text(f"apache-airflow=={AIRFLOW_VERSION}\n")
    return airflow


def _base_python() -> str:
    """The interpreter the project's venv was made from (a venv of a venv would inherit nothing useful)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def airflow_env(home: Path, dags: Path, **variables: str) -> dict[str, str]:
    """Environment for an isolated Airflow: its own home and sqlite database, no examples, loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://127.0.0.1:8080/execution/",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "NO_PROXY": "127.0.0.1,localhost",
    })
    env.update({f"AIRFLOW_VAR_{k.upper()}": v for k, v in variables.items()})
    return env
