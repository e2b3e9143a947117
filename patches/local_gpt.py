"""megatron-core's local GPT (no Transformer Engine, no Apex) with sequence parallelism: the demo's and tests' model.

The local spec's ``WrappedTorchNorm`` refuses ``sequence_parallel``, which MoE with tensor parallelism
requires: :class:`TorchLayerNorm` takes its place (:func:`layer_spec`, :func:`build_tiny_gpt`), and
:func:`allreduce_sequence_parallel_grads` does for its weights what Megatron's ``finalize_model_grads`` does
when no Megatron DDP wrapper is used. :func:`causal_attention_mask` is the explicit mask the local attention
needs. On the CPU, :func:`mindspeed_cez.patches.cpu_mode.apply` comes first. Importing this module imports
nothing of Megatron.
"""

import torch
import torch.distributed as dist

from mindspeed_cez.patches import megatron_state


class TorchLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm signature; marks its weights for the SP grad reduction."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.config = config
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


def layer_spec(num_experts=None):
    """(megatron-core's local GPT layer spec with :class:`TorchLayerNorm`, MoE when ``num_experts``; the block's
    submodules class)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = TorchLayerNorm
    layer.submodules.pre_mlp_layernorm = TorchLayerNorm
    return layer, TransformerBlockSubmodules


def build_tiny_gpt(config, vocab_size, seq_length, num_experts=None, share_embeddings=False):
    """A GPTModel (rotary positions) from :func:`layer_spec`; its final norm a :class:`TorchLayerNorm` too."""
    from megatron.core.models.gpt import GPTModel

    layer, block_submodules = layer_spec(num_experts)
    spec = block_submodules(layer_specs=[layer] * config.num_layers, layer_norm=TorchLayerNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=share_embeddings,
    )


def causal_attention_mask(seq_length, device="cpu"):
    """``[1, 1, s, s]`` bool mask, True = masked (Megatron's convention)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def allreduce_sequence_parallel_grads(model, tp_group=None):
    """Sum the grads of ``sequence_parallel`` parameters over the TP group (like ``finalize_model_grads``)."""
    if tp_group is None:
        tp_group = megatron_state.tensor_parallel_group()
        if tp_group is None:
            raise RuntimeError("allreduce_sequence_parallel_grads: Megatron's model-parallel groups are not set up: "
                               "pass tp_group")
    if dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
