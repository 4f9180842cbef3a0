"""The placement record: how each parallel axis laid a parameter out over its ranks, and
what a training loop needs from it. Each axis of the kit (05's DDPBucketed, 07's FSDP,
08's tensor-parallel layers, 09's pipeline stages, 12's experts) records on every
parameter where it put it (``place``); from that record alone, whatever the composition,
``clip_grad_norm_`` clips by the whole model's norm (each tensor counted once),
``full_state_dict`` / ``load_full_state_dict`` and their optimizer twins save and load the
model under its own names, ``count_parameters`` counts it, and ``materialize`` /
``initialized`` make a model built on the meta device real, each rank its own part. It
needs only torch and the standard library: a copy is this whole file, and every copy
region that names placement.py needs it beside it.
"""
import contextlib
import fnmatch
import io
import math
import pickle
import weakref

import torch
import torch.distributed as dist


def path_matches(path: str, pattern: str) -> bool:
    """A module path against a pattern of the same number of dotted names, each matched by
    fnmatch (``*`` for any one name, as in torch's parallelize_module plans): 08's plan keys
    and 12's split_experts."""
    names, keys = path.split("."), pattern.split(".")
    return len(names) == len(keys) and all(fnmatch.fnmatchcase(n, k) for n, k in zip(names, keys))

class Placement:
    """How one axis laid a tensor out over ``group`` (a process group; None: every rank):

    "replicate": every rank of the group holds the same tensor (data-parallel copies,
        tensor parallelism's whole weights, a tied weight's copy on another stage);
    "shard": the tensor is rank r's chunk of a tensor shaped ``shape``, cut along ``dim``
        into chunks of ceil(shape[dim] / n) (the last padded with zeros), after that dim is
        put in the order ``order`` (a tensor of indices; None: as it is);
    "part": the group's other ranks hold other tensors, each rank its own (a pipeline
        stage's layers, one ep rank's experts);
    "tied": another rank of the group holds a copy under another name, kept equal (a tied
        embedding on the first stage and output head on the last): norms count it once,
        checkpoints save it under each name.

    An axis records its placement on each parameter with ``place``; the record (a tuple,
    ``tensor.placement_record``) lists the axes in the order they were applied, so the last
    shard is the one nearest this rank's tensor. It is plain data on an ordinary tensor:
    gradients and optimizer states shaped like the parameter are laid out alike.
    """

    KINDS = ("replicate", "shard", "part", "tied")

    def __init__(self, kind, group=None, dim=0, shape=(), order=None):
        if kind not in self.KINDS:
            raise ValueError(f"placement kind {kind!r}: one of {self.KINDS}")
        self.kind, self.group, self.dim, self.shape, self.order = kind, group, dim, tuple(shape), order

    def __repr__(self):
        size = dist.get_world_size(self.group) if dist.is_initialized() else "?"
        extra = f", dim={self.dim}, shape={list(self.shape)}" if self.kind == "shard" else ""
        return f"Placement({self.kind!r}, {size} ranks{extra})"


def place(tensor, kind, group=None, dim=0, shape=None, order=None, like=None):
    """Append one axis's placement to ``tensor``'s record (after ``like``'s record, for a new
    tensor that stands for ``like``: a shard made from a parameter); returns ``tensor``.
    ``shape``: for "shard", the shape of the tensor it was cut from (default: the tensor's
    own shape times the group's size along ``dim``)."""
    if kind == "shard" and shape is None:
        shape = list(tensor.shape)
        shape[dim] *= dist.get_world_size(group)
    base = placements(like if like is not None else tensor)
    if kind != "shard" and any(p.kind == kind and p.group is group for p in base):
        return tensor   # recorded already (a second wrapper of the same kind over the same group)
    tensor.placement_record = base + (Placement(kind, group, dim, shape or (), order),)
    return tensor


def placements(tensor) -> tuple:
    """``tensor``'s placement record: () for one no axis has touched."""
    return getattr(tensor, "placement_record", ())


_RANKS = weakref.WeakKeyDictionary()   # a group's ranks while the group lives (held, it would keep its threads)


