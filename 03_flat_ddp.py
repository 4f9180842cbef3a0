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
Writes results/03_flat_ddp.{json,md}.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import common


class FlatDDP(nn.Module):
    """Data parallelism with one all-reduce of all gradients (one per dtype and device).

        model = FlatDDP(MyModel().to(device))       # broadcasts rank 0's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()
        model.finish_gradient_synchronization()     # flatten, one all-reduce, copy back
        opt.step()

    A parameter without a gradient on this rank contributes zeros, so every rank sends the
    same sizes; a flag per parameter rides in the same buffer, and a parameter that no rank
    gave a gradient keeps ``.grad is None``, as in single-process training.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)
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
            dist.all_reduce(flat)
            *grads, has_grad = _unflatten_dense_tensors(flat, parts)
            for p, g, used in zip(params, grads, has_grad.tolist()):
                if used == 0:
                    continue  # no rank has a gradient: leave it None
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


# ----------------------------------------------------------------------------------------
def verify(ctx, args):
    return common.verify_cases(ctx, FlatDDP, args, getattr(args, "cases", None))


def benchmark(ctx, args):
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")
    return [common.bench_method(ctx, args, "naive (per-parameter)", naive.NaiveDDP),
            common.bench_method(ctx, args, "flat (one all-reduce)", FlatDDP)]


def main(argv=None):
    p = common.script_parser(__doc__)
    args = common.resolve_args(p.parse_args(argv))
    common.run_script(args, "03_flat_ddp", "Naive (per-parameter) against flat (one all-reduce) DDP",
                      verify, benchmark)


if __name__ == "__main__":
    common.run_main(main)
