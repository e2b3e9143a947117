"""``examples/pretrain_gpt.py`` with the adaptor (as ``-m mindspeed_cez.launch`` runs it) for the
end-to-end benchmark: one variant per launch.

Two additions, for measuring only:

* ``CEZ_BENCH_HAND_Z=C``: "z-loss by hand", what a Megatron user writes without this package: the
  LM loss of ``LanguageModule.compute_language_model_loss`` plus ``C * logsumexp(logits.float())**2``
  in torch (one rank holds the whole vocab: TP=1 only);
* ``CEZ_BENCH_ATTENTION=sdpa``: Megatron's local core attention on torch's SDPA
  (``bench/sdpa_attention.py``: flash kernels, as a Transformer Engine run would have);
* ``CEZ_BENCH_LOGITS=scale=S`` / ``softcap=C`` (``CEZ_BENCH_LOGITS_IN=torch|kernel``): MindSpeed-LLM's
  ``--output-multiplier-scale`` / ``--output-logit-softcapping`` (Grok-1, Gemma-2), which Megatron's
  GPTModel lacks: the same torch ops on the main head's logits as MindSpeed-LLM's GPTModel
  (``logits * s``; ``logits / C``, ``tanh``, ``* C``), before the unfused op (``torch``) or recorded
  by the adaptor for its kernels (``kernel``, as it serves MindSpeed-LLM);
* at exit, one line ``CEZ_BENCH peak_allocated_bytes=N`` (``torch.cuda.max_memory_allocated``).
"""

import atexit
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRY = os.path.join(os.path.dirname(HERE), "examples", "pretrain_gpt.py")


def _z_loss_by_hand(coeff):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    megatron_loss = LanguageModule.compute_language_model_loss

    def compute_language_model_loss(self, labels, logits):
        # logits [s, b, v] (TP=1), in fp32 (a copy: Megatron's CE then works on them in place)
        fp32 = logits.float() if logits.dtype != torch.float32 else logits.clone()
        z = coeff * torch.logsumexp(fp32, dim=-1).square()
        return megatron_loss(self, labels, logits) + z.transpose(0, 1)

    LanguageModule.compute_language_model_loss = compute_language_model_loss


def _mindspeed_llm_logits(spec, in_kernel):
    """The main head's output layer followed by MindSpeed-LLM's torch ops (``spec``: ``scale=S`` or
    ``softcap=C``); ``in_kernel``: the adaptor is told, as by MindSpeed-LLM's flags."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from mindspeed_cez.patches import mindspeed_llm

    kind, value = spec.split("=")
    value = float(value)
    init = GPTModel.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        layer = getattr(self, "output_layer", None)
        if layer is None:
            return

        def forward(*a, **k):  # the class's forward at call time: the adaptor's patch included
            logits, bias = type(layer).forward(layer, *a, **k)
            if kind == "scale":
                logits = logits * value
            else:
                logits = logits / value
                logits = torch.tanh(logits)
                logits = logits * value
            return logits, bias

        layer.forward = forward

    GPTModel.__init__ = __init__
    from mindspeed_cez.kernels.logit_transform import LogitTransform

    transform = LogitTransform(scale=value) if kind == "scale" else LogitTransform(cap=value)
    mindspeed_llm.logit_transform = lambda args: transform if in_kernel else None  # as MindSpeed-LLM's flags would set it


def _report_peak_memory():
    if torch.cuda.is_available():
        print(f"CEZ_BENCH peak_allocated_bytes={torch.cuda.max_memory_allocated()}", flush=True)


if __name__ == "__main__":
    if os.environ.get("CEZ_BENCH_HAND_Z"):
        _z_loss_by_hand(float(os.environ["CEZ_BENCH_HAND_Z"]))
    if os.environ.get("CEZ_BENCH_ATTENTION") == "sdpa":
        import sdpa_attention

        sdpa_attention.use_sdpa()
    if os.environ.get("CEZ_BENCH_LOGITS"):
        _mindspeed_llm_logits(os.environ["CEZ_BENCH_LOGITS"], os.environ.get("CEZ_BENCH_LOGITS_IN") == "kernel")
    atexit.register(_report_peak_memory)
    from mindspeed_cez import launch

    sys.exit(launch.main([ENTRY, *sys.argv[1:]]))
