"""``out += a @ b`` into an fp32 ``out`` from 16-bit ``a``, ``b``, without fp32 copies of the operands.

The fused output layer's weight gradient (added into an fp32 weight-gradient target) and its fp32
``dhidden`` sums. One way per device type and torch, chosen once (:func:`kind_for`):

``"addmm_out_dtype"``
    CUDA with torch >= 2.8: ``torch.addmm(out, a, b, out_dtype=torch.float32, out=out)``, one
    cuBLAS GEMM with an fp32 output.
``"npu_matmul_add"``
    Ascend with MindSpeed importable: ``mindspeed.ops.npu_matmul_add.npu_matmul_add_fp32``, the op
    Megatron's own gradient-accumulation fusion calls there. Its contract
    (``mindspeed/ops/npu_matmul_add.py`` and its callers in ``mindspeed/core/``):
    ``npu_matmul_add_fp32(total_input [t, k], grad_output [t, m], grad)`` adds
    ``grad_output.T @ total_input`` into the fp32 ``grad [m, k]``, 2-D 16-bit inputs; here
    ``grad_output = a.T`` and ``total_input = b``, taken when both are contiguous (else as below).
``"triton"``
    CUDA without ``out_dtype`` (torch < 2.8): this package's kernel, the product accumulated into
    fp32 in its epilogue (``kernels/triton_matmul_accumulate.py``).
``"gemm_add"``
    Anywhere else (CPU, NPUs without MindSpeed, other devices): a 16-bit GEMM into a scratch
    buffer reused across the calls of one op, then an fp32 add (the product rounded once to 16
    bits, as the unfused layer's 16-bit weight gradient is).

fp32 operands take ``out.addmm_(a, b)``; a 16-bit ``out`` (a 16-bit weight-gradient target, as
Megatron keeps without fp32 gradient accumulation) one GEMM in its dtype, as Megatron's own
accumulation does there.
docs/weight_gradient.md says which runs where and what each costs.
"""

import contextlib
import functools
import importlib

import torch

KINDS = ("addmm_out_dtype", "npu_matmul_add", "triton", "gemm_add")
MINDSPEED_OP = "mindspeed.ops.npu_matmul_add"


def _addmm_has_out_dtype():
    """Whether ``torch.addmm`` takes ``out_dtype`` (a 16-bit GEMM into an fp32 output; torch 2.8 on)."""
    schemas = torch._C._jit_get_schemas_for_operator("aten::addmm")
    return any(arg.name == "out_dtype" for schema in schemas for arg in schema.arguments)


ADDMM_OUT_DTYPE = _addmm_has_out_dtype()


def _npu_matmul_add():
    """MindSpeed's ``npu_matmul_add_fp32``, or None where MindSpeed (or torch_npu under it) does not import."""
    try:
        return importlib.import_module(MINDSPEED_OP).npu_matmul_add_fp32
    except Exception:  # noqa: BLE001 - any import failure: MindSpeed is not usable here
        return None


def _triton_kernel():
    try:
        from mindspeed_cez.kernels import triton_matmul_accumulate
    except ImportError:  # no triton
        return None
    return triton_matmul_accumulate.matmul_accumulate


@functools.lru_cache(maxsize=None)
def _chosen(device_type):
    if device_type == "cuda":
        if ADDMM_OUT_DTYPE:
            return "addmm_out_dtype"
        return "triton" if _triton_kernel() is not None else "gemm_add"
    if device_type == "npu" and _npu_matmul_add() is not None:
        return "npu_matmul_add"
    return "gemm_add"


# Global: the ops make an Accumulator per call, with no handle through which a test or benchmark could force one.
_FORCED = None


def kind_for(device):
    """The accumulation for ``device`` (a ``torch.device`` or anything with ``.type``): chosen once per
    device type in this process (:func:`forced` overrides it)."""
    return _FORCED or _chosen(device.type)


@contextlib.contextmanager
def forced(kind):
    """Run the accumulations inside with ``kind`` (tests, benchmarks: the torch < 2.8 path on a newer
    torch); a kind this process cannot run is an error naming what it needs."""
    global _FORCED
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "addmm_out_dtype" and not ADDMM_OUT_DTYPE:
        raise ValueError("kind='addmm_out_dtype' needs torch >= 2.8 (torch.addmm's out_dtype)")
    if kind == "npu_matmul_add" and _npu_matmul_add() is None:
        raise ValueError(f"kind='npu_matmul_add' needs MindSpeed ({MINDSPEED_OP}) importable")
    if kind == "triton" and _triton_kernel() is None:
        raise ValueError("kind='triton' needs triton")
    previous, _FORCED = _FORCED, kind
    try:
        yield
    finally:
        _FORCED = previous


def chosen_cache_clear():
    """Choose again (after MindSpeed became importable, in tests)."""
    _chosen.cache_clear()


class Accumulator:
    """``acc(out, a, b)``: ``out += a @ b`` the way :func:`kind_for` chose for ``device``. One per op
    call: ``"gemm_add"`` keeps its 16-bit scratch buffer (the largest product so far) across calls."""

    def __init__(self, device):
        self.kind = kind_for(device)
        self._scratch = None

    def _product(self, a, b):
        numel = a.shape[0] * b.shape[1]
        if self._scratch is None or self._scratch.numel() < numel or self._scratch.dtype != a.dtype:
            self._scratch = torch.empty(numel, dtype=a.dtype, device=a.device)
        return torch.matmul(a, b, out=self._scratch[:numel].view(a.shape[0], b.shape[1]))

    def __call__(self, out, a, b):
        if out.dtype != torch.float32:
            out.addmm_(a.to(out.dtype), b.to(out.dtype))
        elif a.dtype == torch.float32:
            out.addmm_(a, b.float())
        elif self.kind == "addmm_out_dtype":
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        elif self.kind == "triton" and out.stride(-1) == 1:
            _triton_kernel()(out, a, b)
        elif self.kind == "npu_matmul_add" and a.t().is_contiguous() and b.is_contiguous():
            if a.numel() and b.numel():
                _npu_matmul_add()(b, a.t(), out)
        else:
            out.add_(self._product(a, b))
        return out
