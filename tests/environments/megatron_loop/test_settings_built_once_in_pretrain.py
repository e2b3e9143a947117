"""One :class:`Settings` per process through Megatron's own ``pretrain`` under torchrun: the launcher's
adaptor import validates the command line, Megatron's ``validate_args`` (in ``initialize_megatron``)
hands that outcome on, and every rank trains with the one Settings built
(``tests/support/count_settings.py`` counts each construction). The argument route alone, and
``apply()``: tests/patches/test_settings_built_once.py."""

import re
import subprocess

import pytest

pytest.importorskip("megatron.training")

from support.megatron_launch import ITERATION_LINE, REPO, TINY_GPT, Z_COEFF, launch_command  # noqa: E402

pytestmark = pytest.mark.slow

COUNTER = REPO / "tests" / "support" / "count_settings.py"


def test_each_rank_builds_one_settings_and_trains_with_it(tmp_path):
    flags = ["--lm-z-loss-coeff", str(Z_COEFF), "--lm-z-loss-log-lse"]
    cmd, env = launch_command(tmp_path, [*TINY_GPT, *flags], nproc=2, env={"CEZ_DUMP_LOGITS_DIR": ""})
    at = cmd.index("mindspeed_cez.launch") - 1  # "-m mindspeed_cez.launch": through the counter
    cmd[at:at + 2] = [str(COUNTER), "-m", "mindspeed_cez.launch"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + "\n" + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert any("lm_z_loss" in m.group(3) for m in map(ITERATION_LINE.search, proc.stdout.splitlines()) if m), \
        log[-4000:]  # trained with the fused loss
    counts = sorted(re.findall(r"cez-settings rank=(\d+) built=(\d+) activated=(\d+) same=(True|False)", proc.stdout))
    assert counts == [("0", "1", "1", "True"), ("1", "1", "1", "True")], log[-4000:]
