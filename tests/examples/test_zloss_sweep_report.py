"""``examples/zloss_sweep_report.py`` on made-up sweeps (no training): intervals, paired differences, LR
sensitivity per seed, runs that diverge, stop at the budget or never start, the rerun.

* A run whose final validation loss is NaN, or whose training loss climbs back by more than a nat,
  counts as diverged; at the loss at initialization in the LR sensitivity.
* The interval is the Student-t 95 % interval of the mean (checked against a float64 computation
  with the t quantile for 2 degrees of freedom); the paired difference pairs runs by seed.
* A seed that lacks a complete run at one learning rate is listed as incomplete, not computed from
  the others; a run stopped at the budget or never started is reported with its status.
"""

import math
import os
import statistics
import sys

import pytest

pytest.importorskip("matplotlib")

from support import load_example  # noqa: E402

report = load_example("zloss_sweep_report")

INIT = 10.5
STEPS = 100
LRS = (1e-3, 1e-2, 1e-1)


def _run(lr, coeff, seed, final, train_tail=3.0, status="complete", hidden=256, wd_mode="none", rerun=False):
    train = [[s, 10.0 - 7.0 * s / STEPS] for s in range(1, STEPS - 10)] + [[s, train_tail] for s in range(STEPS - 10, STEPS + 1)]
    lse = [[s, 10.0 - (5.0 if coeff == 0 else 9.0) * s / STEPS] for s in range(1, STEPS + 1)]
    lse_max = [[s, v + 2 + (100.0 * lr if s == 50 else 0.0)] for s, v in lse]
    series = {"lm loss": train, "lm_lse": lse, "lm_lse_max": lse_max, "lm loss validation": [[STEPS, final]]}
    run = {"name": f"h{hidden}_lr{lr:g}_c{coeff:g}_s{seed}" + ("_rerun" if rerun else ""), "lr": lr, "coeff": coeff,
           "seed": seed, "hidden": hidden, "wd_mode": wd_mode, "wd": 0.0, "rerun": rerun, "rc": 0,
           "complete": status == "complete", "status": status, "last_step": STEPS, "init_loss": INIT,
           "final_validation": final if status == "complete" else None, "series": series}
    run["diverged"] = report.diverged(run) if run["complete"] else None
    run["agg"] = report.aggregates(series, STEPS)
    return run


FINALS = {  # (lr, coeff): finals of seeds 1, 2, 3
    (1e-3, 0.0): [4.0, 4.1, 3.9], (1e-2, 0.0): [3.5, 3.6, 3.55], (1e-1, 0.0): [float("nan"), 5.0, 4.8],
    (1e-3, 1e-4): [3.98, 4.05, 3.91], (1e-2, 1e-4): [3.4, 3.52, 3.5], (1e-1, 1e-4): [4.5, 4.4, 4.6],
}


@pytest.fixture
def summary():
    runs = [_run(lr, c, s + 1, f) for (lr, c), finals in FINALS.items() for s, f in enumerate(finals)]
    runs[-1] = _run(1e-1, 1e-4, 3, None, status="stopped at the budget")  # seed 3 of c=1e-4 lacks LR 0.1
    runs.append(_run(1e-1, 0.0, 2, 5.2, train_tail=6.5))  # diverged by its training loss; replaces seed 2
    runs = [r for r in runs if r["name"] != "h256_lr0.1_c0_s2" or r["final_validation"] == 5.2]
    runs.append(_run(1e-2, 0.0, 1, 3.51, rerun=True))
    runs.append(_run(3e-1, 0.0, 1, None, status="not started"))
    return {"phase": "A", "config": {"layers": 4, "hidden": 256, "seq": 512, "micro_batch": 32, "vocab": 32768},
            "steps": STEPS, "runs": runs, "diverged_rule": "test", "environment": {"commit": "abc", "gpus": ["X"]}}


def test_intervals_and_paired_differences(summary):
    stats = report.statistics_of(report.pool([summary]))
    cell = {(c["lr"], c["coeff"]): c for c in stats["cells"]}
    got = cell[(1e-2, 0.0)]["final_validation"]
    xs = [3.5, 3.6, 3.55]
    assert got["n"] == 3 and got["mean"] == pytest.approx(statistics.fmean(xs))
    assert got["ci95"] == pytest.approx(4.303 * statistics.stdev(xs) / math.sqrt(3), rel=1e-9)
    diff = cell[(1e-2, 1e-4)]["final_validation_minus_c0"]
    assert diff["diffs"] == pytest.approx([3.4 - 3.5, 3.52 - 3.6, 3.5 - 3.55])
    # the NaN run of seed 1 at LR 0.1 has no finite difference; seed 3 of c=1e-4 stopped: one pair left
    assert cell[(1e-1, 1e-4)]["final_validation_minus_c0"]["diffs"] == pytest.approx([4.4 - 5.2])
    assert cell[(1e-1, 1e-4)]["final_validation_minus_c0"]["ci95"] is None
    assert stats["diverged"] == ["h256_lr0.1_c0_s1", "h256_lr0.1_c0_s2"]
    assert "h256_lr0.1_c0.0001_s3: stopped at the budget" in stats["not_complete"]
    assert "h256_lr0.3_c0_s1: not started" in stats["not_complete"]
    assert cell[(1e-1, 0.0)]["lse_max_run"]["mean"] == pytest.approx(10.0 - 2.5 + 2 + 10.0)  # the step-50 spike


def test_lr_sensitivity_per_seed(summary):
    stats = report.statistics_of(report.pool([summary]))
    entry = next(e for e in stats["lr_sensitivity"] if (e["hidden"], e["wd_mode"]) == (256, "none")
                 and not e.get("compare_with"))
    c0, c4 = entry["by_coeff"][0.0], entry["by_coeff"][1e-4]
    # c = 0, seed 1: 4.0, 3.5, NaN -> INIT; seed 2: 4.1, 3.6, 5.2 (diverged, finite: counted as it is)
    assert c0["per_seed"][1] == pytest.approx((4.0 + 3.5 + INIT) / 3 - 3.5)
    assert c0["per_seed"][2] == pytest.approx((4.1 + 3.6 + 5.2) / 3 - 3.6)
    assert c4["incomplete_seeds"] == [3] and 3 not in c4["per_seed"]  # never computed from two learning rates
    assert c4["minus_c0"]["diffs"] == pytest.approx([c4["per_seed"][s] - c0["per_seed"][s] for s in (1, 2)])
    assert stats["best_lr_c0"]["256/none"] == 1e-2


def test_rerun_and_report(summary, tmp_path):
    stats = report.statistics_of(report.pool([summary]))
    (rerun,) = stats["nondeterminism"]
    assert rerun["final_validation_diff"] == pytest.approx(3.51 - 3.5)
    paths = report.report([summary], str(tmp_path))
    for path in paths.values():
        assert os.path.getsize(path) > 0, path
    tables = (tmp_path / "tables.md").read_text()
    assert "stopped at the budget" in tables and "not started" in tables and "| 0.01 | 0 | 3 | 3.550 ± " in tables
