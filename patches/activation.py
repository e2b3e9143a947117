"""Activation: the routes to the adaptor's settings, the one function they call, and the adaptor's
registration.

:func:`enable` is the one place settings become active: it turns on the runtime
(:class:`.runtime.Runtime`, everything the adaptor holds while it is on) that ``remove()`` drops. Its
routes, each building a :class:`.settings.Settings` and calling it:

* ``mindspeed_cez.patches.apply(...)`` (:func:`apply`), from its arguments;
* the flags: :func:`activate_from_flags` takes them from Megatron's parsed arguments
  (:func:`validate_flags`), called by Megatron's ``validate_args`` (:func:`validate_args_wrapper`), by
  our MindSpeed feature's ``validate_args``, or, with megatron-core alone, by the adaptor's import
  from ``sys.argv``.

Where two routes choose, one rule decides (:func:`decide`): an ``apply()`` before Megatron parses its
arguments is kept when the flags choose nothing; flags that choose differently are one error naming
both (:func:`conflict`). :func:`remove` restores Megatron's functions.

**One Settings per process.** The adaptor's import validates the command line before the script runs
(:func:`.arguments.validate_command_line`: a bad value stops the run before Megatron's imports print
their warnings) and keeps the outcome (the runtime's ``command_line``). Megatron's validation hands it on
(:func:`validate_flags`): where Megatron parsed the same flags, its Settings are the run's, not built
again. Only where Megatron's arguments differ from the command line (a script's ``args_defaults``, a
YAML config) are the Settings built from them, the command line's having been its check. ``apply()``
builds its own, once.

``import mindspeed_cez.megatron_adaptor`` calls :func:`register_adaptor`, which imports nothing of
Megatron or MindSpeed:

* **In a MindSpeed process** (once MindSpeed loads ``mindspeed.features_manager``): our feature joins
  MindSpeed's feature list; MindSpeed adds our flags to Megatron's parser, calls our validation, and
  its patch manager applies the wrappers. The MindSpeed API it uses (MindSpeed master and
  26.0.0_core_r0.12.1; ``tests/environments/mindspeed_stack/test_mindspeed_source.py`` checks it on their real
  files):
  ``MindSpeedFeature(feature_name, optimization_level)`` with ``register_args(parser)``,
  ``validate_args(args)`` (also called with a ``TransformerConfig``, so objects without our flags
  are ignored), ``register_patches(patch_manager, args)`` (``optimization_level == 0``: a default
  feature, always applied); ``MindSpeedFeaturesManager.FEATURES_LIST``;
  ``MindSpeedPatchesManager.register_patch(orig_func_name, new_func)`` (a ``new_func`` named
  ``...wrapper`` decorates the current function; the same wrapper twice is a no-op) and
  ``apply_patches()``. Our feature's wrappers are always registered and pass through to Megatron
  until the flags or ``apply()`` activate them.
* **Megatron without MindSpeed**, with ``megatron.training``: the table's wrappers, plus Megatron's
  ``parse_args`` (our flags join whatever ``extra_args_provider`` the script passes) and
  ``validate_args`` (checks the flags, then activates the fused loss). If Megatron's arguments are
  already parsed, they are read right away.
* megatron-core only (no ``megatron.training``): the flags are read from ``sys.argv``.

In every mode the ``--lm-*`` flags and ``MINDSPEED_CEZ_*`` variables on the command line are checked
at the import: a bad value ends the run with one line (exit status 2) before the script prints
anything. Without megatron-core installed, the import ends the run with one line naming
``pip install megatron-core``.
"""

import functools
import logging
import sys
import warnings

import torch

from mindspeed_cez import kernels
from mindspeed_cez.patches import arguments, launch_checks, megatron_state, reporting, runtime
from mindspeed_cez.patches import settings as _settings
from mindspeed_cez.patches.import_hook import ADAPTOR, module_exists, require_megatron_core
from mindspeed_cez.patches.settings import Settings

log = logging.getLogger(__name__)

