"""Checks and figures that need a CUDA GPU: SASRec encode/forward agree and stay finite on the
GPU's attention kernels, a saved model loads onto the GPU, training runs there, and encode speed.

    PYTHONPATH=. python benchmarks/sasrec_gpu_check.py [--ratings data/ml-latest-small/ratings.csv]

Needs only torch and numpy (no pandas): reads the ratings with numpy.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from recsys.model.metrics import evaluate_ranking
from recsys.model.io import load_model, save_model
from recsys.model.sasrec import SASRec, SASRecConfig
from recsys.model.training import FitCallbacks, TrainSettings, ValidationSet, fit
from recsys.sequences import Sequences

DEV = "cuda"
USERS = 1_000_000


def sync() -> None:
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def left_padded(batch: int, max_len: int, num_items: int) -> torch.Tensor:
    seq = torch.randint(1, num_items + 1, (batch, max_len))
    lengths = torch.arange(batch) % (max_len + 1)
    seq[torch.arange(max_len)[None, :] < (max_len - lengths)[:, None]] = 0
    return seq


def correctness() -> None:
    torch.manual_seed(0)
    model = SASRec(SASRecConfig(num_items=500, dim=64, max_len=50)).eval()
    seq = left_padded(1000, 50, 500)
    with torch.no_grad():
        cpu = model.encode(seq)
        gpu_model = model.to(DEV)
        s = seq.to(DEV)
        full = gpu_model(s)[:, -1]
        fast = gpu_model.encode(s)
        check("cuda encode == forward[:, -1]", torch.allclose(fast, full, atol=1e-4), f"max diff {(fast - full).abs().max():.2e}")
        check("cuda encode == cpu encode", torch.allclose(fast.cpu(), cpu, atol=1e-3), f"max diff {(fast.cpu() - cpu).abs().max():.2e}")
        check("cuda all-padding/left-padded rows finite (fp32)", bool(torch.isfinite(fast).all() and torch.isfinite(full).all()))
        zeros = torch.zeros(7, 50, dtype=torch.long, device=DEV)
        check("cuda all-padding batch finite", bool(torch.isfinite(gpu_model.encode(zeros)).all()))
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast(DEV.split(":")[0], dtype=dtype):
                out = gpu_model.encode(s)
                outf = gpu_model(s)
            check(f"cuda autocast {dtype} finite", bool(torch.isfinite(out).all() and torch.isfinite(outf).all()),
                  f"max diff vs fp32 {(out.float() - fast).abs().max():.2e}")
    gpu_model.train()
    out = gpu_model(s[:64])
    out.float().sum().backward()
    check("cuda training-mode forward/backward finite", bool(torch.isfinite(out).all()) and
          all(bool(torch.isfinite(p.grad).all()) for p in gpu_model.parameters() if p.grad is not None))
    with tempfile.TemporaryDirectory() as d:
        save_model(gpu_model.eval(), np.arange(500) + 7, Path(d))
        loaded = load_model(Path(d), device=DEV)
        with torch.no_grad():
            same = torch.equal(loaded.model.encode(s), gpu_model.encode(s))
        check("save from cuda, load onto cuda, identical encode", same and loaded.model.item_emb.weight.device.type == torch.device(DEV).type)


def successor_training() -> None:
    n_items, rng = 40, np.random.default_rng(0)
    runs = [(s + np.arange(n)) % n_items + 1 for s, n in zip(rng.integers(0, n_items, 150), rng.integers(4, 15, 150))]
    targets = np.array([r[-1] % n_items + 1 for r in runs])
    train = Sequences.from_lists(runs)
    config = SASRecConfig(num_items=n_items, dim=32, layers=1, heads=2, max_len=10, dropout=0.1)
    result = fit(train, config, TrainSettings(epochs=12, batch_size=32, learning_rate=5e-3, patience=3, seed=3),
                 valid=ValidationSet(train, targets), device=DEV)
    cpu_metrics = evaluate_ranking(result.model.cpu(), train, targets)
    check("cuda fit learns successor task", result.best_metrics["ndcg@10"] > 0.8, str(result.best_metrics))
    check("cuda-trained model evaluates the same on cpu", abs(cpu_metrics["ndcg@10"] - result.best_metrics["ndcg@10"]) < 1e-6)


def encode_speed() -> None:
    """users/s per chunk size and dtype; a failing kernel is reported, then retried without cuDNN SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = SASRec(SASRecConfig(num_items=100_000, dim=64, max_len=50)).to(DEV).eval()
    users = USERS
    seq = left_padded(users, 50, 100_000).to(DEV)
    for chunk in (4096, 65536, 262144):
        for dtype in (torch.float32, torch.bfloat16):
            for name, fn in (("forward[:, -1]", lambda x: model(x)[:, -1]), ("encode", model.encode)):
                def run():
                    with torch.inference_mode(), torch.autocast(DEV.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
                        for start in range(0, users, chunk):
                            out = fn(seq[start:start + chunk])
                    return out
                for backends in (None, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
                    label = f"chunk={chunk:6d} {str(dtype):15s} {name:15s} {'no-cudnn' if backends else 'default'}"
                    try:
                        with sdpa_kernel(backends) if backends else torch.no_grad():
                            out = run()
                            sync()
                            t = time.perf_counter()
                            out = run()
                            sync()
                            dt = time.perf_counter() - t
                        print(f"encode speed {label}: {users / dt:12,.0f} users/s finite={bool(torch.isfinite(out).all())}", flush=True)
                        break
                    except RuntimeError as exc:
                        print(f"FAIL {label}: {str(exc).splitlines()[0][:150]}", flush=True)
                        sync()


def movielens_epochs(path: str, epochs: int = 30, patience: int = 5, dropout: float = 0.2) -> None:
    raw = np.loadtxt(path, delimiter=",", skiprows=1)
    user, movie, ts = raw[:, 0].astype(np.int64), raw[:, 1].astype(np.int64), raw[:, 3]
    tie = np.random.default_rng(7).random(len(raw))
    order = np.lexsort((tie, ts, user))
    user, movie = user[order], movie[order]
    ids, index = np.unique(movie, return_inverse=True)
    items = index.astype(np.int64) + 1
    _, counts = np.unique(user, return_counts=True)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ends = offsets[1:]
    targets = items[ends - 1]
    keep = np.ones(len(items), bool)
    keep[ends - 1] = False
    train = Sequences(np.concatenate([[0], np.cumsum(counts - 1)]), items[keep])
    config = SASRecConfig(num_items=len(ids), dropout=dropout)
    result = fit(train, config, TrainSettings(epochs=epochs, patience=patience), valid=ValidationSet(train, targets), device=DEV,
                 callbacks=FitCallbacks(progress=lambda row: print(
                     {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)))
    seconds = sum(row["seconds"] for row in result.curve)
    print(f"movielens on {DEV}, dropout {dropout}, patience {patience}: {len(result.curve)} epochs in {seconds:.0f} s, "
          f"best epoch {result.best_epoch} {result.best_metrics}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ratings", default="data/ml-latest-small/ratings.csv")
    p.add_argument("--skip-movielens", action="store_true")
    p.add_argument("--only-movielens", action="store_true")
    p.add_argument("--ml-epochs", type=int, default=30)
    p.add_argument("--ml-patience", type=int, default=5)
    p.add_argument("--ml-dropout", type=float, nargs="+", default=[0.2])
    p.add_argument("--device", default="cuda", help="cpu only to try the script itself")
    p.add_argument("--users", type=int, default=1_000_000, help="users per encode-speed measurement")
    a = p.parse_args()
    global DEV, USERS
    DEV, USERS = a.device, a.users
    print(torch.__version__, torch.cuda.get_device_name() if DEV.startswith("cuda") else DEV, flush=True)
    if not a.only_movielens:
        correctness()
        successor_training()
        encode_speed()
    if not a.skip_movielens:
        for dropout in a.ml_dropout:
            movielens_epochs(a.ratings, a.ml_epochs, a.ml_patience, dropout)


if __name__ == "__main__":
    main()
