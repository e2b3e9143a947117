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
``--lm-fused-output-layer-block-gib G``  (default 4)
    ``forward``'s memory/time dial: one block of token rows holds at most G GiB of logits, whatever
    the sequence length; fewer blocks, less time (each block beyond the first rewrites ``main_grad``).
``--lm-fused-output-layer-block-fraction F``
    The same dial as a share of the tokens: each block takes F of them, so the loss works in F x
    the logits' memory (0.125: lean). One of the two.
``--lm-logit-softcap C``  (default 0: off)
    The main head's loss is of ``C * tanh(logits / C)``, computed in the kernels (Gemma's soft cap);
    the model's logits themselves stay uncapped (apply the cap at inference too). MindSpeed-LLM's
    ``--output-logit-softcapping`` must then be unset or the same ``C``. Logs ``lm_lse`` / ``lm_lse_max``.
``--lm-mu-centering``
    Output embedding centering (:mod:`.mean_embedding`): after every optimizer step the output weight's
    master copy loses its mean row over the vocabulary. Logs ``lm_mu_norm``.
``--lm-mu-loss-coeff L``  (default 0: off)
    Train on ``L * ||mu||**2`` of the mean output embedding ``mu`` too, once per step (mu-loss; 1e-4 in
    the paper). Logs ``lm_mu_norm``.

Each of the three turns the fused kernel on, as ``--lm-fused-ce`` does, and combines with ``--lm-z-loss-coeff``.

