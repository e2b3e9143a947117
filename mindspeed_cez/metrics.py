"""Logging of the LM z-loss through Megatron's MoE auxiliary-loss tracker.

Metrics
-------
``lm_z_loss``
    Per micro-batch: the loss-mask-weighted mean of the per-token ``c * lse**2`` of the main
    model's LM loss, i.e. over exactly the tokens ``lm loss`` counts::

        sum(z_loss * loss_mask) / sum(loss_mask)

    Reported per iteration as the mean over the iteration's micro-batches (``loss_scale = 1 /
    num_microbatches``, as Megatron does for its MoE losses) and over the data-parallel (x
    context-parallel) ranks, from the last pipeline stage (other stages contribute zeros to
    Megatron's pipeline all-reduce). Megatron's ``lm loss`` instead weights every token of the
    iteration equally; the two agree whenever all micro-batches hold the same number of
    unmasked tokens (the usual case in pretraining).
    The mask is the ``loss_mask`` argument of ``GPTModel.forward`` (``pretrain_gpt.py`` passes
    it); a model called without one, or another LanguageModule (BERT, T5, Mamba) whose forward
    takes no mask, gets the plain mean over all tokens of the micro-batch. MTP losses are not
    included (Megatron logs those as ``mtp_*``).
``lm_lse`` (opt-in: ``--lm-z-loss-log-lse`` / ``apply(log_lse=True)``)
    The same mean of the per-token log-sum-exp of the logits (the quantity the z-loss pushes to
    0), taken from the fused op (no extra pass over the logits).

How it reaches the log line
---------------------------
Values are recorded in Megatron's tracker (``get_moe_metrics_tracker().record`` on
megatron-core >= 0.16's ``moe_logging``, ``moe_utils.save_to_aux_losses_tracker`` before) in
layer slot 1, with ``avg_group`` = the data-parallel group with context parallel. The patched
``MoEMetricsTracker.report`` / ``track_moe_metrics`` adds the names to ``track_names``, makes
sure the entry exists with the size Megatron expects on every rank (pipeline stages without the
output layer included, so the pipeline all-reduce matches), and pre-multiplies by the number of
MoE layers that Megatron divides by. Megatron then reduces, writes TensorBoard / W&B scalars and
puts ``lm_z_loss`` into ``total_loss_dict``, so it appears in the training log line next to
``load_balancing_loss``. For dense models (``args.num_experts is None``, where
``megatron.training`` does not call the tracker at all), the patched ``training_log`` calls it
for these names only.

For megatron-core-only training loops: call the model with ``loss_mask=`` (or call
:func:`record_lm_z_loss` yourself with ``auto`` recording off) and call :func:`report` once per
iteration; it returns every tracked scalar (``load_balancing_loss`` too) as floats.
"""

import functools
import inspect
import sys

import torch

from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.settings import LM_LSE, LM_Z_LOSS

__all__ = ["LM_Z_LOSS", "LM_LSE", "record_lm_z_loss", "report", "masked_mean"]


