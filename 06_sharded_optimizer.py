"""Optimizer-state sharding: each rank keeps optimizer state (AdamW's two moments, say) for
about 1/world_size of the parameters, updates only those, and then sends every rank the
updated parameters from their owners.

AdamW's state is twice the size of the weights and, in plain data parallelism, copied on
every rank; sharding it is the first step of ZeRO. ShardedGradientOptimizer is the second:
each gradient bucket is reduce-scattered as soon as backward fills it, so a rank keeps only
its slice of the gradients too (07's FSDP is the third: the parameters as well).

Run:
    python 06_sharded_optimizer.py                 # verify, then memory and timing on the LM
    python 06_sharded_optimizer.py --world-size 4 --model-size micro
    torchrun --standalone --nproc-per-node 2 06_sharded_optimizer.py

Prints PASS/FAIL per verification case; then peak memory at three points (after model
init, before the optimizer step, after it) broken into parameters, gradients, optimizer
state and other, with and without sharding; then time per iteration for plain AdamW,
ShardedOptimizer(AdamW) and torch's ZeroRedundancyOptimizer(AdamW), measured side by side;
then ZeRO's stages 1, 2 and 3 on one table (state kept, peak during a step, time), each of
ours beside torch's twin. Writes <out>/06_sharded_memory, 06_sharded_optimizer and
06_zero_stages (.json and .md).
"""

import copy
import os
import resource

import torch.nn.functional as F

import common

