"""Megatron-LM main's (0.20 dev) new knobs beside the adaptor: ``--output-logit-dtype`` (the output
layer's ``output_dtype``) and Megatron-FSDP v2 with ``--lm-fused-output-layer`` (refused at startup in
one line naming both flags, and the output layer refused at its call where a model sets ``output_dtype``
itself), ``HybridModel.forward(compute_mtp_loss=False)`` (no MTP head calls the output layer first: the
main head's call is the first one).

The flag checks run on every Megatron (``args`` as Megatron's parser leaves them); the checks against
Megatron's own code are feature-detected and skipped, with the reason, where the Megatron on the path
(megatron-core 0.19.2, or main's snapshot on ``PYTHONPATH``) has no such knob.
"""

import argparse
import inspect

import pytest
import torch

from mindspeed_cez.kernels import LogitTransform
from mindspeed_cez.patches import arguments, model_context
from mindspeed_cez.patches import runtime
from mindspeed_cez.patches import settings as _settings

FLAG = "--lm-fused-output-layer"


def _args(*argv, **megatron):
    args = arguments.add_lm_z_loss_args(argparse.ArgumentParser()).parse_args(list(argv))
    for dest, value in megatron.items():  # Megatron's own flags, on its parser
        setattr(args, dest, value)
    return args


@pytest.mark.parametrize("params", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("logit_dtype", ["bf16", "fp32", torch.bfloat16, torch.float32])
def test_output_logit_dtype_other_than_the_parameters_is_refused_with_the_fused_layer(params, logit_dtype):
    """Megatron keeps ``--output-logit-dtype`` as ``args.logit_dtype``: its choice's name, a torch.dtype
    once its validate_args mapped it. The fused layer makes no logits: served where the dtype is the
    parameters' (what the logits would have anyway), else refused naming both flags."""
    megatron = {"logit_dtype": logit_dtype, "bf16": params == "bf16", "fp16": params == "fp16"}
    name = logit_dtype if isinstance(logit_dtype, str) else {torch.bfloat16: "bf16", torch.float32: "fp32"}[logit_dtype]
    if name == params:
        assert arguments.validate(_args(FLAG, **megatron)).fused_output_layer
    else:
        with pytest.raises(arguments.FlagValueError) as refused:
            arguments.validate(_args(FLAG, **megatron))
        message = str(refused.value)
        assert f"--output-logit-dtype {name}" in message and FLAG in message and "\n" not in message
    # the op alone takes the logits in whatever dtype the output layer makes them: nothing to refuse
    assert arguments.validate(_args("--lm-z-loss-coeff", "1e-4", **megatron)) is not None
    assert arguments.validate(_args(FLAG, bf16=params == "bf16", logit_dtype=None)).fused_output_layer


def test_megatron_fsdp_v2_is_refused_with_the_fused_layer():
    v2 = {"use_megatron_fsdp": True, "megatron_fsdp_version": 2}
    with pytest.raises(arguments.FlagValueError,
                       match="--lm-fused-output-layer does not serve --megatron-fsdp-version 2.*"
                             "--megatron-fsdp-version 1 or drop --lm-fused-output-layer"):
        arguments.validate(_args(FLAG, **v2))
    assert arguments.validate(_args(FLAG, use_megatron_fsdp=True, megatron_fsdp_version=1)).fused_output_layer
    assert arguments.validate(_args("--lm-z-loss-coeff", "1e-4", **v2)) is not None  # the op alone: served


def test_megatron_parses_the_knobs_the_checks_read():
    """Where Megatron has the knobs, its parser stores them where the checks read them."""
    margs = pytest.importorskip("megatron.training.arguments", reason="needs megatron.training")
    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)) \
        if hasattr(margs, "add_megatron_arguments") else None
    if parser is None or "--output-logit-dtype" not in parser._option_string_actions:
        pytest.skip("this Megatron has no --output-logit-dtype (Megatron-LM main, 0.20 dev, has)")
    args = parser.parse_args(["--output-logit-dtype", "fp32", "--megatron-fsdp-version", "2"])
    assert args.logit_dtype == "fp32" and args.megatron_fsdp_version == 2


# ------------------------------------------------------------------------ the output layer's calls

class _Layer:
    """A column-parallel output layer as the adaptor's wrapper sees it: one rank, no bias, no gather."""

    def __init__(self, weight, output_dtype=None):
        self.weight, self.output_dtype = weight, output_dtype
        self.gather_output, self.bias, self.sequence_parallel = False, None, False
        self.config = argparse.Namespace(defer_embedding_wgrad_compute=False)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return input_ @ (self.weight if weight is None else weight).t(), None


_Layer.forward = model_context.column_parallel_forward_wrapper(_Layer.forward)


class _HybridLike:
    """HybridModel.forward's order of output layer calls (Megatron main): each MTP head's first where
    ``mtp_process`` and ``compute_mtp_loss``, then the main head's; what each call returned."""

    def __init__(self, layer, mtp_num_layers):
        self.output_layer, self.post_process, self.mtp_process = layer, True, bool(mtp_num_layers)
        self.config = argparse.Namespace(mtp_num_layers=mtp_num_layers or None, use_mup=False)

    def forward(self, hidden, labels=None, *, loss_mask=None, compute_mtp_loss=True):
        calls = []
        if self.mtp_process and compute_mtp_loss:
            calls += [self.output_layer.forward(hidden)[0] for _ in range(self.config.mtp_num_layers)]
        calls.append(self.output_layer.forward(hidden)[0])
        return calls


