"""Tensor (operator) parallelism: split each layer's weight matrices across ranks, forward
and backward, alone and combined with data parallelism.

A column-parallel linear holds a slice of the output features (rows of the weight), a
row-parallel one a slice of the input features. Put a column layer before a row layer and
the slice one produces is exactly the slice the other needs: each pair then costs one
all-reduce in forward (summing the row layer's partial outputs) and one in backward
(summing the column layer's partial input gradients), the two conjugate operators f and g.
In the LM, attention is split by heads (qkv column, output projection row) and the MLP by
its hidden size (first layer column, second row): two all-reduces per block in forward,
two in backward. Embeddings, norms and the output head stay whole on every rank. The
lecture's version splits every layer by columns and all-gathers its output (here with its
backward): every rank then computes attention whole, and each layer costs a collective.

Run:
    python 08_tensor_parallel.py                           # world sizes 2 and 4: verify, then time
    python 08_tensor_parallel.py --world-sizes 4 --tp 2    # TP 2 x DP 2 beside DP 4
    torchrun --standalone --nproc-per-node 4 08_tensor_parallel.py --tp 2 4

Prints PASS/FAIL per verification case (TP, and TP x DP with DDPBucketed on the DP groups,
against one process), then per world size a table: step time, time the collectives ran,
bytes communicated per step (counted) beside the formula's, collectives per step and
parameter memory per rank, for data parallelism alone, our TP, torch's TP
(ColwiseParallel/RowwiseParallel on the same model), the naive all-gather TP and TP x DP.
Writes results/08_tensor_parallel.{json,md}.
"""

import copy

import common

