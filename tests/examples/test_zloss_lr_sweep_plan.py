"""``examples/zloss_lr_sweep.py``'s plans and Megatron arguments (no training, no Megatron needed).

* Phase A: 6 learning rates x c in {0, 1e-4, 1e-3} x seeds 1-3, seed by seed, and one same-seed
  rerun started right after the first seed; every name unique.
* Phase B: the coefficient sweep at the given learning rate (the coefficients phase A lacks, 3 seeds),
  the widths 1024 and 512 at 1e-2..3e-1 with c in {0, 1e-4}, the two weight-decay arms.
* The arguments: head size 64 at every width; decoupled weight decay passed as is, the independent
  one as ``lambda / lr_max`` (Megatron decays by ``lr(t) * wd``, so the decay is ``lambda * s(t)``);
  one validation after the last step over ``eval_iters`` batches.
* A missing requirement is named in one line with its pip install.
"""

import os
import subprocess
import sys

import pytest

from support import REPO, load_example  # noqa: E402

sweep = load_example("zloss_lr_sweep")


def _args(argv):
    return {k: v for k, v in zip(argv, argv[1:]) if k.startswith("--")}


def test_phase_a():
    plan = sweep.plan_phase("A", sweep.FULL)
    assert len(plan) == 55 and len({r["name"] for r in plan}) == 55
    main = [r for r in plan if not r["rerun"]]
    assert {(r["lr"], r["coeff"], r["seed"]) for r in main} == {
        (lr, c, s) for lr in sweep.FULL["lrs"] for c in (0.0, 1e-4, 1e-3) for s in (1, 2, 3)}
    assert [r["seed"] for r in plan[:18]] == [1] * 18 and plan[18]["rerun"] and plan[18]["seed"] == 1
    assert [r["seed"] for r in plan[19:]] == [2] * 18 + [3] * 18
    assert plan[18]["name"] == sweep.run_name(dict(plan[18], rerun=False)) + "_rerun"


def test_phase_b():
    with pytest.raises(ValueError, match="best-lr"):
        sweep.plan_phase("B", sweep.FULL)
    plan = sweep.plan_phase("B", sweep.FULL, best_lr=3e-3)
    assert len({r["name"] for r in plan}) == len(plan)
    coeff = [r for r in plan if r["group"] == "coeff"]
    assert sorted({r["coeff"] for r in coeff}) == [1e-5, 3e-4, 3e-3, 1e-2] and len(coeff) == 12
    assert {r["lr"] for r in coeff} == {3e-3} and {r["seed"] for r in coeff} == {1, 2, 3}
    widths = [r for r in plan if r["group"] == "width"]
    assert {(r["hidden"], r["lr"], r["coeff"], r["steps"]) for r in widths} == {
        (h, lr, c, sweep.SHORT_STEPS) for h in (1024, 512, 256) for lr in (3e-2, 3e-1) for c in (0.0, 1e-4)}
    wd = [r for r in plan if r["group"] == "wd"]
    assert {(r["wd_mode"], r["wd"]) for r in wd} == {("decoupled", 0.1), ("independent", 1e-4)}
    assert {r["lr"] for r in wd} == {3e-3, 3e-1} and len(wd) == 8
    # priorities: the first seed of the coefficient sweep, the arms at 3e-1, the widths at 3e-1 ... the third seed last
    assert [r["seed"] for r in plan[:4]] == [1] * 4 and plan[4]["wd_mode"] == "decoupled" and plan[4]["lr"] == 3e-1
    assert all(r["group"] == "coeff" and r["seed"] == 3 for r in plan[-4:])


