"""Expert parallelism: a mixture-of-experts MLP whose experts live on different ranks,
tokens sent to their experts and back with all-to-alls whose sizes follow the router.

A router scores each token against E experts (softmax), and the token goes to its top k.
With expert parallelism over ep ranks each rank holds E/ep of the experts: it counts the
tokens it routes to each expert, exchanges the counts (an all-to-all of E numbers), sends
each token to the rank of its expert (an all-to-all whose split sizes are those counts),
runs its own experts on what arrives, and sends the outputs back (the reverse all-to-all),
where each token sums its experts' outputs weighted by their gates. Backward runs through
both exchanges. An expert takes at most capacity = ceil(c k N / E) of a rank's N tokens (c:
--capacity-factor, 0 for no limit); the overflow is dropped in token order (a dropped
assignment contributes nothing: the token keeps its residual). The load-balancing loss of
Switch and GShard, E sum_e f_e P_e (f_e the share of assignments routed to e, P_e its mean
router probability; 1 when balanced), is added to the LM's loss times --aux-coef.

The non-expert weights are replicated on every rank and their gradients averaged over all
of them (05's DDPBucketed, told to leave the experts alone); each expert's gradient is
summed over the ranks that hold a copy of it (the ranks outside its ep group) and divided by
the number of data ranks, which is what one process gets on the global batch: its loss is
the mean of the ranks' losses, and an expert's gradient on one rank already holds what
every rank of its ep group routed to it.

Run:
    python 12_expert_parallel.py --ep 2                              # verify, then time
    python 12_expert_parallel.py --ep 4 --experts 8 --top-k 2 --capacity-factor 1.25
    torchrun --standalone --nproc-per-node 4 12_expert_parallel.py --ep 2   # 2 ep groups of 2

Prints PASS/FAIL per verification case (every weight against one process holding all E
experts that routes each rank's shard as that rank does), then tables: step time, tokens/s
and memory per rank of EP beside the same MoE replicated on every rank and a dense model
with as many active parameters per token; tokens per expert, the load's max/mean and the
share dropped; the all-to-all bytes counted beside the formula; the slowest rank's expert
time beside the mean, with and without the load-balancing loss; the loss after training
at each capacity factor beside the share it dropped. Writes
<out>/12_expert_parallel.{json,md}, 12_routing.{json,md}, 12_accounting.{json,md},
12_capacity.{json,md}.
"""

import contextlib
import copy
import statistics

import common

# ---- begin copy: mixture of experts (needs torch, the standard library and placement.py) ----
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from placement import (clip_grad_norm_, full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                       load_full_state_dict, path_matches, place, placements)   # noqa: F401 (what a loop needs, from here too)


class _AllToAllV(torch.autograd.Function):
    """Rows of ``x`` to every rank of the group, ``send[r]`` rows to rank r, ``recv[r]``
    rows from it; backward is the reverse exchange. ``staged``: through host memory."""

    @staticmethod
    def forward(ctx, x, send, recv, group, staged):
        ctx.send, ctx.recv, ctx.group, ctx.staged = send, recv, group, staged
        return _exchange(x, send, recv, group, staged)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.staged), None, None, None, None


def _exchange(x, send, recv, group, staged):
    wire = x.to("cpu") if staged else x.contiguous()
    out = torch.empty(sum(recv), *x.shape[1:], dtype=x.dtype, device=wire.device)
    dist.all_to_all_single(out, wire, recv, send, group=group)
    return out.to(x.device) if staged else out


def _count(index, n):
    """How many times each of 0..n-1 occurs in ``index``, without waiting on the device
    (torch.bincount reads the largest value to size its output)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))


class Expert(nn.Module):
    """One expert: an MLP, d_model -> d_ff -> d_model, GELU."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_in, self.w_out = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x)))


_NO_GROUPED = set()   # (device type, dtype) where torch._grouped_mm raised: the padded batched matmul instead


def _matmul_dtype(x) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's where it is on for x's device (bf16
    autocast makes an nn.Linear's rows and weight bf16), else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _grouped_ok(a, b=None, dtype=None) -> bool:
    """Whether torch._grouped_mm takes these operands (``b`` None: rows ``a`` and weights
    alike; ``dtype``: the dtype both are cast to first, fresh and aligned): float32/bf16/fp16
    on the CPU, bf16 on a CUDA device of compute capability 8.0 or more; strides and
    addresses 16-byte aligned."""
    b = a if b is None else b
    cast = dtype is not None and (dtype != a.dtype or dtype != b.dtype)
    dtype = dtype or a.dtype
    if not hasattr(torch, "_grouped_mm") or (a.device.type, dtype) in _NO_GROUPED or (not cast and a.dtype != b.dtype):
        return False
    if a.device.type == "cpu":
        fits = dtype in (torch.float32, torch.bfloat16, torch.float16)
    else:
        fits = a.device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)
    size = torch.empty((), dtype=dtype).element_size()
    strides = [s for t in (a, b) for s in t.stride() if s != 1]
    return fits and all(s * size % 16 == 0 for s in strides) and (cast or all(t.data_ptr() % 16 == 0 for t in (a, b)))


def _grouped_linear(x, weights, counts, offsets):
    """Rows of ``x`` grouped by expert (``counts[g]`` rows for expert g, host integers;
    ``offsets`` their int32 running ends on x's device) times each expert's Linear weight
    (``weights``: (G, out, in), stacked): one torch._grouped_mm where it takes the operands,
    else one batched matmul over the groups zero-padded to the largest."""
    dtype = _matmul_dtype(x)                                         # under autocast: its dtype, as a Linear
    if dtype != x.dtype or dtype != weights.dtype:
        x, weights = x.to(dtype), weights.to(dtype)
    w = weights.transpose(1, 2)                                      # (G, in, out), as x @ weight.T
    if _grouped_ok(x, w):
        try:
            return torch._grouped_mm(x, w, offs=offsets)
        except (RuntimeError, NotImplementedError):
            _NO_GROUPED.add((x.device.type, x.dtype))
    padded = nn.utils.rnn.pad_sequence(x.split(counts), batch_first=True)   # (G, most, in)
    if padded.shape[1] == 0:
        padded = x.new_zeros(len(counts), 0, x.shape[1])
    y = torch.bmm(padded, w)
    return torch.cat([y[g, :n] for g, n in enumerate(counts)])


def _stacked(experts, name):
    layers = [getattr(e, name, None) for e in experts]
    if any(not isinstance(m, nn.Linear) or m.bias is not None for m in layers):
        raise ValueError(f"grouped experts need .{name} to be an nn.Linear without bias in every expert")
    return torch.stack([m.weight for m in layers])


def grouped_mlp(experts, x, counts, offsets):
    """The kit's Expert (w_out(gelu(w_in x))) for every local expert at once: ``x`` holds
    expert g's rows in ``counts[g]`` consecutive rows (``offsets``: the int32 running
    ends). Two grouped matmuls over the experts' weights, stacked (their gradients flow to
    each expert's own Linear: the state dict is unchanged)."""
    h = F.gelu(_grouped_linear(x, _stacked(experts, "w_in"), counts, offsets))
    return _grouped_linear(h, _stacked(experts, "w_out"), counts, offsets)


def grouped_swiglu(experts, x, counts, offsets):
    """A SwiGLU expert with Meta's names (w2(silu(w1 x) * w3 x), no biases: Llama's
    FeedForward) for every local expert at once, as grouped_mlp. Pass it as ``MoE(...,
    grouped=grouped_swiglu)`` when your expert factory returns such modules."""
    a = _grouped_linear(x, _stacked(experts, "w1"), counts, offsets)
    b = _grouped_linear(x, _stacked(experts, "w3"), counts, offsets)
    return _grouped_linear(F.silu(a) * b, _stacked(experts, "w2"), counts, offsets)


