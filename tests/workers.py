"""Module-level workers for tests (spawned processes find them again by file and name)."""
import contextlib
import copy
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time

import torch
import torch.distributed as dist

import common
import diagnostics
import placement
import sharded_checkpoint


class NoCommDDP(torch.nn.Module):
    """A broken wrapper: broadcasts but never averages gradients. Verification must fail."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def no_sync(self):
        import contextlib
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self):
        pass


def verify_broken(ctx, args):
    """02's verification loop around the broken wrapper, for the "plain" case."""
    naive = common.load_script(os.path.join(common.ROOT, "02_naive_ddp.py"))
    run = common.VerifyRun(ctx, args, common.VERIFY_CASES["plain"])
    model = NoCommDDP(run.model)
    optimizer = run.optimizer(model.parameters())
    for step in range(run.steps):
        naive.train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
    return {"plain": run.compare(model.module)}


def failed_at(folder):
    """The moment a rank fails on purpose, in ``folder``/failed_at: a test measures how fast
    the job reacts from there, not from its command's start (which counts every
    interpreter's start-up, twice as long on a slow machine)."""
    with open(os.path.join(folder, "failed_at"), "w") as f:
        f.write(repr(time.time()))


def fail_on_rank_1(ctx, args):
    """Rank 1 raises while rank 0 waits in a collective that can never complete."""
    with open(os.path.join(args.pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(0.5)
        failed_at(args.pid_dir)
        raise ValueError("boom from the test")
    dist.all_reduce(torch.ones(1))
    time.sleep(600)


def sleep_forever(ctx, args):
    with open(os.path.join(args.pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _wrapper(args):
    mod = common.load_script(os.path.join(common.ROOT, args.script + ".py"))
    cls = getattr(mod, args.cls)
    return (lambda m: cls(m, *args.cls_args))


def record_event_order(ctx, args):
    """One training step of the toy model, logging collective launches against backward.

    Returns the event log: 'all_reduce:<numel>' for each collective, 'input_grad' when
    backward computes the gradient of the input (the last thing it computes), and
    'backward_returned' after loss.backward() returns.
    """
    log = []
    real = dist.all_reduce

    def logged(t, *a, **k):
        log.append(f"all_reduce:{t.numel()}")
        return real(t, *a, **k)
    dist.all_reduce = logged
    try:
        torch.manual_seed(0)
        model = _wrapper(args)(common.ToyModel(unused=args.unused))
        x0 = torch.randn(8, 20)
        y = torch.randint(0, 10, (8,))
        for step in range(2):
            x = x0.clone().requires_grad_(True)
            log.append(f"step:{step}")
            use_extra = args.uneven and ctx.rank == 0
            loss = torch.nn.functional.cross_entropy(model(x, use_extra=use_extra), y)
            x.register_hook(lambda g: log.append("input_grad"))
            loss.backward()
            log.append("backward_returned")
            model.finish_gradient_synchronization()
            log.append("finished")
            for p in model.module.parameters():
                p.grad = None
    finally:
        dist.all_reduce = real
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, log)
    return everyone



def verify_on_subgroups(ctx, args, script, layouts, cases):
    """For each layout (lists of ranks), split the ranks into data-parallel groups and run
    the script's verification on this rank's group, each group with its own data:
    {layout index: every rank's {"group", "results"}}."""
    import argparse
    mod = common.load_script(os.path.join(common.ROOT, script + ".py"))
    out = {}
    for k, layout in enumerate(layouts):
        groups = [dist.new_group(ranks) for ranks in layout]   # every rank creates every group
        mine = next(i for i, ranks in enumerate(layout) if ctx.rank in ranks)
        own = argparse.Namespace(**{**vars(args), "seed": 100 + mine})
        results = mod.verify(ctx, own, cases, groups[mine])
        out[k] = [None] * ctx.world_size
        dist.all_gather_object(out[k], {"group": mine, "results": results})
    return out


def world_ddp_on_subgroups(ctx, args, layout):
    """The control: 02's verification loop on a subgroup's data, but with a NaiveDDP that
    averages over every rank instead of its group."""
    import argparse
    groups = [dist.new_group(ranks) for ranks in layout]
    mine = next(i for i, ranks in enumerate(layout) if ctx.rank in ranks)
    naive = common.load_script(os.path.join(common.ROOT, "02_naive_ddp.py"))
    run = common.VerifyRun(ctx, argparse.Namespace(**{**vars(args), "seed": 100 + mine}),
                           common.VERIFY_CASES["plain"], groups[mine])
    model = naive.NaiveDDP(run.model)   # no process_group: the world
    optimizer = run.optimizer(model.parameters())
    for step in range(run.steps):
        naive.train_step(model, optimizer, run.batch(step), common.StepClock(ctx.device), **run.step_options(step))
    return run.compare(model.module)


def copied_region(script: str, name: str | None) -> str:
    """Exactly the text between a script's begin-copy and end-copy marks for ``name``; a
    library file's whole text where ``name`` is None (placement.py: a copy is the file)."""
    with open(os.path.join(common.ROOT, script + ".py")) as f:
        text = f.read()
    if name is None:
        return text
    begin = text.index(f"# ---- begin copy: {name} ")
    start = text.index("\n", begin) + 1
    return text[start:text.index(f"# ---- end copy: {name} ----")]


def region_header(script: str, name: str | None) -> str:
    """What a region's first line (a library file's docstring) says a copy needs."""
    text = copied_region(script, None)
    if name is None:
        return text.split('"""')[1]
    begin = text.index(f"# ---- begin copy: {name} ")
    return text[begin:text.index("\n", begin)]


def kit_files(src: str) -> list:
    """The kit's own files (top-level .py beside the scripts) that ``src`` imports."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(src)):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        found |= {m.split(".")[0] for m in mods if os.path.exists(os.path.join(common.ROOT, m.split(".")[0] + ".py"))}
    return sorted(found)


def load_copy(script: str, name: str | None):
    """The copied region as a fresh module: nothing in it but what the region imports, and
    the kit's files it names (placement.py) loaded from copies of their own, as in a
    project of the user's that holds the region and those files alone."""
    import importlib.util
    import shutil
    import tempfile
    import types
    src = copied_region(script, name)
    files = kit_files(src)
    saved = {m: sys.modules.pop(m) for m in files if m in sys.modules}
    with tempfile.TemporaryDirectory() as folder:
        try:
            for m in files:   # (a named file's own imports are named files too: test_layout checks)
                shutil.copy(os.path.join(common.ROOT, m + ".py"), folder)
            sys.path.insert(0, folder)   # a named file importing another finds its copy
            for m in files:
                if m not in sys.modules:
                    spec = importlib.util.spec_from_file_location(m, os.path.join(folder, m + ".py"))
                    sys.modules[m] = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(sys.modules[m])
            mod = types.ModuleType(f"copy_of_{name or script}")
            exec(compile(src, f"<copy of {name or script} from {script}.py>", "exec"), mod.__dict__)
        finally:
            if sys.path and sys.path[0] == folder:
                sys.path.pop(0)
            for m in files:
                sys.modules.pop(m, None)
            sys.modules.update(saved)
    return mod


def train_with_copied_regions(ctx, args, classes):
    """train_with_copied_region for each (script, class name): {name: result}."""
    return {name: train_with_copied_region(ctx, args, script, name) for script, name in classes.items()}


def train_sharded_copy(ctx, args, mod, stage):
    run = common.VerifyRun(ctx, args, {"opt": "adamw", "tied": True, "unused": True, "frozen": True})
    params = [p for p in run.model.parameters() if p.requires_grad]
    if stage == 1:
        wrapped = load_copy("02_naive_ddp", "NaiveDDP").NaiveDDP(run.model)
        optimizer = mod.ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    else:
        wrapped = run.model
        optimizer = mod.ShardedGradientOptimizer(params, torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                                                 bucket_mb=0.002, module=run.model)
    for step in range(run.steps):
        x, y = run.batch(step)
        optimizer.zero_grad()
        wrapped(x, y, use_extra=run.step_options(step)["use_extra"]).backward()
        if stage == 1:
            wrapped.finish_gradient_synchronization()
        optimizer.step()
    return run.compare(run.model)


def train_with_copied_region(ctx, args, script, name):
    """An ordinary training loop with the class from its copied region alone (the sharded
    optimizer under 02's copied NaiveDDP), against one process on the whole batches."""
    mod = load_copy(script, name)
    if script == "08_tensor_parallel":
        return train_tp_copy(ctx, args, mod)
    if script == "09_pipeline_parallel":
        return train_pipeline_copy(ctx, args, mod)
    if script == "10_nd_parallel":
        return train_with_copied_mesh(ctx, args, mod)
    if script == "11_context_parallel":
        return train_cp_copy(ctx, args, mod)
    if script == "12_expert_parallel":
        return train_moe_copy(ctx, args, mod)
    if script == "14_fault_tolerant_dp":
        return train_ft_copy(ctx, args, mod)
    if name == "sharded optimizers":   # stage 1 under 02's copied NaiveDDP, stage 2 alone
        one, two = (train_sharded_copy(ctx, args, mod, stage) for stage in (1, 2))
        return {"ok": one["ok"] and two["ok"], "max_diff": max(one["max_diff"], two["max_diff"])}
    case = {"opt": "adamw", "tied": True} if name == "FSDP" else {"opt": "adamw", "tied": True, "unused": True}
    run = common.VerifyRun(ctx, args, case)
    model = run.model
    wrapped = getattr(mod, name)(model, *((1e-6,) if name == "DDPBucketed" else ()))
    optimizer = run.optimizer(wrapped.parameters())
    for step in range(run.steps):
        x, y = run.batch(step)
        optimizer.zero_grad()
        wrapped(x, y, use_extra=run.step_options(step)["use_extra"]).backward()
        wrapped.finish_gradient_synchronization()
        optimizer.step()
    if name != "FSDP":
        return run.compare(model)
    full = wrapped.gather_full_params()
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in run.reference.named_parameters())
    ok = all(torch.allclose(full[n], p.detach(), rtol=1.3e-6, atol=1e-5) for n, p in run.reference.named_parameters())
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"ok": ok, "max_diff": diff})
    return {"ok": all(r["ok"] for r in everyone), "max_diff": max(r["max_diff"] for r in everyone)}


