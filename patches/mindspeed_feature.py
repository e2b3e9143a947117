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

Registering imports nothing: :func:`register` waits (a post-import hook, :func:`.targets.on_import`)
until MindSpeed itself imports ``mindspeed.features_manager.features_manager``, so MindSpeed's
adaptor still runs before anything imports Megatron whichever adaptor is imported first.
"""

import sys

from mindspeed_cez.patches import arguments, targets
from mindspeed_cez.patches.settings import RECORD

FEATURE_NAME = "lm-z-loss"


def make_feature_class(base):
    """Our feature as a subclass of MindSpeed's ``MindSpeedFeature`` (``base``)."""

    class LmZLossFeature(base):
        """Fused vocab-parallel LM cross entropy + z-loss (mindspeed_cez)."""

        def __init__(self):
            super().__init__(FEATURE_NAME, optimization_level=0)
            self._patches_registered = False

        def register_args(self, parser):
            arguments.add_lm_z_loss_args(parser)

        def validate_args(self, args):
            if not arguments.has_lm_z_loss_args(args):
                return  # e.g. MindSpeed validating a TransformerConfig
            if not self._patches_registered:  # MindSpeed never applied its features: do it now
                register_patches_now()
            RECORD.on_flags(args)  # mindspeed_cez.patches.activate_from_flags: the one activation route

        def register_patches(self, patch_manager, args):
            self._patches_registered = True
            direct = set(targets.installed_targets())  # attached before MindSpeed loaded: not twice
            for path, wrapper in targets.patch_targets():
                if path not in direct:
                    patch_manager.register_patch(path, wrapper)

    return LmZLossFeature


def _mindspeed_api():
    """MindSpeed's feature base, features manager and patch manager, from its loaded modules
    (never imported here: MindSpeed imports its features manager before Megatron)."""
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


def register(on_flags):
    """Join MindSpeed's feature list once MindSpeed loads its features manager (idempotent; imports
    nothing). ``on_flags(args)`` activates the parsed flags (``mindspeed_cez.patches.activate_from_flags``).
    Returns the feature instance once registered, else None (MindSpeed not loaded yet).

    MindSpeed's and MindSpeed-LLM's adaptors import ``mindspeed.features_manager`` first, then apply
    their pre-Megatron patches (``torch.compile`` replaced, apex / Transformer Engine stand-ins),
    then every feature's patches, ours among them (:meth:`register_patches`). Imported after such an
    adaptor (Megatron already loaded), the patches are registered and applied right away. Imported
    before MindSpeed-LLM's, the feature stays in the list MindSpeed-LLM sets. MindSpeed ignores a
    wrapper registered twice, so a later ``apply_features_patches`` is harmless.
    """
    RECORD.on_flags = on_flags
    targets.defer_to_mindspeed(registered_with_mindspeed)
    targets.on_import(targets.FEATURES_MANAGER, _join)
    return RECORD.feature


def _join(features_manager_module):
    """Add our feature to the features manager that just loaded (or was loaded already)."""
    base, features_manager, patch_manager = _mindspeed_api()
    if RECORD.feature is None:
        cls = make_feature_class(base)
        existing = [f for f in features_manager.FEATURES_LIST if type(f).__name__ == cls.__name__]
        RECORD.feature = existing[0] if existing else cls()
    if RECORD.feature not in features_manager.FEATURES_LIST:
        features_manager.FEATURES_LIST.append(RECORD.feature)
    _stay_in_features_list(features_manager, RECORD.feature)
    if "megatron.core" in sys.modules:  # MindSpeed applied its features already: ours now
        register_patches_now()


def register_patches_now():
    """(Re)register and apply our wrappers through MindSpeed's patch manager."""
    _, _, patch_manager = _mindspeed_api()
    RECORD.feature.register_patches(patch_manager, None)
    patch_manager.apply_patches()


def registered_with_mindspeed():
    return RECORD.feature is not None and targets.FEATURES_MANAGER in sys.modules
