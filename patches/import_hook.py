"""The generic post-import hook: a patch point attached when its module is first imported.

A :class:`Target` names a patch point by module and attribute, as text: knowing it imports nothing.
:class:`PatchRegistry` attaches each watched target whose module is already imported, and arms a
post-import hook (a ``sys.meta_path`` finder) for the others: a module imported later is patched
right after its code ran, before any other module can bind a copy of its functions (``from x import
f``); copies bound earlier, in modules imported before, are rebound too. :meth:`PatchRegistry.uninstall_all`
restores every function and disarms the hook. :meth:`PatchRegistry.patch_targets` lists the same
targets as ``(dotted path, wrapper)`` for another patch manager (MindSpeed's).

A target is *required* or *optional*: optional ones are feature-detected; a required one that cannot
attach (its module imported, the attribute missing) is a :class:`PatchTargetError` naming it, raised
by :meth:`PatchRegistry.check_attached` (or at the import itself once ``strict``), never a silent miss.

Nothing here knows what is patched: the table is :mod:`.patch_points`, handed to the registry the
runtime holds (:class:`.runtime.Runtime`) by :mod:`mindspeed_cez.patches`.
"""

import importlib
import importlib.abc
import os
import re
import sys
from typing import Callable, NamedTuple, Optional, Tuple

# Where a target attaches: always, only with the adaptor's import (Megatron's argument hooks), only
# through MindSpeed's patch manager (another framework's modules, which the adaptor never imports).
ALWAYS, ADAPTOR, MINDSPEED = "always", "adaptor", "mindspeed"


class PatchTargetError(RuntimeError):
    """A required patch point is missing from the module that should hold it."""


