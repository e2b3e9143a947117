"""apply/remove on megatron-core (single process), import-site copies, and the MindSpeed path.

The MindSpeed path runs against a *recording stand-in* for MindSpeed's patch manager and feature
base (MindSpeed is not on PyPI): it implements only the API surface read at Ascend/MindSpeed
028de58c (register_patch decorating with '*wrapper' functions, apply_patches, FEATURES_LIST).
"""

import argparse
import os
import sys
import types
import warnings

import pytest
import torch

from mindspeed_cez.kernels import LogitTransform

pytest.importorskip("megatron.core")

import mindspeed_cez.patches as patches  # noqa: E402
from mindspeed_cez.patches import activation, runtime  # noqa: E402
from mindspeed_cez.patches import settings as _settings  # noqa: E402


def _logits_target(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3, 40, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, 40, (6, 3), generator=g)
    return logits, target


def _ref(logits, target, c, a=0.0):
    lse = torch.logsumexp(logits, -1)
    ce = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    v = logits.shape[-1]
    s = a * v / (v - 1)  # Megatron's smoothing convention
    mean_logp = (logits - lse.unsqueeze(-1)).mean(-1)
    return (1 - s) * ce - s * mean_logp + c * lse**2


def _assert_ce_value_and_z_loss_gradient(call, logits, target, c, a=0.0):
    """Megatron's convention for auxiliary losses: the value is CE, the gradient CE + c*lse^2."""
    x = logits.float().requires_grad_()
    weights = torch.rand(target.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = call(x)
    (out.double() * weights).sum().backward()
    x64 = logits.clone().requires_grad_()
    (_ref(x64, target, c, a) * weights).sum().backward()
    torch.testing.assert_close(out.detach().double(), _ref(logits, target, 0.0, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


def test_apply_remove_idempotent_and_import_site_copies():
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.models.common.language_module import language_module as lm

    patches.remove()  # start from Megatron's own functions (an adaptor import may have installed them)
    orig_vp = tensor_parallel.vocab_parallel_cross_entropy
    orig_fused = lm.fused_vocab_parallel_cross_entropy
    orig_method = lm.LanguageModule.compute_language_model_loss
    copy_site = types.ModuleType("cez_fake_import_site")  # a module that did `from x import f`
    copy_site.vocab_parallel_cross_entropy = orig_vp
    sys.modules["cez_fake_import_site"] = copy_site
    try:
        patches.apply(z_loss_coeff=1e-2)
        first = tensor_parallel.vocab_parallel_cross_entropy
        patches.apply(z_loss_coeff=2e-2)  # second apply: same patch objects, new settings
        assert tensor_parallel.vocab_parallel_cross_entropy is first is not orig_vp
        assert copy_site.vocab_parallel_cross_entropy is first
        assert lm.fused_vocab_parallel_cross_entropy is fused_cross_entropy.fused_vocab_parallel_cross_entropy
        assert lm.fused_vocab_parallel_cross_entropy is not orig_fused
        assert lm.LanguageModule.compute_language_model_loss is not orig_method
        assert callable(lm.te_parallel_cross_entropy)

        logits, target = _logits_target(0)
        for fn in (first, lm.fused_vocab_parallel_cross_entropy, lm.te_parallel_cross_entropy):
            call = (lambda x: fn(x, target)) if fn is first else (lambda x: fn(x, target, None))
            _assert_ce_value_and_z_loss_gradient(call, logits, target, 2e-2)
        # label smoothing in Megatron's convention
        _assert_ce_value_and_z_loss_gradient(lambda x: first(x, target, label_smoothing=0.1), logits, target, 2e-2, 0.1)
    finally:
        patches.remove()
        patches.remove()
        sys.modules.pop("cez_fake_import_site", None)
    assert tensor_parallel.vocab_parallel_cross_entropy is orig_vp
    assert copy_site.vocab_parallel_cross_entropy is orig_vp
    assert lm.fused_vocab_parallel_cross_entropy is orig_fused
    assert lm.LanguageModule.compute_language_model_loss is orig_method
    assert lm.te_parallel_cross_entropy is None or not hasattr(lm.te_parallel_cross_entropy, "__cez_wraps__")
    assert patches.active_settings() is None


def test_invalid_apply_arguments():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="z_loss_coeff"):
            patches.apply(z_loss_coeff=bad)
    assert patches.active_settings() is None


# ---------------------------------------------------------------- MindSpeed (recording stand-in)


def _resolve(path):
    """``a.b.mod.Cls.attr`` -> (owner, attr), importing as MindSpeed's ``Patch.parse_path`` does."""
    import importlib

    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1]
    raise ImportError(path)


class _RecordingPatchManager:
    """Stand-in for mindspeed.patch_utils.MindSpeedPatchesManager (registration + decorate on apply)."""

    registered = {}
    applied = {}

    @classmethod
    def register_patch(cls, orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        wrappers = cls.registered.setdefault(orig_func_name, [])
        assert new_func.__name__.endswith("wrapper"), "MindSpeed decorates only with '*wrapper' functions"
        if new_func not in wrappers:
            wrappers.append(new_func)

    @classmethod
    def apply_patches(cls):
        for name, wrappers in cls.registered.items():
            if name in cls.applied:
                continue
            owner, attr = _resolve(name)
            orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
            func = orig
            for w in wrappers:
                func = w(func)
            setattr(owner, attr, func)
            if not isinstance(owner, type):  # MindSpeed also rebinds copies in loaded modules
                for module in list(sys.modules.values()):
                    if module is not None and module is not owner and getattr(module, attr, None) is orig and orig is not None:
                        setattr(module, attr, func)
            cls.applied[name] = (owner, attr, orig, func)

    @classmethod
    def remove_patches(cls):
        for owner, attr, orig, func in cls.applied.values():
            for module in list(sys.modules.values()) + [owner]:
                if getattr(module, attr, None) is func:
                    setattr(module, attr, orig)
            if isinstance(owner, type):
                setattr(owner, attr, orig)
        cls.applied.clear()
        cls.registered.clear()


class _Feature:
    """Stand-in for mindspeed.features_manager.feature.MindSpeedFeature (constructor + is_need_apply)."""

    def __init__(self, feature_name, optimization_level=2):
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = optimization_level == 0

    def is_need_apply(self, args):
        return self.default_patches


@pytest.fixture
def fake_mindspeed(monkeypatch):
    class FeaturesManager:
        FEATURES_LIST = []

    mods = {
        "mindspeed": types.ModuleType("mindspeed"),
        "mindspeed.features_manager": types.ModuleType("mindspeed.features_manager"),
        "mindspeed.features_manager.feature": types.ModuleType("mindspeed.features_manager.feature"),
        "mindspeed.features_manager.features_manager": types.ModuleType("mindspeed.features_manager.features_manager"),
        "mindspeed.patch_utils": types.ModuleType("mindspeed.patch_utils"),
    }
    mods["mindspeed.features_manager.feature"].MindSpeedFeature = _Feature
    mods["mindspeed.features_manager.features_manager"].MindSpeedFeaturesManager = FeaturesManager
    mods["mindspeed.patch_utils"].MindSpeedPatchesManager = _RecordingPatchManager
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    patches.remove()
    registered = runtime.current().feature
    runtime.current().feature = None
    yield FeaturesManager
    _RecordingPatchManager.remove_patches()
    runtime.set_active(None)
    runtime.current().feature = registered


def test_mindspeed_feature_registers_args_validation_and_patches(fake_mindspeed):
    from megatron.core.models.common.language_module import language_module as lm

    orig = lm.LanguageModule.compute_language_model_loss
    feature = activation.register_with_mindspeed()
    assert activation.register_with_mindspeed() is feature  # idempotent
    assert fake_mindspeed.FEATURES_LIST == [feature] and feature.feature_name == "lm_z_loss"
    assert feature.is_need_apply(argparse.Namespace())  # a default (always applied) feature
    assert any(n.endswith("LanguageModule.compute_language_model_loss") for n in _RecordingPatchManager.registered)
    assert lm.LanguageModule.compute_language_model_loss is not orig
    assert patches.installed_targets() == []  # nothing patched outside MindSpeed's manager

    parser = argparse.ArgumentParser()
    feature.register_args(parser)
    args = parser.parse_args(["--lm-z-loss-coeff", "5e-3"])
    feature.validate_args(argparse.Namespace(hidden_size=4))  # a TransformerConfig-like object
    assert patches.active_settings() is None
    feature.validate_args(args)
    assert patches.active_settings().z_loss_coeff == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="--lm-z-loss-coeff"):
        feature.validate_args(parser.parse_args(["--lm-z-loss-coeff=-1"]))

    # through MindSpeed's manager the patched function computes CE + c*lse^2
    from megatron.core import tensor_parallel

    logits, target = _logits_target(3)
    _assert_ce_value_and_z_loss_gradient(lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target), logits, target, 5e-3)
    # apply() disagreeing with the parsed flags: one error naming both, the flags' settings stay
    with pytest.raises(ValueError, match=r"apply\(z_loss_coeff=0.001\) and the flags \(--lm-z-loss-coeff 0.005\)"):
        patches.apply(z_loss_coeff=1e-3)
    assert patches.active_settings().z_loss_coeff == pytest.approx(5e-3)
    # patches.apply() in MindSpeed mode goes through the same manager
    patches.remove()
    patches.apply(z_loss_coeff=1e-3)
    assert patches.installed_targets() == []
    _assert_ce_value_and_z_loss_gradient(lambda x: tensor_parallel.vocab_parallel_cross_entropy(x, target), logits, target, 1e-3)