def tp_without_backward_all_reduce(ctx, args):
    """The control for 08: its verification with f's backward all-reduce removed."""
    tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
    tp._CopyToParallel.backward = staticmethod(lambda c, grad: (grad, None))
    return tp.verify(ctx, args, [ctx.world_size])


def sp_without_norm_gradient_sum(ctx, args):
    """The control for 08's sequence parallelism: the norms' gradients left as each rank's
    part of the sequence made them (no sum over the group)."""
    tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
    tp._sum_over = lambda group: (lambda grad: grad)
    return tp.verify(ctx, args, [ctx.world_size])


def pipeline_recompute_perturbed(ctx, args):
    """The control for 09's recomputation: a full recompute whose second run of each block
    (the one in backward) sees its input slightly changed: its check must fail."""
    pp = common.load_script(os.path.join(common.ROOT, "09_pipeline_parallel.py"))
    real = pp.recompute

    def perturbed(blocks, mode="full"):
        blocks = list(blocks)
        if mode == "full":
            for block in blocks:
                calls = [0]

                def forward(x, f=block.forward, calls=calls):
                    calls[0] += 1
                    return f(x + 1e-2 * (calls[0] % 2 == 0))   # even calls: the recomputation
                block.forward = forward
        return real(blocks, mode)
    pp.recompute = perturbed
    return pp.verify(ctx, args, 2, [2], ["1f1b"], 1, ["none", "full"])


def zero2_during_backward(ctx, args):
    """06's ZeRO-2 on the toy model in small buckets: reduce-scatters issued while backward
    runs, no whole gradient left on a parameter, each rank's slice half the padded bucket,
    and the ranks' pieces covering every parameter once."""
    sharded = common.load_script(os.path.join(common.ROOT, "06_sharded_optimizer.py"))
    torch.manual_seed(0)
    model = common.ToyModel(20, n_classes=10)
    opt = sharded.ShardedGradientOptimizer(model.parameters(), torch.optim.SGD, bucket_mb=0.002, lr=0.1)
    launched, real = [], sharded._GradBucket.launch

    def counted(self):
        launched.append(torch._C._current_graph_task_id() >= 0)   # inside backward's graph task
        return real(self)
    sharded._GradBucket.launch = counted
    x, y = torch.randn(8, 20), torch.randint(0, 10, (8,))
    model(common.shard(x, ctx.rank, 2), common.shard(y, ctx.rank, 2)).backward()
    whole = sum(p.grad is not None for p in model.parameters())
    opt.step()
    covered = [None, None]
    dist.all_gather_object(covered, [(n, opt.buckets[i].piece_range[p]) for i, b in enumerate(opt.buckets)
                                     for n, p in model.named_parameters() if p in b.pieces])
    per = {}
    for n, r in covered[0] + covered[1]:
        per.setdefault(n, []).append(r)
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    cover = all(sum(b - a for a, b in per.get(n, [])) == sizes[n] for n in sizes)
    b = opt.buckets[0]
    return {"launched_in_backward": sum(launched), "whole_grads_after_backward": whole,
            "slice_numel": b.k, "padded_numel": b.flat.numel(), "pieces_cover": cover}


def zero2_without_reduction(ctx, args):
    """The control for 06's ZeRO-2: its buckets' reduce-scatter replaced by keeping this
    rank's own slice (no sum over the ranks): its check must fail."""
    sharded = common.load_script(os.path.join(common.ROOT, "06_sharded_optimizer.py"))
    real = sharded._reduce_scatter   # (the module's own name for it: torch's newer or older one)

    def local_only(out, inp, group=None, async_op=False):
        r = dist.get_rank(group)
        out.copy_(inp.view(dist.get_world_size(group), -1)[r])
        return real(torch.empty_like(out), inp, group=group, async_op=async_op)
    sharded._reduce_scatter = local_only
    try:
        return sharded.verify_case(ctx, args, sharded.CASES["adamw"], stage=2)
    finally:
        sharded._reduce_scatter = real


class SmallMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(20, 32)
        self.down = torch.nn.Linear(32, 20)
        self.head = torch.nn.Linear(20, 10)

    def forward(self, x, targets=None, use_extra=False):
        return torch.nn.functional.cross_entropy(self.head(x + self.down(torch.relu(self.up(x)))), targets)


def train_tp_copy(ctx, args, mod):
    """08's copied layers: parallelize a small MLP, train it with AdamW, compare the
    gathered weights with one process."""
    import copy
    torch.manual_seed(0)
    ref = SmallMLP()
    model = mod.parallelize(copy.deepcopy(ref), {"up": "column", "down": "row"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, model)]
    for step, (x, y) in enumerate(common.verify_batches(args, 3, 8)[0]):
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            m(x, y).backward()
            opt.step()
    full = mod.full_state_dict(model, all_ranks=True)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"ok": diff < 1e-5 and set(full) == set(dict(ref.named_parameters())), "max_diff": diff}


def train_cp_copy(ctx, args, mod):
    """11's copied region: the kit's LM over 2 ranks with ring attention (zig-zag), the
    weights' gradients averaged by hand, AdamW, against one process on whole sequences."""
    import copy
    torch.manual_seed(0)
    ref = common.TransformerLM(32, 64, 2, 4, context_length=16)
    model = mod.context_parallel_lm(copy.deepcopy(ref), None, "ring", "zigzag")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, model)]
    for step in range(3):
        x, y = common.lm_batch(2, 16, step, 0, "cpu")
        for opt in opts:
            opt.zero_grad()
        ref(x, y).backward()
        model(*(mod.shard_sequence(t, ctx.rank, ctx.world_size) for t in (x, y))).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        for opt in opts:
            opt.step()
    diff = common.max_param_diff(model, ref)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, diff)
    return {"ok": max(everyone) < 1e-5, "max_diff": max(everyone)}


def train_ft_copy(ctx, args, mod):
    """14's copied region: each rank a replica of its own (its own group of one rank), the
    Coordinator on rank 0 (at least 2 replicas a quorum), an ordinary loop with
    ReplicaManager, against one process on the whole batches (every step with both): its
    one all-reduce after backward; bucket_mb's buckets during backward (several, the one
    holding the parameter that gets no gradient launched after it); those with 2
    micro-batches a step, the first inside no_sync. Two backward passes outside no_sync are
    refused, not summed wrong."""
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    out = {}
    for label, bucket_mb, accum in (("after backward", None, 1), ("buckets", 0.004, 1), ("buckets, accum", 0.004, 2),
                                    ("twice", 0.004, 2)):
        run = common.VerifyRun(ctx, args, {"opt": "adamw", "tied": True, "unused": True, "accum": accum})
        coordinator = mod.Coordinator(min_replicas=2) if ctx.rank == 0 else None
        box = [coordinator.address if coordinator else None]
        dist.broadcast_object_list(box, src=0)
        optimizer = run.optimizer(run.model.parameters())
        manager = mod.ReplicaManager(run.model, optimizer, box[0], replica_id=ctx.rank,
                                     process_group=groups[ctx.rank], bucket_mb=bucket_mb, first_bucket_mb=0.001)
        committed = 0
        try:
            while manager.start_step(run.steps):
                x, y = run.batch(manager.step)
                extra = run.step_options(manager.step)["use_extra"]
                for k, (xk, yk) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
                    quiet = k < accum - 1 and label != "twice"
                    with manager.no_sync() if quiet else contextlib.nullcontext():
                        (run.model(xk, yk, use_extra=extra) / accum).backward()
                if manager.should_commit(manager.all_reduce_gradients()):
                    optimizer.step()
                    committed += 1
                optimizer.zero_grad()
            out[label] = {**run.compare(run.model), "committed": committed == run.steps,
                          "buckets": len(manager.buckets)}
        except RuntimeError as e:
            out[label] = {"refused": str(e)}
        dist.barrier()
        if coordinator:
            coordinator.close()
    cases = [out[k] for k in ("after backward", "buckets", "buckets, accum")]
    return {"ok": all(c["ok"] and c["committed"] for c in cases) and out["buckets"]["buckets"] > 2
            and "run every backward of the step but the last inside manager.no_sync()" in out["twice"].get("refused", ""),
            "max_diff": max(c["max_diff"] for c in cases), "cases": out}


def ft_coordinator_dies_mid_all_reduce(ctx, args):
    """14's coordinator, a process of its own, killed while replica 0 (this job's rank 0, each
    rank a replica) waits in the cross-replica all-reduce for replica 1, which comes late:
    each replica must learn that the coordinator is gone (CoordinatorGone, the word its
    loop saves on), not fail on the coordinator's store with another error."""
    import subprocess
    import threading
    ft = common.load_script(os.path.join(common.ROOT, "14_fault_tolerant_dp.py"))
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    proc = None
    if ctx.rank == 0:
        run = tempfile.mkdtemp(prefix="ft-run-")   # (its record; removed with the test's temporary folder)
        proc = subprocess.Popen([sys.executable, os.path.join(common.ROOT, "14_fault_tolerant_dp.py"), "--coordinator",
                                 "--port", "0", "--min-replicas", "2", "--run-dir", run,
                                 "--parent", str(os.getpid())], stdout=subprocess.PIPE, text=True)   # (gone with it)
    box = [proc.stdout.readline().split()[2] if proc else None]
    dist.broadcast_object_list(box, src=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ft.ReplicaManager(model, opt, box[0], replica_id=ctx.rank, process_group=groups[ctx.rank])
    late = None
    try:   # first a step that replica 1 comes to 3.5 s late (a slow backward): later than the group's
        manager.start_step()   # timeout was (detect's window; 3 s by default), and it commits
        model(torch.randn(4, 64)).square().mean().backward()
        if ctx.rank == 1:
            time.sleep(3.5)
        late = manager.should_commit(manager.all_reduce_gradients())
        opt.step()
        opt.zero_grad()
        manager.start_step()
        model(torch.randn(4, 64)).square().mean().backward()
        if proc:   # the coordinator dies while this replica waits for the other's all-reduce
            threading.Timer(0.3, proc.kill).start()
        else:
            time.sleep(1.0)
        manager.should_commit(manager.all_reduce_gradients())
        said = "not gone"
    except ft.CoordinatorGone as e:
        said = "gone: " + str(e)
    except RuntimeError as e:
        said = f"{type(e).__name__}: {e}"
    if proc:
        proc.wait()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (late, said))
    return everyone


