#!/usr/bin/env bash
# Everything that needs GPUs, as three device calls from the repository root (carry .whl, see
# bench/README.md), each ending within DEADLINE_S (default 570 s: a 10-minute device command with room
# for the machine's start). Logs land in $OUT.
#
#     bash tests/run_gpu_checks.sh            # the op's tests on CUDA (incl. TP=2 over NCCL), the main job
#                                             # on GPUs, the Megatron-LM style launch (TP=2), the self-check
#                                             # users run (one GPU; TP=2 through torchrun)
#     bash tests/run_gpu_checks.sh layouts    # the parallel layouts of Megatron's pretrain (tests/support/gpu_layouts.py, 4 GPUs)
#     bash tests/run_gpu_checks.sh features   # CUDA graphs, FSDP, resharding resumes, fault tolerance
#                                             # (tests/support/gpu_megatron_features.py, 4 GPUs)
#
# Each step's time limit is cut to what is left before the deadline; a step that cannot start in time,
# or needs more GPUs than present, is named at the end ("not run: ... why"), as are the failed ones. The
# two Python scripts start their launches as the host's cores and the GPUs' free memory allow, with
# timeouts scaled by the load (tests/support/launch_admission.py), and list the launches they could not run.
set -u -o pipefail
DEADLINE_S=${DEADLINE_S:-570}
# shellcheck source=tests/support/gpu_checks_steps.sh
. "$(dirname "$0")/support/gpu_checks_steps.sh"  # step, summary: time limits cut to the deadline, the closing list
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "${1:-all}" = layouts ] || [ "${1:-all}" = features ]; then
    if [ "$GPUS" -ge 4 ]; then
        # every layout of Megatron's pretrain the GPUs hold, 4 variants each; or the flag under Megatron's CUDA
        # graphs, FSDP, resharding resumes and fault tolerance. Asserted; the script lists launches not run.
        script=$([ "$1" = layouts ] && echo tests/support/gpu_layouts.py || echo tests/support/gpu_megatron_features.py)
        # shellcheck disable=SC2086  # FEATURES_ARGS: e.g. --only REGEX --timeout-s 150 for part of it
        step "$1" $(($(left) - 10)) 120 "$OUT/$1.log" 80 python3 "$script" --out "$OUT/$1" \
            --deadline-s $(($(left) - 40)) ${FEATURES_ARGS:-}
    else
        ABSENT+=("$1: needs four GPUs, this machine has $GPUS")
    fi
    summary
    exit $?
fi

# Only files that run on a GPU machine, and each must pass at least one test there (a file that
# skips whole on CUDA would be a silent no-op). The CPU/gloo files that skip whenever CUDA is
# present (test_loss_wrappers_gpt.py, test_model_context_output_layer.py, test_mindspeed*_source.py,
# test_mindspeed_llm_stand_in.py, test_output_layer_in_megatron_schedule.py: the CPU mode keeps Megatron
# off CUDA only without a GPU) run in CI.
# test_e2e_megatron_training.py and test_e2e_layouts.py need megatron.training (megatron-core
# 0.19.2, Python 3.12: CI's leg 2); the Megatron-LM style launch below is their GPU run.
# test_linear_forward_grads_accumulation.py and test_linear_cross_entropy.py run on the CPU (gloo, the interpreter);
# test_linear_cross_entropy_gpu.py forces each CUDA accumulation of the weight gradient in turn.
# test_cross_entropy_zloss_properties.py and test_linear_cross_entropy_properties.py run on the CPU (gloo, the interpreter).
GPU_TEST_FILES=(ops/test_cross_entropy_zloss.py ops/test_cross_entropy_zloss_errors.py ops/test_first_order.py
                environments/gpu/test_gpu.py kernels/test_triton_cross_entropy_launch_configs.py
                kernels/test_kernels_logit_transform.py
                environments/gpu/test_linear_cross_entropy_gpu.py)
step "op tests on CUDA" 480 120 "$OUT/gpu_tests.log" 15 \
    bash -c 'cd tests && exec python3 -m pytest -q -p no:cacheprovider --junitxml="$0/gpu_tests.xml" "$@"' \
    "$OUT" "${GPU_TEST_FILES[@]}"
python3 - "$OUT/gpu_tests.xml" "${GPU_TEST_FILES[@]}" <<'PY' || FAILED+=("op tests: a file passed no test on CUDA")
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
    step "main job on GPUs (quick)" 150 60 "$OUT/train_tiny_moe_gpu.log" 15 python3 -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick
    step "Megatron-LM style launch, TP=2 over NCCL" 200 90 "$OUT/megatron_lm_moe_gpu.log" 15 \
        env PYTHON=python3 TRAIN_ITERS=10 bash examples/run_megatron_lm_moe.sh
else
    ABSENT+=("main job and Megatron-LM style launch: TP=2 needs two GPUs, this machine has $GPUS")
fi
step "selfcheck, one GPU (both ops, every backend, small and real vocab 151936, each dtype)" 300 60 \
    "$OUT/selfcheck_1gpu.log" 40 python3 -m mindspeed_cez.selfcheck --json "$OUT/selfcheck_1gpu.json"
if [ "$GPUS" -ge 2 ]; then
    step "selfcheck, TP=2 over NCCL (torchrun)" 300 60 "$OUT/selfcheck_tp2.log" 40 \
        torchrun --standalone --nproc-per-node 2 -m mindspeed_cez.selfcheck --json "$OUT/selfcheck_tp2.json"
else
    ABSENT+=("selfcheck TP=2: needs two GPUs, this machine has $GPUS")
fi
echo "(the parallel layouts and Megatron's features are commands of their own: bash tests/run_gpu_checks.sh layouts;"
echo " bash tests/run_gpu_checks.sh features)"
summary
