"""Megatron's optimizers, right after their step: with ``--lm-mu-centering`` the output weight's master copy
is centered (:mod:`.mean_embedding`) before the model's weight takes its values. The patch points of the
table (:data:`.patch_points.TARGETS`)."""

import torch

from mindspeed_cez.patches.mean_embedding import center_fp32_params, center_main_params
from mindspeed_cez.patches.runtime import while_active


def copy_main_params_to_model_params_wrapper(fn):
    """``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer._copy_main_params_to_model_params``
    (right after the inner optimizer's step): with mu-centering on, the marked weights' master copies are
    centered first, so the model's weights get the centered values."""

    def copy_main_params_to_model_params(runtime, self, *args, **kwargs):
        if runtime.settings.mu_centering and not getattr(self, "is_stub_optimizer", False):
            center_main_params(self)
        return fn(self, *args, **kwargs)

    return while_active(fn, copy_main_params_to_model_params)


def fp32_step_with_ready_grads_wrapper(fn):
    """``FP32Optimizer.step_with_ready_grads``: with mu-centering on, the marked weights after the step."""

    def step_with_ready_grads(runtime, self, *args, **kwargs):
        stepped = fn(self, *args, **kwargs)
        if runtime.settings.mu_centering and not getattr(self, "is_stub_optimizer", False):
            with torch.no_grad():
                center_fp32_params(self)
        return stepped

    return while_active(fn, step_with_ready_grads)
