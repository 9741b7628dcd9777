"""Torch models: sequence encoders scored by dot product against item embeddings.

Pure torch/numpy (no pyspark, no mlflow), so models train, load and score on any machine.
"""
