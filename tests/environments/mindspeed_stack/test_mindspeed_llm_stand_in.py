"""MindSpeed-LLM's training path, through the stand-ins of ``tests/support/stand_ins`` (CI; the real files:
``test_mindspeed_llm_source.py``, opt-in).

In real gloo processes, with ``import mindspeed_cez.megatron_adaptor`` before or after
``from mindspeed_llm import megatron_adaptor`` (whose adaptor removes every patch and sets MindSpeed's
features list anew), MindSpeed-LLM's own ``GPTModel`` forward and its own ``train`` /
``training_log`` must give, against float64 references from the model's logits:

* per-token loss = CE of the scaled and soft-capped logits, their gradient (before the transform)
  that of CE + c*lse^2;
* ``lm_z_loss`` in MindSpeed-LLM's log line and TensorBoard, weighted by the loss mask its forward
  receives, over both micro-batches and the DP ranks; the MTP head's loss plain CE, not counted;
* ``--loss-compute-mode chunk`` at TP=1 and ``--is-instruction-dataset`` refused naming both
  flags; chunk mode at TP=2 (MindSpeed-LLM falls back to the regular loss there) served;
* ``--lm-fused-output-layer``: its forward's output layer makes no logits, outputs, gradients and
  ``lm_z_loss`` as the unfused op's;
* its scaling and soft cap of the logits are recorded, not run by its torch ops, and computed in the
  kernels, with and without ``--lm-fused-output-layer``: the same outputs, gradients and
  ``lm_z_loss`` as its own torch ops followed by the unfused op;
* ``python -m mindspeed_cez.launch`` runs a stand-in of its ``pretrain_gpt.py`` unchanged.
"""

import os
import re
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
from support import STAND_INS, run_on_ranks  # noqa: E402
from support import tiny_gpt as gpt  # noqa: E402
from mindspeed_cez.patches.model_context import TransformedLogits  # noqa: E402

COEFF = 3e-2
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test"),
]


def _import_adaptors(order):
    sys.path.insert(0, STAND_INS)
    if order == "cez first":
        import mindspeed_cez.megatron_adaptor as adaptor
        from mindspeed_llm import megatron_adaptor  # noqa: F401
    else:
        from mindspeed_llm import megatron_adaptor  # noqa: F401
        import mindspeed_cez.megatron_adaptor as adaptor
    assert adaptor.MODE == "mindspeed", adaptor.MODE


def _transform(args):
    def apply(x):
        if args.output_multiplier_scale:
            x = x * args.output_multiplier_scale
        if args.output_logit_softcapping:
            x = torch.tanh(x / args.output_logit_softcapping) * args.output_logit_softcapping
        return x

    return apply


def _reference(logits_shard, labels, tp_group, tp_rank, transform, coeff, weight):
    """float64: CE, lse and d(weight * (CE + c*lse^2))/d(this rank's pre-transform logits)."""
    full = gpt.full_vocab(logits_shard, tp_group).double().requires_grad_()
    x = transform(full)
    lse = torch.logsumexp(x, dim=-1)
    ce = lse - x.gather(-1, labels.transpose(0, 1).unsqueeze(-1)).squeeze(-1)
    ((ce + coeff * lse**2) * weight).sum().backward()
    v = logits_shard.shape[-1]
    return ce.detach().t(), lse.detach().t(), full.grad[..., tp_rank * v:(tp_rank + 1) * v]


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step=None, *args, **kwargs):
        self.scalars[name] = float(value)


