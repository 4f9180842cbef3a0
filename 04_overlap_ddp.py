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
Writes <out>/04_overlap_ddp.{json,md}, <out>/04_timeline_naive.png and
<out>/04_timeline_overlap.png.
"""

import common

# ---- begin copy: DDPIndividualParameters (needs only torch and the standard library) ----
import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn


class DDPIndividualParameters(nn.Module):
    """Per-parameter all-reduce, launched from a hook during backward and awaited at the end.

        model = DDPIndividualParameters(MyModel().to(device))   # broadcasts the group's first rank's weights
        opt = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x_local), y_local)
        loss.backward()                              # all-reduces start as gradients appear
        model.finish_gradient_synchronization()      # wait for them; gradients are averaged
        opt.step()

    ``process_group`` (default: every rank) is the data-parallel group. Launch order is fixed: parameters in reverse ``module.parameters()`` order (about the
    order backward produces them), each launched once it and all before it are ready, so
    every rank issues the same collectives in the same order even when a parameter gets no
    gradient on some rank. Those left over are reduced in ``finish_gradient_synchronization``
    (zeros where a rank has none); a parameter no rank gave a gradient keeps ``.grad is None``.
    Inside ``no_sync()`` backward communicates nothing and gradients accumulate; the next
    synchronized backward reduces the sum. Tied parameters are reduced once.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        src = dist.get_global_rank(process_group or dist.group.WORLD, 0)   # the group's first rank
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=src, group=process_group)
        self._order = [p for p in module.parameters() if p.requires_grad][::-1]
        self._ready = [False] * len(self._order)
        self._next = 0          # the next parameter (in _order) to launch
        self._pending = []      # (work handle, index, buffer reduced in place)
        self._sync = True
        for i, p in enumerate(self._order):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _make_hook(self, i):
        me = weakref.ref(self)   # not self: torch keeps the hook where Python's collector cannot see
        # it, so a hook holding the wrapper would keep it, the model and its group alive for good

        def hook(p):
            self = me()
            if self is None or not self._sync:
                return
            if self._ready[i]:
                raise RuntimeError("backward ran twice without finish_gradient_synchronization(); "
                                   "wrap all but the last micro-batch in no_sync()")
            self._ready[i] = True
            while self._next < len(self._order) and self._ready[self._next]:
                self._launch(self._next, self._order[self._next].grad)
                self._next += 1
        return hook

    def _launch(self, i, buf):
        if self.world_size > 1:    # average by dividing before the sum
            if torch.is_grad_enabled():   # backward(create_graph=True): no part of a graph
                with torch.no_grad():
                    buf.div_(self.world_size)
            else:
                buf.div_(self.world_size)
        self._pending.append((dist.all_reduce(buf, group=self.process_group, async_op=True), i, buf))

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
        has_grad = torch.ones(len(order), device=order[0].device)   # (made there: no copy from the host)
        missing = [i for i, p in enumerate(order) if p.grad is None]
        for i in missing:
            has_grad[i] = 0.0
        flags = dist.all_reduce(has_grad, group=self.process_group, async_op=True)
        for work, _, _ in self._pending:
            work.wait()
        flags.wait()
        # every rank sends its flags; only one that lacked a gradient reads the sums back
        # (a copy to the host, which waits for the device: none in the usual step)
        sums = has_grad.tolist() if missing else [1] * len(order)
        for (_, i, buf), n in zip(sorted(self._pending, key=lambda t: t[1]), sums):
            p = order[i]
            if p.grad is None and n > 0:
                p.grad = buf  # another rank had a gradient: take the average
        self._pending.clear()
        self._ready = [False] * len(order)
        self._next = 0
# ---- end copy: DDPIndividualParameters ----


def train_step(model, optimizer, batch, clock, micro_batches=1, set_to_none=True, **forward_kwargs):
    """One training step on this rank's part of the global batch, timed by phase (the
    phases also label the profiler trace). With ``micro_batches`` > 1 the gradients
    accumulate, communicated once (at the last)."""
    x, y = batch
    optimizer.zero_grad(set_to_none=set_to_none)
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        with model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
            with clock.phase("forward"):
                loss = model(xm, ym, **forward_kwargs) / micro_batches
            with clock.phase("backward"):
                loss.backward()
    with clock.phase("comm"):
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


