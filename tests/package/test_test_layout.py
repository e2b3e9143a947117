"""The suite's layout, so a newcomer finds a module's tests by its name.

* Each folder of tests/ mirrors one folder of the tree: a module ``kernels/x.py``, ``mindspeed_cez/x.py``,
  ``patches/x.py`` or ``examples/x.py`` has its tests in ``tests/<mirror>/test_x.py`` or ``test_x_*.py``; a
  package's ``__init__.py`` in ``test_<package>_*.py``. A module with no test file of its own is in
  :data:`NO_OWN_TESTS`, with the tests that exercise it.
* Test folders hold test files only (``test_*.py``, ``conftest.py``, ``__init__.py``): the helpers the tests
  share live in tests/support/.
* Every ``tests/...`` path the project names (docs, CI, scripts, sources, the tests' own docstrings) exists.

The module list is read from the files on disk.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")

# source folder -> (its tests' folder, the name its __init__.py's tests carry)
MIRRORS = {
    "kernels": ("tests/kernels", "kernels"),
    "mindspeed_cez": ("tests/ops", "mindspeed_cez"),
    "patches": ("tests/patches", "patches"),
    "examples": ("tests/examples", None),
}

# Modules without a test file named after them, and the tests that exercise them.
NO_OWN_TESTS = {
    "kernels/torch_reference.py": "the torch backend: every op test runs it against float64 "
                                  "(tests/ops/test_cross_entropy_zloss.py), tests/kernels/test_backends_protocol.py "
                                  "its interface",
    "kernels/chunked_linear.py": "the fused layer's GEMM-chunk backend: tests/ops/test_linear_cross_entropy.py, "
                                 "tests/kernels/test_backends_protocol.py",
    "kernels/triton_linear_cross_entropy.py": "the fused layer's Triton kernels: tests/ops/test_linear_cross_entropy.py "
                                              "(interpreter), tests/kernels/test_kernels_compile.py (compiled)",
    "kernels/triton_matmul_accumulate.py": "one of the ways of tests/ops/test_linear_forward_grads_accumulation.py",
    "mindspeed_cez/linear_recompute.py": "the recompute path's cases of tests/ops/test_linear_cross_entropy.py "
                                         "and tests/ops/test_first_order.py",
    "mindspeed_cez/linear_options.py": "the fused layer's options: tests/ops/test_linear_cross_entropy.py, "
                                       "tests/ops/test_mindspeed_cez_signatures.py",
    "mindspeed_cez/megatron_adaptor.py": "its import starts every route: tests/patches/test_launch_checks.py, "
                                         "tests/patches/test_settings_built_once.py, tests/ops/test_launch_cli.py",
    "mindspeed_cez/selfcheck_cases.py": "the self-check's cases: tests/ops/test_selfcheck.py",
    "mindspeed_cez/selfcheck_report.py": "the self-check's report: tests/ops/test_selfcheck.py",
    "patches/local_gpt.py": "the tests' model: tests/patches/test_loss_wrappers_gpt.py, tests/patches/test_cpu_mode.py",
    "patches/megatron_state.py": "Megatron's state, read on a real GPTModel: tests/patches/test_loss_wrappers_gpt.py, "
                                 "tests/patches/test_reporting_metrics.py",
    "patches/optimizer_hooks.py": "mu-centering after the optimizer's step: "
                                  "tests/patches/test_mean_embedding_mitigations.py",
    "patches/runtime.py": "the adaptor's one slot: tests/package/test_module_state.py and every test of tests/patches/",
    "examples/plot_losses.py": "the main job's plot: tests/examples/test_train_tiny_moe.py",
    "examples/pretrain_gpt.py": "Megatron's pretrain with the adaptor: tests/environments/megatron_loop/",
    "examples/pypi_text_corpus.py": "the held-out split: tests/examples/test_zloss_divergence.py",
    "examples/zloss_claims.py": "the study's claims: tests/package/test_doc_figures.py",
}

# What a test folder may hold besides test files.
TEST_FILE = re.compile(r"(test_\w+\.py|conftest\.py|__init__\.py)$")
ROOT_FILES = {"conftest.py", "run_gpu_checks.sh"}  # tests/ itself: the shared configuration, the GPU machine's entry


def _modules():
    """``folder/name.py`` of every module of the mirrored folders, private ones (``_x.py``) left out."""
    for folder in MIRRORS:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py") and (name == "__init__.py" or not name.startswith("_")):
                yield f"{folder}/{name}"


def _own_tests(module):
    """The test files named after ``module`` in its mirror folder."""
    folder, name = module.split("/")
    tests_folder, package_name = MIRRORS[folder]
    stem = package_name if name == "__init__.py" else name[: -len(".py")]
    if stem is None:
        return []
    files = os.listdir(os.path.join(ROOT, tests_folder))
    prefix = "test_" + stem
    return [f for f in files if f.endswith(".py") and (f == prefix + ".py" or f.startswith(prefix + "_"))]


def test_each_module_has_tests_named_after_it():
    missing = []
    for module in _modules():
        if module in NO_OWN_TESTS:
            continue
        if not _own_tests(module):
            missing.append(module)
    assert not missing, (f"no tests/<mirror>/test_<module>*.py for: {missing}; name the test file after the module "
                         "(see this file's docstring), or list the module in NO_OWN_TESTS with the tests that cover it")


def test_the_lists_are_honest():
    """An entry of NO_OWN_TESTS names a module that exists and has no test file of its own, and the tests
    it names exist."""
    stale = [m for m in NO_OWN_TESTS if not os.path.isfile(os.path.join(ROOT, m)) or _own_tests(m)]
    assert not stale, f"NO_OWN_TESTS entries that are gone or now have tests of their own: {stale}"
    named = [p for reason in NO_OWN_TESTS.values() for p in re.findall(r"tests/[\w/]+(?:\.py|/)", reason)]
    assert named and not [p for p in named if not os.path.exists(os.path.join(ROOT, p))]


def test_test_folders_hold_test_files_only():
    strays = []
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
        rel = os.path.relpath(folder, TESTS)
        if rel == "support" or rel.startswith("support" + os.sep):
            continue  # the shared helpers
        allowed = ROOT_FILES if rel == "." else ()
        strays += [os.path.join("tests", rel, f) for f in files
                   if not TEST_FILE.match(f) and f not in allowed and not f.endswith((".pyc", ".pyo"))]
    assert not strays, f"helpers belong in tests/support/, not beside the tests: {strays}"


# Where the project names test paths: its docs, CI, scripts and sources (bench/results/ and CHANGELOG.md record
# the past, under the paths of their day).
NAMING = ("README.md", "pyproject.toml", "docs", "examples", "bench", ".ci", "kernels", "mindspeed_cez", "patches",
          "tests")
SKIP = ("bench/results", "tests/package/test_subprocess_paths.py")  # the latter: made-up paths of its own fixtures


def test_every_tests_path_the_project_names_exists():
    missing = set()
    for top in NAMING:
        start = os.path.join(ROOT, top)
        paths = [start] if os.path.isfile(start) else [
            os.path.join(folder, f) for folder, dirs, files in os.walk(start)
            if "__pycache__" not in folder for f in files]
        for path in paths:
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            if rel.startswith(SKIP) or not rel.endswith((".py", ".sh", ".md", ".toml", "run")):
                continue
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            for named in re.findall(r"(?<![\w./-])tests/[\w/]*\w(?:\.(?:py|sh)\b|/)", text):
                if not os.path.exists(os.path.join(ROOT, named)):
                    missing.add(f"{rel}: {named}")
    assert not missing, sorted(missing)
