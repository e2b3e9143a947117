"""Tiny MoE GPT pretraining with megatron-core, z-loss turned on by the flag ``--lm-z-loss-coeff``.

    python -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2          # 2 runs x 60 it
    python -m mindspeed_cez.launch examples/train_tiny_moe.py --lm-z-loss-coeff 1e-2 --quick  # CI: 6 it each

Launched as a Megatron entry script is (``python -m mindspeed_cez.launch``: the adaptor's import checks
the ``--lm-*`` flags and ``MINDSPEED_CEZ_*`` variables first); the flags are then read and validated
by the same functions as on Megatron-LM's route (:func:`mindspeed_cez.patches.arguments.parse_command_line`,
:func:`~mindspeed_cez.patches.arguments.validate`) and their Settings activated in each rank.

Two gloo (CPU) or NCCL (GPU) processes, tensor parallel 2 with sequence parallelism, a 2-layer
GPT with 4 experts (top-2) on synthetic data (a fixed random bigram language, so the loss can
fall). The script trains the same model from the same seed twice: first the fused kernel without
z-loss (the flags' Settings with coefficient 0, for comparison), then with the flags' Settings.
Each rank 0 prints Megatron-style log lines with ``lm loss`` (the CE), ``load_balancing_loss`` and
``lm_z_loss`` (Megatron's MoE report and the adaptor's metrics, :mod:`mindspeed_cez.patches.reporting`);
the script writes ``out/tiny_moe_zloss.png``: lm loss, lm_z_loss and mean lse per iteration for
each run (``lm_lse`` is always logged here, as ``--lm-z-loss-log-lse`` would).

Why 1e-2: the usual 1e-4 (PaLM) barely moves the log-sum-exp in a few dozen steps of a tiny
model; 1e-2 makes the z-loss pull the log-sum-exp towards 0 visibly within the run while the
lm loss stays close to the run without z-loss.

On a machine with GPUs the same script uses them (NCCL, the Triton kernels; the CPU mode stays off).
"""

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VOCAB, SEQ, MICRO_BATCH, LAYERS, EXPERTS = 512, 32, 4, 2, 4
LR = 3e-3


def quiet_megatron_warnings():
    """Megatron's known warnings on a machine without Apex / Transformer Engine (this example only)."""
    for message in (r".*(Apex|Transformer Engine).*not installed", r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated", category=FutureWarning)


def build(tp, use_cpu):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from mindspeed_cez.patches import cpu_mode, local_gpt

    if use_cpu:
        cpu_mode.apply()
    # expert TP = TP: the 0.12 line's local experts fail with sequence parallelism otherwise
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp)
    torch.manual_seed(1234)
    if not use_cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp, sequence_parallel=tp > 1,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = local_gpt.build_tiny_gpt(config, VOCAB, SEQ, num_experts=EXPERTS)
    if not use_cpu:
        model = model.cuda()
    return model


def synthetic_batches(seed, device):
    """A random bigram language: token t+1 ~ a fixed sparse distribution given token t."""
    import torch

    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)  # 4 likely successors per token
    data_g = torch.Generator().manual_seed(seed + 1)
    while True:
        seq = torch.empty(MICRO_BATCH, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (MICRO_BATCH,), generator=data_g)
        for t in range(SEQ):
            pick = torch.randint(0, 4, (MICRO_BATCH,), generator=data_g)
            seq[:, t + 1] = successors[seq[:, t], pick]
        tokens, labels = seq[:, :-1].to(device), seq[:, 1:].to(device)
        loss_mask = torch.ones(MICRO_BATCH, SEQ, device=device)
        yield tokens, labels, loss_mask


def log_line(it, iters, ms, losses):
    """Megatron's ``training_log`` line format, with only the fields this loop computes (no loss scale,
    skipped or nan counts: this is not Megatron's ``pretrain``)."""
    return (f" iteration {it:8d}/{iters:8d} | consumed samples: {it * MICRO_BATCH:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | learning rate: {LR:.6E} | global batch size: {MICRO_BATCH:5d} |"
            + "".join(f" {name}: {value:.6E} |" for name, value in losses.items()))


