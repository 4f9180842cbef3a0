"""Workers for 08's and 09's classes in ordinary training loops (spawned processes find
them again by file and name): a GPT the kit did not write (tests/gpt.py) split with 08's
parallelize, and a pipeline of nn.TransformerEncoderLayer stages, each against one process
trained on the same batches, with gradient clipping, accumulation, dropout, evaluation and
checkpoints resumed at another degree."""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common
import sharded_checkpoint
import placement
from gpt import GPT, GPTConfig

tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
pp = common.load_script(os.path.join(common.ROOT, "09_pipeline_parallel.py"))
ddp = common.load_script(os.path.join(common.ROOT, "05_bucketed_ddp.py"))

MAX_NORM = 0.05   # below the GPT's gradient norm (about 0.3 at the start): every step clips
STEPS, SAVE_AFTER = 6, 3


def batches(steps, batch=8, t=16, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, t), generator=g), torch.randint(0, vocab, (batch, t), generator=g))
            for _ in range(steps)]


def compare(full: dict, ref: nn.Module) -> dict:
    """Whole tensors by name against the reference's, at float32 tolerance."""
    theirs, ok, diff = ref.state_dict(), True, 0.0
    for name, t in theirs.items():
        diff = max(diff, (full[name].double() - t.double()).abs().max().item())
        try:
            torch.testing.assert_close(full[name], t)
        except AssertionError:
            ok = False
    return {"ok": ok and set(full) == set(theirs), "max_diff": diff}


