"""The package's layers, read from its source with ``ast`` (imports inside functions count too):

    kernels/  <-  mindspeed_cez/ (ops, TP steps)  <-  patches/ (Megatron, MindSpeed, MindSpeed-LLM)

``kernels/`` imports nothing of the package outside ``kernels/`` and never reads the environment;
``mindspeed_cez/``'s modules import no ``patches/`` module, except the entry points
(:data:`ENTRY_POINTS`); no module finds one of the package's modules through ``sys.modules`` (so
these import statements are the whole graph); and no two modules import each other through any
chain (a lazy import that closes a cycle fails)."""

import ast
import importlib
import importlib.util
import os
import pkgutil
import re

import mindspeed_cez

PACKAGE = "mindspeed_cez"
KERNELS = f"{PACKAGE}.kernels"
PATCHES = f"{PACKAGE}.patches"
# What a user imports or runs to patch Megatron: the only modules of mindspeed_cez/ above patches/.
ENTRY_POINTS = {f"{PACKAGE}.megatron_adaptor", f"{PACKAGE}.launch"}


def _inside(name, package):
    return name == package or name.startswith(package + ".")


def _modules():
    """{module name: source file} of every module of the package (kernels/ and patches/ included: the
    install maps them into it, so they are not below mindspeed_cez/'s own folder)."""
    found, packages = {}, [PACKAGE, KERNELS, PATCHES]
    while packages:
        package = packages.pop()
        spec = importlib.util.find_spec(package)
        found[package] = spec.origin
        for info in pkgutil.iter_modules(spec.submodule_search_locations, prefix=f"{package}."):
            if info.ispkg:
                packages.append(info.name)
            else:
                found[info.name] = importlib.util.find_spec(info.name).origin
    return found


