"""recsys: nightly top-N recommendations on Apache Spark with PyTorch models and MLflow tracking.

Importing the package imports neither pyspark nor mlflow: the scoring core (``recsys.scoring.core``)
and the models (``recsys.model``) run where only torch, numpy and pyarrow are installed.
"""
__version__ = "0.1.0"