def everyone(obj, group=None):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ----------------------------------------------------------------------------------------
# 08: the GPT with its MLPs split
# ----------------------------------------------------------------------------------------
def gpt_tp(group, dropout=0.0, sync=True, seeded_apart=False):
    """The GPT, every block's MLP split over ``group``; and the one-process twin.
    ``seeded_apart``: each rank's generator seeded differently before parallelize (as a
    loop that seeds by rank does), which ``sync`` undoes."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig(dropout=dropout))
    model = copy.deepcopy(ref)
    if seeded_apart:
        torch.manual_seed(1000 + dist.get_rank())
    for i, block in enumerate(model.transformer.h):
        tp.parallelize(block.mlp, {"c_fc": "column", "c_proj": "row"}, group, sync=sync and i == 0)
    return model, ref


def gpt_loop(model, ref, opts, data, steps, clip="ours", accum=2, group=None):
    """The loop every GPT training script runs: micro-batches accumulated, the gradient
    clipped, a step; the reference the same on the whole batch with torch's clip. Returns
    each step's (our norm, the reference's)."""
    norms = []
    for x, y in data[steps[0]:steps[1]]:
        for m, opt in zip((model, ref), opts):
            opt.zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
                (m(xs, ys)[1] / accum).backward()
        if clip == "ours":
            norm = tp.clip_grad_norm_(model, MAX_NORM, process_group=group)
        else:   # the control: each rank clips by the norm of what it holds
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append((norm.item(), torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()))
        for opt in opts:
            opt.step()
    return norms


def tp_cases(ctx, args, path):
    """At this world size (the tp group: every rank): the GPT against one process with our
    clip and with torch's (the control); evaluation on every rank; the dropout cases; and a
    checkpoint: saved after SAVE_AFTER steps at 2 ranks, or resumed from it at another."""
    group, out = dist.group.WORLD, {}
    data = batches(STEPS)
    resuming = ctx.world_size != 2
    for clip in ([] if resuming else ["ours", "torch"]):
        model, ref = gpt_tp(group)
        opts = [m.configure_optimizers(0.1, 1e-3) for m in (model, ref)]
        norms = gpt_loop(model, ref, opts, data, (0, STEPS), clip, group=group)
        model.eval(), ref.eval()
        with torch.no_grad():   # evaluation: every rank of the tp group runs it
            x, y = data[0]
            losses = (model(x, y)[1].item(), ref(x, y)[1].item())
        r = compare(tp.full_state_dict(model, all_ranks=True), ref)
        r.update(norms=norms, eval=losses, clipped=all(b > MAX_NORM for _, b in norms))
        out[f"clip {clip}"] = everyone(r)
    model, ref = gpt_tp(group)
    opts = [m.configure_optimizers(0.1, 1e-3) for m in (model, ref)]
    if resuming:   # the reference trains from step 0; ours starts from the checkpoint
        for x, y in data[:SAVE_AFTER]:
            opts[1].zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (ref(xs, ys)[1] / 2).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opts[1].step()
        ckpt = torch.load(path, weights_only=True)
        tp.load_full_state_dict(model, ckpt["model"])
        tp.load_full_optim_state_dict(model, opts[0], ckpt["optim"])
        gpt_loop(model, ref, opts, data, (SAVE_AFTER, STEPS), group=group)
        out["resumed"] = everyone(compare(tp.full_state_dict(model, all_ranks=True), ref))
    else:
        gpt_loop(model, ref, opts, data, (0, SAVE_AFTER), group=group)
        ckpt = {"model": tp.full_state_dict(model), "optim": tp.full_optim_state_dict(model, opts[0])}
        if ctx.rank == 0:
            torch.save(ckpt, path)
        out.update(dropout_cases(ctx, data))
    return out


def replicated_everywhere(model, group) -> bool:
    """Whether every tensor that is whole on every rank is bitwise the same on all of them."""
    mine = {n: t.detach().clone() for n, t in model.state_dict().items() if not tp.split_owner(model, n)}
    return all(all(torch.equal(mine[n], other[n]) for n in mine) for other in everyone(mine, group))


def dropout_cases(ctx, data):
    """The GPT with dropout 0.1: after a few steps every rank holds the same replicated
    weights (parallelize synced the default generator), and not without the sync (the
    control); a dropout between a column and a row layer
    draws a mask of its own on each rank, and the replicated weights still agree. Every
    rank's generator is seeded apart first: parallelize's sync puts them in step."""
    out = {}
    for name, sync in (("dropout", True), ("dropout, seeded apart, not synced", False)):
        model, _ = gpt_tp(dist.group.WORLD, dropout=0.1, sync=sync, seeded_apart=True)
        opt = model.configure_optimizers(0.1, 1e-3)
        for x, y in data[:3]:
            opt.zero_grad()
            model(x, y)[1].backward()
            tp.clip_grad_norm_(model, MAX_NORM)
            opt.step()
        out[name] = everyone({"same": replicated_everywhere(model, dist.group.WORLD)})
    torch.manual_seed(0)
    toy = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16), nn.Dropout(0.1))
    tp.parallelize(toy, {"0": "column", "2": "dropout", "3": "row"})
    masks = []
    toy[2].register_forward_hook(lambda mod, inp, outp: masks.append((outp == 0).flatten().tolist()))
    opt = torch.optim.AdamW(toy.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        toy(torch.ones(4, 16)).square().mean().backward()
        opt.step()
    masks = everyone(masks)
    out["dropout in the split region"] = everyone({"same": replicated_everywhere(toy, dist.group.WORLD),
                                                   "own_masks": masks[0] != masks[1]})
    return out


def tp_eval_on_one_rank(ctx, args):
    """Rank 0 evaluates under torch.no_grad(), rank 1 does not: rank 0 must fail within the
    layers' eval timeout, saying why, not hang."""
    model, _ = gpt_tp(dist.group.WORLD)
    for block in model.transformer.h:
        block.mlp.c_proj.eval_timeout = 2.0
    model.eval()
    if ctx.rank == 0:
        with open(args.began, "w") as f:   # the moment it evaluates alone: the test measures from here
            f.write(repr(time.time()))
        with torch.no_grad():
            model(*batches(1)[0])
    else:
        time.sleep(20)