def test_phase_b_completes_phase_a_first(tmp_path):
    runs = [dict(r, complete=r["seed"] != 1 or r["lr"] != 1e-2) for r in sweep.plan_phase("A", sweep.FULL)]
    (tmp_path / "summary.json").write_text(__import__("json").dumps({"runs": runs}))
    missing = sweep.missing_from(str(tmp_path / "summary.json"))
    names = [r["name"] for r in missing]
    assert names == ["h256_lr0.01_c0_s1", "h256_lr0.01_c0_s1_rerun", "h256_lr0.01_c0.0001_s1", "h256_lr0.01_c0.001_s1"]


def test_admission_fills_the_gpus_within_the_deadline():
    """Four GPUs, 32 s per hidden-256 run, 25 s to start, 390 s: 11 runs a GPU are admitted at once
    (25 + 11 x 32 = 377 s), the twelfth would end after the deadline; a hidden-1024 run of 500 steps
    counts 5.7 / 3 runs; the memory cap (12 units) holds whatever the time."""
    cfg = dict(sweep.FULL, startup_s=25)
    load, busy = {g: 0 for g in "0123"}, {g: 0.0 for g in "0123"}
    admitted = []
    for run in [sweep.make_run("main", 1e-2, 0.0, s, 256) for s in range(60)]:
        placed = sweep.place(run, run["cost"], load, busy, 0.0, cfg, 12, 390, 32)
        if placed:
            load[placed[0]] += run["cost"]
            busy[placed[0]] = placed[1]
            admitted.append(placed)
    assert len(admitted) == 44 and all(load[g] == 11 for g in load)
    assert max(end for _, end in admitted) == pytest.approx(25 + 11 * 32)
    wide = sweep.make_run("width", 3e-1, 0.0, 1, 1024, steps=500)
    fresh = {g: 0.0 for g in "0123"}
    gpu, end = sweep.place(wide, wide["cost"], {g: 0 for g in "0123"}, fresh, 100.0, cfg, 12, 390, 32)
    assert end == pytest.approx(100 + 25 + 32 * 5.7 * 500 / 1500)
    assert sweep.place(wide, wide["cost"], {g: 9 for g in "0123"}, fresh, 0.0, cfg, 12, 390, 32) is None
    assert sweep.place(wide, wide["cost"], {g: 0 for g in "0123"}, fresh, 0.0, cfg, 12, 100, None) == ("0", None)


def test_megatron_arguments():
    cfg = sweep.FULL
    for mode, lr, expected in (("none", 1e-2, 0.0), ("decoupled", 1e-2, 0.1), ("independent", 1e-2, 1e-2),
                               ("independent", 1e-1, 1e-3)):
        run = sweep.make_run("wd", lr, 1e-4, 2, 1024, mode)
        args = _args(sweep.megatron_args(cfg, run, "/d", "/o", True, 42, ("t", "v")))
        assert float(args["--weight-decay"]) == pytest.approx(expected), (mode, lr)
        assert args["--num-attention-heads"] == "16" and args["--hidden-size"] == "1024"
        assert args["--ffn-hidden-size"] == "4096" and float(args["--init-method-std"]) == pytest.approx(1024 ** -0.5)
        assert args["--seed"] == "2" and args["--lm-z-loss-coeff"] == "0.0001" and args["--lr"] == f"{lr:g}"
        assert int(args["--eval-interval"]) > cfg["steps"] and args["--eval-iters"] == "42"
        assert args["--lr-warmup-iters"] == "75" and args["--tensorboard-log-interval"] == "1"


def test_missing_requirement_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "tensorboard.py").write_text("raise ImportError('hidden for the test')\n")
    code = ("import sys; sys.path.insert(0, %r); import importlib.util as u; real = u.find_spec\n"
            "u.find_spec = lambda name, *a: None if name == 'tensorboard' else real(name, *a)\n"
            "import zloss_lr_sweep as s; sys.argv = ['x', '--data', %r]; s.main()") % (
        os.path.join(REPO, "examples"), str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('zloss_lr_sweep.py needs: pip install ".[sweep]" (missing: ') and "tensorboard" in last, \
        proc.stderr[-2000:]
