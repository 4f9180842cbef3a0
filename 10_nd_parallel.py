"""N-D parallelism: data, fully sharded data, context, tensor and pipeline parallelism
together, on one device mesh, built from the kit's own classes.

The ranks form a mesh with five named axes, outermost first: pp (pipeline stages), dp
(replicas), fsdp (shards), cp (each sequence split) and tp (tensor slices), each of length
--pp, --dp, --fsdp, --cp, --tp (1 by default; world size = their product). tp is innermost,
so a tensor-parallel group is consecutive ranks: on real machines the ranks of one node,
whose fast links carry the four activation all-reduces per block and micro-batch. cp comes
next, as in torchtitan (its K/V exchanges per block are the next heaviest, and with tp it
splits the sequence while tp splits the heads), then fsdp (its all-gathers move every weight
twice a step), then dp (one gradient all-reduce a step), and pp outermost: its
point-to-point activations are the lightest traffic, fit to cross nodes. Each rank builds
the kit's LM, turns its blocks tensor-parallel over its tp group (08), gives their
attention 11's context-parallel attention over its cp group (--cp-method, ring by default,
zig-zag layout), keeps its pipeline stage's layers (09's LMStage), shards the stage over
its fsdp group by blocks (07's FSDP), wraps that in DDPBucketed over its dp x cp group (05:
the cp ranks hold the same weights and see other tokens, a data axis for the weights; over
FSDP this is hybrid sharding), and runs 09's Pipeline over its pp group with --schedule
(1f1b, interleaved with --chunks, or zb1). With --tie the output head shares the token
embedding's weight, as GPT-2's does; under pipelining the first stage holds one copy and
the last stage the other, and their gradients are summed over the two (Megatron-LM's
embedding group) so both stay equal. With --ep the LM is 12's mixture of experts (a MoE in
every block's MLP, --experts, --top-k) and each MoE's experts are split over ep of the data
ranks (dp x fsdp, as torchtitan and Megatron-LM borrow expert parallelism from them): FSDP
and DDP leave the experts alone, each expert's gradient is summed over its copies (the
same place of the other ep groups); with tp every tp rank runs the same experts (the
experts are not tensor-parallel). The MoEs train without 12's load-balancing loss here (a
pipeline stage has no loss of its own to add it to; 12 verifies it).

Run:
    python 10_nd_parallel.py --dp 2 --tp 2 --pp 2           # verify this mesh, count its bytes, time it
    python 10_nd_parallel.py --pp 2 --fsdp 2 --cp 2         # the sequence split over 2 ranks too
    python 10_nd_parallel.py --pp 2 --dp 2 --schedule interleaved --model-size mini
    python 10_nd_parallel.py --pp 2 --dp 2 --ep 2           # 12's experts over the 2 data ranks
    python 10_nd_parallel.py                                # every mesh of the suite (make 10)
    python 10_nd_parallel.py --plan --model-size xxl --devices 64 --context-length 131072
    torchrun --standalone --nproc-per-node 8 10_nd_parallel.py --fsdp 2 --tp 2 --pp 2

Prints PASS/FAIL per verification case (every parameter, gathered whole, against one
process trained on the same global batches with AdamW clipped by the global norm), the
bytes each axis sends per step counted beside the closed-form prediction, the memory per
rank beside its prediction, and step time and tokens/s per rank beside torch's own
composition (init_device_mesh + fully_shard + parallelize_module + pipelining; none with a
cp axis: torch's context_parallel runs on CUDA only). Writes <out>/10_nd_parallel.{json,
md}, 10_accounting.{json,md}, 10_memory.{json,md}, 10_timeline.png; --plan writes
<out>/10_plan.{json,md}.
"""

import argparse
import contextlib
import copy
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

import common
import sharded_checkpoint
import placement

# ---- begin copy: Mesh (needs only torch and the standard library) ----
import itertools
import math

import torch.distributed as dist


class Mesh:
    """The ranks laid out on named axes, as torch's init_device_mesh does for its classes:
    the first axis outermost, the last innermost (its groups are consecutive ranks). Every
    slice along an axis gets its process group; ``group(axis)`` is this rank's, shared with
    the ranks that differ from it on that axis only. new_group is collective, so every rank
    builds the same Mesh at the same point of its program.

        mesh = Mesh({"pp": 2, "dp": 1, "fsdp": 2, "tp": 2})    # 8 ranks, tp innermost
        mesh.coord("pp"), mesh.size("tp")                      # this rank's place, an axis's length
        qkv = ColumnParallelLinear.from_linear(qkv, mesh.group("tp"))
        model = FSDP(stage, process_group=mesh.group("fsdp"))
        mesh.rank(pp=1, dp=0, fsdp=1, tp=0)                    # the global rank at those coordinates
        ends = mesh.subgroup("pp", [0, mesh.size("pp") - 1])   # first and last stage (collective)
    """

    def __init__(self, shape: dict):
        self.axes, self.shape = list(shape), dict(shape)
        if any(n < 1 for n in self.shape.values()):
            raise ValueError(f"every axis needs a length of at least 1: {self.shape}")
        if math.prod(self.shape.values()) != dist.get_world_size():
            raise ValueError(f"the mesh {self.shape} holds {math.prod(self.shape.values())} ranks, "
                             f"the world has {dist.get_world_size()}")
        self.coords = self.coords_of(dist.get_rank())
        self._groups = {axis: self._new_groups(self.slices(axis)) for axis in self.axes}

    def coords_of(self, rank: int) -> dict:
        out = {}
        for axis in reversed(self.axes):
            rank, out[axis] = divmod(rank, self.shape[axis])
        return {axis: out[axis] for axis in self.axes}

    def rank(self, **coords) -> int:
        r = 0
        for axis in self.axes:
            r = r * self.shape[axis] + coords[axis]
        return r

    def slices(self, axis) -> list:
        """Every line of ranks along ``axis`` (the other coordinates fixed), in a fixed order."""
        others = [a for a in self.axes if a != axis]
        return [[self.rank(**dict(zip(others, fixed)), **{axis: i}) for i in range(self.shape[axis])]
                for fixed in itertools.product(*(range(self.shape[a]) for a in others))]

    def _new_groups(self, lines):
        mine = None
        for members in lines:   # every rank creates every group, in the same order
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        return mine

    def coord(self, axis) -> int:
        return self.coords[axis]

    def size(self, axis) -> int:
        return self.shape[axis]

    def group(self, axis=None):
        """This rank's group along ``axis``; None: every rank of the mesh."""
        return dist.group.WORLD if axis is None else self._groups[axis]

    def ranks(self, axis) -> list:
        """The global ranks of this rank's group along ``axis``, in the group's order."""
        return [self.rank(**{**self.coords, axis: i}) for i in range(self.shape[axis])]

    def subgroup(self, axis, indices):
        """A group of the places ``indices`` along ``axis`` in every line (collective); this
        rank's, or None where this rank is not at one of those places."""
        return self._new_groups([[line[i] for i in indices] for line in self.slices(axis)])

    def joint(self, axes):
        """A new group over several axes (collective): this rank's, shared with the ranks
        that differ from it on ``axes`` only (the data ranks of the weights: dp and cp, say)."""
        others = [a for a in self.axes if a not in axes]
        lines = []
        for fixed in itertools.product(*(range(self.shape[a]) for a in others)):
            base = dict(zip(others, fixed))
            lines.append([self.rank(**base, **dict(zip(axes, c)))
                          for c in itertools.product(*(range(self.shape[a]) for a in axes))])
        return self._new_groups(lines)

    def partition(self, key):
        """A new group of every set of ranks whose coordinates give the same ``key(coords)``
        (collective; every rank the same key): this rank's. Groups the axes do not make, such
        as an expert-parallel group inside the data ranks."""
        lines = {}
        for r in range(math.prod(self.shape.values())):
            lines.setdefault(key(self.coords_of(r)), []).append(r)
        return self._new_groups(list(lines.values()))
# ---- end copy: Mesh ----


AXES = ("pp", "dp", "fsdp", "cp", "tp")   # outermost first: tp innermost (the fastest links)
SCHEDULE_NAMES = ("1f1b", "interleaved", "zb1")   # 09's schedules a mesh can run
MOE_EXPERTS, MOE_TOP_K = 4, 2   # 12's MoE LM in the checks: experts per MoE, each token's


@dataclasses.dataclass(frozen=True)
class Levers:
    """The knobs that travel together through 10, passed whole: the pipeline's ``schedule``,
    ``chunks`` a stage (interleaved; the other schedules hold one: ``v``) and
    ``microbatches`` (None: 2 x pp, ``m(shape)``); 08's sequence parallelism ``sp``; 09's
    ``recompute``; the compute ``dtype``; 11's ``cp_method``; 12's ``ep`` degree, with
    ``experts`` per MoE and ``top_k``; whether the head is ``tie``d to the embedding; and
    the pipeline's ``cuts`` (09's LMStage: each chunk's first block, then the number of
    blocks; None: by FLOPs), which the benchmark measures (09's measure_costs).
    ``dataclasses.replace(levers, sp=True)`` makes a variant."""

    schedule: str = "1f1b"
    chunks: int = 2
    microbatches: int | None = None
    sp: bool = False
    recompute: str = "none"
    dtype: str = "float32"
    cp_method: str = "ring"
    ep: int = 1
    experts: int = MOE_EXPERTS
    top_k: int = MOE_TOP_K
    tie: bool = False
    cuts: tuple | None = None

    @property
    def v(self) -> int:
        """The chunks a stage holds."""
        return chunks_of(self.schedule, self.chunks)

    def m(self, shape) -> int:
        """The micro-batches a step runs on ``shape``."""
        return self.microbatches or default_microbatches(shape)
ddp_mod = common.load_script(common.ROOT / "05_bucketed_ddp.py")
fsdp_mod = common.load_script(common.ROOT / "07_fsdp.py")
tp_mod = common.load_script(common.ROOT / "08_tensor_parallel.py")
pp_mod = common.load_script(common.ROOT / "09_pipeline_parallel.py")
cp_mod = common.load_script(common.ROOT / "11_context_parallel.py")
ep_mod = common.load_script(common.ROOT / "12_expert_parallel.py")


def refusal(shape, schedule="1f1b", sp=False, recompute="none", ep=1):
    """Why a mesh cannot take these memory levers (None if it can)."""
    shape = {a: shape.get(a, 1) for a in AXES}
    if sp and shape["tp"] < 2:
        return "--sp splits the sequence over the tp ranks: give --tp 2 or more"
    if sp and ep > 1:
        return "--sp with --ep: 12's experts keep the MLP whole, which sequence parallelism splits"
    if sp and schedule == "zb1":
        return "--sp with --schedule zb1: zb1 defers the weights' gradients of plain linears only; use 1f1b"
    if recompute == "full" and schedule == "zb1":
        return "--recompute full with --schedule zb1: zb1's W needs each linear's kept input; use selective or 1f1b"
    return None


