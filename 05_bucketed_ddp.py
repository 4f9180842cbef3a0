"""Bucketed, overlapped DDP: gradients live in flat per-bucket buffers, and each bucket is
all-reduced asynchronously as soon as all its gradients are ready during backward.

Buckets trade the two costs of the earlier scripts: fewer calls than per-parameter
all-reduce (each call has a fixed cost), and communication that still overlaps backward
(unlike one flat all-reduce after it).

Run:
    python 05_bucketed_ddp.py --world-size 2 --bucket-mb 10
    python 05_bucketed_ddp.py                      # sweep 1 10 100 MB on two models against torch DDP
    torchrun --standalone --nproc-per-node 2 05_bucketed_ddp.py --bucket-mb 1 25

Prints PASS/FAIL per verification case, then a table of step time and exposed
communication for each model (--models: the kit's LM and an nn.TransformerEncoderLayer
model of the same size) and bucket size next to torch.nn.parallel.DistributedDataParallel at
the same bucket_cap_mb (its first bucket left at its 1 MiB default; vs_torch_ddp is the
median of the paired steps' ratios, with their min and max) and plain training with no wrapper (all three in the same
processes, measured interleaved step by step on CPU; vs_plain is each wrapper's cost over
plain training), plus per-parameter (04) and flat (03) DDP as the two ends. Then it fits the all-reduce cost t = o + bytes/w
and prints the bucket size the overhead model predicts beside the measured best.
Writes <out>/05_bucketed_ddp.{json,md} and <out>/05_bucket_sweep.png. Each bucket size
is its own job (fresh processes) and the table is rewritten after each, so a run cut short
keeps what it measured; --time-box stops starting new sizes after that many seconds.
"""

import argparse
import copy
import statistics
import time

import common

# ---- begin copy: DDPBucketed (needs torch, the standard library and placement.py) ----
import contextlib
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from placement import hold_storage, make_real, place

NCCL_IN_PLACE_MB = 1.0   # DDPBucketed's in_place_mb on an NCCL group where none is given (chosen, not measured)


def in_place_skip(backend: str, device_type: str) -> str:
    """Why gradients on ``device_type`` cannot be all-reduced where they lie over ``backend``
    ("" where they can): CPU tensors (gloo's coalesced all-reduce) and NCCL's GPU tensors can."""
    if device_type not in ("cpu", "meta") and not (device_type == "cuda" and "nccl" in str(backend)):
        return "gloo's coalesced all-reduce takes CPU tensors only (on a GPU only NCCL reduces gradients in place)"
    return ""


def start_all_reduce_coalesced(tensors, op, group=None):
    """Start one all-reduce of ``tensors`` (NCCL runs them as one group); returns its Work.
    The group's own call, which torch.distributed.all_reduce_coalesced makes too: that one
    hands back a Future, and a Future's wait() leaves NCCL's hold on the tensors to NCCL's
    watchdog thread. Gradients that zero_grad() frees then stay allocated until the watchdog
    looks, and the next backward allocates afresh (on a GPU: cudaMalloc, docs/05). Work.wait()
    lets go of them at once."""
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp, opts.asyncOp = op, True
    return (group or dist.group.WORLD).allreduce_coalesced(tensors, opts)


