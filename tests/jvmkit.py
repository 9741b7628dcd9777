"""The tests' Spark JVMs start in about a third of the CPU: C1 only, and Spark's classes from a shared archive.

Every JVM a test starts is short-lived and does little work on tiny data: the shared session's (one per
test process) and each subprocess's (the CLI, ``spark-submit.sh``, the Connect server). Most of their CPU
goes to loading and verifying Spark's and Hive's classes and to the C2 compiler optimising code that runs
a few times. Measured on the 2-core AVX2 EPYC (CPU seconds of the process tree, so the machine's load
does not enter; one run each):

=============================================  ========  ===============  ================
JVM options                                    session   first metastore  3 nightly jobs
=============================================  ========  ===============  ================
Java 17's defaults                               13.3        6.7              81.8
``-XX:TieredStopAtLevel=1`` (C1 only)             8.9        5.1              49.2
C1 and this module's class-data archive           4.4        2.0
=============================================  ========  ===============  ================

:func:`configure` puts both into ``SPARK_SUBMIT_OPTS``, which Spark's launcher adds to the driver JVM of
every ``spark-submit`` (pyspark starts the shared session's JVM through it too), so the test processes
and the subprocesses they start inherit them. The archive (``-XX:SharedArchiveFile``, Java's dynamic
AppCDS) is built once per machine, JDK, pyspark and Derby client: a JVM runs :mod:`jvm_warmup`, a small
workload over the tests' Hive metastore, and writes the classes it loaded when it exits. It is kept under
``$RECSYS_TEST_CACHE`` (default ``~/.cache/recsys/test-jvm``), outside the checkout, named by a digest of
what it depends on, the jars' modification times among it: a JVM ignores an archive whose jars' times differ,
so one built in another checkout's virtualenv did not apply in a fresh clone's. The three used last are
kept. A JVM whose class path differs from the archive's (a job with ``output.table=null`` has no Derby
client on it) ignores it without a word (``-Xlog:cds=off``) and runs with C1 only; tests/test_jvmkit.py
checks that the shared session's options do load Spark's classes from it.

Nothing a test checks depends on how the JVM compiles: these change speed only. ``RECSYS_TEST_JVM=default``
turns them off (for comparing, or when a JVM misbehaves).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# C1 only, with the code cache tiered compilation would have: with C1 alone the JVM reserves 48 MiB, not 240, and a
# JVM that lives through a test module (the on-demand backend's Connect server) filled it and died ("Out of space
# in CodeCache for method handle intrinsic"; the SparkContext stopped, every later request of the module failed)
C1_ONLY = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
QUIET_CDS = "-Xlog:cds=off -Xlog:cds+dynamic=off"     # a class path that does not match: silently no archive
ARCHIVE_VERSION = "1"                                  # bump when jvm_warmup's workload changes
WARMUP = Path(__file__).with_name("jvm_warmup.py")
KEEP_ARCHIVES = 3                                      # the archives kept, one per checkout used lately


def cache_dir() -> Path:
    if os.environ.get("RECSYS_TEST_CACHE"):
        return Path(os.environ["RECSYS_TEST_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recsys" / "test-jvm"


def _java() -> str | None:
    java_home = os.environ.get("JAVA_HOME")
    found = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    return found if found and Path(found).exists() else None


def archive_path() -> Path | None:
    """Where the archive for this JDK, pyspark and Derby client lives (whether built or not); None without java."""
    import pyspark

    from recsys.spark.metastore import DERBY_CLIENT_JAR

    java = _java()
    if java is None:
        return None
    jars = Path(pyspark.__file__).parent / "jars"
    h = hashlib.sha256()
    parts = [ARCHIVE_VERSION, os.path.realpath(java), str(os.stat(os.path.realpath(java)).st_mtime_ns),
             pyspark.__version__, C1_ONLY]
    # the JVM checks each jar of the class path against the archive by name, size and modification time, and
    # ignores the archive without a word if one differs: a virtualenv installed at another time (a fresh clone's,
    # another checkout's) has the same jars with other times, so it gets an archive of its own
    parts += sorted(_jar_key(p) for p in jars.glob("*.jar"))
    if Path(DERBY_CLIENT_JAR).is_file():
        parts.append(_jar_key(Path(DERBY_CLIENT_JAR)))
    for part in parts:
        h.update(part.encode() + b"\n")
    return cache_dir() / f"spark-{pyspark.__version__}-{h.hexdigest()[:16]}.jsa"


def _jar_key(jar: Path) -> str:
    found = jar.stat()
    return f"{jar.name}:{found.st_size}:{found.st_mtime_ns}"


def build(archive: Path, timeout_s: float = 900) -> bool:
    """Run the warm-up JVM with ``-XX:ArchiveClassesAtExit`` and move its archive into place. False on failure
    (the tests then run with C1 only: slower, never wrong)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    env = {**os.environ, "SPARK_SUBMIT_OPTS": f"{C1_ONLY} -XX:ArchiveClassesAtExit={tmp} {QUIET_CDS}",
           "SPARK_LAUNCHER_OPTS": C1_ONLY, "PYSPARK_PYTHON": sys.executable}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(WARMUP)], env=env, capture_output=True, text=True,
                              timeout=timeout_s, cwd=archive.parent)
        if done.returncode != 0 or not tmp.is_file() or tmp.stat().st_size == 0:
            print(f"jvmkit: no class-data archive (the warm-up JVM exited {done.returncode}); the tests' JVMs run "
                  f"with C1 only. Its last lines:\n{done.stderr[-2000:]}", file=sys.stderr)
            return False
        tmp.replace(archive)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"jvmkit: no class-data archive ({exc}); the tests' JVMs run with C1 only", file=sys.stderr)
        return False
    finally:
        tmp.unlink(missing_ok=True)
    print(f"jvmkit: built {archive} ({archive.stat().st_size / 2**20:.0f} MiB) in {time.monotonic() - started:.0f} s; "
          f"later test sessions with this virtualenv reuse it", file=sys.stderr)
    forget_unused(archive.parent, keep=archive)
    return True


