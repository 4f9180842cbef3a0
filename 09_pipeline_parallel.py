"""Pipeline parallelism: consecutive layers on consecutive ranks, activations sent forward
and their gradients backward, micro-batches to shrink the idle time, with the GPipe and
1F1B schedules.

A stage computes its layers for one micro-batch (F), sends the activations to the next
stage, and later gets their gradient back to run its backward (B). GPipe runs every
micro-batch's forward, then every backward: each stage holds the activations of all m
micro-batches at once. 1F1B starts backward as soon as the last stage can: after a few
warm-up forwards each stage alternates one forward and one backward, so stage s holds at
most p - s micro-batches. Both leave the same idle time, the bubble (p-1)/(m+p-1) of a step
for p stages of equal cost. Gradients accumulate over the micro-batches; one optimizer
step per global batch. With p = 2 and m = 1 this is plain model parallelism: the model in
two halves on two devices, the first half's output copied to the second, backward flowing
back.

In your own training loop (the copy region has all of it):
    stage = MyStage(model, rank, n_stages)             # its layers under the model's own names
    pipe = Pipeline(stage, 8, loss_fn, "1f1b", pp_group, activation_shape=(mb, t, d))
    opt.zero_grad(); pipe.step(x if pipe.first else None, y if pipe.last else None)
    clip_grad_norm_(stage.parameters(), max_norm, pp_group)   # not torch's: a stage holds a part
    opt.step()
    model_sd, optim_sd = full_state_dict(stage, pp_group), full_optim_state_dict(stage, opt, pp_group)
    load_full_state_dict(stage, model_sd); load_full_optim_state_dict(stage, opt, optim_sd)
The full state dicts come whole on the pipeline's first rank (save them there) and load at
any number of stages. With data-parallel replicas of each stage, clip after their
gradients are averaged, over the pipeline's group.

Run:
    python 09_pipeline_parallel.py                            # p = 2 and 4, m = 1..8, both schedules
    python 09_pipeline_parallel.py --stages 2 --replicas 2    # 2 stages x 2 data-parallel replicas
    torchrun --standalone --nproc-per-node 4 09_pipeline_parallel.py --stages 4

Prints PASS/FAIL per verification case (every stage's weights against one process), then a
table: step time for each schedule and number of micro-batches beside
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B) on the same stages, the measured
bubble beside (p-1)/(m+p-1), and peak activation memory per stage. Writes
results/09_pipeline_parallel.{json,md}, results/09_timeline_gpipe.png and
results/09_timeline_1f1b.png.
"""

import copy
import math

import common

