"""A real Spark standalone cluster on loopback whose workers cannot see the driver's files.

Master and Workers come from the pip package's ``spark-class``. Each Worker (and so each executor
and Python worker it starts) runs in its own mount namespace (``unshare -m``) where the driver's
checkout, its virtualenv and its private scratch are hidden under empty tmpfs mounts, and chosen
directories are mounted read-only. The Spark distribution the Workers run is a hard-linked copy of
the pip package's ``bin``, ``sbin`` and ``jars`` outside the hidden directories (the pip package lives
inside the hidden virtualenv). Everything the Workers need from the driver (the recsys sources, the
packed environment, the model files) therefore has to travel through Spark.

Used by ``tests/test_cluster.py`` and ``benchmarks/cluster_vs_local.py``; always stop it
(:meth:`Cluster.stop`, or the context manager) even when a test fails.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import jvmkit
from recsys.processes import free_port

CHECKOUT = Path(__file__).resolve().parents[1]


def namespaces_work() -> bool:
    """``unshare -m`` with a tmpfs mount: what the Workers' isolation needs (root, or a user namespace)."""
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                               "mount -t tmpfs none /mnt && umount /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def spark_distribution(cache_root: Path) -> Path:
    """A copy of the pip pyspark's bin/, sbin/ and jars/ (hard links where possible), cached per version."""
    import pyspark

    source = Path(pyspark.__file__).parent
    target = Path(cache_root) / f"recsys-spark-dist-{pyspark.__version__}"
    if (target / ".complete").is_file():
        return target
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("bin", "sbin", "jars"):
        done = subprocess.run(["cp", "-al", str(source / name), str(tmp / name)], capture_output=True)
        if done.returncode != 0:   # another filesystem: copy
            shutil.rmtree(tmp / name, ignore_errors=True)
            shutil.copytree(source / name, tmp / name, symlinks=True)
    (tmp / ".complete").write_text(pyspark.__version__)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _outermost(paths: list[Path]) -> list[Path]:
    resolved = sorted({Path(p).resolve() for p in paths}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in resolved:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return kept


@dataclass
class Worker:
    proc: subprocess.Popen
    work_dir: Path
    log: Path
    killed: bool = False

    def executor_logs(self) -> list[Path]:
        return sorted(self.work_dir.glob("app-*/*/stderr"))

    def can_read(self, path: Path) -> bool:
        """Whether ``path`` can be read in this Worker's mount namespace, which its executors and their
        Python workers inherit: looked up through ``/proc/PID/root``, the namespace's view of the
        filesystem, so no Spark application has to run to find out. A directory counts as readable when
        it lists anything (the hidden ones are empty tmpfs mounts)."""
        seen = Path(f"/proc/{self.proc.pid}/root") / Path(path).relative_to("/")
        try:
            if seen.is_dir():
                return bool(os.listdir(seen))
            with open(seen, "rb") as f:
                f.read(1)
            return True
        except OSError:
            return False


@dataclass
class Cluster:
    url: str
    ui_port: int
    master: subprocess.Popen
    workers: list[Worker] = field(default_factory=list)
    root: Path | None = None

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")
        except OSError:
            return 0

    def wait_for_workers(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_workers() < n:
            for w in self.workers:
                if w.proc.poll() is not None:
                    raise RuntimeError(f"a Worker exited with {w.proc.returncode}: {w.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} workers did not register with {self.url} within {timeout:.0f}s")
            time.sleep(0.5)

    def kill_worker(self, worker: Worker) -> None:
        """SIGKILL the Worker with its executor and Python workers: a host lost mid-task."""
        killpg(worker.proc, signal.SIGKILL)
        worker.proc.wait(timeout=60)
        worker.killed = True

    def stop(self) -> None:
        for proc in [w.proc for w in self.workers] + [self.master]:
            killpg(proc, signal.SIGTERM)
        for proc in [w.proc for w in self.workers] + [self.master]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                killpg(proc, signal.SIGKILL)
                proc.wait(timeout=30)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def killpg(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group ``proc`` leads (started with ``start_new_session``); gone already is fine."""
    try:
        os.killpg(proc.pid, sig)     # each daemon leads its own process group (start_new_session)
    except ProcessLookupError:
        pass


def _clean_env(spark_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_", "SPARK_", "RECSYS_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SPARK_HOME=str(spark_home), SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1",
               SPARK_DAEMON_JAVA_OPTS=jvmkit.C1_ONLY)   # Master and Workers: C1 only, as every test JVM (tests/jvmkit.py)
    return env


def start(root: Path, *, hidden: list[Path], read_only: list[Path] = (), workers: int = 2, cores: int = 1,
          memory: str = "2g", fake_gpus: bool = False) -> Cluster:
    """Start a Master and ``workers`` Workers under ``root``; the Workers cannot see ``hidden``.

    ``fake_gpus``: Worker i offers one GPU with address ``i`` to Spark's resource scheduling (its
    discovery script just names it), so an application that asks for GPUs gets real assignments
    (``TaskContext.resources()``) on a machine without one. The caller must call :meth:`Cluster.stop`
    (a ``with`` block does) whatever happens.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    spark_home = spark_distribution(root.parent if root.parent != root else root)
    env = _clean_env(spark_home)
    class_ = str(spark_home / "bin" / "spark-class")
    port, ui = free_port(), free_port()
    master_log = root / "master.log"
    master = subprocess.Popen([class_, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)],
                              cwd=root, env=env, stdout=master_log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    cluster = Cluster(url=f"spark://127.0.0.1:{port}", ui_port=ui, master=master, root=root)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                cluster.state()
                break
            except OSError:
                if master.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Master did not start: {master_log.read_text()[-3000:]}") from None
                time.sleep(0.3)
        masks = [f"mount -t tmpfs -o size=1m,mode=0755 recsys-hidden {shlex.quote(str(p))}"
                 for p in _outermost(hidden)]
        masks += [f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && "
                  f"mount -o remount,bind,ro {shlex.quote(str(p))}" for p in read_only]
        for i in range(workers):
            work = root / f"worker-{i}"
            work.mkdir(exist_ok=True)
            worker_env = dict(env)
            if fake_gpus:
                script = work / "gpus.sh"
                script.write_text(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [\"{i}\"]}}'\n")
                script.chmod(0o755)
                worker_env["SPARK_WORKER_OPTS"] = (f"-Dspark.worker.resource.gpu.amount=1 "
                                                   f"-Dspark.worker.resource.gpu.discoveryScript={script}")
            launch = " && ".join(masks + [
                f"exec {shlex.quote(class_)} org.apache.spark.deploy.worker.Worker --host 127.0.0.1 "
                f"--webui-port {free_port()} --cores {cores} --memory {memory} --work-dir {shlex.quote(str(work))} "
                f"{cluster.url}"])
            log = work / "worker.log"
            proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "--", "sh", "-c", launch],
                                    cwd=work, env=worker_env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            cluster.workers.append(Worker(proc, work, log))
        cluster.wait_for_workers(workers)
    except BaseException:
        cluster.stop()
        raise
    return cluster
