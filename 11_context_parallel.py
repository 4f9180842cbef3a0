"""Context parallelism: one long sequence split over the ranks of a group, attention
computed across the split with ring attention, all-gathered K/V, or Ulysses all-to-all.

Each rank holds a part of every sequence: its queries, keys and values. Causal attention
needs, for each query, every key at or before its position, so the ranks exchange keys and
values. **ring** (Liu et al. 2023): the K/V blocks travel around the ring while the
queries stay; each step attends to one block through torch's fused attention kernel (which
returns the log-sum-exp with the output), the next block's transfer overlapping this
block's compute, and the partial outputs merge by their log-sum-exp (the online softmax),
so no score matrix is ever whole. Backward is a ring too: K/V travel again, and each
block's dK/dV accumulator travels with them, its exchange overlapping the next block's
compute, home after a full circle. **allgather** (Llama 3): K/V gathered for the forward's
blocks and dropped, gathered again in backward, their gradients reduce-scattered: it keeps
for backward what the ring keeps. **ulysses** (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head
shards, every rank attends over the whole sequence for h/cp heads, and another all-to-all
turns it back; cp must divide the heads. Under the causal mask contiguous parts leave the
last rank with cp times the first's work, so the sequence is cut into 2cp chunks and rank i
holds chunks i and 2cp-1-i (the zig-zag layout): every rank does the same work.

In the LM (context_parallel_lm) each rank embeds its tokens at their true positions, runs
the blocks on its part with the CP attention and takes its part of the loss; the weights
are replicated over the group, their gradients averaged over it (05's DDPBucketed), as over
a data-parallel group.

Run:
    python 11_context_parallel.py                            # cp 2: verify every method and layout, then time
    python 11_context_parallel.py --cp 4 --method ring --seq-lens 1024 4096
    torchrun --standalone --nproc-per-node 4 11_context_parallel.py

Prints PASS/FAIL per verification case (attention outputs and q, k, v gradients at cp 2, 3
and 4 in the tests; LM training against one process), then tables: step time and tokens/s
per rank of each method beside one process across sequence lengths; one attention's saved
and peak memory per rank beside the formula and the bound (the rank's share of one
process's peak + the blocks in flight), and the bytes it sends (per layer and step) counted beside the closed
form; each rank's ring attention time in the contiguous and zig-zag layouts. --sweep
instead times one attention and measures its peak from 1k to 32k tokens, one process
beside every method at cp 2 and 4, and on a GPU torch's context_parallel
(11_sweep.{json,md,png}; make cp-sweep). Writes <out>/11_context_parallel.{json,md}, 11_memory.{json,md} and
11_balance.{json,md}, and <out>/11_timeline.png (one ring step: compute and waiting per
rank).
"""

import argparse
import copy
import os
import statistics

import common

# ---- begin copy: context-parallel attention (needs only torch and the standard library) ----
import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def chunks_of(rank: int, cp: int, layout="zigzag") -> list:
    """The chunks of the sequence rank holds, in its order: "contiguous" cuts the sequence
    into cp chunks (rank i: chunk i), "zigzag" into 2cp (rank i: chunks i and 2cp-1-i)."""
    return [rank] if layout == "contiguous" else [rank, 2 * cp - 1 - rank]


def positions(t_local: int, rank: int, cp: int, layout="zigzag", device=None) -> torch.Tensor:
    """The global positions of rank's ``t_local`` tokens, in the order it holds them."""
    mine = chunks_of(rank, cp, layout)
    size = t_local // len(mine)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in mine])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout="zigzag", dim=1) -> torch.Tensor:
    """Rank's part of a whole sequence (dimension ``dim``), in the order it holds it."""
    n = cp if layout == "contiguous" else 2 * cp
    if x.shape[dim] % n:
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not cut into the {n} chunks of {layout} over {cp}")
    parts = x.chunk(n, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(rank, cp, layout)], dim=dim)


def _peers(group):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = lambda r: dist.get_global_rank(group or dist.group.WORLD, r % cp)  # noqa: E731
    return cp, rank, g(rank + 1), g(rank - 1)


def _exchange(sends, group, nxt, prv, staged, tag=0):
    """Send the tensors ``sends`` to the next rank of the ring and receive as many from the
    previous one, in the background: returns wait(), which gives what arrived. ``staged``:
    through host memory (gloo with GPU tensors: its send/recv take CPU tensors only);
    ``tag`` tells two exchanges in flight at once apart (K/V and their gradients)."""
    wires = [x.to("cpu", copy=True).contiguous() if staged else x.contiguous() for x in sends]
    bufs = [torch.empty_like(w) for w in wires]
    works = dist.batch_isend_irecv([dist.P2POp(op, x, peer, group, tag=2 * tag + i) for i, (w, b) in
                                    enumerate(zip(wires, bufs)) for op, x, peer in
                                    ((dist.isend, w, nxt), (dist.irecv, b, prv))])

    def wait():
        for w in works:
            w.wait()
        return [b.to(x.device) if staged else b for b, x in zip(bufs, sends)]
    return wait


def _block(rank, src, cp, layout, size, causal=True):
    """The work one step leaves between this rank's queries and ``src``'s keys: (query rows,
    key rows, causal within the block) of the two ranks' local tokens, or None where the
    causal mask leaves none. ``size``: tokens of one chunk. The rank's own block is causal
    (its chunks are in order); under zig-zag an earlier rank's first chunk is seen by both of
    this rank's chunks and a later rank's whole block by this rank's second chunk only (its
    second chunk comes after every chunk of a later rank, its first before them); under
    contiguous an earlier rank's block is seen whole, a later one's not at all."""
    whole = slice(0, size * len(chunks_of(rank, cp, layout)))
    if not causal or src == rank:
        return whole, whole, causal
    if layout == "contiguous":
        return (whole, whole, False) if src < rank else None
    return (whole, slice(0, size), False) if src < rank else (slice(size, 2 * size), whole, False)


TILE = 128   # the hand-written path: query rows whose scores exist at once


def _diagonal_mask(n, device):
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _expand(x, g):
    """Grouped-query attention: each of x's key/value heads (dim 1) for its g query heads."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _fold(x, g):
    """The reverse of _expand for gradients: each key/value head's g copies summed."""
    return x if g == 1 else x.unflatten(1, (-1, g)).sum(2)


