"""Offline evaluation: ranking metrics over held-out interactions (pure torch/numpy)."""
