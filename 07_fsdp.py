"""Fully sharded data parallel (FSDP): weights, gradients and optimizer state all sharded,
by units, as torch's FSDP2 does it.

Each rank stores 1/world_size of every parameter (its first dimension split). The model is
cut into units (by default each block of its ModuleLists, plus the root for the rest): just
before a unit's forward one all-gather brings all its parameters whole, and they are freed
right after; before the unit's backward they are gathered again, and its gradients are
reduce-scattered in one call, so each rank keeps only its shards' part. The next unit's
all-gather is issued while the current one computes. The optimizer sees only the shards,
so its state is sharded for free. With a compute dtype (float16, bfloat16) weights travel
and compute in it, while the master shards, their gradients and the optimizer state stay
float32. Gradient accumulation (no_sync), clipping by the global norm, and checkpoints that
load on any number of ranks work as in an ordinary training loop.

Run:
    python 07_fsdp.py                              # verify (fp32 and fp16), then memory and time
    python 07_fsdp.py --world-size 4 --model-size micro
    python 07_fsdp.py --compute-dtype bf16
    torchrun --standalone --nproc-per-node 2 07_fsdp.py

Prints PASS/FAIL per verification case, then step time and per-rank memory (parameters,
gradients, optimizer state, peak) for DDP (05's DDPBucketed), DDP with the sharded
optimizer (06), FSDP and torch's FSDP2 (fully_shard on the same units), measured side by
side. Writes <out>/07_fsdp.{json,md} and <out>/07_fsdp_memory.{json,md}.
"""

import copy
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time


import common
import sharded_checkpoint

# ---- begin copy: FSDP (needs torch, the standard library and placement.py) ----
import collections.abc
import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree

from placement import (clip_grad_norm_, full_optim_state_dict, full_state_dict, hold_storage,
                       load_full_optim_state_dict, load_full_state_dict, make_real, place, placements,
                       whole_tensor)   # noqa: F401 (what a loop needs, from here too)


def _all_gather(out, inp, group, async_op=False):
    """all_gather_into_tensor (named all_gather_single in newer torch)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out, inp, group, async_op=False):
    """reduce_scatter_tensor (named reduce_scatter_single in newer torch), summing."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class _Done:
    """The work of a collective a group of one needs not make."""

    @staticmethod
    def wait():
        return True


_DONE = _Done()


