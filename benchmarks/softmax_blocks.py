"""The full softmax computed block by block with its gradient, against one cross-entropy over the whole logits.

    PYTHONPATH=. python benchmarks/softmax_blocks.py --data .bench/ml-small [--rounds 2] [--epochs 3]
        [--items 1000,5000,9725,50000] [--json .bench/softmax_blocks.json]

On CPU, ``recsys.model.losses.full_softmax_loss`` computes the loss and its gradient together, a block of
rows at a time, instead of ``F.cross_entropy(hidden @ items.T, targets)`` and autograd's backward through
it (the code before), where the logits are more than one block (``CHUNK_LOGITS``; fewer run the one piece,
so at 1,000 items both columns below run the same code). Both give the same values up to rounding
(tests/test_losses.py); this measures what the blocks save:

1. one training step's loss, forward and backward, on random states at the default batch's targets
   (800 = 16 windows of 50) and ``--items`` catalog sizes, in fp32 and in bf16 autocast;
2. whole epochs of the default training (recsys/default.yaml's train settings, ``train.precision: auto``
   resolved for this CPU) on the ``loo`` split's validation phase of ``--data``, as
   benchmarks/train_speed.py trains it: ``--epochs``-epoch runs, the two forms interleaved for
   ``--rounds`` rounds.

Torch uses every core, as the job's training does (no OMP_WAIT_POLICY: the job does not set it). Run
it once as is and once with torch held to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``,
fp32 training as on an AVX2-only CPU) to see both precisions' epochs. Compare the ratios within a run.
Result: docs/performance.md, "Training speed on one machine".
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from unittest import mock

import torch
import torch.nn.functional as F

from loo_validation import load
from train_speed import cpu_model


def one_piece(hidden: torch.Tensor, items: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The full softmax as it was: one cross-entropy over the [T, N] logits, autograd's backward."""
    return F.cross_entropy(hidden @ items.T, targets)


def step_ms(loss, targets: int, items: int, bf16: bool, reps: int = 20) -> float:
    """Milliseconds of one loss's forward and backward at ``targets`` x ``items``, median of ``reps``."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(targets, 64, generator=g).requires_grad_()
    table = (torch.randn(items, 64, generator=g) * 0.1).requires_grad_()
    y = torch.randint(0, items, (targets,), generator=g)
    times = []
    for i in range(reps + 3):
        hidden.grad = table.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            value = loss(hidden, table, y)
        value.backward()
        if i >= 3:                                   # the first calls warm the allocator and the kernels
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    from recsys.learning.settings import model_config, train_settings
    from recsys.model import losses
    from recsys.model.precision import cpu_bf16_supported
    from recsys.model.training import fit

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="dataset root in the input layout (recsys import-movielens --out)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="epochs of each timed training run (default 3)")
    p.add_argument("--items", default="1000,5000,9725,50000", help="catalog sizes of the per-step comparison")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    forms = {"one piece": one_piece, "blocks": losses.full_softmax_loss}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, native bf16: {cpu_bf16_supported()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} torch threads", flush=True)

    steps = []
    print("\nOne step's loss, forward + backward, 800 targets, dim 64 (ms, median of 20):", flush=True)
    print("| items | precision | one piece | blocks | blocks / one piece |\n|---|---|---|---|---|")
    for items in (int(x) for x in a.items.split(",")):
        for bf16 in (False, True):
            if bf16 and not cpu_bf16_supported():
                continue
            ms = {name: step_ms(loss, 800, items, bf16) for name, loss in forms.items()}
            steps.append({"items": items, "bf16": bf16, **ms})
            print(f"| {items:,} | {'bf16' if bf16 else 'fp32'} | {ms['one piece']:.1f} | {ms['blocks']:.1f} | "
                  f"{ms['blocks'] / ms['one piece']:.2f} |", flush=True)

    data = load(a.data, app_name="softmax-blocks")
    config = model_config(data.cfg.train.model, len(data.vocab), "sasrec")
    settings = replace(train_settings(data.cfg.train, torch.device("cpu")), epochs=a.epochs)
    print(f"\nEpochs of the default training ({settings.precision}, {len(data.vocab):,} items), "
          f"{a.epochs}-epoch runs:", flush=True)
    epochs: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(a.rounds):
        order = list(forms) if r % 2 == 0 else list(forms)[::-1]      # alternate who goes first
        for name in order:
            with mock.patch.object(losses, "full_softmax_loss", forms[name]):
                t0 = time.perf_counter()
                fit(data.train, config, settings, stop_after=a.epochs)
                epochs[name].append((time.perf_counter() - t0) / a.epochs)
            print(f"  round {r + 1}, {name}: {epochs[name][-1]:.2f} s/epoch", flush=True)
    means = {name: statistics.fmean(x) for name, x in epochs.items()}
    print(f"mean s/epoch: one piece {means['one piece']:.2f}, blocks {means['blocks']:.2f}, "
          f"ratio {means['blocks'] / means['one piece']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "precision": settings.precision, "steps": steps, "epochs": epochs}, f, indent=1)


if __name__ == "__main__":
    main()
