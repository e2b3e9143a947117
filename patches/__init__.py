"""Patch Megatron-Core so its language-model loss is the fused cross entropy + z-loss.

For scripts built on megatron-core alone::

    import mindspeed_cez.patches
    mindspeed_cez.patches.apply(z_loss_coeff=1e-4)   # before or after building the model
    ...
    mindspeed_cez.patches.remove()                   # Megatron's own functions again

Both are idempotent; calling ``apply`` again only changes the settings. With MindSpeed installed,
``import mindspeed_cez.megatron_adaptor`` registers the same wrappers through MindSpeed's patch
manager instead (see :mod:`mindspeed_cez.mindspeed_feature`).

What is patched is listed in :data:`PATCH_TARGETS`; :mod:`mindspeed_cez.patches.megatron_core`
describes each wrapper. Functions are replaced in their defining module *and* in every loaded
module that bound a copy (``from x import f``); modules imported later pick up the patched
attribute. Targets that this megatron-core does not have are skipped. Once MindSpeed-LLM is
imported, its own model forward and training log join the targets (:mod:`.mindspeed_llm`).
"""

import importlib
import sys
import warnings

from mindspeed_cez import moe_tracker
from mindspeed_cez.patches import megatron_core as mc
from mindspeed_cez.patches import mindspeed_llm, output_layer, training_log
from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.settings import Settings

__all__ = ["apply", "activate", "remove", "is_applied", "active_settings", "Settings", "PATCH_TARGETS"]


def _targets():
    lm = "megatron.core.models.common.language_module.language_module"
    targets = [
        (f"{lm}.LanguageModule.compute_language_model_loss", mc.compute_language_model_loss_wrapper),
        ("megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy", mc.vocab_parallel_cross_entropy_wrapper),
        ("megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy", mc.fused_vocab_parallel_cross_entropy_wrapper),
        (f"{lm}.te_parallel_cross_entropy", mc.te_parallel_cross_entropy_wrapper),
        ("megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward", output_layer.column_parallel_forward_wrapper),
        ("megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.finish_grad_sync",
         output_layer.finish_grad_sync_wrapper),
    ]
    targets += [(path, mc.loss_context_wrapper) for path in mc.loss_context_paths()]
    report = moe_tracker.report_path()
    if report is not None:
        targets.append((report, training_log.moe_metrics_report_wrapper))
    if importlib.util.find_spec("megatron.training") is not None:
        targets.append(("megatron.training.training.training_log", training_log.training_log_wrapper))
    return targets + mindspeed_llm.patch_targets()


def __getattr__(name):
    if name == "PATCH_TARGETS":
        return _targets()
    raise AttributeError(name)