def test_import_changes_no_path():
    """``import mindspeed_cez`` leaves its ``__path__`` alone: kernels/ and patches/ are found through the
    install's mapping (pyproject's package-dir), also from the checkout root, where the source folder
    comes first on ``sys.path``."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import json, os, mindspeed_cez, mindspeed_cez.kernels as k, mindspeed_cez.patches as p; "
              "print(json.dumps([mindspeed_cez.__path__, k.__file__, p.__file__]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, kernels_file, patches_file = __import__("json").loads(proc.stdout.splitlines()[-1])
    assert path == [os.path.dirname(mindspeed_cez.__file__)]
    assert os.path.dirname(kernels_file).endswith("kernels") and os.path.dirname(patches_file).endswith("patches")


def _imports(name, path, modules):
    """The package's modules that ``name`` imports anywhere in its source: ``import a.b`` -> a.b,
    ``from a import b`` -> a.b when that is a module, else a; relative imports resolved."""
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _graph():
    modules = _modules()
    return modules, {name: _imports(name, path, modules) - {name} for name, path in modules.items()}


def test_every_module_imports():
    modules, _ = _graph()
    for name in modules:
        if name != f"{PACKAGE}.megatron_adaptor":  # importing it patches Megatron: its own tests do that
            importlib.import_module(name)
    assert {f"{PACKAGE}.cross_entropy_zloss", f"{KERNELS}.chunked_linear", f"{PACKAGE}.patches.reporting"} <= set(modules)


def test_kernels_import_nothing_of_the_package_outside_kernels():
    _, graph = _graph()
    for name, imported in graph.items():
        if name == KERNELS or name.startswith(KERNELS + "."):
            outside = {m for m in imported if not (m == KERNELS or m.startswith(KERNELS + "."))}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_kernels_never_read_the_environment():
    modules, _ = _graph()
    for name, path in modules.items():
        if name == KERNELS or name.startswith(KERNELS + "."):
            source = open(path).read()
            for word in ("os.environ", "getenv", "environ.get"):
                assert word not in source, f"{name} mentions {word}"


def test_ops_import_nothing_of_patches():
    _, graph = _graph()
    for name, imported in graph.items():
        if _inside(name, PATCHES) or _inside(name, KERNELS) or name in ENTRY_POINTS:
            continue
        upward = sorted(m for m in imported if _inside(m, PATCHES))
        assert not upward, f"{name} imports {upward}: Megatron's side belongs in patches/"


def test_entry_points_exist():
    modules, _ = _graph()
    assert ENTRY_POINTS <= set(modules)
    assert {f"{PATCHES}.{name}" for name in PATCHES_BY_JOB} == {m for m in modules if _inside(m, PATCHES)} - {PATCHES}


# patches/ by job: every module of it, none more (a new job is a decision, made here).
PATCHES_BY_JOB = ("import_hook", "patch_points", "loss_wrappers", "model_context", "reporting", "activation",
                  "runtime",  # the one Runtime: everything the adaptor holds while it is on
                  "mean_embedding",  # the mean output embedding: mu-loss, mu-centering's step
                  "optimizer_hooks",  # Megatron's optimizers after their step (mu-centering)
                  "arguments", "launch_checks", "settings",  # launch_checks: the command line before any parser
                  "megatron_state",  # every read of Megatron's process-wide state
                  "cpu_mode", "local_gpt")  # Megatron on a CPU and its local GPT: the demo's and tests', only when called
MAX_PATCHES_DEPTH = 5  # modules in the longest chain of imports inside patches/


def test_patches_are_at_most_five_imports_deep():
    _, graph = _graph()

    def depth(node, seen=()):
        inside = [m for m in graph.get(node, ()) if _inside(m, PATCHES) and m not in seen]
        return 1 + max((depth(m, (*seen, node)) for m in inside), default=0)

    deepest = max(depth(m) for m in graph if _inside(m, PATCHES))
    assert deepest <= MAX_PATCHES_DEPTH, f"a chain of {deepest} imports inside patches/"


def test_the_patch_points_table_is_data():
    """patch_points.py defines no function or class: the table only (how a point attaches is import_hook's)."""
    modules, _ = _graph()
    tree = ast.parse(open(modules[f"{PATCHES}.patch_points"]).read())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    assert not defined, defined


def _reaches_up(path):
    """``sys.modules[...]`` / ``sys.modules.get(...)`` with a literal naming one of the package's modules."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            key = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.modules.get", "sys.modules.pop"):
            key = node.args[0] if node.args else None
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and _inside(key.value, PACKAGE):
            found.append(key.value)
    return found


def test_no_sys_modules_reach_up():
    modules, _ = _graph()
    for name, path in modules.items():
        assert not _reaches_up(path), f"{name} looks up {_reaches_up(path)} in sys.modules: import it"


def test_a_reach_up_is_found(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("import sys\nf = sys.modules.get('mindspeed_cez.patches.x')\ng = sys.modules['megatron.core']\n")
    assert _reaches_up(str(a)) == ["mindspeed_cez.patches.x"]


def test_no_import_cycle():
    """Depth-first search for a back edge. Edges are the import statements (a module's parent
    package runs first too, which no statement says: not an edge)."""
    _, graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The checker itself: an import inside a function that closes a cycle counts."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import mindspeed_cez.b\n")
    b.write_text("def f():\n    from mindspeed_cez import a\n")
    modules = {f"{PACKAGE}.a": str(a), f"{PACKAGE}.b": str(b)}
    assert _imports(f"{PACKAGE}.b", str(b), modules) == {f"{PACKAGE}.a"}
    assert _imports(f"{PACKAGE}.a", str(a), modules) == {f"{PACKAGE}.b"}


ARCHITECTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "docs", "architecture.md")


def _architecture_layers():
    """{section title: [module names]} of docs/architecture.md's module tables (first column, in backticks)."""
    layers, title = {}, None
    for line in open(ARCHITECTURE).read().splitlines():
        if line and not line.startswith("|") and not line.startswith(" "):
            title = line
        elif line.startswith("| `") and title is not None:
            layers.setdefault(title, []).append(line.split("`")[1])
    return layers


def test_architecture_page_names_every_module_in_its_layer():
    """docs/architecture.md stays true: its tables name each module once, every one of them, in its layer,
    and its entry points are the layering's."""
    modules, _ = _graph()
    layers = _architecture_layers()
    named = [m for names in layers.values() for m in names]
    assert len(named) == len(set(named)), "a module named twice in docs/architecture.md"
    assert set(named) == set(modules), (f"docs/architecture.md lacks {sorted(set(modules) - set(named))}, "
                                        f"names what is gone: {sorted(set(named) - set(modules))}")
    entry, patches, ops, kernels = (next(names for title, names in layers.items() if title.startswith(prefix))
                                    for prefix in ("Entry points", "`patches/`", "`mindspeed_cez/`", "`kernels/`"))
    assert set(entry) == ENTRY_POINTS
    assert all(_inside(m, PATCHES) for m in patches)
    assert all(_inside(m, KERNELS) for m in kernels)
    assert not any(_inside(m, PATCHES) or _inside(m, KERNELS) or m in ENTRY_POINTS for m in ops)


# What only patches/ may know of Megatron: its modules, the weight's main_grad and its flag, its globals.
MEGATRON_WORDS = ("main_grad", "grad_added_to_main_grad", "_GLOBAL_", "sys.modules")


def _megatron_mentions(path):
    """Where a source file imports Megatron or names one of :data:`MEGATRON_WORDS` (code, strings,
    comments and docstrings alike): ``[(line, what)]``."""
    source = open(path).read()
    found = []
    for node in ast.walk(ast.parse(source, path)):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [(node.lineno, f"import {n}") for n in names if n.partition(".")[0] == "megatron"]
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "__import__") \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).partition(".")[0] == "megatron":
            found.append((node.lineno, f"import {node.args[0].value}"))
    for number, line in enumerate(source.splitlines(), 1):
        found += [(number, word) for word in MEGATRON_WORDS if word in line and word != "grad_added_to_main_grad"]
    return sorted(set(found))


