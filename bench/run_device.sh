#!/usr/bin/env bash
# One device-tool call from the repository root: [WHEELS=DIR] bash bench/run_device.sh STEP [STEP ...]
# (no STEP: env tests peers; WHEELS: the folder of wheels, default .whl). Installs the wheels and this tree into $SITE, keeps NVLink multicast off;
# each step writes to $OUT. Steps, outputs, $LINEAR_ARGS / $E2E_ARGS: bench/README.md.
set -u -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-$PWD/out} SITE=${SITE:-/tmp/site} PY=${PYTHON:-python3} WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS/: carry them, or set WHEELS=DIR" >&2; exit 2; }
pip_install() { $PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" "$@" || exit 1; }
pip_install --no-compile "$WHEELS"/*.whl
pip_install --no-build-isolation .
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
for pth in "$SITE"/*.pth; do  # pip --target leaves .pth files unread (nvidia-cutlass-dsl's dsl_packages)
    [ -f "$pth" ] || continue
    while read -r line; do
        case "$line" in ''|'#'*|import*) ;; *) [ -d "$SITE/$line" ] && PYTHONPATH=$PYTHONPATH:$SITE/$line
                                            [ -d "$line" ] && PYTHONPATH=$PYTHONPATH:$line ;; esac
    done <"$pth"
done

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
step_tests() {  # the op's and the fused layer's GPU tests (tests/run_gpu_checks.sh runs every GPU check)
    (cd tests && timeout 420 $PY -m pytest -q -p no:cacheprovider ops/test_cross_entropy_zloss.py ops/test_cross_entropy_zloss_errors.py \
        ops/test_first_order.py environments/gpu/test_gpu.py environments/gpu/test_linear_cross_entropy_gpu.py \
        kernels/test_triton_cross_entropy_launch_configs.py 2>&1) | tee "$OUT/gpu_tests.log" | tail -4
}
step_peers() { timeout 400 $PY bench/op.py --budget-s 300 --out "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -20; }
step_peers-tp() {  # op.py --tp at world size 1, 2, 4, 8 while the GPUs found allow: bench_tp<N>.md
    local gpus world
    gpus=$(nvidia-smi -L | wc -l)
    for world in 1 2 4 8; do
        [ "$world" -le "$gpus" ] || break
        timeout 150 $PY -m torch.distributed.run --standalone --nproc-per-node "$world" \
            bench/op.py --tp --out "$OUT/bench_tp$world.md" 2>&1 | tee "$OUT/bench_tp$world.log" | tail -6
    done
}
step_breakdown() {  # where the fused layer's time goes, per shape: breakdown.md/.json, breakdown_detail.md
    timeout "${BREAKDOWN_S:-300}" $PY bench/linear_cross_entropy.py --breakdown ${BREAKDOWN_ARGS:-} \
        --detail "$OUT/breakdown_detail.md" --out "$OUT/breakdown.md" 2>&1 | tail -4
}
step_linear-ce() { timeout "${LINEAR_S:-400}" $PY bench/linear_cross_entropy.py ${LINEAR_ARGS:-} --out "$OUT/linear_ce.md" 2>&1 | tail -24; }
step_e2e() {
    timeout "${E2E_S:-560}" $PY bench/e2e_megatron.py ${E2E_ARGS:---config busy --variants native cez --pairs 3 --profile} \
        --out "$OUT/e2e" 2>&1 | grep -v '^ *\[20' | tail -40
    tar -czf "$OUT/e2e.tar.gz" -C "$OUT" e2e && rm -r "$OUT/e2e"
}
step_long-context() {  # bench/long_context.py $LONG_ARGS (default: memory): long_context/*.json, long_context.txt, logs
    timeout "${LONG_S:-560}" $PY bench/long_context.py ${LONG_ARGS:-memory} --out "$OUT/long_context" 2>&1 \
        | grep -v '^ *\[20' | tee "$OUT/long_context.txt" | grep -E "tokens|wrote"
    tar -czf "$OUT/long_context_logs.tar.gz" --exclude '*.json' -C "$OUT" long_context && rm -f "$OUT"/long_context/*.log
}
step_e2e-tp12() {  # TP=1 on the first GPU and TP=2 + SP on the last two, at once (3+ GPUs); each packed in one file
    local args=${E2E_ARGS:---config busy --variants cez cez_fol --pairs 3 --iters 20 --profile} n
    n=$(nvidia-smi -L | wc -l)
    [ "$n" -ge 3 ] || { echo "e2e-tp12 needs 3 GPUs or more, $n present" >&2; return 2; }
    CUDA_VISIBLE_DEVICES=0 timeout 560 $PY bench/e2e_megatron.py $args --tp 1 --out "$OUT/e2e_tp1" >"$OUT/e2e_tp1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=$((n - 2)),$((n - 1)) timeout 560 $PY bench/e2e_megatron.py $args --tp 2 --out "$OUT/e2e_tp2" \
        >"$OUT/e2e_tp2.txt" 2>&1 &
    wait
    for tp in 1 2; do
        echo "-- TP=$tp"; grep -v '^ *\[20' "$OUT/e2e_tp$tp.txt" | tail -12
        tar -czf "$OUT/e2e_tp$tp.tar.gz" -C "$OUT" "e2e_tp$tp" && rm -r "$OUT/e2e_tp$tp"
    done
}

step_final() {  # 4 GPUs, FINAL_S (400) seconds from here: the tables of docs/performance.md's fused-layer section
    # GPU 0: e2e TP=1; GPUs 1-2: the layer at TP=2 + SP, then e2e TP=2 + SP; GPU 3: the layer beside the peers,
    # where its time goes, then e2e TP=1 again while 150 s are left
    local n end t
    n=$(nvidia-smi -L | wc -l)
    [ "$n" -ge 4 ] || { echo "final needs 4 GPUs, $n present" >&2; return 2; }
    end=$(( $(date +%s) + ${FINAL_S:-400} ))
    left() { echo $(( end - $(date +%s) )); }
    e2e() {  # GPUS TP NAME [--profile]: the op and the fused layer alternated step by step until the deadline
        CUDA_VISIBLE_DEVICES=$1 $PY bench/e2e_megatron.py --config busy --tp "$2" --alternate --pairs 1 --iters 400 \
            --skip 5 --deadline-s "$(( $(left) - 10 ))" ${4:-} --out "$OUT/$3" >"$OUT/$3.txt" 2>&1
    }
    e2e 0 1 e2e_tp1 --profile &
    (CUDA_VISIBLE_DEVICES=1,2 timeout 100 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/linear_cross_entropy.py --tp --fractions 0.5 --iters 10 --out "$OUT/layer_tp2.md" >"$OUT/layer_tp2.log" 2>&1
     e2e 1,2 2 e2e_tp2 --profile) &
    (CUDA_VISIBLE_DEVICES=3 timeout 180 $PY bench/linear_cross_entropy.py --peers --iters 15 \
        --out "$OUT/layer.md" >"$OUT/layer.log" 2>&1
     CUDA_VISIBLE_DEVICES=3 timeout 80 $PY bench/linear_cross_entropy.py --breakdown --fractions 0.5 1.0 --iters 8 \
        --detail "$OUT/breakdown_detail.md" --out "$OUT/breakdown.md" >"$OUT/breakdown.log" 2>&1
     [ "$(left)" -gt 150 ] && e2e 3 1 e2e_tp1_gpu3) &
    wait
    for t in e2e_tp1 e2e_tp1_gpu3 e2e_tp2; do
        [ -d "$OUT/$t" ] && tar -czf "$OUT/$t.tar.gz" -C "$OUT" "$t" && rm -r "$OUT/$t"
    done
    echo "-- TP=2 + SP layer (rank 0)"; grep '^| [0-9]' "$OUT/layer_tp2.md" 2>/dev/null | cut -c1-150 || tail -3 "$OUT/layer_tp2.log"
    for t in e2e_tp1 e2e_tp1_gpu3 e2e_tp2; do
        echo "-- $t"; grep -v '^ *\[20' "$OUT/$t.txt" 2>/dev/null | tail -9
    done
    echo "-- one GPU, the layer beside the peers (events, / unfused into main_grad)"
    tail -n 7 "$OUT/layer.md" 2>/dev/null || tail -5 "$OUT/layer.log"
}

[ $# -gt 0 ] || set -- env tests peers
for step in "$@"; do
    declare -F "step_$step" >/dev/null || { echo "unknown step: $step" >&2; exit 2; }
    echo "== $step"
    "step_$step"
done
