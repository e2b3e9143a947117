"""Megatron's per-iteration MoE metrics report, whichever API generation megatron-core has.

* 0.18 and later: ``moe_logging.get_moe_metrics_tracker().report(...)``, a method of
  ``MoEMetricsTracker``;
* 0.12 to 0.17: the function ``moe_utils.track_moe_metrics(...)`` (0.12 takes no
  ``mtp_num_layers``, 0.16 adds ``pg_collection``).

Both are called with keywords and take ``iteration``, ``writer``, ``wandb_writer`` and
``total_loss_dict``, which is all the adaptor reads from a call. The generation is detected by
attribute and signature, never by version string; this module is the one place that knows it.
"""

import importlib
import inspect

MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _has_tracker_class():
    moe_logging = _module(MOE_LOGGING)
    return moe_logging is not None and hasattr(moe_logging, "get_moe_metrics_tracker")


def report_path():
    """Dotted path of Megatron's report (the patch target), or None without MoE support."""
    if _has_tracker_class():
        return f"{MOE_LOGGING}.MoEMetricsTracker.report"
    moe_utils = _module(MOE_UTILS)
    if moe_utils is not None and hasattr(moe_utils, "track_moe_metrics"):
        return f"{MOE_UTILS}.track_moe_metrics"
    return None


def report_function():
    """Megatron's report as a function of keyword arguments (bound to the global tracker)."""
    if _has_tracker_class():
        return _module(MOE_LOGGING).get_moe_metrics_tracker().report
    return _module(MOE_UTILS).track_moe_metrics


def call_report(**kwargs):
    """Call Megatron's report with the keywords this generation accepts (others are dropped)."""
    fn = report_function()
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})
