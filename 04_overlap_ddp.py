"""Overlapped DDP: start an asynchronous all-reduce for each parameter's gradient the moment
backward has accumulated it, so communication runs while backward computes the rest.

Run:
    python 04_overlap_ddp.py                       # verify, benchmark, draw the timelines
    python 04_overlap_ddp.py --world-size 4 --model-size micro
    torchrun --standalone --nproc-per-node 2 04_overlap_ddp.py

Prints PASS/FAIL per verification case, then naive, flat and overlapped DDP measured in
the same run: step time and *exposed* communication (the time spent waiting in
finish_gradient_synchronization after backward returns). Then it profiles one step of
naive and of overlapped DDP with torch.profiler and draws each as a timeline.
Writes results/04_overlap_ddp.{json,md}, results/04_timeline_naive.png and
results/04_timeline_overlap.png.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import common


class DDPIndividualParameters(nn.Module):
    """Per-parameter all-reduce, launched from a hook during backward and awaited at the end.

        model = DDPIndividualParameters(MyModel().to(device))   # broadcasts rank 0's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()                              # all-reduces start as gradients appear
        model.finish_gradient_synchronization()      # wait for them; gradients are averaged
        opt.step()

    Launch order is fixed: parameters in reverse ``module.parameters()`` order (about the
    order backward produces them), each launched once it and all before it are ready, so
    every rank issues the same collectives in the same order even when a parameter gets no
    gradient on some rank. Those left over are reduced in ``finish_gradient_synchronization``
    (zeros where a rank has none); a parameter no rank gave a gradient keeps ``.grad is None``.
    Inside ``no_sync()`` backward communicates nothing and gradients accumulate; the next
    synchronized backward reduces the sum. Tied parameters are reduced once.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)
        self._order = [p for p in module.parameters() if p.requires_grad][::-1]
        self._ready = [False] * len(self._order)
        self._next = 0          # the next parameter (in _order) to launch
        self._pending = []      # (work handle, index, buffer reduced in place)
        self._sync = True
        for i, p in enumerate(self._order):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _make_hook(self, i):
        def hook(p):
            if not self._sync:
                return
            if self._ready[i]:
                raise RuntimeError("backward ran twice without finish_gradient_synchronization(); "
                                   "wrap all but the last micro-batch in no_sync()")
            self._ready[i] = True
            while self._next < len(self._order) and self._ready[self._next]:
                self._launch(self._next, self._order[self._next].grad)
                self._next += 1
        return hook

    @torch.no_grad()
    def _launch(self, i, buf):
        buf.div_(self.world_size)  # average by dividing before the sum
        self._pending.append((dist.all_reduce(buf, async_op=True), i, buf))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients locally and communicates nothing."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        order = self._order
        if not order:
            return
        # Whatever did not launch during backward goes now, in the same order on every rank.
        for i in range(self._next, len(order)):
            p = order[i]
            self._launch(i, p.grad if p.grad is not None else torch.zeros_like(p))
        has_grad = torch.tensor([float(p.grad is not None) for p in order], device=order[0].device)
        flags = dist.all_reduce(has_grad, async_op=True)
        for work, _, _ in self._pending:
            work.wait()
        flags.wait()
        for (_, i, buf), n in zip(sorted(self._pending, key=lambda t: t[1]), has_grad.tolist()):
            p = order[i]
            if p.grad is None and n > 0:
                p.grad = buf  # another rank had a gradient: take the average
        self._pending.clear()
        self._ready = [False] * len(order)
        self._next = 0


# ----------------------------------------------------------------------------------------
def verify(ctx, args):
    return common.verify_cases(ctx, DDPIndividualParameters, args, getattr(args, "cases", None))


