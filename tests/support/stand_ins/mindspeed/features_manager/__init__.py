from mindspeed.features_manager.feature import MindSpeedFeature  # noqa: F401
