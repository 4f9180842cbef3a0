"""Pipeline parallelism: consecutive layers on consecutive ranks, activations sent forward
and their gradients backward, micro-batches to shrink the idle time, with the GPipe, 1F1B,
interleaved 1F1B and zero-bubble (ZB-H1) schedules.

A stage computes its layers for one micro-batch (F), sends the activations to the next
stage, and later gets their gradient back to run its backward (B). GPipe runs every
micro-batch's forward, then every backward: each stage holds the activations of all m
micro-batches at once. 1F1B starts backward as soon as the last stage can: after a few
warm-up forwards each stage alternates one forward and one backward, so stage s holds at
most p - s micro-batches. Both leave the same idle time, the bubble (p-1)/(m+p-1) of a step
for p stages of equal cost. Interleaved 1F1B cuts the model into p·v chunks and gives stage
s chunks s, s + p, ...: a micro-batch passes each stage v times, the bubble shrinks to
(p-1)/(v m+p-1) for v times the point-to-point traffic. ZB-H1 splits each backward into B
(the input's gradient, sent upstream at once) and W (the weights' gradient, from the input
and output gradient each linear kept) and runs the W's in what was the bubble: (p-1)/(3m+
p-1) when F, B and W take as long, a third of 1F1B's, holding no more than 1F1B's stage 0.
Gradients accumulate over the micro-batches; one optimizer step per global batch. With
p = 2 and m = 1 this is plain model parallelism: the model in two halves on two devices.

In your own training loop (the copy region and placement.py have all of it):
    stage = MyStage(model, rank, n_stages)             # its layers under the model's own names
    # (PipelineStage(model, "layers", ...) for your model; ModelStage(model, ...) for a transformers one)
    pipe = Pipeline(stage, 8, loss_fn, "1f1b", pp_group)   # what crosses the stages: found by step 1
    opt.zero_grad(); pipe.step(x if pipe.first else None, y if pipe.last else None)
    clip_grad_norm_(stage, max_norm, process_group=pp_group)   # not torch's: a stage holds a part
    opt.step()
    model_sd, optim_sd = full_state_dict(stage, pp_group), full_optim_state_dict(stage, opt, pp_group)
    load_full_state_dict(stage, model_sd); load_full_optim_state_dict(stage, opt, optim_sd)
The full state dicts come whole on the pipeline's first rank (save them there) and load at
any number of stages. With data-parallel replicas of each stage, clip after their
gradients are averaged, over the pipeline's group. A head tied to the embedding lives on
the first and last stage: sum_tied_gradients adds the two copies' gradients (tied_group),
and tie(copies, group) records them, so the norm counts the weight once.

Run:
    python 09_pipeline_parallel.py                            # p = 2 and 4, m = 1..8, every schedule
    python 09_pipeline_parallel.py --stages 4 --schedule interleaved --chunks 2 --microbatches 4 8
    python 09_pipeline_parallel.py --stages 2 --replicas 2    # 2 stages x 2 data-parallel replicas
    torchrun --standalone --nproc-per-node 4 09_pipeline_parallel.py --stages 4

Prints PASS/FAIL per verification case (every stage's weights against one process, the
head tied to the embedding, clipped by the global norm), then a table: step time for each
schedule and number of micro-batches beside torch.distributed.pipelining on the same
stages (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and ScheduleInterleaved-
ZeroBubble with one stage per rank for zb1), the measured bubble beside the schedule's on
paper, peak activation memory and point-to-point bytes per stage beside their formulas.
Writes <out>/09_pipeline_parallel.{json,md} and a timeline per schedule,
<out>/09_timeline_{gpipe,1f1b,interleaved,zb1}.png.
"""

import copy
import hashlib
import math
import statistics

import common

# ---- begin copy: pipeline parallelism (needs torch, the standard library and placement.py) ----
import ast
import builtins
import contextlib
import inspect
import pickle
import textwrap
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from placement import (clip_grad_norm_, full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                       load_full_state_dict, place)   # noqa: F401 (what a loop needs, from here too)


def balanced_split(costs: list, n_stages: int, first: float = 0.0, last: float = 0.0) -> list:
    """Cut a list of layer costs into ``n_stages`` consecutive runs whose largest total is
    as small as possible; returns the index where each stage starts (and len(costs)).
    ``first`` / ``last``: what the first and the last run cost besides their layers (the
    embedding; the head and the loss)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    run = lambda i, j: prefix[j] - prefix[i] + (first if i == 0 else 0.0) + (last if j == n else 0.0)  # noqa: E731
    best = {(0, 0): (0.0, None)}   # (layers placed, stages used) -> (largest stage so far, previous cut)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            best[(j, s)] = min((max(best[(i, s - 1)][0], run(i, j)), i)
                               for i in range(s - 1, j) if (i, s - 1) in best)
    cuts, j = [n], n
    for s in range(n_stages, 0, -1):
        j = best[(j, s)][1]
        cuts.append(j)
    return cuts[::-1]


def measure_costs(pieces, sample, repeats=5, process_group=None) -> list:
    """Each piece's forward and backward seconds on this rank's device, [(F, B), ...]: the
    fastest of ``repeats`` (what the work takes; a shared machine only adds to it), after a
    pass over every piece unmeasured, averaged over the ranks of ``process_group`` (every
    rank then cuts the model the same way). ``pieces``: functions run in turn, each on the
    previous one's output (a tensor or a tuple of them; ``sample`` is the first's input);
    each runs on detached copies of its inputs, so its backward is its own, from a gradient
    of ones (the last piece returns the loss). The pieces' parameters get gradients: zero
    them after."""
    def once(piece, x):
        xs = x if isinstance(x, tuple) else (x,)
        ins = [t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t for t in xs]
        device = next((t.device for t in ins if torch.is_tensor(t)), torch.device("cpu"))
        _sync(device)
        t0 = time.perf_counter()
        out = piece(tuple(ins) if isinstance(x, tuple) else ins[0])
        _sync(device)
        t1 = time.perf_counter()
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t) and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        _sync(device)
        nxt = tuple(t.detach() if torch.is_tensor(t) else t for t in out) if isinstance(out, tuple) else out.detach()
        return (t1 - t0, time.perf_counter() - t1), nxt, device
    x = sample
    for piece in pieces:   # every kernel and buffer warmed up once
        x = once(piece, x)[1]
    times, x = [], sample
    for piece in pieces:
        runs = [once(piece, x) for _ in range(repeats)]
        times.append((min(r[0][0] for r in runs), min(r[0][1] for r in runs)))
        x, device = runs[-1][1], runs[-1][2]
    flat = torch.tensor([v for fb in times for v in fb], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        dist.all_reduce(flat, group=process_group)
        flat /= dist.get_world_size(process_group)
    flat = flat.tolist()
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(times))]


MEASURE_ON_META = ('costs="measure" times real weights, and this model is on the meta device: give costs '
                   "(measure_costs' list, measured on a model that fits) or cuts")


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of your own model, built from its pieces and its list
    of layers (``model.get_submodule(layers)``, an nn.ModuleList), holding the model's own
    modules under their own names: its state_dict keys are the model's, so full_state_dict
    merges the stages into the model's own checkpoint. ``first`` / ``last``: the names of
    the model's modules the first / last stage holds, nested names too ("model.embed_tokens",
    "lm_head": the stage gets the containers on the way, so ``stage.model.embed_tokens`` is
    the model's own); ``embed(stage, *inputs)`` turns the first stage's inputs into the
    activations, ``head(stage, h)`` the last stage's first activation into the output the
    loss takes. Each layer is called as ``call(layer, *activations)`` (default:
    ``layer(*activations)``; give ``call`` for a layer that takes some by keyword) and
    returns the new first activation; the others (rotary tables, positions, a mask) go on
    unchanged to the next layer and stage. A Llama-style model:

        def embed(m, tokens):
            cos, sin = rotary(torch.arange(tokens.shape[1]), head_dim, theta)   # the model's own function
            return m.tok_embeddings(tokens), cos, sin
        stage = PipelineStage(model, "layers", rank, n_stages, embed, lambda m, h: m.output(m.norm(h)),
                              first=["tok_embeddings"], last=["norm", "output"])
        pipe = Pipeline(stage, 8, loss_fn)      # what crosses the stages: found by the first step

    A transformers model: ModelStage (its own pipeline plan and forward: masks, rotary
    tables and soft-caps as the model computes them), not a hand-written embed and call.

    The layers are cut into n_stages x ``chunks`` runs of about equal ``costs`` (default:
    every layer alike; a list: one number a layer); with chunks v > 1 (interleaved) the
    stage holds runs stage, stage + p, ... and ``stage(*xs, chunk=j)`` runs its j-th.
    ``costs="measure"`` times every piece on this rank's device instead, forward and
    backward, averaged over ``process_group``'s ranks (collective): ``embed`` with the first
    modules, each layer, ``head`` with ``loss_fn``, on ``sample`` = (one micro-batch's
    inputs, its targets), and cuts so that the slowest stage (chunk) is as fast as it can
    be, the embedding and the loss counted where they run:

        stage = PipelineStage(model, "layers", rank, n_stages, embed, head, first=[...], last=[...],
                              costs="measure", sample=(tokens[:mb], targets[:mb]), loss_fn=loss_fn)

    ``costs`` may also be measure_costs' list [(F, B), ...] for the embedding, each layer
    and the head; ``cuts`` gives the runs' first layers (and the number of layers)
    outright. The stage keeps ``costs`` and ``cuts``."""

    def __init__(self, model, layers: str, stage: int, n_stages: int, embed=None, head=None, first=(), last=(),
                 chunks: int = 1, costs=None, sample=None, loss_fn=None, process_group=None, cuts=None, call=None):
        super().__init__()
        blocks, total = model.get_submodule(layers), n_stages * chunks
        if not 1 <= total <= len(blocks):
            raise ValueError(f"{n_stages} stages x {chunks} chunks for {len(blocks)} layers: at most one chunk a layer")
        self._call = call or _call_layer
        if costs == "measure":
            if any(p.is_meta for p in model.parameters()):
                raise ValueError(MEASURE_ON_META)
            if sample is None or loss_fn is None:
                raise ValueError('costs="measure" times the pieces on a micro-batch: give sample=(inputs, targets) '
                                 'and loss_fn')
            costs = measure_costs(_stage_pieces(model, blocks, embed, head, loss_fn, self._call), _with_targets(*sample),
                                  process_group=process_group)
            model.zero_grad(set_to_none=True)
        self._cut(len(blocks), stage, n_stages, chunks, costs, cuts)
        self.first, self.last, self.layers_name = stage == 0, stage == n_stages - 1, layers
        self._embed_fn, self._head_fn = embed, head   # (not .embed, .head: the model's modules may be named so)
        for name in first if self.first else ():   # the model's order: first modules, layers, last modules
            self._hold(name, model.get_submodule(name))
        self._hold(layers, nn.ModuleDict({str(i): blocks[i] for lo, hi in self.ranges for i in range(lo, hi)}))
        for name in last if self.last else ():
            self._hold(name, model.get_submodule(name))

    def _cut(self, n, stage, n_stages, chunks, costs, cuts):
        """The runs of the ``n`` layers this stage holds (``ranges``), from ``cuts`` or ``costs``."""
        total = n_stages * chunks
        pieces = costs is not None and all(isinstance(c, (tuple, list)) for c in costs)
        if cuts is None and pieces and len(costs) != n + 2:
            raise ValueError(f"costs: {len(costs)} pieces, but the embedding, {n} layers and the head are {n + 2}")
        if cuts is None and pieces:
            sums = [f + b for f, b in costs]   # the head as a last layer: a stage may hold it alone
            cuts = balanced_split(sums[1:], total, first=sums[0])
        elif cuts is None:
            cuts = balanced_split(list(costs) if costs is not None else [1.0] * n, total)
        if len(cuts) != total + 1 or cuts[0] != 0 or cuts[-1] not in (n, n + 1) or \
                any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"cuts {list(cuts)}: {total + 1} increasing numbers from 0 to {n} layers")
        self.costs, self.cuts = costs, list(cuts)
        self.ranges = [(cuts[k], min(cuts[k + 1], n)) for k in range(stage, total, n_stages)]

    def held_layers(self) -> list:
        """The layers this stage runs, in the model's order (FSDP's units, say)."""
        layers = self.get_submodule(self.layers_name)
        return [layers[str(i) if isinstance(layers, nn.ModuleDict) else i]
                for lo, hi in self.ranges for i in range(lo, hi)]

    def _hold(self, name, module):
        """Register ``module`` under its dotted name, making the containers on the way (plain
        modules, so that the keys below them stay the model's own)."""
        *path, leaf = name.split(".")
        owner = self
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.add_module(leaf, module)

    def forward(self, *xs, chunk=0):
        if self.first and chunk == 0:
            xs = self._embed_fn(self, *xs) if self._embed_fn is not None else xs
            xs = tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)
        layers = self.get_submodule(self.layers_name)
        for i in range(*self.ranges[chunk]):
            xs = (self._call(layers[str(i)], *xs), *xs[1:])
        if self.last and chunk == len(self.ranges) - 1:
            return self._head_fn(self, xs[0]) if self._head_fn is not None else xs[0]
        return xs if len(xs) > 1 else xs[0]