def _kernel(q) -> str:
    """Which attention computes a block of q's: torch's fused kernels, each returning the
    log-sum-exp that merges blocks ("cpu": the CPU flash kernel; "flash": CUDA's, for
    half types on sm80 and later; "efficient": CUDA's memory-efficient one, float32 too),
    or "math", the hand-written tiles, for what none of them takes."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda" or q.shape[-1] % 8:
        return "math"
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and \
            torch.cuda.get_device_capability(q.device) >= (8, 0):
        return "flash"
    return "efficient"


_aten = torch.ops.aten


def _attend(kernel, q, k, v, causal, scale):
    """One block's attention: (out in q's dtype, log-sum-exp float32, what the kernel's
    backward needs besides). k, v may have fewer heads than q (grouped-query)."""
    g = q.shape[1] // k.shape[1]
    if kernel == "cpu":   # takes grouped-query heads as they are
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kernel == "flash":
        r = _aten._scaled_dot_product_flash_attention(q, _expand(k, g), _expand(v, g), 0.0, causal, False,
                                                       scale=scale)
        return r[0], r[1], (r[2], r[3], r[6], r[7])   # cum_seq_q/k (not packed), rng state (no dropout)
    if kernel == "efficient":
        r = _aten._scaled_dot_product_efficient_attention(q, _expand(k, g), _expand(v, g), None, True, 0.0, causal,
                                                           scale=scale)
        return r[0], r[1][..., :q.shape[2]].float(), (r[2], r[3], r[1].shape[-1])   # its lse is padded
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    kf, vf, mask = _expand(k, g).float(), _expand(v, g).float(), _diagonal_mask(k.shape[2], q.device)
    for r in range(0, q.shape[2], TILE):
        rows = slice(r, r + TILE)
        s = (q[:, :, rows].float() @ kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(mask[rows], -math.inf)
        lse[:, :, rows] = torch.logsumexp(s, dim=-1)
        out[:, :, rows] = torch.exp(s - lse[:, :, rows, None]) @ vf
    return out.to(q.dtype), lse, ()


def _attend_backward(kernel, aux, dout, q, k, v, out, lse, causal, scale):
    """The gradients of one block (dq float32, dk and dv with k's heads) given the whole
    attention's ``out`` and ``lse``: with those, each block's backward is exact on its own
    (its probabilities are exp(score - lse), its softmax term sum(dout * out))."""
    g = q.shape[1] // k.shape[1]
    if kernel == "cpu":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                                 scale=scale)
        return dq, dk, dv
    ke, ve = _expand(k, g), _expand(v, g)
    if kernel == "flash":
        cq, ck, seed, offset = aux
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, cq, ck, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    elif kernel == "efficient":
        seed, offset, padded = aux
        lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])) if padded > lse.shape[-1] else lse
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        kf, vf, mask = ke.float(), ve.float(), _diagonal_mask(k.shape[2], q.device)
        dout = dout.float()
        delta = (dout * out.float()).sum(-1)
        dq, dk, dv = torch.empty(q.shape, dtype=torch.float32, device=q.device), torch.zeros_like(kf), \
            torch.zeros_like(vf)
        for r in range(0, q.shape[2], TILE):
            rows = slice(r, r + TILE)
            s = (q[:, :, rows].float() @ kf.transpose(-1, -2)) * scale
            if causal:
                s = s.masked_fill(mask[rows], -math.inf)
            p = torch.exp(s - lse[:, :, rows, None])
            dv += p.transpose(-1, -2) @ dout[:, :, rows]
            ds = p * (dout[:, :, rows] @ vf.transpose(-1, -2) - delta[:, :, rows, None])
            dq[:, :, rows] = ds @ kf * scale
            dk += ds.transpose(-1, -2) @ q[:, :, rows].float() * scale
    return dq, _fold(dk, g), _fold(dv, g)


def _merge(out, lse, rows, block_out, block_lse):
    """Add a block's attention to the running one (out float32, lse), online-softmax style:
    both rescaled to their summed log-sum-exp."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - new)[..., None] + \
        block_out.float() * torch.exp(block_lse - new)[..., None]
    lse[:, :, rows] = new


def _attend_step(kernel, q, k, v, work, scale, running):
    """Attend this rank's queries to one block's keys (``work``: _block's rows) and add the
    result to ``running`` (output float32, log-sum-exp, the kernel's aux), which the rank's
    own block, attended first, starts (every query sees it)."""
    qs, ks, diag = work
    o, lse, aux = _attend(kernel, q[:, :, qs], k[:, :, ks], v[:, :, ks], diag, scale)
    if running is None:
        return o.float(), lse.float(), aux
    _merge(running[0], running[1], qs, o, lse)
    return running


def _attend_step_backward(ctx, dout, q, k, v, out, lse, work, scale):
    """The gradients of one block of _attend_step (dq of its query rows, dk and dv of its
    key rows)."""
    qs, ks, diag = work
    return _attend_backward(ctx.kernel, ctx.aux, dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                            out[:, :, qs], lse[:, :, qs].contiguous(), diag, scale)


def _traced(trace, kind, t0):
    if trace is not None:
        trace.append((kind, t0, time.perf_counter()))


class _RingAttention(torch.autograd.Function):
    """Forward: K/V travel the ring, each block through the fused kernel, merged by
    log-sum-exp. Backward: K/V travel again; each block's dK/dV is computed locally, then
    added to the travelling accumulator of that block, which arrived meanwhile (its
    exchange overlaps the next block's compute) and goes home after a full circle."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, staged, trace, causal, kernel, scale=None):
        cp, rank, nxt, prv = _peers(group)
        size, scale = q.shape[2] // len(chunks_of(rank, cp, layout)), q.shape[-1] ** -0.5 if scale is None else scale
        kv, running = [k, v], None   # the block attended to now: this rank's own first
        for step in range(cp):
            src = (rank - step) % cp
            wait = _exchange(kv, group, nxt, prv, staged) if step < cp - 1 else None   # the next block, meanwhile
            t0 = time.perf_counter()
            work = _block(rank, src, cp, layout, size, causal)
            if work is not None:
                running = _attend_step(kernel, q, kv[0], kv[1], work, scale, running)
            _traced(trace, "compute", t0)
            if wait is not None:
                t0 = time.perf_counter()
                kv = wait()
                _traced(trace, "wait", t0)
        out, lse, ctx.aux = running
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.staged, ctx.trace, ctx.causal, ctx.kernel, ctx.scale = \
            group, layout, staged, trace, causal, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, nxt, prv = _peers(ctx.group)
        size, scale = q.shape[2] // len(chunks_of(rank, cp, ctx.layout)), ctx.scale
        dout = dout.contiguous()
        kv, arriving = [k, v], None
        for step in range(cp):
            src = (rank - step) % cp
            wait_kv = _exchange(kv, ctx.group, nxt, prv, ctx.staged) if step < cp - 1 else None
            t0 = time.perf_counter()
            work = _block(rank, src, cp, ctx.layout, size, ctx.causal)
            if work is None:
                part = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
            else:   # this block's dK, dV from here
                qs, ks, _ = work
                dq_b, dk_b, dv_b = _attend_step_backward(ctx, dout, q, kv[0], kv[1], out, lse, work, scale)
                if step == 0:   # every query row: the gradient of q starts here
                    dq = dq_b.float()
                else:
                    dq[:, :, qs] += dq_b
                if ks.stop - ks.start == k.shape[2]:   # contiguous now, so the exchange sends it as it is
                    part = [dk_b.float().contiguous(), dv_b.float().contiguous()]   # (no copy beside it)
                else:
                    part = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
                    part[0][:, :, ks] += dk_b
                    part[1][:, :, ks] += dv_b
                del dq_b, dk_b, dv_b   # the kernel's outputs go before the next block's arrive
            _traced(ctx.trace, "compute", t0)
            if arriving is not None:   # the earlier ranks' part of this block's gradient
                t0 = time.perf_counter()
                for mine, theirs in zip(part, arriving()):
                    mine += theirs
                _traced(ctx.trace, "wait", t0)
            arriving = _exchange(part, ctx.group, nxt, prv, ctx.staged, tag=1)   # on to the block's next holder
            if wait_kv is not None:
                kv = wait_kv()
        dkv = arriving()   # this rank's own block, home after the full circle
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor       # torch >= 2.14: *_single
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(k, v, group):
    """Every rank's K and V, (cp, 2, batch, heads, its tokens, head dim), in rank order:
    this rank's written into its own slot of the output and gathered in place (as FSDP2
    gathers), with no stacked copy of them for the collective to hold."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(cp, 2, *k.shape, dtype=k.dtype, device=k.device)
    out[rank, 0].copy_(k)
    out[rank, 1].copy_(v)
    _all_gather(out.view(cp * 2, *k.shape), out[rank], group=group)
    return out


