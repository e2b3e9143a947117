"""``import mindspeed_cez.megatron_adaptor`` at the top of a pretraining script (MindSpeed style).

The import registers the adaptor and imports nothing of Megatron or MindSpeed, so it may come
before or after ``from mindspeed_llm import megatron_adaptor`` (or MindSpeed's): MindSpeed's
adaptor still runs before anything imports Megatron. Each patch attaches when its module is first
imported (:mod:`mindspeed_cez.patches.targets`); the flags are checked when Megatron validates its
arguments, and a patch that could not attach is an error there.

* **In a MindSpeed process** (once MindSpeed loads ``mindspeed.features_manager``): the feature of
  :mod:`mindspeed_cez.patches.mindspeed_feature` joins MindSpeed's feature list; MindSpeed adds our
  flags to Megatron's parser, calls our validation, and its patch manager applies the wrappers.
* **Megatron without MindSpeed**, with ``megatron.training``: the wrappers of
  ``mindspeed_cez.patches``, plus Megatron's ``parse_args`` (our flags join whatever
  ``extra_args_provider`` the script passes) and ``validate_args`` (checks the flags, then activates
  the fused loss). If Megatron's arguments are already parsed, they are read right away.
* megatron-core only (no ``megatron.training``): the flags are read from ``sys.argv``.

In every mode the ``--lm-*`` flags and ``MINDSPEED_CEZ_*`` variables on the command line are
checked at the import too: a bad value ends the run with one line (exit status 2) before the script
prints anything. Without megatron-core installed, the import ends the run with one line naming
``pip install megatron-core``.

The flags (``--lm-z-loss-coeff``, ``--lm-fused-ce``, ``--no-lm-fused-ce``,
``--lm-z-loss-log-lse``, ``--lm-fused-output-layer``, ``--lm-fused-output-layer-block-fraction``)
are described in :mod:`mindspeed_cez.patches.arguments`.
"""

import functools
import logging
import sys

from mindspeed_cez import patches
from mindspeed_cez.patches import arguments, mindspeed_feature, targets
from mindspeed_cez.patches.settings import RECORD

log = logging.getLogger(__name__)


def configure_from_args(args):
    """Activate (or deactivate) the fused loss from parsed Megatron args (the flags' route)."""
    return patches.activate_from_flags(args)


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


def _arguments_parsed(args):
    if not arguments.has_lm_z_loss_args(args):
        log.warning("mindspeed_cez: Megatron's arguments were parsed before the adaptor was "
                    "imported; the --lm-* flags are not available (import it first)")
    else:
        configure_from_args(args)


def apply_adaptor():
    """What the import does (idempotent; imports nothing of Megatron or MindSpeed). Returns the mode."""
    if RECORD.adaptor_mode is not None:
        return mode()
    targets.require_megatron_core()
    early = arguments.parse_lm_z_loss_args(sys.argv[1:])  # a bad value: one line, exit 2, now
    mindspeed_feature.register(patches.activate_from_flags)  # joins MindSpeed's features once MindSpeed loads them
    if targets.module_exists("megatron.training"):
        patches.install_patches()
        patches.install_target("megatron.training.arguments.parse_args", parse_args_wrapper)
        patches.install_target("megatron.training.arguments.validate_args", validate_args_wrapper)
        args = patches.megatron_args()
        if args is not None and (arguments.has_lm_z_loss_args(args) or not mindspeed_feature.registered_with_mindspeed()):
            _arguments_parsed(args)
        RECORD.adaptor_mode = "megatron.training"
    else:
        configure_from_args(early)
        RECORD.adaptor_mode = "megatron.core"
    return mode()


def mode():
    """``"mindspeed"`` once our feature is in MindSpeed's list, else ``"megatron.training"`` or
    ``"megatron.core"`` (where the flags are read from)."""
    if mindspeed_feature.registered_with_mindspeed():
        return "mindspeed"
    return RECORD.adaptor_mode


def __getattr__(name):
    if name == "MODE":  # read when asked: MindSpeed may load after this import
        return mode()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


apply_adaptor()
