#!/usr/bin/env bash
# One device call (carry .whl): Nsight Compute of the forward and grad kernels at a narrow and a
# wide shape (bench/ncu_op.py), then a launch-setting sweep at the narrow shapes. What produced
# bench/ncu/ and bench/tune_kernels_narrow_h200_2026-11-23b.log.
#
#     bash bench/run_gpu_narrow.sh
set -u -o pipefail
source bench/device_setup.sh
for s in "16384 16160" "8192 151936"; do
  tag=$(echo $s | tr ' ' x)
  timeout 150 ncu --kernel-name regex:'_forward_kernel|_grad_kernel' --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    $PY bench/ncu_op.py $s 5 > "$OUT/ncu_$tag.txt" 2>&1; echo "ncu $tag rc=$?"
done
timeout 240 $PY bench/tune_kernels.py --shapes 8192x37984,16384x16160 --fwd-blocks 8192 --slot-widths 16 --fwd-warps 4,8 \
    --fwd-per-core 32,64,128 --bwd-blocks 8192,16384 --bwd-warps 4,8 --bwd-per-core 32,64,128 2>&1 \
    | tee "$OUT/tune_narrow.log" | grep -E "best|device"