class DDPBucketed(nn.Module):
    """Overlapped data parallelism with gradient buckets (like torch DDP with
    ``gradient_as_bucket_view=True``).

        model = DDPBucketed(MyModel().to(device), bucket_size_mb=25)   # broadcasts the group's first rank's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()                          # each full bucket is all-reduced during backward
        model.finish_gradient_synchronization()  # wait; every gradient is now the average
        opt.step()

    ``process_group`` (default: every rank) is the data-parallel group. Buckets hold at
    most ``bucket_size_mb`` MiB of gradients each, the first one at most ``first_bucket_mb``
    (so communication starts early), a larger parameter a bucket of its own; one dtype and
    device per bucket; tied parameters appear once and frozen ones not at all. Until the
    first synchronized step they follow reverse ``module.parameters()`` order; that step
    records the order in which gradients really arrive, every rank adopts the group's first
    rank's record (parameters without a gradient then go last), and the buckets are rebuilt
    in that order once. Each parameter's ``.grad`` is a view into its bucket's flat buffer:
    no second copy of the gradients, no copy back after the all-reduce. ``zero_grad()``
    works with ``set_to_none`` True or False (a fresh gradient is moved into its view).
    A gradient of ``in_place_mb`` MiB or more is not moved: it is all-reduced where autograd
    left it, in the same call as the rest of its bucket (``start_all_reduce_coalesced``, whose
    Work the bucket waits on), which on a GPU saves a pass over every large gradient
    (default: 1 MiB on an NCCL group; on gloo, whose coalesced call copies anyway and takes
    CPU tensors only, never). On NCCL the average is NCCL's own (``ReduceOp.AVG``); elsewhere
    the gradients are divided before the sum.

    Bucket k is launched only after buckets 0..k-1, so all ranks issue the same collectives
    in the same order. Buckets that never filled (a parameter got no gradient) are reduced
    in ``finish_gradient_synchronization`` with zeros for the missing parts; one flag per
    parameter rides at the end of each bucket, so a parameter that no rank gave a gradient
    keeps ``.grad is None``, as in single-process training. Inside ``no_sync()`` backward
    only accumulates; the next synchronized backward reduces the sum. If the wrapped module
    synchronizes gradients itself (FSDP over a shard group, making this hybrid sharding:
    shard within a group, replicate across groups), its ``no_sync`` is entered with ours
    and its ``finish_gradient_synchronization`` runs before ours. ``ignore_parameters``:
    parameters left alone (neither broadcast nor reduced), such as a mixture of experts'
    experts, which differ from rank to rank (torch DDP's parameters to ignore). Every other
    parameter records a "replicate" placement over the group (placement.py),
    so that a clip_grad_norm_ or a checkpoint over a composition of axes counts it once.
    A model built on the meta device is not broadcast: placement.materialize gives it storage
    (the buckets built again there) and the same values on every rank (docs/10).
    """

    wraps_module = True   # its parameters' names are its module's (placement.materialize)

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group=None,
                 first_bucket_mb: float = 1.0, ignore_parameters=(), in_place_mb: float | None = None):
        super().__init__()
        if not bucket_size_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket_size_mb and first_bucket_mb must be positive, got {bucket_size_mb}, "
                             f"{first_bucket_mb}")
        if in_place_mb is not None and not in_place_mb >= 0:
            raise ValueError(f"in_place_mb must be 0 or more (or None: the backend's default), got {in_place_mb}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._in_place_mb = in_place_mb
        self._src = dist.get_global_rank(process_group or dist.group.WORLD, 0)   # the group's first rank
        ignored = {id(p) for p in ignore_parameters}
        with torch.no_grad():   # a model built on meta gets its values later, the same on every rank (materialize)
            for t in [p for p in module.parameters() if id(p) not in ignored] + list(module.buffers()):
                if not t.is_meta:
                    dist.broadcast(t, src=self._src, group=process_group)
        self._caps = (min(first_bucket_mb, bucket_size_mb) * 2**20, bucket_size_mb * 2**20)
        for p in module.parameters():
            if id(p) not in ignored:
                place(p, "replicate", process_group)   # a copy on every rank of the group
        self._params = [p for p in module.parameters() if p.requires_grad and id(p) not in ignored]
        self._build(list(range(len(self._params)))[::-1])
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            if p.is_meta:
                hold_storage(p, self)
        self._arrived, self._rebuilt = [], False   # gradient order seen before the rebuild
        self._next = 0                  # the next bucket to launch
        self._sync = True

    def _build(self, order):
        """Buckets along ``order`` (parameter indices), the first capped lower."""
        groups, open_ = [], {}          # groups: lists of parameter indices, in bucket order
        for i in order:
            p = self._params[i]
            key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
            g = open_.get(key)
            if g is None or g[1] + nbytes > self._caps[min(len(groups), 1) if g is None else g[2]]:
                g = open_[key] = [[], 0, min(len(groups), 1)]   # indices, bytes, which cap
                groups.append(g[0])
            g[0].append(i)
            g[1] += nbytes
        self.buckets = [_Bucket([self._params[i] for i in idx], self.process_group, self.world_size,
                                self._in_place_mb) for idx in groups]
        self._slot = [None] * len(self._params)   # parameter index -> (bucket, place in it)
        for bucket, idx in zip(self.buckets, groups):
            for j, i in enumerate(idx):
                self._slot[i] = (bucket, j)

    @torch.no_grad()
    def materialize_storage(self, device):
        """For placement.materialize: the parameters real on ``device`` (where an axis inside
        has not made them so), and the buckets built again there."""
        for p in self._params:
            if p.is_meta:
                make_real(p, device=device)
        self._build(list(range(len(self._params)))[::-1])

    @property
    def bucket_sizes_mb(self):
        return [b.nbytes / 2**20 for b in self.buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients locally and communicates nothing."""
        prev, self._sync = self._sync, False
        try:
            with getattr(self.module, "no_sync", contextlib.nullcontext)():
                yield
        finally:
            self._sync = prev

    def _make_hook(self, i):
        me = weakref.ref(self)   # not self: torch keeps the hook where Python's collector cannot see
        # it, so a hook holding the wrapper would keep it, the model and its group alive for good

        def hook(p):   # each parameter's, every step: only what must be done per parameter
            self, grad = me(), p.grad
            if self is None or grad is None:   # autograd passed no gradient (FSDP inside hands its own over later)
                return
            if not self._rebuilt:
                self._arrived.append(i)
            bucket, j = self._slot[i]
            if not self._sync:
                bucket.attach(j, p, grad)   # accumulate in the bucket
                return
            if bucket.ready[j]:
                raise RuntimeError("backward ran twice without finish_gradient_synchronization(); "
                                   "wrap all but the last micro-batch in no_sync()")
            bucket.attach(j, p, grad)
            bucket.ready[j] = True
            bucket.remaining -= 1
            if bucket.remaining == 0:
                while self._next < len(self.buckets) and self.buckets[self._next].remaining == 0:
                    self.buckets[self._next].launch()
                    self._next += 1
        return hook

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        if hasattr(self.module, "finish_gradient_synchronization"):   # e.g. FSDP inside: its gradients first
            self.module.finish_gradient_synchronization()
        for bucket in self.buckets[self._next:]:   # never filled: launch, in order
            bucket.launch(partial=True)
        for bucket in self.buckets:
            bucket.finish()
        self._next = 0
        if not self._rebuilt:
            self._rebuild()

    def _rebuild(self):
        """Once, after the first synchronized step: buckets in the order gradients arrived on
        the group's first rank (those that got none last), the gradients moved along."""
        seen = list(dict.fromkeys(self._arrived))
        got = set(seen)
        order = seen + [i for i in reversed(range(len(self._params))) if i not in got]
        device = self._params[0].device if self._params else "cpu"
        agreed = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(agreed, src=self._src, group=self.process_group)
        self._rebuilt, self._arrived = True, []
        old = [p.grad for p in self._params]
        self._build(agreed.tolist())
        for i, (p, g) in enumerate(zip(self._params, old)):
            bucket, j = self._slot[i]
            if g is not None and bucket.views[j] is not None:   # (one reduced in place keeps its own)
                bucket.views[j].copy_(g)
                p.grad = bucket.views[j]


class _Bucket:
    """One flat buffer: the gradients of ``params`` below ``in_place_mb`` (DDPBucketed's), then
    one has-gradient flag each; larger gradients stay where autograd put them, reduced in the
    same call."""

    def __init__(self, params, process_group, world_size, in_place_mb=None):
        self.params, self.process_group, self.world_size = params, process_group, world_size
        device, size = params[0].device, params[0].element_size()
        backend = dist.get_backend(process_group)
        if in_place_mb is not None and in_place_skip(backend, device.type):
            raise ValueError(f"in_place_mb: {in_place_skip(backend, device.type)}; leave it None here")
        nccl = device.type == "cuda" and "nccl" in str(backend)
        if in_place_mb is None:
            in_place_mb = NCCL_IN_PLACE_MB if nccl else math.inf
        limit = in_place_mb * 2**20
        # on NCCL the average is its own, inside the reduction; elsewhere divide before the sum
        self.op = dist.ReduceOp.AVG if nccl and world_size > 1 else dist.ReduceOp.SUM
        self.divide = world_size > 1 and not nccl
        self.nbytes = sum(p.numel() for p in params) * size
        copied = [p.numel() * size < limit for p in params]
        numel = sum(p.numel() for p, c in zip(params, copied) if c)
        self.buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0      # a view into the buffer each, None for one reduced in place
        for p, c in zip(params, copied):
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p) if c else None)
            offset += p.numel() if c else 0
        self.in_place = [j for j, c in enumerate(copied) if not c]
        self.grads, self.flags = self.buffer[:numel], self.buffer[numel:]
        self.zeros = {}                 # j -> what a parameter reduced in place sent for a missing gradient
        self.work = None
        self.missing = False
        self._reset()

    def _reset(self):
        self.ready = [False] * len(self.params)
        self.remaining = len(self.params)

    def attach(self, j, p, grad):
        """Make p.grad (``grad``) the bucket's view: a fresh gradient is moved in (one copy;
        nothing where autograd accumulated into the view itself). One reduced in place stays
        where it is (made contiguous, as a collective needs)."""
        view = self.views[j]
        if view is None:
            if not grad.is_contiguous():
                p.grad = grad.contiguous()
        elif grad is not view:
            if torch.is_grad_enabled():     # backward(create_graph=True): the copy is no part of a graph
                with torch.no_grad():
                    view.copy_(grad)
            else:
                view.copy_(grad)
            p.grad = view

    @torch.no_grad()
    def launch(self, partial=False):
        self.missing = False
        self.flags.fill_(1)                 # (the last all-reduce summed them) here, on backward's path,
        # where a GPU's queue hides it: after backward a GPU waits for whatever the host does
        if partial:
            for j, p in enumerate(self.params):
                if p.grad is None:          # no gradient here: send zeros and a zero flag
                    if self.views[j] is None:
                        self.zeros[j] = torch.zeros_like(p)
                    else:
                        self.views[j].zero_()
                    self.flags[j] = 0
                    self.missing = True
                elif not self.ready[j]:     # accumulated earlier (no_sync) or kept by zero_grad
                    self.attach(j, p, p.grad)
        tensors = [self.buffer] + [self.params[j].grad if self.params[j].grad is not None else self.zeros[j]
                                   for j in self.in_place]
        if self.divide:
            self.grads.div_(self.world_size)
            for t in tensors[1:]:
                t.div_(self.world_size)
        if len(tensors) == 1:
            self.work = dist.all_reduce(self.buffer, op=self.op, group=self.process_group, async_op=True)
        else:
            self.work = start_all_reduce_coalesced(tensors, self.op, self.process_group)

    def finish(self):
        self.work.wait()
        self.work = None
        if self.missing:                    # give the average to those that had none here
            for j, (p, n) in enumerate(zip(self.params, self.flags.tolist())):
                if p.grad is None and n > 0:
                    p.grad = self.views[j] if self.views[j] is not None else self.zeros[j]
            self.zeros = {}
        self._reset()