# ---- begin copy: pipeline parallelism (needs only torch and the standard library) ----
import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def balanced_split(costs: list, n_stages: int) -> list:
    """Cut a list of layer costs into ``n_stages`` consecutive runs whose largest total is
    as small as possible; returns the index where each stage starts (and len(costs))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = {(0, 0): (0.0, None)}   # (layers placed, stages used) -> (largest stage so far, previous cut)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            best[(j, s)] = min((max(best[(i, s - 1)][0], prefix[j] - prefix[i]), i)
                               for i in range(s - 1, j) if (i, s - 1) in best)
    cuts, j = [n], n
    for s in range(n_stages, 0, -1):
        j = best[(j, s)][1]
        cuts.append(j)
    return cuts[::-1]


class LMStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of the kit's TransformerLM: the embeddings (first
    stage), its share of the blocks, the final norm and output head (last stage), split so
    the stages cost about the same (a block costs 24 d^2 + 4 t d FLOPs a token, the head
    2 d V). It holds the model's own modules under their own names.

        stage = LMStage(model, rank, world_size)
        pipe = Pipeline(stage, n_microbatches=8, loss_fn=lm_loss, activation_shape=(mb, t, d))
    """

    def __init__(self, model, stage: int, n_stages: int):
        super().__init__()
        d, t, v = model.tok.embedding_dim, model.pos.num_embeddings, model.head.out_features
        n = len(model.blocks)
        if not 1 <= n_stages <= n:
            raise ValueError(f"{n_stages} stages for {n} blocks: at most one stage per block")
        costs = [24 * d * d + 4 * t * d] * n + [2 * d * v]   # the blocks, then the head
        cuts = balanced_split(costs, n_stages)
        lo, hi = cuts[stage], min(cuts[stage + 1], n)
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.tok, self.pos = (model.tok, model.pos) if self.first else (None, None)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        self.ln_f, self.head = (model.ln_f, model.head) if self.last else (None, None)

    def forward(self, x):
        if self.first:   # token ids -> embeddings
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpipe_order(n_microbatches: int, stage: int, n_stages: int) -> list:
    """Every forward, then every backward."""
    m = n_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(n_microbatches: int, stage: int, n_stages: int) -> list:
    """Warm-up forwards (p - s - 1 of them), then one forward one backward, then the
    remaining backwards: stage s never holds more than p - s micro-batches."""
    m = n_microbatches
    warm = min(n_stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


class Pipeline:
    """Runs this rank's stage of a pipeline over ``process_group`` (default: every rank;
    stage = the rank's place in the group). Each ``step`` splits the global batch into
    micro-batches and runs their forwards and backwards in the schedule's order, receiving
    activations from the previous stage and gradients from the next (non-blocking
    isend/irecv, each action's receive batched with the previous action's send, as NCCL
    needs). Gradients accumulate in ``module``'s .grad as the whole batch's mean.

        stage = MyStage(...)                                    # this rank's layers
        pipe = Pipeline(stage, 8, loss_fn, schedule="1f1b", activation_shape=(mb, t, d))
        opt = torch.optim.AdamW(stage.parameters())
        opt.zero_grad()
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)   # loss on the last stage
        opt.step()

    ``activation_shape``: what one micro-batch's activations look like between stages. If
    ``module`` has ``no_sync`` (a DDP wrapper over the stage's data-parallel group), every
    backward but the last runs inside it; call its finish_gradient_synchronization after.
    ``host_staging``: send and receive through host memory (None: when the group's backend
    is gloo and the stage is on a GPU, since gloo's send/recv take CPU tensors only; NCCL
    and CPU tensors go directly). ``timed``: record each action's start and end
    (``timeline``); ``count_activations``: count the bytes autograd saves for backward,
    held between a micro-batch's F and B (``peak_activation_bytes``); parameters do not
    count, nor, if ``count_activations`` is a function, a saved tensor it says False of
    (weights a wrapper gathered, say).
    """

    def __init__(self, module, n_microbatches: int, loss_fn, schedule="1f1b", process_group=None,
                 activation_shape=None, activation_dtype=torch.float32, timed=False, count_activations=False,
                 host_staging=None):
        self.module, self.m, self.loss_fn = module, n_microbatches, loss_fn
        self.group, self.host_staging = process_group, host_staging
        self.stage, self.n_stages = dist.get_rank(process_group), dist.get_world_size(process_group)
        peer = lambda s: dist.get_global_rank(process_group or dist.group.WORLD, s)  # noqa: E731
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.prev = None if self.first else peer(self.stage - 1)
        self.next = None if self.last else peer(self.stage + 1)
        self.order = SCHEDULES[schedule](n_microbatches, self.stage, self.n_stages)
        self.shape, self.dtype = activation_shape, activation_dtype
        self.timed, self.count_activations = timed, count_activations
        self.timeline, self.peak_activation_bytes = [], 0

    def _buffer(self, device):
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def _wire(self, t):
        """What goes over the wire: ``t`` itself, or its copy in host memory when staging."""
        return t.to("cpu", copy=True) if self._staged else t

    def step(self, inputs=None, targets=None):
        m, device = self.m, next(self.module.parameters()).device
        self._staged = self.host_staging if self.host_staging is not None else \
            device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        wire = torch.device("cpu") if self._staged else device   # where received tensors land
        xs = inputs.chunk(m) if self.first else [None] * m
        ys = targets.chunk(m) if self.last else [None] * m
        saved_in, saved_out, held, losses, sends, sent = {}, {}, {}, [], [], []
        live, self.timeline, t0 = 0, [], time.perf_counter()
        for k, (kind, i) in enumerate(self.order):
            recvs = []                       # what this action needs from a neighbour
            if kind == "F" and not self.first:
                saved_in[i] = self._buffer(wire)
                recvs.append(dist.P2POp(dist.irecv, saved_in[i], self.prev, self.group, tag=2 * i))
            if kind == "B" and not self.last:
                grad = self._buffer(wire)
                recvs.append(dist.P2POp(dist.irecv, grad, self.next, self.group, tag=2 * i + 1))
            if sends or recvs:   # wait for what this action receives; sends finish in the background
                works = dist.batch_isend_irecv(sends + recvs)
                done_later = works[:len(sends)] if len(works) == len(sends) + len(recvs) else []
                for work in works[len(done_later):]:
                    work.wait()
                sent += done_later
                if kind == "F" and not self.first:
                    saved_in[i] = saved_in[i].to(device)
                if kind == "B" and not self.last:
                    grad = grad.to(device)
            sends = []
            if self.timed:
                _sync(device)
                start = time.perf_counter() - t0
            if kind == "F":
                x = xs[i] if self.first else saved_in[i].requires_grad_()
                with self._counting(held, i):
                    out = self.module(x)
                    out = self.loss_fn(out, ys[i]) / m if self.last else out   # the batch's mean
                saved_in[i], saved_out[i] = x, out
                live += held.get(i, 0)
                self.peak_activation_bytes = max(self.peak_activation_bytes, live)
                if self.last:
                    losses.append(out.detach())
                else:
                    sends = [dist.P2POp(dist.isend, self._wire(out.detach()), self.next, self.group, tag=2 * i)]
            else:
                last_backward = k == len(self.order) - 1
                sync = contextlib.nullcontext() if last_backward or not hasattr(self.module, "no_sync") \
                    else self.module.no_sync()
                with sync:
                    torch.autograd.backward(saved_out.pop(i), None if self.last else grad)
                x = saved_in.pop(i)
                live -= held.pop(i, 0)
                if not self.first:
                    sends = [dist.P2POp(dist.isend, self._wire(x.grad), self.prev, self.group, tag=2 * i + 1)]
            if self.timed:
                _sync(device)
                self.timeline.append((kind, i, start, time.perf_counter() - t0))
        for work in sent + (dist.batch_isend_irecv(sends) if sends else []):
            work.wait()
        return torch.stack(losses).sum() if self.last else None

    @contextlib.contextmanager
    def _counting(self, held, i):
        """Count the bytes autograd saves for backward during micro-batch i's forward (each
        storage once, parameters excluded)."""
        if not self.count_activations:
            yield
            return
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        counts = self.count_activations if callable(self.count_activations) else lambda t: True
        seen = set()

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params and s.data_ptr() not in seen and counts(t):
                seen.add(s.data_ptr())
                held[i] = held.get(i, 0) + s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- in a training loop: clip by the global norm, checkpoints of the whole model ---------
@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, process_group=None, norm_type=2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a pipeline stage: the norm of the whole model's
    gradient, this stage's parameters' part summed over the pipeline ``process_group`` (the
    stages hold disjoint parameters), so that every stage clips by the same factor. With
    data-parallel replicas of each stage, call it after their gradients are averaged (they
    are equal then) with the pipeline's group. Returns the total norm (collective: every
    stage calls it)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    if norm_type == float("inf"):
        total = torch.stack([g.abs().max().float() for g in grads] or [torch.zeros((), device=device)]).max()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=process_group)
    else:
        total = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros((), device=device))
        dist.all_reduce(total, group=process_group)
        total = total ** (1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _gather_to_first(obj, process_group):
    """Every stage's ``obj`` on the group's first rank (a list), None on the others."""
    first = dist.get_global_rank(process_group or dist.group.WORLD, 0)
    everyone = [None] * dist.get_world_size(process_group) if dist.get_rank() == first else None
    dist.gather_object(obj, everyone, dst=first, group=process_group)
    return everyone


def full_state_dict(module: nn.Module, process_group=None):
    """The whole model's tensors by name, merged from every stage's ``module.state_dict()``
    (each stage keeps its layers under the model's own names), in host memory on the
    group's first rank; None on the others (collective)."""
    parts = _gather_to_first({k: v.detach().cpu() for k, v in module.state_dict().items()}, process_group)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state: dict):
    """Load this stage's tensors from a full_state_dict saved at any number of stages."""
    for name, t in module.state_dict(keep_vars=True).items():
        t.copy_(state[name])