# ---- begin copy: tensor-parallel layers (need only torch and the standard library) ----
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _CopyToParallel(torch.autograd.Function):
    """f: identity in forward; in backward, all-reduce the input's gradient (each rank's
    weight slice contributed only part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: in forward, all-reduce the ranks' partial outputs; identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)   # x is a fresh matmul output: reduced in place
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather the ranks' output slices along the last dimension; backward keeps this
    rank's slice of the gradient (every rank holds the same whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        part = grad.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)]
        return part.contiguous(), None


def _gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (the output features) split over ``process_group``:
    rank r holds rows [r*n, (r+1)*n), n = out_features / group size, and their bias.

        layer = ColumnParallelLinear.from_linear(nn.Linear(512, 2048), group)  # same weights on every rank
        h = layer(x)                    # x whole on every rank -> this rank's 512 output features
        out = RowParallelLinear.from_linear(nn.Linear(2048, 512), group)(F.gelu(h))   # whole again

    The input is whole on every rank; its gradient is all-reduced in backward (f). The
    output is this rank's slice, ready for a RowParallelLinear; ``gather_output=True``
    all-gathers it whole instead (a collective per layer). ``rows`` reorders the output
    features before slicing (to keep whole attention heads on one rank). Built directly,
    each rank initialises its slice as nn.Linear would, biases at zero: seed ranks apart.
    """

    def __init__(self, in_features, out_features, bias=True, process_group=None, gather_output=False,
                 rows=None, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(process_group)
        if out_features % tp:
            raise ValueError(f"out_features {out_features} does not divide over {tp} ranks")
        self.in_features, self.out_features = in_features, out_features
        self.process_group, self.gather_output, self.rows = process_group, gather_output, rows
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))   # nn.Linear's, on this slice

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group=None, gather_output=False, rows=None):
        """This rank's slice of ``linear`` (which must be the same on every rank)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, process_group,
                    gather_output, rows, linear.weight.device, linear.weight.dtype)
        n, r = layer.weight.shape[0], dist.get_rank(process_group)
        order = rows if rows is not None else slice(None)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[order][r * n:(r + 1) * n])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[order][r * n:(r + 1) * n])
        return layer

    def forward(self, x):
        y = F.linear(_CopyToParallel.apply(x, self.process_group), self.weight, self.bias)
        return _GatherFromParallel.apply(y, self.process_group) if self.gather_output else y

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """The whole weight (and bias) in the original feature order (a collective)."""
        full = {"weight": _gather(self.weight, 0, self.process_group)}
        if self.bias is not None:
            full["bias"] = _gather(self.bias, 0, self.process_group)
        if self.rows is not None:
            for k, t in full.items():
                full[k] = torch.empty_like(t).index_copy_(0, self.rows.to(t.device), t)
        return full


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (the input features) split over ``process_group``:
    rank r holds columns [r*n, (r+1)*n), n = in_features / group size. The input is this
    rank's slice of the features (a ColumnParallelLinear's output); the partial outputs are
    all-reduced in forward (g), and the bias, whole on every rank, is added after.
    """

    def __init__(self, in_features, out_features, bias=True, process_group=None, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(process_group)
        if in_features % tp:
            raise ValueError(f"in_features {in_features} does not divide over {tp} ranks")
        self.in_features, self.out_features, self.process_group = in_features, out_features, process_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(6 * tp - 1))   # nn.Linear's bound, whole fan-in

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group=None):
        """This rank's slice of ``linear`` (which must be the same on every rank)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, process_group,
                    linear.weight.device, linear.weight.dtype)
        n, r = layer.weight.shape[1], dist.get_rank(process_group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, r * n:(r + 1) * n])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        y = _ReduceFromParallel.apply(F.linear(x, self.weight), self.process_group)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def full_parameters(self) -> dict:
        full = {"weight": _gather(self.weight, 1, self.process_group)}
        if self.bias is not None:
            full["bias"] = self.bias.detach().clone()
        return full


def parallelize(module: nn.Module, plan: dict, process_group=None) -> nn.Module:
    """Replace the nn.Linear submodules named in ``plan`` ({name: "column" or "row"}) by
    this rank's slices, in place. A "column" layer's output slice is the input slice of the
    "row" layer that follows it; what lies between must work feature by feature."""
    for name, kind in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        layer = ColumnParallelLinear if kind == "column" else RowParallelLinear
        setattr(parent, attr, layer.from_linear(getattr(parent, attr), process_group))
    return module


def heads_by_rank(n_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Output-feature order of a fused qkv projection ([q of every head, k ..., v ...]) that
    gives each rank's contiguous slice whole heads: [q, k, v of rank 0's heads, rank 1's ...]."""
    return torch.arange(3 * n_heads * head_dim).view(3, tp, n_heads // tp, head_dim).transpose(0, 1).reshape(-1)


def tensor_parallel_lm(model: nn.Module, process_group=None) -> nn.Module:
    """The kit's TransformerLM in tensor-parallel form, in place: in every block the fused
    qkv projection and the MLP's first layer are column-parallel (heads and d_ff split over
    the group), the attention output and the MLP's second layer row-parallel. Embeddings,
    norms and the output head stay whole on every rank (replicated: their gradients come
    out the same on every rank, so they need no communication)."""
    tp = dist.get_world_size(process_group)
    for block in model.blocks:
        if block.n_heads % tp or block.ff_in.out_features % tp:
            raise ValueError(f"{tp} ranks must divide the {block.n_heads} heads and d_ff {block.ff_in.out_features}")
        block.qkv = ColumnParallelLinear.from_linear(block.qkv, process_group,
                                                     rows=heads_by_rank(block.n_heads, block.head_dim, tp))
        parallelize(block, {"proj": "row", "ff_in": "column", "ff_out": "row"}, process_group)
    return model


def full_state_dict(model: nn.Module) -> dict:
    """Every parameter whole, by its original name (a collective over each layer's group)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            out.update({f"{name}.{k}": v for k, v in mod.full_parameters().items()})
    for name, p in model.named_parameters():
        out.setdefault(name, p.detach())
    return out
# ---- end copy: tensor-parallel layers ----


def naive_tensor_parallel_lm(model, process_group=None):
    """The lecture's version: every linear of every block split by columns and its output
    all-gathered, so every rank computes attention and the activations whole."""
    for block in model.blocks:
        for name in ("qkv", "proj", "ff_in", "ff_out"):
            setattr(block, name, ColumnParallelLinear.from_linear(getattr(block, name), process_group, gather_output=True))
    return model


def torch_tensor_parallel_lm(model, mesh):
    """The same split with torch.distributed.tensor.parallel: qkv's heads ordered by rank as
    for ours, then ColwiseParallel / RowwiseParallel on the same four layers. The replicated
    modules (embeddings, norms, head) get Replicate DTensor parameters, plain tensors in and
    out, as torch's TP examples have every parameter a DTensor: an optimizer's foreach path
    (the default on CUDA) refuses a list that mixes DTensors and plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = mesh.size()

    def inputs_to_dtensor(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if torch.is_tensor(t) else t
                     for t in inputs)
    for block in model.blocks:
        with torch.no_grad():
            block.qkv.weight.copy_(block.qkv.weight[heads_by_rank(block.n_heads, block.head_dim, tp)])
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "ff_in": ColwiseParallel(), "ff_out": RowwiseParallel()})
    for module in [model.tok, model.pos, model.ln_f, model.head] + [n for b in model.blocks for n in (b.ln1, b.ln2)]:
        distribute_module(module, mesh, input_fn=inputs_to_dtensor, output_fn=lambda mod, out, mesh: out.to_local())
    return model


