"""A tiny megatron-core MoE GPTModel on CPU (real gloo processes): its loss goes through the fused op.

Checked on every rank, for TP=1 x DP=2 and TP=2 (sequence parallel):
* unpatched Megatron loss == loss with the adaptor installed but off (bit-identical);
* patched loss == CE + c*lse^2 computed independently in float64 from the model's own logits;
* ``lm_z_loss`` reported through Megatron's tracker == the float64 loss-mask-weighted mean of
  c*lse^2, averaged over data-parallel ranks, next to ``load_balancing_loss``;
* backward runs and gives finite gradients; ``remove()`` restores Megatron's loss exactly.
"""

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import megatron_cpu_shims as shims  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # A CPU (gloo) test: the shims that keep Megatron off CUDA apply only without a GPU. On GPU
    # machines tests/run_gpu_checks.sh runs the adaptor through the real launch instead.
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test; GPU machines run tests/run_gpu_checks.sh"),
]

VOCAB, SEQ, BATCH, LAYERS = 256, 16, 2, 2


def _setup(tp):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    shims.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1)
    torch.manual_seed(1234)  # same weights on every rank (CPU init of the full weights)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=tp, expert_tensor_parallel_size=1, sequence_parallel=tp > 1,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return shims.build_tiny_gpt(config, VOCAB, SEQ, num_experts=4)


def _batch(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss_mask = (torch.rand(BATCH, SEQ, generator=g) < 0.7).float()
    loss_mask[:, 0] = 1.0
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, labels, loss_mask, position_ids


def _gpt_worker(rank, world_size, tp, coeff):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mindspeed_cez.patches as patches
    from mindspeed_cez import metrics
    from mindspeed_cez.patches import settings as _settings

    model = _setup(tp)
    dp_rank = ps.get_data_parallel_rank()
    tokens, labels, loss_mask, position_ids = _batch(1000 + dp_rank)
    mask = shims.causal_attention_mask(SEQ)

    def loss_of():
        return model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)

    model.train()
    base = loss_of().detach()  # unpatched Megatron

    # float64 reference from the model's own logits (gathered over the TP vocab shards)
    with torch.no_grad():
        logits = model(tokens, position_ids, mask).double()  # [b, s, v_local]
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    ce = lse - full.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(base.double(), ce, rtol=1e-5, atol=1e-5)  # sanity: Megatron's CE
    z_ref = coeff * lse**2
    expected = ce + z_ref

    from megatron.core.transformer.moe import moe_utils  # noqa: F401  (tracker module loaded)

    metrics.report(0, 1, LAYERS)  # start from an empty tracker
    patches.install_patches()
    assert torch.equal(loss_of().detach(), base), "installed but inactive must be Megatron's loss"
    metrics.report(0, 1, LAYERS)

    patches.apply(z_loss_coeff=coeff)
    patches.apply(z_loss_coeff=coeff)  # twice: harmless
    loss = loss_of()
    torch.testing.assert_close(loss.detach().double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(loss.detach(), base), "z-loss must change the loss"
    ((loss * loss_mask).sum() / loss_mask.sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

    scalars = metrics.report(1, 1, LAYERS, track_names=["load_balancing_loss"])
    local = (z_ref * loss_mask).sum() / loss_mask.sum()
    dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=True))
    local /= ps.get_data_parallel_world_size(with_context_parallel=True)
    assert "load_balancing_loss" in scalars and scalars["load_balancing_loss"] > 0, scalars
    assert scalars["lm_z_loss"] == pytest.approx(float(local), rel=1e-5), (scalars, float(local))
    unmasked = float(z_ref.mean())
    assert abs(unmasked - float(local)) > 1e-9 or world_size == 1  # the mask matters

    _settings.set_active(None)  # flag off
    assert torch.equal(loss_of().detach(), base)
    patches.apply(z_loss_coeff=0.0)  # --lm-fused-ce: fused kernel, plain CE
    torch.testing.assert_close(loss_of().detach(), base, rtol=1e-5, atol=1e-5)
    patches.remove()
    patches.remove()
    assert torch.equal(loss_of().detach(), base), "remove() must restore Megatron's loss"
    assert not patches.installed_targets()


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_moe_loss_and_lm_z_loss_metric(tp):
    shims.run_on_ranks(2, _gpt_worker, tp, 3e-2, timeout=300)
