"""Where Megatron logs an iteration: the wrappers that add ``lm_z_loss`` / ``lm_lse`` / ``lm_lse_max`` to it.

* ``megatron.training.training.training_log`` (and MindSpeed-LLM's): the metrics join the
  iteration's ``loss_dict``, logged like ``lm loss`` (MoE and dense models): the log line shows
  the mean over the logging interval, except ``lm_lse_max``: the largest of the interval;
  TensorBoard and W&B get each iteration's value at the iterations they write;
* Megatron's MoE report (:mod:`mindspeed_cez.patches.moe_tracker`, for megatron-core-only loops): the
  metrics are written next to its MoE losses.

The values come from :mod:`mindspeed_cez.patches.metrics`; both wrappers pass through while the adaptor is
inactive (``settings.ACTIVE is None``).
"""

import functools
import inspect

import torch

from mindspeed_cez.patches import metrics
from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.pass_through import while_active


def moe_metrics_report_wrapper(fn):
    """Megatron's MoE report (``mindspeed_cez.patches.moe_tracker``): our metrics are written next to its own."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def report_(*args, **kwargs):
        if _settings.ACTIVE is None:
            return fn(*args, **kwargs)
        with metrics.report_iteration() as values:  # None: Megatron's training_log (or report()) reports them
            result = fn(*args, **kwargs)
            if values is not None:
                a = signature.bind(*args, **kwargs).arguments
                metrics.write(values, a.get("iteration"), a.get("writer"), a.get("wandb_writer"),
                              a.get("total_loss_dict"))
        return result

    report_.__cez_wraps__ = fn
    return report_


# Megatron's training_log counts the iterations of the logging interval under this key of total_loss_dict
# (every version since 2020, MindSpeed-LLM's copy included) and prints each entry's sum divided by it.
ADVANCED_ITERS = "advanced iterations"


def interval_maximum(total_loss_dict, value, skipped):
    """Make Megatron print the interval's largest ``lm_lse_max`` instead of its mean.

    Megatron adds ``value`` to ``total_loss_dict[LM_LSE_MAX]`` (unless the iteration is skipped) and
    prints the sum divided by the interval's advanced iterations ``n``. Before it does, the entry is set
    to ``M * n - value``, ``M`` the largest value of the interval so far (its printed sum / count), so
    the sum it prints is ``M * n`` (fp32 rounding aside). Megatron's reset after the log line (sum and
    count to 0) starts the next interval."""
    if skipped:  # Megatron leaves the sums alone
        return
    n_before = total_loss_dict.get(ADVANCED_ITERS, 0)
    held = total_loss_dict.get(metrics.LM_LSE_MAX)
    largest = value.detach().float().reshape(1)
    if held is not None and n_before > 0:
        largest = torch.maximum(largest, held.detach().float().reshape(1).to(largest.device) / n_before)
    total_loss_dict[metrics.LM_LSE_MAX] = largest * (n_before + 1) - value.detach().float().reshape(1)


def training_log_wrapper(fn):
    """``megatron.training.training.training_log``: our metrics join ``loss_dict`` (MoE and dense); the
    log line shows the largest ``lm_lse_max`` of the logging interval (TensorBoard and W&B get the
    iteration's own, at every iteration they write)."""
    signature = inspect.signature(fn)
    # the interval maximum needs Megatron's running sums and the skipped flag (feature-detected)
    can_hold_max = {"total_loss_dict", "skipped_iter"} <= set(signature.parameters)

    def training_log(settings, *args, **kwargs):
        with metrics.report_iteration() as values:
            if values is None:  # an outer wrapper added our values (the same function wrapped under two
                return fn(*args, **kwargs)  # names: MindSpeed-LLM 2.2.0 re-exports Megatron's training_log)
            bound = signature.bind(*args, **kwargs)
            loss_dict = bound.arguments["loss_dict"]
            if values and loss_dict:  # the last pipeline stage holds the iteration's losses
                bound.arguments["loss_dict"] = {**loss_dict, **values}
                total = bound.arguments.get("total_loss_dict")
                if can_hold_max and metrics.LM_LSE_MAX in values and total is not None:
                    skipped = bool(bound.arguments.get("skipped_iter"))
                    if not skipped:  # the zeros Megatron would start from, so the log line keeps loss_dict's order
                        for key, value in bound.arguments["loss_dict"].items():
                            if key not in total and isinstance(value, torch.Tensor):
                                total[key] = torch.zeros(1, dtype=torch.float, device=value.device)
                    interval_maximum(total, values[metrics.LM_LSE_MAX], skipped)
            return fn(*bound.args, **bound.kwargs)

    return while_active(fn, training_log)
