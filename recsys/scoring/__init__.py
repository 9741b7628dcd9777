"""Scoring: the core (pure torch/numpy/pyarrow), the in-pass checks, the per-worker cache, the scoring
settings, and the Spark glue (the Arrow UDF, the stage, shipping the model to the executors)."""
