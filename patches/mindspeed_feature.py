"""Registration as a MindSpeed feature (used when MindSpeed is installed).

Written against the MindSpeed API at Ascend/MindSpeed commit
028de58ca629d035185b00ff7d1eb7eff4f7fd48 (master, 2026-07-21) and checked against the branch of
the Megatron 0.12.1 line, 26.0.0_core_r0.12.1 (3c44c134f396fc14a22a38934c7d5d8bedb37ff5; same
``patch_utils.py``), by ``tests/test_mindspeed_source.py`` with their real files:

* ``mindspeed/features_manager/feature.py``: ``MindSpeedFeature(feature_name,
  optimization_level)`` with ``register_args(parser)``, ``pre_validate_args`` /
  ``validate_args`` / ``post_validate_args(args)``, ``register_patches(patch_manager, args)``
  and ``is_need_apply(args)`` (``optimization_level == 0`` marks a default feature that is always
  applied). ``validate_args`` is also called with a ``TransformerConfig`` from MindSpeed's
  ``TransformerConfig.__post_init__`` wrapper, so it must ignore objects without our flags.
* ``mindspeed/features_manager/features_manager.py``: ``MindSpeedFeaturesManager.FEATURES_LIST``
  (a class-level list the parse/validate wrappers and ``apply_features_patches`` iterate).
* ``mindspeed/patch_utils.py``: ``MindSpeedPatchesManager.register_patch(orig_func_name,
  new_func)`` (a ``new_func`` whose ``__name__`` ends in ``wrapper``/``decorator`` *decorates*
  the current function, and registering the same wrapper twice is a no-op) and
  ``apply_patches()`` (also rebinds copies in every loaded module).

Our feature is a default feature: its wrappers are always registered and pass through to
Megatron until the flags (``validate_args``) or ``mindspeed_cez.patches.apply`` activate them.
Its flags reach Megatron's ``--help`` through MindSpeed's ``parse_args`` wrapper.
"""

import sys

from mindspeed_cez.patches import arguments, targets
from mindspeed_cez.patches import settings as _settings

FEATURE_NAME = "lm-z-loss"

_REGISTERED = None  # the feature instance once registered with MindSpeed


def make_feature_class(base):
    """Our feature as a subclass of MindSpeed's ``MindSpeedFeature`` (``base``)."""

    class LmZLossFeature(base):
        """Fused vocab-parallel LM cross entropy + z-loss (mindspeed_cez)."""

        def __init__(self):
            super().__init__(FEATURE_NAME, optimization_level=0)

        def register_args(self, parser):
            arguments.add_lm_z_loss_args(parser)

        def validate_args(self, args):
            if not arguments.has_lm_z_loss_args(args):
                return  # e.g. MindSpeed validating a TransformerConfig
            arguments.validate_flags(args)
            _settings.set_active(arguments.settings_from_args(args))

        def register_patches(self, patch_manager, args):
            for path, wrapper in targets.patch_targets():
                patch_manager.register_patch(path, wrapper)

    return LmZLossFeature


def _mindspeed_api():
    # imported when registering, not at import: MindSpeed is optional (and heavy)
    from mindspeed.features_manager.feature import MindSpeedFeature
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return MindSpeedFeature, MindSpeedFeaturesManager, MindSpeedPatchesManager


def _stay_in_features_list(features_manager, feature):
    """Keep ``feature`` in the list when a framework sets a new one (MindSpeed-LLM's
    ``set_features_list`` at import replaces the list that the features are applied from)."""
    setter = features_manager.__dict__.get("set_features_list")
    if not isinstance(setter, classmethod) or getattr(setter.__func__, "__cez_wraps__", None):
        return

    def set_features_list(cls, features_list):
        setter.__func__(cls, features_list)
        if feature not in cls.FEATURES_LIST:
            cls.FEATURES_LIST.append(feature)

    set_features_list.__cez_wraps__ = setter.__func__
    features_manager.set_features_list = classmethod(set_features_list)


def register():
    """Add our feature to MindSpeed's feature list and apply its patches (idempotent).

    Either import order with a framework's adaptor works: imported after it (MindSpeed's or
    MindSpeed-LLM's adaptor already applied its features), the patches are registered and applied
    here; imported before MindSpeed-LLM's, the feature stays in the list MindSpeed-LLM sets and is
    applied again by its adaptor after that adaptor removes every patch. MindSpeed ignores a
    wrapper registered twice, so a later ``apply_features_patches`` is harmless.
    Returns the feature instance.
    """
    global _REGISTERED
    base, features_manager, patch_manager = _mindspeed_api()
    if _REGISTERED is None:
        cls = make_feature_class(base)
        existing = [f for f in features_manager.FEATURES_LIST if type(f).__name__ == cls.__name__]
        _REGISTERED = existing[0] if existing else cls()
        if not existing:
            features_manager.FEATURES_LIST.append(_REGISTERED)
    _stay_in_features_list(features_manager, _REGISTERED)
    _REGISTERED.register_patches(patch_manager, None)
    patch_manager.apply_patches()
    return _REGISTERED


def register_patches_now():
    """(Re)register and apply our wrappers through MindSpeed's patch manager."""
    _, _, patch_manager = _mindspeed_api()
    _REGISTERED.register_patches(patch_manager, None)
    patch_manager.apply_patches()


def registered_with_mindspeed():
    return _REGISTERED is not None and "mindspeed" in sys.modules