class ParallelLM:
    """The kit's LM over a Mesh, from the kit's classes, outermost first: 09's Pipeline over
    pp, 05's DDPBucketed over dp, 07's FSDP over fsdp (a unit per block of the stage, the
    rest the root), 08's tensor-parallel blocks over tp. ``model``: the whole LM, the same on
    every rank (its head may share the embedding's weight); ``batch``: the global batch,
    split over the dp x fsdp replicas and then into ``levers.m(shape)`` micro-batches.
    ``levers`` (Levers): 09's ``schedule`` and ``chunks`` (interleaved: each stage holds
    ``chunks`` chunks of the blocks; zb1 not with fsdp, whose reduce-scatters run in
    backward, before zb1's deferred W); ``sp``: 08's sequence parallelism over tp (the stages
    pass each tp rank's part of the sequence); ``recompute``: 09's activation recomputation
    of the blocks; ``dtype`` bf16: train_step runs the pipeline in autocast (weights,
    gradients, their reduction and the optimizer stay float32); ``cp_method``: 11's; ``ep``:
    12's experts over ep data ranks. Each axis is a call on the model, innermost first, and
    records its placements (common.py), which clip_grad_norm_ and the checkpoints read."""

    def __init__(self, mesh, model, batch, levers=Levers(), bucket_mb=25.0, count_activations=False,
                 **pipeline_options):
        schedule, chunks, cp_method, ep, sp, recompute, dtype = (levers.schedule, levers.v, levers.cp_method, levers.ep,
                                                                 levers.sp, levers.recompute, levers.dtype)
        microbatches = levers.m(mesh.shape)
        self.mesh, self.ep, self.sp, self.recompute, self.dtype = mesh, ep, sp, recompute, dtype
        P, D, F, C, T = (mesh.size(a) for a in AXES)
        if schedule == "zb1" and F > 1:
            raise ValueError("zb1 defers the weights' gradients past FSDP's reduce-scatters: use 1f1b or interleaved")
        why = refusal(mesh.shape, schedule, sp, recompute, ep)
        if why:
            raise ValueError(why)
        self.tied = model.head.weight is model.tok.weight
        self.replica, self.replicas = mesh.coord("dp") * F + mesh.coord("fsdp"), D * F
        if T > 1:
            tp_mod.tensor_parallel_lm(model, mesh.group("tp"), sequence_parallel=sp)
        if C > 1:   # each rank its part of every sequence (11's zig-zag layout), attention across the cp group
            cp_mod.context_parallel_lm(model, mesh.group("cp"), cp_method, "zigzag")
        self.experts, self.expert_copies = [], None
        if ep > 1:  # 12's experts split over ep consecutive data ranks (dp x fsdp), copies at the same place of each
            if (D * F) % ep or C > 1:
                raise ValueError(f"ep {ep} takes its ranks from the {D * F} data ranks (no cp): it must divide them")
            where = lambda c: (c["pp"], c["cp"], c["tp"])   # noqa: E731  (the ranks that hold the same layers)
            self.ep_group = mesh.partition(lambda c: where(c) + ((c["dp"] * F + c["fsdp"]) // ep,))
            copies = mesh.partition(lambda c: where(c) + ((c["dp"] * F + c["fsdp"]) % ep,))
            self.expert_copies = copies if D * F > ep else None
            for moe in (m for m in model.modules() if isinstance(m, ep_mod.MoE)):
                moe.distribute(self.ep_group, self.expert_copies)
            self.experts = ep_mod.expert_parameters(model)
        self.stage = pp_mod.LMStage(model, mesh.coord("pp"), P, chunks, cuts=levers.cuts)
        pp_mod.recompute(self.stage.blocks.values(), recompute)
        self.fsdp = fsdp_mod.FSDP(self.stage, process_group=mesh.group("fsdp"), units=list(self.stage.blocks.values()),
                                  ignore=self.experts) if F > 1 else None
        module = self.fsdp or self.stage
        # the weights' data ranks: dp, and cp (its ranks see other tokens of the same sequences);
        # a group of its own even where it holds the same ranks as the cp group, whose traffic is attention's
        self.data_group = (mesh.joint(("dp", "cp")) if C > 1 else mesh.group("dp")) if D * C > 1 else None
        self.module = ddp_mod.DDPBucketed(module, bucket_mb, process_group=self.data_group,
                                          ignore_parameters=self.experts) if D * C > 1 else module
        shape = (batch // self.replicas // microbatches, model.pos.num_embeddings // C // (T if sp else 1),
                 model.tok.embedding_dim)   # under sp the stages pass this tp rank's part
        self.pipe = pp_mod.Pipeline(self.module, microbatches, pp_mod.lm_loss, schedule, mesh.group("pp"),
                                    activation_shape=shape, count_activations=count_activations and self._activation,
                                    chunks=chunks, **pipeline_options)
        self.params = dict(self.stage.named_parameters())   # FSDP's shards under the original names
        # the tied embedding's two copies (first and last stage) sum their gradients
        self.embed_group = mesh.subgroup("pp", [0, P - 1]) if self.tied and P > 1 else None
        self.tied_copy = self.params.get("tok.weight" if self.pipe.first else "head.weight") \
            if self.embed_group is not None else None
        if self.tied_copy is not None:
            pp_mod.tie([self.tied_copy], self.embed_group)

    def materialize(self, device, source=None):
        """A model built on meta (``torch.device("meta")``, every axis applied): this rank's
        part made real on ``device`` and filled from ``source`` (placement.materialize: the
        model's init, ``placement.initialized(blueprint, seed=...)``, or whole tensors by name;
        None: storage only, for load_full_checkpoint or a sharded checkpoint)."""
        placement.materialize(self.module, device, source)
        return self

    def _activation(self, t) -> bool:
        """Whether a tensor autograd saves is an activation: not a weight FSDP gathered (the
        unit's, freed after its forward; the root's, kept until its backward)."""
        gathered = {f.untyped_storage().data_ptr() for u in (self.fsdp._units if self.fsdp else [])
                    for f in u.full if f is not None and f.untyped_storage().nbytes()}
        return t.untyped_storage().data_ptr() not in gathered

    def part(self, batch):
        """This rank's replica's part of the global batch (every tp and pp rank of a replica
        takes the same part), and of each sequence its cp part."""
        part = tuple(common.shard(t, self.replica, self.replicas) for t in batch)
        C = self.mesh.size("cp")
        return part if C == 1 else tuple(cp_mod.shard_sequence(t, self.mesh.coord("cp"), C, "zigzag") for t in part)

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        if hasattr(self.module, "finish_gradient_synchronization"):
            self.module.finish_gradient_synchronization()   # DDPBucketed, after the FSDP inside it
        if self.embed_group is not None and self.tied_copy.grad is not None:
            dist.all_reduce(self.tied_copy.grad, group=self.embed_group)   # the embedding's + the head's
        if self.ep > 1:   # each expert summed over its copies, over the data ranks' count (12)
            ep_mod.reduce_expert_gradients(self.stage, self.expert_copies, self.replicas)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global L2 norm over the whole mesh, each element once:
        the placement record's clip_grad_norm_ over the mesh's ranks (every axis recorded
        how it laid out each parameter)."""
        total = placement.clip_grad_norm_(self.stage, max_norm, process_group=self.mesh.group())
        self.last_norm = total   # (a tensor: read as a number, it would wait for the device every step)
        return total

    # -- whole tensors by name: verification and checkpoints ---------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict:
        """This rank's stage's parameters whole, by name (collective over fsdp and tp)."""
        return {n: placement.whole_tensor(p, placement.placements(p)) for n, p in self.params.items()}

    def full_checkpoint(self, optimizer) -> dict:
        """Whole parameters and optimizer state by name, with the optimizer's groups, on the
        mesh's first rank ({} in each on the others); every rank must call it."""
        group = self.mesh.group()
        return {"model": placement.full_state_dict(self.stage, group),
                "optim": placement.full_optim_state_dict(self.stage, optimizer, group)}

    def load_full_checkpoint(self, ckpt, optimizer):
        """Load a full_checkpoint saved on any mesh, or one process's (pass it on every rank)."""
        placement.load_full_state_dict(self.stage, ckpt["model"])
        placement.load_full_optim_state_dict(self.stage, optimizer, ckpt["optim"])


MAX_NORM = 0.4   # gradients clipped by the global norm (the verification LM's starts near 0.58: always clipped)


def make_optimizer(model: ParallelLM, params=None):
    # eps 1e-6, as in 08 and 09: with 1e-8 nearly-cancelling gradients turn last-bit
    # differences (split matmuls, other sum orders) into visible ones. bf16: SGD with
    # momentum (AdamW turns bf16's rounding of near-zero gradients into whole steps; 05)
    params = params if params is not None else model.module.parameters()
    if getattr(model, "dtype", "float32") == "bf16":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def train_step(model, optimizer, batch, clock, max_norm=MAX_NORM):
    """One step on this rank's replica's part of the global batch, timed by phase; the
    loss on a last stage (its part of the batch), None elsewhere."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with clock.phase("pipeline"), common.autocast(x.device, model.dtype):   # tp's all-reduces inside
        loss = model.pipe.step(x if model.pipe.first else None, y if model.pipe.last else None)
    with clock.phase("comm"):       # FSDP's reduce-scatters, DP's buckets, the tied copies' sum
        model.finish_gradient_synchronization()
    with clock.phase("optim"):
        model.clip_grad_norm_(max_norm)   # one norm over every axis
        optimizer.step()
    return None if loss is None else loss.item()


# ----------------------------------------------------------------------------------------
# Verification: each mesh against one process on the same global batches
# ----------------------------------------------------------------------------------------
VERIFY_LM = (32, 64, 4, 4)   # d_model, d_ff, blocks, heads: 4 blocks for 4 stages, 4 heads for tp 2 or 4
VERIFY_T, VERIFY_STEPS = 16, 3


def mesh_of(**sizes) -> dict:
    """A mesh shape with every axis, outermost first (1 where not given)."""
    return {a: sizes.get(a, 1) for a in AXES}


def label(shape, tie=False, schedule="1f1b", chunks=2) -> str:
    """A mesh's name: its axes, and its schedule where it is not 1F1B."""
    sched = "" if schedule == "1f1b" else f", {schedule}" + (f" v {chunks}" if schedule == "interleaved" else "")
    return " x ".join(f"{a} {n}" for a, n in shape.items() if n > 1) + (" (tied)" if tie else "") + sched


def lever_label(levers) -> str:
    """The memory levers a name mentions: sequence parallel, recomputation, bf16."""
    on = (["sequence parallel"] if levers.sp else []) + \
        ([f"recompute {levers.recompute}"] if levers.recompute != "none" else []) + \
        (["bf16 autocast"] if levers.dtype == "bf16" else [])
    return f", {', '.join(on)}" if on else ""


def levers_of(args) -> Levers:
    """The command's levers (its flags; the ones a parser lacks at their defaults)."""
    get = lambda name, default: getattr(args, name, None) if getattr(args, name, None) is not None else default  # noqa: E731
    return Levers(schedule=get("schedule", "1f1b"), chunks=get("chunks", 2), microbatches=get("microbatches", None),
                  sp=get("sp", False), recompute=get("recompute", "none"), dtype=get("dtype", "float32"),
                  cp_method=get("cp_method", "ring"), ep=get("ep", 1), experts=get("experts", MOE_EXPERTS),
                  top_k=get("top_k", MOE_TOP_K), tie=get("tie", False))


def chunks_of(schedule, chunks) -> int:
    return chunks if schedule == "interleaved" else 1


def default_microbatches(shape) -> int:
    return 2 * shape["pp"] if shape["pp"] > 1 else 1


def lm(dims, context, tie, seed, device="cpu"):
    """The kit's LM (d_model, d_ff, blocks, heads), with the head tied to the embedding."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = common.TransformerLM(*dims, context_length=context)
    if tie:
        model.head.weight = model.tok.weight
    return model


def moe_lm(dims, context, tie, seed, experts, top_k, device="cpu"):
    """12's MoE LM (a MoE in every block, no capacity limit; the load-balancing loss left
    to 12, which verifies it: a pipeline stage has no loss of its own to add it to)."""
    model = ep_mod.build(dims, context, experts, top_k, 0.0, seed, device, aux_coef=0.0)
    if tie:
        model.head.weight = model.tok.weight
    return model


def routed_as(replicas, m):
    """The groups a MoE mesh routes its tokens in: each replica's part of the batch, each
    micro-batch of it (a MoE's routing depends on the tokens it sees together)."""
    def groups(batch):
        parts = [tuple(common.shard(t, r, replicas).chunk(m)[i] for t in batch) for r in range(replicas)
                 for i in range(m)]
        return parts
    return groups


def compare(model: ParallelLM, ref, norms=(), tol=None, extra_ok=True) -> dict:
    """Every parameter of every stage, gathered whole, against the reference's by name; and
    each step's global gradient norm against the reference's (``norms``: pairs): AdamW
    hardly notices a gradient scaled by a wrong norm, so the norm is checked itself (within
    1e-4: torch's clip_grad_norm_ itself is 4e-5 off the float64 norm on this LM's head)."""
    full, theirs = model.full_parameters(), dict(ref.named_parameters(remove_duplicate=False))
    ok = extra_ok and all(abs(a - b) <= (1e-2 if tol else 1e-4) * b for a, b in norms)
    diff = 0.0
    for name, t in full.items():
        diff = max(diff, (t.double() - theirs[name].detach().double()).abs().max().item())
        try:
            torch.testing.assert_close(t, theirs[name].detach(), **(tol or {}))
        except AssertionError:
            ok = False
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"ok": ok, "max_diff": diff, "names": sorted(full)})
    expected = set(dict(ref.named_parameters())) | ({"head.weight"} if model.embed_group is not None else set())
    return {"ok": all(r["ok"] for r in everyone) and {n for r in everyone for n in r["names"]} == expected,
            "max_diff": max(r["max_diff"] for r in everyone)}