Use :func:`add_lm_z_loss_args` as (or inside) Megatron's ``extra_args_provider``. :func:`validate` is
the one validation: it checks every flag once and builds the run's :class:`.settings.Settings` from
them (None: the fused kernel off); a bad value is an argument error, one line naming the flag and exit
status 2, as argparse's own errors do (a :class:`FlagValueError`, which is also a ``ValueError``).
The adaptor's import runs it on the command line (:func:`validate_command_line`), so that a bad value
stops the run before the script prints anything, and hands its outcome to Megatron's validation, which
builds nothing again where Megatron parsed the same flags: one :class:`.settings.Settings` per process. The
parser takes any text for the flags' values (an unparsable number is kept as text), so that
validation, not the parser's usage dump, reports it; with the fused kernel on, validation also checks
the launch environment's ``MINDSPEED_CEZ_BACKEND`` / ``MINDSPEED_CEZ_LINEAR_BACKEND`` the same way, and
MindSpeed-LLM's flags (:func:`check_mindspeed_llm_args`, :func:`mindspeed_llm_logit_transform`).
"""

import argparse
import os
from typing import NamedTuple, Optional

from mindspeed_cez.kernels import LogitTransform
from mindspeed_cez.kernels.chunked_linear import LOGITS_BUDGET_BYTES
from mindspeed_cez.linear_cross_entropy import GRADS
from mindspeed_cez.patches import launch_checks
from mindspeed_cez.patches.settings import Settings, backends_from_environment

FLAG_COEFF = "--lm-z-loss-coeff"
FLAG_FUSED = "--lm-fused-ce"
FLAG_NO_FUSED = "--no-lm-fused-ce"
FLAG_LOG_LSE = "--lm-z-loss-log-lse"
FLAG_OUTPUT_LAYER = "--lm-fused-output-layer"
OUTPUT_LAYER_GRADS = GRADS
FLAG_BLOCK_FRACTION = "--lm-fused-output-layer-block-fraction"
FLAG_BLOCK_GIB = "--lm-fused-output-layer-block-gib"
FLAG_SOFTCAP = "--lm-logit-softcap"
FLAG_MU_CENTERING = "--lm-mu-centering"
FLAG_MU_LOSS = "--lm-mu-loss-coeff"
GROUP_TITLE = "mindspeed_cez: fused LM cross entropy + z-loss"

__all__ = ["add_lm_z_loss_args", "extra_args_provider", "validate", "validate_command_line", "has_lm_z_loss_args",
           "FlagValueError"]


class FlagValueError(SystemExit, ValueError):
    """A bad flag value: a ``ValueError`` to code that catches one; uncaught, the process exits with
    status 2 and no traceback (a ``SystemExit``), after :func:`validate` printed the one line."""

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
    FLAG_BLOCK_GIB: "With --lm-fused-output-layer forward: the most logits one block holds, in GiB.",
    FLAG_BLOCK_FRACTION: "With --lm-fused-output-layer forward: each block's share of the tokens, 0 < F <= 1.",
    FLAG_SOFTCAP: "Soft-cap the main head's logits in the loss, C*tanh(x/C) (0: off); logs lm_lse, lm_lse_max.",
    FLAG_MU_CENTERING: "Center the output embeddings (subtract their mean row) after every optimizer step; "
                       "logs lm_mu_norm.",
    FLAG_MU_LOSS: "Train on L*||mu||^2 of the mean output embedding mu too (mu-loss; 0: off); logs lm_mu_norm.",
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
        if flag == FLAG_BLOCK_GIB:
            default = LOGITS_BUDGET_BYTES >> 30  # None: the op's default
        if flag == FLAG_BLOCK_FRACTION:
            default = f"off; {FLAG_BLOCK_GIB} sizes the blocks"
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
             "'forward' (default): the gradients are made during the forward, in blocks of at most 4 GiB of logits "
             "(--lm-fused-output-layer-block-gib), for the upstream gradient Megatron's schedule gives the loss "
             "mask (3 GEMMs; the weight's gradient added into its main_grad); 'recompute': backward recomputes "
             "the logits in vocab chunks (4 GEMMs; any upstream gradient).",
    )
    group.add_argument(
        FLAG_BLOCK_GIB, type=_number_or_text, default=None, dest="lm_fused_output_layer_block_gib", metavar="G",
        help=_help(FLAG_BLOCK_GIB) + " With --lm-fused-output-layer forward: the fused output layer takes the tokens in "
             "blocks whose logits take at most G GiB (default 4), whatever the sequence length, micro-batch or TP: "
             "its memory stays bounded; each block beyond the first rewrites the fp32 main_grad once (fewer "
             "blocks, less time; docs/weight_gradient.md).",
    )
    group.add_argument(
        FLAG_BLOCK_FRACTION, type=_number_or_text, default=None, dest="lm_fused_output_layer_block_fraction",
        metavar="F",
        help=_help(FLAG_BLOCK_FRACTION) + " With --lm-fused-output-layer forward: the share of the tokens each block of the fused output "
             "layer takes, 0 < F <= 1; the loss then works in F x the logits' memory, and each block "
             "rewrites the fp32 main_grad once (fewer blocks, less time); 0.125: lean. Off by default "
             f"({FLAG_BLOCK_GIB} sizes the blocks); one of the two (docs/weight_gradient.md).",
    )
    group.add_argument(
        FLAG_SOFTCAP, type=_number_or_text, default=0.0, dest="lm_logit_softcap", metavar="C",
        help=_help(FLAG_SOFTCAP) + " The loss (training and validation) is of C*tanh(logits/C) on the main head, "
             "computed in the fused kernels; the model's logits are not changed, so apply the same cap when "
             "sampling from the model. MindSpeed-LLM's --output-logit-softcapping, where set, must be the same C.",
    )
    group.add_argument(
        FLAG_MU_CENTERING, action="store_true", default=False, dest="lm_mu_centering",
        help=_help(FLAG_MU_CENTERING) + " Output embedding centering (mu-centering, arXiv 2601.02031): after each "
             "optimizer step the output weight's fp32 master copy becomes W - mean_v(W) (with tied embeddings "
             "the input embedding too).",
    )
    group.add_argument(
        FLAG_MU_LOSS, type=_number_or_text, default=0.0, dest="lm_mu_loss_coeff", metavar="L",
        help=_help(FLAG_MU_LOSS) + " mu-loss (arXiv 2601.02031; the paper's 1e-4): L*||mean_v(W)||^2 of the output "
             "weight W enters the gradient once per step, not the logged lm loss.",
    )
    return parser


extra_args_provider = add_lm_z_loss_args


def has_lm_z_loss_args(args):
    """True when ``args`` went through :func:`add_lm_z_loss_args` (not, e.g., a TransformerConfig)."""
    return hasattr(args, "lm_z_loss_coeff")


# The Settings fields the flags set, by the flag's name (what a bad value's error names).
FLAG_NAMES = {"z_loss_coeff": FLAG_COEFF, "label_smoothing": "--label-smoothing", "grads": FLAG_OUTPUT_LAYER,
              "block_fraction": FLAG_BLOCK_FRACTION, "block_bytes": FLAG_BLOCK_GIB,
              "logit_transform": "--output-multiplier-scale / --output-logit-softcapping",
              "logit_softcap": FLAG_SOFTCAP, "mu_centering": FLAG_MU_CENTERING, "mu_loss_coeff": FLAG_MU_LOSS}


class Validated(NamedTuple):
    """A validation's outcome, kept to be handed on: the flags (``args``), the :class:`Settings`
    keyword arguments they gave (as parsed, before any check) and the :class:`Settings` built from
    them (None: the fused kernel off)."""

    args: argparse.Namespace
    inputs: dict
    settings: Optional[Settings]


def _settings_inputs(args):
    """The :class:`Settings` keyword arguments ``args`` give, as parsed (nothing checked yet)."""
    on = fused_ce_enabled(args, checked=False)
    mode = getattr(args, "lm_fused_output_layer", None)
    return dict(
        z_loss_coeff=args.lm_z_loss_coeff,
        label_smoothing=getattr(args, "label_smoothing", None) if on else None,
        log_z_loss=True,
        log_lse=bool(getattr(args, "lm_z_loss_log_lse", False)),
        fused_output_layer=bool(mode),
        grads=mode if mode in OUTPUT_LAYER_GRADS or mode not in (None, False, True) else "forward",
        block_fraction=getattr(args, "lm_fused_output_layer_block_fraction", None),
        block_bytes=_gib_to_bytes(getattr(args, "lm_fused_output_layer_block_gib", None)),
        logit_transform=mindspeed_llm_logit_transform(args) if on else None,
        logit_softcap=getattr(args, "lm_logit_softcap", 0.0),
        mu_centering=bool(getattr(args, "lm_mu_centering", False)),
        mu_loss_coeff=getattr(args, "lm_mu_loss_coeff", 0.0),
        **(backends_from_environment() if on else {}),
    )


def _gib_to_bytes(gib):
    """The flag's GiB as bytes where it is a number > 0 (else as given: validation names the flag)."""
    if isinstance(gib, float) and 0 < gib < float("inf"):
        return max(1, int(gib * (1 << 30)))
    return gib


