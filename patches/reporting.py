"""Reporting: the ``lm_z_loss`` (and ``lm_lse``, ``lm_lse_max``) metrics, recorded per micro-batch and
reported per iteration where Megatron logs it (its ``training_log``, its MoE report, or :func:`report`).

Metrics
-------
``lm_z_loss``
    ``sum(c * lse**2 * loss_mask) / sum(loss_mask)`` over every micro-batch of the iteration and
    every data-parallel x context-parallel rank: the weighting of Megatron's ``lm loss`` (each
    unmasked token of the iteration counts once). Reported from the last pipeline stage; the
    mask is the ``loss_mask`` given to the ``GPTModel`` (a model called without one counts
    every token). MTP losses are not part of it (Megatron logs those as ``mtp_*``).
``lm_lse`` (opt-in: ``--lm-z-loss-log-lse`` / ``apply(log_lse=True)``)
    The same mean of the per-token log-sum-exp, taken from the fused op (no extra pass).
``lm_mu_norm`` (with ``--lm-mu-centering`` or ``--lm-mu-loss-coeff``)
    The norm of the mean output embedding ``mu`` (:mod:`.mean_embedding`) each micro-batch's forward saw,
    weighted like ``lm loss``: what mu-centering holds at 0 and the mu-loss pulls towards 0.
``lm_lse_max`` (with ``lm_lse``)
    The largest log-sum-exp of the iteration's counted tokens (``loss_mask`` > 0), over every
    micro-batch, data-parallel x context-parallel rank and pipeline stage: the token whose logits
    drift furthest, which the mean hides. ``-inf`` when the iteration counts no token. Megatron's
    log line shows the largest of its logging interval (``training_log`` would print the interval's
    mean: :func:`training_log_wrapper` keeps the maximum instead);
    TensorBoard and W&B get each iteration's own value at the iterations they write.

Recording adds three sums and a running maximum to small device tensors (no host sync). Reporting
all-reduces them (SUM, and MAX for the maximum) over the data-parallel group with context
parallelism and over the pipeline group, once per iteration, then hands the values to Megatron's
logging:

* ``megatron.training`` (any version, MoE or dense; MindSpeed-LLM's own loop too): the patched
  ``training_log`` (:func:`training_log_wrapper`) adds them to the iteration's ``loss_dict`` on the
  last pipeline stage, so Megatron treats them exactly like ``lm loss``: accumulated over the log
  interval (skipped iterations left out), printed in the log line, written to TensorBoard and W&B.
* megatron-core-only loops: the patched MoE report (:func:`moe_metrics_report_wrapper`) writes them
  next to Megatron's MoE losses (``total_loss_dict``, TensorBoard, W&B), or the loop calls
  :func:`report`, which returns them with every tracked MoE metric.

Megatron's MoE report has two API generations, told apart here alone (:func:`uses_moe_tracker`):
0.18 on, ``moe_logging.get_moe_metrics_tracker().report(...)`` (a method of ``MoEMetricsTracker``);
0.12 to 0.17, the function ``moe_utils.track_moe_metrics(...)`` (0.12 takes no ``mtp_num_layers``,
0.16 adds ``pg_collection``). Both take ``iteration``, ``writer``, ``wandb_writer`` and
``total_loss_dict`` by keyword, which is all the adaptor reads from a call.

Which metrics are reported is the adaptor's choice (``Settings.metrics``): it hands the
names to :func:`report_names` whenever its settings change. An in-process restart drops the
interrupted step's state (:func:`destroy_global_state_wrapper`).
"""

import contextlib
import functools
import importlib
import inspect
import math

import torch
import torch.distributed as dist

from mindspeed_cez.patches import megatron_state
from mindspeed_cez.patches import runtime
from mindspeed_cez.patches.import_hook import module_exists
from mindspeed_cez.patches.runtime import while_active
from mindspeed_cez.patches.settings import LM_LSE, LM_LSE_MAX, LM_MU_NORM, LM_Z_LOSS

MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"

__all__ = ["LM_Z_LOSS", "LM_LSE", "LM_LSE_MAX", "LM_MU_NORM", "record_lm_z_loss", "reduce_iteration", "report"]
# The token-weighted means, in the order of the sums buffer (the token count last).
SUMMED = (LM_Z_LOSS, LM_LSE, LM_MU_NORM)


