"""The flag under Megatron's fault tolerance and resharding resumes, in Megatron's own training loop on the CPU
(megatron-core 0.19.2 with ``megatron.training``, 2 ranks over gloo, fp32; ``tests/support/gpu_megatron_features.py``
runs the same and more on four GPUs):

* a step re-run by Megatron's rerun state machine (every step, in its determinism-stats mode) reproduces each
  micro-batch's loss exactly with ``--lm-fused-output-layer`` (forward: the weight gradient made in the forward);
* a NaN put into the output layer's input at iteration 3 gets Megatron's verdict with the flag, word for word
  (``validate_results``: re-run, reproducible, checkpoint, exit status 16);
* a ``torch_dist`` checkpoint saved at TP=2 (with SP) resumes at PP=2: the resumed run continues the run that
  never stopped (the saving one), ``lm_z_loss``, ``lm_lse`` and ``lm_lse_max`` included;
* the output layer's weight gradient after Megatron's gradient sync equals the float64 gradient made from what the
  run fed the output layer (DDP at DP2 and TP2 + SP, Megatron-FSDP at DP2 where einops is installed; the fused
  layer forward with the z-loss, and Megatron's own CE).

An in-process restart (nvidia-resiliency-ext, absent here) calls Megatron's ``destroy_global_state`` between a
fault and the next attempt: the adaptor forgets the interrupted step there (its metric sums, the fused layer's
forwards whose backward never came), checked by calling Megatron's own restart finalizer.

Run by ``.ci/leg_py312.sh``; eight launches (seven without einops: CI installs it), about three minutes on two cores.
"""

import subprocess
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.training")

from support.gpu_megatron_features import rerun_lines, verdict  # noqa: E402
from support.megatron_launch import CPP_ABORT, MOE, REPO, TINY_GPT, launch_command, parse_log, with_args  # noqa: E402


FOL = ["--lm-z-loss-coeff", "1e-2", "--lm-z-loss-log-lse", "--lm-fused-output-layer"]
TP2 = with_args(TINY_GPT, global_batch_size=4, tensor_model_parallel_size=2, eval_iters=0, eval_interval=1000,
                train_iters=4) + ["--sequence-parallel"] + MOE
PP2 = with_args(TINY_GPT, global_batch_size=4, pipeline_model_parallel_size=2, eval_iters=0, eval_interval=1000,
                train_iters=4) + MOE
METRICS = ("lm loss", "lm_z_loss", "lm_lse", "lm_lse_max")


class Launched:
    def __init__(self, out, proc):
        self.log_path, self.rc, self.timed_out = out / "train.log", proc.returncode, False
        self.rows = parse_log(proc.stdout)


def run(out, args, env=None, timeout=300):
    """One launch (2 ranks, gloo, no logits dumped); its exit status and log, whatever the status."""
    cmd, env = launch_command(out, args, 2, {"CEZ_DUMP_LOGITS_DIR": "", **(env or {})}, backend="gloo")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "train.log").write_text(proc.stdout + "\n" + proc.stderr)
    return Launched(out, proc)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo): the GPU script runs it on GPUs")
def test_rerun_reproduces_the_loss_with_the_fused_layer(tmp_path):
    launched = run(tmp_path, TP2 + FOL, {"CEZ_TEST_RERUN_MODE": "report_determinism_stats"})
    assert launched.rc == 0, launched.log_path.read_text()[-4000:]
    lines = rerun_lines(launched)
    assert {int(ln.split()[2]) for ln in lines} == {1, 2, 3, 4}, lines  # every step re-run
    assert len(lines) == 4 * 2 * 2 and all(ln.endswith("identical") for ln in lines), lines  # micro-batches x ranks
    assert all("lm_z_loss" in row for row in launched.rows.values()), launched.rows


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo): the GPU script runs it on GPUs")
def test_nan_verdict_unchanged_by_the_flag(tmp_path):
    """The fused layer's run meets Megatron's verdict word for word (the GPU script also launches the run without
    the flag beside it; here the verdict is Megatron's text, which names the third step #4)."""
    args = TP2 + FOL + ["--save", str(tmp_path / "ckpt"), "--save-interval", "1000", "--ckpt-format", "torch"]
    launched = run(tmp_path, args, {"CEZ_TEST_NAN_ITERATION": "3"})
    text = launched.log_path.read_text()
    if launched.rc == 0 or CPP_ABORT in text:
        pytest.fail(f"rc {launched.rc}\n{text[-4000:]}")
    assert sorted(launched.rows) == [1, 2], launched.rows  # the NaN step is never logged
    lines, codes = verdict(launched)
    assert lines == [
        "Unexpected result nan at iteration #4 invocation #1 (message='found NaN in local forward loss calculation')",
        "iteration #4: First rerun: unexpected result is reproducible within the tolerance (nan = nan). "
        "Need to rerun on a different GPU to verify correctness.!",
    ], lines
    assert codes == [16], codes  # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE, after saving a checkpoint
    assert "saving checkpoint at iteration       2" in text


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo): the GPU script runs it on GPUs")
def test_torch_dist_checkpoint_resumes_at_another_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "whole").mkdir()
    (tmp_path / "resumed").mkdir()
    whole = run(tmp_path / "whole", TP2 + FOL + ["--save", str(ckpt), "--save-interval", "2"])
    assert whole.rc == 0, whole.log_path.read_text()[-4000:]
    resumed = run(tmp_path / "resumed", PP2 + FOL + ["--load", str(ckpt), "--ckpt-step", "2"])
    assert resumed.rc == 0, resumed.log_path.read_text()[-4000:]
    a, b = resumed.rows, whole.rows
    assert sorted(a) == [3, 4], a
    for key in METRICS:
        assert a[3][key] == pytest.approx(b[3][key], rel=1e-5), (key, a[3], b[3])
        # Megatron 0.19 prints a run's first iteration without resetting its sums: line 4 covers 3 and 4, the
        # mean of the two for every metric but lm_lse_max, the largest of the two (the interval's maximum)
        held = max if key == "lm_lse_max" else (lambda x, y: (x + y) / 2)
        assert a[4][key] == pytest.approx(held(b[3][key], b[4][key]), rel=1e-5), (key, a[4], b[4])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo): the GPU script runs it on GPUs")
