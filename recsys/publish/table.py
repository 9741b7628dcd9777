"""``output.table``: the catalog table whose partition ``dt=D`` points at the night's run directory.

A Hive-format external Parquet table (``STORED AS PARQUET``: readable by Spark, Hive, Trino and any
engine that reads a Hive metastore or Glue) located at ``paths.output``, partitioned by ``dt DATE``.
Publishing is one metastore operation per night, ``ALTER TABLE ... PARTITION (dt=D) SET LOCATION``
(``ADD PARTITION ... LOCATION`` the first time): a reader of the table sees the old run's files or the
new run's, never a mix, on every store, because neither directory changes while it is pointed at.

Everything goes through ``spark.sql``, so it works alike in a classic session and over Spark Connect
(where the server's catalog is used). The session must have a Hive catalog
(``spark.sql.catalogImplementation=hive``): an in-memory catalog's tables die with the session, so
the job refuses it instead of publishing into nothing. Never run ``MSCK REPAIR TABLE`` on it: that
would register the path views ``dt=D/`` (which are replaced in place) instead of the run directories.
"""
from __future__ import annotations

import datetime as dt
import logging
import re

from recsys.data.contracts import OUTPUT_SPARK_DDL
from recsys.errors import ConfigError, RecsysError, first_line
from recsys.uris import is_local_path, local_path, pyarrow_uri
from recsys.redaction import redact_uri
from recsys.spark.failures import lost_jvm_connection

log = logging.getLogger(__name__)


class MetastoreUnavailable(RecsysError):
    """The metastore cannot be reached or opened: nothing was published; retry when it is back (exit 1)."""


_METASTORE_FAILURE = re.compile(r"SessionHiveMetaStoreClient|Failed to start database|Another instance of Derby|"
                                r"Connection refused|Could not connect to meta store|MetaException|"
                                r"Unable to open a test connection", re.I)


