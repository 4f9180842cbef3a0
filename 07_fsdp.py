"""Fully sharded data parallel (FSDP): weights, gradients and optimizer state all sharded.

Each rank stores 1/world_size of every weight matrix. A layer's full weight is
all-gathered just before the layer runs and freed right after; backward gathers it again,
and the weight's gradient is reduce-scattered so each rank keeps only its shard's part.
The optimizer sees only the shards, so its state is sharded for free. With a compute
dtype (float16, bfloat16) weights travel and compute in it, while the master shards,
their gradients and the optimizer state stay float32.

Run:
    python 07_fsdp.py                              # verify (fp32 and fp16), then memory and time
    python 07_fsdp.py --world-size 4 --model-size micro
    python 07_fsdp.py --compute-dtype bfloat16
    torchrun --standalone --nproc-per-node 2 07_fsdp.py

Prints PASS/FAIL per verification case, then per-rank memory (parameters, gradients,
optimizer state, peak) and step time for DDP (05's DDPBucketed), DDP with the sharded
optimizer (06) and FSDP, measured side by side. Writes results/07_fsdp.{json,md}.
"""

import copy

import common

# ---- begin copy: FSDP (needs only torch and the standard library) ----
import torch
import torch.distributed as dist
import torch.nn as nn


def _all_gather(out, inp, group):
    """all_gather_into_tensor (named all_gather_single in newer torch)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp, group=group)


def _reduce_scatter(out, inp, group):
    """reduce_scatter_tensor (named reduce_scatter_single in newer torch), summing."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)


class FSDP(nn.Module):
    """Shards every parameter with 2+ dimensions across ranks; gathers it per layer.

        model = FSDP(MyModel().to(device), compute_dtype=torch.bfloat16)   # or None for fp32
        opt = torch.optim.AdamW(model.parameters())   # the fp32 shards (and 1-D params)
        loss = loss_fn(model(x_local), y_local)
        loss.backward()                                # weight grads reduce-scattered here
        model.finish_gradient_synchronization()        # all-reduce the replicated 1-D grads
        opt.step()

    Weight matrices (2+ dims: linear and embedding weights, whatever the module class) are
    flattened, padded to a multiple of world_size, and each rank keeps one contiguous slice
    as an fp32 Parameter, so a gradient has its parameter's (shard) shape and dtype. 1-D
    parameters (norm weights, biases) stay whole on every rank; their gradients are
    averaged in ``finish_gradient_synchronization``. ``gather_full_params()`` returns every
    parameter whole, by its original name.

    ``process_group`` (default: every rank) is the group the weights are sharded over.
    Every rank must call the same layers in the same order (each call all-gathers); a
    layer used on some ranks only would make the collectives disagree.
    """

    def __init__(self, module: nn.Module, compute_dtype=None, process_group=None):
        super().__init__()
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        src = dist.get_global_rank(process_group or dist.group.WORLD, 0)   # the group's first rank
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=src, group=process_group)
        self._handles = {}        # id(original parameter) -> _Sharded, so a tied weight is sharded once
        self._sources = {}        # original name -> its _Sharded, or the whole 1-D Parameter
        self._replicated = []     # 1-D parameters: (name, Parameter)
        for mod_name, mod in module.named_modules():
            local = [(n, p) for n, p in mod.named_parameters(recurse=False)]
            hooked = []
            for name, p in local:
                full_name = f"{mod_name}.{name}" if mod_name else name
                if p.dim() >= 2:
                    h = self._handles.get(id(p))
                    if h is None:
                        h = self._handles[id(p)] = _Sharded(p, process_group, compute_dtype, full_name)
                    del mod._parameters[name]
                    mod.register_parameter(f"{name}_shard", h.shard)
                    hooked.append((name, h))
                elif compute_dtype is not None:   # kept whole, but fed to the layer cast
                    del mod._parameters[name]
                    mod.register_parameter(f"{name}_master", p)
                    hooked.append((name, p))
                    self._replicated.append((full_name, p))
                else:
                    self._replicated.append((full_name, p))
                self._sources[full_name] = self._handles[id(p)] if p.dim() >= 2 else p
            if hooked:
                for name, _ in hooked:
                    setattr(mod, name, None)
                mod.register_forward_pre_hook(self._pre_forward(hooked))
                mod.register_forward_hook(self._post_forward(hooked))

    def _pre_forward(self, hooked):
        def hook(mod, args):
            for name, h in hooked:
                if isinstance(h, _Sharded):
                    keep = torch.is_grad_enabled() and h.shard.requires_grad   # will backward need it?
                    setattr(mod, name, _Gather.apply(h.shard, h, keep))
                else:
                    setattr(mod, name, h.to(self.compute_dtype))
            if self.compute_dtype is not None:
                return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                             for a in args)
        return hook

    def _post_forward(self, hooked):
        def hook(mod, args, out):
            gathered = [h for _, h in hooked if isinstance(h, _Sharded)]
            for h in gathered:
                h.free()                      # the full weight goes now, and comes back for backward:
            if torch.is_tensor(out) and out.requires_grad and gathered:
                def regather(grad):
                    for h in gathered:
                        h.regather()
                out.register_hook(regather)   # runs just before this layer's backward
            for name, _ in hooked:
                setattr(mod, name, None)
        return hook

    def forward(self, *args, **kwargs):
        for h in self._handles.values():      # copies a forward without backward left behind
            h.bufs.clear()
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        """Average the replicated (1-D) parameters' gradients; the sharded ones were
        reduce-scattered during backward."""
        params = [p for _, p in self._replicated if p.requires_grad]
        if not params or self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]).div_(self.world_size)
        dist.all_reduce(flat, group=self.process_group)
        offset = 0
        for p in params:
            new = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
            if p.grad is None:
                p.grad = new
            else:
                p.grad.copy_(new)

    @torch.no_grad()
    def gather_full_params(self) -> dict:
        """{original parameter name: full fp32 tensor}, on every rank (a collective)."""
        out, gathered = {}, {}
        for name, src in self._sources.items():
            if isinstance(src, _Sharded):
                if id(src) not in gathered:        # a tied weight is gathered once
                    gathered[id(src)] = src.gather_master()
                out[name] = gathered[id(src)]
            else:
                out[name] = src.detach().clone()
        return out