def train_one(rank, world_size, settings, iters, out_json):
    import torch
    import torch.distributed as dist

    import mindspeed_cez.patches as patches
    from mindspeed_cez.patches import local_gpt
    from mindspeed_cez.patches import reporting as metrics

    use_cpu = not torch.cuda.is_available()
    device = torch.device("cpu") if use_cpu else torch.device("cuda", torch.cuda.current_device())
    model = build(world_size, use_cpu)
    patches.activate(settings)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    mask = local_gpt.causal_attention_mask(SEQ, device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, SEQ)
    batches = synthetic_batches(0, device)  # same data on both TP ranks
    history = []
    for it in range(1, iters + 1):
        start = time.time()
        tokens, labels, loss_mask = next(batches)
        opt.zero_grad(set_to_none=True)
        per_token = model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        loss.backward()
        local_gpt.allreduce_sequence_parallel_grads(model)
        opt.step()
        scalars = metrics.report(it, 1, LAYERS, track_names=["load_balancing_loss"])
        # the per-token loss has the value of CE (Megatron's "lm loss"); its gradient has the z-loss
        lm_loss = float(loss.detach())
        row = {"iteration": it, "lm loss": lm_loss, **scalars}
        history.append(row)
        if rank == 0:
            print(log_line(it, iters, 1000 * (time.time() - start), {"lm loss": lm_loss, **scalars}), flush=True)
    patches.remove()
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump(history, f)
    dist.barrier()


def read_flags(parser, argv):
    """The demo's own options and the ``--lm-*`` flags' Namespace, read and validated as on Megatron-LM's
    route (:mod:`mindspeed_cez.patches.arguments`); a bad value or a missing flag: one line, exit 2."""
    from mindspeed_cez.patches import arguments

    own, rest = parser.parse_known_args(argv)
    leftover = arguments.add_lm_z_loss_args(argparse.ArgumentParser(add_help=False)).parse_known_args(rest)[1]
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    if "mindspeed_cez.megatron_adaptor" not in sys.modules:
        parser.error("launch it as a Megatron script: python -m mindspeed_cez.launch examples/train_tiny_moe.py "
                     "--lm-z-loss-coeff 1e-2")
    flags = arguments.parse_command_line(rest)
    settings = arguments.validate(flags)
    if settings is None or settings.z_loss_coeff == 0:
        parser.error(f"{arguments.FLAG_COEFF} C > 0 is what this demo shows: add {arguments.FLAG_COEFF} 1e-2")
    return own, flags


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # as Megatron's
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="6 iterations per run (CI)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "out"))
    args, flags = read_flags(parser, sys.argv[1:] if argv is None else argv)
    iters = 6 if args.quick else args.iters

    import torch

    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's setting for sequence parallelism
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    runs = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as rendezvous:
        for baseline in (True, False):
            coeff = 0.0 if baseline else flags.lm_z_loss_coeff
            what = "without z-loss (for comparison)" if baseline else f"--lm-z-loss-coeff {coeff:g}"
            print(f"== run: {what}, TP={args.tp}, backend={backend}, {iters} iterations", flush=True)
            path = os.path.join(args.out, f"tiny_moe_c{coeff:g}.json")
            init = "file://" + os.path.join(rendezvous, f"c{coeff:g}")  # the ranks meet through a fresh file
            torch.multiprocessing.spawn(_entry, args=(args.tp, init, backend, flags, baseline, iters, path),
                                        nprocs=args.tp)
            with open(path) as f:
                runs[coeff] = json.load(f)
    print(f"wall time: {time.time() - t0:.1f} s")
    from plot_losses import plot_runs

    png = plot_runs(runs, os.path.join(args.out, "tiny_moe_zloss.png"))
    print(f"plot: {png}")
    for coeff, hist in runs.items():
        last = hist[-1]
        print(f"c={coeff:g}: final lm loss {last['lm loss']:.4f}, lm_z_loss {last.get('lm_z_loss', 0.0):.3e}, mean lse {last['lm_lse']:.3f}")
    return runs


def rank_settings(flags, baseline):
    """This rank's Settings: the flags' (validated again in this process, as each Megatron rank does),
    with the mean lse logged for the plot; ``baseline``: the same with coefficient 0."""
    from mindspeed_cez.patches import arguments

    settings = arguments.validate(flags).replace(log_lse=True)
    return settings.replace(z_loss_coeff=0.0) if baseline else settings


def _entry(rank, world_size, init_method, backend, flags, baseline, iters, out_json):
    """One rank (a process of torch.multiprocessing.spawn): join the group, train, leave."""
    quiet_megatron_warnings()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        train_one(rank, world_size, rank_settings(flags, baseline), iters, out_json)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
