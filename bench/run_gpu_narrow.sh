export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . && export PYTHONPATH=/tmp/site
for s in "16384 16160" "8192 151936"; do
  tag=$(echo $s | tr ' ' x)
  timeout 150 ncu --kernel-name regex:'_forward_kernel|_grad_kernel' --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 bench/ncu_op.py $s 5 > $OUT/ncu_$tag.txt 2>&1; echo "ncu $tag rc=$?"
done
timeout 240 python3 bench/tune_kernels.py --shapes 8192x37984,16384x16160 --fwd-blocks 8192 --slot-widths 16 --fwd-warps 4,8 --fwd-per-core 32,64,128 --bwd-blocks 8192,16384 --bwd-warps 4,8 --bwd-per-core 32,64,128 2>&1 | tee $OUT/tune_narrow.log | grep -E "best|device"
