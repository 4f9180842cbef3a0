"""Collectives benchmark: how long one collective of float32 data takes, by operation,
backend and device (gloo on CPU, NCCL on GPU, gloo on GPU), data size and number of
processes; and all-reduce built from scratch, around a ring and up and down a tree.

Run:
    python 01_allreduce_bench.py                              # all-reduce, the whole grid this machine can run
    python 01_allreduce_bench.py --configs gloo-cpu --world-sizes 2 --sizes-mb 1 10
    python 01_allreduce_bench.py --ops all                    # every op below, 1 KB to 100 MB
    python 01_allreduce_bench.py --ops ring_all_reduce tree_all_reduce all_reduce --world-sizes 2 3 4 6
    torchrun --nproc-per-node 2 01_allreduce_bench.py --configs nccl-cuda

Ops (--ops; `all` = every one): all_reduce (the default), broadcast and reduce (rank 0 the
root), all_gather, reduce_scatter, all_to_all, ping_pong (ranks paired 0-1, 2-3, ...: one
sends, the other sends it back; with an odd world size the last rank sits out; the time is
half the round trip), ring_all_reduce and tree_all_reduce (ours, from scratch, on
isend/irecv), all_reduce_2_groups (the world split into two halves by new_group, both
all-reducing at once; even world sizes of 4 or more).

Each (backend, device, ranks) configuration is one job: for every op and size the result
is checked first (known values in, known values out, compared exactly), then, after a
warm-up, at least --iters calls are timed (the device synchronized around each), taking
per iteration the slowest rank's time. Before timing the from-scratch all-reduces, each
is compared with dist.all_reduce on random integer tensors (exactly) and float tensors (at
tolerance), at sizes that do not divide by the rank count, on the world and on a subgroup.

Sizes are decimal (1 MB = 10^6 bytes) and follow nccl-tests: the size is the whole buffer
(all_gather: the gathered output; reduce_scatter: the input; all_to_all: each rank's
send buffer), rounded down to a multiple of the rank count where the op splits it.
algbw = bytes / time and busbw = algbw x the op's bus factor, in GB/s (10^9 bytes/s):
all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast, reduce
and ping-pong 1. With both from-scratch all-reduces timed, the alpha-beta model of each
(time = alpha x latency steps + bytes / beta) is fitted and the size where the ring
overtakes the tree is given per rank count.

Writes <out>/01_allreduce.{json,md}, _time.png, _busbw.png when only all_reduce runs,
else <out>/01_collectives.* (plus _summary.{json,md}, one row per op and rank count,
and _ring_tree.png), rewritten after every configuration so that a killed run keeps what
it measured.
"""

import os
import time

import torch
import torch.distributed as dist

import common

# ---- begin copy: point-to-point (ring and tree all-reduce, ping-pong; needs only torch and the standard library) ----
import torch
import torch.distributed as dist


def host_staged(tensor: torch.Tensor, group=None, host_staging=None) -> bool:
    """Whether point-to-point on ``group`` must go through host memory: gloo's collectives
    take GPU tensors but its send/recv only CPU ones. ``host_staging`` True or False forces
    the answer (None: gloo with a tensor off the CPU); NCCL and CPU tensors go directly."""
    if host_staging is not None:
        return host_staging
    return tensor.device.type != "cpu" and dist.get_backend(group) == "gloo"


