"""Pure-torch backend: the per-shard partials and the in-place gradient, in row chunks.

Runs on any device (CPU CI, and wherever Triton is missing). It computes the same two
things as the Triton kernels, with the same signatures (see ``kernels/__init__.py``):

* ``shard_partials``: per row of this rank's vocab slice, the local max, the sum of
  ``exp(x - local_max)``, the target logit (0 when another rank owns it, NaN when the target
  is out of range) and, when asked, the sum of the logits.
* ``write_grad``: ``dx = g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` into ``grad``.

Rows are processed in chunks so the fp32 working copy stays small (``_CHUNK_ELEMENTS``),
never the size of the logits.
"""

import torch

_CHUNK_ELEMENTS = 1 << 22  # fp32 elements per working chunk (16 MiB)


def _row_chunks(n_rows: int, n_cols: int):
    rows = max(1, _CHUNK_ELEMENTS // max(n_cols, 1))
    for start in range(0, n_rows, rows):
        yield start, min(start + rows, n_rows)


def _local_target(target, vocab_start, n_cols):
    local = target - vocab_start
    owned = (local >= 0) & (local < n_cols)
    return local.clamp(0, n_cols - 1), owned


def shard_partials(logits, target, vocab_start, global_vocab, ignore_index, with_logit_sum):
    n_rows, n_cols = logits.shape
    k = 4 if with_logit_sum else 3
    partials = torch.empty(k, n_rows, dtype=torch.float32, device=logits.device)
    invalid = (target != ignore_index) & ((target < 0) | (target >= global_vocab))
    for start, end in _row_chunks(n_rows, n_cols):
        x = logits[start:end].float()
        row_max = x.amax(dim=-1)
        partials[0, start:end] = row_max
        partials[1, start:end] = torch.exp(x - row_max[:, None]).sum(dim=-1)
        local, owned = _local_target(target[start:end], vocab_start, n_cols)
        picked = x.gather(1, local[:, None]).squeeze(1)
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        partials[2, start:end] = torch.where(invalid[start:end], torch.full_like(picked, float("nan")), picked)
        if with_logit_sum:
            partials[3, start:end] = x.sum(dim=-1)
    return partials


def write_grad(logits, grad, target, lse, grad_scale, vocab_start, z_loss_coeff, label_smoothing, global_vocab):
    """Write d(loss)/d(logits) scaled per row by ``grad_scale`` into ``grad`` (may alias ``logits``)."""
    n_rows, n_cols = logits.shape
    for start, end in _row_chunks(n_rows, n_cols):
        x = logits[start:end].float()
        g = grad_scale[start:end, None]
        row_lse = lse[start:end, None]
        dx = torch.exp(x - row_lse) * (g * (1.0 + 2.0 * z_loss_coeff * row_lse))
        if label_smoothing:
            dx -= g * (label_smoothing / global_vocab)
        local, owned = _local_target(target[start:end], vocab_start, n_cols)
        onehot_grad = torch.where(owned[:, None], g * (1.0 - label_smoothing), torch.zeros_like(g))
        dx.scatter_add_(1, local[:, None], -onehot_grad)
        grad[start:end].copy_(dx)
    return grad
