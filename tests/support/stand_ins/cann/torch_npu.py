"""Stand-in for ``torch_npu``: only ``npu_cross_entropy_loss``, on CPU tensors, as torch_npu's
documentation describes it (Ascend/op-plugin ``docs/context/torch_npu-npu_cross_entropy_loss.md``
at 64b9136a, CANN's ``aclnnCrossEntropyLoss`` formulas); written for this project, no code of
theirs. It records each call in :data:`CALLS`, refuses what the documentation says the op does not
take, and returns the documented outputs in ``input``'s dtype with the documented gradients
(``loss`` differentiable, ``log_prob`` and ``lse_for_zloss`` not). CANN's page says the z-loss
arguments (``lse_square_scale_for_zloss`` / ``return_zloss``) have no effect: here ``zloss`` and
``lse_for_zloss`` come back as zeros (``zloss`` with a zero gradient), so a backend that read its
z-loss from them would pass every check but the value's. ``tests/kernels/test_cann_backend.py`` puts this
module in ``sys.modules`` as ``torch_npu`` for its own tests only.
"""

import torch

CALLS = []
MAX_N = 200000
_DEFAULTS = {"weight": None, "reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0,
             "lse_square_scale_for_zloss": 0.0, "return_zloss": False}


def _check(input, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale_for_zloss, kwargs):
    if input.dim() != 2 or input.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise RuntimeError(f"input must be [N, C] float16/float32/bfloat16, got {tuple(input.shape)} {input.dtype}")
    n, c = input.shape
    if not 0 < n <= MAX_N or c == 0:
        raise RuntimeError(f"N must be in (0, {MAX_N}] and C > 0, got {tuple(input.shape)}")
    if target.dtype != torch.int64 or tuple(target.shape) != (n,):
        raise RuntimeError(f"target must be int64 [N], got {target.dtype} {tuple(target.shape)}")
    if weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (c,)):
        raise RuntimeError("weight must be float32 [C]")
    if reduction not in ("mean", "sum", "none"):
        raise RuntimeError(f"reduction must be mean, sum or none, got {reduction!r}")
    if not ignore_index < c:
        raise RuntimeError(f"ignore_index must be < C, got {ignore_index}")
    if not (0.0 <= label_smoothing < 1.0 and 0.0 <= lse_square_scale_for_zloss < 1.0):
        raise RuntimeError("label_smoothing and lse_square_scale_for_zloss must be in [0, 1)")
    ignored = target == ignore_index if ignore_index >= 0 else torch.zeros_like(target, dtype=torch.bool)
    if bool(((target < 0) | (target >= c))[~ignored].any()):
        raise RuntimeError("target values must be in [0, C)")
    if input.requires_grad and torch.is_grad_enabled():
        if reduction in ("sum", "none") and label_smoothing != 0.0:
            raise RuntimeError("with requires_grad, reduction sum/none takes no label_smoothing")
        if reduction == "mean" and any(kwargs[k] is not None if k == "weight" else kwargs[k] != v
                                       for k, v in _DEFAULTS.items() if k != "reduction"):
            raise RuntimeError("with requires_grad, reduction mean takes only the defaults of the optional arguments")
    return ignored


class _Op(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, weight, reduction, ignored, label_smoothing, scale, return_zloss):
        x = input.float()
        lse = torch.logsumexp(x, dim=1)
        log_prob = x - lse[:, None]
        w = weight if weight is not None else torch.ones(x.shape[1])
        keep = (~ignored).float()
        safe = torch.where(ignored, torch.zeros_like(target), target)
        w_t = w[safe] * keep
        nll = -log_prob.gather(1, safe[:, None]).squeeze(1) * w_t
        smooth = -(log_prob * w[None, :]).sum(1) / x.shape[1] * keep
        per_token = (1 - label_smoothing) * nll + label_smoothing * smooth
        if reduction == "mean":
            loss = per_token.sum() / w_t.sum()
        elif reduction == "sum":
            loss = per_token.sum()
        else:
            loss = per_token
        ctx.save_for_backward(log_prob.to(input.dtype), safe, keep)
        ctx.reduction, ctx.denominator = reduction, w_t.sum()
        loss = loss.reshape(-1 if reduction == "none" else 1).to(input.dtype)
        # the z-loss arguments have no effect (CANN's page): zeros, whatever scale / return_zloss say
        out = (loss, log_prob.to(input.dtype), torch.zeros_like(loss), torch.zeros_like(lse, dtype=input.dtype))
        ctx.mark_non_differentiable(out[1], out[3])
        return out

    @staticmethod
    def backward(ctx, g_loss, _g_log_prob, _g_zloss, _g_lse):
        log_prob, safe, keep = ctx.saved_tensors
        n = log_prob.shape[0]
        if g_loss is None:
            g = torch.zeros(n)
        else:
            g = g_loss.float().expand(n) if ctx.reduction != "none" else g_loss.float()
        if ctx.reduction == "mean":
            g = g / ctx.denominator
        g = g * keep
        softmax = log_prob.float().exp()
        grad = softmax * g[:, None]
        grad.scatter_add_(1, safe[:, None], -g[:, None])
        return grad.to(log_prob.dtype), None, None, None, None, None, None, None


def npu_cross_entropy_loss(input, target, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                           lse_square_scale_for_zloss=0.0, return_zloss=False):
    kwargs = {"weight": weight, "reduction": reduction, "ignore_index": ignore_index,
              "label_smoothing": label_smoothing, "lse_square_scale_for_zloss": lse_square_scale_for_zloss,
              "return_zloss": return_zloss}
    CALLS.append({"input": (tuple(input.shape), input.dtype, input.requires_grad), "target": target.clone(), **kwargs})
    ignored = _check(input, target, weight, reduction, ignore_index, label_smoothing, lse_square_scale_for_zloss,
                     kwargs)
    return _Op.apply(input, target, weight, reduction, ignored, float(label_smoothing),
                     float(lse_square_scale_for_zloss), bool(return_zloss))