# ---- end copy: DDPBucketed ----


def train_step(model, optimizer, batch, clock, micro_batches=1, set_to_none=True, dtype="float32",
               **forward_kwargs):
    """One training step on this rank's part of the global batch, timed by phase. With
    ``micro_batches`` > 1 the gradients accumulate, communicated once (at the last); with
    ``dtype`` bf16 the forward runs in autocast (the gradients, float32 as the weights, are
    reduced in float32). Returns the loss."""
    x, y = batch
    optimizer.zero_grad(set_to_none=set_to_none)
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
            with clock.phase("forward"), common.autocast(x.device, dtype):
                loss = model(xm, ym, **forward_kwargs) / micro_batches
            total += loss.detach()
            with clock.phase("backward"):
                loss.backward()
    with clock.phase("comm"):
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()
    return total


# Bucket caps that split the plain toy model (12,328 bytes of gradients) into 1, 2 and 3
# buckets, and one below every parameter's size (each parameter alone in a bucket).
TOY_CAPS = {"1 bucket": 1000.0, "2 buckets": 7000 / 2**20, "3 buckets": 6200 / 2**20, "cap < every parameter": 1e-6}
# (cap, in_place_mb): gradients of 4 KiB and more reduced where they lie, the rest copied
# (buckets holding both), and every gradient reduced where it lies (a bucket of flags only)
TOY_IN_PLACE = {"2 buckets, 4 KiB and more in place": (7000 / 2**20, 4096 / 2**20),
                "1 bucket, every gradient in place": (1000.0, 0.0)}


