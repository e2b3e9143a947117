"""tests/support/gpu_checks_steps.sh (run_gpu_checks.sh's steps) on the CPU with fake steps: each step's time limit
cut to what is left before the deadline, a step with too little time left named as not run, failures and
timeouts named, steps the GPUs cannot hold named without failing, and the exit status."""

import os
import re
import subprocess

STEPS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "support",
                     "gpu_checks_steps.sh")


def _bash(script, deadline_s):
    proc = subprocess.run(["bash", "-c", f'set -u -o pipefail; DEADLINE_S={deadline_s}; . "{STEPS}"\n{script}'],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout.splitlines()


def test_every_step_passes(tmp_path):
    rc, out = _bash(f'step one 30 1 {tmp_path}/a.log 1 bash -c "echo x; echo shown"\n'
                    'ABSENT+=("layouts: needs four GPUs, this machine has 2")\nsummary', deadline_s=570)
    assert rc == 0 and out[:2] == ["== one (time limit 30 s)", "shown"], out
    assert out[-2:] == ["not run here: layouts: needs four GPUs, this machine has 2",
                        "every step this machine can hold ran and passed"], out
    assert (tmp_path / "a.log").read_text() == "x\nshown\n"


def test_failures_timeouts_and_the_deadline_are_named(tmp_path):
    rc, out = _bash(f'step fails 30 1 {tmp_path}/a.log 0 bash -c "exit 3"\n'
                    f'step slow 30 1 {tmp_path}/b.log 0 sleep 5\n'
                    f'step late 600 100 {tmp_path}/c.log 0 true\n'
                    'summary', deadline_s=14)  # 14 - 10 s kept for the summary: "slow" gets 4 s
    assert rc == 1, out
    # "slow" gets what is left of the deadline: 4 s, or less where the host was slow to start the steps
    limits = [int(m.group(1)) for m in map(re.compile(r"== slow \(time limit (\d+) s\)").fullmatch, out) if m]
    assert len(limits) == 1 and 1 <= limits[0] <= 4 and "== late: not run (" in out[-5], out
    assert out[-3].startswith("not run: late: ") and out[-3].endswith("deadline, it needs 100 s"), out
    assert out[-2:] == [f"FAILED: fails: exit status 3 (log: {tmp_path}/a.log)",
                        f"FAILED: slow: timed out after {limits[0]} s (log: {tmp_path}/b.log)"], out
