#!/usr/bin/env bash
# Everything that needs GPUs, as one device call from the repository root (carry .whl, see
# bench/README.md): the op's test suite on CUDA (incl. TP=2 over NCCL), the main job on GPUs,
# the Megatron-LM style launch (megatron.training, TP=2, NCCL), the self-check users run (one GPU;
# TP=2 through torchrun where two GPUs are present), and, where four GPUs or more are, the parallel
# layouts of Megatron's pretrain (tests/gpu/gpu_layouts.py, ~5-7 minutes on 4 H100s). Logs land in $OUT.
#
#     bash tests/run_gpu_checks.sh            # all of it
#     bash tests/run_gpu_checks.sh layouts    # the layouts alone (one device command of its own)
#     bash tests/run_gpu_checks.sh features   # CUDA graphs, FSDP, resharding resumes, fault tolerance
#                                             # (tests/gpu/gpu_megatron_features.py, 4 GPUs, one command of its own)
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH=$SITE

GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
layouts() {  # every layout of Megatron's pretrain the GPUs found hold, 4 variants each; asserted
    if [ "$GPUS" -ge 4 ]; then
        echo "== parallel layouts of Megatron's pretrain over NCCL ($GPUS GPUs)"
        timeout 560 python3 tests/gpu/gpu_layouts.py --out "$OUT/layouts" --budget-s 420 2>&1 | tee "$OUT/layouts.log"
        return "${PIPESTATUS[0]}"
    fi
    echo "== parallel layouts: skipped (they need four GPUs, this machine has $GPUS)"
}
features() {  # the flag under Megatron's CUDA graphs, FSDP, resharding resumes and fault tolerance; asserted
    if [ "$GPUS" -ge 4 ]; then
        echo "== Megatron features with the flag over NCCL ($GPUS GPUs)"
        # shellcheck disable=SC2086  # FEATURES_ARGS: e.g. --only REGEX --timeout-s 150 for part of it
        timeout 530 python3 tests/gpu/gpu_megatron_features.py --out "$OUT/features" --budget-s 290 ${FEATURES_ARGS:-} 2>&1 \
            | tee "$OUT/features.log"
        return "${PIPESTATUS[0]}"
    fi
    echo "== Megatron features: skipped (they need four GPUs, this machine has $GPUS)"
}
if [ "${1:-all}" = layouts ]; then
    layouts
    exit $?
fi
if [ "${1:-all}" = features ]; then
    features
    exit $?
fi

# Only files that run on a GPU machine, and each must pass at least one test there (a file that
# skips whole on CUDA would be a silent no-op). The CPU/gloo files that skip whenever CUDA is
# present (test_adaptor_gpt.py, test_adaptor_output_layer.py, test_mindspeed*_source.py,
# test_mindspeed_llm_stand_in.py, test_output_layer_in_megatron_schedule.py: their shims keep Megatron
# off CUDA only without a GPU) run in CI.
# test_e2e_megatron_training.py and test_e2e_layouts.py need megatron.training (megatron-core
# 0.19.2, Python 3.12: CI's leg 2); the Megatron-LM style launch below is their GPU run.
# test_fp32_accumulation.py and test_linear_cross_entropy.py run on the CPU (gloo, the interpreter);
# test_linear_cross_entropy_gpu.py forces each CUDA accumulation of the weight gradient in turn.
# test_op_properties.py and test_linear_properties.py run on the CPU (gloo, the interpreter).
GPU_TEST_FILES=(ops/test_op.py ops/test_op_errors.py ops/test_op_autograd.py gpu/test_gpu.py kernels/test_launch_configs.py
                gpu/test_linear_cross_entropy_gpu.py)
echo "== op tests on CUDA"
(cd tests && timeout 480 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" "${GPU_TEST_FILES[@]}" 2>&1) \
    | tee "$OUT/gpu_tests.log" | tail -15
python3 - "$OUT/gpu_tests.xml" "${GPU_TEST_FILES[@]}" <<'PY' || exit 1
import os
import sys
import xml.etree.ElementTree as ET

passed = {}
for case in ET.parse(sys.argv[1]).iter("testcase"):
    if not any(child.tag in ("failure", "error", "skipped") for child in case):
        module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), "")
        passed[module] = passed.get(module, 0) + 1
count = {f: passed.get(os.path.basename(f)[: -len(".py")], 0) for f in sys.argv[2:]}
idle = [f for f, n in count.items() if n == 0]
print("passed per file:", count)
sys.exit(f"no test passed in: {' '.join(idle)}" if idle else 0)
PY

if [ "$GPUS" -ge 2 ]; then  # the demo and the Megatron-LM style launch run TP=2, one rank per GPU
    echo "== main job on GPUs (quick)"
    timeout 150 python3 examples/train_tiny_moe.py --quick 2>&1 | tee "$OUT/train_tiny_moe_gpu.log" | tail -15

    echo "== Megatron-LM style launch, TP=2 over NCCL"
    PYTHON=python3 TRAIN_ITERS=10 timeout 200 bash examples/run_megatron_lm_moe.sh 2>&1 | tee "$OUT/megatron_lm_moe_gpu.log" | grep -E "iteration|lm_z_loss|Error|error" | tail -15
else
    echo "== main job and Megatron-LM style launch: skipped (TP=2 needs two GPUs, this machine has $GPUS)"
fi

echo "== selfcheck, one GPU (both ops, every backend, small and real vocab 151936, each dtype)"
timeout 300 python3 -m mindspeed_cez.selfcheck --json "$OUT/selfcheck_1gpu.json" 2>&1 | tee "$OUT/selfcheck_1gpu.log" | tail -40
selfcheck_status=${PIPESTATUS[0]}
echo "selfcheck 1 GPU exit status: $selfcheck_status"
if [ "$GPUS" -ge 2 ]; then
    echo "== selfcheck, TP=2 over NCCL (torchrun)"
    timeout 300 torchrun --standalone --nproc-per-node 2 -m mindspeed_cez.selfcheck --json "$OUT/selfcheck_tp2.json" 2>&1 \
        | tee "$OUT/selfcheck_tp2.log" | tail -40
    tp2_status=${PIPESTATUS[0]}
    echo "selfcheck TP=2 exit status: $tp2_status"
    [ "$tp2_status" -eq 0 ] || selfcheck_status=$tp2_status
fi
layouts || selfcheck_status=$?
exit "$selfcheck_status"
