"""The ``recsys`` command line: thin wrappers that read config once and call the library.

Every command exits with a documented code (see ``recsys.errors.ExitCode`` and the README):
expected failures print one line without a traceback; unexpected ones print the traceback.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from recsys.errors import ConfigError, ExitCode, RecsysError

log = logging.getLogger("recsys")


def _date(value: str) -> dt.date:
    from recsys.data.contracts import parse_date

    try:
        return parse_date(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _today() -> dt.date:
    return dt.datetime.now(dt.timezone.utc).date()


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conf", metavar="FILE", help="YAML config merged over the embedded default")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config key, e.g. --set scoring.top_n=50 (repeatable)")


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

    p = sub.add_parser("train", help="train a model on events before a date, register it, move the alias if it is not worse")
    p.add_argument("--date", type=_date, default=None, help="train on events strictly before this date (default: today, UTC)")
    p.add_argument("--force", action="store_true", help="move the alias even if the new version validates worse")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("recommend", help="run the nightly job for one date (same as jobs/nightly_recommendations.py)")
    p.add_argument("--date", type=_date, default=None, help="the partition to produce (default: today, UTC)")
    _add_config_args(p)
    p.set_defaults(func=cmd_recommend)

    p = sub.add_parser("evaluate", help="compare the models and baselines (popularity, Spark ALS) on a protocol; "
                                        "print the table, log it to MLflow")
    p.add_argument("--data", type=Path, required=True,
                   help="dataset root in the input layout (events/ and catalog/), e.g. from import-movielens --out")
    p.add_argument("--protocol", choices=("loo", "temporal"), default="loo",
                   help="loo: leave the last item out per user (the second-to-last validates); temporal: train "
                        "before --split-date, test on the following --test-days (default: loo)")
    p.add_argument("--k", type=int, action="append", default=None, metavar="K",
                   help="metric cut-off, repeatable (default: evaluation.ks, i.e. 10)")
    p.add_argument("--tie-seed", type=int, default=None,
                   help="seed of the hash that orders equal timestamps (default: history.tie_break_seed, i.e. 7)")
    p.add_argument("--split-date", type=_date, default=None,
                   help="temporal: first test day (default: the data's last --test-days days are the test window)")
    p.add_argument("--test-days", type=int, default=30,
                   help="temporal: days in the test window, and in the validation window before it (default: 30)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the table's figures as JSON")
    _add_config_args(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("demo", help="data -> train -> recommend on the bundled MovieLens sample, then show the results")
    p.add_argument("--data", type=Path, help="a MovieLens directory (ratings.csv + movies.csv); default: "
                                             "../shared/data/ml-latest-small, else the bundled copy")
    p.add_argument("--synthetic", action="store_true", help="use generated sample data instead of MovieLens")
    _add_config_args(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from recsys.progress import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    return run_command(args.func, args)


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Map outcomes to exit codes: one line for expected failures, a traceback for the rest."""
    try:
        return int(func(args))
    except RecsysError as exc:
        log.error("%s", exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Exception:
        log.exception("unexpected error; this is a bug or an infrastructure failure")
        return int(ExitCode.UNEXPECTED_ERROR)


def _config(args: argparse.Namespace):
    from recsys.config import load_config

    return load_config(args.conf, args.overrides)


def _dataset_root(cfg, out: Path | None) -> Path:
    if out is not None:
        return out
    events, catalog = Path(cfg.paths.events), Path(cfg.paths.catalog)
    if events.parent == catalog.parent and events.name == "events" and catalog.name == "catalog":
        return events.parent
    raise ConfigError("paths.events and paths.catalog are not <root>/events and <root>/catalog; pass --out")


def cmd_sample_data(args: argparse.Namespace) -> int:
    from recsys.data.sample import generate_sample

    cfg = _config(args)
    summary = generate_sample(_dataset_root(cfg, args.out), users=args.users, items=args.items, days=args.days,
                              seed=args.seed, end_date=args.end_date, progress=log.info,
                              overwrite=args.overwrite)
    print(summary)
    return ExitCode.OK


def cmd_import_movielens(args: argparse.Namespace) -> int:
    from recsys.data.movielens import import_movielens

    cfg = _config(args)
    summary = import_movielens(args.ratings, _dataset_root(cfg, args.out), movies=args.movies, progress=log.info,
                               overwrite=args.overwrite)
    print(summary)
    return ExitCode.OK


def cmd_train(args: argparse.Namespace) -> int:
    from recsys.spark_session import build_session
    from recsys.train import run_training

    cfg = _config(args)
    spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-train")
    try:
        result = run_training(spark, cfg, args.date or _today(), force=args.force)
    finally:
        spark.stop()
    print(result.summary())
    return ExitCode.OK


def cmd_recommend(args: argparse.Namespace) -> int:
    from recsys.nightly import run_nightly
    from recsys.spark_session import build_session

    cfg = _config(args)
    spark = build_session(cfg.spark, cfg.scoring, app_name=f"{cfg.spark.app_name}-nightly")
    try:
        result = run_nightly(spark, cfg, args.date or _today())
    finally:
        spark.stop()
    print(f"published {result.output_dir} (run {result.run_id or 'untracked'})")
    return int(result.exit_code)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from recsys.evaluation.evaluate import check_dataset_root, run_evaluation
    from recsys.spark_session import build_session

    cfg = _config(args)
    check_dataset_root(args.data)
    spark = build_session(cfg.spark, app_name=f"{cfg.spark.app_name}-evaluate")
    try:
        result = run_evaluation(spark, cfg, args.data, protocol=args.protocol, ks=tuple(args.k) if args.k else None,
                                tie_break_seed=args.tie_seed, split_date=args.split_date, test_days=args.test_days,
                                json_path=args.json)
    finally:
        spark.stop()
    print(result.table)
    if result.run_id:
        print(f"\nlogged to MLflow run {result.run_id} (experiment {cfg.mlflow.experiment}-evaluation)")
    return ExitCode.OK


def cmd_demo(args: argparse.Namespace) -> int:
    from recsys.demo import run_demo

    cfg = _config(args)
    return int(run_demo(cfg, data=args.data, synthetic=args.synthetic))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