def _train_worker(rank, world_size, tp, order, coeff, extra):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _import_adaptors(order)
    import mindspeed_llm.core.models.gpt.gpt_model as llm_gpt
    from megatron.core.models.gpt import gpt_model
    from mindspeed_llm.training import arguments, training

    assert gpt_model.GPTModel is llm_gpt.GPTModel
    argv = [f"--tensor-model-parallel-size={tp}", f"--num-layers={gpt.LAYERS}", "--num-micro-batches=2",
            *extra] + (["--sequence-parallel"] if tp > 1 else [])
    args = arguments.parse_args(argv + (["--lm-z-loss-coeff", str(coeff)] if coeff else []))
    model = gpt.build(tp)
    assert type(model) is llm_gpt.GPTModel
    model.train()
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    dp_group = ps.get_data_parallel_group()
    batches = gpt.micro_batches(ps.get_data_parallel_rank())
    position_ids = torch.arange(gpt.SEQ).unsqueeze(0).expand(gpt.BATCH, gpt.SEQ)
    mask = gpt.local_gpt.causal_attention_mask(gpt.SEQ)

    heads, outputs = [], []  # output-layer calls (MTP head first, as in MindSpeed-LLM), model outputs

    def keep_logits(module, inputs, output):
        logits = output[0]
        transformed = isinstance(logits, TransformedLogits)  # its torch ops are not run: the kernels do it
        logits = logits.logits if transformed else logits
        heads.append({"logits": logits.detach().clone(), "live": logits, "transformed": transformed})
        logits.register_hook(lambda g, entry=heads[-1]: entry.__setitem__("grad", g.detach().clone()))

    hooks = [model.output_layer.register_forward_hook(keep_logits),
             model.register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))]
    training.WRITER = writer = _Writer()
    training.train(model, [[(t, lab, m, position_ids, mask) for t, lab, m in batches]])
    for h in hooks:
        h.remove()

    per_mb = 2 if args.mtp_num_layers else 1
    transform = _transform(args)
    sums = torch.zeros(4, dtype=torch.float64)  # sum(c*lse^2*m), sum(ce*m), sum(m), MTP-counted
    for i, (_, labels, loss_mask) in enumerate(batches):
        main = heads[per_mb * i + per_mb - 1]
        assert main["transformed"] == bool(coeff and (args.output_multiplier_scale or args.output_logit_softcapping))
        weight = loss_mask.t().double() / (loss_mask.sum() * len(batches))  # Megatron's schedule
        ce, lse, grad = _reference(main["logits"], labels, tp_group, tp_rank, transform, coeff, weight)
        torch.testing.assert_close(outputs[i].double(), ce, rtol=1e-5, atol=1e-5)  # the value is CE
        torch.testing.assert_close(main["grad"].double(), grad, rtol=1e-4, atol=1e-7)  # the gradient has z
        m = loss_mask.double()
        sums[:3] += torch.stack([(coeff * lse**2 * m).sum(), (ce * m).sum(), m.sum()])
        if per_mb == 2:  # the MTP head: rolled labels, plain CE value and gradient
            mtp = heads[per_mb * i]
            mtp_labels = torch.roll(labels, -1, dims=-1)
            ones = torch.ones_like(weight)
            mtp_ce, mtp_lse, mtp_grad = _reference(mtp["logits"], mtp_labels, tp_group, tp_rank, lambda x: x, 0.0, ones)
            if i == len(batches) - 1:  # the model keeps the last micro-batch's MTP loss
                torch.testing.assert_close(model.mtp_loss.double(), mtp_ce, rtol=1e-5, atol=1e-5)
                (live_grad,) = torch.autograd.grad(model.mtp_loss.sum(), mtp["live"])
                torch.testing.assert_close(live_grad.double(), mtp_grad, rtol=1e-4, atol=1e-7)
            sums[3] += (coeff * mtp_lse**2).sum()
    dist.all_reduce(sums, group=dp_group)

    line = training.LOG_LINES[-1]
    logged = {k: float(v) for k, v in re.findall(r" ([\w ]+): ([0-9.E+-]+) \|", line)}
    assert logged["lm loss"] == pytest.approx(float(sums[1] / sums[2]), rel=1e-5), line
    assert (logged.get("load_balancing_loss", 0) > 0) == bool(args.num_experts), line
    if coeff:
        expected = float(sums[0] / sums[2])
        assert logged["lm_z_loss"] == pytest.approx(expected, rel=1e-5), line
        assert writer.scalars["lm_z_loss"] == pytest.approx(expected, rel=1e-5)
        if per_mb == 2:
            counted = float((sums[0] + sums[3]) / sums[2])
            assert abs(counted - expected) > 1e-4 * expected, "the MTP head must not be counted"
    else:
        assert "lm_z_loss" not in logged and "lm_z_loss" not in writer.scalars, line