class OutputTable:
    """The table, bound to the output root it must be located at. Build it with :func:`open_table`."""

    def __init__(self, spark, name: str, output_root: str, metastore_hint: str = ""):
        self.spark = spark
        self.name = name
        self.output_root = output_root
        self.hint = metastore_hint
        db, table = name.split(".", 1)
        self.quoted = f"`{db}`.`{table}`"
        self.database = db

    # -- reads ----------------------------------------------------------------------------------------
    def location(self, date: dt.date) -> str | None:
        """The directory partition ``dt=D`` points at, or None when the table has no such partition."""
        if date not in self.dates():
            return None
        rows = self._sql(f"DESCRIBE FORMATTED {self.quoted} PARTITION (dt = DATE'{date}')")
        for row in rows:   # the partition's own Location comes before the table's
            if str(row[0]).strip() == "Location":
                return str(row[1]).strip()
        raise RuntimeError(f"{self.name}: the metastore describes partition dt={date} without a location")

    def dates(self) -> list[dt.date]:
        """The table's partitions, oldest first."""
        rows = self._sql(f"SHOW PARTITIONS {self.quoted}")
        found = []
        for row in rows:
            value = str(row[0]).split("=", 1)[-1]
            try:
                found.append(dt.date.fromisoformat(value))
            except ValueError:
                log.warning("%s: ignoring partition %s (not a date)", self.name, row[0])
        return sorted(found)

    # -- the one write per night ----------------------------------------------------------------------
    def point(self, date: dt.date, location: str) -> None:
        """Point partition ``dt=date`` at ``location`` in one metastore operation (added if absent)."""
        where = _literal(_hadoop_uri(location))
        if date in self.dates():
            self._sql(f"ALTER TABLE {self.quoted} PARTITION (dt = DATE'{date}') SET LOCATION {where}")
        else:
            self._sql(f"ALTER TABLE {self.quoted} ADD PARTITION (dt = DATE'{date}') LOCATION {where}")

    def drop(self, date: dt.date) -> None:
        """Remove partition ``dt=date`` from the table (the files are left alone: the table is external)."""
        self._sql(f"ALTER TABLE {self.quoted} DROP IF EXISTS PARTITION (dt = DATE'{date}')")

    # -- creating and checking ------------------------------------------------------------------------
    def ensure(self) -> bool:
        """Create the database and table if missing; refuse one located elsewhere. True if it was created."""
        impl = self._catalog_implementation()
        if impl != "hive":
            raise ConfigError(
                f"output.table={self.name} needs a Hive metastore, and this Spark session's catalog is {impl!r} (its "
                f"tables vanish with the session). Sessions recsys starts get one (output.metastore); under spark-submit "
                f"pass --conf spark.sql.catalogImplementation=hive, start the Connect server with `recsys backend start`, "
                f"or set output.table: null to publish the paths only")
        if not self._database_exists():   # asked first: Hive logs a stack trace for CREATE ... IF NOT EXISTS on one
            self._sql(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")
        if not self._exists():
            self._sql(f"CREATE EXTERNAL TABLE IF NOT EXISTS {self.quoted} ({OUTPUT_SPARK_DDL}) PARTITIONED BY (dt DATE) "
                      f"STORED AS PARQUET LOCATION {_literal(_hadoop_uri(self.output_root))}")
            log.info("created table %s at %s", self.name, redact_uri(self.output_root))
            return True
        found = self._table_location()
        if _normalised(found) != _normalised(self.output_root):
            raise ConfigError(
                f"table {self.name} is located at {redact_uri(found)!r}, not at paths.output={redact_uri(self.output_root)!r}; "
                f"a table belongs to one output root: choose another output.table or point paths.output at its location")
        return False

    def _database_exists(self) -> bool:
        rows = self._sql(f"SHOW DATABASES LIKE '{self.database}'")
        return any(str(r[0]).lower() == self.database.lower() for r in rows)

    def _exists(self) -> bool:
        db, table = self.name.split(".", 1)
        rows = self._sql(f"SHOW TABLES IN `{db}` LIKE '{table}'")
        return any(str(r["tableName"]).lower() == table.lower() for r in rows)

    def _table_location(self) -> str:
        for row in self._sql(f"DESCRIBE FORMATTED {self.quoted}"):
            if str(row[0]).strip() == "Location":
                return str(row[1]).strip()
        raise RuntimeError(f"the metastore describes {self.name} without a location")

    def _catalog_implementation(self) -> str:
        try:
            return str(self.spark.conf.get("spark.sql.catalogImplementation", "in-memory"))
        except Exception:   # a Connect server that does not expose static settings: let the catalog answer
            return "hive"

    def _sql(self, statement: str) -> list:
        try:
            return self.spark.sql(statement).collect()
        except Exception as exc:
            if is_metastore_failure(exc):
                raise MetastoreUnavailable(
                    f"the metastore of {self.name} cannot be reached or opened ({first_line(exc)}){self.hint}; "
                    f"nothing was published: retry when it is back") from None
            raise


def is_metastore_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the metastore cannot be reached or opened (not that a statement is wrong). py4j's own
    refused connection is the Spark JVM gone, not the metastore: left as it is, for
    :func:`recsys.spark.failures.jvm_gone` to name."""
    return bool(_METASTORE_FAILURE.search(str(exc))) and not lost_jvm_connection(exc)


def open_table(spark, name: str | None, output_root: str, metastore_hint: str = "") -> OutputTable | None:
    """The output table (created if missing, its location checked), or None when ``output.table`` is null."""
    if name is None:
        return None
    table = OutputTable(spark, name, output_root, metastore_hint)
    table.created = table.ensure()
    return table


def _hadoop_uri(location: str) -> str:
    """How Hadoop (the metastore) spells a location: local paths as absolute paths, ``s3://`` kept."""
    return str(local_path(location)) if is_local_path(location) else location


def _normalised(location: str) -> str:
    if location.startswith("file:"):
        return "/" + location[len("file:"):].lstrip("/").rstrip("/")
    if is_local_path(location):
        return str(local_path(location)).rstrip("/")
    return pyarrow_uri(location).rstrip("/")


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
