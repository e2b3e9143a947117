"""What the adaptor's import refuses before Megatron parses (patches/launch_checks.py): unknown ``--lm-*``
options with the closest flag named, contradictory pairs, ``MINDSPEED_CEZ_*`` variables, flags or not;
one line from the first process, exit status 2 on every rank, also under torchrun (real processes)."""

import os
import re
import subprocess
import sys

import pytest

from mindspeed_cez.linear_cross_entropy import check_block_fraction
from mindspeed_cez.patches import arguments, launch_checks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,message", [
    (["--lm-zloss-coeff", "1e-4"], "unrecognized argument --lm-zloss-coeff: did you mean --lm-z-loss-coeff?"),
    (["--lm-z-loss=1e-4"], "unrecognized argument --lm-z-loss: did you mean --lm-z-loss-coeff?"),  # no abbreviations
    (["--x", "1", "--no-lm-fused"], "unrecognized argument --no-lm-fused: did you mean --no-lm-fused-ce?"),
    (["--lm-fused-output-layer-block-frac", "0.5"], "unrecognized argument --lm-fused-output-layer-block-frac: "
                                                    "did you mean --lm-fused-output-layer-block-fraction?"),
    (["--lm_z_loss_coeff", "1e-4"], "unrecognized argument --lm_z_loss_coeff: did you mean --lm-z-loss-coeff?"),
    (["--no_lm_fused_ce"], "unrecognized argument --no_lm_fused_ce: did you mean --no-lm-fused-ce?"),
    (["--lm-fused_ce"], "unrecognized argument --lm-fused_ce: did you mean --lm-fused-ce?"),
    (["--lm-fused-ce", "--no-lm-fused-ce"], "--lm-fused-ce and --no-lm-fused-ce contradict each other: keep one"),
    (["--no-lm-fused-ce", "--lm-z-loss-coeff", "0", "--lm-fused-ce"],
     "--lm-fused-ce and --no-lm-fused-ce contradict each other: keep one"),
])
def test_unknown_and_contradictory_flags_are_refused_in_one_line(argv, message):
    assert launch_checks.flag_error(argv, arguments.FLAGS) == message


def test_known_flags_and_the_scripts_own_options_pass():
    known = ["--lm-z-loss-coeff=1e-4", "--lm-fused-ce", "--lm-z-loss-log-lse", "--lm-fused-output-layer", "recompute",
             "--lm-fused-output-layer-block-fraction", "0.25", "--moe-z-loss-coeff", "1e-3", "--", "--lm-own-flag"]
    assert launch_checks.flag_error(known, arguments.FLAGS) is None
    far = launch_checks.flag_error(["--lm-qqqqqqqqqqqqqqqqq"], arguments.FLAGS)
    assert far.startswith("unrecognized argument --lm-qqqqqqqqqqqqqqqqq: the flags: --lm-z-loss-coeff, ")


