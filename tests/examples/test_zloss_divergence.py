"""The divergence rule, Fisher's exact test, the early-warning count (examples/zloss_divergence.py) and the
held-out split's deduplication (examples/pypi_text_corpus.py): synthetic inputs with known answers."""

import math
import sys
from pathlib import Path

import pytest

from support import load_example


corpus = load_example("pypi_text_corpus")
zd = load_example("zloss_divergence")

LINE = (" [2026-11-27 09:52:47.921531] iteration      990/    1500 | consumed samples:        31680 | elapsed time per "
        "iteration (ms): 213.5 | learning rate: 8.524401E-02 | global batch size:    32 | lm loss: 3.572137E+00 | "
        "lm_z_loss: 2.069E-02 | lm_lse: 1.438628E+01 | lm_lse_max: 1.400000E+02 | loss scale: 1.0 | grad norm: 1.890 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_parse_line():
    p = zd.parse_line(LINE)
    assert p == {"step": 990, "steps": 1500, "ms": 213.5, "lr": 8.524401e-02, "loss": 3.572137, "z_loss": 2.069e-02,
                 "lse": 14.38628, "lse_max": 140.0, "grad_norm": 1.89, "skipped_iters": 0.0, "nan_iters": 0.0}
    nan = zd.parse_line(LINE.replace("lm loss: 3.572137E+00", "lm loss: nan"))
    assert math.isnan(nan["loss"])
    assert zd.parse_line(" validation loss at iteration 1500 on validation set | lm loss value: 3.6E+00 |") is None
    assert zd.parse_log("noise\n" + LINE + "\nmore noise\n")[0]["step"] == 990


def points(losses, every=10, **extra):
    return [dict({"step": every * (i + 1), "loss": v}, **extra) for i, v in enumerate(losses)]


def test_a_run_that_learns_has_not_diverged():
    losses = [10.4 - 6 * (1 - math.exp(-i / 50)) for i in range(1000)]
    assert zd.divergence(points(losses), warmup=500) is None


def test_nan_and_nan_iterations():
    losses = [10.4 - 0.005 * i for i in range(300)]
    bad = points(losses)
    bad[200]["loss"] = float("nan")
    assert zd.divergence(bad, 500) == {"rule": "nan", "step": 2010, "confirmed_at": 2010}
    counted = points(losses)
    counted[150]["nan_iters"] = 2.0  # Megatron's logged loss leaves NaN iterations out: the count decides
    assert zd.divergence(counted, 500)["step"] == 1510
    skipped = points(losses)
    skipped[120]["skipped_iters"] = 1.0
    assert zd.divergence(skipped, 500)["rule"] == "nan"


def test_above_the_initial_loss_after_warmup_only():
    # warmup 500: a loss above the initial one during warmup does not count, after it does
    losses = [10.4] + [11.0] * 40 + [9.0] * 100 + [10.6] * 20
    verdict = zd.divergence(points(losses), warmup=500)
    assert verdict["rule"] == "above_init"
    first_bad = 10 * (1 + 40 + 100 + 1)  # the first point of the 10.6 stretch
    # the smoothed loss (the mean of 5 lines) passes 10.4 within 5 lines of the first 10.6
    assert first_bad <= verdict["step"] <= first_bad + 10 * (zd.SMOOTH - 1)


def test_a_spike_that_recovers_is_not_a_divergence():
    base = [10.4] + [5.0 - 0.001 * i for i in range(300)]
    spike = [7.0] * 40  # 400 iterations, then back
    tail = [4.6] * 300
    assert zd.divergence(points(base + spike + tail), warmup=100) is None


def test_a_spike_that_stays_is_one_dated_where_it_rose():
    base = [10.4] + [5.0] * 300
    stuck = [7.0] * 200  # 2000 iterations above the lowest + 1 nat
    verdict = zd.divergence(points(base + stuck), warmup=100)
    assert verdict["rule"] == "spike"
    rose = 10 * 302
    assert rose <= verdict["step"] <= rose + 10 * zd.SMOOTH
    assert verdict["confirmed_at"] - verdict["step"] >= zd.RECOVER_STEPS


def test_an_open_spike_at_the_end_counts_unresolved():
    verdict = zd.divergence(points([10.4] + [5.0] * 300 + [7.0] * 30), warmup=100)
    assert verdict["rule"] == "spike" and verdict["unresolved"] and verdict["confirmed_at"] is None


@pytest.mark.parametrize("table, p", [
    ((3, 1, 1, 3), 0.4857142857142857),        # R: fisher.test(matrix(c(3, 1, 1, 3), 2))
    ((5, 0, 0, 5), 2 / 252),                   # the two most extreme tables of 10 choose 5
    ((1, 9, 11, 3), 0.0027594561852200836),    # scipy.stats.fisher_exact's documented example
    ((0, 5, 0, 5), 1.0),
    ((2, 3, 2, 3), 1.0),
])
def test_fisher_exact(table, p):
    assert zd.fisher_exact(*table) == pytest.approx(p, rel=1e-9)
    a, b, c, d = table
    assert zd.fisher_exact(c, d, a, b) == pytest.approx(p, rel=1e-9)  # the rows' order does not matter


def test_early_warning_counts_leads_and_false_alarms():
    def run(lse, verdict_step=None):
        pts = [{"step": 10 * (i + 1), "lse_max": v} for i, v in enumerate(lse)]
        return {"points": pts, "verdict": {"step": verdict_step} if verdict_step else None}

    runs = [run([10, 20, 60, 80, 90], verdict_step=50),   # crosses 50 at step 30: 20 steps ahead
            run([10, 20, 30, 40, 45], verdict_step=50),   # never crosses before it diverges
            run([10, 55, 20, 20, 20]),                   # a false alarm
            run([10, 20, 20, 20, 20])]                   # quiet
    out = zd.early_warning(runs, "lse_max", 50)
    assert out["leads"] == [20, None] and out["warned"] == 1 and out["diverged"] == 2
    assert out["false_alarms"] == 1 and out["not_diverged"] == 2
    assert zd.early_warning(runs, "lse_max", 50, skip=20)["false_alarms"] == 0  # the crossing at step 20 skipped


def test_heldout_split_deduplicated_against_training():
    shared = [f"    line number {i} that is long enough to be counted as copied" for i in range(10)]
    own = [f"    held-out line {i} nobody trained on, long enough to count" for i in range(10)]
    train = ["\n".join(shared[:8]) + "\nshort\n"]
    valid = [
        {"wheel": "pip.whl", "path": "pip/_vendor/pygments/lexer.py", "text": "\n".join(own)},   # vendored
        {"wheel": "a.whl", "path": "a/copy.py", "text": "\n".join(shared[:6] + own[:2])},        # 6 of 8 in training
        {"wheel": "b.whl", "path": "b/mixed.py", "text": "\n".join(shared[:2] + own[:6] + ["short"])},
    ]
    texts, stats = corpus.heldout(train, valid)
    assert stats["files_vendored"] == ["pip.whl/pip/_vendor/pygments/lexer.py"]
    assert stats["files_copied"] == ["a.whl/a/copy.py"]
    assert texts == ["\n".join(own[:6] + ["short"])]  # the two lines seen in training dropped, short lines kept
    assert stats["lines_dropped"] == 2 and stats["lines_kept"] == 6
    assert train == ["\n".join(shared[:8]) + "\nshort\n"]


def test_digest_mismatch_stops_the_build():
    with pytest.raises(SystemExit, match="manifest says"):
        corpus._check("pypi_valid.bin", "0" * 64, "1" * 64)
    assert corpus._check("x", "a", None) and corpus._check("x", "a", "a")
    with pytest.raises(SystemExit):
        corpus.main(["build", "--dir", "unused", "--no-strict"])  # the option is gone: argparse refuses it


def test_arms_judge_each_run_at_its_horizon_and_fisher_against_c0():
    def run(coeff, seed, last, verdict_step=None, horizon=4000):
        return {"hidden": 256, "wd_mode": "none", "clip": 1.0, "steps": 10000, "lr": 0.3, "coeff": coeff, "seed": seed,
                "last_step": last, "horizon": horizon,
                "verdict": {"rule": "above_init", "step": verdict_step} if verdict_step else None}

    runs = [run(0.0, 1, 900, 900), run(0.0, 2, 950, 950), run(0.0, 3, 5000), run(0.0, 4, 3000),  # 4: cut, undecided
            run(1e-3, 1, 6000), run(1e-3, 2, 6000, 5500), run(1e-3, 3, 4000), run(1e-3, 4, 4200),
            {"not_started": True, **run(1e-3, 5, 0)}]
    table = zd.arms(runs)
    base, arm = table[(256, "none", 1.0, 10000, 0.3, 0.0)], table[(256, "none", 1.0, 10000, 0.3, 1e-3)]
    assert base["diverged"] == [1, 2] and base["complete"] == [3] and base["undecided"] == [4]
    assert arm["diverged"] == [] and arm["complete"] == [1, 2, 3, 4] and arm["later"] == [2]  # 5500 > horizon
    (row,) = zd.compare_to_zero(table)
    assert (row["diverged"], row["decided"], row["diverged_c0"], row["decided_c0"]) == (0, 4, 2, 3)
    assert row["p"] == pytest.approx(zd.fisher_exact(0, 4, 2, 1))
    # by hand: P(x) = C(4, x) C(3, 2 - x) / C(7, 2) = 3, 12, 6 (/21) for x = 0, 1, 2; only x = 0 is as unlikely
    assert zd.fisher_exact(0, 4, 2, 1) == pytest.approx(3 / 21)
