"""MindSpeed-LLM's training loop contract: ``train`` calls this module's own ``training_log`` (by
its global name), which accumulates ``loss_dict`` over the log interval, writes it to TensorBoard,
calls ``track_moe_metrics`` (bound by name at import) and prints the log line."""

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator as nmc
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import track_moe_metrics

from mindspeed_llm.training.arguments import get_args

WRITER = None  # get_tensorboard_writer() in the real loop
LOG_LINES = []
ADVANCED = "advanced iterations"


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration,
                 loss_scale, report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
    args = get_args()
    total_loss_dict[ADVANCED] = total_loss_dict.get(ADVANCED, 0) + (0 if skipped_iter else 1)
    for key, value in loss_dict.items():
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, torch.zeros(1)) + value
        if WRITER is not None:
            WRITER.add_scalar(key, value, iteration)
    if args.num_experts:
        track_moe_metrics(loss_scale=1.0 / args.num_micro_batches, iteration=iteration, writer=WRITER,
                          wandb_writer=None, total_loss_dict=total_loss_dict, per_layer_logging=False,
                          force_initialize=True, track_names=["load_balancing_loss"],
                          num_layers=args.num_layers, moe_layer_freq=1)
    if iteration % args.log_interval == 0:
        line = f" iteration {iteration:8d} |"
        for key in [k for k in total_loss_dict if k != ADVANCED]:
            avg = float(total_loss_dict[key].sum()) / max(1, total_loss_dict[ADVANCED])
            if avg > 0.0:
                line += f" {key}: {avg:.6E} |"
            total_loss_dict[key] = torch.zeros(1)
        total_loss_dict[ADVANCED] = 0
        print(line, flush=True)
        LOG_LINES.append(line)
    return report_memory_flag


def train(model, iterations):
    """``iterations``: a list, per iteration, of micro-batches ``(tokens, labels, loss_mask,
    position_ids, attention_mask)``. pretrain_gpt's loss_func: sum(loss * mask) and the token count;
    each micro-batch's backward as Megatron's schedule runs it for MindSpeed-LLM's train_step: that
    sum over the token count and the number of micro-batches (Megatron's micro-batch calculator, set
    up here as its initialize does), scaled by ``config.grad_scale_func`` where the model has one."""
    dp = parallel_state.get_data_parallel_world_size()
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, len(iterations[0]) * dp, 1, dp)
    grad_scale = model.config.grad_scale_func
    total_loss_dict = {}
    for iteration, micro_batches in enumerate(iterations, start=1):
        reported = torch.zeros(2)
        for tokens, labels, loss_mask, position_ids, attention_mask in micro_batches:
            losses = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
            mask = loss_mask.view(-1).float()
            loss = torch.sum(losses.float().view(-1) * mask)
            output = loss / mask.sum() / nmc.get_num_microbatches()
            (grad_scale(output) if grad_scale is not None else output).backward()
            reported += torch.stack([loss.detach(), mask.sum()])
        dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        loss_dict = {"lm loss": reported[0] / reported[1]}
        training_log(loss_dict, total_loss_dict, 1e-4, None, iteration, 1.0, False, 0, None, None, None)