def test_training_log_wrapped_twice_reports_once():
    """One training_log reachable under two names gets our wrapper twice (MindSpeed-LLM 2.2.0
    re-exports Megatron's): the outer adds lm_z_loss, the inner passes the loss_dict through."""
    from mindspeed_cez.patches import reporting as metrics
    from mindspeed_cez.patches.reporting import training_log_wrapper

    seen = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration):
        seen.append(dict(loss_dict))

    twice = training_log_wrapper(training_log_wrapper(training_log))
    patches.apply(z_loss_coeff=0.5)
    try:
        z = torch.tensor([1.0, 3.0, 5.0])
        metrics.record_lm_z_loss(z, torch.tensor([1.0, 1.0, 0.0]))
        twice({"lm loss": torch.tensor(2.0)}, {}, 1e-4, 1)
    finally:
        patches.remove()
    assert len(seen) == 1 and float(seen[0]["lm_z_loss"]) == pytest.approx(2.0), seen


@pytest.fixture
def megatron_args(monkeypatch):
    """Megatron's parsed arguments as ``get_args()`` holds them (a plain Namespace here)."""
    holder = types.ModuleType("megatron.training.global_vars")
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", holder)

    def set_args(**kwargs):
        holder._GLOBAL_ARGS = argparse.Namespace(**kwargs)

    yield set_args
    patches.remove()


