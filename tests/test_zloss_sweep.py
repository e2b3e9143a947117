"""``examples/zloss_lr_sweep.py --quick``: the z-loss learning-rate sweep's plumbing on the CPU.

Six real runs of Megatron's ``pretrain`` (``torchrun`` + ``-m mindspeed_cez.launch``, gloo, the CPU
shims of ``examples/pretrain_gpt.py``) on a small slice of the Python standard library, two learning
rates x three z-loss coefficients, then the report. Checked from what it wrote:

* every run ended and its TensorBoard events hold ``lm loss``, ``lm_lse``, ``lm_lse_max`` and the
  validation loss, ``lm_z_loss`` exactly where the coefficient is > 0 (the fused kernel logs the
  log-sum-exp at c = 0 too);
* the final validation loss read from TensorBoard equals the one Megatron printed;
* iteration 1 (the same initial weights and batch everywhere: same seed, same data order) has the
  same ``lm loss`` and ``lm_lse`` in all six runs, and ``lm_z_loss = c * mean(lse^2) >= c * lm_lse^2``;
* ``lm_lse_max >= lm_lse`` at every logged step;
* the table's LR sensitivity is Wortsman et al.'s, recomputed here; the three PNGs exist.

Needs megatron.training (megatron-core 0.19.2); about 100 s on 2 cores.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("zloss_quick")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "zloss_lr_sweep.py"), "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(out / "summary.json") as fh:
        return out, json.load(fh)


def test_every_run_ends_and_logs_its_tags(sweep):
    _, summary = sweep
    runs = summary["runs"]
    assert len(runs) == 6 and all(r["complete"] for r in runs), [(r["name"], r["rc"]) for r in runs]
    for run in runs:
        tags = set(run["series"])
        assert {"lm loss", "lm_lse", "lm_lse_max", "lm loss validation"} <= tags, (run["name"], tags)
        assert ("lm_z_loss" in tags) == (run["coeff"] > 0), (run["name"], tags)
        assert run["final_validation"] == pytest.approx(run["validation_log"], rel=1e-5), run["name"]
        assert run["last_step"] == summary["steps"]


def test_same_start_in_every_run(sweep):
    _, summary = sweep
    first = {}
    for run in summary["runs"]:
        step1 = {tag: dict(map(tuple, values)).get(1) for tag, values in run["series"].items()}
        first[run["name"]] = step1
        assert run["first_logged"][1] == pytest.approx(summary["init_loss"], rel=1e-6), run["name"]
        if run["coeff"] > 0:  # c * mean(lse^2) >= c * mean(lse)^2, equal only if every lse is the same
            assert step1["lm_z_loss"] >= run["coeff"] * step1["lm_lse"] ** 2 * (1 - 1e-5), (run["name"], step1)
            assert step1["lm_z_loss"] == pytest.approx(run["coeff"] * step1["lm_lse"] ** 2, rel=0.05), step1
    for tag in ("lm loss", "lm_lse", "lm_lse_max"):
        values = [v[tag] for v in first.values()]
        assert max(values) == pytest.approx(min(values), rel=1e-5), (tag, first)


def test_lse_max_bounds_the_mean(sweep):
    _, summary = sweep
    for run in summary["runs"]:
        means = dict(map(tuple, run["series"]["lm_lse"]))
        for step, largest in run["series"]["lm_lse_max"]:
            assert largest >= means[step] - 1e-6, (run["name"], step, largest, means[step])


def test_report(sweep):
    out, summary = sweep
    report = out / "report"
    for name in ("lr_sensitivity.png", "lse.png", "loss_curves.png", "table.md"):
        assert (report / name).stat().st_size > 0, name
    table = (report / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| **LR sensitivity**"))
    for cell, coeff in zip(row.split("|")[2:-1], sorted({r["coeff"] for r in summary["runs"]})):
        finals = [min(r["final_validation"], summary["init_loss"]) for r in summary["runs"] if r["coeff"] == coeff]
        expected = sum(finals) / len(finals) - min(finals)
        assert math.isclose(float(cell), expected, abs_tol=6e-4), (coeff, cell, expected)
