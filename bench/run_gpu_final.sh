#!/usr/bin/env bash
# One device call (carry .whl): the op suite on CUDA with the shipped launch settings, device
# time by CUDA-graph replay at the four shapes, and Megatron end to end (small config, native CE
# vs this package, alternated pairs). Results in $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
(cd tests && timeout 150 python3 -m pytest -q -p no:cacheprovider test_op.py test_gpu.py test_launch_configs.py 2>&1) \
    | tee "$OUT/gpu_tests.log" | tail -3
timeout 120 python3 bench/device_time.py --out "$OUT/device_time.md" 2>&1 | tail -16
[ -n "${E2E:-}" ] && timeout 330 python3 bench/e2e_megatron.py --config small --variants native cez --pairs 3 --budget-s 280 \
    --out "$OUT" 2>&1 | tail -12
