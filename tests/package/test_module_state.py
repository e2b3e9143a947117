"""State lives in objects, not modules: the few module-level names the package changes at run time
each say, in a ``# Global:`` comment line right above them, why a module must hold them (Megatron
or MindSpeed calls the patched functions without a handle, say); everything else belongs to an object.

A module-level name is state when the code rebinds it through ``global``, or it holds a container
(list, dict, set, ``ContextVar``, ...) that the module changes (a method such as ``append`` /
``update`` / ``set``, an item assignment or deletion), or it holds an instance of one of the
package's own classes (frozen dataclasses, named tuples and the kernels' launch caches aside).
Constant tables (``__all__``, a dict or list never changed) are not state.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("mindspeed_cez", "kernels", "patches")

# The module-level state the package keeps, each name with its # Global: line: the adaptor's one runtime slot
# (patches/runtime.py: Megatron's patched functions read it without a handle), and the ops' per-process
# state that works without the adaptor (the fused layer's forward-gradient ledger, the accumulation a test
# forces). A new name fails; caches keyed by immutable values (functools.lru_cache, each kernel's Launcher)
# are not state.
KNOWN_STATE = {"patches/runtime.py:RUNTIME", "mindspeed_cez/linear_forward_grads.py:_LEDGER",
               "mindspeed_cez/fp32_accumulation.py:_FORCED"}
MAX_GLOBALS = 3  # len(KNOWN_STATE)

MUTABLE_CALLS = {"list", "dict", "set", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "defaultdict",
                 "deque", "OrderedDict", "Counter", "ContextVar"}
MUTATORS = {"append", "add", "clear", "pop", "update", "extend", "remove", "discard", "setdefault", "set",
            "popitem", "insert", "reset", "sort", "reverse"}
# Instances that are caches (like functools.lru_cache): the compiled kernel per kind of arguments.
CACHE_CLASSES = {"Launcher"}


def _called_name(call):
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def _stateful_classes(trees):
    """The package's classes whose instances can change: not frozen dataclasses, named tuples, enums."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
            frozen = any("frozen=True" in ast.unparse(d) for d in node.decorator_list)
            if not (frozen or bases & {"NamedTuple", "Enum", "IntEnum"}):
                names.add(node.name)
    return names - CACHE_CLASSES


def _mutated(tree, name):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name):
            return True
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for target in getattr(node, "targets", None) or [node.target]:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == name:
                    return True
    return False


def module_state(source, stateful_classes=frozenset()):
    """``{name: (line, why)}``: the module-level names of ``source`` changed at run time."""
    tree = ast.parse(source)
    assigned = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                assigned.setdefault(target.id, (node.lineno, value))
    state = {}
    for name, (line, value) in assigned.items():
        if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and _called_name(value) in MUTABLE_CALLS):
            if _mutated(tree, name):
                state[name] = (line, "a container the module changes")
        elif isinstance(value, ast.Call) and _called_name(value) in stateful_classes:
            state[name] = (line, f"an instance of {_called_name(value)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            for name in node.names:
                state.setdefault(name, (assigned[name][0] if name in assigned else None, "rebound through global"))
    return state


def _undocumented(source, state):
    lines = source.splitlines()
    return sorted(name for name, (line, _) in state.items()
                  if line is None or line < 2 or not lines[line - 2].strip().startswith("# Global:"))


def _package_state():
    files = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    sources = {p: p.read_text() for p in files}
    classes = _stateful_classes(ast.parse(s) for s in sources.values())
    return {p.relative_to(ROOT).as_posix(): (source, module_state(source, classes)) for p, source in sources.items()}


def test_the_scan_tells_state_from_constant_tables():
    source = '''
__all__ = ["f"]
TABLE = {"a": 1}
SEEN = []
# Global: the reason.
CACHE = {}
COUNT = None
LEDGER = Ledger()
IDENTITY = Frozen()


def f(x):
    global COUNT
    COUNT = x
    SEEN.append(x)
    CACHE[x] = TABLE["a"]
'''
    state = module_state(source, {"Ledger"})
    assert sorted(state) == ["CACHE", "COUNT", "LEDGER", "SEEN"], state
    assert _undocumented(source, state) == ["COUNT", "LEDGER", "SEEN"]


def test_every_module_level_state_says_why_it_is_global():
    missing = {path: _undocumented(source, state) for path, (source, state) in _package_state().items()}
    missing = {path: names for path, names in missing.items() if names}
    assert not missing, ("module-level state without a '# Global: why' line right above it (or move it into "
                         f"an object that owns it): {missing}")


def test_the_module_level_state_stays_small():
    names = sorted(f"{path}:{name}" for path, (_, state) in _package_state().items() for name in state)
    assert len(names) <= MAX_GLOBALS, (f"{len(names)} module-level mutable names (at most {MAX_GLOBALS}): "
                                       f"{names}; gather a concern's state into one object")


def test_the_module_level_state_is_listed():
    """The package's module-level mutable names, each listed: a new one fails (the adaptor's state goes
    into its Runtime, patches/runtime.py)."""
    names = {f"{path}:{name}" for path, (_, state) in _package_state().items() for name in state}
    assert names <= KNOWN_STATE, (f"module-level state not listed: {sorted(names - KNOWN_STATE)}; put the "
                                  "adaptor's into its Runtime (patches/runtime.py), or make it a cache")
    assert names == KNOWN_STATE, f"listed but gone (drop it from KNOWN_STATE): {sorted(KNOWN_STATE - names)}"


def test_the_adaptor_state_lives_in_one_runtime():
    """Everything the adaptor holds while it is on is the Runtime's; remove() drops it."""
    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import runtime

    before = runtime.current()
    assert isinstance(before, runtime.Runtime) and before.settings is None
    for field in ("settings", "patches", "metrics", "chosen", "announced", "warned", "feature", "adaptor_mode",
                  "command_line"):
        assert hasattr(before, field), field
    patches.remove()
    after = runtime.current()
    assert after is not before and after.patches is before.patches and after.metrics is not before.metrics
    assert after.chosen == {} and after.announced is None