def verify(ctx, args, cases=None, group=None, caps=None):
    """Each case of common.VERIFY_CASES (or those named) at each bucket cap (default:
    TOY_CAPS and TOY_IN_PLACE; a cap or a (cap, in_place_mb) pair): DDPBucketed on this
    rank's part of every global batch, against one process trained on the whole batches.
    ``group``: the data-parallel group (default: every rank)."""
    results, skip = {}, in_place_skip(dist.get_backend(group), ctx.device.type)
    for label, cap in (caps or {**TOY_CAPS, **TOY_IN_PLACE}).items():
        cap, in_place = cap if isinstance(cap, tuple) else (cap, None)
        if in_place is not None and skip:
            results[f"every case [{label}]"] = {"ok": True, "skip": skip}
            continue
        for name in cases or common.VERIFY_CASES:
            run = common.VerifyRun(ctx, args, common.VERIFY_CASES[name], group)
            model = DDPBucketed(run.model, cap, process_group=group, in_place_mb=in_place)
            optimizer = run.optimizer(model.parameters())
            for step in range(run.steps):
                train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
            results[f"{name} [{label}]"] = run.compare(model.module)
    return results


def verify_bf16(ctx, args, group=None, steps=10):
    """bf16 autocast on the micro LM: DDPBucketed's weights against one process under the
    same autocast (common.TOLERANCE["autocast"]), and each step's loss (the group's mean) against one
    float32 process's (within common.BF16_LOSS_BOUND). SGD with momentum: AdamW's division
    by sqrt(v) turns bf16's rounding of near-zero gradients into steps of lr either way,
    which no tolerance on the weights separates from a wrong method."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    batches = [common.lm_batch(4 * size, 16, i, args.seed, ctx.device) for i in range(steps)]
    ref = common.build_lm("micro", 16, ctx.device, args.seed)
    models = {"bf16": copy.deepcopy(ref), "fp32": copy.deepcopy(ref)}
    model = DDPBucketed(copy.deepcopy(ref), 0.05, process_group=group)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in {**models, "ddp": model}.items()}
    losses = {"ddp": [], "fp32": []}
    for x, y in batches:
        for key, m in models.items():
            opts[key].zero_grad()
            with common.autocast(ctx.device, "bf16" if key == "bf16" else "float32"):
                loss = m(x, y)
            loss.backward()
            opts[key].step()
            if key == "fp32":
                losses["fp32"].append(loss.item())
        mine = train_step(model, opts["ddp"], (common.shard(x, rank, size), common.shard(y, rank, size)),
                          common.StepClock(ctx.device), dtype="bf16")
        dist.all_reduce(mine, group=group)
        losses["ddp"].append(mine.item() / size)
    diff, ok = 0.0, True
    for (name, p), q in zip(models["bf16"].named_parameters(), model.module.parameters()):
        diff = max(diff, (p.detach() - q.detach()).abs().max().item())
        ok &= torch.allclose(q, p, **common.TOLERANCE["autocast"])
    gap = max(abs(a - b) for a, b in zip(losses["ddp"], losses["fp32"]))
    everyone = [None] * size
    dist.all_gather_object(everyone, {"ok": ok, "diff": diff}, group=group)
    return {f"micro LM, bf16 autocast, against one process under the same autocast (rtol {common.TOLERANCE['autocast']['rtol']}, "
            f"atol {common.TOLERANCE['autocast']['atol']})": {"ok": all(e["ok"] for e in everyone),
                                                   "max_diff": max(e["diff"] for e in everyone)},
            f"micro LM, bf16 autocast, each of {steps} losses within {common.BF16_LOSS_BOUND} of float32's":
                {"ok": gap <= common.BF16_LOSS_BOUND, "max_diff": gap}}


def mixed_precision(ctx, args):
    """DDPBucketed and torch DDP at 25 MB buckets, float32 and bf16 autocast, steps
    alternating: time (each against torch's at its dtype, paired), bytes sent, and the
    bytes autograd keeps for backward in one step (the activations)."""
    def method(wrap, dtype):
        def make():
            model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return lambda batch, clock: train_step(model, opt, batch, clock, dtype=dtype)
        return make
    names = {(w, d): f"{w} {d}" for w in ("DDPBucketed", "torch DDP") for d in ("float32", "bf16")}
    wraps = {"DDPBucketed": lambda m: DDPBucketed(m, 25), "torch DDP": lambda m: torch_ddp(m, 25, ctx.device)}
    rows = {r["method"]: r for r in common.time_methods(ctx, args, {n: method(wraps[w], d) for (w, d), n in
                                                                  names.items()})}
    x, y = (common.shard(t, ctx.rank, ctx.world_size) for t in
            common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    for (w, d), n in names.items():
        model = common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)
        with common.saved_for_backward(exclude=model.parameters()) as saved, common.autocast(ctx.device, d):
            loss = model(x, y)
        del loss
        rows[n].update(wrapper=w, dtype=d, act_MB=saved.bytes / 1e6)
        if w == "DDPBucketed":
            rows[n].update(common.vs_paired(rows[n], rows[f"torch DDP {d}"], "vs_torch_ddp"))
    for d in ("float32", "bf16"):
        rows[f"DDPBucketed {d}"]["vs_float32"] = common.vs_paired(rows[f"DDPBucketed {d}"],
                                                                  rows["DDPBucketed float32"], "r")["r"]
    return list(rows.values())


MP_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "vs_torch_ddp", "vs_torch_ddp_min", "vs_torch_ddp_max",
              "vs_float32", "comm_MB", "act_MB"]
MP_NAME, MP_TITLE = "05_mixed_precision", "bf16 autocast against float32, ours and torch DDP's"


# ----------------------------------------------------------------------------------------
# Benchmark: one job per bucket size, then the unbucketed baselines
# ----------------------------------------------------------------------------------------
def rank0_decides(flag: bool) -> bool:
    """Rank 0's decision on every rank (under torchrun each rank runs main())."""
    if common.under_torchrun() and dist.is_initialized():
        box = [flag]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return flag


def lm_param_tensors(size: str) -> int:
    """How many parameter tensors the LM has (embeddings, 6 per block, final norm, head)."""
    return 2 + 6 * common.MODEL_SIZES[size][2] + 2


class LoopWrapper(nn.Module):
    """A model with nothing left to do after backward, in the kit's loop: torch's DDP and
    FSDP2 (they wait for their collectives inside backward), a bare module (no
    communication), or one whose optimizer communicates (ZeRO-2). ``no_sync()`` is the
    wrapped model's where it has one, else there is nothing to skip;
    ``finish_gradient_synchronization()`` does nothing."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return getattr(self.module, "no_sync", contextlib.nullcontext)()

    def finish_gradient_synchronization(self):
        pass


def torch_ddp(module, cap_mb, device):
    from torch.nn.parallel import DistributedDataParallel
    return LoopWrapper(DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                               bucket_cap_mb=cap_mb))


def no_wrapper(module):
    """Plain training on this rank's part of the batch: no communication at all."""
    return LoopWrapper(module)


MODELS = {"lm": common.build_lm,                 # the kit's LM (RMSNorm, fused qkv, GELU MLP)
          "encoder": common.build_encoder_lm}     # the same size in nn.TransformerEncoderLayer's


def lm_method(ctx, args, wrap, n_buckets=None, model="lm"):
    """make() for common.time_methods: the model wrapped by ``wrap``, AdamW, train_step (in
    --dtype)."""
    def make():
        model_ = wrap(MODELS[model](args.model_size, args.context_length, ctx.device, args.seed))
        return _stepper(model_, n_buckets, getattr(args, "dtype", "float32"))
    return make


def _stepper(model, n_buckets, dtype="float32"):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch, clock):
        train_step(model, optimizer, batch, clock, dtype=dtype)
        if n_buckets is not None:   # after the first step's rebuild
            n_buckets[:] = [len(model.buckets)]
    return step


