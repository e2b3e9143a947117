"""The fused output projection's two steps as GEMMs on chunks of the vocab.

``torch.matmul`` (cuBLAS on CUDA) makes one chunk's logits ``[n, chunk]`` at a time; the
cross-entropy backend of the device (``backend_for``: Triton kernels, or the torch reference)
reduces them to partials, merged across chunks online (forward), or turns them into their
gradient in place (backward). Same functions as ``triton_linear_cross_entropy``; memory beyond
the inputs: one chunk of logits.
"""

import torch

from . import backend_for
from .torch_reference import LOCAL_MAX, PARTIAL_ROWS, ROW_MAX, SUM_EXP, TARGET_TERM

CHUNK_LOGITS = 1 << 26  # logits per vocab chunk at most (128 MiB in bf16)


def chunk_cols(n_rows, n_cols):
    """Vocab rows of ``weight`` per chunk: 4096 (the H100 sweep's best trade of time for memory,
    bench/results/2026-11-24_h100/linear_ce_chunks.md), fewer where that would exceed
    ``CHUNK_LOGITS`` logits, never under 1024 (GEMMs that stay efficient)."""
    return min(n_cols, max(1024, min(4096, CHUNK_LOGITS // max(n_rows, 1))))


def merge_partials(stats, partials):
    """Fold one vocab chunk's partials into ``stats`` (both ``[4, n]``): the online softmax across
    chunks, as the TP path does across ranks."""
    m = torch.maximum(stats[ROW_MAX], partials[ROW_MAX])
    ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    stats[SUM_EXP] = stats[SUM_EXP] * torch.exp(stats[ROW_MAX] - ref) + partials[SUM_EXP] * torch.exp(
        partials[ROW_MAX] - ref)
    stats[TARGET_TERM] += partials[TARGET_TERM]
    stats[ROW_MAX] = m
    stats[LOCAL_MAX] = m
    return stats


def linear_partials(rows, weight, target, vocab_start, global_vocab, ignore_index, label_smoothing=0.0):
    """fp32 ``[4, n]`` partials (``shard_partials``'s layout) of ``rows @ weight.T``."""
    backend = backend_for(rows.device)
    n_rows, n_cols = rows.shape[0], weight.shape[0]
    stats = torch.zeros(PARTIAL_ROWS, n_rows, dtype=torch.float32, device=rows.device)
    stats[ROW_MAX] = stats[LOCAL_MAX] = float("-inf")
    step = chunk_cols(n_rows, n_cols)
    for c in range(0, n_cols, step):
        logits = rows @ weight[c:c + step].t()
        merge_partials(stats, backend.shard_partials(logits, target, vocab_start + c, global_vocab, ignore_index,
                                                     label_smoothing))
    return stats


def linear_grad(rows, weight, grad, target, lse, grad_loss, ignore_index, vocab_start, z_loss_coeff,
                label_smoothing, global_vocab):
    """Writes the gradient of ``rows @ weight.T``'s loss into ``grad`` ``[n, weight rows]``."""
    torch.matmul(rows, weight.t(), out=grad)
    return backend_for(rows.device).write_grad(grad, grad, target, lse, grad_loss, ignore_index, vocab_start,
                                               z_loss_coeff, label_smoothing, global_vocab)