def train_moe_copy(ctx, args, mod):
    """12's copied region: a MoE MLP (4 experts, top-2) with its experts over 2 ranks, the
    router's gradient averaged by hand and the experts' reduced by the region's function,
    against one process that routes each rank's rows as that rank does."""
    import copy
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), mod.MoE(8, 16, 4, 2))
    model = copy.deepcopy(ref)
    model[1].distribute()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 6, 8, generator=g)
        for opt in opts:
            opt.zero_grad()
        sum(ref(x[r]).square().mean() + 0.01 * ref[1].aux for r in range(2)).div(2).backward()
        (model(x[ctx.rank]).square().mean() + 0.01 * model[1].aux).backward()
        experts = {id(p) for p in mod.expert_parameters(model)}
        for p in model.parameters():
            if id(p) not in experts:
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
        mod.reduce_expert_gradients(model)
        for opt in opts:
            opt.step()
    theirs = dict(ref.named_parameters())
    diff = max((p.detach() - theirs[n].detach()).abs().max().item() for n, p in model.named_parameters())
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, diff)
    return {"ok": max(everyone) < 1e-5, "max_diff": max(everyone)}


def pipeline_stage_fails(ctx, args):
    """Stage 1 raises in its second micro-batch's forward while stage 0 waits to receive
    that micro-batch's gradient."""
    with open(os.path.join(args.pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    pp = common.load_script(os.path.join(common.ROOT, "09_pipeline_parallel.py"))
    stage = pp.LMStage(common.build_lm("nano", 16, "cpu"), ctx.rank, 2)
    if ctx.rank == 1:
        calls = [0]
        real = stage.forward

        def forward(x):
            calls[0] += torch.is_grad_enabled()   # (the schedule's forwards: the first step's look at shapes runs one
            if calls[0] == 2:                     # without autograd before them)
                failed_at(args.pid_dir)
                raise ValueError("stage 1 broke on purpose")
            return real(x)
        stage.forward = forward
    pipe = pp.Pipeline(stage, 4, pp.lm_loss, "gpipe", activation_shape=(1, 16, 64))
    x, y = common.lm_batch(4, 16, 0, 0, "cpu")
    pipe.step(x if pipe.first else None, y if pipe.last else None)


def train_pipeline_copy(ctx, args, mod):
    """09's copied region: a 4-block LM in two stages, 1F1B over 4 micro-batches, AdamW,
    against one process."""
    import copy
    torch.manual_seed(0)
    ref = common.TransformerLM(32, 64, 4, 2, context_length=8)
    stage = mod.LMStage(copy.deepcopy(ref), ctx.rank, ctx.world_size)
    pipe = mod.Pipeline(stage, 4, mod.lm_loss, "1f1b", activation_shape=(2, 8, 32))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, stage)]
    for step in range(3):
        x, y = common.lm_batch(8, 8, step, 0, "cpu")
        for opt in opts:
            opt.zero_grad()
        ref(x, y).backward()
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        for opt in opts:
            opt.step()
    theirs = dict(ref.named_parameters())
    diff = max((p - theirs[n]).abs().max().item() for n, p in stage.named_parameters())
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, diff)
    return {"ok": max(everyone) < 1e-5, "max_diff": max(everyone)}


if __name__ == "__main__":
    import argparse
    pid_dir, what = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "fail_on_rank_1")
    common.run_main(lambda: common.launch(
        globals()[what], argparse.Namespace(pid_dir=pid_dir), world_size=2, backend="gloo", device="cpu", timeout=300))


def copied_ring_and_tree(ctx, args):
    """01's ring and tree all-reduce from their copied region alone, against dist.all_reduce
    on integer tensors (exactly), on the world and on the even ranks' subgroup, directly and
    staged through host memory (forced: on a GPU, gloo needs it); and ping-pong both ways."""
    mod = load_copy("01_allreduce_bench", "point-to-point")
    n = ctx.world_size
    evens = dist.new_group(list(range(0, n, 2)))
    g = torch.Generator().manual_seed(ctx.rank)
    checked = 0
    for group in (None, evens):
        if group is not None and ctx.rank % 2:
            continue
        for numel in (1, 5, 1003):
            x = torch.randint(-10**6, 10**6, (numel,), generator=g)
            want = x.clone()
            dist.all_reduce(want, group=group)
            for fn in (mod.ring_all_reduce, mod.tree_all_reduce):
                for staging in (False, True):
                    got = fn(x.clone(), group, host_staging=staging)
                    assert torch.equal(got, want), (fn.__name__, numel, group, staging)
                    checked += 1
    for staging in (False, True):   # ranks 0 and 1: 0 sends its values, 1 sends back what came
        if ctx.rank < 2:
            mine, out = torch.full((7,), float(ctx.rank + 1)), torch.zeros(7)
            mod.ping_pong(mine, out, 1 - ctx.rank, ctx.rank == 0, host_staging=staging)
            assert torch.equal(out, torch.full((7,), 1.0)), (ctx.rank, staging, out)
            checked += 1
    return checked