def train_step(model, optimizer, batch, clock):
    """One training step on this rank's part of the global batch (its data-parallel group's
    part: a tensor-parallel group shares one part), timed by phase."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("forward"):      # tensor parallel: an all-reduce after attention, one after the MLP
        loss = model(x, y)
    with clock.phase("backward"):     # and one before each, for the input gradients
        loss.backward()
    with clock.phase("comm"):         # data parallel over the DP group, if there is one
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


def tp_dp_groups(world_size: int, tp: int):
    """This rank's (tensor-parallel group, data-parallel group) in a tp x (world/tp) grid:
    TP groups are consecutive ranks, DP groups the ranks at the same place in their TP
    group. Every rank creates every group (new_group is collective)."""
    tp_groups = [dist.new_group(list(range(k * tp, (k + 1) * tp))) for k in range(world_size // tp)]
    dp_groups = [dist.new_group(list(range(i, world_size, tp))) for i in range(tp)]
    rank = dist.get_rank()
    return tp_groups[rank // tp], dp_groups[rank % tp]


# ----------------------------------------------------------------------------------------
# Verification: TP (and TP x DP) against one process on the same global batches
# ----------------------------------------------------------------------------------------
class ToyMLP(nn.Module):
    """Residual MLP blocks (up-projection, GELU, down-projection, with biases) and a head."""

    def __init__(self, d=16, hidden=64, n_classes=10, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(d, hidden), "down": nn.Linear(hidden, d)})
                                    for _ in range(depth))
        self.head = nn.Linear(d, n_classes)

    def forward(self, x, targets):
        for b in self.blocks:
            x = x + b["down"](F.gelu(b["up"](x)))
        return F.cross_entropy(self.head(x), targets)


def toy_tp(model, group):
    for i in range(len(model.blocks)):
        parallelize(model, {f"blocks.{i}.up": "column", f"blocks.{i}.down": "row"}, group)
    return model


VERIFY_LM = "micro"   # d_model 128, 4 heads, d_ff 512: splits over 2 and 4 ranks
# AdamW divides by sqrt(v) + eps: with the default eps 1e-8, a gradient that nearly cancels
# to zero turns the last-bit rounding of split matmuls into 1e-5 weight differences after a
# few steps (measured: gradients agree to 5e-7 of their size). eps 1e-6 keeps the check on
# the method, at float32 tolerance.
EPS = 1e-6


def verify_model(ctx, args, build, convert, batches, tp_group, dp_group):
    """Train ``convert(copy of build(), tp_group)`` (wrapped in DDPBucketed over dp_group
    when it has several ranks) and build() on one process; compare the gathered weights."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    torch.manual_seed(args.seed)
    ref = build().to(ctx.device)
    model = convert(copy.deepcopy(ref), tp_group)
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    wrapped = bucketed.DDPBucketed(model, 0.05, process_group=dp_group) if dp_size > 1 else model
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS) for m in (ref, wrapped)]
    for x, y in batches:
        opts[0].zero_grad()
        ref(x, y).backward()
        opts[0].step()
        train_step(wrapped, opts[1], (common.shard(x, dp_rank, dp_size), common.shard(y, dp_rank, dp_size)),
                   common.StepClock(ctx.device))
    full = full_state_dict(model)
    ok, diff = True, 0.0
    for name, p in ref.named_parameters():
        diff = max(diff, (full[name].double() - p.detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(full[name], p.detach())
        except AssertionError:
            ok = False
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"ok": ok and len(full) == len(dict(ref.named_parameters())), "max_diff": diff})
    return {"ok": all(r["ok"] for r in everyone), "max_diff": max(r["max_diff"] for r in everyone)}


