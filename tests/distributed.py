"""Run a function on N real processes joined by a process group (no mocked collectives).

gloo on the CPU; NCCL on GPUs (rank r uses cuda:r).
"""

import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    ok = False
    try:
        fn(rank, world_size, *args)
        # Every rank done before any tears the group down: a rank that destroys its gloo group
        # while a peer still talks to it can abort ("terminate called without an active exception").
        dist.barrier()
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads were seen to abort a rank
    # (exit -6) after its work had passed (CI, 2026-11-23); the outcome is already decided above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def run_on_ranks(world_size, fn, *args, timeout=300, backend="gloo"):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; re-raise any rank's failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise AssertionError("\n".join(failures))
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world_size, f"rank exit codes {codes}"
