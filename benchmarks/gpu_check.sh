#!/usr/bin/env bash
# The GPU check of issue 4, as one prepared script for a lent GPU machine (torch, numpy, pyarrow;
# no Java, pyspark or mlflow there). Prints the bare-torch limit (gpu_limit.py, passed as $1) and
# then the scoring core at the same shapes, so the two can be read side by side.
#   benchmarks/gpu_check.sh path/to/gpu_limit.py [output dir]
set -uo pipefail
limit_script="$1"
out="${2:-.}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import torch, numpy, pyarrow; print("torch", torch.__version__, "numpy", numpy.__version__, "pyarrow", pyarrow.__version__)'

echo "== correctness on the GPU: the core's CUDA paths against the CPU fp32 reference"
python3 -m pytest -q -p no:cacheprovider tests/test_scoring_core.py tests/test_sequences.py tests/test_model.py 2>&1 | tail -3
python3 benchmarks/gpu_core_agreement.py 2>&1 | tee "$out/agreement.txt"

echo "== bare-torch limit (gpu_limit.py)"
timeout 240 python3 "$limit_script" 2>&1 | tee "$out/gpu_limit.txt"

echo "== the scoring core, 1M users x 100k items, dim 64, history 50, top 100: one run prints the reference core"
echo "   (full forward, one product, torch.topk, fp32), the fast fp32 core and the bf16 core, with their ratios"
timeout 400 python3 -m recsys.cli bench --core-only --device cuda --dtype float32 --users 1000000 --items 100000 \
  --dim 64 --history 50 --top-n 100 --chunk-size 32768 --repeats 3 --json "$out/core.json" 2>&1 | tee "$out/core.txt"
