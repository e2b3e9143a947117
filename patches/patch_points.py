"""Every patch point of every framework, in one table (data only: how each attaches is :mod:`.import_hook`).

Each :class:`~.import_hook.Target` names a module, the class (``""``: the module itself), the first
of the attribute names it has, and the wrapper that decorates it. Optional targets are
feature-detected (``accepts``: a signature; ``when``: the version's API); a required one that cannot
attach is an error naming it. ``route``: ``ALWAYS`` (directly, or through MindSpeed's patch manager in
a MindSpeed process), ``ADAPTOR`` (directly, once ``import mindspeed_cez.megatron_adaptor`` registered
the flags: Megatron's argument hooks), ``MINDSPEED`` (through MindSpeed's patch manager only:
MindSpeed-LLM's modules, never imported by the adaptor; ``loaded_only``: listed once imported).
"""

from mindspeed_cez.patches import activation, loss_wrappers, model_context, optimizer_hooks, reporting
from mindspeed_cez.patches.import_hook import ADAPTOR, MINDSPEED, Target

_LM = "megatron.core.models.common.language_module.language_module"
_TRAINING = "megatron.training.training"
_ARGUMENTS = "megatron.training.arguments"
_LLM_TRAINING = "mindspeed_llm.training.training"
_LOSS_CONTEXT = model_context.loss_context_wrapper
_HAS_LOSS_CONTEXT = model_context.has_loss_context_args

TARGETS = [
    # Megatron-Core: the LM loss, every cross entropy it may call, the output layer, the gradient sync
    Target(_LM, "LanguageModule", ("compute_language_model_loss",), loss_wrappers.compute_language_model_loss_wrapper),
    Target("megatron.core.tensor_parallel.cross_entropy", "", ("vocab_parallel_cross_entropy",),
           loss_wrappers.vocab_parallel_cross_entropy_wrapper),
    Target("megatron.core.fusions.fused_cross_entropy", "", ("fused_vocab_parallel_cross_entropy",),
           loss_wrappers.fused_vocab_parallel_cross_entropy_wrapper, required=False),
    Target(_LM, "", ("te_parallel_cross_entropy",), loss_wrappers.te_parallel_cross_entropy_wrapper, required=False),
    Target("megatron.core.tensor_parallel.layers", "ColumnParallelLinear", ("forward",),
           model_context.column_parallel_forward_wrapper),
    Target("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", ("finish_grad_sync",),
           loss_wrappers.finish_grad_sync_wrapper),
    # Megatron-Core's optimizers, right after their step (--lm-mu-centering: the master weights centered)
    Target("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params",
           ("_copy_main_params_to_model_params",), optimizer_hooks.copy_main_params_to_model_params_wrapper),
    Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
           ("_copy_main_params_to_model_params",), optimizer_hooks.copy_main_params_to_model_params_wrapper),
    Target("megatron.core.optimizer.optimizer", "FP32Optimizer", ("step_with_ready_grads",),
           optimizer_hooks.fp32_step_with_ready_grads_wrapper),
    # Megatron-Core's models whose forward takes the script's labels and loss mask (0.13 on:
    # GPTModel._postprocess, which the MoE schedule-plan path of --overlap-moe-expert-parallel-comm calls
    # directly, not forward; 0.12: forward)
    Target("megatron.core.models.gpt.gpt_model", "GPTModel", ("_postprocess", "forward"), _LOSS_CONTEXT,
           accepts=_HAS_LOSS_CONTEXT),
    Target("megatron.core.models.hybrid.hybrid_model", "HybridModel", ("forward",), _LOSS_CONTEXT, required=False,
           accepts=_HAS_LOSS_CONTEXT),
    Target("megatron.core.models.mamba.mamba_model", "MambaModel", ("forward",), _LOSS_CONTEXT, required=False,
           accepts=_HAS_LOSS_CONTEXT),
    # Megatron's MoE report (megatron-core-only loops), one of two API generations
    Target(reporting.MOE_LOGGING, "MoEMetricsTracker", ("report",), reporting.moe_metrics_report_wrapper,
           required=False, when=reporting.uses_moe_tracker),
    Target(reporting.MOE_UTILS, "", ("track_moe_metrics",), reporting.moe_metrics_report_wrapper, required=False,
           when=reporting.uses_moe_function),
    # megatron.training (0.19 on PyPI; MindSpeed-LLM's copy of Megatron): the log, an in-process restart
    Target(_TRAINING, "", ("training_log",), reporting.training_log_wrapper),
    Target(_TRAINING, "", ("destroy_global_state",), reporting.destroy_global_state_wrapper, required=False),
    # megatron.training's argument hooks: the flags join its parser and its validation
    Target(_ARGUMENTS, "", ("parse_args",), activation.parse_args_wrapper, route=ADAPTOR),
    Target(_ARGUMENTS, "", ("validate_args",), activation.validate_args_wrapper, route=ADAPTOR),
    # MindSpeed-LLM (read at v26.0.0 and master): its GPTModel (registered over
    # Megatron's) and master's DeepSeek4Model have a forward of their own that never calls Megatron's;
    # pretrain_gpt.py trains with its own train(), whose training_log logs the iteration
    Target("mindspeed_llm.core.models.gpt.gpt_model", "GPTModel", ("forward",), _LOSS_CONTEXT, required=False,
           accepts=_HAS_LOSS_CONTEXT, route=MINDSPEED, loaded_only=True),
    Target("mindspeed_llm.core.models.deepseek4.deepseek4_model", "DeepSeek4Model", ("forward",), _LOSS_CONTEXT,
           required=False, accepts=_HAS_LOSS_CONTEXT, route=MINDSPEED, loaded_only=True),
    Target(_LLM_TRAINING, "", ("training_log",), reporting.training_log_wrapper, required=False, route=MINDSPEED),
]
