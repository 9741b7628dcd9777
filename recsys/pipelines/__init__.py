"""Pipelines: the nightly job and its stages, training; each run from an entry point with a config."""
