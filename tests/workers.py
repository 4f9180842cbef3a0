"""Module-level workers for tests (spawned processes find them again by file and name)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time

import torch
import torch.distributed as dist

import common


class NoCommDDP(torch.nn.Module):
    """A broken wrapper: broadcasts but never averages gradients. Verification must fail."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self):
        pass


def verify_broken(ctx, args):
    return common.verify_cases(ctx, NoCommDDP, args, ["plain"])


def fail_on_rank_1(ctx, args):
    """Rank 1 raises while rank 0 waits in a collective that can never complete."""
    with open(os.path.join(args.pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom from the test")
    dist.all_reduce(torch.ones(1))
    time.sleep(600)


if __name__ == "__main__":
    import argparse
    import sys
    pid_dir = sys.argv[1]
    common.run_main(lambda: common.launch(
        fail_on_rank_1, argparse.Namespace(pid_dir=pid_dir), world_size=2, backend="gloo", device="cpu", timeout=300))
