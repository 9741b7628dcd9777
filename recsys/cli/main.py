"""The ``recsys`` command line: thin wrappers that read config once and call the library.

Every command exits with a documented code (see ``recsys.errors.ExitCode`` and the README):
expected failures print one line without a traceback; unexpected ones print the traceback.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import logging
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from recsys.errors import ConfigError, ExitCode, RecsysError, RunStatus, first_line
from recsys.redaction import redact_text
from recsys.scoring.params import ScoringParams

log = logging.getLogger("recsys")


def _date(value: str) -> dt.date:
    from recsys.data.contracts import parse_date

    try:
        return parse_date(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _instant(value: str) -> dt.datetime:
    """YYYY-MM-DD or an ISO 8601 instant; UTC unless it says otherwise."""
    try:
        instant = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a date (YYYY-MM-DD) or an ISO 8601 instant") from None
    return instant if instant.tzinfo else instant.replace(tzinfo=dt.timezone.utc)


def _repeat_rate(value: str) -> float | str:
    if value == "chance":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a share (e.g. 0.75) nor 'chance'") from None


def _today() -> dt.date:
    return dt.datetime.now(dt.timezone.utc).date()


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conf", metavar="FILE", help="YAML config merged over the embedded default")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set scoring.top_n=50 (repeatable)")


def _add_backtest_args(p: argparse.ArgumentParser, *, within_evaluate: bool) -> None:
    """The backtest's options, on `recsys backtest` and on `recsys evaluate --protocol backtest` alike."""
    only = " (--protocol backtest)" if within_evaluate else ""
    p.add_argument("--from", dest="start", type=_date, default=None, required=not within_evaluate, metavar="D1",
                   help=f"first night{only}: its lists come from the events before it, and are measured on the "
                        "events of that day")
    p.add_argument("--to", dest="end", type=_date, default=None, required=not within_evaluate, metavar="D2",
                   help=f"last night, inclusive{only}; the data must hold events on that day")
    p.add_argument("--work", type=Path, default=Path(".recsys/backtest"), metavar="DIR",
                   help=f"where the replay writes{only}: its published partitions, MLflow store and registry, scratch "
                        "and figures; the configured output and tracking store are never written "
                        "(default: .recsys/backtest). The same DIR and settings again resume")
    p.add_argument("--train-every", type=int, default=None, metavar="N",
                   help=f"train every N nights{only} as `recsys train --if-due` would (default: train.every_nights); "
                        "N at least the number of nights trains once, on the first")
    p.add_argument("--model-uri", default=None, metavar="URI",
                   help=f"score every night with this one model and train nothing{only}: models:/NAME@ALIAS or "
                        "models:/NAME/VERSION of the configured tracking store (read only), or a model directory. "
                        "Quick, but a model trained after --from has seen nights it is judged on (the table says so)")
    p.add_argument("--overwrite", action="store_true",
                   help=f"start again in a --work that holds a backtest with other settings{only}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recsys", description="Nightly top-N recommendations on Spark + PyTorch + MLflow.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("sample-data", help="write a realistic synthetic events + catalog dataset")
    p.add_argument("--out", type=Path, help="dataset root (events/ and catalog/ are created inside); "
                                            "default: the parent of paths.events")
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--items", type=int, default=1000)
    p.add_argument("--days", type=int, default=28)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--end-date", type=_date, help="last day with events (default: yesterday, UTC)")
    p.add_argument("--repeat-rate", type=_repeat_rate, default=None, metavar="SHARE",
                   help="share of a returning user's items that are items they had on an earlier day "
                        "(re-buys, re-views), 0-1; 0: every item new to its user; chance: no planted returns, "
                        "the data of the generator before returns (default: 0.75)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset under --out")
    _add_config_args(p)
    p.set_defaults(func=cmd_sample_data)

    p = sub.add_parser("import-movielens", help="convert MovieLens ratings (ratings.csv or u.data) to the input layout")
    p.add_argument("--ratings", type=Path, required=True, help="ratings.csv (ml-latest*) or u.data (ml-100k)")
    p.add_argument("--movies", type=Path, help="movies.csv or u.item, for titles and genres")
    p.add_argument("--out", type=Path, help="dataset root; default: the parent of paths.events")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset under --out")
    _add_config_args(p)
    p.set_defaults(func=cmd_import_movielens)

    p = sub.add_parser("import-interactions", help="convert any interaction log (CSV, plain or compressed) to the "
                                                    "input layout, bad rows counted and reported")
    p.add_argument("--csv", type=Path, required=True,
                   help="the log: one interaction a line (.gz, .bz2, .zst read as such)")
    p.add_argument("--out", type=Path, help="dataset root; default: the parent of paths.events")
    p.add_argument("--user", metavar="COLUMN", help="user column (default: recognised from the header, e.g. user_id)")
    p.add_argument("--item", metavar="COLUMN", help="item column (default: recognised, e.g. item_id, page_id)")
    p.add_argument("--time", metavar="COLUMN", help="time column (default: recognised, e.g. timestamp, seconds)")
    p.add_argument("--time-format", choices=("auto", "s", "ms", "us", "iso"), default="auto",
                   help="Unix seconds, milliseconds or microseconds, or ISO 8601 (default: auto, decided on the "
                        "first block and logged)")
    p.add_argument("--time-origin", type=_instant, metavar="DATE",
                   help="numeric timestamps count from this date or ISO instant, UTC (default: 1970-01-01)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--event-type-column", metavar="COLUMN",
                      help="event type column (default: one named event_type, event or action, if any)")
    kind.add_argument("--event-type", metavar="VALUE", help="one event type for every row (default: interaction)")
    p.add_argument("--title", metavar="COLUMN", help="item title column, for the catalog (default: none; string "
                                                     "item ids are their own title)")
    p.add_argument("--category", metavar="COLUMN", help="item category column, for the catalog (default: none)")
    p.add_argument("--user-ids", choices=("auto", "int", "string"), default="auto",
                   help="int: whole numbers kept; string: mapped to stable 60-bit ids, dictionary in ids/ "
                        "(default: auto, int when the first block's are all whole numbers)")
    p.add_argument("--item-ids", choices=("auto", "int", "string"), default="auto", help="the same, for items")
    p.add_argument("--delimiter", help="field delimiter, \\t for tab (default: sniffed among , tab ; |)")
    p.add_argument("--no-header", action="store_true", help="the first line is data: columns are named 1, 2, ...")
    p.add_argument("--encoding", default="utf8", help="the file's text encoding (default: utf8)")
    p.add_argument("--max-bad-share", type=float, default=0.01, metavar="SHARE",
                   help="fail (exit 2, nothing written) when more than this share of rows is bad (default: 0.01)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset under --out")
    _add_config_args(p)
    p.set_defaults(func=cmd_import_interactions)

    p = sub.add_parser("train", help="train a model on events before a date, register it, move the alias if it is not worse")
    p.add_argument("--date", type=_date, default=None, help="train on events strictly before this date (default: today, UTC)")
    p.add_argument("--force", action="store_true", help="move the alias even if the new version validates worse")
    p.add_argument("--if-due", action="store_true",
                   help="train only when train.every_nights says so (what a schedule runs); otherwise exit 0 saying why")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("recommend", help="run the nightly job for one date or a backfill range "
                                         "(same as jobs/nightly_recommendations.py)")
    p.add_argument("--date", type=_date, default=None, help="the partition to produce (default: today, UTC)")
    p.add_argument("--start-date", type=_date, default=None,
                   help="backfill from this date (inclusive, with --end-date): dates in order, one Spark session")
    p.add_argument("--end-date", type=_date, default=None, help="backfill up to this date (inclusive)")
    p.add_argument("--force", action="store_true",
                   help="recompute dates already published with the same model version and configuration")
    p.add_argument("--accept-guard", action="store_true",
                   help="publish this one night (--date) even if the guard refuses it; the run records that it "
                        "was accepted (docs/operations.md, the guard)")
    _add_config_args(p)
    p.set_defaults(func=cmd_recommend)

    p = sub.add_parser("night", help="the whole night in one process: train if train.every_nights says it is due, "
                                     "then publish the date's lists (same as jobs/night.py)")
    p.add_argument("--date", type=_date, default=None, help="the night: train on events before it, publish its "
                                                            "partition (default: today, UTC)")
    p.add_argument("--force", action="store_true",
                   help="recompute the date's lists if already published with the same model version and "
                        "configuration (training keeps its cadence and its gate)")
    _add_config_args(p)
    p.set_defaults(func=cmd_night)

    p = sub.add_parser("export", help="write a date's published lists into Redis as a new version, then switch "
                                      "the pointer readers follow (same as jobs/export.py; docs/export.md)")
    p.add_argument("--date", type=_date, default=None, help="the published date to export (default: today, UTC)")
    p.add_argument("--force", action="store_true", help="export again a partition the store already serves")
    p.add_argument("--allow-older", action="store_true",
                   help="export a date older than the one the store serves (moves readers back)")
    p.add_argument("--if-configured", action="store_true",
                   help="exit 0 saying so when export.redis_url is not set (what a schedule runs)")
    _add_config_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("rollback", help="point a date back at an earlier published run that is still kept "
                                        "(output.keep_runs): the table, the pointer and the path view")
    p.add_argument("--date", type=_date, required=True, help="the date to roll back")
    p.add_argument("--to", metavar="RUN", default=None,
                   help="the run key to point at (default: the newest earlier published run); --list shows them")
    p.add_argument("--list", action="store_true", help="list the date's kept runs and exit")
    _add_config_args(p)
    p.set_defaults(func=cmd_rollback)

    p = sub.add_parser("metastore", help="a Derby network server on loopback for output.table's metastore, so that "
                                         "the job, the backend and readers can share it (embedded Derby admits one)")
    p.add_argument("action", choices=("start", "stop", "status"))
    _add_config_args(p)
    p.set_defaults(func=cmd_metastore)

    p = sub.add_parser("sql", help="SQL on the table the job publishes to (output.table, in output.metastore; "
                                   "storage.s3), printed as tables; without a statement, a shell reading statements "
                                   "ended by ;")
    p.add_argument("statement", nargs="?", help="the statement(s) to run, e.g. \"select count(*) from "
                                                "recsys.recommendations where dt = '2024-05-01'\"")
    p.add_argument("--print-conf", action="store_true",
                   help="print the Spark settings of that catalog and store for your own spark-sql or pyspark "
                        "(a --properties-file) and exit")
    p.add_argument("--max-rows", type=int, default=1000, help="rows printed of each result (default: 1000)")
    _add_config_args(p)
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("runs", help="list nightly runs from the tracking store, or show one (runs show DATE|RUN_ID)")
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list", help="list (default) or show")
    p.add_argument("which", nargs="?", metavar="DATE|RUN_ID", help="show: a run date (its newest run) or a run id")
    p.add_argument("--last", type=int, default=20, help="list: the newest N runs (default: 20)")
    p.add_argument("--date", type=_date, default=None, help="list: only the runs of this date")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_config_args(p)
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("evaluate", help="compare the models and baselines (popularity, Spark ALS) on a protocol; "
                                        "print the table, log it to MLflow")
    p.add_argument("--data", type=Path, default=None,
                   help="dataset root in the input layout (events/ and catalog/), e.g. from import-movielens --out "
                        "(required for loo and temporal; backtest: default paths.events and paths.catalog)")
    p.add_argument("--protocol", choices=("loo", "temporal", "backtest"), default="loo",
                   help="loo: leave the last item out per user (the second-to-last validates); temporal: train "
                        "before --split-date, test on the following --test-days; backtest: the job itself, night "
                        "by night (the same as `recsys backtest`, with --from/--to) (default: loo)")
    p.add_argument("--k", type=int, action="append", default=None, metavar="K",
                   help="metric cut-off, repeatable (default: evaluation.ks, i.e. 10)")
    p.add_argument("--tie-seed", type=int, default=None,
                   help="seed of the hash that orders equal timestamps (default: history.tie_break_seed, i.e. 7)")
    p.add_argument("--split-date", type=_date, default=None,
                   help="temporal: first test day (default: the data's last --test-days days are the test window)")
    p.add_argument("--test-days", type=int, default=30,
                   help="temporal: days in the test window, and in the validation window before it (default: 30)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="train each sequence model N times (seeds train.seed, train.seed + 1, ...): the table shows "
                        "the mean over seeds, and its intervals resample seeds as well as users (default: 1)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the table's figures as JSON")
    _add_backtest_args(p, within_evaluate=True)
    _add_config_args(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("backtest", help="replay nights through the job (training on its schedule, then the nightly "
                                        "stages) into a scratch area, and measure each night's lists on what users "
                                        "did that day, beside the baselines (docs/quality.md)")
    p.add_argument("--data", type=Path, default=None,
                   help="dataset root in the input layout (events/ and catalog/); default: paths.events and "
                        "paths.catalog")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    _add_backtest_args(p, within_evaluate=False)
    _add_config_args(p)
    p.set_defaults(func=cmd_backtest)

    p = sub.add_parser("demo", help="data -> train -> recommend on the bundled MovieLens sample, then show the results")
    p.add_argument("--data", type=Path, help="a MovieLens directory (ratings.csv + movies.csv); default: "
                                             "../shared/data/ml-latest-small, else the bundled copy")
    p.add_argument("--synthetic", action="store_true", help="use generated sample data instead of MovieLens")
    _add_config_args(p)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="scoring throughput: bare core vs the job's Spark stage vs predict_batch_udf vs ALS")
    p.add_argument("--users", type=int, default=200_000)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--history", type=int, default=50, help="items per user history (= the model's max_len)")
    p.add_argument("--top-n", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; figures are medians")
    p.add_argument("--cores", type=int, default=2, help="Spark local[cores] and torch threads of the bare core")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--arrow-batch-size", type=int, default=10_000)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the Spark systems always run on the CPU here)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int8"])
    p.add_argument("--item-tile", type=int, default=0)
    p.add_argument("--max-tile-mb", type=float, default=ScoringParams.max_tile_mb,
                   help="largest chunk x item-tile score matrix in MiB (0: no limit); default: the job's")
    p.add_argument("--core-only", action="store_true", help="only the bare core: no Spark, MLflow or config needed")
    p.add_argument("--skip", default="", help="comma-separated systems to leave out: reference_core,bare_core_bf16,"
                   "bare_core_int8,job_stage_int8,predict_batch_udf,spark_als")
    p.add_argument("--work-dir", type=Path, help="where temporary data goes (default: the system temp dir)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    p.set_defaults(func=cmd_bench)

    from recsys.serve.cli import add_commands  # recsys backend start|stop|status, recsys serve

    add_commands(sub, _add_config_args, _config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from recsys.logs import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    code = run_command(args.func, args)
    if args.command in ("recommend", "train", "export", "night"):
        from recsys.cli.outcome import final_line

        log.log(*final_line(args.command, code, getattr(args, "outcome", None)))
    return code


def process_main(argv: Sequence[str] | None = None) -> NoReturn:
    """:func:`main` as a process's entry point (the ``recsys`` command, ``jobs/*.py``, ``python -m recsys.cli``):
    exits with its code.

    Before exiting, the objects the garbage collector tracks are frozen (``gc.freeze``): the interpreter's
    last collection would otherwise walk every object the imports made (torch, MLflow, pandas, pyarrow) only
    to free memory the operating system takes back anyway, which cost every job 1.3-1.4 s between its last
    line and its exit (docs/performance.md). ``atexit`` handlers still run. Not in :func:`main`, which tests
    call inside a long-lived process whose later garbage must still be collected.
    """
    code = main(argv)
    gc.freeze()
    sys.exit(code)


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Map outcomes to exit codes: one line for expected failures, for a Spark JVM that died and for a task whose
    process died each time Spark tried it (:mod:`recsys.spark.failures`), a traceback for the rest."""
    try:
        return int(func(args))
    except KeyboardInterrupt:
        log.error("interrupted")
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        from recsys.spark.failures import spark_cause

        # a dead JVM comes back as any error, one of ours too (a read that failed); a task whose process died, as
        # the driver's stack of an aborted job: either is said in one line, the error kept for --verbose
        gone = spark_cause(exc)
        if gone is not None:
            log.error("%s", gone)
            log.debug("the error it caused", exc_info=True)
            args.outcome = gone
            return int(ExitCode.UNEXPECTED_ERROR)
        if isinstance(exc, RecsysError):
            log.error("%s", exc)
            args.outcome = first_line(exc)
            return int(exc.exit_code)
        log.exception("unexpected error; this is a bug or an infrastructure failure")
        args.outcome = f"{first_line(exc, with_type=True)} (traceback above)"
        return int(ExitCode.UNEXPECTED_ERROR)


def _config(args: argparse.Namespace):
    """The configuration, read once; its object-store setting is installed for this process (recsys.storage)."""
    from recsys import storage
    from recsys.config import load_config

    cfg = load_config(args.conf, args.overrides)
    storage.install(storage.ObjectStore.of(cfg.storage.s3))
    return cfg


def _launch():
    """The environment's session settings (SPARK_REMOTE, RECSYS_SHUFFLE_PARTITIONS), read here, once."""
    from recsys.config import load_launch_settings

    return load_launch_settings()


def _hooks():
    """Test and game-day hooks (RECSYS_PAUSE_AT, RECSYS_FAULT_INJECTION; docs/faults.md), read here, once."""
    from recsys.config import load_hooks

    return load_hooks()


def _dataset_root(cfg, out: Path | None) -> Path:
    if out is not None:
        return out
    events, catalog = Path(cfg.paths.events), Path(cfg.paths.catalog)
    if events.parent == catalog.parent and events.name == "events" and catalog.name == "catalog":
        return events.parent
    raise ConfigError("paths.events and paths.catalog are not <root>/events and <root>/catalog; pass --out")


def cmd_sample_data(args: argparse.Namespace) -> int:
    from recsys.data.sample import REPEAT_RATE, SampleSpec, generate_sample

    cfg = _config(args)
    repeat_rate = {None: REPEAT_RATE, "chance": None}.get(args.repeat_rate, args.repeat_rate)
    spec = SampleSpec(users=args.users, items=args.items, days=args.days, seed=args.seed, end_date=args.end_date,
                      repeat_rate=repeat_rate)
    summary = generate_sample(_dataset_root(cfg, args.out), spec, progress=log.info, overwrite=args.overwrite)
    print(summary)
    return ExitCode.OK


def cmd_import_movielens(args: argparse.Namespace) -> int:
    from recsys.data.movielens import import_movielens

    cfg = _config(args)
    summary = import_movielens(args.ratings, _dataset_root(cfg, args.out), movies=args.movies, progress=log.info,
                               overwrite=args.overwrite)
    print(summary)
    return ExitCode.OK


def cmd_import_interactions(args: argparse.Namespace) -> int:
    from recsys.data.interactions import ColumnMapping, ImportOptions, import_interactions

    cfg = _config(args)
    delimiter = "\t" if args.delimiter in ("\\t", "tab") else args.delimiter
    columns = ColumnMapping(user=args.user, item=args.item, time=args.time, event_type_column=args.event_type_column,
                            event_type=args.event_type, title=args.title, category=args.category)
    options = ImportOptions(time_format=args.time_format, time_origin=args.time_origin, user_ids=args.user_ids,
                            item_ids=args.item_ids, delimiter=delimiter, header=not args.no_header,
                            encoding=args.encoding, max_bad_share=args.max_bad_share)
    summary = import_interactions(args.csv, _dataset_root(cfg, args.out), columns=columns, options=options,
                                  progress=log.info, overwrite=args.overwrite)
    print(summary)
    return ExitCode.OK


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _config(args)   # first: a bad setting is reported before torch and Spark are imported
    from recsys.pipelines.night import claim_training
    from recsys.pipelines.train import run_training, training_due
    from recsys.spark.session import build_session

    date = args.date or _today()
    if args.if_due:
        reason = training_due(cfg, date)
        if reason is not None:
            log.info("recsys train: not due: %s", reason)
            args.outcome = f"skipped, not due: {reason}"
            return ExitCode.OK
    attempt = claim_training(cfg, date)     # exit 4 while another process trains the date; ends a dead one's run
    try:
        spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-train", launch=_launch(),
                              storage=cfg.storage)
        try:
            result = run_training(spark, cfg, date, force=args.force, hooks=_hooks())
        finally:
            spark.stop()
    finally:
        attempt.end()
    print(result.summary())
    args.outcome = result.summary().splitlines()[0]
    return ExitCode.OK


def recommend_dates(args: argparse.Namespace) -> list[dt.date]:
    """--date D, or --start-date A --end-date B (inclusive, in order); never both."""
    if args.start_date is None and args.end_date is None:
        return [args.date or _today()]
    if args.date is not None:
        raise ConfigError("give either --date or --start-date/--end-date, not both")
    if args.start_date is None or args.end_date is None:
        raise ConfigError("a backfill needs both --start-date and --end-date (inclusive)")
    from recsys.data.contracts import date_range

    try:
        return date_range(args.start_date, args.end_date, names=("--start-date", "--end-date"))
    except ValueError as exc:
        raise ConfigError(f"backfill: {exc}") from None


def cmd_recommend(args: argparse.Namespace) -> int:
    dates = recommend_dates(args)
    if args.accept_guard and len(dates) != 1:
        raise ConfigError("--accept-guard accepts one night on purpose: give it with --date, not with a backfill range")
    cfg = _config(args)   # first: a bad setting is reported before torch and Spark are imported
    from recsys.pipelines.nightly import overall_exit_code, run_dates
    from recsys.spark.session import build_session

    hooks = _hooks()
    spark = build_session(cfg.spark, cfg.scoring.arrow_batch_size, app_name=f"{cfg.spark.app_name}-nightly", launch=_launch(),
                          output=cfg.output, storage=cfg.storage)
    try:
        results = run_dates(spark, cfg, dates, force=args.force, hooks=hooks,
                            accept_guard=dates[0] if args.accept_guard else None)
    finally:
        spark.stop()
    from recsys.cli.outcome import recommend_detail

    args.outcome = recommend_detail(results)

    from recsys.redaction import redact_uri

    for result in results:
        if result.status == RunStatus.SKIPPED:
            print(f"skipped {redact_uri(result.output_dir)}: {result.reason} (pass --force to recompute)")
        else:
            print(f"published {redact_uri(result.output_dir)} (run {result.run_id or 'untracked'})")
    return int(overall_exit_code(results))


def cmd_night(args: argparse.Namespace) -> int:
    cfg = _config(args)   # first: a bad setting is reported before torch and Spark are imported
    from recsys.cli.outcome import recommend_detail
    from recsys.pipelines.night import run_night
    from recsys.spark.session import build_session

    date = args.date or _today()
    spark = build_session(cfg.spark, cfg.scoring.arrow_batch_size, app_name=f"{cfg.spark.app_name}-night",
                          launch=_launch(), output=cfg.output, storage=cfg.storage)
    try:
        result = run_night(spark, cfg, date, force=args.force, hooks=_hooks())
    finally:
        spark.stop()
    detail = recommend_detail([result.nightly])
    args.outcome = f"{result.training_note.splitlines()[0]}; {detail}"
    print(result.training_note)
    print(detail)
    return int(result.exit_code)


def cmd_export(args: argparse.Namespace) -> int:
    cfg = _config(args)   # first: a bad setting is reported before torch and Spark are imported
    from recsys.pipelines.export import run_export
    from recsys.spark.session import build_session

    date = args.date or _today()
    if args.if_configured and not cfg.export.redis_url:
        args.outcome = "skipped, export.redis_url is not set"
        log.info("recsys export: nothing to do, export.redis_url is not set")
        return ExitCode.OK
    spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-export", launch=_launch(), output=cfg.output,
                          storage=cfg.storage)
    try:
        result = run_export(spark, cfg, date, force=args.force, allow_older=args.allow_older, hooks=_hooks())
    finally:
        spark.stop()
    print(result.summary())
    args.outcome = result.summary()
    return int(result.exit_code)


def cmd_rollback(args: argparse.Namespace) -> int:
    from recsys.pipelines import rollback
    from recsys.spark.session import build_session

    cfg = _config(args)
    if args.list:
        rows = rollback.kept(cfg, args.date)
        if not rows:
            print(f"no run directory of {args.date} is kept under {cfg.paths.output}")
        for r in rows:
            mark = "published now" if r.current else ("published before" if r.published else "never published")
            print(f"{r.run}  {mark:16}  model version {r.model_version or '?'}  {r.published_at or ''}".rstrip())
        return ExitCode.OK
    spark = None
    if cfg.output.table is not None:
        spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-rollback", launch=_launch(),
                              output=cfg.output, storage=cfg.storage)
    try:
        old, new = rollback.rollback(spark, cfg, args.date, args.to)
    finally:
        if spark is not None:
            spark.stop()
    print(f"{args.date}: now run {new} (was {old})")
    args.outcome = f"rolled back {args.date} to run {new}"
    return ExitCode.OK


