"""Orchestrates ``recsys bench``: every system on the same data, cores and threads, interleaved
repetitions, medians, ratios, peak memory; prints a table and optionally writes JSON.

With ``--core-only`` nothing but torch, numpy and pyarrow is imported (no Spark, MLflow or
pydantic), so it runs on a bare GPU machine.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from recsys.bench import core_bench, shapes
from recsys.scoring.core import Scorer, check_dtype
from recsys.scoring.params import ScoringParams


def dtype_refusal(dtype: str, device: torch.device) -> str:
    """Why the rows of ``dtype`` cannot run here ('' when they can): the scoring core's own refusal."""
    try:
        check_dtype(dtype, device)
    except ValueError as e:
        return str(e)
    return ""

BARE, BARE_THREADS, JOB, PBU, ALS = "bare_core", "bare_core_threads", "job_stage", "predict_batch_udf", "spark_als"
REF, BF16, INT8, JOB_INT8 = "reference_core", "bare_core_bf16", "bare_core_int8", "job_stage_int8"
LABELS = {
    REF: "reference core (all positions, full sort), fp32",
    BARE: "bare core, 1 process, N torch threads",
    BARE_THREADS: "bare core, 1 process, N threads x 1 torch thread",
    BF16: "bare core, bfloat16",
    INT8: "bare core, int8",
    JOB: "job scoring stage (Spark, mapInArrow + cache)",
    JOB_INT8: "job scoring stage, int8",
    PBU: "predict_batch_udf wrapping the same core",
    ALS: "Spark ALS recommendForAllUsers (rank = dim)",
}


@dataclass
class BenchOptions:
    """What to run. ``scoring``: the job's scoring settings the systems run with (default: the job's
    defaults for the shape's top N, on the CPU), the same object the nightly stage hands its workers."""

    shape: shapes.BenchShape
    repeats: int = 3
    cores: int = 2
    scoring: ScoringParams | None = None
    arrow_batch_size: int = 10_000
    core_only: bool = False
    skip: tuple[str, ...] = ()
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        self.scoring = self.scoring or shapes.params(self.shape, device="cpu")
        if self.scoring.top_n != self.shape.top_n:
            raise ValueError(f"scoring.top_n {self.scoring.top_n} differs from the shape's top N {self.shape.top_n}")


