"""The main job (examples/train_tiny_moe.py, README command 1) as a user launches it, in real processes:
z-loss from the flag through ``python -m mindspeed_cez.launch``, Megatron's log lines, the plot."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "examples", "train_tiny_moe.py")

pytest.importorskip("matplotlib")
pytest.importorskip("megatron.core")


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_the_flag_turns_z_loss_on_in_megatron_log_lines(tmp_path):
    proc = _run(["-m", "mindspeed_cez.launch", DEMO, "--lm-z-loss-coeff", "1e-2", "--quick", "--out", str(tmp_path)],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = proc.stdout.split("== run: ")[1:]
    assert [run.splitlines()[0].split(",")[0] for run in runs] == ["without z-loss (for comparison)",
                                                                   "--lm-z-loss-coeff 0.01"]
    line = re.compile(r"^ iteration +(\d+)/ +6 \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): [\d.]+ \|"
                      r" learning rate: 3\.000000E-03 \| global batch size: +4 \| lm loss: (\S+) \|")
    for run, z_loss in zip(runs, (False, True)):
        logs = [row for row in run.splitlines() if line.match(row)]
        assert [int(line.match(row).group(1)) for row in logs] == list(range(1, 7))
        assert all((" lm_z_loss: " in row) == z_loss for row in logs), logs
    z_values = [float(re.search(r" lm_z_loss: (\S+) \|", row).group(1)) for row in runs[1].splitlines()
                if line.match(row)]
    assert all(0 < value < 1 for value in z_values)  # c * mean(lse^2), lse ~ 6 for vocab 512: ~0.39
    assert os.path.getsize(tmp_path / "tiny_moe_zloss.png") > 10_000
    assert re.search(r"^c=0\.01: final lm loss [\d.]+, lm_z_loss [1-9]", proc.stdout, re.M)


@pytest.mark.parametrize("args,message", [
    (["-m", "mindspeed_cez.launch", DEMO], "train_tiny_moe.py: error: --lm-z-loss-coeff C > 0 is what this demo "
                                           "shows: add --lm-z-loss-coeff 1e-2"),
    ([DEMO, "--lm-z-loss-coeff", "1e-2"], "train_tiny_moe.py: error: launch it as a Megatron script: python -m "
                                          "mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2"),
    (["-m", "mindspeed_cez.launch", DEMO, "--lm_z_loss_coeff", "1e-2"],
     "train_tiny_moe.py: error: unrecognized argument --lm_z_loss_coeff: did you mean --lm-z-loss-coeff?"),
    (["-m", "mindspeed_cez.launch", DEMO, "--lm-z-loss-coeff", "-1"], None),
    (["-m", "mindspeed_cez.launch", DEMO, "--lm-z-loss-coeff", "1e-2", "--iter", "3"],  # no abbreviations, as Megatron
     None),
])
def test_a_launch_without_the_flag_or_with_a_bad_one_is_refused_in_one_line(args, message, tmp_path):
    proc = _run(args, tmp_path)
    assert proc.returncode == 2 and "== run" not in proc.stdout, (proc.stdout, proc.stderr)
    last = proc.stderr.splitlines()[-1]
    if message is None:
        assert last.startswith("train_tiny_moe.py: error: ") and ("--lm-z-loss-coeff" in last or "--iter" in last), last
    else:
        assert last == message


def test_readme_command_1_and_ci_launch_the_main_job_with_the_flag():
    readme = open(os.path.join(REPO, "README.md")).read()
    command = "python -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2"
    assert f'pip install torch==2.13.0 -e ".[examples]" && {command}\n' in readme
    for ci in (".ci/run", ".ci/leg_users.sh", ".ci/leg_py312.sh"):  # Python 3.11, 3.10, 3.12
        assert f"-m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick" in open(
            os.path.join(REPO, ci)).read(), ci
