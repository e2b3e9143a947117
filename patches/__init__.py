"""Patch Megatron-Core so its language-model loss is the fused cross entropy + z-loss.

For scripts built on megatron-core alone::

    import mindspeed_cez.patches
    mindspeed_cez.patches.apply(z_loss_coeff=1e-4)   # before or after building the model
    ...
    mindspeed_cez.patches.remove()                   # Megatron's own functions again

Both are idempotent; calling ``apply`` again only changes the settings. Neither imports Megatron:
each wrapper attaches when its module is first imported (:mod:`.targets`), so ``apply`` may come
before or after ``import megatron``. In a MindSpeed process the same wrappers are attached by
MindSpeed's patch manager instead (see :mod:`.mindspeed_feature`).

:func:`activate` is the one place settings become active: ``apply()``, the ``--lm-*`` flags and the
MindSpeed feature all end there. An ``apply()`` before Megatron parses its arguments is kept when the
flags choose nothing; flags that choose differently are one clear error.

What is patched is listed in :data:`.targets.TARGETS`; :mod:`.megatron_core` describes each wrapper.

This folder holds everything about Megatron / MindSpeed / MindSpeed-LLM: the flags
(:mod:`.arguments`), the run-time settings, the patch points, the metrics and their logging, the
MindSpeed feature. It builds on the ops of :mod:`mindspeed_cez`, never the other way round.
"""

import sys
import warnings

from mindspeed_cez.patches import arguments, mindspeed_feature, mindspeed_llm, targets
from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.settings import Settings
from mindspeed_cez.patches.targets import (  # noqa: F401  (install_target, installed_targets: re-exported)
    PatchTargetError, install_patches, install_target, installed_targets, patch_targets, uninstall_all)

__all__ = ["apply", "activate", "remove", "active_settings", "Settings", "patch_targets", "PatchTargetError"]


def apply(z_loss_coeff=0.0, *, label_smoothing=None, log_z_loss=True, log_lse=False, fused_output_layer=False,
          grads="forward", logit_transform=None, backend=None, linear_backend=None, block_fraction=None):
    """Use the fused op for Megatron's LM loss: per token, the gradient of ``CE + z_loss_coeff * lse**2``
    and the value of the CE (Megatron's convention for auxiliary losses: ``lm loss`` stays CE).

    Args:
        z_loss_coeff: ``c >= 0``; 0 uses the fused kernel without z-loss.
        label_smoothing: Megatron's convention; None takes ``config.label_smoothing`` if the
            model config has that field (megatron-core 0.16/0.19 do not), else 0.
        log_z_loss: record ``lm_z_loss`` in Megatron's MoE metrics tracker (when ``c > 0``).
        log_lse: also record the mean log-sum-exp as ``lm_lse`` and its maximum over the
            iteration's tokens as ``lm_lse_max``.
        fused_output_layer: compute GPT's output layer and the LM loss together with
            :func:`mindspeed_cez.linear_cross_entropy_zloss` (no logits tensor), see :mod:`.output_layer`.
        grads: the fused output layer's ``grads``: ``"forward"`` (default; gradients during the forward,
            with the loss mask as the op's ``token_weights``, where there is one) or ``"recompute"``.
        logit_transform: the ``LogitTransform`` MindSpeed-LLM's model applies to the logits, computed in
            the kernels instead (:mod:`.logit_transform`); None: read from Megatron's parsed arguments
            (its ``--output-multiplier-scale`` / ``--output-logit-softcapping``); False: none.
        block_fraction: ``"forward"``'s memory/time dial, the op's ``block_fraction``
            (None: 0.5, a block's logits half the logits; 0.125 the lean setting).
        backend, linear_backend: the ops' ``backend`` / ``linear_backend`` (None: automatic per device).

    Runs the startup checks of the flag path (MindSpeed-LLM's modes that bypass the fused kernel,
    :func:`.mindspeed_llm.check_args`) on Megatron's parsed arguments when there are some; with
    MindSpeed-LLM loaded and no arguments parsed yet, warns once that it could not.

    Returns the active :class:`Settings`. Idempotent: a second call only replaces the settings.
    Imports nothing of Megatron; without megatron-core installed, ends the run with one line
    naming ``pip install megatron-core``.
    """
    targets.require_megatron_core()
    if logit_transform is None:
        args = megatron_args()
        logit_transform = None if args is None else mindspeed_llm.logit_transform(args)
    elif logit_transform is False:
        logit_transform = None
    settings = Settings(z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing,
                        log_z_loss=log_z_loss, log_lse=log_lse, fused_output_layer=bool(fused_output_layer),
                        grads=grads, logit_transform=logit_transform, backend=backend, linear_backend=linear_backend,
                        block_fraction=block_fraction)
    return activate(settings)


