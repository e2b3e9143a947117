"""``examples/pretrain_gpt.py`` with the end-to-end tests' hooks (``tests/support/megatron_launch.py``
runs this file under torchrun in its place). The example's own code runs unchanged; this file
wraps three of its functions:

* ``model_provider``: with ``CEZ_DUMP_LOGITS_DIR`` set, a forward hook on the output layer keeps a
  copy of its logits (this rank's vocab shard);
* ``loss_func``: writes them, with the micro-batch's labels and loss mask, for every micro-batch of
  iteration ``CEZ_DUMP_ITERATION`` (default 1) and of the first evaluation, to
  ``$CEZ_DUMP_LOGITS_DIR/logits_{iterN|eval}_dp{d}_cp{c}_mb{k}_tp{t}.pt``;
* ``get_batch``: with ``CEZ_TEST_MASK_TAIL`` set, each micro-batch's loss mask drops a
  data-dependent tail of the sequence, so that micro-batches (and data-parallel ranks) count
  different numbers of tokens, as packed sequences do.

With ``CEZ_TEST_NAN_ITERATION=N`` the output layer's input turns NaN in iteration N (Megatron's NaN
checks and its rerun state machine meet it). ``CEZ_TEST_RERUN_MODE=report_determinism_stats`` puts Megatron's
rerun state machine in that mode (every step run twice, the loss's variability logged), which
megatron-core 0.19.2's ``--rerun-mode report_stats`` cannot reach (its enum value differs); each
re-run micro-batch's loss is then compared with the first run's, exactly, and the result printed. With
``CEZ_DUMP_OUTPUT_GRAD=DIR`` the output layer's weight gradient of iterations 1 and 2, after Megatron's gradient
sync, is written to ``DIR`` (DDP's ``main_grad``, an FSDP parameter's gradient gathered), with what Megatron
scales it by (the loss scale, the micro-batch count, the data-parallel size). With ``CEZ_DUMP_OUTPUT_INPUTS=DIR``
every rank writes, for each micro-batch of iteration 1, what the output layer's loss saw: the layer's input (the
whole sequence), its weight (this rank's vocab rows), the labels and the loss mask, to
``DIR/inputs_dp{d}_tp{t}_mb{k}.pt`` (``tests/support/output_grad_reference.py`` makes the float64 gradient from them). With
``CEZ_TEST_LOG_MEMORY`` each logged step prints this rank's CUDA memory and the CUDA graphs Megatron holds
(``cez-memory iteration I ...``); ``CEZ_TEST_SKIP_TEARDOWN`` leaves the example's CUDA graphs and process
groups to the interpreter's exit.

With ``CEZ_TEST_CP_ATTENTION`` set, Megatron's local layer specs build the test-only
context-parallel attention of ``tests/support/context_parallel_attention.py`` (context parallelism without
Transformer Engine).

The dump also records whether the adaptor knew Megatron's upstream gradient in that forward
(``patches.loss_wrappers.megatron_grad_scale`` returned one: the fused output layer's default path
then adds the weight gradient into ``main_grad`` during the forward), and whether the deferred
output layer's weight had the ``main_grad`` of Megatron's DDP buckets.
"""

import functools
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package
from support import load_example  # noqa: E402

example = load_example("pretrain_gpt")  # the script under test (its CPU mode on without a GPU)

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training import get_args  # noqa: E402


# ---------------------------------------------------------------------------------- dump logits
_CURRENT_BATCH = {}


def _recording(grad_scale_fn):
    @functools.wraps(grad_scale_fn)
    def megatron_grad_scale(config, loss_mask):
        scale = grad_scale_fn(config, loss_mask)
        _CURRENT_BATCH["grad_scale_known"] = scale is not None
        return scale
    return megatron_grad_scale


from mindspeed_cez.patches import loss_wrappers as _cez_output_layer  # noqa: E402

_cez_output_layer.megatron_grad_scale = _recording(_cez_output_layer.megatron_grad_scale)
_DUMPED = {"train": 0, "eval": 0}


