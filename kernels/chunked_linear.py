"""The fused output projection's two steps as GEMMs on chunks of the vocab.

``torch.matmul`` (cuBLAS on CUDA) makes one chunk's logits ``[n, chunk_cols]`` at a time; a
cross-entropy backend (Triton kernels, or the torch reference) reduces them to partials, merged
across chunks (forward), or turns them into their gradient in place (backward). The same interface
as ``triton_linear_cross_entropy`` (:class:`.backends.LinearBackend`); memory beyond the inputs: one
chunk of logits.
"""

import torch

from . import LOCAL_LSE, TARGET_TERM, row, rows_of, torch_reference

CHUNK_LOGITS = 1 << 26  # logits per vocab chunk at most (128 MiB in bf16)
# The fused output layer's bound on the logits it holds at once, at any token count: its default
# block (grads="forward") and the largest vocab chunk of the recompute path's backward.
LOGITS_BUDGET_BYTES = 4 << 30
CHUNK_ALIGN = 128  # vocab rows per chunk: a multiple of the GEMMs' tile


def default_chunk_cols(n_rows, n_cols, itemsize=2):
    """Vocab rows of ``weight`` per chunk: 4096 (the best trade of time for memory: docs/performance.md),
    fewer where that would exceed
    ``CHUNK_LOGITS`` logits, not under 1024 (GEMMs that stay efficient) unless 1024 would pass
    ``LOGITS_BUDGET_BYTES`` (past 2M tokens in bf16), never under ``CHUNK_ALIGN``."""
    n_rows = max(n_rows, 1)
    within_budget = max(CHUNK_ALIGN, LOGITS_BUDGET_BYTES // (n_rows * itemsize) // CHUNK_ALIGN * CHUNK_ALIGN)
    return min(n_cols, within_budget, max(1024, min(4096, CHUNK_LOGITS // n_rows)))


def chunk_width(chunk_cols, n_rows, n_cols, itemsize=2):
    """The vocab rows per chunk for a ``chunk_cols`` setting (None: :func:`default_chunk_cols`),
    never more than ``n_cols``."""
    return min(chunk_cols, n_cols) if chunk_cols else default_chunk_cols(n_rows, n_cols, itemsize)


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


class ChunkedLinear:
    """The ``"gemm"`` linear backend (:class:`.backends.LinearBackend`): ``torch.matmul`` on
    ``chunk_cols`` vocab rows of ``weight`` at a time (None: :func:`default_chunk_cols`), each chunk's
    logits reduced by the cross-entropy backend ``ce_backend``."""

    __slots__ = ("ce_backend", "chunk_cols")

    def __init__(self, ce_backend, chunk_cols=None):
        self.ce_backend, self.chunk_cols = ce_backend, chunk_cols

    def __repr__(self):
        return f"ChunkedLinear({getattr(self.ce_backend, '__name__', self.ce_backend)}, chunk_cols={self.chunk_cols})"

    def linear_partials(self, rows, weight, target, spec, shard):
        """fp32 partials (``shard_partials``'s layout) of ``rows @ weight.T`` (the vocab slice ``shard``).
        Memory beyond one chunk of logits: 8 bytes per token and chunk."""
        n_rows, n_cols = rows.shape[0], weight.shape[0]
        step = chunk_width(self.chunk_cols, n_rows, n_cols, rows.element_size())
        parts = [self.ce_backend.shard_partials(rows @ weight[c:c + step].t(), target, spec,
                                                shard.chunk(c, min(step, n_cols - c)))
                 for c in range(0, n_cols, step)]
        return merge_chunks(torch.stack(parts), n_cols)

    def linear_grad(self, rows, weight, grad, target, lse, grad_loss, spec, shard):
        """Writes the gradient of ``rows @ weight.T``'s loss (the vocab slice ``shard``) into ``grad``
        ``[n, weight rows]``."""
        torch.matmul(rows, weight.t(), out=grad)
        return self.ce_backend.write_grad(grad, grad, target, lse, grad_loss, spec, shard)

    @staticmethod
    def check_targets(target, spec, shard):
        """The chunks' partials check no target: CUDA's device-side assert is the torch reference's."""
        torch_reference.check_targets(target, spec, shard)