def _check_flag_pairs(args, settings):
    """The flags that contradict each other (their values checked already, by ``settings``)."""
    fused = getattr(args, "lm_fused_ce", None)
    mode = getattr(args, "lm_fused_output_layer", None)
    c = settings.z_loss_coeff
    if fused not in (None, True, False):
        raise ValueError(f"{FLAG_FUSED}/{FLAG_NO_FUSED}: expected a flag, got {fused!r}")
    if fused is False and c > 0:
        raise ValueError(
            f"{FLAG_COEFF}={c} needs the fused kernel, but {FLAG_NO_FUSED} turns it off; drop one of them"
        )
    if fused is False and getattr(args, "lm_z_loss_log_lse", False):
        raise ValueError(f"{FLAG_LOG_LSE} needs the fused kernel, but {FLAG_NO_FUSED} turns it off")
    for value, flag in ((settings.block_fraction, FLAG_BLOCK_FRACTION), (settings.block_bytes, FLAG_BLOCK_GIB)):
        if value is not None and mode != "forward" and mode is not True:
            raise ValueError(f"{flag} sets the blocks of {FLAG_OUTPUT_LAYER} forward; it has "
                             f"none with {FLAG_OUTPUT_LAYER} {mode or '(off)'}: drop it or use forward")
    if mode and fused is False:
        raise ValueError(f"{FLAG_OUTPUT_LAYER} is a fused kernel, but {FLAG_NO_FUSED} turns it off")
    for on, flag in ((settings.logit_softcap, FLAG_SOFTCAP), (settings.mu_centering, FLAG_MU_CENTERING),
                     (settings.mu_loss_coeff, FLAG_MU_LOSS)):
        if on and fused is False:
            raise ValueError(f"{flag} works through the fused kernel, but {FLAG_NO_FUSED} turns it off; drop one of them")


