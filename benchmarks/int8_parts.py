"""What int8 buys in each part of the scoring core, on one thread: the measurements behind
``scoring.dtype=int8`` (docs/performance.md, "int8 where the CPU has integer dot products").

Three tables, each CPU time of this thread (``time.thread_time``, so figures taken on a shared,
loaded machine stay comparable), best of interleaved rounds:

1. **layers**: each linear layer of the default SASRec at 3,200 rows (64 users x 50 positions, one
   encoder block of the core), fp32 against the int8 kernels torch offers on the CPU: the dynamic
   quantized linear with weights packed for oneDNN (what ``recsys.model.int8`` uses), the same with
   fbgemm's packing, and ``torch._int_mm`` with its separate passes (quantize the input per row,
   rescale the int32 result, add the bias);
2. **product**: one row block of user vectors against 20,000 items (the core's CPU block, 16 MiB
   of fp32 scores): fp32, bf16 (where the CPU has it, with the fp32 copy the selection needs), the
   oneDNN int8 kernel (fp32 scores out), and ``torch._int_mm`` alone (int32 out, nothing else: a
   lower bound no complete path reaches);
3. **core**: the whole bare core (``Scorer.topn``) over the bench's synthetic users, fp32 against
   int8 with only the encoder, only the product, or both in int8 (``recsys.scoring.core.INT8_ENCODER``
   / ``INT8_PRODUCT``), with each one's top-N overlap against fp32.

    PYTHONPATH=. python benchmarks/int8_parts.py --json .bench/int8_parts.json

Where ``ONEDNN_MAX_CPU_ISA`` holds oneDNN to another instruction set (e.g. ``AVX512_CORE_VNNI``,
``AVX2``) the tables show that CPU's kernels on this one; int8 scoring itself refuses below VNNI.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from recsys.bench import shapes
from recsys.model import int8 as q
from recsys.model.precision import cpu_bf16_supported, cpu_int8_refusal
from recsys.scoring import core


def _cpu_us(f, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        f()
    return (time.thread_time() - start) / calls * 1e6


def best_of(fs: dict, rounds: int, calls: int) -> dict[str, float]:
    """Microseconds per call of each function: the best of ``rounds`` interleaved rounds."""
    best = {k: float("inf") for k in fs}
    for f in fs.values():
        f()
    for _ in range(rounds):
        for k, f in fs.items():
            best[k] = min(best[k], _cpu_us(f, calls))
    return best


def _engine_pack(weight: torch.Tensor, bias: torch.Tensor | None, engine: str):
    codes, scales = q.quantize_rows(weight)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(codes, scales, torch.zeros(len(scales), dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, bias)
    finally:
        torch.backends.quantized.engine = previous


def _int_mm_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """int8 x int8 -> int32 through ``torch._int_mm``, with the passes it needs around it."""
    codes, scales = q.quantize_rows(weight)
    codes_t, w_scale = codes.T.contiguous(), scales.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        x_scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
        acc = torch._int_mm(torch.div(x, x_scale).round_().to(torch.int8), codes_t)
        out = acc.float().mul_(x_scale).mul_(w_scale)
        return out.add_(bias) if bias is not None else out
    return run


def layers_table(rows: int, rounds: int) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, (i, o) in {"attn.qkv": (64, 192), "attn.proj": (64, 64), "mlp.fc": (64, 256), "mlp.proj": (256, 64)}.items():
        x = torch.randn(rows, i)
        w, b = torch.randn(o, i) * 0.1, torch.randn(o) * 0.1
        onednn = _engine_pack(w, b, "onednn")
        fbgemm = _engine_pack(w, b, "fbgemm")
        int_mm = _int_mm_linear(w, b)
        fs = {"fp32": lambda: F.linear(x, w, b),
              "int8 onednn": lambda: q.linear(x, onednn),
              "int8 fbgemm": lambda: torch.ops.quantized.linear_dynamic(x, fbgemm, False),
              "int8 _int_mm": lambda: int_mm(x)}
        out[f"{name} {i}->{o}"] = best_of(fs, rounds, 20)
    return out


def product_table(rows: int, items: int, rounds: int) -> dict:
    torch.manual_seed(0)
    u, it = torch.randn(rows, 64), torch.randn(items, 64) * 0.1
    codes, scales = q.quantize_rows(it)
    packed = q.pack(codes, scales)
    u8 = torch.round(u / (u.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    codes_t = codes.T.contiguous()
    fs = {"fp32": lambda: u @ it.T, "int8 onednn (fp32 out)": lambda: q.linear(u, packed),
          "torch._int_mm alone (int32 out)": lambda: torch._int_mm(u8, codes_t)}
    if cpu_bf16_supported():
        ub, itb = u.bfloat16(), it.bfloat16()
        fs["bf16 (+ fp32 copy)"] = lambda: (ub @ itb.T).float()
    return {k: v / rows for k, v in best_of(fs, rounds, 5).items()}      # per user


def core_table(users: int, chunk: int, rounds: int) -> dict:
    shape = shapes.BenchShape(users=users)
    _, seqs = shapes.histories(shape)
    net = shapes.model(shape)
    dev = torch.device("cpu")
    chunks = [seqs.take(np.arange(lo, min(lo + chunk, users))) for lo in range(0, users, chunk)]
    fp32 = shapes.scorer(shape, net, dev)
    int8 = shapes.scorer(shape, net, dev, shapes.params(shape, dtype="int8"))   # INT8_ENCODER acts per call
    core.INT8_PRODUCT = False                                                    # INT8_PRODUCT when built
    try:
        int8_encoder = shapes.scorer(shape, net, dev, shapes.params(shape, dtype="int8"))
    finally:
        core.INT8_PRODUCT = True
    variants = {"fp32": (fp32, True), "int8 encoder only": (int8_encoder, True),
                "int8 product only": (int8, False), "int8 encoder + product": (int8, True)}

    def run(sc, enc):
        core.INT8_ENCODER = enc
        try:
            return [sc.topn(c)[0] for c in chunks]
        finally:
            core.INT8_ENCODER = True

    base = run(fp32, True)
    out = {}
    for name, (sc, enc) in variants.items():
        ids = run(sc, enc)
        overlap = np.mean([len(np.intersect1d(a, b)) / a.shape[0] for x, y in zip(base, ids) for a, b in zip(x, y)])
        out[name] = {"overlap_with_fp32": float(overlap), "us_per_user": float("inf")}
    for _ in range(rounds):
        for name, (sc, enc) in variants.items():
            start = time.thread_time()
            run(sc, enc)
            out[name]["us_per_user"] = min(out[name]["us_per_user"], (time.thread_time() - start) / users * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=16_384, help="users of the core table")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    refusal = cpu_int8_refusal()
    print(f"torch {torch.__version__}; ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; "
          f"int8 scoring here: {'refused: ' + refusal if refusal else 'supported'}")
    result: dict = {"torch": torch.__version__, "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                    "int8_refusal": refusal}
    block = core.CPU_BLOCK_BYTES // (20_000 * 4)
    with torch.inference_mode():
        result["layers_us_per_call"] = layers = layers_table(3200, args.rounds)
        print("\nlinear layers, 3,200 rows (64 users x 50 positions), us per call, one thread")
        cols = list(next(iter(layers.values())))
        print(f"{'':22s}" + "".join(f"{c:>15s}" for c in cols))
        for name, row in layers.items():
            print(f"{name:22s}" + "".join(f"{row[c]:15.0f}" for c in cols)
                  + f"   onednn/fp32 {row['fp32'] / row['int8 onednn']:.2f}x")
        result["product_us_per_user"] = product = product_table(block, 20_000, args.rounds)
        print(f"\nproduct, {block} users x 20,000 items, d64, us per user, one thread")
        for name, v in product.items():
            print(f"  {name:34s} {v:8.1f}")
        if not refusal:
            result["core"] = table = core_table(args.users, args.chunk_size, max(2, args.rounds // 2))
            print(f"\nwhole bare core, {args.users:,} users x 20,000 items, top 100, us per user, one thread")
            for name, row in table.items():
                print(f"  {name:26s} {row['us_per_user']:8.1f}   x fp32 {table['fp32']['us_per_user'] / row['us_per_user']:.2f}"
                      f"   overlap with fp32 {row['overlap_with_fp32']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