def benchmark(ctx, args, model, cap, fit=False):
    """One model and bucket size: DDPBucketed, torch DDP at the same bucket_cap_mb (its
    first bucket left at its default) and plain training (no wrapper), steps alternating;
    vs_torch_ddp is the median of the paired steps' ratios. With ``fit``, also fits the
    all-reduce cost."""
    n_buckets = []
    rows = common.time_methods(ctx, args, {
        f"DDPBucketed {cap:g} MB": lm_method(ctx, args, lambda m: DDPBucketed(m, cap, in_place_mb=args.in_place_mb),
                                             n_buckets, model),
        f"torch DDP {cap:g} MB": lm_method(ctx, args, lambda m: torch_ddp(m, cap, ctx.device), model=model),
        "plain (no wrapper)": lm_method(ctx, args, no_wrapper, model=model)})
    for r in rows:   # vs_plain: each wrapper's cost over plain training
        r.update(model=model, bucket_mb=cap, n_buckets=None, **common.vs_paired(r, rows[1], "vs_torch_ddp"),
                 vs_plain=common.vs_paired(r, rows[2], "vs_plain")["vs_plain"])
    rows[0]["n_buckets"] = n_buckets[0]
    rows[1].update(comm_ms=None, comm_share=None)   # torch DDP waits inside backward: nothing left after it
    rows[1].update(vs_torch_ddp_min=None, vs_torch_ddp_max=None)
    rows[2].update(vs_torch_ddp=None, vs_torch_ddp_min=None, vs_torch_ddp_max=None, vs_plain=None)
    return {"rows": rows, "fit": fit_allreduce(ctx, args) if fit else None}


def recorder_cost(ctx, args, cap):
    """--recorder-cost: DDPBucketed on the LM with the flight recorder off, on, and checking."""
    return common.recorder_modes(ctx, args, lm_method(ctx, args, lambda m: DDPBucketed(m, cap,
                                                                                    in_place_mb=args.in_place_mb)))


# --per-param: what each hook-driven class costs a parameter a step, where the CPU's work
# around each parameter is all there is to see (the GPU's case: its kernels are fast)
PER_PARAM_SIZES = (801, 1601)
PER_PARAM_HEADERS = ["ranks", "params", "method", "step_ms", "step_min_ms", "step_max_ms", "us_off", "us_on",
                     "us_checking", "vs", "vs_min", "vs_max", "against", "collectives"]
PER_PARAM_NOTE = ("The probe: a tiny embedding of the LM batch's tokens, then 10 blocks (FSDP's and FSDP2's units) of "
                  "Linear(32, 32) + LayerNorm(32) pairs, 4 tensors each, the output's mean square as the loss, SGD, "
                  "one thread a rank; "
                  "every method built in the same processes (three times: the flight recorder, which every job runs "
                  "under, off, on, and on with --check-collectives) and their steps alternating. step_ms: the "
                  "recorder on. us_off, us_on, us_checking: what the method adds to plain training's step a "
                  "parameter, in microseconds, the median over paired steps of (its step - plain training's) / "
                  "parameters, by recorder setting. vs: the median of the paired steps' ratios over the method "
                  "named in against, the recorder on [min, max]. At 1 rank there is nothing to send: the whole "
                  "difference is the CPU's work around each parameter, what a GPU waits for when its kernels are "
                  "faster than that work.")


