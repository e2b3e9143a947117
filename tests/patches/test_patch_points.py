"""Every entry of the patch-point table (``patches/patch_points.py``) resolved against the Megatron under
test (installed, or a checkout on ``PYTHONPATH``): a patch point that no longer exists fails here, naming
it, before a run would train without it. And the layouts the table cannot serve are refused at startup in
one line naming the version (a Megatron tree made for the test: its cross entropy moved into
``megatron/core/ops/loss``, as Megatron's nightly documentation shows it)."""

import importlib
import os
import subprocess
import sys

import pytest

from mindspeed_cez.patches import patch_points
from mindspeed_cez.patches.import_hook import ALWAYS, ADAPTOR, check_megatron_layout, module_spec, pick

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_TRAINING = module_spec("megatron.training") is not None
MEGATRON = [t for t in patch_points.TARGETS if t.route in (ALWAYS, ADAPTOR) and t.module.startswith("megatron.")]


def test_the_table_names_megatron_targets():
    assert len(MEGATRON) >= 12 and any(t.module.startswith("megatron.training") for t in MEGATRON)


@pytest.mark.parametrize("target", MEGATRON, ids=lambda t: t.label)
def test_patch_point_resolves(target):
    """Required: its module exists and holds it (``megatron.training``'s only where this Megatron has
    that package). Optional: absent with its module, not this version's (``when``, or a signature ``accepts``
    declines), inherited from a class another entry patches, else it resolves."""
    if target.module.startswith("megatron.training") and not HAS_TRAINING:
        pytest.skip("this megatron-core has no megatron.training (the wheels ship it from 0.18, Python >= 3.12)")
    if module_spec(target.module) is None:
        assert not target.required, f"{target.label}: its module {target.module} no longer exists"
        return
    module = importlib.import_module(target.module)
    if target.when is not None and not target.when(module):
        return
    if pick(target, module) is None and not target.required:
        if _inherited_from_a_patched_base(target, module):
            return  # e.g. 0.19's MambaModel: a HybridModel without a forward of its own, served by HybridModel's entry
        owner = getattr(module, target.owner, None) if target.owner else module
        if target.accepts is not None and any(callable(getattr(owner, n, None)) for n in target.names):
            return  # there, but not this version's signature (0.16's MambaModel.forward takes no loss_mask)
    assert pick(target, module) is not None, (
        f"{target.label}: {target.module} no longer holds it"
        + ("" if target.accepts is None else " (with the signature the wrapper takes)"))


def _inherited_from_a_patched_base(target, module):
    """Whether ``target``'s class has no method of its own but inherits it from a class that another entry
    of the table patches with the same wrapper."""
    owner = getattr(module, target.owner, None) if target.owner else None
    if not isinstance(owner, type):
        return False
    return any(other is not target and other.wrapper is target.wrapper and set(other.names) & set(target.names)
               and (base.__module__, base.__name__) == (other.module, other.owner)
               for base in owner.__mro__[1:] for other in MEGATRON)


def test_this_layout_is_served():
    check_megatron_layout(patch_points.TARGETS)  # raises where refused


def _fake_megatron(root, moved):
    """A Megatron tree, megatron-core 0.21.0rc0: package_info, and the cross entropy in ops/loss (``moved``) or
    nowhere (tensor_parallel/ without cross_entropy.py)."""
    core = root / "megatron" / "core"
    for package in ("", "ops", "ops/loss", "tensor_parallel"):
        (core / package).mkdir(parents=True, exist_ok=True)
        (core / package / "__init__.py").write_text("")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 21\nPATCH = 0\nPRE_RELEASE = 'rc0'\n")
    if moved:
        (core / "ops" / "loss" / "cross_entropy.py").write_text("def vocab_parallel_cross_entropy(*a): pass\n")
    return root


@pytest.mark.parametrize("how", ["launcher", "apply"])
@pytest.mark.parametrize("moved", [True, False], ids=["ops-loss", "gone"])
def test_an_unserved_layout_is_refused_in_one_line(tmp_path, how, moved):
    site = _fake_megatron(tmp_path / "megatron-lm", moved)
    script = tmp_path / "pretrain.py"
    script.write_text("print('the script ran')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO, os.environ.get("PYTHONPATH", "")]))
    command = {"launcher": ["-m", "mindspeed_cez.launch", str(script), "--lm-z-loss-coeff", "1e-4"],
               "apply": ["-c", "import mindspeed_cez.patches as p; p.apply(z_loss_coeff=1e-4)"]}[how]
    proc = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mindspeed_cez: this Megatron (megatron-core 0.21.0rc0 at "
                                                   f"{site})"), proc.stderr
    where = "megatron.core.ops.loss.cross_entropy" if moved else "megatron.core.tensor_parallel.cross_entropy"
    assert where in lines[0], lines[0]
