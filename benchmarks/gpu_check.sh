#!/usr/bin/env bash
# The GPU check (issues 4 and 13), as one prepared script for a lent GPU machine (torch, numpy,
# pyarrow; no Java, pyspark or mlflow there, so the job's Spark stage cannot run: the rows are the
# bare cores). Prints, in this order so that a cut-short run still returns the most important:
#   1. the core's CUDA paths against the CPU fp32 reference (fp32 and bf16, whole matrix and tiled);
#   2. the reference / fast fp32 / bf16 cores at the issue-13 bench shape (200k x 20k, d64, top 100);
#   3. the bare-torch limit (gpu_limit.py, passed as $1);
#   4. the same three cores at 1M users x 100k items, to read beside the limit's rows.
#   benchmarks/gpu_check.sh path/to/gpu_limit.py [output dir]
set -uo pipefail
limit_script="$1"
out="${2:-.}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import torch, numpy, pyarrow; print("torch", torch.__version__, "numpy", numpy.__version__, "pyarrow", pyarrow.__version__)'
start=$SECONDS

echo "== 1. the core's CUDA paths against the CPU fp32 reference"
timeout 90 python3 benchmarks/gpu_core_agreement.py 2>&1 | tee "$out/agreement.txt"
echo "   ($((SECONDS - start)) s so far)"

# --max-tile-mb 0: untiled, as the recorded H200 rows were measured (the bench now defaults to the job's 1024 MiB)
echo "== 2. cores at 200,000 users x 20,000 items, dim 64, history 50, top 100 (the issue-13 bench shape)"
timeout 100 python3 -m recsys.cli bench --core-only --device cuda --dtype float32 --users 200000 --items 20000 \
  --dim 64 --history 50 --top-n 100 --chunk-size 16384 --max-tile-mb 0 --repeats 3 --json "$out/core_200k.json" 2>&1 | tee "$out/core_200k.txt"
echo "   ($((SECONDS - start)) s so far)"

echo "== 3. bare-torch limit (gpu_limit.py)"
timeout 120 python3 "$limit_script" 2>&1 | tee "$out/gpu_limit.txt"
echo "   ($((SECONDS - start)) s so far)"

echo "== 4. cores at 1,000,000 users x 100,000 items, dim 64, history 50, top 100"
timeout 170 python3 -m recsys.cli bench --core-only --device cuda --dtype float32 --users 1000000 --items 100000 \
  --dim 64 --history 50 --top-n 100 --chunk-size 32768 --max-tile-mb 0 --repeats 2 --json "$out/core_1m.json" 2>&1 | tee "$out/core_1m.txt"
echo "   ($((SECONDS - start)) s in all)"