class ModelStage(PipelineStage):
    """Stage ``stage`` of ``n_stages`` of a transformers model, built from what the model
    ships about itself, with nothing written for its family: its pipeline plan
    (``config.base_model_pp_plan``: the modules before the decoder layers, the layers, the
    modules after; for a family that ships none, as GPT-2, OPT, BLOOM, Falcon and OLMoE,
    the plan read from the model: pipeline_plan) and its own forward. Every stage calls
    the model's forward as it is, so whatever that forward does besides the layers (the
    causal and sliding-window masks each layer type needs, the rotary tables of each type,
    an embedding scale, the final norm, a logit soft-cap) is the model's own code on every
    stage: layers another stage holds pass their input on untouched, this stage's first
    layer takes the activation received, and a stage that is not the last hands on the
    hidden state its last layer gave. The first stage holds the modules before the layers,
    the last those after them and the head (``lm_head``); a module with parameters that the
    plan does not place is refused, named. A multimodal model (Gemma 3's, Qwen-VL's class)
    is staged by its language model (its text config's plan), its vision tower and
    projector, which text never reaches, held by the first stage.

        stage = ModelStage(model, rank, n_stages)              # the model's own names: its checkpoints
        pipe = Pipeline(stage, 8, lambda out, y: F.cross_entropy(out["logits"].flatten(0, 1), y.flatten()))
        pipe.step(x if pipe.first else None, y if pipe.last else None)   # x: token ids (B, T)

    The first stage takes the token ids, and optionally the position ids (B, T) and an
    attention mask (B, T) (they ride along to every stage, as the model's keyword
    arguments); the last returns the model's own output (a ModelOutput). The model is called
    with ``use_cache=False``. (Under context parallelism, where a rank's positions skip, give
    the mask of ones: without one transformers takes the skip for packed sequences and
    builds a mask, which context_parallel refuses.)
    ``chunks``, ``costs`` (one number a layer, or measure_costs' pieces) and ``cuts`` as in
    PipelineStage. A weight tied between the embedding and the head (``tie_word_embeddings``)
    sits on the first and last stage: ``stage.tied`` lists it there, for tie() and
    sum_tied_gradients() (under a wrapper that replaces the parameters, as FSDP with its
    shards, take them again by their names once wrapped). A MoE model's balancing loss over
    every layer (``output_router_logits``) cannot be computed by one stage and is refused."""

    def __init__(self, model, stage: int, n_stages: int, chunks: int = 1, costs=None, cuts=None):
        nn.Module.__init__(self)
        config, kind = _text_config(model), type(model).__name__
        plan, base = pipeline_plan(model), _base_of(model)
        if not plan or base is None:
            raise ValueError(f"{kind} ships no pipeline plan (config.base_model_pp_plan) and none can be read from it: "
                             f"build its stages with PipelineStage(model, layers, stage, n_stages, embed, head, first, "
                             f"last, call=...)")
        if getattr(config, "output_router_logits", False):
            raise ValueError(f"{kind} has output_router_logits=True: its balancing loss is over every layer's router, "
                             f"which no one stage runs; build it with output_router_logits=False")
        prefix = "" if base is model else next(n for n, m in model.named_modules() if m is base) + "."
        keys = [k for k in plan if _has(base, k)]
        at = [k for k in keys if isinstance(base.get_submodule(k), nn.ModuleList)]
        if len(at) != 1:
            raise ValueError(f"{kind}'s pipeline plan {list(plan)} names {len(at)} lists of layers, not one")
        blocks, total = base.get_submodule(at[0]), n_stages * chunks
        if not 1 <= total <= len(blocks):
            raise ValueError(f"{n_stages} stages x {chunks} chunks for {len(blocks)} layers: at most one chunk a layer")
        if costs == "measure":
            raise ValueError('ModelStage takes costs as numbers (one a layer, or measure_costs\' pieces) or cuts, '
                             'not "measure"')
        i = keys.index(at[0])
        before, after = [prefix + k for k in keys[:i]], [prefix + k for k in keys[i + 1:]]
        aside = _beside(model, prefix[:-1])   # the head: the last stage's; a vision tower: the first's
        after += [n for n in aside if config is getattr(model, "config", None) or _holds_head(model, n)]
        before_too = [n for n in aside if n not in after]
        stray = sorted({prefix + n.rpartition(".")[0] for n, _ in base.named_parameters()
                        if not any(n.startswith(k + ".") for k in keys)})
        if stray:
            raise ValueError(f"{kind}'s {', '.join(stray)} has parameters its pipeline plan does not place on a "
                             f"stage: build its stages with PipelineStage(...)")
        self._cut(len(blocks), stage, n_stages, chunks, costs, cuts)
        self.first, self.last, self.layers_name = stage == 0, stage == n_stages - 1, prefix + at[0]
        held = {i for lo, hi in self.ranges for i in range(lo, hi)}
        firsts = {id(p) for n in before for p in model.get_submodule(n).parameters()}
        self.tied = [p for n in after for p in model.get_submodule(n).parameters() if id(p) in firsts] \
            if self.first != self.last else []   # (the same tensor, under the embedding's name or the head's)
        for names, holds in ((before, self.first), (after, self.last), (before_too, self.first)):
            for n in names if not holds else ():
                if any(True for _ in model.get_submodule(n).parameters()):
                    _put(model, n, _Absent(n, stage, model.get_submodule(n) if names is before else None))
        path, _, leaf = (prefix + at[0]).rpartition(".")
        self._unpacks = _unpacked(model.get_submodule(path) if path else model, leaf)
        for i in range(len(blocks)):
            if i not in held:
                blocks[i] = _Skip(self._unpacks, blocks[i])
        for name, child in model.named_children():   # the model's own names: stage.state_dict() is its
            self.add_module(name, child)
        self._model, self._after, self._n, self._stand_ins = [model], after, len(blocks), {}
        self._kind, self._counted = kind, False

    def _refuse_unstageable(self, calls, handed):
        """ValueError where the first forward ran a layer more than once or out of order
        (``calls``: the layers' indices as they ran), or gave a layer this stage holds what
        another stage's layers gave (``handed``: its names)."""
        again = sorted({i for i in calls if calls.count(i) > 1})
        if again or calls != sorted(calls):
            raise ValueError(f"{self._kind}'s forward runs its layers {again or calls} "
                             f"{'more than once each' if again else 'out of their order'} (a recurrent depth, as "
                             f"Dory's and Inkling2-Loop's loops): a pipeline stage holds each layer once, in order; "
                             f"train it on the other axes")
        if handed:
            raise ValueError(f"{self._kind}'s layers hand each other {', '.join(sorted(handed))} beside the hidden "
                             f"state (Inkling2's block states), here from a layer another stage holds: only the hidden "
                             f"state crosses between stages; train it on the other axes")

    def _stand_in(self, name, kind):
        """The _Skip or _Exit for the layer ``name``, made once (a plain dict: not a submodule)."""
        if (name, kind) not in self._stand_ins:
            layer = self._model[0].get_submodule(name)
            self._stand_ins[name, kind] = _Skip(self._unpacks, layer) if kind is _Skip else _Exit(layer)
        return self._stand_ins[name, kind]

    def forward(self, *xs, chunk=0):
        model, (lo, hi) = self._model[0], self.ranges[chunk]
        start, end = self.first and chunk == 0, self.last and chunk == len(self.ranges) - 1
        at = lambda i: f"{self.layers_name}.{i}" if i < self._n else self._after[0]   # noqa: E731 (the head after)
        swaps = {at(i): self._stand_in(at(i), _Skip) for lo2, hi2 in self.ranges if lo2 != lo for i in range(lo2, hi2)}
        if not end:     # hand on the hidden state where the next stage's first layer would run
            swaps[at(hi)] = self._stand_in(at(hi), _Exit)
        if not start:   # the activation received enters at this chunk's first layer (or the norm)
            swaps[at(lo)] = _Enter(model.get_submodule(at(lo)), xs[0])
        calls = None if self._counted else []   # (the first forward: the order the model runs its layers in,
        handed, seen = set(), _FromLayers()     # and what they hand each other; eager)
        if calls is not None:
            swaps.update({at(i): _Counted(swaps.get(at(i)) or model.get_submodule(at(i)), i, calls, handed, seen,
                                          frozenset(range(lo, hi))) for i in range(self._n)})
            self._counted = True
        kept = {name: model.get_submodule(name) for name in swaps}
        for name, m in swaps.items():
            _put(model, name, m)
        kw = dict(zip(("position_ids", "attention_mask"), xs[1:]))
        try:
            try:
                with seen if calls is not None else contextlib.nullcontext(), \
                        torch.compiler.set_stance("force_eager") if calls is not None else contextlib.nullcontext():
                    if start:
                        return model(input_ids=xs[0], use_cache=False, **kw)
                    return model(inputs_embeds=xs[0].detach(), use_cache=False, **kw)
            finally:
                if calls is not None:
                    self._refuse_unstageable(calls, handed)
        except _Handoff as handoff:
            return (handoff.hidden, *xs[1:]) if len(xs) > 1 else handoff.hidden
        finally:
            for name, m in kept.items():
                _put(model, name, m)


def pipeline_plan(model) -> list:
    """The names of a transformers model's pipeline plan, under its base model, in the order
    its forward runs them: the plan it ships (``config.base_model_pp_plan``), or for a
    family that ships none (GPT-2, OPT, BLOOM, Falcon, OLMoE), one read from the model
    itself: the one nn.ModuleList of its decoder layers (its ``_no_split_modules``; where it
    names none, the one outermost list of modules of one kind), and the
    modules beside it in the order the forward of the module holding it names them (its
    source, read, not run). A multimodal model's is its language model's (its text config's
    plan, under that model's base). [] where it cannot tell."""
    config, base = _text_config(model), _base_of(model)
    plan = getattr(config, "base_model_pp_plan", None)
    if plan or base is None:
        return list(plan or ())
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    lists = [n for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) and
             (all(type(x).__name__ in kinds for x in m) if kinds else len({type(x) for x in m}) == 1)]
    if not kinds:   # (a family that names none, as BioGPT: the outermost list of one kind of module)
        lists = [n for n in lists if not any(n.startswith(o + ".") for o in lists)]
    if len(lists) != 1:
        return []
    path, _, _ = lists[0].rpartition(".")
    holder = base.get_submodule(path) if path else base
    children = {n for n, _ in holder.named_children()}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(holder).forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    named = sorted((node.lineno, node.col_offset, node.attr) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                   and node.attr in children)
    order = list(dict.fromkeys(attr for _, _, attr in named))
    return [f"{path}.{n}" if path else n for n in order]


def _text_config(model):
    """A transformers model's config, or a multimodal model's text config (the language
    model's: ``get_text_config()``)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _base_of(model):
    """A transformers model's base model (its decoder, under the head): ``model.base_model``,
    or where that is the model itself because its ``base_model_prefix`` names nothing it
    holds (Llama4ForCausalLM's "language_model": its decoder is under "model"), its one
    child that is a transformers model itself; a multimodal model's, its language model's
    (Gemma 3's model.language_model, Llama 4's language_model.model: the outermost module
    built from its text config). None for a model that is no transformers'."""
    text = _text_config(model)
    if text is not getattr(model, "config", None):
        inner = next((m for m in model.modules() if m is not model and getattr(m, "config", None) is text), None)
        return _base_of(inner) if inner is not None else None
    base = getattr(model, "base_model", None)
    if base is model:
        inner = [m for _, m in model.named_children() if hasattr(m, "base_model_prefix")]
        base = inner[0] if len(inner) == 1 else base
    return base


def _beside(model, path: str) -> list:
    """The names of the modules beside the path from ``model`` down to the module named
    ``path`` (the children of each module on it, but the next one): a causal LM's head; a
    multimodal model's head, vision tower and projector."""
    names, at = [], ""
    for part in path.split(".") if path else ():
        holder = model.get_submodule(at) if at else model
        names += [f"{at}.{n}" if at else n for n, _ in holder.named_children() if n != part]
        at = f"{at}.{part}" if at else part
    return names


def _holds_head(model, name) -> bool:
    """Whether the module ``name`` is or holds the model's output embeddings (its head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and any(m is head for m in model.get_submodule(name).modules())


def _unpacked(holder, name) -> int:
    """How many names the forward of ``holder`` unpacks each of its layers' output into
    (Bamba's ``hidden_states, attn_weights = decoder_layer(...)``: 2), read from its source
    (the call inside a loop over ``self.<name>``); 0 where it takes the output as it is."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(holder).forward)))
    except (OSError, TypeError, SyntaxError):
        return 0
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)):
        if not any(isinstance(a, ast.Attribute) and a.attr == name and isinstance(a.value, ast.Name)
                   and a.value.id == "self" for a in ast.walk(loop.iter)):
            continue
        layer = {t.id for t in ast.walk(loop.target) if isinstance(t, ast.Name)}
        for node in ast.walk(loop):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and
                    isinstance(node.value.func, ast.Name) and node.value.func.id in layer and
                    isinstance(node.targets[0], ast.Tuple)):
                return len(node.targets[0].elts)
    return 0


def _has(module, name) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _put(model, name, module):
    *path, leaf = name.split(".")
    setattr(model.get_submodule(".".join(path)) if path else model, leaf, module)


class _StandIn(nn.Module):
    """A module in a layer's place, through which the layer's own plain attributes are read
    (NemotronH's forward picks each layer's mask by its ``block_type``; Inkling2's by a
    class attribute, ``attention_type``)."""

    def __init__(self, layer=None):
        super().__init__()
        self._own = layer._own if isinstance(layer, _StandIn) else {} if layer is None else {
            **{k: v for cls in reversed(type(layer).__mro__[:-len(nn.Module.__mro__)]) for k, v in vars(cls).items()
               if not k.startswith("_") and isinstance(v, (str, int, float, bool))},   # (Inkling2's attention_type)
            **{k: v for k, v in vars(layer).items() if not k.startswith("_") and k != "training"}}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            own = self.__dict__.get("_own", {})
            if name in own:
                return own[name]
            raise


class _Skip(_StandIn):
    """A layer another stage (or this stage's other chunk) runs: its input goes on as it is,
    as the first of ``unpacks`` values where the model's forward unpacks its layers' output
    into that many (Bamba's: 2; _unpacked). What it gives only ever reaches another _Skip,
    or _Enter, which replaces it: a loop that takes its layers' output[0] (BLOOM's,
    Falcon's) takes a row of it, to no effect."""

    def __init__(self, unpacks=0, layer=None):
        super().__init__(layer)
        self.unpacks = unpacks

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states, *[None] * (self.unpacks - 1)) if self.unpacks else hidden_states


