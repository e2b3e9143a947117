"""From the checkout root a non-editable install is shadowed by the source folder ``mindspeed_cez/``, whose
``kernels`` / ``patches`` only an install maps into the package: the import says so in one line, naming
the checkout and ``pip install -e .``; from another folder the installed copy imports whole.

Real subprocesses, each with a non-editable copy of the package laid out as the wheel installs it
(pyproject's ``package-dir``: ``kernels/`` -> ``mindspeed_cez/kernels``) and without this environment's
editable-install finder (setuptools' ``__editable__`` meta-path finder, which would map the checkout's
kernels/ and patches/ in)."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
editable = lambda f: (getattr(f, "__module__", "") or type(f).__module__).startswith("__editable__")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]  # setuptools installs the class itself
sys.path.append(sys.argv[1])
import mindspeed_cez, mindspeed_cez.patches.patch_points, mindspeed_cez.kernels
print(mindspeed_cez.__file__)
"""


def _installed_copy(site):
    package = site / "mindspeed_cez"
    shutil.copytree(os.path.join(REPO, "mindspeed_cez"), package, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("kernels", "patches"):
        shutil.copytree(os.path.join(REPO, sub), package / sub, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def _run(cwd, site):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    return subprocess.run([sys.executable, "-c", SCRIPT, str(site)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_checkout_root_shadowing_a_non_editable_install_says_so(tmp_path):
    site = tmp_path / "site"
    _installed_copy(site)
    proc = _run(REPO, site)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mindspeed_cez: you are importing the source tree at "), proc.stderr[-3000:]
    assert REPO in last and "`pip install -e .`" in last and "another directory" in last, last


def test_the_installed_copy_imports_from_another_folder(tmp_path):
    site = tmp_path / "site"
    package = _installed_copy(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run(elsewhere, site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == str(package / "__init__.py"), proc.stdout
