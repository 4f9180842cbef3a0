"""Workers for "your own model": the tests' Llama-style decoder (tests/llama.py, written for
one process and never changed) put on the kit's axes with documented calls only, each
against one process trained on the same batches with the same clipped AdamW steps."""
import copy
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

import common
import sharded_checkpoint
import placement
import llama
from loops import sharded_equals_full

tp = common.load_script(os.path.join(common.ROOT, "08_tensor_parallel.py"))
ddp = common.load_script(os.path.join(common.ROOT, "05_bucketed_ddp.py"))
ep = common.load_script(os.path.join(common.ROOT, "12_expert_parallel.py"))
cpm = common.load_script(os.path.join(common.ROOT, "11_context_parallel.py"))
pp = common.load_script(os.path.join(common.ROOT, "09_pipeline_parallel.py"))
import torch.nn.functional as F   # noqa: E402

MAX_NORM = 0.5   # below the Llama's gradient norm at the start: every step clips
STEPS = 4
TP_PLAN = {   # a whole-model plan, as the docs show it
    "layers.*.attention.wq": "column", "layers.*.attention.wk": "column", "layers.*.attention.wv": "column",
    "layers.*.attention.wo": "row", "layers.*.attention.n_heads": "divide", "layers.*.attention.n_kv_heads": "divide",
    "layers.*.feed_forward.w1": "column", "layers.*.feed_forward.w3": "column", "layers.*.feed_forward.w2": "row",
}


def batches(steps=STEPS, batch=8, t=16, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, t), generator=g), torch.randint(0, vocab, (batch, t), generator=g))
            for _ in range(steps)]


