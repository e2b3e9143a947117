"""The parallel layouts of MoE pretraining, end to end in Megatron's own training loop.

Each layout launches ``examples/pretrain_gpt.py`` through its test harness
(``tests/support/megatron_pretrain_harness.py``: Megatron's ``pretrain``, megatron-core with
``megatron.training``, 2 processes, gloo on the CPU) twice, with ``--lm-z-loss-coeff`` and without
it, and checks from Megatron's log and the dumped logits (every micro-batch on every
data-parallel rank of the last pipeline stage; loss masks keep different numbers of tokens per
micro-batch and rank):

* ``lm loss`` equals the flag-off run's at iteration 1 (same weights) and, at iteration 3, the
  token-weighted CE recomputed from the dumped logits;
* ``lm_z_loss`` equals ``sum(c*lse^2*mask) / sum(mask)`` over the iteration's micro-batches and
  data-parallel ranks, recomputed from the same logits; so do ``lm_lse`` (the same mean of lse) and
  ``lm_lse_max`` (the largest lse of the counted tokens; ``--lm-z-loss-log-lse``);
* every logged loss is finite, and the runs end (no hang: each launch has a time limit).

Each layout also runs with ``--lm-fused-output-layer`` (the output layer and the loss as one op)
against the z-loss run: iteration 1's ``lm loss``, ``lm_z_loss``, MTP losses and ``grad norm``
equal, iteration 3 as recomputed from its dumped logits; resume covers it too.

Layouts: PP=2; PP=2 with virtual pipeline stages (interleaved 1F1B); EP=2 over DP=2 with the
alltoall dispatcher; EP=2 x TP=2 (expert TP 1); DP=2 with a dense model; MTP
(``--mtp-num-layers 1``: Megatron's ``mtp_1 loss`` stays CE, without z-loss); checkpoint save and
resume (``--save`` / ``--load --use-checkpoint-args``: the resumed run logs ``lm_z_loss`` and
continues the uninterrupted run's numbers); on GPUs also EP=2 x DP=2 with the MoE schedule plan
(``--overlap-moe-expert-parallel-comm``, bf16). Run by ``.ci/leg_py312.sh`` (megatron-core 0.19.2).
"""

import math

import pytest
import torch

pytest.importorskip("megatron.training")

from support.megatron_launch import (  # noqa: E402
    DUMP_ITERATION, ITERS, MOE, TINY_GPT, Z_COEFF, assert_lse_metrics, ce_mean, launch, per_micro_batch_z_mean,
    deferred_output_layer, grad_scale_known, recompute_from_dump, with_args, z_loss_mean,
)

pytestmark = pytest.mark.slow

FOUR_LAYERS = with_args(TINY_GPT, num_layers=4)
LAYOUTS = {
    "pp2": with_args(FOUR_LAYERS, global_batch_size=4, pipeline_model_parallel_size=2) + MOE,
    "pp2-vpp2": with_args(FOUR_LAYERS, global_batch_size=4, pipeline_model_parallel_size=2,
                          num_layers_per_virtual_pipeline_stage=1) + MOE,
    "ep2-dp2": with_args(TINY_GPT, global_batch_size=8, expert_model_parallel_size=2) + MOE,
    "ep2-tp2": with_args(TINY_GPT, global_batch_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                         expert_tensor_parallel_size=1) + ["--sequence-parallel"] + MOE,
    "dp2-dense": with_args(TINY_GPT, global_batch_size=8),
    # TP=1 (x DP=2): the local MTP layer's torch norms refuse sequence parallelism
    "mtp-dp2": with_args(TINY_GPT, global_batch_size=8, mtp_num_layers=1, position_embedding_type="rope") + MOE,
    # the MoE schedule plan (combined 1F1B): bf16 only, whose optimizer needs CUDA tensors
    "ep2-dp2-overlap": with_args(TINY_GPT, global_batch_size=8, expert_model_parallel_size=2) + MOE + [
        "--bf16", "--overlap-moe-expert-parallel-comm"],
}
CUDA_ONLY = {"ep2-dp2-overlap"}
FLAG = ["--lm-z-loss-coeff", str(Z_COEFF)]
LOG_LSE = ["--lm-z-loss-log-lse"]


FUSED_OUTPUT_LAYER = FLAG + ["--lm-fused-output-layer"]


def megatron_mtp_bug():
    """Why Megatron's own MTP layer cannot be built here, or None. Megatron-LM main (since its commit
    8018459d) builds it through ``is_inference_column_parallel_linear``, an ``isinstance`` against
    Transformer Engine's classes, which are ``MagicMock``s where Transformer Engine is absent: the
    probe raises Megatron's own ``TypeError`` (detected by calling it, not by version)."""
    try:
        from megatron.core.tensor_parallel import inference_layers
    except ImportError:
        return None
    probe = getattr(inference_layers, "is_inference_column_parallel_linear", None)
    if probe is None:
        return None
    try:
        probe(object())
    except TypeError as error:
        return (f"Megatron's own MTP bug without Transformer Engine: multi_token_prediction.py calls "
                f"is_inference_column_parallel_linear, whose TE classes are MagicMocks here ({error})")
    return None


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    name = request.param
    if name in CUDA_ONLY and not torch.cuda.is_available():
        pytest.skip(f"{name}: Megatron runs it in bf16 only, which its optimizer supports on CUDA only")
    if name.startswith("mtp") and megatron_mtp_bug():
        pytest.skip(f"{name}: {megatron_mtp_bug()}")
    out = tmp_path_factory.mktemp(name)
    return (name, launch(out / "z_loss", LAYOUTS[name] + FLAG + LOG_LSE), launch(out / "no_flag", LAYOUTS[name]),
            launch(out / "fused_output_layer", LAYOUTS[name] + FUSED_OUTPUT_LAYER))