# ---- begin copy: sharded optimizers (ShardedOptimizer, ShardedGradientOptimizer; need only torch and the standard library) ----
import weakref

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps any torch.optim.Optimizer so that each rank holds state for its own parameters.

        model = NaiveDDP(MyModel().to(device))          # any DDP wrapper: gradients averaged
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x_local), y_local).backward()
        model.finish_gradient_synchronization()
        opt.step()                                       # update own shard, then broadcast it
        opt.zero_grad()                                  # clears every parameter's gradient

    Each parameter is owned by one rank, chosen greedily by size (largest first, to the
    least-loaded rank) so bytes balance; the choice is deterministic, so all ranks agree.
    ``process_group`` (default: every rank) is the data-parallel group: ownership is spread
    over its ranks. ``add_param_group`` works during construction and later (unfreezing layers), and the
    group's hyperparameters reach the inner optimizer; so do changes to
    ``param_groups[i]["lr"]`` (learning-rate schedulers). A rank may own nothing.
    The parameters of each owner are moved into one flat buffer per dtype and device
    (``p.data`` becomes a view of it, as with ZeroRedundancyOptimizer's
    ``parameters_as_bucket_view``), and ``step`` broadcasts each buffer in place.

    ``state_dict()`` is **per rank**: this rank's shard of the state (plus the
    hyperparameters); load each rank's own file back into an optimizer built the same way.
    ``consolidate_state_dict(to=0)`` gathers the whole state on one rank instead, keyed by
    the parameters' places in ``param_groups``; ``load_state_dict`` takes that on any number
    of ranks, each keeping what it now owns.
    """

    def __init__(self, params, optimizer_cls, process_group=None, **kwargs):
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._global_rank = [dist.get_global_rank(process_group or dist.group.WORLD, r)
                             for r in range(self.world_size)]   # broadcast sources
        self._optimizer_cls = optimizer_cls
        self._kwargs = kwargs
        self.optim = None                            # the inner optimizer, over owned params only
        self._owner = {}                             # parameter -> owning rank
        self._load = [0] * self.world_size           # bytes owned by each rank
        self._owned = [[] for _ in range(self.world_size)]
        self._flats = []                             # (owner, flat buffer its parameters are views of)
        super().__init__(params, defaults=kwargs)    # calls add_param_group for each group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # greedy by size, ties broken by position: the same answer on every rank
        order = sorted(range(len(group["params"])), key=lambda i: -group["params"][i].numel())
        new = [[] for _ in range(self.world_size)]
        for i in order:
            p = group["params"][i]
            r = min(range(self.world_size), key=lambda k: (self._load[k], k))
            self._owner[p] = r
            self._load[r] += p.numel() * p.element_size()
            self._owned[r].append(p)
            new[r].append(p)
        # Each owner's parameters become views into one flat buffer (per dtype and device),
        # so step() broadcasts straight into every rank's parameters: no copy in or out.
        with torch.no_grad():
            for owner, params in enumerate(new):
                kinds = {}
                for p in params:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
                for ps in kinds.values():
                    flat = _flatten_dense_tensors([p.data for p in ps])
                    for p, view in zip(ps, _unflatten_dense_tensors(flat, ps)):
                        p.data = view
                    self._flats.append((owner, flat))
        mine = {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self._owner[p] == self.rank]}
        if self.optim is None:
            self.optim = self._optimizer_cls([mine], **self._kwargs)
        else:
            self.optim.add_param_group(mine)
        for k, v in self.optim.param_groups[-1].items():  # the inner optimizer's defaults, visible here
            group.setdefault(k, v)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        loss = self.optim.step(closure, **kwargs)
        # Every owner's updated parameters, all broadcasts in flight at once (a group of one: none)
        for work in [dist.broadcast(flat, src=self._global_rank[owner], group=self.process_group, async_op=True)
                     for owner, flat in self._flats if self.world_size > 1]:
            work.wait()
        return loss

    def state_dict(self):
        return {"inner": self.optim.state_dict(), "rank": self.rank, "world_size": self.world_size,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def consolidate_state_dict(self, to: int = 0):
        """The whole optimizer state on group rank ``to`` (None on the other ranks; every
        rank must call it). Save it once; load it with load_state_dict on any world size."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        mine = {index[id(p)]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()}
                for p, st in self.optim.state.items()}
        everyone = [None] * self.world_size if self.rank == to else None
        dist.gather_object(mine, everyone, dst=self._global_rank[to], group=self.process_group)
        if self.rank != to:
            return None
        return {"consolidated": True, "state": {k: v for part in everyone for k, v in part.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        if state_dict.get("consolidated"):   # the whole state: keep what this rank owns now
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            _load_state(self, state_dict, lambda p: state_dict["state"].get(index[id(p)]))
        else:
            _load_state(self, state_dict)

    def owned_params(self, rank=None):
        return list(self._owned[self.rank if rank is None else rank])


class ShardedGradientOptimizer(torch.optim.Optimizer):
    """ZeRO stage 2: each rank keeps 1/world_size of the gradients and of the optimizer
    state, and no rank ever holds a whole copy of the gradients. No DDP wrapper:

        opt = ShardedGradientOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x_local), y_local).backward()   # full buckets reduce-scattered meanwhile
        opt.step()          # wait, update this rank's shard, all-gather the parameters
        opt.zero_grad()

    The parameters of each group are cut into buckets of at most ``bucket_mb`` MiB (reverse
    order, as gradients arrive; one dtype and device each), each a flat buffer the
    parameters are views of, padded to a multiple of the group's size; rank r owns the r-th
    slice of every bucket. During backward each gradient is moved into its bucket's
    gradient buffer (``p.grad`` is then None: no whole gradient stays), and a full bucket
    is reduce-scattered at once, at most ``in_flight`` at a time (the oldest is waited for
    and its buffer freed before another starts); when backward ends, buckets some parameter
    did not fill go too (zeros for it). Each bucket also carries one has-gradient flag per
    parameter, so a parameter no rank gave a gradient is skipped by the step, as in one
    process. Several backward passes before a step accumulate (the slices add up).
    ``module``: its frozen parameters and buffers are broadcast from the first rank too
    (what a DDP wrapper does; the trainable ones always are).
    ``step`` runs the inner optimizer over this rank's slices (one piece per parameter, the
    groups' hyperparameters theirs), then all-gathers every bucket. The weights start as
    the group's first rank's. ``add_param_group`` works later too. ``consolidate_state_dict``
    and ``load_state_dict`` move the whole state between world sizes, as ShardedOptimizer's.
    ``grad_shards()``: this rank's (parameter, slice of it, gradient) triples, to clip.
    """

    def __init__(self, params, optimizer_cls, process_group=None, bucket_mb=25.0, in_flight=2, module=None,
                 **kwargs):
        self.process_group, self.in_flight = process_group, in_flight
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self._src = dist.get_global_rank(process_group or dist.group.WORLD, 0)
        with torch.no_grad():
            for t in [p for p in module.parameters() if not p.requires_grad] + list(module.buffers()) \
                    if module is not None else ():
                dist.broadcast(t, src=self._src, group=process_group)
        self._cap = bucket_mb * 2**20
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        self.optim, self.buckets, self._slot, self._flying = None, [], {}, []
        self._callback_queued, self._next = False, 0
        super().__init__(params, defaults=kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        first = len(self.buckets)
        open_ = {}
        for p in reversed([p for p in group["params"] if p.requires_grad]):
            key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
            b = open_.get(key)
            if b is None or b[1] + nbytes > self._cap:
                b = open_[key] = [[], 0]
                self.buckets.append(b[0])
            b[0].append(p)
            b[1] += nbytes
        self.buckets[first:] = [_GradBucket(ps, self.rank, self.world_size, self.process_group, self._src)
                                for ps in self.buckets[first:]]
        me = weakref.WeakMethod(self._hook)   # not self._hook: torch keeps a parameter's hook where Python's
        # collector cannot see it, so a hook holding the optimizer would keep it and its state alive for good

        def hook(p):
            method = me()
            if method is not None:
                method(p)
        for bucket in self.buckets[first:]:
            for j, p in enumerate(bucket.params):
                self._slot[p] = (bucket, j)
                p.register_post_accumulate_grad_hook(hook)
        mine = {**{k: v for k, v in group.items() if k != "params"},
                "params": [piece for b in self.buckets[first:] for piece in b.pieces.values()]}
        if self.optim is None:
            self.optim = self._optimizer_cls([mine], **self._kwargs)
        else:
            self.optim.add_param_group(mine)
        for k, v in self.optim.param_groups[-1].items():
            group.setdefault(k, v)

    def _hook(self, p):   # each parameter's, every backward: only what must be done per parameter
        grad = p.grad
        if grad is None:
            return
        if not self._callback_queued:   # when this backward ends: send what did not fill
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket, j = self._slot[p]
        bucket.add(j, grad)
        p.grad = None
        if bucket.remaining == 0:
            while self._next < len(self.buckets) and self.buckets[self._next].remaining == 0:
                self._launch(self.buckets[self._next])   # in order: every rank issues the same collectives
                self._next += 1

    def _launch(self, bucket):
        while len(self._flying) >= self.in_flight:
            self._flying.pop(0).finish()
        bucket.launch()
        self._flying.append(bucket)

    @torch.no_grad()
    def _end_of_backward(self):
        self._callback_queued = False
        for bucket in self.buckets[self._next:]:   # not filled (some parameter got no gradient)
            self._launch(bucket)
        self._next = 0

    def _wait(self):
        while self._flying:
            self._flying.pop(0).finish()

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        self._wait()
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        for bucket in self.buckets:
            bucket.expose_gradients()
        loss = self.optim.step(closure, **kwargs)
        works = [b.all_gather() for b in self.buckets if self.world_size > 1]   # (a group of one owns all)
        for w in works:
            w.wait()
        return loss

    def zero_grad(self, set_to_none=True):
        self._wait()
        for bucket in self.buckets:
            bucket.clear(set_to_none)
        super().zero_grad(set_to_none)   # any gradient outside the buckets (frozen, say)

    def owned_params(self):
        """The parameters this rank holds a piece of."""
        return [p for b in self.buckets for p in b.pieces]

    def grad_shards(self):
        """(parameter, this rank's piece of it, its gradient or None) for every piece."""
        return [(p, piece, piece.grad) for b in self.buckets for p, piece in b.pieces.items()]

    def state_dict(self):
        return {"inner": self.optim.state_dict(), "rank": self.rank, "world_size": self.world_size,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def consolidate_state_dict(self, to: int = 0):
        """The whole optimizer state on group rank ``to`` (None elsewhere; every rank calls
        it): each parameter's state tensors put back together from the slices, by place."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        mine = [(index[p], b.piece_range[p], {k: v.cpu() if torch.is_tensor(v) else v
                                              for k, v in self.optim.state[piece].items()})
                for b in self.buckets for p, piece in b.pieces.items() if self.optim.state.get(piece)]
        everyone = [None] * self.world_size if self.rank == to else None
        dist.gather_object(mine, everyone, dst=dist.get_global_rank(self.process_group or dist.group.WORLD, to),
                           group=self.process_group)
        if self.rank != to:
            return None
        state = {}
        for i, (lo, hi), st in (piece for part in everyone for piece in part):
            whole = state.setdefault(i, {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:   # a slice of a per-element state
                    whole.setdefault(k, torch.zeros(params[i].shape, dtype=v.dtype)).view(-1)[lo:hi] = v
                else:                                    # a scalar ("step"): the same in every piece
                    whole[k] = v
        return {"consolidated": True, "state": state,
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [index[p] for p in g["params"]]} for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        if state_dict.get("consolidated"):   # the whole state: keep this rank's slices
            index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            owner = {id(piece): (b, p) for b in self.buckets for p, piece in b.pieces.items()}

            def piece_state(piece):
                b, p = owner[id(piece)]
                st = state_dict["state"].get(index[p])
                if not st:
                    return None
                lo, hi = b.piece_range[p]
                return {k: v.reshape(-1)[lo:hi].clone() if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in st.items()}
            _load_state(self, state_dict, piece_state)
        else:
            _load_state(self, state_dict)


def _load_state(opt, state_dict, saved_state=None):
    """Both sharded optimizers' load_state_dict. ``saved_state`` (a consolidated state):
    the saved state of each of the inner optimizer's parameters, or None; the groups'
    hyperparameters come from the saved groups. Without it: this rank's own file."""
    if saved_state is None:
        if (state_dict["rank"], state_dict["world_size"]) != (opt.rank, opt.world_size):
            raise ValueError(f"this state is rank {state_dict['rank']} of {state_dict['world_size']}; load each "
                             f"rank's own file (here rank {opt.rank} of {opt.world_size}), or a "
                             f"consolidate_state_dict() one")
        for g, saved in zip(opt.param_groups, state_dict["param_groups"]):
            g.update(saved)
        opt.optim.load_state_dict(state_dict["inner"])
        return
    if [len(g["params"]) for g in state_dict["param_groups"]] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError("the saved parameter groups differ from this optimizer's")
    inner, n = {"state": {}, "param_groups": []}, 0
    for g, saved, inner_group in zip(opt.param_groups, state_dict["param_groups"], opt.optim.param_groups):
        g.update({k: v for k, v in saved.items() if k != "params"})
        ids = []
        for p in inner_group["params"]:
            st = saved_state(p)
            if st is not None:
                inner["state"][n] = st
            ids.append(n)
            n += 1
        inner["param_groups"].append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    opt.optim.load_state_dict(inner)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor       # torch >= 2.14: *_single
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # (older: *_tensor)


class _GradBucket:
    """Parameters as views of one flat buffer (padded to world_size slices); this rank's
    slice of their gradients, summed over the group, and the pieces the optimizer steps."""

    def __init__(self, params, rank, world_size, group, src):
        self.params, self.rank, self.world_size, self.group = params, rank, world_size, group
        numel = sum(p.numel() for p in params)
        self.k = -(-numel // world_size)                      # slice length
        p0 = params[0]
        with torch.no_grad():
            self.flat = torch.zeros(self.k * world_size, dtype=p0.dtype, device=p0.device)
            offset, self.ranges = 0, []
            for p in params:
                self.flat[offset:offset + p.numel()].copy_(p.data.reshape(-1))
                p.data = self.flat[offset:offset + p.numel()].view_as(p)
                self.ranges.append((offset, offset + p.numel()))
                offset += p.numel()
            dist.broadcast(self.flat, src=src, group=group)   # the first rank's weights everywhere
        lo, hi = rank * self.k, (rank + 1) * self.k
        self.grad = torch.zeros(self.k, dtype=p0.dtype, device=p0.device)   # this rank's slice, summed
        self.flags = torch.zeros(len(params), dtype=p0.dtype, device=p0.device)   # gradients given, summed
        self.all_given = torch.ones_like(self.flags)   # (the usual case, sent without a copy from the host)
        self.pieces, self.piece_range, self._piece_grad = {}, {}, {}
        for j, (p, (a, b)) in enumerate(zip(params, self.ranges)):
            s, e = max(a, lo), min(b, hi)
            if s < e:   # the piece of p this rank owns: a view of the flat weights
                self.pieces[p] = self.flat[s:e]
                self.piece_range[p] = (s - a, e - a)
                self._piece_grad[p] = (j, self.grad[s - lo:e - lo])   # its gradient's view, made once
        self.buffer, self.work = None, None
        self.remaining, self._seen = len(params), [False] * len(params)   # _seen: the gradients given
        self.sure = False   # whether this rank gave every gradient since clear(): then every rank's sum has them

    def add(self, j, grad):
        """Move parameter j's gradient in (one copy; the bucket is divided by world_size as
        it launches: the sum becomes the mean)."""
        if self.buffer is None:   # the whole bucket's gradients, only while it is in flight
            self.buffer = torch.zeros(self.k * self.world_size, dtype=grad.dtype, device=grad.device)
        a, b = self.ranges[j]
        if torch.is_grad_enabled():   # backward(create_graph=True): the copy is no part of a graph
            with torch.no_grad():
                self.buffer[a:b].view(grad.shape).copy_(grad)
        else:
            self.buffer[a:b].view(grad.shape).copy_(grad)
        if not self._seen[j]:
            self._seen[j] = True
            self.remaining -= 1

    def launch(self):
        """Reduce-scatter the gradients (zeros where none came) and sum the flags, async."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.k * self.world_size, dtype=self.grad.dtype, device=self.grad.device)
        if self.world_size > 1:   # average by dividing before the sum: once, the whole bucket
            self.buffer.div_(self.world_size)
        self.sure = self.sure or all(self._seen)   # (every flag above 0 then: nothing to read back)
        given = self.all_given.clone() if all(self._seen) else \
            torch.tensor(self._seen, dtype=self.flags.dtype, device=self.flags.device)   # (a copy from the host)
        if self.world_size == 1:   # a group of one: its sums are its own (no collective, as FSDP2's)
            self.work = (self.buffer, given)
        else:
            out = torch.empty_like(self.grad)
            self.work = (out, given, _reduce_scatter(out, self.buffer, group=self.group, async_op=True),
                         dist.all_reduce(given, group=self.group, async_op=True))
        self.buffer = None   # freed once the collective is done with it
        self.remaining, self._seen = len(self.params), [False] * len(self.params)

    def finish(self):
        out, given, *works = self.work
        for w in works:
            w.wait()
        self.grad += out
        self.flags += given
        self.work = None

    def expose_gradients(self):
        """Each piece's gradient: a view of the summed slice, or None if no rank gave p one
        (and it had none kept by zero_grad(set_to_none=False)). The flags are read once
        (one copy to the host a bucket, not one a parameter), and only where this rank did not
        give every one: the copy waits for the device, which then idles until the host
        queues the optimizer's work."""
        flags = [1] * len(self.params) if self.sure else self.flags.tolist()
        for p, piece in self.pieces.items():
            j, view = self._piece_grad[p]
            piece.grad = view if flags[j] > 0 or piece.grad is not None else None

    def all_gather(self):
        return _all_gather(self.flat, self.flat[self.rank * self.k:(self.rank + 1) * self.k].clone(),
                           group=self.group, async_op=True)

    def clear(self, set_to_none=True):
        self.grad.zero_()
        self.flags.zero_()
        self.sure = False
        for piece in self.pieces.values() if set_to_none else ():
            piece.grad = None
# ---- end copy: sharded optimizers ----


def train_step(model, optimizer, batch, clock):
    """One training step on this rank's part of the global batch, timed by phase: ``model``
    is a DDP wrapper, ``optimizer`` sharded or not."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("forward"):
        loss = model(x, y)
    with clock.phase("backward"):
        loss.backward()
    with clock.phase("comm"):
        if hasattr(model, "finish_gradient_synchronization"):   # ZeRO-2 has no wrapper: its step waits
            model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()   # the sharded optimizers also send every owner's parameters


# ----------------------------------------------------------------------------------------
# Verification: DDP + ShardedOptimizer against one process with the plain optimizer
# ----------------------------------------------------------------------------------------
CASES = {
    "adamw": {"opt": "adamw"},
    "sgd_momentum": {"opt": "sgd"},
    "tied": {"opt": "adamw", "tied": True},
    "param_groups": {"opt": "adamw", "groups": True},
    "add_param_group_mid_training": {"opt": "adamw", "late_head": True},
    "rank_owns_nothing": {"opt": "adamw", "tiny": True},
    "state_dict_round_trip": {"opt": "adamw", "checkpoint": True},
    "lr_schedule": {"opt": "sgd", "schedule": True},
}


class TinyModel(torch.nn.Module):
    """One linear layer, two parameters: with 3 or more ranks some rank owns nothing."""

    def __init__(self, in_dim, n_classes):
        super().__init__()
        self.fc = torch.nn.Linear(in_dim, n_classes)

    def forward(self, x, targets):
        return F.cross_entropy(self.fc(x), targets)


def _build(case, sharded, dims=(20, 10), device="cpu", group=None):
    """The case's model, optimizer (plain, sharded, or ZeRO-2 with ``sharded`` = 2), LR
    scheduler and head parameters."""
    torch.manual_seed(0)
    model = TinyModel(*dims) if case.get("tiny") else \
        common.ToyModel(dims[0], n_classes=dims[1], tied=case.get("tied", False))
    model.to(device)
    cls = torch.optim.AdamW if case["opt"] == "adamw" else torch.optim.SGD
    kw = {"lr": 1e-3, "weight_decay": 0.1} if case["opt"] == "adamw" else {"lr": 0.05, "momentum": 0.9}
    head = list(model.parameters())[-2:]
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    if case.get("groups"):
        params = [{"params": body}, {"params": head, "lr": kw["lr"] * 3, "weight_decay": 0.0}]
    else:
        params = body if case.get("late_head") else list(model.parameters())
    opt = ShardedGradientOptimizer(params, cls, process_group=group, bucket_mb=BUCKET_MB, **kw) if sharded == 2 else \
        ShardedOptimizer(params, cls, process_group=group, **kw) if sharded else cls(params, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if case.get("schedule") else None
    return model, opt, sched, head


BUCKET_MB = 0.002   # the verification's ZeRO-2: buckets of about 2 KB, several per toy model


def verify_case(ctx, args, case, group=None, steps=10, stage=1):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    batches, in_dim, n_cls = common.verify_batches(args, steps, 8 * size)
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")

    def train(sharded, start, stop, state=None):
        """Steps [start, stop): one process on the whole batches, or NaiveDDP + ShardedOptimizer
        on this rank's part; ``state``: (model, optimizer) state_dicts to resume from."""
        model, opt, sched, head = _build(case, sharded and stage, (in_dim, n_cls), ctx.device, group)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        ddp = (model if stage == 2 else naive.NaiveDDP(model, process_group=group)) if sharded else None
        for step in range(start, stop):
            if case.get("late_head") and step == 5:
                opt.add_param_group({"params": head, "lr": 2e-3})   # "unfreeze" the head mid-training
            x, y = batches[step]
            if sharded:
                train_step(ddp, opt, (common.shard(x, rank, size), common.shard(y, rank, size)),
                           common.StepClock(ctx.device))
            else:
                opt.zero_grad()
                model(x, y).backward()
                opt.step()
            if sched:
                sched.step()
        return model, opt

    ref, _ = train(False, 0, steps)
    if case.get("checkpoint"):   # stop halfway, save, rebuild everything, load, go on
        model, opt = train(True, 0, steps // 2)
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        model, opt = train(True, steps // 2, steps, saved)
    else:
        model, opt = train(True, 0, steps)
    owned = len(opt.owned_params())
    opt.zero_grad()
    stale = [p for p in model.parameters() if p.grad is not None]   # every gradient, not only owned
    local = {"ok": common.params_close(model, ref), "max_diff": common.max_param_diff(model, ref),
             "bitwise": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())),
             "owned": owned, "stale_grads": len(stale)}
    everyone = [None] * size
    dist.all_gather_object(everyone, local, group=group)
    return {"ok": all(r["ok"] and r["stale_grads"] == 0 for r in everyone),
            "max_diff": max(r["max_diff"] for r in everyone), "bitwise": all(r["bitwise"] for r in everyone),
            "owned": [r["owned"] for r in everyone], "stale_grads": sum(r["stale_grads"] for r in everyone)}


def resume_run(ctx, args, path, start, stop, save_at, batch, stage=1):
    """NaiveDDP + ShardedOptimizer(AdamW) (``stage`` 2: ShardedGradientOptimizer alone) on
    the toy model, steps [start, stop) of the same global batches whatever the world size;
    loads ``path`` when start > 0, saves the model and the consolidated optimizer state
    there after step ``save_at``. Returns the weights."""
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")
    batches, in_dim, n_cls = common.verify_batches(args, stop, batch)
    torch.manual_seed(0)
    model = common.ToyModel(in_dim, n_classes=n_cls).to(ctx.device)
    cls = ShardedGradientOptimizer if stage == 2 else ShardedOptimizer
    opt = cls(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1, **(
        {"bucket_mb": BUCKET_MB} if stage == 2 else {}))
    if start:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    ddp = model if stage == 2 else naive.NaiveDDP(model)
    for step in range(start, stop):
        x, y = (t.to(ctx.device) for t in batches[step])
        train_step(ddp, opt, (common.shard(x, ctx.rank, ctx.world_size), common.shard(y, ctx.rank, ctx.world_size)),
                   common.StepClock(ctx.device))
        if step + 1 == save_at:
            state = {"model": {k: v.cpu() for k, v in model.state_dict().items()}, "optim": opt.consolidate_state_dict()}
            if ctx.rank == 0:
                torch.save(state, path)
            dist.barrier()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def resume_run_zero2(ctx, args, path, start, stop, save_at, batch):
    return resume_run(ctx, args, path, start, stop, save_at, batch, stage=2)


def verify(ctx, args, cases=None, group=None):
    """Each case of CASES (or those named), on ``group`` (default: every rank), for
    ShardedOptimizer over NaiveDDP and for ShardedGradientOptimizer (ZeRO-2, "ZeRO-2: "
    names); and ZeRO-2 on the data-parallel cases of common.VERIFY_CASES (tied, frozen and
    unused parameters, uneven use, accumulation, two dtypes; "ZeRO-2, DDP case: ")."""
    out = {n: verify_case(ctx, args, CASES[n], group) for n in cases or CASES}
    out.update({f"ZeRO-2: {n}": verify_case(ctx, args, CASES[n], group, stage=2) for n in cases or CASES})
    if not cases:
        out.update({f"ZeRO-2, DDP case: {n}": verify_ddp_case(ctx, args, case, group)
                    for n, case in common.VERIFY_CASES.items()})
    return out


def verify_ddp_case(ctx, args, case, group=None):
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    run = common.VerifyRun(ctx, args, case, group)
    params = [p for p in run.model.parameters() if p.requires_grad]
    cls, kw = (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}) if case.get("opt") == "adamw" else \
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    opt = ShardedGradientOptimizer(params, cls, process_group=group, bucket_mb=BUCKET_MB, module=run.model, **kw)
    model = bucketed.LoopWrapper(run.model)   # ZeRO-2 needs no model wrapper: each backward reduce-scatters
    for step in range(run.steps):
        bucketed.train_step(model, opt, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
    return run.compare(run.model)


# ----------------------------------------------------------------------------------------
# Memory accounting and timing on the LM
# ----------------------------------------------------------------------------------------
def _tensor_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t   # a DTensor (torch's FSDP2): this rank's part
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _optimizer_state(opt):
    if opt is None:
        return []
    inner = getattr(opt, "optim", opt)   # ShardedOptimizer (and torch's ZeRO) keep the shard inside
    return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


def _rss_peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_snapshot(ctx, point, model, opt):
    params = list(model.parameters())
    row = {"point": point, "params_MB": _tensor_bytes(params) / 2**20,
           # gradients: the bucket buffers they live in (allocated at wrap time; ZeRO-2's
           # slices, in its optimizer), and any others
           "grads_MB": _tensor_bytes([b.buffer for b in getattr(model, "buckets", ())] +
                                     [b.grad for b in getattr(opt, "buckets", ())] +
                                     [p.grad for p in params if p.grad is not None]) / 2**20,
           "opt_state_MB": _tensor_bytes(_optimizer_state(opt)) / 2**20}
    tracked = row["params_MB"] + row["grads_MB"] + row["opt_state_MB"]
    if ctx.device.type == "cuda":
        row["peak_MB"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        row["other_MB"] = torch.cuda.memory_allocated(ctx.device) / 2**20 - tracked
    else:
        row["peak_MB"] = _rss_peak_mb()
        row["other_MB"] = _rss_now_mb() - tracked
    return row


def memory_worker(ctx, args, kind):
    """Memory at three points of a training step, per rank, for one optimizer kind."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model = bucketed.DDPBucketed(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), 25)
    rows = [memory_snapshot(ctx, "after model init", model, None)]
    opt = make_optimizer(kind)(list(model.parameters()))
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size) for t in
                  common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    train_step(model, opt, batch, common.StepClock(ctx.device))   # the optimizer state now exists
    hook = opt.register_step_pre_hook(lambda *_: rows.append(memory_snapshot(ctx, "before optimizer step", model, opt)))
    train_step(model, opt, batch, common.StepClock(ctx.device))   # as in steady training
    hook.remove()
    rows.append(memory_snapshot(ctx, "after optimizer step", model, opt))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, rows)
    return [{"optimizer": kind, "rank": r, **row} for r, rs in enumerate(everyone) for row in rs]


def make_optimizer(kind):
    def build(params):
        if kind == "sharded":
            return ShardedOptimizer(params, torch.optim.AdamW, lr=1e-4)
        if kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
        return torch.optim.AdamW(params, lr=1e-4)
    return build


NAMES = {"plain": "AdamW (unsharded)", "sharded": "ShardedOptimizer(AdamW)", "zero": "ZeroRedundancyOptimizer(AdamW)"}


def benchmark(ctx, args):
    """DDPBucketed (25 MB) with plain AdamW, ShardedOptimizer and torch's ZeRO, steps alternating."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")

    def method(kind):
        def make():
            model = bucketed.DDPBucketed(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), 25)
            optimizer = make_optimizer(kind)(list(model.parameters()))
            return lambda batch, clock: train_step(model, optimizer, batch, clock)
        return make
    rows = common.time_methods(ctx, args, {NAMES[k]: method(k) for k in NAMES})
    for r in rows:
        r["optim_ms"] = r["stats"]["optim"]["median"] * 1e3
        r["vs_unsharded"] = r["step_ms"] / rows[0]["step_ms"]
    return rows


# ---- ZeRO's stages side by side: what each shards, its peak during a step, its time ----
def _torch_ddp(model):
    from torch.nn.parallel import DistributedDataParallel
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    return bucketed.LoopWrapper(DistributedDataParallel(model, gradient_as_bucket_view=True))


def _stages(ctx):
    """name -> (ZeRO stage, wrap(model), optimizer(model's parameters, model) or None: AdamW)."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")
    adamw = {"lr": 1e-4}
    return {
        "DDPBucketed + AdamW": (0, lambda m: bucketed.DDPBucketed(m, 25), None),
        "DDPBucketed + ShardedOptimizer (ours)": (1, lambda m: bucketed.DDPBucketed(m, 25), lambda ps, m:
                                                  ShardedOptimizer(ps, torch.optim.AdamW, **adamw)),
        "torch DDP + ZeroRedundancyOptimizer": (1, _torch_ddp, lambda ps, m: make_optimizer("zero")(ps)),
        "ShardedGradientOptimizer, 25 MB buckets (ours)": (2, bucketed.LoopWrapper, lambda ps, m: ShardedGradientOptimizer(
            ps, torch.optim.AdamW, module=m, **adamw)),
        "ShardedGradientOptimizer, 4 MB buckets (ours)": (2, bucketed.LoopWrapper, lambda ps, m: ShardedGradientOptimizer(
            ps, torch.optim.AdamW, bucket_mb=4, module=m, **adamw)),
        "torch FSDP2, reshard_after_forward=False": (2, lambda m: fsdp.torch_fsdp2(m, ctx, False), None),
        "FSDP (07, ours)": (3, lambda m: fsdp.FSDP(m), None),
        "torch FSDP2 (fully_shard)": (3, lambda m: fsdp.torch_fsdp2(m, ctx), None),
    }


TWINS = {"DDPBucketed + ShardedOptimizer (ours)": "torch DDP + ZeroRedundancyOptimizer",
         "ShardedGradientOptimizer, 25 MB buckets (ours)": "torch FSDP2, reshard_after_forward=False",
         "ShardedGradientOptimizer, 4 MB buckets (ours)": "torch FSDP2, reshard_after_forward=False",
         "FSDP (07, ours)": "torch FSDP2 (fully_shard)"}


def _build_stage(ctx, args, name):
    _, wrap, optimizer = _stages(ctx)[name]
    model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
    params = list(model.parameters())
    return model, optimizer(params, model) if optimizer else torch.optim.AdamW(params, lr=1e-4)


def stage_memory(ctx, args, name):
    """One method's memory per rank (07's step_memory: the state kept after a step, the peak
    of live tensor bytes during one), the largest rank's."""
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size) for t in
                  common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    row = fsdp.step_memory(ctx, lambda: _build_stage(ctx, args, name), batch)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, row)
    return {k: max(r[k] for r in everyone) for k in ("params_MB", "grads_MB", "opt_state_MB", "state_MB",
                                                      "step_peak_MB")}


def stage_timing(ctx, args):
    """Every method's step, alternating; ours beside torch's twin pair by pair."""
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")

    def method(name):
        def make():
            model, opt = _build_stage(ctx, args, name)
            return lambda batch, clock: fsdp.train_step(model, opt, batch, clock)
        return make
    rows = {r["method"]: r for r in common.time_methods(ctx, args, {n: method(n) for n in _stages(ctx)})}
    for ours, theirs in TWINS.items():
        rows[ours].update(common.vs_paired(rows[ours], rows[theirs]))
    return list(rows.values())


STAGE_HEADERS = ["method", "stage", "params_MB", "grads_MB", "opt_state_MB", "state_MB", "step_peak_MB", "step_ms",
                 "vs_torch", "vs_torch_min", "vs_torch_max", "comm_MB", "collectives"]
STAGE_NAME, STAGE_TITLE = "06_zero_stages", "ZeRO stages 1, 2 and 3: memory per rank and time, ours beside torch's"


def zero_stages(args):
    """The stage table: each method's memory in a fresh job (its peak its own), then all
    timed together."""
    rows = common.launch(stage_timing, args)
    names = list(_stages(None))
    stages = {n: s for n, (s, *_) in _stages(None).items()}
    for r in rows:
        r.update(stage=stages[r["method"]], **common.launch(stage_memory, args, r["method"]))
    rows.sort(key=lambda r: names.index(r["method"]))
    if common.is_reporter():
        table = common.save_results(args.out, STAGE_NAME, rows, common.lm_settings(args), headers=STAGE_HEADERS,
                                    title=STAGE_TITLE)
        print(f"\n{STAGE_TITLE}\n({args.model_size} LM, {args.world_size} ranks, {args.backend}/{args.device}; MB per "
              f"rank, the largest rank's: state kept after a step (parameters, gradients, AdamW's moments) and the "
              f"peak of live tensor bytes during a step; step_ms median of {args.steps}; vs_torch: ours over its "
              f"twin, paired steps; comm_MB: bytes a rank's collectives carry per step)\n{table}\n"
              f"{common.wrote(args.out, f'{STAGE_NAME}.json and .md')}")
    return rows


HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "comm_ms", "optim_ms", "vs_unsharded", "collectives"]
MEM_HEADERS = ["optimizer", "rank", "point", "params_MB", "grads_MB", "opt_state_MB", "other_MB", "peak_MB"]
NAME, TITLE = "06_sharded_optimizer", "Sharded optimizer: time per iteration (DDPBucketed 25 MB)"


def report_memory(args, mem, timing):
    def state(kind):
        return max(r["opt_state_MB"] for r in mem if r["optimizer"] == kind and r["point"] == "after optimizer step")
    summary = {"opt_state_ratio": state("sharded") / state("plain"), "opt_state_bar": 1 / args.world_size + 0.05,
               "time_ratio_vs_unsharded": timing[1]["vs_unsharded"],
               "time_ratio_vs_zero": timing[1]["step_ms"] / timing[2]["step_ms"]}
    table = common.save_results(args.out, "06_sharded_memory", mem, common.lm_settings(args),
                                headers=MEM_HEADERS, title="Sharded optimizer: memory per rank (MiB)",
                                extra={"summary": summary})
    print(f"\nMemory per rank (MiB; peak = {'max_memory_allocated' if args.device == 'cuda' else 'peak RSS'})\n"
          f"{table}\noptimizer state per rank, sharded / unsharded: {summary['opt_state_ratio']:.3f} "
          f"(bar: <= {summary['opt_state_bar']:.3f})\nstep time, sharded / unsharded: "
          f"{summary['time_ratio_vs_unsharded']:.3f}; sharded / ZeroRedundancyOptimizer: "
          f"{summary['time_ratio_vs_zero']:.3f}\n{common.wrote(args.out, '06_sharded_memory.json and .md')}")


def main(argv=None):
    args = common.parse(common.script_parser(__doc__, default_steps=20), argv)  # close ratios need more steps
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
        common.check_resume(resume_run, args, f"{NAME}: a consolidated checkpoint on another world size")
        common.check_resume(resume_run_zero2, args, f"{NAME}, ZeRO-2: a consolidated checkpoint on another world size")
    if args.no_bench:
        return
    rows = common.launch(benchmark, args)
    common.report_table(args, NAME, TITLE, rows, HEADERS)
    # one job per optimizer kind: fresh processes, so each peak belongs to that kind alone
    mem = [row for kind in ("plain", "sharded") for row in common.launch(memory_worker, args, kind)]
    if common.is_reporter():
        report_memory(args, mem, rows)
    if args.world_size > 1:
        zero_stages(args)


if __name__ == "__main__":
    common.run_main(main)
