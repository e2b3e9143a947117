"""CPU shims for Megatron's *training loop* (``megatron.training``), for CI machines without a GPU.

``megatron.training.pretrain`` hard-codes CUDA in many places (``device='cuda'`` tensors for
all-reduces of timers and losses, ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``,
memory reports, the ``assert torch.cuda.is_available()`` in ``initialize_megatron``...).
:func:`apply` steers all of these to the CPU so that the real loop runs over gloo:

* tensor factories (``torch.*`` and ``Tensor.new_*``) and ``Tensor.to``/``Tensor.cuda`` map any
  CUDA device to ``cpu``;
* ``torch.cuda`` stream/event/synchronize/memory/RNG helpers become CPU no-ops or CPU RNG calls;
* ``initialize_megatron`` is called with ``allow_no_cuda=True``;
* Megatron's model-parallel RNG tracker is seeded on the CPU generator.

Applied only when ``torch.cuda.is_available()`` is False; :func:`apply` is a no-op on a GPU machine.
It complements the adaptor's ``examples/megatron_cpu_shims.py`` (megatron.core) and is safe to
apply together with it, in any order. Nothing here changes numerics.
"""

import contextlib
import functools
import types

import torch

_APPLIED = False
_REAL_CUDA_AVAILABLE = torch.cuda.is_available()


def _is_cuda_device(device):
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means a CUDA device
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_device(device):
    return torch.device("cpu") if _is_cuda_device(device) else device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper._cez_cpu_shim = True
    return wrapper


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "linspace", "eye", "empty_strided",
)


_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


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
    """Stand-in for torch.cuda.Stream: work runs synchronously on the CPU."""

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
def _null_ctx(*args, **kwargs):
    yield


def _patch_torch_cuda():
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # an ordinal; the factory shims map it to the CPU
    # initialize.py builds the model-parallel groups and seeds the RNG tracker only when
    # device_count() > 0: pretend one device (is_available() stays False, so torch itself and
    # the op keep their CPU paths).
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda *a, **k: _CpuStream()
    cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.stream = _null_ctx
    cuda.set_stream = lambda *a, **k: None
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=1
    )
    cuda.is_current_stream_capturing = lambda: False
    # RNG: Megatron's tracker swaps the CUDA generator state; use the CPU generator instead.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None  # torch.manual_seed() already seeds the CPU generator
    cuda.manual_seed_all = lambda seed: None
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    if hasattr(cuda, "nvtx"):
        cuda.nvtx.range_push = lambda *a, **k: None
        cuda.nvtx.range_pop = lambda *a, **k: None


def _patch_megatron():
    # pretrain() -> initialize_megatron() asserts torch.cuda.is_available() unless allow_no_cuda.
    from megatron.training import initialize as m_init
    from megatron.training import training as m_training

    real_init = m_init.initialize_megatron
    if not getattr(real_init, "_cez_cpu_shim", False):

        @functools.wraps(real_init)
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return real_init(*args, **kwargs)

        initialize_megatron._cez_cpu_shim = True
        m_init.initialize_megatron = initialize_megatron
        m_training.initialize_megatron = initialize_megatron

    # The 0.12 line's initialize_megatron builds the legacy fused CUDA kernels (nvcc) on every run.
    fused_kernels = getattr(m_init, "fused_kernels", None)
    if fused_kernels is not None:
        fused_kernels.load = lambda *a, **k: None
    # ... and warms up its jit fusions with CUDA tensors (torch.compile for a GPU).
    if hasattr(m_training, "set_jit_fusion_options"):
        m_init.set_jit_fusion_options = m_training.set_jit_fusion_options = lambda *a, **k: None

    # The model-parallel RNG tracker swaps the *CUDA* generator state around dropout and GPU
    # weight init. On the CPU there is no such generator: keep the tracker's bookkeeping and make
    # the state swap a no-op (CPU init and dropout draw from the CPU generator, seeded by Megatron).
    from megatron.core.tensor_parallel import random as m_random

    m_random._get_cuda_rng_state = lambda *a, **k: torch.zeros(1, dtype=torch.uint8)
    m_random._set_cuda_rng_state = lambda *a, **k: None

    # Gradient clipping asserts grad.type() == 'torch.cuda.FloatTensor' and scales through the
    # CUDA multi-tensor kernels; the same scaling on the CPU (the norm itself is computed by
    # Megatron's get_grad_norm_fp32, unchanged).
    from megatron.core.optimizer import clip_grads as m_clip
    from megatron.core.optimizer import optimizer as m_optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        for g in grads:
            g.detach().mul_(clip_coeff)

    # The alltoall dispatcher turns its split sizes into host arrays only when they are CUDA
    # tensors; on the CPU they must become host arrays too (all_to_all_single takes int lists).
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    real_move = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if real_move is not None and not getattr(real_move, "_cez_cpu_shim", False):

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor):
                return tensor.numpy()
            return real_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        maybe_move_tensor_to_cpu._cez_cpu_shim = True
        moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
        if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
            token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    clip_grad_by_total_norm_fp32._cez_cpu_shim = True
    m_clip.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    m_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def apply(force=False):
    """Steer megatron.training's CUDA calls to the CPU. No-op when a GPU is present (unless force)."""
    global _APPLIED
    if _APPLIED or (_REAL_CUDA_AVAILABLE and not force):
        return False
    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "_cez_cpu_shim", False):
            setattr(torch, name, _wrap_factory(fn))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    for name in _TENSOR_FACTORIES:  # e.g. the alltoall dispatcher's new_empty(device=current_device())
        fn = getattr(torch.Tensor, name)
        if not getattr(fn, "_cez_cpu_shim", False):
            setattr(torch.Tensor, name, _wrap_factory(fn))
    torch.Tensor.cuda = _tensor_cuda
    _patch_torch_cuda()
    _patch_megatron()
    _APPLIED = True
    return True
