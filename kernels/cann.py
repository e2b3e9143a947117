"""``backend="cann"``: the vendor's fused op, ``torch_npu.npu_cross_entropy_loss`` (CANN's
CrossEntropyLoss, Atlas A2 / A3), behind the package's conventions, at TP = 1.

Read from torch_npu's documentation (Ascend/op-plugin ``docs/context/torch_npu-npu_cross_entropy_loss.md``)
and CANN's ``aclnnCrossEntropyLoss`` page: ``npu_cross_entropy_loss(input [N, C],
target [N] int64, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
lse_square_scale_for_zloss=0.0, return_zloss=False) -> (loss, log_prob, zloss, lse_for_zloss)``;
every output in ``input``'s dtype; ``log_prob`` ``[N, C]`` (kept for its backward: a second
logits-sized tensor); a negative ``ignore_index`` ignores nothing; N at most 200000; with a
gradient, ``reduction="none"`` takes no label smoothing. CANN's page says the z-loss arguments
(``lse_square_scale_for_zloss`` / ``return_zloss``) have no effect, so they are never passed: a zero
z-loss with a gradient would train silently without it.

Here the op runs with ``reduction="none"`` and its own gradient; the package adds what it lacks
in plain torch ops on [N] vectors: ignored tokens (``ignore_index``: loss, z-loss and gradient 0),
label smoothing (``a * (x[t] - mean(x))``, whose gradient ``a * (onehot - 1/V)`` turns the op's
``softmax - onehot`` into the smoothed one), fp32 results, the lse (``CE + x[t]``) and the z-loss
``c * lse**2`` of it, both through autograd (the z-loss's gradient ``2c * lse * softmax``). Not
served (refused, naming the argument): vocab shards (TP > 1: the op needs each token's whole
vocab), a ``logit_transform`` (scale / soft cap), the fused output layer.
"""

import importlib

import torch

NAME = "cann"
MAX_ROWS = 200000  # the op's documented limit on N per call


def _op():
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(f"backend='cann' needs torch_npu (Ascend NPUs, CANN): {exc}; on other devices use "
                           "backend='triton' or 'torch' (or None: automatic)") from exc
    op = getattr(torch_npu, "npu_cross_entropy_loss", None)
    if op is None:
        raise RuntimeError("backend='cann': this torch_npu has no npu_cross_entropy_loss (Atlas A2 / A3 releases "
                           "have it); use backend='triton' or 'torch'")
    return op


def available() -> bool:
    """torch_npu imports and has the op (says nothing about the device's support of its z-loss)."""
    try:
        _op()
    except RuntimeError:
        return False
    return True


def check_applies(tp_size, transform):
    """Refuse what the vendor op cannot compute, naming the argument and the fix."""
    if tp_size > 1:
        raise ValueError(
            f"backend='cann': torch_npu.npu_cross_entropy_loss needs each token's whole vocab on one rank, but the "
            f"tensor-parallel group has {tp_size} ranks holding vocab shards; use backend='triton' (or None) at "
            "tensor-parallel size > 1")
    if not transform.is_identity:
        raise ValueError(
            f"backend='cann' computes the loss of the logits as given: logit_transform=LogitTransform("
            f"scale={transform.scale!r}, cap={transform.cap!r}) needs backend='triton' or 'torch' (or scale / cap the "
            "logits first)")


def _rows_loss(rows, target, valid, z_loss_coeff, label_smoothing):
    """(loss, z_loss, lse) fp32 [n] of one call of the op on ``rows`` [n, V] (n <= MAX_ROWS)."""
    safe = torch.where(valid, target, torch.zeros_like(target)).long()  # the op ignores nothing here
    ce, _log_prob, _zloss, _lse = _op()(rows, safe, reduction="none")
    target_logit = rows.gather(1, safe.unsqueeze(1)).squeeze(1).float()
    ce = ce.float()
    loss = ce
    if label_smoothing:  # (1-a)*CE + a*(lse - mean x) = CE + a*(x[t] - mean x)
        loss = loss + label_smoothing * (target_logit - rows.mean(1, dtype=torch.float32))
    # lse = CE + x[t], through autograd: d lse/dx = (softmax - onehot) + onehot = softmax, so the
    # z-loss's gradient 2c*lse*softmax comes from the op's own backward.
    lse = ce + target_logit
    zero = torch.zeros((), dtype=torch.float32, device=rows.device)
    if z_loss_coeff:
        z_loss = z_loss_coeff * lse * lse
        loss = loss + z_loss
        z_loss = z_loss.detach()
    else:
        z_loss = torch.zeros_like(ce, requires_grad=False)
    return torch.where(valid, loss, zero), torch.where(valid, z_loss, zero), lse.detach()


def cross_entropy_zloss(logits, target, spec):
    """``(loss, z_loss, lse)`` (fp32, shape of ``target``) through the vendor op, of the loss ``spec``
    (a ``LossSpec``) :func:`mindspeed_cez.vocab_parallel_cross_entropy_zloss` checked
    (:func:`check_applies` included)."""
    rows = logits.reshape(-1, logits.shape[-1])
    flat = target.reshape(-1)
    valid = flat != spec.ignore_index
    if rows.device.type not in ("cpu", "cuda"):  # the op leaves an out-of-range id undefined: assert, no host sync
        in_range = (flat >= 0) & (flat < rows.shape[1])
        torch._assert_async((in_range | ~valid).all(), "target outside [0, vocab) and not ignore_index")
    parts = [_rows_loss(rows[s:s + MAX_ROWS], flat[s:s + MAX_ROWS], valid[s:s + MAX_ROWS], spec.z_loss_coeff,
                        spec.label_smoothing) for s in range(0, rows.shape[0], MAX_ROWS)]
    if not parts:
        empty = torch.zeros(target.shape, dtype=torch.float32, device=logits.device)
        return empty + 0.0 * logits.sum(), empty, empty
    loss, z_loss, lse = (torch.cat(p) if len(parts) > 1 else p[0] for p in zip(*parts))
    return loss.view(target.shape), z_loss.view(target.shape), lse.view(target.shape)
