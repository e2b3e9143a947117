"""Pretrain a GPT (dense or MoE) with Megatron's own training loop: a plain Megatron entry script.

Nothing in it is about the loss (only its CPU mode, below, comes from this package): it is launched
through ``python -m mindspeed_cez.launch``, which imports ``mindspeed_cez.megatron_adaptor`` first, so
``--lm-z-loss-coeff C`` (and the other ``--lm-*`` flags) are parsed, validated and applied, and
``lm_z_loss`` shows up in Megatron's log line. Model provider, forward step / loss with ``loss_mask``,
mock or real GPT data; written for megatron-core 0.18 and later with ``megatron.training``
(``parse_and_validate_args`` -> ``pretrain_cfg_container_from_args`` -> ``pretrain(cfg, ...)``) and for
the classic Megatron-LM flow (``pretrain(datasets_provider, model_provider, ...)`` parsing the arguments
itself).

GPU: ``torchrun --nproc-per-node 2 -m mindspeed_cez.launch examples/pretrain_gpt.py <Megatron args>``
(NCCL). CPU (CI): the same with ``--distributed-backend gloo``; without a GPU the package's CPU mode
(``mindspeed_cez.patches.cpu_mode``) steers Megatron's hard-coded CUDA calls to the CPU. See
``examples/run_megatron_lm_moe.sh``.
(The end-to-end tests run it through ``tests/support/megatron_pretrain_harness.py``, which adds their hooks.)
"""

import dataclasses
import gc
import inspect
import sys
from functools import partial

import torch

if not torch.cuda.is_available():
    # CPU only (CI): steer Megatron's CUDA calls to the CPU before Megatron runs anything.
    from mindspeed_cez.patches import cpu_mode

    cpu_mode.apply(training_loop=True)

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0

try:  # megatron-core 0.18 and later
    from megatron.training.argument_utils import core_transformer_config_from_args
except ImportError:  # classic Megatron-LM
    from megatron.training.arguments import core_transformer_config_from_args

try:
    from megatron.training.utils import get_blend_and_blend_per_split
except ImportError:
    get_blend_and_blend_per_split = None


# ----------------------------------------------------------------------------------- arguments
ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}


# --------------------------------------------------------------------------------------- model
class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm whose parameters are marked for sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``--sequence-parallel`` (which MoE with TP > 1
    requires) because it does not tag its parameters; tagged, Megatron all-reduces their grads
    over the TP group like those of its fused norms. Used when neither TE nor Apex is installed.
    """

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


def _num_layers_to_build(config, vp_stage):
    """This pipeline stage's (and virtual stage's) share of the layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if "vp_stage" in inspect.signature(get_num_layers_to_build).parameters:
        return get_num_layers_to_build(config, vp_stage=vp_stage)
    return get_num_layers_to_build(config)


def _layer_specs(args, config, vp_stage):
    """(decoder spec for this stage, spec of one layer): TE's, else the local one with torch norms."""
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
            qk_layernorm=args.qk_layernorm,
        )
        return spec, spec
    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm, normalization=args.normalization,
    )
    from megatron.core.models.gpt import gpt_layer_specs

    if getattr(gpt_layer_specs, "HAVE_APEX", False):
        return spec, spec
    submodules = dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelTorchNorm, pre_mlp_layernorm=SequenceParallelTorchNorm,
    )
    spec = dataclasses.replace(spec, submodules=submodules)
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * _num_layers_to_build(config, vp_stage), layer_norm=SequenceParallelTorchNorm,
    )
    return block, spec


