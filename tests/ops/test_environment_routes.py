"""The MINDSPEED_CEZ_* variables read and checked the same on every route (mindspeed_cez/environment.py):
the launcher, the adaptor's import, ``patches.apply()`` and the self-check, each in a real process."""

import os
import subprocess
import sys

import pytest

from mindspeed_cez import environment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_TRITON_DEVICE = environment.triton_cannot_run({})  # None where a GPU/NPU runs Triton here

BAD = [
    ({"MINDSPEED_CEZ_BACKND": "torch"}, "unknown environment variable MINDSPEED_CEZ_BACKND: did you mean MINDSPEED_CEZ_BACKEND?"),
    ({"MINDSPEED_CEZ_BACKEND": "cuda"},
     "MINDSPEED_CEZ_BACKEND='cuda': choose one of ('torch', 'triton', 'cann') (or leave it unset: automatic)"),
    ({"MINDSPEED_CEZ_LINEAR_BACKEND": "cublas"},
     "MINDSPEED_CEZ_LINEAR_BACKEND='cublas': choose one of ('gemm', 'triton') (or leave it unset: automatic)"),
]
if NO_TRITON_DEVICE:
    BAD.append(({"MINDSPEED_CEZ_BACKEND": "triton"},
                f"MINDSPEED_CEZ_BACKEND=triton cannot run here: {NO_TRITON_DEVICE}; unset it (automatic) or choose torch"))


def _run(args, env, tmp_path):
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    for name in ("TRITON_INTERPRET", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def _routes(tmp_path):
    script = tmp_path / "pretrain.py"
    script.write_text("print('ran')\n")
    adaptor = tmp_path / "adaptor.py"
    adaptor.write_text("import mindspeed_cez.megatron_adaptor\nprint('ran')\n")
    return {"launcher": (["-m", "mindspeed_cez.launch", str(script)], "pretrain.py: error: "),
            "import": ([str(adaptor)], "adaptor.py: error: "),
            "apply": (["-c", "import mindspeed_cez.patches as p; p.apply(1e-2)"], "ValueError: "),
            "selfcheck": (["-m", "mindspeed_cez.selfcheck", "--skip-real"], "selfcheck: error: ")}


@pytest.mark.slow
@pytest.mark.parametrize("env,message", BAD)
def test_every_route_refuses_a_bad_variable_with_the_same_line(env, message, tmp_path):
    for route, (args, prefix) in _routes(tmp_path).items():
        proc = _run(args, env, tmp_path)
        assert proc.returncode != 0 and "ran" not in proc.stdout, (route, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines()[-1] == prefix + message, (route, proc.stderr)


def test_apply_takes_the_variables_where_its_arguments_are_none(tmp_path):
    code = ("import mindspeed_cez.patches as p; s = p.apply(1e-2); print(s.backend, s.linear_backend)\n"
            "try:\n    p.apply(1e-2, backend='triton')\nexcept ValueError as e:\n    print(e)")
    proc = _run(["-c", code], {"MINDSPEED_CEZ_BACKEND": "torch", "MINDSPEED_CEZ_LINEAR_BACKEND": "gemm"}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    on, *printed = proc.stdout.splitlines()
    assert on == "mindspeed_cez: on: LM z-loss coefficient 0.01, backend torch; logs lm_z_loss"  # the startup line
    assert printed == ["torch gemm", "apply(backend='triton') and MINDSPEED_CEZ_BACKEND='torch' "
                                     "disagree: keep one (drop the argument or unset the variable)"]


def test_triton_on_the_cpu_interpreter_stays_allowed():
    if environment.triton_cannot_run({"TRITON_INTERPRET": "1"}):
        pytest.skip("Triton does not import here")
    assert environment.read_backends({"MINDSPEED_CEZ_BACKEND": "triton", "TRITON_INTERPRET": "1"}) == {
        "backend": "triton", "linear_backend": None}


def test_the_selfcheck_marks_the_variables_choice_as_what_a_run_uses(monkeypatch):
    import torch

    from mindspeed_cez import selfcheck_cases

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if environment.triton_cannot_run({"TRITON_INTERPRET": "1"}):
        pytest.skip("Triton does not import here")
    cpu = torch.device("cpu")
    assert dict(selfcheck_cases.ce_backends(cpu, 1)) == {"triton": False, "torch": True}  # automatic on a CPU
    chosen = environment.read_backends({"MINDSPEED_CEZ_BACKEND": "triton", "TRITON_INTERPRET": "1"})
    assert dict(selfcheck_cases.ce_backends(cpu, 1, chosen)) == {"triton": True, "torch": False}
    used = [(lb, ce) for lb, _, ce, auto in selfcheck_cases.linear_variants(cpu, 1, chosen) if auto]
    assert used == [("gemm", "triton")]
