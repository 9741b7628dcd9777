"""Bad input through the real ``recsys recommend`` command: exit code 2, one line naming the problem,
no traceback, and nothing published (a partition published earlier for the date stays byte-identical).

Each test spoils a copy of one small dataset; the job runs on the shared Spark session.
"""
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobkit
from jobkit import RUN_DATE
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    store = jobkit.make_store(tmp_path_factory.mktemp("store"))
    data = jobkit.write_dataset(tmp_path_factory.mktemp("data"))
    return store, data


@pytest.fixture
def case(env, tmp_path):
    """A fresh copy of the dataset, with a partition 'published earlier' for the run date."""
    store, data = env
    root = jobkit.copy_dataset(data, tmp_path)
    old = root / "recommendations" / f"dt={RUN_DATE}"
    old.mkdir(parents=True)
    pq.write_table(pa.table({"user_id": [1], "source": ["model"]}), old / "part-00000-old.parquet")
    (old / "_SUCCESS").write_bytes(b"")
    (old / "_manifest.json").write_text(json.dumps({"run_id": "earlier", "model": {"version": "0"},
                                                    "config_digest": "earlier"}))
    return store, root, jobkit.snapshot(old)


def _recommend_fails(monkeypatch, spark, caplog, capsys, case, *extra: str, match: str, args=()) -> str:
    """Run the job; assert exit 2, exactly one error line matching ``match``, no traceback, nothing published.

    ``extra``: config overrides; ``args``: further command-line arguments.
    """
    store, root, before = case
    caplog.clear()
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE), *args,
                                           *jobkit.recommend_args(root, store, *extra)])
    errors = jobkit.errors_logged(caplog)
    out = capsys.readouterr()
    assert code == ExitCode.BAD_INPUT == 2, errors
    assert len(errors) == 1, errors
    assert re.search(match, errors[0]), errors[0]
    assert "Traceback" not in caplog.text and "Traceback" not in out.err
    assert all(r.exc_info is None for r in caplog.records if r.name.startswith("recsys"))
    output = root / "recommendations"
    assert jobkit.partitions(output) == [f"dt={RUN_DATE}"]
    assert jobkit.snapshot(output / f"dt={RUN_DATE}") == before          # the earlier partition is untouched
    assert not list(output.glob("_staging/*/*")) and not list(output.glob("_locks/*.lock"))
    # the failed run's directory is gone: what is left is at most the earlier partition, adopted as a run
    # directory when the job got as far as bringing the date in line (errors found before it leave none)
    kept = jobkit.runs(output)
    assert len(kept) <= 1 and all(
        json.loads((output / "_runs" / run / "_manifest.json").read_text())["run_id"] == "earlier" for run in kept), kept
    return errors[0]


def _rewrite(directory: Path, table: pa.Table) -> None:
    shutil.rmtree(directory)
    directory.mkdir(parents=True)
    pq.write_table(table, directory / "part-00000.parquet")


def test_no_events_in_the_window(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    shutil.rmtree(root / "events" / "dt=2024-05-07")
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, "history.window_days=1",   # the window is 05-07 only
                     match=r"no events between 2024-05-07 and 2024-05-08")


def test_events_whose_ids_are_all_null_leave_no_usable_events(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    for part in (root / "events").iterdir():
        table = pq.read_table(next(part.glob("*.parquet")))
        _rewrite(part, table.set_column(0, "user_id", pa.nulls(len(table), pa.int64())))
    msg = _recommend_fails(monkeypatch, spark, caplog, capsys, case, match=r"no usable events between")
    assert "without a user" in msg


def test_no_catalog_snapshot_on_or_before_the_date(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    shutil.move(root / "catalog" / "dt=2024-05-01", root / "catalog" / "dt=2024-05-09")   # only a later one
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"no catalog snapshot on or before 2024-05-08 under .*catalog")


def test_a_catalog_older_than_the_configured_maximum_age(monkeypatch, spark, caplog, capsys, case):
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, "catalog.max_age_days=3",
                     match=r"newest catalog snapshot on or before 2024-05-08 is 2024-05-01, 7 days old, "
                           r"older than catalog.max_age_days=3")


def test_an_empty_catalog(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    _rewrite(root / "catalog" / "dt=2024-05-01", jobkit.catalog_table(items=[]))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, match=r"catalog snapshot 2024-05-01 .* is empty")