def _mtp_block_spec(args, config, layer_spec, vp_stage):
    """The MTP block's spec: Megatron's; with the local spec and neither TE nor Apex, its norms are
    :class:`SequenceParallelTorchNorm` (Megatron's ``WrappedTorchNorm`` refuses sequence parallelism,
    which MoE with TP > 1 requires) where this Megatron builds MTP specs for a backend."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = args.transformer_impl == "transformer_engine"
    for_backend = getattr(gpt_layer_specs, "get_gpt_mtp_block_spec_for_backend", None)
    if not use_te and not getattr(gpt_layer_specs, "HAVE_APEX", False) and for_backend is not None:
        from megatron.core.models.backends import LocalSpecProvider

        class LocalSpecWithSequenceParallelNorms(LocalSpecProvider):
            def layer_norm(self, *args, **kwargs):
                return SequenceParallelTorchNorm

        return for_backend(config, layer_spec, backend=LocalSpecWithSequenceParallelNorms(),
                           **_with_supported(for_backend, vp_stage=vp_stage))
    fn = gpt_layer_specs.get_gpt_mtp_block_spec
    return fn(config, layer_spec, use_transformer_engine=use_te, **_with_supported(fn, vp_stage=vp_stage))


def _with_supported(fn, **kwargs):
    """The keyword arguments ``fn`` accepts in this Megatron line (e.g. ``vp_stage``)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kwargs):
    """Build a GPTModel (MoE when --num-experts is set, MTP with --mtp-num-layers) for this stage."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    decoder_spec, layer_spec = _layer_specs(args, config, vp_stage)
    extra = _with_supported(GPTModel.__init__, vp_stage=vp_stage)
    if getattr(args, "mtp_num_layers", None):
        extra["mtp_block_spec"] = _mtp_block_spec(args, config, layer_spec, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        **extra,
    )
    return model


# ---------------------------------------------------------------------------- batch and loss
_TUPLE_REPORTS = False


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(data_iterator):
    """TP rank 0 reads the micro-batch; it is broadcast to the other ranks of its TP group, and split
    over the context-parallel ranks."""
    args = get_args()
    bs = (args.micro_batch_size, args.seq_length)
    fields = {
        "tokens": (bs, torch.int64),
        "labels": (bs, torch.int64),
        "loss_mask": (bs, torch.float32),
        "position_ids": (bs, torch.int64),
    }
    if args.create_attention_mask_in_dataloader:
        fields["attention_mask"] = ((args.micro_batch_size, 1, args.seq_length, args.seq_length), torch.bool)
    device = _device()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: data[k].to(device=device, dtype=dtype) for k, (_, dtype) in fields.items()}
    else:
        batch = {k: torch.empty(shape, dtype=dtype, device=device) for k, (shape, dtype) in fields.items()}
    src = parallel_state.get_tensor_model_parallel_src_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    for k in fields:
        torch.distributed.broadcast(batch[k], src, group=group)
    batch.setdefault("attention_mask", None)
    return batch_on_this_cp_rank(batch)


def batch_on_this_cp_rank(batch):
    """With context parallelism, this rank's share of the sequence, as Megatron splits it (2 x CP
    chunks, rank r keeping chunks r and 2 x CP - 1 - r, which its rotary embedding expects)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    try:  # megatron-core 0.16 and later
        from megatron.core.utils import get_batch_on_this_cp_rank
    except ImportError:  # Megatron-LM's training utilities
        from megatron.training.utils import get_batch_on_this_cp_rank
    return get_batch_on_this_cp_rank(batch, **_with_supported(
        get_batch_on_this_cp_rank, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()))


def _train_step_sums_tuples():
    """The 0.12 line's ``train_step`` sums ``(loss sum, token count)`` tuples that the loss
    function all-reduced over data parallel; later lines take a ``[sum, count]`` tensor and
    all-reduce it themselves."""
    from megatron.training import training

    return "isinstance(val, tuple)" in inspect.getsource(training.train_step)


