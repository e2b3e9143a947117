"""``python -m mindspeed_cez.launch SCRIPT ARGS``: SCRIPT runs as ``python SCRIPT ARGS`` would, with
the adaptor imported first (real subprocesses; Megatron's own ``pretrain`` through the launcher is
in tests/environments/megatron_loop/test_e2e_megatron_training.py, MindSpeed-LLM's stand-in in tests/environments/mindspeed_stack/test_mindspeed_llm_stand_in.py)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


@pytest.mark.parametrize("extra,env,line", BAD_LAUNCHES)
def test_a_bad_flag_value_is_an_argument_error(tmp_path, monkeypatch, extra, env, line):
    """Exit status 2 and one line naming the flag or the environment variable (argparse's form), no
    traceback, no usage dump and nothing before it: the launcher's adaptor import checks the command
    line before the script runs (its ``import megatron`` would print Megatron's warnings first), with or
    without ``megatron.training``; every message: tests/patches/test_arguments.py."""
    script = tmp_path / "pretrain.py"
    script.write_text("import megatron.core.optimizer  # prints Megatron's apex warnings\nprint('ran')\n")
    if importlib.util.find_spec("torch_npu") is not None and env.get("MINDSPEED_CEZ_BACKEND") == "cann":
        pytest.skip("torch_npu is installed here")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = _launch([str(script), *extra], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.splitlines() == [f"pretrain.py: error: {line}"], proc.stderr


def _flag_definitions():
    import argparse

    from mindspeed_cez.patches.arguments import add_lm_z_loss_args

    return add_lm_z_loss_args(argparse.ArgumentParser(add_help=False))._actions


def test_launcher_help_lists_the_flags_with_their_defaults(script, tmp_path):
    """``--help``: one line per flag of the parser's own definitions, with its default; ``SCRIPT --help``:
    the same lines first, then the script's own help (here: the script runs with ``--help`` in argv)."""
    proc = _launch(["--help"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    for action in _flag_definitions():
        flag = action.option_strings[0]
        mine = [ln for ln in lines if ln.split()[:1] == [flag]]
        assert len(mine) == 1 and "(default: " in mine[0], (flag, proc.stdout)
    assert "(default: 0.0)" in next(ln for ln in lines if ln.split()[0:1] == ["--lm-z-loss-coeff"])
    through = _launch([str(script), "--help"], cwd=tmp_path)
    assert through.returncode == 0, through.stderr
    out = through.stdout.splitlines()
    assert out.index(next(ln for ln in out if ln.split()[:1] == ["--lm-z-loss-coeff"])) < len(out) - 1
    assert json.loads(out[-1])["argv"][-1] == "--help"  # the script ran after the flags' lines


HIDE_MEGATRON = """
import importlib.machinery
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] == "megatron" else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
"""


@pytest.mark.parametrize("how", ["launcher", "adaptor", "apply"])
def test_without_megatron_core_one_line_names_the_install(script, tmp_path, how):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_MEGATRON)  # megatron-core as if not installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")]))
    command = {"launcher": ["-m", "mindspeed_cez.launch", str(script)],
               "adaptor": ["-c", "import mindspeed_cez.megatron_adaptor"],
               "apply": ["-c", "import mindspeed_cez.patches as p; p.apply(z_loss_coeff=1e-4)"]}[how]
    proc = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        "mindspeed_cez: megatron-core is not installed, and the fused loss patches Megatron's: pip install "
        "megatron-core (MindSpeed-LLM 26.x pins megatron-core==0.12.1)"], proc.stderr