@pytest.mark.parametrize("layout", ["dp2-ddp", "tp2-sp-ddp", "dp2-megatron-fsdp", "tp2-sp-ddp-megatron-ce"])
def test_output_layer_gradient_equals_the_float64_reference(tmp_path, layout):
    """The fused layer (forward: the weight gradient made in the forward, into DDP's ``main_grad``; under
    Megatron-FSDP through autograd) with the z-loss: the output layer's weight gradient of iteration 1 after
    Megatron's gradient sync equals the float64 gradient made from what the run fed the output layer (every
    micro-batch's input, weight, labels and loss mask; ``tests/support/output_grad_reference.py``), two micro-batches per
    rank counting different tokens; Megatron's own CE (c = 0, its logits made from the dumped input and weight) the
    reference's control. Megatron-FSDP needs einops; over gloo, its gradient scaling unfused (gloo has
    no PREMUL_SUM). torch FSDP2 is not run here: Megatron's wrapper wants the parameters on a CUDA device."""
    from support.gpu_megatron_features import grad_difference, output_grads
    from support.output_grad_reference import reference_output_grad

    parallel = ["--tensor-model-parallel-size", "2", "--sequence-parallel"] if layout.startswith("tp2") else []
    fsdp = layout.endswith("megatron-fsdp")
    if fsdp:
        pytest.importorskip("einops")  # Megatron-FSDP imports it
        parallel = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-gradient-reduce-div-fusion"]
    megatron_ce = layout.endswith("megatron-ce")
    args = with_args(TINY_GPT, global_batch_size=4 if layout.startswith("tp2") else 8, train_iters=1, eval_iters=0,
                     eval_interval=1000) + ["--untie-embeddings-and-output-weights"] + parallel + ([] if megatron_ce
                                                                                                  else FOL)
    env = {"CEZ_DUMP_OUTPUT_GRAD": str(tmp_path / "grad"), "CEZ_DUMP_OUTPUT_INPUTS": str(tmp_path / "inputs"),
           "CUDA_DEVICE_MAX_CONNECTIONS": "8" if fsdp else "1"}
    launched = run(tmp_path, args, env)
    assert launched.rc == 0, launched.log_path.read_text()[-4000:]
    reference, facts = reference_output_grad(tmp_path / "inputs")
    assert (facts["dp"], facts["tp"], facts["micro_batches"]) == ((1, 2) if layout.startswith("tp2") else (2, 1)) + (2,)
    if megatron_ce:  # Megatron's logits = the dumped input @ weight.T: the dump holds what the layer used
        assert not facts["deferred"] and facts["z_loss_coeff"] == 0.0 and facts["weight_check"] <= 1e-6, facts
    else:
        assert facts["deferred"] and facts["z_loss_coeff"] == 1e-2, facts
    assert facts["loss_scale"] == 1.0, facts
    dumped = output_grads(SimpleNamespace(env=env), 1)
    where = "DTensor.grad" if fsdp else "Parameter.main_grad"  # Megatron-FSDP's sharded gradient, gathered
    assert sorted(dumped) == sorted(reference) and all(w == where for _, w in dumped.values()), dumped
    diff = grad_difference(dumped, {t: (g, "float64") for t, g in reference.items()})
    assert diff <= 1e-5, diff  # fp32 GEMMs against float64
    if megatron_ce:
        return
    without_z = grad_difference(dumped, {t: (g, "") for t, g in _without_z_loss(tmp_path / "inputs").items()})
    assert without_z > 100 * diff, (without_z, diff)  # the z-loss term is seen


def _without_z_loss(folder):
    """The reference of ``folder`` with the z-loss coefficient set to 0 (the check's control)."""
    import shutil

    from support.output_grad_reference import reference_output_grad

    copy = folder.parent / (folder.name + "_c0")
    shutil.copytree(folder, copy)
    for path in copy.glob("*.pt"):
        dump = torch.load(path)
        dump["lm_z_loss_coeff"] = 0.0
        torch.save(dump, path)
    return reference_output_grad(copy)[0]


