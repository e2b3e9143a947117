#!/usr/bin/env bash
# One phase of the z-loss sweep on a GPU machine without network, from this checkout's root.
#
#   bash examples/zloss_sweep_offline.sh PHASE WHEELS DATA OUT [zloss_lr_sweep.py args ...]
#
# PHASE: A or B (B needs --best-lr LR among the args), pilot or study (the long runs stopped at divergence). WHEELS: a folder with the megatron-core
# wheel (pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2);
# torch, tensorboard and tokenizers come with the machine. DATA: the corpus as it travels, either
# corpus.jsonl.xz + tokenizer.json (examples/pypi_text_corpus.py encodes them there and checks the
# digests) or a finished build. OUT: where the results go, at most 8 files: PHASE_sweep.log,
# PHASE_sweep.json, PHASE_summary.json, PHASE_series.json.gz (A / B: every TensorBoard point),
# PHASE_logs.tgz, PHASE_report.tgz (A / B), PHASE_data.json, PHASE_data_build.log.
# Environment: PYTHON (python3), SITE (where the wheels and this package are installed), WORK
# (scratch); TOTAL_S: the whole call's seconds, the sweep's --budget-s then being what the install
# and the data leave of it, less RESERVE_S (100) for the summary and the packing; CUDA_VISIBLE_DEVICES:
# the GPUs the runs may use; MPS_GPUS (e.g. 0,1): those GPUs' runs share them through a CUDA MPS server
# of this call's own (private pipe folder, stopped at the end; skipped when nvidia-cuda-mps-control is
# absent or a probe through it fails). No GPU setting is changed.
set -u -o pipefail
[ $# -ge 4 ] || { sed -n 2,18p "$0"; exit 2; }
PHASE=$1 WHEELS=$(realpath "$2") DATA=$(realpath "$3") OUT=$4
shift 4
PY=${PYTHON:-python3} SITE=${SITE:-/tmp/zloss_site} WORK=${WORK:-/tmp/zloss_work}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
mkdir -p "$OUT" "$WORK/data"
OUT=$(realpath "$OUT")
start=$SECONDS
stamp() { echo "== zloss $PHASE [$((SECONDS - start)) s] $*"; }

stamp "install megatron-core and this package into $SITE"
$PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/megatron_core-*.whl || exit 1
$PY -m pip install -q --no-index --no-deps --no-cache-dir --no-build-isolation --upgrade --target "$SITE" . || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
for f in "$DATA"/*; do [ -e "$WORK/data/$(basename "$f")" ] || cp -r "$f" "$WORK/data/"; done

stamp "data: build or check $WORK/data"
$PY examples/pypi_text_corpus.py build --dir "$WORK/data" >"$OUT/${PHASE}_data_build.log" 2>&1 || {
    tail -20 "$OUT/${PHASE}_data_build.log"; exit 1; }

if [ -n "${MPS_GPUS:-}" ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    pipe=$WORK/mps
    mkdir -p "$pipe" "${pipe}_log"
    if CUDA_VISIBLE_DEVICES=$MPS_GPUS CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=${pipe}_log \
            nvidia-cuda-mps-control -d; then
        trap 'echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe nvidia-cuda-mps-control' EXIT
        ok=1
        for g in ${MPS_GPUS//,/ }; do
            CUDA_VISIBLE_DEVICES=$g CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=${pipe}_log timeout 30 \
                $PY -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4" || ok=0
        done
        if [ $ok = 1 ]; then
            export ZLOSS_MPS_PIPE=$pipe ZLOSS_MPS_GPUS=$MPS_GPUS
            stamp "MPS on GPUs $MPS_GPUS"
        else
            echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe nvidia-cuda-mps-control
            trap - EXIT
            stamp "MPS probe failed: runs without MPS"
        fi
    else
        stamp "MPS daemon did not start: runs without MPS"
    fi
fi
budget=()
if [ -n "${TOTAL_S:-}" ]; then  # the sweep gets what is left of TOTAL_S, less RESERVE_S for the summary and packing
    budget=(--budget-s $((TOTAL_S - (SECONDS - start) - ${RESERVE_S:-100})))
fi

stamp "sweep ${budget[*]}"
$PY examples/zloss_lr_sweep.py --data "$WORK/data" --phase "$PHASE" --out "$WORK/$PHASE" "$@" "${budget[@]}" 2>&1 \
    | tee "$OUT/${PHASE}_sweep.log"
rc=${PIPESTATUS[0]}

stamp "pack the results (sweep rc=$rc)"
R=$WORK/$PHASE
cp "$R/sweep.json" "$OUT/${PHASE}_sweep.json" 2>/dev/null
cp "$R/summary.json" "$OUT/${PHASE}_summary.json" 2>/dev/null
[ -e "$R/series_full.json.gz" ] && cp "$R/series_full.json.gz" "$OUT/${PHASE}_series.json.gz"
cp "$WORK/data/build.json" "$OUT/${PHASE}_data.json" 2>/dev/null
tar czf "$OUT/${PHASE}_logs.tgz" -C "$R" logs 2>/dev/null
[ -d "$R/report" ] && tar czf "$OUT/${PHASE}_report.tgz" -C "$R" report
ls -la "$OUT"
stamp "done"
exit "$rc"