def verify(ctx, args, cases=None, group=None):
    """Each case of common.VERIFY_CASES (or those named): DDPIndividualParameters on this
    rank's part of every global batch, against one process trained on the whole batches.
    ``group``: the data-parallel group (default: every rank)."""
    results = {}
    for name in cases or common.VERIFY_CASES:
        run = common.VerifyRun(ctx, args, common.VERIFY_CASES[name], group)
        model = DDPIndividualParameters(run.model, process_group=group)
        optimizer = run.optimizer(model.parameters())
        for step in range(run.steps):
            train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
        results[name] = run.compare(model.module)
    return results


def wrappers():
    naive = common.load_script(common.ROOT / "02_naive_ddp.py")
    flat = common.load_script(common.ROOT / "03_flat_ddp.py")
    return {"naive": naive.NaiveDDP, "flat": flat.FlatDDP, "overlap": DDPIndividualParameters}


def benchmark(ctx, args):
    """Naive (02), flat (03) and overlapped DDP on the LM, steps alternating: one row each."""
    def method(wrap):
        def make():
            model = wrap(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return lambda batch, clock: train_step(model, optimizer, batch, clock)
        return make
    w = wrappers()
    return common.time_methods(ctx, args, {"naive (per-parameter)": method(w["naive"]),
                                           "flat (one all-reduce)": method(w["flat"]),
                                           "overlapped (per-parameter, async)": method(w["overlap"])})


# ----------------------------------------------------------------------------------------
# Timelines: one profiled step, drawn as a compute lane and a communication lane
# ----------------------------------------------------------------------------------------
PHASES = {"forward": "forward", "backward": "backward", "comm": "finish_gradient_synchronization",
          "optim": "optimizer.step"}   # the clock's phases, and what they stand for
COMM_PREFIXES = ("gloo:", "nccl:", "c10d::allreduce", "record_param_comms")


def trace(ctx, args):
    """Profile one training step of naive and of overlapped DDP on this rank:
    {name: [(lane, name, start_ms, end_ms)]}."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size) for t in
                  common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device))
    timelines = {}
    for name in ("naive", "overlap"):
        model = wrappers()[name](common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            train_step(model, optimizer, batch, common.StepClock(ctx.device))
        dist.barrier()
        with profile(activities=acts) as prof:
            train_step(model, optimizer, batch, common.StepClock(ctx.device))
        timelines[name] = timeline_events(prof, ctx)
        del model, optimizer
    return timelines


def timeline_events(prof, ctx):
    events = []
    for e in prof.events():
        name = e.name
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3
        if name in PHASES:
            events.append(("compute", name, start, end))
        elif name.startswith(COMM_PREFIXES) and end > start:
            events.append(("comm", name, start, end))
        elif ctx.device.type == "cuda" and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            events.append(("comm" if "nccl" in name.lower() else "gpu", name, start, end))
    t0 = min(s for _, _, s, _ in events)
    return [(lane, name, s - t0, e - t0) for lane, name, s, e in events]


def draw_timeline(events, title, path):
    """One step's events on three lanes (the CPU thread's phases, a GPU's kernels where
    traced, the all-reduces), backward shaded."""
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "comm": "#c44e52", "optim": "#55a868"}
    names = {"compute": "compute (CPU thread)", "gpu": "GPU kernels", "comm": "communication"}
    order = ["compute"] + (["gpu"] if any(lane == "gpu" for lane, *_ in events) else []) + ["comm"]
    lanes = [(names[lane], [{"start": s, "end": e, "min_width": 0.05, "edge": "black" if lane == "comm" else "none",
                             "color": colors.get(name, "#8172b3" if lane == "comm" else "#999999")}
                            for ln, name, s, e in events if ln == lane]) for lane in order]
    back = [(s, e) for _, n, s, e in events if n == "backward"]
    common.draw_lanes(path, title, lanes, "time (ms)", {**{PHASES[n]: c for n, c in colors.items()},
                                                        "all-reduce": "#8172b3"},
                      row=0.6, shade=(*back[0], "#dd8452") if back else None)


NAME, TITLE = "04_overlap_ddp", "Naive, flat and overlapped DDP"


def main(argv=None):
    args = common.parse(common.script_parser(__doc__), argv)
    if not args.no_verify:
        common.check_verification(common.launch(verify, args), f"{NAME} at {args.world_size} rank(s)")
    if args.no_bench:
        return
    common.report_table(args, NAME, TITLE, common.launch(benchmark, args))
    timelines = common.launch(trace, args)
    if common.is_reporter():
        for name, events in timelines.items():
            path = f"{args.out}/04_timeline_{name}.png"
            draw_timeline(events, f"{name} DDP, one step on rank 0 ({args.model_size} LM, "
                                  f"{args.world_size} x {args.backend}/{args.device})", path)
            print(common.wrote(path))


if __name__ == "__main__":
    common.run_main(main)
