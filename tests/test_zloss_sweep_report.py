"""``examples/zloss_sweep_report.py`` on a sweep where some runs diverge (made-up numbers, no training).

A run whose final validation loss is NaN, and one whose training loss climbs back up by more than a
nat, count as diverged: bold in the table, at the loss at initialization in the LR sensitivity;
the highest stable learning rate is the last one the run without z-loss survived; the plots are drawn.
"""

import math
import os
import sys

import pytest

pytest.importorskip("matplotlib")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import zloss_sweep_report as report  # noqa: E402

INIT = 10.5
STEPS = 100


def _run(lr, coeff, final, train_tail=3.0):
    train = [[s, 10.0 - 7.0 * s / STEPS] for s in range(1, STEPS - 10)] + [[s, train_tail] for s in range(STEPS - 10, STEPS + 1)]
    lse = [[s, 10.0 - (5.0 if coeff == 0 else 9.0) * s / STEPS] for s in range(1, STEPS + 1)]
    run = {"name": f"lr{lr:g}_c{coeff:g}", "lr": lr, "coeff": coeff, "rc": 0, "complete": True, "last_step": STEPS,
           "final_validation": final,
           "series": {"lm loss": train, "lm_lse": lse, "lm_lse_max": [[s, v + 2] for s, v in lse],
                      "lm loss validation": [[STEPS, final]]}}
    run["diverged"] = report.diverged(run)
    return run


@pytest.fixture
def summary():
    runs = [_run(1e-3, 0.0, 4.0), _run(1e-2, 0.0, 3.5), _run(1e-1, 0.0, float("nan")),
            _run(1e-3, 1e-4, 4.0), _run(1e-2, 1e-4, 3.4), _run(1e-1, 1e-4, 5.0, train_tail=6.0)]
    return {"config": {"layers": 4, "hidden": 256, "seq": 512, "micro_batch": 32, "vocab": 32768},
            "steps": STEPS, "init_loss": INIT, "runs": runs, "diverged_rule": "test"}


def test_divergence_and_lr_sensitivity(summary, tmp_path):
    by_name = {r["name"]: r for r in summary["runs"]}
    assert [by_name[n]["diverged"] for n in ("lr0.01_c0", "lr0.1_c0", "lr0.01_c0.0001", "lr0.1_c0.0001")] == [
        False, True, False, True]
    assert report.highest_stable_lr(summary) == 1e-2
    by_coeff = {c: {r["lr"]: r for r in summary["runs"] if r["coeff"] == c} for c in (0.0, 1e-4)}
    # c = 0: finals 4.0, 3.5, NaN -> 4.0, 3.5, INIT; best 3.5
    assert report.lr_sensitivity(by_coeff[0.0], INIT) == pytest.approx((4.0 + 3.5 + INIT) / 3 - 3.5)
    # a finite final loss counts as it is, diverged or not (the paper's min(loss, loss at init))
    assert report.lr_sensitivity(by_coeff[1e-4], INIT) == pytest.approx((4.0 + 3.4 + 5.0) / 3 - 3.4)
    paths = report.report(summary, str(tmp_path))
    for path in paths.values():
        assert os.path.getsize(path) > 0, path
    table = (tmp_path / "table.md").read_text()
    assert "**nan**" in table and "**5.000**" in table and "| 0.01 | 3.500 " in table, table
    cells = next(line for line in table.splitlines() if line.startswith("| **LR sensitivity**")).split("|")[2:-1]
    assert [float(c) for c in cells] == pytest.approx([(7.5 + INIT) / 3 - 3.5, 12.4 / 3 - 3.4], abs=6e-4)
    assert not math.isnan(float(cells[0]))
