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


def sleep_forever(ctx, args):
    with open(os.path.join(args.pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    import argparse
    pid_dir, what = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "fail_on_rank_1")
    common.run_main(lambda: common.launch(
        globals()[what], argparse.Namespace(pid_dir=pid_dir), world_size=2, backend="gloo", device="cpu", timeout=300))


def _wrapper(args):
    mod = common.load_script(os.path.join(common.ROOT, args.script + ".py"))
    cls = getattr(mod, args.cls)
    return (lambda m: cls(m, *args.cls_args))


def record_event_order(ctx, args):
    """One training step of the toy model, logging collective launches against backward.

    Returns the event log: 'all_reduce:<numel>' for each collective, 'input_grad' when
    backward computes the gradient of the input (the last thing it computes), and
    'backward_returned' after loss.backward() returns.
    """
    log = []
    real = dist.all_reduce

    def logged(t, *a, **k):
        log.append(f"all_reduce:{t.numel()}")
        return real(t, *a, **k)
    dist.all_reduce = logged
    try:
        torch.manual_seed(0)
        model = _wrapper(args)(common.ToyModel(unused=args.unused))
        x0 = torch.randn(8, 20)
        y = torch.randint(0, 10, (8,))
        for step in range(2):
            x = x0.clone().requires_grad_(True)
            log.append(f"step:{step}")
            use_extra = args.uneven and ctx.rank == 0
            loss = torch.nn.functional.cross_entropy(model(x, use_extra=use_extra), y)
            x.register_hook(lambda g: log.append("input_grad"))
            loss.backward()
            log.append("backward_returned")
            model.finish_gradient_synchronization()
            log.append("finished")
            for p in model.module.parameters():
                p.grad = None
    finally:
        dist.all_reduce = real
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, log)
    return everyone


def bench_job(ctx, args):
    """A benchmark job for run_script: one row per job, and a crash on job "boom"."""
    if args.job == "boom":
        raise RuntimeError("job failed on purpose")
    dist.barrier()
    return [{"method": f"job {args.job}", "step_ms": float(args.job)}]