def test_the_ops_and_kernels_know_nothing_of_megatron():
    """mindspeed_cez/ (the ops; the entry points aside) and kernels/ import no Megatron module and never name
    ``main_grad``, ``grad_added_to_main_grad``, a ``_GLOBAL_*`` or ``sys.modules``: the patch layer hands the
    op its TP group, gradient scale and weight-gradient target, and reads Megatron's state in
    ``patches/megatron_state.py`` alone."""
    modules, _ = _graph()
    mentions = {name: _megatron_mentions(path) for name, path in modules.items()
                if not _inside(name, PATCHES) and name not in ENTRY_POINTS}
    assert any(_inside(name, KERNELS) for name in mentions) and f"{PACKAGE}.linear_cross_entropy" in mentions
    assert not {name: found for name, found in mentions.items() if found}


def test_a_megatron_mention_is_found(tmp_path):
    """The checker itself: a Megatron import (also inside a function), each word, a docstring's mention."""
    a = tmp_path / "a.py"
    a.write_text('"""Adds into main_grad."""\nimport sys\n\n\ndef f(w):\n    from megatron.core import parallel_state\n'
                 '    w.grad_added_to_main_grad = True\n    return sys.modules.get("x"), g._GLOBAL_ARGS\n'
                 'import megatron\nimport importlib\nimportlib.import_module("megatron.training")\n')
    assert _megatron_mentions(str(a)) == [(1, "main_grad"), (6, "import megatron.core"), (7, "main_grad"),
                                          (8, "_GLOBAL_"), (8, "sys.modules"), (9, "import megatron"),
                                          (11, "import megatron.training")]


def test_megatron_state_is_read_in_one_module():
    """Megatron's private globals and ``parallel_state`` are read in ``patches/megatron_state.py`` alone, which
    names the Megatron versions each read was checked against."""
    modules, _ = _graph()
    home = f"{PATCHES}.megatron_state"
    for name, path in modules.items():
        if name == home:
            continue
        source = open(path).read()
        for word in ("_GLOBAL_", "parallel_state.", "global_vars"):
            assert word not in source, f"{name} reads Megatron's {word}: ask {home}"
    source = open(modules[home]).read()
    for version in ("0.12.1", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.19.2", "d98e8a64"):
        assert version in source, f"{home} does not say it was checked against {version}"


# The Megatron-LM main commit the CI runs: a version name (patches/megatron_state.py lists what it checked).
VERSION_NAMES = {"d98e8a64"}


def _history(path):
    """Commit hashes, dates and measurement folders (``bench/results/...``) in a source file: ``[(line, what)]``."""
    found = []
    for number, line in enumerate(open(path).read().splitlines(), 1):
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", line):
            if re.search(r"[0-9]", word) and re.search(r"[a-f]", word) and word not in VERSION_NAMES:
                found.append((number, word))
        found += [(number, date) for date in re.findall(r"\b20[0-9]{2}-[01][0-9](?:-[0-3][0-9])?\b", line)]
        found += [(number, "bench/results/") for _ in re.findall(r"bench/results/", line)]
    return found


def test_shipped_code_carries_no_history():
    """mindspeed_cez/, kernels/ and patches/ say what is: no commit hash, date or measurement folder in code,
    comments or docstrings (they go to CHANGELOG.md and docs/)."""
    modules, _ = _graph()
    found = {name: _history(path) for name, path in modules.items()}
    assert not {name: where for name, where in found.items() if where}


def test_history_is_found(tmp_path):
    a = tmp_path / "a.py"
    a.write_text('"""Read at 64b9136a (2026-07-21), main d98e8a64."""\n# see bench/results/x.md; deadbeef, 0.12.1\n')
    assert _history(str(a)) == [(1, "64b9136a"), (1, "2026-07-21"), (2, "bench/results/")]


def test_kernel_launches_take_the_loss_whole():
    """Every Triton launch in kernels/ gets the loss through ``LossSpec.kernel_args``: no ``bind`` call
    passes a field of the loss spec (``spec.z_loss_coeff``, ...) as a loose keyword."""
    modules, _ = _graph()
    loose = []
    for name, path in modules.items():
        if not _inside(name, KERNELS):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind":
                loose += [f"{name}: {k.arg}={ast.unparse(k.value)}" for k in node.keywords
                          if isinstance(k.value, ast.Attribute) and ast.unparse(k.value.value) in ("spec", "loss")]
    assert not loose, loose
