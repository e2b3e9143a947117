"""Where Megatron logs an iteration: the wrappers that add ``lm_z_loss`` / ``lm_lse`` / ``lm_lse_max`` to it.

* ``megatron.training.training.training_log`` (and MindSpeed-LLM's): the metrics join the
  iteration's ``loss_dict``, logged like ``lm loss`` (MoE and dense models);
* Megatron's MoE report (:mod:`mindspeed_cez.patches.moe_tracker`, for megatron-core-only loops): the
  metrics are written next to its MoE losses.

The values come from :mod:`mindspeed_cez.patches.metrics`; both wrappers pass through while the adaptor is
inactive (``settings.ACTIVE is None``).
"""

import functools
import inspect

from mindspeed_cez.patches import metrics
from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.pass_through import while_active


def moe_metrics_report_wrapper(fn):
    """Megatron's MoE report (``mindspeed_cez.patches.moe_tracker``): our metrics are written next to its own."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def report_(*args, **kwargs):
        result = fn(*args, **kwargs)
        if not metrics.reporting() and _settings.ACTIVE is not None:
            a = signature.bind(*args, **kwargs).arguments
            metrics.write(metrics.reduce_iteration(), a.get("iteration"), a.get("writer"), a.get("wandb_writer"),
                          a.get("total_loss_dict"))
        return result

    report_.__cez_wraps__ = fn
    return report_


def training_log_wrapper(fn):
    """``megatron.training.training.training_log``: our metrics join ``loss_dict`` (MoE and dense)."""
    signature = inspect.signature(fn)

    def training_log(settings, *args, **kwargs):
        # reporting(): an outer wrapper already added our values (the same function wrapped under two
        # names: MindSpeed-LLM 2.2.0 re-exports Megatron's training_log)
        if metrics.reporting():
            return fn(*args, **kwargs)
        values = metrics.reduce_iteration()
        bound = signature.bind(*args, **kwargs)
        loss_dict = bound.arguments["loss_dict"]
        if values and loss_dict:  # the last pipeline stage holds the iteration's losses
            bound.arguments["loss_dict"] = {**loss_dict, **values}
        with metrics.reported_here():
            return fn(*bound.args, **bound.kwargs)

    return while_active(fn, training_log)
