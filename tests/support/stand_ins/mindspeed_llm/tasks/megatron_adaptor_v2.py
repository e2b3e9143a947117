"""What MindSpeed-LLM's adaptor does at import: remove every registered patch, parse its own
arguments (importing its features, which sets the features list anew), then apply the pre-patches
and patches of every feature in that list."""

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

MindSpeedFeaturesManager.remove_patches()
from mindspeed_llm.training.arguments import parse_known_args  # noqa: E402  (sets the features list)

_args = parse_known_args()
MindSpeedFeaturesManager.apply_features_pre_patches(_args)
MindSpeedFeaturesManager.apply_features_patches(_args)
