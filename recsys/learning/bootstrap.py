"""The function TorchDistributor starts in every training process: it makes ``recsys`` importable, then trains.

TorchDistributor pickles the function it is given and runs it in processes that ``torchrun`` starts.
On an executor those processes do not see what Spark put on the Python worker's path: the recsys
sources travel as ``--py-files`` (``recsys.zip``, in the executor's working directory), which
Spark's own worker adds to ``sys.path`` but a child process does not inherit. A function of a
recsys module pickled by reference could not even be unpickled there. So this module is pickled
*by value* (``register_pickle_by_value``) and imports nothing from recsys at its top: it puts the
driver's recsys location and the executor's ``recsys.zip`` on the path first, then unpickles the
job and trains. What it returns is plain (tensors, lists, numbers), so the Python worker that reads
it back needs no recsys class either.
"""
from __future__ import annotations


def run_fit_anywhere(recsys_paths: list, job_fields: dict):
    """Train as one process of the data-parallel group: returns process 0's weights and curve as plain values."""
    import os
    import sys

    for path in [*recsys_paths, os.path.abspath("recsys.zip")]:
        if os.path.exists(path) and path not in sys.path:
            sys.path.insert(0, path)
    from recsys.learning.distributed import FitJob, run_fit

    return run_fit(FitJob.from_plain(job_fields)).to_plain()
