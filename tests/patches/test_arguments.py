"""The --lm-* flags: Megatron's own parser (venv with megatron.training) and the validation hook."""

import argparse
import math
import subprocess
import sys

import pytest

from mindspeed_cez.patches import arguments
from support import TINY_MEGATRON_ARGV

BLOCK = "--lm-fused-output-layer-block-fraction"
GIB = "--lm-fused-output-layer-block-gib"


def _parse(argv):
    parser = arguments.add_lm_z_loss_args(argparse.ArgumentParser(allow_abbrev=False))
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lm-z-loss-coeff=-1e-4"], "--lm-z-loss-coeff"),
        (["--lm-z-loss-coeff", "nan"], "--lm-z-loss-coeff must be a finite number >= 0, got nan"),
        (["--lm-z-loss-coeff", "inf"], "--lm-z-loss-coeff"),
        (["--lm-z-loss-coeff", "1e-4", "--no-lm-fused-ce"], "--no-lm-fused-ce"),
        (["--lm-fused-output-layer", "--no-lm-fused-ce"], "--lm-fused-output-layer .*--no-lm-fused-ce"),
        (["--lm-fused-output-layer", BLOCK, "0"], "-block-fraction takes .* in \\(0, 1\\]"),
        (["--lm-fused-output-layer", BLOCK, "1.5"], "-block-fraction takes .*got 1.5"),
        (["--lm-fused-output-layer", "recompute", BLOCK, "0.25"],
         "-block-fraction sets the blocks of --lm-fused-output-layer forward; it has none with --lm-fused-output-layer "
         "recompute"),
        ([BLOCK, "0.25"], "none with --lm-fused-output-layer \\(off\\)"),
        # text that is no number or path: the parser keeps it, validation names the flag in one line
        (["--lm-z-loss-coeff", "abc"], "--lm-z-loss-coeff must be a finite number >= 0, got 'abc'"),
        (["--lm-fused-output-layer", "sideways"], "--lm-fused-output-layer must be one of \\('forward', 'recompute'\\), "
                                                  "got 'sideways'"),
        (["--lm-fused-output-layer", BLOCK, "half"], "-block-fraction takes .*got 'half'"),
        (["--lm-fused-output-layer", GIB, "0"], "-block-gib takes the most memory one block of logits may take, in "
                                               "GiB: a number > 0 \\(leave it out for the default, 4\\), got 0.0"),
        (["--lm-fused-output-layer", GIB, "-2"], "-block-gib takes .*got -2.0"),
        (["--lm-fused-output-layer", GIB, "2GiB"], "-block-gib takes .*got '2GiB'"),
        (["--lm-fused-output-layer", GIB, "inf"], "-block-gib takes .*got inf"),
        (["--lm-fused-output-layer", "recompute", GIB, "2"], "-block-gib sets the blocks of --lm-fused-output-layer "
                                                             "forward; it has none with --lm-fused-output-layer recompute"),
        (["--lm-fused-output-layer", GIB, "2", BLOCK, "0.5"], "-block-fraction and --lm-fused-output-layer-block-gib "
                                                              "both size the blocks: pass one of them"),
    ],
)
def test_invalid_values_fail_validation_naming_the_flag(argv, message):
    args = _parse(argv)
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        arguments.validate(args)


