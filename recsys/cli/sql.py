"""``recsys sql``: SQL on the catalog the job publishes to, and the settings for a client of your own.

A Spark session a user opens (``pyspark``, ``spark-sql``) does not know the project's metastore
(``output.metastore``: embedded Derby under ``.recsys/metastore``, a Derby server, a JDBC database or a
Hive metastore service) nor its object store (``storage.s3``), so ``recsys.recommendations`` is not there.
``recsys sql`` runs statements on a session built the way the job's is (``recsys.spark.session``), and
``recsys sql --print-conf`` prints those settings in the format ``spark-sql``, ``pyspark`` and
``spark-submit`` read with ``--properties-file`` (``KEY VALUE`` lines), for users who bring their own client.

Without a statement it reads statements from standard input, each ended by ``;``, and prints each result
as a table: an interactive shell on a terminal (an error is printed and the shell goes on), a script
otherwise (the first error ends it with that statement's exit code).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable, Iterator, TextIO

from recsys.errors import ExitCode, InputDataError, RecsysError, first_line

log = logging.getLogger("recsys")

PROMPT, MORE = "recsys-sql> ", "         -> "
QUIT = frozenset({"quit", "exit", r"\q"})


def client_settings(cfg) -> dict[str, str]:
    """The settings of a session bound to the project's catalog and stores, for a client of the user's own:
    what :func:`recsys.spark.session.build_session` gives a local session of the job's (the metastore of
    ``output.table`` with the driver's class path and java options, S3A from ``storage.s3``, the job's SQL
    settings), and the user's ``spark.conf`` over them."""
    from recsys.spark import metastore
    from recsys.spark.session import merged_settings, runtime_settings, store_settings

    settings = {**runtime_settings(), **store_settings(cfg.output, cfg.storage, launching=False)}
    if cfg.output.table is not None:
        settings.update(metastore.launch_settings(metastore.resolve(cfg.output.metastore)))
    return merged_settings(settings, cfg.spark.conf)


def print_conf(cfg, out: TextIO) -> None:
    """:func:`client_settings` as a properties file, with a header saying how to use it."""
    from recsys.spark import metastore

    lines = ["# Spark settings for the catalog and the stores of this recsys configuration. Use them with",
             "#   spark-sql --properties-file FILE      pyspark --properties-file FILE",
             "# or, in Python, SparkSession.builder.config(KEY, VALUE) for each line (KEY, a space, VALUE),",
             "# before the session starts: the metastore and the class path are read when it starts."]
    if cfg.output.table is None:
        lines.append("# output.table is null: the job publishes no table, so there is no metastore to reach.")
    else:
        store = metastore.resolve(cfg.output.metastore)
        lines.append(f"# The table: {cfg.output.table}, in {store.describe()}.")
        if store.embedded:
            lines.append("# Embedded Derby admits one process at a time: while another holds it (the job, the backend), "
                         "run `recsys metastore start` first.")
    lines += [f"{key} {value}" for key, value in client_settings(cfg).items()]
    out.write("\n".join(lines) + "\n")


def split_statements(text: str) -> tuple[list[str], str]:
    """(the complete statements in ``text``, each without its ``;``; what follows the last ``;``).

    A ``;`` inside quotes or backticks, or in a ``--`` comment, ends nothing; comments are dropped.
    """
    statements, current, quote, i = [], [], "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            current.append(ch)
            if ch == "\\" and quote != "`" and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"`":
            quote = ch
            current.append(ch)
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = len(text) if end == -1 else end
            continue
        elif ch == ";":
            statements.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    return [s for s in statements if s], "".join(current)


def run_statement(spark, statement: str, out: TextIO, max_rows: int, hint: str = "") -> None:
    """Run one statement and print its result as a table (``OK`` for a statement that returns none).

    Raises :class:`~recsys.errors.InputDataError` (exit 2) for a statement Spark cannot analyse or parse,
    :class:`~recsys.publish.table.MetastoreUnavailable` (exit 1) when the catalog cannot be reached or opened;
    anything else as it came.
    """
    from pyspark.errors import AnalysisException

    from recsys.publish.table import MetastoreUnavailable, is_metastore_failure

    try:
        frame = spark.sql(statement)
        if not frame.columns:
            print("OK", file=out)
            return
        with contextlib.redirect_stdout(out):   # Spark's own table format (nested values too), written to ``out``
            frame.show(n=max_rows, truncate=False)
    except Exception as exc:
        if is_metastore_failure(exc):
            raise MetastoreUnavailable(f"the metastore cannot be reached or opened ({first_line(exc)}){hint}") from None
        if isinstance(exc, AnalysisException):
            raise InputDataError(f"the statement failed: {first_line(exc)}") from None
        raise
    out.flush()


def shell(run: Callable[[str], None], stdin: TextIO, *, interactive: bool) -> int:
    """Read statements from ``stdin`` and ``run`` each, until EOF or ``quit``. ``interactive``: prompts, and
    an error is printed and the shell goes on; otherwise the first error ends it (raised, with its exit code)."""
    pending = ""
    for line in _lines(stdin, interactive, lambda: MORE if pending.strip() else PROMPT):
        if not pending.strip() and line.strip().rstrip(";").strip().lower() in QUIT:
            break
        statements, pending = split_statements(pending + line)
        for statement in statements:
            _run_one(run, statement, interactive)
    for statement in split_statements(pending + ";")[0]:   # a last statement without its ;
        _run_one(run, statement, interactive)
    return int(ExitCode.OK)


def _run_one(run: Callable[[str], None], statement: str, interactive: bool) -> None:
    try:
        run(statement)
    except Exception as exc:
        if not interactive:
            raise
        print(f"error: {first_line(exc, with_type=not isinstance(exc, RecsysError))}", file=sys.stderr)


def _lines(stdin: TextIO, interactive: bool, prompt: Callable[[], str]) -> Iterator[str]:
    if not interactive:
        yield from stdin
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:   # pragma: no cover (not on every platform)
        pass
    while True:
        try:
            yield input(prompt()) + "\n"
        except EOFError:
            print(file=sys.stderr)
            return
