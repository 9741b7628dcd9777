"""Training's resident memory epoch by epoch: what holds it, and what gives it back.

    python benchmarks/train_memory.py --data DIR [--epochs 8] [--keep-freed] [--json PATH]
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=128 python benchmarks/train_memory.py --data DIR

``--data``: a dataset root in the input layout (``recsys import-movielens --out``). The default SASRec is trained
in this process on the ``loo`` split's validation histories (benchmarks/loo_validation.py), as ``recsys train``
trains in the driver, for ``--epochs`` epochs with no early stop; after each epoch the process's resident memory
(``VmRSS``), its peak so far (``VmHWM``: within the epochs too) and the epoch's seconds are printed. Training
hands the allocator's free pages back after each epoch
(``recsys.model.training.freed_memory_releaser``: glibc's ``malloc_trim(0)``), so what it holds between epochs
is what is live; ``--keep-freed`` turns that off, as the code was before. oneDNN keeps a compiled primitive
per operation and shape (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024), each with its buffers; batches of
several widths (``train.batching: by_length``) make many shapes. Run one configuration per process: the cache's
capacity is read once, when torch first calls oneDNN.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import replace
from unittest import mock


def rss_mb(field: str = "VmRSS") -> int:
    """This process's resident memory in MB (Linux): now (``VmRSS``) or its peak so far (``VmHWM``)."""
    with open("/proc/self/status") as status:
        return int(status.read().split(f"{field}:")[1].split()[0]) // 1024


def main() -> None:
    import torch

    from loo_validation import load
    from recsys.learning.settings import model_config, train_settings
    from recsys.model import training

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--keep-freed", action="store_true", help="no malloc_trim after each epoch (the code before)")
    p.add_argument("--json", default=None)
    a = p.parse_args()

    data = load(a.data, app_name="train-memory")
    config = model_config(data.cfg.train.model, len(data.vocab), "sasrec")
    settings = replace(train_settings(data.cfg.train, torch.device("cpu")), epochs=a.epochs, patience=a.epochs + 1)
    capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (default)")
    rows = [{"epoch": 0, "rss_mb": rss_mb(), "seconds": 0.0}]
    print(f"oneDNN primitive cache {capacity}, freed pages kept: {a.keep_freed}; "
          f"{settings.batching} batches, precision {settings.precision}", flush=True)
    print(f"before the fit: {rows[0]['rss_mb']} MB", flush=True)
    last = [time.perf_counter()]

    def after_epoch(model) -> dict[str, float]:
        now = time.perf_counter()
        rows.append({"epoch": len(rows), "rss_mb": rss_mb(), "peak_mb": rss_mb("VmHWM"),
                     "seconds": round(now - last[0], 2)})
        last[0] = now
        print(f"epoch {rows[-1]['epoch']}: {rows[-1]['rss_mb']} MB, peak so far {rows[-1]['peak_mb']} MB, "
              f"{rows[-1]['seconds']:.2f} s", flush=True)
        return {"ndcg@10": 0.0}       # no early stop: every epoch runs

    keep = mock.patch.object(training, "freed_memory_releaser", lambda: (lambda: None)) if a.keep_freed else None
    with keep or contextlib.nullcontext():
        training.fit(data.train, config, settings, valid=after_epoch)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"cache_capacity": capacity, "keep_freed": a.keep_freed, "epochs": rows}, out, indent=1)


if __name__ == "__main__":
    main()