class IterationMetrics:
    """This iteration's buffers, the names reported by default, and the one report of the iteration.

    The buffers are this iteration's ``[sum(z * mask), sum(lse * mask), sum(mu_norm * mask), sum(mask)]`` and
    ``[max(lse where mask > 0)]``, on the device, updated and cleared in place, so a CUDA graph that
    captured the loss keeps writing into them on replay. Megatron reaches the report by two paths,
    one inside the other (its ``training_log`` calls its MoE report; MindSpeed-LLM wraps Megatron's
    ``training_log`` under a second name): :meth:`report_iteration` hands the values to the outermost.
    """

    def __init__(self):
        self.sums = None
        self.max = None
        self.names = []  # what reduce() reports by default (the adaptor's settings)
        self.reporting = False  # inside report_iteration(): the values are taken

    def record(self, z_loss_per_token=None, loss_mask=None, lse_per_token=None, mu_norm=None):
        given = [t for t in (z_loss_per_token, lse_per_token) if t is not None]
        if not given and mu_norm is None:
            return
        n = given[0].numel() if given else (loss_mask.numel() if loss_mask is not None else 1)
        device = given[0].device if given else mu_norm.device
        if loss_mask is None:
            mask = torch.ones(n, device=device)
        else:
            mask = loss_mask.detach().to(device=device, dtype=torch.float32).reshape(-1)
            if mask.numel() != n:
                raise ValueError(f"loss_mask has {mask.numel()} elements for {n} tokens")

        def masked_sum(t):
            return mask.new_zeros(()) if t is None else (t.detach().float().reshape(-1) * mask).sum()

        counted = mask.sum()
        mu_sum = counted.new_zeros(()) if mu_norm is None else mu_norm.detach().float().to(device) * counted
        sums = torch.stack([masked_sum(z_loss_per_token), masked_sum(lse_per_token), mu_sum, counted])
        if self.sums is None:
            self.sums = torch.zeros(len(SUMMED) + 1, device=sums.device)
        self.sums.add_(sums)
        if lse_per_token is not None and n > 0:
            lse = lse_per_token.detach().float().reshape(-1)
            largest = torch.where(mask > 0, lse, torch.full_like(lse, -math.inf)).amax().reshape(1)
            if self.max is None:
                self.max = torch.full((1,), -math.inf, device=sums.device)
            torch.maximum(self.max, largest, out=self.max)

    def recorded_tokens(self):
        """The tokens counted since the last reduction (a host sync: for tests)."""
        return 0.0 if self.sums is None else float(self.sums[-1])

    def take(self):
        """``(sums, maxima)`` copies of the buffers (None where never written), which are cleared."""
        sums = maxima = None
        if self.sums is not None:
            sums = self.sums.clone()
            self.sums.zero_()
        if self.max is not None:
            maxima = self.max.clone()
            self.max.fill_(-math.inf)
        return sums, maxima

    def reduce(self, names=None):
        """The values of :func:`reduce_iteration`; clears the buffers."""
        if names is None:
            names = list(self.names)
        sums, maxima = self.take()
        if not names:
            return {}
        groups = megatron_state.reduction_groups()
        if groups is not None:
            dp_cp = groups[0]
            if sums is None:
                sums = torch.zeros(len(SUMMED) + 1, device=_collective_device(dp_cp))
            for group in groups:
                dist.all_reduce(sums, group=group)
            if LM_LSE_MAX in names:  # the same names on every rank: the same collectives
                if maxima is None:
                    maxima = torch.full((1,), -math.inf, device=sums.device)
                for group in groups:
                    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        if sums is None:
            return {}
        means = sums[:-1] / sums[-1].clamp(min=1.0)
        values = dict(zip(SUMMED, means))
        if maxima is not None:
            values[LM_LSE_MAX] = maxima[0]
        return {name: values[name] for name in names if name in values}

    @contextlib.contextmanager
    def report_iteration(self):
        """Inside: this iteration's values (:func:`reduce_iteration`, taken on entry) for the outermost
        caller, who reports them; None for a caller inside it."""
        if self.reporting:
            yield None
            return
        values = self.reduce()
        self.reporting = True
        try:
            yield values
        finally:
            self.reporting = False


