"""`recsys sql`: statements on the table the job publishes to, a shell, and the settings for a client of one's own.

A tiny night (Parquet files written by pyarrow, published into the table with the job's publisher) in the
test session's metastore service. The command runs in this process on the shared session, except in the
slow test, where `recsys sql` and a fresh pyspark session configured only from `recsys sql --print-conf` run
as separate processes (one Spark start each) and must both see the night.
"""
from __future__ import annotations

import datetime as dt
import io
import os
import re
import subprocess
import sys

import pytest

import jobkit
from recsys.publish.publisher import PartitionLayout, publish
from recsys.publish.table import open_table

pytestmark = [pytest.mark.spark]

DATE = dt.date(2024, 5, 8)
USERS = 17


@pytest.fixture()
def night(spark, tmp_path):
    """(table name, --set arguments naming its metastore) of a published night of USERS users, version 3."""
    out = str(tmp_path / "recommendations")
    name = jobkit.table_name(tmp_path)
    layout = PartitionLayout(out, DATE, "20240508T000000Z-sql")
    jobkit.write_night(layout.run_dir, "3", USERS)
    publish(layout, jobkit.night_manifest(layout.run_key, "3"), "exchange", table=open_table(spark, name, out))
    sets = []
    for item in [*jobkit.metastore_overrides(tmp_path), f"paths.output={out}"]:
        sets += ["--set", item]
    return name, sets


def _count_query(table: str) -> str:
    return f"select model_version, count(*) as users from {table} where dt = '{DATE}' group by model_version"


