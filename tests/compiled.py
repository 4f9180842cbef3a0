"""Workers for torch.compile: the tests' Llama with each of its layers compiled
(``layer.compile()``, torch.compile per block as torchtitan does; inductor on the CPU) on
each copyable class, against the same compiled model in one process."""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

import placement
import llama
from own_model import (MAX_NORM, TP_PLAN, batches, compare, cpm, ddp, embed, ep, fsdp, head, norms_close, pp, tp,
                       with_floor)

STEPS = 2


def compiled_layers(model):
    for layer in model.layers:
        layer.compile()
    return model


def _moe_llama():
    torch.manual_seed(0)
    a = llama.ModelArgs()
    m = llama.Transformer(a)
    for layer in m.layers:
        layer.feed_forward = ep.MoE(a.dim, a.ffn_hidden, 4, top_k=2,
                                    expert=lambda: llama.FeedForward(a.dim, a.ffn_hidden))
    return m


def _reference(model, data, parts, loss=None):
    """One process, compiled the same way: each step's batch as ``parts`` micro-batches of
    the ranks' shape (the compiled graphs are the ranks'), their mean loss; torch's clip."""
    loss = loss or (lambda m, x, y: llama.loss_fn(m(x), y))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            (loss(model, xs, ys) / parts).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
    return norms


def classes(ctx, args):
    """Each class on the compiled Llama at 2 ranks, STEPS clipped AdamW steps: DDPBucketed,
    FSDP (each layer a unit, prefetching), parallelize (tp 2), PipelineStage (2 stages,
    1F1B, 2 micro-batches), context_parallel (ring, cp 2, DDPBucketed over the group) and
    the MoE with its experts split (ep 2). Each: the comparison with one process (or the
    error it raised, which ends the job: the other rank may be waiting in the middle of a
    step), and the seconds it took (its compilation included)."""
    W, r, data, out = ctx.world_size, ctx.rank, batches(steps=STEPS), {}
    # inductor compiles in this process: no pool of compile workers, each importing torch
    # again (the ranks already share the machine's cores; a pool only adds their start);
    # its C++ kernels scalar: what is tested is the classes' hooks, graph breaks and
    # collectives under compile, which a kernel's SIMD does not change, and gcc builds a
    # scalar kernel faster (the cold test: 140 -> 117 core-s here); both sides of each
    # comparison run the same kernels
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1
    torch._inductor.config.cpp.vec_isa_ok = False
    torch.manual_seed(0)
    base = llama.Transformer(llama.ModelArgs())
    trained = compiled_layers(copy.deepcopy(base))
    if r > 0:   # rank 0 compiles first and the others find its kernels in inductor's cache on disk
        dist.barrier()
    want = with_floor(trained, data, _reference, W, twin=copy.deepcopy(base).double())
    if r == 0:
        dist.barrier()
    pos = torch.arange(data[0][0].shape[1])

    def case(name, build, step, clip, full):
        began = time.perf_counter()
        try:
            module = build()
            opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6)
            norms = []
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                step(module, x, y)
                if hasattr(module, "finish_gradient_synchronization"):
                    module.finish_gradient_synchronization()
                norms.append(clip(module).item())
                opt.step()
            got = full(module)
            res = compare(got, refs.get(name, trained)) if got else {}
            if got:
                res["norms"] = norms_close(norms, wants.get(name, want))
        except Exception as e:   # the other rank may wait in the middle of the step: end the job now
            raise RuntimeError(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        res["seconds"] = time.perf_counter() - began
        res["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]   # compiled so far (not eager)
        if name == "PipelineStage":   # graphs the shape probe compiled: none (it runs eager)
            res["probe_graphs"] = probe_graphs[0]
        everyone = [None] * W
        dist.all_gather_object(everyone, res)
        out[name] = next(x for x in everyone if x)
    refs, wants, probe_graphs = {}, {}, [None]
    mine = lambda t: t.chunk(W)[r]   # noqa: E731
    case("DDPBucketed", lambda: ddp.DDPBucketed(compiled_layers(copy.deepcopy(base)), 1),
         lambda m, x, y: llama.loss_fn(m(mine(x)), mine(y)).backward(),
         lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM), lambda m: m.module.state_dict())
    def fsdp_build():
        model = compiled_layers(copy.deepcopy(base))
        return fsdp.FSDP(model, units=list(model.layers))   # each compiled layer a unit (prefetching)
    case("FSDP", fsdp_build, lambda m, x, y: llama.loss_fn(m(mine(x)), mine(y)).backward(),
         lambda m: m.clip_grad_norm_(MAX_NORM), lambda m: placement.full_state_dict(m.module, all_ranks=True))
    case("parallelize", lambda: compiled_layers(tp.parallelize(copy.deepcopy(base), TP_PLAN)),
         lambda m, x, y: llama.loss_fn(m(x), y).backward(),
         lambda m: tp.clip_grad_norm_(m, MAX_NORM), lambda m: placement.full_state_dict(m, all_ranks=True))

    def stage_of():
        stage = pp.PipelineStage(copy.deepcopy(base), "layers", r, W, embed, head, first=["tok_embeddings"],
                                 last=["norm", "output"])
        for layer in stage.layers.values():
            layer.compile()
        stage.pipe = pp.Pipeline(stage, W, llama.loss_fn, "1f1b")
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        stage.pipe.infer(data[0][0] if stage.pipe.first else None)   # (the first step's shape probe, called first)
        probe_graphs[0] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        return stage
    case("PipelineStage", stage_of, lambda m, x, y: m.pipe.step(x if m.pipe.first else None, y if m.pipe.last else None),
         lambda m: pp.clip_grad_norm_(m, MAX_NORM), lambda m: pp.full_state_dict(m, all_ranks=True))

    def cp_step(m, x, y):
        x, y, p = x.clone(), y.clone(), pos.clone()
        with cpm.context_parallel(None, buffers=[x, y, p], seq_dims=[1, 1, 0], method="ring"):
            llama.loss_fn(m(x, p), y).backward()
    case("context_parallel", lambda: ddp.DDPBucketed(compiled_layers(copy.deepcopy(base)), 1), cp_step,
         lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM), lambda m: m.module.state_dict())
    moe = _moe_llama()
    moe_trained = compiled_layers(copy.deepcopy(moe))
    aux = lambda m: sum(x.aux for x in m.modules() if isinstance(x, ep.MoE))   # noqa: E731
    moe_loss = lambda m, x, y: llama.loss_fn(m(x), y) + 0.01 * aux(m)   # noqa: E731
    refs["MoE"], wants["MoE"] = moe_trained, with_floor(moe_trained, data, _reference, W, moe_loss,
                                                        twin=copy.deepcopy(moe).double())

    def moe_build():
        model = compiled_layers(copy.deepcopy(moe))
        for x in model.modules():
            if isinstance(x, ep.MoE):
                x.distribute()
        return ddp.DDPBucketed(model, 1, ignore_parameters=ep.expert_parameters(model))

    def moe_clip(m):   # after DDP's finish: each expert's gradient over its copies (none at ep = world), the clip
        ep.reduce_expert_gradients(m.module)
        return ep.clip_grad_norm_(m.module, MAX_NORM)
    case("MoE", moe_build, lambda m, x, y: moe_loss(m.module, mine(x), mine(y)).backward(), moe_clip,
         lambda m: ep.full_state_dict(m.module, all_ranks=True))
    return out
