"""The ops' gradients are first order: differentiating them again is refused, naming the op.

Backward writes the gradient with kernels (or in place) that autograd does not record. Under
``create_graph=True`` (a gradient penalty, a Hessian-vector product) that gradient would look
constant to autograd and its own gradient would be silently dropped. :func:`first_order_only`
wraps an autograd Function's ``backward``: without ``create_graph`` it runs as is; with it, it runs
without recording, and each gradient it returns carries a node whose backward raises, so the first
order is right and the second is refused.
"""

import functools

import torch

# A leaf that needs a gradient, input of every refusing node: a node's outputs need a gradient only
# when an input does, and the gradients the kernels return do not.
_ANCHOR = torch.empty(0, requires_grad=True)


class _SecondOrderRefused(torch.autograd.Function):
    """The identity on a gradient; differentiating through it raises, naming the op."""

    @staticmethod
    def forward(ctx, grad, op_name, _anchor):
        ctx.op_name = op_name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _grad):
        raise RuntimeError(
            f"{ctx.op_name} is first-order only: the gradient it gave under create_graph=True cannot be "
            "differentiated again (a gradient penalty, a Hessian-vector product); compute such a term with a loss "
            "written in torch ops (e.g. torch.nn.functional.cross_entropy)")


class _FirstOrderInput(torch.autograd.Function):
    """The identity on an op's input, for an op made of others' autograd (torch_npu's): whatever their
    backward records, the input's gradient under create_graph=True goes through a refusing node."""

    @staticmethod
    def forward(ctx, x, op_name):
        ctx.op_name = op_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            return _SecondOrderRefused.apply(grad.detach(), ctx.op_name, _ANCHOR), None
        return grad, None


def first_order_input(x, op_name):
    """``x`` itself, through a node that makes any second-order gradient of ``op_name`` raise."""
    return _FirstOrderInput.apply(x, op_name) if x.requires_grad and torch.is_grad_enabled() else x


def first_order_only(op_name):
    """Decorate an autograd Function's ``backward`` so that a second-order gradient through it raises."""

    def decorate(backward):
        @functools.wraps(backward)
        def guarded(ctx, *grads):
            if not torch.is_grad_enabled():  # no create_graph: autograd records nothing anyway
                return backward(ctx, *grads)
            with torch.no_grad():
                results = backward(ctx, *grads)
            return tuple(_SecondOrderRefused.apply(r, op_name, _ANCHOR) if isinstance(r, torch.Tensor) else r
                         for r in results)

        return guarded

    return decorate
