"""What the adaptor patches, and how each patch attaches when its module is first imported.

:data:`TARGETS` names every patch point by module and attribute, as text: knowing them imports
nothing. :func:`install_patches` attaches each one whose module is already imported, and arms a
post-import hook (a ``sys.meta_path`` finder) for the others: a module that is imported later is
patched right after its code ran, before any other module can bind a copy of its functions
(``from x import f``); copies bound earlier, in modules imported before, are rebound too.
:func:`uninstall_all` restores every function and disarms the hook.

So registering the adaptor imports no Megatron module: MindSpeed's adaptor, which must run before
Megatron is imported (it replaces ``torch.compile`` and puts its apex / Transformer Engine stand-ins
in ``sys.modules``), still runs first whatever the import order. With MindSpeed, its patch manager
attaches the same list instead (:func:`patch_targets`, :mod:`.mindspeed_feature`): a module whose
code runs once MindSpeed's features manager is loaded is left to it.

A target is *required* or *optional*: optional ones are feature-detected (a megatron-core that has
no Transformer Engine cross entropy, no hybrid model, another MoE metrics API); a required one that
cannot attach (its module imported, the attribute missing) is a :class:`PatchTargetError` naming it,
raised when the adaptor is activated (or at the import itself once it is active), never a silent miss.
"""

import importlib
import importlib.abc
import inspect
import sys
from typing import Callable, NamedTuple, Optional, Tuple

from mindspeed_cez.patches import megatron_core as mc
from mindspeed_cez.patches import megatron_features, mindspeed_llm, output_layer, training_log

MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
FEATURES_MANAGER = "mindspeed.features_manager.features_manager"  # MindSpeed's, once loaded: its route


class PatchTargetError(RuntimeError):
    """A required patch point is missing from the module that should hold it."""