def _dump_name(training):
    """Training: every micro-batch of iteration ``CEZ_DUMP_ITERATION``; eval: the first evaluation."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    args = get_args()
    if training:
        # args.curr_iteration counts completed iterations; during iteration N's forward it is N - 1.
        iteration = int(os.environ.get("CEZ_DUMP_ITERATION", "1"))
        return f"iter{iteration}" if getattr(args, "curr_iteration", -1) == iteration - 1 else None
    return "eval" if _DUMPED["eval"] < args.eval_iters * get_num_microbatches() else None


def _keep_logits_hook(module, inputs, output):
    """A copy of the output layer's logits, taken before the loss (Megatron's own CE changes them
    in place); the last call of a forward is the main LM head's (MTP heads come first)."""
    name = _dump_name(module.training)
    if name is not None:
        logits = output[0] if isinstance(output, tuple) else output
        deferred = type(logits).__name__ == "DeferredLogits"
        if deferred:  # --lm-fused-output-layer: made here for the dump only
            weight = logits.weight
            _CURRENT_BATCH["into_main_grad"] = hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")
            with torch.no_grad():
                hidden = logits.hidden
                if module.sequence_parallel:
                    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                    hidden = gather_from_sequence_parallel_region(hidden)
                logits = hidden @ logits.weight.t()
        _CURRENT_BATCH["logits"] = (name, logits.detach().to("cpu", torch.float32, copy=True))
        _CURRENT_BATCH["deferred"] = deferred


def _dump_logits(name, logits):
    """Write this micro-batch's logits, labels and loss mask (called from the loss function)."""
    kind = "eval" if name == "eval" else "train"
    out_dir = os.environ["CEZ_DUMP_LOGITS_DIR"]
    os.makedirs(out_dir, exist_ok=True)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    torch.save(
        {
            "logits": logits,  # [s, b, vocab / tp], this rank's shard
            "labels": _CURRENT_BATCH["labels"].detach().cpu(),  # [b, s]
            "loss_mask": _CURRENT_BATCH["loss_mask"].detach().float().cpu(),  # [b, s]
            "tp_rank": tp_rank,
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "lm_z_loss_coeff": getattr(get_args(), "lm_z_loss_coeff", None),
            "deferred": _CURRENT_BATCH.get("deferred", False),  # the output layer made no logits
            "grad_scale_known": _CURRENT_BATCH.pop("grad_scale_known", False),
            "into_main_grad": _CURRENT_BATCH.pop("into_main_grad", False),  # the weight had DDP's main_grad
        },
        os.path.join(out_dir, f"logits_{name}_dp{dp_rank}_cp{cp_rank}_mb{_DUMPED[kind]}_tp{tp_rank}.pt"),
    )
    _DUMPED[kind] += 1