def _check_with_other_flags(args):
    """The flags against Megatron's and MindSpeed-LLM's own (none of which the command line check at the
    adaptor's import reads: they exist once Megatron parsed its arguments)."""
    mode = getattr(args, "lm_fused_output_layer", None)
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    if getattr(args, "lm_mu_centering", False) and tied and (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        # the first stage's copy of the tied embedding is not reached (only the last stage's loss marks weights)
        raise ValueError(f"{FLAG_MU_CENTERING} with tied embeddings serves one pipeline stage; with "
                         "--pipeline-model-parallel-size > 1 use --untie-embeddings-and-output-weights or "
                         f"{FLAG_MU_LOSS}")
    if mode:
        for dest, flag in (("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute"),
                           ("use_mup", "--use-mup")):
            if getattr(args, dest, False):
                raise ValueError(f"{FLAG_OUTPUT_LAYER} does not serve {flag}; drop one of them")
        if getattr(args, "use_megatron_fsdp", False) and getattr(args, "megatron_fsdp_version", 1) == 2:
            raise ValueError(f"{FLAG_OUTPUT_LAYER} does not serve --megatron-fsdp-version 2 (its parameters are "
                             "not Megatron-FSDP v1's, whose weight-gradient path the flag follows): use "
                             f"--megatron-fsdp-version 1 or drop {FLAG_OUTPUT_LAYER}")
        message = output_logit_dtype_error(args)
        if message:
            raise ValueError(message)
    if fused_ce_enabled(args):
        check_mindspeed_llm_args(args, _flag_turning_fused_on(args), FLAG_OUTPUT_LAYER if mode else None)


# Megatron's --output-logit-dtype (dest ``logit_dtype``: its choices' names, a torch.dtype once
# Megatron's validate_args mapped them), and the parameters' dtype its flags set.
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def output_logit_dtype_error(args):
    """The refusal of Megatron's ``--output-logit-dtype`` (the output layer's ``output_dtype``, Megatron
    main / 0.20) beside the fused output layer, or None. That layer makes no logits tensor whose dtype the
    flag could set: it is served where it sets the dtype the logits have anyway (the parameters')."""
    wanted = getattr(args, "logit_dtype", None)
    if wanted is None:
        return None
    wanted = _DTYPE_NAMES.get(str(wanted).replace("torch.", ""), str(wanted))
    params = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    if wanted == params:
        return None
    return (f"{FLAG_OUTPUT_LAYER} makes no logits tensor, so --output-logit-dtype {wanted} (with {params} "
            f"parameters) is not served: drop --output-logit-dtype or {FLAG_OUTPUT_LAYER}")


def _default_inputs():
    """The inputs of the flags at their parser defaults. With the fused kernel off, any other value is an
    error (a bad value, or a flag that needs the kernel beside --no-lm-fused-ce): only then are Settings
    built, to name it."""
    return _settings_inputs(add_lm_z_loss_args(argparse.ArgumentParser(add_help=False)).parse_args([]))


def _validated(args, checked=None):
    inputs = _settings_inputs(args)
    if checked is not None and checked.inputs == inputs:
        settings = checked.settings  # the same flags, checked already: handed on, not built again
    elif not fused_ce_enabled(args, checked=False) and inputs == _default_inputs():
        settings = None  # the fused kernel off, every flag at its default: nothing to check, nothing built
    else:
        settings = Settings(**inputs, names=FLAG_NAMES)  # each value checked once, named by its flag
        _check_flag_pairs(args, settings)
        if not fused_ce_enabled(args):
            settings = None
    _check_with_other_flags(args)
    return Validated(args, inputs, settings)


def validate(args, checked=None):
    """The one validation of the flags: the run's :class:`Settings` from Megatron's (or MindSpeed's)
    parsed ``args``, each value checked once, or None where the fused kernel is off (and for objects
    without the flags, e.g. a TransformerConfig). A bad value prints ``SCRIPT: error: <the message
    naming the flag>`` and raises :class:`FlagValueError` (exit status 2 where uncaught).

    ``checked``: the command line's :class:`Validated` (:func:`validate_command_line`, at the adaptor's
    import). Where ``args`` give the same inputs (Megatron parsed the same command line), its Settings
    are returned as they are: built once per process, each value checked once. Where they differ (a
    script's ``args_defaults``, a YAML config), the Settings are built from ``args``: those are the
    run's, the command line's were its check. Either way the flags are then checked against Megatron's
    and MindSpeed-LLM's own."""
    if not has_lm_z_loss_args(args):
        return None
    try:
        return _validated(args, checked).settings
    except FlagValueError:
        raise
    except ValueError as err:
        raise argument_error(err) from None


def validate_command_line(argv):
    """The adaptor's import check of the command line ``argv``, before the script runs (its ``import
    megatron`` prints Megatron's warnings first): what :func:`check_launch` checks, then the flags'
    values (:func:`validate` on :func:`parse_command_line`'s flags). Returns the :class:`Validated` that
    Megatron's validation hands on (:func:`validate`'s ``checked``); an error is one line, exit status 2."""
    args = parse_command_line(argv)
    try:
        return _validated(args)
    except FlagValueError:
        raise
    except ValueError as err:
        raise argument_error(err) from None


def argument_error(err):
    """Print ``SCRIPT: error: <err>`` (one line, as argparse does) and return the
    :class:`FlagValueError` to raise (exit status 2 where uncaught)."""
    launch_checks.report(err)  # from the first process only: a torchrun shows it once
    return FlagValueError(str(err))


def _flag_turning_fused_on(args):
    if args.lm_z_loss_coeff > 0:
        return f"{FLAG_COEFF}={args.lm_z_loss_coeff}"
    if getattr(args, "lm_fused_ce", None):
        return FLAG_FUSED
    for dest, flag in _TURNING_ON:
        if _positive(getattr(args, dest, 0)):
            return flag
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
            or bool(getattr(args, "lm_fused_output_layer", False))
            or any(_positive(getattr(args, dest, 0)) for dest, _ in _TURNING_ON))


