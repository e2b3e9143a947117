"""Command-line flags for Megatron's argument parser, and their validation.

Flags (one argument group, shown in ``--help``):

``--lm-z-loss-coeff C``  (default 0)
    ``C > 0``: the LM loss trains on the fused kernel's ``CE + C * logsumexp(logits)**2`` per token
    (the logged ``lm loss`` stays the CE) and
    ``lm_z_loss`` is logged. Distinct from Megatron's router ``--moe-z-loss-coeff``.
``--lm-fused-ce``
    Use the fused kernel even with ``C = 0`` (plain cross entropy through the fused op).
``--no-lm-fused-ce``
    Opt out: Megatron's own cross entropy, whatever else is set (``C > 0`` is then an error).
``--lm-z-loss-log-lse``
    Also log the mean log-sum-exp as ``lm_lse`` and its maximum over the iteration's tokens as
    ``lm_lse_max``.
``--lm-fused-output-layer [recompute|forward]``
    Compute GPT's output layer and the LM loss as one op (``linear_cross_entropy_zloss``): no
    logits tensor on the training path; turns the fused loss on like ``--lm-fused-ce``.
    ``forward``: gradients made in the forward with the loss mask as token weights.
``--lm-fused-output-layer-block-fraction F``  (default: one block up to 4 GiB of logits, else 0.5)
    ``forward``'s memory/time dial: each block of token rows takes the share F of the tokens, so
    the loss works in F x the logits' memory; fewer blocks, less time (0.125: the lean setting).

Use :func:`add_lm_z_loss_args` as (or inside) Megatron's ``extra_args_provider`` and
:func:`validate_lm_z_loss_args` as a validation hook (it raises ``ValueError`` naming the flag).
Megatron's and MindSpeed's hooks call :func:`validate_flags`: a bad value there ends the run as an
argument error, one line naming the flag and exit status 2, as argparse's own errors do. The parser
takes any text for the flags' values (an unparsable number is kept as text), so that validation, not
the parser's usage dump, reports it; with the fused kernel on, validation also checks the launch
environment's ``MINDSPEED_CEZ_BACKEND`` / ``MINDSPEED_CEZ_LINEAR_BACKEND`` the same way.
"""

import argparse
import os
import sys

from mindspeed_cez.linear_cross_entropy import GRADS
from mindspeed_cez.patches import mindspeed_llm
from mindspeed_cez.patches.settings import Settings, backends_from_environment

FLAG_COEFF = "--lm-z-loss-coeff"
FLAG_FUSED = "--lm-fused-ce"
FLAG_NO_FUSED = "--no-lm-fused-ce"
FLAG_LOG_LSE = "--lm-z-loss-log-lse"
FLAG_OUTPUT_LAYER = "--lm-fused-output-layer"
OUTPUT_LAYER_GRADS = GRADS
FLAG_BLOCK_FRACTION = "--lm-fused-output-layer-block-fraction"
GROUP_TITLE = "mindspeed_cez: fused LM cross entropy + z-loss"

__all__ = ["add_lm_z_loss_args", "extra_args_provider", "validate_lm_z_loss_args", "validate_flags",
           "settings_from_args", "has_lm_z_loss_args", "FlagValueError"]


class FlagValueError(SystemExit, ValueError):
    """A bad flag value: a ``ValueError`` to code that catches one; uncaught, the process exits with
    status 2 and no traceback (a ``SystemExit``), after :func:`validate_flags` printed the one line."""

    def __init__(self, message):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def _number_or_text(text):
    """A flag's number, or its text where it is none: validation refuses that in one line naming the flag."""
    try:
        return float(text)
    except ValueError:
        return text


# One line per flag: the first sentence of its help in Megatron's --help, and the launcher's --help.
SUMMARY = {
    FLAG_COEFF: "LM-head z-loss coefficient C: trains on CE + C*logsumexp(logits)^2 with the fused kernel, logs lm_z_loss.",
    FLAG_FUSED: "Use the fused cross-entropy kernel even without z-loss.",
    FLAG_NO_FUSED: "Use Megatron's own LM cross entropy (the fused kernel stays off).",
    FLAG_LOG_LSE: "Also log the logits' mean log-sum-exp (lm_lse) and its maximum (lm_lse_max).",
    FLAG_OUTPUT_LAYER: "Compute the output layer and the loss as one fused op, without the logits tensor.",
    FLAG_BLOCK_FRACTION: "With --lm-fused-output-layer forward: each block's share of the tokens, 0 < F <= 1.",
}


def _help(flag, details=""):
    return f"{SUMMARY[flag]} {details}".strip()


