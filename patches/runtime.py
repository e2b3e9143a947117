"""The adaptor's runtime: everything it holds while it is on, in one :class:`Runtime`, and the one slot
the patched functions read it from.

Megatron, MindSpeed and the import system call the patched functions without a handle to the
adaptor, so the runtime sits in one module-level slot, :data:`RUNTIME`. Nothing else of the package
keeps module-level state besides caches keyed by immutable values
(``tests/package/test_module_state.py``).

Its life: the package's import (:mod:`mindspeed_cez.patches`) puts an off runtime in the slot, holding
the patch table; every route (the flags at the adaptor's import, Megatron's ``validate_args``,
MindSpeed's feature, ``apply()``) builds its :class:`~.settings.Settings` and calls
:func:`.activation.enable`, which turns the runtime on; ``remove()`` drops it: its patches uninstalled,
a fresh off runtime in the slot, carrying only what the process registered once (the import hook's
watches, our MindSpeed feature, the adaptor import's mode and command line) and the warnings given.

This module imports nothing of the package: every patched function reads the slot through
:func:`while_active`.
"""

import functools
import weakref


class Runtime:
    """Everything the adaptor holds while it is on.

    settings: the active :class:`~.settings.Settings`, None: off (the patched functions run Megatron's own).
    patches: the :class:`~.import_hook.PatchRegistry`: the table, what is installed, watched, failed;
        the post-import hook.
    metrics: the iteration's metric buffers (:class:`~.reporting.IterationMetrics`).
    ledger: the fused output layer's forwards that owe a backward
        (:class:`~mindspeed_cez.linear_forward_grads.ForwardGradientLedger`), checked before Megatron's gradient sync.
    chosen: ``{route: Settings or None}``: what ``apply()`` (``"apply"``) and the parsed flags
        (``"flags"``, None: the fused loss off) chose; :func:`.activation.decide` reconciles them.
    announced: the settings whose startup line was printed.
    warned: the warnings given (their keys), each once per process; warned_models: the models told that
        they hand no loss mask (each once, held weakly).
    feature, adaptor_mode, command_line: what the process registered once: our MindSpeed feature,
        the adaptor import's mode, the command line's validation at that import.
    """

    __slots__ = ("settings", "patches", "metrics", "ledger", "chosen", "announced", "warned", "warned_models", "feature",
                 "adaptor_mode", "command_line")

    def __init__(self, patches, metrics, ledger):
        self.settings = None
        self.patches = patches
        self.metrics = metrics
        self.ledger = ledger
        self.chosen = {}
        self.announced = None
        self.warned = set()
        self.warned_models = weakref.WeakSet()
        self.feature = None
        self.adaptor_mode = None
        self.command_line = None

    def successor(self):
        """A fresh, off runtime for after ``remove()``: the same patch registry (uninstalled by then),
        new metric buffers and ledger, no choices; the registrations and the warnings given carried over."""
        fresh = Runtime(self.patches, type(self.metrics)(), type(self.ledger)())
        fresh.warned, fresh.warned_models = self.warned, self.warned_models
        fresh.feature, fresh.adaptor_mode, fresh.command_line = self.feature, self.adaptor_mode, self.command_line
        return fresh

    def warn_once(self, key):
        """True the first time ``key`` is asked for (the caller gives that warning then)."""
        if key in self.warned:
            return False
        self.warned.add(key)
        return True

    def warn_once_for(self, model):
        """True the first time ``model`` is asked for (its warning given then)."""
        if model in self.warned_models:
            return False
        self.warned_models.add(model)
        return True


# Global: Megatron, MindSpeed and the import system call the patched functions without a handle to the adaptor.
RUNTIME = None


def current():
    """The runtime in the slot (the package's import put one there)."""
    return RUNTIME


def replace(runtime):
    """Put ``runtime`` in the slot (the package's import, ``remove()``); returns it."""
    global RUNTIME
    RUNTIME = runtime
    return runtime


def set_active(settings):
    """Make ``settings`` the ones the patched functions use (None: Megatron's own functions again).
    Only :func:`.activation.enable` and ``remove()`` call it."""
    RUNTIME.settings = settings


def get_active():
    """The active settings, or None."""
    runtime = RUNTIME
    return None if runtime is None else runtime.settings


def while_active(fn, active, inactive=None):
    """The replacement of ``fn``: ``active(runtime, *args, **kwargs)`` while the runtime has settings,
    else ``inactive(*args, **kwargs)`` (default ``fn``, unchanged). ``inactive`` serves a name Megatron
    binds to None (e.g. ``te_parallel_cross_entropy`` without Transformer Engine). ``__cez_wraps__``
    holds ``fn``, for the patch manager to restore it."""
    inactive = fn if inactive is None else inactive

    def replacement(*args, **kwargs):
        runtime = RUNTIME
        if runtime is None or runtime.settings is None:
            return inactive(*args, **kwargs)
        return active(runtime, *args, **kwargs)

    if fn is not None:
        functools.update_wrapper(replacement, fn)
    else:
        replacement.__name__ = replacement.__qualname__ = active.__name__
    replacement.__cez_wraps__ = fn
    return replacement