def full_optim_state_dict(module: nn.Module, optimizer, process_group=None):
    """Every stage's optimizer state keyed by parameter name, and the settings of its
    groups, merged on the group's first rank (None on the others; collective). Load it with
    load_full_optim_state_dict at any number of stages."""
    names = {id(p): n for n, p in module.named_parameters()}
    mine = {"state": {names[id(p)]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]}
    parts = _gather_to_first(mine, process_group)
    if parts is None:
        return None
    groups = [{**g, "params": [n for part in parts for n in part["param_groups"][i]["params"]]}
              for i, g in enumerate(parts[0]["param_groups"])]
    return {"state": {n: s for part in parts for n, s in part["state"].items()}, "param_groups": groups}


def load_full_optim_state_dict(module: nn.Module, optimizer, full: dict):
    """Load this stage's part of a full_optim_state_dict into ``optimizer`` (its groups
    built as when it was saved: the same settings, this stage's parameters)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    ids = iter(range(len(order)))
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [next(ids) for _ in g["params"]]}
              for saved, g in zip(full["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": {i: full["state"][n] for i, n in enumerate(order) if n in full["state"]},
                               "param_groups": groups})
# ---- end copy: pipeline parallelism ----


def train_step(pipe, optimizer, batch, clock):
    """One global batch through this rank's stage, timed by phase."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("pipeline"):     # every micro-batch's forward and backward, in schedule order
        pipe.step(x if pipe.first else None, y if pipe.last else None)
    with clock.phase("comm"):         # data parallel over the stage's replicas, if any
        if hasattr(pipe.module, "finish_gradient_synchronization"):
            pipe.module.finish_gradient_synchronization()
    with clock.phase("optim"):
        optimizer.step()


