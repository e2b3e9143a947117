#!/usr/bin/env bash
# Megatron-LM style MoE pretraining launch with the fused LM cross entropy + z-loss.
#
# The integration is one change to the launch line: run the pretrain script through the launcher,
#
#     torchrun ... -m mindspeed_cez.launch pretrain_gpt.py <Megatron args> --lm-z-loss-coeff 1e-4
#
# (it imports mindspeed_cez.megatron_adaptor, then runs the script unchanged; set
# PRETRAIN_SCRIPT=/path/to/Megatron-LM/pretrain_gpt.py for Megatron-LM's own) plus the flag
# (0 / absent: Megatron's own cross entropy),
#
# and `lm_z_loss` appears in Megatron's log line next to `lm loss` and `load_balancing_loss`.
#
# 2 GPUs: NCCL.  No GPU: gloo, and the entry script turns on the package's CPU mode itself.
#   bash examples/run_megatron_lm_moe.sh                     # tiny MoE, mock data, 20 iterations
#   Z_LOSS_COEFF=0 bash examples/run_megatron_lm_moe.sh      # baseline, Megatron's own CE
#   bash examples/run_megatron_lm_moe.sh --train-iters 50    # extra args go to Megatron
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
PRETRAIN_SCRIPT="${PRETRAIN_SCRIPT:-examples/pretrain_gpt.py}"
NPROC="${NPROC:-2}"
TP="${TP:-2}"
Z_LOSS_COEFF="${Z_LOSS_COEFF:-1e-4}"
TRAIN_ITERS="${TRAIN_ITERS:-20}"
LOG="${LOG:-}"  # optional: also write the log here

export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Megatron's training loop: from the pretrain script's folder (a Megatron-LM checkout) or the
# megatron-core wheel (the wheels ship megatron.training from 0.17 on, for Python >= 3.12; 0.19.2 tested).
if ! PYTHONPATH="$(dirname "$PRETRAIN_SCRIPT")${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
        'import importlib.util, sys; sys.exit(importlib.util.find_spec("megatron.training") is None)' 2>/dev/null; then
    echo "run_megatron_lm_moe.sh: $PYTHON cannot import megatron.training (Megatron's training loop): on Python" \
         ">= 3.12 pip install megatron-core==0.19.2, or set PRETRAIN_SCRIPT=<Megatron-LM checkout>/pretrain_gpt.py" >&2
    exit 2
fi

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    BACKEND=nccl
    echo "GPU found: NCCL over $NPROC GPUs, no CPU mode"
else
    BACKEND=gloo
    echo "no GPU: gloo over $NPROC CPU processes, in the CPU mode of the entry script"
fi

GPT_ARGS=(
    --num-layers "${NUM_LAYERS:-2}" --hidden-size "${HIDDEN:-64}" --ffn-hidden-size "${FFN_HIDDEN:-128}"
    --num-attention-heads "${HEADS:-4}" --seq-length "${SEQ:-32}" --max-position-embeddings "${SEQ:-32}"
    --micro-batch-size "${MBS:-2}" --global-batch-size "${GBS:-4}"
    --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.01
    --train-iters "$TRAIN_ITERS" --log-interval 1 --eval-iters 0 --eval-interval 1000000 --seed 1234
)
MOE_ARGS=(
    --num-experts "${EXPERTS:-4}" --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --sequence-parallel --distributed-backend "$BACKEND"
)
DATA_ARGS=(
    --mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-511}"
)
# Megatron-core only (no Transformer Engine / Apex needed), on CPU and GPU alike.
IMPL_ARGS=(
    --transformer-impl local --attention-backend unfused --no-gradient-accumulation-fusion
    --use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion
    --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm
)
Z_LOSS_ARGS=()
if [ "$Z_LOSS_COEFF" != "0" ]; then
    Z_LOSS_ARGS=(--lm-z-loss-coeff "$Z_LOSS_COEFF")
fi

cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1
     --master-port "${MASTER_PORT:-29517}" -m mindspeed_cez.launch "$PRETRAIN_SCRIPT"
     "${GPT_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${IMPL_ARGS[@]}"
     "${Z_LOSS_ARGS[@]}" "$@")
echo "${cmd[*]}"
if [ -n "$LOG" ]; then
    "${cmd[@]}" 2>&1 | tee "$LOG"
else
    "${cmd[@]}"
fi