def cmd_metastore(args: argparse.Namespace) -> int:
    from recsys.spark import metastore

    cfg = _config(args)
    directory = Path(cfg.output.metastore.dir)
    running = metastore.running_server(directory)
    if args.action == "status":
        print(f"running: {running['url']} (pid {running['pid']})" if running else f"not running (metastore: "
              f"{metastore.resolve(cfg.output.metastore).describe()})")
        return ExitCode.OK if running else ExitCode.UNEXPECTED_ERROR
    if args.action == "stop":
        print("stopped" if metastore.stop_server(directory) else "not running")
        return ExitCode.OK
    if running:
        print(f"already running: {running['url']} (pid {running['pid']})")
        return ExitCode.OK
    try:
        info = metastore.start_server(directory)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    print(f"metastore server on {info['url']} (pid {info['pid']}); every recsys process with output.metastore.dir="
          f"{directory} uses it. Other Spark sessions: --driver-class-path {metastore.DERBY_CLIENT_JAR} "
          f"--conf spark.sql.catalogImplementation=hive --conf spark.hadoop.javax.jdo.option.ConnectionURL='{info['url']}' "
          f"--conf spark.hadoop.javax.jdo.option.ConnectionDriverName=org.apache.derby.jdbc.ClientDriver")
    return ExitCode.OK


