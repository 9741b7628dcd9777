"""The Spark-side systems of the benchmark: the job's scoring stage, predict_batch_udf, Spark ALS.

Each returns the seconds to produce every user's top N as materialised rows (Spark's ``noop``
sink: every row is computed and converted, nothing is written), so all three are timed the same
way. The two Python systems are timed on warm workers (``recsys.bench.run`` scores a small warm-up
set first): Spark kills a Python worker idle for a minute, so without it whichever system ran
first after ALS would pay worker start-up and model loading and the other would not.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from recsys.data.contracts import HISTORY_COLUMN
from recsys.bench.shapes import BenchShape, item_ids
from recsys.scoring.figures import WorkerFigures
from recsys.scoring.stage import score_histories, worker_figures
from recsys.scoring.udf import ScoringSpec
from recsys.sequences import Sequences


def write_histories(path: Path, user_ids: np.ndarray, seqs: Sequences, files: int) -> None:
    """Histories as the job's prepare stage leaves them: Parquet, user_id + history array<bigint>."""
    path.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(seqs), files + 1).astype(np.int64)
    for f, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = seqs.take(np.arange(lo, hi))
        history = pa.ListArray.from_arrays(pa.array(part.offsets.astype(np.int32)), pa.array(part.items))
        table = pa.table({"user_id": pa.array(user_ids[lo:hi]), HISTORY_COLUMN: history})
        pq.write_table(table, path / f"part-{f:04d}.parquet", compression="zstd")


def _noop(df: DataFrame) -> float:
    start = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - start


def job_stage(spark: SparkSession, histories_path: Path, spec: ScoringSpec) -> tuple[float, WorkerFigures]:
    scored, observation = score_histories(spark.read.parquet(str(histories_path)), spec)
    seconds = _noop(scored)
    return seconds, worker_figures(observation)


class PredictBatch:
    """``pyspark.ml.functions.predict_batch_udf`` wrapping the same scoring core: what a Spark user
    would write instead of the job's glue (its make_predict_fn returns the core's top-N).

    The UDF is built once and reused, as a user would: predict_batch_udf caches ``make_predict_fn``'s
    result per Python worker under the UDF's id, so later runs on warm workers do not reload.
    """

    def __init__(self, model_dir: Path, shape: BenchShape, chunk_size: int):
        from pyspark.ml.functions import predict_batch_udf

        model_path, top_n, history = str(model_dir), shape.top_n, shape.history
        ids = item_ids(shape)

        def make_predict_fn():
            import torch

            from recsys.model.io import load_model
            from recsys.scoring.core import Candidates, Scorer, popularity_fallback
            from recsys.sequences import Sequences as Seqs
            from recsys.sequences import Vocabulary

            torch.set_num_threads(1)  # one task per core, as in the job
            loaded = load_model(Path(model_path))
            index = np.arange(1, len(ids) + 1, dtype=np.int64)
            scorer = Scorer(model=loaded.model, vocab=Vocabulary(loaded.item_ids), candidates=Candidates(index, ids),
                            fallback=popularity_fallback(ids, np.ones(len(ids)), top_n), top_n=top_n,
                            device=torch.device("cpu"))

            def predict(hist: np.ndarray) -> dict[str, np.ndarray]:
                rows = hist.shape[0]
                seqs = Seqs(np.arange(0, (rows + 1) * history, history, dtype=np.int64),
                            hist.reshape(-1).astype(np.int64))
                top_ids, top_scores, _, _ = scorer.topn(seqs)
                return {"item_ids": top_ids, "scores": top_scores}

            return predict

        return_type = T.StructType([T.StructField("item_ids", T.ArrayType(T.LongType())),
                                    T.StructField("scores", T.ArrayType(T.FloatType()))])
        self.udf = predict_batch_udf(make_predict_fn, return_type=return_type, batch_size=chunk_size,
                                     input_tensor_shapes=[[history]])

    def run(self, spark: SparkSession, histories_path: Path) -> float:
        df = spark.read.parquet(str(histories_path))
        return _noop(df.select("user_id", self.udf(HISTORY_COLUMN).alias("top")))


class AlsBaseline:
    """Spark ALS (implicit) with rank = dim, fitted once on the histories; ``recommendForAllUsers`` timed.

    Fitting is not timed and runs one iteration only: the speed of recommending does not depend
    on how well the factors fit.
    """

    def __init__(self, spark: SparkSession, histories_path: Path, shape: BenchShape):
        from pyspark.ml.recommendation import ALS

        interactions = (spark.read.parquet(str(histories_path))
                        .select(F.col("user_id").cast("int").alias("user"), F.explode(HISTORY_COLUMN).alias("item_id"))
                        .select("user", F.col("item_id").cast("int").alias("item"), F.lit(1.0).alias("rating")))
        als = ALS(rank=shape.dim, maxIter=1, regParam=0.1, implicitPrefs=True, alpha=1.0, userCol="user",
                  itemCol="item", ratingCol="rating", seed=shape.seed, coldStartStrategy="drop")
        start = time.perf_counter()
        self.model = als.fit(interactions)
        self.fit_seconds = time.perf_counter() - start
        self.top_n = shape.top_n

    def recommend_all(self) -> float:
        return _noop(self.model.recommendForAllUsers(self.top_n))
