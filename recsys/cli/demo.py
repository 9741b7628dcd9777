"""``recsys demo`` (what ``make demo`` runs): data -> train -> recommend -> export, then show what came out.

It ends by exporting the night to a Redis of its own (the server the project's set-up installs, on loopback,
its data in ``.recsys/redis/``) and printing one lookup through ``recsys serve``'s URL; both servers are
stopped before it exits, and it prints the commands that bring them back.

It runs on the embedded default configuration, so afterwards ``recsys recommend --date D`` in the
same directory reruns the nightly job on the demo's data and model.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq

from recsys.config import Config, LaunchSettings
from recsys.errors import ConfigError, ExitCode
from recsys.publish import manifest
from recsys.uris import local_path
from recsys.redaction import redact_text

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]   # recsys/cli/demo.py -> the checkout
MOVIELENS_CANDIDATES = (
    Path("../shared/data/ml-latest-small"),
    REPO_ROOT.parent / "shared" / "data" / "ml-latest-small",
    REPO_ROOT / "data" / "ml-latest-small",
)
IMPORT_MARKER = "_recsys_import.json"


def find_movielens() -> Path | None:
    for candidate in MOVIELENS_CANDIDATES:
        if (candidate / "ratings.csv").is_file():
            return candidate.resolve()
    return None


def run_demo(cfg: Config, *, data: Path | None = None, synthetic: bool = False, spark=None,
             launch: LaunchSettings | None = None) -> ExitCode:
    """``spark``: an existing session to use (and leave running); by default the demo builds its own
    (with ``launch``, the environment's session settings)."""
    from recsys.learning.shards import training_window
    from recsys.pipelines.nightly import run_nightly
    from recsys.pipelines.train import run_training
    from recsys.spark.session import apply_runtime_settings, build_session

    root = _dataset_root(cfg)
    date = _prepare_data(root, data, synthetic)
    print(f"\n== recsys demo: data in {root}, producing recommendations for {date} ==\n", flush=True)
    own_session = spark is None
    if own_session:
        spark = build_session(cfg.spark, cfg.scoring.arrow_batch_size, app_name=f"{cfg.spark.app_name}-demo", launch=launch,
                              output=cfg.output, storage=cfg.storage)
    else:
        apply_runtime_settings(spark, cfg.scoring.arrow_batch_size)
    try:
        # training and the night read one window, once (as recsys night does)
        with training_window(spark, cfg, date) as kept:
            trained = run_training(spark, cfg, date, kept=kept)
            result = run_nightly(spark, cfg, date, kept=kept)
        table_rows = _table_rows(spark, cfg, date)
        _show(cfg, result, trained, table_rows)
        redis, cfg = _start_redis(cfg)
        try:
            exported = _export(spark, cfg, date)
            _lookup_through_serve(cfg, result)
        finally:
            redis.stop()
    finally:
        if own_session:
            spark.stop()
    return max(result.exit_code, exported.exit_code)


def _start_redis(cfg: Config):
    """The demo's Redis on loopback (a free port, data in .recsys/redis), and the config that exports to it."""
    from recsys.export.local_redis import LocalRedis

    server = LocalRedis(local_path(cfg.paths.output).parent / "redis", appendfsync="everysec").start()
    export = cfg.export.model_copy(update={"redis_url": server.url})
    return server, cfg.model_copy(update={"export": export})


def _export(spark, cfg: Config, date: dt.date):
    from recsys.pipelines.export import run_export

    result = run_export(spark, cfg, date)
    print(f"\n== exported to Redis ==\n   {result.summary()}", flush=True)
    return result


def _lookup_through_serve(cfg: Config, result) -> None:
    """`recsys serve` on the demo's Redis: one GET through its URL, printed, then the frontend stopped."""
    import subprocess
    import sys

    import yaml

    from recsys.processes import free_port

    out = local_path(cfg.paths.output).parent
    conf = out / "demo-serve.yaml"
    conf.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    port = free_port()
    log_file = out / "demo-serve.log"
    user = min(pq.read_table(local_path(result.output_dir), columns=["user_id"]).column("user_id").to_pylist())
    url = f"http://127.0.0.1:{port}/v1/users/{user}/recommendations?top_n=5"
    with open(log_file, "w") as log_out:
        serve = subprocess.Popen([sys.executable, "-m", "recsys.cli", "serve", "--conf", str(conf), "--port", str(port),
                                  "--set", f"serve.store={cfg.export.redis_url}"],
                                 stdout=log_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            answer = _first_answer(serve, url, log_file)
        finally:
            serve.terminate()
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                serve.kill()
    print(f"\n== one lookup through recsys serve ==\n   GET {url}\n   {json.dumps(answer)}")
    print("\n== serve the lists yourself ==")
    print(f"   .venv/bin/redis-server --port {cfg.export.redis_url.rsplit(':', 1)[1].split('/')[0]} --dir {out / 'redis'} "
          f"--appendonly yes &")
    print(f"   .venv/bin/recsys serve --set serve.store={cfg.export.redis_url}      # or serve.store=embedded: "
          f"no Redis needed")
    print(f"   curl -s 'http://127.0.0.1:8000/v1/users/{user}/recommendations?top_n=5'\n", flush=True)


def _first_answer(serve, url: str, log_file: Path, timeout_s: float = 120.0) -> dict:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"recsys serve exited with {serve.returncode}; see {log_file}")
        try:
            response = httpx.get(url, timeout=10)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"recsys serve did not answer {url} within {timeout_s:.0f}s; see {log_file}")