def _metrics():
    """The runtime's metric buffers (:class:`.runtime.Runtime`)."""
    return runtime.current().metrics


def report_names(names):
    """Report ``names`` (of ``LM_Z_LOSS``, ``LM_LSE``, ``LM_LSE_MAX``) by default from now on; ``[]``: none."""
    _metrics().names = list(names)


def record_lm_z_loss(z_loss_per_token=None, loss_mask=None, *, lse_per_token=None, mu_norm=None):
    """Add one micro-batch of the main LM loss to this iteration's sums.

    Args:
        z_loss_per_token: ``c * lse**2`` per token (the op's second output), or None.
        loss_mask: the mask ``lm loss`` uses (1 = counted), any layout with the tokens' count;
            None counts every token.
        lse_per_token: per-token log-sum-exp (the op's third output), or None; gives the sum
            and the maximum over the counted tokens.
        mu_norm: the norm of the mean output embedding in this micro-batch's forward (a 0-dim tensor), or None.
    """
    _metrics().record(z_loss_per_token, loss_mask, lse_per_token, mu_norm)


def recorded_tokens():
    """The tokens recorded since the last :func:`reduce_iteration` (a host sync: for tests)."""
    return _metrics().recorded_tokens()


def report_iteration():
    """``with report_iteration() as values``: this iteration's values for the outermost report (Megatron's
    ``training_log``, its MoE report, :func:`report`), None inside it: each iteration is reported once."""
    return _metrics().report_iteration()


def _collective_device(group):
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def reduce_iteration(names=None):
    """This iteration's values ``{name: 0-dim fp32 tensor}``: token-weighted means, the maximum for
    ``lm_lse_max``; clears the buffers.

    Collective: with Megatron's parallel state initialized, every rank must call it once per
    iteration (the sums are all-reduced over data x context parallel, then over the pipeline, the
    maximum likewise with MAX, so every rank returns the last stage's values). ``names`` defaults to
    :func:`report_names`'.
    """
    return _metrics().reduce(names)


def write(values, iteration, writer=None, wandb_writer=None, total_loss_dict=None):
    """Log ``values`` as Megatron logs its MoE losses: running sums, TensorBoard, W&B."""
    for name, value in values.items():
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict[name] + value if name in total_loss_dict else value
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer:
            wandb_writer.log({name: value}, iteration)


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
    """Report one iteration for a megatron-core-only loop; returns ``{name: float}``.

    Calls Megatron's own MoE report for ``track_names`` (``()`` for a dense model) as
    ``megatron.training`` does (``loss_scale = 1/num_microbatches``), then adds ``lm_z_loss`` /
    ``lm_lse`` / ``lm_lse_max`` when the adaptor is active. Collective: call it on every rank once per iteration.
    """
    capture = _CapturingWriter(writer)
    with report_iteration() as values:
        call_moe_report(
            loss_scale=1.0 / num_microbatches, iteration=iteration, writer=capture,
            wandb_writer=wandb_writer, total_loss_dict=total_loss_dict, per_layer_logging=False,
            force_initialize=False, track_names=list(track_names), num_layers=num_layers,
            moe_layer_freq=moe_layer_freq, mtp_num_layers=mtp_num_layers,
        )
    write(values or {}, iteration, capture, wandb_writer, total_loss_dict)
    return capture.scalars


# ---------------------------------------------------------------------------------------------
# Megatron's MoE report, whichever API generation megatron-core has
# ---------------------------------------------------------------------------------------------


def uses_moe_tracker(_module=None):
    """Whether this megatron-core reports MoE metrics through ``MoEMetricsTracker.report`` (0.18 on:
    ``moe_logging`` came with the tracker) rather than ``moe_utils.track_moe_metrics``; imports nothing.
    The one detector of the generation (the patch points' ``when`` and :func:`call_moe_report`)."""
    return module_exists(MOE_LOGGING)


def uses_moe_function(_module=None):
    return not uses_moe_tracker()