def unrun_cases_fail_their_check(ctx, args, ops):
    """Each op's buffers before the op runs: the check must see the difference."""
    bench = common.load_script(common.ROOT / "01_allreduce_bench.py")
    n = ctx.world_size
    halves = [dist.new_group(list(range(n // 2))), dist.new_group(list(range(n // 2, n)))]
    caught = {}
    for op in ops:
        run, out, expected, nbytes = bench.op_case(op, ctx, 1000, halves)
        caught[op] = expected is None or not torch.equal(out, expected)
        run()   # keep every rank's calls matched
        common.sync(ctx.device)
        caught[op] = caught[op] and (expected is None or torch.equal(out, expected))
    return caught


def torch_tp_with_foreach(ctx, args):
    """08's torch baseline and our TP from the same LM, 3 AdamW steps each with
    foreach=True (the CUDA default, where DTensors and plain tensors must not mix): the
    whole weights must agree."""
    from torch.distributed.device_mesh import init_device_mesh
    tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    theirs = tp.torch_tensor_parallel_lm(common.build_lm("micro", 16, "cpu"), mesh)
    ours = tp.tensor_parallel_lm(common.build_lm("micro", 16, "cpu"))
    for model in (theirs, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=True)
        for step in range(3):
            opt.zero_grad()
            model(*common.lm_batch(4, 16, step, 0, "cpu")).backward()
            opt.step()
    whole = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    order = tp.heads_by_rank(4, 32, ctx.world_size)   # torch's qkv rows are in our rank order
    full = tp.full_state_dict(ours, all_ranks=True)
    for name, t in full.items():
        if name.endswith("qkv.weight"):
            full[name] = t[order]
    diff = max((whole[n] - full[n]).abs().max().item() for n in full)
    return {"names_match": set(whole) == set(full), "max_diff": diff}


def pipeline_staged_equals_direct(ctx, args):
    """09's Pipeline over 2 stages (1F1B, 4 micro-batches) sending directly and staged
    through host memory (forced, as gloo needs on a GPU): the same loss and gradients, bit
    for bit."""
    pp = common.load_script(os.path.join(common.ROOT, "09_pipeline_parallel.py"))
    x, y = common.lm_batch(8, 16, 0, 0, "cpu")
    out = {}
    for schedule in pp.SCHEDULES:
        got, v = [], 2 if schedule == "interleaved" else 1
        for staging in (False, True):
            torch.manual_seed(0)
            stage = pp.LMStage(common.TransformerLM(64, 256, 4, 2, context_length=16), ctx.rank, 2, v)
            pipe = pp.Pipeline(stage, 4, pp.lm_loss, schedule, activation_shape=(2, 16, 64), host_staging=staging,
                               chunks=v)
            loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
            got.append((loss, [p.grad.clone() for p in stage.parameters()]))
        (loss0, g0), (loss1, g1) = got
        same = all(torch.equal(a, b) for a, b in zip(g0, g1)) and (loss0 is None or torch.equal(loss0, loss1))
        out[schedule] = [None] * ctx.world_size
        dist.all_gather_object(out[schedule], same)
    return out


def ring_staged_equals_direct(ctx, args):
    """11's ring attention over 2 ranks, direct, staged through host memory (forced), and
    staged with its backward on another thread (as a GPU's autograd runs it, the ring's
    messages then sent from that thread under the flight recorder): the same output and
    gradients, bit for bit."""
    import threading
    cpm = common.load_script(os.path.join(common.ROOT, "11_context_parallel.py"))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (cpm.shard_sequence(torch.randn(1, 2, 16, 8, generator=g), ctx.rank, 2, dim=2) for _ in range(4))
    got = []
    for staging, thread in ((False, False), (True, False), (True, True)):
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = cpm.context_parallel_attention(*mine, method="ring", host_staging=staging)
        failed = []

        def backward():
            try:
                out.backward(dout)
            except BaseException as e:   # raised here, on the main thread
                failed.append(e)
        if thread:
            t = threading.Thread(target=backward)
            t.start()
            t.join()
        else:
            backward()
        if failed:
            raise failed[0]
        got.append([out.detach()] + [x.grad for x in mine])
    same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*got))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, same)
    return everyone


def ring_kernels_equal_sdpa(ctx, args):
    """11's ring and all-gather attention through the fused kernel and through the
    hand-written tiles, against one process's SDPA on the whole sequence: every layout,
    causal or not, 4 query heads over 4 or 2 key/value heads (grouped-query). Each case's
    largest difference of output and q, k, v gradients, the worst over the ranks."""
    import torch.nn.functional as F
    cpm = common.load_script(os.path.join(common.ROOT, "11_context_parallel.py"))
    cp, diffs = ctx.world_size, {}
    for layout in cpm.LAYOUTS:
        for hk in (4, 2):
            for causal in (True, False):
                g = torch.Generator().manual_seed(hk)
                t = 2 * cp * 20   # tiles of 128 and chunks of 20 tokens: every block smaller than a tile
                q = torch.randn(2, 4, t, 16, generator=g)
                k, v = (torch.randn(2, hk, t, 16, generator=g) for _ in range(2))
                dout = torch.randn(2, 4, t, 16, generator=g)
                whole = [x.clone().requires_grad_() for x in (q, k, v)]
                ref = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=True)
                ref.backward(dout)
                mine = lambda x: cpm.shard_sequence(x, ctx.rank, cp, layout, dim=2)  # noqa: E731
                for method in ("ring", "allgather"):
                    for kernel in ("cpu", "math"):
                        part = [mine(x).clone().requires_grad_() for x in (q, k, v)]
                        if method == "ring":
                            out = cpm._RingAttention.apply(*part, None, layout, False, None, causal, kernel)
                        else:
                            out = cpm._GatheredAttention.apply(*part, None, layout, causal, kernel)
                        out.backward(mine(dout))
                        d = max((a - mine(b)).abs().max().item() for a, b in
                                zip([out] + [x.grad for x in part], [ref] + [x.grad for x in whole]))
                        diffs[f"{method} {kernel} {layout} {hk} kv heads{' causal' if causal else ''}"] = d
    everyone = [None] * cp
    dist.all_gather_object(everyone, diffs)
    return {k: max(e[k] for e in everyone) for k in diffs}


def step_memory_of(ctx, args, method):
    """07's step_memory for ``method`` ("ddp": DDPBucketed, "fsdp": FSDP; AdamW) on an LM of
    4 blocks with a small vocabulary (so the blocks, not the root, hold most parameters);
    every rank's row, and the whole parameters' MiB."""
    fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))
    bucketed = common.load_script(os.path.join(common.ROOT, "05_bucketed_ddp.py"))

    def make():
        torch.manual_seed(0)
        lm = common.TransformerLM(128, 512, 4, 4, vocab_size=500, context_length=32)
        model = bucketed.DDPBucketed(lm, 25) if method == "ddp" else fsdp.FSDP(lm)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 500, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = tuple(common.shard(t, ctx.rank, ctx.world_size) for t in (tokens[:, :-1], tokens[:, 1:]))
    whole = sum(p.numel() * 4 for p in common.TransformerLM(128, 512, 4, 4, vocab_size=500,
                                                             context_length=32).parameters()) / 2**20
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {**fsdp.step_memory(ctx, make, batch), "whole_MB": whole})
    return everyone


def nd_controls(ctx, args):
    """10's checks must fail when the composition is wrong: the tied embedding's two copies
    not summed (pp 4), a replicated parameter's gradient counted in the norm on every tp
    rank (tp 2 x pp 2); and clipping must be active in the check."""
    nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
    out, real_finish, real_counts = {}, nd.ParallelLM.finish_gradient_synchronization, placement._counter
    clipped, real_clip = [], nd.ParallelLM.clip_grad_norm_

    def clip(self, max_norm):
        norm = real_clip(self, max_norm)
        clipped.append(norm.item() > max_norm)
        return norm
    nd.ParallelLM.clip_grad_norm_ = clip
    try:
        nd.ParallelLM.finish_gradient_synchronization = lambda self: None   # no DP, no FSDP here: only the sum
        out["untied sum"] = nd.verify_mesh(ctx, args, nd.mesh_of(pp=4), nd.Levers(tie=True))
        nd.ParallelLM.finish_gradient_synchronization = real_finish
        placement._counter = lambda *groups: lambda tensor: True   # the placement record ignored
        out["norm counted on every tp rank"] = nd.verify_mesh(ctx, args, nd.mesh_of(pp=2, tp=2))
    finally:
        nd.ParallelLM.finish_gradient_synchronization, placement._counter = real_finish, real_counts
        nd.ParallelLM.clip_grad_norm_ = real_clip
    out["clipped"] = all(clipped)
    return out


def nd_accounting(ctx, args, shapes):
    """10's account() on each (mesh, schedule) (the verification LM, the tied one at pp x tp)."""
    nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
    out = []
    for shape, schedule, *ep in shapes:
        m = nd.default_microbatches(shape)
        tie = shape["pp"] > 1 and shape["tp"] > 1
        out.append(nd.account(ctx, args, shape, nd.VERIFY_LM, 2 * m * shape["dp"] * shape["fsdp"],
                              nd.Levers(tie=tie, schedule=schedule, ep=ep[0] if ep else 1)))
    return out


