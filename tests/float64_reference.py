"""The tests' oracle: cross entropy + z-loss on the full (unsharded) vocab in float64.

Written independently of the package: plain log-softmax, no online softmax, no sharding.
"""

import torch


def cross_entropy_zloss_float64(logits, target, z_loss_coeff=0.0, label_smoothing=0.0, ignore_index=-100):
    """Per-token (loss, z_loss, lse) in float64; logits [..., V] over the GLOBAL vocab."""
    x = logits.double()
    lse = torch.logsumexp(x, dim=-1)
    log_probs = x - lse.unsqueeze(-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(dim=-1)
    z_loss = z_loss_coeff * lse * lse
    loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth + z_loss
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, loss, zero), torch.where(valid, z_loss, zero), lse


def loss_and_grad_float64(logits, target, upstream, **kwargs):
    """(loss, z_loss, d(sum(upstream*loss))/d(logits)) in float64."""
    x = logits.detach().double().requires_grad_(True)
    loss, z_loss, _ = cross_entropy_zloss_float64(x, target, **kwargs)
    (grad,) = torch.autograd.grad(loss, x, upstream.double())
    return loss.detach(), z_loss.detach(), grad


def relative_error(actual, expected):
    expected = expected.double()
    diff = (actual.double() - expected).norm()
    return (diff / expected.norm().clamp_min(1e-30)).item()