class FSDP(nn.Module):
    """Fully sharded data parallelism by units, as torch's FSDP2 does it.

        model = FSDP(MyModel().to(device))     # units: each decoder layer (or ModuleList block), and the root
        opt = torch.optim.AdamW(model.parameters())   # this rank's shards, under their own names
        loss = loss_fn(model(x_local), y_local)   # each unit gathered whole before it runs, freed after
        loss.backward()                           # gathered again; gradients reduce-scattered per unit
        model.finish_gradient_synchronization()   # wait for them: every .grad is this rank's shard's
        model.clip_grad_norm_(1.0); opt.step()

    Every parameter is split along its first dimension (padded to a multiple of the group
    size): rank r keeps rows [r*k, (r+1)*k) as a Parameter registered under the original
    name and with the original number of dimensions, so optimizer parameter groups by name
    or by ``p.dim()`` work. A unit's shards are views of one flat buffer per rank. Just
    before a unit's forward one all-gather brings all its parameters whole; during the
    unit's forward its modules' attributes (``module.weight``) are the whole tensors, so a
    parent may read a child's parameters (``nn.MultiheadAttention`` reads
    ``out_proj.weight``); outside forward they are this rank's shards again. After the
    forward they are freed, gathered again before the unit's backward, and its gradients
    reduce-scattered in one call. The next unit's all-gather is issued while the current
    one computes, in forward and in backward; a unit's reduce-scatter runs while the next
    unit computes its gradients, and is waited for (its whole-size input freed) before that
    unit issues its own, so at most one is in flight. A parameter used by several units
    (tied weights) belongs to the root unit. Activation checkpointing (torch.utils.checkpoint,
    non-reentrant, e.g. torch's checkpoint_wrapper on each block, inside the unit or around
    it): the unit is whole again before its backward and its modules see the whole tensors
    while the forward is recomputed, so the recomputation gathers nothing more. A frozen
    unit a backward passes through (trained layers before it) is gathered for that backward
    and freed by finish_gradient_synchronization. ``units``: the submodules to use as units
    (None: the modules a transformers model names in its ``_no_split_modules``, its decoder
    layers, where the model has any; else each module of the model's ModuleLists). ``compute_dtype``: weights gathered, computed and reduced in
    it (float16, bfloat16); shards, their gradients and the optimizer state stay float32.
    ``reduce_dtype``: the gradients reduced in it instead (float32 with a bfloat16
    compute_dtype: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)).
    ``process_group``: the group to shard over (default: every rank). Every rank must run
    the same units in the same order. On a group of one nothing is communicated, and the
    whole tensors are views of the shards (with a compute_dtype, of one cast of them).

    ``replicate(module, param) -> bool``: called once per parameter with the module that
    registers it (the first one, for a tied parameter); where it says True the parameter
    stays whole on every rank, is never gathered, and its gradient is all-reduced (averaged)
    with its unit's communication, so every rank ends with the same whole gradient. The
    course's rule, Linear and Embedding weights sharded and the rest (norms) replicated:
    ``FSDP(model, replicate=lambda mod, p: not isinstance(mod, (nn.Linear, nn.Embedding)))``.
    None (the default) shards every parameter.

    Use ``clip_grad_norm_`` instead of torch.nn.utils.clip_grad_norm_: each rank holds only
    shards, so torch's would clip every rank by a different norm. ``no_sync()`` accumulates
    whole-size gradients locally (no communication) until a synchronized backward.
    ``full_state_dict`` / ``load_full_state_dict`` and ``full_optim_state_dict`` /
    ``load_full_optim_state_dict`` save whole tensors and load them on any group size. These
    are placement.py's functions over this group: each shard records a
    "shard" placement (dim 0 over the group, after any the parameter had), each replicated
    parameter a "replicate" one, so the same functions serve FSDP inside other axes.
    ``ignore``: parameters left out (never broadcast, sharded, gathered or reduced: a
    mixture of experts' experts, distinct on every rank); clip_grad_norm_ counts them as
    their own placement record says, and their gradients are the caller's to reduce.

    A model built on the meta device: nothing is broadcast, the shards stay on meta, and
    placement.materialize(model, device, source) gives this rank's flat buffers storage (the
    same shard Parameters) and fills them, from the model's init or a checkpoint (docs/10,
    "A model larger than one rank").
    """

    wraps_module = True   # its parameters' names are its module's (placement.materialize)

    def __init__(self, module: nn.Module, compute_dtype=None, process_group=None, units=None, replicate=None,
                 ignore=(), reduce_dtype=None):
        super().__init__()
        self.module, self.compute_dtype, self.process_group = module, compute_dtype, process_group
        self.reduce_dtype = reduce_dtype
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        src = dist.get_global_rank(process_group or dist.group.WORLD, 0)   # the group's first rank
        ignored = {id(p) for p in ignore}
        self._ignored = {name: p for name, p in module.named_parameters() if id(p) in ignored}
        with torch.no_grad():   # a model built on meta gets its values later (placement.materialize)
            for t in [p for p in module.parameters() if id(p) not in ignored] + list(module.buffers()):
                if not t.is_meta:
                    dist.broadcast(t, src=src, group=process_group)
        if units is None:   # what the model says must stay whole (transformers' decoder layers), else
            # each module of a ModuleList; outermost ones only
            whole_kinds = {n for m in module.modules() for n in getattr(m, "_no_split_modules", None) or ()}
            units = [m for m in module.modules() if type(m).__name__ in whole_kinds] or \
                [m for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst]
        units = [u for u in units if u is not module]
        unit_of = {}   # module -> the unit it belongs to (None: the root)
        for u in units:
            for m in u.modules():
                unit_of.setdefault(m, u)
        units = [u for u in units if unit_of[u] is u]      # drop units nested in another unit
        params, uses, names = {}, {}, {}   # by id(parameter): it, [(module, attribute)], its name
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None and id(p) not in ignored:
                    params[id(p)] = p
                    uses.setdefault(id(p), []).append((mod, attr))
                    names.setdefault(id(p), f"{mod_name}.{attr}" if mod_name else attr)
        whole = {k for k in params if replicate is not None and replicate(uses[k][0][0], params[k])}
        members = {u: [] for u in units + [None]}   # None: the root unit
        for key, where in uses.items():
            homes = {unit_of.get(mod) for mod, _ in where}
            members[homes.pop() if len(homes) == 1 else None].append(params[key])
        self._units = [_Unit(self, members[u], uses, names, whole, u) for u in units + [None] if members[u]]
        self._root = next((u for u in self._units if u.module is None), None)
        self._where = {id(p): (unit, info) for unit in self._units for p, info in zip(unit.params, unit.infos)}
        # The hooks run eager under torch.compile (a graph break each side of a compiled unit, as
        # FSDP2's): a compiled layer's call runs its hooks, and traced, their bookkeeping (which
        # unit, the order so far, each parameter's shape) became guards: a graph per layer's
        # place, past dynamo's limit of 8 at 9 layers, and recompiled while the order was learned
        for unit in self._units:
            target = unit.module if unit.module is not None else module
            target.register_forward_pre_hook(torch.compiler.disable(self._pre_forward(unit)))
            target.register_forward_hook(torch.compiler.disable(self._post_forward(unit)))
        # non-root units in forward order, per kind of forward (its keyword arguments: a
        # pipeline stage of several chunks runs ``module(x, chunk=j)``, each its own units)
        self._orders, self._seen, self._kind = {}, [], None
        self._sync, self._reducing = True, None   # the unit whose gradient reduction is in flight

    @torch.no_grad()
    def materialize_storage(self, device):
        """For placement.materialize (a model built on meta): each unit's flat buffer made on
        ``device``, its shards views of it again (the same Parameter objects)."""
        for unit in self._units:
            unit.materialize_storage(torch.device(device))

    # -- forward and backward -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # the kind: the keywords' names, and the values that are plain constants (a stage's chunk=j);
        # a tensor's or an object's value is not part of it (a tensor's repr read it, on a GPU a sync,
        # and every batch's input_ids=x was a kind of its own: no prefetch of the first unit, a
        # recompilation a step under torch.compile, a record a step)
        self._seen = []
        self._kind = tuple(sorted((k, v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__)
                                  for k, v in kwargs.items()))
        out = self.module(*args, **kwargs)
        self._orders[self._kind] = self._seen
        return out

    def _next(self, unit, step):
        """The unit after (step=1) or before (step=-1) ``unit`` in the order of the last
        forward that ran it."""
        for order in self._orders.values():
            if unit in order:
                i = order.index(unit) + step
                return order[i] if 0 <= i < len(order) else None
        return None

    def _pre_forward(self, unit):
        def hook(mod, args):
            if _in_backward():              # activation checkpointing runs the unit's forward again in
                unit.unshard()              # backward: whole already (its backward has begun, or will
                unit.lend(unit.gather())   # after this), no order, no prefetch
                return self._cast(args)
            if unit is not self._root:
                self._seen.append(unit)
            unit.unshard()
            ahead = self._next(unit, 1) if unit is not self._root else (self._orders.get(self._kind) or [None])[0]
            if ahead is not None:
                ahead.prefetch()
            unit.lend(unit.gather())
            return self._cast(args)
        return hook

    def _cast(self, args):
        if self.compute_dtype is not None:
            return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def _post_forward(self, unit):
        def hook(mod, args, out):
            unit.take_back()
            if _in_backward():              # a recomputation: the unit stays whole for its backward
                return
            outs = [t for t in _tensors_in(out) if t.requires_grad]   # (a dict, a ModelOutput too)
            if not (torch.is_grad_enabled() and outs):
                unit.reshard()              # no backward will pass through it
                return
            if unit is self._root:          # its parameters stay whole until its synchronized
                return                      # backward. The last unit is gathered when the gradient
                                            # reaches it, not when backward starts: fetched then, it
                                            # would be alive beside the loss's gradients and the
                                            # head's backward, the step's peak (one unit's weights
                                            # more: 121.2 against 115.2 MiB at mini, 2 ranks)
            unit.reshard()                  # whole parameters go now, and come back for backward
            for t in outs:
                t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))
        return hook

    def _pre_backward(self, unit):
        """Before the unit's backward (once per output it gave): make it whole again, lend
        the whole tensors to its modules (a recomputation of its forward, activation
        checkpointing's, may run inside the backward without passing the unit's hooks), and
        fetch the unit whose backward comes next."""
        self._launch_staged()
        unit.unshard()
        if not unit.lent:
            with torch.enable_grad():       # as the forward's: a recomputation saves what it saved
                unit.lend(unit.gather())
        before = self._next(unit, -1)
        if before is not None:
            before.prefetch()

    def _reduce(self, unit, grads):
        """Issue ``unit``'s gradient reduction, after the one in flight has finished (so its
        whole-size input is freed first: one unit's gradients in flight at a time). The
        root's (its embedding's gradient is mostly the last of the backward) is copied in
        now and issued at the next hook or at finish_gradient_synchronization, after
        autograd has dropped its whole-size gradients: they and the collective's buffers are
        never alive together. A unit whose backward comes again in the same step (its
        forward ran twice) first adds the reduction of the one before to its gradients."""
        self._launch_staged()
        if self._reducing is not None:
            self._reducing.wait_reduction()
        if unit.reduced is not None:   # its second backward this step (a unit the forward runs twice, a
            unit.wait_reduction()       # recurrent depth's loop): the first's gradients go in first
            unit.assign_grads([1] * len(unit.params) if unit.had_all else unit.reduced[1].tolist())
        unit.reduce(grads, launch=unit is not self._root)
        self._reducing = unit

    def _launch_staged(self):
        if self._reducing is not None and self._reducing.staged is not None:
            self._reducing.launch()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates whole-size gradients locally and
        communicates nothing; the next synchronized backward reduce-scatters the sum."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        """Wait for the last reductions; then each shard's .grad holds its part of the
        gradient averaged over the group, each replicated parameter's .grad the whole
        average (None where no rank had one)."""
        self._launch_staged()
        if self._reducing is not None:
            self._reducing.wait_reduction()
            self._reducing = None
        pending = [u for u in self._units if u.reduced is not None]
        unsure = [u for u in pending if not u.had_all]   # (a unit where this rank had every gradient has a
        #                                                  sum above 0 each: nothing to read, no sync)
        flags = torch.cat([u.reduced[1] for u in unsure]).tolist() if unsure else []   # one sync for all
        for unit in pending:
            if unit.had_all:
                unit.assign_grads([1] * len(unit.params))
                continue
            unit.assign_grads(flags[:len(unit.params)])
            flags = flags[len(unit.params):]
        for unit in self._units:
            unit.drop_prefetch()        # one the last forward's order fetched but nothing used
            unit.reshard()              # a frozen unit a backward passed through (no gradient of its
            #                             own told it its backward was over)

    # -- ordinary training-loop helpers: placement.py's, over the group -------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks' shards and the replicated
        parameters (counted once): clip_grad_norm_ of the placement record over this
        group (a collective). Returns that norm. Use it instead of
        torch.nn.utils.clip_grad_norm_, which would see only this rank's shards."""
        return clip_grad_norm_(self.module, max_norm, norm_type, self.process_group)

    @torch.no_grad()
    def gather_full_params(self) -> dict:
        """{original parameter name: whole tensor (a copy)}, on every rank (a collective,
        each shard gathered by its placement record); ignored parameters as this rank holds
        them."""
        return {name: whole_tensor(p, placements(p)).clone() for name, p in self.module.named_parameters()}

    def full_state_dict(self) -> dict:
        """The wrapped module's state_dict with whole tensors, on the group's first rank
        (empty on the others); every rank must call it."""
        return full_state_dict(self.module, self.process_group)

    def load_full_state_dict(self, state: dict):
        """Load whole tensors (a state_dict of the unwrapped module, saved at any group
        size) into this rank's shards and replicated parameters. Pass it on every rank."""
        load_full_state_dict(self.module, state)

    def full_optim_state_dict(self, optimizer) -> dict:
        """The optimizer's state with whole tensors, keyed by parameter name, on the group's
        first rank (empty on the others); every rank must call it."""
        return full_optim_state_dict(self.module, optimizer, self.process_group)

    def load_full_optim_state_dict(self, optimizer, full: dict):
        """Load a full_optim_state_dict (saved at any group size) into ``optimizer``, built
        over this model's parameters with the same parameter groups. Pass it on every rank."""
        load_full_optim_state_dict(self.module, optimizer, full)