class MoE(nn.Module):
    """A mixture-of-experts MLP over an expert-parallel group: a linear router with softmax
    gates, top-k (for k > 1 the k gates renormalised to sum to 1, as Mixtral does; for k = 1
    the gate is the router's probability, as in Switch, so the router learns through it),
    E experts of which this rank holds E/ep, held under their global index (``experts.5``:
    a checkpoint of whole tensors by name loads at any ep).

        moe = MoE(512, 2048, n_experts=8, top_k=2, capacity_factor=1.25)   # the same on every rank
        # or your own experts:  expert=lambda: FeedForward(512, 1408), shared_experts=FeedForward(512, 1408)
        moe.distribute(ep_group, replica_group)   # keep this rank's experts: 8/ep of them
        y = moe(x)                           # this rank's tokens in, their output out; moe.aux: the balance loss
        loss = task_loss + 0.01 * moe.aux
        loss.backward()
        reduce_expert_gradients(model, replica_group, data_ranks)   # see there; other weights: any DDP
        clip_grad_norm_(model, 1.0)          # if clipping: by the global norm (torch's sees only this rank's experts)

    Until distribute, every expert is local and nothing is sent: the one-process model.
    ``capacity_factor`` c > 0: an expert takes at most ceil(c k N / E) of this rank's N
    tokens' assignments, the rest dropped in token order (first the first token's
    choices); 0: no limit. Every local expert runs, on no token if none came, so each gets
    a gradient (zero) and steps as the one-process model's does. After a forward,
    ``aux`` is E sum_e f_e P_e over this rank's tokens, and ``stats`` holds the tokens routed
    to each expert (before dropping) and the share dropped. ``host_staging``: exchange
    through host memory (None: when the group is gloo and the tokens on a GPU).

    Your own experts: ``expert``, a callable that returns one expert, any module from
    (n, d_model) rows to (n, d_model) (a SwiGLU FeedForward, say), called once per expert in
    index order (so the same seed gives the same experts on every rank); default: Expert(d_model,
    d_ff). ``grouped``: how the local experts run on the rows that arrived, sorted by expert
    once: a function (experts, rows, counts, offsets) -> outputs that runs them all at once
    (grouped_mlp for the kit's Expert: one grouped matmul a weight; grouped_swiglu for
    SwiGLU experts with Meta's names), or False: one call per expert on its slice of the
    rows (the default for your own experts). "auto" (the default for the kit's Expert):
    grouped_mlp where torch._grouped_mm takes the rows on a GPU, else one call per expert
    (on the CPU the grouped kernel is the slower: 12_grouped's table). ``shared_experts`` (DeepSeekMoE's): a module every token passes through, its
    output added to the routed experts'; it is replicated like the router (not sent, not
    split: a DDP wrapper reduces its gradients), and it is not among expert_parameters.
    """

    def __init__(self, d_model, d_ff, n_experts, top_k=1, capacity_factor=0.0, host_staging=None, expert=None,
                 shared_experts=None, grouped="auto"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {n_experts} experts")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        make = expert or (lambda: Expert(d_model, d_ff))
        self.experts = nn.ModuleDict({str(e): make() for e in range(n_experts)})
        self.shared_experts = shared_experts
        if grouped == "auto" and not all(type(e) is Expert for e in self.experts.values()):
            grouped = False                                   # your own experts: a loop unless you say how
        self.grouped = grouped
        self.group, self.ep, self.host_staging, self.distributed, self.copies = None, 1, host_staging, False, None
        self.aux, self._stats = None, {}

    @property
    def stats(self) -> dict:
        """The last forward's routing, read when asked (the forward keeps tensors, so it
        waits on the device only for the split sizes its all-to-all needs): tokens routed
        to each expert before dropping, the share of assignments dropped, the rows this rank
        kept, the rows that arrived at its experts, those that left it, and its experts'
        forward time."""
        s = dict(self._stats)
        if "tokens" in s:
            s["tokens"], s["kept"] = s["tokens"].tolist(), int(s["kept"])
            s["dropped"] = 1.0 - s["kept"] / s.pop("assignments") if s["assignments"] else 0.0
        return s

    def distribute(self, process_group=None, copies=None):
        """Keep this rank's experts, E/ep consecutive ones, and exchange tokens over the group.
        ``copies``: the group of the ranks holding the same experts in other ep groups (the
        replica group reduce_expert_gradients sums over), recorded with the experts'
        placement so norms and checkpoints count them once."""
        self.group, self.ep, rank = process_group, dist.get_world_size(process_group), dist.get_rank(process_group)
        self.distributed, self.copies = True, copies
        if self.n_experts % self.ep:
            raise ValueError(f"{self.ep} ranks do not divide the {self.n_experts} experts")
        per = self.n_experts // self.ep
        for e in range(self.n_experts):
            if not rank * per <= e < (rank + 1) * per:
                del self.experts[str(e)]
        for p in self.experts.parameters():
            place(p, "part", process_group)   # this rank's experts; the group's others hold the rest
            if copies is not None:
                place(p, "replicate", copies)
        return self

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        n, E, k = x.shape[0], self.n_experts, self.top_k
        probs = F.softmax(self.router(x).float(), dim=-1)
        gates, chosen = probs.topk(k, dim=-1)                                 # (n, k)
        if k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        flat = chosen.flatten()                                               # token-major: token order
        counts = _count(flat, E)
        self.aux = E * ((counts.float() / flat.numel()) * probs.mean(0)).sum()
        key = flat                                                            # a dropped assignment: key E, last
        if self.capacity_factor > 0:                                          # place of each assignment at its expert
            one_hot = torch.zeros(flat.numel(), E, dtype=torch.long, device=flat.device).scatter_(1, flat[:, None], 1)
            place = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
            key = torch.where(place < math.ceil(self.capacity_factor * k * n / E), flat, E)
        order = key.argsort(stable=True)                                      # kept assignments by expert, then dropped
        rows = _count(key, E + 1)[:E]                                         # rows this rank sends each expert
        self._stats = {"tokens": counts, "assignments": flat.numel()}
        if self.distributed:                                                  # to the experts' ranks and back
            staged = self.staged(x.device, self.group)
            per = E // self.ep
            got = _exchange(rows, [per] * self.ep, [per] * self.ep, self.group, staged)   # the counts first
            counts_here = torch.cat([rows, got]).tolist()   # the forward's one wait on the device: the split sizes
            order = order[:sum(counts_here[:E])]
            token_of = order // k
            inputs = x[token_of]
            send = [sum(counts_here[r * per:(r + 1) * per]) for r in range(self.ep)]      # rows to each rank
            recv_rows = [counts_here[E + r * per:E + (r + 1) * per] for r in range(self.ep)]   # from each, per expert
            recv = [sum(r) for r in recv_rows]
            me = dist.get_rank(self.group)
            self._stats.update(kept=len(order), rows_out=sum(send) - send[me], arrived=sum(recv),   # leaving, coming
                               send=send, recv=recv)
            arrived = _AllToAllV.apply(inputs, send, recv, self.group, staged)
            outputs = self._run_local(arrived, recv_rows, got)
            outputs = _AllToAllV.apply(outputs, recv, send, self.group, staged)
        else:
            flat_rows, rows = rows, rows.tolist()                             # the forward's one wait on the device
            order = order[:sum(rows)]
            token_of = order // k
            self._stats.update(kept=len(order), rows_out=0, arrived=len(order))
            outputs = self._run_local(x[token_of], [rows], flat_rows)
        y = torch.zeros_like(x, dtype=outputs.dtype)
        y = y.index_add(0, token_of, outputs * gates.flatten()[order, None].to(outputs.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)

    def staged(self, device, group) -> bool:
        """Whether the exchanges over ``group`` go through host memory: ``host_staging``
        if given, else when the group is gloo and the tokens on a GPU."""
        return _staged(self.host_staging, device, group)

    def _run_local(self, x, rows, flat):
        """Run the local experts on the rows that arrived: ``rows[r][j]`` rows from rank r for
        local expert j, in that order (source rank, then expert; host integers), ``flat``
        the same counts on x's device. The rows are sorted expert-major once, run (all
        experts at once if ``grouped``, else one call per expert on its slice) and put back
        in arrival order."""
        per, ranks, t0 = len(rows[0]), len(rows), time.perf_counter()
        counts = [sum(r[j] for r in rows) for j in range(per)]               # rows per local expert
        self._stats["rows"] = rows
        perm = None
        if ranks > 1 and per > 1:                                            # arrived rank-major: one sort
            seg = torch.repeat_interleave(torch.arange(ranks * per, device=x.device), flat, output_size=x.shape[0])
            perm = ((seg % per) * ranks + seg // per).argsort(stable=True)
            x = x[perm]
        experts, grouped = list(self.experts.values()), self.grouped          # an expert with no rows still
        if grouped == "auto":                                                # runs: a zero gradient
            grouped = grouped_mlp if x.device.type == "cuda" and _grouped_ok(x, dtype=_matmul_dtype(x)) else False
        if grouped:
            offsets = flat.view(ranks, per).sum(0).cumsum(0).to(torch.int32)
            out = grouped(experts, x, counts, offsets)
        else:
            out = torch.cat([e(part) for e, part in zip(experts, x.split(counts))])
        if perm is not None:
            out = torch.empty_like(out).index_copy(0, perm, out)
        self._stats["expert_s"] = time.perf_counter() - t0   # (forward only; a GPU's kernels may still run)
        return out


class _ExpertExchange:
    """The two forward hooks split_experts puts on a model's own experts module: before its
    forward, each (token, choice) goes to the rank of its expert with its gate, sorted by
    expert (so the counts exchanged first number the rows that arrive), and the module runs
    on what arrived with one choice a row, its experts numbered locally; after it, the rows
    go back and each token sums its choices' outputs."""

    def __init__(self, group, per, host_staging):
        self.group, self.per, self.host_staging, self.pending = group, per, host_staging, []
        self.ep, self.me, self.rows_out = dist.get_world_size(group), dist.get_rank(group), 0

    def before(self, module, args, kwargs):
        x, index, gates = _experts_inputs(args, kwargs)
        staged = _staged(self.host_staging, x.device, self.group)
        if index is None:
            return self._dense_before(x, staged)
        k, flat = index.shape[-1], index.reshape(-1)                          # token-major
        order = flat.argsort(stable=True)                                     # by expert: its rank, then its place
        counts = _count(flat, self.ep * self.per)                             # rows for each expert
        got = _exchange(counts, [self.per] * self.ep, [self.per] * self.ep, self.group, staged)   # for mine, by rank
        sizes = torch.cat([counts.view(self.ep, self.per).sum(1), got.view(self.ep, self.per).sum(1)]).tolist()
        send, recv = sizes[:self.ep], sizes[self.ep:]                         # the one wait on the device
        self.rows_out += sum(send) - send[self.me]
        token_of = order // k
        rows = _AllToAllV.apply(x[token_of], send, recv, self.group, staged)
        weights = _AllToAllV.apply(gates.reshape(-1)[order][:, None], send, recv, self.group, staged)
        local = torch.arange(self.per, device=got.device).repeat(self.ep).repeat_interleave(got, output_size=sum(recv))
        self.pending.append((token_of, send, recv, x.shape[0], staged))
        return (rows, local[:, None].to(index.dtype), weights), {}

    def after(self, module, args, kwargs, out):
        token_of, send, recv, n, staged = self.pending.pop()
        if token_of is None:
            return self._dense_after(out, send, recv, n, staged)
        back = _AllToAllV.apply(out, recv, send, self.group, staged)
        return back.new_zeros(n, *back.shape[1:]).index_add(0, token_of, back)

    def _dense_before(self, x, staged):
        """Experts called with every expert's rows, expert-major (Llama 4's: the tokens
        repeated once an expert, each scaled by its gate, zero where not chosen), [E x T, D]:
        each rank's T rows of each expert go to the expert's rank, which runs its experts
        on every rank's rows, expert-major again: [E/ep x (T_0 + T_1 + ...), D]."""
        E = self.ep * self.per
        if x.shape[0] % E:
            raise ValueError(f"split_experts: experts called with {x.shape[0]} rows, not a multiple of the {E} experts")
        t = x.shape[0] // E
        ts = _exchange(torch.full((self.ep,), t, device=x.device), [1] * self.ep, [1] * self.ep, self.group,
                       staged).tolist()                                      # each rank's tokens
        send, recv = [self.per * t] * self.ep, [self.per * u for u in ts]
        self.rows_out += sum(send) - send[self.me]
        arrived = _AllToAllV.apply(x, send, recv, self.group, staged)        # rank-major, then expert
        rows = torch.cat([a.view(self.per, u, -1) for a, u in zip(arrived.split(recv), ts)], dim=1)
        self.pending.append((None, send, recv, ts, staged))
        return (rows.reshape(-1, x.shape[-1]),), {}

    def _dense_after(self, out, send, recv, ts, staged):
        mine = out.view(self.per, sum(ts), -1).split(ts, dim=1)            # back to rank-major
        back = torch.cat([m.reshape(-1, out.shape[-1]) for m in mine])
        return _AllToAllV.apply(back, recv, send, self.group, staged)


def _experts_inputs(args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) as an experts module is called, or
    (hidden_states, None, None) for one called with every expert's rows (Llama 4's)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    given = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if kwargs.keys() - set(names) or len(given) not in (1, 3):
        raise TypeError("split_experts: the experts module takes (hidden_states, top_k_index, top_k_weights), or "
                        "(hidden_states) with every expert's rows")
    return given if len(given) == 3 else [given[0], None, None]


def _staged(host_staging, device, group) -> bool:
    """Whether exchanges go through host memory (MoE.staged)."""
    if host_staging is not None:
        return host_staging
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


def split_experts(model: nn.Module, pattern: str, process_group=None, copies=None, host_staging=None) -> nn.Module:
    """Expert parallelism on a model's own experts, its code and its router unchanged: every
    module of ``model`` whose path matches ``pattern`` ("model.layers.*.mlp.experts", ``*``
    for any one name) keeps E/ep of its experts, consecutive ones, along dim 0 of each of
    its own parameters with E rows (transformers' 3D expert tensors: gate_up_proj [E, 2F,
    D], down_proj [E, D, F]), its ``num_experts`` set to E/ep. Such a module is called as
    transformers' are, ``experts(hidden_states [N, D], top_k_index [N, k], top_k_weights
    [N, k])`` -> [N, D], the gates applied inside; two forward hooks send each token's
    choices to the rank of their expert (all-to-all, sizes following the router) and the
    outputs back, summed per token. One called with every expert's rows instead (Llama
    4's ``experts(hidden_states [E x T, D])``, its tokens repeated an expert, gated before)
    gets each expert's rows sent to its rank and back. Dropless, as transformers' models
    are: their balancing loss, computed by the model from its router's logits, is
    unchanged. ``copies``: the ranks holding the same experts in other ep groups, as for
    MoE.distribute. Recorded as a shard over the group (and a replica over ``copies``), so
    clip_grad_norm_, full_state_dict and materialize see the E experts whole under the
    model's own name.

        split_experts(model, "model.layers.*.mlp.experts", ep_group)
        wrapped = DDPBucketed(model, 25, ignore_parameters=expert_parameters(model))   # or FSDP(ignore=...)
        loss.backward(); wrapped.finish_gradient_synchronization()
        reduce_expert_gradients(model)        # summed over copies, divided by the data ranks

    Built on the meta device, the slices stay on meta for materialize to fill."""
    found = {name: m for name, m in model.named_modules() if path_matches(name, pattern)}
    if not found:
        raise ValueError(f"split_experts: {pattern!r} matches no module")
    ep, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    for name, m in found.items():
        E = getattr(m, "num_experts", None)
        own = {n: p for n, p in m.named_parameters(recurse=False) if p.dim() and p.shape[0] == E}
        if not isinstance(E, int) or not own:
            raise ValueError(f"split_experts: {name} has no num_experts and parameters with that many rows")
        if E % ep:
            raise ValueError(f"split_experts: {ep} ranks do not divide {name}'s {E} experts")
    for name, m in found.items():
        per = m.num_experts // ep
        for n, p in m.named_parameters(recurse=False):
            if p.dim() and p.shape[0] == m.num_experts:
                whole = list(p.shape)
                p.data = p.data[rank * per:(rank + 1) * per].clone()
                place(p, "shard", process_group, dim=0, shape=whole)
                if copies is not None:
                    place(p, "replicate", copies)
        m.num_experts, m.expert_copies = per, copies
        m.expert_exchange = _ExpertExchange(process_group, per, host_staging)   # .rows_out: rows sent away
        m.register_forward_pre_hook(m.expert_exchange.before, with_kwargs=True)
        m.register_forward_hook(m.expert_exchange.after, with_kwargs=True)
    return model


def _split_modules(model):
    """(module, its expert parameters, their default replica group) of every MoE and every
    module split_experts split."""
    for m in model.modules():
        if isinstance(m, MoE):
            yield m, list(m.experts.parameters()), m.copies
        elif hasattr(m, "expert_copies"):
            yield m, [p for p in m.parameters(recurse=False) if placements(p)], m.expert_copies


def expert_parameters(model: nn.Module) -> list:
    """The parameters of every MoE's local experts and of every module split_experts split."""
    return [p for _, params, _ in _split_modules(model) for p in params]


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, replica_group=None, data_ranks=None, bucket_mb=25.0):
    """After backward: each local expert's gradient summed over ``replica_group`` (the
    ranks that hold a copy of the same experts: those at the same place of other ep groups;
    default: the ``copies`` each MoE was distributed with, None: no copies) and divided by
    ``data_ranks`` (the ranks whose losses the step averages; default: the world). The
    gradients go flattened, one all-reduce per bucket of up to ``bucket_mb`` MB (of one
    group and dtype), not one per tensor. Frozen experts' parameters (no gradient) are
    left out. The non-expert weights are a DDP wrapper's, told to ignore
    expert_parameters(model)."""
    data_ranks = data_ranks or dist.get_world_size()
    buckets = {}   # (group, dtype) -> gradients, in the modules' order (the same on every rank)
    for m, params, copies in _split_modules(model):
        group = replica_group if replica_group is not None else copies
        for p in params:
            if p.grad is None and p.requires_grad and not isinstance(m, MoE):
                p.grad = torch.zeros_like(p)   # no token reached these experts here: one process's zero rows
            if p.grad is not None:
                buckets.setdefault((group, p.grad.dtype), []).append(p.grad)
    for (group, _), grads in buckets.items():
        if group is None:
            for g in grads:
                g.div_(data_ranks)
            continue
        limit, bucket, size = bucket_mb * 2 ** 20, [], 0
        for i, g in enumerate(grads):
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= limit or i == len(grads) - 1:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                flat.div_(data_ranks)
                for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(part.view_as(b))
                bucket, size = [], 0


# clip_grad_norm_, full_state_dict, load_full_state_dict, full_optim_state_dict and
# load_full_optim_state_dict are the placement record's (common.py): distribute records each
# kept expert's parameters as a "part" over the ep group (and "replicate" over ``copies``),
# DDPBucketed the other weights as "replicate": over every rank, the norm counts each
# element once and a checkpoint holds every expert once, under its global name.
# ---- end copy: mixture of experts ----


bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")


class MoEBlock(common.Block):
    """The kit's block with its MLP replaced by a MoE."""

    def __init__(self, d_model, d_ff, n_heads, moe):
        super().__init__(d_model, d_ff, n_heads)
        del self.ff_in, self.ff_out
        self.moe = moe

    def feed_forward(self, h):
        return self.moe(h)


class MoELM(common.TransformerLM):
    """The kit's LM with a MoE in every block (``every`` 1) or every other one (2: the odd
    blocks), each with ``n_experts`` experts of the block's d_ff; its loss adds ``aux_coef``
    times the blocks' load-balancing losses."""

    def __init__(self, dims, context, n_experts, top_k, capacity_factor, aux_coef=0.01, every=1):
        d, f, n, h = dims
        super().__init__(d, f, n, h, context_length=context)
        for i in range(n):
            if i % every == every - 1:
                self.blocks[i] = MoEBlock(d, f, h, MoE(d, f, n_experts, top_k, capacity_factor))
        self.aux_coef = aux_coef

    def moes(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        return out if targets is None else out + self.aux_coef * sum(m.aux for m in self.moes())


def build(dims, context, experts, top_k, capacity, seed, device, aux_coef=0.01, every=1):
    torch.manual_seed(seed)
    with torch.device(device):
        return MoELM(dims, context, experts, top_k, capacity, aux_coef, every)


def ep_groups(world_size, ep):
    """This rank's (ep group, replica group): ep groups are consecutive ranks; an expert's
    copies sit at the same place of every ep group (every rank creates every group)."""
    eps = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world_size // ep)]
    reps = [dist.new_group(list(range(j, world_size, ep))) for j in range(ep)]
    rank = dist.get_rank()
    return eps[rank // ep], (reps[rank % ep] if world_size > ep else None)


def expert_parallel(model, ep_group, replica_group, bucket_mb=25.0):
    """The MoE LM over the world: each MoE keeps its ep group's share of the experts, the
    other weights under DDPBucketed over every rank (ignoring the experts)."""
    for moe in model.moes():
        moe.distribute(ep_group, replica_group)
    return bucketed.DDPBucketed(model, bucket_mb, ignore_parameters=expert_parameters(model))


def experts_split(model) -> bool:
    """Whether ``model``'s experts are split over ranks (expert parallel), so their
    gradients are reduce_expert_gradients' (a replicated MoE's are DDP's)."""
    return any(m.distributed for m in model.modules() if isinstance(m, MoE))


def train_step(model, optimizer, batch, clock, max_norm=None):
    """One step on this rank's part of the global batch, timed by phase (``max_norm``:
    gradients clipped by the global norm first); returns the loss."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("forward"):      # per MoE: the counts, the tokens out, the outputs back
        loss = model(x, y)
    with clock.phase("backward"):     # the two exchanges again, reversed
        loss.backward()
    with clock.phase("comm"):         # the shared weights averaged; each expert over its copies
        model.finish_gradient_synchronization()
        if experts_split(model):   # expert parallel (a replicated MoE: DDP did all)
            reduce_expert_gradients(model.module)   # over the copies each MoE was distributed with
    if max_norm is not None:
        clip_grad_norm_(model, max_norm)
    with clock.phase("optim"):
        optimizer.step()
    return loss.detach()


# ----------------------------------------------------------------------------------------
# Verification: against one process holding every expert
# ----------------------------------------------------------------------------------------
VERIFY_LM = (16, 32, 2, 2)   # d_model, d_ff (each expert's), blocks, heads
VERIFY_T = 8


MAX_NORM = 0.05   # the clipped case: below the verification LM's gradient norm, so every step clips


def verify_case(ctx, args, groups, experts, top_k, capacity, aux_coef=0.01, clip=None):
    """The MoE LM with expert parallelism against one process that holds every expert and
    routes each rank's shard as that rank does (same capacity, drops and load-balancing
    loss), trained alike (AdamW) for a few steps; also whether some expert got no token.
    ``clip``: both clipped by the global norm (one process with torch's clip), SGD so the
    factor shows in every weight."""
    ep_group, replica_group = groups
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = build(VERIFY_LM, VERIFY_T, experts, top_k, capacity, args.seed, ctx.device, aux_coef)
    model = expert_parallel(copy.deepcopy(ref), ep_group, replica_group)
    # eps 1e-6 as in 08-11: sums split over ranks round differently, AdamW must not magnify it
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6) if clip is None else
            torch.optim.SGD(m.parameters(), lr=1.0) for m in (ref, model)]
    empty = False
    for step in range(args.verify_steps):
        x, y = common.lm_batch(2 * world, VERIFY_T, step, args.seed, ctx.device)
        opts[0].zero_grad()
        loss = sum(ref(*(common.shard(t, r, world) for t in (x, y))) for r in range(world)) / world
        empty |= any(0 in m.stats["tokens"] for m in ref.moes())   # (the last shard's routing)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opts[0].step()
        train_step(model, opts[1], tuple(common.shard(t, rank, world) for t in (x, y)), common.StepClock(ctx.device),
                   MAX_NORM if clip else None)
        empty |= any(0 in m.stats["tokens"] for m in model.module.moes())
    theirs = dict(ref.named_parameters())
    ok, diff = True, 0.0
    for name, p in model.module.named_parameters():
        diff = max(diff, (p.detach().double() - theirs[name].detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(p, theirs[name])
        except AssertionError:
            ok = False
    everyone = [None] * world
    dist.all_gather_object(everyone, {"ok": ok, "max_diff": diff, "empty": empty})
    return {"ok": all(e["ok"] for e in everyone), "max_diff": max(e["max_diff"] for e in everyone),
            "an expert got no token": any(e["empty"] for e in everyone)}


def verify(ctx, args, ep, cases):
    """Each (experts per rank, top-k, capacity factor) of ``cases`` at this ep."""
    groups = ep_groups(ctx.world_size, ep)
    out = {}
    for per, k, c in cases:
        if k > per * ep:
            continue   # top-2 of a single expert (ep 1)
        reps = ctx.world_size // ep
        name = f"ep {ep}{f' x {reps} copies' if reps > 1 else ''}, {per} expert(s) a rank, top-{k}, " + \
            (f"capacity {c:g}" if c else "no dropping")
        out[name] = verify_case(ctx, args, groups, per * ep, k, c)
    per, k, c = cases[-1]
    if k <= per * ep:   # a loop that clips: by the global norm, the experts' squares over the ep group
        out[f"{name}, clipped by the global norm (SGD)"] = verify_case(ctx, args, groups, per * ep, k, c, clip=True)
    return out


VERIFY_CASES = [(per, k, c) for per in (1, 2) for k in (1, 2) for c in (0.0, 1.0)]


def verify_bf16(ctx, args, ep, steps=6):
    """--dtype bf16: the MoE LM under bf16 autocast, EP with grouped experts
    (torch._grouped_mm in bf16 where it takes the rows: the CPU, or a GPU of sm80 or later)
    against one process holding every expert, one call each (routing each rank's shard as
    that rank does), under the same autocast: the weights within common.TOLERANCE["autocast"] after
    SGD with momentum (AdamW's division by sqrt(v) turns bf16's rounding of near-zero
    gradients into steps of lr either way), and each step's loss (the group's mean) within
    common.BF16_LOSS_BOUND of one float32 process's. Top-2 of 2 experts a rank, no
    dropping and capacity 1; and the kernel the experts ran."""
    groups, world, rank = ep_groups(ctx.world_size, ep), ctx.world_size, ctx.rank
    out = {}
    for c in (0.0, 1.0):
        ref = build(VERIFY_LM, VERIFY_T, 2 * ep, 2, c, args.seed, ctx.device)
        fp32 = copy.deepcopy(ref)
        model = expert_parallel(copy.deepcopy(ref), *groups)
        for m in model.module.moes():
            m.grouped = grouped_mlp
        for m in ref.moes() + fp32.moes():
            m.grouped = False
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fp32, model)]
        gap, kernels = 0.0, set()
        for step in range(steps):
            x, y = common.lm_batch(2 * world, VERIFY_T, step, args.seed, ctx.device)
            for m, opt, dtype in ((ref, opts[0], "bf16"), (fp32, opts[1], "float32")):
                opt.zero_grad()
                with common.autocast(ctx.device, dtype):
                    loss = sum(m(*(common.shard(t, r, world) for t in (x, y))) for r in range(world)) / world
                loss.backward()
                opt.step()
            with common.count_collectives() as seen, common.autocast(ctx.device, "bf16"):
                mine = train_step(model, opts[2], tuple(common.shard(t, rank, world) for t in (x, y)),
                                  common.StepClock(ctx.device)).double()
            kernels |= seen.kernels
            dist.all_reduce(mine)
            gap = max(gap, abs(mine.item() / world - loss.item()))
        theirs = dict(ref.named_parameters())
        diff = max((p.detach().double() - theirs[n].detach().double()).abs().max().item()
                   for n, p in model.module.named_parameters())
        ok = all(torch.allclose(p, theirs[n], **common.TOLERANCE["autocast"]) for n, p in model.module.named_parameters())
        everyone = [None] * world
        dist.all_gather_object(everyone, {"ok": ok, "diff": diff, "kernels": sorted(kernels)})
        how = "torch._grouped_mm" if any("grouped_mm" in e["kernels"] for e in everyone) else "padded bmm"
        name = f"ep {ep}, bf16 autocast, grouped experts ({how}), top-2, " + (f"capacity {c:g}" if c else "no dropping")
        out[f"{name}, against one process under it (rtol {common.TOLERANCE['autocast']['rtol']}, atol {common.TOLERANCE['autocast']['atol']})"] = \
            {"ok": all(e["ok"] for e in everyone), "max_diff": max(e["diff"] for e in everyone)}
        out[f"{name}, each of {steps} losses within {common.BF16_LOSS_BOUND} of float32's"] = \
            {"ok": gap <= common.BF16_LOSS_BOUND, "max_diff": gap}
    return out


def control_wrong_group(ctx, args, ep):
    """The control: expert gradients averaged over their copies only (divided by the
    replica group's size, as a DDP over it would), not by the data ranks: must fail."""
    global reduce_expert_gradients
    right = reduce_expert_gradients

    def wrong(model, replica_group=None, data_ranks=None):
        copies = next(m.copies for m in model.modules() if isinstance(m, MoE))
        right(model, replica_group, dist.get_world_size(copies) if copies else 1)
    reduce_expert_gradients = wrong
    try:
        return verify(ctx, args, ep, [(1, 1, 0.0)])
    finally:
        reduce_expert_gradients = right


def control_torch_clip(ctx, args, ep):
    """The control: the EP ranks clip with torch's clip_grad_norm_, each by the norm of its
    own parameters (its experts only): must fail."""
    global clip_grad_norm_
    right = clip_grad_norm_
    clip_grad_norm_ = lambda model, max_norm, *rest, **options: torch.nn.utils.clip_grad_norm_(  # noqa: E731
        model.parameters(), max_norm)
    try:
        return verify_case(ctx, args, ep_groups(ctx.world_size, ep), 2 * ep, 2, 1.0, clip=True)
    finally:
        clip_grad_norm_ = right


def checkpoint_case(ctx, args, path, action, ep, saved_world=None, steps=4, k=2):
    """Train the MoE LM at this ep; "save" after step k (whole tensors and AdamW's state),
    or "resume" from that file here (another ep and world) and end beside one process
    trained from step 0, routing each step's shards as the ranks of that step did (the
    load-balancing loss is a shard's): the weights must agree."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = build(VERIFY_LM, VERIFY_T, 4, 2, 0.0, args.seed, ctx.device)
    model = expert_parallel(copy.deepcopy(ref), *ep_groups(world, ep))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6) for m in (ref, model)]
    for step in range(steps):
        x, y = common.lm_batch(8, VERIFY_T, step, args.seed, ctx.device)
        shards = saved_world if action == "resume" and step < k else world
        opts[0].zero_grad()
        (sum(ref(*(common.shard(t, r, shards) for t in (x, y))) for r in range(shards)) / shards).backward()
        opts[0].step()
        if action == "resume" and step < k:
            continue
        if action == "resume" and step == k:
            ckpt = torch.load(path, weights_only=True)
            load_full_state_dict(model.module, ckpt["model"])
            load_full_optim_state_dict(model.module, opts[1], ckpt["optim"])
        train_step(model, opts[1], tuple(common.shard(t, rank, world) for t in (x, y)), common.StepClock(ctx.device))
        if action == "save" and step + 1 == k:
            ckpt = {"model": full_state_dict(model.module), "optim": full_optim_state_dict(model.module, opts[1])}
            if rank == 0:
                torch.save(ckpt, path)
            dist.barrier()
            return None
    theirs = dict(ref.named_parameters())
    diff = max((p.detach() - theirs[n].detach()).abs().max().item() for n, p in model.module.named_parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, diff)
    return {"ok": max(everyone) < 1e-5, "max_diff": max(everyone)}


# ----------------------------------------------------------------------------------------
# Benchmark: EP beside the replicated MoE and a dense model; routing; bytes; memory
# ----------------------------------------------------------------------------------------
def state_bytes(model, optimizer) -> dict:
    """Parameters, gradients and optimizer state this rank holds (bytes), and the experts' share."""
    experts = {id(p) for p in expert_parameters(model)}
    params = list(model.parameters())
    state = {id(p): sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
             for p, s in optimizer.state.items()}
    total = sum(p.numel() * p.element_size() * 2 + state.get(id(p), 0) for p in params)
    mine = sum(p.numel() * p.element_size() * 2 + state.get(id(p), 0) for p in params if id(p) in experts)
    return {"state_MB": total / 1e6, "experts_state_MB": mine / 1e6}


def predicted_state(dims, context, experts, ep, every=1) -> dict:
    """Bytes per rank by formula: every weight (fp32) with its gradient and AdamW's two
    moments, 16 bytes, the experts' only E/ep of them; and AdamW's step count (4 bytes) per
    tensor."""
    d, f, n, h = dims
    moes = sum(1 for i in range(n) if i % every == every - 1)
    shared = 2 * common.VOCAB_SIZE * d + context * d + n * (4 * d * d + 2 * d) + d + moes * d * experts \
        + (n - moes) * 2 * d * f
    mine = moes * experts // ep * 2 * d * f
    tensors = 4 + 4 * n + moes * (1 + 2 * experts // ep) + (n - moes) * 2
    return {"state_MB": (16 * (shared + mine) + 4 * tensors) / 1e6,
            "experts_state_MB": (16 * mine + 4 * moes * 2 * experts // ep) / 1e6}


def dense_lm(dims, context, seed, device):
    torch.manual_seed(seed)
    with torch.device(device):
        return common.TransformerLM(*dims, context_length=context)


def benchmark(ctx, args, ep):
    """EP (with and without the load-balancing loss) beside the same MoE replicated on every
    rank and a dense model with the same active parameters per token, steps alternating;
    the routing, the exchanges' bytes and the memory of each; in --dtype (bf16: every
    forward in autocast)."""
    with common.autocast(ctx.device, getattr(args, "dtype", "float32")):
        return _benchmark(ctx, args, ep)


def _benchmark(ctx, args, ep):
    dims, W = common.MODEL_SIZES[args.model_size], ctx.world_size
    E, k, c, t = args.experts, args.top_k, args.capacity_factor, args.context_length
    groups = ep_groups(W, ep)
    extra, routing, models = {}, {}, {}

    def method(name, make):
        def setup():
            model = make()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            models[name] = model, opt
            routing[name] = []

            def step(batch, clock):
                train_step(model, opt, tuple(common.shard(x, ctx.rank, W) for x in batch), clock)
                moes = model.module.moes() if hasattr(model.module, "moes") else []
                routing[name].append([dict(m.stats) for m in moes])
            for _ in range(2):
                step(common.lm_batch(args.batch_size, t, 0, args.seed, ctx.device), common.StepClock(ctx.device))
            extra[name] = state_bytes(model.module, opt)
            return step
        return name, setup
    moe = lambda aux: build(dims, t, E, k, c, args.seed, ctx.device, aux, args.moe_every)  # noqa: E731
    methods = dict([
        method(f"EP {ep}, aux {args.aux_coef:g}", lambda: expert_parallel(moe(args.aux_coef), *groups)),
        method(f"EP {ep}, aux 0", lambda: expert_parallel(moe(0.0), *groups)),
        method("MoE replicated (plain DP)", lambda: bucketed.DDPBucketed(moe(args.aux_coef), 25)),
        method(f"dense, d_ff {k} x {dims[1]}", lambda: bucketed.DDPBucketed(dense_lm(
            (dims[0], k * dims[1], dims[2], dims[3]), t, args.seed, ctx.device), 25))])
    rows = common.time_methods(ctx, args, methods, global_batch=True)
    everyone = [None] * W
    dist.all_gather_object(everyone, {"routing": {n: r[-args.steps:] for n, r in routing.items()}, "extra": extra})
    ep_name = f"EP {ep}, aux {args.aux_coef:g}"
    for r in rows:
        r.update(extra[r["method"]], ep=ep if r["method"].startswith("EP") else 1,
                 tokens_per_s_per_rank=args.batch_size * t / (r["step_ms"] / 1e3) / W,
                 experts_kernel="-" if r["method"].startswith("dense") else
                 ("torch._grouped_mm" if "grouped_mm" in r["kernels"] else "one call each"))
        r["state_MB_max"] = max(e["extra"][r["method"]]["state_MB"] for e in everyone)
        steps = [e["routing"][r["method"]] for e in everyone]
        if steps[0] and steps[0][0]:
            times = [sum(layer.get("expert_s", 0.0) for step in rank for layer in step) for rank in steps]
            r["slowest_expert_ms"] = max(times) / len(steps[0]) * 1e3
            r["mean_expert_ms"] = sum(times) / len(times) / len(steps[0]) * 1e3
    if ep_name in {r["method"] for r in rows}:
        pred = predicted_state(dims, t, E, ep, args.moe_every)
        by = {r["method"]: r for r in rows}
        by[ep_name].update(state_predicted_MB=pred["state_MB"], experts_predicted_MB=pred["experts_state_MB"])
        by[ep_name].update(common.vs_paired(by[ep_name], by["MoE replicated (plain DP)"], "vs_replicated"))
    timing = time_model(ctx, args, ep, models, groups) if ep_name in models and ep > 1 else None
    return rows, routing_rows(everyone, E, ep, W), accounting(ctx, args, ep, groups), timing


def _timed(ctx, fn, reps=5) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one (the ranks start each
    together), the slowest rank's."""
    times = [common.time_call(ctx.device, fn) for _ in range(reps + 1)][1:]
    t = torch.tensor([sorted(times)[reps // 2]], dtype=torch.float64, device=ctx.device)   # NCCL: on the device
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _replay(ctx, moes, layers):
    """A function that runs ``moes``' local experts forward and backward on as many rows
    from each rank as each got in a step (``layers``: the step's stats per MoE layer),
    sorted and put back as there: the experts' compute of that step, alone."""
    calls = []
    for moe, stats in zip(moes, layers):
        rows = stats["rows"]
        x = torch.randn(sum(map(sum, rows)), moe.router.in_features, device=ctx.device, requires_grad=True)
        flat = torch.tensor([n for r in rows for n in r], device=ctx.device)
        calls.append(lambda moe=moe, x=x, rows=rows, flat=flat: moe._run_local(x, rows, flat).sum().backward())
    return lambda: [call() for call in calls]


def alltoall_model(ctx, group, nbytes=8 << 20) -> tuple:
    """An all-to-all's latency (seconds, 8 bytes to each rank) and bandwidth (bytes/s, from
    one of ``nbytes`` put in by each rank, large enough that the latency is a small part of
    it), timed on ``group``: the alpha-beta model t = a + bytes / b."""
    n = dist.get_world_size(group)
    def run(per):
        send = torch.zeros(n * per, device=ctx.device)
        recv = torch.empty_like(send)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    per = max(1, int(nbytes) // 4 // n)
    alpha = _timed(ctx, run(2))
    return alpha, per * n * 4 / max(_timed(ctx, run(per)) - alpha, alpha)


def _plain_step(model, optimizer, batch, sync=True):
    """A DDP-wrapped model's training step, untimed (``sync`` False: backward under no_sync,
    the gradients left unreduced)."""
    optimizer.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if sync else model.no_sync():
        model(*batch).backward()
    if sync:
        model.finish_gradient_synchronization()
    optimizer.step()


def _exchange_hooks(ctx, moes, group, current) -> list:
    """Hooks that make EP's all-to-alls in a replicated MoE's step: at each point where EP
    exchanges (before a MoE, the counts and the tokens out; after it, the outputs back; the
    same two reversed in backward), an all-to-all of the bytes EP sent there over ``group``,
    read from ``current[0]`` (EP's routing stats of a step, per MoE layer; None: no
    exchange). Returns the handles."""
    n = dist.get_world_size(group)

    def hooks(i, moe):
        d, per, staged = moe.router.in_features, moe.n_experts // n, moe.staged(ctx.device, group)

        def a2a(out, back):   # rows ``out`` to each rank, ``back`` from each (EP's _exchange)
            if current[0] is not None:
                st = current[0][i]
                _exchange(torch.zeros(sum(st[out]), d, device=ctx.device), st[out], st[back], group, staged)

        def counts_and_tokens(*_):
            if current[0] is not None:
                _exchange(torch.zeros(moe.n_experts, dtype=torch.long, device=ctx.device), [per] * n, [per] * n,
                          group, staged)
            a2a("send", "recv")
        return [moe.register_forward_pre_hook(counts_and_tokens),                          # counts, tokens out
                moe.register_forward_hook(lambda *_: a2a("recv", "send")),                 # outputs back
                moe.register_full_backward_pre_hook(lambda *_: a2a("send", "recv")),       # their gradients out
                moe.register_full_backward_hook(lambda *_: a2a("recv", "send"))]           # inputs' gradients back
    return [h for i, moe in enumerate(moes) for h in hooks(i, moe)]


TIME_TERMS = ("ep", "replicated", "replicated_no_reduce", "replicated_exchanging", "ep_experts", "replicated_experts")


def time_model(ctx, args, ep, models, groups) -> tuple:
    """EP's step time by a model of its parts: the replicated MoE's step, less its experts'
    compute (forward and backward, the slowest rank, replayed on the rows each expert got)
    and the part of the step that waited for their gradients' all-reduce (the step less the
    same step reducing nothing, times the experts' share of the gradients' bytes; at most
    the all-reduce's own time), plus EP's slowest rank's expert compute (replayed the same
    way), its experts' gradient all-reduce over their copies (none when ep is the world,
    timed alone) and its all-to-alls: each exchange of the step (the counts; the tokens out
    and back, forward and backward) with EP's bytes, made at the same points of the
    replicated step (the step with them less the step without: the transfers and the
    ranks' waits for each other there). Every part is measured in each of 2 x --steps + 4
    rounds, beside EP's step on the same batch, in an order reversed every other round:
    step_over_model is the median of the rounds' ratios (the machine's drift cancels within
    a round), the other columns each term's median. Beside it, for reference, the
    exchanges at the alpha-beta model's time (timed back to back, the slowest rank's)."""
    ep_name, rep_name = f"EP {ep}, aux {args.aux_coef:g}", "MoE replicated (plain DP)"
    (ep_model, ep_opt), (rep_model, rep_opt) = models[ep_name], models[rep_name]
    rounds = 2 * args.steps + 4
    ep_moes, rep_moes = (m.module.moes() for m in (ep_model, rep_model))

    def allreduce(model, group=None):   # the experts' gradients, all-reduced over ``group``
        grads = torch.zeros(sum(p.numel() for p in expert_parameters(model.module)), device=ctx.device)
        return _timed(ctx, lambda: dist.all_reduce(grads, group=group))
    ar, ar_ep = allreduce(rep_model), allreduce(ep_model, groups[1]) if groups[1] is not None else 0.0
    share = sum(p.numel() for p in expert_parameters(rep_model.module)) / sum(p.numel() for p in rep_model.parameters())
    batches = [tuple(common.shard(x, ctx.rank, ctx.world_size) for x in common.lm_batch(
        args.batch_size, args.context_length, i, args.seed, ctx.device)) for i in range(4)]
    current, local = [None], []
    handles = _exchange_hooks(ctx, rep_moes, groups[0], current)
    try:
        for i in range(rounds + 1):   # the first round warms the hooks up; not counted
            batch, got = batches[i % len(batches)], {}

            def replicated(sync=True, exchanging=False):
                current[0] = got["ep_layers"] if exchanging else None
                _plain_step(rep_model, rep_opt, batch, sync)
                current[0] = None
            steps = {"ep": lambda: train_step(ep_model, ep_opt, batch, common.StepClock(ctx.device)),
                     "replicated": replicated, "replicated_no_reduce": lambda: replicated(sync=False)}
            order = list(steps) if i % 2 == 0 else list(steps)[::-1]
            for name in order:
                got[name] = common.time_call(ctx.device, steps[name])
                if name == "ep":
                    got["ep_layers"] = [m.stats for m in ep_moes]
                elif name == "replicated":
                    got["rep_layers"] = [m.stats for m in rep_moes]
            got["replicated_exchanging"] = common.time_call(ctx.device, lambda: replicated(exchanging=True))
            with ep_model.no_sync(), rep_model.no_sync():   # replays: no DDP reduction
                replays = {"ep_experts": _replay(ctx, ep_moes, got["ep_layers"]),
                           "replicated_experts": _replay(ctx, rep_moes, got["rep_layers"])}
                for name in (list(replays) if i % 2 == 0 else list(replays)[::-1]):
                    got[name] = common.time_call(ctx.device, replays[name])
            if i:
                local.append([got[k] for k in TIME_TERMS])
    finally:
        for h in handles:
            h.remove()
    slowest = torch.tensor(local, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)   # each step's and replay's slowest rank
    per_round = []
    for values in slowest.tolist():
        r = dict(zip(TIME_TERMS, values))
        exposed = min(ar, max(0.0, r["replicated"] - r["replicated_no_reduce"]) * share)
        a2a = r["replicated_exchanging"] - r["replicated"]
        model = r["replicated"] - r["replicated_experts"] - exposed + r["ep_experts"] + ar_ep + a2a
        per_round.append({**r, "experts_allreduce_exposed": exposed, "alltoall": a2a, "model": model,
                          "step_over_model": r["ep"] / model})
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    layers = got["ep_layers"]   # the last round's
    d = ep_moes[0].router.in_features
    sizes = [4 * d * n for st in layers for n in (sum(st["send"]), sum(st["recv"]))]   # bytes put in, per exchange
    alpha, beta = alltoall_model(ctx, groups[0])
    ab = torch.tensor([sum(2 * (alpha + b / beta) for b in sizes) + len(layers) * alpha], dtype=torch.float64,
                      device=ctx.device)
    dist.all_reduce(ab, op=dist.ReduceOp.MAX)       # forward and backward, and the counts; the slowest rank's
    ratios = sorted(r["step_over_model"] for r in per_round)
    row = {"method": ep_name, "ep": ep, "rounds": rounds, "step_ms": med["ep"] * 1e3, "model_ms": med["model"] * 1e3,
           "step_over_model": med["step_over_model"], "step_over_model_q1": ratios[len(ratios) // 4],
           "step_over_model_q3": ratios[(3 * len(ratios)) // 4], "replicated_ms": med["replicated"] * 1e3,
           "replicated_experts_ms": med["replicated_experts"] * 1e3, "experts_allreduce_ms": ar * 1e3,
           "experts_allreduce_exposed_ms": med["experts_allreduce_exposed"] * 1e3,
           "ep_experts_ms": med["ep_experts"] * 1e3, "ep_allreduce_ms": ar_ep * 1e3, "alltoall_ms": med["alltoall"] * 1e3,
           "alltoall_alpha_beta_ms": ab.item() * 1e3, "a2a_latency_us": alpha * 1e6, "a2a_GBps": beta / 1e9}
    return row, per_round


CAPACITIES = (0.0, 2.0, 1.25, 1.0, 0.5)


def capacity_steps(args) -> int:
    """The capacity table's AdamW steps at each capacity factor: 4 x --steps (40 by default),
    so a short run (a GPU's smoke job, gloo over CUDA staging every exchange) stays short."""
    return max(8, 4 * args.steps)


def capacity_and_loss(ctx, args, ep, steps=None, batches=4):
    """What dropping does to the loss: EP trained at each capacity factor of CAPACITIES
    (0: no dropping) from the same weights on the same ``batches`` global batches, cycled
    for ``steps`` AdamW steps (random tokens: the loss falls only as the model memorizes
    them, which is what capacity limits); the last 4 steps' mean loss (the group's) and
    the share of assignments dropped over the run."""
    dims, W, t = common.MODEL_SIZES[args.model_size], ctx.world_size, args.context_length
    steps = steps or capacity_steps(args)
    groups, rows = ep_groups(W, ep), []
    data = [common.lm_batch(args.batch_size, t, b, args.seed, ctx.device) for b in range(batches)]
    for c in CAPACITIES:
        model = expert_parallel(build(dims, t, args.experts, args.top_k, c, args.seed, ctx.device, args.aux_coef,
                                      args.moe_every), *groups)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, dropped = [], []
        for step in range(steps):
            x, y = (common.shard(v, ctx.rank, W) for v in data[step % batches])
            with common.autocast(ctx.device, getattr(args, "dtype", "float32")):
                loss = train_step(model, opt, (x, y), common.StepClock(ctx.device))
            task = loss.float() - args.aux_coef * sum(m.aux.detach() for m in model.module.moes())
            dist.all_reduce(task)
            losses.append(task.item() / W)
            dropped += [m.stats["dropped"] for m in model.module.moes()]
        share = torch.tensor(sum(dropped) / len(dropped), dtype=torch.float64, device=ctx.device)   # NCCL: on the device
        dist.all_reduce(share)
        rows.append({"capacity_factor": c, "steps": steps, "first_loss": losses[0],
                     "last_loss": sum(losses[-4:]) / 4, "dropped": share.item() / W})
    return rows


GROUPED_CASES = [(E, k) for E in (8, 32) for k in (1, 2)]


def expert_timing(ctx, args, tokens=4096):
    """One MoE layer's forward and backward on one rank (rank 0; the others wait), its
    experts run one call each (a loop over slices) and grouped (grouped_mlp), at 8 and 32
    experts, top-1 and top-2, on ``tokens`` tokens of the LM's width (no dropping), in
    --dtype (bf16: under autocast): the median of --steps calls each after 2 unmeasured,
    the two alternating; the kernel the grouped path ran (torch._grouped_mm, seen
    dispatched, or the padded batched matmul), and which of the two MoE's default ("auto")
    takes here."""
    with common.autocast(ctx.device, getattr(args, "dtype", "float32")):
        return _expert_timing(ctx, args, tokens)


def _expert_timing(ctx, args, tokens):
    rows = []
    if ctx.rank == 0:
        d, d_ff = common.MODEL_SIZES[args.model_size][:2]
        x = torch.randn(tokens, d, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(args.seed))
        for E, k in GROUPED_CASES:
            torch.manual_seed(args.seed)
            with torch.device(ctx.device):
                moes = {"loop": MoE(d, d_ff, E, top_k=k, grouped=False),
                        "grouped": MoE(d, d_ff, E, top_k=k, grouped=grouped_mlp)}
            moes["grouped"].load_state_dict(moes["loop"].state_dict())
            times = {name: [] for name in moes}
            with common.count_collectives() as seen:   # the kernels the grouped path runs
                moes["grouped"](x).sum().backward()
            for i in range(2 + args.steps):
                for name in (list(moes) if i % 2 == 0 else list(moes)[::-1]):
                    common.sync(ctx.device)
                    t0 = time.perf_counter()
                    moes[name](x).sum().backward()
                    common.sync(ctx.device)
                    if i >= 2:
                        times[name].append(time.perf_counter() - t0)
            kernel = "torch._grouped_mm" if "grouped_mm" in seen.kernels else "padded bmm"
            default = "grouped" if ctx.device.type == "cuda" and _grouped_ok(x, dtype=_matmul_dtype(x)) else "loop"
            med = {name: common.summarize(t)["median"] * 1e3 for name, t in times.items()}
            rows.append({"experts": E, "top_k": k, "rows": tokens * k, "loop_ms": med["loop"],
                         "grouped_ms": med["grouped"], "loop_over_grouped": med["loop"] / med["grouped"],
                         "grouped_kernel": kernel, "default": default, "dtype": getattr(args, "dtype", "float32")})
    dist.barrier()
    return rows


def routing_rows(everyone, E, ep, W) -> list:
    """Per method with a MoE and per step: tokens per expert summed over the ranks of one ep
    group (every MoE layer), their max over mean, and the share of assignments dropped."""
    rows = []
    for name in everyone[0]["routing"]:
        steps = [e["routing"][name] for e in everyone]
        for i in range(len(steps[0])):
            for layer in range(len(steps[0][i])):
                tokens = [sum(steps[r][i][layer]["tokens"][e] for r in range(W)) for e in range(E)]
                dropped = sum(steps[r][i][layer]["dropped"] for r in range(W)) / W
                rows.append({"method": name, "step": i, "layer": layer, "tokens_per_expert": tokens,
                             "max_over_mean": max(tokens) / (sum(tokens) / E), "dropped": dropped})
    return rows


def accounting(ctx, args, ep, groups):
    """One counted step of EP: the all-to-all bytes this rank puts in (nccl-tests'
    all-to-all size, count_collectives) beside the formula: per MoE layer, the E counts
    (int64), and d floats per row: its kept assignments twice (dispatched in forward, their
    outputs' gradients combined back in backward) and the rows that arrived for its experts
    twice (their outputs sent back, their inputs' gradients returned); summed over the ep
    group both are the k N d of every token's choices. Also the rows that left the rank
    beside (ep-1)/ep of k N, what uniform routing sends away."""
    dims, W = common.MODEL_SIZES[args.model_size], ctx.world_size
    d, t = dims[0], args.context_length
    model = expert_parallel(build(dims, t, args.experts, args.top_k, args.capacity_factor, args.seed, ctx.device,
                                  args.aux_coef, args.moe_every), *groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tuple(common.shard(x, ctx.rank, W) for x in common.lm_batch(args.batch_size, t, 0, args.seed, ctx.device))
    train_step(model, opt, batch, common.StepClock(ctx.device))
    with common.count_collectives() as counter:
        train_step(model, opt, batch, common.StepClock(ctx.device))
    ep_name = groups[0].group_name
    counted = sum(b for op, g, b in counter.log if op == "alltoall_base_" and g == ep_name)
    moes = model.module.moes()
    n = batch[0].numel()
    kept, arrived = sum(m.stats["kept"] for m in moes), sum(m.stats["arrived"] for m in moes)
    row = {"rank": ctx.rank, "moe_layers": len(moes), "tokens": n, "kept_assignments": kept, "arrived_rows": arrived,
           "a2a_MB": counted / 1e6,
           "a2a_formula_MB": (2 * (kept + arrived) * d * 4 + len(moes) * args.experts * 8) / 1e6,
           "left_rank_MB": 4 * sum(m.stats["rows_out"] for m in moes) * d * 4 / 1e6,
           "left_rank_uniform_MB": 4 * (ep - 1) / ep * args.top_k * n * len(moes) * d * 4 / 1e6}
    everyone = [None] * W
    dist.all_gather_object(everyone, row)
    return everyone


HEADERS = ["method", "ep", "step_ms", "step_min_ms", "step_max_ms", "vs_replicated", "vs_replicated_min",
           "vs_replicated_max", "tokens_per_s_per_rank", "comm_MB", "state_MB", "state_predicted_MB",
           "experts_state_MB", "experts_predicted_MB", "slowest_expert_ms", "mean_expert_ms", "experts_kernel"]
NAME, TITLE = "12_expert_parallel", "Expert parallelism beside the replicated MoE and a dense model"
TABLES = ("benchmark", "capacity", "grouped")


def parser():
    """12's flags: ep, experts, routing, capacity, the balancing loss, --dtype, the tables."""
    p = common.script_parser(__doc__, cpu_size="micro", gpu_size="small", world="--ep")
    p.add_argument("--ep", type=common.COUNT, default=None,
                   help="ranks that share the experts (default: 2; the world holds world/ep copies of them)")
    p.add_argument("--experts", type=common.COUNT, default=None, help="experts per MoE layer (default: 2 x ep)")
    p.add_argument("--top-k", type=common.COUNT, default=2, help="experts each token goes to")
    p.add_argument("--capacity-factor", type=common.number(float, 0, hint="; 0 means no dropping"), default=1.25,
                   help="a rank-batch's slots per expert, over the even share (0: no dropping)")
    p.add_argument("--aux-coef", type=common.NONNEG, default=0.01, help="the load-balancing loss's weight")
    p.add_argument("--moe-every", type=int, choices=[1, 2], default=1, help="a MoE in every block, or every other")
    common.add_dtype_flag(p)   # bf16: the MoE LM in autocast, grouped experts in bf16 (torch._grouped_mm on sm80+)
    p.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES),
                   help="the benchmark's parts: benchmark (EP beside the replicated MoE and a dense model, its time "
                        "model, routing, bytes), capacity (the loss by capacity factor), grouped (experts one call "
                        "each or grouped) (default: all)")
    p.set_defaults(context_length=64)
    return p


def checked_args(p, argv):
    """The flags parsed and checked before any worker starts: (args, ep)."""
    first = p.parse_args(argv)
    ep = first.ep if first.ep is not None else 2
    args = common.parse(p, argv, world=lambda a: a.world_size if a.world_size is not None else ep,
                        world_flag="--world-size" if first.world_size else "--ep")
    if args.world_size % ep:
        raise common.UsageError(f"--ep {ep} does not divide the world size {args.world_size}"
                                + (" (torchrun's world)" if common.under_torchrun() else "")
                                + ": the ranks form groups of ep")
    args.experts = args.experts if args.experts is not None else 2 * ep
    if args.experts % ep:
        raise common.UsageError(f"--ep {ep} does not divide --experts {args.experts}: each rank holds experts/ep; "
                                f"use a multiple of {ep}")
    if args.top_k > args.experts:
        raise common.UsageError(f"--top-k {args.top_k} must be at most --experts {args.experts}")
    return args, ep


def run_tables(args, ep):
    """The benchmark's parts (--tables), each part's tables written as soon as it has run: a
    run cut short (a time box) keeps them."""
    settings = {**common.lm_settings(args), "ep": ep, "experts": args.experts, "top_k": args.top_k,
                "capacity_factor": args.capacity_factor, "aux_coef": args.aux_coef, "moe_every": args.moe_every}
    report, printed = common.is_reporter(), []
    if "benchmark" in args.tables:
        rows, routing, acc, timing = common.launch(benchmark, args, ep)
        if report:
            printed.append(save_benchmark(args, settings, rows, routing, acc, timing))
    capacity = common.launch(capacity_and_loss, args, ep) if "capacity" in args.tables else None
    if report and capacity is not None:
        printed.append("Capacity and the loss\n" + common.save_results(
            args.out, "12_capacity", capacity, settings,
            title="What dropping does to the loss: the task loss (without the balance term) over the run, and the "
                  "share of assignments dropped, by capacity factor",
            note=f"EP from the same weights at each capacity factor (0: no dropping), {capacity_steps(args)} AdamW "
                 f"steps (4 x --steps) cycling the same 4 global batches of random tokens (the loss falls only as "
                 f"the model memorizes them, which capacity limits); last_loss: the mean of the last 4 steps; "
                 f"dropped: the share of assignments dropped over the run."))
    grouped = common.launch(expert_timing, args) if "grouped" in args.tables else None
    if report and grouped is not None:
        printed.append(f"Experts one call each or grouped (one MoE layer, forward and backward, 4096 tokens, "
                       f"{args.dtype}; ms)\n" + common.save_results(
                           args.out, "12_grouped", grouped, settings,
                           title="Experts one call each (a loop) or grouped: one MoE layer's forward and backward",
                           note=expert_timing.__doc__.replace("\n    ", " ")))
    if report:
        files = {"benchmark": f"{NAME}.*, 12_time_model.*, 12_routing.*, 12_accounting.*", "capacity": "12_capacity.*",
                 "grouped": "12_grouped.*"}
        print("\n\n".join(printed) + "\n" + common.wrote(args.out, ", ".join(files[t] for t in TABLES if t in args.tables)))


def main(argv=None):
    args, ep = checked_args(parser(), argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args, ep, VERIFY_CASES), f"{NAME} at ep {ep}")
        if args.dtype == "bf16":
            common.check_verification(common.launch(verify_bf16, args, ep), f"{NAME}, bf16, at ep {ep}")
    if not args.no_bench:
        run_tables(args, ep)


def save_benchmark(args, settings, rows, routing, acc, timing) -> str:
    """The benchmark's tables (the step table, the time model, routing, all-to-all bytes):
    written, and returned as the text to print."""
    table = common.save_results(args.out, NAME, rows, settings, headers=HEADERS, title=TITLE)
    summary = {}
    for r in routing:
        s = summary.setdefault(r["method"], {"method": r["method"], "steps": 0, "max_over_mean": 0.0,
                                              "dropped": 0.0, "tokens_per_expert_last": None})
        s["steps"] = max(s["steps"], r["step"] + 1)
        s["max_over_mean"] = max(s["max_over_mean"], r["max_over_mean"])
        s["dropped"] += r["dropped"]
        s["tokens_per_expert_last"] = r["tokens_per_expert"]
    for s in summary.values():
        s["dropped"] /= max(1, sum(1 for r in routing if r["method"] == s["method"]))
    t2 = common.save_results(args.out, "12_routing", list(summary.values()), settings,
                             title="Routing: tokens per expert (every rank, the last layer of the last step), the "
                                   "largest load over the mean, the share of assignments dropped",
                             extra={"per_step": routing})
    t3 = common.save_results(args.out, "12_accounting", acc, settings,
                             title="All-to-all bytes per step and rank, counted beside the formula",
                             note=accounting.__doc__.replace("\n    ", " "))
    t6 = common.save_results(args.out, "12_time_model", [timing[0]] if timing else [], settings,
                             title="EP's step beside the model of its time",
                             note=time_model.__doc__.replace("\n    ", " "),
                             extra={"per_round": timing[1] if timing else []})
    return (f"\n{TITLE}\n({args.model_size} LM with {args.experts} experts a MoE, top-{args.top_k}, capacity "
            f"{args.capacity_factor:g}, {args.dtype}, {args.world_size} x {args.backend}/{args.device}, global batch "
            f"{args.batch_size}x{args.context_length}; times in ms, median [min, max] of {args.steps} steps; "
            f"vs_replicated: paired ratio; state: parameters, gradients, AdamW per rank)\n{table}\n\n"
            f"EP's step beside the model of its time (ms)\n{t6}\n\nRouting\n{t2}\n\n"
            f"All-to-all bytes per rank (MB)\n{t3}")


if __name__ == "__main__":
    common.run_main(main)