def ring_all_reduce(tensor: torch.Tensor, group=None, host_staging=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` (default: every rank) in place, around a
    ring, as NCCL's ring algorithm does: the tensor is cut into n chunks; in n-1
    reduce-scatter steps each rank sends one chunk to its right neighbour and adds the chunk
    arriving from its left, after which rank r holds the full sum of chunk r+1; n-1
    all-gather steps then pass the finished chunks around. Every rank sends 2(n-1)/n of
    the tensor in 2(n-1) steps, whatever n is. Any size (chunks may be uneven or empty),
    any dtype that adds; call it on every rank of the group with the same shape. Staged
    through host memory (see host_staged), it runs on a host copy and copies the sum back."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor")
    if n == 1:
        return tensor
    if host_staged(tensor, group, host_staging):
        return tensor.copy_(ring_all_reduce(tensor.to("cpu", copy=True), group, host_staging=False))
    right, left = _peer(group, r + 1), _peer(group, r - 1)
    chunks = tensor.view(-1).tensor_split(n)          # the first ones are the larger
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):   # reduce-scatter: after step s, chunk r-s-1 holds s+2 ranks' sum
        mine, theirs = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        _exchange(mine, right, incoming[:theirs.numel()], left, group)
        theirs.add_(incoming[:theirs.numel()])
    for s in range(n - 1):   # all-gather: the chunk finished at the previous step moves on
        _exchange(chunks[(r + 1 - s) % n], right, chunks[(r - s) % n], left, group)
    return tensor


def tree_all_reduce(tensor: torch.Tensor, group=None, host_staging=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place on a binary tree (group rank i
    has children 2i+1 and 2i+2): each rank adds its children's sums to its own and sends
    the total to its parent; rank 0 then holds the sum and sends it back down. 2 log2(n)
    steps instead of the ring's 2(n-1), but whole tensors on every edge (not pipelined in
    chunks, as NCCL's tree is): few steps for small tensors, more bytes for large ones.
    Staged through host memory like ring_all_reduce."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n > 1 and host_staged(tensor, group, host_staging):
        return tensor.copy_(tree_all_reduce(tensor.to("cpu", copy=True), group, host_staging=False))
    children = [_peer(group, c) for c in (2 * r + 1, 2 * r + 2) if c < n]
    parent = _peer(group, (r - 1) // 2) if r else None
    received = [torch.empty_like(tensor) for _ in children]
    for work in [dist.irecv(b, c, group=group) for b, c in zip(received, children)]:
        work.wait()
    for b in received:   # left child, then right: the same order on every call
        tensor.add_(b)
    if parent is not None:
        dist.send(tensor, parent, group=group)
        dist.recv(tensor, parent, group=group)
    for work in [dist.isend(tensor, c, group=group) for c in children]:
        work.wait()
    return tensor


def _peer(group, i):
    """The global rank of group rank i (mod the group's size), as isend/irecv want it."""
    group = group or dist.group.WORLD
    return dist.get_global_rank(group, i % dist.get_world_size(group))


def _exchange(send, to, recv, source, group):
    """Send ``send`` to ``to`` while receiving ``recv`` from ``source`` (an empty part is
    skipped on both sides: its size is known to both)."""
    ops = ([dist.P2POp(dist.isend, send, to, group)] if send.numel() else []) + \
          ([dist.P2POp(dist.irecv, recv, source, group)] if recv.numel() else [])
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def ping_pong(tensor, out, peer: int, first: bool, group=None, host_staging=None):
    """One round trip with group rank ``peer``: the ``first`` side sends ``tensor`` and
    receives the reply into ``out``; the other receives into ``out`` and sends that back.
    Blocking send/recv: if both sides sent first they would deadlock, so the order is the
    point. Staged through host memory as host_staged says."""
    staged = host_staged(out, group, host_staging)
    wire = torch.empty_like(out, device="cpu") if staged else out
    peer = _peer(group, peer)
    if first:
        dist.send(tensor.to("cpu", copy=True) if staged else tensor, peer, group=group)
    dist.recv(wire, peer, group=group)
    if not first:
        dist.send(wire, peer, group=group)
    return out.copy_(wire) if staged else out
# ---- end copy: point-to-point ----


CONFIGS = {"gloo-cpu": ("gloo", "cpu"), "nccl-cuda": ("nccl", "cuda"), "gloo-cuda": ("gloo", "cuda")}
# op: bus factor as a function of the ranks taking part, as nccl-tests counts it
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
              "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n, "ping_pong": lambda n: 1.0,
              "ring_all_reduce": lambda n: 2 * (n - 1) / n, "tree_all_reduce": lambda n: 2 * (n - 1) / n,
              "all_reduce_2_groups": lambda n: 2 * (n // 2 - 1) / (n // 2)}
OPS = list(BUS_FACTOR)
SPLIT = ("all_gather", "reduce_scatter", "all_to_all")   # the buffer is cut into n parts
# torch 2.14 renamed the flat-tensor forms; older versions have only the old names
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def op_case(op, ctx, numel, halves, host_staging=None):
    """Buffers for one op at one size, filled with known values. Returns (run, out,
    expected, nbytes): run() does the op once; right after it, ``out`` must equal
    ``expected`` (None where this rank receives nothing). Outputs start at -1, which no
    op produces, so an op that did nothing fails the check. ``host_staging``: for the
    point-to-point ops (see host_staged)."""
    n, r = ctx.world_size, ctx.rank
    f32 = {"dtype": torch.float32, "device": ctx.device}
    if op in SPLIT:
        numel = max(numel - numel % n, n)
    part = numel // n
    x = torch.full((numel,), float(r + 1), **f32)
    total = torch.full((numel,), n * (n + 1) / 2, **f32)
    if op in ("all_reduce", "ring_all_reduce", "tree_all_reduce"):
        fn = {"all_reduce": dist.all_reduce, "ring_all_reduce": lambda t: ring_all_reduce(t, None, host_staging),
              "tree_all_reduce": lambda t: tree_all_reduce(t, None, host_staging)}[op]
        return (lambda: fn(x)), x, total, numel * 4
    if op == "all_reduce_2_groups":
        mine = halves[r >= n // 2]
        members = range(n // 2) if r < n // 2 else range(n // 2, n)
        return (lambda: dist.all_reduce(x, group=mine)), x, torch.full_like(x, sum(k + 1 for k in members)), numel * 4
    if op == "broadcast":
        return (lambda: dist.broadcast(x, src=0)), x, torch.ones_like(x) if r else None, numel * 4
    if op == "reduce":
        return (lambda: dist.reduce(x, dst=0)), x, total if r == 0 else None, numel * 4
    labels = torch.arange(1, n + 1, **f32).repeat_interleave(part)   # part i holds i+1
    if op == "all_gather":
        out = torch.full((numel,), -1.0, **f32)
        return (lambda: all_gather_flat(out, x[:part])), out, labels, numel * 4
    if op == "reduce_scatter":
        x = labels * (r + 1)            # part j of rank r holds (j+1)(r+1)
        out = torch.full((part,), -1.0, **f32)
        return (lambda: reduce_scatter_flat(out, x)), out, total[:part] * (r + 1), numel * 4
    if op == "all_to_all":
        x = labels + r * n              # part j of rank r holds r*n + j + 1: it goes to rank j
        out = torch.full((numel,), -1.0, **f32)
        expected = torch.arange(n, **f32).repeat_interleave(part) * n + r + 1
        return (lambda: dist.all_to_all_single(out, x)), out, expected, numel * 4
    if op == "ping_pong":
        partner = r + 1 if r % 2 == 0 else r - 1
        back = torch.full((numel,), -1.0, **f32)
        if partner >= n:                # odd world size: the last rank sits out
            return (lambda: None), back, None, numel * 4
        first = r % 2 == 0              # sends its own values and gets them back
        return (lambda: ping_pong(x, back, partner, first, host_staging=host_staging)), back, \
            (x.clone() if first else torch.full_like(x, float(partner + 1))), numel * 4
    raise ValueError(f"unknown op {op}")


def check_from_scratch(ctx):
    """ring and tree all-reduce against dist.all_reduce: integers exactly, floats at
    tolerance, sizes that do not divide by the rank count, on the world and on the even
    ranks' subgroup. Returns the largest float difference; raises on a mismatch."""
    n = ctx.world_size
    evens = dist.new_group(list(range(0, n, 2)))   # every rank takes part in creating it
    worst = 0.0
    g = torch.Generator().manual_seed(1234 + ctx.rank)
    for group in (None, evens):
        if group is not None and ctx.rank % 2:
            continue
        for numel in sorted({1, max(n - 1, 1), 7, 1001, 12345}):
            for dtype in (torch.int64, torch.float32):
                x = (torch.randint(-1000, 1000, (numel,), generator=g) if dtype == torch.int64
                     else torch.randn(numel, generator=g)).to(dtype=dtype, device=ctx.device)
                want = x.clone()
                dist.all_reduce(want, group=group)
                for fn in (ring_all_reduce, tree_all_reduce):
                    got = fn(x.clone(), group)
                    where = f"{fn.__name__} of {numel} {dtype} on {'the even ranks' if group else 'the world'}"
                    if dtype == torch.int64 and not torch.equal(got, want):
                        raise RuntimeError(f"{where} differs from dist.all_reduce")
                    if dtype == torch.float32:
                        diff = (got - want).abs().max().item()
                        if not diff <= 1e-5:
                            raise RuntimeError(f"{where}: max |diff| {diff:.3g} from dist.all_reduce")
                        worst = max(worst, diff)
    return worst


def bench_worker(ctx, args, ops):
    """Check and time every op and size for this job's configuration; one row each."""
    n = ctx.world_size
    halves = [dist.new_group(list(range(n // 2))), dist.new_group(list(range(n // 2, n)))] \
        if "all_reduce_2_groups" in ops else None
    checked = None
    if {"ring_all_reduce", "tree_all_reduce"} & set(ops):
        checked = check_from_scratch(ctx)
    rows = []
    for op in ops:
        started = time.perf_counter()
        for size_mb in args.sizes_mb:
            run, out, expected, nbytes = op_case(op, ctx, max(round(size_mb * 1e6) // 4, 1), halves)
            run()
            common.sync(ctx.device)
            if expected is not None and not torch.equal(out, expected):
                bad = (out != expected).nonzero()[0].item()
                raise RuntimeError(f"{op} of {size_mb} MB at {n} ranks: element {bad} is {out[bad].item()}, "
                                   f"expected {expected[bad].item()}")
            for t in (out, *([] if expected is None else [expected])):
                t.zero_()   # zeros stay zeros: no overflow however many iterations run
            times, stopped = time_op(ctx, args, run, started)
            everyone = [None] * n
            dist.all_gather_object(everyone, times)
            per_iter = [max(r[i] for r in everyone) for i in range(len(times))]
            if op == "ping_pong":   # one way: half the round trip
                per_iter = [t / 2 for t in per_iter]
            st = common.summarize(per_iter)
            algbw = nbytes / st["median"] / 1e9
            rows.append({"op": op, "backend": ctx.backend, "device": ctx.device.type, "ranks": n,
                         "size_mb": size_mb, "bytes": nbytes, "iters": len(per_iter), "time_ms": st["median"] * 1e3,
                         "min_ms": st["min"] * 1e3, "max_ms": st["max"] * 1e3, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * BUS_FACTOR[op](n), "time_boxed": stopped,
                         "all_ms": [t * 1e3 for t in per_iter]})
            if op in ("ring_all_reduce", "tree_all_reduce"):
                rows[-1]["check_max_diff"] = checked
            if stopped:
                break
    return rows


def time_op(ctx, args, run, started):
    """Warm-up, then at least args.iters timed calls; the time box (rank 0's clock decides,
    so every rank stops after the same iteration) cuts a size short."""
    times = []
    for i in range(args.warmup + args.iters):
        common.sync(ctx.device)
        t0 = time.perf_counter()
        run()
        common.sync(ctx.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        flag = torch.tensor([float(time.perf_counter() - started > args.time_box and len(times) >= 1)],
                            device=ctx.device)   # NCCL carries device tensors only
        dist.broadcast(flag, src=0)
        if flag.item():
            return times, True
    return times, False


# ---------------------------------------------------------------------------------------
# The alpha-beta model of the two from-scratch all-reduces
# ---------------------------------------------------------------------------------------
def ring_cost(n, nbytes):
    """(latency steps, bytes through one rank's link) of ring_all_reduce."""
    return 2 * (n - 1), 2 * (n - 1) / n * nbytes


def tree_cost(n, nbytes):
    """The same for tree_all_reduce: per level of edges one step up and one down, and the
    busiest parent at that level takes (up) and gives (down) one tensor per child."""
    steps = volume = 0
    level = 0
    while 2**level - 1 < n and 2**(level + 1) - 1 < n:   # nodes at this level have children
        parents = range(2**level - 1, min(2**(level + 1) - 1, n))
        most = max(sum(c < n for c in (2 * i + 1, 2 * i + 2)) for i in parents)
        steps, volume = steps + 2, volume + 2 * most * nbytes
        level += 1
    return steps, volume


COST = {"ring_all_reduce": ring_cost, "tree_all_reduce": tree_cost}


def fit_line(points):
    """time = a + c x bytes through (bytes, seconds) points, least squares on the relative
    error (so 1 KB counts as much as 100 MB); a and c kept non-negative."""
    xs, ts = [x for x, _ in points], [t for _, t in points]
    w = [1 / t**2 for t in ts]
    a, c = common.fit_line(xs, ts, w)
    if a < 0 or c < 0:   # one term only
        a, c = ((0.0, sum(wi * x * t for wi, x, t in zip(w, xs, ts)) / sum(wi * x * x for wi, x in zip(w, xs)))
                if a < 0 else (sum(wi * t for wi, t in zip(w, ts)) / sum(w), 0.0))
    return a, c


def fit_alpha_beta(rows):
    """For each configuration, from-scratch op and rank count: the line through its sizes,
    read as the alpha-beta model (alpha = a / latency steps, beta = bytes per rank / c)."""
    fits = {}
    for r in rows:
        if r["op"] in COST and r["ranks"] > 1:
            fits.setdefault(f"{r['backend']}+{r['device']}", {}).setdefault(r["op"], {}).setdefault(r["ranks"], [])
            fits[f"{r['backend']}+{r['device']}"][r["op"]][r["ranks"]].append((r["bytes"], r["time_ms"] / 1e3))
    for by_op in fits.values():
        for op, by_n in by_op.items():
            for n, points in by_n.items():
                if len({x for x, _ in points}) < 2:
                    by_n[n] = None
                    continue
                a, c = fit_line(points)
                steps, per_byte = COST[op](n, 1.0)
                by_n[n] = {"alpha_us": a / steps * 1e6, "beta_GBps": per_byte / c / 1e9 if c else None,
                           "a_ms": a * 1e3, "ms_per_MB": c * 1e9,
                           "max_rel_err": max(abs(a + c * x - t) / t for x, t in points)}
    return fits


def predict(fit, nbytes):
    """Seconds for ``nbytes`` by a fitted line."""
    return (fit["a_ms"] + fit["ms_per_MB"] * nbytes / 1e6) / 1e3


def crossover(ring, tree):
    """Where the fitted ring and tree take equal time: {"small": the one faster for the
    smallest tensors, "equal_at_mb": the size above which the other is faster, None if
    it never is}."""
    lines = {"ring": (ring["a_ms"], ring["ms_per_MB"]), "tree": (tree["a_ms"], tree["ms_per_MB"])}
    large = min(lines, key=lambda k: (lines[k][1], lines[k][0]))    # the faster for large tensors
    other = "tree" if large == "ring" else "ring"
    (a_l, c_l), (a_o, c_o) = lines[large], lines[other]
    if a_o < a_l * (1 - 1e-9):   # the other starts lower: faster up to where they cross
        return {"small": other, "equal_at_mb": (a_l - a_o) / (c_o - c_l) if c_o > c_l else None}
    return {"small": large, "equal_at_mb": None}


def analyse(rows):
    """Per configuration and rank count: the alpha-beta fit of ring and tree, where the
    model puts their crossover and the sizes at which the tree was measured faster."""
    out = {}
    for key, by_op in fit_alpha_beta(rows).items():
        ring, tree = by_op.get("ring_all_reduce", {}), by_op.get("tree_all_reduce", {})
        for n in sorted(set(ring) & set(tree)):
            if not (ring[n] and tree[n]):
                continue
            t = {op: {r["size_mb"]: r["time_ms"] for r in series(rows, op, *key.split("+"), n)} for op in COST}
            both = sorted(set(t["ring_all_reduce"]) & set(t["tree_all_reduce"]))
            out.setdefault(key, {})[n] = {
                "ring_all_reduce": ring[n], "tree_all_reduce": tree[n], "model": crossover(ring[n], tree[n]),
                "measured_tree_faster_at_mb": [s for s in both if t["tree_all_reduce"][s] < t["ring_all_reduce"][s]]}
    return out


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------
def series(rows, op, backend, device, ranks):
    """One op's rows at one configuration and rank count, by size."""
    return sorted((r for r in rows if (r["op"], r["backend"], r["device"], r["ranks"]) == (op, backend, device, ranks)),
                  key=lambda r: r["size_mb"])


def style(ax, ylabel, title, logy):
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("data size (MB, float32)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot(rows, out, name, ops):
    plt = common.pyplot()
    configs = sorted({(r["backend"], r["device"], r["ranks"]) for r in rows})
    for key, ylabel, fname, logy in (("time_ms", "time per call (ms)", "_time.png", True),
                                     ("busbw_GBps", "bus bandwidth (GB/s)", "_busbw.png", False)):
        if ops == ["all_reduce"]:   # one panel, one curve per configuration
            fig, ax = plt.subplots(figsize=(6.5, 4.2))
            panels = [(ax, configs, None)]
        else:                       # one panel per configuration, one curve per op
            fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.2), squeeze=False)
            panels = [(ax, [c], c) for ax, c in zip(axes[0], configs)]
        for ax, cs, title in panels:
            for op in ops:
                for c in cs:
                    rs = series(rows, op, *c)
                    if rs:
                        ax.plot([r["size_mb"] for r in rs], [r[key] for r in rs], marker="o",
                                label=f"{c[0]}+{c[1]}, {c[2]} ranks" if title is None else op)
            what = ylabel.split(" (")[0]
            style(ax, ylabel, f"all-reduce: {what}" if title is None
                  else f"{what}, {title[0]}+{title[1]}, {title[2]} ranks", logy)
        common.save_figure(fig, f"{out}/{name}{fname}")


def plot_ring_tree(rows, analysis, out, name):
    """Measured time of ring, tree and dist.all_reduce beside the fitted model, per rank count."""
    plt = common.pyplot()
    panels = [(key, n) for key, by_n in analysis.items() for n in by_n]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (key, n) in zip(axes[0], panels):
        for op, color in (("ring_all_reduce", "C0"), ("tree_all_reduce", "C1"), ("all_reduce", "C2")):
            rs = series(rows, op, *key.split("+"), n)
            if not rs:
                continue
            short = "dist.all_reduce" if op == "all_reduce" else op.split("_")[0]
            ax.plot([r["size_mb"] for r in rs], [r["time_ms"] for r in rs], "o", color=color,
                    label=f"{short} (measured)")
            fit = analysis[key][n].get(op)
            if fit:
                beta = f"{fit['beta_GBps']:.2g} GB/s" if fit["beta_GBps"] else "no size term"
                ax.plot([r["size_mb"] for r in rs], [predict(fit, r["bytes"]) * 1e3 for r in rs], "-",
                        color=color, label=f"{short} model: {fit['alpha_us']:.0f} us/step, {beta}")
        style(ax, "time per all-reduce (ms)", f"ring against tree, {key}, {n} ranks", True)
    common.save_figure(fig, f"{out}/{name}_ring_tree.png")


# ---------------------------------------------------------------------------------------
# Plan and main
# ---------------------------------------------------------------------------------------
def plan(args, n_gpus):
    """The (backend, device, ranks, ops) jobs to run, and notes on what is skipped."""
    jobs, notes = [], []
    for name in args.configs:
        backend, device = CONFIGS[name]
        for ws in args.world_sizes:
            if device == "cuda" and n_gpus == 0:
                notes.append(f"skipped {name} at {ws} ranks: no GPU here")
            elif backend == "nccl" and n_gpus < ws:
                notes.append(f"skipped {name} at {ws} ranks: NCCL needs {ws} GPUs, this machine has {n_gpus}")
            else:
                ops = list(args.ops)
                for op, why in (("ping_pong", ws < 2 and "needs 2 ranks"),
                                ("all_reduce_2_groups", (ws % 2 or ws < 4) and "needs an even world size of 4+")):
                    if op in ops and why:
                        ops.remove(op)
                        notes.append(f"skipped {op} at {ws} ranks: {why}")
                if ops:
                    jobs.append((backend, device, ws, ops))
    return jobs, notes


def parse_ops(ops):
    names = [o for o in ops if o != "all"]
    unknown = [o for o in names if o not in BUS_FACTOR]
    if unknown:
        raise common.UsageError(f"unknown op(s) {', '.join(unknown)}; choose from all, {', '.join(OPS)}")
    return OPS if "all" in ops else list(dict.fromkeys(names))


HEADERS = ["backend", "device", "ranks", "size_mb", "iters", "time_ms", "min_ms", "max_ms", "algbw_GBps", "busbw_GBps"]


def parser(n_gpus):
    """01's flags: configurations, ops, world sizes, sizes, iterations, time box."""
    p = common.KitParser(description=__doc__.split("\n\n")[0])
    default_configs = ["gloo-cpu"] + (["nccl-cuda"] if n_gpus else [])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=default_configs,
                   help="backend-device pairs")
    p.add_argument("--ops", nargs="+", default=["all_reduce"], metavar="OP",
                   help=f"collectives to time: all, or any of {', '.join(OPS)}")
    p.add_argument("--world-sizes", nargs="+", type=common.COUNT, default=[2, 4, 6])
    p.add_argument("--sizes-mb", nargs="+", type=common.number(float, above=0), default=None,
                   help="default: 1 10 100 1000 for all_reduce alone, else 0.001 0.01 0.1 1 10 100")
    p.add_argument("--iters", type=common.COUNT, default=10, help="timed iterations per size")
    p.add_argument("--warmup", type=common.COUNT0, default=5, help="untimed iterations per size first")
    p.add_argument("--time-box", type=common.SECONDS, default=300.0,
                   help="seconds per configuration and op; past it a size stops after its current iteration")
    p.add_argument("--timeout", type=common.SECONDS, default=600.0, help="seconds a collective may wait")
    common.add_stall_flags(p)
    p.add_argument("--out", default=common.DEFAULT_OUT, help="folder for results (make all writes results/)")
    p.add_argument("--name", default=None, help="results file stem (default: 01_allreduce for all_reduce "
                                                "alone, else 01_collectives)")
    return p


def checked_args(p, argv):
    """The flags parsed, checked, and the defaults the ops ask for filled in."""
    args = p.parse_args(argv)
    args.ops = parse_ops(args.ops)
    alone = args.ops == ["all_reduce"]
    args.sizes_mb = args.sizes_mb or ([1, 10, 100, 1000] if alone else [0.001, 0.01, 0.1, 1, 10, 100])
    args.name = args.name or ("01_allreduce" if alone else "01_collectives")
    args.configs = list(dict.fromkeys(args.configs))   # each once, in the order given
    args.world_sizes = list(dict.fromkeys(args.world_sizes))
    if any(c.startswith("gloo") for c in args.configs):
        common.check_ranks(max(args.world_sizes), "gloo", "--world-sizes")
    common.check_out(args.out)
    if common.under_torchrun():
        args.world_sizes = [int(os.environ["WORLD_SIZE"])]
        args.configs = args.configs[:1]
    return args


def run_job(args, job, rows, failed, notes) -> tuple | None:
    """One configuration at one world size: its rows printed, every table and plot
    rewritten; a failed job goes to ``failed`` and the others still run. Returns the ring
    and tree analysis so far and the table as printed (None where nothing was added)."""
    backend, device, ws, ops = job
    alone, report = args.ops == ["all_reduce"], common.is_reporter()
    headers = HEADERS if alone else ["op"] + HEADERS
    if report:
        print(f"{backend}+{device}, {ws} ranks ...", flush=True)
    try:
        got = common.launch(bench_worker, args, ops, world_size=ws, backend=backend, device=device)
    except common.LaunchError as e:
        failed.append(f"{backend}+{device} at {ws} ranks failed: {str(e).splitlines()[0]}")   # rank and error
        print(f"{backend}+{device} at {ws} ranks failed: {e}")
        return None
    if not report:
        return None
    rows += got
    for r in got:
        label = "" if alone else f"{r['op']:<20}"
        print(f"  {label}{r['size_mb']:>7g} MB  {r['time_ms']:9.3f} ms  "
              f"busbw {r['busbw_GBps']:6.3f} GB/s"
              f"{'  (time box: ' + str(r['iters']) + ' iters)' if r['time_boxed'] else ''}")
    if any("check_max_diff" in r for r in got):
        print(f"  ring and tree all-reduce equal dist.all_reduce: integers exactly, floats with a largest "
              f"difference of {max(r.get('check_max_diff') or 0 for r in got):.2g}")
    analysis = analyse(rows)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "name")}
    table = common.save_results(args.out, args.name, rows, settings, headers=headers,
                                title="All-reduce benchmark" if alone else "Collectives benchmark",
                                note="\n".join(notes + failed + describe(analysis)),
                                extra={"ring_tree": analysis} if analysis else None)
    plot(rows, args.out, args.name, args.ops)
    if not alone:   # the op-by-op overview
        common.save_results(args.out, f"{args.name}_summary", summary(rows), settings,
                            title="Collectives: latency (time of the smallest size) and busbw (GB/s) of "
                                  "the largest sizes", note=f"All sizes: `{args.name}.md`.")
    if analysis:
        plot_ring_tree(rows, analysis, args.out, args.name)
    return analysis, table


def main(argv=None):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args = checked_args(parser(n_gpus), argv)
    jobs, notes = plan(args, n_gpus)
    if common.under_torchrun() and not jobs:
        raise common.UsageError("; ".join(notes))
    report = common.is_reporter()
    for note in notes if report else []:
        print(note)
    rows, failed, analysis, table = [], [], {}, ""
    for job in jobs:
        analysis, table = run_job(args, job, rows, failed, notes) or (analysis, table)
    if report and rows:
        print(f"verify {args.name}: {'FAIL' if failed else 'PASS'} (every op's result checked against known values "
              f"before it was timed, in {len(jobs) - len(failed)} of {len(jobs)} jobs)")
        print("\n".join([f"\n{table}", *describe(analysis),
                         common.wrote(args.out, f"{args.name}.json, .md, _time.png, _busbw.png"
                                     + (", _ring_tree.png" if analysis else ""))]))
    if failed:
        raise common.LaunchError("; ".join(failed))


def summary(rows):
    """One row per op, configuration and rank count: the time of the smallest size (the
    latency side) and busbw at the three largest (the bandwidth side)."""
    sizes = sorted({r["size_mb"] for r in rows})
    big = sizes[-3:]
    out = []
    for key in dict.fromkeys((r["op"], r["backend"], r["device"], r["ranks"]) for r in rows):
        mine = {r["size_mb"]: r for r in rows if (r["op"], r["backend"], r["device"], r["ranks"]) == key}
        row = dict(zip(("op", "backend", "device", "ranks"), key))
        row[f"time_ms_{sizes[0]:g}MB"] = mine[sizes[0]]["time_ms"] if sizes[0] in mine else None
        row.update({f"busbw_{s:g}MB": mine[s]["busbw_GBps"] if s in mine else None for s in big})
        out.append(row)
    return out


def describe(analysis):
    """The fits and crossovers in sentences."""
    lines = []
    for key, by_n in analysis.items():
        for n, c in by_n.items():
            fits = "; ".join(
                f"{op.split('_')[0]} alpha {c[op]['alpha_us']:.0f} us/step, beta "
                f"{c[op]['beta_GBps']:.3g} GB/s" if c[op]["beta_GBps"] else f"{op.split('_')[0]} alpha "
                f"{c[op]['alpha_us']:.0f} us/step, no size term" for op in COST)
            worst = max(c[op]["max_rel_err"] for op in COST)
            small, at = c["model"]["small"], c["model"]["equal_at_mb"]
            other = "ring" if small == "tree" else "tree"
            where = (f"the {small} is faster at every size" if at is None
                     else f"the {small} is faster up to {at:.3g} MB, the {other} above")
            lines.append(f"{key} at {n} ranks: {fits} (worst point {100 * worst:.0f} % off); by the model {where}; "
                         f"measured, the tree was faster at "
                         f"{', '.join(f'{s:g}' for s in c['measured_tree_faster_at_mb']) or 'no size'} MB")
    return lines


if __name__ == "__main__":
    common.run_main(main)
