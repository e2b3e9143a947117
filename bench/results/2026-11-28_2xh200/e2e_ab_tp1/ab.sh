#!/usr/bin/env bash
# A/B of the fused layer's two forms end to end (TP=1, config busy): each process alternates the op and the
# fused layer step by step; defer (last block's GEMMs in backward) and main (all in forward) side by side on
# GPUs 0/1, then swapped. Usage: bash .gpu/ab.sh ROUND_S
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
R=${1:-200} O=/tmp/ab; mkdir -p $O
for t in defer main; do
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --no-build-isolation --target /tmp/site_$t .whl/*.whl ./.gpu/$t >/dev/null 2>&1 || echo "install $t failed"
done
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $O/env.txt
run() { # GPU TREE NAME [--profile]
  (cd .gpu/$2 && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=/tmp/site_$2 timeout $((R+40)) python3 bench/e2e_megatron.py --config busy --tp 1 \
     --alternate --pairs 1 --iters 400 --skip 5 --deadline-s $R ${4:-} --out $O/$3 > $O/$3.txt 2>&1)
}
run 0 defer r1_defer_gpu0 --profile & run 1 main r1_main_gpu1 --profile & wait
run 0 main r2_main_gpu0 & run 1 defer r2_defer_gpu1 & wait
for f in $O/r*.txt; do echo "-- $f"; grep -v '^ *\[20' $f | tail -6; done