def nd_levers(ctx, args, cases):
    """10's verify_mesh on each (mesh, schedule, levers): {name: result}; and account() on
    those that run in float32 (the formulas count float32): {name: every rank's row}."""
    nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
    out, accounting = {}, {}
    for shape, schedule, options in cases:
        levers = nd.Levers(schedule=schedule, **options)
        name = nd.label(shape, False, schedule) + nd.lever_label(levers)
        out[name] = nd.verify_mesh(ctx, args, shape, levers)
        if levers.dtype == "float32":
            m = nd.default_microbatches(shape)
            accounting[name] = nd.account(ctx, args, shape, nd.VERIFY_LM, 2 * m * shape["dp"] * shape["fsdp"], levers)
    return out, accounting


def nd_mesh_groups(ctx, args):
    """10's Mesh at 8 ranks (pp 2 x dp 2 x tp 2): this rank's coordinates, its groups'
    ranks, an all-reduce of the ranks over each group, and the first-and-last-stage group."""
    nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
    mesh = nd.Mesh(nd.mesh_of(pp=2, dp=2, tp=2))
    got = {"coords": mesh.coords, **{a: mesh.ranks(a) for a in ("tp", "dp", "pp")}, "sums": {}}
    for axis in ("tp", "dp", "pp"):
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=mesh.group(axis))
        got["sums"][axis] = int(t.item())
    ends = mesh.subgroup("pp", [0, 1])
    got["ends"] = None if ends is None else sorted(dist.get_process_group_ranks(ends))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, got)
    return everyone


def train_with_copied_mesh(ctx, args, mod):
    """10's copied Mesh on 2 ranks as dp 2 x tp 1: 02's copied NaiveDDP over its dp group
    trains like one process (and its tp groups hold one rank each)."""
    mesh = mod.Mesh({"dp": 2, "tp": 1})
    assert mesh.ranks("tp") == [ctx.rank] and mesh.ranks("dp") == [0, 1] and mesh.coord("dp") == ctx.rank
    run = common.VerifyRun(ctx, args, {"opt": "adamw", "tied": True}, mesh.group("dp"))
    model = load_copy("02_naive_ddp", "NaiveDDP").NaiveDDP(run.model, process_group=mesh.group("dp"))
    optimizer = run.optimizer(model.parameters())
    for step in range(run.steps):
        x, y = run.batch(step)
        optimizer.zero_grad()
        model(x, y).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    return run.compare(run.model)


def fsdp_resume_runs(ctx, args, runs):
    """07's resume runs one after another in these processes: each (function name, path,
    start, stop, save_at) on batches of 16 sequences; their final weights."""
    fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))
    return [getattr(fsdp, run)(ctx, args, path, start, stop, save_at, 16) for run, path, start, stop, save_at in runs]


def checkpoint_crash(ctx, args, folder, phase):
    """A small model under 07's FSDP on 2 ranks, sharded checkpoints in ``folder``. "save":
    one step, saved as step 1; another step, and saving step 2 rank 1 dies (SIGKILL-like
    exit) once its tensor file is written, before its piece of the metadata. "load": the
    newest complete checkpoint loaded into a fresh model: its whole weights and the
    checkpoint's extra."""
    fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))
    torch.manual_seed(0)
    model = fsdp.FSDP(torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.GELU(), torch.nn.Linear(15, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))).square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
    if phase == "load":
        latest = sharded_checkpoint.latest_checkpoint(folder)
        extra = sharded_checkpoint.load_sharded(model.module, opt, latest)
        return {"latest": os.path.basename(latest), "extra": extra, "weights": model.full_state_dict()}
    step()
    sharded_checkpoint.save_sharded(model.module, opt, folder, 1, extra={"step": 1})
    saved = model.full_state_dict()
    dist.barrier()
    step()
    if ctx.rank == 1:
        real = sharded_checkpoint._write

        def dying(path, write):
            real(path, write)
            if os.path.basename(path).startswith("shard-"):
                os._exit(9)
        sharded_checkpoint._write = dying
    torch.save(saved, os.path.join(folder, "saved-at-1.pt")) if ctx.rank == 0 else None
    sharded_checkpoint.save_sharded(model.module, opt, folder, 2, extra={"step": 2}, timeout=5.0)
    dist.barrier()   # rank 1 never gets here
    return None


