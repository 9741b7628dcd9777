"""The Hive metastore of the sessions recsys starts: its Spark settings, and a Derby network server for it.

Three set-ups (``output.metastore``, docs/configuration.md):

- **embedded Derby** (default, nothing set): the metastore database lives in ``dir/metastore_db``, its
  log in ``dir/derby.log``, the warehouse in ``dir/warehouse``: never in the working directory. Embedded
  Derby admits one process at a time, so the nightly job, the Connect backend and a notebook cannot
  share it: a second process fails to open it (one line, exit 1, naming this);
- **a metastore database as a service** (``url``, ``jars``): a JDBC URL every process connects to, e.g.
  the Derby network server ``recsys metastore start`` runs on loopback (Debian's ``libderby-java``
  server, ``libderbyclient-java`` client), or Postgres (``jdbc:postgresql://...``, ``libpostgresql-jdbc-java``).
  When ``url`` is unset and ``recsys metastore start`` runs on ``dir``, that server is used;
- **a Hive metastore service** (``uris``: ``thrift://host:9083``), what production uses (it owns the
  database and its credentials; AWS Glue through its client factory: docs/cluster.md).

The settings are static (read when the session starts): :func:`metastore_settings` gives them to
:mod:`recsys.spark.session` for local sessions and the backend; ``spark-submit.sh`` asks
:func:`submit_arguments` for the driver class path a JDBC driver needs (the JVM is already running
when the job's Python code starts).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from recsys.config import MetastoreConfig
from recsys.processes import free_port, stop_process
from recsys.redaction import redact_uri

# Debian packages (apt-get install libderby-java libderbyclient-java); no Maven is needed.
DERBY_SERVER_JARS = ("/usr/share/java/derby.jar", "/usr/share/java/derbynet.jar")
DERBY_CLIENT_JAR = "/usr/share/java/derbyclient.jar"
SERVER_FILE = "server.json"
JDBC_DRIVERS = {"jdbc:derby://": "org.apache.derby.jdbc.ClientDriver", "jdbc:derby:": "org.apache.derby.jdbc.EmbeddedDriver",
                "jdbc:postgresql:": "org.postgresql.Driver", "jdbc:mysql:": "com.mysql.cj.jdbc.Driver",
                "jdbc:mariadb:": "org.mariadb.jdbc.Driver"}


@dataclass(frozen=True)
class Metastore:
    """How this process reaches the metastore: a JDBC URL (and its jars) or thrift URIs."""

    dir: Path
    url: str | None
    jars: tuple[str, ...]
    uris: str | None

    @property
    def embedded(self) -> bool:
        return self.uris is None and (self.url is None or (self.url.startswith("jdbc:derby:") and
                                                           not self.url.startswith("jdbc:derby://")))

    def describe(self) -> str:
        if self.uris:
            return f"the Hive metastore service {redact_uri(self.uris)}"
        if self.embedded:
            return f"embedded Derby in {self.dir / 'metastore_db'}"
        return f"the metastore database {redact_uri(self.url or '')}"

    def hint(self) -> str:
        """What to do when it cannot be opened, for the error line."""
        if self.embedded:
            return (f"; the metastore is {self.describe()}, which one process at a time may open: if the Connect "
                    f"backend or another job holds it, run `recsys metastore start` (a Derby network server on the "
                    f"same directory) or set output.metastore.url/uris (docs/configuration.md)")
        return f"; the metastore is {self.describe()}"


def resolve(cfg: MetastoreConfig) -> Metastore:
    """The metastore the settings name; with nothing set, a running ``recsys metastore`` server on ``dir`` if any."""
    directory = Path(cfg.dir)
    if cfg.url or cfg.uris:
        return Metastore(directory, cfg.url, tuple(cfg.jars), cfg.uris)
    server = running_server(directory)
    if server is not None:
        return Metastore(directory, server["url"], (DERBY_CLIENT_JAR,), None)
    return Metastore(directory, None, (), None)


def metastore_settings(store: Metastore) -> dict[str, str]:
    """Static Spark settings for a session with this metastore (Hive catalog, warehouse, JDBC or thrift)."""
    settings = {
        "spark.sql.catalogImplementation": "hive",
        "spark.sql.warehouse.dir": str(store.dir / "warehouse"),
        # Hive 2.3 creates its schema in an empty database (Derby, Postgres) instead of refusing it
        "spark.hadoop.datanucleus.schema.autoCreateAll": "true",
        "spark.hadoop.hive.metastore.schema.verification": "false",
    }
    if store.uris:
        settings["spark.hadoop.hive.metastore.uris"] = store.uris
        return settings
    url = store.url or f"jdbc:derby:;databaseName={store.dir / 'metastore_db'};create=true"
    settings["spark.hadoop.javax.jdo.option.ConnectionURL"] = url
    if store.embedded:
        # Hive retries opening its database 10 times, 2 s apart: embedded Derby that another process holds
        # stays held for longer than that, so the job would only wait 20 s to fail the same way
        settings["spark.hadoop.hive.hmshandler.retry.attempts"] = "1"
    driver = next((d for prefix, d in JDBC_DRIVERS.items() if url.startswith(prefix)), None)
    if driver:
        settings["spark.hadoop.javax.jdo.option.ConnectionDriverName"] = driver
    return settings


def launch_settings(store: Metastore) -> dict[str, str]:
    """Settings that only count when the driver's JVM starts: the JDBC driver's class path, derby.log's place."""
    settings = {"spark.driver.extraJavaOptions": f"-Dderby.stream.error.file={store.dir / 'derby.log'}"}
    if store.jars:
        settings["spark.driver.extraClassPath"] = os.pathsep.join(store.jars)
    return settings