def test_inprocess_restart_forgets_the_interrupted_step():
    """Megatron's restart finalizer (``inprocess_restart.destroy_state``), called with the adaptor active after a
    step that recorded metric sums and dropped a fused-layer forward: the next step starts clean."""
    from megatron.training import inprocess_restart

    from mindspeed_cez import patches
    from mindspeed_cez.patches import reporting as metrics
    from mindspeed_cez.patches import runtime

    patches.apply(z_loss_coeff=1e-2, log_lse=True, fused_output_layer=True)
    try:
        ledger = runtime.current().ledger  # the adaptor's: the fused layer's forwards that owe a backward
        metrics.record_lm_z_loss(torch.full((4,), 2.0), torch.ones(4), lse_per_token=torch.full((4,), 7.0))
        alive = ledger.owe("output_layer.weight (alive)")  # a forward whose backward was pending
        ledger.owe("output_layer.weight (freed)")  # one whose graph went without a backward
        inprocess_restart.destroy_state()
        ledger.check()  # nothing owed, nothing dropped: no ForwardGradientError
        del alive
        ledger.check()
        metrics.record_lm_z_loss(torch.full((2,), 1.0), torch.ones(2), lse_per_token=torch.full((2,), 3.0))
        values = metrics.reduce_iteration()  # no parallel state: this rank's values
        assert {k: float(v) for k, v in values.items()} == {"lm_z_loss": 1.0, "lm_lse": 3.0, "lm_lse_max": 3.0}
    finally:
        patches.remove()


@pytest.mark.parametrize("fsdp", [True, False], ids=["megatron-fsdp", "ddp"])
def test_fused_layer_leaves_megatron_fsdp_main_grad_alone(fsdp):
    """A weight Megatron-FSDP manages (``__fsdp_param__``) keeps last iteration's ``main_grad`` view in forward;
    the fused layer hands its gradient back through autograd (Megatron-FSDP's hook puts it into the bucket), the
    gradient of a plain weight; a DDP weight's gradient goes into ``main_grad`` (the control)."""
    from mindspeed_cez import ForwardGradientLedger
    from mindspeed_cez.patches import loss_wrappers, runtime
    from mindspeed_cez.patches.settings import Settings

    torch.manual_seed(0)
    s, b, h, v = 8, 2, 16, 32
    hidden = torch.randn(s, b, h)
    target = torch.randint(0, v, (s, b))
    mask = (torch.rand(b, s) > 0.3).float()
    settings = Settings(z_loss_coeff=1e-2, fused_output_layer=True, grads="recompute")
    on = runtime.Runtime(None, None, ForwardGradientLedger())  # what the patched loss gets: settings, ledger
    on.settings = settings
    config = SimpleNamespace(grad_scale_func=None, calculate_per_token_loss=False)
    layer = SimpleNamespace(sequence_parallel=False, gradient_accumulation_fusion=False)

    def weight_grad(weight):
        x = hidden.clone().requires_grad_()
        deferred = loss_wrappers.DeferredLogits(x, weight, layer)
        loss, _, _ = loss_wrappers.linear_loss(deferred, target, settings.loss, None, on, mask, config)
        (loss.transpose(0, 1) * mask).sum().backward()
        return weight

    init = torch.randn(v, h) * 0.1
    plain = weight_grad(torch.nn.Parameter(init.clone())).grad
    weight = torch.nn.Parameter(init.clone())
    weight.main_grad = torch.full((v, h), 7.0)  # the view a previous iteration left
    weight.grad_added_to_main_grad = False
    if fsdp:
        weight.__fsdp_param__ = True
    weight_grad(weight)
    if fsdp:
        assert torch.equal(weight.main_grad, torch.full((v, h), 7.0))
        torch.testing.assert_close(weight.grad, plain)
    else:
        torch.testing.assert_close(weight.main_grad - 7.0, plain)
        assert weight.grad_added_to_main_grad


def test_every_gpu_launch_passes_megatrons_argument_validation(monkeypatch, tmp_path):
    """The four-GPU script's launches (CUDA graphs, FSDP, resharding, faults) as Megatron validates them at
    startup, with the flags' validation, on the CPU: a launch Megatron would refuse never costs device time."""
    from support import gpu_megatron_features
    from megatron.training import arguments as megatron_arguments

    from mindspeed_cez.patches.arguments import add_lm_z_loss_args, validate

    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)  # Hopper, as the GPUs used
    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    specs = gpu_megatron_features.specs(cpu=False, work=tmp_path)
    assert {s.group for s in specs} == {"graphs", "fsdp", "reshard", "faults"}
    for spec in specs:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", spec.env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"))
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *spec.args, "--distributed-backend", "nccl"])
        args = megatron_arguments.parse_args(extra_args_provider=add_lm_z_loss_args)
        megatron_arguments.validate_args(args, {"tokenizer_type": "NullTokenizer"})
        validate(args)
