"""Naive data-parallel training: broadcast the weights once, then after every backward
all-reduce each parameter's gradient with its own call, and step.

This is the baseline the later scripts improve on: it makes one collective per parameter
and starts communicating only after backward has finished.

Run:
    python 02_naive_ddp.py                       # verify on random data, then benchmark the LM
    python 02_naive_ddp.py --world-size 4 --model-size micro
    python 02_naive_ddp.py --data mnist --data-root data --download --no-bench
    torchrun --nproc-per-node 2 02_naive_ddp.py  # same thing, started by torchrun

Prints PASS/FAIL for each verification case (weights against single-process training on
the same global batch), then a table of step time and gradient-communication time.
Writes <out>/02_naive_ddp.{json,md}.
"""

import common

# ---- begin copy: NaiveDDP (needs only torch and the standard library) ----
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class NaiveDDP(nn.Module):
    """Data parallelism the plain way: one blocking all-reduce per parameter after backward.

        model = NaiveDDP(MyModel().to(device))      # broadcasts the group's first rank's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()
        model.finish_gradient_synchronization()     # averages every gradient across ranks
        opt.step()

    ``process_group`` (default: every rank) is the data-parallel group. A parameter that
    got no gradient on some rank counts as zeros there; a parameter that got none on any
    rank keeps ``.grad is None``, just as in single-process training. For gradient
    accumulation, run several backwards and call finish once (``no_sync`` is provided for
    the same code shape as the other wrappers).
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        src = dist.get_global_rank(process_group or dist.group.WORLD, 0)   # the group's first rank
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=src, group=process_group)
        # parameters() yields a tied (shared) parameter once; frozen ones are never reduced
        self._params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Communication happens only in finish_gradient_synchronization(): nothing to skip."""
        yield

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        if not self._params:
            return
        # One small call tells every rank which parameters have a gradient somewhere, so all
        # ranks then make the same calls in the same order.
        has_grad = torch.tensor([float(p.grad is not None) for p in self._params],
                                device=self._params[0].device)
        dist.all_reduce(has_grad, group=self.process_group)
        for p, n in zip(self._params, has_grad.tolist()):
            if n == 0:
                continue  # no rank has a gradient: leave it None, as single-process would
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.world_size)
            dist.all_reduce(p.grad, group=self.process_group)
# ---- end copy: NaiveDDP ----


def train_step(model, optimizer, batch, clock, micro_batches=1, set_to_none=True, **forward_kwargs):
    """One training step on this rank's part of the global batch, timed by phase. With
    ``micro_batches`` > 1 the gradients accumulate, communicated once (at the last)."""
    x, y = batch
    optimizer.zero_grad(set_to_none=set_to_none)
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
            with clock.phase("forward"):
                loss = model(xm, ym, **forward_kwargs) / micro_batches
            with clock.phase("backward"):
                loss.backward()
    with clock.phase("comm"):
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


def verify(ctx, args, cases=None, group=None):
    """Each case of common.VERIFY_CASES (or those named): NaiveDDP on this rank's part of
    every global batch, against one process trained on the whole batches. ``group``: the
    data-parallel group (default: every rank)."""
    results = {}
    for name in cases or common.VERIFY_CASES:
        run = common.VerifyRun(ctx, args, common.VERIFY_CASES[name], group)
        model = NaiveDDP(run.model, process_group=group)
        optimizer = run.optimizer(model.parameters())
        for step in range(run.steps):
            train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
        results[name] = run.compare(model.module)
    return results


def benchmark(ctx, args):
    """Time NaiveDDP's training steps on the LM: one table row."""
    def make():
        model = NaiveDDP(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return lambda batch, clock: train_step(model, optimizer, batch, clock)
    return common.time_methods(ctx, args, {"naive (per-parameter)": make})


NAME, TITLE = "02_naive_ddp", "Naive DDP: one all-reduce per parameter after backward"


def main(argv=None):
    args = common.parse(common.script_parser(__doc__), argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
    if not args.no_bench:
        common.report_table(args, NAME, TITLE, common.launch(benchmark, args))


if __name__ == "__main__":
    common.run_main(main)