class _ShardInfo:
    """Where one parameter lives: its whole shape, and its rows in the unit's flat buffers."""

    def __init__(self, shape, offset, world_size, rank):
        self.shape, self.offset, self.world_size, self.rank = tuple(shape), offset, world_size, rank
        self.rows = shape[0] if len(shape) else 1
        self.rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.rows_per = -(-self.rows // world_size)
        self.numel = self.rows_per * self.rest          # this rank's share, padding included
        self.shard_shape = (self.rows_per,) + tuple(shape[1:]) if len(shape) else (1,)

    def slice(self, whole):
        """This rank's padded rows of a whole tensor of this parameter's shape."""
        out = torch.zeros(self.shard_shape, dtype=whole.dtype, device=whole.device)
        lo = self.rank * self.rows_per
        rows = whole.reshape(self.rows, self.rest)[lo:lo + self.rows_per]
        out.view(-1, self.rest)[:rows.shape[0]] = rows
        return out

    def copy_out(self, gathered, into):
        """Fill ``into`` (the whole parameter) from the unit's gathered buffer (ranks x U)."""
        src = gathered[:, self.offset:self.offset + self.numel].view(self.world_size, self.rows_per, self.rest)
        dst = into.view(self.rows, self.rest)
        if self.rows == self.world_size * self.rows_per:
            dst.view(self.world_size, self.rows_per, self.rest).copy_(src)
        else:
            for r in range(self.world_size):
                lo, hi = r * self.rows_per, min((r + 1) * self.rows_per, self.rows)
                if lo < hi:
                    dst[lo:hi].copy_(src[r, :hi - lo])

    def copy_in(self, whole, send):
        """Put a whole-size gradient into the reduce-scatter buffer (ranks x U'), zeros as padding."""
        dst = send[:, self.offset:self.offset + self.numel].view(self.world_size, self.rows_per, self.rest)
        src = whole.reshape(self.rows, self.rest)
        if self.rows == self.world_size * self.rows_per:
            dst.copy_(src.view(self.world_size, self.rows_per, self.rest))
            return
        dst.zero_()
        for r in range(self.world_size):
            lo, hi = r * self.rows_per, min((r + 1) * self.rows_per, self.rows)
            if lo < hi:
                dst[r, :hi - lo].copy_(src[lo:hi])


class _Unit:
    """One unit: its parameters (shards, views of one flat buffer on this rank; replicated
    ones whole), and the whole tensors it lends its modules while they run."""

    def __init__(self, fsdp, params, uses, names, whole, module):
        self.fsdp, self.module, self.group = fsdp, module, fsdp.process_group
        ws, rank = fsdp.world_size, fsdp.rank
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"an FSDP unit mixes parameter dtypes {sorted(map(str, dtypes))}: make them separate units")
        self.dtype, self.device = params[0].dtype, params[0].device
        self.compute_dtype = fsdp.compute_dtype or self.dtype
        self.reduce_dtype = fsdp.reduce_dtype or self.compute_dtype
        self.names = [names[id(p)] for p in params]
        self.uses = [uses[id(p)] for p in params]
        self.infos, offset = [], 0   # a _ShardInfo per sharded parameter, None per replicated one
        for p in params:
            self.infos.append(None if id(p) in whole else _ShardInfo(p.shape, offset, ws, rank))
            offset += self.infos[-1].numel if self.infos[-1] else 0
        self.size = offset                                 # U: this rank's flat buffer of shards
        self.whole_numel = sum(p.numel() for p, info in zip(params, self.infos) if info is None)
        shards = [info for info in self.infos if info is not None]
        self.sizes = [info.numel for info in shards]                    # each one's columns of the flat
        self.even = all(info.rows == ws * info.rows_per and info.numel for info in shards)   # buffer; no
        #                                                                     padding, no empty tensor
        self.flat = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        self.hooks = [(i, list(p._backward_hooks.values())) for i, p in enumerate(params)   # the parameters'
                      if getattr(p, "_backward_hooks", None)]                                # gradient hooks
        self.params = []             # what the optimizer sees: shards, and replicated parameters as they are
        with torch.no_grad():
            for p, info in zip(params, self.infos):
                if info is None:
                    self.params.append(place(p, "replicate", self.group))
                    continue
                view = self.flat[info.offset:info.offset + info.numel].view(info.shard_shape)
                view.copy_(info.slice(p.detach()))
                shard = place(nn.Parameter(view, requires_grad=p.requires_grad), "shard", self.group, 0, p.shape, like=p)
                if shard.is_meta:   # built on meta: placement.materialize asks the FSDP for its storage
                    hold_storage(shard, fsdp)
                for mod, attr in uses[id(p)]:
                    mod._parameters[attr] = shard
                self.params.append(shard)
        self._make_full()
        self.is_whole, self.gathered, self.work = self.size == 0 or self.alias, None, None
        self.pending, self.works, self.reduced, self.lent, self.staged = None, [], None, False, None
        self.had_all = False        # whether this rank had a gradient for each trainable parameter

    def _make_full(self):
        """The whole parameters: one tensor each for the unit's life, whose storage is filled
        from an all-gather while the unit is whole and resized to nothing while it is not.
        Every forward lends aliases of them, so whatever autograd saved, in any of several
        micro-batches' forwards (a pipeline), sees them refilled before its backward. On a
        group of one (``alone``) a shard is its whole parameter, and the whole tensors are
        views of one buffer: computing in the shards' dtype (``alias``), the flat buffer
        itself, always whole, so nothing is copied to make the unit whole and no second copy
        of its weights is held (FSDP2 copies them through a one-rank all-gather); with a
        compute_dtype, a buffer of that dtype (``cast_into``), filled by one cast and freed
        as the others are."""
        alone = self.alone()
        self.alias = alone and self.compute_dtype == self.dtype
        self.cast_into = None
        if alone:
            base = self.flat if self.alias else torch.empty(self.size, dtype=self.compute_dtype, device=self.device)
            self.full = [None if info is None else base[info.offset:info.offset + info.numel].view(info.shape)
                         for info in self.infos]
            if not self.alias:
                self.cast_into = base
                if not base.is_meta:
                    base.untyped_storage().resize_(0)
            return
        self.full = [None if info is None else torch.empty(info.shape, dtype=self.compute_dtype, device=self.device)
                     for info in self.infos]
        for t in self.full:
            if t is not None and not t.is_meta:
                t.untyped_storage().resize_(0)

    def alone(self) -> bool:
        """Whether this rank holds the unit alone (a group of one): its shards are whole."""
        return self.fsdp.world_size == 1 and self.size > 0

    def materialize_storage(self, device):
        """The flat buffer on ``device`` (uninitialised), the shards views of it (each keeps
        its Parameter object: placement.make_real), and the whole tensors' there."""
        if not self.flat.is_meta:
            return
        self.device, self.flat = device, torch.zeros(self.size, dtype=self.dtype, device=device)
        for p, info in zip(self.params, self.infos):
            if info is None:
                if p.is_meta:
                    make_real(p, device=device)
            else:
                make_real(p, self.flat[info.offset:info.offset + info.numel].view(info.shard_shape))
        self._make_full()

    def prefetch(self):
        if not self.is_whole and self.gathered is None and self.cast_into is None:
            self.gathered = torch.empty(self.fsdp.world_size * self.size, dtype=self.compute_dtype, device=self.device)
            self.work = _all_gather(self.gathered, self.flat.to(self.compute_dtype), self.group, async_op=True)

    def unshard(self):
        """Make the whole parameters whole: wait for their all-gather (issued now, unless
        prefetched) and copy them out of its buffer."""
        if self.is_whole:
            return
        if self.cast_into is not None:   # alone: one cast into the whole tensors' buffer (.data: refilling
            whole = self.cast_into.data  # saved storage is not an in-place change)
            whole.untyped_storage().resize_(whole.numel() * whole.element_size())
            whole.copy_(self.flat)
            self.is_whole = True
            return
        self.prefetch()
        self.work.wait()
        g = self.gathered.view(self.fsdp.world_size, self.size)
        self.gathered, self.work = None, None   # the work holds its tensors until dropped
        whole = [t.data for t in self.full if t is not None]   # .data: refilling saved storage is not
        for t in whole:                                         # an in-place change
            t.untyped_storage().resize_(t.numel() * t.element_size())
        if self.even:   # no padding: each rank's rows split straight into the whole tensors, one op
            torch.split_with_sizes_copy(g, self.sizes, dim=1, out=[t.view(g.shape[0], -1) for t in whole])
        else:
            for t, info in zip(whole, [info for info in self.infos if info is not None]):
                info.copy_out(g, t)
        self.is_whole = True

    def reshard(self):
        """Free the whole parameters' memory (the tensors, and aliases autograd saved, stay)."""
        if self.size and self.is_whole and not self.alias:
            for t in self.full:
                if t is not None:
                    t.untyped_storage().resize_(0)
            self.is_whole = False

    def drop_prefetch(self):
        if self.work is not None:
            self.work.wait()
        self.gathered, self.work = None, None

    def whole_tensors(self, params):
        """The tensors the modules compute with (inside the gather's forward): aliases of the
        whole parameters, and the replicated parameters (cast to the compute dtype)."""
        return [(p.to(self.compute_dtype) if p.dtype != self.compute_dtype else p.view_as(p)) if t is None
                else t.detach() for p, t in zip(params, self.full)]

    def gather(self):
        """The whole tensors for the unit's modules, through _Gather (whose backward hands
        their gradients to the unit). A gradient hook a parameter carries runs on its whole
        tensor's gradient, as it would without FSDP (08's sequence parallelism sums the
        norms' gradients over tp with one)."""
        whole = _Gather.apply(self, *self.params)
        for i, hooks in self.hooks:
            if whole[i].requires_grad:
                for hook in hooks:
                    whole[i].register_hook(hook)
        return whole

    def lend(self, whole):
        """The modules see the whole tensors, under the parameters' own names."""
        for t, uses in zip(whole, self.uses):
            for mod, attr in uses:
                mod.__dict__[attr] = t
        self.lent = True

    def take_back(self):
        for uses in self.uses:
            for mod, attr in uses:
                mod.__dict__.pop(attr, None)
        self.lent = False

    def after_backward(self, grads):
        """The unit's backward (of one forward) is done: free the whole parameters (the
        root keeps them until its synchronized backward: several micro-batches may come),
        then reduce the gradients (asynchronously), or keep adding them up inside no_sync."""
        self.take_back()
        if self.fsdp._sync or self is not self.fsdp._root:
            self.reshard()
        if self.pending is not None:   # accumulated under no_sync (in the reduce dtype)
            grads = [a if b is None else (b if a is None else b + a) for a, b in zip(grads, self.pending)]
            self.pending = None
        if not self.fsdp._sync:
            self.pending = [g if g is None else g.to(self.reduce_dtype) for g in grads]
            return
        self.fsdp._reduce(self, grads)

    def reduce(self, grads, launch=True):
        """Average the gradients over the group, dividing before the sum: the shards' by one
        reduce-scatter, the replicated ones (whole on every rank) by one all-reduce, each
        with a flag per parameter that says whether this rank had a gradient. The gradients
        (in the compute dtype) become the reduce dtype as they are copied into the buffer:
        no whole-size copy of them in between. ``launch`` False: only copied in; launch()
        issues the collectives later, once autograd has dropped the gradients."""
        ws, n, kw = self.fsdp.world_size, len(self.infos), {"dtype": self.reduce_dtype, "device": self.device}
        mine = [g for g, info in zip(grads, self.infos) if info is not None]   # the shards' gradients
        fused = self.size and all(g is not None and g.numel() for g in mine) and len({g.dtype for g in mine}) == 1
        # the flags, a row for each rank's part (made on the device: a tensor copied from the host waits for it)
        had = torch.ones(ws, n, dtype=mine[0].dtype if fused else self.reduce_dtype, device=self.device)
        for i, g in enumerate(grads):
            if g is None:
                had[:, i] = 0.0
        self.had_all = all(g is not None or not p.requires_grad for g, p in zip(grads, self.params))
        send = whole = None
        if fused:                      # one op (FSDP2's): each gradient cut into the ranks' rows, zero-
            send = torch.empty(ws, self.size + n, **kw)   # padded and cast, then the flags
            # (contiguous: CUDA's kernel copies a dense tensor's bytes in memory order, and a custom
            # op may give a gradient transposed strides)
            torch._chunk_cat([g.contiguous() if g.dim() else g.reshape(1) for g in mine] + [had], dim=0,
                             num_chunks=ws, out=send)
        elif self.size:                # (a shard with no gradient here, or one with no elements: a copy each)
            send = torch.empty(ws, self.size + n, **kw)
            for g, info in zip(grads, self.infos):
                if info is not None and g is None:
                    send[:, info.offset:info.offset + info.numel].zero_()
                elif info is not None:
                    info.copy_in(g, send)
            send[:, self.size:] = had
        if self.whole_numel or not self.size:   # the replicated gradients (and the flags, if no shard carries them)
            whole = torch.cat([(g.to(self.reduce_dtype) if g is not None else
                                torch.zeros_like(p, dtype=self.reduce_dtype)).reshape(-1)
                               for g, p, info in zip(grads, self.params, self.infos) if info is None]
                              + ([] if self.size else [had[0]]))
        self.staged = (send, whole)
        if launch:
            self.launch()

    def launch(self):
        """Issue the collectives of the gradients reduce() copied in (the output buffer made
        only now: on gloo the reduce-scatter copies its input too). A group of one issues
        none (as FSDP2): its sum is its own gradients, where reduce() put them."""
        (send, whole), self.staged, out = self.staged, None, None
        ws = self.fsdp.world_size
        if send is not None and ws == 1:
            out = send.view(-1)
            self.works.append(_DONE)
        elif send is not None:
            out = torch.empty(send.shape[1], dtype=send.dtype, device=send.device)
            self.works.append(_reduce_scatter(out, send.div_(ws).view(-1), self.group, async_op=True))
        if whole is not None:
            self.works.append(_DONE if ws == 1 else dist.all_reduce(whole.div_(ws), group=self.group, async_op=True))
        self.reduced = (out, out[self.size:] if self.size else whole[self.whole_numel:], whole)

    def wait_reduction(self):
        """Wait for this unit's collectives (on a GPU: the current stream waits for them)
        and drop them, so their whole-size input can go."""
        for work in self.works:
            work.wait()
        self.works = []

    def assign_grads(self, had):
        """After wait_reduction: this rank's gradients, from the reduced buffers; ``had``:
        the summed flags (0: no rank had a gradient, which then stays None)."""
        out, _, whole = self.reduced
        self.reduced, offset = None, 0
        for p, info, n in zip(self.params, self.infos, had):
            if info is None:
                g, offset = whole[offset:offset + p.numel()].view_as(p), offset + p.numel()
            elif out is None:   # (a unit of empty parameters only: nothing was reduced but flags)
                g = torch.zeros(info.shard_shape, dtype=self.reduce_dtype, device=self.device)
            else:
                g = out[info.offset:info.offset + info.numel].view(info.shard_shape)
            if not p.requires_grad or n == 0:
                continue
            g = g.to(self.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def _tensors_in(obj) -> list:
    """Every tensor inside a module's output, however it is packed: tuples, lists, dicts and
    other mappings (transformers' ModelOutput), dataclasses, and whatever torch's pytree
    knows (as torch's own FSDP2 looks into outputs)."""
    out = []
    for leaf in torch.utils._pytree.tree_leaves(obj):
        if torch.is_tensor(leaf):
            out.append(leaf)
        elif isinstance(leaf, collections.abc.Mapping):
            out += _tensors_in(list(leaf.values()))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += _tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        elif isinstance(leaf, (tuple, list)):   # a subclass pytree does not know
            out += _tensors_in(list(leaf))
    return out


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward then is a
    recomputation (torch.utils.checkpoint's)."""
    return torch._C._current_graph_task_id() != -1


class _Gather(torch.autograd.Function):
    """A unit's parameters -> the tensors its modules compute with (shards from the
    all-gather already done; replicated parameters as they are). Backward: hand their
    gradients to the unit, which reduces them."""

    @staticmethod
    def forward(ctx, unit, *params):
        ctx.unit = unit
        ctx.set_materialize_grads(False)   # an unused parameter's gradient must stay None, not zeros
        whole = unit.whole_tensors(params)
        ctx.mark_non_differentiable(*[t for t, p in zip(whole, params) if not p.requires_grad])
        return tuple(whole)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.after_backward(list(grads))
        return (None,) * (1 + len(grads))
# ---- end copy: FSDP ----


def train_step(model, optimizer, batch, clock, micro_batches=1, max_norm=None, **forward_kwargs):
    """One training step on this rank's part of the global batch, timed by phase; with
    ``micro_batches`` > 1 the gradients accumulate (communicated once, at the last), with
    ``max_norm`` they are clipped by the global norm."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
            with clock.phase("forward"):      # gathers each unit just before it runs
                loss = model(xm, ym, **forward_kwargs) / micro_batches
            with clock.phase("backward"):     # gathers it again; reduce-scatters its gradients
                loss.backward()
    with clock.phase("comm"):                 # waits for the last reduce-scatters
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        if max_norm is not None:
            model.clip_grad_norm_(max_norm)
        optimizer.step()


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------
# Low precision is compared with a single process that casts the same way, within
# common.TOLERANCE["low-precision compute"]
LOW_PRECISION_TOL = common.TOLERANCE["low-precision compute"]


def _reference_step(master, x, y, compute_dtype, micro_batches=1, max_norm=None, kwargs=None):
    """One single-process step on the global batch, weights and inputs cast like FSDP's."""
    model = master if compute_dtype is None else copy.deepcopy(master).to(compute_dtype)
    for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        xm = xm.to(compute_dtype) if compute_dtype is not None and xm.is_floating_point() else xm
        (model(xm, ym, **(kwargs or {})) / micro_batches).backward()
    if model is not master:
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = None if q.grad is None else q.grad.float()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm)


# name: model ("toy", "lm": the kit's LM, "encoder": EncoderLM), dtype (compute), tied,
# unused (a layer used every other step, one never: their gradients stay None), accum
# (micro-batches, all but the last inside no_sync), clip (max norm), groups (optimizer groups
# by p.dim(): shards keep it), units ("layers": one unit per linear layer of the toy;
# default: each block of a ModuleList, plus the root), replicate (a rule of REPLICATE: those
# parameters stay whole, their gradients all-reduced), recompute (each block's activations
# recomputed in backward by torch's checkpoint_wrapper: "wrapper", FSDP's units the wrappers,
# whose hooks stay outside the recomputation; "inner", the units the wrapped blocks, whose
# hooks run again inside it), frozen (that block's parameters frozen, the others trained)
REPLICATE = {"course": lambda mod, p: not isinstance(mod, (nn.Linear, nn.Embedding)),   # norms whole
             "1-D": lambda mod, p: p.dim() < 2}                                        # biases, norms whole
CASES = {
    "toy fp32": {"model": "toy"},
    "toy fp32, a unit per layer": {"model": "toy", "units": "layers"},
    "toy fp32 tied": {"model": "toy", "tied": True},
    "toy fp32, unused parameters (AdamW)": {"model": "toy", "unused": True, "adamw": True},
    "toy fp32, accumulation over 2 micro-batches (no_sync)": {"model": "toy", "accum": 2, "units": "layers"},
    "LM fp32 (AdamW, clipped at 1.0)": {"model": "lm", "adamw": True, "clip": 1.0},
    "LM fp32 (AdamW, no weight decay on 1-D parameters)": {"model": "lm", "adamw": True, "groups": True},
    "TransformerEncoderLayer model fp32 (AdamW)": {"model": "encoder", "adamw": True},
    "toy float16": {"model": "toy", "dtype": torch.float16},
    "toy float16 tied": {"model": "toy", "dtype": torch.float16, "tied": True},
    "LM fp32, norms replicated (the course's rule; AdamW, clipped at 1.0)":
        {"model": "lm", "adamw": True, "clip": 1.0, "replicate": "course"},
    "TransformerEncoderLayer model fp32, the course's rule (AdamW)":
        {"model": "encoder", "adamw": True, "replicate": "course"},
    "toy fp32 tied, unused, 1-D parameters replicated, accumulation (no_sync)":
        {"model": "toy", "tied": True, "unused": True, "accum": 2, "units": "layers", "replicate": "1-D"},
    "toy float16, 1-D parameters replicated": {"model": "toy", "dtype": torch.float16, "replicate": "1-D"},
    "LM fp32, every block recomputed in backward (torch's checkpoint_wrapper; AdamW, clipped at 1.0)":
        {"model": "lm", "adamw": True, "clip": 1.0, "recompute": "wrapper"},
    "LM fp32, every block recomputed, its hooks inside the recomputation, accumulation (no_sync)":
        {"model": "lm", "recompute": "inner", "accum": 2},
    "LM fp32, the first block frozen between trained layers (AdamW)": {"model": "lm", "adamw": True, "frozen": 0},
}


def build_case(case, args, size, steps, device):
    """The case's model (the same on every rank) and its global batches."""
    torch.manual_seed(args.seed)
    micro = case.get("accum", 1)
    if case["model"] == "toy":
        batches, in_dim, n_cls = common.verify_batches(args, steps, 8 * size * micro)
        model = common.ToyModel(in_dim, n_classes=n_cls, tied=case.get("tied", False), unused=case.get("unused", False))
    else:
        batches = [common.lm_batch(4 * size * micro, 16, i, args.seed, "cpu") for i in range(steps)]
        model = common.TransformerLM(32, 64, 2, 4, context_length=16) if case["model"] == "lm" else common.EncoderLM()
    return model.to(device), [(x.to(device), y.to(device)) for x, y in batches]


def make_optimizer(case, params):
    # AdamW's eps 1e-6: its division turns last-bit differences in nearly-cancelling
    # gradients into visible ones (see 08); the check is on FSDP
    params = list(params)
    if case.get("groups"):   # as training loops often do: no weight decay on norms and biases
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6) if case.get("adamw") else \
        torch.optim.SGD(params, lr=0.05, momentum=0.9)


