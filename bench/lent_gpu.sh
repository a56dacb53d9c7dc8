#!/usr/bin/env bash
# The one call to make on a lent GPU machine (it has torch and transformers, not DeepSpeed, and no network):
#   here, once:  ../shared/device/prepare-wheels.sh      (fills the ignored .whl/ with DeepSpeed and what it lacks)
#   the call:    run(command="bash bench/lent_gpu.sh", carry=[".whl"], timeout_s=590)
# It stays within BUDGET seconds (540 by default) and leaves results.json, results.md and every case's log under
# $OUT (bench/results/gpu-DATE when run by hand). Commit them to bench/results/ with the date and the GPU.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0 \
  MAX_JOBS=16 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# Only 8 files come back from $OUT: results.json/.md and nvidia-smi.txt go there as they are written, the cases'
# logs into one archive at the end (the bench keeps its budget, so the end comes).
out=${OUT:-bench/results/gpu-$(date +%F)}
rc=0
python3 bench/gpu_bench.py --budget "${BUDGET:-540}" --out "$out" --logs /tmp/gpu-bench-logs || rc=$?
tar czf "$out/logs.tar.gz" -C /tmp gpu-bench-logs
exit $rc