def _dataset_root(cfg: Config) -> Path:
    events, catalog = local_path(cfg.paths.events), local_path(cfg.paths.catalog)
    if events.parent != catalog.parent or events.name != "events" or catalog.name != "catalog":
        raise ConfigError("the demo writes <root>/events and <root>/catalog; paths.events and paths.catalog must "
                          "be siblings named like that")
    return events.parent


def _synthetic_source() -> dict:
    """The demo's synthetic data, as recorded in its marker: data written by an older generator (another
    repeat rate) is generated again, not reused."""
    from recsys.data.sample import REPEAT_RATE

    return {"kind": "synthetic", "users": 2000, "items": 1000, "days": 28, "seed": 7, "repeat_rate": REPEAT_RATE}


def _prepare_data(root: Path, data: Path | None, synthetic: bool) -> dt.date:
    """Import (or generate) the demo data once; later demos reuse it. Returns the date to run for."""
    marker = root / IMPORT_MARKER
    if synthetic:
        source = _synthetic_source()
    else:
        movielens = data.resolve() if data else find_movielens()
        if movielens is None:
            log.warning("MovieLens not found (looked in %s); using synthetic sample data",
                        ", ".join(str(p) for p in MOVIELENS_CANDIDATES))
            source = _synthetic_source()
        else:
            ratings = movielens / "ratings.csv"
            source = {"kind": "movielens", "ratings": str(ratings), "size": ratings.stat().st_size}
    if marker.is_file():
        previous = json.loads(marker.read_text())
        if previous.get("source") == source:
            log.info("demo data already in %s (%s); reusing it", root, source["kind"])
            return dt.date.fromisoformat(previous["run_date"])
    elif any(any((root / sub).glob("dt=*")) for sub in ("events", "catalog")):
        raise ConfigError(f"{root} holds a dataset the demo did not write; refusing to overwrite it. "
                          f"Run the demo with the embedded default configuration or point paths.* elsewhere")
    if source["kind"] == "movielens":
        from recsys.data.movielens import import_movielens

        movies = Path(source["ratings"]).with_name("movies.csv")
        summary = import_movielens(Path(source["ratings"]), root, movies=movies if movies.is_file() else None,
                                   progress=log.info, overwrite=True)
        last = summary.last_date
    else:
        from recsys.data.sample import SampleSpec, generate_sample

        spec = SampleSpec(users=source["users"], items=source["items"], days=source["days"], seed=source["seed"],
                          repeat_rate=source["repeat_rate"])
        summary = generate_sample(root, spec, progress=log.info, overwrite=True)
        last = summary.last_date
    log.info("%s", summary)
    run_date = last + dt.timedelta(days=1)
    marker.write_text(json.dumps({"source": source, "run_date": str(run_date)}, indent=2))
    return run_date


def _table_rows(spark, cfg: Config, date: dt.date) -> tuple[str, int] | None:
    """The query a reader of the table runs, and its answer (None without output.table)."""
    if cfg.output.table is None:
        return None
    query = f"select count(*) from {cfg.output.table} where dt = '{date}'"
    return query, int(spark.sql(query).first()[0])


def _show(cfg: Config, result, trained, table_rows: tuple[str, int] | None = None) -> None:
    """Print where the output is, a few users' lists with titles, and how to open MLflow."""
    out = local_path(result.output_dir)
    table = pq.read_table(out, columns=["user_id", "recommendations", "source"])
    titles = _titles(cfg, str(result.manifest.catalog_snapshot))
    counts = result.manifest.counts
    print(f"\n== published {out} ==")
    print(f"   {counts.rows:,} users: {counts.model_users:,} scored by model version "
          f"{result.manifest.model.version}, {counts.fallback_users:,} on the popularity fallback")
    print(f"   training: {trained.summary()}")
    if table_rows is not None:
        print(f"   table {cfg.output.table}: spark.sql(\"{table_rows[0]}\") -> {table_rows[1]:,} "
              f"(metastore: {cfg.output.metastore.dir})")
    rows = table.sort_by("user_id").slice(0, 3).to_pylist()
    for row in rows:
        print(f"\n   user {row['user_id']} ({row['source']}):")
        for rank, rec in enumerate(row["recommendations"][:5], 1):
            print(f"     {rank}. {titles.get(rec['item_id'], '?')}  (item {rec['item_id']}, score {rec['score']:.3f})")
    uri = redact_text(cfg.mlflow.tracking_uri)   # not redact_uri: it rewrites sqlite:///x as sqlite:/x
    print("\n== next ==")
    print(f"   inspect runs:   .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000   (then open "
          "http://127.0.0.1:5000/#/experiments?workflowType=machine_learning: the model-training view)")
    print(f"   rerun the job:  .venv/bin/recsys recommend --date {result.date}")
    print(f"   run id {result.run_id}; manifest: {out / manifest.NAME}\n", flush=True)


def _titles(cfg: Config, snapshot: str) -> dict[int, str]:
    """item_id -> title of the snapshot; {} for a catalog without titles (they are optional there)."""
    dataset = ds.dataset(local_path(cfg.paths.catalog) / f"dt={snapshot}", format="parquet")
    if "title" not in dataset.schema.names:
        return {}
    table = dataset.to_table(columns=["item_id", "title"])
    return dict(zip(table.column("item_id").to_pylist(), table.column("title").to_pylist()))
