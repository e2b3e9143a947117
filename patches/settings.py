"""The adaptor's run-time settings, shared by the patched Megatron functions.

The patched functions read :data:`ACTIVE` on every call: ``None`` means "behave exactly like
Megatron" (the original function runs), a :class:`Settings` means "use the fused op with these
settings". :func:`mindspeed_cez.patches.apply` and the argument hooks set it; ``remove`` clears it.
:data:`RECORD` (an :class:`AdaptorRecord`) keeps how they got there: what ``apply()`` and the flags
chose, the MindSpeed feature, the adaptor import's mode.

:func:`backends_from_environment` is the one place that reads the launch script's overrides of the
kernels (``MINDSPEED_CEZ_BACKEND``, ``MINDSPEED_CEZ_LINEAR_BACKEND``), for the flags' settings.
"""

import os
from dataclasses import InitVar, dataclass, field
from typing import Mapping, Optional

from mindspeed_cez import cann, kernels
from mindspeed_cez.kernels.logit_transform import IDENTITY, LogitTransform
from mindspeed_cez.kernels.loss_spec import LossSpec
from mindspeed_cez.linear_cross_entropy import GradientPath
from mindspeed_cez.patches import metrics
from mindspeed_cez.patches.metrics import LM_LSE, LM_LSE_MAX, LM_Z_LOSS

BACKENDS = (*kernels.BACKENDS, cann.NAME)  # "cann": torch_npu's op, where the vocab is not sharded
BACKEND_ENV = "MINDSPEED_CEZ_BACKEND"
LINEAR_BACKEND_ENV = "MINDSPEED_CEZ_LINEAR_BACKEND"


@dataclass(frozen=True)
class Settings:
    """What the patched loss computes.

    z_loss_coeff: ``c >= 0``; training follows the gradient of ``CE + c * lse**2`` per token, while
        the loss value Megatron logs stays the CE.
    label_smoothing: in *Megatron's* convention (``tensor_parallel.vocab_parallel_cross_entropy``);
        ``None`` takes ``config.label_smoothing`` when the model config has such a field, else 0.
    log_z_loss: record ``lm_z_loss`` in Megatron's MoE metrics tracker (only when ``c > 0``).
    log_lse: also record the mean log-sum-exp as ``lm_lse`` and its maximum over the iteration's
        tokens as ``lm_lse_max`` (the op's own lse: no extra pass).
    fused_output_layer: GPT's output layer and LM loss as one op, without the logits tensor
        (``--lm-fused-output-layer``, :mod:`mindspeed_cez.patches.output_layer`).
    grads: the fused output layer's path, the op's ``grads``: ``"forward"`` (default: gradients made
        in the forward with the loss mask as token weights and Megatron's upstream gradient, where
        both are known; else as ``"recompute"``) or ``"recompute"`` (logits recomputed in backward).
    block_fraction: ``"forward"``'s memory/time dial, the op's ``block_fraction``: the share of the
        tokens (and of the logits' memory) one block takes; None: the op's default (one block up to 4 GiB of logits, else 0.5), 0.125 the
        lean setting (``--lm-fused-output-layer-block-fraction``).
    logit_transform: the :class:`~mindspeed_cez.kernels.logit_transform.LogitTransform` the model
        applies to the main head's logits with torch ops before the loss (MindSpeed-LLM's
        ``--output-multiplier-scale`` / ``--output-logit-softcapping``), or None (no transform).
        Those ops are recorded, checked against it and computed in the kernels instead
        (:mod:`.logit_transform`).
    backend: the ops' cross-entropy backend, ``"triton"`` / ``"torch"``, None: automatic per device;
        ``"cann"``: torch_npu's fused op (TP = 1, no fused output layer, no logit transform).
    linear_backend: the fused output layer's, ``"gemm"`` / ``"triton"``, None: automatic.
    names: the caller's name per field for errors (the flags' names, :func:`.arguments.settings_from_args`);
        by default the fields' own. Each field is checked here, once.

    Made from the fields, once, and handed to the ops as they are:
    loss: the :class:`~mindspeed_cez.kernels.loss_spec.LossSpec` of the main head (its z-loss, the
        logit transform, ``label_smoothing`` in Megatron's convention, 0 for None); the patched loss
        derives each call's with :meth:`LossSpec.replace` (:func:`.megatron_core.call_loss`).
    gradient_path: the :class:`~mindspeed_cez.linear_cross_entropy.GradientPath` of ``grads`` and
        ``block_fraction``, the fused output layer's ``path``.
    """

    z_loss_coeff: float = 0.0
    label_smoothing: Optional[float] = None
    log_z_loss: bool = True
    log_lse: bool = False
    fused_output_layer: bool = False
    grads: str = "forward"
    block_fraction: Optional[float] = None
    logit_transform: Optional[LogitTransform] = None
    backend: Optional[str] = None
    linear_backend: Optional[str] = None
    names: InitVar[Optional[Mapping[str, str]]] = None
    loss: LossSpec = field(init=False, repr=False, compare=False)
    gradient_path: GradientPath = field(init=False, repr=False, compare=False)

    def __post_init__(self, names):
        name = (lambda field: names.get(field, field)) if names else (lambda field: field)
        if self.logit_transform is not None and not isinstance(self.logit_transform, LogitTransform):
            raise TypeError(f"{name('logit_transform')} must be None or a LogitTransform, got {self.logit_transform!r}")
        loss = LossSpec(z_loss_coeff=self.z_loss_coeff,
                        label_smoothing=0.0 if self.label_smoothing is None else self.label_smoothing,
                        logit_transform=self.logit_transform or IDENTITY, names=names)
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "z_loss_coeff", loss.z_loss_coeff)
        if self.label_smoothing is not None:
            object.__setattr__(self, "label_smoothing", loss.label_smoothing)
        path = GradientPath(self.grads, self.block_fraction, names=names)
        object.__setattr__(self, "gradient_path", path)
        object.__setattr__(self, "block_fraction", path.block_fraction)
        if self.backend not in (None, *BACKENDS):
            raise ValueError(f"backend must be None or one of {BACKENDS}, got {self.backend!r}")
        if self.backend == cann.NAME and self.fused_output_layer:
            raise ValueError("backend='cann' (MINDSPEED_CEZ_BACKEND=cann) needs logits, and the fused output layer "
                             "(--lm-fused-output-layer) makes none: drop one of the two")
        if self.backend == cann.NAME and self.logit_transform:
            raise ValueError("backend='cann' (MINDSPEED_CEZ_BACKEND=cann) computes the loss of the logits as given; "
                             "--output-multiplier-scale / --output-logit-softcapping need MINDSPEED_CEZ_BACKEND=triton "
                             "or unset")
        if self.linear_backend not in (None, *kernels.LINEAR_BACKENDS):
            raise ValueError(f"linear_backend must be None or one of {tuple(kernels.LINEAR_BACKENDS)}, "
                             f"got {self.linear_backend!r}")

    def metric_names(self):
        """The tracker names this run reports; identical on every rank (collectives depend on it)."""
        names = []
        if self.log_z_loss and self.z_loss_coeff > 0:
            names.append(LM_Z_LOSS)
        if self.log_lse:
            names += [LM_LSE, LM_LSE_MAX]
        return names