def loss_func(loss_mask, output_tensor):
    """Sum of the per-token LM loss over the unmasked tokens, and their count (Megatron's contract)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), loss_mask.sum().view(1)])
    _validate_loss(loss)
    if _TUPLE_REPORTS:
        torch.distributed.all_reduce(reporting, group=parallel_state.get_data_parallel_group())
        return loss, num_tokens, {"lm loss": (reporting[0], reporting[1])}
    return loss, num_tokens, {"lm loss": reporting}


SPIKY_LOSS_FACTOR = 10


def _validate_loss(loss):
    """Megatron's result validation of the micro-batch's loss (its rerun state machine: NaN and Inf are
    fatal, a spiky loss is reported; ``--rerun-mode`` decides whether a rejected step is re-run to tell a
    transient fault from a reproducible one), as Megatron-LM's own GPT script does."""
    try:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
    except ImportError:  # a Megatron line without the rerun state machine
        return
    args = get_args()
    machine = get_rerun_state_machine()
    if getattr(args, "check_for_nan_in_loss_and_grad", False):
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, fatal=True, tolerance=0.0,
                                    message=f"found {what} in local forward loss calculation")
    if getattr(args, "check_for_spiky_loss", False):
        machine.validate_result(
            result=loss, message="Spiky loss", tolerance=0.0, fatal=False,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"))


def forward_step(data_iterator, model, return_schedule_plan=False):
    """One micro-batch; with ``--overlap-moe-expert-parallel-comm`` Megatron asks for the MoE
    schedule plan instead of running the forward (it runs the plan itself)."""
    batch = get_batch(data_iterator)
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    run = model.build_schedule_plan if return_schedule_plan else model
    output_tensor = run(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


# -------------------------------------------------------------------------------------- data
def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    if get_blend_and_blend_per_split is not None:
        blend, blend_per_split = get_blend_and_blend_per_split(args)
    else:
        blend, blend_per_split = None, None
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        path_to_cache=args.data_cache_path,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config,
    ).build()


train_valid_test_datasets_provider.is_distributed = True


def _skip_dataset_helpers_build_if_prebuilt():
    """The megatron-core wheel ships the compiled ``helpers_cpp`` but no Makefile, and
    ``initialize_megatron`` runs ``make`` in that directory (exiting on failure)."""
    import importlib.util

    from megatron.core.datasets import utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        dataset_utils.compile_helpers = lambda: None


# -------------------------------------------------------------------------------------- main
def _with_inprocess_restart(pretrain_fn):
    """``(train, extra kwargs)``: with ``--inprocess-restart``, ``pretrain`` wrapped by Megatron's in-process
    restart (which needs nvidia-resiliency-ext; without it Megatron warns and returns ``pretrain`` as is)
    and the store it hands ``pretrain``, as Megatron-LM's own GPT script does; else ``pretrain``."""
    if "--inprocess-restart" not in sys.argv:
        return pretrain_fn, {}
    from megatron.training import inprocess_restart

    train, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain_fn)
    return train, ({"store": store} if "store" in inspect.signature(pretrain_fn).parameters else {})


def release_cuda_graphs_and_process_groups():
    """After ``pretrain`` with a full-iteration CUDA graph (``--cuda-graph-impl full_iteration``: it holds NCCL
    collectives): drop the graphs Megatron captured, then the process groups, in that order; left to the
    interpreter's exit, such a run's ranks hang there after training. Runs without one (eager, per-layer
    ``local`` graphs) exit on their own and are left to it (releasing per-layer graphs here hangs instead)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized() and torch.cuda.is_available()):
        return
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:  # a Megatron line without full-iteration graphs
        return
    if not any(graph is not None for graph in FullCudaGraphWrapper.cuda_graph.values()):
        return
    torch.cuda.synchronize()
    for stage in list(FullCudaGraphWrapper.cuda_graph):
        FullCudaGraphWrapper.cuda_graph[stage] = FullCudaGraphWrapper.result[stage] = None
    try:
        from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
    except ImportError:
        delete_cuda_graphs = None
    if delete_cuda_graphs is not None:
        delete_cuda_graphs()
    gc.collect()
    torch.cuda.synchronize()
    torch.distributed.destroy_process_group()


def main():
    global _TUPLE_REPORTS
    _TUPLE_REPORTS = _train_step_sums_tuples()
    _skip_dataset_helpers_build_if_prebuilt()
    params = inspect.signature(pretrain).parameters
    if "cfg_container" in params:
        # megatron-core 0.18 and later: parse + validate, build the config container, then pretrain.
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        train, extra = _with_inprocess_restart(pretrain)
        args = parse_and_validate_args(extra_args_provider=None, args_defaults=ARGS_DEFAULTS)
        cfg = pretrain_cfg_container_from_args(args)
        train(  # by keyword: 0.18 and 0.19 order these parameters differently
            cfg, train_valid_test_dataset_provider=train_valid_test_datasets_provider,
            model_provider=model_provider, model_type=ModelType.encoder_or_decoder,
            forward_step_func=forward_step, **extra,
        )
        release_cuda_graphs_and_process_groups()
    else:
        # Classic Megatron-LM: pretrain() parses and validates the arguments itself.
        pretrain(
            train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
            args_defaults=ARGS_DEFAULTS,
        )


if __name__ == "__main__":
    main()