def cmd_sql(args: argparse.Namespace) -> int:
    from functools import partial

    from recsys.cli import sql
    from recsys.spark import metastore
    from recsys.spark.session import build_session

    cfg = _config(args)
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)   # pyspark's page per failed statement:
    if args.print_conf:                                                      # the command says it in one line
        if args.statement is not None:
            raise ConfigError("--print-conf prints settings and runs nothing: give it without a statement")
        sql.print_conf(cfg, sys.stdout)
        return ExitCode.OK
    if args.max_rows < 1:
        raise ConfigError(f"--max-rows {args.max_rows} must be at least 1")
    statements = None
    if args.statement is not None:
        statements, _ = sql.split_statements(args.statement + ";")
        if not statements:
            raise ConfigError(f"no statement in {args.statement!r}; leave it out for a shell reading standard input")
    if cfg.output.table is None:
        log.warning("output.table is null: the session has no metastore, so no table of the job's is there")
    hint = metastore.resolve(cfg.output.metastore).hint() if cfg.output.table is not None else ""
    spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-sql", launch=_launch(), output=cfg.output,
                          storage=cfg.storage)
    try:
        run = partial(sql.run_statement, spark, out=sys.stdout, max_rows=args.max_rows, hint=hint)
        if statements is not None:
            for statement in statements:
                run(statement)
            return ExitCode.OK
        interactive = sys.stdin.isatty()
        if interactive:
            where = metastore.resolve(cfg.output.metastore).describe() if cfg.output.table is not None else "no metastore"
            print(f"recsys sql on {where}: end each statement with ;, quit to leave", file=sys.stderr)
        return sql.shell(run, sys.stdin, interactive=interactive)
    finally:
        spark.stop()