def module_exists(name):
    """Whether ``name`` can be imported, asking the import system's finders without running any
    module (``importlib.util.find_spec`` would import the parent packages)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    parent = name.rpartition(".")[0]
    path = _package_path(parent) if parent else None
    return (path is not None or not parent) and _find_spec(name, path) is not None


def _package_path(name):
    """Where package ``name``'s submodules are looked for (its ``__path__``), found level by level from the
    top without importing any; None where ``name`` is not a package that can be imported."""
    if name in sys.modules:
        return getattr(sys.modules[name], "__path__", None)
    parent = name.rpartition(".")[0]
    path = _package_path(parent) if parent else None
    if parent and path is None:
        return None
    spec = _find_spec(name, path)
    return None if spec is None else spec.submodule_search_locations


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


class Target(NamedTuple):
    """One patch point: ``module``'s ``owner`` class (``""``: the module itself), the first of
    ``names`` it has (that ``accepts``), decorated by ``wrapper``."""

    module: str
    owner: str
    names: Tuple[str, ...]
    wrapper: Callable
    required: bool = True
    accepts: Optional[Callable] = None  # fn -> bool: which of ``names`` (a signature, say)
    when: Optional[Callable] = None  # module -> bool: whether this version uses this point
    route: str = ALWAYS  # ALWAYS, ADAPTOR or MINDSPEED
    loaded_only: bool = False  # MindSpeed's list: only once its module is imported (never imported here)

    @property
    def label(self):
        return ".".join(p for p in (self.module, self.owner, "|".join(self.names)) if p)


def pick(target, module):
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


def dotted_path(owner, name):
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def missing_error(labels):
    return PatchTargetError(
        "mindspeed_cez cannot patch " + ", ".join(labels) + ": this Megatron lacks the function the fused "
        "loss replaces there, so the run would train without it; use a megatron-core this package supports "
        "(0.12 to 0.19) or report the version")


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
    """The table of targets, the functions installed directly, the callbacks waiting for a module,
    and the post-import hook that attaches them (:class:`_PostImportFinder`, first on
    ``sys.meta_path`` while armed)."""

    def __init__(self, table=()):
        self.table = list(table)  # every Target (.patch_points.TARGETS)
        self.routes = {ALWAYS}  # the routes attached directly (ADAPTOR once the adaptor is registered)
        self.applied = {}  # path -> (owner, attr, original, replacement)
        self.failed = {}  # label -> module name: required targets whose module ran without them
        self.callbacks = {}  # module name -> [callable(module)], run once the module's code ran
        self.manager_module = None  # while this module is loaded, another patch manager attaches the targets
        self.strict = False  # a required target missing at its import raises there (the adaptor is active)
        self.finder = _PostImportFinder(self)

    def deferred(self):
        return self.manager_module is not None and self.manager_module in sys.modules

    def install(self, owner, attr, wrapper):
        path = dotted_path(owner, attr)
        if path in self.applied:
            return
        is_class = isinstance(owner, type)
        original = owner.__dict__.get(attr) if is_class else getattr(owner, attr)
        replacement = wrapper(original)
        setattr(owner, attr, replacement)
        if not is_class and original is not None:  # copies bound earlier (``from x import f``)
            _rebind(original, replacement, skip=owner)
        self.applied[path] = (owner, attr, original, replacement)

    def uninstall(self, path):
        owner, attr, original, replacement = self.applied.pop(path)
        if (owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)) is replacement:
            setattr(owner, attr, original)
        if not isinstance(owner, type) and original is not None:  # copies bound while patched, or before
            _rebind(replacement, original)

    def attach(self, target, module):
        """Attach ``target`` in its freshly executed (or already loaded) ``module``."""
        if self.deferred():
            return  # the other patch manager attaches it (patch_targets)
        picked = pick(target, module)
        if picked is None:
            if target.required:
                self.failed[target.label] = target.module
                if self.strict:  # active already: the import itself fails
                    raise missing_error([target.label])
            return
        self.failed.pop(target.label, None)
        self.install(*picked, target.wrapper)

    def watched(self):
        return [t for t in self.table if t.route in self.routes]

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
        """Run ``callback(module)`` once ``module_name`` is imported (now, if it is already)."""
        callbacks = self.callbacks.setdefault(module_name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        self.arm()
        if sys.modules.get(module_name) is not None:
            callback(sys.modules[module_name])

    def install_patches(self, *routes):
        """Attach every watched wrapper (those of ``routes`` too, from now on) whose module is loaded and
        arm the hook for the others (idempotent; imports nothing). Returns the attached paths."""
        self.routes.update(routes)
        self.arm()
        for target in self.watched():
            if sys.modules.get(target.module) is not None:
                self.attach(target, sys.modules[target.module])
        return sorted(self.applied)

    def check_attached(self):
        """Raise :class:`PatchTargetError` naming the required targets that could not attach."""
        if self.failed and not self.deferred():
            raise missing_error(sorted(self.failed))

    def forget_failures(self):
        """Forget the required targets that could not attach (as if their modules were not imported)."""
        self.failed.clear()

    def uninstall_all(self):
        """Restore every function installed here and disarm the hook (idempotent)."""
        for path in list(self.applied):
            self.uninstall(path)
        self.routes = {ALWAYS}
        self.failed.clear()
        self.strict = False
        if not self.callbacks:
            self.disarm()

    def installed(self):
        """The patch points currently installed directly (not through another patch manager)."""
        return sorted(self.applied)

    def patch_targets(self):
        """``[(dotted path, wrapper)]`` of the table for this process, for another patch manager
        (MindSpeed's): the ALWAYS and MINDSPEED routes. Imports the target modules (those marked
        ``loaded_only`` only where imported already). A required target missing is a :class:`PatchTargetError`."""
        found, seen, missing = [], set(), []
        for target in self.table:
            if target.route == ADAPTOR or (target.loaded_only and target.module not in sys.modules):
                continue
            if target.route == MINDSPEED and (target.module.partition(".")[0] not in sys.modules
                                              or not module_exists(target.module)):
                continue  # its framework not loaded; MindSpeed's manager fails on a missing module
            try:
                module = importlib.import_module(target.module)
            except ImportError:
                if target.required and not target.module.startswith("megatron.training"):
                    missing.append(target.label)
                continue  # megatron.training: megatron-core 0.12-0.16 have none
            picked = pick(target, module)
            if picked is None:
                if target.required:
                    missing.append(target.label)
                continue
            owner, name = picked
            fn = vars(owner).get(name) if isinstance(owner, type) else None
            if fn is not None and (id(fn), target.wrapper) in seen:
                continue  # one class registered under two names (MindSpeed-LLM's GPTModel over Megatron's)
            seen.add((id(fn), target.wrapper))
            found.append((dotted_path(owner, name), target.wrapper))
        if missing:
            raise missing_error(missing)
        return found


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


class MegatronCoreMissing(SystemExit):
    """megatron-core is not installed: uncaught, the process ends with this one line on stderr and
    exit status 1 (no traceback)."""

    MESSAGE = ("mindspeed_cez: megatron-core is not installed, and the fused loss patches Megatron's: "
               "pip install megatron-core (MindSpeed-LLM 26.x pins megatron-core==0.12.1)")

    def __init__(self):
        super().__init__(self.MESSAGE)


def require_megatron_core(table):
    """Raise :class:`MegatronCoreMissing` unless ``megatron.core`` can be imported, and
    :class:`MegatronLayoutRefused` where its layout is one the patch points of ``table`` cannot serve
    (:func:`check_megatron_layout`). Imports nothing."""
    if not module_exists("megatron.core"):
        raise MegatronCoreMissing()
    check_megatron_layout(table)


def module_spec(name):
    """``name``'s module spec, each package on the way found through its parent's ``__path__``
    (imported ones read from ``sys.modules``), without running any module; None where absent."""
    path, spec = None, None
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = sys.modules.get(prefix)
        if module is not None:
            spec = getattr(module, "__spec__", None)
            path = getattr(module, "__path__", None)
        else:
            spec = _find_spec(prefix, path)
            if spec is None:
                return None
            path = spec.submodule_search_locations
        if depth < len(parts) and path is None:
            return None
    return spec


def megatron_version():
    """megatron-core's version and where it is, for messages only (decisions feature-detect): read from
    the text of ``megatron/core/package_info.py`` (a source checkout on ``PYTHONPATH`` has no
    distribution metadata), without importing Megatron."""
    spec = module_spec("megatron.core.package_info")
    where = os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))) if spec is not None and spec.origin else "?"
    try:
        text = open(spec.origin, encoding="utf-8").read()
        parts = {key: re.search(rf"^{key}\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M).group(1)
                 for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
        version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"
    except (AttributeError, OSError, TypeError):
        version = "of unknown version"
    return f"megatron-core {version} at {where}"


# Where the cross entropy's own code lives once it leaves tensor_parallel/ and fusions/ (Megatron's nightly
# documentation: megatron/core/ops/loss/cross_entropy.py and fused_cross_entropy.py, bound to the model
# once by ops.loss.backends.select_cross_entropy). Not served: no released source of these modules to check
# against. Megatron-LM's ops/loss/backends.py sits over the old homes, which the table's targets serve as they are.
MOVED_CROSS_ENTROPY = ("megatron.core.ops.loss.cross_entropy", "megatron.core.ops.loss.fused_cross_entropy")


class MegatronLayoutRefused(SystemExit):
    """This Megatron's layout is one the patch points cannot serve: uncaught, the process ends with this
    one line on stderr and exit status 1 (no traceback)."""


def check_megatron_layout(table):
    """Raise :class:`MegatronLayoutRefused`, one line naming the version, where this Megatron keeps its
    cross entropy in ``megatron/core/ops/loss`` (:data:`MOVED_CROSS_ENTROPY`) or lacks the module of a
    required megatron-core patch point of ``table`` (``.patch_points.TARGETS``). Imports nothing."""
    moved = [name for name in MOVED_CROSS_ENTROPY if module_spec(name) is not None]
    if moved:
        raise MegatronLayoutRefused(
            f"mindspeed_cez: this Megatron ({megatron_version()}) keeps its cross entropy in {moved[0]}, a layout "
            "mindspeed_cez does not serve yet (its fused loss would be bypassed): use megatron-core <= 0.20 or "
            "Megatron-LM main up to d98e8a64, or report the version")
    gone = sorted({t.module for t in table if t.required and t.route == ALWAYS
                   and t.module.startswith("megatron.core.") and module_spec(t.module) is None})
    if gone:
        raise MegatronLayoutRefused(
            f"mindspeed_cez: this Megatron ({megatron_version()}) has no {', '.join(gone)}, where mindspeed_cez "
            "patches its loss (a layout it does not serve, the fused loss would be bypassed): use megatron-core "
            "0.12 to 0.20, or report the version")