class _FromLayers(torch.overrides.TorchFunctionMode):
    """A stage's first forward: which layers (their indices) each tensor the layers gave, or
    the model's forward made from that, comes from (by id, the tensor weakly held: a tensor
    gone leaves no stale id)."""

    def __init__(self):
        super().__init__()
        self.given = {}

    def origins(self, t) -> frozenset:
        entry = self.given.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else frozenset()

    def add(self, out, origins):
        for t in _tensors_in(out):
            self.given[id(t)] = (weakref.ref(t), origins)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        origins = frozenset().union(*(self.origins(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                                      if torch.is_tensor(t)))
        if origins:
            self.add(out, origins)
        return out


class _Counted(_StandIn):
    """A layer (or its stand-in) whose calls a stage's first forward notes in ``calls``; a
    layer this chunk runs (``held``: their indices) notes in ``handed`` the names of what it
    is given beside its hidden state that layers it does not hold gave, or the forward made
    from that (``seen``, a _FromLayers): that would have to cross between stages too."""

    def __init__(self, layer, index, calls, handed, seen, held):
        super().__init__(layer)
        self._inner = [layer, index, calls, handed, seen, held]

    def forward(self, *args, **kwargs):
        layer, index, calls, handed, seen, held = self._inner
        calls.append(index)
        if index in held:
            rest = {**{f"argument {i}": a for i, a in enumerate(args[1:], 1)},
                    **{k: v for k, v in kwargs.items() if k != "hidden_states"}}
            handed.update(k for k, v in rest.items() if any(seen.origins(t) - held for t in _tensors_in(v)))
        out = layer(*args, **kwargs)
        seen.add(out, frozenset([index]))
        return out


class _Handoff(Exception):
    """The hidden state a stage that is not the last hands on: raised where the next
    stage's first layer would run, ending the model's forward there."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden


class _Exit(_StandIn):
    def forward(self, hidden_states, *args, **kwargs):
        raise _Handoff(hidden_states)


class _Enter(_StandIn):
    """This chunk's first layer, given the activation received in place of the input the
    model's forward computed from nothing this stage holds."""

    def __init__(self, layer, hidden):
        super().__init__(layer)
        self._inner = [layer, hidden]

    def forward(self, *args, **kwargs):
        layer, hidden = self._inner
        if args:
            return layer(hidden, *args[1:], **kwargs)
        return layer(**{**kwargs, "hidden_states": hidden})


class _Absent(nn.Module):
    """A module another stage holds: the model's forward must not call it here. One that
    ran before the layers (``before``: the module it stands for) may be called: GPT-2's
    forward adds its position embedding, BLOOM's normalizes the embedding, whatever it is
    given. What it gives leads only to the first layer's input, which this stage replaces
    with the activation received (_Enter), so it gives zeros of the shape that module would
    give: an embedding's lookup, a linear layer's, or its input's (a norm)."""

    def __init__(self, name, stage, before=None):
        super().__init__()
        self.name, self.stage = name, stage
        self.width = (("embedding", before.embedding_dim) if isinstance(before, nn.Embedding) else
                      ("linear", before.out_features) if isinstance(before, nn.Linear) else
                      ("same", None) if before is not None else None)
        self.dtype = next(before.parameters()).dtype if before is not None else None

    def forward(self, *args, **kwargs):
        if self.width is not None:
            x = next(a for a in (*args, *kwargs.values()) if torch.is_tensor(a))
            kind, width = self.width
            shape = (*x.shape, width) if kind == "embedding" else (*x.shape[:-1], width) if kind == "linear" else x.shape
            return torch.zeros(shape, dtype=self.dtype if kind != "same" else x.dtype, device=x.device)
        raise RuntimeError(f"stage {self.stage} does not hold {self.name}, but the model's forward called it there: "
                           f"the model does more outside its layers than its pipeline plan says; build its stages "
                           f"with PipelineStage(...)")


def _tensors_in(out) -> list:
    """The tensors a stage returned, in order, however they are packed (a tensor, tuples,
    lists, dicts, transformers' ModelOutput: whatever torch's pytree knows); the next stage
    takes them as its positional arguments."""
    return [t for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]


def _with_targets(inputs, targets):
    return (*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)), targets)


def _call_layer(layer, *xs):
    return layer(*xs)


def _stage_pieces(model, blocks, embed, head, loss_fn, call=_call_layer):
    """PipelineStage's pieces for measure_costs: each carries (activations..., targets)."""
    def first(xs):
        *inputs, targets = xs
        out = embed(model, *inputs) if embed is not None else inputs
        return (*(out if isinstance(out, (tuple, list)) else (out,)), targets)

    def layer(b):
        return lambda xs: (call(b, *xs[:-1]), *xs[1:-1], xs[-1])

    def last(xs):
        return loss_fn(head(model, xs[0]) if head is not None else xs[0], xs[-1])
    return [first] + [layer(b) for b in blocks] + [last]


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _lm_embed(m, tokens):
    """The kit's LM's first pieces: token ids to embeddings, positions added."""
    return m.tok(tokens) + m.pos(torch.arange(tokens.shape[1], device=tokens.device))


def _lm_head(m, h):
    return m.head(m.ln_f(h))


def lm_pieces(model, loss_fn):
    """The kit's TransformerLM as measure_costs' pieces (PipelineStage's, given the LM's
    embedding and head): the embeddings (tokens in), each block, the final norm and head
    with the loss (the targets ride along with the activations)."""
    return _stage_pieces(model, model.blocks, _lm_embed, _lm_head, loss_fn)


def lm_costs(model, microbatch, seed=0, process_group=None) -> list:
    """The kit's LM's pieces timed forward and backward (measure_costs of lm_pieces) on one
    micro-batch of ``microbatch`` = (sequences, tokens) random token ids drawn from
    ``seed``, averaged over ``process_group``'s ranks; the model's gradients left unset.
    What every split of the LM by measured time starts from: LMStage(costs="measure"),
    09's benchmark, 10's meshes."""
    v, device = model.head.out_features, model.head.weight.device
    g = torch.Generator().manual_seed(seed)
    sample = tuple(torch.randint(0, v, microbatch, generator=g).to(device) for _ in range(2))
    costs = measure_costs(lm_pieces(model, lm_loss), sample, process_group=process_group)
    model.zero_grad(set_to_none=True)
    return costs


class LMStage(PipelineStage):
    """Stage ``stage`` of ``n_stages`` of the kit's TransformerLM: the embeddings (first
    stage), its share of the blocks, the final norm and output head (last stage), split so
    the stages cost about the same: a PipelineStage given the LM's pieces (its layers
    ``blocks``, its first modules ``tok`` and ``pos``, its last ``ln_f`` and ``head``), holding
    the model's own modules under their own names.
    With ``chunks`` v > 1 (interleaved schedules) the model is cut into p·v chunks and this
    stage holds chunks stage, stage + p, ..., one forward each: ``stage(x, chunk=j)`` runs
    its j-th.

        stage = LMStage(model, rank, world_size, costs="measure", microbatch=(mb, t))
        pipe = Pipeline(stage, n_microbatches=8, loss_fn=lm_loss)   # what crosses: found by the first step

    ``costs``: "flops" (a block costs 24 d^2 + 4 t d a token, the head 2 d V, the embedding
    nothing); "measure": each piece (the embeddings, every block, the norm and head with the
    loss) timed forward and backward on this rank's device for a micro-batch of
    ``microbatch`` = (sequences, tokens) (default: one sequence of the model's context),
    averaged over ``process_group``'s ranks (collective: every rank builds its stage); or
    measure_costs' list [(F, B), ...] of those pieces, from a measurement made once.
    ``cuts``: the p·v runs' first blocks and the number of blocks, given outright. The
    measured times stay on the stage (``costs``), with its cuts (``cuts``)."""

    def __init__(self, model, stage: int, n_stages: int, chunks: int = 1, costs="flops", microbatch=None,
                 process_group=None, cuts=None):
        d, t, v = model.tok.embedding_dim, model.pos.num_embeddings, model.head.out_features
        n = len(model.blocks)
        if cuts is None and costs == "flops" and 1 <= n_stages * chunks <= n:   # the blocks, then the head
            cuts = balanced_split([24 * d * d + 4 * t * d] * n + [2 * d * v], n_stages * chunks)
        elif cuts is None and costs == "measure" and not model.head.weight.is_meta:
            costs = lm_costs(model, microbatch or (1, t), 0, process_group)
        super().__init__(model, "blocks", stage, n_stages, _lm_embed, _lm_head, first=["tok", "pos"],
                         last=["ln_f", "head"], chunks=chunks, costs=None if costs == "flops" else costs,
                         loss_fn=lm_loss, process_group=process_group, cuts=cuts)


