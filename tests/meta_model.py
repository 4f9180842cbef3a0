"""Workers for "a model larger than one rank": the tests' Llama (and the kit's LM) built under
torch.device("meta"), put on each axis with documented calls, given real storage for this
rank's part only by placement.materialize, filled either by the model's own init module by
module (placement.initialized: one process's values, bit for bit) or from a checkpoint
(load_full_state_dict, load_sharded), then trained against one process."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

import sharded_checkpoint
import placement
import diagnostics
import llama
from own_model import (MAX_NORM, TP_PLAN, batches, compare, ddp, embed, ep, everyone, fsdp, head, llama_init,
                       llama_moe, norms_close, pp, tp, train_experts, train_reference)


def on_meta(make):
    """(the model built on meta, its blueprint: a copy before any axis)."""
    with torch.device("meta"):
        model = make()
    return model, copy.deepcopy(model)


class NoMetaCollectives:
    """A traced_calls observer: a collective or message given a meta tensor raises."""
    seen = 0

    def enter(self, op, args, kwargs, group, async_op):
        self.seen += 1
        bad = [tuple(t.shape) for t in diagnostics.call_tensors(op, args, kwargs) if t.is_meta]
        if bad:
            raise AssertionError(f"{op} was given meta tensors {bad}")

    def exit(self, token, result):
        pass


def one_process(blueprint, seed=0):
    """The reference: one process's model from the same blueprint, init and seed."""
    model = copy.deepcopy(blueprint)
    return placement.materialize(model, "cpu", placement.initialized(blueprint, llama_init, seed=seed))


def train(module, opt, data, step, clip):
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        step(x, y)
        if hasattr(module, "finish_gradient_synchronization"):
            module.finish_gradient_synchronization()
        norms.append(clip().item())
        opt.step()
    return norms


def _result(full, ref, norms, want):
    r = compare(full, ref)
    r["norms"] = norms_close(norms, want)
    return r


