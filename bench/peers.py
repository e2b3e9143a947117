"""The implementations the benchmark sets beside this package's op, each as
``(name, callable(logits, target) -> (loss, z_loss) or None, note)``."""

import inspect

import torch
import torch.nn.functional as F

from harness import BACKEND
from report import short, version


def _z_loss_separate(logits, coeff):
    """The usual add-on z-loss: c * logsumexp(logits)^2 in fp32, its own autograd graph."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return coeff * lse * lse


def build_impls(tp_group, device, coeff):
    """[(name, callable(logits, target) -> (loss, z_loss) or None, note)]."""
    impls = []

    # 1. this package
    try:
        import mindspeed_cez
        from mindspeed_cez import kernels as cez_kernels

        backend = cez_kernels.backend_for(device, BACKEND).__name__.rsplit(".", 1)[-1]

        def ours(x, t):
            return mindspeed_cez.vocab_parallel_cross_entropy_zloss(x, t, z_loss_coeff=coeff, tp_group=tp_group,
                                                                    backend=BACKEND)

        impls.append(("mindspeed_cez", ours, f"backend {backend}"))
    except Exception as exc:  # noqa: BLE001
        impls.append(("mindspeed_cez", None, short(exc)))

    # 2. Megatron-Core native vocab-parallel CE + separate z-loss
    try:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        kwargs = {}
        if "tp_group" in inspect.signature(vocab_parallel_cross_entropy).parameters:
            kwargs["tp_group"] = tp_group

        def mcore_native(x, t):
            z = _z_loss_separate(x, coeff)
            ce = vocab_parallel_cross_entropy(x, t, **kwargs)
            return ce + z, z.detach()

        impls.append(("megatron native CE + z", mcore_native, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("megatron native CE + z", None, short(exc)))

    # 3. Megatron-Core fused CE + separate z-loss
    try:
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        def mcore_fused(x, t):
            z = _z_loss_separate(x, coeff)
            ce = fused_vocab_parallel_cross_entropy(x, t, tp_group)
            return ce + z, z.detach()

        impls.append(("megatron fused CE + z", mcore_fused, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("megatron fused CE + z", None, short(exc)))

    # 4. Liger-Kernel CE with built-in z-loss (lse_square_scale)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        params = inspect.signature(liger_cross_entropy).parameters
        missing = [p for p in ("lse_square_scale", "return_z_loss", "reduction") if p not in params]
        if missing:
            raise ImportError(f"liger_cross_entropy has no {missing}")

        def liger(x, t):
            out = liger_cross_entropy(x, t, reduction="none", lse_square_scale=coeff, return_z_loss=True)
            if hasattr(out, "loss"):
                return out.loss, out.z_loss
            return out[0], out[1]

        impls.append(("liger-kernel CE(z)", liger, f"v{version('liger-kernel')}, loss in logits dtype"))
    except Exception as exc:  # noqa: BLE001
        impls.append(("liger-kernel CE(z)", None, short(exc)))

    # 5. torch.compile of CE + z-loss
    try:
        import torch._dynamo as dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)

        def ce_z(x, t):
            xf = x.float()
            lse = torch.logsumexp(xf, dim=-1)
            z = coeff * lse * lse
            ce = F.cross_entropy(xf, t, reduction="none")
            return ce + z, z.detach()

        compiled = torch.compile(ce_z, dynamic=False)
        impls.append(("torch.compile CE + z", compiled, ""))
    except Exception as exc:  # noqa: BLE001
        impls.append(("torch.compile CE + z", None, short(exc)))
    return impls
