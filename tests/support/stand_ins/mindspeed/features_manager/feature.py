"""MindSpeed's feature base: hooks called by the features manager; level 0 = always applied."""


class MindSpeedFeature:
    def __init__(self, feature_name, optimization_level=2):
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = optimization_level == 0

    def is_need_apply(self, args):
        return self.default_patches or bool(getattr(args, self.feature_name, None))

    def register_args(self, parser):
        pass

    def pre_validate_args(self, args):
        pass

    def validate_args(self, args):
        pass

    def post_validate_args(self, args):
        pass

    def pre_register_patches(self, patch_manager, args):
        pass

    def register_patches(self, patch_manager, args):
        pass
