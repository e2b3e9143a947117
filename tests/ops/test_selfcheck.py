"""``python -m mindspeed_cez.selfcheck`` on the CPU: green as shipped (the command itself, with
``--json``), the notes it prints (where the report went, why a backend has no rows, the tokens of each
row), red with a planted broken backend (a wrong loss, a wrong gradient, a backend that
raises), and at TP = 2 through gloo collectives in two spawned processes. The real size runs
shrunk (4 tokens of vocab 151936), Triton under the interpreter at the small size only.
"""

import json
import os
import subprocess
import sys

import pytest
from support import run_on_ranks

from mindspeed_cez import kernels, selfcheck
from mindspeed_cez.kernels import torch_reference

QUICK = ["--real-rows", "4", "--reps", "0", "--small-rows", "16"]


def test_command_passes_and_writes_a_report(tmp_path):
    out = tmp_path / "report.json"
    # Outside the checkout: the installed package (the wheel in the users' leg), as a user runs it.
    proc = subprocess.run([sys.executable, "-m", "mindspeed_cez.selfcheck", *QUICK, "--reps", "1", "--dtypes",
                           "fp32,bf16", "--json", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASSED" in proc.stdout and "vocab_parallel_cross_entropy_zloss" in proc.stdout
    assert f"wrote {out} " in proc.stdout  # where the report went
    # every row says how many tokens it used: the real vocab with --real-rows 4, the small one with 16
    assert " real 4x151936 " in proc.stdout and " small 16x1000 " in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    results = report["results"]
    ops = {(r["op"], r["backend"], r["grads"]) for r in results if r["status"] == "ok"}
    assert ("vocab_parallel_cross_entropy_zloss", "torch", None) in ops
    linear = "linear_cross_entropy_zloss"
    assert {(linear, "gemm", "recompute"), (linear, "auto", "forward")} <= ops
    assert {r["vocab"] for r in results if r["status"] == "ok"} == {1000, 151936}
    assert {r["dtype"] for r in results} == {"fp32", "bf16"}
    real = [r for r in results if r["size"] == "real" and r["status"] == "ok"]
    assert real and all(r["ms"] > 0 and r["torch_ms"] > 0 for r in real)
    assert "ms on the CPU: indicative only" in proc.stdout  # what a CPU's times are worth, said where they are
    assert any(r["auto"] for r in results)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU suite: Triton runs at the small size
        assert any(r["backend"] == "triton" and r["status"] == "ok" for r in results)


@pytest.mark.parametrize("triton_installed", [True, False])
def test_says_why_a_backend_has_no_rows(monkeypatch, capsys, triton_installed):
    kernels.triton_available()  # import the kernels as the suite has them: triton.jit reads TRITON_INTERPRET then
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU as a user has it
    monkeypatch.setattr(kernels, "triton_available", lambda: triton_installed)
    status = selfcheck.main([*QUICK, "--skip-real", "--dtypes", "fp32", "--json", "-"])
    out = capsys.readouterr().out
    assert status == 0, out
    report = json.loads(out[out.index("\n{") + 1:])
    assert report["results"] and not any("triton" in (r["backend"], r["ce_backend"]) for r in report["results"])
    why = ("no GPU/NPU here: the kernels run on accelerators" if triton_installed else "Triton is not installed")
    assert report["absent_backends"]["triton"].startswith(why)
    assert report["absent_backends"]["cann"] == "Ascend NPUs only"
    assert f"no triton rows: {why}" in out and "no cann rows: Ascend NPUs only" in out


def _planted(monkeypatch, where):
    if where == "loss":
        original = torch_reference.fused_loss

        def fused_loss(*args, **kwargs):
            out = original(*args, **kwargs).clone()
            out[0] += 0.01  # a loss 0.01 too high on every token
            return out

        monkeypatch.setattr(torch_reference, "fused_loss", fused_loss)
    elif where == "grad":
        original = torch_reference.write_grad

        def write_grad(logits, grad, *args, **kwargs):
            out = original(logits, grad, *args, **kwargs)
            out[:, :1] *= 1.05  # one column's gradient 5 % off
            return out

        monkeypatch.setattr(torch_reference, "write_grad", write_grad)
    else:
        def fused_loss(*args, **kwargs):
            raise RuntimeError("planted: this backend is broken")

        monkeypatch.setattr(torch_reference, "fused_loss", fused_loss)


def test_a_broken_backend_fails_the_check(monkeypatch, capsys):
    for where, reason in (("loss", "over tolerance: loss"), ("grad", "over tolerance: grad"),
                          ("raises", "planted: this backend is broken")):
        with monkeypatch.context() as m:
            _planted(m, where)
            status = selfcheck.main([*QUICK, "--skip-real", "--dtypes", "fp32", "--json", "-"])
        out = capsys.readouterr().out
        assert status == 1, (where, out)
        report = json.loads(out[out.index("\n{") + 1:])
        failed = [r for r in report["results"] if r["status"] == "FAIL"]
        # the torch backend's rows fail (the op's, and the fused layer's that reduce through it on the CPU)
        assert failed and not any("triton" in (r["backend"], r["ce_backend"]) for r in failed), (where, failed)
        op_row = next(r for r in failed if r["op"] == "vocab_parallel_cross_entropy_zloss")
        assert op_row["backend"] == "torch" and reason in op_row["reason"] and not report["ok"]
        assert "FAILED" in out


def _two_ranks(rank, world_size, report):
    status = selfcheck.main([*QUICK, "--dtypes", "fp32", "--real-rows", "2", "--reps", "2", "--json", report])  # timed too
    assert status == 0, f"rank {rank}: selfcheck failed"


def test_two_ranks_through_gloo(tmp_path):
    report = tmp_path / "tp2.json"
    run_on_ranks(2, _two_ranks, str(report), timeout=300)
    results = json.loads(report.read_text())["results"]  # written by rank 0
    ran = [r for r in results if r["status"] == "ok"]
    assert ran and all(r["tp"] == 2 for r in results)
    assert {r["op"] for r in ran} == {"vocab_parallel_cross_entropy_zloss", "linear_cross_entropy_zloss"}
    assert {r["vocab"] for r in ran} == {1000, 151936}
