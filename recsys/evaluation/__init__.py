"""`recsys evaluate`: protocols read through Spark, ALS and popularity baselines, models ranked on held-out
phases, and the comparison report with bootstrap intervals (ranking metrics: :mod:`recsys.model.metrics`)."""
