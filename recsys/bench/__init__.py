"""``recsys bench``: scoring throughput side by side (bare core, the job's Spark stage,
``predict_batch_udf``, Spark ALS), as ratios from one run on the same cores."""
