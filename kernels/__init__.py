"""Backends for the fused cross-entropy + z-loss ops, their interfaces in :mod:`.backends`.

Cross-entropy backends (:class:`.backends.CrossEntropyBackend`, the loss of logits that exist):
``"triton"`` (``triton_cross_entropy``) runs on CUDA, on Ascend through triton-ascend, and on the
CPU under ``TRITON_INTERPRET=1``; ``"torch"`` (``torch_reference``) runs anywhere.
``backend_for(device, name)`` returns the named one, or for ``name=None`` Triton on accelerators
where it imports, else torch.

Whole-loss backends (:class:`.backends.WholeLossBackend`, a vendor's op with its own autograd, one
rank holding the whole vocab): ``"cann"`` (``cann``: torch_npu's ``npu_cross_entropy_loss``);
:func:`whole_loss_backend` returns it by name; ``backend_for`` refuses it.

Linear backends (:class:`.backends.LinearBackend`, the loss of ``rows @ weight.T`` without its
logits): ``"triton"`` (``triton_linear_cross_entropy``, ``tl.dot`` tiles) and ``"gemm"``
(``chunked_linear.ChunkedLinear``: GEMMs on vocab chunks reduced by a cross-entropy backend);
``linear_backend_for(device, name, backend, chunk_cols)`` picks one.

Every backend takes the loss whole (:class:`.loss_spec.LossSpec`) and where its columns lie
(:class:`.loss_spec.VocabShard`); the ops take the backends' names; nothing in ``kernels/`` reads
the environment. ``launch_as("npu")`` (``device_cores``): within the block, the Triton kernels on
CPU tensors (the interpreter) launch with the NPU's settings; the Ascend leg's execution test uses it.
"""

import functools
import importlib

from . import torch_reference
from .logit_transform import IDENTITY, LogitTransform  # noqa: F401  (public: the loss's transform)
from .loss_spec import LossSpec, VocabShard  # noqa: F401  (public: what every backend takes)
from .device_cores import launch_as  # noqa: F401 - public: kernels.launch_as("npu")

WHOLE_LOSS_BACKENDS = {"cann": ".cann"}
BACKENDS = ("torch", "triton", *WHOLE_LOSS_BACKENDS)
LINEAR_BACKENDS = {"gemm": ".chunked_linear", "triton": ".triton_linear_cross_entropy"}


@functools.lru_cache(maxsize=None)  # the import tried once per process
def _triton_import():
    """``(module, None)``, or ``(None, the ImportError)`` where triton (or triton-ascend) is not installed."""
    try:
        return importlib.import_module(".triton_cross_entropy", __name__), None
    except ImportError as exc:
        return None, exc


def _load_triton():
    return _triton_import()[0]


def triton_available() -> bool:
    return _load_triton() is not None


def get_backend(name: str):
    """The cross-entropy backend module called ``name`` (``"torch"`` or ``"triton"``)."""
    if name == "torch":
        return torch_reference
    if name == "triton":
        module = _load_triton()
        if module is None:
            raise RuntimeError(f"backend='triton' but Triton failed to import: {_triton_import()[1]}")
        return module
    if name in WHOLE_LOSS_BACKENDS:
        raise ValueError(f"backend={name!r} (a vendor's whole op) serves "
                         "vocab_parallel_cross_entropy_zloss at tensor-parallel size 1 only; the fused output layer "
                         "(linear_cross_entropy_zloss) and the vocab-sharded steps need backend='triton' or 'torch' "
                         "(or None: automatic)")
    raise ValueError(f"unknown backend {name!r}; backend must be one of {BACKENDS} or None (automatic)")


def whole_loss_backend(name):
    """The :class:`.backends.WholeLossBackend` module called ``name`` (``"cann"``), None for another name."""
    module = WHOLE_LOSS_BACKENDS.get(name) if isinstance(name, str) else None
    return None if module is None else importlib.import_module(module, __name__)


def backend_for(device, name=None):
    """The backend ``name``; for None, Triton on accelerators where it imports, else the torch reference."""
    if name is not None:
        return get_backend(name)
    if device.type != "cpu" and triton_available():
        return _load_triton()
    return torch_reference


def linear_backend_for(device, name=None, backend=None, chunk_cols=None):
    """The fused output projection's :class:`.backends.LinearBackend`: ``"triton"``
    (``triton_linear_cross_entropy``: ``tl.dot`` tiles, no logits in memory) or ``"gemm"``
    (``chunked_linear.ChunkedLinear`` of the cross-entropy backend ``backend_for(device, backend)``
    and ``chunk_cols``). ``name=None``: GEMMs on CUDA (cuBLAS is the faster of the two there, see
    docs/performance.md) and where the cross-entropy backend is the torch reference; Triton on other
    accelerators (Ascend: the cube unit)."""
    if name is not None and name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; linear_backend must be one of "
                         f"{tuple(LINEAR_BACKENDS)} or None (automatic)")
    ce_backend = backend_for(device, backend)
    if name is None:
        name = "triton" if device.type != "cuda" and ce_backend is not torch_reference else "gemm"
    if name == "triton":
        return importlib.import_module(LINEAR_BACKENDS[name], __name__)
    from .chunked_linear import ChunkedLinear

    return ChunkedLinear(ce_backend, chunk_cols)
