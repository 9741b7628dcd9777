"""The tests' JVM options (tests/jvmkit.py) do what they are there for: Spark's classes come from the class-data
archive. A JVM whose class path does not match the archive's ignores it without a word, so nothing else would
notice when the archive stops applying (it did: one built for another checkout's virtualenv was reused)."""
from __future__ import annotations

import os
import subprocess

import pytest

import jvmkit

pytestmark = [pytest.mark.spark]


def test_the_shared_session_s_jvm_options_load_spark_s_classes_from_the_archive(spark, tmp_path):
    if os.environ.get("RECSYS_TEST_JVM") == "default":
        pytest.skip("RECSYS_TEST_JVM=default: the tests' JVMs run with Java's defaults")
    archive = jvmkit.archive_path()
    if archive is None or not archive.is_file():      # its build failed, and said why at the session's start
        pytest.skip(f"no class-data archive was built ({archive}): the tests' JVMs run without it")
    jvm = spark._jvm
    class_path = jvm.java.lang.System.getProperty("java.class.path")
    options = [str(a) for a in jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()]
    assert f"-XX:SharedArchiveFile={archive}" in options, options       # configure() gave it this archive
    java = os.path.join(jvm.java.lang.System.getProperty("java.home"), "bin", "java")
    # a JVM as the session's (its options and class path) loading one of Spark's classes, saying where from
    run = subprocess.run([java, *options, "-Xlog:class+load=info", "-cp", class_path,
                          "org.apache.spark.deploy.SparkSubmit", "--version"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    loaded = [line for line in run.stdout.splitlines() if "org.apache.spark.deploy.SparkSubmit " in line]
    assert loaded and "source: shared objects file (top)" in loaded[0], (loaded, run.stderr[-2000:])


def test_an_archive_is_kept_per_checkout_used_lately_and_the_rest_go(tmp_path):
    archives = []
    for age in range(5):                    # spark-0 is the newest, spark-4 the oldest
        path = tmp_path / f"spark-{age}.jsa"
        path.write_bytes(b"x")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
        archives.append(path)
    (tmp_path / "other.txt").write_text("not an archive")
    removed = jvmkit.forget_unused(tmp_path, keep=archives[3], most=3)
    assert sorted(p.name for p in removed) == ["spark-2.jsa", "spark-4.jsa"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "spark-0.jsa", "spark-1.jsa", "spark-3.jsa"]