def forget_unused(directory: Path, keep: Path, most: int = KEEP_ARCHIVES) -> list[Path]:
    """Remove all but the ``most`` archives used last (``keep`` among them); what was removed.

    Each checkout's virtualenv has an archive of its own (about 200 MiB): a developer's checkout beside a
    fresh clone or two keeps its own, while the archives of clones deleted since, or of another JDK or
    pyspark, go. "Used" is the file's modification time, which :func:`configure` renews at every session."""
    others = sorted((p for p in directory.glob("spark-*.jsa") if p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    removed = others[max(0, most - 1):]
    for old in removed:
        old.unlink(missing_ok=True)
    return removed


def options(archive: Path | None) -> str:
    found = [C1_ONLY]
    if archive is not None and archive.is_file():
        found += [f"-XX:SharedArchiveFile={archive}", QUIET_CDS]
    return " ".join(found)


def configure(build_missing: bool) -> None:
    """Set ``SPARK_SUBMIT_OPTS`` (ours first, so a value already there wins) and ``SPARK_LAUNCHER_OPTS`` for this
    process and its children; with ``build_missing``, build the archive first if there is none."""
    if os.environ.get("RECSYS_TEST_JVM") == "default" or os.environ.get("RECSYS_TEST_JVM_SET"):
        return
    try:
        archive = archive_path()
    except Exception as exc:   # no pyspark or an unreadable JDK: the tests say what is missing themselves
        print(f"jvmkit: JVM options left alone ({exc})", file=sys.stderr)
        return
    if archive is not None and build_missing and not archive.is_file():
        build(archive)
    elif archive is not None and build_missing:
        with contextlib.suppress(OSError):        # used now: the last one forget_unused would remove
            os.utime(archive)
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(filter(None, [options(archive), os.environ.get("SPARK_SUBMIT_OPTS")]))
    os.environ["SPARK_LAUNCHER_OPTS"] = " ".join(filter(None, [C1_ONLY, os.environ.get("SPARK_LAUNCHER_OPTS")]))
    os.environ["RECSYS_TEST_JVM_SET"] = "1"   # xdist workers inherit the result: never added twice