# ----------------------------------------------------------------------------------------
# 09: a pipeline of nn.TransformerEncoderLayer stages
# ----------------------------------------------------------------------------------------
class Encoder(nn.Module):
    """A causal LM of nn.TransformerEncoderLayers, held in a ModuleList."""

    def __init__(self, vocab=97, d=32, heads=4, layers=4, t=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


class EncoderStage(nn.Module):
    """Stage ``s`` of ``n`` of an Encoder, its modules under the model's own names, as a
    user writes one."""

    def __init__(self, model, s, n):
        super().__init__()
        k = len(model.layers)
        self.first, self.last = s == 0, s == n - 1
        if self.first:
            self.tok, self.pos = model.tok, model.pos
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(s * k // n, (s + 1) * k // n)})
        if self.last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for layer in self.layers.values():
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x)) if self.last else x


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def encoder_pipeline(n_stages, replicas, m=2, batch=8, t=16):
    """This rank's stage of an Encoder (DDPBucketed over its replicas), its Pipeline,
    optimizer and the one-process reference with its own."""
    pipes = [dist.new_group(list(range(k * n_stages, (k + 1) * n_stages))) for k in range(replicas)]
    reps = [dist.new_group(list(range(s, n_stages * replicas, n_stages))) for s in range(n_stages)]
    rank = dist.get_rank()
    pipe_group, dp_group = pipes[rank // n_stages], reps[rank % n_stages]
    torch.manual_seed(0)
    ref = Encoder()
    stage = EncoderStage(copy.deepcopy(ref), dist.get_rank(pipe_group), n_stages)
    module = ddp.DDPBucketed(stage, 1, process_group=dp_group) if replicas > 1 else stage
    pipe = pp.Pipeline(module, m, lm_loss, "1f1b", pipe_group, activation_shape=(batch // replicas // m, t, 32))
    decay = lambda mod: [{"params": [p for p in mod.parameters() if p.dim() >= 2], "weight_decay": 0.1},  # noqa: E731
                         {"params": [p for p in mod.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    # eps 1e-6, as in 09's check: micro-batches sum the gradient in another order, and with
    # 1e-8 a nearly-cancelling gradient turns that rounding into 1e-5 weight differences
    opts = [torch.optim.AdamW(decay(stage), lr=1e-3, eps=1e-6), torch.optim.AdamW(decay(ref), lr=1e-3, eps=1e-6)]
    return stage, module, pipe, opts, ref, pipe_group, dist.get_rank(dp_group), replicas


def pipeline_loop(setup, data, steps, clip="ours"):
    stage, module, pipe, opts, ref, group, dp_rank, replicas = setup
    norms = []
    for x, y in data[steps[0]:steps[1]]:
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        xs, ys = common.shard(x, dp_rank, replicas), common.shard(y, dp_rank, replicas)
        pipe.step(xs if pipe.first else None, ys if pipe.last else None)
        if hasattr(module, "finish_gradient_synchronization"):
            module.finish_gradient_synchronization()
        ref(x, y).backward()
        clipper = (lambda ps: pp.clip_grad_norm_(ps, MAX_NORM, process_group=group)) if clip == "ours" else \
            (lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))   # the control: this stage's norm
        norms.append((clipper(list(stage.parameters())).item(),
                      torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()))
        for opt in opts:
            opt.step()
    return norms


def compare_stage(stage, ref):
    mine, theirs = stage.state_dict(), ref.state_dict()
    r = compare({**theirs, **mine}, ref)   # this stage's tensors; the others' are the reference's own
    r["names"] = sorted(mine)
    return r


def pp_cases(ctx, args, path):
    """2 stages (and at 4 ranks 2 stages x 2 replicas) against one process with our clip,
    the control with torch's per stage; a checkpoint saved after SAVE_AFTER steps at 2
    stages, resumed at 4."""
    data, out = batches(STEPS, batch=8), {}
    layouts = [(2, 1, "ours"), (2, 1, "torch")] if ctx.world_size == 2 else [(2, 2, "ours")]
    for n_stages, replicas, clip in layouts:
        setup = encoder_pipeline(n_stages, replicas)
        norms = pipeline_loop(setup, data, (0, STEPS), clip)
        r = compare_stage(setup[0], setup[4])
        r.update(norms=norms, clipped=all(b > MAX_NORM for _, b in norms))
        out[f"{n_stages} stages x {replicas}, clip {clip}"] = everyone(r)
    n_stages = ctx.world_size
    setup = encoder_pipeline(n_stages, 1)
    stage, _, _, opts, ref, group, _, _ = setup
    if n_stages == 2:
        pipeline_loop(setup, data, (0, SAVE_AFTER))
        model, optim = pp.full_state_dict(stage, group), pp.full_optim_state_dict(stage, opts[0], group)
        if ctx.rank == 0:
            torch.save({"model": model, "optim": optim}, path + ".pp")
        dist.barrier()
    else:
        for x, y in data[:SAVE_AFTER]:   # the reference catches up
            opts[1].zero_grad()
            ref(x, y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opts[1].step()
        ckpt = torch.load(path + ".pp", weights_only=True)
        pp.load_full_state_dict(stage, ckpt["model"])
        pp.load_full_optim_state_dict(stage, opts[0], ckpt["optim"])
        pipeline_loop(setup, data, (SAVE_AFTER, STEPS))
        out["resumed"] = everyone(compare_stage(stage, ref))
    return out


def real_loops(ctx, args, path):
    """Every case of this world size: {case: every rank's result}."""
    return {**{f"tp {k}": v for k, v in tp_cases(ctx, args, path).items()},
            **{f"pp {k}": v for k, v in pp_cases(ctx, args, path).items()}}


def sharded_equals_full(stage, opt, folder) -> bool:
    """common.sharded_matches (the sharded checkpoint gives back what the full one loaded,
    bit for bit), and its extra came back."""
    return common.sharded_matches(stage, opt, folder) and set(sharded_checkpoint.load_sharded(stage, None, folder)) == {"mesh"}


# ----------------------------------------------------------------------------------------
# Three axes on the GPT, composed by documented calls; one clip and one checkpoint
# ----------------------------------------------------------------------------------------
def gpt_three_axes(ctx, args, path):
    """The GPT (its own configure_optimizers: two parameter groups, weight decay by dim; its
    tied head) on dp 2 x fsdp 2 x tp 2: every MLP split by 08's parallelize, 07's FSDP over
    each fsdp group (a unit per block), 05's DDPBucketed over each dp group; two micro-batches
    accumulated (no_sync), the placement record's clip_grad_norm_ and full checkpoint. Saved
    after SAVE_AFTER steps and resumed on fsdp 4 x tp 2; both against one process."""
    fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))
    nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
    data, out = batches(STEPS), {}
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    ref_opt = ref.configure_optimizers(0.1, 1e-3)
    want = []
    for x, y in data:   # one process, the same accumulation
        ref_opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (ref(xs, ys)[1] / 2).backward()
        want.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        ref_opt.step()
    for name, shape, steps in (("dp 2 x fsdp 2 x tp 2", {"dp": 2, "fsdp": 2, "tp": 2}, (0, SAVE_AFTER)),
                               ("fsdp 4 x tp 2", {"dp": 1, "fsdp": 4, "tp": 2}, (SAVE_AFTER, STEPS))):
        mesh = nd.Mesh(shape)
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        for block in model.transformer.h:   # the user's calls, innermost axis first
            tp.parallelize(block.mlp, {"c_fc": "column", "c_proj": "row"}, mesh.group("tp"))
        sharded = fsdp.FSDP(model, process_group=mesh.group("fsdp"), units=list(model.transformer.h))
        wrapped = ddp.DDPBucketed(sharded, 1, process_group=mesh.group("dp")) if shape["dp"] > 1 else sharded
        opt = model.configure_optimizers(0.1, 1e-3)   # the model's own groups, over its shards
        if steps[0]:
            ckpt = torch.load(path, weights_only=True)
            placement.load_full_state_dict(model, ckpt["model"])
            placement.load_full_optim_state_dict(model, opt, ckpt["optim"])
            sharded = sharded_equals_full(model, opt, sharded_checkpoint.latest_checkpoint(path + ".sharded"))
        replicas, replica = shape["dp"] * shape["fsdp"], mesh.coord("dp") * shape["fsdp"] + mesh.coord("fsdp")
        norms = []
        for x, y in data[steps[0]:steps[1]]:
            x, y = common.shard(x, replica, replicas), common.shard(y, replica, replicas)
            opt.zero_grad(set_to_none=True)
            with wrapped.no_sync():
                (wrapped(x[:1], y[:1])[1] / 2).backward()
            (wrapped(x[1:], y[1:])[1] / 2).backward()
            wrapped.finish_gradient_synchronization()
            norms.append(placement.clip_grad_norm_(model, MAX_NORM).item())
            opt.step()
        r = {"norms": list(zip(norms, want[steps[0]:steps[1]]))}
        if steps[0] == 0:
            ckpt = {"model": placement.full_state_dict(model), "optim": placement.full_optim_state_dict(model, opt)}
            if ctx.rank == 0:
                torch.save(ckpt, path)
            sharded_checkpoint.save_sharded(model, opt, path + ".sharded", steps[1], extra={"mesh": name})
            dist.barrier()
        else:
            r.update(compare(placement.full_state_dict(model, all_ranks=True), ref), sharded=sharded)
        out[name] = everyone(r)
    return out