def call_moe_report(**kwargs):
    """Call Megatron's MoE report with the keywords this generation accepts (others are dropped)."""
    if uses_moe_tracker():
        fn = importlib.import_module(MOE_LOGGING).get_moe_metrics_tracker().report
    else:
        fn = importlib.import_module(MOE_UTILS).track_moe_metrics
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


# ---------------------------------------------------------------------------------------------
# Where Megatron logs an iteration: its training_log (MindSpeed-LLM's too) and its MoE report
# ---------------------------------------------------------------------------------------------


def moe_metrics_report_wrapper(fn):
    """Megatron's MoE report (either generation): our metrics are written next to its own."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def report_(*args, **kwargs):
        if runtime.get_active() is None:
            return fn(*args, **kwargs)
        with report_iteration() as values:  # None: Megatron's training_log (or report()) reports them
            result = fn(*args, **kwargs)
            if values is not None:
                a = signature.bind(*args, **kwargs).arguments
                write(values, a.get("iteration"), a.get("writer"), a.get("wandb_writer"),
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
    held = total_loss_dict.get(LM_LSE_MAX)
    largest = value.detach().float().reshape(1)
    if held is not None and n_before > 0:
        largest = torch.maximum(largest, held.detach().float().reshape(1).to(largest.device) / n_before)
    total_loss_dict[LM_LSE_MAX] = largest * (n_before + 1) - value.detach().float().reshape(1)


def training_log_wrapper(fn):
    """``megatron.training.training.training_log``: our metrics join ``loss_dict`` (MoE and dense); the
    log line shows the largest ``lm_lse_max`` of the logging interval (TensorBoard and W&B get the
    iteration's own, at every iteration they write)."""
    signature = inspect.signature(fn)
    # the interval maximum needs Megatron's running sums and the skipped flag (feature-detected)
    can_hold_max = {"total_loss_dict", "skipped_iter"} <= set(signature.parameters)

    def training_log(_runtime, *args, **kwargs):
        with report_iteration() as values:
            if values is None:  # an outer wrapper added our values (the same function wrapped under two
                return fn(*args, **kwargs)  # names: MindSpeed-LLM 2.2.0 re-exports Megatron's training_log)
            bound = signature.bind(*args, **kwargs)
            loss_dict = bound.arguments["loss_dict"]
            if values and loss_dict:  # the last pipeline stage holds the iteration's losses
                bound.arguments["loss_dict"] = {**loss_dict, **values}
                total = bound.arguments.get("total_loss_dict")
                if can_hold_max and LM_LSE_MAX in values and total is not None:
                    skipped = bool(bound.arguments.get("skipped_iter"))
                    if not skipped:  # the zeros Megatron would start from, so the log line keeps loss_dict's order
                        for key, value in bound.arguments["loss_dict"].items():
                            if key not in total and isinstance(value, torch.Tensor):
                                total[key] = torch.zeros(1, dtype=torch.float, device=value.device)
                    interval_maximum(total, values[LM_LSE_MAX], skipped)
            return fn(*bound.args, **bound.kwargs)

    return while_active(fn, training_log)


# ---------------------------------------------------------------------------------------------
# An in-process restart (--inprocess-restart, nvidia-resiliency-ext) abandons the step a fault
# interrupted and calls Megatron's destroy_global_state before it trains again: that step's partial
# metric sums and the forwards of --lm-fused-output-layer (forward) whose backward never came would
# otherwise be counted into the first step after the restart and be reported as a dropped gradient.
# ---------------------------------------------------------------------------------------------


def reset_iteration_state():
    """Forget the interrupted step: this iteration's metric sums and the fused layer's forwards that owe a
    backward. Local; no collective, no device sync."""
    reduce_iteration([])  # clears the sums, reports nothing
    runtime.current().ledger.forget()


def destroy_global_state_wrapper(fn):
    """``megatron.training.training.destroy_global_state`` (called by Megatron's in-process restart between a
    fault and the next attempt): :func:`reset_iteration_state` first."""

    def destroy_global_state(_runtime, *args, **kwargs):
        reset_iteration_state()
        return fn(*args, **kwargs)

    return while_active(fn, destroy_global_state)