def expert_buckets(ctx, args):
    """12's reduce_expert_gradients at ep 2 on 4 ranks (each expert, a user's MLP with
    biases, on 2 ranks), buckets of two weight matrices, one expert bias frozen: (the collectives it issued, whether every
    gradient equals the same gradient all-reduced alone over the copies and divided by the
    world, the frozen one left without)."""
    mod = common.load_script(os.path.join(common.ROOT, "12_expert_parallel.py"))
    ep_group, copies = mod.ep_groups(ctx.world_size, 2)
    torch.manual_seed(0)
    expert = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))  # noqa: E731
    moe = mod.MoE(8, 16, 4, 2, expert=expert).distribute(ep_group, copies)
    params = list(moe.experts.parameters())   # 2 experts: w1 (16 x 8), b1, w2 (8 x 16), b2 each
    params[1].requires_grad_(False)
    g = torch.Generator().manual_seed(ctx.rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None
    want = []
    for p in params:
        alone = None if p.grad is None else p.grad.clone()
        if alone is not None:
            dist.all_reduce(alone, group=copies)
            alone /= ctx.world_size
        want.append(alone)
    with common.count_collectives() as c:
        mod.reduce_expert_gradients(torch.nn.Sequential(moe), bucket_mb=2 * 128 * 4 / 2 ** 20)
    same = all(w is None and p.grad is None or w is not None and torch.equal(p.grad, w) for p, w in zip(params, want))
    return c.calls, same


def background_save_fails(ctx, args):
    """sharded_checkpoint.save_sharded with async_save, its file writes failing (a full disk, say): the
    error the next wait_for_saves raises (None: none raised), and what the folder holds."""
    folder = args.out
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def full(path, write):
        raise OSError(28, "No space left on device")
    sharded_checkpoint._write = full
    sharded_checkpoint.save_sharded(model, opt, folder, 1, async_save=True)
    try:
        sharded_checkpoint.wait_for_saves()
        error = None
    except RuntimeError as e:
        error = (str(e), type(e.__cause__).__name__)
    sharded_checkpoint.wait_for_saves()   # the error is raised once
    return error, sorted(os.listdir(folder))


def _raised(fn):
    """The message fn() raised (RuntimeError), or None."""
    try:
        fn()
        return None
    except RuntimeError as e:
        return str(e)


def device_audit_regressions(ctx, args):
    """Under the device audit (the test sets KIT_DEVICE_AUDIT=1), the three code paths a GPU
    run failed in at 8b1762b, each on its own: 08's verification comparing the host's
    gathered weights with the reference on the job's device, 12's capacity table and time
    model reducing host tensors, and 11's sweep timing one. {name: error or None}."""
    tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
    ep = common.load_script(os.path.join(common.ROOT, "12_expert_parallel.py"))
    cp = common.load_script(os.path.join(common.ROOT, "11_context_parallel.py"))
    g = torch.Generator().manual_seed(1)
    toy = [(torch.randn(8, 16, generator=g).to(ctx.device), torch.randint(0, 10, (8,), generator=g).to(ctx.device))
           for _ in range(2)]
    tp_group, dp_group = tp.tp_dp_groups(ctx.world_size, ctx.world_size)
    out = {"08 verify_model": _raised(lambda: tp.verify_model(ctx, args, tp.ToyMLP, tp.toy_tp, toy, tp_group,
                                                              dp_group))}
    out["12 capacity_and_loss"] = _raised(lambda: ep.capacity_and_loss(ctx, args, ctx.world_size, steps=1, batches=1))
    out["12 _timed"] = _raised(lambda: ep._timed(ctx, lambda: None, reps=1))
    out["11 _slowest_median_ms"] = _raised(lambda: cp._slowest_median_ms(ctx, args, lambda: None))
    return out


KERNEL_DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def cp_kernel_errors(ctx, args):
    """11's context_parallel context manager around one F.scaled_dot_product_attention call of
    ``args.tokens`` tokens, head dim ``args.head_dim``: every method x layout x causal/full x
    (8 query heads with 8 or 2 key/value heads, enable_gqa) x bf16/float32. For each case:
    (the largest error of the output and the q, k, v gradients of this rank's part against
    one process in float64, one process's own error in the same dtype, the kernels that ran),
    the worst over the ranks."""
    cpm = common.load_script(os.path.join(common.ROOT, "11_context_parallel.py"))
    F = torch.nn.functional
    t, d, out = args.tokens, args.head_dim, {}
    for dtype in ("bf16", "float32"):
        for hk in (8, 2):
            g = torch.Generator().manual_seed(hk)
            q = torch.randn(1, 8, t, d, generator=g).to(ctx.device)
            k, v = (torch.randn(1, hk, t, d, generator=g).to(ctx.device) for _ in range(2))
            dout = torch.randn(1, 8, t, d, generator=g).to(ctx.device)
            for causal in (True, False):
                def whole(dt):
                    xs = [x.to(dt).clone().requires_grad_() for x in (q, k, v)]
                    o = F.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=hk != 8)
                    o.backward(dout.to(dt))
                    return [o.detach().double()] + [x.grad.double() for x in xs]
                exact, one = whole(torch.float64), whole(KERNEL_DTYPES[dtype])
                for method in ("ring", "allgather", "ulysses"):
                    for layout in ("zigzag", "contiguous"):
                        part = lambda x: cpm.shard_sequence(x, ctx.rank, ctx.world_size, layout, 2)  # noqa: E731
                        qs, ks, vs, ds = (x.to(KERNEL_DTYPES[dtype]).clone() for x in (q, k, v, dout))
                        with common.count_collectives() as seen:
                            with cpm.context_parallel(None, buffers=[qs, ks, vs, ds], seq_dims=[2] * 4, method=method,
                                                      layout=layout):
                                a, b, c = (x.detach().requires_grad_() for x in (qs, ks, vs))
                                o = F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=hk != 8)
                                o.backward(ds)
                                got = [o.detach().double()] + [x.grad.double() for x in (a, b, c)]
                        err = max((x - part(y)).abs().max().item() for x, y in zip(got, exact))
                        own = max((part(x) - part(y)).abs().max().item() for x, y in zip(one, exact))
                        name = f"{dtype}, {method}, {layout}, {'causal' if causal else 'full'}, 8/{hk} heads"
                        out[name] = (err, own, sorted(seen.kernels))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, out)
    return {n: (max(e[n][0] for e in everyone), max(e[n][1] for e in everyone),
                sorted({k for e in everyone for k in e[n][2]})) for n in out}


def crash_rank(ctx, args):
    """Rank 1 crashes in C code (a write to address 0: SIGSEGV), in a function of its own;
    rank 0 sleeps meanwhile (in no collective: it does not fail first) until it is ended."""
    if ctx.rank == 1:
        _write_to_address_zero()
    time.sleep(60)


def _write_to_address_zero():
    import ctypes
    ctypes.memmove(0, b"x", 1)


def _spin(seconds=None):
    """A rank's computing (or, with no end, its infinite loop): Python running bytecode and
    holding the GIL, in bursts of 3 ms with pauses of 12 ms between them, so that a spinning
    rank takes a fifth of a core from the jobs beside it, not a whole one, for the 20 s its
    job lasts. The recorder's look at a stack (32 looks, 16 ms or more) spans a burst either
    way; while it spins, the thread that looks is given the GIL after 0.5 ms of waiting, not
    Python's 5, so that it takes the GIL from inside a burst, as it does from a rank that
    computes without pauses."""
    end = time.time() + (seconds if seconds is not None else float("inf"))
    n, interval = 0, sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        while time.time() < end:
            burst = time.time() + 0.003
            while time.time() < burst:
                n += 1
            time.sleep(0.012)
    finally:
        sys.setswitchinterval(interval)
    return n


def _all_reduce_in_a_thread(x):
    """dist.all_reduce issued from another thread (the recorder sees only the main thread's
    calls), the main thread waiting for it in join(): a C++ wait nothing records."""
    import threading
    failed = []

    def run():
        try:
            dist.all_reduce(x)
        except Exception as e:   # noqa: BLE001  (raised again in the main thread)
            failed.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failed:
        raise failed[0]


@dataclasses.dataclass
class _Out:
    """What transformers' ModelOutput is to a training loop: a dataclass of tensors."""
    loss: torch.Tensor
    logits: torch.Tensor


class PackedOutputs(torch.nn.Module):
    """Three linear layers and a head whose forward returns its loss and logits packed as
    ``pack`` says: a dict, a dataclass (as transformers' models return), or nested tuples
    and dicts."""

    def __init__(self, pack):
        super().__init__()
        self.pack = pack
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return {"dict": {"logits": logits, "loss": loss}, "dataclass": _Out(loss, logits),
                "nested": ((logits,), {"loss": loss})}[self.pack]


def packed_loss(out):
    return out["loss"] if isinstance(out, dict) else out.loss if isinstance(out, _Out) else out[1]["loss"]


