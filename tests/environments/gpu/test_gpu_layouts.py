"""The checks of ``tests/support/gpu_layouts.py`` (the GPU layouts matrix) on canned Megatron logs and dumps:
consistent runs pass every check, and each kind of slip fails the check meant for it."""

import math

import pytest
import torch

from support import gpu_layouts as gl
from support.megatron_launch import DUMP_ITERATION, VOCAB

ITERS, S, B, TP = 4, 6, 2, 2


def _dump(directory, seed, deferred):
    """Two micro-batches of one DP rank, both TP shards; returns lm loss, lm_z_loss, lm_lse, lm_lse_max
    in float64."""
    g = torch.Generator().manual_seed(seed)
    num_z = num_ce = num_lse = count = 0.0
    largest = -math.inf
    for mb in range(2):
        logits = 3 * torch.randn(S, B, VOCAB, generator=g)
        labels = torch.randint(0, VOCAB, (B, S), generator=g)
        mask = torch.ones(B, S)
        mask[:, S - 1 - mb:] = 0  # micro-batches count different numbers of tokens
        lse = torch.logsumexp(logits.double(), -1).transpose(0, 1)
        ce = lse - logits.double().transpose(0, 1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        num_z, num_ce, count = num_z + float((gl.Z_COEFF * lse**2 * mask).sum()), num_ce + float((ce * mask).sum()), \
            count + float(mask.sum())
        num_lse, largest = num_lse + float((lse * mask).sum()), max(largest, float(lse[mask > 0].max()))
        for tp, shard in enumerate(logits.chunk(TP, dim=-1)):
            torch.save({"logits": shard, "labels": labels, "loss_mask": mask, "tp_rank": tp, "tp_size": TP,
                        "deferred": deferred, "grad_scale_known": deferred, "into_main_grad": deferred},
                       directory / f"logits_iter{DUMP_ITERATION}_dp0_cp0_mb{mb}_tp{tp}.pt")
    return num_ce / count, num_z / count, num_lse / count, largest


def _line(it, values):
    fields = " | ".join(f"{k}: {v:.6E}" if "loss" in k else f"{k}: {v}" for k, v in values.items())
    return f" [2026-01-01 00:00:00] iteration {it:8d}/{ITERS:8d} | {fields} |"


def _runs(tmp_path, slip=None):
    runs = {}
    for variant in gl.VARIANTS:
        run = gl.Run("tp2-sp", variant, tmp_path / variant)
        (run.out / "dump").mkdir(parents=True)
        ce, z, lse, lse_max = _dump(run.out / "dump", 0, variant.startswith("fol"))
        lines = []
        for it in range(1, ITERS + 1):
            values = {"elapsed time per iteration (ms)": 100.0, "lm loss": ce if it == DUMP_ITERATION else 8.6 - it / 10}
            if variant != "ce":
                values["lm_z_loss"] = z if it == DUMP_ITERATION else 7.4e-3
                values["lm_lse"] = lse if it == DUMP_ITERATION else 8.6
                values["lm_lse_max"] = lse_max if it == DUMP_ITERATION else 9.1
            if slip == "lse_max_off" and variant == "fol" and it == DUMP_ITERATION:
                values["lm_lse_max"] -= 1e-2
            values.update({"grad norm": 1.075, "number of skipped iterations": 0, "number of nan iterations": 0})
            if slip == "z_off" and variant == "z" and it == DUMP_ITERATION:
                values["lm_z_loss"] *= 1 + 1e-3
            if slip == "no_z_line" and variant == "fol" and it == 2:
                del values["lm_z_loss"]
            if slip == "nan_iteration" and variant == "fol_recompute" and it == 4:
                values["number of nan iterations"] = 1
            if slip == "grad_norm" and variant == "fol" and it == 1:
                values["grad norm"] = 1.2
            if slip == "flag_changes_lm_loss" and variant == "z" and it == 1:
                values["lm loss"] *= 1 + 1e-3
            lines.append(_line(it, values))
        if slip == "missing_iteration" and variant == "ce":
            lines.pop()
        run.rc, run.rows = 0, gl.parse_log("\n".join(lines))
        runs[variant] = run
    return runs


LAYOUT = gl.Layout("tp2-sp", 2, gl._parallel(tp=2, sp=True))


def test_consistent_runs_pass(tmp_path):
    checks = gl.check_layout(LAYOUT, _runs(tmp_path), ITERS, cpu=True)
    assert checks.ok and len(checks.items) == 17, [c for c in checks.items if not c["ok"]]
    report = gl.table({"tp2-sp": (LAYOUT, _runs(tmp_path / "again"), checks)}, [], gl.Checks("across layouts"), None)
    row = next(line for line in report.splitlines() if line.startswith("| tp2-sp"))
    assert row.endswith("| ok (17) |"), row


@pytest.mark.parametrize("slip, failing", [
    ("z_off", "z: iteration 3 = float64 from the dumped logits"),
    ("lse_max_off", "fol: iteration 3 = float64 from the dumped logits"),
    ("no_z_line", "lm_z_loss on every log line with the flag, on none without"),
    ("nan_iteration", "fol_recompute: 4 iterations, finite, none skipped or NaN"),
    ("grad_norm", "iteration 1: grad norm, fused layer = unfused"),
    ("flag_changes_lm_loss", "iteration 1: lm loss with the flag = Megatron's CE"),
    ("missing_iteration", "ce: ran 4 iterations"),
])
def test_each_slip_fails_its_check(tmp_path, slip, failing):
    checks = gl.check_layout(LAYOUT, _runs(tmp_path, slip), ITERS, cpu=True)
    failed = [c["check"] for c in checks.items if not c["ok"]]
    assert failing in failed, failed
    report = gl.table({"tp2-sp": (LAYOUT, _runs(tmp_path / "again", slip), checks)}, [], gl.Checks("x"), None)
    assert "FAILED: " + failing in report


def test_layouts_with_the_same_weights_are_compared(tmp_path):
    """Layouts that split the same weights differently agree at iteration 1; EP or PP layouts stand apart."""
    runs = _runs(tmp_path)
    other = _runs(tmp_path / "other")
    other["z"].rows[1]["lm_z_loss"] *= 1 + 1e-2
    results = {name: (lay, r, gl.Checks(name)) for name, lay, r in [
        ("tp2-sp", LAYOUT, runs), ("mtp1-tp2-sp", gl.Layout("mtp1-tp2-sp", 2, gl._parallel(tp=2, sp=True)), other),
        ("ep2-dp2", gl.Layout("ep2-dp2", 2, gl._parallel(ep=2)), other)]}
    across = gl.check_across(results)
    assert [c["ok"] for c in across.items] == [True, False], across.items  # lm loss agrees, lm_z_loss not
    assert math.isclose(across.items[1]["value"], 1e-2, rel_tol=1e-3)


def test_layout_flags():
    """Every size asked for reaches Megatron's flags, a virtual stage of one layer too."""
    assert gl._parallel(pp=2, vpp=1) == ["--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1"]
    assert gl._parallel(tp=2, ep=2, etp=1, sp=True) == ["--tensor-model-parallel-size", "2",
                                                        "--expert-model-parallel-size", "2",
                                                        "--expert-tensor-parallel-size", "1", "--sequence-parallel"]
    assert [lay.weights for lay in gl.gpu_layouts()][:3] == ["ep1-pp1-vpp0", "ep1-pp2-vpp1", "ep4-pp1-vpp0"]


def test_gpus_are_shared_between_layouts_up_to_their_slots():
    slots = {gpu: 2 for gpu in range(4)}
    assert gl.take_gpus(slots, 4) == [0, 1, 2, 3] and gl.take_gpus(slots, 2) == [0, 1]
    assert gl.take_gpus(slots, 4) is None and gl.take_gpus(slots, 2) == [2, 3]
    assert gl.take_gpus({gpu: 2 for gpu in range(4)}, 8) is None  # eight ranks never share a GPU