def test_a_catalog_without_available_items(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    _rewrite(root / "catalog" / "dt=2024-05-01", jobkit.catalog_table(unavailable=set(range(1, 31))))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, match=r"has 30 items but none is available")


def test_a_catalog_whose_available_items_the_model_does_not_know(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    _rewrite(root / "catalog" / "dt=2024-05-01", jobkit.catalog_table(items=range(1000, 1010)))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"none of the 10 available items in catalog snapshot 2024-05-01 is known to model version")


def test_schema_drift_a_missing_column(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    _rewrite(root / "catalog" / "dt=2024-05-01", jobkit.catalog_table().drop_columns(["available"]))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"catalog file .*dt=2024-05-01/part-00000.parquet lacks column\(s\) \['available'\]")


def test_schema_drift_a_column_renamed_in_the_newest_partition_only(monkeypatch, spark, caplog, capsys, case):
    # Left to Spark, the other files' schema would win and the new day's users would read as nulls.
    _, root, _ = case
    day = root / "events" / "dt=2024-05-07"
    table = pq.read_table(next(day.glob("*.parquet")))
    _rewrite(day, table.rename_columns(["userId", "item_id", "event_type", "ts"]))
    msg = _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                           match=r"events file .*dt=2024-05-07/part-00000.parquet lacks column\(s\) \['user_id'\]")
    assert "userId" in msg


def test_schema_drift_a_wrong_type_in_the_newest_partition_only(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    day = root / "events" / "dt=2024-05-07"
    table = pq.read_table(next(day.glob("*.parquet")))
    _rewrite(day, table.set_column(1, "item_id", table.column("item_id").cast(pa.string())))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"events column 'item_id' in file .*dt=2024-05-07/part-00000.parquet has type string, "
                           r"expected bigint")


def test_null_item_ids_in_the_catalog(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    table = jobkit.catalog_table()
    ids = table.column("item_id").to_pylist()
    ids[4] = None
    _rewrite(root / "catalog" / "dt=2024-05-01", table.set_column(0, "item_id", pa.array(ids, pa.int64())))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, match=r"has 1 row\(s\) with a null item_id")


def test_duplicate_catalog_rows(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    table = jobkit.catalog_table()
    _rewrite(root / "catalog" / "dt=2024-05-01", pa.concat_tables([table, table.slice(2, 2)]))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"has 2 duplicate row\(s\) \(item_id 3, 4 among them\)")


def test_a_file_that_is_not_parquet(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    (root / "events" / "dt=2024-05-06" / "part-99999.parquet").write_bytes(b"PAR1 truncated upload")
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"events file .*dt=2024-05-06/part-99999.parquet is not a readable Parquet file")


def test_a_parquet_file_corrupt_behind_a_valid_footer(monkeypatch, spark, caplog, capsys, case):
    # The footer check passes; Spark fails while decoding pages, and that failure is translated too.
    _, root, _ = case
    day = root / "events" / "dt=2024-05-06"
    path = next(day.glob("*.parquet"))
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    for i in range(4, len(data) - footer_len - 8):   # every data page byte, header and values alike
        data[i] = 0xFF
    path.write_bytes(bytes(data))
    _recommend_fails(monkeypatch, spark, caplog, capsys, case,
                     match=r"events: Spark cannot read .*dt=2024-05-06/.*\.parquet")


def test_invalid_configuration_values(monkeypatch, spark, caplog, capsys, case):
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, "scoring.top_n=0",
                     match=r"config key 'scoring.top_n' = 0: Input should be greater than or equal to 1")
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, "paths.work=../elsewhere",
                     match=r"config key 'paths.work' .* must not contain '..'")


def test_an_output_path_inside_an_input_dataset(monkeypatch, spark, caplog, capsys, case):
    _, root, _ = case
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, f"paths.output={root / 'events' / 'recs'}",
                     match=r"paths.output=.* overlaps paths.events")


def test_a_missing_model_alias(monkeypatch, spark, caplog, capsys, case):
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, "mlflow.alias=nosuch",
                     match=r"no model at models:/recsys-test@nosuch .*run `recsys train` first")