def module_exists(name):
    """Whether ``name`` can be imported, asking the import system's finders without running any
    module (``importlib.util.find_spec`` would import the parent packages)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        if parent in sys.modules:
            path = getattr(sys.modules[parent], "__path__", None)
        else:
            spec = _find_spec(parent, None)
            path = None if spec is None else spec.submodule_search_locations
        if path is None:
            return False
    return _find_spec(name, path) is not None


def _find_spec(name, path, skip=None):
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if finder is skip or find is None:
            continue
        try:
            spec = find(name, path)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


def _has_loss_context_args(fn):
    return {"labels", "loss_mask"} <= set(inspect.signature(fn).parameters)


def _moe_tracker_class(module):  # 0.18 on: MoEMetricsTracker.report
    return hasattr(module, "get_moe_metrics_tracker")


def _moe_function(module):  # 0.12 to 0.17: moe_utils.track_moe_metrics (moe_logging came with the tracker)
    return not module_exists(MOE_LOGGING)


class Target(NamedTuple):
    """One patch point: ``module``'s ``owner`` class (``""``: the module itself), the first of
    ``names`` it has (that ``accepts``), decorated by ``wrapper``."""

    module: str
    owner: str
    names: Tuple[str, ...]
    wrapper: Callable
    required: bool = True
    accepts: Optional[Callable] = None  # fn -> bool: which of ``names`` (a signature, say)
    when: Optional[Callable] = None  # module -> bool: whether this megatron-core uses this point

    @property
    def label(self):
        return ".".join(p for p in (self.module, self.owner, "|".join(self.names)) if p)


_LM = "megatron.core.models.common.language_module.language_module"
TARGETS = [
    Target(_LM, "LanguageModule", ("compute_language_model_loss",), mc.compute_language_model_loss_wrapper),
    Target("megatron.core.tensor_parallel.cross_entropy", "", ("vocab_parallel_cross_entropy",),
           mc.vocab_parallel_cross_entropy_wrapper),
    Target("megatron.core.fusions.fused_cross_entropy", "", ("fused_vocab_parallel_cross_entropy",),
           mc.fused_vocab_parallel_cross_entropy_wrapper, required=False),
    Target(_LM, "", ("te_parallel_cross_entropy",), mc.te_parallel_cross_entropy_wrapper, required=False),
    Target("megatron.core.tensor_parallel.layers", "ColumnParallelLinear", ("forward",),
           output_layer.column_parallel_forward_wrapper),
    Target("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", ("finish_grad_sync",),
           output_layer.finish_grad_sync_wrapper),
    *[Target(module, cls, methods, mc.loss_context_wrapper, required=module.endswith(".gpt_model"),
             accepts=_has_loss_context_args) for module, cls, methods in mc._LOSS_CONTEXT_METHODS],
    Target(MOE_LOGGING, "MoEMetricsTracker", ("report",), training_log.moe_metrics_report_wrapper, required=False,
           when=_moe_tracker_class),
    Target(MOE_UTILS, "", ("track_moe_metrics",), training_log.moe_metrics_report_wrapper, required=False,
           when=_moe_function),
    Target("megatron.training.training", "", ("training_log",), training_log.training_log_wrapper),
    Target("megatron.training.training", "", ("destroy_global_state",), megatron_features.destroy_global_state_wrapper,
           required=False),
]


def _pick(target, module):
    """``(owner object, attribute name)`` of ``target`` in its executed ``module``; None where this
    version does not use it (``when``), or lacks it."""
    if target.when is not None and not target.when(module):
        return None
    owner = module
    if target.owner:
        owner = getattr(module, target.owner, None)
        if not isinstance(owner, type):
            return None
    for name in target.names:
        if isinstance(owner, type):
            fn = vars(owner).get(name)
            if fn is not None and (target.accepts is None or target.accepts(fn)):
                return owner, name
        elif name in vars(owner):  # a module's name bound to None (an optional import that failed) counts
            return owner, name
    return None


def _path(owner, name):
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def patch_targets():
    """``[(dotted path, wrapper)]`` for this megatron-core (and MindSpeed-LLM, once imported), for
    MindSpeed's patch manager. Imports the target modules: call it once MindSpeed's own patches
    that must precede Megatron are applied (its ``register_patches`` stage). A required target
    missing is a :class:`PatchTargetError`."""
    found, missing = [], []
    for target in TARGETS:
        try:
            module = importlib.import_module(target.module)
        except ImportError:
            if target.required and not target.module.startswith("megatron.training"):
                missing.append(target.label)
            continue  # megatron.training: megatron-core 0.12-0.16 have none
        picked = _pick(target, module)
        if picked is None:
            if target.required:
                missing.append(target.label)
            continue
        found.append((_path(*picked), target.wrapper))
    if missing:
        raise _missing_error(missing)
    return found + mindspeed_llm.patch_targets()


def _missing_error(labels):
    return PatchTargetError(
        "mindspeed_cez cannot patch " + ", ".join(labels) + ": this Megatron lacks the function the fused "
        "loss replaces there, so the run would train without it; use a megatron-core this package supports "
        "(0.12 to 0.19) or report the version")


# ---------------------------------------------------------------------------------------------
# direct installation (no MindSpeed): attach now or when the module is first imported
# ---------------------------------------------------------------------------------------------


def _rebind(old, new, skip=None):
    """Every module-level name bound to ``old`` in the loaded modules (this package's and ``skip`` aside)
    bound to ``new``."""
    for modname, module in list(sys.modules.items()):
        if module is None or module is skip or modname.startswith("mindspeed_cez"):
            continue
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is old:
                setattr(module, name, new)


class PatchRegistry:
    """The functions installed directly, the targets and callbacks watched, and the post-import hook
    that attaches them (:class:`_PostImportFinder`, first on ``sys.meta_path`` while armed)."""

    def __init__(self):
        self.applied = {}  # path -> (owner, attr, original, replacement)
        self.extra = []  # targets added by install_target (the argument hooks of mindspeed_cez.megatron_adaptor)
        self.failed = {}  # label -> module name: required targets whose module ran without them
        self.callbacks = {}  # module name -> [callable(module)], run once the module's code ran
        self.defer = None  # a callable: True while MindSpeed's patch manager attaches the targets
        self.finder = _PostImportFinder(self)

    def deferred(self):
        return self.defer is not None and self.defer()

    def install(self, owner, attr, wrapper):
        path = _path(owner, attr)
        if path in self.applied:
            return True
        is_class = isinstance(owner, type)
        original = owner.__dict__.get(attr) if is_class else getattr(owner, attr)
        replacement = wrapper(original)
        setattr(owner, attr, replacement)
        if not is_class and original is not None:  # copies bound earlier (``from x import f``)
            _rebind(original, replacement, skip=owner)
        self.applied[path] = (owner, attr, original, replacement)
        return True

    def uninstall(self, path):
        owner, attr, original, replacement = self.applied.pop(path)
        if (owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)) is replacement:
            setattr(owner, attr, original)
        if not isinstance(owner, type) and original is not None:  # copies bound while patched, or before
            _rebind(replacement, original)

    def attach(self, target, module):
        """Attach ``target`` in its freshly executed (or already loaded) ``module``."""
        if self.deferred():
            return  # MindSpeed's patch manager attaches it (patch_targets)
        picked = _pick(target, module)
        if picked is None:
            if target.required:
                self.failed[target.label] = target.module
                from mindspeed_cez.patches import settings

                if settings.get_active() is not None:  # active already: the import itself fails
                    raise _missing_error([target.label])
            return
        self.failed.pop(target.label, None)
        self.install(*picked, target.wrapper)

    def watched(self):
        return [*TARGETS, *self.extra]

    def watches(self, name):
        return name in self.callbacks or any(t.module == name for t in self.watched())

    def on_executed(self, name, module):
        for target in self.watched():
            if target.module == name:
                self.attach(target, module)
        for callback in self.callbacks.get(name, ()):
            callback(module)

    def arm(self):
        if self.finder not in sys.meta_path:
            sys.meta_path.insert(0, self.finder)

    def disarm(self):
        while self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)

    def on_import(self, module_name, callback):
        callbacks = self.callbacks.setdefault(module_name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        self.arm()
        if sys.modules.get(module_name) is not None:
            callback(sys.modules[module_name])

    def install_target(self, target):
        if target not in self.extra:
            self.extra.append(target)
        self.arm()
        if sys.modules.get(target.module) is not None:
            self.attach(target, sys.modules[target.module])

    def install_patches(self):
        self.arm()
        for target in self.watched():
            if sys.modules.get(target.module) is not None:
                self.attach(target, sys.modules[target.module])
        return sorted(self.applied)

    def check_attached(self):
        if self.failed and not self.deferred():
            raise _missing_error(sorted(self.failed))

    def forget_failures(self):
        """Forget the required targets that could not attach (as if their modules were not imported)."""
        self.failed.clear()

    def uninstall_all(self):
        for path in list(self.applied):
            self.uninstall(path)
        self.extra.clear()
        self.failed.clear()
        if not self.callbacks:
            self.disarm()


class _PostImportLoader(importlib.abc.Loader):
    """The loader of a watched module: its own loader runs the module, then the patches attach."""

    def __init__(self, loader, name, registry):
        self._loader, self._name, self._registry = loader, name, registry

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._registry.on_executed(self._name, sys.modules.get(self._name, module))

    def __getattr__(self, name):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while armed; answers only for watched modules, with their own spec."""

    def __init__(self, registry):
        self._registry = registry

    def find_spec(self, name, path, target=None):
        if name in sys.modules or not self._registry.watches(name):
            return None
        spec = _find_spec(name, path, skip=self)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PostImportLoader(spec.loader, name, self._registry)
        return spec


# Global: the import system (the post-import hook) and Megatron's modules reach the patches without a handle.
_REGISTRY = PatchRegistry()


def on_import(module_name, callback):
    """Run ``callback(module)`` once ``module_name`` is imported (now, if it is already)."""
    _REGISTRY.on_import(module_name, callback)


def defer_to_mindspeed(predicate):
    """``predicate()`` True: MindSpeed's patch manager attaches the targets, not this module."""
    _REGISTRY.defer = predicate


def install_target(path, wrapper):
    """Attach one extra wrapper (``module.function`` or ``module.Class.method``; the argument hooks
    of ``mindspeed_cez.megatron_adaptor``) now or when its module is imported."""
    module, _, name = path.rpartition(".")
    _REGISTRY.install_target(Target(module, "", (name,), wrapper))
    return True


def install_patches():
    """Attach every wrapper whose module is loaded and arm the hook for the others (idempotent;
    imports nothing). They pass through until settings are active. Returns the attached paths."""
    return _REGISTRY.install_patches()


def check_attached():
    """Raise :class:`PatchTargetError` naming the required targets that could not attach."""
    _REGISTRY.check_attached()


def uninstall_all():
    """Restore every function installed here and disarm the hook (idempotent)."""
    _REGISTRY.uninstall_all()


def installed_targets():
    """The patch targets currently installed directly (not through MindSpeed)."""
    return sorted(_REGISTRY.applied)


class MegatronCoreMissing(SystemExit):
    """megatron-core is not installed: uncaught, the process ends with this one line on stderr and
    exit status 1 (no traceback)."""

    MESSAGE = ("mindspeed_cez: megatron-core is not installed, and the fused loss patches Megatron's: "
               "pip install megatron-core (MindSpeed-LLM 26.x pins megatron-core==0.12.1)")

    def __init__(self):
        super().__init__(self.MESSAGE)


def require_megatron_core():
    """Raise :class:`MegatronCoreMissing` unless ``megatron.core`` can be imported (imports nothing)."""
    if not module_exists("megatron.core"):
        raise MegatronCoreMissing()
