"""The op's forward + backward a few times at one shape, for Nsight Compute (where time goes).

    ncu --kernel-name regex:'_forward_kernel|_grad_kernel' --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 bench/ncu_op.py 16384 16160
"""

import sys

import torch

from mindspeed_cez import vocab_parallel_cross_entropy_zloss


def main():
    n, v = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randn(n, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4):
        logits = base.clone().requires_grad_()
        loss, _ = vocab_parallel_cross_entropy_zloss(logits * 1, target, z_loss_coeff=1e-4)  # non-leaf: in place
        loss.sum().backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
