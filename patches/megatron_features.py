"""Megatron's training features beside the flags: Megatron-FSDP's gradient buckets, and the adaptor's state at
an in-process restart.

What runs with the flags is in ``docs/megatron_features.md`` (the runs behind it: ``tests/gpu_megatron_features.py``
on four GPUs, ``tests/test_megatron_features_cpu.py`` on the CPU); none of those features is refused.

* :func:`megatron_fsdp_param`: under ``--use-megatron-fsdp`` the fused output layer leaves ``main_grad`` alone.
* :func:`reset_iteration_state`: an in-process restart (``--inprocess-restart``, nvidia-resiliency-ext)
  abandons the step a fault interrupted and calls Megatron's ``destroy_global_state`` before it trains again;
  the adaptor then drops that step's partial metric sums (``lm_z_loss``, ``lm_lse``, ``lm_lse_max``) and the
  forwards of ``--lm-fused-output-layer`` (forward) whose backward never came, which would otherwise be
  counted into the first step after the restart and be reported as a dropped gradient
  (:func:`destroy_global_state_wrapper`).
"""

from mindspeed_cez.linear_forward_grads import forget_forward_gradients
from mindspeed_cez.patches import metrics
from mindspeed_cez.patches.pass_through import while_active


def megatron_fsdp_param(weight):
    """Whether Megatron-FSDP manages ``weight`` (its ``__fsdp_param__``, which Transformer Engine reads too). Its
    ``main_grad`` is a view of a gradient bucket that Megatron-FSDP fetches in backward, overwrites and
    reduce-scatters: one seen in forward is the last iteration's, released. The fused output layer hands such a
    weight's gradient back through autograd (into the bucket by Megatron-FSDP's own hook), as Megatron's
    unfused layer without gradient-accumulation fusion does."""
    return bool(getattr(weight, "__fsdp_param__", False))


def reset_iteration_state():
    """Forget the interrupted step: this iteration's metric sums and the fused layer's forwards that owe a
    backward. Local; no collective, no device sync."""
    metrics.reduce_iteration([])  # clears the sums, reports nothing
    forget_forward_gradients()


def destroy_global_state_wrapper(fn):
    """``megatron.training.training.destroy_global_state`` (called by Megatron's in-process restart between a
    fault and the next attempt): :func:`reset_iteration_state` first."""

    def destroy_global_state(settings, *args, **kwargs):
        reset_iteration_state()
        return fn(*args, **kwargs)

    return while_active(fn, destroy_global_state)
