"""examples/mitigation_study.py: the arms' counts, Fisher's tests against c = 0 and the z-loss, and the paired
losses, on made-up summaries whose answers are known."""

import json

import pytest

from support import load_example

study = load_example("mitigation_study")

COLUMNS = ["step", "loss", "z_loss", "lse", "lse_max", "grad_norm", "lr", "ms", "nan_iters", "skipped_iters", "mu_norm"]


def _run(lr, seed, coeff=0.0, mitigation=None, diverged_at=None, loss=3.0, horizon=100, last_step=None):
    rows = [[step, loss, None, 10.0, 12.0, 1.0, lr, 40.0, 0.0, 0.0, 0.5] for step in range(10, horizon + 1, 10)]
    run = {"lr": lr, "seed": seed, "coeff": coeff, "horizon": horizon, "steps": 1000,
           "last_step": horizon if last_step is None else last_step,
           "series": {"columns": COLUMNS, "rows": rows}}
    if mitigation:
        run["mitigation"] = mitigation
    if diverged_at:
        run["verdict"] = {"rule": "above_init", "step": diverged_at}
        run["last_step"] = diverged_at
    return run


def test_counts_tests_and_paired_losses():
    runs = []
    for seed in range(1, 6):
        runs.append(_run(0.3, seed, diverged_at=90 + seed))                      # c = 0: all diverge
        runs.append(_run(0.3, seed, coeff=1e-4, diverged_at=80 + seed))          # the z-loss too
        runs.append(_run(0.3, seed, mitigation="softcap", loss=3.0 + 0.1 * seed))  # none do
        runs.append(_run(0.2, seed, loss=3.0))
        runs.append(_run(0.2, seed, mitigation="mu_loss", loss=3.0 + 0.01 * seed))
    runs.append(_run(0.3, 6, mitigation="mu_centering", last_step=50))            # cut by the budget: undecided
    runs.append(_run(0.3, 1, coeff=1e-3))                                         # another arm: left out
    result = study.tables(runs)
    assert set(result[0.3]) == {"c0", "z-loss 1e-4", "softcap", "mu_centering"}
    cap = result[0.3]["softcap"]
    assert len(cap["diverged"]) == 0 and cap["decided"] == 5
    assert cap["p_vs_c0"] == pytest.approx(2 / 252, rel=1e-9)  # 0/5 against 5/5: two-sided, 2 / C(10, 5)
    assert cap["p_vs_z-loss 1e-4"] == pytest.approx(2 / 252, rel=1e-9)
    assert result[0.3]["z-loss 1e-4"]["p_vs_c0"] == pytest.approx(1.0)
    assert result[0.3]["mu_centering"]["undecided"] == [6] and result[0.3]["mu_centering"]["decided"] == 0
    assert sorted(result[0.3]["c0"]["diverged"].values()) == [91, 92, 93, 94, 95]
    pair = result[0.2]["mu_loss"]["loss_vs_c0"]
    assert pair["seeds"] == [1, 2, 3, 4, 5] and pair["mean"] == pytest.approx(0.03)
    assert pair["half_width"] == pytest.approx(2.776 * 0.0158113883 / 5 ** 0.5, rel=1e-6)
    assert result[0.2]["mu_loss"]["mu_norm"] == {s: 0.5 for s in range(1, 6)}


def test_the_command_writes_its_tables(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"runs": [_run(0.3, 1, diverged_at=50), _run(0.3, 1, mitigation="softcap")]}))
    study.main([str(summary), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "mitigations.md").read_text()
    assert "| 0.3 | c0 | 1 / 1 (50-50) |" in text and "| 0.3 | softcap | 0 / 1 |" in text
    assert json.loads((tmp_path / "out" / "mitigations.json").read_text())["0.3"]["softcap"]["decided"] == 1