def test_apply_runs_the_startup_checks_on_megatron_args(megatron_args):
    """apply() refuses MindSpeed-LLM's modes that bypass the fused kernel, as the flags do."""
    megatron_args(loss_compute_mode="chunk", tensor_model_parallel_size=1, context_parallel_size=1)
    with pytest.raises(ValueError, match=r"apply\(z_loss_coeff=0.0001\) and MindSpeed-LLM's --loss-compute-mode chunk"):
        patches.apply(z_loss_coeff=1e-4)
    assert patches.active_settings() is None  # refused before anything was activated
    megatron_args(is_instruction_dataset=True)
    with pytest.raises(ValueError, match="--is-instruction-dataset"):
        patches.apply(z_loss_coeff=1e-4)
    megatron_args(output_logit_softcapping=30.0)
    assert patches.apply(z_loss_coeff=1e-4).logit_transform == LogitTransform(cap=30.0)  # served in the kernels
    assert patches.apply(z_loss_coeff=1e-4, fused_output_layer=True).logit_transform == LogitTransform(cap=30.0)
    assert patches.apply(z_loss_coeff=1e-4, logit_transform=False).logit_transform is None
    megatron_args(add_output_layer_bias=True)
    with pytest.raises(ValueError, match=r"apply\(fused_output_layer=True\) and MindSpeed-LLM's --add-output-layer-bias"):
        patches.apply(z_loss_coeff=1e-4, fused_output_layer=True)
    megatron_args(loss_compute_mode="chunk", tensor_model_parallel_size=2)  # chunk mode at TP>1: served
    assert patches.apply(z_loss_coeff=1e-4).z_loss_coeff == 1e-4


