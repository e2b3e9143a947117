"""Megatron's local core attention on ``torch.nn.functional.scaled_dot_product_attention``.

For the end-to-end benchmark only. Without Transformer Engine, Megatron's local layer spec runs
``DotProductAttention``, which materializes ``[b, heads, s, s]`` scores: at sequence 8192 its
softmax and elementwise kernels take most of the step and memory grows with s^2, which no real
pretraining run (TE or flash-attn) looks like. ``use_sdpa()`` gives the same class a forward on
torch's SDPA (FlashAttention-2 kernels on Hopper for bf16, causal, no mask tensor): the
attention a user's run has, so the step and the longest sequence reflect the rest of the model.
Causal self-attention without dropout, bias, packed sequences or softmax variants only; anything
else raises.
"""

import torch
import torch.nn.functional as F


def _forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
             packed_seq_params=None):
    from megatron.core.transformer.enums import AttnMaskType

    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    if mask_type != AttnMaskType.causal or attention_bias is not None or packed_seq_params is not None:
        raise NotImplementedError(f"sdpa_attention: causal self-attention only, got {mask_type}")
    if self.attention_dropout.p or getattr(self.config, "softmax_type", "vanilla") != "vanilla":
        raise NotImplementedError("sdpa_attention: no attention dropout, vanilla softmax only")
    # [s, b, heads, d] -> [b, heads, s, d]; key / value carry the query groups (GQA)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                         enable_gqa=groups > 1)
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)


def use_sdpa():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    DotProductAttention.forward = _forward
    print("CEZ_BENCH attention: torch scaled_dot_product_attention (causal)", flush=True)


def self_check(device="cuda"):
    """The SDPA forward against Megatron's unfused math on a small causal case (float32)."""
    torch.manual_seed(0)
    s, b, h, d = 64, 2, 4, 32
    q, k, v = (torch.randn(s, b, h, d, device=device) for _ in range(3))
    scale = d ** -0.5
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=device).triu(1), float("-inf"))
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * d)

    class _Attention:
        attn_mask_type = None
        attention_dropout = torch.nn.Dropout(0.0)
        softmax_scale = scale
        hidden_size_per_partition = h * d

    from megatron.core.transformer.enums import AttnMaskType

    _Attention.attn_mask_type = AttnMaskType.causal
    _Attention.config = type("C", (), {"softmax_type": "vanilla"})()
    torch.testing.assert_close(_forward(_Attention(), q, k, v, None), expected, rtol=1e-4, atol=1e-4)