_HybridLike.forward = model_context.loss_context_wrapper(_HybridLike.forward)


@pytest.fixture
def active():
    def activate(**fields):
        runtime.set_active(_settings.Settings(**fields))
    yield activate
    runtime.set_active(None)


def test_real_hybrid_model_forward_has_the_mtp_switch_the_adaptor_reads():
    hybrid = pytest.importorskip("megatron.core.models.hybrid.hybrid_model",
                                 reason="this megatron-core has no HybridModel (Megatron-LM main has)")
    params = inspect.signature(hybrid.HybridModel.forward).parameters
    if "compute_mtp_loss" not in params:
        pytest.skip("this megatron-core's HybridModel.forward has no compute_mtp_loss (Megatron-LM main has)")
    assert params["compute_mtp_loss"].default is True and model_context.has_loss_context_args(hybrid.HybridModel.forward)
    source = inspect.getsource(hybrid.HybridModel.forward)
    # the MTP heads (which call the output layer) run only under both switches mtp_heads_before reads
    assert "self.mtp_process" in source and "compute_mtp_loss" in source


@pytest.mark.parametrize("fields", [{"fused_output_layer": True},
                                    {"logit_transform": LogitTransform(0.5, 30.0)},
                                    {"fused_output_layer": True, "logit_transform": LogitTransform(1.0, 15.0)}],
                         ids=["fused", "softcap", "fused+softcap"])
@pytest.mark.parametrize("compute_mtp_loss", [True, False, None], ids=["mtp", "no-mtp", "default"])
def test_the_main_head_is_the_last_call_with_or_without_mtp_heads(active, fields, compute_mtp_loss):
    gen = torch.Generator().manual_seed(63)
    hidden, weight = torch.randn(4, 8, generator=gen), torch.randn(11, 8, generator=gen)
    model = _HybridLike(_Layer(weight), mtp_num_layers=2)
    labels = torch.randint(0, 11, (4,), generator=gen)
    active(**fields)
    kwargs = {} if compute_mtp_loss is None else {"compute_mtp_loss": compute_mtp_loss}
    calls = model.forward(hidden, labels, loss_mask=torch.ones(4), **kwargs)
    assert len(calls) == (1 if compute_mtp_loss is False else 3)
    for mtp_logits in calls[:-1]:  # MTP heads: real logits, as Megatron's layer makes them
        assert type(mtp_logits) is torch.Tensor and torch.equal(mtp_logits, hidden @ weight.t())
    main = calls[-1]
    if "logit_transform" in fields:
        assert isinstance(main, model_context.TransformedLogits)
        main = main.logits
    if fields.get("fused_output_layer"):
        assert isinstance(main, model_context.DeferredLogits) and main.hidden is hidden and main.weight is weight
    else:
        assert torch.equal(main, hidden @ weight.t())
    # no MTP process on this stage: the main head's call is the first whatever compute_mtp_loss says
    model.mtp_process = False
    again = model.forward(hidden, labels, loss_mask=torch.ones(4), **kwargs)
    assert len(again) == 1 and type(again[0]) is type(calls[-1])


def test_a_forward_without_the_switch_counts_mtp_heads_from_the_config():
    """GPTModel's ``process_mtp_loss`` calls the output layer per MTP head whenever
    ``config.mtp_num_layers`` is set (``mtp_process`` is whether this stage runs the MTP block): only a
    forward with ``compute_mtp_loss`` (HybridModel's) reads the two switches."""
    model = argparse.Namespace(config=argparse.Namespace(mtp_num_layers=2), mtp_process=False)
    assert model_context.mtp_heads_before(model, {"compute_mtp_loss": False}) == 2
    assert model_context.mtp_heads_before(model, {}, mtp_switch=True) == 0
    model.mtp_process = True
    assert model_context.mtp_heads_before(model, {}, mtp_switch=True) == 2
    assert model_context.mtp_heads_before(model, {"compute_mtp_loss": False}, mtp_switch=True) == 0


def test_an_output_dtype_other_than_the_hidden_states_is_refused_at_the_call(active):
    """A model built with ``output_dtype`` (Megatron main's ColumnParallelLinear) outside the flags'
    startup check: the fused layer's call refuses it naming both flags; the hidden states' own dtype
    (what the logits have anyway) is served."""
    hidden, weight = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(11, 8, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (4,))
    active(fused_output_layer=True)
    with pytest.raises(model_context.FusedOutputLayerError, match="--output-logit-dtype.*--lm-fused-output-layer"):
        _HybridLike(_Layer(weight, output_dtype=torch.float32), 0).forward(hidden, labels, loss_mask=torch.ones(4))
    calls = _HybridLike(_Layer(weight, output_dtype=torch.bfloat16), 0).forward(hidden, labels, loss_mask=torch.ones(4))
    assert isinstance(calls[-1], model_context.DeferredLogits)