def test_apply_warns_once_where_it_cannot_check(monkeypatch):
    """MindSpeed-LLM loaded, Megatron's arguments not parsed yet: one loud warning, then quiet."""
    for name in ("mindspeed_llm", "mindspeed_llm.training"):  # packages with nothing in them
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    runtime.current().warned.discard("apply_unchecked")
    try:
        with pytest.warns(UserWarning, match="--loss-compute-mode chunk at TP=1.*could not be checked"):
            patches.apply(z_loss_coeff=1e-4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            patches.apply(z_loss_coeff=1e-4)
    finally:
        patches.remove()


def test_backends_from_the_environment_name_the_variable():
    env = {"MINDSPEED_CEZ_BACKEND": "torch", "MINDSPEED_CEZ_LINEAR_BACKEND": ""}
    assert _settings.backends_from_environment(env) == {"backend": "torch", "linear_backend": None}
    with pytest.raises(ValueError, match="MINDSPEED_CEZ_LINEAR_BACKEND='cublas'"):
        _settings.backends_from_environment({"MINDSPEED_CEZ_LINEAR_BACKEND": "cublas"})
    with pytest.raises(ValueError, match="backend must be None or one of"):
        patches.apply(backend="cuda")


# ---------------------------------------------------------------- attaching when Megatron is imported

LATE_IMPORTS = """
import json, sys
megatron = lambda: sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
import mindspeed_cez.megatron_adaptor
from mindspeed_cez import patches
patches.apply(z_loss_coeff=1e-3)
seen = {"after_register": megatron()}
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # a copy bound after the hook ran
from megatron.core.tensor_parallel import cross_entropy
from megatron.core.models.gpt import gpt_model
from megatron.core.models.common.language_module.language_module import LanguageModule
wrapped = lambda f: getattr(f, "__cez_wraps__", None) is not None
seen["copy"] = vocab_parallel_cross_entropy is cross_entropy.vocab_parallel_cross_entropy and wrapped(vocab_parallel_cross_entropy)
seen["method"] = wrapped(LanguageModule.compute_language_model_loss)
seen["gpt"] = wrapped(vars(gpt_model.GPTModel).get("_postprocess") or gpt_model.GPTModel.forward)
seen["installed"] = len(patches.installed_targets())
patches.remove()
import megatron.core.tensor_parallel as tp
seen["removed"] = not any(wrapped(f) for f in (tp.vocab_parallel_cross_entropy, cross_entropy.vocab_parallel_cross_entropy,
                                                LanguageModule.compute_language_model_loss))
print(json.dumps(seen))
"""


def test_registering_imports_no_megatron_and_patches_attach_at_import():
    """The adaptor import and apply() import no Megatron module; each patch attaches when the program
    imports its module, also in copies bound by ``from x import f`` afterwards; remove() restores them."""
    import json
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", LATE_IMPORTS], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])), cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["after_register"] == [], seen["after_register"][:10]
    assert seen["copy"] and seen["method"] and seen["gpt"] and seen["installed"] >= 5, seen
    assert seen["removed"], seen


def test_a_required_target_that_cannot_attach_is_an_error_naming_it(tmp_path, monkeypatch):
    """A module imported without the function a required patch replaces: activating fails naming it
    (never a silent miss); once active, the import itself fails. A feature-detected optional one is quiet."""
    from mindspeed_cez.patches import import_hook, patch_points

    (tmp_path / "cez_fake_megatron_mod.py").write_text("def other():\n    return 1\n")
    (tmp_path / "cez_fake_megatron_late.py").write_text("def other():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wrapper = patch_points.TARGETS[1].wrapper
    registry = runtime.current().patches  # the same registry before and after remove()
    monkeypatch.setattr(registry, "table", [
        import_hook.Target("cez_fake_megatron_mod", "", ("loss_fn",), wrapper),
        import_hook.Target("cez_fake_megatron_mod", "", ("optional_fn",), wrapper, required=False),
        import_hook.Target("cez_fake_megatron_late", "", ("loss_fn",), wrapper)])
    patches.remove()
    try:
        registry.install_patches()
        import cez_fake_megatron_mod  # noqa: F401

        with pytest.raises(patches.PatchTargetError, match=r"cannot patch cez_fake_megatron_mod\.loss_fn:"):
            patches.apply(z_loss_coeff=1e-3)
        assert patches.active_settings() is None
        registry.forget_failures()  # as if that module had not been imported
        registry.strict = True  # as activation leaves it
        runtime.set_active(patches.Settings(z_loss_coeff=1e-3))
        with pytest.raises(patches.PatchTargetError, match=r"cez_fake_megatron_late\.loss_fn"):
            import cez_fake_megatron_late  # noqa: F401
    finally:
        patches.remove()
        for name in ("cez_fake_megatron_mod", "cez_fake_megatron_late"):
            sys.modules.pop(name, None)
