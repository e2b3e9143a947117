"""Every read of Megatron's process-wide state, in one place: its parallel groups, its micro-batch
count and its parsed arguments.

Megatron keeps these in module globals, some of them private. The rest of the package asks here,
and the ops get what is read as arguments. Each function names the Megatron versions it was checked
against (``CHECKED``): megatron-core 0.12.1, 0.13.1, 0.14.0, 0.15.3, 0.16.1 and 0.19.2, and
Megatron-LM main d98e8a64 (the CI lines). None of them imports a Megatron module that is not loaded
already, except where the docstring says so.
"""

import sys

import torch.distributed as dist

CHECKED = ("megatron-core 0.12.1", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.19.2", "Megatron-LM main d98e8a64")

PARALLEL_STATE = "megatron.core.parallel_state"
GLOBAL_VARS = "megatron.training.global_vars"


class MegatronStateMissing(RuntimeError):
    """A Megatron that keeps a piece of state elsewhere than the versions in ``CHECKED``."""


def _parallel_state():
    """``megatron.core.parallel_state`` where Megatron loaded it and set up its groups, else None."""
    parallel_state = sys.modules.get(PARALLEL_STATE)
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        return parallel_state
    return None


def tensor_parallel_group():
    """Megatron's tensor-parallel group where its groups are set up, else None (one rank).

    Reads ``parallel_state.model_parallel_is_initialized()`` and ``get_tensor_model_parallel_group()``
    (public functions; checked: ``CHECKED``). Imports nothing: Megatron loaded the module if it set up
    the groups."""
    parallel_state = _parallel_state()
    return None if parallel_state is None else parallel_state.get_tensor_model_parallel_group()


def module_tp_group(module):
    """The tensor-parallel group of a Megatron module (its ``tp_group`` / ``pg_collection.tp``, else Megatron's)."""
    group = getattr(module, "tp_group", None)
    if group is None:
        group = getattr(getattr(module, "pg_collection", None), "tp", None)
    return tensor_parallel_group() if group is None else group


def reduction_groups():
    """``(data-parallel group with context parallelism, pipeline group)`` of Megatron's set-up groups, or
    None without them (or without torch.distributed). The metrics are reduced over these.

    Reads ``get_data_parallel_group(with_context_parallel=True)`` and
    ``get_pipeline_model_parallel_group()`` (checked: ``CHECKED``). Imports nothing."""
    parallel_state = _parallel_state()
    if parallel_state is None or not dist.is_initialized():
        return None
    return (parallel_state.get_data_parallel_group(with_context_parallel=True),
            parallel_state.get_pipeline_model_parallel_group())


def context_parallel_size():
    """Megatron's context-parallel size: 0 without torch.distributed, None where it runs but Megatron's
    groups are not set up.

    Imports ``megatron.core.parallel_state``; reads ``get_context_parallel_group(check_initialized=False)``
    (checked: ``CHECKED``)."""
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    return None if group is None else group.size()


def num_microbatches():
    """Megatron's micro-batch count, None where no micro-batch calculator is set up (a model run outside
    Megatron's schedule). Raises :class:`MegatronStateMissing` for a megatron-core that keeps the
    calculator elsewhere.

    Imports ``megatron.core.num_microbatches_calculator``; reads its private
    ``_GLOBAL_NUM_MICROBATCHES_CALCULATOR`` (whether one is set up: ``get_num_microbatches()`` fails
    without one) and ``get_num_microbatches()`` (checked: ``CHECKED``)."""
    from megatron.core import num_microbatches_calculator as calculators

    if not hasattr(calculators, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"):
        raise MegatronStateMissing("megatron.core.num_microbatches_calculator does not keep "
                                   "_GLOBAL_NUM_MICROBATCHES_CALCULATOR in this megatron-core")
    if calculators._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        return None
    return calculators.get_num_microbatches()


def parsed_args():
    """Megatron's parsed arguments (what ``get_args()`` returns; MindSpeed-LLM trains with the same), or
    None before they are parsed or without ``megatron.training``.

    Reads ``megatron.training.global_vars._GLOBAL_ARGS`` (private; ``get_args()`` asserts where it is
    None). Checked: ``CHECKED`` where ``megatron.training`` ships (Megatron-LM core_v0.12.1, the
    megatron-core 0.19.2 wheel, main d98e8a64); the 0.13.1 to 0.16.1 wheels have no
    ``megatron.training``, so there it is None. Imports nothing."""
    return getattr(sys.modules.get(GLOBAL_VARS), "_GLOBAL_ARGS", None)