@common.groups_freed()   # its mesh's groups, not kept for the cases after it
def verify_mesh(ctx, args, shape, levers=Levers(), checkpoint=None, meta=False):
    """Train the verification LM over ``shape`` and one process on the same global batches
    (AdamW, clipped at MAX_NORM), VERIFY_STEPS steps; compare. ``checkpoint`` = (path, "save"
    | "resume", k): RESUME_STEPS steps of RESUME_BATCH, saving after step k, or starting
    from the file at step k (the reference still trains from step 0; a fourth entry: the
    mesh the resumed checkpoint's steps ran on, with ep routed as there). ``levers.ep`` > 1: 12's MoE LM, its experts over ep data ranks (the reference
    routes each replica's micro-batches as they are routed). ``sp``, ``recompute``,
    ``dtype``: the memory levers (the reference trains without the first two; bf16: under the same autocast,
    within common.TOLERANCE["autocast"], and its losses within common.BF16_LOSS_BOUND of float32's). ``meta``:
    the model built on the meta device, the axes applied, then each rank's part made real
    and initialised module by module (ParallelLM.materialize): one process's values."""
    mesh, m, ep, dtype = Mesh(shape), levers.m(shape), levers.ep, levers.dtype
    steps, batch = (RESUME_STEPS, RESUME_BATCH) if checkpoint else (VERIFY_STEPS, 2 * m * shape["dp"] * shape["fsdp"])
    build = (lambda device: moe_lm(VERIFY_LM, VERIFY_T, levers.tie, args.seed, levers.experts, levers.top_k, device)) \
        if ep > 1 else (lambda device: lm(VERIFY_LM, VERIFY_T, levers.tie, args.seed, device))
    if meta:   # one process: the same init on the same seed (MoELM's constructor draws for the MLPs it drops)
        whole = build("meta")
        blueprint = copy.deepcopy(whole)   # the model as built (on meta: no memory)
        ref = placement.materialize(copy.deepcopy(blueprint), ctx.device, placement.initialized(blueprint, seed=args.seed))
        model = ParallelLM(mesh, whole, batch, levers).materialize(ctx.device, placement.initialized(blueprint,
                                                                                                  seed=args.seed))
    else:
        ref = build(ctx.device)
        model = ParallelLM(mesh, copy.deepcopy(ref), batch, levers)
    same = meta or meta_twin(ctx, args, mesh, batch, levers, build)
    fp32 = copy.deepcopy(ref) if dtype == "bf16" else None
    opt, ref_opt = make_optimizer(model), make_optimizer(model, ref.parameters())
    fp32_opt = make_optimizer(model, fp32.parameters()) if fp32 is not None else None
    gap = 0.0
    path, action, k, saved_on = (tuple(checkpoint) + (None,))[:4] if checkpoint else (None, None, None, None)
    routed = lambda s: routed_as(s["dp"] * s["fsdp"], default_microbatches(s)) if ep > 1 else None  # noqa: E731
    norms = []
    for step in range(steps):
        x, y = common.lm_batch(batch, VERIFY_T, step, args.seed, ctx.device)
        groups = routed(saved_on if action == "resume" and step < k else shape)   # a MoE: the mean over its parts
        with common.autocast(ctx.device, dtype):
            norm = common.one_process_step(ref, ref_opt, [(part, {}) for part in (groups((x, y)) if groups else
                                                                                  [(x, y)])], MAX_NORM).item()
        if fp32 is not None:   # float32's loss on this batch, before its step
            fp32_opt.zero_grad(set_to_none=True)
            loss32 = fp32(x, y)
            loss32.backward()
            torch.nn.utils.clip_grad_norm_(fp32.parameters(), MAX_NORM)
            fp32_opt.step()
        if action == "resume" and step < k:
            continue
        if action == "resume" and step == k:
            model.load_full_checkpoint(torch.load(path, weights_only=True), opt)
            sharded = common.sharded_matches(model.stage, opt, sharded_checkpoint.latest_checkpoint(path + ".sharded"))
        loss = train_step(model, opt, model.part((x, y)), common.StepClock(ctx.device))
        norms.append((model.last_norm.item(), norm))
        if fp32 is not None:   # the global batch's loss: the last stages' parts, averaged over the replicas
            total = torch.tensor([loss if loss is not None else 0.0], device=ctx.device)
            dist.all_reduce(total)
            gap = max(gap, abs(total.item() / (model.replicas * mesh.size("cp") * mesh.size("tp")) - loss32.item()))
        if action == "save" and step + 1 == k:
            ckpt = model.full_checkpoint(opt)
            if dist.get_rank() == 0:
                torch.save(ckpt, path)
            sharded_checkpoint.save_sharded(model.stage, opt, path + ".sharded", k)   # each rank its part: must load alike
            dist.barrier()
            return {"ok": True, "max_diff": 0.0, "saved": path}
    if action == "resume":   # the sharded checkpoint of the same step loaded bit for bit as the full one
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sharded)
        sharded = all(everyone)
    out = compare(model, ref, norms, common.TOLERANCE["autocast"] if dtype == "bf16" else None,
                  extra_ok=gap <= common.BF16_LOSS_BOUND and (action != "resume" or sharded) and same)
    out["meta_same"] = same
    if action == "resume":
        out["sharded"] = sharded
    if fp32 is not None:
        out["loss_gap"] = gap
    return out


def meta_twin(ctx, args, mesh, batch, levers, build) -> bool:
    """Whether the mesh set up from a model built on meta (ParallelLM.materialize with the
    LM's init) holds, on every rank, bit for bit what the same mesh set up from the whole
    model with those values holds: every parameter and buffer of this rank's stage, FSDP's
    padding included. Training from equal states is the same code on the same tensors; the
    suite trains two meshes from meta outright (SUITE_META)."""
    whole = build("meta")
    blueprint = copy.deepcopy(whole)
    twin = ParallelLM(mesh, whole, batch, levers).materialize(ctx.device, placement.initialized(blueprint,
                                                                                             seed=args.seed))
    plain = ParallelLM(mesh, placement.materialize(copy.deepcopy(blueprint), ctx.device,
                                                placement.initialized(blueprint, seed=args.seed)), batch, levers)
    a, b = twin.stage.state_dict(), plain.stage.state_dict()
    mine = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return all(everyone)


# The suite: every 2-axis mesh at 4 ranks, the 3-axis ones at 8, an axis of 3 at 6; the tied
# embedding at pp 2 and pp 4; 09's interleaved schedule (2 chunks a stage) on pp x dp and
# pp x fsdp, ZB-H1 on pp x tp; 11's context parallelism (ring, zig-zag) with tp, fsdp, pp, dp
# and pp x fsdp; a checkpoint saved on fsdp x tp x pp, resumed on dp x pp.
# Each case: (mesh shape, tied, schedule).
SUITE = {8: [(mesh_of(pp=2, dp=2, tp=2), False, "1f1b"), (mesh_of(pp=2, fsdp=2, tp=2), False, "1f1b"),
             (mesh_of(pp=2, fsdp=2, cp=2), True, "1f1b")],
         4: [(mesh_of(dp=2, tp=2), False, "1f1b"), (mesh_of(pp=2, dp=2), False, "1f1b"),
             (mesh_of(pp=2, tp=2), False, "1f1b"), (mesh_of(fsdp=2, tp=2), False, "1f1b"),
             (mesh_of(pp=2, fsdp=2), False, "1f1b"), (mesh_of(dp=2, fsdp=2), False, "1f1b"),
             (mesh_of(pp=4), True, "1f1b"), (mesh_of(pp=2, tp=2), True, "1f1b"),
             (mesh_of(pp=2, dp=2), True, "interleaved"), (mesh_of(pp=2, fsdp=2), False, "interleaved"),
             (mesh_of(pp=2, tp=2), True, "zb1"),
             (mesh_of(cp=2, tp=2), False, "1f1b"), (mesh_of(fsdp=2, cp=2), False, "1f1b"),
             (mesh_of(pp=2, cp=2), True, "1f1b"), (mesh_of(dp=2, cp=2), False, "1f1b")],
         6: [(mesh_of(dp=3, tp=2), False, "1f1b")]}
SUITE_CHUNKS = 2
# 12's experts on the data ranks (ep 2, 4 experts, top-2): dp x tp, dp 4 (each expert on 2
# ranks), pp x dp, fsdp x tp (the experts not tensor-parallel: every tp rank runs the same
# ones); and a checkpoint of dp 4 x tp 2 at ep 4 after 2 steps, resumed on dp 2 x tp 2 at ep 2.
SUITE_EP = {4: [(mesh_of(dp=2, tp=2), 2), (mesh_of(dp=4), 2), (mesh_of(pp=2, dp=2), 2), (mesh_of(fsdp=2, tp=2), 2)]}
EP_RESUME = ((mesh_of(dp=4, tp=2), 4), (mesh_of(dp=2, tp=2), 2), 2)
# built on the meta device, each rank's part made real and initialised (ParallelLM.materialize)
SUITE_META = {8: [(mesh_of(pp=2, fsdp=2, tp=2), True, 1)], 4: [(mesh_of(dp=2, tp=2), False, 2)]}
RESUME = (mesh_of(pp=2, fsdp=2, tp=2), mesh_of(pp=2, dp=2), 2)   # saved on, resumed on, after step
RESUME_STEPS, RESUME_BATCH = 4, 16


def verify(ctx, args, cases, resume=None, levers=None):
    """Each (mesh shape, tie, schedule) of ``cases`` in these processes, with ``levers`` (a
    Levers' fields, as a dict: the job crosses to fresh processes; its chunks and memory
    levers, a name says which are on); ``resume`` = (path, "save" or "resume") also saves
    RESUME's checkpoint from its first mesh or resumes it on its second, whichever has this
    world size."""
    levers = Levers(**(levers or {}))
    out = {label(shape, tie, schedule, levers.chunks) + lever_label(levers): verify_mesh(   # (default micro-batches)
        ctx, args, shape, dataclasses.replace(levers, tie=tie, schedule=schedule, microbatches=None))
        for shape, tie, schedule in cases}
    if resume is not None and resume[0] == "ep":   # one mesh with 12's experts (the command's --ep)
        _, ep, shape, tie = resume
        return {f"{label(shape, tie)}, ep {ep}": verify_mesh(ctx, args, shape, Levers(tie=tie, ep=ep))}
    for shape, ep in SUITE_EP.get(ctx.world_size, []) if resume is not None else []:
        out[f"{label(shape)}, ep {ep}"] = verify_mesh(ctx, args, shape, Levers(ep=ep))
    for shape, tie, ep in SUITE_META.get(ctx.world_size, []) if resume is not None else []:
        out[f"{label(shape, tie)}{f', ep {ep}' if ep > 1 else ''}, built on meta"] = verify_mesh(
            ctx, args, shape, Levers(tie=tie, ep=ep), meta=True)
    if resume is not None:
        path, action = resume
        shape = RESUME[0] if action == "save" else RESUME[1]
        r = verify_mesh(ctx, args, shape, Levers(tie=True), (path, action, RESUME[2]))
        if action == "resume":
            out[f"checkpoint of {label(RESUME[0], True)} after step {RESUME[2]}, resumed on {label(shape)}"] = r
        (then, ep_then), (now, ep_now), k = EP_RESUME
        shape, ep = (then, ep_then) if action == "save" else (now, ep_now)
        r = verify_mesh(ctx, args, shape, Levers(ep=ep), (path + ".ep", action, k, then))
        if action == "resume":
            out[f"checkpoint of {label(then)}, ep {ep_then} after step {k}, resumed on {label(now)}, ep {ep_now}"] = r
    return out


# ----------------------------------------------------------------------------------------
# Accounting: bytes each axis sends and memory per rank, counted beside the formulas
# ----------------------------------------------------------------------------------------
def counted_bytes(model: ParallelLM, log) -> dict:
    """Bytes this rank sent per axis, from count_collectives' log of one step (ep: the
    bytes it put into the experts' all-to-alls, whose splits follow the router)."""
    mesh, axes = model.mesh, {}
    for a in AXES:
        axes[mesh.group(a).group_name] = (a, mesh.size(a))
    if model.data_group is not None:   # dp x cp: the weights' gradients
        axes[model.data_group.group_name] = ("dp", mesh.size("dp") * mesh.size("cp"))
    if model.ep > 1:
        axes[model.ep_group.group_name] = ("ep", None)
        if model.expert_copies is not None:
            axes[model.expert_copies.group_name] = ("ep copies", dist.get_world_size(model.expert_copies))
    if model.embed_group is not None:
        axes[model.embed_group.group_name] = ("tie", 2)
    axes[mesh.group().group_name] = ("clip", dist.get_world_size())
    out = {}
    for op, group, nbytes in log:
        axis, n = axes[group]
        out[axis] = out.get(axis, 0.0) + (nbytes if axis == "ep" else nbytes * common.SENT_SHARE[op](n))
    return out