def backends_from_environment(environ=os.environ):
    """``{"backend": ..., "linear_backend": ...}`` from a launch script's environment (unset or empty:
    None, automatic); a bad name, or ``cann`` where torch_npu's op does not import, is a ``ValueError``
    naming the variable."""
    chosen = {}
    for field, variable, names in (("backend", BACKEND_ENV, BACKENDS),
                                   ("linear_backend", LINEAR_BACKEND_ENV, tuple(kernels.LINEAR_BACKENDS))):
        value = environ.get(variable) or None
        if value not in (None, *names):
            raise ValueError(f"{variable}={value!r}: choose one of {names} (or leave it unset: automatic)")
        chosen[field] = value
    if chosen["backend"] == cann.NAME and not cann.available():
        raise ValueError(f"{BACKEND_ENV}=cann needs torch_npu with npu_cross_entropy_loss (Ascend NPUs, CANN), which "
                         "does not import here: unset it (automatic) or choose triton or torch")
    return chosen


class AdaptorRecord:
    """How this process reaches its active settings: what ``apply()`` and the ``--lm-*`` flags chose
    (:func:`mindspeed_cez.patches.activate` reconciles them), the MindSpeed feature once it joined
    MindSpeed's list and the route its validation hands the flags to (:mod:`.mindspeed_feature`), and
    where the adaptor's import reads the flags (:mod:`mindspeed_cez.megatron_adaptor`)."""

    def __init__(self):
        self.apply_chose, self.from_apply = False, None  # an apply() (activate()) call chose these Settings
        self.flags_chose, self.from_flags = False, None  # the parsed flags chose explicitly (None: kernel off)
        self.warned_unchecked = False  # apply() warned that MindSpeed-LLM's modes could not be checked
        self.feature = None  # our MindSpeed feature, once registered with MindSpeed
        self.on_flags = None  # callable(args): what the feature's validate_args hands the parsed flags to
        self.adaptor_mode = None  # "megatron.training" / "megatron.core": the adaptor import's registration

    def chose_by_apply(self, settings):
        self.apply_chose, self.from_apply = True, settings

    def chose_by_flags(self, settings):
        self.flags_chose, self.from_flags = True, settings

    def forget_choices(self):
        """``remove()``: neither ``apply()`` nor the flags chose (the registrations stay)."""
        self.apply_chose, self.from_apply = False, None
        self.flags_chose, self.from_flags = False, None


# Global: Megatron's validate_args and MindSpeed's features manager reach the activation route without a handle.
RECORD = AdaptorRecord()

# Global: Megatron calls the patched functions without a handle to the adaptor, so they read it here.
ACTIVE: Optional[Settings] = None


def set_active(settings: Optional[Settings]):
    """Activate ``settings`` (None: Megatron's own loss again); the metrics report its names."""
    global ACTIVE
    ACTIVE = settings
    metrics.report_names(settings.metric_names() if settings is not None else [])


def get_active() -> Optional[Settings]:
    return ACTIVE