def pp_dp_groups(world_size: int, n_stages: int):
    """This rank's (pipeline group, data-parallel group): pipelines are consecutive ranks,
    a stage's replicas the ranks at the same place in their pipeline. Every rank creates
    every group (new_group is collective)."""
    pipes = [dist.new_group(list(range(k * n_stages, (k + 1) * n_stages))) for k in range(world_size // n_stages)]
    replicas = [dist.new_group(list(range(s, world_size, n_stages))) for s in range(n_stages)]
    rank = dist.get_rank()
    return pipes[rank // n_stages], replicas[rank % n_stages]


# ----------------------------------------------------------------------------------------
# Verification: every stage's weights against one process on the same global batches
# ----------------------------------------------------------------------------------------
VERIFY_DIMS = (64, 256, 4, 2)   # d_model, d_ff, layers, heads: 4 blocks split over up to 4 stages
VERIFY_T = 16
# AdamW's eps is 1e-6 in the check: micro-batches add the gradient up in another order, and
# with the default 1e-8 a gradient that nearly cancels turns that rounding into 1e-5 weight
# differences within a few steps (as in 08); the check is on the pipeline, not on AdamW.


def verify_case(ctx, args, groups, n_stages, m, schedule, batch):
    """The LM pipelined over ``n_stages`` ranks (the remaining ranks data-parallel replicas
    of each stage, DDPBucketed over each stage's replicas), against one process."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    pipe_group, dp_group = groups
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    torch.manual_seed(args.seed)
    d, f, n, h = VERIFY_DIMS
    ref = common.TransformerLM(d, f, n, h, context_length=VERIFY_T).to(ctx.device)
    stage = LMStage(copy.deepcopy(ref), dist.get_rank(pipe_group), n_stages)
    module = bucketed.DDPBucketed(stage, 0.01, process_group=dp_group) if dp_size > 1 else stage
    pipe = Pipeline(module, m, lm_loss, schedule, pipe_group, activation_shape=(batch // dp_size // m, VERIFY_T, d))
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for mod in (ref, module)]
    for step in range(args.verify_steps):
        x, y = common.lm_batch(batch, VERIFY_T, step, args.seed, ctx.device)
        opts[0].zero_grad()
        ref(x, y).backward()
        opts[0].step()
        train_step(pipe, opts[1], (common.shard(x, dp_rank, dp_size), common.shard(y, dp_rank, dp_size)),
                   common.StepClock(ctx.device))
    mine, theirs = dict(stage.named_parameters()), dict(ref.named_parameters())
    ok, diff = bool(mine), 0.0
    for name, p in mine.items():
        diff = max(diff, (p.detach().double() - theirs[name].detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(p, theirs[name])
        except AssertionError:
            ok = False
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"ok": ok, "max_diff": diff, "names": sorted(mine)})
    covered = sorted(n for r in everyone for n in r["names"])   # each parameter on one stage of each replica
    return {"ok": all(r["ok"] for r in everyone) and covered == sorted(sorted(theirs) * dp_size),
            "max_diff": max(r["max_diff"] for r in everyone)}


def verify(ctx, args, n_stages, microbatches):
    """Both schedules at each number of micro-batches; with more ranks than stages, each
    stage has data-parallel replicas."""
    dp = ctx.world_size // n_stages
    groups = pp_dp_groups(ctx.world_size, n_stages)
    batch = 2 * math.lcm(*microbatches) * dp   # two sequences per micro-batch at the largest count
    layout = f"p {n_stages}" + (f" x {dp} replicas" if dp > 1 else "")
    out = {}
    for m in microbatches:
        for schedule in SCHEDULES:
            note = " (model parallelism: two halves)" if (n_stages, m, dp) == (2, 1, 1) else ""
            out[f"{schedule}, {layout}, m {m}{note}"] = verify_case(ctx, args, groups, n_stages, m, schedule, batch)
    return out


# ----------------------------------------------------------------------------------------
# Benchmark: ours against torch.distributed.pipelining, the bubble, activation memory
# ----------------------------------------------------------------------------------------
def torch_pipeline(ctx, args, stage, m, schedule):
    """torch.distributed.pipelining on the same stage module and micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    pstage = PipelineStage(stage, ctx.rank, ctx.world_size, ctx.device)
    return (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pstage, n_microbatches=m, loss_fn=lm_loss)


def torch_pipelining_runs(backend, device) -> bool:
    """torch.distributed.pipelining sends the stage's own tensors: over gloo they must be
    on the CPU (gloo's send/recv abort the rank on CUDA tensors)."""
    return not (backend == "gloo" and device == "cuda")


def benchmark(ctx, args, microbatches):
    """For each number of micro-batches and schedule, ours and torch's on the same stages,
    steps alternating; for ours also the bubble of every step and the activation memory."""
    d, p = common.MODEL_SIZES[args.model_size][0], ctx.world_size
    shape = lambda m: (args.batch_size // m, args.context_length, d)  # noqa: E731
    bubbles = {}

    def build():
        return LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank, p)

    def ours(m, schedule):
        stage = build()
        pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=shape(m), timed=True)
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
        bubbles[(m, schedule)] = []

        def step(batch, clock):   # the idle share of each step, from its action timeline
            train_step(pipe, opt, batch, clock)
            busy = sum(end - start for _, _, start, end in pipe.timeline)
            bubbles[(m, schedule)].append(1 - busy / clock.times["pipeline"])
        return step

    def theirs(m, schedule):
        stage = build()
        sched = torch_pipeline(ctx, args, stage, m, schedule)
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)

        def step(batch, clock):   # contiguous: torch 2.11's stages check the strides of what they get
            x, y = (t.contiguous() for t in batch)
            opt.zero_grad(set_to_none=True)
            with clock.phase("pipeline"):
                sched.step(*([x] if stage.first else []), **({"target": y} if stage.last else {}))
            with clock.phase("comm"):
                pass
            with clock.phase("optim"):
                opt.step()
        return step
    methods = {}
    for m in microbatches:
        for schedule in SCHEDULES:
            methods[f"{schedule}, m {m} (ours)"] = lambda m=m, s=schedule: ours(m, s)
            # torch's Schedule1F1B refuses fewer micro-batches than stages; its stages send CUDA
            # tensors point to point, which gloo cannot carry (main says so)
            if (schedule == "gpipe" or m >= p) and torch_pipelining_runs(ctx.backend, ctx.device.type):
                methods[f"{schedule}, m {m} (torch)"] = lambda m=m, s=schedule: theirs(m, s)
    rows = common.time_methods(ctx, args, methods, global_batch=True)
    everyone = [None] * p
    dist.all_gather_object(everyone, {k: v[-args.steps:] for k, v in bubbles.items()})
    memory = activation_memory(ctx, args, microbatches)
    by_name = {r["method"]: r for r in rows}
    for m in microbatches:
        for schedule in SCHEDULES:
            r, t = by_name[f"{schedule}, m {m} (ours)"], by_name.get(f"{schedule}, m {m} (torch)")
            for row in (r, t) if t else (r,):
                row.update(schedule=schedule, stages=p, microbatches=m, theory=(p - 1) / (m + p - 1))
            per_stage = [common.summarize(e[(m, schedule)])["median"] for e in everyone]
            r.update(bubble=sum(per_stage) / p, bubble_per_stage=per_stage,
                     act_MB_per_stage=[b / 1e6 for b in memory[(m, schedule)]],
                     peak_act_MB=max(memory[(m, schedule)]) / 1e6)
            if t:
                r.update(common.vs_paired(r, t))
    return rows


def activation_memory(ctx, args, microbatches):
    """Peak bytes of activations each stage holds for backward, for each (m, schedule): one
    counted step each (the count is exact, so one step is enough)."""
    d, out = common.MODEL_SIZES[args.model_size][0], {}
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    for m in microbatches:
        for schedule in SCHEDULES:
            stage = LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank,
                            ctx.world_size)
            pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=(args.batch_size // m, args.context_length, d),
                            count_activations=True)
            pipe.step(x if pipe.first else None, y if pipe.last else None)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, pipe.peak_activation_bytes)
            out[(m, schedule)] = everyone
    return out


