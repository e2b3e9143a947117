"""Peak memory of one GPU in Megatron's ``pretrain`` per LM loss, and the longest micro-batch that fits.

    python bench/estimate_memory.py --hidden 4096 --layers 32 --vocab 151936 --tp 1 --tokens 8192
    python bench/estimate_memory.py --config deep --tokens 65536     # a model of bench/e2e_megatron.py

Bytes per token, bf16 weights and activations, vocabulary V per rank (V / TP), hidden h (activations / TP
with sequence parallelism), L layers:

* the logits' part (``LOGIT_BYTES``, x V):
  Megatron's CE 6 (the bf16 logits 2 + their fp32 copy 4, which becomes the softmax, then the gradient;
  backward casts it to bf16 beside it); its fused CE 10 (its jit-fused steps return new fp32 buffers: the
  bf16 logits, the fp32 logits and the fp32 exponentials at once); Liger's patch 6 (the bf16 logits and its
  fp32 exponential buffer, the gradient in place, cast to bf16 in backward); the z-loss by hand 18 (in
  backward: the fp32 copy logsumexp saved 4, ``grad * (x - lse).exp()``'s three fp32 temporaries 12, and
  the CE branch's bf16 gradient 2 waiting to be added); the op 2 (the bf16 logits, the gradient written
  in place; plus 12 bytes of fp32 loss, z-loss, lse); the fused output layer 0: one block of logits of at
  most 4 GiB whatever the length (the tokens shared by equal blocks, as ``default_row_block`` does).
* the transformer: what autograd saves per layer (``saved_bytes``): its input 2h; attention 10h (the
  norm's output, the rotated q and k, v, the attention output); MoE 4h + 4kh + 4kf (the norm's input and
  output, k copies of each token into and out of the experts, their ffn f before and after the activation),
  or a dense MLP's 4h + 4f. With full recompute each layer keeps only its input until backward, and the
  layer being recomputed holds the rest plus its experts' input and output gradients (4kh; ``recompute_bytes``).
  Always: the embedding's output, the final norm's and the output layer's inputs (3 x 2h) and the batch's
  token ids, labels, positions and loss mask (28 bytes).
* fixed: 18 bytes per parameter (bf16 weight 2, fp32 gradient buffer 4, fp32 master weight and Adam's two
  moments 12), tied embedding and output weight, plus ``WORKSPACE`` (1 GiB: the bf16 weight gradient of the
  output layer, cuBLAS workspaces, allocator rounding; the one number fitted to the runs rather than
  derived).

The peak is the larger of two moments: at the loss (every layer's input kept, the logits' part alive)
and in backward while one layer is recomputed. Out of memory above ``USABLE`` of the card (95 %: the CUDA
context, NCCL's buffers and fragmentation take the rest). Checked against the measured runs
(tests/bench/test_estimate_memory.py, within 10 %); docs/performance.md#what-it-buys-for-your-model.
"""
import argparse
import os
import sys
from dataclasses import dataclass

GIB = 2 ** 30
WORKSPACE = 1 * GIB
USABLE = 0.95
BLOCK = 4 * GIB  # the fused output layer's default block of logits (--lm-fused-output-layer-block-gib)
LOGIT_BYTES = {"native": 6, "fused": 10, "liger": 6, "z_by_hand": 18, "cez": 2, "cez_fol": 0}
PER_TOKEN_EXTRA = {"cez": 12}  # the op's fp32 loss, z-loss and lse
BATCH_BYTES = 28  # token ids, labels, position ids (int64) and the loss mask (fp32)


