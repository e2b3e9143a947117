"""Backends for the fused cross-entropy + z-loss op.

Each backend is a module with the same functions (logits ``[n, v_local]`` with a contiguous
last dim, target ``[n]`` global ids, results fp32). ``loss`` is the loss's description, a
:class:`.loss_spec.LossSpec` (ignore index, z-loss coefficient ``c``, label smoothing ``a``, logit
transform: everything below is of ``z = loss.logit_transform.apply(x)``, transformed per element in
the backend's own working tiles / chunks, and ``write_grad`` writes ``dz * dz/dx``); ``shard`` is where
the logits' columns lie in the global vocab, a :class:`.loss_spec.VocabShard`:

``fused_loss(logits, target, loss)``
    one rank holds the whole vocab: ``[3, n]`` rows loss, z-loss, lse, in one pass.
``shard_partials(logits, target, loss, shard)``
    the flat partials of this vocab slice, the layout of :mod:`.partials`: per row its
    log-sum-exp and target term ``(1-a)*z[target] + (a/V)*sum(z)`` (NaN for an out-of-range
    target), then the slice's width.
``loss_from_partials(partials, target, loss, out=None)``
    ``[ranks, numel]`` partials (every rank's, all-gathered; ``[1, numel]`` for one) -> ``[3, n]``
    loss, z-loss, lse (into ``out`` when given); unequal widths give NaN, on CUDA also a
    device-side assert.
``write_grad(logits, grad, target, lse, grad_loss, loss, shard)``
    writes ``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` into ``grad`` (which may be
    ``logits`` itself), ``g`` the upstream gradient, 0 on ignored rows.
``check_targets(target, loss, shard)``
    on CUDA an asynchronous device-side assert on out-of-range targets (no host sync); the
    Triton backend asserts inside its forward kernel instead, so its ``check_targets`` launches
    nothing.

``"triton"`` (``triton_cross_entropy``) runs on CUDA, on Ascend through triton-ascend, and on
the CPU under ``TRITON_INTERPRET=1``; ``"torch"`` (``torch_reference``) runs anywhere.
``backend_for(device, name)`` returns the named one, or for ``name=None`` picks Triton on
accelerators when it imports, else torch. The ops take the name as their ``backend`` argument;
nothing in ``kernels/`` reads the environment (the adaptor's settings do).

The fused output projection (``linear_cross_entropy_zloss``) has backends of its own, with
``linear_partials(rows, weight, target, loss, shard, *, ce_backend=None, chunk_cols=None)`` (the
partials of ``rows @ weight.T``) and ``linear_grad(rows, weight, grad, target, lse, grad_loss, loss,
shard, *, ce_backend=None)`` (its gradient into ``grad``), ``loss`` and ``shard`` as above:
``"triton"`` (``triton_linear_cross_entropy``, ``tl.dot`` tiles; it makes no logits, so it needs
neither keyword) and ``"gemm"`` (``chunked_linear``: GEMMs on ``chunk_cols`` vocab rows at a time,
reduced by the cross-entropy backend ``ce_backend``, ``backend_for(device)`` when None);
``linear_backend_for(device, name, backend)`` picks one.

``launch_as("npu")`` (``device_cores``): within the block, the Triton kernels on CPU tensors (the
interpreter) launch with the NPU's settings; the Ascend leg's execution test uses it.
"""

import importlib

from . import torch_reference
from .logit_transform import IDENTITY, LogitTransform  # noqa: F401  (public: the loss's transform)
from .loss_spec import LossSpec, VocabShard  # noqa: F401  (public: what every backend takes)
from .device_cores import launch_as  # noqa: F401 - public: kernels.launch_as("npu")

BACKENDS = ("torch", "triton")
LINEAR_BACKENDS = {"gemm": ".chunked_linear", "triton": ".triton_linear_cross_entropy"}
_triton_module = None
_triton_error = None


def _load_triton():
    global _triton_module, _triton_error
    if _triton_module is None and _triton_error is None:
        try:
            _triton_module = importlib.import_module(".triton_cross_entropy", __name__)
        except ImportError as exc:  # triton (or triton-ascend) not installed
            _triton_error = exc
    return _triton_module


def triton_available() -> bool:
    return _load_triton() is not None


def get_backend(name: str):
    """The cross-entropy backend module called ``name`` (``"torch"`` or ``"triton"``)."""
    if name == "torch":
        return torch_reference
    if name == "triton":
        module = _load_triton()
        if module is None:
            raise RuntimeError(f"backend='triton' but Triton failed to import: {_triton_error}")
        return module
    if name == "cann":
        raise ValueError("backend='cann' (torch_npu's npu_cross_entropy_loss) serves vocab_parallel_cross_entropy_zloss "
                         "at tensor-parallel size 1 only; the fused output layer (linear_cross_entropy_zloss) and the "
                         "vocab-sharded steps need backend='triton' or 'torch' (or None: automatic)")
    raise ValueError(f"unknown backend {name!r}; backend must be one of {BACKENDS} or None (automatic)")


def backend_for(device, name=None):
    """The backend ``name``; for None, Triton on accelerators where it imports, else the torch reference."""
    if name is not None:
        return get_backend(name)
    if device.type != "cpu" and triton_available():
        return _triton_module
    return torch_reference


def linear_backend_for(device, name=None, backend=None):
    """The fused output projection's backend, with ``linear_partials`` and ``linear_grad``:
    ``"triton"`` (``triton_linear_cross_entropy``: ``tl.dot`` tiles, no logits in memory) or
    ``"gemm"`` (``chunked_linear``: ``torch.matmul`` on vocab chunks and the cross-entropy
    backend's kernels). ``name=None``: GEMMs on CUDA (cuBLAS is the faster of the two there, see
    docs/performance.md) and where the cross-entropy backend (``backend_for(device, backend)``) is
    the torch reference; Triton on other accelerators (Ascend: the cube unit)."""
    if name is None:
        triton_device = device.type != "cuda" and backend_for(device, backend) is not torch_reference
        name = "triton" if triton_device else "gemm"
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; linear_backend must be one of "
                         f"{tuple(LINEAR_BACKENDS)} or None (automatic)")
    return importlib.import_module(LINEAR_BACKENDS[name], __name__)
