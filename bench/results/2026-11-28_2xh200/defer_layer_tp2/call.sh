#!/usr/bin/env bash
# the deferred-GEMM fused layer (tree .gpu/defer): the layer beside the peers (GPU 0) and its GPU tests (GPU 1),
# then the layer at TP=2 + SP and end to end at TP=2 + SP (op and fused layer alternated), both GPUs
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
O=/tmp/c3; mkdir -p $O; S=/tmp/site_defer
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --no-build-isolation --target $S .whl/*.whl ./.gpu/defer >/dev/null 2>&1 || echo "install failed"
cd .gpu/defer; export PYTHONPATH=$S
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/linear_cross_entropy.py --peers --iters 15 --out $O/layer.md > $O/layer.log 2>&1) &
(cd tests && CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -p no:cacheprovider gpu/test_linear_cross_entropy_gpu.py > $O/gpu_tests.log 2>&1) &
wait
CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/linear_cross_entropy.py --tp --fractions 0.5 --iters 10 --out $O/layer_tp2.md > $O/layer_tp2.log 2>&1
CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 bench/e2e_megatron.py --config busy --tp 2 --alternate --pairs 1 --iters 400 --skip 5 --deadline-s 200 --profile --out $O/e2e_tp2 > $O/e2e_tp2.txt 2>&1
tail -4 $O/gpu_tests.log; echo "-- layer"; tail -8 $O/layer.md; echo "-- layer tp2"; grep '^| [0-9]' $O/layer_tp2.md | cut -c1-160; echo "-- e2e tp2"; grep -v '^ *\[20' $O/e2e_tp2.txt | tail -8
