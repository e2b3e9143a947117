"""The mitigations beside the z-loss: ``--lm-logit-softcap``, ``--lm-mu-centering``, ``--lm-mu-loss-coeff``.

* The flags: each builds its Settings field, turns the fused kernel on and its metrics; a bad value (or one
  beside ``--no-lm-fused-ce``, or a soft cap that differs from MindSpeed-LLM's own) is one error naming the flag.
* A tiny megatron-core MoE GPTModel on CPU in real gloo processes (TP=1 x DP=2 and TP=2 with sequence
  parallelism x DP=2, untied and tied embeddings), against float64 references from the model's own logits
  and weights: with the soft cap (and the z-loss) the per-token loss is the CE of ``C tanh(x / C)`` and the
  logits' gradient that of ``CE + c lse**2`` of the capped logits; with mu-loss the loss value stays the CE,
  the logits' gradient is the CE's and the output weight's gradient gains ``2 L mu / V`` on every row;
  ``lm_mu_norm`` is ``||mu||``; mu-centering marks the output weight (and with tied embeddings the input
  embedding) and :func:`center_` leaves its mean row over the whole vocabulary at 0; the fused output layer
  (``fused_output_layer=True``) gives the unfused path's losses and parameter gradients with all of them on.
"""

import argparse
import math

import pytest
import torch

from mindspeed_cez.patches import arguments
from mindspeed_cez.patches.settings import LM_LSE, LM_LSE_MAX, LM_MU_NORM, Settings
from support import run_on_ranks

SOFTCAP = "--lm-logit-softcap"
CENTERING = "--lm-mu-centering"
MU_LOSS = "--lm-mu-loss-coeff"


def _parse(argv, mindspeed_llm_cap=None):
    parser = arguments.add_lm_z_loss_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(argv)
    args.output_logit_softcapping = mindspeed_llm_cap
    return args


@pytest.mark.parametrize("argv, field, value, metric", [
    ([SOFTCAP, "30"], "logit_softcap", 30.0, LM_LSE_MAX),
    ([CENTERING], "mu_centering", True, LM_MU_NORM),
    ([MU_LOSS, "1e-4"], "mu_loss_coeff", 1e-4, LM_MU_NORM),
])
def test_each_flag_sets_its_field_turns_the_kernel_on_and_logs(argv, field, value, metric):
    settings = arguments.validate(_parse(argv))
    assert settings is not None, "the flag must turn the fused kernel on"
    assert getattr(settings, field) == value
    assert metric in settings.metrics
    assert settings.z_loss_coeff == 0
    combined = arguments.validate(_parse(argv + ["--lm-z-loss-coeff", "1e-4"]))
    assert getattr(combined, field) == value and combined.z_loss_coeff == 1e-4


def test_defaults_leave_the_kernel_off():
    assert arguments.validate(_parse([])) is None


@pytest.mark.parametrize("argv, message", [
    ([SOFTCAP + "=-1"], "--lm-logit-softcap must be a finite number >= 0 .*got -1"),
    ([SOFTCAP, "inf"], "--lm-logit-softcap must be a finite number >= 0"),
    ([SOFTCAP, "thirty"], "--lm-logit-softcap must be a finite number >= 0 .*got 'thirty'"),
    ([MU_LOSS + "=-1e-4"], "--lm-mu-loss-coeff must be a finite number >= 0"),
    ([MU_LOSS, "nan"], "--lm-mu-loss-coeff must be a finite number >= 0"),
    ([SOFTCAP, "30", "--no-lm-fused-ce"], "--lm-logit-softcap works through the fused kernel, but --no-lm-fused-ce"),
    ([CENTERING, "--no-lm-fused-ce"], "--lm-mu-centering works through the fused kernel, but --no-lm-fused-ce"),
    ([MU_LOSS, "1e-4", "--no-lm-fused-ce"], "--lm-mu-loss-coeff works through the fused kernel, but --no-lm-fused-ce"),
])
def test_bad_values_fail_in_one_line_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message) as caught:
        arguments.validate(_parse(argv))
    assert "\n" not in str(caught.value)


def test_mu_centering_refuses_tied_embeddings_over_pipeline_stages():
    args = _parse([CENTERING])
    args.pipeline_model_parallel_size, args.untie_embeddings_and_output_weights = 2, False
    with pytest.raises(ValueError, match="--lm-mu-centering with tied embeddings serves one pipeline stage"):
        arguments.validate(args)
    args.untie_embeddings_and_output_weights = True
    assert arguments.validate(args).mu_centering
    args.pipeline_model_parallel_size, args.untie_embeddings_and_output_weights = 1, False
    assert arguments.validate(args).mu_centering