def cmd_runs(args: argparse.Namespace) -> int:
    from recsys.cli import runs

    cfg = _config(args)
    if args.action == "show":
        if not args.which:
            raise ConfigError("recsys runs show needs a date (YYYY-MM-DD) or a run id")
        run = runs.show_run(cfg, args.which)
        text = runs.to_json(run) if args.json else runs.format_run(run)
    else:
        if args.which:
            raise ConfigError(f"unexpected {args.which!r}; did you mean `recsys runs show {args.which}`?")
        rows = runs.list_runs(cfg, last=args.last, date=args.date)
        text = runs.to_json(rows) if args.json else runs.format_table(rows)
    # runs recorded before a secret was known to be one (or by an older version) are masked on the way out too
    print(redact_text(text))
    return ExitCode.OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    from recsys.evaluation.evaluate import EvaluationRequest, check_dataset_root, run_evaluation
    from recsys.spark.session import build_session

    if args.protocol == "backtest":
        if args.k or args.split_date or args.seeds != 1:
            raise ConfigError("--k, --split-date and --seeds do not apply to --protocol backtest (it measures HR and "
                              "NDCG at 10 and recall at scoring.top_n of the job's own lists)")
        return cmd_backtest(args)
    if args.start is not None or args.end is not None:
        raise ConfigError(f"--from/--to belong to --protocol backtest, not {args.protocol}")
    if args.data is None:
        raise ConfigError(f"--protocol {args.protocol} needs --data DIR (a dataset root in the input layout)")
    cfg = _config(args)
    check_dataset_root(args.data)
    spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-evaluate", launch=_launch(), storage=cfg.storage)
    try:
        request = EvaluationRequest(args.data, args.protocol, ks=tuple(args.k) if args.k else None,
                                    tie_break_seed=args.tie_seed, split_date=args.split_date,
                                    test_days=args.test_days, json_path=args.json, seeds=args.seeds)
        result = run_evaluation(spark, cfg, request)
    finally:
        spark.stop()
    print(result.table)
    if result.run_id:
        print(f"\nlogged to MLflow run {result.run_id} (experiment {cfg.mlflow.experiment}-evaluation)")
    return ExitCode.OK