@dataclass
class Model:
    hidden: int
    layers: int
    vocab: int
    tp: int = 1
    experts: int = 0
    topk: int = 2
    moe_ffn: int = 0
    ffn: int = 0

    @classmethod
    def from_megatron_args(cls, args, tp=1):
        """From a Megatron argument list (the last of a repeated flag wins, as in Megatron)."""
        args = args.split() if isinstance(args, str) else list(args)

        def get(flag, default=0):
            values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
            return int(values[-1]) if values else default

        hidden = get("--hidden-size")
        return cls(hidden=hidden, layers=get("--num-layers"), vocab=get("--vocab-size"),
                   tp=get("--tensor-model-parallel-size", tp), experts=get("--num-experts"),
                   topk=get("--moe-router-topk", 2), moe_ffn=get("--moe-ffn-hidden-size"),
                   ffn=get("--ffn-hidden-size", 4 * hidden))

    def vocab_per_rank(self, divisible_by=128):
        multiple = divisible_by * self.tp
        return -(-self.vocab // multiple) * multiple // self.tp

    def parameters_per_rank(self):
        h = self.hidden
        attention = 4 * h * h
        mlp = self.experts * (2 * h * self.moe_ffn + h) if self.experts else 2 * h * self.ffn
        return self.vocab_per_rank() * h + self.layers * (attention + mlp + 4 * h) // self.tp + 2 * h

    def saved_bytes(self):
        """Per token, what one layer saves for backward (bf16), its input included."""
        h, k, f = self.hidden, self.topk, self.moe_ffn
        mlp = 4 * h + 4 * k * h + 4 * k * f if self.experts else 4 * h + 4 * self.ffn
        return (2 * h + 10 * h + mlp) / self.tp

    def recompute_bytes(self):
        """Per token, the layer being recomputed in backward: what it saves beyond its kept input, and
        the gradients of its experts' input and output (of its MLP's hidden, dense)."""
        grads = 4 * self.topk * self.hidden if self.experts else 4 * self.ffn
        return self.saved_bytes() - 2 * self.hidden / self.tp + grads / self.tp

    def kept_bytes(self, recompute="full"):
        """Per token, what stays until backward at the loss: every layer's input (full recompute) or all
        it saves (none), and the model's own inputs and the batch."""
        h = self.hidden
        per_layer = 2 * h / self.tp if recompute == "full" else self.saved_bytes()
        return self.layers * per_layer + 3 * 2 * h / self.tp + BATCH_BYTES


def logits_block_bytes(tokens, vocab, budget=BLOCK):
    """The fused output layer's block of bf16 logits: its default blocks share the tokens equally, rows a
    multiple of 128, each within ``budget`` (mindspeed_cez.linear_forward_grads.default_row_block)."""
    largest = max(1024, budget // (2 * vocab) // 128 * 128)
    blocks = -(-tokens // largest)
    rows = min(tokens, -(-(-(-tokens // blocks)) // 128) * 128)
    return 2 * vocab * rows


def peak_bytes(model, variant, tokens, recompute="full"):
    """Predicted peak allocated bytes at ``tokens`` per micro-batch."""
    fixed = 18 * model.parameters_per_rank() + WORKSPACE
    kept = tokens * model.kept_bytes(recompute)
    v = model.vocab_per_rank()
    at_loss = tokens * (LOGIT_BYTES[variant] * v + PER_TOKEN_EXTRA.get(variant, 0))
    if variant == "cez_fol":
        at_loss = logits_block_bytes(tokens, v)
    recomputing = tokens * model.recompute_bytes() if recompute == "full" else 0
    return fixed + kept + max(at_loss, recomputing)


def longest_tokens(model, variant, capacity_bytes, recompute="full", multiple=1):
    """The most tokens per micro-batch (a multiple of ``multiple``) whose predicted peak stays under
    ``USABLE`` of ``capacity_bytes``; 0 if none."""
    limit = USABLE * capacity_bytes
    lo, hi = 0, 1
    while peak_bytes(model, variant, hi * multiple, recompute) <= limit:
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_bytes(model, variant, mid * multiple, recompute) <= limit else (lo, mid)
    return lo * multiple


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a model of bench/e2e_megatron.py (long, deep, ...)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism, with sequence parallelism")
    parser.add_argument("--experts", type=int, default=0, help="MoE experts (0: a dense MLP)")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--moe-ffn", type=int, default=0, help="each expert's ffn size")
    parser.add_argument("--ffn", type=int, default=None, help="a dense MLP's ffn size (default 4 x hidden)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (per rank before SP)")
    parser.add_argument("--recompute", choices=("full", "none"), default="full")
    parser.add_argument("--gpu-gib", type=float, default=81559 / 1024, help="the card's memory (H100 80GB: 79.6)")
    args = parser.parse_args(argv)
    if args.config:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from e2e_megatron import COMMON, CONFIGS

        model = Model.from_megatron_args(COMMON + CONFIGS[args.config], tp=args.tp)
    elif args.hidden and args.layers:
        model = Model(args.hidden, args.layers, args.vocab, args.tp, args.experts, args.topk, args.moe_ffn,
                      args.ffn or 4 * args.hidden)
    else:
        parser.error("--config, or --hidden and --layers")
    capacity = args.gpu_gib * GIB
    print(f"{model}; {model.parameters_per_rank() / 1e9:.2f}B parameters per rank; recompute {args.recompute}; "
          f"out of memory above {USABLE:.0%} of {args.gpu_gib:.1f} GiB")
    print(f"| LM loss | peak at {args.tokens} tokens (GiB) | longest micro-batch (tokens) |")
    print("|---|---|---|")
    for variant in LOGIT_BYTES:
        peak = peak_bytes(model, variant, args.tokens, args.recompute) / GIB
        print(f"| {variant} | {peak:.1f} | {longest_tokens(model, variant, capacity, args.recompute)} |")


if __name__ == "__main__":
    main()
