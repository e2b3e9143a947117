"""The output layer's weight gradient of one training iteration of Megatron, in float64, from what the run fed its
output layer (the harness's ``CEZ_DUMP_OUTPUT_INPUTS`` dumps: every micro-batch of every rank).

Megatron-Core 0.19's normalization of the gradient it sums into the output layer's weight (no
``--calculate-per-token-loss``, no context parallelism):

* the loss function returns ``(sum of loss * mask, mask.sum(), ...)`` (``examples/pretrain_gpt.py``); the
  schedule divides that sum by ``clamp(mask.sum(), min=1)`` and by the number of micro-batches ``M``
  (``pipeline_parallel/schedules.py``, ``forward_step_calc_loss``) and multiplies it by the optimizer's loss scale
  before the backward (``backward_step``: ``config.grad_scale_func``; 1 in bf16 and fp32);
* the gradient sync averages over the data-parallel ranks: DDP scales every bucket by ``1 / DP`` before its sum
  (``distributed/distributed_data_parallel.py``, ``gradient_scaling_factor``), Megatron-FSDP the same
  (``megatron_fsdp.py``, ``_init_fsdp_param_and_grad_buffer``), torch FSDP2 reduce-scatters with an average;
* each counted token's loss is ``CE + c * lse**2`` (the flag's z-loss enters the gradient, not ``lm loss``;
  ``c = 0`` for Megatron's own CE).

So for vocab row ``v`` of the weight ``W`` (a tensor-parallel rank holds its rows, the softmax spans all)::

    dL/dW[v] = loss_scale / DP * sum_{rank, micro-batch} 1 / (M * max(n_mb, 1))
               * sum_{tokens} mask * (p_v * (1 + 2 c lse) - [v == label]) * hidden

with ``p = softmax(hidden @ W.T)`` over the whole vocabulary and ``n_mb`` the micro-batch's ``mask.sum()``.
"""

import re
from pathlib import Path

import torch

NAME = re.compile(r"inputs_dp(\d+)_tp(\d+)_mb(\d+)\.pt")


def load_inputs(folder):
    """{(dp rank, micro-batch): {tp rank: dump}} of the harness's dumps in ``folder``."""
    found = {}
    for path in Path(folder).glob("inputs_dp*_tp*_mb*.pt"):
        dp, tp, mb = map(int, NAME.fullmatch(path.name).groups())
        found.setdefault((dp, mb), {})[tp] = torch.load(path)
    return found


def reference_output_grad(folder):
    """``({tp rank: float64 gradient [vocab / tp, h]}, facts)`` of iteration 1 from the dumps in ``folder``;
    ``facts``: what the normalization used, and the largest ``weight_check`` (Megatron's logits against
    ``hidden @ weight.T``: the dumped weight is the one the layer used)."""
    found = load_inputs(folder)
    if not found:
        raise FileNotFoundError(f"no output layer inputs dumped in {folder}")
    first = next(iter(next(iter(found.values())).values()))
    tp_size, dp_size, m = first["tp_size"], first["dp_size"], first["num_microbatches"]
    if first["cp_size"] != 1 or first["calculate_per_token_loss"] or first["label_smoothing"]:
        raise NotImplementedError("the reference covers no context parallelism, no --calculate-per-token-loss, "
                                  "no label smoothing")
    expected = {(dp, mb) for dp in range(dp_size) for mb in range(m)}
    if set(found) != expected or any(sorted(shards) != list(range(tp_size)) for shards in found.values()):
        tp_ranks = sorted({t for shards in found.values() for t in shards})
        raise ValueError(f"{folder}: dumps of {sorted(found)} (tp ranks {tp_ranks}), expected every micro-batch of "
                         f"{dp_size} data-parallel x {tp_size} tensor-parallel ranks")
    weights = {t: found[(0, 0)][t]["weight"].double() for t in range(tp_size)}
    for dp in range(1, dp_size):
        if any(not torch.equal(found[(dp, 0)][t]["weight"], found[(0, 0)][t]["weight"]) for t in range(tp_size)):
            raise ValueError(f"{folder}: data-parallel rank {dp}'s output layer weight differs from rank 0's")
    grads = {t: torch.zeros_like(w) for t, w in weights.items()}
    checks = [d["weight_check"] for shards in found.values() for d in shards.values() if d["weight_check"] is not None]
    for (dp, mb), shards in sorted(found.items()):
        d = shards[0]
        hidden = d["hidden"].double()  # [s, b, h], the same on every tp rank
        for t in range(1, tp_size):
            if not torch.equal(shards[t]["hidden"], d["hidden"]) or not torch.equal(shards[t]["loss_mask"],
                                                                                      d["loss_mask"]):
                raise ValueError(f"{folder}: dp {dp} micro-batch {mb}: tp rank {t} saw other inputs than tp rank 0")
        labels, mask = d["labels"].t(), d["loss_mask"].double().t()  # [s, b]
        c = float(d["lm_z_loss_coeff"])
        logits = torch.cat([hidden @ weights[t].t() for t in range(tp_size)], dim=-1)  # [s, b, V]
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        dlogits = torch.exp(logits - lse) * (1 + 2 * c * lse)
        dlogits.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(lse))
        token_weight = mask * d["loss_scale"] / (dp_size * m * max(float(mask.sum()), 1.0))
        dlogits *= token_weight.unsqueeze(-1)
        rows = weights[0].shape[0]
        for t in range(tp_size):
            grads[t] += torch.einsum("sbv,sbh->vh", dlogits[..., t * rows:(t + 1) * rows], hidden)
    facts = {"tp": tp_size, "dp": dp_size, "micro_batches": m, "z_loss_coeff": c, "loss_scale": first["loss_scale"],
             "deferred": first["deferred"], "weight_check": max(checks, default=None)}
    return grads, facts