# The mitigations' flags, each of which turns the fused kernel on (their dests, their names).
_TURNING_ON = (("lm_logit_softcap", FLAG_SOFTCAP), ("lm_mu_centering", FLAG_MU_CENTERING),
               ("lm_mu_loss_coeff", FLAG_MU_LOSS))


def _positive(value):
    """A flag's value that turns it on: True, a number other than 0, or text (which its check then refuses)."""
    return value is True or isinstance(value, str) or (isinstance(value, (int, float)) and value != 0)


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors as one line (``PROG: error: ...``, exit status 2), without the usage dump."""

    def error(self, message):
        raise argument_error(message)


def _float_or_none(text):
    try:
        return float(text)
    except ValueError:
        return None  # not ours to refuse: MindSpeed-LLM's parser does


# MindSpeed-LLM's flags that enter the Settings (its logit transform): read from the command line too, so
# that the Settings built at the adaptor's import are the run's (validate() hands them on).
MINDSPEED_LLM_LOGIT_FLAGS = ("--output-multiplier-scale", "--output-logit-softcapping")


def parse_command_line(argv):
    """Only these flags of ``argv`` (unknown ones ignored), as a Namespace, with MindSpeed-LLM's
    :data:`MINDSPEED_LLM_LOGIT_FLAGS` where given (None where they are no number: MindSpeed-LLM's own
    parser refuses those); for tools without Megatron's parser (megatron-core alone) and the adaptor's
    check of the command line at its import. A value the parser refuses is an argument error, one
    line; :func:`validate` checks the values."""
    check_launch(argv)
    parser = add_lm_z_loss_args(_OneLineErrorParser(add_help=False, allow_abbrev=False))
    for flag in MINDSPEED_LLM_LOGIT_FLAGS:
        parser.add_argument(flag, type=_float_or_none, default=None, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    return args


# ---------------------------------------------------------------------------------------------
# MindSpeed-LLM's flags (read at Ascend/MindSpeed-LLM v26.0.0 and master)
# ---------------------------------------------------------------------------------------------
# * ``--output-multiplier-scale`` / ``--output-logit-softcapping``: its GPTModel forward scales and
#   soft-caps the logits; with the fused loss those ops are recorded and computed in the loss kernels
#   (``Settings.logit_transform``, :mod:`.model_context`).
# * ``--loss-compute-mode chunk`` at TP=1 and CP=1 computes the loss with ``F.cross_entropy`` per chunk
#   of hidden states, never through ``compute_language_model_loss``; ``--is-instruction-dataset``
#   shifts the labels inside the forward, into a tensor the adaptor cannot tell from an MTP head's.
#   Both are refused with the fused kernel on rather than silently trained without z-loss.
# * ``--add-output-layer-bias`` changes the output layer itself: refused with ``--lm-fused-output-layer``.
#   (``--output-layer-slice-num`` needs no check: MindSpeed-LLM's own validation resets it to 1.)


def mindspeed_llm_logit_transform(args):
    """The ``LogitTransform`` MindSpeed-LLM's forward applies to the logits before the loss (its
    ``--output-multiplier-scale`` / ``--output-logit-softcapping``), or None for neither."""
    scale = getattr(args, "output_multiplier_scale", None)
    cap = getattr(args, "output_logit_softcapping", None)
    if not (scale or cap):
        return None
    return LogitTransform(scale=scale or 1.0, cap=cap or 0.0)


def check_mindspeed_llm_args(args, fused_flag, output_layer_flag=None):
    """Raise ``ValueError`` for MindSpeed-LLM modes the fused kernel cannot serve. ``fused_flag`` names
    what turned the kernel on; ``output_layer_flag`` what turned the fused output layer on (None:
    off). Arguments without MindSpeed-LLM's flags pass."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    if getattr(args, "loss_compute_mode", "default") == "chunk" and tp == 1 and cp == 1:
        raise ValueError(
            f"{fused_flag} and MindSpeed-LLM's --loss-compute-mode chunk: at TP=1 and CP=1 the chunked loss "
            "is plain F.cross_entropy and never reaches the fused kernel (no z-loss would be trained); "
            "drop one of them (chunk mode at TP>1 falls back to the regular loss, which is served)"
        )
    if output_layer_flag:
        # its GPTModel forward swaps the output layer for one the fused op does not stand in for
        # (its scaling and soft cap of the logits are served: .logit_transform)
        if getattr(args, "add_output_layer_bias", False):
            raise ValueError(
                f"{output_layer_flag} and MindSpeed-LLM's --add-output-layer-bias: the fused op computes the "
                "logits of hidden @ weight.T itself, so the bias would be lost; drop one of them")
    if getattr(args, "is_instruction_dataset", False):
        raise ValueError(
            f"{fused_flag} and MindSpeed-LLM's --is-instruction-dataset: that path shifts the labels inside "
            "the model's forward, which this adaptor does not serve; drop one of them"
        )


FLAGS = (FLAG_COEFF, FLAG_FUSED, FLAG_NO_FUSED, FLAG_LOG_LSE, FLAG_OUTPUT_LAYER, FLAG_BLOCK_GIB, FLAG_BLOCK_FRACTION,
         FLAG_SOFTCAP, FLAG_MU_CENTERING, FLAG_MU_LOSS)


def check_launch(argv, environ=None):
    """What the adaptor's import checks whatever the flags turn on (:mod:`.launch_checks`): an unknown
    ``--lm-*`` option or underscore spelling (the closest flag named), ``--lm-fused-ce`` with
    ``--no-lm-fused-ce``, and the ``MINDSPEED_CEZ_*`` variables as every route checks them
    (:func:`mindspeed_cez.environment.read_backends`). Each is an argument error (one line, exit 2)."""
    environ = os.environ if environ is None else environ
    message = launch_checks.flag_error(argv, FLAGS)
    if message is None:
        try:
            backends_from_environment(environ)
        except ValueError as err:
            message = str(err)
    if message is not None:
        raise argument_error(message)
