"""``examples/zloss_lr_sweep.py --quick``: the z-loss sweep's plumbing on the CPU, and ``lm_lse_max`` in
Megatron's real ``training_log`` with a log interval of 4.

Nine real runs of Megatron's ``pretrain`` (``torchrun`` + ``-m mindspeed_cez.launch``, gloo, the CPU
mode of ``examples/pretrain_gpt.py``) on a small corpus of this checkout's own files (the pinned
corpus's builder), two learning rates x c in {0, 1e-3} x seeds 1, 2, and the same-seed rerun; then
the report. Checked from what they wrote:

* every run ended; its TensorBoard events hold ``lm loss``, ``lm_lse``, ``lm_lse_max`` at every
  iteration and the validation loss, ``lm_z_loss`` exactly where the coefficient is > 0; the final
  validation loss read from TensorBoard equals the one Megatron printed;
* iteration 1 is the same in every run of a seed (same weights and batch) and differs between seeds
  (its mean CE and mean lse);
  ``lm_z_loss = c * mean(lse^2) >= c * lm_lse^2``; the rerun repeats its original;
* the log line (every 4th iteration) shows for ``lm_lse_max`` the largest per-iteration value of its
  logging interval (TensorBoard's, written at every iteration) and for ``lm_lse`` their mean;
* the report's LR sensitivity per seed is Wortsman et al.'s, recomputed here; the PNGs exist.

Needs megatron.training (megatron-core >= 0.18), tokenizers, tensorboard, matplotlib; about 2 minutes on 2 cores.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm_lse: ([-+\w.]+) \| lm_lse_max: ([-+\w.]+) \|")
LOG_INTERVAL = 4


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("zloss_quick")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "zloss_lr_sweep.py"), "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(out / "summary.json") as fh:
        summary = json.load(fh)
    with open(out / "series_full.json.gz", "rb") as fh:
        import gzip

        full = json.loads(gzip.decompress(fh.read()))
    return out, summary, full


def test_every_run_ends_and_logs_its_tags(sweep):
    _, summary, full = sweep
    runs = summary["runs"]
    assert len(runs) == 9 and all(r["complete"] for r in runs), [(r["name"], r["status"]) for r in runs]
    assert summary["config"]["log_interval"] == LOG_INTERVAL
    for run in runs:
        tags = set(full[run["name"]])
        assert {"lm loss", "lm_lse", "lm_lse_max", "lm loss validation"} <= tags, (run["name"], tags)
        assert ("lm_z_loss" in tags) == (run["coeff"] > 0), (run["name"], tags)
        assert [s for s, _ in full[run["name"]]["lm_lse_max"]] == list(range(1, summary["steps"] + 1))
        assert run["final_validation"] == pytest.approx(run["validation_log"], rel=1e-5), run["name"]
        assert run["last_step"] == summary["steps"]


def test_same_start_per_seed_and_the_rerun(sweep):
    _, summary, full = sweep
    first = {}
    for run in summary["runs"]:
        step1 = {tag: dict(map(tuple, values)).get(1) for tag, values in full[run["name"]].items()}
        first[run["name"]] = (run["seed"], step1)
        if run["coeff"] > 0:  # c * mean(lse^2) >= c * mean(lse)^2, equal only if every lse is the same
            assert step1["lm_z_loss"] >= run["coeff"] * step1["lm_lse"] ** 2 * (1 - 1e-5), (run["name"], step1)
    by_seed = {}
    for seed, step1 in first.values():
        by_seed.setdefault(seed, []).append(tuple(step1[tag] for tag in ("lm loss", "lm_lse", "lm_lse_max")))
    for values in by_seed.values():
        for tag, column in zip(("lm loss", "lm_lse", "lm_lse_max"), zip(*values)):
            assert max(column) == pytest.approx(min(column), rel=1e-5), (tag, by_seed)
    # Seeds differ in their weights: the mean CE and mean lse of iteration 1 differ. Not asserted at a
    # tolerance: at initialisation every lse sits near log V, so two seeds can agree to 1e-5 in one of them
    # (lm_lse_max did once: 8.856838 vs 8.856762); the pair of means tells them apart.
    assert by_seed[1][0][:2] != by_seed[2][0][:2], by_seed
    rerun = next(r for r in summary["runs"] if r.get("rerun"))
    original = next(r for r in summary["runs"] if r["name"] == rerun["name"].replace("_rerun", ""))
    assert rerun["final_validation"] == pytest.approx(original["final_validation"], rel=1e-4)


def test_log_line_shows_the_interval_maximum(sweep):
    """Megatron's own training_log (log interval 4): lm_lse_max is the interval's largest, lm_lse its mean."""
    out, summary, full = sweep
    checked = 0
    for run in summary["runs"]:
        per_step = {tag: dict(map(tuple, full[run["name"]][tag])) for tag in ("lm_lse", "lm_lse_max")}
        for step, largest in per_step["lm_lse_max"].items():
            assert largest >= per_step["lm_lse"][step] - 1e-6, (run["name"], step)
        text = (out / "logs" / (run["name"] + ".log")).read_text()
        lines = [(int(i), float(m), float(x)) for i, m, x in LOG_LINE.findall(text)]
        assert [i for i, _, _ in lines if i % LOG_INTERVAL == 0] == list(range(LOG_INTERVAL, summary["steps"] + 1,
                                                                               LOG_INTERVAL)), lines
        for iteration, mean, largest in lines:
            first = (iteration - 1) // LOG_INTERVAL * LOG_INTERVAL + 1 if iteration % LOG_INTERVAL else \
                iteration - LOG_INTERVAL + 1
            window = range(first, iteration + 1)
            expected_max = max(per_step["lm_lse_max"][s] for s in window)
            expected_mean = sum(per_step["lm_lse"][s] for s in window) / len(window)
            assert largest == pytest.approx(expected_max, rel=2e-6), (run["name"], iteration, largest, expected_max)
            assert mean == pytest.approx(expected_mean, rel=2e-6), (run["name"], iteration, mean, expected_mean)
            if len(window) > 1:  # the maximum is not the interval's mean of maxima
                mean_of_max = sum(per_step["lm_lse_max"][s] for s in window) / len(window)
                assert largest >= mean_of_max
            checked += 1
    assert checked >= 9 * 3


def test_report(sweep):
    out, summary, _ = sweep
    report = out / "report"
    for name in ("lr_sensitivity.png", "lse.png", "lse_curves.png", "tables.md", "stats.json"):
        assert (report / name).stat().st_size > 0, name
    stats = json.loads((report / "stats.json").read_text())
    entry = next(e for e in stats["lr_sensitivity"] if not e.get("compare_with"))
    init = entry["init_loss"]
    for coeff, got in entry["by_coeff"].items():
        for seed, value in got["per_seed"].items():
            finals = [min(r["final_validation"], init) for r in summary["runs"]
                      if r["coeff"] == float(coeff) and r["seed"] == int(seed) and not r.get("rerun")]
            assert len(finals) == 2
            assert value == pytest.approx(sum(finals) / len(finals) - min(finals), abs=1e-9), (coeff, seed)
        assert got["n"] == 2 and not got["incomplete_seeds"]
    assert len(stats["nondeterminism"]) == 1 and math.isfinite(stats["nondeterminism"][0]["final_validation_diff"])