def submit_arguments(argv: Sequence[str]) -> list[str]:
    """What ``spark-submit.sh`` adds for the job whose arguments are ``argv`` (``--conf FILE``, ``--set K=V``):
    ``JAVA=<driver java options>`` (derby.log under ``output.metastore.dir``) and ``CLASSPATH=<jars>`` (the
    metastore's JDBC driver, ``--driver-class-path``); the job's session applies the other settings."""
    import argparse

    from recsys.config import load_config

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--conf")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    known, _ = parser.parse_known_args(list(argv))
    cfg = load_config(known.conf, known.overrides)
    if cfg.output.table is None:
        return []
    store = resolve(cfg.output.metastore)
    if store.embedded:
        # Derby opens derby.log when it boots, before the job's session could create the directory: a missing
        # one would put its boot banner and a FileNotFoundException in the scheduler's log instead. A directory
        # that cannot be made is left to the job, which names it.
        with contextlib.suppress(OSError):
            store.dir.mkdir(parents=True, exist_ok=True)
    launch = launch_settings(store)
    lines = [f"JAVA={launch['spark.driver.extraJavaOptions']}"]
    if store.jars:
        lines.append(f"CLASSPATH={launch['spark.driver.extraClassPath']}")
    return lines


# ------------------------------------------------------------------------------------------------
# a Derby network server (`recsys metastore start`, and the tests' metastore service)


def missing_jars(jars: Sequence[str] = (*DERBY_SERVER_JARS, DERBY_CLIENT_JAR)) -> list[str]:
    return [j for j in jars if not Path(j).is_file()]


def running_server(directory: Path) -> dict | None:
    """The server ``recsys metastore start`` runs on ``directory``, if it is alive and answers."""
    path = Path(directory) / SERVER_FILE
    try:
        info = json.loads(path.read_text())
        with socket.create_connection(("127.0.0.1", int(info["port"])), timeout=1):
            return info
    except (OSError, ValueError, KeyError):
        return None


def start_server(directory: Path, port: int = 0, timeout_s: float = 60.0) -> dict:
    """Start a Derby network server on 127.0.0.1 for the metastore database under ``directory/server``.

    Its database is its own (``server/metastore_db``): Debian's Derby 10.14 cannot open a database that
    pip pyspark's embedded Derby 10.16 created. The first job that opens the table registers every
    published date again from the pointers. Returns ``{"pid", "port", "url"}``, also written to
    ``directory/server.json``.
    """
    missing = missing_jars()
    if missing:
        raise FileNotFoundError(f"the Derby network server needs {', '.join(missing)}: apt-get install libderby-java "
                                f"libderbyclient-java (Debian/Ubuntu)")
    directory = Path(directory)
    home = directory / "server"
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = open(home / "server.log", "ab")
    proc = subprocess.Popen(
        ["java", f"-Dderby.system.home={home}", f"-Dderby.stream.error.file={home / 'derby.log'}",
         "-cp", os.pathsep.join(DERBY_SERVER_JARS), "org.apache.derby.drda.NetworkServerControl",
         "start", "-h", "127.0.0.1", "-p", str(port), "-noSecurityManager"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the Derby network server exited with {proc.returncode}; see {home / 'server.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"the Derby network server did not listen on 127.0.0.1:{port} within {timeout_s:.0f}s")
            time.sleep(0.2)
    info = {"pid": proc.pid, "port": port, "url": f"jdbc:derby://127.0.0.1:{port}/metastore_db;create=true"}
    (directory / SERVER_FILE).write_text(json.dumps(info))
    return info


def stop_server(directory: Path, timeout_s: float = 30.0) -> bool:
    """Stop the server ``start_server`` started on ``directory``; False if none was running."""
    path = Path(directory) / SERVER_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    path.unlink(missing_ok=True)
    return stop_process(int(info.get("pid", 0)), timeout_s)


if __name__ == "__main__":   # spark-submit.sh: python -m recsys.spark.metastore JOB-ARGS...
    print("\n".join(submit_arguments(sys.argv[1:])))