class ManyParams(nn.Module):
    """The per-parameter probe: ``n_params`` tensors (a tiny embedding of each sequence's
    first 8 tokens, then 10 blocks of Linear(32, 32) + LayerNorm(32) pairs, 4 tensors a
    pair; ``n_params`` - 1 a multiple of 40, which main checks); the loss is the output's
    mean square."""

    def __init__(self, n_params, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(*[m for _ in range((n_params - 1) // 40)
                                                    for m in (nn.Linear(32, 32), nn.LayerNorm(32))])
                                    for _ in range(10))

    def forward(self, idx, targets=None):
        h = self.embed(idx[:, :8] % 64)   # 8 tokens a sequence: little compute beside the parameters
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def per_param(ctx, args, n_params):
    """--per-param: plain training, torch DDP, 04's DDPIndividualParameters, DDPBucketed,
    06's ShardedGradientOptimizer, 07's FSDP and torch's FSDP2 on the probe, each under
    the flight recorder off, on and checking, steps alternating."""
    overlap = common.load_script(common.ROOT / "04_overlap_ddp.py")
    sharded = common.load_script(common.ROOT / "06_sharded_optimizer.py")
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")
    torch.set_num_threads(1)   # one a rank at 1 rank too: tiny ops gain nothing from more, and OpenMP's
    # handing each op to a second thread took half of a 1-rank step here, hiding what is measured

    def method(wrap, optimizer=None, on=True, check=False):
        def make():
            model = ManyParams(n_params, args.seed).to(ctx.device)
            wrapped = wrap(model)
            opt = optimizer(model) if optimizer else torch.optim.SGD(wrapped.parameters(), lr=1e-3)
            return common.recorded(lambda batch, clock: train_step(wrapped, opt, batch, clock), on, check)
        return make
    classes = {
        "torch DDP": (lambda m: torch_ddp(m, 25, ctx.device), None, None),
        "DDPIndividualParameters (04)": (overlap.DDPIndividualParameters, None, "torch DDP"),
        "DDPBucketed": (lambda m: DDPBucketed(m, 25), None, "torch DDP"),
        "ShardedGradientOptimizer (06)": (LoopWrapper, lambda m: sharded.ShardedGradientOptimizer(
            m.parameters(), torch.optim.SGD, bucket_mb=25, module=m, lr=1e-3), "torch DDP"),
        "FSDP2": (lambda m: fsdp.torch_fsdp2(m, ctx), None, None),
        "FSDP (07)": (fsdp.FSDP, None, "FSDP2")}
    modes = {"off": (False, False), "on": (True, False), "on, checking": (True, True)}
    methods = {("plain training", "on"): method(no_wrapper)}
    for name, (wrap, optimizer, _) in classes.items():
        for mode, (on, check) in modes.items():
            methods[(name, mode)] = method(wrap, optimizer, on, check)
    timed = {tuple(r["method"].split(" | ")): r
             for r in common.time_methods(ctx, args, {f"{n} | {m}": make for (n, m), make in methods.items()})}
    plain = timed[("plain training", "on")]["stats"]["step"]["all"]

    def extra(r):   # microseconds a parameter over plain training, paired step by step
        return statistics.median((a - b) / n_params * 1e6 for a, b in zip(r["stats"]["step"]["all"], plain))
    rows = []
    for name in ["plain training", *classes]:
        on = timed[(name, "on")]
        row = {"ranks": ctx.world_size, "params": n_params, "method": name, "step_ms": on["step_ms"],
               "step_min_ms": on["step_min_ms"], "step_max_ms": on["step_max_ms"], "collectives": on["collectives"],
               "steps_s": {m: timed[(name, m)]["stats"]["step"]["all"] for m in modes if (name, m) in timed}}
        for mode, key in zip(modes, ("us_off", "us_on", "us_checking")):
            row[key] = extra(timed[(name, mode)]) if (name, mode) in timed else None
        against = classes.get(name, (None, None, None))[2]
        if against:
            row.update(common.vs_paired(on, timed[(against, "on")], "vs"), against=against)
        rows.append(row)
    return rows


def benchmark_baselines(ctx, args):
    """The two unbucketed ends: per-parameter overlapped (04) and one flat all-reduce (03)."""
    overlap = common.load_script(common.ROOT / "04_overlap_ddp.py")
    flat = common.load_script(common.ROOT / "03_flat_ddp.py")
    rows = common.time_methods(ctx, args, {
        "per-parameter overlapped (04)": lm_method(ctx, args, overlap.DDPIndividualParameters),
        "flat after backward (03)": lm_method(ctx, args, flat.FlatDDP)})
    return [{**r, "model": "lm"} for r in rows]


def fit_allreduce(ctx, args):
    """Least-squares fit of all-reduce time t = o + bytes / w on this job's ranks and device."""
    sizes = [2**k for k in (14, 16, 18, 20, 22, 24)]   # 16 KiB .. 16 MiB
    times = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=ctx.device)
        ts = []
        for i in range(13):
            common.sync(ctx.device)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            common.sync(ctx.device)
            ts.append(time.perf_counter() - t0)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, ts[3:])
        times.append(sorted(max(r[i] for r in everyone) for i in range(10))[5])
    o, slope = common.fit_line(sizes, times)
    o = max(o, 1e-7)
    # w is None when time does not grow with size (one rank: nothing crosses a link)
    return {"sizes_bytes": sizes, "times_s": times, "o_s": o, "w_Bps": 1 / slope if slope > 0 else None}


def overhead_model(s, w, o, n_b):
    """Time left after backward: the last bucket's transfer plus one fixed cost per bucket."""
    return s / (n_b * w) + n_b * o


