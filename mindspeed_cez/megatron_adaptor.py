"""``import mindspeed_cez.megatron_adaptor`` at the top of a pretraining script (MindSpeed style).

What the import does:

* **With MindSpeed** (``mindspeed`` importable): registers the feature of
  :mod:`mindspeed_cez.patches.mindspeed_feature` with MindSpeed's feature list and patch manager.
  MindSpeed then adds our flags to Megatron's parser and calls our validation; the wrappers
  are applied by ``MindSpeedPatchesManager``.
* **Without MindSpeed**: installs the megatron-core wrappers (``mindspeed_cez.patches``; they
  pass through until configured) and, when ``megatron.training`` exists, wraps its
  ``parse_args`` (adds :func:`mindspeed_cez.patches.arguments.add_lm_z_loss_args` to whatever
  ``extra_args_provider`` the script passes) and ``validate_args`` (runs
  :func:`mindspeed_cez.patches.arguments.validate_lm_z_loss_args`, then activates the fused loss with
  the parsed flags). If Megatron's arguments are already parsed, they are read right away.
* megatron-core only (no ``megatron.training``): the flags are read from ``sys.argv``.

The flags (``--lm-z-loss-coeff``, ``--lm-fused-ce``, ``--no-lm-fused-ce``,
``--lm-z-loss-log-lse``, ``--lm-fused-output-layer``) are described in
:mod:`mindspeed_cez.patches.arguments`.
"""

import functools
import importlib.util
import logging
import sys

from mindspeed_cez import patches
from mindspeed_cez.patches import arguments, mindspeed_feature
from mindspeed_cez.patches import settings as _settings

log = logging.getLogger(__name__)

MODE = None  # "mindspeed", "megatron.training" or "megatron.core" once applied


def configure_from_args(args):
    """Activate (or deactivate) the fused loss from parsed, validated Megatron args."""
    settings = arguments.settings_from_args(args)
    if settings is None:
        _settings.set_active(None)
    else:
        patches.activate(settings)
    return settings


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
    """Megatron's ``validate_args``: our flags are checked first, then the loss is configured."""

    @functools.wraps(fn)
    def validate_args(args, *rest, **kwargs):
        arguments.validate_flags(args)
        result = fn(args, *rest, **kwargs)
        configure_from_args(args)
        return result

    validate_args.__cez_wraps__ = fn
    return validate_args


def _apply_with_mindspeed():
    mindspeed_feature.register()
    args = patches.megatron_args()
    if args is not None and arguments.has_lm_z_loss_args(args):
        configure_from_args(args)
    return "mindspeed"


def _apply_without_mindspeed():
    patches.install_patches()
    if importlib.util.find_spec("megatron.training") is not None:
        patches.install_target("megatron.training.arguments.parse_args", parse_args_wrapper)
        patches.install_target("megatron.training.arguments.validate_args", validate_args_wrapper)
        args = patches.megatron_args()
        if args is not None:
            if not arguments.has_lm_z_loss_args(args):
                log.warning("mindspeed_cez: Megatron's arguments were parsed before the adaptor was "
                            "imported; the --lm-* flags are not available (import it first)")
            else:
                configure_from_args(args)
        return "megatron.training"
    configure_from_args(arguments.parse_lm_z_loss_args(sys.argv[1:]))
    return "megatron.core"


def apply_adaptor():
    """What the import does (idempotent). Returns the mode."""
    global MODE
    if MODE is not None:
        return MODE
    if importlib.util.find_spec("mindspeed") is not None:
        try:
            MODE = _apply_with_mindspeed()
            return MODE
        except ImportError as err:  # MindSpeed present but unusable here (e.g. no torch_npu)
            log.warning("mindspeed_cez: MindSpeed found but not usable (%s); patching megatron-core directly", err)
    MODE = _apply_without_mindspeed()
    return MODE


apply_adaptor()