def timelines(ctx, args, m):
    """One timed step of each schedule on every stage: {schedule: [stage's actions]}."""
    d, out = common.MODEL_SIZES[args.model_size][0], {}
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    for schedule in SCHEDULES:
        stage = LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank,
                        ctx.world_size)
        pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=(args.batch_size // m, args.context_length, d),
                        timed=True)
        for _ in range(3):   # the last step is drawn
            dist.barrier()
            pipe.step(x if pipe.first else None, y if pipe.last else None)
            stage.zero_grad()
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, pipe.timeline)
        out[schedule] = everyone
    return out


def draw_timeline(lanes, title, path):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * len(lanes)))
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for s, actions in enumerate(lanes):
        for kind, i, start, end in actions:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (s - 0.35, 0.7), facecolors=colors[kind],
                           edgecolors="white", linewidth=0.5)
            ax.text((start + end) / 2 * 1e3, s, str(i), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"stage {s}" for s in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms); F = forward, B = backward, numbers: micro-batch")
    ax.set_title(title)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    common.save_figure(fig, path)


HEADERS = ["method", "stages", "microbatches", "step_ms", "step_min_ms", "step_max_ms", "vs_torch", "vs_torch_min",
           "vs_torch_max", "bubble", "theory", "peak_act_MB"]