def test_a_soft_cap_other_than_mindspeed_llms_own_is_refused():
    with pytest.raises(ValueError, match="--lm-logit-softcap=30 and the model's own soft cap 20 .*differ") as caught:
        arguments.validate(_parse([SOFTCAP, "30"], mindspeed_llm_cap=20.0))
    assert "--output-logit-softcapping" in str(caught.value)
    same = arguments.validate(_parse([SOFTCAP, "30"], mindspeed_llm_cap=30.0))
    assert same.logit_softcap == 30.0 and same.logit_transform.cap == 30.0


def test_the_main_heads_transform_adds_the_cap_where_the_model_applies_none():
    from mindspeed_cez.kernels import IDENTITY, LogitTransform
    from mindspeed_cez.patches.loss_wrappers import main_head_transform

    cap = Settings(logit_softcap=30.0).logit_softcap
    assert main_head_transform(IDENTITY, cap) == LogitTransform(1.0, 30.0)
    assert main_head_transform(LogitTransform(2.0, 0.0), cap) == LogitTransform(2.0, 30.0)
    assert main_head_transform(LogitTransform(2.0, 30.0), cap) == LogitTransform(2.0, 30.0)
    assert main_head_transform(LogitTransform(2.0, 0.0), Settings().logit_softcap) == LogitTransform(2.0, 0.0)
    with pytest.raises(ValueError, match="cann"):
        Settings(logit_softcap=30.0, backend="cann")


def test_flags_and_apply_that_disagree_name_both():
    from mindspeed_cez.patches import activation

    applied, flagged = Settings(z_loss_coeff=1e-4), Settings(z_loss_coeff=1e-4, mu_loss_coeff=1e-4)
    assert activation.differ(applied, flagged)
    assert "--lm-mu-loss-coeff 0.0001" in activation.conflict(applied, flagged)
    assert not activation.differ(flagged, Settings(z_loss_coeff=1e-4, mu_loss_coeff=1e-4))


# ---------------------------------------------------------------------------------------------
# the tiny GPT in real processes
# ---------------------------------------------------------------------------------------------

CAP = 0.2  # small enough that the tiny model's logits are visibly capped
MU_COEFF = 50.0  # large, so the mu-loss's gradient stands out of the CE's


def _output_weight_name(model):
    from mindspeed_cez.patches import mean_embedding

    weight = mean_embedding.output_weight(model)
    return next(n for n, p in model.named_parameters() if p is weight)


