"""``patches.import_hook.module_exists``: whether a dotted module can be imported, answered from the finders
alone, at any depth, with none of its packages imported (the MindSpeed route asks it of modules such as
``mindspeed_llm.core.models.gpt.gpt_model`` while only ``mindspeed_llm`` is loaded)."""
import sys

from mindspeed_cez.patches.import_hook import module_exists


def test_a_nested_module_is_found_without_importing_its_packages(tmp_path, monkeypatch):
    deep = tmp_path / "cez_probe_pkg" / "sub" / "deep"
    deep.mkdir(parents=True)
    for package in (deep.parent.parent, deep.parent, deep):
        (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (deep / "mod.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "cez_probe_pkg" / "plain.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert module_exists("cez_probe_pkg.sub.deep.mod")
    assert module_exists("cez_probe_pkg.sub.deep") and module_exists("cez_probe_pkg")
    assert not module_exists("cez_probe_pkg.sub.deep.missing")
    assert not module_exists("cez_probe_pkg.missing.deep.mod")
    assert not module_exists("cez_probe_pkg.plain.child")  # a module, not a package: nothing below it
    assert not [name for name in sys.modules if name.startswith("cez_probe_pkg")]


def test_an_imported_module_and_a_blocked_one(monkeypatch):
    assert module_exists("json.decoder")
    monkeypatch.setitem(sys.modules, "cez_probe_blocked", None)  # import blocked, as Python marks it
    assert not module_exists("cez_probe_blocked")
