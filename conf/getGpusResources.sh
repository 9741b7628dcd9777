#!/usr/bin/env bash
# Spark GPU discovery script: prints the GPUs of this host as Spark's resource JSON, e.g.
#   {"name": "gpu", "addresses": ["0", "1"]}
# Referenced by conf/spark-gpu.conf (spark.worker/executor.resource.gpu.discoveryScript); it must be
# executable on every worker host (standalone) or executor container (YARN, Kubernetes): see docs/cluster.md.
set -euo pipefail
addresses="$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, - | sed 's/ //g; s/,/", "/g')"
echo "{\"name\": \"gpu\", \"addresses\": [\"${addresses}\"]}"
