"""Pure-torch backend: the same functions as the Triton kernels, in row chunks.

Runs on any device (CPU CI, and wherever Triton is missing); see ``kernels/__init__.py`` for
the interface. Rows are processed in chunks so the fp32 working copy stays small
(``_CHUNK_ELEMENTS``), never the size of the logits.
"""

import torch

from . import (LOCAL_LSE, TARGET_TERM, UNEQUAL_WIDTHS, WIDTH, VocabShard, partials_numel, row, rows_of,
               width_words)

_CHUNK_ELEMENTS = 1 << 22  # fp32 elements per working chunk (16 MiB)


def _row_chunks(n_rows: int, n_cols: int):
    rows = max(1, _CHUNK_ELEMENTS // max(n_cols, 1))
    for start in range(0, n_rows, rows):
        yield start, min(start + rows, n_rows)


def _local_target(target, vocab_start, n_cols):
    """(column of ``target`` in this slice, clamped; whether the slice owns it). int64 columns:
    ``gather`` / ``scatter_add_`` take no other index dtype before torch 2.8 (int32 targets)."""
    local = target.long() - vocab_start
    owned = (local >= 0) & (local < n_cols)
    return local.clamp(0, n_cols - 1), owned


def valid_targets(target, global_vocab, ignore_index):
    """Where ``target`` is a vocab id in ``[0, global_vocab)`` or ``ignore_index``."""
    return (target == ignore_index) | ((target >= 0) & (target < global_vocab))


def logsumexp(x, dim=-1):
    """``log(sum(exp(x)))`` along ``dim`` as the kernels make it: -inf where every value is -inf
    (no ``-inf - (-inf)``), NaN where one is +inf or NaN."""
    m = x.amax(dim=dim, keepdim=True)
    ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    return (ref + torch.log(torch.exp(x - ref).sum(dim=dim, keepdim=True))).squeeze(dim)


def write_width(partials, n_rows, width):
    """The slice's width words of the partials layout (two fills: no host-to-device copy)."""
    words = partials[WIDTH * n_rows:]
    for i, value in enumerate(width_words(width)):
        words[i].fill_(value)


def shard_partials(logits, target, spec, shard):
    """fp32 ``[partials_numel(n)]`` (the partials layout, ``kernels/__init__.py``) of
    ``spec.logit_transform.apply(logits)`` (``spec``: a :class:`.LossSpec`; ``shard``: the logits'
    :class:`.VocabShard`)."""
    n_rows, n_cols = logits.shape
    a = spec.label_smoothing
    partials = torch.empty(partials_numel(n_rows), dtype=torch.float32, device=logits.device)
    lse, terms = row(partials, LOCAL_LSE, n_rows), row(partials, TARGET_TERM, n_rows)
    invalid = ~valid_targets(target, shard.global_vocab, spec.ignore_index)
    for start, end in _row_chunks(n_rows, n_cols):
        x = spec.logit_transform.apply(logits[start:end].float())
        lse[start:end] = logsumexp(x)
        local, owned = _local_target(target[start:end], shard.vocab_start, n_cols)
        picked = x.gather(1, local[:, None]).squeeze(1)
        term = torch.where(owned, picked, torch.zeros_like(picked)) * (1.0 - a)
        if a:
            term += (a / shard.global_vocab) * x.sum(dim=-1)
        terms[start:end] = torch.where(invalid[start:end], torch.full_like(term, float("nan")), term)
    write_width(partials, n_rows, n_cols)
    return partials


def loss_from_partials(gathered, target, spec, out=None):
    """fp32 ``[3, n]`` rows (loss, z-loss, lse), into ``out`` when given, from ``gathered`` ``[ranks, numel]``
    partials (every rank's, all-gathered; ``[1, numel]`` for one): lse the log-sum-exp of the
    ranks' lse, the target terms summed. Slices of unequal width give NaN (on CUDA also a
    device-side assert)."""
    ranks, n_rows = gathered.shape[0], rows_of(gathered.shape[1])
    lse = logsumexp(row(gathered, LOCAL_LSE, n_rows), dim=0)
    term = row(gathered, TARGET_TERM, n_rows).sum(dim=0)
    z_loss = spec.z_loss_coeff * lse * lse
    total = lse - term + z_loss
    if ranks > 1:
        words = gathered[:, WIDTH * n_rows:]
        unequal = (words != words[:1]).any()
        if gathered.device.type == "cuda":
            torch._assert_async(~unequal, UNEQUAL_WIDTHS)
        total = torch.where(unequal, torch.full_like(total, float("nan")), total)
    ignored = target == spec.ignore_index
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    out = torch.empty(3, n_rows, dtype=torch.float32, device=gathered.device) if out is None else out
    out[0] = torch.where(ignored, zero, total)
    out[1] = torch.where(ignored, zero, z_loss)
    out[2] = lse
    return out


def fused_loss(logits, target, spec):
    """One rank holds the whole vocab: fp32 [3, n] rows (loss, z-loss, lse)."""
    partials = shard_partials(logits, target, spec, VocabShard.whole(logits.shape[1]))
    return loss_from_partials(partials[None], target, spec)


def write_grad(logits, grad, target, lse, grad_loss, spec, shard):
    """Write ``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` into ``grad`` (may alias
    ``logits``), ``g`` the upstream gradient ``grad_loss`` (0 on ignored rows); with a transform,
    that gradient of the transformed logits times their slope ``dz/dx``."""
    n_rows, n_cols = logits.shape
    a, c, transform = spec.label_smoothing, spec.z_loss_coeff, spec.logit_transform
    grad_scale = grad_loss.float().masked_fill(target == spec.ignore_index, 0.0)
    for start, end in _row_chunks(n_rows, n_cols):
        z, slope = transform.apply_with_slope(logits[start:end].float())
        g = grad_scale[start:end, None]
        row_lse = lse[start:end, None]
        dx = torch.exp(z - row_lse) * (g * (1.0 + 2.0 * c * row_lse))
        if a:
            dx -= g * (a / shard.global_vocab)
        local, owned = _local_target(target[start:end], shard.vocab_start, n_cols)
        onehot_grad = torch.where(owned[:, None], g * (1.0 - a), torch.zeros_like(g))
        dx.scatter_add_(1, local[:, None], -onehot_grad)
        if not transform.is_identity:
            dx *= slope
        grad[start:end].copy_(dx)
    return grad


def check_targets(target, spec, shard):
    """CUDA: an asynchronous device-side assert (no host sync). Elsewhere the partials carry NaN."""
    if target.device.type == "cuda":
        valid = valid_targets(target, shard.global_vocab, spec.ignore_index)
        torch._assert_async(valid.all(), "target outside [0, vocab) and not ignore_index")

