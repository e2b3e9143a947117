"""The adaptor's run-time settings: one :class:`Settings` per process.

:class:`Settings` is built once, from the parsed ``--lm-*`` flags (:func:`.arguments.validate`) or by
``apply()``, and handed on as it is (:func:`.activation.enable` makes it the runtime's,
:mod:`.runtime`).

:func:`backends_from_environment` (:func:`mindspeed_cez.environment.read_backends`, the one reader of
``MINDSPEED_CEZ_BACKEND`` / ``MINDSPEED_CEZ_LINEAR_BACKEND`` on every route) gives the flags' backends.
"""

import math
import numbers

from mindspeed_cez import environment, kernels
from mindspeed_cez.environment import BACKEND_ENV, LINEAR_BACKEND_ENV  # noqa: F401 (public names)
from mindspeed_cez.kernels import cann
from mindspeed_cez.kernels.chunked_linear import LOGITS_BUDGET_BYTES
from mindspeed_cez.kernels import IDENTITY, LogitTransform, LossSpec
from mindspeed_cez.linear_cross_entropy import GradientPath

# The metrics the settings choose (reported by .reporting).
LM_Z_LOSS = "lm_z_loss"
LM_LSE = "lm_lse"
LM_LSE_MAX = "lm_lse_max"
LM_MU_NORM = "lm_mu_norm"

BACKENDS = kernels.BACKENDS  # "cann": torch_npu's op, where the vocab is not sharded
# the one reader of the MINDSPEED_CEZ_* variables, for the flags' settings (and apply(), the self-check)
backends_from_environment = environment.read_backends