# ------------------------------------------------------------------ dump the output layer's inputs
def _dump_output_inputs_hook(module, args, kwargs, output):
    """Iteration 1 (training): this micro-batch's output layer input (gathered over the sequence-parallel ranks),
    weight (in micro-batch 0; an FSDP parameter gathered over data parallel), labels and loss mask, to
    ``$CEZ_DUMP_OUTPUT_INPUTS/inputs_dp{d}_tp{t}_mb{k}.pt``. The fused layer's deferred call holds the hidden
    states and weight the op takes; Megatron's layer made its logits from them, which the dump checks
    (``weight_check``: ``|hidden @ weight.T - logits| / |logits|``)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    if not (module.training and torch.is_grad_enabled() and getattr(get_args(), "curr_iteration", -1) == 0):
        return
    result = output[0] if isinstance(output, tuple) else output
    deferred = type(result).__name__ == "DeferredLogits"
    hidden = result.hidden if deferred else args[0]
    weight = result.weight if deferred else (kwargs.get("weight") if kwargs.get("weight") is not None
                                             else (args[1] if len(args) > 1 else module.weight))
    with torch.no_grad():
        weight = _whole(weight.detach())  # a collective of the data-parallel ranks where it is a DTensor
        if module.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        check = None
        if not deferred:
            made = hidden.float() @ weight.float().t()
            check = float((made - result.float()).norm() / result.float().norm().clamp(min=1e-30))
    config, args_ = module.config, get_args()
    scale_func = getattr(config, "grad_scale_func", None)
    loss_scale = float(scale_func(torch.ones(1, device=hidden.device))) if scale_func is not None else 1.0
    dp, tp = parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    k = _DUMPED.setdefault("inputs", 0)
    _DUMPED["inputs"] += 1
    out_dir = os.environ["CEZ_DUMP_OUTPUT_INPUTS"]
    os.makedirs(out_dir, exist_ok=True)
    torch.save(
        {
            "hidden": hidden.detach().to("cpu", copy=True),  # [s, b, h], as the layer got it (bf16 under --bf16)
            "weight": weight.to("cpu", copy=True) if k == 0 else None,  # [vocab / tp, h], this rank's rows
            "labels": _CURRENT_BATCH["labels"].detach().cpu(),  # [b, s]
            "loss_mask": _CURRENT_BATCH["loss_mask"].detach().float().cpu(),  # [b, s]
            "dp_rank": dp, "dp_size": parallel_state.get_data_parallel_world_size(),
            "tp_rank": tp, "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "cp_size": parallel_state.get_context_parallel_world_size(),
            "micro_batch": k, "num_microbatches": get_num_microbatches(),
            "lm_z_loss_coeff": getattr(args_, "lm_z_loss_coeff", None) or 0.0,
            "label_smoothing": getattr(args_, "label_smoothing_factor", 0.0) or 0.0,
            "calculate_per_token_loss": bool(getattr(config, "calculate_per_token_loss", False)),
            "loss_scale": loss_scale,
            "deferred": deferred, "weight_check": check,
        },
        os.path.join(out_dir, f"inputs_dp{dp}_tp{tp}_mb{k}.pt"),
    )


# ------------------------------------------------------------------------- the example, wrapped
_example_model_provider, _example_get_batch, _example_loss_func = (
    example.model_provider, example.get_batch, example.loss_func)


def _nan_into_output_layer(module, args):
    """``CEZ_TEST_NAN_ITERATION=N``: the output layer's input becomes NaN in every training forward of
    iteration N (a fault for Megatron's NaN checks to find; a re-run of the step meets it again)."""
    if module.training and getattr(get_args(), "curr_iteration", -1) == int(os.environ["CEZ_TEST_NAN_ITERATION"]) - 1:
        return (args[0] * float("nan"), *args[1:])
    return None


@functools.wraps(_example_model_provider)  # the same signature: Megatron reads it
def model_provider(*args, **kwargs):
    model = _example_model_provider(*args, **kwargs)
    post_process = inspect.signature(_example_model_provider).bind(*args, **kwargs).arguments.get("post_process", True)
    if post_process and os.environ.get("CEZ_DUMP_LOGITS_DIR"):
        model.output_layer.register_forward_hook(_keep_logits_hook)
    if post_process and os.environ.get("CEZ_DUMP_OUTPUT_INPUTS"):
        model.output_layer.register_forward_hook(_dump_output_inputs_hook, with_kwargs=True)
    if post_process and os.environ.get("CEZ_TEST_NAN_ITERATION"):
        model.output_layer.register_forward_pre_hook(_nan_into_output_layer)
    if os.environ.get("CEZ_TEST_RERUN_MODE"):  # after initialize_megatron made the rerun state machine
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        get_rerun_state_machine().set_mode(RerunMode(os.environ["CEZ_TEST_RERUN_MODE"]))
    return model


def get_batch(data_iterator):
    batch = _example_get_batch(data_iterator)
    if os.environ.get("CEZ_TEST_MASK_TAIL"):
        # the tail of the whole sequence (this rank's share of it under context parallelism)
        # on the device (no host sync: a full-iteration CUDA graph captures it)
        total = batch["tokens"].sum()
        if parallel_state.get_context_parallel_world_size() > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
        keep = 4 + total % (get_args().seq_length - 4)
        batch["loss_mask"].masked_fill_(batch["position_ids"] >= keep, 0.0)  # mock data: position_ids = arange(seq)
    _CURRENT_BATCH.update(batch)
    return batch


_RERUN_LOSSES = {}  # (iteration, re-run?) -> this rank's micro-batch losses, in order


def _compare_rerun(result):
    """Under ``CEZ_TEST_RERUN_MODE``: each micro-batch's loss sum of a re-run step against the first run's,
    printed as ``cez-rerun iteration I micro-batch K: identical`` (or both values)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    machine = get_rerun_state_machine()
    rerun = machine.state == RerunState.RERUNNING_IN_PLACE
    losses = _RERUN_LOSSES.setdefault((machine.current_iteration, rerun), [])
    losses.append(float(result[0]))
    if rerun:
        k = len(losses) - 1
        first = _RERUN_LOSSES.get((machine.current_iteration, False), [])
        same = k < len(first) and first[k] == losses[k]
        print(f"cez-rerun iteration {machine.current_iteration} micro-batch {k} rank {torch.distributed.get_rank()}: "
              + ("identical" if same else f"differs: {first[k] if k < len(first) else None!r} then {losses[k]!r}")
              + "\n", end="", flush=True)  # one write: the ranks share the log


def loss_func(loss_mask, output_tensor):
    pending = _CURRENT_BATCH.pop("logits", None)
    if pending is not None:
        _dump_logits(*pending)
    result = _example_loss_func(loss_mask, output_tensor)
    if os.environ.get("CEZ_TEST_RERUN_MODE") and torch.is_grad_enabled():
        _compare_rerun(result)
    return result


# ------------------------------------------------------------------- the output layer's gradient
def _whole(grad, param=None):
    """A gradient (or weight) as this rank's tensor-parallel shard, whole over data parallel, in fp32. An FSDP
    DTensor's local rows (torch FSDP2: even chunks; Megatron-FSDP: uneven, of this rank's tensor-parallel shard,
    however its global shape counts the tensor-parallel ranks) are put in place in data-parallel rank order and
    summed over the data-parallel group (collectives of the data-parallel ranks, which all call this). Megatron-FSDP
    leaves no gradient on a rank whose shard of ``param`` is empty: that rank joins with no rows."""
    from torch.distributed.tensor import DTensor

    if grad is None and isinstance(param, DTensor):
        grad = param.to_local().new_zeros(param.to_local().shape)
    elif isinstance(grad, DTensor):
        grad = grad.to_local()
    else:
        return grad
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    rows = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(rows, grad.shape[0], group=group)
    start = sum(rows[:torch.distributed.get_rank(group)])
    whole = torch.zeros((sum(rows), *grad.shape[1:]), dtype=torch.float32, device=grad.device)
    whole[start:start + grad.shape[0]] = grad.float()
    torch.distributed.all_reduce(whole, group=group)
    expected = get_args().padded_vocab_size // parallel_state.get_tensor_model_parallel_world_size()
    if whole.shape[0] != expected:
        raise RuntimeError(f"the output layer's FSDP shards hold {whole.shape[0]} rows in all, not {expected}")
    return whole


def _dumping_output_grad(finalize):
    """Megatron's ``finalize_model_grads`` (the gradient sync), then, in iterations 1 and 2, the output layer's
    weight gradient as the optimizer will read it (DDP: ``main_grad``; FSDP: the parameter's gradient, gathered)
    to ``$CEZ_DUMP_OUTPUT_GRAD/output_grad_it{i}_tp{t}.pt`` from data-parallel rank 0."""

    @functools.wraps(finalize)
    def finalize_model_grads(model, *args, **kwargs):
        result = finalize(model, *args, **kwargs)
        iteration = getattr(get_args(), "curr_iteration", -1) + 1
        if iteration in (1, 2):
            for chunk in model:
                for name, param in chunk.named_parameters():
                    if name.endswith("output_layer.weight"):
                        fsdp = type(param).__name__ == "DTensor"  # its gradient is .grad (absent where its shard is)
                        source = "grad" if param.grad is not None or fsdp else "main_grad"
                        grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
                        grad = _whole(grad, param)
                        if parallel_state.get_data_parallel_rank() == 0:
                            os.makedirs(os.environ["CEZ_DUMP_OUTPUT_GRAD"], exist_ok=True)
                            tp = parallel_state.get_tensor_model_parallel_rank()
                            path = os.path.join(os.environ["CEZ_DUMP_OUTPUT_GRAD"],
                                                f"output_grad_it{iteration}_tp{tp}.pt")
                            torch.save({"grad": None if grad is None else grad.detach().float().cpu(), "name": name,
                                        "tp_rank": tp, "kind": type(param).__name__, "source": source}, path)
        return result

    return finalize_model_grads


def _graphs():
    """Which CUDA graphs Megatron holds now: ``full`` (the training step, ``--cuda-graph-impl full_iteration``)
    and ``local`` (per layer, ``--cuda-graph-impl local``)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    held = [name for name, on in (("full", FullCudaGraphWrapper.cuda_graph.get("training") is not None),
                                  ("local", _CudagraphGlobalRecord.cudagraph_created)) if on]
    return ",".join(held) or "none"


def _logging_memory(training_log):
    """Megatron's ``training_log``, then ``cez-memory iteration I: allocated A reserved R`` (this rank's CUDA
    memory in bytes after the step: steady across steps replayed from a CUDA graph)."""

    @functools.wraps(training_log)
    def logged(*args, **kwargs):
        result = training_log(*args, **kwargs)
        iteration = inspect.signature(training_log).bind(*args, **kwargs).arguments["iteration"]
        print(f"cez-memory iteration {iteration} rank {torch.distributed.get_rank()}: allocated "
              f"{torch.cuda.memory_allocated()} reserved {torch.cuda.memory_reserved()} graphs {_graphs()}\n", end="",
              flush=True)  # one write: the ranks share the log
        return result

    return logged


if os.environ.get("CEZ_TEST_LOG_MEMORY"):
    from megatron.training import training as _training

    _training.training_log = _logging_memory(_training.training_log)

if os.environ.get("CEZ_DUMP_OUTPUT_GRAD"):
    from megatron.training import training as _training

    _training.finalize_model_grads = _dumping_output_grad(_training.finalize_model_grads)

if os.environ.get("CEZ_TEST_SKIP_TEARDOWN"):  # leave the CUDA graphs and process groups to the interpreter's exit
    example.release_cuda_graphs_and_process_groups = lambda: None

if os.environ.get("CEZ_TEST_CP_ATTENTION"):
    from support import context_parallel_attention

    context_parallel_attention.use_in_local_specs()

# The example's forward_step and main look these names up in their module when they run.
example.model_provider, example.get_batch, example.loss_func = model_provider, get_batch, loss_func

if __name__ == "__main__":
    example.main()