def test_an_unknown_fault_injection_name(monkeypatch, spark, caplog, capsys, case):
    monkeypatch.setenv("RECSYS_FAULT_INJECTION", "fail_everything")
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, match=r"RECSYS_FAULT_INJECTION holds unknown faults")


def test_a_backfill_range_given_with_a_date(monkeypatch, spark, caplog, capsys, case):
    _recommend_fails(monkeypatch, spark, caplog, capsys, case, args=["--start-date", "2024-05-01", "--end-date",
                                                                      "2024-05-02"],
                     match=r"either --date or --start-date/--end-date")


def test_a_backfill_range_that_ends_before_it_starts(monkeypatch, spark, caplog, capsys, case):
    store, root, _ = case
    caplog.clear()
    code = jobkit.cli(monkeypatch, spark, ["recommend", "--start-date", "2024-05-09", "--end-date", "2024-05-08",
                                           *jobkit.recommend_args(root, store)])
    assert code == 2 and "--end-date 2024-05-08 is before --start-date 2024-05-09" in jobkit.errors_logged(caplog)[0]


@pytest.mark.slow   # 40-50 s on 2 cores: out of the fast loop (make test-fast)
def test_a_scoring_dtype_the_workers_cannot_run(monkeypatch, spark, caplog, capsys, case):
    """The executors refuse a dtype their device cannot run natively (float16 on a CPU here; bf16 on a CPU
    without AVX-512-BF16 or AMX-BF16 takes the same path): the driver reports their reason as bad
    configuration, not as a crashed stage with a worker traceback."""
    error = _recommend_fails(monkeypatch, spark, caplog, capsys, case, "scoring.dtype=float16", "scoring.device=cpu",
                             match=r"the executors refused scoring\.dtype=float16: .*float16 is for CUDA devices")
    assert "PythonException" not in error and "\n" not in error


@pytest.mark.slow   # 40-50 s on 2 cores: new Python workers start for the changed environment
def test_int8_on_workers_whose_cpu_cannot_run_it(monkeypatch, spark, caplog, capsys, case):
    """int8 where the executors' CPU has no integer dot products: the same exit 2 with their reason. The
    workers get ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's own cap, which the capability check honours), so
    on any CPU their oneDNN really is held below VNNI; Spark starts new Python workers for the changed
    environment and the session's other workers keep theirs."""
    monkeypatch.setitem(spark.sparkContext.environment, "ONEDNN_MAX_CPU_ISA", "AVX2")
    error = _recommend_fails(monkeypatch, spark, caplog, capsys, case, "scoring.dtype=int8", "scoring.device=cpu",
                             match=r"the executors refused scoring\.dtype=int8: scoring\.dtype=int8 needs a CPU with "
                                   r"AMX-INT8, AVX-512-VNNI or AVX-VNNI")
    assert "PythonException" not in error and "\n" not in error


@pytest.mark.slow          # a training and a night: about 16 s on a warm session
def test_a_night_opens_no_file_outside_its_window_neither_training_nor_scoring(monkeypatch, spark, env, tmp_path):
    """A night reads only its window, in training as in scoring: a file that is not Parquet in a partition
    older than ``history.window_days``, and one in the partition of the run date itself (tomorrow's log, for
    this night), stop nothing and are never opened (any reader that listed or checked them would exit 2)."""
    store, data = env
    root = jobkit.copy_dataset(data, tmp_path)
    for day in ("2024-04-20", str(RUN_DATE)):
        partition = root / "events" / f"dt={day}"
        partition.mkdir()
        (partition / "part-00000.parquet").write_bytes(b"PAR1 truncated upload")
    window = "history.window_days=7"                                       # 2024-05-01..07
    tiny = ["train.epochs=1", "train.device=cpu", "train.model.sasrec.dim=8", "train.model.sasrec.layers=1",
            "train.model.sasrec.heads=1", "train.model.sasrec.max_len=8", f"mlflow.model_name={store.model_name}-window"]
    assert jobkit.cli(monkeypatch, spark, ["train", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(root, store, window, *tiny)]) == 0
    assert jobkit.cli(monkeypatch, spark, ["recommend", "--date", str(RUN_DATE),
                                           *jobkit.recommend_args(root, store, window)]) == 0
    manifest = json.loads((root / "recommendations" / f"dt={RUN_DATE}" / "_manifest.json").read_text())
    assert manifest["counts"]["rows"] == jobkit.N_USERS