class Settings:
    """What the patched loss computes: built once per process (from the parsed ``--lm-*`` flags, or by
    ``apply()``), checked field by field as it is built, then handed on as it is.

    Arguments:
    z_loss_coeff: ``c >= 0``; training follows the gradient of ``CE + c * lse**2`` per token, while
        the loss value Megatron logs stays the CE.
    label_smoothing: in *Megatron's* convention (``tensor_parallel.vocab_parallel_cross_entropy``);
        ``None`` takes ``config.label_smoothing`` when the model config has such a field, else 0.
    log_z_loss: record ``lm_z_loss`` in Megatron's MoE metrics tracker (only when ``c > 0``).
    log_lse: also record the mean log-sum-exp as ``lm_lse`` and its maximum over the iteration's
        tokens as ``lm_lse_max`` (the op's own lse: no extra pass).
    fused_output_layer: GPT's output layer and LM loss as one op, without the logits tensor
        (``--lm-fused-output-layer``, :mod:`mindspeed_cez.patches.model_context`).
    grads: the fused output layer's path, the op's ``grads``: ``"forward"`` (default: gradients made
        in the forward with the loss mask as token weights and Megatron's upstream gradient, where
        both are known; else as ``"recompute"``) or ``"recompute"`` (logits recomputed in backward).
    block_bytes: ``"forward"``'s memory/time dial, the op's ``block_bytes``: the most memory one block
        of logits takes (``--lm-fused-output-layer-block-gib``); None with no ``block_fraction``: the
        op's default, 4 GiB.
    block_fraction: the same dial as the op's ``block_fraction``, the share of the tokens (and of the
        logits' memory) one block takes, 0.125 the lean setting (``--lm-fused-output-layer-block-fraction``).
    logit_transform: the :class:`~mindspeed_cez.kernels.LogitTransform` the model
        applies to the main head's logits with torch ops before the loss (MindSpeed-LLM's
        ``--output-multiplier-scale`` / ``--output-logit-softcapping``), or None (no transform).
        Those ops are recorded, checked against it and computed in the kernels instead.
    backend: the ops' cross-entropy backend, ``"triton"`` / ``"torch"``, None: automatic per device;
        ``"cann"``: torch_npu's fused op (TP = 1, no fused output layer, no logit transform).
    linear_backend: the fused output layer's, ``"gemm"`` / ``"triton"``, None: automatic.
    logit_softcap: ``C > 0``: the main head's loss is of ``C * tanh(x / C)`` (after the model's own
        scale), computed in the kernels (``--lm-logit-softcap``); 0: off. A model that caps its logits
        itself (MindSpeed-LLM's ``--output-logit-softcapping``) must cap at the same ``C``.
    mu_centering: subtract the mean output embedding (the mean row of the output weight over the
        whole vocabulary) from the output weight after every optimizer step (``--lm-mu-centering``,
        :mod:`.mu_centering`).
    mu_loss_coeff: ``lambda >= 0``: train on ``lambda * ||mu||**2`` of the mean output embedding ``mu``
        besides the LM loss, once per step (``--lm-mu-loss-coeff``); 0: off.
    names: the caller's name per field for errors (the flags' names, :func:`.arguments.validate`);
        by default the fields' own.

    What it holds (read-only):
    loss: the :class:`~mindspeed_cez.kernels.LossSpec` of the main head: the coefficient,
        label smoothing (0 for None) and logit transform; the patched loss derives each call's with
        :meth:`LossSpec.replace`.
    gradient_path: the :class:`~mindspeed_cez.linear_cross_entropy.GradientPath` of ``grads`` and
        ``block_bytes`` / ``block_fraction`` (which read it), the fused output layer's ``path``.
    label_smoothing_from_config, log_z_loss, log_lse, fused_output_layer, backend, linear_backend.
    Derived once from those, read by the patched loss on every call (plain attributes: no code runs):
    ``z_loss_coeff``, ``label_smoothing`` (Megatron's convention; None: the model config's),
    ``logit_transform`` (the model's, None for none), ``mean_embedding_metrics`` (``lm_mu_norm`` reported:
    mu-centering or mu-loss on) and ``metrics`` (the tracker names this run reports, identical on every rank:
    collectives depend on it).
    """

    FIELDS = ("loss", "gradient_path", "label_smoothing_from_config", "log_z_loss", "log_lse", "fused_output_layer",
              "backend", "linear_backend", "logit_softcap", "mu_centering", "mu_loss_coeff")
    __slots__ = FIELDS + ("z_loss_coeff", "label_smoothing", "logit_transform", "mean_embedding_metrics", "metrics")

    def __init__(self, z_loss_coeff=0.0, label_smoothing=None, log_z_loss=True, log_lse=False,
                 fused_output_layer=False, grads="forward", block_fraction=None, logit_transform=None,
                 backend=None, linear_backend=None, names=None, block_bytes=None, logit_softcap=0.0,
                 mu_centering=False, mu_loss_coeff=0.0):
        name = (lambda field: names.get(field, field)) if names else (lambda field: field)
        if logit_transform is not None and not isinstance(logit_transform, LogitTransform):
            raise TypeError(f"{name('logit_transform')} must be None or a LogitTransform, got {logit_transform!r}")
        if not (_finite(logit_softcap) and logit_softcap >= 0):
            raise ValueError(f"{name('logit_softcap')} must be a finite number >= 0 (0: no cap), got {logit_softcap!r}")
        if not (_finite(mu_loss_coeff) and mu_loss_coeff >= 0):
            raise ValueError(f"{name('mu_loss_coeff')} must be a finite number >= 0 (0: off), got {mu_loss_coeff!r}")
        if not isinstance(mu_centering, bool):
            raise TypeError(f"{name('mu_centering')} must be True or False, got {mu_centering!r}")
        model_cap = logit_transform.cap if logit_transform is not None else 0.0
        if logit_softcap and model_cap and model_cap != logit_softcap:
            raise ValueError(f"{name('logit_softcap')}={logit_softcap:g} and the model's own soft cap "
                             f"{model_cap:g} ({name('logit_transform')}) differ: the logits would be capped twice; "
                             "set one of them, or both to the same value")
        if backend == cann.NAME and logit_softcap:
            raise ValueError(f"backend='cann' (MINDSPEED_CEZ_BACKEND=cann) computes the loss of the logits as given; "
                             f"{name('logit_softcap')} needs MINDSPEED_CEZ_BACKEND=triton or unset")
        loss = LossSpec(z_loss_coeff=z_loss_coeff, label_smoothing=0.0 if label_smoothing is None else label_smoothing,
                        logit_transform=logit_transform or IDENTITY, names=names)
        if backend not in (None, *BACKENDS):
            raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
        if backend == cann.NAME and fused_output_layer:
            raise ValueError("backend='cann' (MINDSPEED_CEZ_BACKEND=cann) needs logits, and the fused output layer "
                             "(--lm-fused-output-layer) makes none: drop one of the two")
        if backend == cann.NAME and not loss.logit_transform.is_identity:
            raise ValueError("backend='cann' (MINDSPEED_CEZ_BACKEND=cann) computes the loss of the logits as given; "
                             "--output-multiplier-scale / --output-logit-softcapping need MINDSPEED_CEZ_BACKEND=triton "
                             "or unset")
        if linear_backend not in (None, *kernels.LINEAR_BACKENDS):
            raise ValueError(f"linear_backend must be None or one of {tuple(kernels.LINEAR_BACKENDS)}, "
                             f"got {linear_backend!r}")
        values = {"loss": loss, "gradient_path": GradientPath(grads, block_fraction, block_bytes, names=names),
                  "label_smoothing_from_config": label_smoothing is None, "log_z_loss": bool(log_z_loss),
                  "log_lse": bool(log_lse), "fused_output_layer": bool(fused_output_layer), "backend": backend,
                  "linear_backend": linear_backend, "logit_softcap": float(logit_softcap),
                  "mu_centering": mu_centering, "mu_loss_coeff": float(mu_loss_coeff)}
        values.update(z_loss_coeff=loss.z_loss_coeff, label_smoothing=None if label_smoothing is None else loss.label_smoothing,
                      logit_transform=None if loss.logit_transform.is_identity else loss.logit_transform,
                      mean_embedding_metrics=mu_centering or mu_loss_coeff > 0)
        values["metrics"] = _metrics(values)
        for slot, value in values.items():
            object.__setattr__(self, slot, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"Settings are frozen: make new ones (settings.replace({name}=...))")

    @property
    def grads(self):
        return self.gradient_path.grads

    @property
    def block_fraction(self):
        return self.gradient_path.block_fraction

    @property
    def block_bytes(self):
        return self.gradient_path.block_bytes

    def _arguments(self):
        return {"z_loss_coeff": self.z_loss_coeff, "label_smoothing": self.label_smoothing,
                "log_z_loss": self.log_z_loss, "log_lse": self.log_lse, "fused_output_layer": self.fused_output_layer,
                "grads": self.grads, "block_fraction": self.block_fraction, "block_bytes": self.block_bytes,
                "logit_transform": self.logit_transform,
                "backend": self.backend, "linear_backend": self.linear_backend, "logit_softcap": self.logit_softcap,
                "mu_centering": self.mu_centering, "mu_loss_coeff": self.mu_loss_coeff}

    def replace(self, **changes):
        """New settings: these with the arguments in ``changes``."""
        return Settings(**{**self._arguments(), **changes})

    def _key(self):
        return tuple(getattr(self, field) for field in self.FIELDS)

    def __eq__(self, other):
        return isinstance(other, Settings) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self._arguments().items()) + ")"

    def describe(self, backend):
        """One line of what these settings turn on, ``backend`` naming the cross-entropy backend."""
        parts = [f"LM z-loss coefficient {self.z_loss_coeff:g}", f"backend {backend}"]
        if self.fused_output_layer:
            path = self.gradient_path
            if path.grads != "forward":
                blocks = ""
            elif path.block_fraction is not None:
                blocks = f", blocks of {path.block_fraction:g} of the tokens"
            else:
                blocks = f", blocks of at most {(path.block_bytes or LOGITS_BUDGET_BYTES) / (1 << 30):g} GiB of logits"
            parts.append(f"fused output layer ({path.grads}{blocks}; linear backend {self.linear_backend or 'auto'})")
        if self.logit_transform is not None:
            parts.append(f"the model's logit transform {self.logit_transform}")
        if self.logit_softcap:
            parts.append(f"logit soft cap {self.logit_softcap:g}")
        if self.mu_centering:
            parts.append("mu-centering")
        if self.mu_loss_coeff:
            parts.append(f"mu-loss coefficient {self.mu_loss_coeff:g}")
        return ", ".join(parts) + (f"; logs {' '.join(self.metrics)}" if self.metrics else "")


def _metrics(values):
    """The tracker names settings of these ``values`` report, as a tuple."""
    names = []
    if values["log_z_loss"] and values["z_loss_coeff"] > 0:
        names.append(LM_Z_LOSS)
    if values["log_lse"] or values["logit_softcap"]:  # the soft cap bounds the lse: shown by lm_lse / lm_lse_max
        names += [LM_LSE, LM_LSE_MAX]
    if values["mean_embedding_metrics"]:
        names.append(LM_MU_NORM)
    return tuple(names)


def _finite(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
