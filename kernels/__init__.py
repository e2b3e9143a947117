"""Backends for the fused cross-entropy + z-loss op.

Each backend is a module with two functions of the same signature:

``shard_partials(logits, target, vocab_start, global_vocab, ignore_index, with_logit_sum)``
    logits ``[n, v_local]`` (last dim contiguous), target ``[n]`` global ids. Returns fp32
    ``[3 or 4, n]``: local row max, sum of exp(x - local max), target logit (0 if another rank
    owns it, NaN if out of range), and the logit sum when ``with_logit_sum``.
``write_grad(logits, grad, target, lse, grad_scale, vocab_start, z_loss_coeff, label_smoothing, global_vocab)``
    writes ``grad_scale * (softmax * (1 + 2c*lse) - (1-a)*onehot - a/V)`` into ``grad``
    (which may be ``logits`` itself).

``"triton"`` (``triton_cross_entropy``) runs on CUDA, on Ascend through triton-ascend, and on
the CPU under ``TRITON_INTERPRET=1``; ``"torch"`` (``torch_reference``) runs anywhere.
``backend_for(device)`` picks Triton on accelerators when it imports, else torch. The
environment variable ``MINDSPEED_CEZ_BACKEND`` (``torch`` / ``triton``) or ``use_backend``
forces one.
"""

import contextlib
import importlib
import os

from . import torch_reference

BACKENDS = ("torch", "triton")
_forced = os.environ.get("MINDSPEED_CEZ_BACKEND") or None
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
