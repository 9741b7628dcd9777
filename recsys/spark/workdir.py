"""``paths.work`` must be writable by the executors, not only by the driver: check it first.

On a cluster the driver and the executors often hold different credentials (an instance role, a
service account), and ``paths.work`` is where executors write a run's histories. A directory only
the driver can write would otherwise fail deep inside the histories stage, after the task retries,
with a storage error that names neither the setting nor the fix. One tiny write job up front turns
that into one line naming ``paths.work`` (exit code 2), before anything is read or published.
"""
from __future__ import annotations

import logging

from recsys import fs as rfs
from recsys.errors import ConfigError
from recsys.redaction import redact_text, redact_uri

log = logging.getLogger(__name__)


def check_executors_can_write(spark, work_dir: str, *, configured: str, setting: str = "paths.work") -> None:
    """Write and remove one row under ``work_dir`` (a run's directory under the ``configured`` root) from an
    executor; ConfigError naming the setting and its value if they cannot."""
    probe = rfs.join(work_dir, "_executors_can_write")
    try:
        spark.range(1).coalesce(1).write.mode("overwrite").parquet(probe)
    except Exception as exc:  # Spark wraps the storage error in its own; the first line names the cause
        raise ConfigError(
            f"the executors cannot write under {setting}={redact_uri(configured)!r}: {_cause(exc)}; give {setting} "
            f"a directory or URI that the driver and every executor can write (docs/cluster.md)"
        ) from None
    try:
        fs, path = rfs.resolve(probe)
        rfs.delete_dir_if_exists(fs, path)
    except OSError as exc:  # the run's work directory is removed at the end anyway
        log.warning("could not remove %s: %s", probe, exc)


def _cause(exc: BaseException) -> str:
    """The innermost storage error of a Spark failure, on one line, credentials removed."""
    text = str(exc)
    for marker in ("Caused by: ", "IOException: ", "AccessDeniedException: ", "FileSystemException: "):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return redact_text(line)[:300]