def verify_case(ctx, args, case, group=None, steps=5):
    """Train FSDP on this rank's part of every global batch and one process on the whole
    batches (cast like FSDP's compute dtype); compare every parameter, gathered, by name."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dtype, micro = case.get("dtype"), case.get("accum", 1)
    ref, batches = build_case(case, args, size, steps, ctx.device)
    if case.get("recompute"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(ref.blocks):
            ref.blocks[i] = checkpoint_wrapper(block)
    if "frozen" in case:
        ref.blocks[case["frozen"]].requires_grad_(False)
    copy_ = copy.deepcopy(ref)
    units = [copy_.fc1, copy_.fc2, copy_.fc3, copy_.head] if case.get("units") == "layers" else None
    if case.get("recompute") == "inner":
        units = [w._checkpoint_wrapped_module for w in copy_.blocks]
    model = FSDP(copy_, compute_dtype=dtype, process_group=group, units=units,
                 replicate=REPLICATE.get(case.get("replicate")))
    opt, ref_opt = make_optimizer(case, model.parameters()), make_optimizer(case, ref.parameters())
    shapes_ok, replicated = True, []
    for step, (x, y) in enumerate(batches):
        extra = {"use_extra": step % 2 == 0} if case.get("unused") else {}
        ref_opt.zero_grad()
        _reference_step(ref, x, y, dtype, micro, case.get("clip"), extra)
        ref_opt.step()
        train_step(model, opt, (common.shard(x, rank, size), common.shard(y, rank, size)), common.StepClock(ctx.device),
                   micro, case.get("clip"), **extra)
        shapes_ok &= all(p.grad is None or (p.grad.shape == p.shape and p.grad.dtype == p.dtype)
                         for p in model.parameters())
        replicated.append({n: p.grad.cpu() for n, p in model.module.named_parameters()   # whole: the same on every rank
                           if model._where[id(p)][1] is None and p.grad is not None})
    everyone = [None] * size
    dist.all_gather_object(everyone, replicated, group=group)
    same = all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
               for r in everyone for a, b in zip(r, everyone[0]))
    return compare_whole(ctx, model.gather_full_params(), ref, LOW_PRECISION_TOL if dtype else {}, group,
                         shapes_ok=shapes_ok, replicated_equal=same,
                         replicated=sum(len(step) for step in replicated))


def compare_whole(ctx, whole, ref, tol, group, **extra):
    """Gathered whole parameters against the reference's, by name, gathered over the group."""
    diff, ok = 0.0, True
    for name, p in ref.named_parameters():
        diff = max(diff, (whole[name].double() - p.detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(whole[name], p.detach(), **tol)
        except AssertionError:
            ok = False
    local = {"ok": ok and set(whole) == {n for n, _ in ref.named_parameters()}, "max_diff": diff, **extra}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    flags = {k: all(r[k] for r in everyone) for k, v in extra.items() if isinstance(v, bool)}
    return {**extra, **flags, "ok": all(r["ok"] for r in everyone) and all(flags.values()),
            "max_diff": max(r["max_diff"] for r in everyone)}


def verify(ctx, args, cases=None, group=None):
    """Every case of CASES (or those named), with --compute-dtype's low precision in place
    of float16 when given; ``group`` shards over a subgroup."""
    low = common.DTYPES.get(getattr(args, "compute_dtype", "float32")) or torch.float16
    out = {}
    for name in cases or CASES:
        case = dict(CASES[name])
        if case.get("dtype") is not None:
            case["dtype"] = low
            name = name.replace("float16", str(low).replace("torch.", ""))
        out[name] = verify_case(ctx, args, case, group)
    if getattr(args, "dtype", "float32") == "bf16" and not cases:
        out.update(verify_bf16(ctx, args, group))
    return out


def verify_bf16(ctx, args, group=None, steps=10):
    """--dtype bf16: FSDP with bf16 weights and float32 gradient reduction, on the LM
    (SGD: see 05's verify_bf16), against one process computing in bf16 (LOW_PRECISION_TOL);
    and each step's loss against one float32 process's (within common.BF16_LOSS_BOUND)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    case = {"model": "lm", "dtype": torch.bfloat16}
    ref, batches = build_case(case, args, size, steps, ctx.device)
    fp32 = copy.deepcopy(ref)
    model = FSDP(copy.deepcopy(ref), torch.bfloat16, process_group=group, reduce_dtype=torch.float32)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fp32, model)]
    gap = 0.0
    for x, y in batches:
        opts[0].zero_grad()
        _reference_step(ref, x, y, torch.bfloat16)
        opts[0].step()
        opts[1].zero_grad()
        loss = fp32(x, y)
        loss.backward()
        opts[1].step()
        opts[2].zero_grad()
        mine = model(common.shard(x, rank, size), common.shard(y, rank, size))
        mine.backward()
        model.finish_gradient_synchronization()
        opts[2].step()
        mine = mine.detach().float()
        dist.all_reduce(mine, group=group)
        gap = max(gap, abs(mine.item() / size - loss.item()))
    same = compare_whole(ctx, model.gather_full_params(), ref, LOW_PRECISION_TOL, group)
    return {"LM bfloat16, gradients reduced in float32, against one process in bfloat16": same,
            f"LM bfloat16, gradients reduced in float32: each of {steps} losses within {common.BF16_LOSS_BOUND} of "
            f"float32's": {"ok": gap <= common.BF16_LOSS_BOUND, "max_diff": gap}}


# ----------------------------------------------------------------------------------------
# Checkpoints: save at one world size, resume at another
# ----------------------------------------------------------------------------------------
def resume_run(ctx, args, path, start, stop, save_at, batch, replicate=None):
    """The LM of the verification, FSDP + AdamW (clipped at 1.0), trained from ``start`` to
    ``stop`` on the same global batches whatever the world size; loads ``path`` when
    start > 0, saves it (whole tensors, from the first rank) after step ``save_at``.
    Returns the whole parameters at the end. ``replicate``: a rule of REPLICATE."""
    case = {"model": "lm", "adamw": True}
    ref, batches = build_case(case, args, batch // 4, stop, ctx.device)   # batch sequences
    model = FSDP(ref, replicate=REPLICATE.get(replicate))
    opt = make_optimizer(case, model.parameters())
    if start:
        saved = torch.load(path, weights_only=True)
        model.load_full_state_dict(saved["model"])
        model.load_full_optim_state_dict(opt, saved["optim"])
    for step in range(start, stop):
        x, y = batches[step]
        train_step(model, opt, (common.shard(x, ctx.rank, ctx.world_size), common.shard(y, ctx.rank, ctx.world_size)),
                   common.StepClock(ctx.device), max_norm=1.0)
        if step + 1 == save_at:
            state = {"model": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
            if ctx.rank == 0:
                torch.save(state, path)
            dist.barrier()
    return {k: v.cpu() for k, v in model.gather_full_params().items()}


def resume_run_course_rule(ctx, args, path, start, stop, save_at, batch):
    """resume_run with the norms replicated (the course's rule), the rest sharded."""
    return resume_run(ctx, args, path, start, stop, save_at, batch, replicate="course")


# ----------------------------------------------------------------------------------------
# Benchmark: memory and time against DDP, DDP + sharded optimizer and torch's FSDP2
# ----------------------------------------------------------------------------------------
def torch_fsdp2(model, ctx, reshard_after_forward=None, **policy):
    """torch's FSDP2 on the same units: fully_shard on every block, then on the root
    (``reshard_after_forward`` False: the weights stay whole from forward to backward, as
    ZeRO-2 keeps them; None: fully_shard's default, the root's stay; ``policy``: its other
    arguments, mp_policy say)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    if reshard_after_forward is not None:
        policy["reshard_after_forward"] = reshard_after_forward
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return common.load_script(common.ROOT / "05_bucketed_ddp.py").LoopWrapper(model)   # FSDP2 waits inside backward


def recomputed(model):
    """Every block of the LM recomputed in backward: torch's checkpoint_wrapper around it
    (non-reentrant), what FSDP or fully_shard then takes as a unit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


# --methods: the groups of the tables, each of ours with the torch FSDP2 it is compared with
METHOD_GROUPS = ("ddp", "sharded", "fsdp", "recomputed", "bf16")


def methods(args, ctx):
    """{name: (wrap the model, optimizer or None: AdamW)} of --methods' groups; each of our
    FSDP methods is followed by the torch FSDP2 method it is compared with."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    sharded = common.load_script(common.ROOT / "06_sharded_optimizer.py")
    dt = common.DTYPES[args.compute_dtype]
    groups = {
        "ddp": {"DDP (DDPBucketed 25 MB) + AdamW": (lambda m: bucketed.DDPBucketed(m, 25), None)},
        "sharded": {"DDP + ShardedOptimizer(AdamW)": (lambda m: bucketed.DDPBucketed(m, 25),
                                                      sharded.make_optimizer("sharded"))},
        "fsdp": {f"FSDP ({args.compute_dtype}) + AdamW": (lambda m: FSDP(m, dt), None),
                 "torch FSDP2 (fully_shard per block) + AdamW": (lambda m: torch_fsdp2(m, ctx), None)},
        "recomputed": {f"FSDP ({args.compute_dtype}), blocks recomputed + AdamW": (lambda m: FSDP(recomputed(m), dt),
                                                                                   None),
                       "torch FSDP2, blocks recomputed + AdamW": (lambda m: torch_fsdp2(recomputed(m), ctx), None)}}
    if getattr(args, "dtype", "float32") == "bf16":   # the course's mixed precision, ours and FSDP2's policy
        from torch.distributed.fsdp import MixedPrecisionPolicy
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        groups["bf16"] = {"FSDP (bf16, gradients reduced in float32) + AdamW": (
                              lambda m: FSDP(m, torch.bfloat16, reduce_dtype=torch.float32), None),
                          "torch FSDP2, MixedPrecisionPolicy(bf16, float32) + AdamW": (
                              lambda m: torch_fsdp2(m, ctx, mp_policy=policy), None)}
    chosen = getattr(args, "methods", None) or METHOD_GROUPS
    return {name: m for g in METHOD_GROUPS if g in chosen and g in groups for name, m in groups[g].items()}


def train(ctx, args):
    """--train: the LM of --model-size under FSDP over every rank (AdamW, clipped at 1.0),
    trained from the newest checkpoint in --checkpoint-dir (common.train_with_checkpoints:
    saves, resumes, the final sha256); step i's global batch depends on i alone."""
    model = FSDP(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed),
                 common.DTYPES[args.compute_dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        x, y = (common.shard(t, ctx.rank, ctx.world_size)
                for t in common.lm_batch(args.batch_size, args.context_length, i, args.seed, ctx.device))
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        model.finish_gradient_synchronization()
        model.clip_grad_norm_(1.0)
        opt.step()
    return common.train_with_checkpoints(ctx, args, model.module, opt, step)


class HostPeak:
    """The peak growth of this process's resident memory while the block runs (a thread
    reads /proc/self/statm every millisecond; Linux; None elsewhere). Memory the allocator
    had freed and reuses does not show: a lower bound of what the block held."""

    def __enter__(self):
        self.page, self.peak, self.stop = os.sysconf("SC_PAGE_SIZE"), 0, threading.Event()
        self.start = self.read()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def read(self):
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page
        except OSError:
            return None

    def watch(self):
        while not self.stop.is_set():
            now = self.read()
            if now is not None and self.start is not None:
                self.peak = max(self.peak, now - self.start)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.mb = self.peak / 2**20 if self.start is not None else None


def checkpoint_benchmark(ctx, args, folder):
    """Ours (07's FSDP, save_sharded, sync and async) beside torch's (FSDP2,
    torch.distributed.checkpoint.save and async_save) on the same LM and ranks: the step
    alone; the time a save blocks the loop; for async, the next step's time (the writer
    thread beside it) and the save's time until it is on disk; the growth of host memory
    during the save (the snapshot); the bytes written. Each save 3 times, the median."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size)
                  for t in common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    rows = []
    apart = dist.new_group(backend="gloo")   # dcp's own collectives, off the training's group: async_save's run
    for owner in ("ours", "torch"):          # in its thread beside the next step's all-gathers
        lm = common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)
        model = FSDP(lm) if owner == "ours" else torch_fsdp2(lm, ctx)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            model(*batch).backward()
            model.finish_gradient_synchronization()
            opt.step()
            common.sync(ctx.device)
        for _ in range(2):
            step()
        plain = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
        for mode in ("sync", "async"):
            blocked, after, total, peaks = [], [], [], []
            for k in range(3):
                path = os.path.join(folder, f"{owner}-{mode}-{k}")
                dist.barrier()
                with HostPeak() as host:
                    t0 = time.perf_counter()
                    if owner == "ours":
                        sharded_checkpoint.save_sharded(model.module, opt, path, k, async_save=mode == "async")
                    else:
                        sd = dict(zip(("model", "optim"), get_state_dict(lm, opt)))
                        pending = (dcp.async_save if mode == "async" else dcp.save)(sd, checkpoint_id=path,
                                                                                    process_group=apart)
                    blocked.append(time.perf_counter() - t0)
                    t1 = time.perf_counter()
                    if mode == "async":
                        step()
                        after.append(time.perf_counter() - t1)
                        if owner == "ours":
                            sharded_checkpoint.wait_for_saves()
                        else:
                            pending.result()
                    total.append(time.perf_counter() - t0)   # async: until on disk, the step beside it included
                peaks.append(host.mb)
                dist.barrier()
            written = sum(os.path.getsize(os.path.join(d, f))
                          for d, _, fs in os.walk(os.path.join(folder, f"{owner}-{mode}-0")) for f in fs)
            med = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
            name = {("ours", "sync"): "ours: save_sharded", ("ours", "async"): "ours: save_sharded(async_save=True)",
                    ("torch", "sync"): "torch: dcp.save", ("torch", "async"): "torch: dcp.async_save"}[owner, mode]
            rows.append({"method": name,
                         "rank": ctx.rank, "step_ms": med(plain), "blocked_ms": med(blocked),
                         "step_during_write_ms": med(after), "save_total_ms": med(total),
                         "rss_growth_MB": max((p for p in peaks if p is not None), default=None),
                         "written_MB": written / 2**20})
        del model, opt
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, rows)
    return [r for part in everyone for r in part]


def build(ctx, args, wrap, optimizer):
    model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
    params = list(model.parameters())
    return model, optimizer(params) if optimizer else torch.optim.AdamW(params, lr=1e-4)


class StepPeak:
    """The peak of live tensor bytes during one step, measured the same way for every method.
    On a GPU: max_memory_allocated over the step. On the CPU, where the allocator keeps no
    such count: c10's CPU allocator is told to keep a running total of its live bytes (its
    flag caffe2_report_cpu_memory_usage, set through ctypes, so that frees in gloo's threads
    count too), and torch.profiler (profile_memory) records that total at every allocation
    and free from the moment the block is entered; that must come before the model is built,
    so that every free meets its allocation. The profiler's own buffers swell the process,
    so a CPU job that reads its peak RSS passes ``profile=False`` (peak: None).

        with StepPeak(device) as mem:
            model, opt = build(); train_step(...)   # earlier steps make the optimizer state
            with mem.step():
                train_step(...)
        mem.peak                                     # bytes
        mem.held                                     # bytes the step left alive (its activations, if
                                                     # it is a forward without its backward)
    """

    def __init__(self, device, profile=True):
        self.device, self.profile, self.peak, self.held, self.prof = device, profile, None, None, None

    def __enter__(self):
        if self.device.type == "cpu" and self.profile:
            import ctypes
            import gc
            gc.collect()   # an earlier model's cycles freed now, not inside the count
            from torch.profiler import ProfilerActivity, profile
            c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            self.flag = ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage")
            self._spend_the_warning()
            self.flag.value = True
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def _spend_the_warning(self):
        """c10 logs a warning the first time (then every 1000th) a block allocated before the
        count is freed during it. Such frees are expected here and simply not counted (a
        block a worker's setup allocated, freed by the collector inside the step), so the
        one warning is spent on a block of our own, with this process's stderr silenced."""
        block = torch.empty(16)
        self.flag.value = True
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            del block
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)

    @contextlib.contextmanager
    def step(self):
        if self.device.type == "cpu":
            with torch.profiler.record_function("measured step"):
                time.sleep(0.01)       # frees in gloo's threads land, then an allocation
                torch.empty(1)         # records the total at the start (for self.held)
                yield
                time.sleep(0.01)
                torch.empty(1)         # and at the end
            return
        common.sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device)
        yield
        common.sync(self.device)
        self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated(self.device))
        self.held = torch.cuda.memory_allocated(self.device) - start

    def __exit__(self, *exc):
        if self.prof is None:
            return
        self.prof.__exit__(*exc)
        self.flag.value = False   # blocks from before the block are freed later (the group's): not counted, no warning
        from torch._C._profiler import _EventType
        nodes, events = list(self.prof.profiler.kineto_results.experimental_event_tree()), []
        while nodes:
            node = nodes.pop()
            nodes += node.children
            events.append(node)
        marks = sorted((e for e in events if e.name == "measured step"), key=lambda e: e.start_time_ns)
        allocs = sorted((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size) for e in events
                        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu")
        if not allocs:   # (a block that allocated nothing: one that failed first, say)
            return
        base = allocs[0][1] - allocs[0][2]   # what an earlier block in this process left alive
        for mark in marks:                   # each measured step; the highest peak, the last one's held bytes
            before = [total for when, total, _ in allocs if when < mark.start_time_ns][-1:]   # the step starts there
            during = [total for when, total, _ in allocs if mark.start_time_ns <= when <= mark.end_time_ns]
            if not during:   # (a step that allocated nothing)
                continue
            self.peak = max(self.peak or 0, max(before + during) - base)
            self.held = during[-1] - during[0]   # the two markers' totals


def step_memory(ctx, make, batch, live=True, steps=4, measured=3) -> dict:
    """Memory per rank (MiB) of ``make()``'s (model, optimizer): the state kept after the
    last of ``steps`` training steps (parameters, gradients, optimizer state: tensor bytes,
    each storage once; the first step makes the optimizer state, DDPBucketed's buckets and
    FSDP's unit order), the highest peak of live tensor bytes during each of the last
    ``measured`` steps (StepPeak; on the CPU only with ``live``: where a collective's buffers
    are freed by another thread, the peak moves with its timing, and the worst step is the
    one that counts), and the process's peak RSS (which also holds what the allocator keeps,
    and the runtime; on the CPU only without ``live``)."""
    sharded = common.load_script(common.ROOT / "06_sharded_optimizer.py")
    with StepPeak(ctx.device, profile=live) as mem:
        model, opt = make()
        for i in range(steps):
            with mem.step() if i >= steps - measured else contextlib.nullcontext():
                train_step(model, opt, batch, common.StepClock(ctx.device))
    snap = sharded.memory_snapshot(ctx, "after a step", model, opt)
    row = {k: snap[k] for k in ("params_MB", "grads_MB", "opt_state_MB")}
    row["state_MB"] = row["params_MB"] + row["grads_MB"] + row["opt_state_MB"]
    profiled = ctx.device.type == "cpu" and live
    return {**row, "step_peak_MB": None if mem.peak is None else mem.peak / 2**20,
            "peak_rss_MB": None if profiled else sharded._rss_peak_mb()}


def memory_worker(ctx, args, index):
    """step_memory of method ``index`` on the LM, every rank's row. On the CPU twice in this
    fresh process: first unprofiled, for the peak RSS (read before the profiler's buffers
    swell the process), then profiled, for the peak of live tensor bytes."""
    name, (wrap, optimizer) = list(methods(args, ctx).items())[index]
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size) for t in
                  common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    make = lambda: build(ctx, args, wrap, optimizer)  # noqa: E731
    row = step_memory(ctx, make, batch, ctx.device.type == "cuda")
    if ctx.device.type == "cpu":
        row["step_peak_MB"] = step_memory(ctx, make, batch, True)["step_peak_MB"]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, row)
    return [{"method": name, "rank": r, **row} for r, row in enumerate(everyone)]