def _check_megatron_args(settings):
    args = megatron_args()
    if args is not None:
        output_layer_flag = "mindspeed_cez.patches.apply(fused_output_layer=True)" if settings.fused_output_layer else None
        mindspeed_llm.check_args(args, f"mindspeed_cez.patches.apply(z_loss_coeff={settings.z_loss_coeff})",
                                 output_layer_flag)
    elif (mindspeed_llm.loaded() and not _settings.RECORD.warned_unchecked
          and "mindspeed_cez.megatron_adaptor" not in sys.modules):
        _settings.RECORD.warned_unchecked = True
        warnings.warn(
            "mindspeed_cez.patches.apply(): MindSpeed-LLM is loaded but Megatron's arguments are not parsed "
            "yet, so its modes that bypass the fused kernel (--loss-compute-mode chunk at TP=1, "
            "--is-instruction-dataset) could not be checked: there the run would train without the "
            "z-loss. Call apply() after the arguments are parsed, or use the --lm-z-loss-coeff flag "
            "(import mindspeed_cez.megatron_adaptor), which checks them at startup", stacklevel=4)


def megatron_args():
    """Megatron's parsed arguments (``get_args()``; MindSpeed-LLM trains with the same), or None
    before they are parsed or without ``megatron.training``. Imports nothing."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def activate(settings, *, args=None):
    """The one activation route: attach the wrappers (now or when their modules are imported),
    check that every required one could attach, and make ``settings`` active. Returns the active
    settings.

    ``args``: Megatron's parsed arguments whose ``--lm-*`` flags gave ``settings`` (validated;
    None: the fused kernel off); without ``args``, ``settings`` come from ``apply()`` and are run
    through the startup checks on Megatron's arguments where they are parsed. Flags that choose
    nothing keep an earlier ``apply()``; flags and ``apply()`` that disagree are a ``ValueError``
    naming both.
    """
    record = _settings.RECORD
    if args is None:
        if record.flags_chose and _differ(record.from_flags, settings):
            raise ValueError(_conflict(settings, record.from_flags))
        _check_megatron_args(settings)
        record.chose_by_apply(settings)
    else:
        explicit = settings is not None or getattr(args, "lm_fused_ce", None) is False
        if explicit:
            record.chose_by_flags(settings)
        applied = record.from_apply
        if record.apply_chose and explicit and _differ(settings, applied):
            raise ValueError(_conflict(applied, settings))
        if record.apply_chose and not explicit:
            settings = applied
            mindspeed_llm.check_args(args, _apply_call(settings),
                                     _apply_call(settings, "fused_output_layer") if settings.fused_output_layer else None)
    mindspeed_feature.register(activate_from_flags)  # in a MindSpeed process its patch manager attaches the wrappers
    if mindspeed_feature.registered_with_mindspeed():
        if "megatron.core" in sys.modules:
            mindspeed_feature.register_patches_now()  # MindSpeed's patch manager owns the patching
    else:
        install_patches()
    targets.check_attached()
    _settings.set_active(settings)
    return settings


def activate_from_flags(args):
    """The ``--lm-*`` flags' route, from Megatron's (or MindSpeed's) validation of ``args``: a bad
    value or a conflict with ``apply()`` is an argument error (one line, exit status 2)."""
    settings = arguments.flag_settings(args)
    try:
        return activate(settings, args=args)
    except arguments.FlagValueError:
        raise
    except ValueError as err:
        raise arguments.argument_error(err) from None


_COMPARED = ("z_loss_coeff", "log_lse", "fused_output_layer", "grads", "block_fraction")


def _differ(a, b):
    if a is None or b is None:
        return (a is None) != (b is None)
    fields = _COMPARED if a.fused_output_layer or b.fused_output_layer else _COMPARED[:3]
    return any(getattr(a, f) != getattr(b, f) for f in fields)


def _apply_call(settings, field="z_loss_coeff"):
    return f"mindspeed_cez.patches.apply({field}={getattr(settings, field)!r})"


def _conflict(applied, flagged):
    flags = arguments.FLAG_NO_FUSED if flagged is None else (
        f"{arguments.FLAG_COEFF} {flagged.z_loss_coeff}" + (f" {arguments.FLAG_LOG_LSE}" if flagged.log_lse else "")
        + (f" {arguments.FLAG_OUTPUT_LAYER} {flagged.grads}" if flagged.fused_output_layer else ""))
    return (f"{_apply_call(applied)} and the flags ({flags}) configure the fused loss differently: "
            "keep one of them (drop the apply() call or the --lm-* flags)")


def remove():
    """Restore Megatron's original functions and deactivate the adaptor (idempotent).

    Patches installed through MindSpeed's patch manager stay in place but pass through to the
    functions they wrap (MindSpeed owns them); only the settings are cleared."""
    _settings.set_active(None)
    _settings.RECORD.forget_choices()
    uninstall_all()


def active_settings():
    return _settings.get_active()

