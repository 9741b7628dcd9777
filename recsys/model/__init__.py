"""Torch models: sequence encoders scored by dot product against item embeddings, their configs and
registry, save/load, the training loop and the ranking metrics they are trained and judged by.

Pure torch/numpy (no pyspark, no mlflow), so models train, load and score on any machine.
"""
