"""MindSpeed-LLM's own training path: where the adaptor hooks in there, and what it refuses.

Read at Ascend/MindSpeed-LLM 4a035628 (v26.0.0) and c77308a1 (master, 2026-08-21), both on
Megatron core 0.12.1. MindSpeed-LLM replaces the Megatron code the other patches target:

* its ``GPTModel`` (``mindspeed_llm.core.models.gpt.gpt_model``; its ``model`` feature registers it
  over Megatron's) has a forward of its own that never calls Megatron's: it scales and soft-caps
  the logits (``--output-multiplier-scale``, ``--output-logit-softcapping``) and calls
  ``self.compute_language_model_loss(labels, logits)``, still Megatron's method, which the
  adaptor patches. With either flag the scaling and soft cap are recorded and computed in the
  loss kernels (:mod:`.logit_transform`, ``Settings.logit_transform``), not by its torch ops.
  The loss mask reaches only that forward, so it is a loss-context target here
  (master's ``DeepSeek4Model`` likewise). dualpipev runs the same forward.
* ``pretrain_gpt.py`` trains with ``mindspeed_llm.training.training.train``, whose own
  ``training_log`` (same leading parameters as Megatron's) logs the iteration: wrapped like
  Megatron's, so ``lm_z_loss`` joins its ``loss_dict``.
* ``--loss-compute-mode chunk`` at TP=1 and CP=1 computes the loss with ``F.cross_entropy`` per
  chunk of hidden states, never through ``compute_language_model_loss``; and
  ``--is-instruction-dataset`` shifts the labels inside the forward, into a tensor the adaptor
  cannot tell from an MTP head's. Both are refused with the fused kernel on (:func:`check_args`,
  run by the flags' validation and by ``mindspeed_cez.patches.apply``) rather than silently
  trained without z-loss.
* ``--lm-fused-output-layer``: the main head's output layer call is deferred in its forward as in
  Megatron's (with the logit transform above, if any); ``--add-output-layer-bias``, which changes
  the output layer itself, is refused with it. (``--output-layer-slice-num`` needs no check:
  MindSpeed-LLM's own validation resets it to 1 before any feature's check runs.)

Nothing here imports MindSpeed-LLM: only its modules already imported are looked at.
"""

import importlib.util
import sys

from mindspeed_cez.kernels.logit_transform import LogitTransform
from mindspeed_cez.patches import megatron_core as mc
from mindspeed_cez.patches import training_log

PACKAGE = "mindspeed_llm"
TRAINING = "mindspeed_llm.training.training"

LOSS_CONTEXT_METHODS = (
    ("mindspeed_llm.core.models.gpt.gpt_model", "GPTModel", ("forward",)),
    ("mindspeed_llm.core.models.deepseek4.deepseek4_model", "DeepSeek4Model", ("forward",)),
)


def loaded():
    return PACKAGE in sys.modules


def patch_targets():
    """``[(dotted path, wrapper)]`` for MindSpeed-LLM's loop and models; empty until it is imported."""
    if not loaded():
        return []
    targets = [(path, mc.loss_context_wrapper) for path in mc.loss_context_paths(LOSS_CONTEXT_METHODS, loaded_only=True)]
    if importlib.util.find_spec(TRAINING) is not None:  # MindSpeed's manager fails on a missing module
        targets.append((f"{TRAINING}.training_log", training_log.training_log_wrapper))
    return targets


def logit_transform(args):
    """The ``LogitTransform`` MindSpeed-LLM's forward applies to the logits before the loss (its
    ``--output-multiplier-scale`` / ``--output-logit-softcapping``), or None for neither."""
    scale = getattr(args, "output_multiplier_scale", None)
    cap = getattr(args, "output_logit_softcapping", None)
    if not (scale or cap):
        return None
    return LogitTransform(scale=scale or 1.0, cap=cap or 0.0)


def check_args(args, fused_flag, output_layer_flag=None):
    """Raise ``ValueError`` for MindSpeed-LLM modes the fused kernel cannot serve. ``fused_flag`` names
    what turned the kernel on; ``output_layer_flag`` what turned the fused output layer on (None:
    off). Arguments without MindSpeed-LLM's flags pass."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    if getattr(args, "loss_compute_mode", "default") == "chunk" and tp == 1 and cp == 1:
        raise ValueError(
            f"{fused_flag} and MindSpeed-LLM's --loss-compute-mode chunk: at TP=1 and CP=1 the chunked loss "
            "is plain F.cross_entropy and never reaches the fused kernel (no z-loss would be trained); "
            "drop one of them (chunk mode at TP>1 falls back to the regular loss, which is served)"
        )
    if output_layer_flag:
        # its GPTModel forward swaps the output layer for one the fused op does not stand in for
        # (its scaling and soft cap of the logits are served: .logit_transform)
        if getattr(args, "add_output_layer_bias", False):
            raise ValueError(
                f"{output_layer_flag} and MindSpeed-LLM's --add-output-layer-bias: the fused op computes the "
                "logits of hidden @ weight.T itself, so the bias would be lost; drop one of them")
    if getattr(args, "is_instruction_dataset", False):
        raise ValueError(
            f"{fused_flag} and MindSpeed-LLM's --is-instruction-dataset: that path shifts the labels inside "
            "the model's forward, which this adaptor does not serve; drop one of them"
        )
