"""Stand-in for ``mindspeed.ops.npu_matmul_add`` (MindSpeed 84855f04): the contract its callers in
``mindspeed/core/`` rely on, ``npu_matmul_add_fp32(total_input [t, k], grad_output [t, m], grad)``
adds ``grad_output.T @ total_input`` into the fp32 ``grad [m, k]`` in place, 16-bit 2-D inputs.
Each call is checked against that contract and recorded in :data:`CALLS`."""

import torch

CALLS = []  # (total_input shape, grad_output shape, grad shape, input dtype) per call


def npu_matmul_add_fp32(total_input, grad_output, grad):
    assert total_input.dim() == 2 and grad_output.dim() == 2, (total_input.shape, grad_output.shape)
    assert total_input.dtype in (torch.bfloat16, torch.float16) and grad_output.dtype == total_input.dtype
    assert grad.dtype == torch.float32, grad.dtype
    assert total_input.shape[0] == grad_output.shape[0], (total_input.shape, grad_output.shape)
    assert tuple(grad.shape) == (grad_output.shape[1], total_input.shape[1]), (grad.shape, grad_output.shape)
    assert total_input.is_contiguous() and grad_output.is_contiguous()
    CALLS.append((tuple(total_input.shape), tuple(grad_output.shape), tuple(grad.shape), total_input.dtype))
    grad.add_((grad_output.double().t() @ total_input.double()).float())  # the product exact, one fp32 rounding


def npu_matmul_add_fp16(total_input, grad_output, grad):
    raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
