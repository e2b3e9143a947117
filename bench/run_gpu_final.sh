#!/usr/bin/env bash
# One device call (carry .whl): the op suite on CUDA with the shipped launch settings, device
# time by CUDA-graph replay at the four shapes, and with E2E=1 Megatron end to end (small config,
# native CE vs this package, alternated pairs). Results in $OUT.
set -u -o pipefail
source bench/device_setup.sh
(cd tests && timeout 150 $PY -m pytest -q -p no:cacheprovider test_op.py test_gpu.py test_launch_configs.py 2>&1) \
    | tee "$OUT/gpu_tests.log" | tail -3
timeout 120 $PY bench/device_time.py --out "$OUT/device_time.md" 2>&1 | tail -16
if [ -n "${E2E:-}" ]; then
    timeout 330 $PY bench/e2e_megatron.py --config small --variants native cez --pairs 3 --budget-s 280 \
        --out "$OUT" 2>&1 | tail -12
fi