def everyone(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def train_reference(ref, data):
    """One process: the whole batch, torch's clip, AdamW. Its float64 twin trained beside it
    gives ``ref`` its rounding floor (with_floor), which compare's bound follows."""
    return with_floor(ref, data, _train_reference)


def _train_reference(ref, data):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        llama.loss_fn(ref(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
    return norms


def compare(full: dict, ref) -> dict:
    """``full`` (a method's weights, by name) against the one-process model ``ref``. Where
    ``ref`` carries its rounding floor (trained by with_floor): every difference at most
    FLOOR_TIMES times that floor, a bound that follows how far float32's rounding alone moves
    these weights in these steps on this machine. Elsewhere (a checkpoint loaded, nothing
    trained): torch's float32 closeness, element by element (rtol 1e-4, atol 1e-5)."""
    theirs, ok, diff = ref.state_dict(), True, 0.0
    floor = getattr(ref, "rounding_floor", None)
    for name, t in theirs.items():
        diff = max(diff, (full[name].double() - t.double()).abs().max().item())
        if floor is None:
            try:
                torch.testing.assert_close(full[name], t, rtol=1e-4, atol=1e-5)
            except AssertionError:
                ok = False
    if floor is not None:
        ok = diff <= FLOOR_TIMES * floor
    r = {"ok": ok and set(full) == set(theirs), "max_diff": diff}
    return r if floor is None else {**r, "floor": floor}


# The bound's multiple of the floor. Measured (docs/testing): every method of the suite lands
# within 0.0-3.4 floors of one process, on this machine's AVX-512 kernels and forced onto its
# AVX2 and scalar ones; the broken variants the suite keeps land 1,100-13,500 floors away.
FLOOR_TIMES = 8


def with_floor(ref, data, train, *args, twin=None):
    """Train ``ref`` by ``train(model, data, *args)`` (returning what it returns), and its
    float64 twin (``twin``, else a copy of ``ref`` made first, in float64: a compiled
    model's twin is its eager one, its kernels not compiled again) on the same steps; ``ref.rounding_floor``
    is then the largest difference between the two: how far float32's rounding alone moves
    these weights here. (transformers' norms and softmaxes compute in float32 in a float64
    model too, as do the Llama's rotary angles: the twin is a run rounded otherwise, not
    exact arithmetic, and the floor the distance between two honest runs.)"""
    twin = copy.deepcopy(ref).double() if twin is None else twin
    if hasattr(twin, "config"):   # a transformers model: its grouped expert GEMMs take no float64
        twin.config._experts_implementation = "eager"
    out = train(ref, data, *args)
    other = train(twin, data, *args)
    mine, theirs = ref.state_dict(), twin.state_dict()
    ref.rounding_floor = max((mine[n].double() - theirs[n].double()).abs().max().item() for n in mine)
    if isinstance(out, list) and out and all(isinstance(v, float) for v in out):   # each step's norm
        out = Norms(out, itertools.accumulate((abs(a - b) / b for a, b in zip(out, other)), max))
    return out


class Norms(list):
    """One process's global norm at each step, and ``floor``: at each step, the largest
    relative difference so far between them and its float64 twin's (with_floor)."""
    def __init__(self, norms, floor):
        super().__init__(norms)
        self.floor = list(floor)


def norms_close(norms, want, steps=None) -> bool:
    """Whether each step's global norm is one process's (``want``): within 1e-4 of it, or,
    where float32's rounding alone moves that run's norms further (Gemma 4's: 4e-4 by its
    fourth step), within FLOOR_TIMES that step's floor. ``steps``: those compared (all)."""
    floor = getattr(want, "floor", None) or [0.0] * len(want)
    return all(abs(norms[i] - want[i]) / want[i] < max(1e-4, FLOOR_TIMES * floor[i])
               for i in (range(min(len(norms), len(want))) if steps is None else steps))


def tensor_parallel(ctx, args):
    """The Llama at tp 2 (2 ranks), or dp 2 x tp 2 composed by hand (4 ranks):
    parallelize with the whole-model plan, DDPBucketed over the data ranks, 08's clip over
    the tp group. Also what parallelize refuses, before it changes anything."""
    out, data = {}, batches()
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs())
    ref_trained = copy.deepcopy(ref)
    want = train_reference(ref_trained, data)
    layouts = [(1, 2)] if ctx.world_size == 2 else [(2, 2)]   # 2 key/value heads: tp 2 at most
    for dp, t in layouts:
        tp_groups = [dist.new_group(list(range(i, i + t))) for i in range(0, ctx.world_size, t)]
        dp_groups = [dist.new_group(list(range(i, ctx.world_size, t))) for i in range(t)]
        tp_group, dp_group = tp_groups[ctx.rank // t], dp_groups[ctx.rank % t]
        model = tp.parallelize(copy.deepcopy(ref), TP_PLAN, tp_group)
        wrapped = ddp.DDPBucketed(model, 1, process_group=dp_group) if dp > 1 else model
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-6)
        norms = []
        for x, y in data:
            xs, ys = (z.chunk(dp)[ctx.rank // t] for z in (x, y))
            opt.zero_grad(set_to_none=True)
            llama.loss_fn(wrapped(xs), ys).backward()
            if dp > 1:
                wrapped.finish_gradient_synchronization()
            norms.append(tp.clip_grad_norm_(model, MAX_NORM, process_group=tp_group).item())
            opt.step()
        r = compare(tp.full_state_dict(model, all_ranks=True), ref_trained)
        r["norms"] = norms_close(norms, want)
        out[f"dp {dp} x tp {t}"] = r
    if ctx.world_size == 2:
        out.update(between_split_layers())
    return out


class LearnedActivation(torch.nn.Module):
    """A module the kit has never seen: an activation with two learned scalars (as
    Apertus's xIELU), applied feature by feature."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = torch.nn.Parameter(torch.tensor(0.8)), torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        return torch.where(x > 0, self.alpha_p * x * x + x, self.alpha_n * torch.expm1(x.clamp(max=0)))


class ScaledBlock(torch.nn.Module):
    """Attention-like heads with a learned scale per head dimension that every head uses
    (between the column q and the row o), then an MLP through LearnedActivation; with
    ``gain``, a learned gain per hidden feature of the MLP, which its split divides; with
    ``center``, the MLP's hidden features centered on their mean (a statistic over them all)."""

    def __init__(self, d=32, hidden=64, heads=4, gain=False, center=False):
        super().__init__()
        self.center = center
        self.q, self.o = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(d // heads))
        self.norm = torch.nn.RMSNorm(d)
        self.up, self.act, self.down = torch.nn.Linear(d, hidden), LearnedActivation(), torch.nn.Linear(hidden, d)
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden)) if gain else None

    def forward(self, x):
        q = self.q(x)
        x = x + self.o((q.unflatten(-1, (-1, self.scale.numel())) * self.scale).flatten(-2).tanh())
        h = self.act(self.up(self.norm(x)))
        h = h - h.mean(-1, keepdim=True) if self.center else h
        return x + self.down(h * self.gain if self.gain is not None else h)


SCALED_PLAN = {"q": "column", "o": "row", "up": "column", "down": "row"}


def between_split_layers():
    """parallelize on ScaledBlock at tp 2 against one process (4 clipped AdamW steps): the
    parameters it leaves whole between the split layers found at the first forward and
    summed (summed_whole), the norm outside them not; with a gain per split feature, or a
    mean taken over the split features, the first forward refused naming it."""
    torch.manual_seed(0)
    ref = ScaledBlock()
    model = tp.parallelize(copy.deepcopy(ref), SCALED_PLAN)
    data = [(torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(i)),) for i in range(STEPS)]
    want = with_floor(ref, data, _train_scaled)
    norms = _train_scaled(model, data, lambda m: tp.clip_grad_norm_(m, MAX_NORM))
    r = compare(tp.full_state_dict(model, all_ranks=True), ref)
    r.update(norms=norms_close(norms, want), summed=tp.summed_whole(model))
    refused = {}
    for case, block in (("a gain per split feature", dict(gain=True)), ("a mean over split features", dict(center=True))):
        torch.manual_seed(0)
        try:
            tp.parallelize(ScaledBlock(**block), SCALED_PLAN)(data[0][0])
            refused[case] = "not refused"
        except ValueError as e:
            refused[case] = str(e)
    return {"between split layers": r, **refused}


def _train_scaled(model, data, clip=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    norms = []
    for (x,) in data:
        opt.zero_grad(set_to_none=True)
        model(x.to(next(model.parameters()).dtype)).square().mean().backward()
        norms.append((clip or (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)))(model).item())
        opt.step()
    return norms


def plan_refusals(ctx, args):
    """What parallelize refuses, each before it changes anything: a key that matches
    nothing, a head count the group's size does not divide, a kind it does not know."""
    out = {}
    for label, plan, model_args in (
            ("no match", {**TP_PLAN, "layers.*.attention.wqkv": "column"}, llama.ModelArgs()),
            ("heads", TP_PLAN, llama.ModelArgs(n_kv_heads=1)),
            ("kind", {"layers.*.attention.wq": "colum"}, llama.ModelArgs())):
        model = llama.Transformer(model_args)
        before = {n: type(m) for n, m in model.named_modules()}, [l.attention.n_heads for l in model.layers]
        try:
            tp.parallelize(model, plan)
            out[label] = "not refused"
        except ValueError as e:
            after = {n: type(m) for n, m in model.named_modules()}, [l.attention.n_heads for l in model.layers]
            out[label] = str(e) if after == before else f"changed the model: {e}"
    return out


AUX = 0.01


def llama_moe(n_experts=4, top_k=2, grouped=False):
    """The Llama with each layer's feed-forward replaced by a MoE of its own SwiGLU
    FeedForward experts and one shared expert (a module swapped in, the model's source as
    it is); ``grouped``: one call per expert (False) or 12's grouped_swiglu."""
    torch.manual_seed(0)
    args = llama.ModelArgs()
    model = llama.Transformer(args)
    for layer in model.layers:
        layer.feed_forward = ep.MoE(args.dim, args.ffn_hidden, n_experts, top_k=top_k,
                                    expert=lambda: llama.FeedForward(args.dim, args.ffn_hidden),
                                    shared_experts=llama.FeedForward(args.dim, args.ffn_hidden), grouped=grouped)
    return model


def moe_loss(model, x, y):
    return llama.loss_fn(model(x), y) + AUX * sum(m.aux for m in model.modules() if isinstance(m, ep.MoE))


def expert_parallel(ctx, args):
    """The MoE Llama with its experts split over every rank (ep = world), the other weights
    (attention, norms, router, shared experts) under DDPBucketed, 12's clip; against one
    process holding every expert that routes each rank's part of the batch as that rank
    does (the balance loss is per part) and averages the parts' losses. At ep 2 (two experts a
    rank) the experts run grouped (grouped_swiglu), at ep 4 one call each."""
    data = batches()
    ref = llama_moe(grouped=ep.grouped_swiglu if ctx.world_size == 2 else False)
    model = copy.deepcopy(ref)
    for moe in (m for m in model.modules() if isinstance(m, ep.MoE)):
        moe.distribute()
    wrapped = ddp.DDPBucketed(model, 1, ignore_parameters=ep.expert_parameters(model))
    r = train_experts(ctx, model, wrapped, ref, data)
    shared = {id(p) for p in model.layers[0].feed_forward.shared_experts.parameters()}
    r["shared_replicated"] = not shared & {id(p) for p in ep.expert_parameters(model)}   # DDP's, not sent
    r["local_experts"] = sorted(model.layers[0].feed_forward.experts.keys())
    r["grouped"] = getattr(model.layers[0].feed_forward.grouped, "__name__", "loop")
    return r


def train_experts(ctx, model, wrapped, ref, data) -> dict:
    """``model`` with its experts split over every rank, the rest under ``wrapped`` (a
    DDPBucketed), and ``ref`` in one process, trained side by side (clipped AdamW): one
    process routes each rank's part of the batch as that rank does and averages the parts'
    losses. The comparison of the whole weights, and whether every step's norm agreed."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (wrapped, ref)]
    norms, want = [], []
    for x, y in data:
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        parts = list(zip(x.chunk(ctx.world_size), y.chunk(ctx.world_size)))
        moe_loss(wrapped, *parts[ctx.rank]).backward()
        wrapped.finish_gradient_synchronization()
        ep.reduce_expert_gradients(model)
        norms.append(ep.clip_grad_norm_(model, MAX_NORM).item())
        (sum(moe_loss(ref, *part) for part in parts) / len(parts)).backward()
        want.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        for opt in opts:
            opt.step()
    r = compare(ep.full_state_dict(model, all_ranks=True), ref)
    r["norms"] = norms_close(norms, want)
    return r


def _attention_case(group, method, layout, causal, gqa, cp_rank, cp):
    """One SDPA call under context_parallel against the whole sequence's: this rank's part
    of the output and of q's, k's and v's gradients; and the bytes this rank sent."""
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, 8, 16, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(2))
    if gqa == "repeated":   # the model repeats its key/value heads itself and calls plain SDPA
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=gqa == "enable_gqa")
    out.backward(dout)
    want = [out] + [x.grad for x in ref]
    part = lambda x: cpm.shard_sequence(x, cp_rank, cp, layout, dim=2)   # noqa: E731
    with common.count_collectives() as c, \
            cpm.context_parallel(group, buffers=[q, k, v, dout], seq_dims=[2, 2, 2, 2], method=method, layout=layout):
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*mine, is_causal=causal, enable_gqa=gqa == "enable_gqa")
        o.backward(dout)
    got = [o] + [x.grad for x in mine]
    diff = max((a.detach() - part(b.detach())).abs().max().item() for a, b in zip(got, want))
    ok = all(torch.allclose(a.detach(), part(b.detach()), rtol=1e-4, atol=1e-5) for a, b in zip(got, want))
    block = part(k).numel() * k.element_size()   # this rank's K: its key/value heads only
    return {"ok": ok and q.shape[2] == 16, "max_diff": diff, "sent": common.sent_bytes(c.log),
            "formula": cpm.attention_bytes(method, cp, block)}