NAME, TITLE = "09_pipeline_parallel", "Pipeline parallelism: GPipe and 1F1B against torch.distributed.pipelining"


def main(argv=None):
    p = common.script_parser(__doc__)
    p.add_argument("--stages", nargs="+", type=int, default=None,
                   help="pipeline depths, one job each (default: 2 4, with NCCL those this machine has GPUs for)")
    p.add_argument("--replicas", type=int, default=1,
                   help="data-parallel replicas of every stage (world size = stages x replicas)")
    p.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.set_defaults(batch_size=8, context_length=64)
    args = common.parse(p, argv, cpu_size="mini8")   # mini's width, enough blocks to balance 4 stages
    n_layers = common.MODEL_SIZES[args.model_size][2]
    if args.replicas < 1:
        raise common.UsageError(f"--replicas must be at least 1, got {args.replicas}")
    stages = list(dict.fromkeys(args.stages or [s for s in (2, 4) if common.nccl_fits(args.backend, s * args.replicas)]))
    if not stages or not all(common.nccl_fits(args.backend, s * args.replicas) for s in stages):
        raise common.UsageError(f"a pipeline needs 2 or more ranks, and nccl a GPU per rank: {stages or [2]} stages x "
                                f"{args.replicas} replicas but {common.gpu_count()} GPU(s) here; {common.NCCL_HINT}")
    if common.under_torchrun():   # the world is given: every depth must divide it
        bad = [s for s in stages if args.world_size % s]
        if bad:
            raise common.UsageError(f"--stages {bad[0]} does not divide the world size {args.world_size}")
    blocks = ([] if args.no_bench else [(n_layers, f"{args.model_size} has {n_layers} blocks")]) + \
        ([] if args.no_verify else [(VERIFY_DIMS[2], f"the verification LM {VERIFY_DIMS[2]}")])
    top = min([n for n, _ in blocks], default=None)
    for s in stages:   # what this command runs, nothing else
        if s < 2 or (top is not None and s > top):
            raise common.UsageError(f"--stages {s}: a pipeline needs 2 to {top} stages "
                                    f"({', '.join(why for _, why in blocks)})" if top is not None else
                                    f"--stages {s}: a pipeline needs 2 or more stages")
    common.check_divisible(args.batch_size, args.replicas, "--batch-size")
    for m in args.microbatches:
        if m < 1 or (not args.no_bench and (args.batch_size // args.replicas) % m):
            raise common.UsageError(f"--batch-size {args.batch_size} does not split into {args.replicas} x {m} "
                                    f"micro-batches: use micro-batch counts that divide the batch per replica")
    worlds = {s: (args.world_size // s if common.under_torchrun() else args.replicas) * s for s in stages}

    if not args.no_verify:
        for s in stages:
            common.check_verification(common.launch(verify, args, s, args.microbatches, world_size=worlds[s]),
                                      f"{NAME}, {s} stages on {worlds[s]} ranks")
        if 2 in stages and worlds[2] == 2 and not common.under_torchrun():   # pipeline x data: 2 x 2
            if common.nccl_fits(args.backend, 4):
                common.check_verification(common.launch(verify, args, 2, args.microbatches, world_size=4),
                                          f"{NAME}, 2 stages x 2 replicas")
            elif common.is_reporter():
                print(f"verify {NAME}, 2 stages x 2 replicas: skipped (4 NCCL ranks, {common.gpu_count()} GPU(s))")
    if args.no_bench:
        return
    if not torch_pipelining_runs(args.backend, args.device) and common.is_reporter():
        print("torch.distributed.pipelining: not run (its stages send CUDA tensors point to point, which gloo "
              "cannot carry; ours stage them through host memory)")
    rows = []
    for s in stages:   # one job per depth; the table is rewritten after each
        if worlds[s] != s:
            print(f"(the benchmark runs pipelines alone: skipped {s} stages x {worlds[s] // s} replicas)")
            continue
        rows += common.launch(benchmark, args, args.microbatches, world_size=s)
        if common.is_reporter():
            table = common.save_results(args.out, NAME, rows, {**common.lm_settings(args), "world_size": stages},
                                        headers=HEADERS, title=TITLE)
    if rows and common.is_reporter():
        print(f"\n{TITLE}\n({args.model_size} LM, {args.backend}/{args.device}, global batch {args.batch_size}x"
              f"{args.context_length}; step times in ms, median [min, max] of {args.steps} steps; vs_torch: "
              f"median of paired steps; bubble: idle share of a step, mean of the stages; peak_act_MB: "
              f"activations held for backward, largest stage)\n{table}\nwrote {args.out}/{NAME}.json and .md")
    deepest = max(s for s in stages if worlds[s] == s) if rows else None
    if deepest:
        lanes = common.launch(timelines, args, max(args.microbatches), world_size=deepest)
        if common.is_reporter():
            for schedule, stage_lanes in lanes.items():
                path = f"{args.out}/09_timeline_{schedule}.png"
                draw_timeline(stage_lanes, f"{schedule.upper()}: {deepest} stages, {max(args.microbatches)} "
                                           f"micro-batches, one step ({args.model_size} LM, {args.backend}/{args.device})",
                              path)
                print(f"wrote {path}")


if __name__ == "__main__":
    common.run_main(main)
