"""Flat DDP: after backward, concatenate every gradient into one buffer and make a single
all-reduce, instead of one call per parameter.

Each all-reduce pays a fixed cost (launch, synchronization between ranks) on top of the
bytes it moves; one call for the whole model pays it once.

Run:
    python 03_flat_ddp.py                          # verify, then naive vs flat on the LM
    python 03_flat_ddp.py --world-size 4 --model-size micro --steps 20
    torchrun --standalone --nproc-per-node 2 03_flat_ddp.py

Prints PASS/FAIL per verification case, then a table of naive (per-parameter) and flat DDP
measured in the same run: step time, communication time and share, collectives per step.
Writes <out>/03_flat_ddp.{json,md}.
"""

import common

# ---- begin copy: FlatDDP (needs only torch and the standard library) ----
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class FlatDDP(nn.Module):
    """Data parallelism with one all-reduce of all gradients (one per dtype and device).

        model = FlatDDP(MyModel().to(device))       # broadcasts the group's first rank's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()
        model.finish_gradient_synchronization()     # flatten, one all-reduce, copy back
        opt.step()

    ``process_group`` (default: every rank) is the data-parallel group. A parameter
    without a gradient on this rank contributes zeros, so every rank sends the same sizes; a flag per parameter rides in the same buffer, and a parameter that no rank
    gave a gradient keeps ``.grad is None``, as in single-process training.
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
        groups = {}
        for p in module.parameters():  # a tied parameter appears once; frozen ones not at all
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device), []).append(p)
        self._groups = list(groups.values())

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Communication happens only in finish_gradient_synchronization(): nothing to skip."""
        yield

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        for params in self._groups:
            has_grad = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype,
                                    device=params[0].device)
            parts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params] + [has_grad]
            flat = _flatten_dense_tensors(parts)
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.process_group)
            *grads, has_grad = _unflatten_dense_tensors(flat, parts)
            for p, g, used in zip(params, grads, has_grad.tolist()):
                if used == 0:
                    continue  # no rank has a gradient: leave it None
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
# ---- end copy: FlatDDP ----


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
    """Each case of common.VERIFY_CASES (or those named): FlatDDP on this rank's part of
    every global batch, against one process trained on the whole batches. ``group``: the
    data-parallel group (default: every rank)."""
    results = {}
    for name in cases or common.VERIFY_CASES:
        run = common.VerifyRun(ctx, args, common.VERIFY_CASES[name], group)
        model = FlatDDP(run.model, process_group=group)
        optimizer = run.optimizer(model.parameters())
        for step in range(run.steps):
            train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
        results[name] = run.compare(model.module)
    return results


def benchmark(ctx, args):
    """Naive (02) and flat DDP on the LM, steps alternating: one row each."""
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")

    def method(wrap):
        def make():
            model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return lambda batch, clock: train_step(model, optimizer, batch, clock)
        return make
    return common.time_methods(ctx, args, {"naive (per-parameter)": method(naive.NaiveDDP),
                                           "flat (one all-reduce)": method(FlatDDP)})


NAME, TITLE = "03_flat_ddp", "Naive (per-parameter) against flat (one all-reduce) DDP"


def main(argv=None):
    args = common.parse(common.script_parser(__doc__), argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
    if not args.no_bench:
        common.report_table(args, NAME, TITLE, common.launch(benchmark, args))


if __name__ == "__main__":
    common.run_main(main)