def context_parallel(ctx, args):
    """Attention and the Llama over context_parallel at cp = world: every method and layout,
    grouped-query both ways, causal and not, each beside one process; what it refuses
    (before any exchange, the next call then working); and the Llama trained with its own
    positions, DDPBucketed averaging the weights' gradients over the group, clipped AdamW."""
    cp, rank, out = ctx.world_size, ctx.rank, {}
    for method in cpm.METHODS:
        for layout in cpm.LAYOUTS:
            for causal in (True, False):
                for gqa in ("enable_gqa", "repeated"):
                    out[f"attention, {method}, {layout}, {'causal' if causal else 'full'}, {gqa}"] = \
                        _attention_case(None, method, layout, causal, gqa, rank, cp)
    q = torch.randn(1, 8, 8, 4)
    for label, kwargs in (("attn_mask", {"attn_mask": torch.ones(8, 8, dtype=torch.bool)}),
                          ("dropout", {"dropout_p": 0.1}), ("gqa without enable_gqa", {})):
        k = q[:, :2] if label.startswith("gqa") else q
        try:
            with cpm.context_parallel(None, method="ring"):
                F.scaled_dot_product_attention(q, k, k, **kwargs)
            out[f"refuses {label}"] = "not refused"
        except ValueError as e:
            out[f"refuses {label}"] = str(e)
    after = _attention_case(None, "ring", "zigzag", True, "enable_gqa", rank, cp)   # the group still works
    out["works after a refusal"] = after["ok"]

    data = batches()
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs())
    ref_trained = copy.deepcopy(ref)
    want = train_reference(ref_trained, data)
    for method in cpm.METHODS + ("control",):   # control: positions left to the model (0..t/cp-1: wrong)
        model = ddp.DDPBucketed(copy.deepcopy(ref), 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        norms = []
        for x, y in data:
            x, y, pos = x.clone(), y.clone(), torch.arange(x.shape[1])
            opt.zero_grad(set_to_none=True)
            if method == "control":
                with cpm.context_parallel(None, buffers=[x, y], seq_dims=[1, 1], method="ring"):
                    llama.loss_fn(model(x), y).backward()
            else:
                with cpm.context_parallel(None, buffers=[x, y, pos], seq_dims=[1, 1, 0], method=method):
                    llama.loss_fn(model(x, pos), y).backward()
            model.finish_gradient_synchronization()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())   # replicated: whole
            opt.step()
        r = compare(model.module.state_dict(), ref_trained)
        r["norms"] = norms_close(norms, want)
        out[f"llama, {method}"] = r
    return out