def _mitigations_worker(rank, world_size, tp, tied):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import mean_embedding
    from mindspeed_cez.patches import reporting as metrics
    from mindspeed_cez.patches import local_gpt
    from support.tiny_gpt import BATCH, COEFF, LAYERS, SEQ, VOCAB, build, full_vocab, micro_batches
    from support.tiny_gpt import iteration as _iteration

    model = build(tp, share_embeddings=tied)
    model.train()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    batches = micro_batches(ps.get_data_parallel_rank())
    tokens_total = sum(float(m.sum()) for _, _, m in batches)
    weight_name = _output_weight_name(model)

    def reference(captured, transform):
        """float64 per micro-batch: CE of the transformed logits and the gradient of sum((CE + c lse^2) m) / sum(m)."""
        out = []
        for cap, (_, labels, loss_mask) in zip(captured, batches):
            x = full_vocab(cap["logits"], tp_group).double().requires_grad_()
            z = transform(x)
            lse = torch.logsumexp(z, dim=-1)
            ce = lse - z.gather(-1, labels.transpose(0, 1).unsqueeze(-1)).squeeze(-1)
            m = loss_mask.transpose(0, 1).double()
            (((ce + COEFF * lse**2) * m).sum() / tokens_total).backward()
            v_local = cap["logits"].shape[-1]
            out.append({"ce": ce.detach().transpose(0, 1), "lse": lse.detach().transpose(0, 1),
                        "grad": x.grad[..., tp_rank * v_local:(tp_rank + 1) * v_local]})
        return out

    # the soft cap, with the z-loss: loss and gradients of the capped logits
    patches.apply(z_loss_coeff=COEFF, logit_softcap=CAP)
    losses, captured, grads = _iteration(model, batches)
    scalars = metrics.report(1, len(batches), LAYERS, track_names=())
    ref = reference(captured, lambda x: CAP * torch.tanh(x / CAP))
    assert max(float(c["logits"].abs().max()) for c in captured) > CAP, "the cap must bite"
    for loss, r, cap in zip(losses, ref, captured):
        torch.testing.assert_close(loss.double(), r["ce"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap["grad"].double(), r["grad"], rtol=1e-4, atol=1e-7)
    _, _, ref_grads = _iteration(model, batches, grad_of_logits=[r["grad"] for r in ref])
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    lse_sum = torch.stack([(r["lse"] * m.double()).sum() for r, (_, _, m) in zip(ref, batches)]).sum()
    counts = torch.stack([lse_sum, torch.tensor(tokens_total, dtype=torch.float64)])
    dist.all_reduce(counts, group=ps.get_data_parallel_group(with_context_parallel=True))
    assert scalars[LM_LSE] == pytest.approx(float(counts[0] / counts[1]), rel=1e-5), scalars
    assert scalars[LM_LSE_MAX] <= CAP + math.log(VOCAB) + 1e-5, "the capped logits' lse is at most C + log V"

    # mu-loss: the value and the logits' gradient are the CE's, the output weight gains 2 L mu / V per row
    patches.apply(mu_loss_coeff=MU_COEFF)
    losses, captured, grads = _iteration(model, batches)
    scalars = metrics.report(2, len(batches), LAYERS, track_names=())
    ref = reference(captured, lambda x: x)
    weight = dict(model.named_parameters())[weight_name].detach()
    rows = full_vocab(weight.t().contiguous(), tp_group).t().double()  # [V, h]
    mu = rows.mean(dim=0)
    for loss, r, cap in zip(losses, ref, captured):
        torch.testing.assert_close(loss.double(), r["ce"], rtol=1e-5, atol=1e-5)
    # the reference's logits gradient includes the z-loss term: the CE's alone here
    ce_grads = []
    for cap, (_, labels, loss_mask) in zip(captured, batches):
        x = full_vocab(cap["logits"], tp_group).double().requires_grad_()
        ce = torch.logsumexp(x, -1) - x.gather(-1, labels.transpose(0, 1).unsqueeze(-1)).squeeze(-1)
        ((ce * loss_mask.transpose(0, 1).double()).sum() / tokens_total).backward()
        v_local = cap["logits"].shape[-1]
        ce_grads.append(x.grad[..., tp_rank * v_local:(tp_rank + 1) * v_local])
    for cap, g in zip(captured, ce_grads):
        torch.testing.assert_close(cap["grad"].double(), g, rtol=1e-4, atol=1e-7)
    _, _, ref_grads = _iteration(model, batches, grad_of_logits=ce_grads)
    for name in grads:
        expected = ref_grads[name]
        if name == weight_name:
            expected = expected + (2 * MU_COEFF * mu / rows.shape[0]).to(expected.dtype)
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)
    assert float((grads[weight_name] - ref_grads[weight_name]).abs().max()) > 1e-5, "mu-loss must change the gradient"
    assert scalars[LM_MU_NORM] == pytest.approx(float(mu.norm()), rel=1e-5), scalars

    # the fused output layer serves both alike: the same losses and parameter gradients as the unfused path
    def losses_and_grads(**settings):
        patches.apply(**settings)
        model.zero_grad(set_to_none=True)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        losses = []
        for tokens, labels, loss_mask in batches:
            loss = model(tokens, position_ids, local_gpt.causal_attention_mask(SEQ), labels=labels, loss_mask=loss_mask)
            losses.append(loss.detach())
            ((loss * loss_mask).sum() / tokens_total).backward()
        local_gpt.allreduce_sequence_parallel_grads(model)
        return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    both = dict(z_loss_coeff=COEFF, logit_softcap=CAP, mu_loss_coeff=MU_COEFF)
    unfused_losses, unfused = losses_and_grads(**both)
    fused_losses, fused = losses_and_grads(**both, fused_output_layer=True)
    for a, b in zip(fused_losses, unfused_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fused.keys() == unfused.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], unfused[name], rtol=1e-4, atol=1e-6, msg=name)
    metrics.reduce_iteration()

    # mu-centering: the forward marks the weights; centering leaves the global mean row at 0
    patches.apply(mu_centering=True)
    _iteration(model, batches)
    marked = [n for n, p in model.named_parameters() if hasattr(p, mean_embedding.CENTERED)]
    assert weight_name in marked and len(marked) == 1, marked
    with torch.no_grad():
        live = dict(model.named_parameters())[weight_name]
        before = live.detach().clone()
        mean_embedding.center_(live.data, tp_group)
        after = full_vocab(live.detach().t().contiguous(), tp_group).t().double()
        assert float(after.mean(dim=0).abs().max()) < 1e-6, "the mean row must be 0 after centering"
        torch.testing.assert_close(live.double() - before.double(),
                                   -mu.expand_as(before).to(torch.float64), rtol=1e-5, atol=1e-6)
    patches.remove()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test; GPU machines run tests/run_gpu_checks.sh")
