"""The scoring core (pure torch/numpy/pyarrow), the per-worker model cache and the Spark glue."""
