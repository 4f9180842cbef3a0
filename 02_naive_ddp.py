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
Writes results/02_naive_ddp.{json,md}.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import common


class NaiveDDP(nn.Module):
    """Data parallelism the plain way: one blocking all-reduce per parameter after backward.

        model = NaiveDDP(MyModel().to(device))      # broadcasts rank 0's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()
        model.finish_gradient_synchronization()     # averages every gradient across ranks
        opt.step()

    A parameter that got no gradient on some rank counts as zeros there; a parameter that
    got none on any rank keeps ``.grad is None``, just as in single-process training. For
    gradient accumulation, run several backwards and call finish once (``no_sync`` is
    provided for the same code shape as the other wrappers).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)
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
        dist.all_reduce(has_grad)
        for p, n in zip(self._params, has_grad.tolist()):
            if n == 0:
                continue  # no rank has a gradient: leave it None, as single-process would
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.world_size)
            dist.all_reduce(p.grad)


# ----------------------------------------------------------------------------------------
def verify(ctx, args):
    return common.verify_cases(ctx, NaiveDDP, args, getattr(args, "cases", None))


def benchmark(ctx, args):
    return [common.bench_method(ctx, args, "naive (per-parameter)", NaiveDDP)]


def main(argv=None):
    p = common.script_parser(__doc__)
    args = common.resolve_args(p.parse_args(argv))
    common.run_script(args, "02_naive_ddp", "Naive DDP: one all-reduce per parameter after backward", verify, benchmark)


if __name__ == "__main__":
    common.run_main(main)