class _GatheredAttention(torch.autograd.Function):
    """All-gather attention that keeps for backward only what the ring keeps (this rank's
    q, k, v, out, log-sum-exp): K and V are gathered for the forward, dropped, and gathered
    again in backward, whose dK/dV of the whole sequence are reduce-scattered (float32) to
    their owners. The blocks are the ring's, through the same fused kernel."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, kernel, scale=None):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        size, scale = q.shape[2] // len(chunks_of(rank, cp, layout)), q.shape[-1] ** -0.5 if scale is None else scale
        kv, running = _gather_kv(k, v, group), None
        for src in [rank] + [r for r in range(cp) if r != rank]:   # its own block first: it starts every row
            work = _block(rank, src, cp, layout, size, causal)
            if work is not None:
                running = _attend_step(kernel, q, kv[src, 0], kv[src, 1], work, scale, running)
        out, lse, ctx.aux = running
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.kernel, ctx.scale = group, layout, causal, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        size, scale = q.shape[2] // len(chunks_of(rank, cp, ctx.layout)), ctx.scale
        dout = dout.contiguous()
        kv = _gather_kv(k, v, ctx.group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)
        for src in range(cp):
            work = _block(rank, src, cp, ctx.layout, size, ctx.causal)
            if work is not None:
                qs, ks, _ = work
                dq_b, dk_b, dv_b = _attend_step_backward(ctx, dout, q, kv[src, 0], kv[src, 1], out, lse, work, scale)
                dq[:, :, qs] += dq_b
                dkv[src, 0][:, :, ks] += dk_b
                dkv[src, 1][:, :, ks] += dv_b
                del dq_b, dk_b, dv_b   # freed before the next block's are made
        del kv
        mine = torch.empty(dkv.shape[1:], dtype=torch.float32, device=k.device)
        _reduce_scatter(mine, dkv.flatten(0, 1), group=ctx.group)   # each block's parts summed at its owner
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    """Part j of dimension 0 goes to rank j, which puts it at place (this rank); its own
    transpose, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _global_order(cp, t_local, layout, device):
    """Where the tokens of all ranks, laid end to end in rank order, go in the sequence."""
    return torch.cat([positions(t_local, r, cp, layout, device) for r in range(cp)]).argsort()


