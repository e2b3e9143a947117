"""MindSpeed's patch manager, as its ``patch_utils.py`` behaves.

* ``register_patch(path, fn)``: ``fn`` whose name ends in ``wrapper``/``decorator`` decorates the
  function at ``path`` (registered once); any other ``fn`` replaces it.
* ``apply_patches()``: for every registered path, in registration order: the replacement (or the
  function found at the first apply) wrapped by each decorator, set on its owner and on every
  loaded module that holds the function found there. The owner is resolved at the first apply.
* ``remove_patches()``: restore what each applied patch replaced; forget replacements and decorators
  (the paths stay registered, in their order).
"""

import importlib
import sys


def _resolve(path):
    """``a.b.Cls.attr`` -> (owner, attr): the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(path)


class _Patch:
    def __init__(self, path):
        self.path = path
        self.owner = self.original = None
        self.replacement = None
        self.decorators = []
        self.applied = None

    def add(self, fn):
        if fn.__name__.endswith(("wrapper", "decorator")):
            if fn not in self.decorators:
                self.decorators.append(fn)
        else:
            self.replacement = fn
        self.applied = None

    def apply(self):
        if self.applied is not None:
            return
        owner, attr = _resolve(self.path)
        current = getattr(owner, attr)
        if self.owner is None:
            self.owner, self.original = owner, current
        final = self.replacement if self.replacement is not None else self.original
        for decorate in self.decorators:
            final = decorate(final)
        setattr(self.owner, attr, final)
        for module in list(sys.modules.values()):
            if current is not None and module is not None and module.__dict__.get(attr) is current:
                setattr(module, attr, final)
        self.applied = final

    def remove(self):
        attr = self.path.rsplit(".", 1)[1]
        if self.applied is not None:
            for holder in [self.owner] + list(sys.modules.values()):
                if holder is not None and holder.__dict__.get(attr) is self.applied:
                    setattr(holder, attr, self.original)
        self.replacement, self.decorators, self.applied = None, [], None


class MindSpeedPatchesManager:
    patches_info = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        MindSpeedPatchesManager.patches_info.setdefault(orig_func_name, _Patch(orig_func_name)).add(new_func)

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply()

    @staticmethod
    def remove_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove()