class PeakRss:
    """Samples a process's resident memory in a background thread and keeps the peak (MB)."""

    def __init__(self, pid: int, interval: float = 0.2):
        import psutil

        self._proc = psutil.Process(pid)
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.peak_mb = max(self.peak_mb, self._proc.memory_info().rss / 2**20)
            except Exception:  # the process ended: keep what was seen
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def run_bench(opts: BenchOptions, log: Callable[[str], None] = print) -> dict:
    shape = opts.shape
    torch.set_num_threads(opts.cores)
    settings = opts.scoring
    device = torch.device(settings.device)
    log(f"generating {shape.users:,} users x {shape.items:,} items, history {shape.history}, dim {shape.dim}")
    user_ids, seqs = shapes.histories(shape)
    net = shapes.model(shape)
    scorer = shapes.scorer(shape, net, device, settings)
    chunks = core_bench.contiguous_chunks(seqs, settings.chunk_size)
    core_bench.score_chunks(scorer, user_ids, chunks[:1])  # warm-up: kernels, allocator, caches

    threads_mode = device.type == "cpu" and opts.cores > 1

    def timed(sc: Scorer) -> Callable[[], float]:
        """The reference and bf16 rows run as the faster bare row usually does: N threads x 1 torch
        thread on a multi-core CPU (how Spark runs tasks), one process otherwise."""
        if threads_mode:
            return lambda: core_bench.score_chunks_parallel(sc, user_ids, chunks, opts.cores)[0]
        return lambda: core_bench.score_chunks(sc, user_ids, chunks)[0]

    systems: dict[str, Callable[[], float]] = {}
    extra: dict = {"device": str(device), "torch": torch.__version__, "threads": opts.cores}
    if REF not in opts.skip:
        reference = shapes.scorer(shape, net, device, replace(settings, dtype="float32"), reference=True)
        systems[REF] = timed(reference)
        extra["reference_identical_lists"] = core_bench.agreement(reference, scorer, chunks[0][2])
    systems[BARE] = lambda: core_bench.score_chunks(scorer, user_ids, chunks)[0]
    if threads_mode:
        systems[BARE_THREADS] = lambda: core_bench.score_chunks_parallel(scorer, user_ids, chunks, opts.cores)[0]
    if BF16 not in opts.skip and settings.dtype == "float32":
        refusal = dtype_refusal("bfloat16", device)
        if refusal:
            extra["bf16_skipped"] = refusal
        else:
            bf16 = shapes.scorer(shape, net, device, replace(settings, dtype="bfloat16"))
            core_bench.score_chunks(bf16, user_ids, chunks[:1])
            systems[BF16] = timed(bf16)
            extra["bf16_overlap"] = core_bench.agreement(scorer, bf16, chunks[0][2], overlap=True)
    # int8 (where the CPU has VNNI or AMX-INT8): a bare-core row and, with Spark, the job's stage in int8
    int8_settings = None
    wants_int8 = INT8 not in opts.skip or (JOB_INT8 not in opts.skip and not opts.core_only)
    if wants_int8 and settings.dtype == "float32":
        refusal = dtype_refusal("int8", device)
        if refusal:
            extra["int8_skipped"] = refusal
        else:
            int8_settings = replace(settings, dtype="int8")
            int8 = shapes.scorer(shape, net, device, int8_settings)
            core_bench.score_chunks(int8, user_ids, chunks[:1])
            if INT8 not in opts.skip:
                systems[INT8] = timed(int8)
            extra["int8_overlap"] = core_bench.agreement(scorer, int8, chunks[0][2], overlap=True)
    if device.type == "cuda":
        extra["gpu"] = torch.cuda.get_device_name(device)
    session = None
    tmp = None
    if not opts.core_only:
        session, tmp, spark_systems, spark_extra = _spark_systems(opts, user_ids, seqs, net, int8_settings)
        systems.update(spark_systems)
        extra.update(spark_extra)
    try:
        seconds = _interleaved(systems, opts.repeats, log)
        if session is not None:
            extra.update(_memory(session, extra))
    finally:
        if session is not None:
            session["stop"]()
        if tmp is not None:
            tmp.cleanup()
    extra["driver_python_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return _report(opts, seconds, extra)


def _interleaved(systems: dict[str, Callable[[], float]], repeats: int, log: Callable[[str], None]) -> dict[str, list[float]]:
    """Each repetition runs every system once, in a rotated order, so machine noise hits all alike."""
    names = list(systems)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            s = systems[name]()
            seconds[name].append(s)
            log(f"  repetition {rep + 1}/{repeats}: {name:18s} {s:8.2f} s")
    return seconds


def _spark_systems(opts: BenchOptions, user_ids: np.ndarray, seqs, net, int8_settings: ScoringParams | None = None):
    """The Spark rows; ``int8_settings``: also the job's stage with these (int8) settings, on the same workers."""
    from recsys.bench import spark_bench
    from recsys.config import SparkConfig
    from recsys.model.io import save_model
    from recsys.scoring.shipping import ship_model
    from recsys.scoring.udf import ScoringSpec
    from recsys.spark.session import build_session

    shape = opts.shape
    tmp = tempfile.TemporaryDirectory(prefix="recsys-bench-", dir=opts.work_dir)
    root = Path(tmp.name)
    ids = shapes.item_ids(shape)
    model_dir = save_model(net.cpu(), ids, root / "model")
    net.to(opts.scoring.device)
    hist_path = root / "histories"
    spark_bench.write_histories(hist_path, user_ids, seqs, files=4 * opts.cores)
    # a few chunks per core, in one file per task: scoring them starts and warms every Python worker
    warm_path = root / "warm-up"
    warm_rows = min(len(user_ids), 2 * opts.cores * opts.scoring.chunk_size)
    spark_bench.write_histories(warm_path, user_ids[:warm_rows], seqs.take(np.arange(warm_rows)), files=2 * opts.cores)
    spark_cfg = SparkConfig(master=f"local[{opts.cores}]", remote=None, app_name="recsys-bench",
                            conf={"spark.driver.memory": "6g", "spark.sql.shuffle.partitions": str(4 * opts.cores),
                                  "spark.ui.enabled": "false"})
    spark = build_session(spark_cfg, opts.arrow_batch_size)
    fallback = shapes.scorer(shape, net, torch.device("cpu")).fallback
    index = np.arange(1, shape.items + 1, dtype=np.int64)
    shipped = ship_model(spark, model_dir, name="bench", version="bench", scratch=root / "driver")
    spec = ScoringSpec(model=shipped, model_version="bench",
                       candidates_index=index, candidates_item_ids=ids, candidates_digest="bench",
                       fallback_item_ids=fallback.item_ids, fallback_scores=fallback.scores,
                       fallback_name=fallback.name, params=opts.scoring)
    figures: dict = {}

    def job_with(job_spec: ScoringSpec) -> Callable[[], float]:
        def job() -> float:
            spark_bench.job_stage(spark, warm_path, job_spec)
            seconds, workers = spark_bench.job_stage(spark, hist_path, job_spec)
            reported = workers.metrics()
            figures.setdefault("job_worker_figures", []).append(
                {"dtype": job_spec.params.dtype,
                 **{k: reported[k] for k in ("tasks", "workers", "model_misses", "scorer_misses", "int8_misses",
                                             "int8_build_s", "worker_rss_mb_max", "encode_s", "score_s", "to_arrow_s",
                                             "task_s")}})
            return seconds
        return job

    systems: dict[str, Callable[[], float]] = {JOB: job_with(spec)}
    if int8_settings is not None and JOB_INT8 not in opts.skip:
        systems[JOB_INT8] = job_with(replace(spec, params=int8_settings))
    if PBU not in opts.skip:
        pbu = spark_bench.PredictBatch(model_dir, shape, opts.scoring.chunk_size)

        def predict_batch() -> float:
            pbu.run(spark, warm_path)
            return pbu.run(spark, hist_path)

        systems[PBU] = predict_batch
    extra: dict = {"figures": figures}
    if ALS not in opts.skip:
        als = spark_bench.AlsBaseline(spark, hist_path, shape)
        extra["als_fit_s_excluded"] = als.fit_seconds
        systems[ALS] = als.recommend_all
    jvm = PeakRss(spark.sparkContext._gateway.proc.pid)
    return {"spark": spark, "jvm": jvm, "stop": spark.stop}, tmp, systems, extra


def _memory(session: dict, extra: dict) -> dict:
    runs = extra.get("figures", {}).get("job_worker_figures", [])
    return {
        "jvm_peak_mb": session["jvm"].stop(),
        "python_worker_peak_mb": max((r["worker_rss_mb_max"] for r in runs), default=float("nan")),
    }


def _report(opts: BenchOptions, seconds: dict[str, list[float]], extra: dict) -> dict:
    users = opts.shape.users
    median = {n: statistics.median(s) for n, s in seconds.items()}
    ups = {n: users / s for n, s in median.items()}
    # the limit is the faster way of running the bare core on these cores
    bare = max(ups[n] for n in (BARE, BARE_THREADS) if n in ups)
    ratios = {f"{n}/bare": ups[n] / bare for n in ups if n not in (BARE, BARE_THREADS, REF, BF16, INT8)}
    if REF in ups:
        # like with like: the reference runs in the mode of the BARE_THREADS row where there is one
        same_mode = ups.get(BARE_THREADS, ups[BARE])
        ratios["bare/reference"] = same_mode / ups[REF]
        if BF16 in ups:
            ratios["bf16/reference"] = ups[BF16] / ups[REF]
        if INT8 in ups:
            ratios["int8/reference"] = ups[INT8] / ups[REF]
    if BF16 in ups:
        ratios["bf16/bare"] = ups[BF16] / ups.get(BARE_THREADS, ups[BARE])
    if INT8 in ups:
        ratios["int8/bare"] = ups[INT8] / ups.get(BARE_THREADS, ups[BARE])
        if JOB_INT8 in ups:   # the int8 job against its own bare core, as the fp32 job against the fp32 one
            ratios["job_int8/bare_int8"] = ups[JOB_INT8] / ups[INT8]
    overhead_us = {n: (1 / ups[n] - 1 / bare) * 1e6 for n in ups if n in (JOB, PBU)}
    if JOB in ups and PBU in ups and overhead_us[PBU] > 0:
        ratios["job_overhead/pbu_overhead"] = overhead_us[JOB] / overhead_us[PBU]
    if JOB in ups and ALS in ups:
        ratios["job/als"] = ups[JOB] / ups[ALS]
    if JOB_INT8 in ups and ALS in ups:
        ratios["job_int8/als"] = ups[JOB_INT8] / ups[ALS]
    if JOB_INT8 in ups and INT8 in ups:
        overhead_us[JOB_INT8] = (1 / ups[JOB_INT8] - 1 / ups[INT8]) * 1e6
    return {
        "shape": opts.shape.as_dict(),
        "cores": opts.cores, "repeats": opts.repeats, "chunk_size": opts.scoring.chunk_size,
        "arrow_batch_size": opts.arrow_batch_size, "dtype": opts.scoring.dtype, "item_tile": opts.scoring.item_tile,
        "max_tile_mb": opts.scoring.max_tile_mb,
        "seconds": seconds, "users_per_s": ups, "bare_limit_users_per_s": bare, "ratios": ratios,
        "overhead_us_per_user": overhead_us,
        **{k: v for k, v in extra.items() if k != "figures"},
        "job_worker_figures": extra.get("figures", {}).get("job_worker_figures", []),
    }


def format_table(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"recsys bench: {s['users']:,} users x {s['items']:,} items, dim {s['dim']}, history {s['history']}, "
        f"top {s['top_n']}; {result['cores']} cores/threads on {result['device']}"
        + (f" ({result['gpu']})" if result.get("gpu") else "")
        + f"; median of {result['repeats']} interleaved repetitions; chunk {result['chunk_size']}, dtype {result['dtype']}",
        "",
        f"{'system':50s} {'users/s':>12s} {'x bare core':>12s}",
    ]
    bare = result["bare_limit_users_per_s"]
    for name, value in result["users_per_s"].items():
        lines.append(f"{LABELS[name]:50s} {value:12,.0f} {value / bare:12.2f}")
    lines.append(f"(x bare core: relative to the faster {result['dtype']} bare-core row, the practical limit on these cores)")
    r, o = result["ratios"], result["overhead_us_per_user"]
    lines.append("")
    if "bare/reference" in r:
        lines.append(f"fp32 core / reference core: {r['bare/reference']:.2f}x (same mode); "
                     f"identical top-N lists: {result.get('reference_identical_lists', float('nan')):.4f} of users")
    if "bf16/reference" in r:
        lines.append(f"bf16 core / reference core: {r['bf16/reference']:.2f}x; top-N overlap with fp32: "
                     f"{result.get('bf16_overlap', float('nan')):.4f}")
    if result.get("bf16_skipped"):
        lines.append(f"bf16 row skipped: {result['bf16_skipped']}")
    if "int8/reference" in r or "int8/bare" in r:
        head = f"int8 core / reference core: {r['int8/reference']:.2f}x; " if "int8/reference" in r else ""
        lines.append(f"{head}int8 core / fp32 core: {r['int8/bare']:.2f}x (same mode); top-N overlap with fp32: "
                     f"{result.get('int8_overlap', float('nan')):.4f}")
    elif "int8_overlap" in result:
        lines.append(f"int8 top-N overlap with fp32: {result['int8_overlap']:.4f}")
    if result.get("int8_skipped"):
        lines.append(f"int8 rows skipped: {result['int8_skipped']}")
    if JOB in o:
        lines.append(f"job overhead over the bare core:          {o[JOB]:8.1f} us/user")
    if JOB_INT8 in o:
        lines.append(f"int8 job overhead over the int8 core:     {o[JOB_INT8]:8.1f} us/user")
    if "job_int8/bare_int8" in r:
        lines.append(f"int8 job / int8 bare core: {r['job_int8/bare_int8']:.2f}")
    if PBU in o:
        lines.append(f"predict_batch_udf overhead over the core: {o[PBU]:8.1f} us/user")
    if "job_overhead/pbu_overhead" in r:
        lines.append(f"job overhead / predict_batch_udf overhead: {r['job_overhead/pbu_overhead']:.2f}")
    if "job/als" in r:
        lines.append(f"job / Spark ALS: {r['job/als']:.2f}x")
    if "job_int8/als" in r:
        lines.append(f"int8 job / Spark ALS: {r['job_int8/als']:.2f}x")
    mem = [f"{k} {result[k]:,.0f} MB" for k in ("driver_python_peak_mb", "jvm_peak_mb", "python_worker_peak_mb")
           if k in result and result[k] == result[k]]
    if mem:
        lines.append("peak memory: " + ", ".join(mem))
    return "\n".join(lines)


def write_json(result: dict, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=float) + "\n")