def fsdp_packed_outputs(ctx, args):
    """07's FSDP (a unit per layer, the head in the root unit) on a model whose output is a
    dict, a dataclass or nested containers, 3 AdamW steps against one process: {pack: the
    largest difference of any parameter, or the error it raised}."""
    fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))
    out = {}
    for pack in ("dict", "dataclass", "nested"):
        torch.manual_seed(0)
        ref = PackedOutputs(pack)
        try:
            mine = copy.deepcopy(ref)
            model = fsdp.FSDP(mine, units=list(mine.layers))
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                n = 4 * ctx.world_size
                x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
                for o in opts:
                    o.zero_grad()
                packed_loss(ref(x, y)).backward()
                mine_x, mine_y = (common.shard(t, ctx.rank, ctx.world_size) for t in (x, y))
                packed_loss(model(mine_x, mine_y)).backward()
                model.finish_gradient_synchronization()
                for o in opts:
                    o.step()
            full = placement.full_state_dict(model.module, all_ranks=True)
            out[pack] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        except Exception as e:   # noqa: BLE001  (the test shows it)
            out[pack] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def blamed_lines(ctx, args):
    """The line the flight recorder names for collectives made inside the kit's library
    files (placement.py's count_parameters, sharded_checkpoint.py's save_sharded, common.py's
    agreed_past): each the line of this file that called into the library. Returns
    [(what the recorder named, the calling line)]."""
    import inspect
    import tempfile
    rec, here = diagnostics._RECORDER[0], inspect.currentframe()
    model, out = torch.nn.Linear(2, 2), []
    placement.count_parameters(model); out.append((rec.done["site"], here.f_lineno))  # noqa: E702
    common.agreed_past(ctx, False); out.append((rec.done["site"], here.f_lineno))  # noqa: E702
    folder = [tempfile.mkdtemp() if ctx.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    sharded_checkpoint.save_sharded(model, None, folder[0], 1); out.append((rec.done["site"], here.f_lineno))  # noqa: E702
    dist.barrier()
    if ctx.rank == 0:
        import shutil
        shutil.rmtree(folder[0], ignore_errors=True)
    return out


def stall_scenario(ctx, args):
    """Six all_reduces on every rank, then a broadcast; at the fourth, rank 1 misbehaves as
    ``args.mode`` says: "stop" (SIGSTOP to itself), "loop" (computes forever), "skip" (skips
    that all_reduce), "op" (broadcasts instead), "shape" (all-reduces another shape), "group"
    (all-reduces on another group of the same two ranks), "busy"
    (computes ``args.busy`` seconds, then goes on), "thread" (computes forever, while rank 0
    waits for that all_reduce issued from another thread), "none". Rank 1 writes the time it
    misbehaved to <args.out>/misbehaved. Returns the sum every rank ends with."""
    import signal
    if args.mode == "ddp_stop":
        return _ddp_stop(ctx, args)
    x = torch.ones(4)
    pair = dist.new_group([0, 1]) if args.mode == "group" else None
    for i in range(6):
        if ctx.rank == 1 and i == 3 and args.mode != "none":
            with open(os.path.join(args.out, "misbehaved"), "w") as f:
                f.write(repr(time.time()))
            if args.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.mode == "loop":
                _spin()
            elif args.mode == "skip":
                continue
            elif args.mode == "op":
                dist.broadcast(x, 0)
                continue
            elif args.mode == "shape":
                dist.all_reduce(torch.ones(5))
                continue
            elif args.mode == "group":   # the same call on another group of the same ranks
                dist.all_reduce(x, group=pair)
                continue
            elif args.mode == "busy":
                _spin(args.busy)
            elif args.mode == "thread":   # computes on; rank 0 waits where the recorder cannot see
                _spin()
        if ctx.rank == 0 and i == 3 and args.mode == "thread":
            _all_reduce_in_a_thread(x)
            continue
        dist.all_reduce(x)
    dist.broadcast(x, 0)
    return x.sum().item()


def _ddp_stop(ctx, args):
    """05's DDPBucketed training a small model; at the third step rank 1 stops itself
    (SIGSTOP) in the middle of backward, after its first bucket's all-reduce went out: rank
    0 finishes backward and waits for its buckets' async all-reduces."""
    import signal
    bucketed = common.load_script(os.path.join(common.ROOT, "05_bucketed_ddp.py"))
    torch.manual_seed(0)
    model = bucketed.DDPBucketed(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]), 0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model.module[0].weight

    def stop(grad):
        if ctx.rank == 1 and step[0] == 2:
            with open(os.path.join(args.out, "misbehaved"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return grad
    first.register_hook(stop)
    step = [0]
    for step[0] in range(4):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
    return 0.0


def steps_start_together(ctx, args):
    """time_methods with and without start_together, rank 1's steps 0.3 s longer than rank
    0's: [(start, end) of every step] per rank and setting (perf_counter: one clock)."""
    out = {}
    for together in (True, False):
        spans = []

        def make():
            def step(batch, clock):
                t = time.perf_counter()
                with clock.phase("comm"):
                    if ctx.rank == 1:
                        time.sleep(0.3)
                spans.append((t, time.perf_counter()))
            return step
        common.time_methods(ctx, args, {"a": make}, global_batch=True, start_together=together)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, spans)
        out[together] = everyone
    return out


def per_parameter_work(ctx, args):
    """The aten ops DDPBucketed (both zero_grad modes) and ShardedGradientOptimizer add to a
    step's backward and gradient synchronization, over the same model's plain backward:
    {(class, set_to_none): {op: count}}, beside the numbers of parameters and buckets; and
    whether DDPBucketed's averaged gradients are one process's over the world size."""
    from torch.utils._python_dispatch import TorchDispatchMode
    bucketed = common.load_script(os.path.join(common.ROOT, "05_bucketed_ddp.py"))
    sharded = common.load_script(os.path.join(common.ROOT, "06_sharded_optimizer.py"))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.__name__] = self.ops.get(func.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))

    def counted(module, opt, finish, set_to_none=True, steps=3):   # the last step's ops
        for step in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            ops = Ops()
            with ops if step == steps - 1 else contextlib.nullcontext():
                module(x).square().sum().backward()
                finish()
            opt.step()
        return ops.ops

    def more(ops, base):
        return {k: v - base.get(k, 0) for k, v in ops.items() if v != base.get(k, 0)}
    out = {}
    for set_to_none in (True, False):
        m = model()
        base = counted(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda: None, set_to_none)
        ddp = bucketed.DDPBucketed(model(), 300 / 2**20)   # 300 bytes: 6 buckets, a layer's 2 tensors each
        ops = counted(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), ddp.finish_gradient_synchronization,
                      set_to_none)   # (the second step rebuilt the buckets)
        out[("DDPBucketed", set_to_none)] = more(ops, base)
    out["buckets"], out["params"] = len(ddp.buckets), len(list(ddp.parameters()))
    m = model()
    opt = sharded.ShardedGradientOptimizer(m.parameters(), torch.optim.SGD, bucket_mb=300 / 2**20, lr=0.1)
    out[("ShardedGradientOptimizer", True)] = more(counted(m, opt, opt._wait), base)
    out["sharded_buckets"] = len(opt.buckets)
    plain, one = model(), model()   # the average against one process: the ranks' x together, / world size
    everyone = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(ctx.world_size)])
    ddp = bucketed.DDPBucketed(plain, 1000)
    ddp(x).square().sum().backward()
    ddp.finish_gradient_synchronization()
    one(everyone).square().sum().div(ctx.world_size).backward()
    out["close"] = all(torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6) for a, b in zip(plain.parameters(),
                                                                                       one.parameters()))
    return out