@pytest.mark.parametrize("env, message", [
    ({"MINDSPEED_CEZ_BACKEND": "cuda"}, "MINDSPEED_CEZ_BACKEND='cuda': choose one of \\('torch', 'triton', 'cann'\\)"),
    ({"MINDSPEED_CEZ_LINEAR_BACKEND": "cublas"}, "MINDSPEED_CEZ_LINEAR_BACKEND='cublas': choose one of"),
    ({"MINDSPEED_CEZ_BACKEND": "cann"}, "MINDSPEED_CEZ_BACKEND=cann needs torch_npu .* unset it"),
])
def test_the_launch_environment_is_checked_with_the_flags(monkeypatch, env, message):
    """With the fused kernel on, a bad kernel override in the environment fails validation like a bad
    flag (one line, exit status 2 through :func:`arguments.validate`); with it off nothing reads it."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # no torch_npu: its import fails
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        arguments.validate(_parse(["--lm-fused-ce"]))
    with pytest.raises(arguments.FlagValueError) as caught:
        arguments.validate(_parse(["--lm-z-loss-coeff", "1e-4"]))
    assert caught.value.code == 2
    assert arguments.validate(_parse([])) is None


def test_parser_errors_without_megatron_are_one_line(capsys, monkeypatch):
    """The flags read from ``sys.argv`` (megatron-core without ``megatron.training``): argparse's own
    errors too are one line and exit status 2, without the usage dump."""
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    for argv, line in ((["--lm-z-loss-coeff"], "argument --lm-z-loss-coeff: expected one argument"),
                       (["--lm-z-loss-coeff", "x1"], "--lm-z-loss-coeff must be a finite number >= 0, got 'x1'")):
        with pytest.raises(SystemExit) as caught:
            arguments.validate(arguments.parse_command_line(argv))
        assert caught.value.code == 2
        assert capsys.readouterr().err.splitlines() == [f"pretrain.py: error: {line}"]
    assert arguments.parse_command_line(["--lm-z-loss-coeff", "2e-4", "--other", "7"]).lm_z_loss_coeff == 2e-4


def test_settings_from_flags():
    assert arguments.validate(_parse([])) is None
    assert arguments.validate(_parse(["--no-lm-fused-ce"])) is None
    s = arguments.validate(_parse(["--lm-fused-ce"]))
    assert s is not None and s.z_loss_coeff == 0.0 and s.metrics == ()
    s = arguments.validate(_parse(["--lm-z-loss-coeff", "3e-4", "--lm-z-loss-log-lse"]))
    assert math.isclose(s.z_loss_coeff, 3e-4) and s.metrics == ("lm_z_loss", "lm_lse", "lm_lse_max")
    s = arguments.validate(_parse(["--lm-fused-output-layer"]))
    assert s is not None and s.fused_output_layer and s.z_loss_coeff == 0.0
    assert s.grads == "forward" and s.block_fraction is None and s.block_bytes is None
    s = arguments.validate(_parse(["--lm-fused-output-layer", BLOCK, "0.125"]))
    assert s.grads == "forward" and s.block_fraction == 0.125 and s.block_bytes is None
    s = arguments.validate(_parse(["--lm-fused-output-layer", GIB, "1.5"]))
    assert s.block_bytes == 3 << 29 and s.block_fraction is None and s.gradient_path.block_bytes == 3 << 29
    s = arguments.validate(_parse(["--lm-fused-output-layer", "recompute", "--lm-z-loss-coeff", "1e-4"]))
    assert s.fused_output_layer and s.grads == "recompute" and s.metrics == ("lm_z_loss",)
    s = arguments.validate(_parse(["--lm-z-loss-coeff", "1e-4"]))
    assert not s.fused_output_layer
    for dest, flag in (("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute"), ("use_mup", "--use-mup")):
        args = _parse(["--lm-fused-output-layer"])
        setattr(args, dest, True)  # Megatron's own flags, on its parser
        with pytest.raises(ValueError, match=f"--lm-fused-output-layer does not serve {flag}"):
            arguments.validate(args)
    # objects without the flags (MindSpeed hands TransformerConfigs to validate hooks): no settings
    assert arguments.validate(argparse.Namespace(hidden_size=8)) is None


@pytest.mark.parametrize("argv", [["--lm-fused-output-layer", "recompute", "--lm-z-loss-coeff", "1e-4"],
                                  ["--lm-fused-output-layer"], ["--lm-z-loss-coeff", "2e-4", "--lm-z-loss-log-lse"]])
def test_megatron_adaptor_activates_every_setting(argv):
    """What the flags set is what the patches run with (the flag must never be a silent no-op)."""
    from mindspeed_cez.patches import activation, runtime

    import mindspeed_cez.patches as patches

    try:
        expected = activation.activate_from_flags(_parse(argv))
        active = runtime.current().settings
        assert active is expected and expected == arguments.validate(_parse(argv)), (active, expected)
    finally:
        patches.remove()



_SCRIPT = """
import os, sys, json
os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("RANK", "0")
import mindspeed_cez.megatron_adaptor as adaptor
from megatron.training import arguments as A
from mindspeed_cez.patches import active_settings, runtime
results = []
for argv in json.loads(sys.argv[1]):
    runtime.set_active(None)
    sys.argv = ["pretrain_gpt.py"] + argv
    args = A.parse_args()
    out = {"mode": adaptor.MODE, "lm": args.lm_z_loss_coeff, "moe": args.moe_z_loss_coeff, "fused": args.lm_fused_ce}
    try:
        A.validate_args(args, {})
        s = active_settings()
        out["active"] = None if s is None else s.z_loss_coeff
    except ValueError as e:
        out["error"] = str(e)
    results.append(out)