def flags_help():
    """The flags as the launcher's ``--help`` lists them: one line each with its default, from the
    parser's own definitions (:func:`add_lm_z_loss_args`)."""
    parser = add_lm_z_loss_args(argparse.ArgumentParser(add_help=False))
    lines = [f"{GROUP_TITLE} (Megatron's own --help, where it works, describes them in full):"]
    for action in parser._actions:
        flag = action.option_strings[0]
        name = f"{flag} {action.metavar}" if action.metavar else flag
        if action.default is None or action.nargs == 0:
            default = "off" if action.default in (None, False) else action.default
        else:
            default = action.default
        if action.nargs == "?":
            default = f"off; alone: {action.const}"
        if flag == FLAG_BLOCK_FRACTION:
            default = "1 block up to 4 GiB of logits, else 0.5"  # None: the op's default
        lines.append(f"  {name:<44} {SUMMARY[flag]} (default: {default})")
    return "\n".join(lines)


def add_lm_z_loss_args(parser):
    """Add the flags to ``parser`` and return it (Megatron's ``extra_args_provider`` contract)."""
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        FLAG_COEFF, type=_number_or_text, default=0.0, dest="lm_z_loss_coeff", metavar="C",
        help=_help(FLAG_COEFF) + " Coefficient of the LM-head z-loss C*logsumexp(logits)^2 added to every token's cross "
             "entropy by the fused vocab-parallel kernel (in the gradient; the logged lm loss stays "
             "the cross entropy, as for Megatron's auxiliary losses); C > 0 turns the fused kernel "
             "on and logs lm_z_loss. Not the router z-loss (--moe-z-loss-coeff). Default 0 (off).",
    )
    group.add_argument(
        FLAG_FUSED, action="store_const", const=True, default=None, dest="lm_fused_ce",
        help=_help(FLAG_FUSED),
    )
    group.add_argument(
        FLAG_NO_FUSED, action="store_const", const=False, dest="lm_fused_ce",
        help=_help(FLAG_NO_FUSED),
    )
    group.add_argument(
        FLAG_LOG_LSE, action="store_true", default=False, dest="lm_z_loss_log_lse",
        help=_help(FLAG_LOG_LSE) + " Also log the mean log-sum-exp of the logits as lm_lse and its maximum over the iteration's "
             "tokens as lm_lse_max (taken from the fused kernel, no extra pass).",
    )
    group.add_argument(
        FLAG_OUTPUT_LAYER, nargs="?", const="forward", default=None, metavar="{" + ",".join(OUTPUT_LAYER_GRADS) + "}",
        dest="lm_fused_output_layer",
        help=_help(FLAG_OUTPUT_LAYER) + " Compute the GPT output layer and the LM loss (CE + z-loss) as one fused op, without the "
             "logits tensor (labels given: training and validation; logits are still made without labels). "
             "'forward' (default): the gradients are made during the forward, blocks of half the tokens "
             "(--lm-fused-output-layer-block-fraction), for the upstream gradient Megatron's schedule gives the loss "
             "mask (3 GEMMs; the weight's gradient added into its main_grad); 'recompute': backward recomputes "
             "the logits in vocab chunks (4 GEMMs; any upstream gradient).",
    )
    group.add_argument(
        FLAG_BLOCK_FRACTION, type=_number_or_text, default=None, dest="lm_fused_output_layer_block_fraction",
        metavar="F",
        help=_help(FLAG_BLOCK_FRACTION) + " With --lm-fused-output-layer forward: the share of the tokens each block of the fused output "
             "layer takes, 0 < F <= 1; the loss then works in F x the logits' memory, and each block "
             "rewrites the fp32 main_grad once (fewer blocks, less time). Default: one block while the logits "
             "take at most 4 GiB, else 0.5; 0.125: lean "
             "(docs/weight_gradient.md).",
    )
    return parser


extra_args_provider = add_lm_z_loss_args


def has_lm_z_loss_args(args):
    """True when ``args`` went through :func:`add_lm_z_loss_args` (not, e.g., a TransformerConfig)."""
    return hasattr(args, "lm_z_loss_coeff")


def validate_lm_z_loss_args(args, defaults=None):
    """Check the flags; raise ``ValueError`` naming the offending flag. Returns ``args``.

    Usable as a validation hook (``validate(args)`` or ``validate(args, defaults)``); objects
    without the flags (e.g. a TransformerConfig handed to MindSpeed's feature hooks) pass through.
    """
    if has_lm_z_loss_args(args):
        _validated_settings(args)
    return args


# The Settings fields the flags set, by the flag's name (what a bad value's error names).
FLAG_NAMES = {"z_loss_coeff": FLAG_COEFF, "label_smoothing": "--label-smoothing", "grads": FLAG_OUTPUT_LAYER,
              "block_fraction": FLAG_BLOCK_FRACTION,
              "logit_transform": "--output-multiplier-scale / --output-logit-softcapping"}