FEATURE_NAME = "lm-z-loss"
FEATURES_MANAGER = "mindspeed.features_manager.features_manager"  # MindSpeed's, once loaded: its route


# The routes that choose settings; where two of them choose, :func:`decide` rules.
APPLY = "apply"  # an apply() (activate()) call
FLAGS = "flags"  # the parsed --lm-* flags (argv at the adaptor's import, Megatron's validate_args, MindSpeed's feature)


# ---------------------------------------------------------------------------------------------
# the routes: apply() and the flags
# ---------------------------------------------------------------------------------------------


def apply(z_loss_coeff=0.0, *, label_smoothing=None, log_z_loss=True, log_lse=False, fused_output_layer=False,
          grads="forward", logit_transform=None, backend=None, linear_backend=None, block_fraction=None,
          block_bytes=None, logit_softcap=0.0, mu_centering=False, mu_loss_coeff=0.0):
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
            :func:`mindspeed_cez.linear_cross_entropy_zloss` (no logits tensor), see :mod:`.model_context`.
        grads: the fused output layer's ``grads``: ``"forward"`` (default; gradients during the forward,
            with the loss mask as the op's ``token_weights``, where there is one) or ``"recompute"``.
        logit_transform: the ``LogitTransform`` MindSpeed-LLM's model applies to the logits, computed in
            the kernels instead (:mod:`.model_context`); None: read from Megatron's parsed arguments
            (its ``--output-multiplier-scale`` / ``--output-logit-softcapping``); False: none.
        block_bytes: ``"forward"``'s memory/time dial, the op's ``block_bytes``: the most memory one
            block of logits takes (None, with no ``block_fraction``: 4 GiB).
        block_fraction: the same dial as the op's ``block_fraction``, the share of the tokens one
            block takes (0.125 the lean setting); pass one of the two.
        backend, linear_backend: the ops' ``backend`` / ``linear_backend``; None: ``MINDSPEED_CEZ_BACKEND`` /
            ``MINDSPEED_CEZ_LINEAR_BACKEND`` where set, else automatic per device. The variables are read and
            checked as on every route (:func:`mindspeed_cez.environment.read_backends`); an argument that
            disagrees with a set variable is a ``ValueError`` naming both.
        logit_softcap: ``C > 0``: the main head's loss is of ``C * tanh(logits / C)`` (``--lm-logit-softcap``).
        mu_centering: center the output embeddings after every optimizer step (``--lm-mu-centering``).
        mu_loss_coeff: ``L > 0``: train on ``L * ||mu||**2`` of the mean output embedding (``--lm-mu-loss-coeff``).

    Runs the startup checks of the flag path (MindSpeed-LLM's modes that bypass the fused kernel,
    :func:`.arguments.check_mindspeed_llm_args`) on Megatron's parsed arguments when there are some; with
    MindSpeed-LLM loaded and no arguments parsed yet, warns once that it could not.

    Returns the active :class:`Settings`. Idempotent: a second call only replaces the settings.
    Imports nothing of Megatron; without megatron-core installed, ends the run with one line
    naming ``pip install megatron-core``.
    """
    require_megatron_core(runtime.current().patches.table)
    backend, linear_backend = _with_environment(backend=backend, linear_backend=linear_backend)
    if logit_transform is None:
        args = megatron_args()
        logit_transform = None if args is None else arguments.mindspeed_llm_logit_transform(args)
    elif logit_transform is False:
        logit_transform = None
    settings = Settings(z_loss_coeff=z_loss_coeff, label_smoothing=label_smoothing,
                        log_z_loss=log_z_loss, log_lse=log_lse, fused_output_layer=bool(fused_output_layer),
                        grads=grads, logit_transform=logit_transform, backend=backend, linear_backend=linear_backend,
                        block_fraction=block_fraction, block_bytes=block_bytes, logit_softcap=logit_softcap,
                        mu_centering=mu_centering, mu_loss_coeff=mu_loss_coeff)
    return enable(settings)


def _with_environment(**given):
    """apply()'s backends: each argument, else its variable's value (:func:`.settings.backends_from_environment`)."""
    from_environment = _settings.backends_from_environment()
    variables = {"backend": _settings.BACKEND_ENV, "linear_backend": _settings.LINEAR_BACKEND_ENV}
    for field, value in given.items():
        set_value = from_environment[field]
        if value is not None and set_value is not None and value != set_value:
            raise ValueError(f"apply({field}={value!r}) and {variables[field]}={set_value!r} disagree: "
                             "keep one (drop the argument or unset the variable)")
    return tuple(given[field] or from_environment[field] for field in ("backend", "linear_backend"))


def _check_megatron_args(settings, state):
    args = megatron_args()
    if args is not None:
        output_layer_flag = "mindspeed_cez.patches.apply(fused_output_layer=True)" if settings.fused_output_layer else None
        arguments.check_mindspeed_llm_args(
            args, f"mindspeed_cez.patches.apply(z_loss_coeff={settings.z_loss_coeff})", output_layer_flag)
    elif "mindspeed_llm" in sys.modules and state.adaptor_mode is None and state.warn_once("apply_unchecked"):
        warnings.warn(
            "mindspeed_cez.patches.apply(): MindSpeed-LLM is loaded but Megatron's arguments are not parsed "
            "yet, so its modes that bypass the fused kernel (--loss-compute-mode chunk at TP=1, "
            "--is-instruction-dataset) could not be checked: there the run would train without the "
            "z-loss. Call apply() after the arguments are parsed, or use the --lm-z-loss-coeff flag "
            "(import mindspeed_cez.megatron_adaptor), which checks them at startup", stacklevel=4)


def megatron_args():
    """Megatron's parsed arguments (``get_args()``; MindSpeed-LLM trains with the same), or None
    before they are parsed or without ``megatron.training``. Imports nothing."""
    return megatron_state.parsed_args()


def enable(settings, *, args=None):
    """The one function every route calls: ``settings`` (None: the fused loss off) made the runtime's
    (:class:`.runtime.Runtime`), after :func:`decide` reconciled them with another route's; the wrappers
    attached (now or when their modules are imported, through MindSpeed's patch manager in a MindSpeed
    process) and every required one checked. Returns the active settings.

    ``args``: Megatron's parsed arguments whose ``--lm-*`` flags gave ``settings`` (the flags' route);
    None: ``settings`` come from ``apply()`` and are run through the startup checks on Megatron's
    arguments where they are parsed.
    """
    state = runtime.current()
    settings = decide(state, settings, args)
    register_with_mindspeed()  # in a MindSpeed process its patch manager attaches the wrappers
    if registered_with_mindspeed():
        if "megatron.core" in sys.modules:
            register_patches_now()  # MindSpeed's patch manager owns the patching
    else:
        state.patches.install_patches()
    state.patches.check_attached()
    _set_active(state, settings)
    return settings


activate = enable  # the public name (mindspeed_cez.patches.activate)


def decide(state, settings, args):
    """The one rule where two routes meet: the settings to make active when ``apply()`` (``args`` None)
    or the flags of ``args`` (``settings`` None: the fused loss off) choose ``settings``, given what the
    other route chose before (``state.chosen``).

    Flags that choose nothing (no ``--lm-*`` flag set) keep an earlier ``apply()``'s settings, run
    through the startup checks on ``args``; ``apply()`` and flags that choose differently are a
    ``ValueError`` naming both (:func:`conflict`). Records the choice."""
    chosen = state.chosen
    if args is None:
        if FLAGS in chosen and differ(chosen[FLAGS], settings):
            raise ValueError(conflict(settings, chosen[FLAGS]))
        _check_megatron_args(settings, state)
        chosen[APPLY] = settings
        return settings
    explicit = settings is not None or getattr(args, "lm_fused_ce", None) is False
    if explicit:
        chosen[FLAGS] = settings
    if APPLY not in chosen:
        return settings
    applied = chosen[APPLY]
    if explicit and differ(settings, applied):
        raise ValueError(conflict(applied, settings))
    if not explicit:
        settings = applied
        arguments.check_mindspeed_llm_args(
            args, _apply_call(settings), _apply_call(settings, "fused_output_layer") if settings.fused_output_layer
            else None)
    return settings


def _set_active(state, settings):
    runtime.set_active(settings)
    reporting.report_names(settings.metrics if settings is not None else ())
    state.patches.strict = settings is not None  # active: a required patch point missing at its import fails there
    if settings is not None and settings != state.announced:
        state.announced = settings
        if launch_checks.first_process():
            print(f"mindspeed_cez: on: {settings.describe(backend_name(settings))}", flush=True)


def backend_name(settings):
    """The cross-entropy backend the ops will take on this process's device: the settings' own, else
    Triton where an accelerator is present and Triton imports, else the torch reference."""
    if settings.backend is not None:
        return settings.backend
    accelerator = torch.cuda.is_available() or bool(getattr(torch, "npu", None) and torch.npu.is_available())
    return f"auto: {'triton' if accelerator and kernels.triton_available() else 'torch'}"


def validate_flags(args):
    """The flags' Settings from Megatron's (or MindSpeed's) parsed ``args`` (:func:`.arguments.validate`),
    with the command line's validation at the adaptor's import handed on: built once per process."""
    return arguments.validate(args, runtime.current().command_line)


def activate_from_flags(args):
    """The ``--lm-*`` flags' route, from Megatron's (or MindSpeed's) validation of ``args``: their
    Settings (:func:`validate_flags`) activated; a bad value or a conflict with ``apply()`` is an
    argument error (one line, exit status 2)."""
    return _activate_flags(args, validate_flags(args))


def _activate_flags(args, settings):
    """Activate ``settings``, the flags' (validated from ``args``; None: the fused kernel off)."""
    try:
        return enable(settings, args=args)
    except arguments.FlagValueError:
        raise
    except ValueError as err:
        raise arguments.argument_error(err) from None


_COMPARED = ("z_loss_coeff", "log_lse", "logit_softcap", "mu_centering", "mu_loss_coeff", "fused_output_layer")
_COMPARED_OUTPUT_LAYER = ("grads", "block_fraction", "block_bytes")


def differ(a, b):
    """Whether settings ``a`` and ``b`` (either None: the fused loss off) configure the fused loss differently."""
    if a is None or b is None:
        return (a is None) != (b is None)
    fields = _COMPARED + (_COMPARED_OUTPUT_LAYER if a.fused_output_layer or b.fused_output_layer else ())
    return any(getattr(a, f) != getattr(b, f) for f in fields)


def _apply_call(settings, field="z_loss_coeff"):
    return f"mindspeed_cez.patches.apply({field}={getattr(settings, field)!r})"


def conflict(applied, flagged):
    """The error when ``apply()`` chose ``applied`` and the flags ``flagged``: it names both."""
    flags = arguments.FLAG_NO_FUSED if flagged is None else (
        f"{arguments.FLAG_COEFF} {flagged.z_loss_coeff}" + (f" {arguments.FLAG_LOG_LSE}" if flagged.log_lse else "")
        + (f" {arguments.FLAG_SOFTCAP} {flagged.logit_softcap:g}" if flagged.logit_softcap else "")
        + (f" {arguments.FLAG_MU_CENTERING}" if flagged.mu_centering else "")
        + (f" {arguments.FLAG_MU_LOSS} {flagged.mu_loss_coeff:g}" if flagged.mu_loss_coeff else "")
        + (f" {arguments.FLAG_OUTPUT_LAYER} {flagged.grads}" if flagged.fused_output_layer else ""))
    return (f"{_apply_call(applied)} and the flags ({flags}) configure the fused loss differently: "
            "keep one of them (drop the apply() call or the --lm-* flags)")


def remove():
    """Restore Megatron's original functions and deactivate the adaptor (idempotent).

    Patches installed through MindSpeed's patch manager stay in place but pass through to the
    functions they wrap (MindSpeed owns them); only the settings are cleared."""
    state = runtime.current()
    _set_active(state, None)
    state.patches.uninstall_all()
    runtime.replace(state.successor())  # the registrations and the warnings given stay with the process


def active_settings():
    """The active :class:`Settings`, or None (Megatron's own loss)."""
    return runtime.get_active()


# ---------------------------------------------------------------------------------------------
# megatron.training's argument hooks (the table's ADAPTOR route)
# ---------------------------------------------------------------------------------------------


def parse_args_wrapper(fn):
    """Megatron's ``parse_args``: our flags join any ``extra_args_provider`` the script gives."""

    @functools.wraps(fn)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if not any(arguments.FLAG_COEFF in a.option_strings for a in parser._actions):
                parser = arguments.add_lm_z_loss_args(parser)
            return parser

        return fn(provider, ignore_unknown_args)

    parse_args.__cez_wraps__ = fn
    return parse_args


def validate_args_wrapper(fn):
    """Megatron's ``validate_args``: our flags are checked first (:func:`validate_flags`, before
    Megatron's validation prints its arguments), then Megatron's own validation runs, then the
    settings are activated."""

    @functools.wraps(fn)
    def validate_args(args, *rest, **kwargs):
        settings = validate_flags(args)
        result = fn(args, *rest, **kwargs)
        if arguments.has_lm_z_loss_args(args):
            _activate_flags(args, settings)
        return result

    validate_args.__cez_wraps__ = fn
    return validate_args



# ---------------------------------------------------------------------------------------------
# MindSpeed's feature
# ---------------------------------------------------------------------------------------------


def make_feature_class(base):
    """Our feature as a subclass of MindSpeed's ``MindSpeedFeature`` (``base``)."""

    class LmZLossFeature(base):
        """Fused vocab-parallel LM cross entropy + z-loss (mindspeed_cez)."""

        def __init__(self):
            super().__init__(FEATURE_NAME, optimization_level=0)
            self._patches_registered = False

        def register_args(self, parser):
            arguments.add_lm_z_loss_args(parser)

        def validate_args(self, args):
            if not arguments.has_lm_z_loss_args(args):
                return  # e.g. MindSpeed validating a TransformerConfig
            if not self._patches_registered:  # MindSpeed never applied its features: do it now
                register_patches_now()
            activate_from_flags(args)

        def register_patches(self, patch_manager, args):
            self._patches_registered = True
            patches = runtime.current().patches
            direct = set(patches.installed())  # attached before MindSpeed loaded: not twice
            for path, wrapper in patches.patch_targets():
                if path not in direct:
                    patch_manager.register_patch(path, wrapper)

    return LmZLossFeature


def _mindspeed_api():
    """MindSpeed's feature base, features manager and patch manager, from its loaded modules
    (never imported here: MindSpeed imports its features manager before Megatron)."""
    from mindspeed.features_manager.feature import MindSpeedFeature
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return MindSpeedFeature, MindSpeedFeaturesManager, MindSpeedPatchesManager


def _stay_in_features_list(features_manager, feature):
    """Keep ``feature`` in the list when a framework sets a new one (MindSpeed-LLM's
    ``set_features_list`` at import replaces the list that the features are applied from)."""
    setter = features_manager.__dict__.get("set_features_list")
    if not isinstance(setter, classmethod) or getattr(setter.__func__, "__cez_wraps__", None):
        return

    def set_features_list(cls, features_list):
        setter.__func__(cls, features_list)
        if feature not in cls.FEATURES_LIST:
            cls.FEATURES_LIST.append(feature)

    set_features_list.__cez_wraps__ = setter.__func__
    features_manager.set_features_list = classmethod(set_features_list)


def register_with_mindspeed():
    """Join MindSpeed's feature list once MindSpeed loads its features manager (idempotent; imports
    nothing). Returns the feature instance once registered, else None (MindSpeed not loaded yet).

    MindSpeed's and MindSpeed-LLM's adaptors import ``mindspeed.features_manager`` first, then apply
    their pre-Megatron patches (``torch.compile`` replaced, apex / Transformer Engine stand-ins),
    then every feature's patches, ours among them (:meth:`register_patches`). Imported after such an
    adaptor (Megatron already loaded), the patches are registered and applied right away. Imported
    before MindSpeed-LLM's, the feature stays in the list MindSpeed-LLM sets. MindSpeed ignores a
    wrapper registered twice, so a later ``apply_features_patches`` is harmless.
    """
    runtime.current().patches.on_import(FEATURES_MANAGER, _join)
    return runtime.current().feature


def _join(features_manager_module):
    """Add our feature to the features manager that just loaded (or was loaded already)."""
    base, features_manager, patch_manager = _mindspeed_api()
    state = runtime.current()
    if state.feature is None:
        cls = make_feature_class(base)
        existing = [f for f in features_manager.FEATURES_LIST if type(f).__name__ == cls.__name__]
        state.feature = existing[0] if existing else cls()
    if state.feature not in features_manager.FEATURES_LIST:
        features_manager.FEATURES_LIST.append(state.feature)
    _stay_in_features_list(features_manager, state.feature)
    state.patches.manager_module = FEATURES_MANAGER  # while it is loaded, MindSpeed's patch manager attaches the table
    if "megatron.core" in sys.modules:  # MindSpeed applied its features already: ours now
        register_patches_now()


def register_patches_now():
    """(Re)register and apply our wrappers through MindSpeed's patch manager."""
    _, _, patch_manager = _mindspeed_api()
    runtime.current().feature.register_patches(patch_manager, None)
    patch_manager.apply_patches()


def registered_with_mindspeed():
    return runtime.current().feature is not None and FEATURES_MANAGER in sys.modules


# ---------------------------------------------------------------------------------------------
# the adaptor's import (mindspeed_cez.megatron_adaptor)
# ---------------------------------------------------------------------------------------------


def _arguments_parsed(args):
    if not arguments.has_lm_z_loss_args(args):
        log.warning("mindspeed_cez: Megatron's arguments were parsed before the adaptor was "
                    "imported; the --lm-* flags are not available (import it first)")
    else:
        activate_from_flags(args)


def register_adaptor(argv=None):
    """What ``import mindspeed_cez.megatron_adaptor`` does (idempotent; imports nothing of Megatron or
    MindSpeed): the command line validated (``argv``, default ``sys.argv[1:]``; a bad value: one line,
    exit 2, now) and its outcome kept for Megatron's validation to hand on (the runtime's ``command_line``), our
    MindSpeed feature registered, and the wrappers attached (with Megatron's argument hooks) or, with
    megatron-core alone, the flags' Settings activated. Returns the mode."""
    state = runtime.current()
    if state.adaptor_mode is not None:
        return mode()
    require_megatron_core(state.patches.table)
    state.command_line = arguments.validate_command_line(sys.argv[1:] if argv is None else argv)
    register_with_mindspeed()  # joins MindSpeed's features once MindSpeed loads them
    if module_exists("megatron.training"):
        state.patches.install_patches(ADAPTOR)
        args = megatron_args()
        if args is not None and (arguments.has_lm_z_loss_args(args) or not registered_with_mindspeed()):
            _arguments_parsed(args)
        state.adaptor_mode = "megatron.training"
    else:
        # megatron-core alone: the command line is the parsed flags, its Settings the run's
        _activate_flags(state.command_line.args, state.command_line.settings)
        state.adaptor_mode = "megatron.core"
    return mode()


def mode():
    """``"mindspeed"`` once our feature is in MindSpeed's list, else ``"megatron.training"`` or
    ``"megatron.core"`` (where the flags are read from)."""
    if registered_with_mindspeed():
        return "mindspeed"
    return runtime.current().adaptor_mode
