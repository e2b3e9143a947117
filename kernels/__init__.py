"""Backends for the fused cross-entropy + z-loss op.

Each backend is a module with the same functions (logits ``[n, v_local]`` with a contiguous
last dim, target ``[n]`` global ids, results fp32):

``fused_loss(logits, target, ignore_index, z_loss_coeff, label_smoothing)``
    one rank holds the whole vocab: ``[3, n]`` rows loss, z-loss, lse, in one pass.
``shard_partials(logits, target, vocab_start, global_vocab, ignore_index, label_smoothing)``
    ``[4, n]``: this slice's row max, sum of exp(x - row max), target term
    ``(1-a)*x[target] + (a/V)*sum(x)`` (NaN for an out-of-range target), row max again.
``rescale_sum_exp(partials)``
    after the MAX all-reduce of row 0: the sum-exp rescaled to the global max, in place.
``loss_from_partials(partials, target, ignore_index, z_loss_coeff)``
    after the SUM all-reduce of rows 1-2: ``[3, n]`` loss, z-loss, lse, over the partials.
``write_grad(logits, grad, target, lse, grad_loss, ignore_index, vocab_start, z_loss_coeff, label_smoothing, global_vocab)``
    writes ``g * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` into ``grad`` (which may be
    ``logits`` itself), ``g`` the upstream gradient, 0 on ignored rows.
``check_targets(target, global_vocab, ignore_index)``
    on CUDA an asynchronous device-side assert on out-of-range targets (no host sync); the
    Triton backend asserts inside its forward kernel instead, so its ``check_targets`` launches
    nothing.

``"triton"`` (``triton_cross_entropy``) runs on CUDA, on Ascend through triton-ascend, and on
the CPU under ``TRITON_INTERPRET=1``; ``"torch"`` (``torch_reference``) runs anywhere.
``backend_for(device)`` picks Triton on accelerators when it imports, else torch. The
environment variable ``MINDSPEED_CEZ_BACKEND`` (``torch`` / ``triton``) or ``use_backend``
forces one.

The fused output projection (``linear_cross_entropy_zloss``) has backends of its own, with
``linear_partials(rows, weight, target, vocab_start, global_vocab, ignore_index, label_smoothing)``
(the ``[4, n]`` partials of ``rows @ weight.T``) and ``linear_grad(rows, weight, grad, ...)`` (its
gradient into ``grad``): ``"triton"`` (``triton_linear_cross_entropy``, ``tl.dot`` tiles) and
``"gemm"`` (``chunked_linear``); ``linear_backend_for(device)`` picks one.
"""

import contextlib
import importlib
import os

from . import torch_reference

BACKENDS = ("torch", "triton")
_forced = os.environ.get("MINDSPEED_CEZ_BACKEND") or None
_triton_module = None
_triton_error = None
_forced_linear = os.environ.get("MINDSPEED_CEZ_LINEAR_BACKEND") or None
LINEAR_BACKENDS = {"gemm": ".chunked_linear", "triton": ".triton_linear_cross_entropy"}


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
    if name == "torch":
        return torch_reference
    if name == "triton":
        module = _load_triton()
        if module is None:
            raise RuntimeError(f"MINDSPEED_CEZ_BACKEND=triton but Triton failed to import: {_triton_error}")
        return module
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def backend_for(device):
    if _forced is not None:
        return get_backend(_forced)
    if device.type != "cpu" and triton_available():
        return _triton_module
    return torch_reference


def linear_backend_for(device):
    """The fused output projection's backend, with ``linear_partials`` and ``linear_grad``:
    ``"triton"`` (``triton_linear_cross_entropy``: ``tl.dot`` tiles, no logits in memory) or
    ``"gemm"`` (``chunked_linear``: ``torch.matmul`` on vocab chunks and the cross-entropy
    backend's kernels). Default: GEMMs on CUDA (cuBLAS; 1.54x the three-GEMM floor against the
    Triton kernels' 1.65x on an H100, bench/results/2026-11-24_h100/linear_ce_triton.md) and where
    ``backend_for`` picks the torch reference; Triton on other accelerators (Ascend: the cube unit).
    ``MINDSPEED_CEZ_LINEAR_BACKEND`` or ``use_linear_backend`` forces one."""
    triton_device = device.type != "cuda" and backend_for(device) is not torch_reference
    name = _forced_linear or ("triton" if triton_device else "gemm")
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; choose one of {LINEAR_BACKENDS}")
    return importlib.import_module(LINEAR_BACKENDS[name], __name__)


@contextlib.contextmanager
def use_backend(name):
    """Force a backend (``"torch"``, ``"triton"``, or ``None`` for automatic) inside the block."""
    global _forced
    if name is not None:
        get_backend(name)
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


@contextlib.contextmanager
def use_linear_backend(name):
    """Force the fused output projection's backend (``"gemm"``, ``"triton"``, ``None``) inside the block."""
    global _forced_linear
    if name is not None and name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear backend {name!r}; choose one of {tuple(LINEAR_BACKENDS)}")
    previous, _forced_linear = _forced_linear, name
    try:
        yield
    finally:
        _forced_linear = previous
