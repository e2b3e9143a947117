"""The test-only context-parallel attention (``tests/support/context_parallel_attention.py``, which the
end-to-end layouts use for CP without Transformer Engine) against causal attention of the whole
sequence: outputs and the gradients of query, key and value, float64, CP=2 over gloo, with query
groups (GQA)."""

import pytest
import torch

pytest.importorskip("megatron.core")

from support import run_on_ranks  # noqa: E402

S, B, HEADS, GROUPS, D = 24, 2, 4, 2, 8


def _worker(rank, world_size):
    from megatron.core import parallel_state as ps

    from support.context_parallel_attention import context_parallel_causal_attention, zigzag_positions

    ps.initialize_model_parallel(context_parallel_size=world_size)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(S, B, n, D, generator=g, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS))
    upstream = torch.randn(S, B, HEADS * D, generator=g, dtype=torch.float64)
    scale = 0.3
    # the whole sequence, causal
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qf, kf, vf = (t.permute(1, 2, 0, 3) for t in full)
    kf, vf = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (kf, vf))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    ref = ref.permute(2, 0, 1, 3).reshape(S, B, HEADS * D)
    (ref * upstream).sum().backward()
    # this rank's chunks
    mine = zigzag_positions(rank, world_size, S // (2 * world_size))
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_causal_attention(*local, scale, ps.get_context_parallel_group())
    (out * upstream[mine]).sum().backward()
    torch.testing.assert_close(out, ref[mine].detach(), rtol=1e-12, atol=1e-12)
    for name, got, want in zip("qkv", local, full):
        torch.testing.assert_close(got.grad, want.grad[mine], rtol=1e-10, atol=1e-12, msg=f"d{name}")
    ps.destroy_model_parallel()


def test_matches_causal_attention_of_the_whole_sequence():
    run_on_ranks(2, _worker, timeout=240)