class _Sharded:
    """One weight's fp32 shard and the gathered full copy it lends a layer."""

    def __init__(self, p, group, compute_dtype, name):
        self.name, self.shape, self.numel, self.group = name, p.shape, p.numel(), group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size, self.compute_dtype = world_size, compute_dtype or p.dtype
        self.k = -(-self.numel // world_size)                    # shard length, padded
        flat = torch.zeros(self.k * world_size, dtype=p.dtype, device=p.device)
        flat[:self.numel] = p.detach().reshape(-1)
        self.shard = nn.Parameter(flat[rank * self.k:(rank + 1) * self.k].clone(), requires_grad=p.requires_grad)
        self.bufs = []                                           # gathered copies lent out

    def gather(self, keep):
        """All-gather the full weight (in the compute dtype) into a new buffer: (buffer, weight).
        ``keep``: backward will need it back, so free() and regather() look after it."""
        buf = torch.empty(self.k * self.world_size, dtype=self.compute_dtype, device=self.shard.device)
        _all_gather(buf, self.shard.detach().to(self.compute_dtype), self.group)
        if keep:
            self.bufs.append(buf)
        return buf, buf[:self.numel].view(self.shape)

    def free(self):
        for buf in self.bufs:
            buf.untyped_storage().resize_(0)   # the memory goes; the tensor autograd saved stays

    @torch.no_grad()
    def regather(self):
        for buf in self.bufs:
            if buf.untyped_storage().nbytes() == 0:
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                # .data: refilling the storage autograd saved must not count as an in-place change
                _all_gather(buf.data, self.shard.detach().to(self.compute_dtype), self.group)

    def release(self, buf):
        buf.untyped_storage().resize_(0)
        self.bufs = [b for b in self.bufs if b is not buf]

    def reduce_scatter(self, grad_full):
        flat = torch.zeros(self.k * self.world_size, dtype=grad_full.dtype, device=grad_full.device)
        flat[:self.numel] = grad_full.reshape(-1)
        flat.div_(self.world_size)                              # average by dividing before the sum
        out = torch.empty(self.k, dtype=grad_full.dtype, device=grad_full.device)
        _reduce_scatter(out, flat, self.group)
        return out.to(self.shard.dtype)

    def gather_master(self):
        full = torch.empty(self.k * self.world_size, dtype=self.shard.dtype, device=self.shard.device)
        _all_gather(full, self.shard.detach(), self.group)
        return full[:self.numel].view(self.shape).clone()


class _Gather(torch.autograd.Function):
    """shard -> full weight (all-gather); backward: full gradient -> shard gradient
    (reduce-scatter)."""

    @staticmethod
    def forward(ctx, shard, h, keep):
        ctx.h = h
        ctx.buf, full = h.gather(keep)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        ctx.h.release(ctx.buf)      # the layer's backward is done with this copy
        return ctx.h.reduce_scatter(grad_full), None, None
# ---- end copy: FSDP ----


def train_step(model, optimizer, batch, clock):
    """One training step on this rank's part of the global batch, timed by phase."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("forward"):      # gathers each layer's weights just before it runs
        loss = model(x, y)
    with clock.phase("backward"):     # gathers them again; reduce-scatters the weight gradients
        loss.backward()
    with clock.phase("comm"):         # the replicated (1-D) parameters' gradients
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------
DTYPES = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Low precision is compared with a single process that casts the same way, within this tolerance:
LOW_PRECISION_TOL = {"rtol": 1e-2, "atol": 2e-3}


def _reference_step(master, x, y, compute_dtype):
    """One single-process step on the global batch, weights and inputs cast like FSDP's."""
    if compute_dtype is None:
        master(x, y).backward()
        return
    low = copy.deepcopy(master).to(compute_dtype)
    low(x.to(compute_dtype), y).backward()   # the toy model takes its loss in float32
    for p, q in zip(master.parameters(), low.parameters()):
        if q.grad is not None:
            p.grad = q.grad.float()


def verify_case(ctx, args, compute_dtype, tied=False, group=None, steps=5):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    batches, in_dim, n_cls = common.verify_batches(args, steps, 8 * size)
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]   # reference on the same device
    torch.manual_seed(args.seed)
    ref = common.ToyModel(in_dim, n_classes=n_cls, tied=tied).to(ctx.device)
    model = FSDP(copy.deepcopy(ref), compute_dtype=compute_dtype, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    shapes_ok = True
    for x, y in batches:
        ref_opt.zero_grad()
        _reference_step(ref, x, y, compute_dtype)
        ref_opt.step()
        train_step(model, opt, (common.shard(x, rank, size), common.shard(y, rank, size)), common.StepClock(ctx.device))
        shapes_ok &= all(p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
                         for p in model.parameters())
    full = model.gather_full_params()
    tol = LOW_PRECISION_TOL if compute_dtype is not None else {}
    diff, ok = 0.0, True
    for name, p in ref.named_parameters():
        diff = max(diff, (full[name].to(p.device).double() - p.detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(full[name].to(p.device), p.detach(), **tol)
        except AssertionError:
            ok = False
    everyone = [None] * size
    dist.all_gather_object(everyone, {
        "ok": ok, "max_diff": diff, "shapes_ok": shapes_ok,
        "replicated": [p.grad.tolist() for _, p in model._replicated], "names": sorted(full),
        "ref_names": sorted(n for n, _ in ref.named_parameters(remove_duplicate=False))}, group=group)
    same_replicated = all(r["replicated"] == everyone[0]["replicated"] for r in everyone)
    return {"ok": all(r["ok"] and r["shapes_ok"] for r in everyone) and same_replicated,
            "max_diff": max(r["max_diff"] for r in everyone), "bitwise": False,
            "shapes_ok": all(r["shapes_ok"] for r in everyone), "replicated_identical": same_replicated,
            "names_match": everyone[0]["names"] == everyone[0]["ref_names"]}


def verify(ctx, args, cases=None, group=None):
    """fp32 and one low-precision compute dtype (--compute-dtype, default float16), with and
    without tied weights; ``cases`` names some of them, ``group`` shards over a subgroup."""
    low = DTYPES.get(getattr(args, "compute_dtype", "float32")) or torch.float16
    all_cases = {f"{label}{' tied' if tied else ''}": (dt, tied)
                 for label, dt in (("fp32", None), (str(low).replace("torch.", ""), low)) for tied in (False, True)}
    return {name: verify_case(ctx, args, *all_cases[name], group=group) for name in cases or all_cases}


# ----------------------------------------------------------------------------------------
# Benchmark: memory and time against DDP and DDP + sharded optimizer
# ----------------------------------------------------------------------------------------
def methods(args):
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    sharded = common.load_script(common.ROOT / "06_sharded_optimizer.py")
    dt = DTYPES[args.compute_dtype]
    return {"DDP (DDPBucketed 25 MB) + AdamW": (lambda m: bucketed.DDPBucketed(m, 25), None),
            "DDP + ShardedOptimizer(AdamW)": (lambda m: bucketed.DDPBucketed(m, 25), sharded.make_optimizer("sharded")),
            f"FSDP ({args.compute_dtype}) + AdamW": (lambda m: FSDP(m, dt), None)}


def build(ctx, args, wrap, optimizer):
    model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
    params = list(model.parameters())
    return model, optimizer(params) if optimizer else torch.optim.AdamW(params, lr=1e-4)


def memory_worker(ctx, args, index):
    """Memory per rank after two full training steps (state exists), for method ``index``."""
    sharded = common.load_script(common.ROOT / "06_sharded_optimizer.py")
    name, (wrap, optimizer) = list(methods(args).items())[index]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model, opt = build(ctx, args, wrap, optimizer)
    for i in range(2):
        batch = common.lm_batch(args.batch_size, args.context_length, i, args.seed, ctx.device)
        train_step(model, opt, tuple(common.shard(t, ctx.rank, ctx.world_size) for t in batch),
                   common.StepClock(ctx.device))
    row = sharded.memory_snapshot(ctx, "after optimizer step", model, opt)
    row.pop("point")
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, row)
    return [{"method": name, "rank": r, **row} for r, row in enumerate(everyone)]


def benchmark(ctx, args):
    """DDP, DDP + ShardedOptimizer and FSDP on the LM, steps alternating: one row each."""
    def method(wrap, optimizer):
        def make():
            model, opt = build(ctx, args, wrap, optimizer)
            return lambda batch, clock: train_step(model, opt, batch, clock)
        return make
    rows = common.time_methods(ctx, args, {name: method(*m) for name, m in methods(args).items()})
    for r in rows:
        r["optim_ms"] = r["stats"]["optim"]["median"] * 1e3
    return rows


HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "comm_ms", "optim_ms", "collectives"]
MEM_HEADERS = ["method", "rank", "params_MB", "grads_MB", "opt_state_MB", "other_MB", "peak_MB"]
NAME, TITLE = "07_fsdp", "FSDP against DDP and DDP + sharded optimizer: time per iteration"


def main(argv=None):
    p = common.script_parser(__doc__)
    p.add_argument("--compute-dtype", choices=list(DTYPES), default="float32",
                   help="dtype of gathered weights, communication and compute (master stays float32)")
    args = common.parse(p, argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
    if args.no_bench:
        return
    rows = common.launch(benchmark, args)
    common.report_table(args, NAME, TITLE, rows, HEADERS)
    # one job per method: fresh processes, so each peak belongs to that method alone
    mem = [row for i in range(len(methods(args))) for row in common.launch(memory_worker, args, i)]
    if common.is_reporter():
        table = common.save_results(args.out, "07_fsdp_memory", mem, common.lm_settings(args), headers=MEM_HEADERS,
                                    title="FSDP against DDP: memory per rank after a step (MiB)")
        print(f"\nMemory per rank after a training step (MiB; peak = "
              f"{'max_memory_allocated' if args.device == 'cuda' else 'peak RSS'})\n{table}\n"
              f"wrote {args.out}/07_fsdp_memory.json and .md")


if __name__ == "__main__":
    common.run_main(main)