def _new_tracker_api():
    """megatron-core >= 0.16 with ``moe_logging.get_moe_metrics_tracker`` (0.19.2), else None."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        return None
    return moe_logging


def _avg_group():
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_data_parallel_group(with_context_parallel=True)
    return None


def masked_mean(values, loss_mask=None):
    """``sum(values * mask) / max(sum(mask), 1)`` in fp32 (plain mean without a mask)."""
    values = values.detach().float()
    if loss_mask is None:
        return values.mean()
    mask = loss_mask.detach().to(values.dtype).reshape(values.shape)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _tracker_record(name, value, num_layers):
    moe_logging = _new_tracker_api()
    if moe_logging is not None:
        moe_logging.get_moe_metrics_tracker().record(
            name=name, value=value, layer_number=1, num_layers=num_layers,
            reduce_group=None, avg_group=_avg_group(), needs_dp_avg=False,
        )
    else:
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        save_to_aux_losses_tracker(name, value, 1, num_layers, reduce_group=None, avg_group=_avg_group())


def record_lm_z_loss(z_loss_per_token, loss_mask=None, *, lse_per_token=None, num_layers=1, settings=None):
    """Record one micro-batch's ``lm_z_loss`` (and ``lm_lse``) in Megatron's tracker.

    Args:
        z_loss_per_token: ``c * lse**2`` per token (the op's second output, in the loss_mask's
            layout, e.g. ``[b, s]``), or None to record only ``lm_lse``.
        loss_mask: the mask ``lm loss`` uses (1 = counted); None counts every token.
        lse_per_token: per-token log-sum-exp, recorded as ``lm_lse`` when that metric is on.
        num_layers: size of the tracker entry (any size works; :func:`report` resizes it).
        settings: the active settings (default: the current ones); only names they enable
            are recorded, so every rank reports the same names.
    """
    settings = settings or _settings.ACTIVE
    names = settings.metric_names() if settings is not None else [LM_Z_LOSS]
    if z_loss_per_token is not None and LM_Z_LOSS in names:
        _tracker_record(LM_Z_LOSS, masked_mean(z_loss_per_token, loss_mask), num_layers)
    if lse_per_token is not None and LM_LSE in names:
        _tracker_record(LM_LSE, masked_mean(lse_per_token, loss_mask), num_layers)


# ----------------------------------------------------------------------------------------------
# report side
# ----------------------------------------------------------------------------------------------


def count_moe_layers(num_layers, moe_layer_freq=None, mtp_num_layers=None):
    """The divisor Megatron's tracker applies (same formula in 0.16.1 and 0.19.2)."""
    if num_layers is None and moe_layer_freq is None:
        return None
    if moe_layer_freq is None:
        n = num_layers
    elif isinstance(moe_layer_freq, int):
        n = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    else:
        n = sum(moe_layer_freq)
    return n + (mtp_num_layers or 0)


def _default_device(existing):
    for tensor in existing:
        return tensor.device
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prepare_entries(names, size, divisor):
    """Ensure every name has a tracker entry of ``size`` on this rank, scaled by ``divisor``."""
    moe_logging = _new_tracker_api()
    if moe_logging is not None:
        metrics = moe_logging.get_moe_metrics_tracker().metrics
        get_values = lambda n: metrics[n].values if n in metrics else None  # noqa: E731

        def set_values(n, v):
            if n in metrics:
                metrics[n].values = v
            else:
                metrics[n] = moe_logging.MetricEntry(values=v, avg_group=_avg_group(), needs_dp_avg=False)

        existing = [e.values for e in metrics.values()]
    else:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        get_values = lambda n: tracker[n]["values"] if n in tracker else None  # noqa: E731

        def set_values(n, v):
            entry = tracker.setdefault(n, {"reduce_group": None, "avg_group": _avg_group(), "reduce_group_has_dp": False})
            entry["values"] = v

        existing = [e["values"] for e in tracker.values()]
    device = _default_device(existing)
    for name in names:
        values = get_values(name)
        if values is None:
            set_values(name, torch.zeros(size or 1, device=device))
            continue
        if size and values.numel() != size:
            resized = torch.zeros(size, device=values.device, dtype=values.dtype)
            resized[0] = values.sum()
            values = resized
        if divisor:
            values = values * divisor
        set_values(name, values)


def _extend_track_names(track_names, names):
    if track_names is None:
        return None
    if isinstance(track_names, str):
        track_names = [track_names]
    return list(track_names) + [n for n in names if n not in track_names]


def moe_metrics_report_wrapper(fn):
    """Wraps ``MoEMetricsTracker.report`` (0.19.2) or ``moe_utils.track_moe_metrics`` (0.16.1)."""
    signature = inspect.signature(fn)
    new_api = "self" in signature.parameters

    @functools.wraps(fn)
    def report_(*args, **kwargs):
        settings = _settings.ACTIVE
        names = settings.metric_names() if settings is not None else []
        if not names:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        num_layers, mtp = a.get("num_layers"), a.get("mtp_num_layers")
        size = None if num_layers is None else num_layers + ((mtp or 0) if new_api else 0)
        _prepare_entries(names, size, count_moe_layers(num_layers, a.get("moe_layer_freq"), mtp))
        a["track_names"] = _extend_track_names(a.get("track_names"), names)
        return fn(*bound.args, **bound.kwargs)

    report_.__cez_wraps__ = fn
    return report_