def benchmark(ctx, args):
    """DDP, DDP + ShardedOptimizer, FSDP and torch's FSDP2 on the LM, steps alternating."""
    def method(wrap, optimizer):
        def make():
            model, opt = build(ctx, args, wrap, optimizer)
            return lambda batch, clock: train_step(model, opt, batch, clock)
        return make
    rows = common.time_methods(ctx, args, {name: method(*m) for name, m in methods(args, ctx).items()},
                               time_box=getattr(args, "time_box", None))
    for r in rows:
        r["optim_ms"] = r["stats"]["optim"]["median"] * 1e3
    for ours, theirs in zip(rows, rows[1:]):   # each FSDP over the FSDP2 after it, their steps alternating
        if ours["method"].startswith("FSDP"):
            ours.update(common.vs_paired(ours, theirs))
    return rows


HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "vs_torch", "vs_torch_min", "vs_torch_max", "comm_ms",
           "optim_ms", "collectives", "comm_MB"]
MEM_HEADERS = ["method", "rank", "params_MB", "grads_MB", "opt_state_MB", "state_MB", "step_peak_MB",
               "vs_fsdp2", "peak_rss_MB", "rss_vs_fsdp2"]
CKPT_HEADERS = ["method", "rank", "step_ms", "blocked_ms", "step_during_write_ms", "save_total_ms", "rss_growth_MB",
                "written_MB"]