# --num-experts: the loop reports MoE metrics (track_moe_metrics); without it, only the log line does
CASES = {
    "tp1-dp2, cez imported after MindSpeed-LLM": (1, "cez last", COEFF, ["--num-experts=4"]),
    "tp1-dp2, cez imported first, MTP, no MoE report": (1, "cez first", COEFF, ["--mtp-num-layers=1"]),
    "tp2sp, cez first, chunk mode, scaled and soft-capped logits": (
        2, "cez first", COEFF, ["--num-experts=4", "--loss-compute-mode=chunk", "--loss-chunk-size=4",
                                "--output-multiplier-scale=0.5", "--output-logit-softcapping=3"],
    ),
    "tp1-dp2, flag off": (1, "cez last", 0.0, ["--num-experts=4"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mindspeed_llm_model_and_loop(case):
    tp, order, coeff, extra = CASES[case]
    run_on_ranks(2, _train_worker, tp, order, coeff, extra, timeout=600)


def _kind(logits):
    return (type(logits).__name__, *([type(logits.logits).__name__] if isinstance(logits, TransformedLogits) else []))


def _fused_output_layer_worker(rank, world_size, tp, transform):
    """MindSpeed-LLM's forward and loop with ``--lm-fused-output-layer``: no logits made, and the
    same outputs, parameter gradients and ``lm_z_loss`` as the unfused op's run of the same model.
    With ``transform`` (its scaling and soft cap of the logits), both runs compute them in the kernels
    and equal a third: MindSpeed-LLM's own torch ops on the logits, then the unfused op. Under a loss
    scale, the fused layer's default path is told the schedule's gradient in forward."""

    from megatron.core import parallel_state as ps

    _import_adaptors("cez first")
    from mindspeed_llm.training import arguments, training

    from mindspeed_cez.patches import runtime as cez_runtime
    from support import recorded_grad_scales

    model = gpt.build(tp)
    model.train()
    model.config.grad_scale_func = lambda loss: loss * 4.0  # a loss scale, as Megatron's optimizer sets it
    batches = gpt.micro_batches(ps.get_data_parallel_rank())
    position_ids = torch.arange(gpt.SEQ).unsqueeze(0).expand(gpt.BATCH, gpt.SEQ)
    mask = gpt.local_gpt.causal_attention_mask(gpt.SEQ)
    base = [f"--tensor-model-parallel-size={tp}", f"--num-layers={gpt.LAYERS}", "--num-micro-batches=2",
            "--num-experts=4", "--lm-z-loss-coeff", str(COEFF)] + (["--sequence-parallel"] if tp > 1 else [])
    base += TRANSFORM if transform else []

    def run(extra, torch_transform=False):
        arguments.parse_args(base + extra)
        if torch_transform:  # the reference: MindSpeed-LLM's own ops on the logits
            cez_runtime.set_active(cez_runtime.get_active().replace(logit_transform=None))
        model.zero_grad(set_to_none=True)
        kinds, outputs = [], []
        hooks = [model.output_layer.register_forward_hook(lambda m, i, o: kinds.append(_kind(o[0]))),
                 model.register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))]
        training.LOG_LINES.clear()
        training.train(model, [[(t, lab, m, position_ids, mask) for t, lab, m in batches]])
        for h in hooks:
            h.remove()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        logged = dict(re.findall(r" ([\w ]+): ([0-9.E+-]+) \|", training.LOG_LINES[-1]))
        return kinds, outputs, grads, {k: float(v) for k, v in logged.items()}

    runs = {"unfused": run([])}
    with recorded_grad_scales() as scales:
        runs["fused"] = run(["--lm-fused-output-layer"])
    expected = [4.0 / float(m.sum()) / len(batches) for _, _, m in batches]
    assert [float(s) for s in scales] == pytest.approx(expected, rel=1e-6), (scales, expected)
    wrap = ("TransformedLogits",) if transform else ()
    assert runs["fused"][0] == [(*wrap, "DeferredLogits")] * len(batches), runs["fused"][0]
    assert runs["unfused"][0] == [(*wrap, "Tensor")] * len(batches), runs["unfused"][0]
    if transform:
        runs["torch ops"] = run([], torch_transform=True)
        assert runs["torch ops"][0] == [("Tensor",)] * len(batches)
    _, out_u, grads_u, log_u = runs.pop("unfused")
    for name, (_, out, grads, log) in runs.items():
        for a, b in zip(out, out_u):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        assert grads.keys() == grads_u.keys()
        for param in grads:
            torch.testing.assert_close(grads[param], grads_u[param], rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")
        for key in ("lm loss", "lm_z_loss"):
            assert log[key] == pytest.approx(log_u[key], rel=1e-5), (name, key, log, log_u)


# Grok-1's multiplier (as its MindSpeed-LLM script sets it) and a cap small enough to bend the logits
TRANSFORM = ["--output-multiplier-scale=0.5773502691896257", "--output-logit-softcapping=2"]


@pytest.mark.parametrize("tp,transform", [(1, False), (2, False), (1, True), (2, True)],
                         ids=["tp1-dp2", "tp2sp", "tp1-dp2, scaled and soft-capped", "tp2sp, scaled and soft-capped"])
def test_mindspeed_llm_fused_output_layer(tp, transform):
    run_on_ranks(2, _fused_output_layer_worker, tp, transform, timeout=600)


def _refusal_worker(rank, world_size, order):
    _import_adaptors(order)
    from mindspeed_llm.training import arguments

    for extra in (["--loss-compute-mode", "chunk"], ["--is-instruction-dataset"]):
        with pytest.raises(ValueError, match=f"--lm-z-loss-coeff.*{extra[0]}"):
            arguments.parse_args(["--lm-z-loss-coeff", "1e-4", *extra])
    args = arguments.parse_args(["--loss-compute-mode", "chunk", "--tensor-model-parallel-size", "2", "--lm-z-loss-coeff", "1e-4"])
    assert args.lm_z_loss_coeff == 1e-4
    arguments.parse_args(["--loss-compute-mode", "chunk"])  # without the flag: MindSpeed-LLM's own chunk loss
    from mindspeed_cez.patches import active_settings

    for extra in (["--output-multiplier-scale", "0.5"], ["--output-logit-softcapping", "30"]):
        for flags in (["--lm-fused-output-layer"], ["--lm-z-loss-coeff", "1e-4"]):  # served, in the kernels
            arguments.parse_args([*flags, *extra])
            assert active_settings().logit_transform is not None
    arguments.parse_args(["--lm-z-loss-coeff", "1e-4"])
    assert active_settings().logit_transform is None


@pytest.mark.parametrize("order", ["cez first", "cez last"])
def test_mindspeed_llm_modes_the_kernel_cannot_serve_fail_at_validation(order):
    run_on_ranks(1, _refusal_worker, order, timeout=300)


@pytest.mark.parametrize("launcher", [True, False], ids=["through the launcher", "without it"])
def test_mindspeed_llm_pretrain_script_unchanged_through_the_launcher(tmp_path, launcher):
    """``torchrun ... -m mindspeed_cez.launch pretrain_gpt.py ARGS``: MindSpeed-LLM's script takes the
    flag and logs ``lm_z_loss`` with no Python file changed; without the launcher its parser refuses it."""
    import subprocess

    from support import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *(["-m", "mindspeed_cez.launch"] if launcher else []),
           os.path.join(STAND_INS, "pretrain_gpt.py"), "--num-experts=4", "--num-micro-batches=2",
           "--lm-z-loss-coeff", str(COEFF)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    if not launcher:
        assert proc.returncode != 0 and "unrecognized arguments: --lm-z-loss-coeff" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(" iteration")]
    logged = {k: float(v) for k, v in re.findall(r" ([\w ]+): ([0-9.E+-]+) \|", lines[-1])}
    # (megatron-core 0.12 puts load_balancing_loss in the line only with a TensorBoard writer: not asked here)
    assert logged["lm loss"] > 0 and logged["lm_z_loss"] > 0, lines


def test_mindspeed_llm_pretrain_builds_one_settings_per_rank(tmp_path):
    """Through the launcher, with MindSpeed-LLM's logit flags (which enter the Settings): each rank builds
    one Settings, at the adaptor's import, and MindSpeed's validation of our feature hands it on
    (``tests/support/count_settings.py`` counts every construction)."""
    import subprocess

    from support import TESTS, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.join(TESTS, "support", "count_settings.py"),
           "-m", "mindspeed_cez.launch", os.path.join(STAND_INS, "pretrain_gpt.py"), "--num-experts=4",
           "--num-micro-batches=2", "--lm-z-loss-coeff", str(COEFF), *TRANSFORM]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    counts = sorted(re.findall(r"cez-settings rank=(\d+) built=(\d+) activated=(\d+) same=(True|False)", proc.stdout))
    assert counts == [("0", "1", "1", "True"), ("1", "1", "1", "True")], proc.stdout[-3000:]