@pytest.mark.parametrize("tp, tied", [(1, False), (2, False), (2, True)], ids=["tp1-dp2", "tp2sp-dp2", "tp2sp-dp2-tied"])
def test_soft_cap_mu_loss_and_mu_centering_against_float64(tp, tied):
    pytest.importorskip("megatron.core")
    run_on_ranks(2 * tp, _mitigations_worker, tp, tied, timeout=600)


# ---------------------------------------------------------------------------------------------
# mu-centering through Megatron's distributed optimizer's layout, on real gloo ranks
# ---------------------------------------------------------------------------------------------


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _ShardedOptimizer:
    """What ``center_distributed_main_params`` reads of Megatron's ``DistributedOptimizer``: every rank's
    model params in one order (its buffers' ``params``), this rank's fp32 shard of those it holds a range of
    (``shard_fp32_from_float16_groups`` beside ``model_float16_groups``) and its range of the flattened
    param (``_get_model_param_range_map(param)["param"]``), the data-parallel group."""

    def __init__(self, params, ranges, dp_group):
        from types import SimpleNamespace

        self.config = SimpleNamespace(use_precision_aware_optimizer=False)
        self.data_parallel_group = dp_group
        self.buffers = [SimpleNamespace(params=list(params))]
        self._ranges = {p: r for p, r in zip(params, ranges) if r is not None}
        owned = [p for p in params if p in self._ranges]
        self.model_float16_groups = [owned]
        self.shard_fp32_from_float16_groups = [[p.detach().view(-1)[self._ranges[p].start:self._ranges[p].end]
                                                .float().clone() for p in owned]]
        self.model_fp32_groups, self.shard_fp32_groups = [[]], [[]]

    def _get_model_param_range_map(self, param):
        return {"param": self._ranges[param]}


def _distributed_centering_worker(rank, world_size):
    import torch.distributed as dist

    from mindspeed_cez.patches import mean_embedding

    tp = 2  # ranks (0, 1) and (2, 3) are the two data-parallel ranks of TP ranks 0 and 1
    tp_rank, dp_rank = rank % tp, rank // tp
    tp_group = dp_group = None
    for group_ranks in ([0, 1], [2, 3]):
        g = dist.new_group(group_ranks)
        if rank in group_ranks:
            tp_group = g
    for group_ranks in ([0, 2], [1, 3]):
        g = dist.new_group(group_ranks)
        if rank in group_ranks:
            dp_group = g
    v_local, h = 7, 5
    full = torch.randn(v_local * tp, h, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 4.0
    weight = torch.nn.Parameter(full[tp_rank * v_local:(tp_rank + 1) * v_local].float().clone())
    other = torch.nn.Parameter(torch.randn(3, h))  # unmarked: never touched
    setattr(weight, mean_embedding.CENTERED, tp_group)
    cut = 13  # rows cut mid-way: rank 0 of the data-parallel pair holds elements [0, 13), rank 1 the rest
    # the first data-parallel rank also holds none of a second marked weight: it must still join its collectives
    third = torch.nn.Parameter(torch.randn(4, h) + 1.0)
    setattr(third, mean_embedding.CENTERED, tp_group)
    ranges = [_Range(0, cut) if dp_rank == 0 else _Range(cut, weight.numel()), None,
              None if dp_rank == 0 else _Range(0, third.numel())]
    optimizer = _ShardedOptimizer([weight, other, third], ranges, dp_group)
    before_other = optimizer.shard_fp32_from_float16_groups[0]
    mean_embedding.center_distributed_main_params(optimizer)
    shard = optimizer.shard_fp32_from_float16_groups[0][0]
    expected = (full - full.mean(dim=0))[tp_rank * v_local:(tp_rank + 1) * v_local].reshape(-1)
    r = ranges[0]
    torch.testing.assert_close(shard.double(), expected[r.start:r.end], rtol=1e-6, atol=1e-5)
    assert len(before_other) == 1 + dp_rank, "only the ranges a rank holds are its shards"
    if dp_rank == 1:  # the whole third weight: its mean over both TP ranks' rows
        thirds = [torch.empty_like(third) for _ in range(tp)]
        dist.all_gather(thirds, third.detach(), group=tp_group)
        both = torch.cat(thirds).double()
        torch.testing.assert_close(optimizer.shard_fp32_from_float16_groups[0][1].double(),
                                   (third.double() - both.mean(dim=0)).reshape(-1), rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_mu_centering_through_the_distributed_optimizers_shards():
    run_on_ranks(4, _distributed_centering_worker, timeout=300)
