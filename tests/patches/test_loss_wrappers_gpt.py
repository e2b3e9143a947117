"""A tiny megatron-core MoE GPTModel on CPU (real gloo processes): its loss goes through the fused op.

Layouts: TP=1 x DP=2, and TP=2 with sequence parallelism x DP=2. Each iteration has two
micro-batches whose loss masks differ in size, within a rank and across the DP ranks. Checked on
every rank, against float64 references computed from the model's own logits (gathered over the
TP vocab shards):

* Megatron without the adaptor, with the adaptor installed but off, and after ``remove()``:
  bit-identical per-token losses, logits gradients, parameter gradients and MoE metrics;
* with the z-loss: the per-token loss equals plain CE (what Megatron logs as ``lm loss``), the
  gradient of the logits equals that of ``sum((CE + c*lse^2) * mask) / sum(mask)``, and the
  parameter gradients equal Megatron's backward of that float64 logits gradient;
* ``lm_z_loss`` and ``lm_lse`` reported by :func:`mindspeed_cez.patches.reporting.report` equal
  ``sum(c*lse^2*mask) / sum(mask)`` over both micro-batches and both DP ranks, ``lm_lse_max`` the
  largest lse of their counted tokens (float64 from the logits gathered over TP), next to
  Megatron's ``load_balancing_loss``; an eval forward (``model.eval()``, no grad) gives CE and
  records nothing.

Runs on every megatron-core line CI tests (``.ci/run``'s table): 0.12.1 (the users' leg), 0.16.1 (leg 1),
0.19.2 (leg 2) and Megatron-LM main; on 0.13.1, 0.14.0 and 0.15.3 the TP=2 case only.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from mindspeed_cez.patches import local_gpt  # noqa: E402
from support import run_on_ranks  # noqa: E402
from support.tiny_gpt import BATCH, COEFF, LAYERS, SEQ, build, micro_batches  # noqa: E402
from support.tiny_gpt import iteration as _iteration, reference as _reference  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # A CPU (gloo) test: the CPU mode that keeps Megatron off CUDA applies only without a GPU. On GPU
    # machines tests/run_gpu_checks.sh runs the adaptor through the real launch instead.
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test; GPU machines run tests/run_gpu_checks.sh"),
]


def _assert_same(a, b, what):
    la, ca, ga = a
    lb, cb, gb = b
    for x, y in zip(la, lb):
        assert torch.equal(x, y), f"{what}: per-token losses differ"
    for x, y in zip(ca, cb):
        assert torch.equal(x["grad"], y["grad"]), f"{what}: logits gradients differ"
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga), f"{what}: parameter gradients differ"


def _gpt_worker(rank, world_size, tp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import reporting as metrics
    from mindspeed_cez.patches import runtime

    model = build(tp)
    model.train()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    assert dist.get_world_size(dp_group) == 2
    batches = micro_batches(ps.get_data_parallel_rank())

    def run(**kw):
        result = _iteration(model, batches, **kw)
        return result, metrics.report(1, len(batches), LAYERS, track_names=["load_balancing_loss"])

    patches.remove()
    megatron, megatron_scalars = run()  # Megatron's own loss
    assert "lm_z_loss" not in megatron_scalars and megatron_scalars["load_balancing_loss"] > 0

    runtime.current().patches.install_patches()  # installed, inactive: Megatron's numbers, bit for bit
    inactive, inactive_scalars = run()
    _assert_same(inactive, megatron, "installed but inactive")
    assert inactive_scalars == megatron_scalars

    patches.apply(z_loss_coeff=COEFF, log_lse=True)
    patches.apply(z_loss_coeff=COEFF, log_lse=True)  # twice: harmless
    (losses, captured, grads), scalars = run()
    ref = _reference(captured, batches, tp_group, tp_rank)
    for loss, r, cap in zip(losses, ref, captured):
        torch.testing.assert_close(loss.double(), r["ce"], rtol=1e-5, atol=1e-5)  # the value is CE
        torch.testing.assert_close(cap["grad"].double(), r["grad"], rtol=1e-4, atol=1e-7)  # grad: CE + z
    assert not torch.allclose(captured[0]["grad"], megatron[1][0]["grad"], rtol=1e-3, atol=0), "z-loss must change the gradient"
    _, _, ref_grads = _iteration(model, batches, grad_of_logits=[r["grad"] for r in ref])
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    # the metrics: token-weighted over both micro-batches and both DP ranks
    sums = torch.zeros(3, dtype=torch.float64)
    for r, (_, _, loss_mask) in zip(ref, batches):
        m = loss_mask.double()
        sums += torch.stack([(COEFF * r["lse"] ** 2 * m).sum(), (r["lse"] * m).sum(), m.sum()])
    dist.all_reduce(sums, group=dp_group)
    largest = torch.stack([r["lse"][m > 0].max() for r, (_, _, m) in zip(ref, batches)]).max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=dp_group)
    assert scalars["lm_z_loss"] == pytest.approx(float(sums[0] / sums[2]), rel=1e-5), scalars
    assert scalars["lm_lse"] == pytest.approx(float(sums[1] / sums[2]), rel=1e-5), scalars
    assert scalars["lm_lse_max"] == pytest.approx(float(largest), rel=1e-5), scalars
    assert scalars["load_balancing_loss"] > 0
    per_micro_batch = torch.stack([(COEFF * r["lse"] ** 2 * m).sum() / m.sum() for r, (_, _, m) in zip(ref, batches)])
    assert abs(float(per_micro_batch.mean()) - scalars["lm_z_loss"]) > 1e-7, "the weighting must matter here"

    # eval: CE, nothing recorded
    model.eval()
    with torch.no_grad():
        tokens, labels, loss_mask = batches[0]
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        loss = model(tokens, position_ids, local_gpt.causal_attention_mask(SEQ), labels=labels, loss_mask=loss_mask)
    torch.testing.assert_close(loss.double(), ref[0]["ce"], rtol=1e-5, atol=1e-5)
    assert metrics.recorded_tokens() == 0, "an eval forward must not record"
    model.train()

    # a caller that hands no loss mask (no GPTModel around the loss): every token counts, said once
    logits = captured[0]["logits"].clone().requires_grad_()
    with pytest.warns(UserWarning, match="no loss mask"):
        model.compute_language_model_loss(batches[0][1], logits)
    unmasked = torch.stack([(COEFF * ref[0]["lse"] ** 2).sum(), torch.tensor(float(ref[0]["lse"].numel()), dtype=torch.float64)])
    dist.all_reduce(unmasked, group=dp_group)
    scalars = metrics.report(2, 1, LAYERS, track_names=())
    assert scalars["lm_z_loss"] == pytest.approx(float(unmasked[0] / unmasked[1]), rel=1e-5), scalars

    runtime.set_active(None)  # flag off
    _assert_same(run()[0], megatron, "flag off")
    patches.apply(z_loss_coeff=0.0)  # --lm-fused-ce: fused kernel, plain CE and its gradient
    (losses, captured, _), scalars = run()
    assert "lm_z_loss" not in scalars
    for loss, ref_loss, cap, ref_cap in zip(losses, megatron[0], captured, megatron[1]):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap["grad"], ref_cap["grad"], rtol=1e-4, atol=1e-7)
    patches.remove()
    patches.remove()
    removed, removed_scalars = run()
    _assert_same(removed, megatron, "remove()")
    assert removed_scalars == megatron_scalars
    assert not patches.installed_targets()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1-dp2", "tp2sp-dp2"])
def test_gpt_moe_loss_gradient_and_lm_z_loss_metric(tp):
    run_on_ranks(2 * tp, _gpt_worker, tp, timeout=600)


def _schedule_plan_worker(rank, world_size):
    """The MoE schedule-plan path (``--overlap-moe-expert-parallel-comm``) never calls
    ``GPTModel.forward``: its post-process node calls ``GPTModel._postprocess`` with the labels and
    loss mask it kept. Megatron's node, run here on the CPU, must give the masked metric."""
    import types

    from megatron.core.models.common.utils import PostProcessNode

    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import reporting as metrics

    model = build(1)
    model.train()
    tokens, labels, loss_mask = micro_batches(0)[1]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = local_gpt.causal_attention_mask(SEQ)
    kept = {}
    handle = model.decoder.register_forward_hook(lambda m, i, o: kept.__setitem__("hidden", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        logits = model(tokens, position_ids, mask).double()  # [b, s, v]
    handle.remove()
    lse = torch.logsumexp(logits, -1)
    ce = lse - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    patches.apply(z_loss_coeff=COEFF)
    state = types.SimpleNamespace(
        input_ids=tokens, position_ids=position_ids, labels=labels, loss_mask=loss_mask, attention_mask=mask,
        decoder_input=None, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, packed_seq_params=None,
        sequence_len_offset=None, runtime_gather_output=None, extra_block_kwargs=None, output_processor=None,
        output_processor_context=None,
    )
    loss = PostProcessNode(model, state, None, None).forward_impl(kept["hidden"].detach().requires_grad_())
    torch.testing.assert_close(loss.double(), ce, rtol=1e-5, atol=1e-5)
    scalars = metrics.report(1, 1, LAYERS, track_names=())
    m = loss_mask.double()
    expected = float((COEFF * lse**2 * m).sum() / m.sum())
    assert scalars["lm_z_loss"] == pytest.approx(expected, rel=1e-5), scalars
    assert abs(float(COEFF * (lse**2).mean()) - expected) > 1e-5 * expected  # the mask matters here
    patches.remove()


def test_schedule_plan_postprocess_node_uses_the_loss_mask():
    pytest.importorskip("megatron.core.models.common.utils", reason="no MoE schedule plan in this megatron-core")
    from megatron.core.models.common import utils

    if not hasattr(utils, "PostProcessNode"):
        pytest.skip("no schedule-plan post-process node in this megatron-core")
    run_on_ranks(1, _schedule_plan_worker, timeout=300)