def _check(q, k, v, cp, method, layout):
    """What context_parallel_attention cannot take, refused before any exchange (every rank
    of the group sees the same shapes, so every rank refuses alike and none waits)."""
    if method not in ("ring", "allgather", "ulysses"):
        raise ValueError(f"unknown method {method!r}: ring, allgather or ulysses")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"unknown layout {layout!r}: contiguous or zigzag")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.shape[0], q.shape[2], q.shape[3]) != \
            (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q, k, v must be (batch, heads, tokens, head dim), k and v alike: got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    h, hk, t_local = q.shape[1], k.shape[1], q.shape[2]
    if h % hk:
        raise ValueError(f"{hk} key/value heads do not divide the {h} query heads")
    if t_local % len(chunks_of(0, cp, layout)):
        raise ValueError(f"this rank's {t_local} tokens do not cut into the {layout} layout's chunks")
    if method == "ulysses" and h % cp:
        raise ValueError(f"ulysses splits the {h} heads over {cp} ranks: cp must divide the heads")


# torch.compile runs it as it is, a clean graph break where it is called (dynamo traced into the
# autograd Functions' exchanges, which break its graph inside them, and failed now and then with
# "Global grad_mode state changed while dynamo tracing")
@torch.compiler.disable
def context_parallel_attention(q, k, v, group=None, method="ring", layout="zigzag", host_staging=None, trace=None,
                               causal=True, scale=None):
    """Attention for this rank's part of the sequence (q, k, v: batch, heads, its tokens,
    head dim; its tokens those of ``layout``, see shard_sequence), over the ranks of
    ``group``; returns this rank's output. ``method``: "ring", "allgather" or "ulysses".
    ``causal``: each query sees the keys at or before its position (else every key);
    ``scale``: what q k^T is multiplied by (default head_dim ** -0.5, as SDPA's).

        q, k, v = (shard_sequence(t, rank, cp, dim=2) for t in (q_all, k_all, v_all))
        out = context_parallel_attention(q, k, v, cp_group, "ring")   # = that part of whole attention

    Grouped-query attention: k and v may have fewer heads than q (each serving
    q_heads / kv_heads query heads, as SDPA's enable_gqa); only those heads are exchanged
    (ulysses: where cp divides them too, else they are repeated first). Bad input is
    refused (ValueError) before any exchange. ``host_staging``: point-to-point through host
    memory (None: when the group is gloo and the tensors on a GPU). ``trace``: a list the
    ring appends (kind, start, end) to.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    _check(q, k, v, cp, method, layout)
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5 if scale is None else scale
    if method == "ring":
        staged = host_staging if host_staging is not None else \
            q.device.type != "cpu" and dist.get_backend(group) == "gloo"
        return _RingAttention.apply(q, k, v, group, layout, staged, trace, causal, _kernel(q), scale)
    t_local = q.shape[2]
    if method == "allgather":
        return _GatheredAttention.apply(q, k, v, group, layout, causal, _kernel(q), scale)
    b, h, _, d = q.shape   # ulysses
    if k.shape[1] % cp:   # the key/value heads do not split: every query head's own copy travels
        k, v, g = _expand(k, g), _expand(v, g), 1
    hk = k.shape[1]
    xq = _AllToAll.apply(q.reshape(b, cp, h // cp, t_local, d).transpose(0, 1), group)   # (cp sources, b, h/cp, ...)
    xkv = _AllToAll.apply(torch.stack([k, v]).view(2, b, cp, hk // cp, t_local, d).permute(2, 0, 1, 3, 4, 5), group)
    order = _global_order(cp, t_local, layout, q.device)
    xq = xq.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, order]           # (b, h/cp, t, d), the sequence in order
    xkv = xkv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[:, :, :, order]   # (2, b, hk/cp, t, d)
    o = F.scaled_dot_product_attention(xq, _expand(xkv[0], g), _expand(xkv[1], g), is_causal=causal, scale=scale)
    o = o[:, :, order.argsort()].unflatten(2, (cp, t_local)).permute(2, 0, 1, 3, 4)
    o = _AllToAll.apply(o, group)                                        # (cp head groups, b, h/cp, t/cp, d)
    return o.permute(1, 0, 2, 3, 4).flatten(1, 2)


class _RouteAttention(torch.overrides.TorchFunctionMode):
    """While on, every F.scaled_dot_product_attention call, by any model, goes to
    context_parallel_attention over the group (see context_parallel)."""

    def __init__(self, group, method, layout, host_staging):
        super().__init__()
        self.group, self.method, self.layout, self.host_staging = group, method, layout, host_staging

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        return self.attend(*args, **(kwargs or {}))

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        why = ("an attn_mask (only causal or full attention splits over the ranks)" if attn_mask is not None else
               f"dropout_p {dropout_p} (attention dropout does not split over the ranks)" if dropout_p else
               f"{key.shape[1] if key.dim() == 4 else '?'} key/value heads for {query.shape[1]} query heads without "
               f"enable_gqa=True" if key.dim() == 4 and query.dim() == 4 and key.shape[1] != query.shape[1]
               and not enable_gqa else None)
        if why:   # every rank of the group gets here with the same call: all refuse, none waits
            raise ValueError(f"context_parallel: scaled_dot_product_attention with {why}")
        return context_parallel_attention(query, key, value, self.group, self.method, self.layout, self.host_staging,
                                          causal=is_causal, scale=scale)


@contextlib.contextmanager
def context_parallel(group=None, buffers=(), seq_dims=(), method="ring", layout="zigzag", host_staging=None):
    """Run any model's attention over a context-parallel group, in the manner of torch's
    experimental context_parallel: on entry each of ``buffers`` (tensors that do not
    require grad: tokens, targets, positions) is cut, in place, to this rank's part along
    its ``seq_dims`` entry by ``layout``; inside, every F.scaled_dot_product_attention
    call (causal or not, grouped-query with enable_gqa=True or with k/v repeated) runs as
    context_parallel_attention(method) over ``group``; on exit the buffers are whole again.

        positions = torch.arange(tokens.shape[1])      # zigzag hands each rank its true positions
        with context_parallel(cp_group, buffers=[tokens, targets, positions], seq_dims=[1, 1, 0]):
            loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), targets.flatten())
            loss.backward()
        ddp.finish_gradient_synchronization()          # the weights' gradients averaged over the group

    An attn_mask, attention dropout or shapes it cannot take raise one ValueError on every
    rank before any exchange, and the next call on the group works. Tokens that meet
    outside SDPA (a Mamba layer's scan, a convolution over the sequence) would meet only
    within a rank's part: token_mixers(model) lists them, for the caller to refuse.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{len(buffers)} buffers but {len(seq_dims)} seq_dims: one dimension each")
    if method not in ("ring", "allgather", "ulysses") or layout not in ("contiguous", "zigzag"):
        raise ValueError(f"method {method!r} (ring, allgather, ulysses) or layout {layout!r} (contiguous, zigzag)")
    if any(b.requires_grad for b in buffers):
        raise ValueError("context_parallel's buffers are cut in place: they must not require grad")
    parts = [shard_sequence(b, rank, cp, layout, d) for b, d in zip(buffers, seq_dims)]   # all checked first
    whole = [b.data for b in buffers]
    for b, part in zip(buffers, parts):
        b.data = part
    try:
        with _RouteAttention(group, method, layout, host_staging):
            yield
    finally:
        for b, w in zip(buffers, whole):
            b.data = w


def token_mixers(model) -> list:
    """What in ``model`` mixes tokens outside its attention, which context_parallel leaves
    to each rank's part of the sequence, wrong without the rest: the modules holding a
    Conv1d over the sequence (Mamba and Mamba-2 mixers, short convolutions, gated delta
    nets, recurrent blocks), and the layer types its config names that are no softmax
    attention (MiniMax's linear attention). [] for a model whose tokens meet in SDPA alone."""
    config = getattr(model, "config", None)
    kinds = {t for key in ("layer_types", "layers_block_type", "block_types") for t in getattr(config, key, None) or ()
             if isinstance(t, str) and any(w in t for w in ("linear", "recurrent", "conv", "mamba"))}
    return sorted({type(m).__name__ for m in model.modules() for c in m.children()
                   if isinstance(c, torch.nn.Conv1d)}) + [f"its {t!r} layers" for t in sorted(kinds)]


class _RoutedAttention:
    """A block's attention function run with its SDPA routed over the group (as inside
    context_parallel): also when a recomputation calls it again in backward."""

    def __init__(self, attention, group, method, layout):
        self.attention, self.route = attention, _RouteAttention(group, method, layout, None)

    def __call__(self, q, k, v):
        with self.route:
            return self.attention(q, k, v)


def context_parallel_lm(model, group=None, method="ring", layout="zigzag"):
    """The kit's TransformerLM (or 09's stages of it) over a context-parallel group, in
    place: every block's attention runs routed as under context_parallel, and the position
    embedding takes this rank's tokens' true positions. Feed each rank its part of every
    sequence (shard_sequence of the inputs and of the targets); the weights stay whole on
    every rank: average their gradients over the group (a DDP wrapper over it). A model of
    your own needs none of this: see context_parallel."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for block in model.blocks.values() if hasattr(model.blocks, "values") else model.blocks:
        block.attention = _RoutedAttention(block.attention, group, method, layout)
    if getattr(model, "pos", None) is not None:
        model.pos.register_forward_pre_hook(
            lambda mod, args: (positions(args[0].shape[-1], rank, cp, layout, args[0].device),))
    return model
# ---- end copy: context-parallel attention ----


METHODS = ("ring", "allgather", "ulysses")
LAYOUTS = ("contiguous", "zigzag")


def train_step(model, optimizer, batch, clock, dtype="float32"):
    """One step on this rank's part of every sequence of the batch, timed by phase: the
    attention's exchanges run inside forward and backward; the replicated weights'
    gradients are averaged over the group after. ``dtype`` bf16: the forward in bf16
    autocast (the attention then takes bf16 q, k, v: on a GPU the flash kernel)."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("forward"), common.autocast(x.device, dtype):   # per block: K/V around the ring,
        loss = model(x, y)                                             # gathered, or all-to-all'd
    with clock.phase("backward"):     # the same exchanges for the gradients
        loss.backward()
    with clock.phase("comm"):         # the weights' gradients averaged over the group
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


def runs(method, heads, cp) -> bool:
    """Ulysses splits the heads over the ranks: cp must divide them."""
    return method != "ulysses" or heads % cp == 0


# ----------------------------------------------------------------------------------------
# Verification: attention and LM training against one process
# ----------------------------------------------------------------------------------------
def verify_attention(ctx, args, methods, group=None, control=False):
    """Every method and layout, against one process's causal attention on the whole
    sequence: the output and the q, k, v gradients of this rank's part, at two sequence
    lengths (2cp and 6cp tokens) and with 3 and 4 heads (ulysses refuses 3 unless cp does
    divide it: checked to raise); the 4-head cases with a scale of 0.5, not head_dim ** -0.5
    (Gemma's). ``control``: shard by zig-zag but attend as if the parts were contiguous (the
    causal mask on the wrong positions): must fail."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for heads in (3, 4):
        for t in (2 * cp, 6 * cp):
            g = torch.Generator().manual_seed(args.seed + 7 * t + heads)
            q, k, v, dout = (torch.randn(2, heads, t, 8, generator=g).to(ctx.device) for _ in range(4))
            qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
            scale = 0.5 if heads == 4 else None
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
            ref.backward(dout)
            for layout in LAYOUTS:
                for method in methods:
                    name = f"{method}, {layout}, {heads} heads, {t} tokens"
                    if not runs(method, heads, cp):
                        try:
                            context_parallel_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], group, method, layout)
                            out[name + " (must refuse)"] = {"ok": False, "max_diff": float("inf")}
                        except ValueError:
                            out[name + " (refused: cp does not divide the heads)"] = {
                                "ok": True, "max_diff": 0.0, "skip": f"ulysses: cp {cp} does not divide {heads} heads "
                                                                     f"(its refusal checked)"}
                        continue
                    part = lambda x: shard_sequence(x, rank, cp, layout, dim=2)  # noqa: E731
                    mine = [part(x).clone().requires_grad_() for x in (q, k, v)]
                    o = context_parallel_attention(*mine, group=group, method=method,
                                                   layout="contiguous" if control else layout, scale=scale)
                    o.backward(part(dout))
                    got = [o] + [x.grad for x in mine]
                    want = [part(ref)] + [part(x.grad) for x in (qr, kr, vr)]
                    ok, diff = True, 0.0
                    for a, b in zip(got, want):
                        diff = max(diff, (a.detach().double() - b.detach().double()).abs().max().item())
                        ok = ok and torch.allclose(a.detach(), b.detach(), rtol=1e-4, atol=1e-5)
                    out[name] = {"ok": ok, "max_diff": diff}
    return gather_results(out, group)


def gather_results(results, group=None):
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, results, group=group)
    return {k: {**r, "ok": all(e[k]["ok"] for e in everyone), "max_diff": max(e[k]["max_diff"] for e in everyone)}
            for k, r in results.items()}


VERIFY_LM = (32, 64, 2, 4)   # d_model, d_ff, blocks, heads: 4 heads for ulysses at cp 2 and 4
VERIFY_T = 48                # its tokens by default (--context-length): divides 2cp for cp = 2, 3, 4 and 6


def verify_lm(ctx, args, methods, group=None):
    """The LM trained with each method and layout (DDPBucketed averaging the replicated
    weights' gradients over the group) against one process on the whole sequences: every
    weight after a few AdamW steps."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for layout in LAYOUTS:
        for method in methods:
            if not runs(method, VERIFY_LM[3], cp):
                out[f"LM, {method}, {layout}"] = {"ok": True, "max_diff": 0.0, "skip": f"ulysses: cp {cp} does not "
                                                  f"divide the verification LM's {VERIFY_LM[3]} heads"}
                continue
            torch.manual_seed(args.seed)
            ref = common.TransformerLM(*VERIFY_LM, context_length=args.context_length).to(ctx.device)
            model = bucketed.DDPBucketed(context_parallel_lm(copy.deepcopy(ref), group, method, layout), 1,
                                         process_group=group)
            # eps 1e-6 as in 08 and 09: the split sums round differently, AdamW must not magnify it
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for m in (ref, model)]
            for step in range(args.verify_steps):
                x, y = common.lm_batch(2, args.context_length, step, args.seed, ctx.device)
                opts[0].zero_grad()
                ref(x, y).backward()
                opts[0].step()
                part = tuple(shard_sequence(t, rank, cp, layout) for t in (x, y))
                train_step(model, opts[1], part, common.StepClock(ctx.device))
            ok = common.params_close(model.module, ref)
            out[f"LM, {method}, {layout}"] = {"ok": ok, "max_diff": common.max_param_diff(model.module, ref)}
    return gather_results(out, group)


def verify_bf16(ctx, args, methods, group=None, steps=6):
    """--dtype bf16. The attention in bf16 (what autocast hands it): each method and layout,
    its output and q, k, v gradients against one process in float64, within twice the error
    of one process's own SDPA in bf16 (+1e-3), at 2cp, 6cp and 64cp tokens. Then the LM
    under bf16 autocast with each method (zig-zag) against one process under the same
    autocast (common.TOLERANCE["autocast"]; SGD with momentum, as 05: AdamW's division by sqrt(v) turns
    bf16's rounding of near-zero gradients into steps of lr either way), and each step's loss
    (the group's mean) within common.BF16_LOSS_BOUND of one float32 process's."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    out, bf16 = {}, torch.bfloat16
    for t in (2 * cp, 6 * cp, 64 * cp):
        g = torch.Generator().manual_seed(args.seed + t)
        q, k, v, dout = (torch.randn(2, 4, t, 8, generator=g).to(ctx.device) for _ in range(4))

        def run(inputs, grad, dtype, attend):
            xs = [x.to(dtype).clone().requires_grad_() for x in inputs]
            o = attend(*xs)
            o.backward(grad.to(dtype))
            return [o.detach().double()] + [x.grad.double() for x in xs]
        sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
        exact, one = (run((q, k, v), dout, dt, sdpa) for dt in (torch.float64, bf16))
        for layout in LAYOUTS:
            part = lambda x: shard_sequence(x, rank, cp, layout, dim=2)  # noqa: E731
            own = max((part(a) - part(b)).abs().max().item() for a, b in zip(one, exact))
            for method in [m for m in methods if runs(m, 4, cp)]:
                got = run([part(x) for x in (q, k, v)], part(dout), bf16,
                          lambda a, b, c: context_parallel_attention(a, b, c, group, method, layout))
                err = max((a - part(b)).abs().max().item() for a, b in zip(got, exact))
                out[f"bf16 attention, {method}, {layout}, {t} tokens (error within 2 x one process's bf16 "
                    f"error + 1e-3)"] = {"ok": err <= 2 * own + 1e-3, "max_diff": err}
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    batches = [common.lm_batch(2, args.context_length, i, args.seed, ctx.device) for i in range(steps)]
    for method in [m for m in methods if runs(m, VERIFY_LM[3], cp)]:
        torch.manual_seed(args.seed)
        ref = common.TransformerLM(*VERIFY_LM, context_length=args.context_length).to(ctx.device)
        models = {"bf16": copy.deepcopy(ref), "fp32": copy.deepcopy(ref),
                  "cp": bucketed.DDPBucketed(context_parallel_lm(copy.deepcopy(ref), group, method), 1,
                                             process_group=group)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
        gap = 0.0
        for x, y in batches:
            for key in ("bf16", "fp32"):
                opts[key].zero_grad()
                with common.autocast(ctx.device, "bf16" if key == "bf16" else "float32"):
                    loss = models[key](x, y)
                loss.backward()
                opts[key].step()
                fp32_loss = loss.item() if key == "fp32" else None
            opts["cp"].zero_grad()
            with common.autocast(ctx.device, "bf16"):
                mine = models["cp"](*(shard_sequence(v, rank, cp) for v in (x, y)))
            mine.backward()
            models["cp"].finish_gradient_synchronization()
            opts["cp"].step()
            mine = mine.detach().clone()
            dist.all_reduce(mine, group=group)
            gap = max(gap, abs(mine.item() / cp - fp32_loss))
        ok = all(torch.allclose(a, b, **common.TOLERANCE["autocast"]) for a, b in
                 zip(models["cp"].module.parameters(), models["bf16"].parameters()))
        out[f"LM, {method}, bf16 autocast, against one process under it (rtol {common.TOLERANCE['autocast']['rtol']}, "
            f"atol {common.TOLERANCE['autocast']['atol']})"] = {"ok": ok, "max_diff": common.max_param_diff(models["cp"].module,
                                                                                             models["bf16"])}
        out[f"LM, {method}, bf16 autocast, each of {steps} losses within {common.BF16_LOSS_BOUND} of float32's"] = \
            {"ok": gap <= common.BF16_LOSS_BOUND, "max_diff": gap}
    return gather_results(out, group)


def verify(ctx, args, methods):
    results = {**verify_attention(ctx, args, methods), **verify_lm(ctx, args, methods)}
    if getattr(args, "dtype", "float32") == "bf16":
        results.update(verify_bf16(ctx, args, methods))
    return results


# ----------------------------------------------------------------------------------------
# Benchmark: time and tokens/s beside one process, memory, bytes, balance, a ring timeline
# ----------------------------------------------------------------------------------------
def bench_lm(ctx, args, t, method=None, layout="zigzag"):
    """The benchmark LM at context ``t`` with this rank's part (method None: the whole
    sequence on each rank, one process's work), its optimizer, and its step."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    model = common.build_lm(args.model_size, t, ctx.device, args.seed)
    if method is not None:
        model = bucketed.DDPBucketed(context_parallel_lm(model, None, method, layout), 25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch, clock):
        part = batch if method is None else tuple(shard_sequence(x, ctx.rank, ctx.world_size, layout) for x in batch)
        train_step(model, opt, part, clock, getattr(args, "dtype", "float32"))
    return step


def torch_cp_skip(backend, device) -> str | None:
    """Why torch's context_parallel cannot run on this setting (None: it can): its SDPA has
    a sharding rule on CUDA only, and over gloo with CUDA tensors its ring crashes the
    process (a segmentation fault inside torch, seen on an H200 with torch 2.11) instead of
    raising, so it runs under NCCL only, one GPU per rank."""
    if device != "cuda":
        return "its SDPA has no CPU sharding rule (CUDA only)"
    if backend != "nccl":
        return ("over gloo with CUDA tensors its ring crashes the process (segmentation fault, seen with torch "
                "2.11); it needs NCCL, one GPU per rank")
    return None


def torch_context_parallel(ctx, args, t):
    """torch's own context parallelism on the same LM, as its docs run it: a device mesh over
    the ranks, torch DDP averaging the gradients over it, and each step inside
    torch.distributed.tensor.experimental.context_parallel, which shards the batch's
    buffers (tokens, targets, positions) along the sequence with its load-balancing layout
    and turns SDPA into its ring attention. Its SDPA has no CPU sharding rule: CUDA only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cuda", (ctx.world_size,))
    model = torch.nn.parallel.DistributedDataParallel(common.build_lm(args.model_size, t, ctx.device, args.seed))
    holder = {}
    model.module.pos.register_forward_pre_hook(lambda mod, a: (holder["positions"][0],))   # the shard's true positions
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch, clock):
        x, y = (b.clone() for b in batch)
        holder["positions"] = torch.arange(t, device=x.device)[None].clone()
        opt.zero_grad(set_to_none=True)
        with context_parallel(mesh, buffers=[x, y, holder["positions"]], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={x, y, holder["positions"]}):
            with clock.phase("forward"), common.autocast(x.device, getattr(args, "dtype", "float32")):
                loss = model(x, y)
            with clock.phase("backward"):
                loss.backward()
        with clock.phase("comm"):
            pass                       # DDP waited inside backward
        with clock.phase("optim"):
            opt.step()
    return step


def benchmark(ctx, args, methods, seq_lens):
    """At each sequence length: one process, each method, and on a GPU torch's
    context_parallel, steps alternating."""
    cp, rows = ctx.world_size, []
    heads = common.MODEL_SIZES[args.model_size][3]
    for t in seq_lens:
        timing = argparse.Namespace(**{**vars(args), "context_length": t})
        cases = {"one process (whole sequence)": lambda t=t: bench_lm(ctx, args, t)}
        cases.update({f"{m} (cp {cp})": lambda t=t, m=m: bench_lm(ctx, args, t, m) for m in methods if runs(m, heads, cp)})
        if torch_cp_skip(ctx.backend, ctx.device.type) is None:
            cases[f"torch context_parallel (cp {cp})"] = lambda t=t: torch_context_parallel(ctx, args, t)
        got = common.time_methods(ctx, timing, cases, global_batch=True)
        for r in got:
            r.update(seq_len=t, cp=1 if r["method"].startswith("one") else cp,
                     tokens_per_s_per_rank=args.batch_size * t / (r["step_ms"] / 1e3) / (1 if r["method"].startswith("one") else cp))
            r["vs_one_process"] = r["step_ms"] / got[0]["step_ms"]
        rows += got
    return rows


def attention_bytes(method, cp, block, recomputed=False) -> float:
    """Bytes a rank sends for one attention forward and backward, in closed form, for
    ``block`` bytes of this rank's K (or V, q, out). ring: K and V forward to the next rank
    cp-1 times, again in backward, and their gradients (float32) cp times around the circle;
    allgather: (cp-1)/cp of the gathered K and V, in forward and again in backward, and
    their gradients (float32) reduce-scattered; ulysses: (cp-1)/cp of q, k, v and out
    through all-to-all, and of their gradients. ``recomputed``: the forward runs again in
    backward (activation recomputation), its exchange with it."""
    forward = (cp - 1) * 2 * block if method in ("ring", "allgather") else (cp - 1) / cp * block * 4
    again = forward if recomputed else 0.0
    if method == "ring":
        return (cp - 1) * 2 * block * 2 + cp * 2 * block + again
    if method == "allgather":
        return 3 * (cp - 1) * 2 * block + again
    return (cp - 1) / cp * block * 8 + again


def saved_bytes(cp, b, h, t, d) -> float:
    """Bytes one attention saves for backward per rank (float32), in closed form: ring and
    allgather q, k, v, out and the log-sum-exp of its t/cp tokens (allgather gathers K and
    V again in backward rather than keep them); ulysses q, k, v, out and the log-sum-exp of
    the whole sequence for h/cp heads; one process all of it whole."""
    n, f = b * h * t * d * 4, b * h * t * 4
    return (4 * n + f) / cp


def in_flight_bytes(method, cp, block) -> float:
    """What a rank holds at its peak beyond its share of one process's attention, in
    closed form, for ``block`` bytes of its K (float32). ring, in a backward step: the K/V
    block attended and the next one arriving (4 blocks); the block's dK/dV, the accumulator
    sent and the one arriving (6); dq's block (1); and one block allowed for the fused
    kernel's working memory: 12. allgather: every rank's K and V (2cp blocks) and in
    backward their float32 gradients (2cp), with 3 for the running output and the kernel.
    ulysses: the all-to-all's buffers of q, k, v and out on both sides (8)."""
    return {"ring": 12 * block, "allgather": (4 * cp + 3) * block, "ulysses": 8 * block}[method]


def attention_memory(ctx, args, methods, seq_lens):
    """For each sequence length, one attention forward and backward (one sequence, the
    model's heads): the bytes saved for backward (counted as autograd saves them) and the
    peak of live tensor bytes (07's StepPeak), per rank, beside the formula and the bound:
    the rank's share of one process's measured peak plus what the method holds in flight
    (in_flight_bytes). The share is one process's peak / cp for the ring and all-gather (a
    rank attends with t/cp queries); for Ulysses, one process's peak on the h/cp heads the
    rank attends with, measured (the whole sequence: the fused kernel's working memory is
    per query tile and thread, not per head, so it does not fall with cp). The bytes sent,
    counted, beside the formula."""
    d_model, _, _, h = common.MODEL_SIZES[args.model_size]
    d, cp, rows = d_model // h, ctx.world_size, []
    for t in seq_lens:
        one = one_attention(ctx, t, h, d, "one process")
        rows.append({**one, "peak_bound_MB": one["peak_MB"]})
        share = {"ring": one["peak_MB"] / cp, "allgather": one["peak_MB"] / cp}
        if "ulysses" in methods and runs("ulysses", h, cp):
            share["ulysses"] = one_attention(ctx, t, h // cp, d, "one process")["peak_MB"]
        for method in (m for m in methods if runs(m, h, cp)):
            r = one_attention(ctx, t, h, d, method)
            block = h * (t // cp) * d * 4
            rows.append({**r, "peak_bound_MB": share[method] + in_flight_bytes(method, cp, block) / 1e6})
    return rows


def _attention_inputs(ctx, t, h, d, method, dtype="float32"):
    """q, k, v (needing gradients) and the output's gradient for one sequence of t tokens, in
    ``dtype`` (bf16: what autocast hands the attention): whole for "one process", else this
    rank's zig-zag part."""
    g = torch.Generator().manual_seed(t)
    dt = common.DTYPES[dtype] or torch.float32
    q, k, v, dout = (torch.randn(1, h, t, d, generator=g).to(ctx.device, dt) for _ in range(4))
    if method != "one process":
        q, k, v, dout = (shard_sequence(x, ctx.rank, ctx.world_size, "zigzag", dim=2) for x in (q, k, v, dout))
    return [x.requires_grad_() for x in (q, k, v)] + [dout]


def _attention(q, k, v, method):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) if method == "one process" \
        else context_parallel_attention(q, k, v, None, method, "zigzag")


def one_attention(ctx, t, h, d, method, dtype="float32"):
    """attention_memory's row for one method and length (every rank's maximum), and the
    kernel that ran; the tensors live in this function only, so none is freed inside the
    next one's count."""
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")
    cp = ctx.world_size
    with fsdp.StepPeak(ctx.device) as mem, common.count_collectives() as c:   # first: every free counted
        q, k, v, dout = _attention_inputs(ctx, t, h, d, method, dtype)
        with mem.step():
            with common.saved_for_backward() as saved:
                o = _attention(q, k, v, method)
            o.backward(dout)
    sent = common.sent_bytes(c.log)
    block = q.numel() * q.element_size()
    row = {"seq_len": t, "method": method, "cp": 1 if method == "one process" else cp,
           "saved_MB": saved.bytes / 1e6, "saved_formula_MB": saved_bytes(
               1 if method == "one process" else cp, 1, h, t, d) / 1e6,
           "peak_MB": mem.peak / 1e6, "sent_MB": sent / 1e6,
           "sent_formula_MB": 0.0 if method == "one process" else attention_bytes(method, cp, block) / 1e6,
           "kernel": ", ".join(sorted(c.kernels)) or "math (tiles)"}
    everyone = [None] * cp
    dist.all_gather_object(everyone, row)
    return {**row, **{k: max(e[k] for e in everyone) for k in ("saved_MB", "peak_MB", "sent_MB")}}


def sweep_job(ctx, args, methods, lens):
    """sweep()'s rows for this job's cp (one process at cp 1): at each length, one
    attention's forward and backward, its time (median of --steps after --warmup, the
    slowest rank's) and its peak of live bytes per rank."""
    d_model, _, _, h = common.MODEL_SIZES[args.model_size]
    d, cp, rows = d_model // h, ctx.world_size, []
    for t in lens:
        for method in ("one process",) if cp == 1 else [m for m in methods if runs(m, h, cp)]:
            row = one_attention(ctx, t, h, d, method, getattr(args, "dtype", "float32"))
            q, k, v, dout = _attention_inputs(ctx, t, h, d, method, getattr(args, "dtype", "float32"))

            def once():
                _attention(q, k, v, method).backward(dout)
                q.grad = k.grad = v.grad = None
            rows.append({"seq_len": t, "method": method, "cp": cp, "attention_ms": _slowest_median_ms(ctx, args, once),
                         "peak_MB": row["peak_MB"], "saved_MB": row["saved_MB"], "kernel": row["kernel"]})
    return rows


def _slowest_median_ms(ctx, args, fn) -> float:
    """The median of --steps calls of ``fn`` after --warmup (the ranks starting each
    together), in ms, the slowest rank's."""
    times = [common.time_call(ctx.device, fn) for _ in range(args.warmup + args.steps)]
    ms = torch.tensor([statistics.median(times[args.warmup:]) * 1e3], device=ctx.device)   # NCCL: on the device
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def torch_sweep_job(ctx, args, lens):
    """On a GPU, sweep_job's rows for torch's context_parallel at this job's cp: one causal
    SDPA forward and backward inside its context manager, which shards q, k, v and the
    output's gradient along the sequence (its load-balanced layout) and runs SDPA as its
    ring attention (its SDPA has no CPU sharding rule). The peak is StepPeak's over one
    call; saved bytes are not counted (None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    fsdp = common.load_script(common.ROOT / "07_fsdp.py")
    d_model, _, _, h = common.MODEL_SIZES[args.model_size]
    d, cp, rows = d_model // h, ctx.world_size, []
    mesh = init_device_mesh(ctx.device.type, (cp,))
    for t in lens:
        g = torch.Generator().manual_seed(t)
        dt = common.DTYPES[getattr(args, "dtype", "float32")] or torch.float32
        q, k, v, dout = (torch.randn(1, h, t, d, generator=g).to(ctx.device, dt) for _ in range(4))
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2] * 4,
                              no_restore_buffers={q, k, v, dout}):   # each now this rank's shard

            def once():
                a, b, c = (x.detach().requires_grad_() for x in (q, k, v))
                F.scaled_dot_product_attention(a, b, c, is_causal=True).backward(dout)
            with fsdp.StepPeak(ctx.device) as mem, common.count_collectives() as seen:
                with mem.step():
                    once()
            ms = _slowest_median_ms(ctx, args, once)
        peak = torch.tensor([mem.peak / 1e6], device=ctx.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append({"seq_len": t, "method": "torch context_parallel", "cp": cp, "attention_ms": ms,
                     "peak_MB": peak.item(), "saved_MB": None, "kernel": ", ".join(sorted(seen.kernels))})
    return rows


def sweep(args, methods):
    """--sweep: one process, then every method at each cp of --sweep-cps (on a GPU torch's
    context_parallel too), across --sweep-lens; the peak beside one process's / cp.
    Returns the rows (rank 0's)."""
    skip = torch_cp_skip(args.backend, args.device)
    if skip and common.is_reporter():
        print(f"sweep: SKIP torch context_parallel: {skip}")
    rows = common.launch(sweep_job, args, methods, args.sweep_lens, world_size=1)
    one = {r["seq_len"]: r for r in rows}
    for cp in args.sweep_cps:
        jobs = [(sweep_job, (args, methods, args.sweep_lens))]
        if skip is None:
            jobs.append((torch_sweep_job, (args, args.sweep_lens)))
        for job, job_args in jobs:
            got = common.launch(job, *job_args, world_size=cp)
            for r in got:
                base = one[r["seq_len"]]
                r.update(vs_one_process=r["attention_ms"] / base["attention_ms"],
                         peak_x_cp_vs_one=r["peak_MB"] * cp / base["peak_MB"])
            rows += got
            if common.is_reporter():   # rewritten after each job: a run cut short keeps what it measured
                save_sweep(args, rows)
    return rows


SWEEP_HEADERS = ["seq_len", "method", "cp", "attention_ms", "vs_one_process", "peak_MB", "peak_x_cp_vs_one", "saved_MB",
                 "kernel"]


def save_sweep(args, rows):
    skip = torch_cp_skip(args.backend, args.device)
    settings = {**common.lm_settings(args), "sweep_cps": args.sweep_cps,
                "skipped": {"torch context_parallel": skip} if skip else {}}
    table = common.save_results(args.out, "11_sweep", rows, settings, headers=SWEEP_HEADERS,
                                title="One attention forward and backward across sequence lengths",
                                note="attention_ms: the slowest rank's, median of the steps; peak_MB: live tensor "
                                     "bytes per rank; peak_x_cp_vs_one: the peak times cp over one process's (1: "
                                     "memory falls as 1/cp)" + (f"\n\nSKIP torch context_parallel: {skip}" if skip
                                                                else ""))
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for key in dict.fromkeys((r["method"], r["cp"]) for r in rows):
        mine = [r for r in rows if (r["method"], r["cp"]) == key]
        label = key[0] if key[1] == 1 else f"{key[0]} (cp {key[1]})"
        style = "k-" if key[1] == 1 else ("-" if key[1] == min(args.sweep_cps) else "--")
        for ax, col in zip(axes, ("attention_ms", "peak_MB")):
            ax.plot([r["seq_len"] for r in mine], [r[col] for r in mine], style, marker="o", label=label)
    for ax, what in zip(axes, ("forward + backward, ms (slowest rank)", "peak live MB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"One causal attention ({args.model_size}'s heads, {args.backend}/{args.device})")
    common.save_figure(fig, f"{args.out}/11_sweep.png")
    return table


def balance(ctx, args, t):
    """Each rank's time in the ring's attention blocks (forward and backward, one
    sequence), contiguous against zig-zag: the causal mask gives the last contiguous part
    cp times the first's work, the zig-zag parts the same."""
    d_model, _, _, h = common.MODEL_SIZES[args.model_size]
    cp, out = ctx.world_size, {}
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, h, t, d_model // h, generator=g).to(ctx.device) for _ in range(4)]
    for layout in LAYOUTS:
        times = []
        for _ in range(5):
            q, k, v, dout = (shard_sequence(x, ctx.rank, cp, layout, dim=2) for x in whole)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            trace = []
            context_parallel_attention(q, k, v, None, "ring", layout, trace=trace).backward(dout)
            times.append(sum(b - a for kind, a, b in trace if kind == "compute"))
        everyone = [None] * cp
        dist.all_gather_object(everyone, sorted(times)[2])
        out[layout] = everyone
    return out


def ring_timeline(ctx, args, t):
    """One ring attention forward, every rank's compute and waits on a clock shared after a
    barrier."""
    d_model, _, _, h = common.MODEL_SIZES[args.model_size]
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, h, t, d_model // h, generator=g), ctx.rank, ctx.world_size, "zigzag",
                              dim=2).to(ctx.device) for _ in range(3))
    for _ in range(3):   # the last is drawn
        trace = []
        dist.barrier()
        t0 = time.perf_counter()
        context_parallel_attention(q, k, v, None, "ring", "zigzag", trace=trace)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, [(kind, a - t0, b - t0) for kind, a, b in trace])
    return everyone


def draw_timeline(lanes, title, path):
    """Each rank's ring attention forward: a block's attention, or waiting for the next."""
    colors = {"compute": "#4c72b0", "wait": "#c44e52"}
    common.draw_lanes(path, title, [(f"rank {r}", [{"start": a * 1e3, "end": b * 1e3, "color": colors[kind]}
                                                   for kind, a, b in spans]) for r, spans in enumerate(lanes)],
                      "ms into the attention's forward: blue, a block's attention (the next block's transfer "
                      "running meanwhile); red, waiting for it", colors, row=0.5)


def measure(ctx, args, methods, seq_lens):
    """Everything beside the timing, in one job: memory and bytes, balance, the timeline."""
    return attention_memory(ctx, args, methods, args.memory_lens), balance(ctx, args, max(seq_lens)), \
        ring_timeline(ctx, args, max(seq_lens))


HEADERS = ["method", "seq_len", "cp", "step_ms", "step_min_ms", "step_max_ms", "vs_one_process",
           "tokens_per_s_per_rank", "comm_ms", "collectives", "comm_MB", "kernels"]
MEMORY_HEADERS = ["seq_len", "method", "cp", "saved_MB", "saved_formula_MB", "peak_MB", "peak_bound_MB", "sent_MB",
                  "sent_formula_MB"]
NAME, TITLE = "11_context_parallel", "Context parallelism: step time beside one process"


def parser():
    """11's flags: cp, the methods, the lengths timed and measured, --sweep, --dtype."""
    p = common.script_parser(__doc__, cpu_size="micro", gpu_size="small", world="--cp")
    p.add_argument("--cp", type=common.COUNT, default=None,
                   help="ranks that share one sequence (default: --world-size, else 2; under torchrun, its world)")
    p.add_argument("--method", nargs="+", choices=METHODS, default=None,
                   help="the methods to verify and time (default: all; ulysses where cp divides the heads)")
    p.add_argument("--seq-lens", nargs="+", type=common.COUNT, default=[512, 2048],
                   help="sequence lengths to time")
    p.add_argument("--memory-lens", nargs="+", type=common.COUNT, default=[256, 1024, 4096, 16384],
                   help="sequence lengths of the memory table (one attention)")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the timing tables: one attention's forward and backward across --sweep-lens, "
                        "one process beside every method at each of --sweep-cps, on a GPU torch's context_parallel "
                        "too (time and peak memory, a table and a plot: 11_sweep.*)")
    p.add_argument("--sweep-lens", nargs="+", type=common.COUNT, default=[1024, 2048, 4096, 8192, 16384, 32768],
                   help="sequence lengths of --sweep")
    p.add_argument("--sweep-cps", nargs="+", type=common.number(int, 2), default=[2, 4], help="cps of --sweep")
    common.add_dtype_flag(p)   # bf16: the LM in autocast, the attention on bf16 q, k, v (a GPU's flash kernel)
    p.set_defaults(batch_size=1, context_length=VERIFY_T)
    common.set_help(p, "context_length", "tokens a sequence of the verification LM (the benchmark's: --seq-lens)")
    return p


def checked_args(p, argv):
    """The flags parsed and checked before any worker starts: (args, methods, heads)."""
    first = p.parse_args(argv)
    if common.under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if first.cp not in (None, world):
            raise common.UsageError(f"--cp {first.cp} but torchrun started {world} processes: every rank shares the "
                                    f"sequence, so give --nproc-per-node {first.cp} or leave --cp out")
    elif None not in (first.cp, first.world_size) and first.cp != first.world_size:
        raise common.UsageError(f"--cp {first.cp} and --world-size {first.world_size}: every rank shares the sequence, "
                                f"so the world is cp; give one of them")
    args = common.parse(p, argv, world=lambda a: a.cp or a.world_size or 2, batch_unit=lambda a: None,
                        world_flag="--cp" if first.cp else "--world-size")
    cp = args.world_size
    heads = common.MODEL_SIZES[args.model_size][3]
    methods = list(dict.fromkeys(args.method or METHODS))
    if args.method and "ulysses" in methods and not args.no_bench and heads % cp:   # asked to time it
        raise common.UsageError(f"ulysses splits the heads over the ranks: cp {cp} does not divide the {heads} heads "
                                f"of {args.model_size}: use a --cp that does, or leave ulysses out")
    t = args.context_length
    if not args.no_verify and t % (2 * cp):
        fits = [c for c in range(2, common.max_ranks(args.backend) + 1) if t % (2 * c) == 0]
        raise common.UsageError(f"cp {cp} cuts a sequence into 2 x {cp} = {2 * cp} chunks (the zig-zag layout): the "
                                f"verification LM's {t} tokens do not; use --cp {' or '.join(map(str, fits[:4])) or 1}, "
                                f"or --context-length {-(-t // (2 * cp)) * 2 * cp}")
    for n in args.seq_lens + args.memory_lens if not args.no_bench and not args.sweep else []:
        if n % (2 * cp):
            raise common.UsageError(f"a sequence of {n} tokens (--seq-lens/--memory-lens) does not cut into the "
                                    f"2 x {cp} chunks of the zig-zag layout: use a multiple of {2 * cp}")
    if args.sweep and not args.no_bench:
        for c in args.sweep_cps:
            common.check_ranks(c, args.backend, "--sweep-cps")
            bad = [n for n in args.sweep_lens if n % (2 * c)]
            if bad:
                raise common.UsageError(f"--sweep-lens {bad[0]} does not cut into the 2 x {c} chunks of the zig-zag "
                                        f"layout at cp {c} (--sweep-cps): use multiples of "
                                        f"{2 * math.lcm(*args.sweep_cps)}")
    return args, methods, heads


def print_skips(args, methods, heads) -> str | None:
    """The SKIP lines of what this setting cannot run; returns why torch's context_parallel
    is left out (None: it runs)."""
    cp = args.world_size
    if common.is_reporter() and not all(runs(m, heads, cp) for m in methods):
        print(f"benchmark: SKIP ulysses (cp {cp} does not divide {args.model_size}'s {heads} heads)")
    cp_skip = torch_cp_skip(args.backend, args.device)   # the baseline left out where it cannot run
    if common.is_reporter() and cp_skip:
        print(f"benchmark: SKIP torch context_parallel: {cp_skip}")
    return cp_skip


def run_sweep(args, methods):
    """--sweep: one attention from --sweep-lens, every method at each of --sweep-cps."""
    rows = sweep(args, methods)
    if common.is_reporter():
        print(f"\nOne causal attention, forward and backward ({args.model_size}'s heads, {args.dtype}; ms, the "
              f"slowest rank's median of {args.steps}; peak live MB per rank)\n{save_sweep(args, rows)}\n"
              f"{common.wrote(args.out, '11_sweep.{json,md,png}')}")


def run_benchmark(args, methods, cp_skip):
    """The LM's step at each of --seq-lens, every method beside one process (and torch's
    context_parallel where it runs)."""
    cp = args.world_size
    rows = common.launch(benchmark, args, methods, args.seq_lens)
    if common.is_reporter():
        settings = {**common.lm_settings(args), "seq_lens": args.seq_lens, "cp": cp,
                    "skipped": {"torch context_parallel": cp_skip} if cp_skip else {}}
        table = common.save_results(args.out, NAME, rows, settings, headers=HEADERS, title=TITLE,
                                    note=f"SKIP torch context_parallel: {cp_skip}" if cp_skip else "")
        print(f"\n{TITLE}\n({args.model_size} LM, {args.dtype}, {args.backend}/{args.device}, {args.batch_size} "
              f"sequence(s) a step, zig-zag layout; times in ms, median [min, max] of {args.steps} steps; torch's context_parallel: "
              f"{'SKIP, ' + cp_skip if cp_skip else 'beside ours'})\n{table}")


def run_measurements(args, methods):
    """One attention's memory and bytes beside the formulas, each rank's ring time by
    layout, and one ring forward drawn."""
    cp = args.world_size
    memory, spread, lanes = common.launch(measure, args, methods, args.seq_lens)
    if common.is_reporter():
        settings = {**common.lm_settings(args), "cp": cp}
        t2 = common.save_results(args.out, "11_memory", memory, settings, headers=MEMORY_HEADERS,
                                 title="One attention's memory and bytes per rank, beside the formulas",
                                 note="\n\n".join(f.__doc__.replace("\n    ", " ") for f in (
                                     saved_bytes, attention_memory, in_flight_bytes, attention_bytes)))
        t = max(args.seq_lens)
        rows3 = [{"layout": layout, "seq_len": t, **{f"rank_{r}_ms": ms * 1e3 for r, ms in enumerate(times)},
                  "max_over_mean": max(times) / (sum(times) / len(times))} for layout, times in spread.items()]
        t3 = common.save_results(args.out, "11_balance", rows3, settings,
                                 title="Ring attention: each rank's time in attention blocks, by layout")
        print(f"\nOne attention per rank (zig-zag; MB): saved for backward, peak of live tensors, sent\n{t2}\n\n"
              f"Each rank's ring attention time (forward and backward, {t} tokens), contiguous and zig-zag\n{t3}")
        path = f"{args.out}/11_timeline.png"
        draw_timeline(lanes, f"One ring attention forward: cp {cp}, {t} tokens ({args.model_size}'s heads, "
                             f"{args.backend}/{args.device})", path)
        print(common.wrote(args.out, f"{NAME}.*, 11_memory.*, 11_balance.*, {os.path.basename(path)}"))


def main(argv=None):
    args, methods, heads = checked_args(parser(), argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args, methods), f"{NAME} at cp {args.world_size}")
    if args.no_bench:
        return
    cp_skip = print_skips(args, methods, heads)
    if args.sweep:
        return run_sweep(args, methods)
    run_benchmark(args, methods, cp_skip)
    run_measurements(args, methods)


if __name__ == "__main__":
    common.run_main(main)