def test_a_statement_s_rows_are_printed_as_a_table(spark, night, monkeypatch, capsys):
    table, sets = night
    assert jobkit.cli(monkeypatch, spark, ["sql", _count_query(table), *sets]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\|model_version\|users\|$", out, flags=re.M)
    assert re.search(rf"^\|3 +\|{USERS} *\|$", out, flags=re.M), out


def test_a_wrong_statement_exits_2_in_one_line(spark, night, monkeypatch, caplog):
    _, sets = night
    assert jobkit.cli(monkeypatch, spark, ["sql", "select * from no_such_table", *sets]) == 2
    errors = jobkit.errors_logged(caplog)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith("the statement failed: [TABLE_OR_VIEW_NOT_FOUND]") and "no_such_table" in errors[0]


def test_the_shell_runs_statements_ended_by_semicolons_and_a_script_stops_at_its_first_error(
        spark, night, monkeypatch, capsys):
    table, sets = night
    script = (f"select count(*) as n\n  from {table}\n  where dt = '{DATE}';  select 'a;b' as s; -- not; a statement\n"
              "select * from no_such_table;\nselect 'never' as x;\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert jobkit.cli(monkeypatch, spark, ["sql", *sets]) == 2
    out = capsys.readouterr().out
    assert re.search(rf"^\|{USERS} *\|$", out, flags=re.M) and "|a;b|" in out
    assert "never" not in out


def test_a_last_statement_needs_no_semicolon_and_quit_ends_the_shell(spark, night, monkeypatch, capsys):
    _, sets = night
    monkeypatch.setattr(sys, "stdin", io.StringIO("select 40 + 2 as answer\n"))
    assert jobkit.cli(monkeypatch, spark, ["sql", *sets]) == 0
    assert "|42    |" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("quit\nselect 'after quit' as x;\n"))
    assert jobkit.cli(monkeypatch, spark, ["sql", *sets]) == 0
    assert "after quit" not in capsys.readouterr().out


def test_print_conf_names_the_metastore_and_the_object_store(tmp_path, capsys):
    from recsys.cli.main import main

    url = "jdbc:derby://127.0.0.1:1527/metastore_db;create=true"
    assert main(["sql", "--print-conf", "--set", f"output.metastore.dir={tmp_path}", "--set", f"output.metastore.url={url}",
                 "--set", "output.metastore.jars=[/opt/derbyclient.jar]", "--set", "storage.s3.endpoint=http://127.0.0.1:9000",
                 "--set", "storage.s3.path_style=true", "--set", "spark.conf.spark.driver.memory=3g"]) == 0
    out = capsys.readouterr().out
    settings = dict(line.split(" ", 1) for line in out.splitlines() if line and not line.startswith("#"))
    assert settings["spark.sql.catalogImplementation"] == "hive"
    assert settings["spark.hadoop.javax.jdo.option.ConnectionURL"] == url
    assert settings["spark.hadoop.javax.jdo.option.ConnectionDriverName"] == "org.apache.derby.jdbc.ClientDriver"
    assert settings["spark.driver.extraClassPath"] == "/opt/derbyclient.jar"
    assert settings["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert settings["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert settings["spark.driver.memory"] == "3g" and settings["spark.sql.session.timeZone"] == "UTC"
    assert "# The table: recsys.recommendations" in out
    assert not (tmp_path / "metastore_db").exists()   # printing opens nothing


def test_statements_split_at_semicolons_outside_quotes_and_comments():
    from recsys.cli.sql import split_statements

    text = "select ';' as a, `x;y` from t -- no; split\n; select \"it\\\"s;\" ;\n select 3"
    assert split_statements(text) == (["select ';' as a, `x;y` from t", 'select "it\\"s;"'], "\n select 3")
    assert split_statements(" ; ;\n") == ([], "\n")


def test_an_interactive_shell_reports_an_error_and_goes_on(monkeypatch, capsys):
    from recsys.cli import sql
    from recsys.errors import InputDataError

    typed = iter(["select 1", "  as one;", "select oops;", "select 2;"])

    def answer(prompt):
        print(prompt, end="")
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    ran = []

    def run(statement):
        if "oops" in statement:
            raise InputDataError("the statement failed: [UNRESOLVED_COLUMN] oops")
        ran.append(statement)

    monkeypatch.setattr("builtins.input", answer)
    assert sql.shell(run, io.StringIO(), interactive=True) == 0
    assert ran == ["select 1\n  as one", "select 2"]
    captured = capsys.readouterr()
    assert captured.out == sql.PROMPT + sql.MORE + sql.PROMPT + sql.PROMPT + sql.PROMPT
    assert "error: the statement failed: [UNRESOLVED_COLUMN] oops" in captured.err


_FRESH_CLIENT = """
import sys
from pyspark.sql import SparkSession

builder = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
for line in open(sys.argv[1]):
    if line.strip() and not line.startswith("#"):
        key, value = line.rstrip("\\n").split(" ", 1)
        builder = builder.config(key, value)
spark = builder.getOrCreate()
print("ROWS", sorted(tuple(r) for r in spark.sql(sys.argv[2]).collect()))
"""


@pytest.mark.slow
def test_print_conf_lets_a_fresh_pyspark_session_and_recsys_sql_in_its_own_process_see_the_night(night, tmp_path):
    table, sets = night
    env = {**{k: v for k, v in os.environ.items() if k != "RECSYS_LOG4J_CONF"}, "PYSPARK_PYTHON": sys.executable}
    sets = [*sets, "--set", "spark.master=local[1]", "--set", "spark.conf.spark.ui.enabled=false"]
    command = [sys.executable, "-m", "recsys.cli", "sql"]
    printed = subprocess.run([*command, "--print-conf", *sets], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert printed.returncode == 0, printed.stderr[-3000:]
    conf = tmp_path / "recsys-sql.conf"
    conf.write_text(printed.stdout)
    fresh = subprocess.run([sys.executable, "-c", _FRESH_CLIENT, str(conf), _count_query(table)], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert f"ROWS [('3', {USERS})]" in fresh.stdout, fresh.stderr[-3000:]
    shell = subprocess.run([*command, *sets], input=f"{_count_query(table)};\n", env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert shell.returncode == 0, shell.stderr[-3000:]
    assert re.search(rf"^\|3 +\|{USERS} *\|$", shell.stdout, flags=re.M), shell.stdout
    # its JVM logs as spark-submit.sh's do (conf/log4j2.properties), not with Spark's INFO banner and local notes
    assert not re.search(r"default log4j profile|NativeCodeLoader|setLogLevel", shell.stderr), shell.stderr[-3000:]