CKPT_TITLE = ("Sharded checkpoints: ours (07's FSDP, save_sharded) beside torch's (FSDP2, torch.distributed.checkpoint), "
              "the time a save blocks the loop, a step while an async save writes, host memory")
NAME, TITLE = "07_fsdp", "FSDP against DDP, DDP + sharded optimizer and torch's FSDP2: time per iteration"


def main(argv=None):
    p = common.script_parser(__doc__)
    p.add_argument("--compute-dtype", choices=list(common.DTYPES), default="float32",
                   help="dtype of gathered weights, communication and compute (master stays float32)")
    common.add_dtype_flag(p)   # bf16: also FSDP's bf16 weights with float32 gradient reduction, beside FSDP2's
    common.add_train_flags(p)
    p.add_argument("--methods", nargs="+", choices=METHOD_GROUPS, default=None,
                   help="the tables' methods, each of ours with its torch FSDP2: ddp (DDPBucketed), sharded (DDP + "
                        "ShardedOptimizer), fsdp, recomputed (blocks recomputed), bf16 (with --dtype bf16) "
                        "(default: all)")
    p.add_argument("--time-box", type=common.SECONDS, default=None,
                   help="seconds after which no further method starts, in the memory table (a job each) and on a "
                        "GPU in the timing table (one after another there); what ran is saved")
    p.add_argument("--checkpoint-bench", action="store_true",
                   help="time sharded checkpoints instead of the step and memory tables: save_sharded (sync, async) "
                        "beside torch.distributed.checkpoint's save and async_save on FSDP2 (results/07_checkpoint)")
    common.check_train_flags(p.parse_args(argv))
    args = common.parse(p, argv)
    if not args.no_bench and args.methods and "bf16" in args.methods and args.dtype != "bf16":
        raise common.UsageError("--methods bf16 is FSDP's bf16 beside FSDP2's policy: it needs --dtype bf16")
    if args.train:
        common.launch(train, args)
        return
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
        common.check_resume(resume_run_course_rule, args, f"{NAME}: a full checkpoint on another world size "
                                                          f"(norms replicated, the rest sharded)")
    if args.no_bench:
        return
    if args.checkpoint_bench:
        return report_checkpoints(args)
    started = time.perf_counter()
    rows = common.launch(benchmark, args)
    names = list(methods(args, None))
    left = [n for n in names if n not in {r["method"] for r in rows}]
    common.report_table(args, NAME, TITLE, rows, HEADERS, note=time_box_note(args, left))
    # one job per method: fresh processes, so each peak belongs to that method alone
    mem = []
    for i, name in enumerate(names):
        if args.time_box is not None and mem and time.perf_counter() - started > args.time_box:
            left = names[i:]
            break
        mem += common.launch(memory_worker, args, i)
        left = []
    if common.is_reporter():
        report_memory(args, mem, time_box_note(args, left))