def embed(m, tokens):
    """The Llama's first stage: its own embedding and its own rotary function."""
    args = llama.ModelArgs()
    cos, sin = llama.rotary(torch.arange(tokens.shape[1]), args.dim // args.n_heads, args.rope_theta)
    return m.tok_embeddings(tokens), cos, sin


def head(m, h):
    return m.output(m.norm(h))


def pipeline(ctx, args):
    """The Llama (4 layers) cut into stages = every rank with PipelineStage, each schedule
    (interleaved: 2 chunks a stage), rotary tables crossing beside the hidden state, 09's
    clip over the pipeline group every step; the merged checkpoint against one process;
    and a checkpoint saved at this depth loaded by one process (the names are the model's)."""
    out, data, m = {}, batches(), 2
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs(n_layers=4))
    ref_trained = copy.deepcopy(ref)
    want = train_reference(ref_trained, data)
    a = ref.args
    hd, mb, t = a.dim // a.n_heads, data[0][0].shape[0] // m, data[0][0].shape[1]
    for schedule in pp.SCHEDULES:   # each cut where the pieces' measured times balance (collective)
        chunks = 2 if schedule == "interleaved" else 1
        model = copy.deepcopy(ref)
        stage = pp.PipelineStage(model, "layers", ctx.rank, ctx.world_size, embed, head, first=["tok_embeddings"],
                                 last=["norm", "output"], chunks=chunks, costs="measure",
                                 sample=(data[0][0][:mb], data[0][1][:mb]), loss_fn=llama.loss_fn)
        assert len(stage.costs) == a.n_layers + 2 and all(p.grad is None for p in model.parameters())
        pipe = pp.Pipeline(stage, m, llama.loss_fn, schedule, activation_shape=[(mb, t, a.dim), (t, hd // 2),
                                                                                (t, hd // 2)], chunks=chunks)
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-6)
        norms = []
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            pipe.step(x if pipe.first else None, y if pipe.last else None)
            norms.append(pp.clip_grad_norm_(stage.parameters(), MAX_NORM).item())
            opt.step()
        full = pp.full_state_dict(stage)   # on the first rank ({} on the others)
        r = compare(full, ref_trained) if full else None
        if full:
            r["norms"] = norms_close(norms, want)
            loaded = llama.Transformer(llama.ModelArgs(n_layers=4))
            loaded.load_state_dict(full)   # the model's own names: one process loads it as it is
            r["loads"] = compare(loaded.state_dict(), ref_trained)["ok"]
        out[schedule] = everyone(r)[0]
    out["tied"] = tied_pipeline(ctx, data, m)
    return out


def tied_pipeline(ctx, data, m):
    """The Llama with its output head tied to its embedding by the user (one Parameter),
    at 2 stages (1F1B): the first stage's copy and the last's add their gradients
    (09's tied_group and sum_tied_gradients), the clip counts the pair once."""
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs(n_layers=4))
    ref.output.weight = ref.tok_embeddings.weight
    ref_trained = copy.deepcopy(ref)
    want = train_reference(ref_trained, data)
    a = ref.args
    hd, mb, t = a.dim // a.n_heads, data[0][0].shape[0] // m, data[0][0].shape[1]
    stage = pp.PipelineStage(copy.deepcopy(ref), "layers", ctx.rank, ctx.world_size, embed, head,
                             first=["tok_embeddings"], last=["norm", "output"])
    pipe = pp.Pipeline(stage, m, llama.loss_fn, "1f1b", activation_shape=[(mb, t, a.dim), (t, hd // 2), (t, hd // 2)])
    group = pp.tied_group([list(range(ctx.world_size))])
    tied = pp.tie([stage.tok_embeddings.weight] if pipe.first else [stage.output.weight], group)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-6)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        pp.sum_tied_gradients(tied, group)
        norms.append(pp.clip_grad_norm_(stage, MAX_NORM).item())   # the tied pair counted once
        opt.step()
    full = pp.full_state_dict(stage)
    r = None
    if full:
        r = compare(full, ref_trained)
        r["norms"] = norms_close(norms, want)
    return everyone(r)[0]


nd = common.load_script(os.path.join(common.ROOT, "10_nd_parallel.py"))
fsdp = common.load_script(os.path.join(common.ROOT, "07_fsdp.py"))


def llama_init(m):
    """The Llama's init, one module at a time (placement.initialized): its norms' weights at
    one, the rest as torch initialises them (nn.Linear's and nn.Embedding's reset_parameters)."""
    if isinstance(m, llama.RMSNorm):
        torch.nn.init.ones_(m.weight)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()


def compose(model, mesh, m):
    """The Llama on ``mesh`` by calls, innermost first, as a user writes it: tp (08's whole-
    model plan) -> pipeline stages (09's PipelineStage) -> fsdp (07, each layer a unit) ->
    dp and cp's data ranks (05) -> the pipeline's schedule (09). Returns (the model or
    stage whose names are the model's, the module the optimizer steps, the pipeline or
    None). cp needs no call here: its context manager wraps each step."""
    P, D, F_, C, T = (mesh.size(a) for a in ("pp", "dp", "fsdp", "cp", "tp"))
    if T > 1:
        tp.parallelize(model, TP_PLAN, mesh.group("tp"))
    stage = pp.PipelineStage(model, "layers", mesh.coord("pp"), P, embed, head, first=["tok_embeddings"],
                             last=["norm", "output"]) if P > 1 else model
    layers = stage.layers.values() if P > 1 else stage.layers
    module = fsdp.FSDP(stage, process_group=mesh.group("fsdp"), units=list(layers)) if F_ > 1 else stage
    if D * C > 1:
        module = ddp.DDPBucketed(module, 1, process_group=mesh.joint(("dp", "cp")) if C > 1 else mesh.group("dp"))
    pipe = None
    if P > 1:
        pipe = pp.Pipeline(module, m, llama.loss_fn, "1f1b", mesh.group("pp"))   # shapes found by the first step
    return stage, module, pipe


def composed_steps(mesh, stage, module, pipe, opt, data, norms):
    """Clipped AdamW steps on the mesh: this replica's part of each batch (dp x fsdp), its cp
    part inside context_parallel; every gradient synchronized, then one clip over the mesh."""
    replicas = mesh.size("dp") * mesh.size("fsdp")
    replica = mesh.coord("dp") * mesh.size("fsdp") + mesh.coord("fsdp")
    for x, y in data:
        x, y = (common.shard(t, replica, replicas).clone() for t in (x, y))
        opt.zero_grad(set_to_none=True)
        if pipe is not None:
            pipe.step(x if pipe.first else None, y if pipe.last else None)
        else:
            pos = torch.arange(x.shape[1])
            with cpm.context_parallel(mesh.group("cp"), buffers=[x, y, pos], seq_dims=[1, 1, 0], method="ring"):
                llama.loss_fn(module(x, pos), y).backward()
        if hasattr(module, "finish_gradient_synchronization"):
            module.finish_gradient_synchronization()
        if not norms:   # first step: the inf and 1-norms, clipping nothing
            norms.append([placement.clip_grad_norm_(stage, 1e9, norm_type=p).item() for p in (float("inf"), 1)])
        norms.append(placement.clip_grad_norm_(stage, MAX_NORM).item())   # one norm over every axis
        opt.step()


def composed(ctx, args):
    """The Llama composed by calls on two meshes of 8 ranks, against one process: pp 2 x
    fsdp 2 x tp 2 trains the first half of the steps, its full checkpoint (model and AdamW,
    whole tensors by name) loads on dp 2 x cp 2 x tp 2, which trains the rest; and the
    other way round. Each checks its norms (every step's, and the inf norm), its counted-
    once parameter count and its whole weights against one process."""
    data, half = batches(), STEPS // 2
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs(n_layers=4))
    numel = sum(p.numel() for p in ref.parameters())
    probe = copy.deepcopy(ref)
    llama.loss_fn(probe(data[0][0]), data[0][1]).backward()
    other = [torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e9, norm_type=p).item() for p in (float("inf"), 1)]
    ref_trained = copy.deepcopy(ref)
    want = train_reference(ref_trained, data)
    path = os.path.join(args.out, "composed.pt")
    meshes = {"pp 2 x fsdp 2 x tp 2": {"pp": 2, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2},
              "dp 2 x cp 2 x tp 2": {"pp": 1, "dp": 2, "fsdp": 1, "cp": 2, "tp": 2}}
    out = {}
    for first, then in (tuple(meshes), tuple(meshes)[::-1]):
        r = {}
        for name, steps in ((first, data[:half]), (then, data[half:])):
            mesh = nd.Mesh(meshes[name])
            stage, module, pipe = compose(copy.deepcopy(ref), mesh, 2)
            opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6)
            norms = [] if name == first else [other]
            if name == then:
                ckpt = torch.load(path, weights_only=True)
                placement.load_full_state_dict(stage, ckpt["model"])
                placement.load_full_optim_state_dict(stage, opt, ckpt["optim"])
                r[name] = {"sharded": sharded_equals_full(stage, opt, sharded_checkpoint.latest_checkpoint(folder))}
                plain = llama.Transformer(llama.ModelArgs(n_layers=4))   # and into the model of one process
                sharded_checkpoint.load_sharded(plain, None, sharded_checkpoint.latest_checkpoint(folder))
                r["one process"] = all(torch.equal(v, ckpt["model"][k]) for k, v in plain.state_dict().items())
            composed_steps(mesh, stage, module, pipe, opt, steps, norms)
            r[name] = {**r.get(name, {}), "count": placement.count_parameters(stage) == numel}
            if name == first:
                folder = os.path.join(args.out, f"sharded {first}")   # each rank writes what it holds
                sharded_checkpoint.save_sharded(stage, opt, folder, half, extra={"mesh": first}, async_save=first == tuple(meshes)[0])
                sharded_checkpoint.wait_for_saves()
                dist.barrier()
                with open(os.path.join(sharded_checkpoint.latest_checkpoint(folder), "metadata.json")) as f:
                    saved = json.load(f)["tensors"]
                r["scalars once"] = sorted({len(v) for k, v in saved.items() if k.endswith("/step")})
                r["inf and 1-norm"] = all(abs(a - b) <= 1e-5 * b for a, b in zip(norms[0], other))
                try:   # a norm over tp alone: a stage's part is refused; data ranks' copies clip alike
                    placement.clip_grad_norm_(stage, 1e9, process_group=mesh.group("tp"))
                    r["refused"] = "not refused"
                except ValueError as e:
                    r["refused"] = str(e)
                ckpt = {"model": placement.full_state_dict(stage), "optim": placement.full_optim_state_dict(stage, opt)}
                if ctx.rank == 0:
                    torch.save(ckpt, path)
                dist.barrier()
            r[name]["norms"] = max(abs(a - b) / b for a, b in zip(norms[1:], want[:half] if name == first
                                                                   else want[half:])) < 1e-4
        full = placement.full_state_dict(stage, all_ranks=True)
        r.update(compare(full, ref_trained))
        out[f"{first}, then {then}"] = everyone(r)
    # the same composition on a model built on the meta device: each rank's part made real,
    # then the Llama's own init module by module (one process's values), trained every step
    with torch.device("meta"):
        model = llama.Transformer(llama.ModelArgs(n_layers=4))
    blueprint = copy.deepcopy(model)
    mesh = nd.Mesh(meshes["pp 2 x fsdp 2 x tp 2"])
    stage, module, pipe = compose(model, mesh, 2)
    placement.materialize(module, "cpu", placement.initialized(blueprint, llama_init, seed=0))
    held = sum(t.numel() for t in module.parameters())
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6)
    norms = [other]
    composed_steps(mesh, stage, module, pipe, opt, data, norms)
    r = compare(placement.full_state_dict(stage, all_ranks=True), ref_trained)
    r["norms"] = norms_close(norms[1:], want)
    r["held"] = held / numel
    out["pp 2 x fsdp 2 x tp 2, built on meta"] = everyone(r)
    counter = placement._counter   # the control: every rank counts what it holds (the record ignored)
    placement._counter = lambda *groups: lambda tensor: True
    try:
        out["control count"] = placement.count_parameters(stage) / numel
    finally:
        placement._counter = counter
    return out


