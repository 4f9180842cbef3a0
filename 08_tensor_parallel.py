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

In your own training loop (the copy region and placement.py have all of it):
    for block in gpt.transformer.h:                     # same weights on every tp rank
        parallelize(block.mlp, {"c_fc": "column", "c_proj": "row"}, tp_group)
    opt = gpt.configure_optimizers(...)                 # parameter groups as usual
    loss.backward()                                     # every tp rank on the same batch
    clip_grad_norm_(gpt, max_norm, process_group=tp_group)   # not torch's: a rank holds a part
    opt.step()
    ckpt = {"model": full_state_dict(gpt, tp_group), "optim": full_optim_state_dict(gpt, opt, tp_group)}
    load_full_state_dict(gpt, ckpt["model"]); load_full_optim_state_dict(gpt, opt, ckpt["optim"])
Checkpoints hold whole tensors by name, on the group's first rank: they load at any
tensor-parallel degree, and on one process. Dropout:
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
Writes <out>/08_tensor_parallel.{json,md}.
"""

import common

# ---- begin copy: tensor-parallel layers (need torch, the standard library and placement.py) ----
import contextlib
import copy
import math
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from placement import (clip_grad_norm_, full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                       load_full_state_dict, path_matches, place, placements)   # noqa: F401 (what a loop needs, from here too)


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


# ---- sequence parallelism: between the split linears, each rank holds its part of the sequence
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor       # torch >= 2.14: *_single
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_sequence(x, group):
    """(b, t/T, ...) on each rank -> (b, t, ...) on every rank, the ranks' parts in order."""
    n = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()
    out = torch.empty(n * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    _all_gather(out, x, group=group)
    return out.transpose(0, 1)


def _scatter_sequence_sum(x, group):
    """(b, t, ...) partial sums on each rank -> this rank's part (b, t/T, ...) of their sum."""
    n = dist.get_world_size(group)
    x = x.transpose(0, 1).contiguous()
    out = torch.empty(x.shape[0] // n, *x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter(out, x, group=group)
    return out.transpose(0, 1)


def _my_part(x, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=1)[r]


class _ScatterSequence(torch.autograd.Function):
    """A whole sequence (the same on every rank) -> this rank's part; backward all-gathers
    the parts' gradients, so what made it (the embeddings) gets its whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_part(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """The parts made whole again (before what needs the whole sequence: the final norm and
    head, replicated); backward keeps this rank's part of the gradient (every rank's is the same)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_part(grad, ctx.group).contiguous(), None


class _SequenceParallelInput(torch.autograd.Function):
    """A column-parallel linear on a sequence-parallel input: the sequence all-gathered, then
    multiplied; backward reduce-scatters the input's gradient back to the parts. The weight's
    gradient needs the whole input: ``keep`` saves the gathered input (the bytes of TP's all-
    reduces, the whole input kept), otherwise backward gathers it again (Megatron-LM's
    choice: an all-gather more per layer, only this rank's part kept)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, keep):
        ctx.group, ctx.has_bias, ctx.keep = group, bias is not None, keep
        whole = _gather_sequence(x, group)
        ctx.save_for_backward(whole if keep else x, weight)
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = x if ctx.keep else _gather_sequence(x, ctx.group)
        g2 = grad.reshape(-1, grad.shape[-1])
        return (_scatter_sequence_sum(grad.matmul(weight), ctx.group), g2.t().matmul(whole.reshape(-1, whole.shape[-1])),
                g2.sum(0) if ctx.has_bias else None, None, None)


class _SequenceParallelOutput(torch.autograd.Function):
    """A row-parallel linear's partial outputs reduce-scattered to this rank's part of the
    sequence; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _scatter_sequence_sum(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


def _sum_over(group):
    """A parameter's gradient hook: the sum over ``group`` of what each rank's part gave."""
    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


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
    ``sequence_parallel``: the input is this rank's part of the sequence (dimension 1), all-
    gathered first (backward: reduce-scattered), as with sequence parallelism; backward
    gathers it again for the weight's gradient unless ``keep_gathered`` (memory for bytes).
    """

    sequence_parallel = keep_gathered = False

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
        for p in (self.weight, self.bias):   # rows, in the order ``rows`` puts them, split over the group
            if p is not None:
                place(p, "shard", process_group, 0, (out_features,) + tuple(p.shape[1:]), rows)

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
        if self.sequence_parallel:
            return _SequenceParallelInput.apply(x, self.weight, self.bias, self.process_group, self.keep_gathered)
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
    ``sequence_parallel``: the partial outputs are reduce-scattered to this rank's part of
    the sequence instead (backward: all-gathered).
    """

    eval_timeout = 300.0
    sequence_parallel = False

    def __init__(self, in_features, out_features, bias=True, process_group=None, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(process_group)
        if in_features % tp:
            raise ValueError(f"in_features {in_features} does not divide over {tp} ranks")
        self.in_features, self.out_features, self.process_group = in_features, out_features, process_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(6 * tp - 1))   # nn.Linear's bound, whole fan-in
        place(self.weight, "shard", process_group, 1, (out_features, in_features))   # columns split
        if self.bias is not None:
            place(self.bias, "replicate", process_group)

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
        if self.sequence_parallel:
            y = _SequenceParallelOutput.apply(y, self.process_group)
        elif torch.is_grad_enabled():
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


class _SumOverParallel(_CopyToParallel):
    """A sum every rank's part adds to and every rank then uses (a norm's statistic over
    features split across the group): all-reduced in forward, and its gradient all-reduced
    in backward as f's (each rank's use of it contributes)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x



class _SharedOutput(torch.autograd.Function):
    """Identity in forward; in backward, the gradient of the output features [start, stop)
    summed over the group: a replicated layer whose output every rank's heads use directly
    (MLA's shared rotary key), each rank's gradient of it only its own heads' part."""

    @staticmethod
    def forward(ctx, y, group, start, stop):
        ctx.group, ctx.start, ctx.stop = group, start, stop
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        part = grad[..., ctx.start:ctx.stop].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start:ctx.stop] = part
        return grad, None, None, None


# ops that take a statistic along a dim: (where the dim is among the arguments, input first;
# its default, None for every dim); layer_norm, rms_norm and group_norm by their shapes
_ACROSS = {**dict.fromkeys(("sum", "nansum", "mean", "nanmean", "std", "var", "std_mean", "var_mean", "prod", "amax",
                            "amin", "aminmax", "logsumexp", "argmax", "argmin", "median", "nanmedian", "max", "min",
                            "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
                            "logcumsumexp"), (1, None)),
           **dict.fromkeys(("norm", "linalg_norm", "linalg_vector_norm", "quantile", "nanquantile"), (2, None)),
           "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1), "normalize": (2, 1)}
# ops whose output may have its input's shape with its features moved (not followed through)
_LAYOUT = {"transpose", "transpose_", "permute", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "__get__",
           "flip", "fliplr", "flipud", "roll", "rot90", "view", "reshape", "view_as", "reshape_as", "unflatten",
           "flatten", "matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum", "tensordot", "linear", "gather",
           "scatter", "scatter_add", "index_select", "take_along_dim", "__getitem__", "as_strided", "expand",
           "expand_as", "squeeze", "unsqueeze"}


def _dims_across(name: str, args, kwargs, ndim: int) -> set:
    """The dims of an ``ndim``-dim input (``args[0]``) that the op ``name`` takes a statistic
    along (empty for any other op, and for max / min of two tensors)."""
    if name in ("layer_norm", "rms_norm"):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
        return set(range(ndim - (1 if isinstance(shape, int) else len(shape)), ndim))
    if name == "group_norm":
        return set(range(1, ndim))
    if name not in _ACROSS or not ndim or "other" in kwargs:
        return set()
    at, default = _ACROSS[name]
    dim = args[at] if len(args) > at else kwargs.get("dim", default)
    if isinstance(dim, (torch.Tensor, str)):   # (max of two tensors; a named dim)
        return set()
    if dim is None or isinstance(dim, bool) or (isinstance(dim, (tuple, list)) and not dim):   # (std(x, unbiased))
        return set(range(ndim))
    return {d % ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}


class _SplitProbe(torch.overrides.TorchFunctionMode):
    """parallelize's look at a region's first eager forward (the module holding a row
    layer, from its start to its end): a tensor a column layer returned is split over the
    group, and so is whatever an op makes from one, until a row layer makes it whole again.
    A parameter the plan left whole that an op combines with split features, itself or
    through what is computed from it alone (softplus(alpha)), gets only this rank's part of
    its gradient there (a learned activation's scalars between the column and the row
    layer, a scale every head uses): that op gets it through f (its gradient summed over the
    group), and from then on its module's forward sees it through f (_summed_in_forward).
    An op that takes a statistic along the split features themselves (a mean, a spread, a
    softmax or a norm over them: Gemma 3n's sparse gate) would take it over this rank's part
    alone, a different model: refused, naming the op and the region (the dim a column layer
    split is followed through ops that keep their input's shape; a module with a true
    ``sums_over_group``, SplitRMSNorm, sums its statistic over the group itself).
    ``whole``: id -> name of the parameters no plan entry placed, as the modules hold them
    now (07's FSDP lends its whole tensors); ``owners``: name -> (module, attribute);
    ``met``: the names found; ``where``: the region's name."""

    def __init__(self, whole: dict, owners: dict, group, where=""):
        super().__init__()
        self.whole, self.owners, self.group, self.where = whole, owners, group, where
        self.split, self.origin, self.met, self.used_whole = {}, {}, set(), set()
        self.dims, self.quiet = {}, 0   # id of a split tensor -> the dim holding the split features

    def __enter__(self):
        super().__enter__()
        return self

    def sources(self, t) -> set:
        """The whole parameters ``t`` is, or was computed from alone."""
        return {self.whole[id(t)]} if id(t) in self.whole else set(self.origin.get(id(t), (None, ()))[1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        split = any(id(t) in self.split for t in flat)
        if split and not self.quiet and args and id(args[0]) in self.dims:
            self.refuse_across(func, args, kwargs)
        mine = set().union(*(self.sources(t) for t in flat))
        if split and mine:   # each rank's part of their gradient here: summed over the group
            self.met |= mine
            args, kwargs = torch.utils._pytree.tree_map(
                lambda t: _CopyToParallel.apply(t, self.group) if isinstance(t, torch.Tensor) and self.sources(t)
                else t, (args, kwargs))
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            if split and mine:
                name = sorted(mine)[0]
                shape = tuple(getattr(*self.owners[name]).shape)
                raise ValueError(f"{name} {shape}: a parameter the plan leaves whole meets features split over the "
                                 f"group's {dist.get_world_size(self.group)} ranks and does not fit their part "
                                 f"({str(e).splitlines()[0]}): split it with its layers (name it in the plan; \"heads\" "
                                 f"for one entry a head) or keep the layers around it whole") from e
            raise
        if split:   # (an op that keeps its input's shape keeps where its features are split)
            self.mark(out, dims=[] if getattr(func, "__name__", "") in _LAYOUT else
                      [(t.shape, self.dims[id(t)]) for t in flat if id(t) in self.dims])
        elif mine:   # (indices and masks carry no gradient back: topk's indices of whole scores, DSA's)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                    self.origin[id(t)] = (t, mine)
        return out

    def whole_use(self, x):
        """``x`` goes on whole (into a column layer, or out of the region): the parameters it
        was computed from get their whole gradient there, the same on every rank."""
        for t in torch.utils._pytree.tree_leaves(x):
            if isinstance(t, torch.Tensor):
                self.used_whole |= self.sources(t)

    def check(self):
        """A parameter both met split features and went on whole (MLA's key/value
        down-projection, its rotary key used by this rank's heads and the rest through a
        column layer): its gradient is neither this rank's part nor whole; refused."""
        both = sorted(self.met & self.used_whole)
        if both:
            raise ValueError(f"{both[0]} {tuple(getattr(*self.owners[both[0]]).shape)}: a parameter the plan leaves "
                             f"whole of which part meets features split over the group's "
                             f"{dist.get_world_size(self.group)} ranks and part goes on whole: name it in the plan "
                             f"(\"shared\" with the output features every rank's heads use, or split it with its "
                             f"layers)")

    def mark(self, out, split=True, dims=None):
        """A column layer's output (``split``) or a row layer's (whole): what they computed
        from whole parameters before them no longer counts (their input's gradient is
        all-reduced, or their output is the same on every rank). A column layer's output has
        its features split in its last dim; an op's (``dims``: (shape, dim) of its split
        inputs) keeps the dim of an input of its own shape, and has none known otherwise."""
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.origin.pop(id(t), None)
                if not split:
                    self.split.pop(id(t), None)
                    self.dims.pop(id(t), None)
                    continue
                self.split[id(t)] = t   # (held until the region ends: an id is not reused meanwhile)
                dim = (t.dim() - 1 if t.dim() else None) if dims is None else \
                    next((d for shape, d in dims if shape == t.shape), None)
                if dim is None:
                    self.dims.pop(id(t), None)
                else:
                    self.dims[id(t)] = dim

    def refuse_across(self, func, args, kwargs):
        """ValueError where ``func`` takes a statistic along the split features of its input."""
        x, name = args[0], getattr(func, "__name__", str(func))
        if self.dims[id(x)] not in _dims_across(name, args, kwargs, x.dim()):
            return
        tp, n = dist.get_world_size(self.group), x.shape[self.dims[id(x)]]
        raise ValueError(f"{self.where}: {name} over the {n * tp} features its column layers split over the group's "
                         f"{tp} ranks would be taken over each rank's {n} alone, a different model: keep this "
                         f"module's layers whole (leave them out of the plan; an RMS norm over them: \"norm\")")


def _summed_in_forward(owner: nn.Module, attr: str, group):
    """From now on ``owner``'s forward sees its parameter ``attr`` through f: its gradient
    summed over the group in backward, where each rank's use of it gives its own part. (The
    tensor shadows the parameter in the module's __dict__ for the call, as 07's FSDP lends
    its whole tensors; what was there before is put back.)"""
    held = []

    def before(m, args):
        held.append(m.__dict__.get(attr))
        m.__dict__[attr] = _CopyToParallel.apply(getattr(m, attr), group)

    def after(m, args, out):
        before_call = held.pop()
        if before_call is None:
            m.__dict__.pop(attr, None)
        else:
            m.__dict__[attr] = before_call
    owner.register_forward_pre_hook(before)
    owner.register_forward_hook(after, always_call=True)


def _probe_regions(module: nn.Module, owners: dict, group) -> set:
    """Hooks for _SplitProbe: on each module that holds a RowParallelLinear as a child (a
    region), for its first eager forward; on each ColumnParallelLinear and RowParallelLinear,
    to mark its output split or whole (and a column's input as going on whole); all removed
    once every region has run. ``owners``: name -> (module, attribute) of the parameters no
    plan entry placed. Returns the set of the names summed, filled as the regions run (a
    forward torch.compile traces is not probed: the hooks wait for an eager one)."""
    met, state, columns = set(), {"probe": None}, []
    regions = {module.get_submodule(n.rpartition(".")[0]) for n, m in module.named_modules()
               if isinstance(m, RowParallelLinear)}
    names = {id(m): n or type(m).__name__ for n, m in module.named_modules()}
    handles = {}

    def enter(m, args, kwargs):
        if state["probe"] is None and not torch.compiler.is_compiling():
            whole = {id(getattr(o, a)): name for name, (o, a) in owners.items()}   # (as lent now, under FSDP)
            state["probe"], state["region"] = _SplitProbe(whole, owners, group, names[id(m)]).__enter__(), m

    def leave(m, args, kwargs, out):
        probe = state["probe"]
        if probe is None or state["region"] is not m:
            return
        probe.__exit__(None, None, None)
        state["probe"] = None
        for h in handles.pop(m):
            h.remove()
        if not handles:
            for h in columns:
                h.remove()
        probe.whole_use(out)
        probe.check()
        for name in sorted(probe.met - met):
            _summed_in_forward(*owners[name], group)
        met.update(probe.met)

    def mark(m, args, out):   # a column's output is split (unless gathered); a row's is whole again
        if state["probe"] is not None:
            state["probe"].mark(out, isinstance(m, ColumnParallelLinear) and not m.gather_output)

    def hush(m, args):   # a module that sums its statistics over the group itself
        if state["probe"] is not None:
            state["probe"].quiet += 1

    def unhush(m, args, out):
        if state["probe"] is not None and state["probe"].quiet:
            state["probe"].quiet -= 1

    def into_column(m, args):
        if state["probe"] is not None:
            state["probe"].whole_use(args)
    for region in regions:
        handles[region] = (region.register_forward_pre_hook(enter, with_kwargs=True),
                           region.register_forward_hook(leave, with_kwargs=True, always_call=True))
    columns += [m.register_forward_hook(mark) for m in module.modules()
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    columns += [m.register_forward_pre_hook(into_column) for m in module.modules() if isinstance(m, ColumnParallelLinear)]
    for m in (m for m in module.modules() if getattr(m, "sums_over_group", False)):
        columns += [m.register_forward_pre_hook(hush), m.register_forward_hook(unhush, always_call=True)]
    return met


def summed_whole(module: nn.Module) -> list:
    """The parameters parallelize left whole that its look at the first forward found meeting
    split features, whose gradients it therefore sums over the group (sorted names; empty
    before the model's first eager forward)."""
    return sorted(getattr(module, "_summed_whole", ()))


def _rms_eps(norm: nn.Module) -> float:
    """The epsilon of an RMS norm of the form weight * x * rsqrt(mean(x^2) + eps) (Llama's,
    OLMo-2's), checked on a random input; ValueError for any other form."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{type(norm).__name__}: a norm split over ranks must be an RMS norm with a 1-D weight "
                         f"and an eps (variance_epsilon)")
    g = torch.Generator().manual_seed(0)
    if weight.is_meta:   # (a model built on meta, to be filled from a checkpoint: a copy of it on the host)
        norm = copy.deepcopy(norm).to_empty(device="cpu")
        weight = norm.weight
        with torch.no_grad():
            weight.copy_(torch.rand(weight.shape, generator=g) + 0.5)
    x = torch.randn(3, weight.numel(), generator=g).to(weight)
    with torch.no_grad():
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        if not torch.allclose(norm(x), want, rtol=1e-4, atol=1e-5):
            raise ValueError(f"{type(norm).__name__} is not weight * x * rsqrt(mean(x^2) + eps): the kit cannot "
                             f"split it over ranks (keep it whole, its projection gathered)")
    return eps


class SplitRMSNorm(nn.Module):
    """An RMS norm over features a column split spread over ``process_group`` (OLMo-2's
    q_norm over the q of every head): this rank's slice of the weight; the mean of squares
    is over every rank's features (the ranks' sums all-reduced), so each rank normalizes its
    slice exactly as the whole norm would. ``from_norm(norm)`` checks the norm's form first."""

    sums_over_group = True   # (parallelize's look at the first forward: its sum over a rank's part is summed)

    def __init__(self, features, eps, process_group=None, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(process_group)
        if features % tp:
            raise ValueError(f"{features} features do not divide over {tp} ranks")
        self.features, self.eps, self.process_group = features, eps, process_group
        self.weight = nn.Parameter(torch.ones(features // tp, device=device, dtype=dtype))
        place(self.weight, "shard", process_group, 0, (features,))

    @classmethod
    def from_norm(cls, norm: nn.Module, process_group=None):
        layer = cls(norm.weight.numel(), _rms_eps(norm), process_group, norm.weight.device, norm.weight.dtype)
        n, r = layer.weight.numel(), dist.get_rank(process_group)
        with torch.no_grad():
            layer.weight.copy_(norm.weight[r * n:(r + 1) * n])
        return layer

    def forward(self, x):
        h = x.float()
        total = h.pow(2).sum(-1, keepdim=True)
        total = _SumOverParallel.apply(total, self.process_group) if torch.is_grad_enabled() else \
            _reduce_or_explain(total, self.process_group, RowParallelLinear.eval_timeout)
        return self.weight * (h * torch.rsqrt(total / self.features + self.eps)).to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) split over ``process_group``: rank r holds
    the ids [r*n, (r+1)*n). Each rank looks up the ids it holds (zeros for the rest) and the
    ranks' results are all-reduced; backward reaches each rank's own rows only."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, process_group=None, device=None, dtype=None):
        super().__init__()
        tp = dist.get_world_size(process_group)
        if num_embeddings % tp:
            raise ValueError(f"a vocabulary of {num_embeddings} does not divide over {tp} ranks")
        self.num_embeddings, self.embedding_dim, self.process_group = num_embeddings, embedding_dim, process_group
        n = num_embeddings // tp
        self.first = dist.get_rank(process_group) * n
        self.padding_idx = padding_idx - self.first if padding_idx is not None and \
            self.first <= padding_idx < self.first + n else None
        self.weight = nn.Parameter(torch.empty(n, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight)
        place(self.weight, "shard", process_group, 0, (num_embeddings, embedding_dim))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, process_group=None):
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("a vocabulary-parallel embedding takes no max_norm, scale_grad_by_freq or sparse")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, process_group,
                    embedding.weight.device, embedding.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.first:layer.first + layer.weight.shape[0]])
        return layer

    def forward(self, ids):
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(elsewhere, 0), self.weight, self.padding_idx)
        y = y.masked_fill(elsewhere.unsqueeze(-1), 0)
        if torch.is_grad_enabled():
            return _ReduceFromParallel.apply(y, self.process_group)
        return _reduce_or_explain(y, self.process_group, RowParallelLinear.eval_timeout)


def packed_rows(parts, tp: int) -> torch.Tensor:
    """Output-feature order of a projection that packs several outputs end to end ([q | k |
    v], [gate | up]) so that each rank's contiguous slice holds its share of every part:
    [part 0's rank-0 rows, part 1's rank-0 rows, ..., part 0's rank-1 rows, ...]."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return torch.cat([torch.arange(s + r * (n // tp), s + (r + 1) * (n // tp))
                      for r in range(tp) for s, n in zip(starts, parts)])


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


KINDS = ("column", "row", "dropout", "divide", "sum", "norm", "vocab", "shared", "heads")


def _count_path(key):
    """A "divide" key's module and its attribute: "a.b.n_heads" -> ("a.b", "n_heads");
    through a config, "a.b.config.num_attention_heads" -> ("a.b", "config.num_attention_heads")."""
    if ".config." in f".{key}":
        owner, _, rest = f".{key}".rpartition(".config.")
        return owner[1:], f"config.{rest}"
    owner, _, attr = key.rpartition(".")
    return owner, attr


def _attribute(obj, path):
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
    return obj


def parallelize(module: nn.Module, plan: dict, process_group=None, sync=True) -> nn.Module:
    """Put ``module``'s submodules named in ``plan`` in tensor-parallel form, in place. A key
    is a module path under ``module``, where ``*`` stands for any one name
    ("layers.*.attention.wq"), and every key must match something. Its kind:
    "column" / "row": an nn.Linear becomes this rank's slice of its output / input features;
    "dropout": an nn.Dropout between a column and a row layer becomes a ParallelDropout;
    "divide": an integer attribute (a head count the model's forward reshapes by, say
    "layers.*.attention.n_heads") is divided by the group's size, so the model's own code
    sees the heads this rank holds; "sum": a module between the two whose weights every
    rank holds whole but applies to its own heads only (Qwen3's per-head q_norm and k_norm),
    each of its parameters' gradients summed over the group as backward makes it;
    ("column", parts): a projection that packs several outputs end to end (Phi-3's qkv_proj:
    the q, k and v features; a gate_up_proj: gate and up), each part split over the group,
    so a rank holds its own heads' q, k and v rows (packed_rows); "norm": an RMS norm over
    the features a column split spread (OLMo-2's q_norm over every head), its weight split
    alike and its mean of squares taken over the group (SplitRMSNorm); "vocab": an
    nn.Embedding split by vocabulary rows (VocabParallelEmbedding); "shared" or ("shared",
    (start, stop)): an nn.Linear every rank holds whole whose output (those features) every
    rank's heads use directly, not through a column layer (MLA's rotary key, a key/value
    projection the group's size does not divide): its gradient summed over the group in
    backward, each rank's being its own heads' part. "heads": a parameter (the key names it,
    "layers.*.self_attn.sinks") holding one entry a head along its first dim, as GPT-OSS's
    attention sinks: this rank's rows, the heads its column layers compute (a placement
    record's shard). "divide" may name a count
    in the module's config ("layers.*.self_attn.config.num_attention_heads", for a forward
    that slices by it): the module gets a config of its own first, the model's unchanged. A
    "column" layer's output slice is the input slice of the "row" layer that follows it;
    what lies between must work feature by feature (or head by head, with the head counts
    divided, or its weights' gradients summed). Everything is checked before anything
    changes (ValueError: a key that matches nothing, a count or a layer the group's size
    does not divide). ``sync``: sync_rng over the group first, so dropout everywhere else
    draws the same masks on every rank.

        plan = {"layers.*.attention.wq": "column", "layers.*.attention.wk": "column",
                "layers.*.attention.wv": "column", "layers.*.attention.wo": "row",
                "layers.*.attention.n_heads": "divide", "layers.*.attention.n_kv_heads": "divide",
                "layers.*.feed_forward.w1": "column", "layers.*.feed_forward.w3": "column",
                "layers.*.feed_forward.w2": "row"}
        parallelize(model, plan, tp_group)
    """
    tp = dist.get_world_size(process_group)
    modules = dict(module.named_modules())
    todo = []
    for key, kind in plan.items():
        kind, parts = (kind[0], tuple(kind[1])) if isinstance(kind, (tuple, list)) else (kind, None)
        if kind not in KINDS or (parts is not None and kind not in ("column", "shared")):
            raise ValueError(f"plan[{key!r}]: unknown kind {plan[key]!r} ({', '.join(KINDS)}, or (\"column\", parts) "
                             f"or (\"shared\", (start, stop)))")
        owner_key, attr = _count_path(key) if kind in ("divide", "heads") else (key, "")
        found = [n for n in modules if path_matches(n, owner_key)]
        if kind == "divide":
            found = [n for n in found if isinstance(_attribute(modules[n], attr), int)]
        if kind == "heads":
            found = [n for n in found if isinstance(modules[n]._parameters.get(attr), nn.Parameter)]
        if not found:
            what = {"divide": "integer attribute", "heads": "parameter"}.get(kind, "module")
            raise ValueError(f"plan key {key!r} matches no {what} of the model")
        for name in found:
            target = modules[name]
            if kind == "divide" and _attribute(target, attr) % tp:
                raise ValueError(f"{name}.{attr} = {_attribute(target, attr)} does not divide over the group's {tp} "
                                 f"ranks: use a tensor-parallel degree that divides it")
            if kind in ("column", "row"):
                features = getattr(target, "out_features" if kind == "column" else "in_features", None)
                if not isinstance(target, nn.Linear) or features % tp:
                    raise ValueError(f"{name}: a {kind}-parallel layer must be an nn.Linear whose "
                                     f"{'output' if kind == 'column' else 'input'} features the group's {tp} ranks "
                                     f"divide")
                if parts is not None and (sum(parts) != features or any(n % tp for n in parts)):
                    raise ValueError(f"{name}: parts {list(parts)} must add up to its {features} output features, "
                                     f"each divided by the group's {tp} ranks")
            if kind == "shared" and not (isinstance(target, nn.Linear) and (parts is None or (
                    len(parts) == 2 and 0 <= parts[0] < parts[1] <= target.out_features))):
                raise ValueError(f"{name}: \"shared\" takes an nn.Linear and (start, stop) within its "
                                 f"{getattr(target, 'out_features', '?')} output features")
            if kind == "norm":
                _rms_eps(target)
                if target.weight.numel() % tp:
                    raise ValueError(f"{name}: {target.weight.numel()} features do not divide over {tp} ranks")
            if kind == "heads" and getattr(target, attr).shape[0] % tp:
                raise ValueError(f"{(name + '.') if name else ''}{attr}: its {getattr(target, attr).shape[0]} heads do "
                                 f"not divide over the group's {tp} ranks")
            if kind == "vocab" and (not isinstance(target, nn.Embedding) or target.num_embeddings % tp):
                raise ValueError(f"{name}: a vocabulary-parallel layer must be an nn.Embedding whose vocabulary the "
                                 f"group's {tp} ranks divide")
            todo.append((name, kind, attr, parts))
    if sync:
        sync_rng(process_group)
    own = set()
    for name, kind, attr, parts in todo:
        target = modules[name]
        if kind == "divide":
            *path, leaf = attr.split(".")
            if path and id(target) not in own:   # (a config the whole model shares: this module's own copy)
                setattr(target, path[0], copy.copy(getattr(target, path[0])))
                own.add(id(target))
            holder = _attribute(target, ".".join(path)) if path else target
            setattr(holder, leaf, getattr(holder, leaf) // tp)
            continue
        if kind == "heads":   # this rank's heads' rows, as a column layer's
            whole = getattr(target, attr)
            n, r = whole.shape[0] // tp, dist.get_rank(process_group)
            part = nn.Parameter(whole.detach()[r * n:(r + 1) * n].clone(), requires_grad=whole.requires_grad)
            place(part, "shard", process_group, 0, tuple(whole.shape))
            setattr(target, attr, part)
            continue
        if kind == "sum":
            for p in target.parameters():
                p.register_hook(_sum_over(process_group))
            continue
        if kind == "shared":
            start, stop = parts or (0, target.out_features)
            target.register_forward_hook(lambda m, i, y, a=start, b=stop: _SharedOutput.apply(y, process_group, a, b))
            continue
        parent_name, _, child = name.rpartition(".")
        if kind == "dropout":
            new = ParallelDropout(target.p, process_group)
        elif kind == "norm":
            new = SplitRMSNorm.from_norm(target, process_group)
        elif kind == "vocab":
            new = VocabParallelEmbedding.from_embedding(target, process_group)
        elif kind == "column":
            new = ColumnParallelLinear.from_linear(target, process_group, rows=packed_rows(parts, tp) if parts else None)
        else:
            new = RowParallelLinear.from_linear(target, process_group)
        setattr(module.get_submodule(parent_name), child, new)
    placed = {id(p) for name, kind, attr, _ in todo if kind != "divide"
              for p in ([getattr(modules[name], attr)] if kind == "heads" else module.get_submodule(name).parameters())}
    owners = {}   # the parameters no plan entry placed: name -> (module, attribute)
    for mname, m in module.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            if id(p) not in placed:
                owners.setdefault(f"{mname}.{attr}" if mname else attr, (m, attr))
    module._summed_whole = _probe_regions(module, owners, process_group)
    replicated_over(module, process_group)
    return module


# MLA's attention as transformers' own plans split it (DeepSeek-V2's, the same module names in
# every MLA family): used where a config describes MLA (kv_lora_rank, qk_rope_head_dim) and its
# plan names no attention (DeepSeek-V3's, Kimi's); what a configuration does not build (q_proj
# beside a q_lora_rank's q_a_proj and q_b_proj) is left out as for any plan
HF_MLA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
               "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "layers.*.self_attn.kv_b_proj": "colwise",
               "layers.*.self_attn.o_proj": "rowwise"}

# transformers' plan styles (config.base_model_tp_plan) in parallelize's words; the two HF
# gathers (a column split whose output is gathered, then a row split of the whole input) are
# split by heads instead wherever the layout is known (_by_heads); the rest kept whole
HF_STYLES = {"colwise": "column", "rowwise": "row", "replicated_with_grad_allreduce": "sum",
             "embedding_rowwise": "vocab"}
HF_GATHERED = ("colwise_gather_output", "colwise_rep", "packed_colwise")   # split by heads where the layout is known
HF_SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")                      # their row partners
_GATHERED = "a column split whose output is gathered again, packed in a layout the model's config does not tell: " \
            "computed whole on every rank"
_SPLIT_INPUT = "a row split of a whole input (its column partner kept whole): computed whole on every rank"
_UNPARTNERED = "a column split whose output is gathered again, with no row partner in its module to take it " \
               "split: computed whole on every rank"
HF_KEPT_WHOLE = {
    "colwise_gather_output": _GATHERED, "colwise_rep": _GATHERED,
    "rowwise_split_input": _SPLIT_INPUT, "rowwise_rep": _SPLIT_INPUT,
    "embedding_rowwise": "a vocabulary-parallel embedding tied to the head: kept whole on every rank",
    "embedding_colwise": "an embedding split by its hidden features: kept whole on every rank",
    "sequence_parallel": "sequence parallelism is not taken from a plan (08's --sp): kept whole",
    "packed_colwise": "experts' fused tensors: split them by expert parallelism (12's split_experts)",
    "packed_rowwise": "a row split of a packed input: kept whole on every rank",
    **dict.fromkeys(("moe_tp_experts", "moe_identity_expert", "grouped_gemm", "ep_dispatch_experts"),
                    "experts: split them by expert parallelism (12's split_experts)"),
    "all_reduce": "outputs summed over ranks (experts under tensor parallelism): kept whole on every rank",
    "mla_kv_a_proj": "MLA's key/value down-projection, in a config without qk_rope_head_dim: kept whole",
    "local_params": "the module's own parameters as plain tensors: those the plan names split, the rest kept whole",
    "replicate": "kept whole on every rank, as the plan says"}


def model_plan(model: nn.Module) -> tuple:
    """The plan a transformers model ships for itself (``config.base_model_tp_plan``) in
    parallelize's words, its keys under the model's own names (the base model's prefix,
    ``model.`` or ``gpt_neox.``, put in front where ``model`` holds the base model):
    (plan, whole). colwise, rowwise, replicated_with_grad_allreduce and embedding_rowwise
    become column, row, sum and vocab; mla_kv_a_proj ("shared") sums the gradient of MLA's
    rotary key, which every head uses; colwise naming a 1-D parameter (attention sinks, a
    gate's bias, one entry a head) becomes "heads". Where HF gathers a column split's output again
    (colwise_gather_output or colwise_rep, then rowwise_split_input or rowwise_rep), or packs
    a linear layer (packed_colwise), the kit splits by heads instead, from
    the layout the config gives: a fused q, k and v projection as ("column", (q, k, v)) with
    the module's head counts divided (in a config of its own), a fused gate and up as
    ("column", (up, up)), a separate projection with a norm over all its heads as "column"
    and that norm as "norm". What it cannot split (a layout it cannot tell, experts, which
    12's split_experts splits, an embedding tied to the head, an MLP whose gate is cut by
    statistics of all its features: _whole_across) stays whole on every rank,
    which computes the same numbers, and goes into ``whole`` ({key: why}); so does an entry
    naming a parameter rather than a module. Entries for modules this configuration does not
    build (a dense MLP in an all-sparse MoE) are left out. ValueError: no plan, or a style
    it does not know.

        plan, whole = model_plan(model)
        parallelize(model, plan, tp_group)
    """
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config   # (a multimodal model's)
    hf = getattr(config, "base_model_tp_plan", None)
    if not hf:
        raise ValueError(f"{type(model).__name__} ships no tensor-parallel plan (config.base_model_tp_plan): "
                         f"write one for parallelize")
    base = _base_prefix(model)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    plan, whole, gathered = {}, {}, {}
    rope = _uniform(config, "qk_rope_head_dim")   # (MLA's rotary key: the tail of kv_a_proj_with_mqa)
    if rope and _uniform(config, "kv_lora_rank") and not any(".self_attn." in f".{k}" for k in hf):
        hf = {**HF_MLA_PLAN, **hf}   # MLA (a config with its ranks) whose plan names no attention: MLA's own plan
    for key, style in hf.items():
        key = base + key
        if style not in HF_STYLES and style not in HF_KEPT_WHOLE:
            raise ValueError(f"plan key {key!r}: style {style!r} is not one the kit knows "
                             f"({', '.join([*HF_STYLES, *HF_KEPT_WHOLE])}): write the plan yourself")
        found = [n for n in modules if path_matches(n, key)]
        if not found:
            named = [p for n, p in parameters.items() if path_matches(n, key)]
            if named and style == "colwise" and ".experts." not in f".{key}." and all(p.dim() == 1 for p in named):
                plan[key] = "heads"   # (one entry a head, its dim 0 split as the heads are: attention sinks)
            elif named:   # (experts' 3D tensors)
                whole[key] = HF_KEPT_WHOLE["packed_colwise"] if ".experts." in f".{key}." else \
                    "a parameter, not a module: kept whole on every rank"
            continue   # a module this configuration does not build
        module, parent = modules[found[0]], modules[found[0].rpartition(".")[0]]
        if style == "embedding_rowwise" and any(m is not module and getattr(m, "weight", None) is module.weight
                                                for m in modules.values()):
            whole[key] = HF_KEPT_WHOLE[style]
        elif style in HF_SPLIT_INPUT or (style in HF_GATHERED and isinstance(module, nn.Linear)):
            gathered[key] = (style, module, parent)
        elif style == "mla_kv_a_proj" and isinstance(module, nn.Linear) and rope:   # its rotary key: every head's
            plan[key] = ("shared", (module.out_features - rope, module.out_features))
        elif style in HF_STYLES:
            plan[key] = HF_STYLES[style]
        else:
            whole[key] = HF_KEPT_WHOLE[style]
    _by_heads(config, gathered, plan, whole)
    _whole_across(modules, plan, whole)
    for key in [k for k, kind in plan.items() if kind == "heads"]:   # (split only beside its module's split heads)
        owner = key.rpartition(".")[0]
        if not any(k.rpartition(".")[0] == owner and (kind if isinstance(kind, str) else kind[0]) == "column"
                   for k, kind in plan.items()):
            plan.pop(key)
            whole[key] = "one entry a head of an attention kept whole: kept whole on every rank"
    for name, m in modules.items():   # linear layers the plan leaves whole, by their module (MLA, routers)
        planned = [k for k in [*plan, *whole] if path_matches(name, k) or any(
            path_matches(f"{name}.{c}", k) for c, _ in m.named_children())]
        if any(isinstance(c, nn.Linear) for c in m.children()) and not planned and ".layers." in f".{name}." \
                and name.startswith(base):
            key = ".".join("*" if part.isdigit() else part for part in name.split("."))
            whole.setdefault(key, f"{', '.join(n for n, c in m.named_children() if isinstance(c, nn.Linear))}: "
                                  f"not in the model's plan, kept whole on every rank")
    return plan, whole


def _whole_across(modules: dict, plan: dict, whole: dict):
    """model_plan's modules whose forward takes a statistic across the features a column
    split spreads, which a rank's slice would take over its own features alone: an MLP with
    activation sparsity (Gemma 3n's first layers: its gate's cutoff is the mean plus a
    multiple of the spread of every intermediate feature) stays whole on every rank, each
    plan key that matched its projections narrowed to the layers that have none."""
    across = [n for n, m in modules.items() if (getattr(m, "activation_sparsity", 0) or 0) > 0]
    if not across:
        return
    inside = lambda n: any(n.startswith(a + ".") for a in across)   # noqa: E731
    for key in [k for k in plan if any(path_matches(n, k) and inside(n) for n in modules)]:
        kind = plan.pop(key)
        plan.update({n: kind for n in modules if path_matches(n, key) and not inside(n)})
    for name in across:
        whole[name] = (f"activation sparsity {modules[name].activation_sparsity}: its gate's cutoff is taken over every "
                       f"intermediate feature, which a column split spreads: kept whole on every rank")


def _base_prefix(model) -> str:
    """The name a transformers model holds its base model under (the decoder its plan's keys
    are relative to), and a dot: its ``base_model_prefix``, or where it holds nothing by
    that name (Llama4ForCausalLM's "language_model": its decoder is under "model"), its one
    child that is a transformers model; a multimodal model's, its language model's (Gemma
    3's "model.language_model.", Llama 4's "language_model.model.": under the outermost
    module built from its text config); "" for a base model itself."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        inner = next(((n, m) for n, m in model.named_modules() if n and getattr(m, "config", None) is text), None)
        return f"{inner[0]}.{_base_prefix(inner[1])}" if inner else ""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix + "."
    inner = [n for n, m in model.named_children() if hasattr(m, "base_model_prefix")]
    return inner[0] + "." if len(inner) == 1 else ""


def layer_values(config, name: str) -> list:
    """A transformers config's ``name``, one value a layer (``config.num_hidden_layers`` of
    them; one where it gives no count): each layer's own where the config is heterogeneous
    and gives it a layer (transformers' per_layer_config: Gemma 4's full-attention layers
    have a head_dim of their own, and reading config.head_dim then raises), else the one
    value repeated; None where the config has none."""
    layers = getattr(config, "num_hidden_layers", None) or 1
    if getattr(config, "is_heterogeneous", False) and name in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(layer, name, None) for layer in config.per_layer_config]
    return [getattr(config, name, None)] * layers


def _uniform(config, name: str):
    """``config.name`` where every layer has the same (layer_values), else None."""
    values = layer_values(config, name)
    return values[0] if all(v == values[0] for v in values) else None


def _by_heads(config, gathered, plan, whole):
    """model_plan's split by heads of what HF gathers or packs: each such projection whose
    output the config's counts account for and whose module has a row partner to take it
    split (Qwen3-Next's linear attention gathers its out_proj, whose width is the heads'
    by chance: kept whole), and its row partners in the same module (kept whole with it
    where it is)."""
    n_q = _uniform(config, "num_attention_heads")   # (None where the layers differ: their layout kept whole)
    n_kv = _uniform(config, "num_key_value_heads") or n_q
    hd = _uniform(config, "head_dim") or (config.hidden_size // n_q if n_q else None)
    up = _uniform(config, "intermediate_size")
    split = set()
    partnered = {key.rpartition(".")[0] for key, (style, _, _) in gathered.items() if style in HF_SPLIT_INPUT}
    for key, (style, linear, parent) in gathered.items():
        if style not in HF_GATHERED:
            continue
        owner, out = key.rpartition(".")[0], linear.out_features
        if owner not in partnered:
            whole[key] = _UNPARTNERED
            continue
        if n_q and hd and out == (n_q + 2 * n_kv) * hd and out != 2 * (up or 0):   # q, k and v in one
            plan[key] = ("column", (n_q * hd, n_kv * hd, n_kv * hd))
            plan.update({f"{owner}.{count}": "divide" for count in ("num_heads", "num_attention_heads",
                                                                    "num_key_value_heads", "config.num_attention_heads",
                                                                    "config.num_key_value_heads")
                         if isinstance(_attribute(parent, count), int)})   # the counts its forward slices by
        elif up and out == 2 * up:                        # gate and up in one
            plan[key] = ("column", (up, up))
        elif n_q and hd and out in (n_q * hd, n_kv * hd):   # one of q, k, v, normed over all its heads
            plan[key] = "column"
            plan.update({f"{owner}.{name}": "norm" for name, child in parent.named_children()
                         if isinstance(getattr(child, "weight", None), torch.Tensor) and child.weight.dim() == 1
                         and child.weight.numel() == out})
        else:
            whole[key] = HF_KEPT_WHOLE["colwise_gather_output"]
            continue
        split.add(owner)
    for key, (style, _, _) in gathered.items():
        if style in HF_SPLIT_INPUT:
            if key.rpartition(".")[0] in split:
                plan[key] = "row"
            else:
                whole[key] = HF_KEPT_WHOLE[style]
    kept = {key.rpartition(".")[0] for key, (style, _, _) in gathered.items() if style in HF_GATHERED
            and key in whole}
    for key in [k for k, v in plan.items() if v == "row" and k.rpartition(".")[0] in kept]:   # (a packed_colwise's)
        del plan[key]
        whole[key] = "a row split whose column partner is kept whole: computed whole on every rank"
    return split


def replicated_over(module: nn.Module, process_group=None):
    """Record a "replicate" placement over the group on every parameter of ``module`` that
    no split over it placed: whole and the same on every rank of the group."""
    for p in module.parameters():
        if not any(pl.group is process_group for pl in placements(p)):
            place(p, "replicate", process_group)


def heads_by_rank(n_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Output-feature order of a fused qkv projection ([q of every head, k ..., v ...]) that
    gives each rank's contiguous slice whole heads: [q, k, v of rank 0's heads, rank 1's ...]."""
    return packed_rows([n_heads * head_dim] * 3, tp)


def tensor_parallel_lm(model: nn.Module, process_group=None, sequence_parallel=False, keep_gathered=False) -> nn.Module:
    """The kit's TransformerLM in tensor-parallel form, in place: in every block the fused
    qkv projection and the MLP's first layer are column-parallel (heads and d_ff split over
    the group), the attention output and the MLP's second layer row-parallel. Embeddings,
    norms and the output head stay whole on every rank (replicated: their gradients come
    out the same on every rank, so they need no communication). A block without the MLP's
    two layers (a mixture of experts in their place, 12) keeps its MLP whole.

    ``sequence_parallel`` (Korthikanti et al. 2022): between the split linears each rank
    holds its part of the sequence (t/T tokens: the residual stream, the norms and what they
    keep for backward). The first block takes this rank's part of the embeddings (backward:
    all-gathered), each column layer all-gathers its input (backward: reduce-scatters), each
    row layer reduce-scatters its output (backward: all-gathers), and the final norm gathers
    its input whole (for itself and the head). The blocks' norms see this rank's
    tokens only: a hook on each of their parameters sums the gradient over the group as
    backward makes it (so any loop, accumulation included, sees the whole gradient).
    ``keep_gathered``: see ColumnParallelLinear. Under a pipeline (09's LMStage) the stages
    pass each tp rank's part of the sequence: a third of TP's bytes at tp 3, say."""
    tp = dist.get_world_size(process_group)
    for block in model.blocks:
        mlp = hasattr(block, "ff_in")
        if tp > 1:
            block.qkv = ColumnParallelLinear.from_linear(block.qkv, process_group,
                                                         rows=heads_by_rank(block.n_heads, block.head_dim, tp))
        parallelize(block, {"proj": "row", **({"ff_in": "column", "ff_out": "row"} if mlp else {})}, process_group,
                    sync=False)
        if sequence_parallel and mlp:
            for name in ("qkv", "proj", "ff_in", "ff_out"):
                getattr(block, name).sequence_parallel = True
                getattr(block, name).keep_gathered = keep_gathered
            for p in list(block.ln1.parameters()) + list(block.ln2.parameters()):
                p.register_hook(_sum_over(process_group))
        elif sequence_parallel:
            raise ValueError("sequence parallelism needs every block's MLP tensor-parallel (not a mixture of experts)")
    if sequence_parallel and len(model.blocks):
        model.blocks[0].register_forward_pre_hook(lambda mod, args: (_ScatterSequence.apply(args[0], process_group),
                                                                     *args[1:]))
        model.ln_f.register_forward_pre_hook(lambda mod, args: (_GatherSequence.apply(args[0], process_group),
                                                                 *args[1:]))
    replicated_over(model, process_group)
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


# clip_grad_norm_, full_state_dict, load_full_state_dict, full_optim_state_dict and
# load_full_optim_state_dict are the placement record's (common.py): every split weight
# records a "shard" placement, everything else parallelize or tensor_parallel_lm touched a
# "replicate" one, over the group: pass ``process_group=`` the tensor-parallel group.
# ---- end copy: tensor-parallel layers ----


def naive_tensor_parallel_lm(model, process_group=None):
    """The lecture's version: every linear of every block split by columns and its output
    all-gathered, so every rank computes attention and the activations whole."""
    for block in model.blocks:
        for name in ("qkv", "proj", "ff_in", "ff_out"):
            setattr(block, name, ColumnParallelLinear.from_linear(getattr(block, name), process_group, gather_output=True))
    return model


def torch_tensor_parallel_lm(model, mesh, sequence_parallel=False):
    """The same split with torch.distributed.tensor.parallel: qkv's heads ordered by rank as
    for ours, then ColwiseParallel / RowwiseParallel on the same four layers. The replicated
    modules (embeddings, norms, head) get Replicate DTensor parameters, plain tensors in and
    out, as torch's TP examples have every parameter a DTensor: an optimizer's foreach path
    (the default on CUDA) refuses a list that mixes DTensors and plain tensors.
    ``sequence_parallel``: torch's SequenceParallel style on the blocks' norms, the column
    layers' input and the row layers' output sharded on the sequence (Shard(1)), the first
    block's input made Shard(1) from the replicated embeddings and the last block's output
    Replicate again (PrepareModuleInput / PrepareModuleOutput), as ours."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    tp = mesh.size()

    def inputs_to_dtensor(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if torch.is_tensor(t) else t
                     for t in inputs)
    seq = {"input_layouts": Shard(1)} if sequence_parallel else {}
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    for block in model.blocks:
        with torch.no_grad():
            block.qkv.weight.copy_(block.qkv.weight[heads_by_rank(block.n_heads, block.head_dim, tp)])
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(**seq), "proj": RowwiseParallel(**out),
                                         "ff_in": ColwiseParallel(**seq), "ff_out": RowwiseParallel(**out),
                                         **({"ln1": SequenceParallel(), "ln2": SequenceParallel()}
                                            if sequence_parallel else {})})
    replicated = [model.tok, model.pos, model.ln_f, model.head]
    if sequence_parallel:
        parallelize_module(model.blocks[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                     desired_input_layouts=(Shard(1),),
                                                                     use_local_output=True))
        parallelize_module(model.blocks[-1], mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                       desired_output_layouts=Replicate()))
    else:
        replicated += [n for b in model.blocks for n in (b.ln1, b.ln2)]
    for module in replicated:
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


VERIFY_LM, VERIFY_T = "micro", 32   # d_model 128, 4 heads, d_ff 512, 32 tokens: splits over 2 and 4 ranks
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
    full = full_state_dict(model, all_ranks=True)   # over every rank: tp's slices, dp's copies once, on the host
    ok, diff = True, 0.0
    for name, p in ref.named_parameters():
        mine = p.detach().cpu()   # compared where the gathered weights are (a GPU job's reference is on the GPU)
        diff = max(diff, (full[name].double() - mine.double()).abs().max().item())
        try:
            torch.testing.assert_close(full[name], mine)
        except AssertionError:
            ok = False
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"ok": ok and len(full) == len(dict(ref.named_parameters())), "max_diff": diff})
    return {"ok": all(r["ok"] for r in everyone), "max_diff": max(r["max_diff"] for r in everyone)}


def verify(ctx, args, tps):
    """At this world size, for each TP degree in ``tps`` (the rest of the ranks data
    parallel): the toy MLP and the LM; and the naive all-gather TP over all ranks. With
    ``args.sp``: the LM with sequence parallelism too (and keeping the gathered inputs, at
    TP over all ranks)."""
    results, steps, batch, sp = {}, args.verify_steps, 8, getattr(args, "sp", False)
    g = torch.Generator().manual_seed(args.seed + 1)
    toy = [(torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)]
    toy = [(x.to(ctx.device), y.to(ctx.device)) for x, y in toy]
    lm = [common.lm_batch(batch, VERIFY_T, i, args.seed, ctx.device) for i in range(steps)]
    build_lm = lambda: common.build_lm(VERIFY_LM, VERIFY_T, ctx.device, args.seed)  # noqa: E731
    for tp in tps:
        tp_group, dp_group = tp_dp_groups(ctx.world_size, tp)
        layout = f"TP {tp}" + (f" x DP {ctx.world_size // tp}" if tp < ctx.world_size else "")
        results[f"toy MLP, {layout}"] = verify_model(ctx, args, ToyMLP, toy_tp, toy, tp_group, dp_group)
        results[f"{VERIFY_LM} LM, {layout}"] = verify_model(ctx, args, build_lm, tensor_parallel_lm, lm,
                                                            tp_group, dp_group)
        if sp:
            results[f"{VERIFY_LM} LM, {layout}, sequence parallel"] = verify_model(
                ctx, args, build_lm, lambda m, g: tensor_parallel_lm(m, g, sequence_parallel=True), lm,
                tp_group, dp_group)
        if tp == ctx.world_size:
            results[f"{VERIFY_LM} LM, naive TP {tp} (all-gather per layer)"] = verify_model(
                ctx, args, build_lm, naive_tensor_parallel_lm, lm, tp_group, dp_group)
            if sp:
                results[f"{VERIFY_LM} LM, TP {tp}, sequence parallel keeping the gathered inputs"] = verify_model(
                    ctx, args, build_lm, lambda m, g: tensor_parallel_lm(m, g, sequence_parallel=True,
                                                                        keep_gathered=True), lm, tp_group, dp_group)
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


def predicted_mb(args, world_size, tp, naive=False, sp=False, keep=False) -> float:
    """Bytes a rank communicates per step by the formula (nccl-tests sizes), in MB: per
    block, TP all-reduces b*t*d in forward twice and backward twice (naive: all-gathers
    every layer's output, all-reduces every layer's input gradient; SP: all-gathers and
    reduce-scatters it ten times, eight with ``keep`` (torch's: the gathered inputs kept),
    the ends gather it twice, the norms' gradients are all-reduced); DP all-reduces the
    gradients of what the rank holds, once."""
    d, f, n, _ = common.MODEL_SIZES[args.model_size]
    dp = world_size // tp
    tokens = args.batch_size // dp * args.context_length
    tp_bytes = 0 if tp == 1 else n * tokens * 4 * ((8 * d + 2 * f) if naive else 4 * d)
    if sp:
        tp_bytes = ((8 if keep else 10) * n + 2) * tokens * 4 * d + 2 * n * 4 * d
    held = common.lm_param_count(args.model_size, args.context_length) - n * (4 * d * d + 2 * d * f) * (1 - 1 / tp)
    return (tp_bytes + (held * 4 if dp > 1 else 0)) / 1e6


def torch_sp_skip(backend, device) -> str | None:
    """Why torch's SequenceParallel cannot run beside ours on this setting (None: it can):
    over gloo with CUDA tensors its all-gather of the sequence (a functional collective)
    crashes the process, a segmentation fault inside torch (seen on an H200 with torch 2.11),
    instead of raising; it runs under NCCL, one GPU per rank, and on the CPU."""
    if backend == "gloo" and device == "cuda":
        return ("over gloo with CUDA tensors its all-gather of the sequence crashes the process (segmentation "
                "fault inside torch, seen with torch 2.11); it needs NCCL, one GPU per rank")
    return None


def benchmark(ctx, args, tps):
    """At this world size: DP alone, then for each TP degree in ``tps`` ours (TP alone, or
    TP x DP), and at TP over all ranks torch's TP and the naive TP, steps alternating."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    W, extra = ctx.world_size, {}
    build = lambda: common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)  # noqa: E731
    g_batch = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)

    def method(name, make_model, dp_group, tp, naive=False, sp=False, keep=False):
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
                           "predicted_MB": predicted_mb(args, W, tp, naive, sp, keep)}
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
                        *([method(f"TP {W} + SP (ours)", lambda t=tp_group: tensor_parallel_lm(
                            build(), t, sequence_parallel=True), dp_group, tp, sp=True)] if args.sp else []),
                        *([method(f"TP {W} + SP (torch SequenceParallel)", lambda: torch_tensor_parallel_lm(
                            build(), mesh, sequence_parallel=True), dp_group, tp, sp=True, keep=True)]
                          if args.sp and not torch_sp_skip(args.backend, ctx.device.type) else []),
                        method(f"TP {W}, naive (all-gather per layer)",
                               lambda t=tp_group: naive_tensor_parallel_lm(build(), t), dp_group, tp, naive=True)])
    rows = common.time_methods(ctx, args, methods, global_batch=True)
    for r in rows:
        r.update(extra[r["method"]])
        r.pop("comm_share")
    by_name = {r["method"]: r for r in rows}
    for ours, theirs in ((f"TP {W} (ours)", f"TP {W} (torch parallelize_module)"),
                         (f"TP {W} + SP (ours)", f"TP {W} + SP (torch SequenceParallel)")):
        if ours in by_name and theirs in by_name:   # steps alternate, so compare them pair by pair
            by_name[ours].update(common.vs_paired(by_name[ours], by_name[theirs]))
    return rows


def activation_formula(args, tp, sp=False, keep=False) -> float:
    """Bytes a rank keeps for backward through the blocks (float32), per token of its batch:
    each norm keeps its input, its inverse RMS and their product (2d + 1), each linear its
    input, attention (SDPA's fused kernel) q, k, v, its output (proj's input too) and log-sum-
    exp (4d + h), the MLP GELU's input and output (2 d_ff). TP splits what lies between a
    column and a row layer (4d + h + 2 d_ff) by tp and keeps the rest (6d + 2) whole on every
    rank; SP splits everything by tp (keep: the qkv and ff_in inputs whole, 2d, instead of
    this rank's parts). With the blocks' output (d; this rank's part under SP)."""
    d, f, n, h = common.MODEL_SIZES[args.model_size]
    split, whole = 4 * d + h + 2 * f, 6 * d + 2
    per = (split + whole) / tp if sp and not keep else split / tp + (4 * d + 2) / tp + 2 * d if sp else \
        split / tp + whole
    return 4 * args.batch_size * args.context_length * (n * per + (d / tp if sp else d))


def sent_formula(args, tp, sp=False, keep=False) -> float:
    """Bytes a rank sends per step with TP over all ranks (ring collectives): TP all-reduces
    b*t*d four times a block (2(T-1)/T of it each); SP all-gathers and reduce-scatters it
    eight times a block ((T-1)/T each: the same bytes), ten without ``keep`` (the gathers
    again in backward), and at the ends gathers the last block's output and the first's
    input gradient; the norms' gradients (2 a block, d floats) are all-reduced."""
    d, f, n, h = common.MODEL_SIZES[args.model_size]
    act, share = 4 * args.batch_size * args.context_length * d, (tp - 1) / tp
    if not sp:
        return n * 4 * act * 2 * share
    return ((8 if keep else 10) * n + 2) * act * share + n * 2 * 4 * d * 2 * share


def sequence_parallel_accounting(ctx, args):
    """With TP over every rank, with and without SP (ours and torch's), and one process: the
    bytes the blocks keep for backward per rank (counted as autograd saves them, with the
    blocks' output) beside activation_formula, and the bytes sent in a step, counted, beside
    sent_formula."""
    from torch.distributed.device_mesh import init_device_mesh
    W, group, rows = ctx.world_size, dist.group.WORLD, []
    mesh = init_device_mesh(ctx.device.type, (W,))
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    cases = [("one process", 1, lambda m: m, {}),
             (f"TP {W} (ours)", W, lambda m: tensor_parallel_lm(m, group), {}),
             (f"TP {W} + SP (ours)", W, lambda m: tensor_parallel_lm(m, group, sequence_parallel=True), {"sp": True}),
             (f"TP {W} + SP, gathered inputs kept (ours)", W,
              lambda m: tensor_parallel_lm(m, group, sequence_parallel=True, keep_gathered=True),
              {"sp": True, "keep": True}),
             (f"TP {W} (torch parallelize_module)", W, lambda m: torch_tensor_parallel_lm(m, mesh), None),
             *([(f"TP {W} + SP (torch SequenceParallel)", W,
                 lambda m: torch_tensor_parallel_lm(m, mesh, sequence_parallel=True), None)]
               if not torch_sp_skip(args.backend, ctx.device.type) else [])]
    for name, tp, convert, formula in cases:
        model = convert(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
        h = model.tok(x) + model.pos(torch.arange(x.shape[1], device=ctx.device))
        with common.saved_for_backward(exclude=model.parameters()) as saved:
            for block in model.blocks:
                h = block(h)
        held = saved.bytes + h.numel() * h.element_size()   # and the blocks' output
        del h
        with common.count_collectives() as c:
            model(x, y).backward()
        row = {"method": name, "tp": tp, "act_MB": held / 1e6,
               "act_formula_MB": None if formula is None else activation_formula(args, tp, **formula) / 1e6,
               "sent_MB": common.sent_bytes(c.log) / 1e6,
               "sent_formula_MB": None if formula is None else sent_formula(args, tp, **formula) / 1e6}
        everyone = [None] * W
        dist.all_gather_object(everyone, row)
        rows.append({**row, **{k: max(e[k] for e in everyone) for k in ("act_MB", "sent_MB")}})
        del model
    return rows


SP_HEADERS = ["method", "tp", "act_MB", "act_formula_MB", "sent_MB", "sent_formula_MB"]
SP_NAME, SP_TITLE = "08_sequence_parallel", "Sequence parallelism: activation memory and bytes per rank"


HEADERS = ["method", "world_size", "tp", "dp", "step_ms", "step_min_ms", "step_max_ms", "vs_torch", "vs_torch_min",
           "vs_torch_max", "comm_ms", "comm_MB", "predicted_MB", "collectives", "param_MB"]
NAME, TITLE = "08_tensor_parallel", "Tensor parallelism against data parallelism and torch's TP"


def parser():
    """08's flags: the world sizes, the TP degrees, --sp."""
    p = common.script_parser(__doc__, world="see --world-sizes",
                             batch="the least common multiple of 8 and the world sizes; the benchmark's alone")
    p.add_argument("--world-sizes", nargs="+", type=common.number(int, 2), default=None,
                   help="one job per world size (default: 2 4, with NCCL those this machine has GPUs for; "
                        "--world-size N: N alone; under torchrun: its world size)")
    p.add_argument("--tp", nargs="+", type=common.number(int, 2), default=None,
                   help="tensor-parallel degrees (default: every divisor > 1 of each world size); "
                        "the rest of the ranks are data parallel")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism too: verified at every TP degree, timed beside torch's "
                        "SequenceParallel, its activation memory and bytes beside their formulas")
    return p


def checked_args(p, argv):
    """The flags parsed and checked before any worker starts: (args, world sizes, each
    world size's TP degrees)."""
    first = p.parse_args(argv)
    if first.world_size is not None and first.world_sizes and not common.under_torchrun():
        raise common.UsageError("--world-size and --world-sizes both given: --world-size N is --world-sizes N")
    args = common.parse(p, argv, world=lambda a: a.world_size or max(a.world_sizes or [2]), batch_unit=lambda a: None)
    sizes = [args.world_size] if common.under_torchrun() else list(dict.fromkeys(
        [first.world_size] if first.world_size else
        args.world_sizes or [w for w in (2, 4) if common.nccl_fits(args.backend, w)]))
    for w in sizes:
        common.check_ranks(w, args.backend, "--world-sizes")
    if args.batch_size is None:   # every world size's data ranks split it
        args.batch_size = math.lcm(8, *sizes)
    if not sizes or not all(common.nccl_fits(args.backend, w) for w in sizes):
        raise common.UsageError(f"tensor parallelism needs 2 or more ranks, and nccl a GPU per rank: "
                                f"world sizes {sizes or [2]} but {common.gpu_count()} GPU(s) here; {common.NCCL_HINT}")
    d, f, _, heads = common.MODEL_SIZES[args.model_size]
    _, vf, _, vheads = common.MODEL_SIZES[VERIFY_LM]
    plan = {}
    for w in sizes:
        if w < 2:
            raise common.UsageError(f"--world-sizes must be at least 2, got {w}")
        if not args.no_bench:
            common.check_divisible(args.batch_size, w, "--batch-size")
        plan[w] = [t for t in (args.tp or range(2, w + 1)) if w % t == 0]
    for t in args.tp or []:
        if t < 2 or not any(w % t == 0 for w in sizes):
            raise common.UsageError(f"--tp {t} must be at least 2 and divide a world size ({sizes})")
    checked = ([] if args.no_bench else [(f"the {heads} heads of {args.model_size}", heads), (f"its d_ff {f}", f)]) + \
        ([] if args.no_verify else [(f"the {vheads} heads of the verification LM ({VERIFY_LM})", vheads)])
    if args.sp:   # each rank holds t/tp of every sequence
        checked += ([] if args.no_bench else [(f"the sequence (--context-length {args.context_length})",
                                               args.context_length)]) + \
            ([] if args.no_verify else [(f"the verification LM's sequence ({VERIFY_T})", VERIFY_T)])
    for t in {t for ts in plan.values() for t in ts}:   # what this command runs, nothing else
        for what, n in checked:
            if n % t:
                raise common.UsageError(f"tensor-parallel degree {t} does not divide {what}: "
                                        f"choose --tp (or --model-size) so that it does")
    return args, sizes, plan


def run_benchmark(args, sizes, plan):
    """TP beside DP and torch's TP at each world size (and with --sp, the sequence-parallel
    accounting), one job per world size, the tables rewritten after each."""
    rows, sp_skip = [], torch_sp_skip(args.backend, args.device) if args.sp else None
    note = f"SKIP torch SequenceParallel: {sp_skip}" if sp_skip else ""
    if sp_skip and common.is_reporter():
        print(f"benchmark: {note}")
    for w in sizes:   # one job per world size; the table is rewritten after each
        rows += common.launch(benchmark, args, plan[w], world_size=w)
        if common.is_reporter():
            table = common.save_results(args.out, NAME, rows, {**common.lm_settings(args), "world_size": sizes},
                                        headers=HEADERS, title=TITLE, note=note)
    sp_rows = []
    for w in sizes if args.sp else []:
        sp_rows += common.launch(sequence_parallel_accounting, args, world_size=w)
        if common.is_reporter():
            sp_table = common.save_results(args.out, SP_NAME, sp_rows, {**common.lm_settings(args),
                                                                        "world_size": sizes},
                                           headers=SP_HEADERS, title=SP_TITLE, note=note)
    if common.is_reporter():
        print(f"\n{TITLE}\n({args.model_size} LM, {args.backend}/{args.device}, global batch {args.batch_size}x"
              f"{args.context_length}; times in ms, median [min, max] of {args.steps} steps; comm_ms: time the "
              f"collectives ran in one profiled step; MB per rank per step)\n{table}\n"
              f"{common.wrote(args.out, f'{NAME}.json and .md')}")
        if sp_rows:
            print(f"\n{SP_TITLE}\n(act_MB: bytes the blocks keep for backward on a rank, largest rank, counted as "
                  f"autograd saves them; sent_MB: bytes a rank sends in a step, from the collectives counted; "
                  f"each beside its formula)\n{sp_table}\n{common.wrote(args.out, f'{SP_NAME}.json and .md')}")


def main(argv=None):
    args, sizes, plan = checked_args(parser(), argv)
    for w in sizes if not args.no_verify else []:
        common.check_verification(common.launch(verify, args, plan[w], world_size=w),
                                  f"{NAME} at {w} ranks, TP {', '.join(map(str, plan[w]))}")
    if not args.no_bench:
        run_benchmark(args, sizes, plan)


if __name__ == "__main__":
    common.run_main(main)