def _validated_settings(args):
    """The flags checked, each value once (:class:`Settings` with the flags' names): the Settings when
    the fused kernel is on, else None."""
    fused = getattr(args, "lm_fused_ce", None)
    on = fused_ce_enabled(args, checked=False)
    mode = getattr(args, "lm_fused_output_layer", None)
    settings = Settings(
        z_loss_coeff=args.lm_z_loss_coeff,
        label_smoothing=getattr(args, "label_smoothing", None) if on else None,
        log_z_loss=True,
        log_lse=bool(getattr(args, "lm_z_loss_log_lse", False)),
        fused_output_layer=bool(mode),
        grads=mode if mode in OUTPUT_LAYER_GRADS or mode not in (None, False, True) else "forward",
        block_fraction=getattr(args, "lm_fused_output_layer_block_fraction", None),
        logit_transform=mindspeed_llm.logit_transform(args) if on else None,
        **(backends_from_environment() if on else {}),
        names=FLAG_NAMES,
    )
    c = settings.z_loss_coeff
    if fused not in (None, True, False):
        raise ValueError(f"{FLAG_FUSED}/{FLAG_NO_FUSED}: expected a flag, got {fused!r}")
    if fused is False and c > 0:
        raise ValueError(
            f"{FLAG_COEFF}={c} needs the fused kernel, but {FLAG_NO_FUSED} turns it off; drop one of them"
        )
    if fused is False and getattr(args, "lm_z_loss_log_lse", False):
        raise ValueError(f"{FLAG_LOG_LSE} needs the fused kernel, but {FLAG_NO_FUSED} turns it off")
    if settings.block_fraction is not None and mode != "forward" and mode is not True:
        raise ValueError(f"{FLAG_BLOCK_FRACTION} sets the blocks of {FLAG_OUTPUT_LAYER} forward; it has "
                         f"none with {FLAG_OUTPUT_LAYER} {mode or '(off)'}: drop it or use forward")
    if mode:
        if fused is False:
            raise ValueError(f"{FLAG_OUTPUT_LAYER} is a fused kernel, but {FLAG_NO_FUSED} turns it off")
        for dest, flag in (("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute"),
                           ("use_mup", "--use-mup")):
            if getattr(args, dest, False):
                raise ValueError(f"{FLAG_OUTPUT_LAYER} does not serve {flag}; drop one of them")
    if not on:
        return None
    mindspeed_llm.check_args(args, _flag_turning_fused_on(args), FLAG_OUTPUT_LAYER if mode else None)
    return settings


def validate_flags(args, defaults=None):
    """:func:`validate_lm_z_loss_args` for the command line: a bad value prints
    ``SCRIPT: error: <the message naming the flag>`` and raises :class:`FlagValueError` (exit status 2)."""
    flag_settings(args)
    return args


def flag_settings(args):
    """The flags' :class:`Settings` (None: the fused kernel off), each value checked once; a bad value
    is an argument error as in :func:`validate_flags`. Objects without the flags give None."""
    if not has_lm_z_loss_args(args):
        return None
    try:
        return _validated_settings(args)
    except FlagValueError:
        raise
    except ValueError as err:
        raise argument_error(err) from None


def argument_error(err):
    """Print ``SCRIPT: error: <err>`` (one line, as argparse does) and return the
    :class:`FlagValueError` to raise (exit status 2 where uncaught)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return FlagValueError(str(err))


def _flag_turning_fused_on(args):
    if args.lm_z_loss_coeff > 0:
        return f"{FLAG_COEFF}={args.lm_z_loss_coeff}"
    if getattr(args, "lm_fused_ce", None):
        return FLAG_FUSED
    return FLAG_OUTPUT_LAYER if getattr(args, "lm_fused_output_layer", False) else FLAG_LOG_LSE


def fused_ce_enabled(args, checked=True):
    """Whether the flags turn the fused kernel on (``checked=False``: before the coefficient is checked,
    a value that is no number counts as on, so that its check runs)."""
    fused = getattr(args, "lm_fused_ce", None)
    if fused is False:
        return False
    c = args.lm_z_loss_coeff
    positive = c > 0 if checked or isinstance(c, (int, float)) else True
    return (bool(fused) or positive or bool(getattr(args, "lm_z_loss_log_lse", False))
            or bool(getattr(args, "lm_fused_output_layer", False)))


def settings_from_args(args):
    """``mindspeed_cez.patches.Settings`` for validated ``args``, or None when the kernel is off. The
    kernels' backends come from the environment (``MINDSPEED_CEZ_BACKEND``,
    ``MINDSPEED_CEZ_LINEAR_BACKEND``), unset: automatic."""
    return _validated_settings(args)


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors as one line (``PROG: error: ...``, exit status 2), without the usage dump."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise FlagValueError(message)


def parse_lm_z_loss_args(argv):
    """Parse only these flags from ``argv`` (unknown ones ignored); for tools without Megatron. A bad
    value is an argument error, one line (:func:`validate_flags`)."""
    parser = add_lm_z_loss_args(_OneLineErrorParser(add_help=False, allow_abbrev=False))
    args, _ = parser.parse_known_args(argv)
    return validate_flags(args) if isinstance(args, argparse.Namespace) else args