def _ranks(group) -> frozenset:
    """The global ranks of ``group`` (None: every rank)."""
    pg = group or dist.group.WORLD
    got = _RANKS.get(pg)
    if got is None:
        got = _RANKS[pg] = frozenset(dist.get_process_group_ranks(pg))
    return got


def _counter(process_group, known=()):
    """A test of whether this rank counts a tensor once in a sum over ``process_group`` (so
    that every element of the model is counted once over it): it is the first rank of every
    group that replicates it inside ``process_group``, and of every group of ``known`` (the
    groups the model's other records name) that its record does not mention: an axis that
    split or spread the tensor would have said so (a weight a partial tensor-parallel plan
    left whole is the same on every tp rank). A tensor with no record is one process's, the
    same on every rank: the group's first rank counts it. A shard or part spread over ranks
    outside ``process_group`` cannot be summed in it: ValueError. Each group's ranks and this
    rank's place in it are looked up once for every tensor the test is asked about (a clip
    asks it of each parameter every step)."""
    within, me, seen, first = _ranks(process_group), dist.get_rank(), {}, dist.get_rank(process_group) == 0

    def group(g):   # (its ranks, whether they lie inside process_group, this rank's place in it: looked up once)
        got = seen.get(id(g))
        if got is None:
            ranks = _ranks(g)
            got = seen[id(g)] = [ranks, ranks <= within, None]
        return got

    def rank(g, got):
        if got[2] is None:
            got[2] = dist.get_rank(g)
        return got[2]
    known = [(g, group(g)) for g in known if group(g)[1]]

    def counted(tensor) -> bool:
        record = placements(tensor)
        if not record:
            return first
        for p in record:
            got = group(p.group)
            if p.kind in ("replicate", "tied") and got[1] and rank(p.group, got) != 0:
                return False
            if p.kind in ("shard", "part") and not got[1]:
                raise ValueError(f"a parameter is split ({p.kind}) over ranks outside the process group the norm or "
                                 f"count is taken over: pass a process_group that holds them (default: every rank)")
        for g, got in known:
            if not any((group(p.group)[0] & got[0]) - {me} for p in record) and rank(g, got) != 0:
                return False
        return True
    return counted


def _known_groups(params) -> list:
    """Every group the records of ``params`` name (each once)."""
    groups = {}
    for p in params:
        for pl in placements(p):
            groups.setdefault(id(pl.group), pl.group)
    return list(groups.values())


def _parameters(model_or_parameters) -> list:
    if isinstance(model_or_parameters, torch.Tensor):
        return [model_or_parameters]
    params = model_or_parameters.parameters() if hasattr(model_or_parameters, "parameters") else model_or_parameters
    unique = {}
    for p in params:
        unique.setdefault(id(p), p)
    return list(unique.values())


