"""The fused output projection's two steps as GEMMs on chunks of the vocab.

``torch.matmul`` (cuBLAS on CUDA) makes one chunk's logits ``[n, chunk_cols]`` at a time; a
cross-entropy backend (``ce_backend``: Triton kernels, or the torch reference; by default the
device's, ``backend_for``) reduces them to partials, merged across chunks online (forward), or turns them into their
gradient in place (backward). Same functions as ``triton_linear_cross_entropy``; memory beyond
the inputs: one chunk of logits.
"""

import torch

from . import backend_for, torch_reference
from .partials import LOCAL_LSE, TARGET_TERM, row, rows_of

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


def merge_chunks(parts, n_cols):
    """``[k, numel]`` partials of ``k`` vocab chunks -> the partials of their ``n_cols`` columns
    (``shard_partials``'s layout): the chunks' lse merged as the ranks' are, once after the last
    chunk (a merge per chunk would launch a dozen small kernels per chunk)."""
    n_rows = rows_of(parts.shape[-1])
    stats = torch.empty(parts.shape[-1], dtype=torch.float32, device=parts.device)
    row(stats, LOCAL_LSE, n_rows).copy_(torch_reference.logsumexp(row(parts, LOCAL_LSE, n_rows), dim=0))
    torch.sum(row(parts, TARGET_TERM, n_rows), dim=0, out=row(stats, TARGET_TERM, n_rows))
    torch_reference.write_width(stats, n_rows, n_cols)
    return stats


def linear_partials(rows, weight, target, loss, shard, *, ce_backend=None, chunk_cols=None):
    """fp32 partials (``shard_partials``'s layout) of ``rows @ weight.T`` (the vocab slice ``shard``),
    ``chunk_cols`` vocab rows at a time (None: :func:`default_chunk_cols`), reduced by the CE
    backend. Memory beyond one chunk of logits: 8 bytes per token and chunk."""
    backend = ce_backend or backend_for(rows.device)
    n_rows, n_cols = rows.shape[0], weight.shape[0]
    step = chunk_width(chunk_cols, n_rows, n_cols)
    parts = [backend.shard_partials(rows @ weight[c:c + step].t(), target, loss, shard.chunk(c, min(step, n_cols - c)))
             for c in range(0, n_cols, step)]
    return merge_chunks(torch.stack(parts), n_cols)


def linear_grad(rows, weight, grad, target, lse, grad_loss, loss, shard, *, ce_backend=None):
    """Writes the gradient of ``rows @ weight.T``'s loss (the vocab slice ``shard``) into ``grad``
    ``[n, weight rows]``."""
    torch.matmul(rows, weight.t(), out=grad)
    return (ce_backend or backend_for(rows.device)).write_grad(grad, grad, target, lse, grad_loss, loss, shard)