def test_variables_are_checked_whatever_the_flags(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    for env, message in (({"MINDSPEED_CEZ_BACKEN": "torch"},
                          "unknown environment variable MINDSPEED_CEZ_BACKEN: did you mean MINDSPEED_CEZ_BACKEND?"),
                         ({"MINDSPEED_CEZ_LINEAR_BACKEND": "cublas"},
                          "MINDSPEED_CEZ_LINEAR_BACKEND='cublas': choose one of ('gemm', 'triton') (or leave it "
                          "unset: automatic)")):
        with pytest.raises(arguments.FlagValueError) as caught:
            arguments.check_launch([], env)  # no --lm-* flag at all
        assert caught.value.code == 2 and str(caught.value) == message
        assert capsys.readouterr().err.splitlines() == [f"pretrain.py: error: {message}"]
    arguments.check_launch(["--lm-fused-ce"], {"MINDSPEED_CEZ_BACKEND": "torch", "PATH": "/bin"})


@pytest.mark.parametrize("env,first", [({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True),
                                       ({"RANK": "3", "LOCAL_RANK": "0"}, False), ({"LOCAL_RANK": "1"}, False),
                                       ({"LOCAL_RANK": "0"}, True), ({"RANK": ""}, True)])
def test_the_first_process_prints(env, first, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    assert launch_checks.first_process(env) is first
    assert launch_checks.report("m", env) == "pretrain.py: error: m"  # no TORCHELASTIC_RUN_ID: no wait
    assert capsys.readouterr().err == ("pretrain.py: error: m\n" if first else "")


def test_the_block_fraction_error_names_values_a_user_can_type():
    with pytest.raises(ValueError) as caught:
        check_block_fraction(2.0, "--lm-fused-output-layer-block-fraction")
    assert "None" not in str(caught.value) and "a number in (0, 1]" in str(caught.value), caught.value
    with pytest.raises(ValueError) as caught:
        check_block_fraction(2.0)  # the op's argument: None is a value there
    assert "None" in str(caught.value)


def _run(command, env=None, timeout=300):
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "pretrain.py"
    path.write_text("print('ran')\n")
    return path


@pytest.mark.parametrize("how", ["launcher", "import"])
def test_a_typo_or_a_bad_variable_stops_the_process_before_the_script(script, how):
    """The launcher, or the import in the script: exit status 2, the one line and nothing else."""
    cases = [(["--lm-zloss-coeff", "1e-4"], {},
              "unrecognized argument --lm-zloss-coeff: did you mean --lm-z-loss-coeff?"),
             (["--lm_z_loss_coeff", "1e-4"], {},
              "unrecognized argument --lm_z_loss_coeff: did you mean --lm-z-loss-coeff?"),
             ([], {"MINDSPEED_CEZ_BACKEND": "cuda"},
              "MINDSPEED_CEZ_BACKEND='cuda': choose one of ('torch', 'triton', 'cann') (or leave it unset: automatic)"),
             (["--lm-fused-output-layer", "--lm-fused-output-layer-block-fraction", "2"], {}, None)]
    for extra, env, message in cases:
        if how == "launcher":
            proc = _run(["-m", "mindspeed_cez.launch", str(script), *extra], env)
        else:
            script.write_text("import mindspeed_cez.megatron_adaptor\nprint('ran')\n")
            proc = _run([str(script), *extra], env)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        if message is None:  # the block fraction: values a user can type, no None
            (line,) = proc.stderr.splitlines()
            assert line.startswith("pretrain.py: error: --lm-fused-output-layer-block-fraction ") and "None" not in line
            continue
        assert proc.stderr.splitlines() == [f"pretrain.py: error: {message}"], proc.stderr


@pytest.mark.slow
def test_under_torchrun_the_line_appears_once_and_every_rank_exits_2(script):
    """torchrun with 2 ranks: the line once (rank 0), each rank torchrun reports exited with status 2
    (its summary's exitcodes, each naming the line), no rank's traceback. torchrun itself then prints its own failure
    report (its traceback of torch/distributed/run.py) and exits with status 1: that is torchrun's, for
    any rank that exits non-zero, and what the README tells users they will see."""
    proc = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mindspeed_cez.launch", str(script),
                 "--lm-zloss-coeff", "1e-4"], timeout=240)
    line = "pretrain.py: error: unrecognized argument --lm-zloss-coeff: did you mean --lm-z-loss-coeff?"
    out = proc.stdout + proc.stderr
    assert out.splitlines().count(line) == 1, out
    assert "ran" not in proc.stdout.splitlines(), out
    # torchrun's summary lists the ranks it saw fail: both (torch 2.13), or the first while it stops the
    # other (torch 2.7.1: "<NO_OTHER_FAILURES>"); each listed rank exited with status 2, naming the line
    codes = re.findall(r"^\s+exitcode\s+: (-?\d+)", out, re.M)
    assert codes and set(codes) == {"2"}, out
    assert out.count(f"traceback : {line}") == len(codes), out
    assert out.count("Traceback (most recent call last)") == 1, out  # torchrun's own, no rank's
    tail = out[out.index("Traceback (most recent call last)"):]
    assert "torch/distributed/run.py" in tail and "mindspeed_cez" not in tail.split("ChildFailedError")[0], out
    assert proc.returncode == 1, out