def dropped(ctx, args):
    """Each class trains one step on the Llama and is dropped, as a loop that builds several
    models in one process drops them: {class: whether its parameters were freed} (the last
    layer's first parameter, after gc.collect). The control: a post-accumulate-grad hook
    that holds its wrapper (torch keeps such a hook where Python's collector cannot see)."""
    import gc
    import weakref
    overlap = common.load_script(os.path.join(common.ROOT, "04_overlap_ddp.py"))
    zero = common.load_script(os.path.join(common.ROOT, "06_sharded_optimizer.py"))
    (x, y), = batches(steps=1)
    W, r, out = ctx.world_size, ctx.rank, {}
    mine = lambda t: t.chunk(W)[r]   # noqa: E731
    a = llama.ModelArgs()

    def case(name, build, step, make=lambda: llama.Transformer(a)):
        def trained():
            torch.manual_seed(0)
            model = make()
            step(build(model))
            return weakref.ref(next(model.layers[-1].parameters()))
        held = trained()
        gc.collect()
        out[name] = held() is None
        dist.barrier()

    def data_parallel(m):
        llama.loss_fn(m(mine(x)), mine(y)).backward()
        m.finish_gradient_synchronization()

    def optimizer(cls):
        def build(model):
            return model, cls(model.parameters(), torch.optim.AdamW, lr=1e-3)

        def step(built):
            model, opt = built
            llama.loss_fn(model(mine(x)), mine(y)).backward()
            opt.step()
        return build, step

    def stage(model):
        s = pp.PipelineStage(model, "layers", r, W, embed, head, first=["tok_embeddings"], last=["norm", "output"])
        s.pipe = pp.Pipeline(s, W, llama.loss_fn, "1f1b")
        return s

    def with_experts(model):
        for layer in model.layers:
            layer.feed_forward.distribute()
        return ddp.DDPBucketed(model, 1, ignore_parameters=ep.expert_parameters(model))

    def in_context(model):
        xs, ys, pos = x.clone(), y.clone(), torch.arange(x.shape[1])
        with cpm.context_parallel(None, buffers=[xs, ys, pos], seq_dims=[1, 1, 0], method="ring"):
            llama.loss_fn(model(xs, pos), ys).backward()

    ft = common.load_script(os.path.join(common.ROOT, "14_fault_tolerant_dp.py"))
    groups = [dist.new_group([k]) for k in range(W)]   # each rank a replica

    def replicas(model):   # its all-reduce during backward (hooks on the parameters)
        coordinator = ft.Coordinator(min_replicas=W) if r == 0 else None
        address = everyone(coordinator and coordinator.address)[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return ft.ReplicaManager(model, opt, address, replica_id=r, process_group=groups[r], bucket_mb=1), coordinator

    def replica_step(built):   # one step, then dropped without close()
        manager, coordinator = built
        manager.start_step()
        llama.loss_fn(manager.module(mine(x)), mine(y)).backward()
        manager.should_commit(manager.all_reduce_gradients())
        dist.barrier()
        if coordinator:
            coordinator.close()

    class Holding(torch.nn.Module):   # the control
        def __init__(self, module):
            super().__init__()
            self.module = module

            def hook(p):
                assert self.module is not None   # the wrapper, in the hook's closure
            for p in module.parameters():
                p.register_post_accumulate_grad_hook(hook)

    case("DDPIndividualParameters", overlap.DDPIndividualParameters, data_parallel)
    case("DDPBucketed", lambda m: ddp.DDPBucketed(m, 1), data_parallel)
    case("ShardedOptimizer", *optimizer(zero.ShardedOptimizer))
    case("ShardedGradientOptimizer", *optimizer(zero.ShardedGradientOptimizer))
    case("FSDP", lambda m: fsdp.FSDP(m, units=list(m.layers)), lambda m: llama.loss_fn(m(mine(x)), mine(y)).backward())
    case("parallelize", lambda m: tp.parallelize(m, TP_PLAN), lambda m: llama.loss_fn(m(x), y).backward())
    case("PipelineStage", stage, lambda s: s.pipe.step(x if s.pipe.first else None, y if s.pipe.last else None))
    case("context_parallel", lambda m: m, in_context)
    case("MoE", with_experts, lambda m: (data_parallel(m), ep.reduce_expert_gradients(m.module)), make=llama_moe)
    case("ReplicaManager", replicas, replica_step)
    case("a hook holding its wrapper (the control)", Holding, lambda m: llama.loss_fn(m.module(x), y).backward())
    return out


def fault_tolerant_replicas(ctx, args):
    """The Llama in two replicas of one rank each (14's ReplicaManager, its Coordinator on
    rank 0 waiting for both), each replica half of every batch, torch's clip, AdamW: equal
    to one process on the whole batches, every step committed."""
    ft = common.load_script(os.path.join(common.ROOT, "14_fault_tolerant_dp.py"))
    data = batches()
    torch.manual_seed(0)
    ref = llama.Transformer(llama.ModelArgs())
    model = copy.deepcopy(ref)
    train_reference(ref, data)
    coordinator = ft.Coordinator(min_replicas=2) if ctx.rank == 0 else None
    address = [coordinator.address if coordinator else None]
    dist.broadcast_object_list(address, src=0)
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]   # each replica its own group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    manager = ft.ReplicaManager(model, opt, address[0], replica_id=ctx.rank, process_group=groups[ctx.rank])
    committed = 0
    while manager.start_step(len(data)):
        x, y = (z.chunk(2)[ctx.rank] for z in data[manager.step])
        llama.loss_fn(model(x), y).backward()
        if manager.should_commit(manager.all_reduce_gradients()):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            committed += 1
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    if coordinator:
        coordinator.close()
    r = compare({k: v.detach() for k, v in model.state_dict().items()}, ref)
    return {**r, "ok": r["ok"] and committed == len(data)}