def verify(ctx, args, tps):
    """At this world size, for each TP degree in ``tps`` (the rest of the ranks data
    parallel): the toy MLP and the LM; and the naive all-gather TP over all ranks."""
    results, steps, batch = {}, args.verify_steps, 8
    g = torch.Generator().manual_seed(args.seed + 1)
    toy = [(torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]
    toy = [(x.to(ctx.device), y.to(ctx.device)) for x, y in toy]
    lm = [common.lm_batch(batch, 32, i, args.seed, ctx.device) for i in range(steps)]
    build_lm = lambda: common.build_lm(VERIFY_LM, 32, ctx.device, args.seed)  # noqa: E731
    for tp in tps:
        tp_group, dp_group = tp_dp_groups(ctx.world_size, tp)
        layout = f"TP {tp}" + (f" x DP {ctx.world_size // tp}" if tp < ctx.world_size else "")
        results[f"toy MLP, {layout}"] = verify_model(ctx, args, ToyMLP, toy_tp, toy, tp_group, dp_group)
        results[f"{VERIFY_LM} LM, {layout}"] = verify_model(ctx, args, build_lm, tensor_parallel_lm, lm,
                                                            tp_group, dp_group)
        if tp == ctx.world_size:
            results[f"{VERIFY_LM} LM, naive TP {tp} (all-gather per layer)"] = verify_model(
                ctx, args, build_lm, naive_tensor_parallel_lm, lm, tp_group, dp_group)
    return results


# ----------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------
def param_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def collective_ms(ctx, step, batch) -> float:
    """Milliseconds the collectives ran during one profiled step (gloo's work on CPU, NCCL's
    kernels on a GPU): blocking ones (tensor parallel) wait that long; overlapped ones
    (DDP's buckets) partly hide behind backward."""
    from torch.profiler import ProfilerActivity, profile
    cuda = ctx.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step(batch, common.StepClock(ctx.device))
    total = 0.0
    for e in prof.events():
        name = e.name.lower()
        if (cuda and "nccl" in name and e.device_type == torch.autograd.DeviceType.CUDA) or \
                (not cuda and name.startswith("gloo:")):
            total += (e.time_range.end - e.time_range.start) / 1e3
    return total


def predicted_mb(args, world_size, tp, naive=False) -> float:
    """Bytes a rank communicates per step by the formula (nccl-tests sizes), in MB: per
    block, TP all-reduces b*t*d in forward twice and backward twice (naive: all-gathers
    every layer's output, all-reduces every layer's input gradient); DP all-reduces the
    gradients of what the rank holds, once."""
    d, f, n, _ = common.MODEL_SIZES[args.model_size]
    dp = world_size // tp
    tokens = args.batch_size // dp * args.context_length
    tp_bytes = 0 if tp == 1 else n * tokens * 4 * ((8 * d + 2 * f) if naive else 4 * d)
    held = common.lm_param_count(args.model_size, args.context_length) - n * (4 * d * d + 2 * d * f) * (1 - 1 / tp)
    return (tp_bytes + (held * 4 if dp > 1 else 0)) / 1e6


def benchmark(ctx, args, tps):
    """At this world size: DP alone, then for each TP degree in ``tps`` ours (TP alone, or
    TP x DP), and at TP over all ranks torch's TP and the naive TP, steps alternating."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    W, extra = ctx.world_size, {}
    build = lambda: common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)  # noqa: E731
    g_batch = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)

    def method(name, make_model, dp_group, tp, naive=False):
        dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)

        def make():
            model = make_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(batch, clock):   # this rank's DP group's part of the global batch
                train_step(model, optimizer, tuple(common.shard(t, dp_rank, dp_size) for t in batch), clock)
            for _ in range(2):
                step(g_batch, common.StepClock(ctx.device))
            extra[name] = {"world_size": W, "tp": tp, "dp": W // tp, "param_MB": param_bytes(model) / 1e6,
                           "comm_ms": collective_ms(ctx, step, g_batch),
                           "predicted_MB": predicted_mb(args, W, tp, naive)}
            return step
        return name, make
    methods = dict([method(f"DP {W} (DDPBucketed)", lambda: bucketed.DDPBucketed(build(), 25), dist.group.WORLD, 1)])
    for tp in tps:
        tp_group, dp_group = tp_dp_groups(W, tp)
        if tp < W:
            methods.update([method(f"TP {tp} x DP {W // tp} (ours + DDPBucketed)", lambda t=tp_group, d=dp_group:
                                   bucketed.DDPBucketed(tensor_parallel_lm(build(), t), 25, process_group=d),
                                   dp_group, tp)])
            continue
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(ctx.device.type, (W,))
        methods.update([method(f"TP {W} (ours)", lambda t=tp_group: tensor_parallel_lm(build(), t), dp_group, tp),
                        method(f"TP {W} (torch parallelize_module)", lambda: torch_tensor_parallel_lm(build(), mesh),
                               dp_group, tp),
                        method(f"TP {W}, naive (all-gather per layer)",
                               lambda t=tp_group: naive_tensor_parallel_lm(build(), t), dp_group, tp, naive=True)])
    rows = common.time_methods(ctx, args, methods, global_batch=True)
    for r in rows:
        r.update(extra[r["method"]])
        r.pop("comm_share")
    by_name = {r["method"]: r for r in rows}
    if f"TP {W} (ours)" in by_name:   # steps alternate, so compare them pair by pair
        by_name[f"TP {W} (ours)"].update(common.vs_paired(by_name[f"TP {W} (ours)"],
                                                          by_name[f"TP {W} (torch parallelize_module)"]))
    return rows


HEADERS = ["method", "world_size", "tp", "dp", "step_ms", "step_min_ms", "step_max_ms", "vs_torch", "vs_torch_min",
           "vs_torch_max", "comm_ms", "comm_MB", "predicted_MB", "collectives", "param_MB"]
NAME, TITLE = "08_tensor_parallel", "Tensor parallelism against data parallelism and torch's TP"


def main(argv=None):
    p = common.script_parser(__doc__)
    p.add_argument("--world-sizes", nargs="+", type=int, default=None,
                   help="one job per world size (default: 2 4, with NCCL those this machine has GPUs for; "
                        "ignored under torchrun: its world size)")
    p.add_argument("--tp", nargs="+", type=int, default=None,
                   help="tensor-parallel degrees (default: every divisor > 1 of each world size); "
                        "the rest of the ranks are data parallel")
    p.set_defaults(batch_size=8)
    args = common.parse(p, argv)
    sizes = [args.world_size] if common.under_torchrun() else list(dict.fromkeys(
        args.world_sizes or [w for w in (2, 4) if common.nccl_fits(args.backend, w)]))
    if not sizes or not all(common.nccl_fits(args.backend, w) for w in sizes):
        raise common.UsageError(f"tensor parallelism needs 2 or more ranks, and nccl a GPU per rank: "
                                f"world sizes {sizes or [2]} but {common.gpu_count()} GPU(s) here; {common.NCCL_HINT}")
    d, f, _, heads = common.MODEL_SIZES[args.model_size]
    _, vf, _, vheads = common.MODEL_SIZES[VERIFY_LM]
    plan = {}
    for w in sizes:
        if w < 2:
            raise common.UsageError(f"--world-sizes must be at least 2, got {w}")
        common.check_divisible(args.batch_size, w, "--batch-size")
        plan[w] = [t for t in (args.tp or range(2, w + 1)) if w % t == 0]
    for t in args.tp or []:
        if t < 2 or not any(w % t == 0 for w in sizes):
            raise common.UsageError(f"--tp {t} must be at least 2 and divide a world size ({sizes})")
    checked = ([] if args.no_bench else [(f"the {heads} heads of {args.model_size}", heads), (f"its d_ff {f}", f)]) + \
        ([] if args.no_verify else [(f"the {vheads} heads of the verification LM ({VERIFY_LM})", vheads)])
    for t in {t for ts in plan.values() for t in ts}:   # what this command runs, nothing else
        for what, n in checked:
            if n % t:
                raise common.UsageError(f"tensor-parallel degree {t} does not divide {what}: "
                                        f"choose --tp (or --model-size) so that it does")

    for w in sizes:
        if not args.no_verify:
            common.check_verification(common.launch(verify, args, plan[w], world_size=w),
                                      f"{NAME} at {w} ranks, TP {', '.join(map(str, plan[w]))}")
    if args.no_bench:
        return
    rows = []
    for w in sizes:   # one job per world size; the table is rewritten after each
        rows += common.launch(benchmark, args, plan[w], world_size=w)
        if common.is_reporter():
            table = common.save_results(args.out, NAME, rows, {**common.lm_settings(args), "world_size": sizes},
                                        headers=HEADERS, title=TITLE)
    if common.is_reporter():
        print(f"\n{TITLE}\n({args.model_size} LM, {args.backend}/{args.device}, global batch {args.batch_size}x"
              f"{args.context_length}; times in ms, median [min, max] of {args.steps} steps; comm_ms: time the "
              f"collectives ran in one profiled step; MB per rank per step)\n{table}\n"
              f"wrote {args.out}/{NAME}.json and .md")


if __name__ == "__main__":
    common.run_main(main)