def test_fused_output_layer(runs):
    """``--lm-fused-output-layer`` against the unfused run: iteration 1's lm loss, lm_z_loss and
    grad norm (same weights), iteration 3's numbers from its own dumped logits, MTP losses."""
    name, z_run, _, fused_run = runs
    first, reference = fused_run["rows"][1], z_run["rows"][1]
    losses = [key for key in reference if "loss" in key]  # lm loss, lm_z_loss, MoE and MTP losses
    assert "lm_z_loss" in losses and {k for k in first if "loss" in k} == set(losses), (name, first, reference)
    for key in losses:
        assert first[key] == pytest.approx(reference[key], rel=1e-5), (name, key, first, reference)
    # printed with three decimals: one unit of the last digit
    assert first["grad norm"] == pytest.approx(reference["grad norm"], abs=1.01e-3), (name, first, reference)
    assert "grad norm" in first and "lm_z_loss" in first, first
    assert all(deferred_output_layer(fused_run["dump"])), f"{name}: the flag must keep the logits from being made"
    # the default path knew Megatron's upstream gradient in forward (checked against it in backward)
    assert all(grad_scale_known(fused_run["dump"])), f"{name}: the adaptor did not know the upstream gradient"
    micro_batches = recompute_from_dump(fused_run["dump"])
    row = fused_run["rows"][DUMP_ITERATION]
    assert row["lm_z_loss"] == pytest.approx(z_loss_mean(micro_batches), rel=1e-5), (name, row)
    assert row["lm loss"] == pytest.approx(ce_mean(micro_batches), rel=1e-5), (name, row)
    assert row["lm loss"] == pytest.approx(z_run["rows"][DUMP_ITERATION]["lm loss"], rel=1e-4), name


def test_layout(runs):
    name, z_run, plain_run, _ = runs
    for run in (z_run, plain_run):
        for it, row in run["rows"].items():
            assert all(math.isfinite(v) for v in row.values()), (name, it, row)
    assert all("lm_z_loss" in row for row in z_run["rows"].values()), (name, z_run["rows"])
    assert not any("lm_z_loss" in row for row in plain_run["rows"].values())
    assert z_run["rows"][1]["lm loss"] == pytest.approx(plain_run["rows"][1]["lm loss"], rel=1e-5), name

    assert not any(deferred_output_layer(z_run["dump"])), name
    micro_batches = recompute_from_dump(z_run["dump"])
    row = z_run["rows"][DUMP_ITERATION]
    expected_z = z_loss_mean(micro_batches)
    assert row["lm_z_loss"] == pytest.approx(expected_z, rel=1e-5), (name, row, expected_z)
    assert row["lm loss"] == pytest.approx(ce_mean(micro_batches), rel=1e-5), (name, row)
    assert_lse_metrics(row, micro_batches, name)
    counts = {float(mask.sum()) for _, _, mask in micro_batches}
    assert len(counts) > 1, f"{name}: the masks must keep different numbers of tokens, got {counts}"
    assert abs(per_micro_batch_z_mean(micro_batches) - expected_z) > 1e-5 * expected_z

    mtp = [k for k in plain_run["rows"][1] if k.startswith("mtp")]
    if name.startswith("mtp"):
        assert mtp, plain_run["rows"][1]
        for key in mtp:  # Megatron's MTP loss is CE with and without the flag
            assert z_run["rows"][1][key] == pytest.approx(plain_run["rows"][1][key], rel=1e-5), key


@pytest.mark.parametrize("fused_output_layer", [False, True], ids=["loss", "fused-output-layer"])
def test_checkpoint_save_and_resume(tmp_path, fused_output_layer):
    """Save at iteration 2, resume: iteration 3 as the uninterrupted run (with
    ``--lm-fused-output-layer`` the saving and resumed runs use it, the uninterrupted one not)."""
    args = with_args(TINY_GPT, global_batch_size=4, tensor_model_parallel_size=2) + ["--sequence-parallel"] + MOE + FLAG
    whole = launch(tmp_path / "whole", args)
    if fused_output_layer:
        args = args + ["--lm-fused-output-layer"]
    ckpt = tmp_path / "ckpt"
    launch(tmp_path / "first", with_args(args, train_iters=ITERS - 1, save=ckpt, save_interval=ITERS - 1),
           iters=ITERS - 1)
    # the scheduler's horizon comes from --train-iters, which the first run had shorter
    resumed = launch(tmp_path / "resumed",
                     args + ["--load", str(ckpt), "--use-checkpoint-args", "--override-opt_param-scheduler"])
    assert sorted(resumed["rows"]) == [ITERS], resumed["rows"]
    for key in ("lm loss", "lm_z_loss", "load_balancing_loss"):
        rel = 1e-4 if fused_output_layer else 1e-5  # two optimizer steps on gradients summed in another order
        assert resumed["rows"][ITERS][key] == pytest.approx(whole["rows"][ITERS][key], rel=rel), key
    micro_batches = recompute_from_dump(resumed["dump"])
    assert resumed["rows"][ITERS]["lm_z_loss"] == pytest.approx(z_loss_mean(micro_batches), rel=1e-5)
