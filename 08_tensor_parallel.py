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

In your own training loop (the copy region has all of it):
    for block in gpt.transformer.h:                     # same weights on every tp rank
        parallelize(block.mlp, {"c_fc": "column", "c_proj": "row"}, tp_group)
    opt = gpt.configure_optimizers(...)                 # parameter groups as usual
    loss.backward()                                     # every tp rank on the same batch
    clip_grad_norm_(gpt, max_norm, tp_group)            # not torch's: a rank holds a part
    opt.step()
    ckpt = {"model": full_state_dict(gpt), "optim": full_optim_state_dict(gpt, opt)}
    load_full_state_dict(gpt, ckpt["model"]); load_full_optim_state_dict(gpt, opt, ckpt["optim"])
Checkpoints hold whole tensors by name: they load at any tensor-parallel degree. Dropout:
parallelize gives every rank of the group the first rank's default generator, so dropout
outside the split layers (after a row layer's all-reduce, on the residual stream) draws the
same mask on every rank; the ranks must then run the same code, as they do. A dropout
between a column and a row layer (on a rank's heads or slice of d_ff) is marked "dropout"
in the plan and draws a mask of its own per rank. Evaluation: every rank of a tp group
must run it (each forward all-reduces over the group); under torch.no_grad() a rank that
skipped it makes the others fail after RowParallelLinear.eval_timeout seconds, saying so.

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
import contextlib
import math
from datetime import timedelta

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


def _reduce_or_explain(y, group, seconds):
    """All-reduce ``y`` in place, waiting at most ``seconds``: outside autograd (evaluation
    under torch.no_grad()) a rank of the group that skipped this forward would otherwise
    leave the others waiting without a word."""
    work = dist.all_reduce(y, group=group, async_op=True)
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as e:
        raise RuntimeError(
            f"a tensor-parallel all-reduce over {dist.get_world_size(group)} ranks did not complete in {seconds:g} s: "
            f"every rank of a tensor-parallel group must run the same forwards, evaluation too (run it on every "
            f"rank of the group, then print or save on one)") from e
    return y


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
        with torch.no_grad():
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(layer.local(getattr(linear, name), name))
        return layer

    def forward(self, x):
        y = F.linear(_CopyToParallel.apply(x, self.process_group), self.weight, self.bias)
        return _GatherFromParallel.apply(y, self.process_group) if self.gather_output else y

    @torch.no_grad()
    def whole(self, t, name="weight"):
        """A tensor shaped like this rank's ``name`` (the weight or the bias, or their
        gradient or optimizer state) made whole, in the original feature order (collective)."""
        full = _gather(t, 0, self.process_group)
        if self.rows is None:
            return full
        return torch.empty_like(full).index_copy_(0, self.rows.to(full.device), full)

    def local(self, whole, name="weight"):
        """This rank's slice of a whole tensor shaped like ``name``."""
        ordered = whole if self.rows is None else whole[self.rows.to(whole.device)]
        n, r = ordered.shape[0] // dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        return ordered[r * n:(r + 1) * n].detach().clone()

    def full_parameters(self) -> dict:
        """The whole weight (and bias) in the original feature order (a collective)."""
        return {name: self.whole(p, name) for name, p in self.named_parameters(recurse=False)}


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (the input features) split over ``process_group``:
    rank r holds columns [r*n, (r+1)*n), n = in_features / group size. The input is this
    rank's slice of the features (a ColumnParallelLinear's output); the partial outputs are
    all-reduced in forward (g), and the bias, whole on every rank, is added after. Under
    torch.no_grad() the all-reduce waits at most ``eval_timeout`` seconds, then says why.
    """

    eval_timeout = 300.0

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
        with torch.no_grad():
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(layer.local(getattr(linear, name), name))
        return layer

    def forward(self, x):
        y = F.linear(x, self.weight)
        if torch.is_grad_enabled():
            y = _ReduceFromParallel.apply(y, self.process_group)
        else:
            y = _reduce_or_explain(y, self.process_group, self.eval_timeout)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def whole(self, t, name="weight"):
        """A tensor shaped like this rank's ``name`` made whole (the bias is whole already)."""
        return _gather(t, 1, self.process_group) if name == "weight" else t.detach().clone()

    def local(self, whole, name="weight"):
        if name != "weight":
            return whole.detach().clone()
        n, r = whole.shape[1] // dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        return whole[:, r * n:(r + 1) * n].detach().clone()

    def full_parameters(self) -> dict:
        return {name: self.whole(p, name) for name, p in self.named_parameters(recurse=False)}


class ParallelDropout(nn.Module):
    """A dropout between a column- and a row-parallel layer (on this rank's slice of the
    features or heads): each rank draws its own mask, from a generator state of its own (a
    seed apart per rank), so the ranks' slices get independent masks while the default
    generator, which the dropouts of the replicated regions draw from, is left untouched
    and stays in step over the group. Megatron-LM's model-parallel RNG in short."""

    def __init__(self, p: float, process_group=None, seed=None):
        super().__init__()
        self.p, self.process_group, self._states = p, process_group, {}
        self.seed = (torch.initial_seed() if seed is None else seed) + 2718 + dist.get_rank(process_group)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self._own_generator(x.device):
            return F.dropout(x, self.p, True)

    @contextlib.contextmanager
    def _own_generator(self, device):
        cuda = device.type == "cuda"
        get = (lambda: torch.cuda.get_rng_state(device)) if cuda else torch.get_rng_state
        put = (lambda s: torch.cuda.set_rng_state(s, device)) if cuda else torch.set_rng_state
        if device not in self._states:
            self._states[device] = torch.Generator(device=device).manual_seed(self.seed).get_state()
        default = get()
        put(self._states[device])
        try:
            yield
        finally:
            self._states[device] = get()
            put(default)


def sync_rng(process_group=None):
    """Give every rank of the group the group's first rank's default generator (CPU, and
    the current GPU's): dropout in the replicated regions then draws the same mask on every
    rank, as long as the ranks run the same code (collective)."""
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(process_group or dist.group.WORLD, 0),
                               group=process_group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def parallelize(module: nn.Module, plan: dict, process_group=None, sync=True) -> nn.Module:
    """Replace the submodules named in ``plan`` by their tensor-parallel form, in place:
    an nn.Linear by this rank's slice ("column" or "row"), an nn.Dropout between a column
    and a row layer by a ParallelDropout ("dropout"). A "column" layer's output slice is the
    input slice of the "row" layer that follows it; what lies between must work feature by
    feature. ``sync``: sync_rng over the group first, so dropout everywhere else draws the
    same masks on every rank (leave it on unless the ranks' generators are in step already).

        for block in gpt.transformer.h:
            parallelize(block.mlp, {"c_fc": "column", "c_proj": "row"}, tp_group)
    """
    if sync:
        sync_rng(process_group)
    for name, kind in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent, old = module.get_submodule(parent_name), module.get_submodule(name)
        if kind == "dropout":
            new = ParallelDropout(old.p, process_group)
        elif kind in ("column", "row"):
            new = (ColumnParallelLinear if kind == "column" else RowParallelLinear).from_linear(old, process_group)
        else:
            raise ValueError(f"{name}: unknown kind {kind!r} (column, row or dropout)")
        setattr(parent, attr, new)
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
    out the same on every rank, so they need no communication). A block without the MLP's
    two layers (a mixture of experts in their place, 12) keeps its MLP whole."""
    tp = dist.get_world_size(process_group)
    for block in model.blocks:
        mlp = hasattr(block, "ff_in")
        if block.n_heads % tp or (mlp and block.ff_in.out_features % tp):
            raise ValueError(f"{tp} ranks must divide the {block.n_heads} heads and d_ff")
        block.qkv = ColumnParallelLinear.from_linear(block.qkv, process_group,
                                                     rows=heads_by_rank(block.n_heads, block.head_dim, tp))
        parallelize(block, {"proj": "row", **({"ff_in": "column", "ff_out": "row"} if mlp else {})}, process_group,
                    sync=False)
    sync_rng(process_group)
    return model


# ---- in a training loop: clip by the global norm, checkpoints of whole tensors ---------
def split_owner(module: nn.Module, name: str):
    """The tensor-parallel layer that holds the parameter ``name`` split, or None when it is
    whole on every rank (anything else, and a row-parallel layer's bias)."""
    owner, _, attr = name.rpartition(".")
    layer = module.get_submodule(owner)
    split = isinstance(layer, ColumnParallelLinear) or (isinstance(layer, RowParallelLinear) and attr == "weight")
    return (layer, attr) if split else None


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, process_group=None, norm_type=2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model: the norm of the whole
    model's gradient, each element counted once over the tensor-parallel ``process_group``
    (the split weights' slices summed over the group, everything whole on every rank once),
    so that every rank clips by the same factor. Returns the total norm (collective: every
    rank of the group calls it)."""
    params = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
    device = params[0][1].grad.device if params else torch.device("cpu")
    split = [p.grad for n, p in params if split_owner(module, n)]
    whole = [p.grad for n, p in params if not split_owner(module, n)]
    if math.isinf(norm_type):
        part = torch.stack([g.abs().max().float() for g in split] or [torch.zeros((), device=device)]).max()
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=process_group)
        total = torch.stack([part] + [g.abs().max().float() for g in whole]).max()
    else:
        part = sum((g.float().norm(norm_type) ** norm_type for g in split), torch.zeros((), device=device))
        dist.all_reduce(part, group=process_group)
        total = (part + sum((g.float().norm(norm_type) ** norm_type for g in whole),
                            torch.zeros((), device=device))) ** (1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for _, p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return total


def full_state_dict(module: nn.Module) -> dict:
    """Every tensor of ``module.state_dict()`` whole, by its original name: the split
    weights gathered over their group (a collective: every rank of the group calls it)."""
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        owner = split_owner(module, name)
        out[name] = owner[0].whole(t, owner[1]) if owner else t.detach()
    return out


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict):
    """Load whole tensors by name (a full_state_dict saved at any tensor-parallel degree):
    each rank keeps its slice of the split ones."""
    for name, t in module.state_dict(keep_vars=True).items():
        owner = split_owner(module, name)
        t.copy_(owner[0].local(state[name], owner[1]) if owner else state[name])


def full_optim_state_dict(module: nn.Module, optimizer) -> dict:
    """The optimizer's state with whole tensors, keyed by parameter name, and its groups
    (their settings and parameter names): loadable at any tensor-parallel degree
    (collective)."""
    names = {id(p): n for n, p in module.named_parameters()}
    state = {}
    for p in (p for g in optimizer.param_groups for p in g["params"] if p in optimizer.state):   # the same order on every rank
        owner = split_owner(module, names[id(p)])
        state[names[id(p)]] = {k: owner[0].whole(v, owner[1]) if owner and torch.is_tensor(v) and v.shape == p.shape
                               else v for k, v in optimizer.state[p].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_full_optim_state_dict(module: nn.Module, optimizer, full: dict):
    """Load a full_optim_state_dict into ``optimizer``, whose groups hold the same
    parameters in the same order: each rank keeps its slices of the split states."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, n in enumerate(order):
        if n in full["state"]:
            owner = split_owner(module, n)
            state[i] = {k: owner[0].local(v, owner[1]) if owner and torch.is_tensor(v) and v.dim() else v
                        for k, v in full["state"][n].items()}
    ids, groups = iter(range(len(order))), []
    for saved, g in zip(full["param_groups"], optimizer.param_groups):
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": [next(ids) for _ in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
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
