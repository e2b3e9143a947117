"""What the adaptor patches, and the direct (non-MindSpeed) installation of those patches.

:func:`patch_targets` lists ``(dotted path, wrapper)`` pairs; :func:`install_patches` replaces each
function in its defining module *and* in every loaded module that bound a copy
(``from x import f``); :func:`uninstall_all` restores them. Targets that this megatron-core does
not have are skipped. Once MindSpeed-LLM is imported, its own model forward and training log join
the targets (:mod:`.mindspeed_llm`). With MindSpeed, its patch manager installs the same list
(:mod:`.mindspeed_feature`).
"""

import importlib
import sys

from mindspeed_cez.patches import megatron_core as mc
from mindspeed_cez.patches import megatron_features, mindspeed_llm, moe_tracker, output_layer, training_log


def patch_targets():
    """``[(dotted path, wrapper)]`` for this megatron-core (and MindSpeed-LLM, once imported)."""
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
        targets.append(("megatron.training.training.destroy_global_state", megatron_features.destroy_global_state_wrapper))
    return targets + mindspeed_llm.patch_targets()


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
    for path, wrapper in patch_targets():
        if path not in _APPLIED:
            _install(path, wrapper)
    return sorted(_APPLIED)


def uninstall_all():
    """Restore every function installed here (idempotent)."""
    for path in list(_APPLIED):
        _uninstall(path)


def installed_targets():
    """The patch targets currently installed directly (not through MindSpeed)."""
    return sorted(_APPLIED)