def benchmark(ctx, args):
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")
    flat = common.load_script(common.ROOT / "03_flat_ddp.py")
    rows = [common.bench_method(ctx, args, "naive (per-parameter)", naive.NaiveDDP),
            common.bench_method(ctx, args, "flat (one all-reduce)", flat.FlatDDP),
            common.bench_method(ctx, args, "overlapped (per-parameter, async)", DDPIndividualParameters)]
    rows += [{"method": "timeline", "name": name, "events": trace_step(ctx, args, wrap)}
             for name, wrap in (("naive", naive.NaiveDDP), ("overlap", DDPIndividualParameters))]
    return rows


# ----------------------------------------------------------------------------------------
# Timelines: one profiled step, drawn as a compute lane and a communication lane
# ----------------------------------------------------------------------------------------
PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer.step")
COMM_PREFIXES = ("gloo:", "nccl:", "c10d::allreduce", "record_param_comms")


def trace_step(ctx, args, wrap):
    """Profile one training step on this rank; returns [(lane, name, start_ms, end_ms)]."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler_start/stop chatter on stderr
    from torch.profiler import ProfilerActivity, profile, record_function
    model, _ = common.lm_trainer(ctx, args, wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (common.shard(t, ctx) for t in common.lm_batch(args.batch_size, args.context_length, 0,
                                                          args.seed, ctx.device))

    def step():
        opt.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = model(x, y)
        with record_function("backward"):
            loss.backward()
            common.sync(ctx.device)
        with record_function("finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
            common.sync(ctx.device)
        with record_function("optimizer.step"):
            opt.step()
            common.sync(ctx.device)

    for _ in range(2):
        step()
    dist.barrier()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
    events = []
    for e in prof.events():
        name = e.name
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3
        if name in PHASES:
            events.append(("compute", name, start, end))
        elif name.startswith(COMM_PREFIXES) and end > start:
            events.append(("comm", name, start, end))
        elif ctx.device.type == "cuda" and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            lane = "comm" if "nccl" in name.lower() else "gpu"
            events.append((lane, name, start, end))
    t0 = min(s for _, _, s, _ in events)
    return [(lane, name, s - t0, e - t0) for lane, name, s, e in events]


def draw_timeline(events, title, path):
    plt = common.pyplot()
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "finish_gradient_synchronization": "#c44e52",
              "optimizer.step": "#55a868"}
    lanes = ["compute"] + (["gpu"] if any(l == "gpu" for l, *_ in events) else []) + ["comm"]
    fig, ax = plt.subplots(figsize=(10, 2.6))
    bars = {}   # one broken_barh per lane and colour: a GPU step has thousands of kernels
    for lane, name, s, e in events:
        color = colors.get(name, "#8172b3" if lane == "comm" else "#999999")
        bars.setdefault((lane, color), []).append((s, max(e - s, 0.05)))
    for (lane, color), spans in bars.items():
        y = lanes.index(lane)
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color,
                       edgecolors="black" if lane == "comm" else "none", linewidth=0.3)
    back = [(s, e) for l, n, s, e in events if n == "backward"]
    if back:
        ax.axvspan(*back[0], color="#dd8452", alpha=0.08)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels({"compute": "compute (CPU thread)", "gpu": "GPU kernels",
                        "comm": "communication"}[l] for l in lanes)
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()] +
              [Patch(color="#8172b3", label="all-reduce")], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    common.save_figure(fig, path)


def main(argv=None):
    p = common.script_parser(__doc__)
    args = common.resolve_args(p.parse_args(argv))
    timelines = {}

    def split(rows):  # the traces are drawn, not tabulated
        timelines.update((r["name"], r["events"]) for r in rows if r["method"] == "timeline")
        return [r for r in rows if r["method"] != "timeline"]

    def after(rows):
        for name, events in timelines.items():
            path = f"{args.out}/04_timeline_{name}.png"
            draw_timeline(events, f"{name} DDP, one step on rank 0 ({args.model_size} LM, "
                                  f"{args.world_size} x {args.backend}/{args.device})", path)
            print(f"wrote {path}")

    common.run_script(args, "04_overlap_ddp", "Naive, flat and overlapped DDP", verify,
                      benchmark, after=after, prepare=split)


if __name__ == "__main__":
    common.run_main(main)
