"""The MindSpeed feature against MindSpeed's real source (``../shared/third_party``'s archive, or ``CEZ_MINDSPEED_SRC=<checkout>``).

MindSpeed is not on PyPI, and its package ``mindspeed.features_manager`` imports ``torch_npu`` in
its ``__init__`` (through its fused MoE permute feature), so it does not import on a machine
without Ascend. Its plug-in surface does: ``mindspeed/patch_utils.py`` (``MindSpeedPatchesManager``),
``features_manager/feature.py`` (``MindSpeedFeature``) and ``features_manager/features_manager.py``
(``MindSpeedFeaturesManager``) import only the standard library and ``patch_utils``. This test
loads those three real files (the package ``__init__`` is skipped) and, in a fresh process with
megatron-core, checks what ``import mindspeed_cez.megatron_adaptor`` does through them:

* the adaptor takes the MindSpeed path: our feature joins MindSpeed's ``FEATURES_LIST`` and its
  wrappers are applied by MindSpeed's own patch manager, once, also after MindSpeed applies
  every feature's patches again;
* MindSpeed's argument hooks add ``--lm-z-loss-coeff`` and its validation activates the loss (and
  refuses a negative coefficient naming the flag);
* on a MoE GPTModel: the loss is CE, its logits gradient that of CE + c*lse^2 (float64), and
  ``lm_z_loss`` the token-weighted mean; MindSpeed's ``remove_patches`` restores Megatron.

In CI on every leg that runs the suite (MindSpeed cannot be installed there: its source is read).
"""

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
from support import mindspeed_llm_source  # noqa: E402


def _source():
    """CEZ_MINDSPEED_SRC, else ../shared/third_party's MindSpeed: the 0.12.1 line's branch on MindSpeed-LLM's
    Python 3.10, master elsewhere (None where the archives are not here; CI=true: an error)."""
    if os.environ.get("CEZ_MINDSPEED_SRC"):
        return os.environ["CEZ_MINDSPEED_SRC"]
    triple = mindspeed_llm_source.sources("v26.0.0" if sys.version_info[:2] == (3, 10) else "master")
    return None if triple is None else triple[1]


SOURCE = _source()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SOURCE, reason="no MindSpeed source: ../shared/third_party, or set CEZ_MINDSPEED_SRC"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo test"),
]


def _load_mindspeed_plugin_surface(source):
    """Import MindSpeed's patch manager and feature classes from ``source`` without torch_npu."""
    import types

    sys.path.insert(0, source)
    import mindspeed.patch_utils  # noqa: F401  (plain module)

    package = types.ModuleType("mindspeed.features_manager")  # its __init__ needs torch_npu
    package.__path__ = [os.path.join(source, "mindspeed", "features_manager")]
    sys.modules["mindspeed.features_manager"] = package
    from mindspeed.features_manager.feature import MindSpeedFeature

    package.MindSpeedFeature = MindSpeedFeature
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return MindSpeedFeaturesManager, MindSpeedPatchesManager


def _worker(rank, world_size, source):
    import argparse

    from support import tiny_gpt as gpt

    features, patch_manager = _load_mindspeed_plugin_surface(source)
    from megatron.core.models.common.language_module import language_module as lm

    original = lm.LanguageModule.compute_language_model_loss
    import mindspeed_cez.megatron_adaptor as adaptor
    from mindspeed_cez import patches
    from mindspeed_cez.patches import reporting as metrics

    assert adaptor.MODE == "mindspeed", adaptor.MODE
    ours = [f for f in features.FEATURES_LIST if f.feature_name == "lm_z_loss"]
    assert len(ours) == 1
    assert patches.installed_targets() == []  # MindSpeed's manager did the patching
    path = "megatron.core.models.common.language_module.language_module.LanguageModule.compute_language_model_loss"
    assert path in patch_manager.patches_info
    assert lm.LanguageModule.compute_language_model_loss.__cez_wraps__ is original

    parser = argparse.ArgumentParser()
    features.register_features_args(parser)
    with pytest.raises(ValueError, match="--lm-z-loss-coeff"):
        features.validate_features_args(parser.parse_args(["--lm-z-loss-coeff=-1"]))
    args = parser.parse_args(["--lm-z-loss-coeff", str(gpt.COEFF), "--lm-z-loss-log-lse"])
    args.optimization_level = 2
    features.validate_features_args(args)
    assert patches.active_settings().z_loss_coeff == gpt.COEFF
    features.apply_features_patches(args)  # MindSpeed applies every feature again: still one wrapper
    assert lm.LanguageModule.compute_language_model_loss.__cez_wraps__ is original

    model = gpt.build(1)
    model.train()
    from megatron.core import parallel_state as ps

    batches = gpt.micro_batches(0)
    losses, captured, _ = gpt.iteration(model, batches)
    scalars = metrics.report(1, len(batches), gpt.LAYERS, track_names=["load_balancing_loss"])
    ref = gpt.reference(captured, batches, ps.get_tensor_model_parallel_group(), 0)
    for loss, r, cap in zip(losses, ref, captured):
        torch.testing.assert_close(loss.double(), r["ce"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap["grad"].double(), r["grad"], rtol=1e-4, atol=1e-7)
    num = sum(float((gpt.COEFF * r["lse"] ** 2 * m).sum()) for r, (_, _, m) in zip(ref, batches))
    den = sum(float(m.sum()) for _, _, m in batches)
    assert scalars["lm_z_loss"] == pytest.approx(num / den, rel=1e-5), scalars

    features.remove_patches()
    assert lm.LanguageModule.compute_language_model_loss is original


def test_feature_through_mindspeeds_real_patch_manager():
    from support import run_on_ranks

    run_on_ranks(1, _worker, SOURCE, timeout=600)
