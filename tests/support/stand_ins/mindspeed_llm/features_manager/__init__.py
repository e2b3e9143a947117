"""MindSpeed-LLM's features; importing this module sets them as MindSpeed's features list."""

from mindspeed.features_manager.feature import MindSpeedFeature
from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager


class ModelFeature(MindSpeedFeature):
    """Registers MindSpeed-LLM's GPTModel over Megatron's (a replacement, not a decorator)."""

    def __init__(self):
        super().__init__("model", optimization_level=0)

    def register_args(self, parser):
        group = parser.add_argument_group(title="model")
        group.add_argument("--output-multiplier-scale", type=float, default=None)
        group.add_argument("--output-logit-softcapping", type=float, default=None)
        group.add_argument("--is-instruction-dataset", action="store_true")
        group.add_argument("--mtp-num-layers", type=int, default=None)

    def register_patches(self, patch_manager, args):
        from mindspeed_llm.core.models.gpt.gpt_model import GPTModel

        patch_manager.register_patch("megatron.core.models.gpt.gpt_model.GPTModel", GPTModel)


class ChunkLossFeature(MindSpeedFeature):
    def __init__(self):
        super().__init__("use-chunk-loss", optimization_level=0)

    def register_args(self, parser):
        group = parser.add_argument_group(title=self.feature_name)
        group.add_argument("--loss-compute-mode", type=str, default="default", choices=["default", "chunk"])
        group.add_argument("--loss-chunk-size", type=int, default=1024)


def set_default_features_list():
    MindSpeedFeaturesManager.set_features_list([ModelFeature(), ChunkLossFeature()])


set_default_features_list()
