"""Run Megatron on a CPU over gloo: for the demo, the example launch and the tests on machines without a GPU.

Megatron hard-codes CUDA where a CPU run reaches it. :func:`apply` steers those places to the CPU, only
when called and only where CUDA is not available (``force=True`` overrides): a GPU machine never gets it.
It is not one of the adaptor's patch points: ``patches.apply()`` and the flags never apply it, the patch
point table does not list it, ``patches.remove()`` leaves it (a process keeps it until it exits).
Nothing here changes numerics; importing this module imports nothing of Megatron.

``apply()``: megatron-core's models, built and stepped by hand (the demo, most tests):

* ``torch.cuda.current_device()`` -> ``"cpu"`` (tensors Megatron creates "on the current device");
* the model-parallel RNG tracker's ``fork()`` -> a no-op context (dropout draws from the CPU generator);
* ``moe_utils.te_general_gemm = None`` without Transformer Engine (0.16.1 reads the undefined name).

``apply(training_loop=True)``: also Megatron's training loop (megatron.core's DDP, schedules and
optimizer; megatron.training's ``pretrain`` where it is installed):

* torch's tensor factories, ``Tensor.new_*``, ``Tensor.to`` and ``Tensor.cuda`` map any CUDA device to the
  CPU, and ``current_device()`` is the ordinal 0 (Megatron also builds ``cuda:N`` from it), which they map;
* ``torch.cuda``'s streams, events, synchronize, memory reports and RNG become CPU no-ops or CPU RNG
  calls; ``device_count()`` is 1 (initialize builds the model-parallel groups only then; ``is_available()``
  stays False, so torch and the op keep their CPU paths);
* the RNG tracker's CUDA state swap is a no-op; gradient clipping scales on the CPU (it asserts
  ``torch.cuda.FloatTensor``); the alltoall dispatcher's split sizes become host arrays;
* ``initialize_megatron`` gets ``allow_no_cuda=True``, builds no fused CUDA kernels, warms up no jit fusion.
"""

import contextlib
import functools
import importlib.util
import types

import torch

MARK = "_cez_cpu_mode"  # set on what this module put in place: applying twice changes nothing


def _mark(fn):
    setattr(fn, MARK, True)
    return fn


def _marked(fn):
    return getattr(fn, MARK, False)


def apply(training_loop=False, force=False):
    """Steer Megatron's hard-coded CUDA to the CPU (see the module's docstring for what each depth covers).

    Returns whether the CPU mode is on: False on a machine with CUDA (nothing changed) unless ``force``.
    Idempotent; ``apply(training_loop=True)`` after ``apply()`` adds the training loop's part."""
    if torch.cuda.is_available() and not force:
        return False
    _steer_core_models()
    if training_loop and not _marked(torch.Tensor.cuda):
        _steer_torch()
        _steer_core_loop()
    if training_loop and importlib.util.find_spec("megatron.training") is not None:
        _steer_pretrain()
    return True


# --------------------------------------------------------------------------- megatron-core's models
def _steer_core_models():
    from megatron.core.tensor_parallel import random as mp_random

    if _marked(mp_random.CudaRNGStatesTracker.fork):
        return
    torch.cuda.current_device = _mark(lambda: "cpu")

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    mp_random.CudaRNGStatesTracker.fork = _mark(fork)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ---------------------------------------------------------------------------- torch, for the loop
def _is_cuda_device(device):
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means a CUDA device
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_device(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return _mark(wrapper)


FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "randperm",
             "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "linspace", "eye",
             "empty_strided")
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")  # e.g. the alltoall dispatcher's


def _tensor_to(real_to):
    @functools.wraps(real_to)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = (torch.device("cpu"),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("non_blocking", None)
        return real_to(self, *args, **kwargs)

    return to


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: work runs synchronously on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: always done, no time elapsed."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


@contextlib.contextmanager
def _null_context(*args, **kwargs):
    yield


def _steer_torch():
    for name in FACTORIES:
        factory = getattr(torch, name, None)
        if factory is not None and not _marked(factory):
            setattr(torch, name, _on_cpu(factory))
    for name in TENSOR_FACTORIES:
        if not _marked(getattr(torch.Tensor, name)):
            setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = _mark(_tensor_cuda)

    cuda = torch.cuda
    cuda.current_device = _mark(lambda: 0)  # an ordinal; the factories map it to the CPU
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream, cuda.Event = _CpuStream, _CpuEvent
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.stream = _null_context
    cuda.set_stream = lambda *a, **k: None
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    cuda.is_current_stream_capturing = lambda: False
    # RNG: Megatron's tracker swaps the CUDA generator's state; the CPU generator's instead.
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None  # torch.manual_seed() seeds the CPU generator
    if hasattr(cuda, "nvtx"):
        cuda.nvtx.range_push = lambda *a, **k: None
        cuda.nvtx.range_pop = lambda *a, **k: None


# -------------------------------------------------------------------- megatron-core's training loop
def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's scaling by ``max_norm / total_norm`` (the norm is its own ``get_grad_norm_fp32``), on the CPU."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
    elif clip_coeff >= 1.0:
        return
    for p in parameters:
        if getattr(p, attr, None) is not None:
            getattr(p, attr).detach().mul_(clip_coeff)


def _steer_core_loop():
    # The model-parallel RNG tracker swaps the CUDA generator's state around dropout and GPU weight init:
    # keep its bookkeeping, make the swap a no-op (the CPU generator, seeded by Megatron, serves both).
    from megatron.core.tensor_parallel import random as m_random

    m_random._get_cuda_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)
    m_random._set_cuda_rng_state = lambda *a, **k: None

    from megatron.core.optimizer import clip_grads as m_clip
    from megatron.core.optimizer import optimizer as m_optimizer

    m_clip.clip_grad_by_total_norm_fp32 = m_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # The alltoall dispatcher makes its split sizes host arrays only when they are CUDA tensors.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    real_move = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if real_move is not None:

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor):
                return tensor.numpy()
            return real_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
        if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
            token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ------------------------------------------------------------------------ megatron.training's pretrain
def _steer_pretrain():
    from megatron.training import initialize as m_init
    from megatron.training import training as m_training

    real_init = m_init.initialize_megatron
    if _marked(real_init):
        return

    @functools.wraps(real_init)
    def initialize_megatron(*args, **kwargs):  # it asserts torch.cuda.is_available() unless allow_no_cuda
        kwargs["allow_no_cuda"] = True
        return real_init(*args, **kwargs)

    m_init.initialize_megatron = m_training.initialize_megatron = _mark(initialize_megatron)
    # The 0.12 line's initialize_megatron builds the legacy fused CUDA kernels (nvcc) on every run ...
    fused_kernels = getattr(m_init, "fused_kernels", None)
    if fused_kernels is not None:
        fused_kernels.load = lambda *a, **k: None
    # ... and warms up its jit fusions with CUDA tensors.
    if hasattr(m_training, "set_jit_fusion_options"):
        m_init.set_jit_fusion_options = m_training.set_jit_fusion_options = lambda *a, **k: None
