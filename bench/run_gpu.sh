#!/usr/bin/env bash
# The whole GPU benchmark as one device call, run from the repository root:
#
#     bash bench/run_gpu.sh            (carry: .whl)
#
# The GPU machine has no network and neither megatron-core nor liger-kernel: they travel as
# wheels in .whl/ (see bench/README.md for the download line). This package is installed from
# the working tree next to them in /tmp/site (kernels/ and patches/ only become
# mindspeed_cez.kernels / mindspeed_cez.patches through the install). Results land in $OUT:
#   env.txt        GPUs, driver, package versions
#   bench.md/.log  single GPU: 5 implementations x 4 shapes, correctness, copy-bandwidth floor
#   bench_tp.md/.log  2 GPUs (torchrun, NCCL): per-rank kernel / op at TP=1 / op at TP=2
# Worst case about 20 + 400 + 140 s, inside the device tool's 600 s per command.
set -u -o pipefail
source bench/device_setup.sh

{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    nvidia-smi topo -m
    (cd /tmp && $PY -c 'import mindspeed_cez.kernels as k, torch, triton; print("mindspeed_cez from", k.__file__); print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())')
    for pkg in megatron-core liger-kernel mindspeed_cez numpy transformers; do
        (cd /tmp && $PY -c "import sys; from importlib.metadata import version; print(sys.argv[1], version(sys.argv[1]))" $pkg) 2>/dev/null || echo "$pkg not installed"
    done
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 400 $PY bench/bench_cross_entropy.py --budget-s 300 --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"
echo "single-GPU run exit status: $?"

ngpu=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "${ngpu:-0}" -ge 2 ]; then
    timeout 140 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/bench_cross_entropy.py --tp --out "$OUT/bench_tp.md" 2>&1 | tee "$OUT/bench_tp.log"
    echo "TP run exit status: $?"
else
    echo "TP run skipped: $ngpu GPU(s) here, it needs 2" | tee "$OUT/bench_tp.md"
fi