print("RESULT" + json.dumps(results))
"""


def _run_megatron(*extras):
    import json

    argvs = [TINY_MEGATRON_ARGV + list(extra) for extra in extras]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def test_megatron_parser_takes_the_flags_and_validates():
    pytest.importorskip("megatron.training")
    on, nan, clash, off = _run_megatron(
        ["--lm-z-loss-coeff", "2e-4", "--moe-z-loss-coeff", "1e-3"],
        ["--lm-z-loss-coeff", "nan"],
        ["--lm-z-loss-coeff", "1e-4", "--no-lm-fused-ce"],
        [],
    )
    assert on["mode"] == "megatron.training"
    assert on["lm"] == pytest.approx(2e-4) and on["moe"] == pytest.approx(1e-3)  # no clash
    assert on["active"] == pytest.approx(2e-4)
    assert "--lm-z-loss-coeff" in nan["error"]
    assert "--no-lm-fused-ce" in clash["error"]
    assert off["active"] is None and off["fused"] is None  # default: Megatron's own CE


def test_flags_in_megatron_parser_help(monkeypatch):
    """Megatron builds the parser; our group is in it and renders in --help.

    (megatron-core 0.19.2's full ``--help`` output itself crashes on one of Megatron's own help
    strings, so the help of our argument group is rendered with the parser's own formatter.)"""
    A = pytest.importorskip("megatron.training.arguments")
    from mindspeed_cez.patches.activation import parse_args_wrapper

    captured = {}

    def provider(parser):
        captured["parser"] = parser
        return parser

    monkeypatch.setattr(sys, "argv", ["x"] + TINY_MEGATRON_ARGV + ["--lm-z-loss-coeff", "1e-3"])
    args = parse_args_wrapper(A.parse_args.__dict__.get("__cez_wraps__", A.parse_args))(provider)
    assert args.lm_z_loss_coeff == pytest.approx(1e-3)
    parser = captured["parser"]
    assert "--moe-z-loss-coeff" in parser._option_string_actions
    (group,) = [g for g in parser._action_groups if g.title == arguments.GROUP_TITLE]
    fmt = parser._get_formatter()
    fmt.start_section(group.title)
    fmt.add_arguments(group._group_actions)
    fmt.end_section()
    text = fmt.format_help()
    for flag in ("--lm-z-loss-coeff", "--lm-fused-ce", "--no-lm-fused-ce", "--lm-z-loss-log-lse"):
        assert flag in text, text


_APPLY_SCRIPT = """
import os, sys, json
os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("RANK", "0")
import mindspeed_cez.megatron_adaptor
from mindspeed_cez import patches
from mindspeed_cez.patches.arguments import FlagValueError
patches.apply(z_loss_coeff=1e-3)  # before Megatron is imported or its arguments parsed
out = {"megatron": [m for m in sys.modules if m.split(".")[0] == "megatron"]}
from megatron.training import arguments as A
base = json.loads(sys.argv[1])
for name, extra in (("none", []), ("same", ["--lm-z-loss-coeff", "1e-3"]), ("other", ["--lm-z-loss-coeff", "2e-3"])):
    sys.argv = ["pretrain_gpt.py"] + base + extra
    try:
        A.validate_args(A.parse_args(), {})
        out[name] = patches.active_settings().z_loss_coeff
    except FlagValueError as e:
        out[name] = "error: " + str(e)
print("RESULT" + json.dumps(out))
"""


def test_apply_before_parsing_is_kept_or_refused_by_the_flags():
    """``patches.apply()`` before Megatron parses its arguments (the adaptor imported): flags that choose
    nothing keep it (they reset it before), the same choice is served, another one is one error naming both."""
    import json

    pytest.importorskip("megatron.training")
    proc = subprocess.run([sys.executable, "-c", _APPLY_SCRIPT, json.dumps(TINY_MEGATRON_ARGV)],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    assert out["megatron"] == [] and out["none"] == 1e-3 and out["same"] == 1e-3, out
    assert out["other"] == ("error: mindspeed_cez.patches.apply(z_loss_coeff=0.001) and the flags "
                            "(--lm-z-loss-coeff 0.002) configure the fused loss differently: keep one of them "
                            "(drop the apply() call or the --lm-* flags)"), out
    assert proc.stderr.count("pretrain_gpt.py: error: ") == 1, proc.stderr[-2000:]
