"""Stand-in of MindSpeed-LLM's ``pretrain_gpt.py``, which sits beside its ``mindspeed_llm`` package and
starts with MindSpeed-LLM's adaptor: here its own loop trains one iteration of a tiny MoE GPT
(``torchrun --nproc-per-node 2``, gloo). Launched unchanged through ``python -m mindspeed_cez.launch``
by tests/environments/mindspeed_stack/test_mindspeed_llm_stand_in.py."""

from mindspeed_llm import megatron_adaptor  # noqa: F401  (MindSpeed-LLM's first line)

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the support package
from support import tiny_gpt as gpt  # noqa: E402  (the tiny model and its micro-batches)


def main():
    from megatron.core import parallel_state as ps
    from mindspeed_llm.training import arguments, training

    dist.init_process_group("gloo")
    args = arguments.parse_args(sys.argv[1:])
    model = gpt.build(args.tensor_model_parallel_size)
    model.train()
    position_ids = torch.arange(gpt.SEQ).unsqueeze(0).expand(gpt.BATCH, gpt.SEQ)
    mask = gpt.local_gpt.causal_attention_mask(gpt.SEQ)
    batches = gpt.micro_batches(ps.get_data_parallel_rank())
    training.train(model, [[(t, lab, m, position_ids, mask) for t, lab, m in batches]])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