def time_box_note(args, left) -> str:
    """The line a table gets for the methods the time box left out."""
    if not left:
        return ""
    note = f"Time box ({args.time_box:g} s) reached: not run: {', '.join(left)}."
    if common.is_reporter():
        print(note)
    return note


def report_checkpoints(args):
    """--checkpoint-bench: the checkpoint table (results/07_checkpoint)."""
    folder = tempfile.mkdtemp(prefix="kit_ckpt_bench_")   # the same folder on every rank: one machine here
    try:
        rows = common.launch(checkpoint_benchmark, args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    common.report_table(args, "07_checkpoint", CKPT_TITLE, rows, CKPT_HEADERS)


def report_memory(args, mem, also=""):
    """The memory table, each method's peaks beside torch FSDP2's on the same rank (ours
    beside the FSDP2 that follows it; DDP's beside plain FSDP2's)."""
    names = list(dict.fromkeys(r["method"] for r in mem))
    theirs = {a: b for a, b in zip(names, names[1:]) if a.startswith("FSDP") and b.startswith("torch FSDP2")}
    plain = "torch FSDP2 (fully_shard per block) + AdamW"
    theirs.update({n: plain for n in names if n.startswith("DDP") and plain in names})
    theirs.update({n: n for n in names if n.startswith("torch FSDP2")})
    by = {(r["method"], r["rank"]): r for r in mem}
    for r in mem:   # (none where --methods or the time box left the FSDP2 to compare with out)
        ref = by.get((theirs.get(r["method"]), r["rank"]))
        r["vs_fsdp2"] = r["step_peak_MB"] / ref["step_peak_MB"] if ref else None
        r["rss_vs_fsdp2"] = r["peak_rss_MB"] / ref["peak_rss_MB"] if ref else None
    how = ("max_memory_allocated during a step" if args.device == "cuda" else
           "peak of live tensor bytes during a step, from every allocation and free torch.profiler recorded")
    note = (f"state = parameters + gradients + optimizer state after a step; step_peak = {how}; peak_rss = "
            f"the process's peak resident memory (allocator cache and runtime included); vs_fsdp2: over torch "
            f"FSDP2's on the same rank (a bf16 method: over FSDP2 with the same MixedPrecisionPolicy; blocks "
            f"recomputed: over FSDP2 with the same checkpoint_wrapper). One job per method." + (f" {also}" if also else ""))
    table = common.save_results(args.out, "07_fsdp_memory", mem, common.lm_settings(args), headers=MEM_HEADERS,
                                title="FSDP against DDP and torch's FSDP2: memory per rank (MiB)", note=note)
    print(f"\nMemory per rank (MiB; {note})\n{table}\n{common.wrote(args.out, '07_fsdp_memory.json and .md')}")

if __name__ == "__main__":
    common.run_main(main)