def _megatron_report(**kwargs):
    """Megatron's own tracker report (whichever API this megatron-core has)."""
    moe_logging = _new_tracker_api()
    if moe_logging is not None:
        return moe_logging.get_moe_metrics_tracker().report(**kwargs)
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.track_moe_metrics(**kwargs)


class _CapturingWriter:
    """A TensorBoard-writer stand-in that keeps the scalars (and forwards them to ``inner``)."""

    def __init__(self, inner=None):
        self.inner = inner
        self.scalars = {}

    def add_scalar(self, name, value, step=None, *args, **kwargs):
        self.scalars[name] = float(value)
        if self.inner is not None:
            self.inner.add_scalar(name, value, step, *args, **kwargs)

    def __getattr__(self, name):
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


def report(iteration, num_microbatches, num_layers, *, track_names=("load_balancing_loss",),
           moe_layer_freq=None, mtp_num_layers=None, total_loss_dict=None, writer=None,
           wandb_writer=None):
    """Reduce and clear Megatron's tracker for one iteration; returns ``{name: float}``.

    This calls Megatron's own reporting (``MoEMetricsTracker.report`` / ``track_moe_metrics``)
    exactly as ``megatron.training.training_log`` does, with ``loss_scale = 1/num_microbatches``;
    when the patches are applied, ``lm_z_loss`` / ``lm_lse`` are added to ``track_names``. Call it
    on every rank (it all-reduces). ``track_names`` lists Megatron's own MoE names to report
    (e.g. ``load_balancing_loss``); use ``()`` for a dense model.
    """
    capture = _CapturingWriter(writer)
    _megatron_report(
        loss_scale=1.0 / num_microbatches,
        iteration=iteration,
        writer=capture,
        wandb_writer=wandb_writer,
        total_loss_dict=total_loss_dict,
        per_layer_logging=False,
        force_initialize=False,
        track_names=list(track_names),
        num_layers=num_layers,
        moe_layer_freq=moe_layer_freq,
        mtp_num_layers=mtp_num_layers,
    )
    return capture.scalars


def training_log_wrapper(fn):
    """``megatron.training.training.training_log``: dense models get ``lm_z_loss`` too.

    ``training_log`` reports the tracker only when ``args.num_experts`` is set; for a dense
    model this reports our names (and nothing else) the same way, into ``total_loss_dict`` (so
    ``lm_z_loss`` is in the log line) and TensorBoard / W&B.
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def training_log(*args, **kwargs):
        settings = _settings.ACTIVE
        names = settings.metric_names() if settings is not None else []
        if names:
            from megatron.training import get_args
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

            try:
                from megatron.core.num_microbatches_calculator import get_num_microbatches
            except ImportError:  # older layouts
                from megatron.training import get_num_microbatches
            margs = get_args()
            if getattr(margs, "num_experts", None) is None:
                bound = signature.bind(*args, **kwargs)
                _megatron_report(
                    loss_scale=1.0 / get_num_microbatches(),
                    iteration=bound.arguments["iteration"],
                    writer=get_tensorboard_writer(),
                    wandb_writer=get_wandb_writer(),
                    total_loss_dict=bound.arguments["total_loss_dict"],
                    per_layer_logging=False,
                    force_initialize=False,
                    track_names=[],
                    num_layers=margs.num_layers,
                    moe_layer_freq=None,
                    mtp_num_layers=getattr(margs, "mtp_num_layers", None),
                )
        return fn(*args, **kwargs)

    training_log.__cez_wraps__ = fn
    return training_log