def _resolve(path):
    """``a.b.mod.Cls.attr`` -> (owner object, attribute name, owner-is-a-class)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:split])
        try:
            owner = importlib.import_module(modname)
        except ImportError:
            continue
        for attr in parts[split:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1], isinstance(owner, type)
    raise ImportError(path)


# path -> (owner, attr, original, replacement, [(module, attr) copies replaced])
_APPLIED = {}


def _install(path, wrapper):
    try:
        owner, attr, is_class = _resolve(path)
    except (ImportError, AttributeError):
        return False  # this megatron-core version has no such target (e.g. megatron.training absent)
    if not is_class and not hasattr(owner, attr):
        return False
    original = owner.__dict__.get(attr) if is_class else getattr(owner, attr)
    if is_class and original is None:
        return False
    replacement = wrapper(original)
    setattr(owner, attr, replacement)
    copies = []
    if not is_class and original is not None:
        for modname, module in list(sys.modules.items()):
            if module is None or module is owner or modname.startswith("mindspeed_cez"):
                continue
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, name, replacement)
                    copies.append((module, name))
    _APPLIED[path] = (owner, attr, original, replacement, copies)
    return True


def _uninstall(path):
    owner, attr, original, replacement, copies = _APPLIED.pop(path)
    if (owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)) is replacement:
        setattr(owner, attr, original)
    for module, name in copies:
        if getattr(module, name, None) is replacement:
            setattr(module, name, original)
    # modules imported while patched bound the replacement: restore those too
    if not isinstance(owner, type):
        for modname, module in list(sys.modules.items()):
            if module is None or modname.startswith("mindspeed_cez"):
                continue
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is replacement:
                    setattr(module, name, original)


def install_target(path, wrapper):
    """Install one extra wrapper (e.g. the argument hooks of ``mindspeed_cez.megatron_adaptor``)."""
    return path in _APPLIED or _install(path, wrapper)


def install_patches():
    """Install every wrapper (idempotent); they stay pass-through until settings are active."""
    for path, wrapper in _targets():
        if path not in _APPLIED:
            _install(path, wrapper)
    return sorted(_APPLIED)


def apply(z_loss_coeff=0.0, *, label_smoothing=None, log_z_loss=True, log_lse=False, fused_output_layer=False,
          output_layer_grads="forward", logit_transform=None, backend=None, linear_backend=None,
          output_layer_block_fraction=None):
    """Use the fused op for Megatron's LM loss: per token, the gradient of ``CE + z_loss_coeff * lse**2``
    and the value of the CE (Megatron's convention for auxiliary losses: ``lm loss`` stays CE).

    Args:
        z_loss_coeff: ``c >= 0``; 0 uses the fused kernel without z-loss.
        label_smoothing: Megatron's convention; None takes ``config.label_smoothing`` if the
            model config has that field (megatron-core 0.16/0.19 do not), else 0.
        log_z_loss: record ``lm_z_loss`` in Megatron's MoE metrics tracker (when ``c > 0``).
        log_lse: also record the mean log-sum-exp as ``lm_lse``.
        fused_output_layer: compute GPT's output layer and the LM loss together with
            :func:`mindspeed_cez.linear_cross_entropy_zloss` (no logits tensor), see :mod:`.output_layer`.
        output_layer_grads: the op's ``grads``: ``"forward"`` (default; gradients during the forward,
            with the loss mask as the op's ``token_weights``, where there is one) or ``"recompute"``.
        output_layer_block_fraction: ``"forward"``'s memory/time dial, the op's ``block_fraction``
            (None: 0.5, a block's logits half the logits; 0.125 the lean setting).
        logit_transform: compute MindSpeed-LLM's scaling / soft cap of the logits in the kernels
            (:mod:`.logit_transform`); None: where Megatron's parsed arguments have those flags set.
        backend, linear_backend: the ops' ``backend`` / ``linear_backend`` (None: automatic per device).

    Runs the startup checks of the flag path (MindSpeed-LLM's modes that bypass the fused kernel,
    :func:`.mindspeed_llm.check_args`) on Megatron's parsed arguments when there are some; with
    MindSpeed-LLM loaded and no arguments parsed yet, warns once that it could not.

    Returns the active :class:`Settings`. Idempotent: a second call only replaces the settings.
    """
    if logit_transform is None:
        args = megatron_args()
        logit_transform = args is not None and mindspeed_llm.transforms_logits(args)
    settings = Settings(z_loss_coeff=float(z_loss_coeff), label_smoothing=label_smoothing,
                        log_z_loss=log_z_loss, log_lse=log_lse, fused_output_layer=bool(fused_output_layer),
                        output_layer_grads=output_layer_grads, logit_transform=bool(logit_transform),
                        backend=backend, linear_backend=linear_backend,
                        output_layer_block_fraction=output_layer_block_fraction)
    _check_megatron_args(settings)
    return activate(settings)


_WARNED_UNCHECKED = []


def _check_megatron_args(settings):
    args = megatron_args()
    if args is not None:
        output_layer_flag = "mindspeed_cez.patches.apply(fused_output_layer=True)" if settings.fused_output_layer else None
        mindspeed_llm.check_args(args, f"mindspeed_cez.patches.apply(z_loss_coeff={settings.z_loss_coeff})",
                                 output_layer_flag)
    elif mindspeed_llm.loaded() and not _WARNED_UNCHECKED:
        _WARNED_UNCHECKED.append(True)
        warnings.warn(
            "mindspeed_cez.patches.apply(): MindSpeed-LLM is loaded but Megatron's arguments are not parsed "
            "yet, so its modes that bypass the fused kernel (--loss-compute-mode chunk at TP=1, "
            "--is-instruction-dataset) could not be checked: there the run would train without the "
            "z-loss. Call apply() after the arguments are parsed, or use the --lm-z-loss-coeff flag "
            "(import mindspeed_cez.megatron_adaptor), which checks them at startup", stacklevel=3)


def megatron_args():
    """Megatron's parsed arguments (``get_args()``; MindSpeed-LLM trains with the same), or None
    before they are parsed or without ``megatron.training``. Imports nothing."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def activate(settings):
    """Install the wrappers (idempotent) and make ``settings`` the active ones; no checks (the
    flag path validated its arguments already). Returns ``settings``."""
    feature = sys.modules.get("mindspeed_cez.mindspeed_feature")
    if feature is not None and feature.registered_with_mindspeed():
        feature.register_patches_now()  # MindSpeed's patch manager owns the patching
    else:
        install_patches()
    _settings.set_active(settings)
    return settings


def remove():
    """Restore Megatron's original functions and deactivate the adaptor (idempotent).

    Patches installed through MindSpeed's patch manager stay in place but pass through to the
    functions they wrap (MindSpeed owns them); only the settings are cleared."""
    _settings.set_active(None)
    for path in list(_APPLIED):
        _uninstall(path)


def is_applied():
    return _settings.get_active() is not None


def active_settings():
    return _settings.get_active()


def installed_targets():
    """The patch targets currently installed directly (not through MindSpeed)."""
    return sorted(_APPLIED)