def cmd_backtest(args: argparse.Namespace) -> int:
    from recsys.cli.backtest import BacktestRequest, check_request, run_backtest, scratch_config, with_data
    from recsys.spark.session import build_session

    if args.start is None or args.end is None:
        raise ConfigError("the backtest needs --from D1 and --to D2 (the nights, inclusive), e.g. --from 2024-01-25 "
                          "--to 2024-01-31")
    cfg = _config(args)
    if args.data is not None:
        from recsys.evaluation.evaluate import check_dataset_root

        check_dataset_root(args.data)
        cfg = with_data(cfg, args.data)
    request = BacktestRequest(args.start, args.end, args.work, train_every=args.train_every, model_uri=args.model_uri,
                              json_path=args.json, overwrite=args.overwrite)
    nights = check_request(cfg, request)          # before Spark starts: a bad range costs nothing
    scratch = scratch_config(cfg, request.work)   # the session's settings: no output table, no metastore
    spark = build_session(cfg.spark, cfg.scoring.arrow_batch_size, app_name=f"{cfg.spark.app_name}-backtest",
                          launch=_launch(), output=scratch.output, storage=cfg.storage)
    try:
        result = run_backtest(spark, cfg, request)
    finally:
        spark.stop()
    print(result.table)
    print(f"\n{len(nights)} night(s) in {result.seconds:.0f} s. Logged to MLflow run {result.run_id or '(not recorded)'}, "
          f"experiment {result.experiment}, in the backtest's own store: mlflow ui --backend-store-uri "
          f"{result.tracking_uri}")
    return ExitCode.OK


def cmd_demo(args: argparse.Namespace) -> int:
    from recsys.cli.demo import run_demo

    cfg = _config(args)
    return int(run_demo(cfg, data=args.data, synthetic=args.synthetic, launch=_launch()))


def cmd_bench(args: argparse.Namespace) -> int:
    from recsys.bench import shapes
    from recsys.bench.run import BenchOptions, format_table, run_bench, write_json
    from recsys.bench.shapes import BenchShape

    shape = BenchShape(users=args.users, items=args.items, dim=args.dim, history=args.history, top_n=args.top_n,
                       seed=args.seed)
    scoring = shapes.params(shape, chunk_size=args.chunk_size, device=args.device, dtype=args.dtype,
                            item_tile=args.item_tile, max_tile_mb=args.max_tile_mb)
    opts = BenchOptions(shape=shape, repeats=args.repeats, cores=args.cores, scoring=scoring,
                        arrow_batch_size=args.arrow_batch_size, core_only=args.core_only,
                        skip=tuple(x.strip() for x in args.skip.split(",") if x.strip()), work_dir=args.work_dir)
    result = run_bench(opts, log=log.info)
    print(format_table(result), flush=True)
    if args.json:
        write_json(result, args.json)
    return ExitCode.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
