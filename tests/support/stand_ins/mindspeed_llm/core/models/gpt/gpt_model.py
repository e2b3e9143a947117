"""MindSpeed-LLM's GPTModel contract: a subclass of Megatron's with a forward of its own that never
calls Megatron's forward. It receives ``labels`` and ``loss_mask``; an MTP head calls
``compute_language_model_loss`` with rolled labels first; the logits are scaled and soft-capped;
``--loss-compute-mode chunk`` at TP=1 and CP=1 computes the loss with ``F.cross_entropy`` per chunk,
bypassing ``compute_language_model_loss``; ``--is-instruction-dataset`` shifts the labels."""

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel

from mindspeed_llm.training.arguments import get_args


class GPTModel(MegatronGPTModel):
    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_params=None, packed_seq_params=None, extra_block_kwargs=None, loss_mask=None):
        args = get_args()
        hidden = self.embedding(input_ids=input_ids, position_ids=position_ids)
        seq = hidden.size(0) * (parallel_state.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1)
        hidden = self.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=self.rotary_pos_emb(seq))
        if args.mtp_num_layers:
            mtp_logits, _ = self.output_layer(hidden * 0.5)
            self.mtp_loss = self.compute_language_model_loss(torch.roll(labels, -1, dims=-1), mtp_logits)
        if args.loss_compute_mode == "chunk" and args.tensor_model_parallel_size == 1 and args.context_parallel_size == 1:
            return self._chunk_loss(hidden, labels, args.loss_chunk_size)
        logits, _ = self.output_layer(hidden)
        if args.output_multiplier_scale:
            logits = logits * args.output_multiplier_scale
        if args.output_logit_softcapping:
            logits = torch.tanh(logits / args.output_logit_softcapping) * args.output_logit_softcapping
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        if args.is_instruction_dataset:
            labels, logits = labels[:, 1:].contiguous(), logits[:-1].contiguous()
        return self.compute_language_model_loss(labels, logits)

    def _chunk_loss(self, hidden, labels, chunk):
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, t in zip(torch.split(hidden, chunk, dim=0), torch.split(labels.t(), chunk, dim=0)):
            logits = F.linear(h, self.output_layer.weight).float()
            total = total + F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")
        return total / (labels > -1).sum()
