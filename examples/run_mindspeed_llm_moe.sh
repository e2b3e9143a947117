#!/usr/bin/env bash
# MindSpeed-LLM MoE pretraining (Ascend NPUs) with the fused LM cross entropy + z-loss.
# The model and parallel flags follow MindSpeed-LLM v26.0.0's Qwen3-30B-A3B pretrain script
# (examples/mcore/qwen3_moe/pretrain_qwen3_30b_a3b_4K_ptd.sh there), two nodes of 8 NPUs.
#
# The integration is one change to the launch line, no Python file edited: torchrun runs
# MindSpeed-LLM's pretrain_gpt.py through the launcher,
#
#     torchrun $DISTRIBUTED_ARGS -m mindspeed_cez.launch pretrain_gpt.py ... --lm-z-loss-coeff 1e-4
#
# which imports mindspeed_cez.megatron_adaptor and then runs pretrain_gpt.py as `python pretrain_gpt.py`
# would (its own `from mindspeed_llm import megatron_adaptor` runs after ours; either order is served).
# MindSpeed-LLM's argument parser then knows --lm-z-loss-coeff, its own GPTModel forward computes
# the loss with the fused kernel (on the logits after --output-multiplier-scale and
# --output-logit-softcapping), and its training log line shows lm_z_loss next to lm loss.
# Refused at startup, naming both flags: --loss-compute-mode chunk at TP=1 and CP=1 (its chunked
# loss never reaches the kernel) and --is-instruction-dataset. Not run here: no NPU (README).
#
#   MINDSPEED_LLM_DIR=/path/to/MindSpeed-LLM TOKENIZER_PATH=/path/to/Qwen3-30B-A3B \
#   DATA_PATH=/path/to/dataset_text_document bash examples/run_mindspeed_llm_moe.sh
set -euo pipefail

MINDSPEED_LLM_DIR="${MINDSPEED_LLM_DIR:?set MINDSPEED_LLM_DIR to a MindSpeed-LLM checkout}"
TOKENIZER_PATH="${TOKENIZER_PATH:?set TOKENIZER_PATH to a HuggingFace tokenizer directory}"
DATA_PATH="${DATA_PATH:?set DATA_PATH to a Megatron-preprocessed dataset prefix}"
NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
TP="${TP:-1}"
PP="${PP:-2}"
EP="${EP:-8}"
SEQ_LENGTH="${SEQ_LENGTH:-4096}"
TRAIN_ITERS="${TRAIN_ITERS:-2000}"
Z_LOSS_COEFF="${Z_LOSS_COEFF:-1e-4}"
CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-./ckpt_qwen3_moe_cez}"
USE_LAUNCHER="${USE_LAUNCHER:-1}"

export HCCL_CONNECT_TIMEOUT=1800
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
# CANN environment (set_env.sh) is expected to be sourced already.

cd "$MINDSPEED_LLM_DIR"
LAUNCH="-m mindspeed_cez.launch pretrain_gpt.py"
[ "$USE_LAUNCHER" = 1 ] || LAUNCH=pretrain_gpt.py  # with the import added to pretrain_gpt.py by hand

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR --master_port $MASTER_PORT"

# The flag: trains on CE + C * logsumexp(logits)^2 per token (lm loss stays CE), logs lm_z_loss.
Z_LOSS_ARGS=""
if [ "$Z_LOSS_COEFF" != "0" ]; then
    Z_LOSS_ARGS="--lm-z-loss-coeff $Z_LOSS_COEFF"
fi

MOE_ARGS="
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001
    --moe-grouped-gemm --moe-permutation-async-comm --moe-token-dispatcher-type alltoall_seq
    --moe-layer-freq -1 --first-k-dense-replace -1
"
OPTIMIZE_ARGS="
    --use-flash-attn --use-fused-rotary-pos-emb --use-rotary-position-embeddings --use-fused-swiglu
    --use-fused-rmsnorm --no-masked-softmax-fusion --use-distributed-optimizer --sequence-parallel
    --gemm-gradient-accumulation-fusion
    --recompute-method uniform --recompute-granularity full --recompute-num-layers 1
"
TRAIN_ARGS="
    --micro-batch-size 1 --global-batch-size 256 --train-iters $TRAIN_ITERS --seq-length $SEQ_LENGTH
    --lr 1.25e-6 --min-lr 1.25e-7 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 1e-1
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.01 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096 --seed 42 --bf16 --no-shared-storage
"
MODEL_PARALLEL_ARGS="
    --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --expert-model-parallel-size $EP
    --context-parallel-size 1
"
GPT_ARGS="
    --use-mcore-models --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec
    --kv-channels 128 --qk-layernorm --norm-topk-prob
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER_PATH
    --max-position-embeddings $SEQ_LENGTH --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
    --num-attention-heads 32 --group-query-attention --num-query-groups 4
    --make-vocab-size-divisible-by 1 --padded-vocab-size 151936 --rotary-base 1000000
    --untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type rope
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --attention-softmax-in-fp32
    --no-gradient-accumulation-fusion --transformer-impl local
"
DATA_ARGS="--data-path $DATA_PATH --split 100,0,0"
OUTPUT_ARGS="--log-interval 1 --save-interval $TRAIN_ITERS --eval-interval $TRAIN_ITERS --eval-iters 0 --save $CKPT_SAVE_DIR"

mkdir -p logs
torchrun $DISTRIBUTED_ARGS $LAUNCH \
    $GPT_ARGS $MOE_ARGS $OPTIMIZE_ARGS $TRAIN_ARGS $MODEL_PARALLEL_ARGS $Z_LOSS_ARGS $DATA_ARGS $OUTPUT_ARGS \
    --distributed-backend nccl \
    "$@" | tee logs/pretrain_qwen3_moe_cez.log