def analyse(rows, fit, args):
    """The overhead model on the kit's LM's sweep."""
    rows = [r for r in rows if r.get("model", "lm") == "lm"]
    s = common.lm_param_count(args.model_size, args.context_length) * 4
    w, o = fit["w_Bps"] or math.inf, fit["o_s"]
    # the formula's optimum, kept between one bucket and one bucket per parameter tensor
    n_star = min(max(math.sqrt(s / (w * o)), 1.0), lm_param_tensors(args.model_size))
    best = min((r for r in rows if r["method"].startswith("DDPBucketed")), key=lambda r: r["step_ms"])
    ours = [r for r in rows if r["method"].startswith("DDPBucketed")]
    return {"s_bytes": s, "w_GBps": fit["w_Bps"] and fit["w_Bps"] / 1e9, "o_ms": o * 1e3, "n_b_opt": n_star,
            "bucket_opt_mb": s / n_star / 2**20, "overhead_opt_ms": overhead_model(s, w, o, n_star) * 1e3,
            "predicted_overhead_ms": {r["bucket_mb"]: overhead_model(s, w, o, r["n_buckets"]) * 1e3 for r in ours},
            "measured_best_mb": best["bucket_mb"], "measured_best_step_ms": best["step_ms"],
            # the table's ratio: the median of the paired steps' (not the ratio of the medians)
            "best_vs_torch_ddp": best["vs_torch_ddp"],
            "best_ratio_any_cap": min(r["vs_torch_ddp"] for r in ours)}


def plot(rows, args):
    plt = common.pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        plot_model(ax, [r for r in rows if r["model"] == model], args, model)
    common.save_figure(fig, f"{args.out}/05_bucket_sweep.png")


