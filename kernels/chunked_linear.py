"""The fused output projection's two steps as GEMMs on chunks of the vocab.

``torch.matmul`` (cuBLAS on CUDA) makes one chunk's logits ``[n, chunk_cols]`` at a time; a
cross-entropy backend (``ce_backend``: Triton kernels, or the torch reference; by default the
device's, ``backend_for``) reduces them to partials, merged across chunks online (forward), or turns them into their
gradient in place (backward). Same functions as ``triton_linear_cross_entropy``; memory beyond
the inputs: one chunk of logits.
"""

import torch

from . import backend_for
from .logit_transform import IDENTITY
from .partials import LOCAL_MAX, PARTIAL_ROWS, ROW_MAX, SUM_EXP, TARGET_TERM

CHUNK_LOGITS = 1 << 26  # logits per vocab chunk at most (128 MiB in bf16)


def default_chunk_cols(n_rows, n_cols):
    """Vocab rows of ``weight`` per chunk: 4096 (the H100 sweep's best trade of time for memory,
    bench/results/2026-11-24_h100/linear_ce_chunks.md), fewer where that would exceed
    ``CHUNK_LOGITS`` logits, never under 1024 (GEMMs that stay efficient)."""
    return min(n_cols, max(1024, min(4096, CHUNK_LOGITS // max(n_rows, 1))))


def chunk_width(chunk_cols, n_rows, n_cols):
    """The vocab rows per chunk for a ``chunk_cols`` setting (None: :func:`default_chunk_cols`),
    never more than ``n_cols``."""
    return min(chunk_cols, n_cols) if chunk_cols else default_chunk_cols(n_rows, n_cols)


def merge_chunks(parts):
    """``[k, 4, n]`` partials of ``k`` vocab chunks -> ``[4, n]`` (``shard_partials``'s layout): the
    softmax merged across chunks as the TP path merges ranks, once after the last chunk (a merge
    per chunk would launch a dozen small kernels per chunk)."""
    m = parts[:, ROW_MAX].amax(0)
    ref = torch.where(m == float("-inf"), 0.0, m)
    stats = torch.empty(PARTIAL_ROWS, parts.shape[-1], dtype=torch.float32, device=parts.device)
    stats[ROW_MAX] = m
    stats[LOCAL_MAX] = m
    stats[SUM_EXP] = (parts[:, SUM_EXP] * torch.exp(parts[:, ROW_MAX] - ref)).sum(0)
    stats[TARGET_TERM] = parts[:, TARGET_TERM].sum(0)
    return stats


def linear_partials(rows, weight, target, vocab_start, global_vocab, ignore_index, label_smoothing=0.0, *,
                    ce_backend=None, chunk_cols=None, transform=IDENTITY):
    """fp32 ``[4, n]`` partials (``shard_partials``'s layout) of ``rows @ weight.T``, ``chunk_cols``
    vocab rows at a time (None: :func:`default_chunk_cols`), transformed by the CE backend. Memory
    beyond one chunk of logits: 16 bytes per token and chunk."""
    backend = ce_backend or backend_for(rows.device)
    n_rows, n_cols = rows.shape[0], weight.shape[0]
    step = chunk_width(chunk_cols, n_rows, n_cols)
    parts = [backend.shard_partials(rows @ weight[c:c + step].t(), target, vocab_start + c, global_vocab,
                                    ignore_index, label_smoothing, transform=transform)
             for c in range(0, n_cols, step)]
    return merge_chunks(torch.stack(parts))


def linear_grad(rows, weight, grad, target, lse, grad_loss, ignore_index, vocab_start, z_loss_coeff,
                label_smoothing, global_vocab, *, ce_backend=None, transform=IDENTITY):
    """Writes the gradient of ``rows @ weight.T``'s loss into ``grad`` ``[n, weight rows]``."""
    torch.matmul(rows, weight.t(), out=grad)
    return (ce_backend or backend_for(rows.device)).write_grad(grad, grad, target, lse, grad_loss, ignore_index, vocab_start,
                                               z_loss_coeff, label_smoothing, global_vocab, transform=transform)
