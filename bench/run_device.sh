#!/usr/bin/env bash
# One device-tool call, run from the repository root with .whl carried (bench/README.md):
#
#     bash bench/run_device.sh STEP [STEP ...]        (no STEP: env tests peers)
#
# Each step writes to $OUT (the device tool brings it back; put what you keep under
# bench/results/<date>_<device>/):
#   env          GPUs, driver, package versions                       env.txt
#   tests        the op suites on CUDA                                 gpu_tests.log
#   peers        the op beside Megatron, Liger-Kernel, torch.compile   bench.md/.json, bench.log
#   peers-tp     the same at TP=2 over NCCL (2 GPUs)                   bench_tp.md/.json, bench_tp.log
#   linear-ce    output projection + loss beside cuBLAS + op, Liger, CCE linear_ce.md/.json
#                ($LINEAR_ARGS for bench/linear_cross_entropy.py)
#   e2e          Megatron end to end; $E2E_ARGS for e2e_megatron.py   e2e/
#                (default: --config busy --variants native cez --pairs 3 --profile)
# Mind the device tool's 600 s per command: e2e alone takes most of it.
set -u -o pipefail
source bench/device_setup.sh

step_env() {
    {
        nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
        (cd /tmp && $PY -c 'import mindspeed_cez.kernels as k, torch, triton; print("mindspeed_cez from", k.__file__); print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())')
        for pkg in megatron-core liger-kernel cut-cross-entropy mindspeed_cez; do
            (cd /tmp && $PY -c "import sys; from importlib.metadata import version; print(sys.argv[1], version(sys.argv[1]))" $pkg) 2>/dev/null || echo "$pkg not installed"
        done
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
}
step_tests() {
    (cd tests && timeout 240 $PY -m pytest -q -p no:cacheprovider test_op.py test_op_errors.py test_gpu.py test_linear_cross_entropy_gpu.py \
        test_launch_configs.py test_triton_launcher.py 2>&1) | tee "$OUT/gpu_tests.log" | tail -4
}
step_peers() { timeout 400 $PY bench/op.py --budget-s 300 --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -20; }
step_peers-tp() {
    timeout 140 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/op.py --tp --out "$OUT/bench_tp.md" 2>&1 | tee "$OUT/bench_tp.log" | tail -12
}
step_linear-ce() { timeout 400 $PY bench/linear_cross_entropy.py ${LINEAR_ARGS:-} --out "$OUT/linear_ce.md" 2>&1 | tail -24; }
step_e2e() {
    timeout 560 $PY bench/e2e_megatron.py ${E2E_ARGS:---config busy --variants native cez --pairs 3 --profile} \
        --out "$OUT/e2e" 2>&1 | grep -v '^ *\[20' | tail -40
}

[ $# -gt 0 ] || set -- env tests peers
for step in "$@"; do
    declare -F "step_$step" >/dev/null || { echo "unknown step: $step" >&2; exit 2; }
    echo "== $step"
    "step_$step"
done
