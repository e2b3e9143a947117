"""Run megatron-core models on the CPU over gloo (CI, laptops). Never imported by the adaptor.

megatron-core hard-codes CUDA in a few places that a CPU forward/backward reaches. :func:`apply`
steers them to the CPU; it is a no-op on a machine with a GPU (``force=True`` overrides):

* ``torch.cuda.current_device()`` -> ``"cpu"`` (tensors Megatron creates "on the current device");
* the model-parallel CUDA RNG tracker's ``fork()`` -> a no-op context (dropout then uses the CPU
  generator; the tests and example use dropout 0);
* ``moe_utils.te_general_gemm = None`` when Transformer Engine is absent (0.16.1 reads the
  undefined name otherwise).

Also here, because every CPU user of megatron-core needs them:

* :class:`CPULayerNorm` -- a torch LayerNorm that accepts Megatron's norm constructor and supports
  sequence parallelism (the local spec's ``WrappedTorchNorm`` refuses ``sequence_parallel``,
  which MoE with tensor parallelism requires); :func:`tiny_gpt_layer_spec` puts it in the local
  spec; :func:`allreduce_sequence_parallel_grads` does what Megatron's ``finalize_model_grads``
  does for its weights when no Megatron DDP wrapper is used;
* :func:`causal_attention_mask` -- the explicit causal mask the local attention needs.
"""

import contextlib

import torch
import torch.distributed as dist

_APPLIED = False


def apply(force=False):
    """Steer megatron-core's CUDA-only spots to the CPU (only without a GPU). Idempotent."""
    global _APPLIED
    if _APPLIED or (torch.cuda.is_available() and not force):
        return _APPLIED
    torch.cuda.current_device = lambda: "cpu"

    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def _fork(self, name=None):
        yield

    mp_random.CudaRNGStatesTracker.fork = _fork
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True
    return True


class CPULayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm signature; marks weights for SP grad reduction."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.config = config
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


def tiny_gpt_layer_spec(num_experts=None):
    """megatron-core's local GPT layer spec (MoE when ``num_experts``) with :class:`CPULayerNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = CPULayerNorm
    layer.submodules.pre_mlp_layernorm = CPULayerNorm
    return layer, TransformerBlockSubmodules


def build_tiny_gpt(config, vocab_size, seq_length, num_experts=None, layer_norm=CPULayerNorm, share_embeddings=False):
    """A GPTModel from the local spec; the final norm is ``layer_norm`` too."""
    from megatron.core.models.gpt import GPTModel

    layer, block_submodules = tiny_gpt_layer_spec(num_experts)
    spec = block_submodules(layer_specs=[layer] * config.num_layers, layer_norm=layer_norm)
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
    """Sum the grads of ``sequence_parallel`` parameters over the TP group (like finalize_model_grads)."""
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
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