def recompute(blocks, mode="full"):
    """Activation recomputation on the kit's blocks (common.Block: its ``recompute``
    setting, read by its own forward): "full" keeps only each block's input and runs its
    forward again in backward; "selective" only attention's core (softmax(q k^T) v), the
    part Korthikanti et al. 2022 recompute: memory that grows with the sequence, little work
    to redo (a fused kernel such as SDPA's flash already keeps only its output and
    log-sum-exp); "none" leaves them. torch.utils.checkpoint, non-reentrant. Your own
    layers: wrap them in torch's checkpoint_wrapper instead."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"unknown recompute mode {mode!r}: none, full or selective")
    for block in blocks:
        if not hasattr(block, "recompute"):
            raise ValueError(f"{type(block).__name__} has no recompute setting: wrap it in torch's checkpoint_wrapper")
        block.recompute = mode
    return blocks


# A schedule is each rank's order of actions (kind, chunk, micro-batch): F forward, B
# backward (with W: its input-gradient half), W the weight-gradient half.
def _one_chunk(name, chunks):
    if chunks != 1:
        raise ValueError(f"the {name} schedule runs one chunk per stage, not {chunks}: use interleaved")


def gpipe_order(n_microbatches: int, stage: int, n_stages: int, chunks: int = 1) -> list:
    """Every forward, then every backward."""
    _one_chunk("gpipe", chunks)
    m = n_microbatches
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def one_f_one_b_order(n_microbatches: int, stage: int, n_stages: int, chunks: int = 1) -> list:
    """Warm-up forwards (p - s - 1 of them), then one forward one backward, then the
    remaining backwards: stage s never holds more than p - s micro-batches."""
    _one_chunk("1f1b", chunks)
    m = n_microbatches
    warm = min(n_stages - stage - 1, m)
    order = [("F", 0, i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", 0, warm + i), ("B", 0, i)]
    return order + [("B", 0, i) for i in range(m - warm, m)]


def interleaved_order(n_microbatches: int, stage: int, n_stages: int, chunks: int = 2) -> list:
    """Interleaved 1F1B (Narayanan et al. 2021): the stage's v chunks take the micro-batches
    in groups of p (chunk 0 for micro-batches 0..p-1, chunk 1 for the same, ..., then the
    next group); forwards run ahead by 2 (p - s - 1) + (v - 1) p chunk-steps, then one
    forward one backward, backwards in the reverse chunk order. The bubble shrinks v times,
    to (p - 1) / (v m + p - 1), for v times the point-to-point traffic. Requires m to be a
    multiple of p (as Megatron-LM's)."""
    p, v, m = n_stages, chunks, n_microbatches
    if m % p:
        raise ValueError(f"interleaved needs micro-batches in groups of the {p} stages: {m} is not a multiple of {p}")
    total = m * v
    micro = lambda k: (k // (p * v)) * p + k % p   # noqa: E731  (the k-th chunk-step's micro-batch)
    fwd = lambda k: ("F", (k // p) % v, micro(k))   # noqa: E731
    bwd = lambda k: ("B", v - 1 - (k // p) % v, micro(k))   # noqa: E731
    warm = min(2 * (p - stage - 1) + (v - 1) * p, total)
    order = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        order += [fwd(warm + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warm, total)]


def zb1_order(n_microbatches: int, stage: int, n_stages: int, chunks: int = 1) -> list:
    """ZB-H1 (Qi et al. 2023): 1F1B's order with each backward split into B (the input's
    gradient, sent upstream at once) and W (the weights' gradient). Stage s runs W of
    micro-batch i - s right after B of micro-batch i, the rest at the end: the W's fill the
    bubble, and stage s holds at most p micro-batches (forwarded and not yet W'd), 1F1B's
    peak on stage 0. With B and W as long as F each, the bubble is (p - 1) / (3 m + p - 1)
    for m >= p, a third of 1F1B's."""
    _one_chunk("zb1", chunks)
    order, done = [], 0
    for kind, c, i in one_f_one_b_order(n_microbatches, stage, n_stages):
        order.append((kind, c, i))
        if kind == "B" and i >= stage:
            order.append(("W", c, i - stage))
            done += 1
    return order + [("W", 0, i) for i in range(done, n_microbatches)]


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "interleaved": interleaved_order, "zb1": zb1_order}


class _DeferredLinear(torch.autograd.Function):
    """A linear layer whose backward computes only the input's gradient and leaves the
    weight's to W: it keeps (weight, bias, input, output gradient) in ``stash``."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.stash = weight, bias, stash   # the parameters themselves, for W
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        # the node lets go of the stash: x's graph leads back to the linears before it, whose
        # nodes would otherwise hold the stash that holds x (a cycle through autograd's C++
        # graph, which no garbage collection sees: a step's inputs and gradients leaked)
        stash, ctx.stash = ctx.stash, None
        stash.append((ctx.weight, ctx.bias, x, grad))
        return (grad.matmul(ctx.weight) if ctx.needs_input_grad[0] else None), None, None, None


class _DeferWeightGradients(torch.overrides.TorchFunctionMode):
    """While active, every nn.functional.linear on a weight that is a leaf (a parameter)
    goes through _DeferredLinear: nn.Linear and the tensor-parallel layers alike."""

    def __init__(self, stash):
        super().__init__()
        self.stash = stash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.requires_grad and weight.is_leaf:
                return _DeferredLinear.apply(x, weight, bias, self.stash)
        return func(*args, **kwargs)


@torch.no_grad()
def _weight_gradients(stash, through_autograd=False):
    """W: each deferred linear's weight gradient, grad_out^T @ input (and the bias's, the
    sum of grad_out), added to its .grad; ``through_autograd``: handed to autograd instead,
    so that gradient hooks (a DDP wrapper's) fire as in a plain backward."""
    grads = {}
    for weight, bias, x, g in stash:
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        for p, gp in ((weight, (g2, x2)), (bias, g2)):
            if p is None:
                continue
            if not through_autograd and p.grad is not None:
                p.grad.addmm_(gp[0].t(), gp[1]) if p is weight else p.grad.add_(gp.sum(0))
                continue
            gp = gp[0].t().matmul(gp[1]) if p is weight else gp.sum(0)
            if through_autograd:
                grads[p] = grads[p] + gp if p in grads else gp
            else:
                p.grad = gp
    if grads:
        torch.autograd.backward(list(grads), list(grads.values()))


def _send_object(obj, dst, group, wire):
    """``obj`` pickled to rank ``dst`` of ``group``: its length, then its bytes, two sends of
    tensors on ``wire`` (torch.distributed's send, which the flight recorder sees: its
    send_object_list calls a send of its own module that no wrapper reaches, so that a rank
    waiting in it looked busy in no call to the stall report)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire), dst=dst, group=group)
    dist.send(data.to(wire), dst=dst, group=group)


def _recv_object(src, group, wire):
    """What _send_object sent from rank ``src`` of ``group``."""
    n = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.recv(n, src=src, group=group)
    data = torch.empty(int(n.item()), dtype=torch.uint8, device=wire)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.cpu().numpy().tobytes())


class Pipeline:
    """Runs this rank's stage of a pipeline over ``process_group`` (default: every rank;
    stage = the rank's place in the group). Each ``step`` splits the global batch into
    micro-batches and runs their forwards and backwards in the schedule's order, receiving
    activations from the previous stage and gradients from the next (non-blocking
    isend/irecv, each action's receive batched with the previous action's send, as NCCL
    needs). Gradients accumulate in ``module``'s .grad as the whole batch's mean.

        stage = MyStage(...)                                    # this rank's layers
        pipe = Pipeline(stage, 8, loss_fn, schedule="1f1b")    # what crosses: found by the first step
        opt = torch.optim.AdamW(stage.parameters())
        opt.zero_grad()
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)   # loss on the last stage
        opt.step()

    Schedules (SCHEDULES): "gpipe", "1f1b", "interleaved" (``chunks`` v >= 2 chunks per
    stage, ``module(x, chunk=j)`` runs the j-th; m a multiple of p), and "zb1" (ZB-H1: each
    linear's weight gradient is left out of backward and computed later, in W, from the
    input and output gradient it kept). A stage may return its tensors packed any way
    (a tuple, a dict, a ModelOutput: torch's pytree), they cross in that order and the next
    stage takes them as positional arguments; the last stage's output goes to ``loss_fn``
    as it is. What crosses each stage boundary (the tensors,
    their shapes and dtypes) is found by the first step before it sends anything (infer:
    one no-grad forward of a micro-batch per chunk, once); ``activation_shape`` (a shape,
    or a list where several tensors cross) and ``activation_dtype`` may state it, and a
    statement that disagrees is a ValueError on every rank. If ``module`` has ``no_sync`` (a DDP wrapper over
    the stage's data-parallel group), every gradient-making action but each chunk's last runs
    inside it; call its finish_gradient_synchronization after. ``host_staging``: send and receive
    through host memory (None: when the group's backend is gloo and the stage is on a GPU,
    since gloo's send/recv take CPU tensors only; NCCL and CPU tensors go directly).
    ``timed``: record each action's (kind, chunk, micro-batch, start, end) (``timeline``,
    seconds from the step's start ``began``), what each spent besides computing, posting
    its messages and copying them (``overhead``, by (kind, chunk, micro-batch)), what it
    waited for its inputs (``waits``), and all the step waited for its neighbours
    (``waited``: the inputs, and at the end the last sends);
    ``count_activations``: count the bytes autograd saves for backward, held between a
    micro-batch's F and B (and with zb1, the inputs and gradients W keeps, until W)
    (``peak_activation_bytes``); parameters do not count, nor, if ``count_activations`` is
    a function, a saved tensor it says False of (weights a wrapper gathered, say).
    """

    def __init__(self, module, n_microbatches: int, loss_fn, schedule="1f1b", process_group=None,
                 activation_shape=None, activation_dtype=torch.float32, timed=False, count_activations=False,
                 host_staging=None, chunks=1):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.module, self.m, self.loss_fn, self.chunks = module, n_microbatches, loss_fn, chunks
        self.group, self.host_staging = process_group, host_staging
        self.stage, self.n_stages = dist.get_rank(process_group), dist.get_world_size(process_group)
        peer = lambda s: dist.get_global_rank(process_group or dist.group.WORLD, s % self.n_stages)  # noqa: E731
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.prev, self.next = peer(self.stage - 1), peer(self.stage + 1)
        self.order = SCHEDULES[schedule](n_microbatches, self.stage, self.n_stages, chunks)
        self.deferred = any(kind == "W" for kind, _, _ in self.order)
        # what crosses between stages: one tensor, or several (a list of shapes, and of dtypes);
        # found by the first step (io: per boundary, the tensors going into virtual stage v)
        self.stated = None
        if activation_shape is not None:
            shapes = activation_shape if isinstance(activation_shape, list) else [activation_shape]
            dtypes = activation_dtype if isinstance(activation_dtype, (list, tuple)) else [activation_dtype] * len(shapes)
            if len(dtypes) != len(shapes):
                raise ValueError(f"{len(shapes)} activation shapes but {len(dtypes)} dtypes")
            self.stated = [(tuple(sh), dt) for sh, dt in zip(shapes, dtypes)]
        self.io = None
        self.timed, self.count_activations = timed, count_activations
        self.timeline, self.peak_activation_bytes, self.overhead, self.waited = [], 0, {}, 0.0
        self.waits, self.began = {}, 0.0
        if self.n_stages > 1:
            for p in module.parameters():   # this stage's own: the others hold the rest of the model
                place(p, "part", process_group)
        self.receive_ahead = 2   # gloo: actions whose receives are posted before they run

    def _virtual(self, chunk):
        """The place of this rank's ``chunk`` among all the chunks of the model."""
        return self.stage + chunk * self.n_stages

    def _tag(self, kind, virtual, i, j=0):
        """The tag of what flows into chunk ``virtual`` for micro-batch i: F its activation,
        B the gradient of its output (its j-th tensor, where several cross)."""
        return (2 * (i * self.n_stages * self.chunks + virtual) + (kind == "B")) * self.width + j

    def _receive(self, k, wire, last_virtual):
        """The receives action k needs (its inputs from the previous chunk, or its outputs'
        gradients from the next): a list, empty if none."""
        kind, c, i = self.order[k]
        v = self._virtual(c)
        if kind == "F" and v > 0:
            return [dist.P2POp(dist.irecv, self._buffer(wire, v, j), self.prev, self.group, tag=self._tag("F", v, i, j))
                    for j in range(len(self.io[v]))]
        if kind == "B" and v < last_virtual:
            return [dist.P2POp(dist.irecv, self._buffer(wire, v + 1, j), self.next, self.group,
                               tag=self._tag("B", v, i, j)) for j in self.with_grad[v + 1]]
        return []

    def _buffer(self, device, v, j=0):
        shape, dtype = self.io[v][j]
        return torch.empty(shape, dtype=dtype, device=device)

    @torch.no_grad()
    def infer(self, inputs=None):
        """What crosses each stage boundary (shapes and dtypes), found once, before anything
        of the schedule is sent (the first step calls it; call it first yourself so that a
        step you count sends only the schedule's messages): ``inputs`` the first stage's
        global batch, as step takes it (None on the others); a collective over the group.
        Each chunk runs the first micro-batch's forward without autograd, in the model's
        order (its input received from the chunk before, its output sent to the chunk after
        as a Python object), the generator states kept as they were; then every rank learns
        every boundary. A forward that raises (a stage refusing its model on its first call,
        as ModelStage does) sends its words on in place of its output and raises on every
        rank, the exception itself where it was raised: no stage is left waiting for it. A
        stated activation_shape (and dtype) that disagrees is a ValueError on every rank.
        Costs one eager forward of a micro-batch per chunk, once."""
        if self.io is not None:
            return
        x0 = None
        if self.first:
            x0 = tuple(t.chunk(self.m)[0] for t in inputs) if isinstance(inputs, (tuple, list)) else \
                inputs.chunk(self.m)[0]
        device = next(self.module.parameters()).device
        total, found, failed, raised, wire = self.n_stages * self.chunks, {}, None, None, self._landing(device)
        devices = [device] if device.type == "cuda" else []
        # eager, even where the stage's layers are compiled: the probe wants shapes, and a
        # compiled layer would compile a second graph for a forward without autograd
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            for v in range(total):
                if v % self.n_stages != self.stage:
                    continue
                if v == 0:
                    x = list(x0) if isinstance(x0, tuple) else [x0]
                else:
                    x = _recv_object(self.prev, self.group, wire)
                    failed = failed or (x if isinstance(x, tuple) else None)   # (a chunk before failed: its words)
                if failed is None:
                    try:
                        x = [t.to(device) for t in x] if v > 0 else x   # (the inputs as given)
                        out = self.module(*x, chunk=v // self.n_stages) if self.chunks > 1 else self.module(*x)
                        outs = _tensors_in(out)
                    except Exception as e:   # (every rank raises it below, after the gather)
                        chunk = f" (chunk {v // self.n_stages})" if self.chunks > 1 else ""
                        failed, raised = (type(e).__name__, f"stage {self.stage}{chunk}'s first forward: {e}"), e
                if v + 1 < total:
                    if failed is None:
                        found[v + 1] = [(tuple(t.shape), t.dtype) for t in outs]
                    _send_object(failed or [t.cpu() for t in outs], self.next, self.group, wire)
        parts = [None] * self.n_stages
        dist.all_gather_object(parts, (found, failed), group=self.group)
        if raised is not None:
            raise raised
        failed = next((f for _, f in parts if f), None)
        if failed is not None:
            kind, words = failed
            kind = getattr(builtins, kind, None)   # (the same kind where it is Python's own: a ValueError)
            raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(words)
        parts = [found for found, _ in parts]
        io = {v: io for part in parts for v, io in part.items()}
        if self.stated is not None:
            for v in sorted(io):
                if io[v] != self.stated:
                    show = lambda xs: ", ".join(f"{list(sh)} {str(dt).replace('torch.', '')}" for sh, dt in xs)  # noqa
                    raise ValueError(f"activation_shape says [{show(self.stated)}] crosses into stage "
                                     f"{v % self.n_stages} (chunk {v // self.n_stages}), but the model sends "
                                     f"[{show(io[v])}] there: leave activation_shape out, it is found by the "
                                     f"first step")
        self.io, self.width = io, max([len(x) for x in io.values()] + [1])
        # which of the tensors going into virtual stage v carry a gradient back
        self.with_grad = {v: [j for j, (_, dt) in enumerate(x) if dt.is_floating_point] for v, x in io.items()}

    @torch.no_grad()
    def evaluate(self, inputs=None, targets=None):
        """The loss of a batch without training it (evaluation on held-out data): each
        micro-batch's forward, stage after stage, nothing kept for backward; on the last
        stage the mean of loss_fn over the micro-batches (step's loss, times m), None on the
        others. Every rank of the group calls it, with step's arguments (the inputs on the
        first stage, the targets on the last)."""
        self.infer(inputs)
        m, total = self.m, self.n_stages * self.chunks
        device, wire, xs, ys = self._begin(inputs, targets)
        losses = []
        for i in range(m):   # a micro-batch through every chunk in the model's order: each rank in turn
            for c in range(self.chunks):
                v = self._virtual(c)
                if v == 0:
                    x = list(xs[i]) if isinstance(xs[i], tuple) else [xs[i]]
                else:
                    x = [self._buffer(wire, v, j) for j in range(len(self.io[v]))]
                    for j, t in enumerate(x):
                        dist.recv(t, src=self.prev, group=self.group, tag=self._tag("F", v, i, j))
                    x = [t.to(device) for t in x]
                out = self.module(*x, chunk=c) if self.chunks > 1 else self.module(*x)
                if v == total - 1:
                    losses.append(self.loss_fn(out, ys[i]))
                else:
                    for j, t in enumerate(_tensors_in(out)):
                        dist.send(self._wire(t), dst=self.next, group=self.group, tag=self._tag("F", v + 1, i, j))
        return torch.stack(losses).mean() if self.last else None

    def _wire(self, t):
        """What goes over the wire: ``t`` itself, or its copy in host memory when staging."""
        return t.to("cpu", copy=True) if self._staged else t.contiguous()   # (sends take dense tensors)

    def _landing(self, device):
        """Where messages travel from and land: host memory where ``host_staging`` says so (by
        default, where the group is gloo's and the stage on a GPU: gloo's send and recv take
        CPU tensors only; self._staged), else the stage's device."""
        self._staged = self.host_staging if self.host_staging is not None else \
            device.type != "cpu" and dist.get_backend(self.group) == "gloo"
        return torch.device("cpu") if self._staged else device

    def _begin(self, inputs, targets):
        """A step's (or an evaluation's) start: whether messages go through host memory
        (self._staged), the stage's device and where received tensors land, the first
        stage's inputs and the last's targets cut into the micro-batches (one tensor, or a
        tuple of them, each cut along the batch; None elsewhere)."""
        m, device = self.m, next(self.module.parameters()).device
        wire = self._landing(device)   # where received tensors land
        xs = [None] * m
        if self.first:
            xs = list(zip(*(t.chunk(m) for t in inputs))) if isinstance(inputs, (tuple, list)) else inputs.chunk(m)
        return device, wire, xs, targets.chunk(m) if self.last else [None] * m

    def step(self, inputs=None, targets=None):
        m, last_virtual = self.m, self.n_stages * self.chunks - 1
        device, wire, xs, ys = self._begin(inputs, targets)
        self.infer(inputs)
        saved_in, saved_out, held, stashes, losses, sends, sent, posted = {}, {}, {}, {}, [], [], [], {}
        live, self.timeline, t0, self.overhead, self.waited, self.waits = 0, [], time.perf_counter(), {}, 0.0, {}
        self.began = t0   # (time.perf_counter: one clock for every process of a machine)
        # each chunk's last gradient-making action runs synchronized (a DDP or FSDP wrapper
        # reduces then what its parameters, all of one chunk, accumulated); the others in no_sync
        synced = {max(k for k, (kind, c, _) in enumerate(self.order) if kind in "BW" and c == j)
                  for j in range(self.chunks)}
        # gloo: receives are posted ahead (the next actions' data arrives while this one
        # computes); NCCL runs its point-to-point kernels in order on one stream, so there
        # each action's receive goes only with the previous action's send
        ahead = self.receive_ahead if dist.get_backend(self.group) == "gloo" else 0
        for k, (kind, c, i) in enumerate(self.order):
            v, key = self._virtual(c), (c, i)
            if self.timed:
                _sync(device)
                began = time.perf_counter()
            recvs = []                       # what this action and the next few need from a neighbour
            for j in range(k, min(k + ahead + 1, len(self.order))):
                ops = self._receive(j, wire, last_virtual) if j not in posted else []
                if ops:
                    posted[j] = [[op.tensor for op in ops], []]
                    recvs += [(j, op) for op in ops]
            if sends or recvs:   # sends finish in the background
                works = dist.batch_isend_irecv(sends + [op for _, op in recvs])
                if len(works) == len(sends) + len(recvs):
                    sent += works[:len(sends)]
                    for (j, _), work in zip(recvs, works[len(sends):]):
                        posted[j][1].append(work)
                else:                        # one work for the whole batch (NCCL): done with it here
                    for work in works:
                        work.wait()
            sends = []
            waited = 0.0
            if k in posted:                  # wait for what this action receives
                data, works = posted.pop(k)
                before = time.perf_counter()
                for work in works:
                    work.wait()
                waited = time.perf_counter() - before
                if kind == "F":
                    saved_in[key] = [t.to(device) for t in data]
                else:
                    grad = [t.to(device) for t in data]
            if self.timed:
                _sync(device)
                start = time.perf_counter() - t0
                self.waited += waited
                self.overhead[(kind, c, i)] = start + t0 - began - waited
                self.waits[(kind, c, i)] = waited
            sync = contextlib.nullcontext() if k in synced or not hasattr(self.module, "no_sync") \
                else self.module.no_sync()
            if kind == "F":
                if v == 0:
                    x = list(xs[i]) if isinstance(xs[i], tuple) else [xs[i]]
                else:
                    x = [t.requires_grad_() if j in self.with_grad[v] else t for j, t in enumerate(saved_in[key])]
                stashes[key] = []
                defer = _DeferWeightGradients(stashes[key]) if self.deferred else contextlib.nullcontext()
                with self._counting(held, key), defer:
                    out = self.module(*x, chunk=c) if self.chunks > 1 else self.module(*x)
                    out = self.loss_fn(out, ys[i]) / m if v == last_virtual else out   # the batch's mean
                saved_in[key], saved_out[key] = x, out
                live += held.get(key, 0)
                if v == last_virtual:
                    losses.append(out.detach())
                else:
                    outs = _tensors_in(out)
                    if len(outs) != len(self.io[v + 1]):
                        raise RuntimeError(f"stage {self.stage} returned {len(outs)} tensor(s) where its first "
                                           f"step's forward gave {len(self.io[v + 1])}")
                    sends = [dist.P2POp(dist.isend, self._wire(t.detach()), self.next, self.group,
                                        tag=self._tag("F", v + 1, i, j)) for j, t in enumerate(outs)]
            elif kind == "B":
                out = saved_out.pop(key)
                if v == last_virtual:
                    roots, grads = [out], None
                else:   # the outputs gradients came back for, those autograd can reach
                    outs = _tensors_in(out)
                    pairs = [(outs[j], g) for j, g in zip(self.with_grad[v + 1], grad) if outs[j].requires_grad]
                    roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
                with sync:
                    torch.autograd.backward(roots, grads)
                x = saved_in.pop(key)
                live -= held.pop(key, 0)
                if self.deferred and self.count_activations:   # what W keeps until it runs
                    held[key] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                     for entry in stashes[key] for t in entry[2:]}.values())
                    live += held[key]
                if v > 0:
                    if all(x[j].grad is None for j in self.with_grad[v]):
                        raise RuntimeError(f"stage {self.stage}: backward gave its input no gradient (micro-batch "
                                           f"{i}): does the stage detach its input, or not use it?")
                    sends = [dist.P2POp(dist.isend, self._wire(x[j].grad if x[j].grad is not None else
                                                               torch.zeros_like(x[j])), self.prev, self.group,
                                        tag=self._tag("B", v - 1, i, j)) for j in self.with_grad[v]]
            else:
                with sync:
                    _weight_gradients(stashes.pop(key), hasattr(self.module, "no_sync"))
                live -= held.pop(key, 0)
            self.peak_activation_bytes = max(self.peak_activation_bytes, live)
            if self.timed:
                _sync(device)
                self.timeline.append((kind, c, i, start, time.perf_counter() - t0))
        before = time.perf_counter()
        for work in sent + (dist.batch_isend_irecv(sends) if sends else []):
            work.wait()
        self.waited += time.perf_counter() - before
        return torch.stack(losses).sum() if self.last else None

    @contextlib.contextmanager
    def _counting(self, held, key):
        """Count the bytes autograd saves for backward during one forward (each storage
        once, parameters excluded)."""
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
                held[key] = held.get(key, 0) + s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- in a training loop: clip by the global norm, checkpoints of the whole model ---------
def tied_group(pipelines: list):
    """The group of this rank's pipeline's first and last stages, where a tied embedding
    and output head live (Megatron-LM's embedding group); None on the other stages.
    ``pipelines``: every pipeline's global ranks in stage order (every rank creates every
    group, in the same order: new_group is collective)."""
    mine = None
    for ranks in pipelines:
        group = dist.new_group(sorted({ranks[0], ranks[-1]}))
        if dist.get_rank() in (ranks[0], ranks[-1]):
            mine = group
    return mine


@torch.no_grad()
def sum_tied_gradients(parameters, group):
    """A tied weight's two copies (the first stage's embedding, the last stage's head) add
    their gradients, so both step alike, as the one tensor of one process does. Call it
    after backward (after a DDP wrapper's finish_gradient_synchronization). A copy that
    got no gradient adds zeros: both ranks always issue the all-reduce."""
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


def tie(parameters, group):
    """Record that each of ``parameters`` (the first stage's embedding, the last stage's
    tied head) is one of two copies of one weight, kept equal over ``group`` (tied_group's)
    by sum_tied_gradients: clip_grad_norm_ counts it once, checkpoints keep it under both
    names (the model of one process loads either). Returns ``parameters``."""
    for p in parameters:
        place(p, "tied", group)
    return parameters


# clip_grad_norm_, full_state_dict, load_full_state_dict, full_optim_state_dict and
# load_full_optim_state_dict are the placement record's (common.py): Pipeline records each of
# its stage's parameters as a "part" over the pipeline's group; pass that group as
# ``process_group=`` (data-parallel copies of a stage, "replicate" over another group, each
# clip alike and are saved once).
# ---- end copy: pipeline parallelism ----


def train_step(pipe, optimizer, batch, clock, tied=None, max_norm=None):
    """One global batch through this rank's stage, timed by phase. ``tied``: (group, this
    rank's copy of a tied weight, recorded by tie), on the first and last stage;
    ``max_norm``: clip by the whole model's norm."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("pipeline"):     # every micro-batch's F, B (and W) in the schedule's order
        pipe.step(x if pipe.first else None, y if pipe.last else None)
    with clock.phase("comm"):         # data parallel over the stage's replicas; the tied copies
        if hasattr(pipe.module, "finish_gradient_synchronization"):
            pipe.module.finish_gradient_synchronization()
        if tied:
            sum_tied_gradients([tied[1]], tied[0])
    with clock.phase("optim"):
        if max_norm:
            clip_grad_norm_(pipe.module, max_norm, process_group=pipe.group)   # the tied copies: counted once
        optimizer.step()


def pp_dp_groups(world_size: int, n_stages: int):
    """This rank's (pipeline group, data-parallel group, every pipeline's ranks): pipelines
    are consecutive ranks, a stage's replicas the ranks at the same place in their
    pipeline. Every rank creates every group (new_group is collective)."""
    lines = [list(range(k * n_stages, (k + 1) * n_stages)) for k in range(world_size // n_stages)]
    pipes = [dist.new_group(ranks) for ranks in lines]
    replicas = [dist.new_group(list(range(s, world_size, n_stages))) for s in range(n_stages)]
    rank = dist.get_rank()
    return pipes[rank // n_stages], replicas[rank % n_stages], lines


def runs(schedule, m, n_stages) -> bool:
    """Whether ``schedule`` can run m micro-batches on n_stages (interleaved: groups of p)."""
    return schedule != "interleaved" or m % n_stages == 0


# ----------------------------------------------------------------------------------------
# Schedules on paper: every rank's order run on a clock, checked and timed
# ----------------------------------------------------------------------------------------
def simulate(orders: list, chunks=1, cost=None):
    """Every rank runs its order on one clock: an action starts when its rank is free and
    its input exists (F after the previous chunk's F of the micro-batch, B after its own F
    and the next chunk's B, W after its B); sends cost nothing unless ``cost["send"]`` says
    what a message between two ranks takes. ``cost``: time of a whole stage's F, B, W (a
    chunk's is 1/v of it). Returns each rank's actions with (start, end), or None if some
    rank waits for ever (a deadlock)."""
    p = len(orders)
    last = p * chunks - 1
    cost = dict(cost or {"F": 1.0, "B": 2.0, "W": 0.0})
    send = cost.pop("send", 0.0)   # what a message between two ranks takes
    # a kind's time: a whole stage's (each of its v chunks 1/v of it), a list (one per chunk of
    # the model), or a dict by (chunk of the model, micro-batch): each action's own
    dur = {kind: (lambda k, i, c=c: c[(k, i)]) if isinstance(c, dict) else
           (lambda k, i, c=c: c[k]) if isinstance(c, (list, tuple)) else (lambda k, i, c=c: c / chunks)
           for kind, c in cost.items()}
    done, pos, free, spans = {}, [0] * p, [0.0] * p, [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, c, i = orders[r][pos[r]]
                k = r + c * p
                need = {"F": [("F", k - 1, i)] if k else [],
                        "B": [("F", k, i)] + ([("B", k + 1, i)] if k < last else []),
                        "W": [("B", k, i)]}[kind]
                if any(n not in done for n in need):
                    break
                start = max([free[r]] + [done[n] + (send if n[1] % p != r else 0.0) for n in need])
                done[(kind, k, i)] = free[r] = start + dur[kind](k, i)
                spans[r].append((kind, c, i, start, free[r]))
                pos[r] += 1
                moved = True
    return None if any(pos[r] < len(orders[r]) for r in range(p)) else spans


def check_orders(orders: list, m: int, chunks=1) -> list:
    """What is wrong with every rank's order (empty: nothing): each (chunk, micro-batch)
    forwarded and backwarded once (and W'd once, if any W), F before B before W on a rank;
    every rank running its list to the end (no deadlock, by simulate); and between every two
    ranks, the sends in the sender's order matching the receives in the receiver's (NCCL
    pairs them by order)."""
    p, problems = len(orders), []
    for r, order in enumerate(orders):
        kinds = "FBW" if any(k == "W" for k, _, _ in order) else "FB"
        want = sorted((k, c, i) for k in kinds for c in range(chunks) for i in range(m))
        if sorted(order) != want:
            problems.append(f"rank {r}: not every action once")
        place = {a: n for n, a in enumerate(order)}
        for c in range(chunks):
            for i in range(m):
                if any(place.get((a, c, i), -1) > place.get((b, c, i), 1 << 30) for a, b in ("FB", "BW")):
                    problems.append(f"rank {r}: chunk {c}, micro-batch {i} out of order (F, B, W)")
    if simulate(orders, chunks) is None:
        problems.append("deadlock: some rank waits for ever")
    last = p * chunks - 1
    for a in range(p):
        for b in {(a + 1) % p, (a - 1) % p} - {a}:
            sent = [(kind, c, i) for kind, c, i in orders[a] if (kind == "F" and b == (a + 1) % p and a + c * p < last)
                    or (kind == "B" and b == (a - 1) % p and a + c * p > 0)]
            got = [(kind, c, i) for kind, c, i in orders[b]
                   if (kind == "F" and a == (b - 1) % p and b + c * p > 0)
                   or (kind == "B" and a == (b + 1) % p and b + c * p < last)]
            if [(k, i) for k, _, i in sent] != [(k, i) for k, _, i in got]:
                problems.append(f"ranks {a} -> {b}: sends and receives in different orders")
    return problems


def bubble_formula(schedule, m, p, chunks=1) -> float:
    """The bubble by the closed formula: the idle share of a step for p equal stages and m
    micro-batches, backward twice the forward, free sends: GPipe and 1F1B (p-1)/(m+p-1),
    interleaved (p-1)/(v m+p-1), ZB-H1 (p-1)/(3m+p-1) (m >= p)."""
    scale = {"interleaved": chunks, "zb1": 3}.get(schedule, 1)
    return (p - 1) / (scale * m + p - 1)


def bubble_on_paper(schedule, m, p, chunks=1, costs=None) -> list:
    """The bubble on paper: each stage's idle share of a step by the schedule run on paper
    (simulate): stages of equal cost,
    backward twice the forward (B and W one forward each with zb1), free sends. GPipe and
    1F1B: (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); ZB-H1 (p-1)/(3m+p-1) for m >= p.
    ``costs``: the stages unequal, each chunk of the model its own F and B (and W) seconds
    ({"F": [...], "B": [...]}: chunk_costs' or action_costs'); with zb1 and no W, its B is
    half input, half weight gradient."""
    orders = [SCHEDULES[schedule](m, s, p, chunks) for s in range(p)]
    if costs is not None:
        cost = {"F": costs["F"], "B": costs["B"], "W": costs.get("W", 0.0)}
        if schedule == "zb1" and "W" not in costs:
            cost.update(B=[b / 2 for b in costs["B"]], W=[b / 2 for b in costs["B"]])
    else:
        cost = {"F": 1.0, "B": 1.0, "W": 1.0} if schedule == "zb1" else None
    spans = simulate(orders, chunks, cost)
    end = max(a[-1] for lane in spans for a in lane)
    return [1 - sum(b - a for *_, a, b in lane) / end for lane in spans]


def message_time(steps, p, chunks) -> float:
    """What a message between two stages took in the run: from the sending action's end to
    the receiving action's start, over the actions that waited for it (the others' data was
    there before they were ready), the median; ``steps``: per rank (began, timeline, waits)
    of one step, on the machine's one clock. 0 where no action waited."""
    done = [{(kind, c, i): began + end for kind, c, i, _, end in timeline} for began, timeline, _ in steps]
    got, last = [], p * chunks - 1
    for r, (began, timeline, waits) in enumerate(steps):
        for kind, c, i, start, _ in timeline:
            src = r + c * p + (-1 if kind == "F" else 1)
            if kind == "W" or not 0 <= src <= last or waits.get((kind, c, i), 0.0) < 1e-4:
                continue
            sent = done[src % p].get((kind, src // p, i))
            if sent is not None:
                got.append(began + start - sent)
    return statistics.median(got) if got else 0.0


def bubble_on_paper_of_step(schedule, m, p, chunks, timelines, send=0.0) -> list:
    """The bubble on paper of one measured step: each stage's idle share had it run its
    actions in the same times, and
    each message taken ``send`` seconds: the schedule on paper with that step's measured
    actions (each rank's timeline, each action's time with its overhead)."""
    cost = {"F": {}, "B": {}, "W": {}, "send": send}
    for r, timeline in enumerate(timelines):
        for kind, c, i, start, end in timeline:
            cost[kind][(r + c * p, i)] = end - start
    orders = [SCHEDULES[schedule](m, s, p, chunks) for s in range(p)]
    spans = simulate(orders, chunks, cost)
    end = max(a[-1] for lane in spans for a in lane)
    return [1 - sum(b - a for *_, a, b in lane) / end for lane in spans]


def step_record(pipe, clock) -> tuple:
    """What one step of a timed Pipeline leaves for bubble_measured: what it waited for its
    neighbours, its pipeline phase (the clock's), when it began, its timeline, each
    action's overhead and wait."""
    return pipe.waited, clock.times["pipeline"], pipe.began, list(pipe.timeline), dict(pipe.overhead), \
        dict(pipe.waits)


def bubble_measured(steps, schedule, m, p, chunks) -> dict:
    """The bubble measured in some timed steps: ``steps``, for each step every stage's step_record.
    Each stage's idle share of a step is what it waited for its neighbours and what was
    left once it was done, over the slowest stage's pipeline phase (the median over the
    steps); beside it the schedule on paper with the step's own actions, each with its
    overhead, and every message taking the run's median message time (message_time); and
    each chunk's median action times (action_costs)."""
    idle, papers, ran, runs = [], [], [], []
    for ranks in steps:
        T = max(r[1] for r in ranks)
        idle.append([(waited + T - own) / T for waited, own, *_ in ranks])
        runs.append([[(k, c, i, a - overhead[(k, c, i)], b) for k, c, i, a, b in timeline]
                     for _, _, _, timeline, overhead, _ in ranks])
        ran.append(action_costs(runs[-1], p, chunks))
    flight = statistics.median(message_time([(began, timeline, waits) for _, _, began, timeline, _, waits in ranks],
                                            p, chunks) for ranks in steps)
    papers = [bubble_on_paper_of_step(schedule, m, p, chunks, actions, flight) for actions in runs]
    return {"bubble_per_stage": [statistics.median(x[s] for x in idle) for s in range(p)],
            "theory_split_per_stage": [statistics.median(x[s] for x in papers) for s in range(p)],
            "message": flight,
            "action_costs": {k: [statistics.median(x[k][j] for x in ran) for j in range(p * chunks)] for k in ran[0]}}


def action_costs(timelines, p, chunks) -> dict:
    """Each chunk of the model's mean F, B (and W) seconds as the pipeline ran them: from
    every rank's timeline of a step (actions (kind, chunk, micro-batch, start, end)), chunk
    k = rank + chunk x p."""
    out = {}
    for r, timeline in enumerate(timelines):
        for kind, c, _, start, end in timeline:
            out.setdefault(kind, {}).setdefault(r + c * p, []).append(end - start)
    return {kind: [sum(t[k]) / len(t[k]) for k in range(p * chunks)] for kind, t in out.items()}


def chunk_costs(costs, cuts) -> dict:
    """Each chunk of the model's F and B seconds from measure_costs' pieces (the embeddings,
    every block, the head with the loss) and the chunks' ``cuts``: its blocks, the first
    chunk the embeddings, the last the head."""
    n, k = len(costs) - 2, len(cuts) - 1
    out = {"F": [], "B": []}
    for c in range(k):
        pieces = list(range(1 + cuts[c], 1 + min(cuts[c + 1], n))) + ([0] if c == 0 else []) + \
            ([n + 1] if c == k - 1 else [])
        out["F"].append(sum(costs[i][0] for i in pieces))
        out["B"].append(sum(costs[i][1] for i in pieces))
    return out


def held_peak(order, act, stash=None) -> float:
    """The most activation bytes a rank's order holds at once: one micro-batch's ``act[c]``
    through chunk c from its F to its B, and after B until W ``stash[c]`` (the inputs and
    output gradients W keeps). GPipe holds m micro-batches, 1F1B min(p - s, m), interleaved
    min(2 (p - s - 1) + (v - 1) p + 1, m v) chunk-micro-batches, ZB-H1 p - s full and s
    kept for W."""
    held = peak = 0.0
    kept = stash if any(kind == "W" for kind, _, _ in order) else [0.0] * len(act)
    for kind, c, _ in order:
        held += {"F": act[c], "B": kept[c] - act[c], "W": -kept[c]}[kind]
        peak = max(peak, held)
    return peak


def p2p_bytes(m, p, s, chunks, message) -> float:
    """Bytes stage s sends in a step: an activation forward and a gradient back per
    micro-batch and chunk boundary it sits at (interleaved: v times the boundaries)."""
    return m * message * (2 * chunks - (s == p - 1) - (s == 0))


# ----------------------------------------------------------------------------------------
# Verification: every stage's weights against one process on the same global batches
# ----------------------------------------------------------------------------------------
VERIFY_DIMS = (32, 128, 9, 2)   # d_model, d_ff, blocks, heads: 2 or 4 stages of 2 chunks, not a multiple of 9
VERIFY_T, MAX_NORM = 16, 0.1    # clipped by the whole model's norm (the LM's is near 0.5: every step clips)
# AdamW's eps is 1e-6 in the check: micro-batches add the gradient up in another order, and
# with the default 1e-8 a gradient that nearly cancels turns that rounding into 1e-5 weight
# differences within a few steps (as in 08); the check is on the pipeline, not on AdamW.


_REFERENCES = {}   # (seed, global batch, steps, device) -> the one-process model after its steps


def reference(args, batch, device):
    """The one-process model every case of a job is checked against: the LM tied, trained
    ``args.verify_steps`` AdamW steps on the global batches, clipped by its norm. The same
    whatever the schedule, micro-batches or recomputation, so each process trains it once."""
    key = (args.seed, batch, args.verify_steps, str(device))
    if key not in _REFERENCES:
        torch.manual_seed(args.seed)
        d, f, n, h = VERIFY_DIMS
        ref = common.TransformerLM(d, f, n, h, context_length=VERIFY_T).to(device)
        ref.head.weight = ref.tok.weight
        initial = copy.deepcopy(ref)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
        for step in range(args.verify_steps):
            common.one_process_step(ref, opt, [(common.lm_batch(batch, VERIFY_T, step, args.seed, device), {})],
                                    MAX_NORM)
        _REFERENCES[key] = (initial, ref)
    return _REFERENCES[key]


def verify_case(ctx, args, groups, n_stages, m, schedule, chunks, batch, mode="none", costs="flops"):
    """The LM, its head tied to its embedding, pipelined over ``n_stages`` ranks (the
    remaining ranks data-parallel replicas of each stage, DDPBucketed over each stage's
    replicas), clipped by the global norm, against one process; its blocks recomputed
    (``mode``) or not; split by ``costs`` (LMStage's: "measure" times the pieces, on every
    rank). "digest": every rank's weights, hashed (recomputation must not change a bit)."""
    bucketed = common.load_script(common.ROOT / "05_bucketed_ddp.py")
    pipe_group, dp_group, tie_group = groups
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    d = VERIFY_DIMS[0]
    initial, ref = reference(args, batch, ctx.device)
    stage = LMStage(copy.deepcopy(initial), dist.get_rank(pipe_group), n_stages, chunks, costs=costs,
                    microbatch=(batch // dp_size // m, VERIFY_T))
    recompute(stage.blocks.values(), mode)
    module = bucketed.DDPBucketed(stage, 0.01, process_group=dp_group) if dp_size > 1 else stage
    pipe = Pipeline(module, m, lm_loss, schedule, pipe_group, activation_shape=(batch // dp_size // m, VERIFY_T, d),
                    chunks=chunks)
    tied = (tie_group, *tie([stage.tok.weight if stage.first else stage.head.weight], tie_group)) if tie_group else None
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    for step in range(args.verify_steps):
        x, y = common.lm_batch(batch, VERIFY_T, step, args.seed, ctx.device)
        train_step(pipe, opt, (common.shard(x, dp_rank, dp_size), common.shard(y, dp_rank, dp_size)),
                   common.StepClock(ctx.device), tied, MAX_NORM)
    mine, theirs = dict(stage.named_parameters()), dict(ref.named_parameters(remove_duplicate=False))
    ok, diff = bool(mine), 0.0
    for name, p in mine.items():
        diff = max(diff, (p.detach().double() - theirs[name].detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(p, theirs[name])
        except AssertionError:
            ok = False
    digest = hashlib.sha256(b"".join(mine[n].detach().cpu().numpy().tobytes() for n in sorted(mine))).hexdigest()
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"ok": ok, "max_diff": diff, "names": sorted(mine), "digest": digest})
    covered = sorted(n for r in everyone for n in r["names"])   # each parameter on one stage of each replica
    return {"ok": all(r["ok"] for r in everyone) and covered == sorted(sorted(theirs) * dp_size),
            "max_diff": max(r["max_diff"] for r in everyone), "digest": [r["digest"] for r in everyone]}


def verify(ctx, args, n_stages, microbatches, schedules, chunks, modes=("none",)):
    """Every schedule at each number of micro-batches it can run; with more ranks than
    stages, each stage has data-parallel replicas. Each recompute mode of ``modes`` but
    none: every schedule it runs (not full with zb1) at the largest m, its weights equal to
    one process's and bit for bit to the same run without recomputation."""
    dp = ctx.world_size // n_stages
    pipe_group, dp_group, lines = pp_dp_groups(ctx.world_size, n_stages)
    groups = (pipe_group, dp_group, tied_group(lines))
    batch = math.lcm(*microbatches) * dp   # one sequence per micro-batch at the largest count
    layout = f"p {n_stages}" + (f" x {dp} replicas" if dp > 1 else "")
    out = {}
    for m in microbatches:
        for schedule in schedules:
            if runs(schedule, m, n_stages):
                v = chunks if schedule == "interleaved" else 1
                note = " (model parallelism: two halves)" if (n_stages, m, dp, schedule) == (2, 1, 1, "gpipe") else ""
                name = f"{schedule}{f' v {v}' if v > 1 else ''}, {layout}, m {m}{note}"
                out[name] = verify_case(ctx, args, groups, n_stages, m, schedule, v, batch)
                if m != max(microbatches):
                    continue
                out[f"{name}, split by measured time"] = verify_case(ctx, args, groups, n_stages, m, schedule, v,
                                                                     batch, costs="measure")
                for mode in modes:
                    if mode != "none" and recompute_runs(mode, schedule):
                        r = verify_case(ctx, args, groups, n_stages, m, schedule, v, batch, mode)
                        r["ok"] = r["ok"] and r["digest"] == out[name]["digest"]
                        out[f"{name}, recompute {mode} (bit for bit as without)"] = r
    return out


def recompute_runs(mode, schedule) -> bool:
    """Full recomputation runs a block's forward again inside backward; zb1's split of
    backward into B and W (weights' gradients from kept linear inputs) does not take it."""
    return not (mode == "full" and schedule == "zb1")


# ----------------------------------------------------------------------------------------
# Benchmark: ours against torch.distributed.pipelining, the bubble, memory, bytes
# ----------------------------------------------------------------------------------------
def torch_pipeline(ctx, model, m, schedule, chunks, costs="flops"):
    """torch.distributed.pipelining on the same chunks and micro-batches: ScheduleGPipe,
    Schedule1F1B, ScheduleInterleaved1F1B (a PipelineStage per chunk), and for zb1
    ScheduleInterleavedZeroBubble with one stage per rank (torch's ZB-H1); ``costs``: the
    split ours uses (LMStage's)."""
    from torch.distributed.pipelining import PipelineStage, schedules
    p, v = ctx.world_size, chunks if schedule == "interleaved" else 1
    cuts = LMStage(model, 0, p, v, costs=costs).cuts   # the p·v chunks, each a stage of torch's
    mods = [LMStage(model, ctx.rank + j * p, p * v, cuts=cuts) for j in range(v)]
    stages = [PipelineStage(mod, ctx.rank + j * p, p * v, ctx.device) for j, mod in enumerate(mods)]
    cls = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B,
           "interleaved": schedules.ScheduleInterleaved1F1B, "zb1": schedules.ScheduleInterleavedZeroBubble}[schedule]
    return mods, cls(stages if schedule in ("interleaved", "zb1") else stages[0], n_microbatches=m, loss_fn=lm_loss)


def torch_pipelining_runs(backend, device) -> bool:
    """torch.distributed.pipelining sends the stage's own tensors: over gloo they must be
    on the CPU (gloo's send/recv abort the rank on CUDA tensors)."""
    return not (backend == "gloo" and device == "cuda")


def measured_costs(ctx, args, microbatches) -> dict:
    """{m: the LM's pieces (embeddings, each block, head with the loss) timed forward and
    backward (measure_costs) on a micro-batch of the global batch cut m ways}: one profiling
    pass per micro-batch size, the same on every rank."""
    model = common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)
    return {m: lm_costs(model, (args.batch_size // m, args.context_length), args.seed)
            for m in sorted(set(microbatches))}


SPLITS = ("measured", "flops")   # --split: where each stage's blocks end: by measured time, or by FLOPs


def split_costs(split, measured, m):
    return measured[m] if split == "measured" else "flops"


def benchmark(ctx, args, microbatches, schedules, chunks):
    """For each number of micro-batches and schedule, ours on each --split (the stages cut
    by measured time, and by FLOPs) and torch's on the first, steps alternating; for ours
    also the bubble of every step beside the schedule on paper, equal stages and these
    stages' measured times, the activation memory and the point-to-point bytes."""
    d, p = common.MODEL_SIZES[args.model_size][0], ctx.world_size
    shape = lambda m: (args.batch_size // m, args.context_length, d)  # noqa: E731
    build = lambda: common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)  # noqa: E731
    chunks_of = lambda s: chunks if s == "interleaved" else 1  # noqa: E731
    splits = list(getattr(args, "split", None) or SPLITS)
    bubbles, cases = {}, [(m, s) for m in microbatches for s in schedules if runs(s, m, p)]
    measured, cuts = measured_costs(ctx, args, microbatches), {}

    def ours(m, schedule, split):
        stage = LMStage(build(), ctx.rank, p, chunks_of(schedule), costs=split_costs(split, measured, m))
        cuts[(m, schedule, split)] = stage.cuts
        pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=shape(m), timed=True, chunks=chunks_of(schedule))
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
        bubbles[(m, schedule, split)] = []

        def step(batch, clock):
            train_step(pipe, opt, batch, clock)
            bubbles[(m, schedule, split)].append(step_record(pipe, clock))
        return step

    def theirs(m, schedule):
        mods, sched = torch_pipeline(ctx, build(), m, schedule, chunks, split_costs(splits[0], measured, m))
        opt = torch.optim.AdamW([q for mod in mods for q in mod.parameters()], lr=1e-4)

        def step(batch, clock):   # contiguous: torch 2.11's stages check the strides of what they get
            x, y = (t.contiguous() for t in batch)
            opt.zero_grad(set_to_none=True)
            with clock.phase("pipeline"):
                sched.step(*([x] if ctx.rank == 0 else []), **({"target": y} if ctx.rank == p - 1 else {}))
            with clock.phase("comm"):
                pass
            with clock.phase("optim"):
                opt.step()
        return step
    methods = {}
    for m, schedule in cases:
        for split in splits:
            methods[ours_name(schedule, m, split)] = lambda m=m, s=schedule, sp=split: ours(m, s, sp)
        # torch's Schedule1F1B refuses fewer micro-batches than stages; its stages send CUDA
        # tensors point to point, which gloo cannot carry (main says so)
        if (schedule != "1f1b" or m >= p) and torch_pipelining_runs(ctx.backend, ctx.device.type):
            methods[f"{schedule}, m {m} (torch)"] = lambda m=m, s=schedule: theirs(m, s)
    rows = common.time_methods(ctx, args, methods, global_batch=True, start_together=True)
    everyone = [None] * p
    dist.all_gather_object(everyone, {k: v[-args.steps:] for k, v in bubbles.items()})
    memory = activation_memory(ctx, args, cases, chunks, {m: split_costs(splits[0], measured, m) for m in measured})
    by_name = {r["method"]: r for r in rows}
    message = args.batch_size * args.context_length * d * 4   # a whole batch's activations, fp32
    for m, schedule in cases:
        t, v = by_name.get(f"{schedule}, m {m} (torch)"), chunks_of(schedule)
        equal = bubble_on_paper(schedule, m, p, v)
        for split in splits:
            r = by_name[ours_name(schedule, m, split)]
            stages = chunk_costs(measured[m], cuts[(m, schedule, split)])
            got = bubble_measured([[e[(m, schedule, split)][i] for e in everyone] for i in range(args.steps)],
                                  schedule, m, p, v)
            per_stage, on_paper, ran = got["bubble_per_stage"], got["theory_split_per_stage"], got["action_costs"]
            r.update(split=split, cuts=cuts[(m, schedule, split)], bubble=sum(per_stage) / p,
                     message_ms=got["message"] * 1e3, bubble_per_stage=per_stage, theory_per_stage=equal,
                     theory_split=sum(on_paper) / p, theory_split_per_stage=on_paper, action_costs=ran,
                     chunk_costs=stages,
                     theory_profiled=sum(bubble_on_paper(schedule, m, p, v, stages)) / p,
                     chunk_ms=[(f + b) * 1e3 for f, b in zip(stages["F"], stages["B"])],
                     run_chunk_ms=[sum(ran[k][j] for k in ran) * 1e3 for j in range(p * v)])
            if split == splits[0]:
                mem = memory[(m, schedule)]
                r.update(act_MB_per_stage=[s["peak"] / 1e6 for s in mem], peak_act_MB=max(s["peak"] for s in mem) / 1e6,
                         act_formula_MB=max(s["formula"] for s in mem) / 1e6,
                         p2p_MB=max(s["sent"] for s in mem) / 1e6,
                         p2p_formula_MB=max(p2p_bytes(m, p, s, v, message / m) for s in range(p)) / 1e6)
                if t:
                    r.update(common.vs_paired(r, t))
        for row in [by_name[ours_name(schedule, m, sp)] for sp in splits] + ([t] if t else []):
            row.update(schedule=schedule, chunks=v, stages=p, microbatches=m, theory=sum(equal) / p)
        if t:
            t.update(split=splits[0], cuts=cuts[(m, schedule, splits[0])])
    return rows


def ours_name(schedule, m, split) -> str:
    return f"{schedule}, m {m}, {'FLOP' if split == 'flops' else 'measured'} split (ours)"


def one_microbatch(stage, chunk, mb, context, d, deferred):
    """Bytes autograd saves for one micro-batch of ``mb`` sequences through ``chunk`` of
    ``stage`` (parameters excluded), and with ``deferred`` (zb1) what W keeps of it after
    B: the inputs and output gradients of its linears."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    device = next(stage.parameters()).device
    first = stage.first and chunk == 0
    x = torch.zeros(mb, context, dtype=torch.long, device=device) if first else \
        torch.zeros(mb, context, d, device=device, requires_grad=True)
    stash = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            (_DeferWeightGradients(stash) if deferred else contextlib.nullcontext()):
        out = stage(x, chunk=chunk)
        if stage.last and chunk == len(stage.ranges) - 1:
            out = lm_loss(out, torch.zeros(mb, context, dtype=torch.long, device=device))
    act = sum(seen.values())
    if not deferred:
        return act, 0
    out.backward(torch.ones_like(out))
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for e in stash for t in e[2:]}
    stage.zero_grad(set_to_none=True)
    return act, sum(kept.values())


RECOMPUTE = ("none", "selective", "full")


def block_activation_bytes(d, f, h, tokens, mode="none") -> float:
    """Bytes a block keeps for backward (float32) for ``tokens`` tokens: each norm its input,
    inverse RMS and their product (2d + 1), each linear its input, attention (SDPA's fused
    kernel) q, k, v, its output (the projection's input too) and log-sum-exp (4d + h), the
    MLP's GELU input and output (2 d_ff): 10d + 2 d_ff + h + 2. "selective": the log-sum-
    exp (h) no more (the output stays, as the projection's input); "full": the input (d)."""
    per = {"none": 10 * d + 2 * f + h + 2, "selective": 10 * d + 2 * f + 2, "full": d}[mode]
    return 4 * tokens * per


def stage_activation_bytes(stage, d, f, h, mb, t, vocab, mode="none") -> float:
    """One micro-batch's bytes through ``stage`` (every chunk) by the formula: its blocks,
    and on the first stage the token and position ids the embeddings keep (int64), on the
    last the final norm (2d + 1), the head's input (d), log-softmax's output (vocab) and the
    targets (int64)."""
    n = sum(hi - lo for lo, hi in stage.ranges)
    total = n * block_activation_bytes(d, f, h, mb * t, mode)
    if stage.first:
        total += 8 * (mb * t + t)
    if stage.last:
        total += mb * t * (4 * (3 * d + 1 + vocab) + 8)
    return total


def recompute_accounting(ctx, args, m, modes):
    """For each recompute mode, 1F1B over the world's stages with m micro-batches: one
    micro-batch's activation bytes per stage (counted as autograd saves them) beside
    stage_activation_bytes, the peak held during a counted step beside held_peak's formula
    (1F1B holds p - stage micro-batches), and the step's time (alternating steps; the ratio
    to none pair by pair: the forward run again)."""
    d, f, _, h = common.MODEL_SIZES[args.model_size]
    p, mb = ctx.world_size, args.batch_size // m
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)

    def build(mode):
        stage = LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank, p)
        recompute(stage.blocks.values(), mode)
        return stage
    rows = {}
    for mode in modes:
        stage = build(mode)
        one = one_microbatch(stage, 0, mb, args.context_length, d, False)[0]
        pipe = Pipeline(stage, m, lm_loss, "1f1b", activation_shape=(mb, args.context_length, d),
                        count_activations=True)
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        formula = stage_activation_bytes(stage, d, f, h, mb, args.context_length, common.VOCAB_SIZE, mode)
        everyone = [None] * p
        dist.all_gather_object(everyone, {"one": one, "formula": formula, "peak": pipe.peak_activation_bytes,
                                          "peak_formula": held_peak(SCHEDULES["1f1b"](m, ctx.rank, p), [formula])})
        rows[mode] = everyone

    def method(mode):
        def make():
            stage = build(mode)
            pipe = Pipeline(stage, m, lm_loss, "1f1b", activation_shape=(mb, args.context_length, d))
            opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
            return lambda batch, clock: train_step(pipe, opt, batch, clock)
        return make
    timed = {r["method"]: r for r in common.time_methods(ctx, args, {mode: method(mode) for mode in modes},
                                                         global_batch=True)}
    out = []
    for mode in modes:
        stages = rows[mode]
        row = {"recompute": mode, "stages": p, "microbatches": m,
               "mb_act_MB": [s["one"] / 1e6 for s in stages], "mb_formula_MB": [s["formula"] / 1e6 for s in stages],
               "peak_act_MB": [s["peak"] / 1e6 for s in stages],
               "peak_formula_MB": [s["peak_formula"] / 1e6 for s in stages],
               **{k: timed[mode][k] for k in ("step_ms", "step_min_ms", "step_max_ms", "stats")}}
        if mode != "none" and "none" in timed:
            row.update(common.vs_paired(timed[mode], timed["none"], key="vs_none"))
        out.append(row)
    return out


def activation_memory(ctx, args, cases, chunks, costs=None):
    """For each (m, schedule), on every stage: the peak bytes of activations held for
    backward in one counted step (exact: one step is enough) beside the schedule's formula
    (held_peak, from one micro-batch's bytes through each chunk), and the bytes the stage
    sent point to point. ``costs``: {m: LMStage's costs}, the split (default: by FLOPs)."""
    d, out = common.MODEL_SIZES[args.model_size][0], {}
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    for m, schedule in cases:
        v = chunks if schedule == "interleaved" else 1
        stage = LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank,
                        ctx.world_size, v, costs=(costs or {}).get(m, "flops"))
        units = [one_microbatch(stage, c, args.batch_size // m, args.context_length, d, schedule == "zb1")
                 for c in range(v)]
        pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=(args.batch_size // m, args.context_length, d),
                        count_activations=True, chunks=v)
        pipe.infer(x if pipe.first else None)   # (its objects are not the schedule's messages)
        with common.count_collectives() as c:
            pipe.step(x if pipe.first else None, y if pipe.last else None)
        order = SCHEDULES[schedule](m, ctx.rank, ctx.world_size, v)
        formula = held_peak(order, [a for a, _ in units], [k for _, k in units])
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, {"peak": pipe.peak_activation_bytes, "formula": formula,
                                          "sent": sum(b for op, _, b in c.log if op == "send")})
        out[(m, schedule)] = everyone
    return out


def timelines(ctx, args, m, schedules, chunks):
    """One timed step of each schedule on every stage, split as the first --split says:
    {schedule: [stage's actions]}."""
    d, out = common.MODEL_SIZES[args.model_size][0], {}
    x, y = common.lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    split = (getattr(args, "split", None) or SPLITS)[0]
    costs = measured_costs(ctx, args, [m])[m] if split == "measured" else "flops"
    for schedule in schedules:
        v = chunks if schedule == "interleaved" else 1
        stage = LMStage(common.build_lm(args.model_size, args.context_length, ctx.device, args.seed), ctx.rank,
                        ctx.world_size, v, costs=costs)
        pipe = Pipeline(stage, m, lm_loss, schedule, activation_shape=(args.batch_size // m, args.context_length, d),
                        timed=True, chunks=v)
        for _ in range(3):   # the last step is drawn
            dist.barrier()
            pipe.step(x if pipe.first else None, y if pipe.last else None)
            stage.zero_grad()
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, pipe.timeline)
        out[schedule] = everyone
    return out


ACTION_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def draw_timeline(lanes, title, path):
    """Each stage's actions in one step: F, B and W of each micro-batch (chunk.micro-batch
    where a stage holds several chunks, the odd chunks lighter)."""
    chunked = any(c for actions in lanes for _, c, *_ in actions)
    kinds = {kind for actions in lanes for kind, *_ in actions}
    names = {"F": "forward", "B": "backward", "W": "weights' gradient"}
    common.draw_lanes(path, title, [(f"stage {s}", [
        {"start": start * 1e3, "end": end * 1e3, "color": ACTION_COLORS[kind], "alpha": 1.0 if c % 2 == 0 else 0.65,
         "text": f"{c}.{i}" if chunked else str(i), "text_color": "white"} for kind, c, i, start, end in actions])
        for s, actions in enumerate(lanes)],
        "time in the step (ms); F forward, B backward (input gradient with W), W weight gradient; "
        + ("labels: chunk.micro-batch" if chunked else "numbers: micro-batch"),
        {names[k]: ACTION_COLORS[k] for k in "FBW" if k in kinds})


HEADERS = ["method", "stages", "chunks", "microbatches", "step_ms", "step_min_ms", "step_max_ms", "vs_torch",
           "vs_torch_min", "vs_torch_max", "bubble", "theory_split", "theory", "peak_act_MB", "act_formula_MB", "p2p_MB",
           "p2p_formula_MB"]
SPLIT_HEADERS = ["stages", "chunks", "microbatches", "split", "cuts", "chunk_ms"]
NAME, TITLE = "09_pipeline_parallel", "Pipeline schedules against torch.distributed.pipelining"
RC_HEADERS = ["recompute", "stages", "microbatches", "mb_act_MB", "mb_formula_MB", "peak_act_MB", "peak_formula_MB",
              "step_ms", "step_min_ms", "step_max_ms", "vs_none", "vs_none_min", "vs_none_max"]
RC_NAME, RC_TITLE = "09_recompute", "Activation recomputation: memory per stage and time"


def parser():
    """09's flags: depths, replicas, micro-batches, schedules, chunks, split, recompute."""
    # mini's width, enough blocks to balance 4 stages
    p = common.script_parser(__doc__, cpu_size="mini8", world="--stages x --replicas",
                             batch="--replicas x the least common multiple of 8 and the micro-batch counts; "
                                   "a replica cuts its part into micro-batches")
    p.add_argument("--stages", nargs="+", type=common.number(int, 2), default=None,
                   help="pipeline depths, one job each (default: 2 4, with NCCL those this machine has GPUs for; "
                        "with --world-size W: W / --replicas)")
    p.add_argument("--replicas", type=common.COUNT, default=1,
                   help="data-parallel replicas of every stage (world size = stages x replicas)")
    p.add_argument("--microbatches", nargs="+", type=common.COUNT, default=None,
                   help="micro-batches a step, one row each (default: 1 2 4 8; with --schedule interleaved, the "
                        "stages' least common multiple and twice that, the groups of p it needs)")
    p.add_argument("--schedule", nargs="+", default=None,
                   help=f"schedules, of {', '.join(SCHEDULES)} (default: all; interleaved only where the "
                        f"micro-batches are a multiple of the stages)")
    p.add_argument("--chunks", type=common.COUNT, default=2, help="interleaved: chunks of layers per stage (v)")
    p.add_argument("--split", nargs="+", choices=SPLITS, default=list(SPLITS),
                   help="where the stages' blocks end, one row each: measured (each piece of the LM timed forward and "
                        "backward on the device, the slowest stage made as fast as it can be) and flops (a block "
                        "24 d^2 + 4 t d a token, the head 2 d V, the embedding free); torch's pipelining gets the "
                        "first")
    p.add_argument("--recompute", nargs="+", default=["none"], choices=RECOMPUTE,
                   help="activation recomputation of the blocks: verified bit for bit against none (every schedule "
                        "at the largest m), and a table per mode: activation memory per stage beside the formula, "
                        "step time beside none (1F1B at the largest m)")
    p.set_defaults(context_length=64)
    return p


def checked_args(p, argv):
    """The flags parsed and checked before any worker starts: (args, schedules, recompute
    modes, stages, each depth's world)."""
    first = p.parse_args(argv)
    if first.world_size is not None and not common.under_torchrun():
        if first.world_size % first.replicas:
            raise common.UsageError(f"--world-size {first.world_size} is not a multiple of --replicas {first.replicas}: "
                                    f"the world is stages x replicas")
        wrong = [s for s in first.stages or [] if s * first.replicas != first.world_size]
        if wrong:
            raise common.UsageError(f"--world-size {first.world_size} but --stages {wrong[0]} x --replicas "
                                    f"{first.replicas} is {wrong[0] * first.replicas} ranks: leave --world-size out "
                                    f"or match it")
        if first.world_size // first.replicas < 2:
            raise common.UsageError(f"--world-size {first.world_size} leaves {first.world_size // first.replicas} "
                                    f"stage(s) a replica: a pipeline needs 2 or more")
    args = common.parse(p, argv, world=lambda a: a.world_size or max(a.stages or [2]) * a.replicas,
                        batch_unit=lambda a: None, world_flag="--world-size" if first.world_size else
                        "--stages x --replicas")
    if first.world_size is not None and not common.under_torchrun():
        args.stages = args.stages or [first.world_size // args.replicas]
    n_layers = common.MODEL_SIZES[args.model_size][2]
    unknown = [s for s in args.schedule or [] if s not in SCHEDULES]
    if unknown:
        raise common.UsageError(f"unknown --schedule {unknown[0]!r}: choose from {', '.join(SCHEDULES)}")
    schedules = list(dict.fromkeys(args.schedule or SCHEDULES))
    modes = list(dict.fromkeys(args.recompute))
    if "full" in modes and args.schedule and schedules == ["zb1"]:
        raise common.UsageError("--recompute full with --schedule zb1: zb1's weight gradients come from each "
                                "linear's kept input, which full recomputation does not keep; use selective or "
                                "another schedule")
    stages = list(dict.fromkeys(args.stages or [s for s in (2, 4) if common.nccl_fits(args.backend, s * args.replicas)]))
    if not stages or not all(common.nccl_fits(args.backend, s * args.replicas) for s in stages):
        raise common.UsageError(f"a pipeline needs 2 or more ranks, and nccl a GPU per rank: {stages or [2]} stages x "
                                f"{args.replicas} replicas but {common.gpu_count()} GPU(s) here; {common.NCCL_HINT}")
    for s in stages:
        common.check_ranks(s * args.replicas, args.backend, f"--stages {s} x --replicas {args.replicas}")
    if args.microbatches is None:   # what the schedules asked for can run
        group = math.lcm(*stages)
        args.microbatches = [group, 2 * group] if args.schedule and "interleaved" in schedules else [1, 2, 4, 8]
    if args.batch_size is None:
        args.batch_size = args.replicas * math.lcm(8, *args.microbatches)
    if common.under_torchrun():   # the world is given: every depth must divide it
        bad = [s for s in stages if args.world_size % s]
        if bad:
            raise common.UsageError(f"--stages {bad[0]} does not divide the world size {args.world_size}")
    v = args.chunks if "interleaved" in schedules else 1   # what the deepest chunking needs
    blocks = ([] if args.no_bench else [(n_layers, f"{args.model_size} has {n_layers} blocks")]) + \
        ([] if args.no_verify else [(VERIFY_DIMS[2], f"the verification LM {VERIFY_DIMS[2]}")])
    top = min([n for n, _ in blocks], default=None)
    for s in stages:   # what this command runs, nothing else
        if s < 2:
            raise common.UsageError(f"--stages {s}: a pipeline needs 2 or more stages")
        if top is not None and s * v > top:
            raise common.UsageError(f"--stages {s}{f' x --chunks {v}' if v > 1 else ''} is more chunks than blocks: "
                                    f"{', '.join(why for _, why in blocks)}; use fewer stages or chunks")
    if args.schedule and "interleaved" in schedules:   # asked for: every micro-batch count must fit it
        for s in stages:
            bad = [m for m in args.microbatches if m % s]
            if bad:
                raise common.UsageError(f"--schedule interleaved needs micro-batches in groups of the {s} stages: "
                                        f"--microbatches {bad[0]} is not a multiple of {s}")
    common.check_divisible(args.batch_size, args.replicas, "--batch-size")
    for m in args.microbatches:
        if m < 1 or (not args.no_bench and (args.batch_size // args.replicas) % m):
            raise common.UsageError(f"--batch-size {args.batch_size} does not split into {args.replicas} x {m} "
                                    f"micro-batches: use micro-batch counts that divide the batch per replica")
    worlds = {s: (args.world_size // s if common.under_torchrun() else args.replicas) * s for s in stages}
    return args, schedules, modes, stages, worlds


def run_verification(args, schedules, modes, stages, worlds):
    """Every depth's schedules against one process (and 2 stages x 2 replicas where the
    world allows)."""
    for s in stages:
        common.check_verification(common.launch(verify, args, s, args.microbatches, schedules, args.chunks,
                                                modes, world_size=worlds[s]),
                                  f"{NAME}, {s} stages on {worlds[s]} ranks")
    if 2 in stages and worlds[2] == 2 and not common.under_torchrun():   # pipeline x data: 2 x 2
        if common.nccl_fits(args.backend, 4):
            common.check_verification(common.launch(verify, args, 2, args.microbatches, schedules, args.chunks,
                                                    world_size=4), f"{NAME}, 2 stages x 2 replicas")
        elif common.is_reporter():
            print(f"verify {NAME}, 2 stages x 2 replicas: skipped (4 NCCL ranks, {common.gpu_count()} GPU(s))")


def run_benchmark(args, schedules, stages, worlds) -> list:
    """One job per depth, ours beside torch's pipelining on the same split; the tables
    (09_pipeline_parallel and 09_split) rewritten after each. Returns the rows."""
    if not torch_pipelining_runs(args.backend, args.device) and common.is_reporter():
        print("benchmark: SKIP torch.distributed.pipelining: its stages send CUDA tensors point to point, which gloo "
              "cannot carry (ours stage them through host memory)")
    rows = []
    for s in stages:   # one job per depth; the table is rewritten after each
        if worlds[s] != s:
            print(f"(the benchmark runs pipelines alone: skipped {s} stages x {worlds[s] // s} replicas)")
            continue
        rows += common.launch(benchmark, args, args.microbatches, schedules, args.chunks, world_size=s)
        if common.is_reporter():
            settings = {**common.lm_settings(args), "world_size": stages, "chunks": args.chunks, "split": args.split}
            table = common.save_results(args.out, NAME, rows, settings, headers=HEADERS, title=TITLE,
                                        note=" ".join(bubble_on_paper.__doc__.split()))
            splits = list({(r["stages"], r["chunks"], r["microbatches"], r["split"]): {
                **{k: r[k] for k in SPLIT_HEADERS}, "chunk_ms": [round(x, 2) for x in r["chunk_ms"]]}
                for r in rows if r["method"].endswith("(ours)")}.values())
            split_table = common.save_results(args.out, "09_split", splits, settings, headers=SPLIT_HEADERS,
                                              title="Where the stages' blocks end: by measured time and by FLOPs",
                                              note=" ".join(measure_costs.__doc__.split()))
    if rows and common.is_reporter():
        print(f"\n{TITLE}\n({args.model_size} LM, {args.backend}/{args.device}, global batch {args.batch_size}x"
              f"{args.context_length}; step times in ms, median [min, max] of {args.steps} steps; vs_torch: "
              f"median of paired steps, torch's stages on the first split; bubble: idle share of a step, mean of "
              f"the stages, beside theory_split (the schedule on paper with these stages' measured times) and "
              f"theory (equal stages); peak_act_MB: activations held for backward, largest stage, beside the "
              f"schedule's formula; p2p_MB: bytes the busiest stage sends, beside the formula)\n{table}\n\n"
              f"The splits (cuts: each chunk's first block, then the number of blocks; chunk_ms: each chunk's "
              f"measured forward and backward, its embeddings or head included)\n{split_table}\n"
              f"{common.wrote(args.out, f'{NAME}.json, .md and 09_split.*')}")
    return rows


def run_recompute(args, modes, stages, worlds):
    """Each recomputation mode's activation memory per stage and step time (1F1B at the
    largest m), one job per depth."""
    m, rc_rows = max(args.microbatches), []
    for s in stages:
        if worlds[s] == s:
            rc_rows += common.launch(recompute_accounting, args, m, list(dict.fromkeys(["none"] + modes)),
                                     world_size=s)
    if common.is_reporter():
        rc_table = common.save_results(args.out, RC_NAME, rc_rows, {**common.lm_settings(args), "world_size": stages},
                                       headers=RC_HEADERS, title=RC_TITLE, note=block_activation_bytes.__doc__)
        print(f"\n{RC_TITLE}\n({args.model_size} LM, 1F1B, m {m}; per stage: mb_act_MB one micro-batch's bytes "
              f"kept for backward, counted, beside the formula; peak_act_MB the most held in a step, beside "
              f"1F1B's; step times in ms over {args.steps} steps, vs_none: paired ratio)\n{rc_table}\n"
              f"{common.wrote(args.out, f'{RC_NAME}.json and .md')}")


def draw_timelines(args, schedules, stages, worlds):
    """One step of each schedule on the deepest pipeline timed alone, drawn stage by stage."""
    deepest = max(s for s in stages if worlds[s] == s)
    m = max(m for m in args.microbatches if all(runs(s, m, deepest) for s in schedules)) \
        if any(all(runs(s, m, deepest) for s in schedules) for m in args.microbatches) else max(args.microbatches)
    drawn = [s for s in schedules if runs(s, m, deepest)]
    lanes = common.launch(timelines, args, m, drawn, args.chunks, world_size=deepest)
    if common.is_reporter():
        for schedule, stage_lanes in lanes.items():
            path = f"{args.out}/09_timeline_{schedule}.png"
            v = f", {args.chunks} chunks a stage" if schedule == "interleaved" else ""
            draw_timeline(stage_lanes, f"{schedule.upper()}: {deepest} stages{v}, {m} micro-batches, one step "
                                       f"({args.model_size} LM, {args.backend}/{args.device})", path)
            print(common.wrote(path))


def main(argv=None):
    p = parser()
    args, schedules, modes, stages, worlds = checked_args(p, argv)
    if not args.no_verify:
        run_verification(args, schedules, modes, stages, worlds)
    if args.no_bench:
        return
    rows = run_benchmark(args, schedules, stages, worlds)
    if rows and modes != ["none"]:
        run_recompute(args, modes, stages, worlds)
    if rows:
        draw_timelines(args, schedules, stages, worlds)


if __name__ == "__main__":
    common.run_main(main)