def stage_layout(dims, context, shape, stage, levers=Levers(), ep_rank=0):
    """(name, whole shape, unit) of every parameter on ``stage`` (tp slices: the local
    shape), from the model's dimensions alone (a model on the meta device); ``levers.ep`` >
    1: 12's MoE LM, with the experts of place ``ep_rank`` of its ep group only."""
    d, f, _, _ = dims
    tie, chunks, ep, experts = levers.tie, levers.v, levers.ep, levers.experts
    T = shape["tp"]
    local = {"qkv.weight": lambda s: (s[0] // T, s[1]), "proj.weight": lambda s: (s[0], s[1] // T),
             "ff_in.weight": lambda s: (s[0] // T, s[1]), "ff_out.weight": lambda s: (s[0], s[1] // T)}
    whole = moe_lm(dims, context, tie, 0, experts, 1, "meta") if ep > 1 else lm(dims, context, tie, 0, "meta")
    model = pp_mod.LMStage(whole, stage, shape["pp"], chunks, cuts=levers.cuts)
    per = experts // ep
    mine = lambda name: ".experts." not in name or \
        ep_rank * per <= int(name.split(".experts.")[1].split(".")[0]) < (ep_rank + 1) * per  # noqa: E731
    out = []
    for name, p in ((n, p) for n, p in model.named_parameters() if mine(n)):
        kind = name.split(".", 2)[-1]
        unit = name.split(".")[1] if name.startswith("blocks.") else None
        out.append((name, local[kind](tuple(p.shape)) if name.startswith("blocks.") and kind in local else tuple(p.shape),
                    unit))
    return out


def predicted_bytes(dims, context, shape, coords, batch, levers=Levers(), routed=None) -> dict:
    """Bytes a rank at ``coords`` sends per step, by axis, in closed form (ring algorithms:
    an all-reduce of S bytes over n ranks sends 2(n-1)/n S, an all-gather or reduce-scatter
    of S (n-1)/n S). DP: an all-reduce of the rank's gradients (plus a has-gradient flag per
    tensor). FSDP: a block unit is gathered before each micro-batch's forward and again
    before its backward (2m), the root once (it stays whole until its last backward), and
    each unit's gradients reduce-scattered once (flags included). TP: 4 all-reduces of the
    activations (b t d) per block and micro-batch. PP: one activation forward and one
    gradient back per micro-batch and chunk boundary (interleaved: v chunks a stage, v times
    the boundaries). CP: per block and micro-batch, 11's attention's exchanges of this rank's
    K and V (attention_bytes), the gradients' all-reduce going over dp x cp. EP (12's
    experts on ep data ranks; ``routed``: the rows the step's MoE forwards kept and received,
    summed): what this rank puts into the all-to-alls, 2 (kept + received) d floats and E
    counts per forward; its experts' gradients all-reduced over their copies ("ep copies")
    and left out of dp and fsdp. Tie: the two copies' gradients summed. Clip: one number
    over the whole mesh. SP (08's sequence parallelism): per block and micro-batch ten all-
    gathers or reduce-scatters of the activations ((T-1)/T each: TP's four all-reduces and
    backward's two gathers again), the norms' gradients (2 d) all-reduced, the first block's
    input gradient and the final norm's input gathered once each; PP then passes parts.
    Full recomputation runs each block's forward again in backward, its tp collectives too,
    up to the last tensor backward needs (torch's checkpoint stops there): not the MLP's
    output reduction, which only the next block's input needs (3 of SP's 4, 1 of TP's 2)."""
    d = dims[0]
    m, tie, chunks, cp_method, ep, experts, sp, recompute = (levers.m(shape), levers.tie, levers.v, levers.cp_method,
                                                             levers.ep, levers.experts, levers.sp, levers.recompute)
    P, D, F, C, T = (shape[a] for a in AXES)
    s, n_ranks, b, context = coords["pp"], math.prod(shape.values()), batch // (D * F), context // C
    replica = coords["dp"] * F + coords["fsdp"]
    full = stage_layout(dims, context * C, shape, s, levers, replica % ep)
    layout = [e for e in full if ".experts." not in e[0]] if ep > 1 else full

    def shard(shp):   # FSDP's shard of a parameter: its rows padded to a multiple of F
        rows, rest = (shp[0], math.prod(shp[1:])) if shp else (1, 1)
        return -(-rows // F) * rest if F > 1 else rows * rest
    out = {}
    if D * C > 1:
        out["dp"] = 2 * (D * C - 1) / (D * C) * 4 * sum(shard(shp) + 1 for _, shp, _ in layout)
    if F > 1:
        units = {}
        for _, shp, unit in layout:
            numel, count = units.get(unit, (0, 0))
            units[unit] = (numel + shard(shp), count + 1)
        out["fsdp"] = sum(((2 * m if unit is not None else 1) * size + size + count) * (F - 1) * 4
                          for unit, (size, count) in units.items())
    blocks = len({unit for _, _, unit in layout if unit is not None})
    if T > 1 and sp:
        here = [i for _, _, unit in layout if unit is not None for i in [int(unit)]]
        ends = (0 in here) + (coords["pp"] == P - 1)   # the first block's scatter (backward), ln_f's gather
        again = 3 if recompute == "full" else 0   # the forward's gathers and attention's reduce-scatter
        out["tp"] = (blocks * (10 + again) + ends) * b * context * d * 4 * (T - 1) / T + \
            blocks * m * 2 * d * 4 * 2 * (T - 1) / T
    elif T > 1:   # 4 all-reduces a block (attention's f and g, the MLP's); a MoE's experts are not split: 2
        again = 1 if recompute == "full" else 0   # attention's all-reduce
        out["tp"] = blocks * ((2 if ep > 1 else 4) + again) * b * context * d * 4 * 2 * (T - 1) / T
    if C > 1:   # one micro-batch's K (or V) on this rank: b/m sequences, its tokens, its heads; recomputed
        out["cp"] = blocks * m * cp_mod.attention_bytes(cp_method, C, b // m * context * d // T * 4,   # (either
                                                        recomputed=recompute != "none")   # mode): its exchange again
    if ep > 1:
        out["ep"] = 2 * routed["rows"] * d * 4 + routed["forwards"] * experts * 8
        copies = D * F // ep
        if copies > 1:
            out["ep copies"] = 2 * (copies - 1) / copies * 4 * sum(math.prod(shp) for n, shp, _ in full
                                                                   if ".experts." in n)
    if P > 1:
        out["pp"] = b * context * d * 4 * (2 * chunks - (s == P - 1) - (s == 0)) / (T if sp else 1)
        if tie and s in (0, P - 1):
            out["tie"] = 4 * shard(next(shp for name, shp, _ in layout if name in ("tok.weight", "head.weight")))
    out["clip"] = 2 * (n_ranks - 1) / n_ranks * 4
    return out


def activation_bytes(dims, context, shape, stage, mb, levers=Levers()) -> list:
    """Bytes autograd saves for one micro-batch of ``mb`` sequences through each of the
    stage's chunks (float32): per block and token 6d + (4d + 2f + h) / T + 2 numbers
    (RMSNorm's input, its scaled input and output, twice; q, k, v, the attention output and
    its log-sum-exp per head, split over tp; the MLP's hidden layer before and after GELU,
    split over tp; the norms' scales); the first chunk adds the token ids, the last the
    final norm's (3d + 1), the log-softmax over the vocabulary and the targets. With cp,
    each rank holds context/cp tokens of every sequence (11's ring saves what SDPA does).
    SP splits the whole-kept part too: (10d + 2f + h + 2) / T; recompute (09's
    block_activation_bytes): selective drops the log-sum-exp, full keeps the input (d, or
    d/T under SP)."""
    d, f, _, h = dims
    chunks, cp, sp, recompute = levers.v, shape["cp"], levers.sp, levers.recompute
    ranges = pp_mod.LMStage(lm(dims, context, False, 0, "meta"), stage, shape["pp"], chunks, cuts=levers.cuts).ranges
    context //= cp
    P, T, n = shape["pp"], shape["tp"], mb * context
    out = []
    lse = 0 if recompute == "selective" else h
    per = (d if recompute == "full" else 10 * d + 2 * f + lse + 2) / T if sp else \
        d if recompute == "full" else 6 * d + (4 * d + 2 * f + lse) // T + 2
    for c, (lo, hi) in enumerate(ranges):
        total = (hi - lo) * n * 4 * per
        if stage == 0 and c == 0:
            total += n * 8 + context * 8
        if stage == P - 1 and c == chunks - 1:
            total += n * 4 * (3 * d + 1 + common.VOCAB_SIZE) + n * 8
        out.append(total)
    return out


def kept_bytes(dims, context, shape, stage, mb, chunks=1, cuts=None) -> list:
    """zb1: bytes W keeps of one micro-batch from its B until its W, per chunk: each
    linear's input and output gradient, per block and token d (qkv's and ff_in's input,
    the norm's output) + d/T + f/T (proj's and ff_out's input) + 3d/T + d + f/T + d (the
    output gradients), and the head's d + V."""
    d, f, _, _ = dims
    P, T, n = shape["pp"], shape["tp"], mb * context
    ranges = pp_mod.LMStage(lm(dims, context, False, 0, "meta"), stage, P, chunks, cuts=cuts).ranges
    return [(hi - lo) * n * 4 * (4 * d + 4 * d // T + 2 * f // T)
            + (n * 4 * (d + common.VOCAB_SIZE) if stage == P - 1 and c == chunks - 1 else 0)
            for c, (lo, hi) in enumerate(ranges)]


def predicted_memory(dims, context, shape, stage, batch, levers=Levers()) -> dict:
    """Bytes per rank: parameters (tp slices, FSDP shards), gradients (as many), AdamW's two
    moments and a step count per tensor, and the activations the stage holds at its peak,
    by the schedule's order (09's held_peak: GPipe all m; 1F1B at most p - s; interleaved
    its warm-up's chunk-micro-batches; zb1 also what W keeps)."""
    F, C, m, chunks = shape["fsdp"], shape["cp"], levers.m(shape), levers.v
    layout = stage_layout(dims, context, shape, stage, dataclasses.replace(levers, tie=False, ep=1))
    numel = sum((-(-shp[0] // F) * math.prod(shp[1:]) if shp else 1) for _, shp, _ in layout)
    mb = batch // (shape["dp"] * F) // m
    order = pp_mod.SCHEDULES[levers.schedule](m, stage, shape["pp"], chunks)
    held = pp_mod.held_peak(order, activation_bytes(dims, context, shape, stage, mb, levers),
                            kept_bytes(dims, context // C, shape, stage, mb, chunks, levers.cuts))
    return {"params": 4 * numel, "grads": 4 * numel, "opt_state": 8 * numel + 4 * len(layout), "activations": held}


def measured_memory(model: ParallelLM, optimizer) -> dict:
    """Tensor bytes this rank holds after a step (each tensor's own elements), and the
    peak of activations the pipeline counted."""
    params = list(model.params.values())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(p.numel() * 4 for p in params),
            "grads": sum(p.grad.numel() * 4 for p in params if p.grad is not None),
            "opt_state": sum(v.numel() * v.element_size() for v in state),
            "activations": model.pipe.peak_activation_bytes}


@common.groups_freed()   # its mesh's groups, not kept for the cases after it
def account(ctx, args, shape, dims, batch, levers=Levers()):
    """One counted step of ``shape`` (after two to settle the buckets and the units' order):
    every rank's bytes per axis and memory, each beside its prediction."""
    mesh = Mesh(shape)
    whole = moe_lm(dims, args.context_length, levers.tie, args.seed, levers.experts, levers.top_k, ctx.device) \
        if levers.ep > 1 else lm(dims, args.context_length, levers.tie, args.seed, ctx.device)
    model = ParallelLM(mesh, whole, batch, levers, count_activations=True)
    opt = make_optimizer(model)
    routed = {"rows": 0, "forwards": 0}   # every MoE forward of the counted step: rows kept and received

    def tally(moe, inputs, output):
        routed["rows"] += moe.stats["kept"] + moe.stats["arrived"]
        routed["forwards"] += 1
    for step in range(3):
        x, y = common.lm_batch(batch, args.context_length, step, args.seed, ctx.device)
        model.pipe.peak_activation_bytes = 0
        hooks = [moe.register_forward_hook(tally) for moe in model.stage.modules()
                 if isinstance(moe, ep_mod.MoE)] if step == 2 else []
        with common.count_collectives() if step == 2 else contextlib.nullcontext() as counter:
            train_step(model, opt, model.part((x, y)), common.StepClock(ctx.device))
        for h in hooks:
            h.remove()
    row = {"coords": mesh.coords, "counted": counted_bytes(model, counter.log),
           "predicted": predicted_bytes(dims, args.context_length, shape, mesh.coords, batch, levers, routed),
           "memory": measured_memory(model, opt),
           "memory_predicted": predicted_memory(dims, args.context_length, shape, mesh.coord("pp"), batch, levers)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, row)
    return everyone


# ----------------------------------------------------------------------------------------
# Benchmark: ours beside torch's own composition, steps alternating
# ----------------------------------------------------------------------------------------
def torch_composition(ctx, shape, model, batch, levers=Levers()):
    """The same mesh with torch's classes: init_device_mesh; parallelize_module on the same
    four layers per block, the replicated modules' parameters Replicate DTensors (08's
    baseline); fully_shard per block and on each chunk over (dp, fsdp) (HSDP: replicate over
    dp, shard over fsdp); a PipelineStage per chunk and torch's matching schedule over pp
    (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble). Returns
    step(batch, clock) on the global batch (this rank takes its replica's part), clipping by
    the global norm as ours does; ``recompute`` (09's, on each stage's blocks before
    fully_shard) and ``dtype`` (bf16 autocast) as ours."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules
    P, D, F, C, T = (shape[a] for a in AXES)
    m, schedule, chunks, recompute, dtype = levers.m(shape), levers.schedule, levers.v, levers.recompute, levers.dtype
    if C > 1:
        raise ValueError("torch's composition here has no cp axis: its context_parallel runs on CUDA only")
    # Under tp without pp, the stage's logits come out as a view (the Replicate head's
    # local tensor); nothing writes into them in place (the loss reads them), so FSDP2's
    # warning about in-place ops on views does not apply.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    tmesh = init_device_mesh(ctx.device.type, tuple(shape.values()), mesh_dim_names=AXES)
    coords = {a: tmesh.get_local_rank(a) for a in AXES}
    if T > 1:
        tp_mod.torch_tensor_parallel_lm(model, tmesh["tp"])
    cuts = levers.cuts or pp_mod.LMStage(model, 0, P, chunks).cuts   # ours's split, a chunk each a stage of torch's
    mods = [pp_mod.LMStage(model, coords["pp"] + j * P, P * chunks, cuts=cuts) for j in range(chunks)]
    for mod in mods:
        pp_mod.recompute(mod.blocks.values(), recompute)
    if D * F > 1:
        for stage in mods:
            for block in stage.blocks.values():
                fully_shard(block, mesh=tmesh["dp", "fsdp"])
            fully_shard(stage, mesh=tmesh["dp", "fsdp"])
    stage = mods[0]
    params = [p for mod in mods for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)
    stages = [PipelineStage(mod, coords["pp"] + j * P, P * chunks, ctx.device, group=tmesh["pp"].get_group())
              for j, mod in enumerate(mods)]
    kind = {"1f1b": schedules.Schedule1F1B, "interleaved": schedules.ScheduleInterleaved1F1B,
            "zb1": schedules.ScheduleInterleavedZeroBubble}[schedule]
    sched = kind(stages if schedule != "1f1b" else stages[0], m, loss_fn=pp_mod.lm_loss) if P > 1 else None
    replica = coords["dp"] * F + coords["fsdp"]

    def step(global_batch, clock):
        x, y = (common.shard(t, replica, D * F).contiguous() for t in global_batch)
        opt.zero_grad(set_to_none=True)
        with clock.phase("pipeline"), common.autocast(x.device, dtype):
            if sched is None:
                pp_mod.lm_loss(stage(x), y).backward()
            else:
                sched.step(*([x] if coords["pp"] == 0 else []), **({"target": y} if coords["pp"] == P - 1 else {}))
        with clock.phase("comm"):
            pass                  # FSDP2 and the schedule have waited inside
        with clock.phase("optim"):
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if P > 1:             # the stages' squares summed
                sq = norm.pow(2)
                dist.all_reduce(sq, group=tmesh["pp"].get_group())
                norm = sq.sqrt()
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
            opt.step()
    return step


PEAK_TFLOPS = {"float32": (("H100", 67.0), ("H200", 67.0), ("A100", 19.5)),    # without TF32
               "bf16": (("H100", 989.0), ("H200", 989.0), ("A100", 312.0))}    # dense (no sparsity)


def peak_flops(device, given=None, dtype="float32"):
    """Peak FLOP/s of one device for MFU, from --peak-tflops, or for a known GPU in the
    precision of the run's matrix math (float32 without TF32, or bf16 autocast's dense
    peak; datasheet figures, SXM parts)."""
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS[dtype] if key in name), None)


def flops_per_token(dims, context) -> float:
    """Training FLOPs per token: 6 per weight of the matrix multiplies (blocks and head), and
    attention's 12 L t d (as nanoGPT and PaLM count them)."""
    d, f, n, _ = dims
    return 6 * (n * (4 * d * d + 2 * d * f) + d * common.VOCAB_SIZE) + 12 * n * context * d


def recorder_cost(ctx, args, shape, dims):
    """--recorder-cost: ours on the mesh with the flight recorder off, on, and checking."""
    levers = dataclasses.replace(levers_of(args), tie=False)
    batch = args.batch_size or 2 * levers.m(shape) * shape["dp"] * shape["fsdp"]

    def make():
        whole = moe_lm(dims, args.context_length, False, args.seed, args.experts, args.top_k, ctx.device) \
            if args.ep > 1 else lm(dims, args.context_length, False, args.seed, ctx.device)
        model = ParallelLM(Mesh(shape), whole, batch, levers)
        opt = make_optimizer(model)
        return lambda b, clock: train_step(model, opt, model.part(b), clock)
    return common.recorder_modes(ctx, argparse.Namespace(**{**vars(args), "batch_size": batch}), make,
                                 global_batch=True)


def measured_cuts(ctx, args, dims, shape, batch, levers) -> tuple:
    """09's split by measured time for this mesh's pipeline: the LM's pieces (embeddings, each
    block, head with the loss; the whole model, as one process holds it) timed on a
    micro-batch of this mesh (its replica's part, cut m ways; its cp part of each sequence),
    the same on every rank; the cuts of its pp x v chunks."""
    whole = lm(dims, args.context_length, False, args.seed, ctx.device)
    mb, tokens = batch // (shape["dp"] * shape["fsdp"]) // levers.m(shape), args.context_length // shape["cp"]
    costs = pp_mod.lm_costs(whole, (mb, tokens), args.seed)
    return tuple(pp_mod.LMStage(whole, 0, shape["pp"], levers.v, costs=costs).cuts)


def bubble_of_mesh(ctx, steps, shape, m, levers) -> dict:
    """The pipeline's bubble measured in these steps (09's bubble_measured, the mean of the stages)
    beside the schedule on paper with the steps' own actions and message time and with
    equal stages; the whole mesh's ranks gathered, one pipeline (the first replica's)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)
    P, v = shape["pp"], levers.v
    stride = dist.get_world_size() // P   # the mesh puts pp outermost: stage s's first rank is s x stride
    got = pp_mod.bubble_measured([[everyone[s * stride][i] for s in range(P)] for i in range(len(steps))],
                                 levers.schedule, m, P, v)
    return {"bubble": sum(got["bubble_per_stage"]) / P, "theory_split": sum(got["theory_split_per_stage"]) / P,
            "theory": sum(pp_mod.bubble_on_paper(levers.schedule, m, P, v)) / P, "cuts": list(levers.cuts or [])}


def torch_skip(shape, levers, ep, backend, device) -> str | None:
    """Why torch's composition is left out beside ours on this mesh (None: it runs)."""
    if shape["pp"] > 1 and not pp_mod.torch_pipelining_runs(backend, device):
        return "torch.distributed.pipelining's stages send CUDA tensors point to point, which gloo cannot carry"
    if shape["cp"] > 1:
        return "its context_parallel is not composed here (it runs only under NCCL with a GPU per rank: see 11)"
    if ep > 1:
        return "torch has no expert parallelism"
    if levers.sp:
        return ("its pipeline stages would pass sequence-parallel parts whose shapes torch.distributed.pipelining "
                "infers whole (its SequenceParallel is timed beside ours in 08)")
    return None


def benchmark(ctx, args, shapes, dims, trace=None):
    """For each mesh of ``shapes``: ours and torch's composition on the LM of ``dims``,
    steps alternating; then one counted step of ours (account). ``trace``: the mesh whose
    step to draw (its AxisTracer timeline). Returns (rows, accounting, timeline)."""
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # its advice on meshes
    rows, accounting, timeline = [], [], None
    peak = peak_flops(ctx.device, args.peak_tflops)
    levers = dataclasses.replace(levers_of(args), tie=False)   # the timed LM is untied
    for shape in shapes:
        m, name = levers.m(shape), label(shape, False, levers.schedule, levers.v) + lever_label(levers)
        batch = args.batch_size or 2 * m * shape["dp"] * shape["fsdp"]
        holder, steps = {}, []
        mesh_levers = dataclasses.replace(levers, cuts=measured_cuts(ctx, args, dims, shape, batch, levers)) \
            if shape["pp"] > 1 and getattr(args, "split", "measured") == "measured" else levers

        def ours():
            whole = moe_lm(dims, args.context_length, False, args.seed, args.experts, args.top_k, ctx.device) \
                if args.ep > 1 else lm(dims, args.context_length, False, args.seed, ctx.device)
            model = ParallelLM(Mesh(shape), whole, batch, mesh_levers, timed=shape["pp"] > 1)
            opt = make_optimizer(model)
            holder.update(model=model, opt=opt)

            def step(b, clock):   # (with pp: each step's record, for its bubble)
                train_step(model, opt, model.part(b), clock)
                if shape["pp"] > 1:
                    steps.append(pp_mod.step_record(model.pipe, clock))
            return step

        def theirs():
            return torch_composition(ctx, shape, lm(dims, args.context_length, False, args.seed, ctx.device), batch,
                                     mesh_levers)
        timing = argparse.Namespace(**{**vars(args), "batch_size": batch})   # this mesh's global batch
        methods = {f"{name} (ours)": ours}
        if torch_skip(shape, levers, args.ep, ctx.backend, ctx.device.type) is None:   # main says why not
            methods[f"{name} (torch)"] = theirs
        # with pp, the stages start each step together: the bubble is the schedule's, not the skew
        # a previous step (the other composition's, an optimizer's) leaves
        got = common.time_methods(ctx, timing, methods, global_batch=True, start_together=shape["pp"] > 1)
        tokens = batch * args.context_length
        for r in got:
            r.update(mesh=name, world_size=dist.get_world_size(), microbatches=m, batch=batch,
                     tokens_per_s_per_rank=tokens / (r["step_ms"] / 1e3) / dist.get_world_size())
            if peak:
                r["mfu"] = flops_per_token(dims, args.context_length) * tokens / (r["step_ms"] / 1e3) / \
                    dist.get_world_size() / peak
        if len(got) == 2:   # steps alternate: compare them pair by pair
            got[0].update(common.vs_paired(got[0], got[1]))
        if shape["pp"] > 1:
            got[0].update(bubble_of_mesh(ctx, steps[-args.steps:], shape, m, mesh_levers))
        rows += got
        if shape == trace:
            timeline = trace_step(ctx, args, holder["model"], holder["opt"], batch)
        holder.clear()
        if levers.dtype == "float32":   # the formulas count float32 bytes
            accounting.append({"mesh": name, "shape": shape, "batch": batch, "microbatches": m,
                               "ranks": account(ctx, args, shape, dims, batch, mesh_levers)})
    return rows, accounting, timeline


# ----------------------------------------------------------------------------------------
# A timeline of one step: what each rank computes, and which axis it waits for
# ----------------------------------------------------------------------------------------
class AxisTracer:
    """While active, every torch.distributed call this rank makes through the module's
    functions records when it waited and on which axis (its group's): a blocking call for
    its whole length, an asynchronous one from its wait() to the end."""

    WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "batch_isend_irecv", "broadcast")

    def __init__(self, axes_by_group, t0):
        self.axes, self.t0, self.spans, self.saved = axes_by_group, t0, [], {}

    def _axis(self, args, kwargs):
        group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        if group is None and args and isinstance(args[0], list) and args[0]:   # batch_isend_irecv's P2POps
            group = getattr(args[0][0], "group", None)
        return self.axes.get((group or dist.group.WORLD).group_name, "other")

    def _wrap(self, fn):
        tracer = self

        class Timed:
            def __init__(self, work, axis):
                self.work, self.axis = work, axis

            def wait(self, *a):
                start = time.perf_counter()
                out = self.work.wait(*a)
                tracer.spans.append((self.axis, start - tracer.t0, time.perf_counter() - tracer.t0))
                return out

            def __getattr__(self, name):
                return getattr(self.work, name)

        def call(*args, **kwargs):
            axis, start = self._axis(args, kwargs), time.perf_counter()
            out = fn(*args, **kwargs)
            if isinstance(out, list):
                return [Timed(w, axis) for w in out]
            if out is None or not kwargs.get("async_op"):
                self.spans.append((axis, start - self.t0, time.perf_counter() - self.t0))
                return out
            return Timed(out, axis)
        return call

    def __enter__(self):
        for name in self.WRAPPED:
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self.saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def trace_step(ctx, args, model, opt, batch):
    """One traced step of ``model``: every rank's computation (the pipeline's forward and
    backward actions) and its waits by axis, on a clock shared after a barrier."""
    axes = {model.mesh.group(a).group_name: a for a in AXES}
    if model.data_group is not None:
        axes[model.data_group.group_name] = "dp"
    axes[model.mesh.group().group_name] = "clip"
    if model.embed_group is not None:
        axes[model.embed_group.group_name] = "tie"
    model.pipe.timed, offset, run = True, [], model.pipe.step

    def step(*a, **k):   # the pipeline's action times count from its own start
        offset.append(time.perf_counter() - clock.t0)
        return run(*a, **k)
    model.pipe.step = step
    x, y = common.lm_batch(batch, args.context_length, 0, args.seed, ctx.device)
    dist.barrier()
    clock = common.StepClock(ctx.device)
    with AxisTracer(axes, clock.t0) as tracer:
        train_step(model, opt, model.part((x, y)), clock)
    lane = {"coords": model.mesh.coords, "actions": [(k, c, i, a + offset[0], b + offset[0])
                                                     for k, c, i, a, b in model.pipe.timeline],
            "waits": tracer.spans, "phases": clock.times}
    model.pipe.timed = False
    del model.pipe.step
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lane)
    return everyone


AXIS_COLORS = {"tp": "#c44e52", "cp": "#dd8452", "fsdp": "#8172b2", "dp": "#937860", "pp": "#55a868", "tie": "#da8bc3",
               "clip": "#8c8c8c", "other": "#cccccc"}


def draw_timeline(lanes, title, path):
    """Each rank's step: its micro-batches' F and B in the upper half of its lane, the waits
    on each axis in the lower half."""
    actions = {"F": "#a1c9f4", "B": "#ffb482"}
    common.draw_lanes(path, title, [(f"rank {r} " + " ".join(f"{a}{c}" for a, c in lane["coords"].items()), [
        *({"start": start * 1e3, "end": end * 1e3, "color": actions.get(kind, "#8de5a1"), "part": "upper",
           "text": f"{kind}{c}.{i}" if c else f"{kind}{i}"} for kind, c, i, start, end in lane["actions"]),
        *({"start": start * 1e3, "end": end * 1e3, "min_width": 0.02, "part": "lower",
           "color": AXIS_COLORS.get(axis, "#cccccc")} for axis, start, end in lane["waits"])])
        for r, lane in enumerate(lanes)],
        "ms into the step: upper half forward (F) and backward (B) of each micro-batch; lower half, the rank "
        "waits on an axis", {"forward": actions["F"], "backward": actions["B"],
                             **{f"waits: {a}": c for a, c in AXIS_COLORS.items() if a != "other"}},
        width=11.0, row=0.5)


# ----------------------------------------------------------------------------------------
# --plan: which mesh for a model on many devices (no workers: arithmetic)
# ----------------------------------------------------------------------------------------
XXL = (16384, 53248, 126)   # the accounting problem's model: d_model, d_ff, blocks of two linears
# Device figures: the course's TPU v5p (95 GB, C = 4.6e14 FLOP/s bf16, W_ici = 2 x 9e10 bytes/s,
# the FSDP axis on 2 links, TP on 1), and an H100 SXM by its datasheet (80 GB, 989e12 FLOP/s
# dense bf16, NVLink 450e9 bytes/s each way).
HARDWARE = {"v5p": {"memory_gb": 95.0, "flops": 4.6e14, "link": 2 * 9e10, "m_fsdp": 2, "m_tp": 1},
            "h100": {"memory_gb": 80.0, "flops": 989e12, "link": 450e9, "m_fsdp": 1, "m_tp": 1}}


def plan_model(size, experts=1, top_k=1):
    """(d_model, d_ff, blocks, weights, weights a token uses) of --model-size: xxl is the
    course's blocks of two linears; the kit's LM counts the four linears of a block
    (embeddings and attention's own math left out, as the course's accounting does). With
    ``experts`` > 1 every block's MLP is a MoE of that many experts of the MLP's size, of
    which a token uses ``top_k``."""
    if size == "xxl":
        d, f, n = XXL
        return d, f, n, n * 2 * d * f * experts, n * 2 * d * f * top_k if experts > 1 else n * 2 * d * f
    d, f, n, _ = common.MODEL_SIZES[size]
    mlp = 2 * d * f
    return d, f, n, n * (4 * d * d + mlp * experts), n * (4 * d * d + mlp * (top_k if experts > 1 else 1))


def act_per_token(d, f, T, sp=False, recompute="none") -> float:
    """bf16 bytes a block keeps per token in the course's model (the inputs of its two
    linears, d and f/T): SP splits the d over tp too; full recomputation keeps the block's
    input only (d, d/T under SP); selective recomputes attention's core, which the model
    leaves out, so it changes nothing here."""
    if recompute == "full":
        return 2 * d / (T if sp else 1)
    return 2 * ((d / T if sp else d) + f / T)


def mesh_costs(hw, model, shape, tokens, act_fraction=1.0, levers=Levers()) -> dict:
    """Per device, one step of ``tokens`` tokens over the mesh, in the course's (the Scaling
    Book's) model: bf16 weights, activations and communication; fp32 master weights,
    gradients and AdamW state (16 bytes a weight) sharded over fsdp, tp and pp; every
    collective moves its array once over its links at link x multiplicity; communication
    overlaps compute; the pipeline runs 4p micro-batches with ``schedule`` (interleaved: v
    chunks a stage, v times the activations crossing stages). A MoE (``active``: the weights
    a token uses, ``top_k``): compute on the active weights, state and weight traffic on all
    of them, and its experts' all-to-alls, k d values a token each way, twice. ``model``:
    plan_model's (d, f, n, weights, active); ``levers``: schedule, chunks, sp, recompute and,
    for a MoE (active below weights), top_k. Seconds and bytes."""
    d, f, n, weights, active = model
    schedule, chunks, sp, recompute = levers.schedule, levers.v, levers.sp, levers.recompute
    top_k = levers.top_k if active != weights else 0
    P, D, F, _, T = (shape[a] for a in AXES)
    b = tokens / (D * F)                                   # tokens one data replica (fsdp shard) sees
    C, W = hw["flops"], hw["link"]
    out = {"compute_s": 6 * (active or weights) / (T * P) * b / C,
           "ep_s": 2 * 2 * 2 * b * top_k * d * n / P / W if top_k else 0.0,
           "fsdp_s": 3 * 2 * weights / (T * P) / (W * hw["m_fsdp"]) if F > 1 else 0.0,   # gather x2, reduce-scatter
           "tp_s": 2 * 2 * 2 * b * d * n / P / (W * hw["m_tp"]) if T > 1 else 0.0,      # 2 fwd + 2 bwd of b d bf16
           "dp_s": 2 * 2 * weights / (F * T * P) / W if D > 1 else 0.0,                  # all-reduce of bf16 grads
           "pp_s": 2 * 2 * b * d * chunks / W if P > 1 else 0.0,                         # activations out, grads back
           "state_gb": 16 * weights / (F * T * P) / 1e9,
           "activations_gb": act_fraction * b * (n / P) * act_per_token(d, f, T, sp, recompute) / 1e9,
           "bubble": pp_mod.bubble_formula(schedule, 4 * P, P, chunks)}
    out["memory_gb"] = out["state_gb"] + out["activations_gb"]
    # full recomputation runs the forward again in backward: 2 more FLOPs a weight a token, time
    # the step pays but that hides no communication of its own accord (the bound counts 6)
    out["recompute_s"] = out["compute_s"] / 3 if recompute == "full" else 0.0
    out["step_s"] = max((out["compute_s"] + out["recompute_s"]) / (1 - out["bubble"]), out["fsdp_s"], out["tp_s"], out["dp_s"], out["pp_s"],
                        out["ep_s"])
    return out


def compute_bound_tokens(hw, model, shape, levers=Levers()) -> float:
    """The fewest tokens per step at which compute is at least every axis's communication
    (inf if an axis's traffic grows with the batch faster than its compute: tp, when
    d_ff / tp < alpha / M_tp)."""
    one, two = (mesh_costs(hw, model, shape, t, levers=levers) for t in (1.0, 2.0))
    need = 0.0
    for axis in ("fsdp_s", "tp_s", "dp_s", "pp_s", "ep_s"):
        slope, fixed = two[axis] - one[axis], 2 * one[axis] - two[axis]
        per_token = one["compute_s"] - slope
        if one[axis] == 0:
            continue
        if per_token <= 0:
            return math.inf
        need = max(need, fixed / per_token)
    return need


def plan(args) -> dict:
    """Every mesh of --devices with its memory, compute-bound batch and step time; the pick;
    and the course's accounting answers (a)-(c) for the model."""
    hw = dict(HARDWARE[args.hardware])
    if args.device_memory:
        hw["memory_gb"] = args.device_memory
    experts, top_k = getattr(args, "experts", 1) or 1, getattr(args, "top_k", 1)
    model = plan_model(args.model_size, experts, top_k)
    d, f, n, weights, active = model
    shapes = []
    for pp_, tp_ in itertools.product(range(1, args.devices + 1), repeat=2):
        if args.devices % (pp_ * tp_) or n % pp_ or f % tp_:
            continue
        rest = args.devices // (pp_ * tp_)
        shapes += [mesh_of(pp=pp_, dp=rest // k, fsdp=k, tp=tp_) for k in range(1, rest + 1) if rest % k == 0]
    levers = Levers(schedule=getattr(args, "schedule", "1f1b"), chunks=getattr(args, "chunks", 1),
                    sp=getattr(args, "sp", False), recompute=getattr(args, "recompute", "none"), top_k=top_k)
    shapes = [s for s in shapes if s["pp"] * levers.v <= n]   # interleaved: a chunk holds at least a block
    bounds = {label(s): compute_bound_tokens(hw, model, s, levers) for s in shapes}
    finite = [t for t in bounds.values() if t < math.inf]
    meshes = []
    for shape in shapes:   # each at its compute-bound batch; one that never is, at the largest other one
        tokens = bounds[label(shape)]
        cost = mesh_costs(hw, model, shape, tokens if tokens < math.inf else max(finite, default=0.0), levers=levers)
        meshes.append({"mesh": label(shape) or "one device", **shape, "bound_tokens": tokens,
                       "bound_tokens_per_device": tokens / args.devices, "fits": cost["memory_gb"] <= hw["memory_gb"],
                       **cost})
    fitting = [r for r in meshes if r["fits"] and r["bound_tokens"] < math.inf]
    pick = min(fitting, key=lambda r: (r["bound_tokens"], r["memory_gb"]), default=None)
    # the course's questions, for its mesh: X = --fsdp (16), Y = --tp (4)
    X, Y = args.fsdp or 16, args.tp or 4
    state, act_token = 16 * weights, n * 2 * (d + f)
    alpha = hw["flops"] / hw["link"]
    answers = {"weights": weights, "state_gb": state / 1e9, "h100s_for_state": state / 80e9,
               "activation_bytes_per_token": act_token,
               "n_fsdp": {t: math.ceil((state + t * act_token / 2) / (hw["memory_gb"] * 1e9 - t * act_token / 2))
                          for t in args.act_tokens},
               "alpha": alpha, "X": X, "Y": Y, "fsdp_tokens_per_shard": alpha / hw["m_fsdp"],
               "tokens_per_device": alpha / hw["m_fsdp"] / Y, "overall_tokens": alpha / hw["m_fsdp"] * X,
               "tp_ratio": f / Y, "tp_bound": alpha / hw["m_tp"], "tp_met": f / Y >= alpha / hw["m_tp"]}
    if pick:   # one sequence of --context-length tokens on the pick: its activations, and the cp that fits them
        L = getattr(args, "context_length", None) or 0
        per_token = n / pick["pp"] * act_per_token(d, f, pick["tp"], levers.sp, levers.recompute)   # this device's blocks
        free = hw["memory_gb"] - pick["state_gb"]
        answers.update(context=L, sequence_gb=L * per_token / 1e9,
                       cp_needed=max(1, math.ceil(L * per_token / 1e9 / free)) if free > 0 else math.inf)
    return {"hardware": hw, "model": {"d_model": d, "d_ff": f, "blocks": n, "weights": weights, "active": active,
                                      "experts": experts, "top_k": top_k},
            "meshes": meshes, "pick": pick, "answers": answers}


# ----------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------
def accounting_rows(accounting) -> tuple:
    """Bytes per axis and memory, by mesh and pipeline stage (the ranks of a stage agree:
    checked), each counted beside its prediction."""
    traffic, memory = [], []
    for job in accounting:
        for stage in range(job["shape"]["pp"]):
            ranks = [r for r in job["ranks"] if r["coords"]["pp"] == stage]
            first = ranks[0]
            for axis in sorted(set(first["counted"]) | set(first["predicted"]), key=list(AXES + ("ep", "ep copies", "tie", "clip")).index):
                counted, predicted = first["counted"].get(axis, 0.0), first["predicted"].get(axis, 0.0)
                traffic.append({"mesh": job["mesh"], "stage": stage, "axis": axis, "counted_MB": counted / 1e6,
                                "predicted_MB": predicted / 1e6, "equal": abs(counted - predicted) <= 1e-6 * max(1, predicted),
                                "ranks_agree": all(r["counted"].get(axis, 0.0) == counted for r in ranks)})
            row = {"mesh": job["mesh"], "stage": stage}
            for k, v in first["memory"].items():
                row[f"{k}_MB"], row[f"{k}_predicted_MB"] = v / 2**20, first["memory_predicted"][k] / 2**20
            row["activations_ratio"] = first["memory"]["activations"] / first["memory_predicted"]["activations"]
            memory.append(row)
    return traffic, memory


TIME_HEADERS = ["method", "world_size", "microbatches", "batch", "step_ms", "step_min_ms", "step_max_ms", "vs_torch",
                "vs_torch_min", "vs_torch_max", "tokens_per_s_per_rank", "mfu", "collectives", "comm_MB", "bubble",
                "theory_split", "theory", "cuts"]
TRAFFIC_HEADERS = ["mesh", "stage", "axis", "counted_MB", "predicted_MB", "equal", "ranks_agree"]
MEMORY_HEADERS = ["mesh", "stage", "params_MB", "params_predicted_MB", "grads_MB", "grads_predicted_MB", "opt_state_MB",
                  "opt_state_predicted_MB", "activations_MB", "activations_predicted_MB", "activations_ratio"]
NAME, TITLE = "10_nd_parallel", "N-D parallelism: ours against torch's composition, steps alternating"


def report(args, rows, accounting, dims, partial=""):
    """Save the three tables; print them unless ``partial`` (saved after each benchmark job,
    marked so until the last: a run cut short keeps its rows, and the tables print once)."""
    settings = {**common.lm_settings(args), "world_size": sorted({r["world_size"] for r in rows}),
                "model_dims": dims, "schedule": args.schedule, "chunks": chunks_of(args.schedule, args.chunks)}
    table = common.save_results(args.out, NAME, rows, settings, headers=TIME_HEADERS, title=TITLE, note=partial.strip())
    traffic, memory = accounting_rows(accounting)
    t2 = common.save_results(args.out, "10_accounting", traffic, settings, headers=TRAFFIC_HEADERS,
                             title="Bytes each axis sends per step and rank, counted beside the formula",
                             note=predicted_bytes.__doc__.split("\n\n")[0].replace("\n    ", " ") + partial)
    t3 = common.save_results(args.out, "10_memory", memory, settings, headers=MEMORY_HEADERS,
                             title="Memory per rank after a step (MiB), counted beside the formula",
                             note=predicted_memory.__doc__.replace("\n    ", " ") + partial)
    if partial:
        return
    print(f"\n{TITLE}\n({args.model_size} LM, {args.backend}/{args.device}, context {args.context_length}; step times "
          f"in ms, median [min, max] of {args.steps} steps; vs_torch: median of paired steps [min, max]; with pp, "
          f"split by {args.split}, torch's on the same cuts: bubble, its idle share (09's), beside theory_split, "
          f"the schedule on paper with the steps' own actions and message time, and theory, equal stages)\n"
          f"{table}\n\n"
          f"Bytes each axis sends per step, per rank of each pipeline stage (MB)\n{t2}\n\n"
          f"Memory per rank (MiB): counted, and predicted\n{t3}\n"
          f"{common.wrote(args.out, f'{NAME}.*, 10_accounting.*, 10_memory.*')}", flush=True)


def report_plan(args):
    """--plan: every mesh of the devices, the pick, and the accounting answers (a)-(c)."""
    if args.model_size not in common.MODEL_SIZES and args.model_size != "xxl":
        raise common.UsageError(f"unknown --model-size {args.model_size!r}: choose xxl or one of "
                                f"{', '.join(common.MODEL_SIZES)}")
    common.check_out(args.out)
    out = plan(args)
    hw, a, pick = out["hardware"], out["answers"], out["pick"]
    rows = sorted(out["meshes"], key=lambda r: (not r["fits"], r["bound_tokens"], r["memory_gb"]))
    headers = ["mesh", "fits", "memory_gb", "state_gb", "activations_gb", "bound_tokens", "bound_tokens_per_device",
               "compute_s", "fsdp_s", "tp_s", "dp_s", "pp_s", "bubble", "step_s"]
    lines = [f"(a) {a['weights']:.4g} weights: fp32 master weights, gradients and AdamW's two moments take 16 bytes "
             f"each, {a['state_gb']:,.1f} GB = {a['h100s_for_state']:.1f} H100s of 80 GB before any activation; "
             f"the activations saved for backward (bf16 inputs of both linears) take "
             f"{a['activation_bytes_per_token'] / 1e6:.2f} MB per token",
             *[f"(b) state and half of the activations of {t} tokens sharded, the other half kept: "
               f"{a['state_gb']:,.1f}/N + {t * a['activation_bytes_per_token'] / 2e9:,.1f}/N + "
               f"{t * a['activation_bytes_per_token'] / 2e9:,.1f} GB <= {hw['memory_gb']:g} GB -> N_FSDP >= {n}"
               for t, n in a["n_fsdp"].items()],
             f"(c) alpha = C / W_ici = {a['alpha']:.1f}; FSDP (X = {a['X']}) compute-bound when B/X >= alpha/M_X = "
             f"{a['fsdp_tokens_per_shard']:.1f} tokens per FSDP shard, so per device B/(X*Y) >= "
             f"{a['tokens_per_device']:.1f} and overall B >= {a['overall_tokens']:,.0f} tokens; TP (Y = {a['Y']}) "
             f"when d_ff/Y = {a['tp_ratio']:g} >= alpha/M_Y = {a['tp_bound']:.1f}: "
             f"{'met' if a['tp_met'] else 'not met'}"]
    if pick:
        lines.append(f"pick: {pick['mesh']}, compute-bound from {pick['bound_tokens']:,.0f} tokens a step "
                     f"({pick['bound_tokens_per_device']:,.1f} per device), {pick['memory_gb']:.1f} GB per device, "
                     f"{pick['step_s']:.3f} s a step")
        lines.append(f"long context: one sequence of {a['context']:,} tokens (--context-length) holds "
                     f"{a['sequence_gb']:,.1f} GB of activations on a device of the pick, beside "
                     f"{hw['memory_gb'] - pick['state_gb']:,.1f} GB left after its state: "
                     + ("it fits without cp" if a["cp_needed"] == 1 else
                        f"it needs cp >= {a['cp_needed']} (each of the cp devices holds 1/cp of the sequence)"
                        if a["cp_needed"] < math.inf else "no cp fits: the state alone fills the device"))
    sp, recompute = getattr(args, "sp", False), getattr(args, "recompute", "none")
    if sp or recompute != "none":
        lines.append("memory levers: " + ", ".join(
            (["--sp: the blocks' activations split over tp (d/tp + d_ff/tp a token)"] if sp else []) +
            (["--recompute full: a block keeps its input only, its forward run again (compute x 8/6)"]
             if recompute == "full" else []) +
            (["--recompute selective: attention's core, which this model of the activations leaves out: no change"]
             if recompute == "selective" else [])))
    note = "\n".join(lines)
    table = common.save_results(args.out, "10_plan", rows[:args.plan_rows], {
        "model_size": args.model_size, **out["model"], "devices": args.devices, "hardware": args.hardware, **hw,
        "sp": sp, "recompute": recompute},
        headers=headers, title=f"Meshes for {args.model_size} on {args.devices} x {args.hardware}", note=note,
        extra={"answers": a, "pick": pick, "all_meshes": rows})
    print(f"Meshes for {args.model_size} on {args.devices} {args.hardware} devices ({hw['memory_gb']:g} GB, "
          f"{hw['flops']:.3g} FLOP/s, links {hw['link']:.3g} B/s; bound_tokens: the fewest tokens a step at which "
          f"compute covers every axis's communication)\n{table}\n\n{note}\n{common.wrote(args.out, '10_plan.json and .md')}")
    return out


# ----------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------
def check_mesh(shape, dims, batch, levers, context=None, verified=True, timed=True):
    """Bad input for one mesh, as the command runs it: ``verified`` (on the verification
    LM) and ``timed`` (on the LM of ``dims``): one line (UsageError). A pipeline's stages
    need not divide the blocks (09 balances them)."""
    T, P = shape["tp"], shape["pp"]
    m, schedule, chunks, cp_method, sp = levers.m(shape), levers.schedule, levers.v, levers.cp_method, levers.sp
    if schedule != "1f1b" and P < 2:
        raise common.UsageError(f"--schedule {schedule} is a pipeline schedule: it needs --pp 2 or more")
    if schedule == "zb1" and shape["fsdp"] > 1:
        raise common.UsageError("--schedule zb1 defers the weights' gradients past FSDP's reduce-scatters: use it "
                                "without --fsdp, or --schedule 1f1b or interleaved")
    C = shape["cp"]
    models = ([("the verification LM's", VERIFY_LM, VERIFY_T)] if verified else []) + \
        ([("the model's", dims, context)] if timed else [])
    for whose, (_, f, n, h), t in models:
        if h % T or f % T:
            raise common.UsageError(f"--tp {T} does not divide {whose} {h} heads and d_ff {f}: choose --tp (or "
                                    f"--model-size) so that it does")
        fix = ("use --cp 2, 4 or 8 (or --no-verify, the benchmark alone)" if whose == "the verification LM's"
               else f"use a --context-length that is a multiple of {2 * C}")
        if C > 1 and t is not None and t % (2 * C):
            raise common.UsageError(f"--cp {C} cuts each sequence into {2 * C} chunks (11's zig-zag): {whose} "
                                    f"{t} tokens do not; {fix}")
        if sp and t is not None and t % (C * T):
            fix = ("choose --cp x --tp dividing 16 (or --no-verify, the benchmark alone)" if whose ==
                   "the verification LM's" else f"use a --context-length that is a multiple of {C * T}")
            raise common.UsageError(f"--sp gives each of the {C * T} cp x tp ranks its part of a sequence: {whose} "
                                    f"{t} tokens do not divide; {fix}")
        if C > 1 and cp_method == "ulysses" and (h // T) % C:
            raise common.UsageError(f"--cp-method ulysses splits {whose} {h // T} heads per tp rank over --cp {C}: "
                                    f"it must divide them")
        if P * chunks > n:
            what = f"--pp {P} x --chunks {chunks} is more chunks" if chunks > 1 else f"--pp {P} is more stages"
            raise common.UsageError(f"{what} than {whose} {n} blocks: use fewer" +
                                    (", or a --model-size with more blocks" if whose == "the model's" else ""))
    if schedule == "interleaved" and m % P:
        raise common.UsageError(f"--schedule interleaved needs micro-batches in groups of the {P} stages: "
                                f"--microbatches {m} is not a multiple of {P}")
    replicas = shape["dp"] * shape["fsdp"]
    if timed and batch is not None and (batch < 1 or batch % (replicas * m)):
        raise common.UsageError(f"--batch-size {batch} does not split into {replicas} replicas x {m} micro-batches: "
                                f"use a multiple of {replicas * m}")


def parser():
    """10's flags: the mesh's axes, the levers, --plan's, --train's, and the other modes."""
    p = common.script_parser(__doc__, cpu_size="micro", world="the mesh's ranks (the product of the axes); the suite: "
                                                            "4, 6 and 8", batch="on GPU: 4, on CPU: 2, a multiple of "
                                                            "the data ranks x the micro-batches")
    for axis, what in (("dp", "data-parallel replicas"), ("fsdp", "FSDP shards"), ("tp", "tensor-parallel ranks"),
                       ("pp", "pipeline stages"), ("cp", "context-parallel ranks (each sequence split over them)")):
        p.add_argument(f"--{axis}", type=common.COUNT, default=None,
                       help=f"{what} (default: 1; no axis given: the suite)")
    p.add_argument("--tie", action="store_true", help="the output head shares the token embedding's weight")
    p.add_argument("--microbatches", type=common.COUNT, default=None,
                   help="per step (default: 2 x pp, 1 without pipeline)")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b", help="the pipeline's schedule (09's)")
    p.add_argument("--chunks", type=common.COUNT, default=2, help="--schedule interleaved: chunks of blocks per stage")
    p.add_argument("--cp-method", choices=list(cp_mod.METHODS), default="ring", help="--cp: 11's attention")
    p.add_argument("--ep", type=common.COUNT, default=1, help="12's experts split over this many data ranks "
                                                             "(dp x fsdp; a MoE in every block)")
    p.add_argument("--experts", type=common.COUNT, default=None,
                   help=f"--ep: experts per MoE (default: {MOE_EXPERTS}); --plan: a MoE of that many experts in every "
                        f"block's place of its MLP (default: dense)")
    p.add_argument("--top-k", type=common.COUNT, default=MOE_TOP_K, help="--ep, --plan: experts per token")
    p.add_argument("--sp", action="store_true", help="08's sequence parallelism over --tp (with a mesh; --plan too)")
    p.add_argument("--recompute", choices=pp_mod.RECOMPUTE, default="none",
                   help="09's activation recomputation of the blocks (with a mesh; --plan too)")
    common.add_dtype_flag(p)
    p.add_argument("--peak-tflops", type=common.number(float, above=0), default=None,
                   help="a device's peak, for MFU (default: known GPUs)")
    p.add_argument("--plan", action="store_true", help="list the meshes for --model-size on --devices; no workers")
    p.add_argument("--devices", type=common.COUNT, default=64, help="--plan: how many devices")
    p.add_argument("--hardware", choices=list(HARDWARE), default="v5p", help="--plan: the device's figures")
    p.add_argument("--device-memory", type=common.number(float, above=0), default=None,
                   help="--plan: GB per device (default: the hardware's)")
    p.add_argument("--act-tokens", nargs="+", type=common.COUNT0, default=[0, 4096],
                   help="--plan, question (b): tokens of activations per device")
    p.add_argument("--plan-rows", type=common.COUNT, default=20, help="--plan: rows of the table (all go to the JSON)")
    p.add_argument("--split", choices=["measured", "flops"], default="measured",
                   help="where a pipeline's stages end in the benchmark: by the LM's pieces timed on the device (09's "
                        "measured split) or by FLOPs (the verification's)")
    p.add_argument("--recorder-cost", action="store_true",
                   help="instead of the verification and benchmark: ours on the mesh (pp 2 x dp 2 without one) with "
                        "the flight recorder off, on, and on with --check-collectives, steps alternating")
    p.set_defaults(context_length=32)
    return p


def check_moe_flags(args):
    """--experts (its default), --top-k and --ep: the experts a MoE holds and how they split."""
    args.experts = args.experts if args.experts is not None else (1 if args.plan else MOE_EXPERTS)
    if args.experts > 1 and args.top_k > args.experts:
        raise common.UsageError(f"--top-k {args.top_k} must be at most --experts {args.experts}")
    if args.experts % args.ep:
        raise common.UsageError(f"--ep {args.ep} does not divide --experts {args.experts}: each of its ranks holds "
                                f"experts/ep; use a multiple of {args.ep}")
    return args


def mesh_args(p, first, argv):
    """The flags parsed for the mesh the axes give (single) or the suite: (args, shape,
    single). --recorder-cost without a mesh takes pp 2 x dp 2."""
    if first.recorder_cost and not any(getattr(first, a) is not None for a in AXES):
        first.pp = first.dp = 2
        argv = [*(argv if argv is not None else sys.argv[1:]), "--pp", "2", "--dp", "2"]
    single = any(getattr(first, a) is not None for a in AXES)
    shape = mesh_of(**{a: getattr(first, a) if getattr(first, a) is not None else 1 for a in AXES})
    if first.world_size is not None and not common.under_torchrun():
        if not single:
            raise common.UsageError(f"--world-size {first.world_size} without a mesh: the suite runs meshes of 4, 6 "
                                    f"and 8 ranks; give a mesh (--dp, --fsdp, --tp, --pp) instead")
        if first.world_size != math.prod(shape.values()):
            raise common.UsageError(f"--world-size {first.world_size} but the mesh {label(shape)} holds "
                                    f"{math.prod(shape.values())} ranks: leave --world-size out or match it")
    args = common.parse(p, argv, world=lambda a: math.prod(shape.values()) if single else max(SUITE),
                        batch_unit=lambda a: None, world_flag=f"the mesh {label(shape)}" if single else "the suite")
    args.experts = first.experts
    if common.under_torchrun() and not single:
        raise common.UsageError("under torchrun give the mesh (--dp, --fsdp, --tp, --pp): the suite needs several "
                                "world sizes")
    if single and math.prod(shape.values()) != args.world_size:
        raise common.UsageError(f"the mesh {label(shape)} holds {math.prod(shape.values())} ranks but the world has "
                                f"{args.world_size}")
    return args, shape, single


def check_run(args, shape, single):
    """Every check of the run's meshes before any worker starts (experts, schedule, levers,
    each mesh's shapes): the levers, and the meshes timed."""
    if args.ep > 1:
        replicas = shape["dp"] * shape["fsdp"]
        if not single:
            raise common.UsageError(f"--ep {args.ep} takes its ranks from a mesh's data ranks (dp x fsdp): give a mesh")
        if shape["cp"] > 1:
            raise common.UsageError("--ep with --cp: the experts' all-to-all is not composed with context "
                                    "parallelism here; leave one of them out")
        if replicas % args.ep:
            raise common.UsageError(f"--ep {args.ep} takes its ranks from the mesh's data ranks (dp x fsdp), "
                                    f"{replicas} here, which it must divide: use --ep "
                                    f"{' or '.join(str(e) for e in range(2, replicas + 1) if replicas % e == 0) or 1}"
                                    f" or more data ranks")
    if not single and args.schedule != "1f1b":
        raise common.UsageError(f"--schedule {args.schedule} without a mesh: the suite verifies its own schedules; "
                                f"give a mesh (--pp 2 or more) to time this one")
    levers = levers_of(args)
    if lever_label(levers) and not single:
        raise common.UsageError("--sp, --recompute and --dtype bf16 apply to one mesh: give one (--tp 2, say)")
    if lever_label(levers) and args.ep > 1:
        raise common.UsageError("--sp, --recompute and --dtype bf16 are not verified with --ep: leave them out")
    why = refusal(shape, args.schedule, args.sp, args.recompute, args.ep)
    if why:
        raise common.UsageError(why)
    dims = common.MODEL_SIZES[args.model_size]
    timed = [shape] if single else [s for w in (4, 8) for s, tie, sched in SUITE[w] if not tie and sched == "1f1b"]
    cases = [(shape, args.tie, args.schedule)] if single else [c for cases in SUITE.values() for c in cases]
    for s, _, sched in cases:
        check_mesh(s, dims, args.batch_size, dataclasses.replace(levers, schedule=sched,
                                                                  chunks=args.chunks if single else SUITE_CHUNKS),
                   args.context_length, not args.no_verify, not args.no_bench and s in timed and (single or sched == "1f1b"))
    return levers, timed


def run_verification(args, shape, single, levers):
    """The mesh (or the suite's meshes at 8, 4 and 6 ranks, a checkpoint saved at 8 and
    resumed at 4) against one process; raises naming a failed case."""
    if single and args.ep > 1:
        jobs = [(args.world_size, [], ("ep", args.ep, shape, args.tie))]
    elif single:
        jobs = [(args.world_size, [(shape, args.tie, args.schedule)], None)]
    else:
        folder = tempfile.mkdtemp(prefix="nd_checkpoint_")
        path = os.path.join(folder, "checkpoint.pt")
        jobs = [(8, SUITE[8], (path, "save")), (4, SUITE[4], (path, "resume")), (6, SUITE[6], None)]
    try:
        for world, cases, resume in jobs:
            common.check_verification(common.launch(verify, args, cases, resume,
                                                    dataclasses.asdict(levers) if single else {"chunks": SUITE_CHUNKS},
                                                    world_size=world),
                                      f"{NAME} at {world} ranks")
    finally:
        if not single:
            shutil.rmtree(folder, ignore_errors=True)


def run_benchmark(args, shape, single, timed):
    """The timed meshes beside torch's composition, one job per world size (the tables
    saved after each, printed after the last)."""
    dims = common.MODEL_SIZES[args.model_size]
    trace = mesh_of(pp=2, dp=2, tp=2) if not single else (shape if sum(k > 1 for k in shape.values()) >= 2 else None)
    bench = [(args.world_size, [shape])] if single else [(w, [s for s in timed if math.prod(s.values()) == w])
                                                          for w in (4, 8)]
    rows, accounting = [], []
    for i, (world, group) in enumerate(bench):
        got, acc, lanes = common.launch(benchmark, args, group, dims, trace, world_size=world)
        for s in group:
            reason = torch_skip(s, dataclasses.replace(levers_of(args), tie=False), args.ep, args.backend, args.device)
            if reason and common.is_reporter():
                print(f"benchmark: SKIP torch's composition on {label(s)}: {reason}")
        rows, accounting = rows + got, accounting + acc
        if common.is_reporter():
            report(args, rows, accounting, dims, common.partial_note(i + 1, len(bench), "benchmark jobs"))
            if lanes:
                path = f"{args.out}/10_timeline.png"
                draw_timeline(lanes, f"One step of {label(trace)} ({args.model_size} LM, {args.backend}/{args.device})",
                              path)
                print(common.wrote(path))


# flags 10 once had, and where they went: a command written for them is told so
MOVED = {"--train": "a training run with sharded checkpoints and resume is 13_train.py's (a model folder and a text: "
                    "python 13_train.py --pp 2 --dp 2 --steps 40 --checkpoint-every 10)",
         "--setup-memory": "it is 13_train.py --setup-memory", "--hf-checkpoint": "it is 13_train.py --hf-checkpoint"}
MOVED.update({f: MOVED["--train"] + " (its checkpoints go to --run-dir)"
              for f in ("--checkpoint-every", "--checkpoint-dir", "--checkpoint-async")})


def main(argv=None):
    moved = [f for f in (sys.argv[1:] if argv is None else argv) if f.split("=")[0] in MOVED]
    if moved:
        flag = moved[0].split("=")[0]
        raise common.UsageError(f"{flag} moved out of 10_nd_parallel.py: {MOVED[flag]}")
    p = parser()
    first = p.parse_args(argv)
    check_moe_flags(first)
    if first.plan:
        first.model_size = first.model_size or "xxl"
        return report_plan(first)
    args, shape, single = mesh_args(p, first, argv)
    levers, timed = check_run(args, shape, single)
    if args.recorder_cost:
        args.batch_size = args.batch_size or 2 * levers.m(shape) * shape["dp"] * shape["fsdp"]
        rows = common.launch(recorder_cost, args, shape, common.MODEL_SIZES[args.model_size])
        return common.report_table(args, "10_recorder_cost", f"The flight recorder's cost on {label(shape)} (ours)",
                                   rows, common.RECORDER_HEADERS, common.RECORDER_NOTE)
    if not args.no_verify:
        run_verification(args, shape, single, levers)
    if args.no_bench:
        return
    run_benchmark(args, shape, single, timed)
    if not single and common.is_reporter():
        print()
        report_plan(p.parse_args(["--plan", "--model-size", "xxl", "--out", args.out]))


if __name__ == "__main__":
    common.run_main(main)