def plot_model(ax, rows, args, model):
    ours = sorted((r for r in rows if r["method"].startswith("DDPBucketed")), key=lambda r: r["bucket_mb"])
    theirs = sorted((r for r in rows if r["method"].startswith("torch DDP")), key=lambda r: r["bucket_mb"])
    x = [r["bucket_mb"] for r in ours]
    ax.errorbar(x, [r["step_ms"] for r in ours], marker="o", label="DDPBucketed (ours)",
                yerr=[[r["step_ms"] - r["step_min_ms"] for r in ours], [r["step_max_ms"] - r["step_ms"] for r in ours]],
                capsize=3)
    ax.plot([r["bucket_mb"] for r in theirs], [r["step_ms"] for r in theirs], "--", marker="s",
            label="torch DDP, same bucket_cap_mb")
    plain = sorted((r for r in rows if r["method"].startswith("plain")), key=lambda r: r["bucket_mb"])
    ax.plot([r["bucket_mb"] for r in plain], [r["step_ms"] for r in plain], ":", marker=".", color="black",
            label="plain training, no wrapper (same job)")
    for r, style in zip([r for r in rows if r.get("bucket_mb") is None], (":", "-.")):
        ax.axhline(r["step_ms"], linestyle=style, color="gray", label=r["method"])
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("step time (ms, median; bars min-max)")
    name = "the kit's LM" if model == "lm" else "nn.TransformerEncoderLayer's model"
    ax.set_title(f"{name} ({args.model_size}), {args.world_size} x {args.backend}/{args.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


HEADERS = ["model", "method", "bucket_mb", "n_buckets", "step_ms", "step_min_ms", "step_max_ms", "comm_ms",
           "vs_torch_ddp", "vs_torch_ddp_min", "vs_torch_ddp_max", "vs_plain", "collectives"]
NAME, TITLE = "05_bucketed_ddp", "Bucketed DDP against torch DDP at the same bucket size"


def settings(args) -> dict:
    """The results' settings: the LM's, and the gradient size DDPBucketed reduces in place
    from (MiB; None: every gradient copied into its bucket)."""
    in_place = args.in_place_mb
    if in_place is None and args.backend == "nccl":
        in_place = NCCL_IN_PLACE_MB
    return {**common.lm_settings(args), "in_place_mb": in_place}


def parser():
    """05's flags: bucket sizes, models, baselines, --dtype, the time box, --recorder-cost."""
    p = common.script_parser(__doc__, default_steps=20)  # close ratios need more steps
    p.add_argument("--bucket-mb", nargs="+", type=common.number(float, above=0), default=[1, 10, 100],
                   help="bucket sizes to sweep, MiB (torch DDP's bucket_cap_mb unit; on the 33 MB mini "
                        "models 100 already holds all but the first 1 MB in one bucket)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="the kit's LM (lm) and a model of nn.TransformerEncoderLayer's of the same size (encoder)")
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                   help="also time 04's per-parameter and 03's flat DDP (--no-baselines: the sweep only)")
    p.add_argument("--in-place-mb", type=common.number(float, 0), default=None,
                   help="DDPBucketed's in_place_mb: gradients of this many MiB or more are all-reduced where "
                        "autograd left them, not copied into their bucket (default: 1 on NCCL, none on gloo; "
                        "1e6: copy every one; on gloo CPU tensors only)")
    common.add_dtype_flag(p)
    p.add_argument("--time-box", type=common.SECONDS, default=None,
                   help="seconds of benchmarking after which no further bucket size starts "
                        "(what ran is saved; the first size always runs)")
    p.add_argument("--recorder-cost", action="store_true",
                   help="instead of the sweep: DDPBucketed at the first --bucket-mb with the flight recorder off, on, "
                        "and on with --check-collectives, steps alternating (05_recorder_cost)")
    p.add_argument("--per-param", nargs="*", type=common.COUNT, default=None, metavar="N",
                   help="instead of the sweep: what each hook-driven class (04, 05, 06, 07) costs a parameter a step "
                        "beside torch DDP and FSDP2, on a probe of N small parameters (1 + 40 k; given alone: "
                        f"{' and '.join(map(str, PER_PARAM_SIZES))}) at 1 rank and --world-size (05_per_param)")
    return p


def run_sweep(args, caps) -> tuple:
    """One job (fresh processes) per model and bucket size, then the baselines; the table
    rewritten after each, so a run cut short keeps what it measured; the LM's first size
    also fits the all-reduce cost. Returns (rows, the fit, the time box's note)."""
    report = common.is_reporter()
    jobs = [(m, c) for m in dict.fromkeys(args.models) for c in caps] + (["baselines"] if args.baselines else [])
    rows, fit, note = [], None, ""
    started = time.perf_counter()
    for i, job in enumerate(jobs):
        if i and args.time_box and rank0_decides(time.perf_counter() - started > args.time_box):
            note = (f"Time box ({args.time_box:g} s) reached: not run: "
                    f"{', '.join(f'{j[0]} {j[1]:g}' if j != 'baselines' else j for j in jobs[i:])}.")
            if report:
                print(note)
            break
        if job == "baselines":
            rows += common.launch(benchmark_baselines, args)
        else:
            got = common.launch(benchmark, args, *job, fit is None and job[0] == "lm")
            rows, fit = rows + got["rows"], fit or got["fit"]
        if report and i < len(jobs) - 1:
            common.save_results(args.out, NAME, rows, settings(args), headers=HEADERS, title=TITLE,
                                note=common.partial_note(i + 1, len(jobs), "benchmark jobs").strip())
    return rows, fit, note


def report_overhead_model(args, rows, fit):
    """The overhead model fitted to the all-reduce's cost beside the sweep's measured best."""
    a = analyse(rows, fit, args)
    print(f"\nOverhead model: overhead(n_b) = s/(n_b*w) + n_b*o, best n_b = sqrt(s/(w*o)), "
          f"bucket = sqrt(s*w*o)\n  fitted all-reduce cost: o = {a['o_ms']:.3f} ms per call, "
          f"w = {'%.3f GB/s' % a['w_GBps'] if a['w_GBps'] else 'unbounded (time does not grow with size)'}; "
          f"s = {a['s_bytes'] / 1e6:.1f} MB of gradients\n"
          f"  predicted best bucket: {a['bucket_opt_mb']:.2f} MiB ({a['n_b_opt']:.1f} buckets), "
          f"overhead {a['overhead_opt_ms']:.1f} ms\n"
          f"  measured best bucket (of the sweep): {a['measured_best_mb']:g} MiB, "
          f"{a['measured_best_step_ms']:.1f} ms/step, {a['best_vs_torch_ddp']:.3f}x torch DDP at that cap")
    ours = {r["bucket_mb"]: r for r in rows if r["method"].startswith("DDPBucketed") and r["model"] == "lm"}
    common.save_results(args.out, "05_overhead_model", [
        {"bucket_mb": b, "predicted_overhead_ms": v, "n_buckets": ours[b]["n_buckets"],
         "step_ms": ours[b]["step_ms"], "comm_ms": ours[b]["comm_ms"]}
        for b, v in a["predicted_overhead_ms"].items()], settings(args),
        title="Bucketed DDP: overhead model against measurement", extra={"fit": fit, "analysis": a})
    plot(rows, args)
    print(common.wrote(args.out, "05_bucket_sweep.png and 05_overhead_model.json, .md"))


def run_per_param(args):
    """--per-param: one job per world size (1, then --world-size) and probe size; the
    table rewritten after each."""
    sizes = list(dict.fromkeys(args.per_param or PER_PARAM_SIZES))
    rows = []
    for ranks in dict.fromkeys([1, args.world_size] if not common.under_torchrun() else [args.world_size]):
        for n in sizes:
            rows += common.launch(per_param, args, n, world_size=ranks)
            if common.is_reporter():
                table = common.save_results(args.out, "05_per_param", rows, settings(args),
                                            headers=PER_PARAM_HEADERS, note=PER_PARAM_NOTE,
                                            title="What each hook-driven class costs a parameter a step")
    if common.is_reporter():
        print(f"\nWhat each hook-driven class costs a parameter a step ({args.backend}/{args.device}; "
              f"median of {args.steps} paired steps)\n{table}\n{common.wrote(args.out, '05_per_param.json and .md')}")


def main(argv=None):
    args = common.parse(parser(), argv)
    bad = [n for n in args.per_param or () if n < 41 or (n - 1) % 40]
    if bad:
        raise common.UsageError(f"--per-param {bad[0]}: the probe has 1 + 40 k parameters (10 blocks of "
                                f"Linear + LayerNorm pairs and an embedding): use 41, 81, ..., 801, 1601")
    caps = list(dict.fromkeys(args.bucket_mb))   # each size once
    if args.in_place_mb is not None and in_place_skip(args.backend, args.device):
        raise common.UsageError(f"--in-place-mb: {in_place_skip(args.backend, args.device)}")
    if not args.no_verify:   # the toy caps, and the first size asked for
        results = common.launch(verify, args, None, None, {f"{caps[0]:g} MB": (caps[0], args.in_place_mb), **TOY_CAPS,
                                                            **TOY_IN_PLACE})
        common.check_verification(results, f"{NAME} at {args.world_size} rank(s)")
        if args.dtype == "bf16":
            common.check_verification(common.launch(verify_bf16, args), f"{NAME}, bf16, at {args.world_size} rank(s)")
    if args.no_bench:
        return
    if args.per_param is not None:
        return run_per_param(args)
    if args.recorder_cost:
        rows = common.launch(recorder_cost, args, caps[0])
        return common.report_table(args, "05_recorder_cost", f"The flight recorder's cost on DDPBucketed "
                                   f"({caps[0]:g} MB buckets)", rows, common.RECORDER_HEADERS, common.RECORDER_NOTE,
                                   settings(args))
    rows, fit, note = run_sweep(args, caps)
    common.report_table(args, NAME, TITLE, rows, HEADERS, note, settings(args))
    if args.dtype == "bf16":
        common.report_table(args, MP_NAME, MP_TITLE, common.launch(mixed_precision, args), MP_HEADERS)
    if not common.is_reporter():
        return
    if fit is not None:   # the overhead model needs the LM's first job
        report_overhead_model(args, rows, fit)
    else:
        plot(rows, args)


if __name__ == "__main__":
    common.run_main(main)
