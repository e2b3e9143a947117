"""At activation the first process prints one line of what the adaptor turned on (every route meets in
``activation.activate``): the coefficient, the backend, the fused output layer and its block budget, the
mitigations and the metrics; once per distinct settings, never from the other ranks."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

SCRIPT = """
import mindspeed_cez.patches as p
p.apply(z_loss_coeff=1e-4, fused_output_layer=True, block_bytes=2 << 30, logit_softcap=30.0)
p.apply(z_loss_coeff=1e-4, fused_output_layer=True, block_bytes=2 << 30, logit_softcap=30.0)
p.apply(z_loss_coeff=0.0, mu_centering=True, mu_loss_coeff=1e-4, backend="torch")
"""


def _lines(env_rank):
    """The startup lines a process of rank ``env_rank`` prints."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(PYTHONWARNINGS="ignore", RANK=env_rank)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith("mindspeed_cez: on:")]


def test_the_first_process_says_once_what_is_on():
    lines = _lines("0")
    assert len(lines) == 2, lines  # the repeated apply() says nothing
    assert lines[0].startswith("mindspeed_cez: on: LM z-loss coefficient 0.0001, backend auto: ")
    assert "fused output layer (forward, blocks of at most 2 GiB of logits; linear backend auto)" in lines[0]
    assert "logit soft cap 30" in lines[0] and lines[0].endswith("; logs lm_z_loss lm_lse lm_lse_max")
    assert lines[1] == ("mindspeed_cez: on: LM z-loss coefficient 0, backend torch, mu-centering, "
                        "mu-loss coefficient 0.0001; logs lm_mu_norm")


def test_other_ranks_stay_quiet():
    assert _lines("1") == []