def axes(ctx, args):
    """Each axis on a meta-built Llama, filled by the init (one process's values) and trained
    STEPS clipped AdamW steps against one process: DDPBucketed, FSDP (each layer a unit),
    parallelize (tp = every rank at 2 ranks; dp 2 x tp 2 at 4), PipelineStage (a stage a
    rank, 1F1B, its activation shapes found by the first step), and the MoE Llama with its
    experts split (ep = every rank). Then the checkpoint path: FSDP from meta filled by
    load_full_state_dict, and by load_sharded. No collective is given a meta tensor."""
    out, data, W, r = {}, batches(), ctx.world_size, ctx.rank
    watch = NoMetaCollectives()
    with diagnostics.traced_calls(watch):
        # -- DDPBucketed
        model, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        ref = one_process(bp)
        trained = copy.deepcopy(ref)
        want = train_reference(trained, data)
        wrapped = ddp.DDPBucketed(model, 1)
        placement.materialize(wrapped, "cpu", placement.initialized(bp, llama_init, seed=0))
        out["same init on every rank"] = everyone(float(sum(p.detach().double().sum() for p in model.parameters())))
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-6)
        norms = train(wrapped, opt, data, lambda x, y: llama.loss_fn(wrapped(x.chunk(W)[r]), y.chunk(W)[r]).backward(),
                      lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        out["ddp"] = _result(model.state_dict(), trained, norms, want)

        # -- FSDP, each layer a unit
        model, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        wrapped = fsdp.FSDP(model, units=list(model.layers))
        placement.materialize(wrapped, "cpu", placement.initialized(bp, llama_init, seed=0))
        out["fsdp held"] = sum(p.numel() for p in wrapped.parameters())
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-6)
        norms = train(wrapped, opt, data, lambda x, y: llama.loss_fn(wrapped(x.chunk(W)[r]), y.chunk(W)[r]).backward(),
                      lambda: wrapped.clip_grad_norm_(MAX_NORM))
        out["fsdp"] = _result(placement.full_state_dict(model, all_ranks=True), trained, norms, want)

        # -- tensor parallel (with DDPBucketed over the data ranks at 4)
        model, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        dp, t = (1, 2) if W == 2 else (2, 2)
        tp_groups = [dist.new_group(list(range(i, i + t))) for i in range(0, W, t)]
        dp_groups = [dist.new_group(list(range(i, W, t))) for i in range(t)]
        tp_group, dp_group = tp_groups[r // t], dp_groups[r % t]
        tp.parallelize(model, TP_PLAN, tp_group)
        wrapped = ddp.DDPBucketed(model, 1, process_group=dp_group) if dp > 1 else model
        placement.materialize(wrapped, "cpu", placement.initialized(bp, llama_init, seed=0))
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-6)
        norms = train(wrapped, opt, data,
                      lambda x, y: llama.loss_fn(wrapped(x.chunk(dp)[r // t]), y.chunk(dp)[r // t]).backward(),
                      lambda: tp.clip_grad_norm_(model, MAX_NORM, process_group=tp_group))
        out[f"dp {dp} x tp {t}"] = _result(placement.full_state_dict(model, all_ranks=True), trained, norms, want)

        # -- pipeline: a stage a rank, 1F1B, nothing said of the activations
        args4 = llama.ModelArgs(n_layers=4)
        model, bp = on_meta(lambda: llama.Transformer(args4))
        ref4 = one_process(bp)
        trained4 = copy.deepcopy(ref4)
        want4 = train_reference(trained4, data)
        stage = pp.PipelineStage(model, "layers", r, W, embed, head, first=["tok_embeddings"], last=["norm", "output"])
        pipe = pp.Pipeline(stage, 2, llama.loss_fn, "1f1b")
        placement.materialize(stage, "cpu", placement.initialized(bp, llama_init, seed=0))
        held = sum(p.numel() for p in stage.parameters())
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-6)
        norms = train(stage, opt, data, lambda x, y: pipe.step(x if pipe.first else None, y if pipe.last else None),
                      lambda: pp.clip_grad_norm_(stage.parameters(), MAX_NORM))
        full = pp.full_state_dict(stage, all_ranks=True)
        out["pipeline"] = {**_result(full, trained4, norms, want4), "held": everyone(held),
                           "whole": sum(p.numel() for p in ref4.parameters()),
                           "meta left": sum(p.is_meta for p in model.parameters())}

        # -- experts split over every rank, the rest under DDPBucketed
        model, bp = on_meta(llama_moe)
        ref = one_process(bp)
        for moe in (m for m in model.modules() if isinstance(m, ep.MoE)):
            moe.distribute()
        wrapped = ddp.DDPBucketed(model, 1, ignore_parameters=ep.expert_parameters(model))
        placement.materialize(wrapped, "cpu", placement.initialized(bp, llama_init, seed=0))
        out["experts"] = {**train_experts(ctx, model, wrapped, ref, data),
                          "local": sorted(model.layers[0].feed_forward.experts.keys())}

        # -- the checkpoint path: storage only, then a whole state dict, or a sharded checkpoint
        model, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        saved = one_process(bp, seed=7)
        wrapped = fsdp.FSDP(model, units=list(model.layers))
        placement.materialize(wrapped, "cpu")
        placement.load_full_state_dict(model, saved.state_dict())
        out["load_full_state_dict"] = compare(placement.full_state_dict(model, all_ranks=True), saved)
        folder = os.path.join(args.out, "meta-sharded")
        sharded_checkpoint.save_sharded(copy.deepcopy(saved), None, folder, 1)
        dist.barrier()
        model, _ = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        if W == 4:   # tp 2 x fsdp 2; at 2 ranks FSDP alone
            tp.parallelize(model, TP_PLAN, tp_group)
        wrapped = fsdp.FSDP(model, units=list(model.layers), process_group=None if W == 2 else dp_group)
        placement.materialize(wrapped, "cpu")
        sharded_checkpoint.load_sharded(model, None, sharded_checkpoint.latest_checkpoint(folder))
        out["load_sharded"] = compare(placement.full_state_dict(model, all_ranks=True), saved)
        out["load_sharded"]["exact"] = all(torch.equal(v, saved.state_dict()[k])
                                           for k, v in placement.full_state_dict(model, all_ranks=True).items())
    out["collectives seen"] = watch.seen
    out["collect"] = collected(ctx)
    return out


def collected(ctx):
    """placement's merge of every rank's tensors (full_state_dict's and full_optim_state_dict's
    transport: tensors in one flat buffer a rank, the rest pickled), on the world and on a
    group of the last ranks, to the first rank and to all: each rank's tensors arrive bit
    for bit, on the host, with their dtypes and shapes (bf16, complex, bool, 0-d, no elements,
    a transposed view), one tensor named twice still one object, a Parameter and the values
    that are not tensors as pickled, nothing sharing memory with the sender's."""
    def mine(r, most=False):   # most: this rank sends nearly all (the others' buffers not padded to it)
        g = torch.Generator().manual_seed(r)
        shared = torch.randn(3, generator=g)
        return {"most": torch.randn(4096 if most else 1, generator=g),
                "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
                "0-d": torch.tensor(r + 0.5, dtype=torch.float64),
                "empty": torch.empty(0, 5), "transposed": torch.randn(3, 5, generator=g).t(),
                "complex": torch.randn(2, generator=g, dtype=torch.complex64), "bool": torch.arange(5) % (r + 2) == 0,
                "tied": shared, "tied again": shared, "param": torch.nn.Parameter(torch.full((2,), float(r))),
                "state": {"step": torch.tensor(float(r + 1)), "lr": 1e-3 * r, "names": [f"rank {r}"]}}

    def same(a, b):
        if torch.is_tensor(a):
            return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu" and \
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b
    out, last = {}, list(range(1, ctx.world_size))
    groups = {"world": None, "last ranks": dist.new_group(last)}
    for label, group in groups.items():
        ranks = list(range(ctx.world_size)) if group is None else last
        if ctx.rank not in ranks:
            continue
        for most, all_ranks in ((most, all_ranks) for most in (None, ranks[-1]) for all_ranks in (True, False)):
            case = f"{label}, {'to all' if all_ranks else 'to the first'}" + \
                (", one sends most" if most is not None else "")
            sent = mine(ctx.rank, ctx.rank == most)
            parts = placement._collect(sent, group, all_ranks)
            if not all_ranks and ctx.rank != ranks[0]:
                out[case] = parts is None
                continue
            ok = len(parts) == len(ranks) and all(same(mine(r, r == most), p) for r, p in zip(ranks, parts))
            ok = ok and all(p["tied"] is p["tied again"] for p in parts)
            if len(ranks) > 1:   # a copy: the sender's tensor keeps its values (a group of one returns its own)
                parts[ranks.index(ctx.rank)]["bf16"].zero_()
            out[case] = ok and same(mine(ctx.rank, ctx.rank == most), sent)
        out[f"{label}, nothing but values"] = placement._collect({"rank": ctx.rank}, group, True) == \
            [{"rank": r} for r in ranks]
    if ctx.rank in last:
        dist.destroy_process_group(groups["last ranks"])
    return everyone(out)


def refusals(ctx, args):
    """What a meta model's setup refuses, each on every rank and before anything is sent:
    a stated activation shape that the model does not send, an init that writes into
    another module's tensor, a module with no reset_parameters and no init given."""
    out, data = {}, batches(steps=1)
    model, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
    stage = pp.PipelineStage(model, "layers", ctx.rank, ctx.world_size, embed, head, first=["tok_embeddings"],
                             last=["norm", "output"])
    placement.materialize(stage, "cpu", placement.initialized(bp, llama_init, seed=0))
    pipe = pp.Pipeline(stage, 2, llama.loss_fn, "1f1b", activation_shape=(4, 16, 32))   # dim is 64; and rotary
    try:
        x, y = data[0]
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        out["shape"] = "not refused"
    except ValueError as e:
        out["shape"] = str(e)
    out["grads after"] = sum(p.grad is not None for p in stage.parameters())

    def meddling(m):   # a parent's init reaching into its child's weight
        if isinstance(m, llama.Attention):
            m.wq.weight.fill_(0.0)
        else:
            llama_init(m)
    for label, init in (("other module", meddling), ("no reset", None)):
        _, bp = on_meta(lambda: llama.Transformer(llama.ModelArgs()))
        try:
            for _ in placement.initialized(bp, init, seed=0):
                pass
            out[label] = "not refused"
        except ValueError as e:
            out[label] = str(e)
    return out
