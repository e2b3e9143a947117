"""One :class:`Settings` per process: built once, from the parsed flags or by ``apply()``, and the one
activated (real processes, ``tests/support/count_settings.py`` counting every construction).

The adaptor's import validates the command line (a bad value stops the run before the script prints
anything) and Megatron's validation hands that outcome on instead of building again; with megatron-core
alone the command line is the parsed flags. Megatron's own ``pretrain`` under torchrun:
tests/environments/megatron_loop/test_settings_built_once_in_pretrain.py."""

import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from mindspeed_cez.patches import arguments
from support import TINY_MEGATRON_ARGV

COUNTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "count_settings.py")
TRAINING = importlib.util.find_spec("megatron.training") is not None

# A pretraining script's argument route: the adaptor imported first; with megatron.training, Megatron
# parses and validates sys.argv as initialize_megatron does. Prints the active coefficient.
SCRIPT = """
import os, sys
os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("RANK", "0")
import mindspeed_cez.megatron_adaptor
from mindspeed_cez import patches
if os.environ.get("CEZ_TEST_APPLY"):
    patches.apply(z_loss_coeff=float(os.environ["CEZ_TEST_APPLY"]))
try:
    from megatron.training import arguments as A
except ImportError:
    A = None
if A is not None:
    A.validate_args(A.parse_args(), {})
active = patches.active_settings()
print("ACTIVE", None if active is None else active.z_loss_coeff, flush=True)
"""


def _run(tmp_path, flags, env=None):
    script = tmp_path / "pretrain.py"
    script.write_text(SCRIPT)
    argv = (TINY_MEGATRON_ARGV if TRAINING else []) + flags
    proc = subprocess.run([sys.executable, COUNTER, str(script), *argv], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (active,) = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("ACTIVE ")]
    (count,) = re.findall(r"cez-settings rank=\S+ built=(\d+) activated=(\d+) same=(True|False)", proc.stdout)
    return active, tuple(int(c) if c.isdigit() else c == "True" for c in count)


@pytest.mark.parametrize("flags", [["--lm-z-loss-coeff", "1e-3"],
                                   ["--lm-fused-output-layer", "--lm-z-loss-coeff", "1e-3", "--lm-z-loss-log-lse"]])
def test_the_flags_build_one_settings(tmp_path, flags):
    """The import's validation of the command line is the one construction, handed to Megatron's
    ``validate_args`` (megatron.training) or activated at the import (megatron-core alone)."""
    active, (built, activated, same) = _run(tmp_path, flags)
    assert active == "0.001" and (built, activated, same) == (1, 1, True), (active, built, activated, same)


def test_apply_builds_one_settings_and_no_flag_builds_none(tmp_path):
    """``apply()`` in a script that imports the adaptor without flags: the flags at their defaults build
    nothing (the kernel off), apply() builds the one Settings, and Megatron's validation keeps it."""
    active, counts = _run(tmp_path, [], env={"CEZ_TEST_APPLY": "0.002"})
    assert active == "0.002" and counts == (1, 1, True), (active, counts)
    active, counts = _run(tmp_path, [])
    assert active == "None" and counts == (0, 0, False), (active, counts)


def _parse(argv):
    return arguments.add_lm_z_loss_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)


def test_validation_hands_on_the_command_lines_settings_or_builds_from_megatrons_arguments(monkeypatch):
    """Megatron's arguments that carry the command line's flags get its Settings, the same object;
    arguments that differ (a script's ``args_defaults``, a YAML config) get their own."""
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    for name in [v for v in os.environ if v.startswith("MINDSPEED_CEZ_")]:
        monkeypatch.delenv(name)
    checked = arguments.validate_command_line(["--lm-z-loss-coeff", "1e-4", "--lm-z-loss-log-lse", "--other", "7"])
    assert checked.settings is not None and checked.settings.z_loss_coeff == 1e-4
    assert arguments.validate(_parse(["--lm-z-loss-log-lse", "--lm-z-loss-coeff", "1e-4"]), checked) is checked.settings
    other = arguments.validate(_parse(["--lm-z-loss-coeff", "2e-4"]), checked)
    assert other is not checked.settings and other.z_loss_coeff == 2e-4 and not other.log_lse
    assert arguments.validate(_parse([]), checked) is None  # Megatron's arguments turn it off: off
    args = _parse(["--lm-fused-output-layer"])
    args.use_mup = True  # Megatron's own flags are checked against ours even where the Settings are handed on
    with pytest.raises(ValueError, match="--lm-fused-output-layer does not serve --use-mup"):
        arguments.validate(args, arguments.validate_command_line(["--lm-fused-output-layer"]))
    assert arguments.validate_command_line([]).settings is None  # flags at their defaults: nothing built


def test_mindspeed_llm_logit_flags_on_the_command_line_enter_the_handed_on_settings(monkeypatch):
    """MindSpeed-LLM's ``--output-multiplier-scale`` / ``--output-logit-softcapping`` enter the Settings:
    read from the command line too, so that its Settings are the run's (its parser checks their text)."""
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    for name in [v for v in os.environ if v.startswith("MINDSPEED_CEZ_")]:
        monkeypatch.delenv(name)
    checked = arguments.validate_command_line(["--lm-z-loss-coeff", "1e-4", "--output-multiplier-scale=0.5",
                                               "--output-logit-softcapping", "30"])
    transform = checked.settings.logit_transform
    assert (transform.scale, transform.cap) == (0.5, 30.0)
    args = _parse(["--lm-z-loss-coeff", "1e-4"])
    args.output_multiplier_scale, args.output_logit_softcapping = 0.5, 30.0  # MindSpeed-LLM's parser's
    assert arguments.validate(args, checked) is checked.settings
    not_a_number = arguments.validate_command_line(["--lm-fused-ce", "--output-multiplier-scale", "x"])
    assert not_a_number.settings.logit_transform is None  # left to MindSpeed-LLM's parser
