"""The fused output projection + CE + z-loss on a GPU at a real size, both of its paths (logits
recomputed in backward; gradients made in forward with the loss mask as token weights), against
float64 and no worse than the unfused bf16 path (cuBLAS logits, then the op). Skipped without CUDA."""

import pytest
import torch

from float64_reference import relative_error
from mindspeed_cez import linear_cross_entropy_zloss, vocab_parallel_cross_entropy_zloss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, H, V, Z = 4096, 2048, 32768, 1e-3


def _float64(hidden, weight, target, upstream, label_smoothing):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = h @ w.t()
    lse = torch.logsumexp(logits, -1)
    valid = target != -100
    t = torch.where(valid, target, 0)
    nll = lse - (1 - label_smoothing) * logits.gather(-1, t[:, None])[:, 0] - label_smoothing * logits.mean(-1)
    loss = torch.where(valid, nll + Z * lse**2, 0)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("forward_grads", [False, True], ids=["recompute", "grads-in-forward"])
def test_matches_float64_at_a_real_size(forward_grads, label_smoothing):
    g = torch.Generator(device="cuda").manual_seed(5)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 4 / H**0.5).bfloat16()
    target = torch.randint(0, V, (N,), device="cuda", generator=g)
    target[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    mask = (torch.rand(N, device="cuda", generator=g) < 0.9).float()
    upstream = mask / mask.sum()
    exp_loss, exp_dh, exp_dw = _float64(hidden, weight, target, upstream, label_smoothing)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = linear_cross_entropy_zloss(h, w, target, Z, label_smoothing,
                                         token_weights=mask if forward_grads else None)
    (loss * upstream).sum().backward()
    hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lu, _ = vocab_parallel_cross_entropy_zloss(hu @ wu.t(), target, Z, label_smoothing)
    (lu * upstream).sum().backward()

    # bf16 logits bound every path's error (the float64 reference takes exact products)
    for ours, unfused, exp in ((loss, lu, exp_loss), (h.grad, hu.grad, exp_dh), (w.grad, wu.grad, exp_dw)):
        assert relative_error(ours, exp) <= 1.5 * relative_error(unfused, exp) + 1e-4, (
            relative_error(ours, exp), relative_error(unfused, exp))
