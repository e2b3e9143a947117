"""``python -m mindspeed_cez.launch SCRIPT ARGS``: SCRIPT runs as ``python SCRIPT ARGS`` would, with
the adaptor imported first (real subprocesses; Megatron's own ``pretrain`` through the launcher is
in tests/test_e2e_megatron_training.py, MindSpeed-LLM's stand-in in tests/test_mindspeed_llm_stand_in.py)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys
    adaptor = sys.modules.get("mindspeed_cez.megatron_adaptor")  # imported before this line runs
    import sibling  # a module beside the script: its folder is first on sys.path
    from mindspeed_cez.patches import active_settings
    settings = active_settings()
    print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "sibling": sibling.VALUE,
                      "mode": adaptor and adaptor.MODE,
                      "coeff": None if settings is None else settings.z_loss_coeff}))
    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
""")


def _launch(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mindspeed_cez.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "sibling.py").write_text("VALUE = 42\n")
    path = folder / "pretrain.py"
    path.write_text(SCRIPT)
    return path


def test_runs_the_script_as_main_with_its_arguments_and_the_adaptor(script, tmp_path):
    proc = _launch([str(script), "--lm-z-loss-coeff", "1e-3", "--other", "x"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["name"] == "__main__" and seen["file"] == str(script) and seen["sibling"] == 42
    assert seen["argv"] == [str(script), "--lm-z-loss-coeff", "1e-3", "--other", "x"]
    assert seen["mode"] in ("megatron.core", "megatron.training", "mindspeed")
    if seen["mode"] == "megatron.core":  # no Megatron parser: the flags are read from sys.argv
        assert seen["coeff"] == 1e-3


def test_the_script_exit_code_and_bad_usage(script, tmp_path):
    assert _launch([str(script), "7"], cwd=tmp_path).returncode == 7
    none = _launch([], cwd=tmp_path)
    assert none.returncode == 2 and "usage: python -m mindspeed_cez.launch SCRIPT" in none.stderr
    missing = _launch([str(tmp_path / "nope.py")], cwd=tmp_path)
    assert missing.returncode == 2 and "is not a file" in missing.stderr


BAD_LAUNCHES = [  # (extra arguments, environment, the one error line after "pretrain.py: error: ")
    (["--lm-z-loss-coeff", "abc"], {}, "--lm-z-loss-coeff must be a finite number >= 0, got 'abc'"),
    (["--lm-fused-ce"], {"MINDSPEED_CEZ_BACKEND": "cuda"}, "MINDSPEED_CEZ_BACKEND='cuda': choose one of ('torch', "
                                                          "'triton', 'cann') (or leave it unset: automatic)"),
    (["--lm-fused-ce"], {"MINDSPEED_CEZ_BACKEND": "cann"}, "MINDSPEED_CEZ_BACKEND=cann needs torch_npu with "
                                                           "npu_cross_entropy_loss (Ascend NPUs, CANN), which does not "
                                                           "import here: unset it (automatic) or choose triton or torch"),
]


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None,
                    reason="with megatron.training the flags go through Megatron's own parser, which this script "
                           "never calls: tests/test_e2e_megatron_training.py runs that through pretrain")
@pytest.mark.parametrize("extra,env,line", BAD_LAUNCHES)
def test_a_bad_flag_value_is_an_argument_error(script, tmp_path, monkeypatch, extra, env, line):
    """Exit status 2 and one line naming the flag or the environment variable (argparse's form), no
    traceback and no usage dump, where the adaptor reads the flags from ``sys.argv`` (megatron-core
    without ``megatron.training``); Megatron's own ``pretrain`` through examples/pretrain_gpt.py:
    tests/test_e2e_megatron_training.py; every message: tests/test_arguments.py."""
    if importlib.util.find_spec("torch_npu") is not None and env.get("MINDSPEED_CEZ_BACKEND") == "cann":
        pytest.skip("torch_npu is installed here")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = _launch([str(script), *extra], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert errors == [f"pretrain.py: error: {line}"], proc.stderr
