#!/usr/bin/env bash
# Issue 16's per-op numbers as one device call from the repository root (carry .whl): the op
# suite on CUDA first (the kernels being timed must be right), then host time per call
# (bench/host_time.py), device time by CUDA-graph replay and memory per token
# (bench/device_time.py), and this package beside Liger-Kernel with event timing
# (bench/bench_cross_entropy.py). Results land in $OUT.
#
#     bash bench/run_gpu_perf.sh
set -u -o pipefail
source bench/device_setup.sh

echo "== op tests on CUDA"
(cd tests && timeout 200 $PY -m pytest -q -p no:cacheprovider -x test_op.py test_op_errors.py test_gpu.py \
    test_launch_configs.py test_launch.py 2>&1) | tee "$OUT/gpu_tests.log" | tail -4

echo "== host time"
timeout 120 $PY bench/host_time.py --calls 1000 --repeats 5 --profile --out "$OUT/host_time.md" 2>&1 | head -12

echo "== device time (CUDA-graph replay) and memory"
timeout 150 $PY bench/device_time.py --out "$OUT/device_time.md" 2>&1 | tail -14

echo "== beside Liger-Kernel (events)"
timeout 150 $PY bench/bench_cross_entropy.py --impls mindspeed_cez liger --budget-s 100 --out "$OUT/bench.md" \
    2>&1 | tail -16
