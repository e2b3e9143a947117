#!/usr/bin/env bash
# MindSpeed-LLM style MoE pretraining (Ascend NPUs) with the fused LM cross entropy + z-loss.
#
# Not run in this repository's CI (it needs MindSpeed-LLM, MindSpeed and torch_npu); the CI runs
# the Megatron-LM flavour (examples/run_megatron_lm_moe.sh, tests/test_e2e_megatron_training.py).
#
# The integration is the same one line, placed after MindSpeed-LLM's own adaptor (which patches
# Megatron for the NPU) in MindSpeed-LLM's pretrain_gpt.py:
#
#     from mindspeed_llm import megatron_adaptor     # already there
#     import mindspeed_cez.megatron_adaptor          # registers the lm-z-loss MindSpeed feature
#
# so that MindSpeed's features manager adds --lm-z-loss-coeff / --lm-fused-ce / --no-lm-fused-ce to
# the parser, validates them, and registers the patches through its patch manager. If you would
# rather not edit pretrain_gpt.py, this script writes a 4-line launcher that does the two imports
# and then runs pretrain_gpt.py unchanged (USE_LAUNCHER=1, the default).
#
#   MINDSPEED_LLM_DIR=/path/to/MindSpeed-LLM TOKENIZER_PATH=/path/to/hf_tokenizer \
#   DATA_PATH=/path/to/dataset_text_document bash examples/run_mindspeed_llm_moe.sh
set -euo pipefail

MINDSPEED_LLM_DIR="${MINDSPEED_LLM_DIR:?set MINDSPEED_LLM_DIR to a MindSpeed-LLM checkout}"
TOKENIZER_PATH="${TOKENIZER_PATH:?set TOKENIZER_PATH to a HuggingFace tokenizer directory}"
DATA_PATH="${DATA_PATH:?set DATA_PATH to a Megatron-preprocessed dataset prefix}"
NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
TP="${TP:-2}"
PP="${PP:-1}"
EP="${EP:-4}"
Z_LOSS_COEFF="${Z_LOSS_COEFF:-1e-4}"
CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-./ckpt_moe_cez}"
USE_LAUNCHER="${USE_LAUNCHER:-1}"

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
# CANN environment (set_env.sh) is expected to be sourced already.

cd "$MINDSPEED_LLM_DIR"
PRETRAIN=pretrain_gpt.py
if [ "$USE_LAUNCHER" = 1 ]; then
    PRETRAIN="$(mktemp -d)/pretrain_gpt_cez_launcher.py"
    cat > "$PRETRAIN" <<EOF
import runpy, sys
from mindspeed_llm import megatron_adaptor  # noqa: F401  MindSpeed-LLM's NPU patches first
import mindspeed_cez.megatron_adaptor  # noqa: F401  then the lm-z-loss feature
sys.path.insert(0, "$MINDSPEED_LLM_DIR"); sys.argv[0] = "$MINDSPEED_LLM_DIR/pretrain_gpt.py"
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
fi

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

MOE_ARGS="
    --num-experts 8 \
    --expert-model-parallel-size $EP \
    --moe-router-topk 2 \
    --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 0.01 \
    --moe-token-dispatcher-type alltoall \
    --moe-grouped-gemm \
    --moe-permutation-async-comm
"

# The flag: trains on CE + C * logsumexp(logits)^2 per token (lm loss stays CE), logs lm_z_loss (0 = MindSpeed/Megatron CE).
Z_LOSS_ARGS=""
if [ "$Z_LOSS_COEFF" != "0" ]; then
    Z_LOSS_ARGS="--lm-z-loss-coeff $Z_LOSS_COEFF"
fi

GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size $TP \
    --pipeline-model-parallel-size $PP \
    --sequence-parallel \
    --use-distributed-optimizer \
    --num-layers 16 \
    --hidden-size 2048 \
    --ffn-hidden-size 5632 \
    --num-attention-heads 16 \
    --group-query-attention \
    --num-query-groups 4 \
    --seq-length 4096 \
    --max-position-embeddings 4096 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --use-fused-rmsnorm \
    --swiglu \
    --use-fused-swiglu \
    --use-fused-rotary-pos-emb \
    --use-flash-attn \
    --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path $TOKENIZER_PATH \
    --micro-batch-size 1 \
    --global-batch-size 64 \
    --lr 3e-4 \
    --min-lr 3e-5 \
    --lr-decay-style cosine \
    --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --init-method-std 0.01 \
    --train-iters 2000 \
    --no-gradient-accumulation-fusion \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --bf16
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --split 100,0,0
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 1000 \
    --eval-interval 1000 \
    --eval-iters 0 \
    --save $CKPT_SAVE_DIR
"

mkdir -p logs
torchrun $DISTRIBUTED_ARGS "$PRETRAIN" \
    $GPT_ARGS $MOE_ARGS $Z_LOSS_ARGS $DATA_ARGS $OUTPUT_ARGS \
    --distributed-backend nccl \
    "$@" | tee logs/pretrain_moe_cez.log