def _group_device(process_group):
    """Where a tensor of the group's collectives lives: the current GPU under NCCL, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(process_group) == "nccl" \
        else torch.device("cpu")


@torch.no_grad()
def clip_grad_norm_(model_or_parameters, max_norm: float, norm_type: float = 2.0, process_group=None):
    """torch.nn.utils.clip_grad_norm_ for a model split over ranks by any composition of axes
    that recorded their placements: the norm of the whole model's gradient, each element
    counted once over ``process_group`` (default: every rank; all of its ranks call it, a
    collective), so every rank clips by the same factor. Returns that norm. ``norm_type``:
    any p, or inf (the largest element). Pass the group spanning the model's ranks when
    other ranks train something else; a group that replicates a parameter beyond it (data-
    parallel copies, each clipping alike) is left out of the count."""
    params = [p for p in _parameters(model_or_parameters) if p.grad is not None]
    device = params[0].grad.device if params else _group_device(process_group)
    counts, fp32, rest = _counter(process_group, _known_groups(params)), [], []
    for p in params:   # (torch's fused norms for float32; each other dtype's in float32)
        if counts(p) and p.grad.numel():
            (fp32 if p.grad.dtype == torch.float32 else rest).append(p.grad)
    norm_type = float(norm_type)
    fused = torch.nn.utils.get_total_norm(fp32, norm_type).to(device) if fp32 else torch.zeros((), device=device)
    inf = math.isinf(norm_type)
    if inf:
        total = torch.stack([g.abs().max().float() for g in rest] + [fused]).max()
    else:
        total = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type for g in rest),
                    fused ** norm_type)
    if dist.get_world_size(process_group) > 1:   # a group of one has nothing to add
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=process_group)
    if not inf:
        total = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)   # max_norm / (total + 1e-6), at most 1
    return total


def _real_numel(tensor) -> int:
    """The elements of ``tensor`` that are the model's (a shard's padding left out)."""
    shards = [p for p in placements(tensor) if p.kind == "shard"]
    if not shards:
        return tensor.numel()
    last = shards[-1]
    shape = list(last.shape) or [1]
    n, r = dist.get_world_size(last.group), dist.get_rank(last.group)
    chunk = -(-shape[last.dim] // n)
    shape[last.dim] = max(0, min(chunk, shape[last.dim] - r * chunk))
    return math.prod(shape)


def count_parameters(model_or_parameters, process_group=None) -> int:
    """The whole model's number of parameters, each counted once over ``process_group``
    (collective: every rank of it calls)."""
    params = _parameters(model_or_parameters)
    counts = _counter(process_group, _known_groups(params))
    mine = sum(_real_numel(p) for p in params if counts(p))
    total = torch.tensor([mine], dtype=torch.float64,
                          device=params[0].device if params else torch.device("cpu"))
    dist.all_reduce(total, group=process_group)
    return int(total.item())


def _gather_shard(t, p, to=None):
    """The tensor ``p`` cut ``t`` from, whole again (collective over p.group); ``to``: only on
    the group's rank ``to`` (a gather: None on the others)."""
    n = dist.get_world_size(p.group)
    if to is None:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=p.group)
    else:
        if t.device.type != "cpu" and dist.get_backend(p.group) == "gloo":
            t = t.cpu()   # (gloo gathers host tensors)
        parts = [torch.empty_like(t) for _ in range(n)] if dist.get_rank(p.group) == to else None
        dist.gather(t.contiguous(), parts, dst=dist.get_global_rank(p.group or dist.group.WORLD, to), group=p.group)
        if parts is None:
            return None
    if not p.shape:   # a 0-d tensor, sharded as one row
        return torch.cat(parts)[:1].reshape(())
    full = torch.cat(parts, dim=p.dim).narrow(p.dim, 0, p.shape[p.dim])
    if p.order is None:
        return full
    return torch.empty_like(full).index_copy_(p.dim, p.order.to(full.device), full)


def _cut_shard(whole, p):
    """This rank's chunk of ``whole`` (shaped p.shape) as ``p`` cuts it."""
    if p.order is not None:
        whole = whole.index_select(p.dim, p.order.to(whole.device))
    whole = whole.reshape(1) if not p.shape else whole
    n, r = dist.get_world_size(p.group), dist.get_rank(p.group)
    chunk = -(-whole.shape[p.dim] // n)
    shape = list(whole.shape)
    shape[p.dim] = chunk
    out = torch.zeros(shape, dtype=whole.dtype, device=whole.device)
    lo, hi = r * chunk, min((r + 1) * chunk, whole.shape[p.dim])
    if lo < hi:
        out.narrow(p.dim, 0, hi - lo).copy_(whole.narrow(p.dim, lo, hi - lo))
    return out


def whole_tensor(t, record):
    """``t`` (a parameter, or its gradient or optimizer state) made whole: every shard of
    ``record`` gathered, innermost first (collective over each shard's group)."""
    t = t.detach()
    for p in reversed(record):
        if p.kind == "shard":
            t = _gather_shard(t, p)
    return t


def local_tensor(whole, record):
    """This rank's part of a whole tensor laid out as ``record`` says."""
    for p in record:
        if p.kind == "shard":
            whole = _cut_shard(whole, p)
    return whole


def _sends(record, process_group) -> bool:
    """Whether this rank contributes a tensor to a checkpoint merged over ``process_group``:
    the first rank of every group inside it that replicates the tensor (a tensor with no
    record: every rank, the first rank's kept)."""
    within = _ranks(process_group)
    return all(dist.get_rank(p.group) == 0 for p in record if p.kind == "replicate" and _ranks(p.group) <= within)


class _TensorsApart(pickle.Pickler):
    """Pickles an object with each plain dense tensor in it left out, as a place in one
    flat byte buffer (``tensors``: each with its offset), shared by every mention of it."""
    ALIGN = 64   # (each tensor's bytes start where any dtype may view them)

    def __init__(self, f):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors, self.ids, self.size = [], {}, 0

    def persistent_id(self, obj):
        if type(obj) is not torch.Tensor or obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            return None
        if id(obj) not in self.ids:
            self.ids[id(obj)] = (len(self.tensors), self.size, obj.dtype, tuple(obj.shape))
            self.tensors.append((obj, self.size))
            self.size += -(-obj.numel() * obj.element_size() // self.ALIGN) * self.ALIGN
        return self.ids[id(obj)]


class _TensorsFrom(pickle.Unpickler):
    """Unpickles what _TensorsApart wrote, its tensors viewed in ``flat`` (one rank's buffer)."""

    def __init__(self, f, flat):
        super().__init__(f)
        self.flat, self.made = flat, {}

    def persistent_load(self, pid):
        if pid not in self.made:
            _, offset, dtype, shape = pid
            nbytes = math.prod(shape) * dtype.itemsize
            self.made[pid] = self.flat[offset:offset + nbytes].view(dtype).reshape(shape)
        return self.made[pid]


def _collect(mine, process_group, all_ranks):
    """Every rank's ``mine``, in rank order, on the group's first rank (or on every rank with
    ``all_ranks``); None elsewhere (collective). The tensors in it travel as one flat buffer
    a rank, the rest pickled (all_gather_object pickles each tensor, and each receiving rank
    unpickled every one by torch.load: a state dict of 8 ranks took 64 loads of every
    tensor); they arrive on the host. The buffers go in one all_gather (or gather) padded to
    the largest where that at most doubles what arrives, else each at its own size (a model
    replicated over the group, which its first rank alone sends)."""
    n = dist.get_world_size(process_group)
    if n == 1:
        return [mine]
    f = io.BytesIO()
    apart = _TensorsApart(f)
    apart.dump(mine)
    heads = [None] * n
    dist.all_gather_object(heads, (f.getvalue(), apart.size), group=process_group)
    sizes, me = [h[1] for h in heads], dist.get_rank(process_group)
    if not max(sizes):   # no tensors anywhere
        return [pickle.loads(h[0]) for h in heads] if all_ranks or me == 0 else None
    padded = n * max(sizes) <= 2 * sum(sizes)
    device = _group_device(process_group)
    flat = torch.zeros(max(sizes) if padded else sizes[me], dtype=torch.uint8, device=device)
    for t, offset in apart.tensors:
        b = t.detach().reshape(-1).view(torch.uint8)
        flat[offset:offset + b.numel()].copy_(b)
    ranks = [dist.get_global_rank(process_group or dist.group.WORLD, i) for i in range(n)]
    if not all_ranks and me != 0:   # what the first rank alone receives
        if padded:
            dist.gather(flat, None, dst=ranks[0], group=process_group)
        elif sizes[me]:
            dist.send(flat, dst=ranks[0], group=process_group)
        return None
    if padded:
        flats = [torch.empty_like(flat) for _ in range(n)]
        if all_ranks:
            dist.all_gather(flats, flat, group=process_group)
        else:
            dist.gather(flat, flats, dst=ranks[0], group=process_group)
    else:
        flats = [flat if i == me else torch.empty(s, dtype=torch.uint8, device=device) for i, s in enumerate(sizes)]
        for i, b in enumerate(flats):
            if sizes[i] and all_ranks:
                dist.broadcast(b, src=ranks[i], group=process_group)
            elif sizes[i] and i != me:
                dist.recv(b, src=ranks[i], group=process_group)
    return [_TensorsFrom(io.BytesIO(h[0]), b.cpu()).load() for h, b in zip(heads, flats)]


def _union(tables) -> dict:
    out = {}
    for table in tables:
        for k, v in table.items():
            out.setdefault(k, v)
    return out


def _host(v):
    return v.detach().cpu().clone() if torch.is_tensor(v) else v


@torch.no_grad()
def full_state_dict(module, process_group=None, all_ranks=False) -> dict:
    """``module.state_dict()`` of the whole model, every tensor whole and on the host, by its
    own name, merged from every rank of ``process_group`` (default: every rank; all call it,
    a collective): on the group's first rank ({} on the others), or with ``all_ranks`` on
    every rank. Loadable by load_full_state_dict on any composition, or by the model of one
    process."""
    mine = {}
    for name, t in module.state_dict(keep_vars=True).items():
        whole = whole_tensor(t, placements(t))
        if _sends(placements(t), process_group):
            mine[name] = _host(whole)
    parts = _collect(mine, process_group, all_ranks)
    return {} if parts is None else _union(parts)


@torch.no_grad()
def load_full_state_dict(module, state: dict, strict=True):
    """Load whole tensors by name (a full_state_dict saved on any composition, or one
    process's state_dict): each rank keeps its part of every tensor it holds. Pass it on
    every rank. ``strict``: a tensor of the module missing from ``state`` is a KeyError."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, t in own.items():
        if name in state:
            t.copy_(local_tensor(state[name].to(t.device, t.dtype), placements(t)))


def _names(module) -> dict:
    """{id(parameter): every name it has in ``module``} (a tied weight has two)."""
    names = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


@torch.no_grad()
def full_optim_state_dict(module, optimizer, process_group=None, all_ranks=False) -> dict:
    """``optimizer``'s state with every tensor whole, keyed by the parameter's name in
    ``module`` (under each name of a tied weight), and its groups' settings with their
    parameters' names, merged over ``process_group`` as full_state_dict does (a
    collective). Loadable by load_full_optim_state_dict on any composition."""
    names = _names(module)
    state = {}
    for p in (p for g in optimizer.param_groups for p in g["params"]):   # the same order on every rank
        record = placements(p)
        entry = {k: whole_tensor(v, record) if torch.is_tensor(v) and v.shape == p.shape and v.dim() else v
                 for k, v in optimizer.state.get(p, {}).items()}
        if entry and _sends(record, process_group):
            state.update({n: {k: _host(v) for k, v in entry.items()} for n in names[id(p)]})
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [n for p in g["params"] for n in names[id(p)]]}
              for g in optimizer.param_groups]
    parts = _collect({"state": state, "groups": groups}, process_group, all_ranks)
    if parts is None:
        return {}
    merged = [dict(g, params=[]) for g in parts[0]["groups"]]
    for part in parts:   # each group's parameters, over every rank (the first rank's settings)
        if len(part["groups"]) != len(merged):
            raise ValueError("the ranks' optimizers have different numbers of parameter groups")
        for g, other in zip(merged, part["groups"]):
            g["params"] += [n for n in other["params"] if n not in g["params"]]
    return {"state": _union(part["state"] for part in parts), "param_groups": merged}


@torch.no_grad()
def load_full_optim_state_dict(module, optimizer, full: dict):
    """Load a full_optim_state_dict (saved on any composition) into ``optimizer``, built over
    this rank's parameters of ``module`` with the saved groups' settings: each parameter
    takes its part of its saved state. Pass it on every rank."""
    names = _names(module)
    if len(optimizer.param_groups) != len(full["param_groups"]):
        raise ValueError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
                         f"{len(full['param_groups'])}")
    state, groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, full["param_groups"]):
        ids = []
        for p in group["params"]:
            if not set(names[id(p)]) & set(saved["params"]):
                raise ValueError(f"{names[id(p)][0]} is not in the saved parameter group it is in here")
            entry = next((full["state"][n] for n in names[id(p)] if n in full["state"]), {})
            if entry:
                state[index] = {k: local_tensor(v.to(p.device), placements(p)) if torch.is_tensor(v) and v.dim()
                                else v for k, v in entry.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- a model built on the meta device: each rank's part made real, filled a tensor at a time --
_HOLDERS = [0]   # how many storage holders were made: their order (an inner wrapper first)


def hold_storage(tensor, holder):
    """Say that ``holder`` (an axis's object with ``materialize_storage(device)``) gives
    ``tensor`` its storage when materialize makes a meta-built model real (FSDP: shards that
    are views of one flat buffer; DDPBucketed: buckets built over the parameters)."""
    if not hasattr(holder, "_holder_order"):
        _HOLDERS[0] += 1
        holder._holder_order = _HOLDERS[0]
    held = tensor.__dict__.setdefault("storage_holders", [])
    if all(h is not holder for h in held):
        held.append(holder)
    return tensor


def make_real(t, data=None, device=None):
    """Put ``data`` (a real tensor shaped like ``t``; default: an uninitialised one on
    ``device``) in place of the meta tensor ``t`` (a parameter or a buffer), keeping ``t``'s
    Python object: whatever holds it (a module, an axis's lists) sees the real tensor, with
    its attributes (the placement record) and its gradient hooks (registered again: they
    belong to the storage torch swaps out)."""
    if data is None:
        data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        data = torch.nn.Parameter(data, requires_grad=t.requires_grad)
    saved = dict(t.__dict__)
    pre = list((t._backward_hooks or {}).values()) if t.requires_grad else []
    post = list((getattr(t, "_post_accumulate_grad_hooks", None) or {}).values())
    torch.utils.swap_tensors(t, data)
    t.__dict__.update(saved)
    if pre or post:
        t._backward_hooks, t._post_accumulate_grad_hooks = None, None
        for hook in pre:
            t.register_hook(hook)
        for hook in post:
            t.register_post_accumulate_grad_hook(hook)
    return t


def _tensors(module) -> dict:
    """{a name the model of one process gives it: [tensor, ...]} for every parameter and buffer
    of ``module`` (a tied one under each name). A wrapper's ``module.`` (the kit's, torch
    DDP's; any module with ``wraps_module``) and torch.compile's ``_orig_mod.`` are left out
    of the names."""
    out = {}

    def walk(mod, prefix, seen):
        for kind in (mod._parameters, mod._buffers):
            for name, t in kind.items():
                if t is not None:
                    out.setdefault(prefix + name, [])
                    if all(x is not t for x in out[prefix + name]):
                        out[prefix + name].append(t)
        wrapper = getattr(mod, "wraps_module", False) or type(mod).__name__ in ("DistributedDataParallel",
                                                                                "OptimizedModule")
        for name, child in mod._modules.items():
            if child is None or id(child) in seen:
                continue
            skip = (wrapper and name == "module") or name == "_orig_mod"
            walk(child, prefix if skip else f"{prefix}{name}.", seen | {id(child)})
    walk(module, "", frozenset())
    return out


@contextlib.contextmanager
def meta_parameters():
    """Build a model inside this block and its parameters go to the meta device as they are
    registered (no storage), while its buffers stay real: the constructor's own code computes
    them as in one process (a rotary module's inv_freq, which no checkpoint holds), bit for
    bit. Apply the axes, then materialize (which moves those buffers to its device) or
    load_hf_checkpoint.

        with meta_parameters():
            model = LlamaForCausalLM(config)      # parameters: shapes only; model.model.rotary_emb.inv_freq: real
    """
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@torch.no_grad()
def materialize(module, device, source=None, strict=True):
    """Give every meta tensor of ``module`` (a model built under ``torch.device("meta")``,
    after the axes were applied: each holds only this rank's part, still on meta) real,
    uninitialised storage on ``device``, this rank's part only, then fill it from ``source``:

    - None: storage only; fill it with load_full_state_dict or load_sharded (the checkpoint
      path: load_sharded reads only this rank's pieces);
    - a state dict of whole tensors (one process's, or full_state_dict's);
    - an iterable of (name, whole tensor) pairs, each cut to this rank's part as it comes
      (``initialized(blueprint)``, the pretraining path: one tensor whole at a time).

    Names are the model's own (a wrapper's ``module.`` and compile's ``_orig_mod.`` aside),
    so pass the outermost object or any part holding the model's modules. An axis that
    keeps storage of its own (FSDP's flat buffers) makes its tensors real itself. Buffers
    that are real already (meta_parameters' computed ones) move to ``device`` as they are.
    Build the optimizer afterwards. ``strict``: a tensor made real that ``source`` did not
    fill is a KeyError. Returns ``module``."""
    device = torch.device(device)
    own = _tensors(module)
    meta = {id(t): (name, t) for name, ts in own.items() for t in ts if t.is_meta}
    holders = {}
    for _, t in meta.values():
        for h in t.__dict__.get("storage_holders", []):
            holders.setdefault(id(h), h)
    for h in sorted(holders.values(), key=lambda h: h._holder_order):
        h.materialize_storage(device)
    for _, t in meta.values():
        if t.is_meta:
            make_real(t, device=device)
    for ts in own.values():   # real buffers (meta_parameters' computed ones) go to the device too
        for t in ts:
            if not isinstance(t, torch.nn.Parameter) and t.device != device and id(t) not in meta:
                make_real(t, t.to(device))
    if source is None:
        return module
    filled = set()
    for name, whole in (source.items() if isinstance(source, dict) else source):
        if whole.is_meta and own.get(name):
            raise ValueError(f"materialize: the source's {name} is on the meta device: it holds no values")
        for t in own.get(name, []):
            t.copy_(local_tensor(whole.detach(), placements(t)).to(t.device, t.dtype))
            filled.add(id(t))
    missing = sorted({name for key, (name, _) in meta.items() if key not in filled})
    if strict and missing:
        raise KeyError(f"materialize: the source did not fill {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return module


class _OwnTensorsOnly(torch.overrides.TorchFunctionMode):
    """Inside one module's init: an in-place op on a meta tensor (another module's, not made
    real for this init) is an error, not a silent no-op."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, torch.Tensor) and a.is_meta:
                    raise ValueError(f"the init of {self.where} writes {name} into a tensor that is not its own "
                                     f"(another module's): an init sets only its module's own parameters and buffers")
        return func(*args, **(kwargs or {}))


def initialized(blueprint, init=None, seed=None, device="cpu"):
    """(name, whole tensor) for every parameter and buffer of ``blueprint`` (the model as built
    on meta, before any axis: ``copy.deepcopy(model)`` costs nothing there), each made whole
    on ``device`` and initialised module by module, children before their parent as
    ``nn.Module.apply`` goes: ``init(module)`` (default: its ``reset_parameters()``) on the
    module's own tensors, the rest of the model left on meta. The same values, bit for bit,
    as one process running the same init on the same seed (``seed``: torch.manual_seed(seed)
    first, the caller's generator untouched), and as one process's constructor where it
    initialises its modules in that order (every nn.Linear and nn.Embedding does). A tied
    tensor keeps its first module's values (a later module's init still draws). At most
    one module's tensors are whole at a time. For materialize's ``source``."""
    names = {}
    for name, t in list(blueprint.named_parameters(remove_duplicate=False)) + \
            list(blueprint.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    done, order, seen = {}, [], set()

    def post(mod, path):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, child in mod._modules.items():
            if child is not None:
                post(child, f"{path}.{name}" if path else name)
        order.append((path, mod))
    post(blueprint, "")
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for path, mod in order:
            own = [(kind, k, t) for kind in (mod._parameters, mod._buffers) for k, t in kind.items() if t is not None]
            if not own and init is None:
                continue   # (a given init still runs: it may draw, or refuse to write into a child)
            for kind, k, t in own:
                real = torch.empty(t.shape, dtype=t.dtype, device=device)
                kind[k] = torch.nn.Parameter(real, requires_grad=t.requires_grad) if kind is mod._parameters else real
            where = f"{path or 'the model'} ({type(mod).__name__})"
            if init is None and not hasattr(mod, "reset_parameters"):
                raise ValueError(f"{where} has parameters or buffers of its own and no reset_parameters: give "
                                 f"init=, a function of one module that sets its own tensors (e.g. "
                                 f"nn.init.ones_(m.weight) for a norm, m.reset_parameters() for the rest)")
            with _OwnTensorsOnly(where):
                (init or type(mod).reset_parameters)(mod)
            for kind, k, t in own:
                made, kind[k] = kind[k], t    # back to meta: the next module's turn
                if id(t) in done:
                    continue                  # tied: the first module's values
                done[id(t)] = True
                for name in names.get(id(t), []):
                    yield name, made.detach()
