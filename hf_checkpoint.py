"""Hugging Face checkpoint folders in and out, on any composition of the kit's axes.
``load_hf_checkpoint`` fills a model (built with placement.meta_parameters, the axes
applied) from a folder save_pretrained wrote (model.safetensors, or shards listed in
model.safetensors.index.json), each rank reading only the slices of each tensor it holds
(safetensors reads a slice without the rest of the tensor). ``save_hf_checkpoint`` writes
such a folder (safetensors files with their index, the config beside them) that
from_pretrained loads: each tensor is gathered whole on the ranks of its shard groups, one
tensor at a time, and written by one of them, the writers taking turns, so no rank holds
the whole model; a folder is published complete or not at all. Names are the model's own
(a wrapper's ``module.`` aside). Used by the tests on transformers' models and by any loop
on the kit's classes. It needs torch, the standard library, safetensors, placement.py and
sharded_checkpoint.py: a copy is these three files.
"""
import itertools
import json
import os
import shutil
import uuid

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from placement import _tensors, materialize, placements, whole_tensor
from sharded_checkpoint import _fsync_dir, _indices, _whole_shape

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _weight_map(folder) -> dict:
    """{tensor name: its file} of a checkpoint folder."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    if not os.path.exists(os.path.join(folder, SINGLE)):
        raise FileNotFoundError(f"{folder} holds neither {INDEX} nor {SINGLE}")
    with safe_open(os.path.join(folder, SINGLE), "pt") as f:
        return {name: SINGLE for name in f.keys()}


def _saved_tensors(module) -> list:
    """[(names, tensor)] for every parameter and persistent buffer of ``module`` (a tied one
    once, under each of its names), in the modules' order: what a checkpoint holds."""
    persistent = {id(t) for t in module.state_dict(keep_vars=True).values()}
    by_id = {}
    for name, ts in _tensors(module).items():
        for t in ts:
            if id(t) in persistent:
                by_id.setdefault(id(t), ([], t))[0].append(name)
    return list(by_id.values())


def _agree(problems: list, what: str):
    """Every rank learns every rank's ``problems`` (collective) and raises the same error."""
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else None
    if everyone is not None:
        dist.all_gather_object(everyone, problems)
    found = sorted({p for ps in (everyone or [problems]) for p in ps})
    if found:
        raise KeyError(f"{what} {found[:5]}{' ...' if len(found) > 5 else ''}")


def per_expert_layout(experts="mlp.experts", gate_up=("gate_proj", "up_proj"), down="down_proj"):
    """The checkpoints of transformers' mixture-of-experts models (Qwen3-MoE, Mixtral, as
    save_pretrained writes them and the Hub holds them) keep one tensor per expert,
    ``experts.{e}.gate_proj.weight`` [F, D], ``up_proj`` [F, D], ``down_proj`` [D, F],
    where the model holds them fused, ``experts.gate_up_proj`` [E, 2F, D] and
    ``experts.down_proj`` [E, D, F]: the pieces of each fused tensor, for
    load_hf_checkpoint's ``pieces``."""
    def pieces(name, shape):
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(experts) or len(shape) != 3:
            return None
        if leaf == "gate_up_proj":
            half = shape[1] // 2
            return [(f"{prefix}.{e}.{g}.weight", (e, k * half, 0)) for e in range(shape[0])
                    for k, g in enumerate(gate_up)]
        if leaf == down:
            return [(f"{prefix}.{e}.{down}.weight", (e, 0, 0)) for e in range(shape[0])]
        return None
    return pieces


def _runs_of(at) -> list:
    """Positions 0..n-1 of ``at`` (indices into a stored tensor) as runs of consecutive
    indices: [(first position, first index, length)]."""
    runs, values = [], at.tolist()
    for pos, i in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([pos, i, 1])
    return runs


@torch.no_grad()
def _read_into(target, record, shape, pieces, open_slice) -> int:
    """Copy into ``target`` (this rank's part of a tensor shaped ``shape``, laid out as
    ``record``) every element it holds, from ``pieces`` [(checkpoint name, offsets)], each a
    checkpoint tensor placed at ``offsets`` in the whole (with leading dims of one where it
    has fewer). Only this rank's elements are read: a box for each run of consecutive
    indices (one run a dim, unless an axis reordered it: a fused qkv's heads), through
    ``open_slice(name)``, safetensors' lazy slice. Returns the number of elements read."""
    mine = _indices(record, shape)
    flat = target.view(1) if target.dim() == 0 else target
    want = [mine.get(d, torch.arange(shape[d] if shape else 1)) for d in range(max(len(shape), 1))]
    for d, idx in enumerate(want):   # this rank's padding (the last shard's tail) is zeros
        if (idx < 0).any():
            flat.index_fill_(d, (idx < 0).nonzero().flatten(), 0)
    read = 0
    for name, offsets in pieces:
        sliced = open_slice(name)
        own = list(sliced.get_shape())
        size = [1] * (len(want) - len(own)) + own
        to, runs = [], []
        for d, idx in enumerate(want):
            inside = ((idx >= offsets[d]) & (idx < offsets[d] + size[d])).nonzero().flatten()
            to.append(inside)
            runs.append(_runs_of(idx[inside] - offsets[d]))
        if any(t.numel() == 0 for t in to):
            continue
        for box in itertools.product(*runs):
            stored = tuple(slice(i, i + n) for _, i, n in box)
            part = sliced[stored[len(want) - len(own):]] if own else sliced[:]
            part = part.reshape([n for _, _, n in box])
            read += part.numel()
            where = [to[d][pos:pos + n] for d, (pos, _, n) in enumerate(box)]   # this rank's positions
            flat[torch.meshgrid(*where, indexing="ij")] = part.to(flat.device, flat.dtype)
    return read


def load_hf_checkpoint(module, folder, device=None, pieces=None) -> dict:
    """Fill ``module`` (its axes applied; on meta or real) from a Hugging Face checkpoint
    folder: its meta tensors made real on ``device`` first (materialize; storage only), then
    each rank reads, for every parameter and persistent buffer it holds, only the slice of
    the checkpoint's tensor that is its part, cast to the tensor's dtype (build the model in
    the checkpoint's dtype to keep it). Buffers no checkpoint holds (non-persistent: rotary
    tables) stay as the model computed them (placement.meta_parameters). ``pieces(name,
    whole shape)``: for a tensor the checkpoint keeps in pieces, [(checkpoint name, offsets
    in the whole)], else None (per_expert_layout(): transformers' experts, one tensor per
    expert on disk). A tensor the checkpoint lacks is a KeyError naming it on every rank
    (collective), before anything is read; a shape that differs, a ValueError. Returns
    {"read": elements read, "held": elements this rank holds, its padding aside}."""
    weight_map = _weight_map(folder)
    plan = []
    for names, t in _saved_tensors(module):
        whole = tuple(_whole_shape(t, placements(t)))
        found = next((n for n in names if n in weight_map), None)
        parts = [(found, (0,) * len(whole))] if found else next(
            (p for p in ((pieces(n, whole) if pieces else None) for n in names) if p), [(names[0], None)])
        plan.append((names[0], t, whole, parts))
    _agree(sorted({n for _, _, _, parts in plan for n, _ in parts if n not in weight_map}),
           f"load_hf_checkpoint: {folder} lacks")
    if any(t.is_meta for ts in _tensors(module).values() for t in ts):
        materialize(module, device or "cpu")
    files, stats = {}, {"read": 0, "held": 0}

    def open_slice(name):
        if weight_map[name] not in files:
            files[weight_map[name]] = safe_open(os.path.join(folder, weight_map[name]), "pt")
        return files[weight_map[name]].get_slice(name)
    for name, t, whole, parts in plan:
        if len(parts) == 1 and tuple(open_slice(parts[0][0]).get_shape()) != whole:
            raise ValueError(f"load_hf_checkpoint: {parts[0][0]} is {list(open_slice(parts[0][0]).get_shape())} in "
                             f"{folder}, {list(whole)} in the model")
        stats["read"] += _read_into(t, placements(t), whole, parts, open_slice)
        mine, held = _indices(placements(t), whole), 1
        for d in range(len(whole)):
            held *= int((mine[d] >= 0).sum()) if d in mine else whole[d]
        stats["held"] += held
    return stats


def _writes(record, counter) -> bool:
    """Whether this rank writes the ``counter``-th tensor it holds. Every rank of the groups
    that replicate or shard it holds it whole once gathered; of those, the one ``counter``
    points at writes it, so that the writers take turns. A tensor no axis placed is one
    process's, the same on every rank: the first rank writes it."""
    groups = [p.group for p in record if p.kind in ("replicate", "shard")]
    if not record:
        return dist.get_rank() == 0
    for group in groups:
        n = dist.get_world_size(group)
        if dist.get_rank(group) != counter % n:
            return False
        counter //= n
    return True


def save_hf_checkpoint(module, folder, config=None) -> str:
    """Write ``module`` (on any composition, every rank calling: a collective) as a Hugging
    Face checkpoint folder: tensors by the model's own names, whole, in safetensors files
    (one per writing rank, model-0000k-of-0000n.safetensors) listed in
    model.safetensors.index.json, and ``config`` beside them (an object with
    save_pretrained: the model's transformers config), so that from_pretrained(folder)
    loads it. Each tensor is gathered whole on the ranks of its shard groups, one at a
    time, and kept by one of them: a rank holds its part, its share of whole tensors and one
    tensor being gathered, never the whole model. The files go to a temporary folder beside
    ``folder``, which is published by renaming once every rank has written (an older
    ``folder`` is replaced; a failed save leaves it as it was). Returns ``folder``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    nonce = [uuid.uuid4().hex[:12] if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(nonce, src=0)
    folder = os.path.abspath(folder)
    partial = f"{folder}.partial-{nonce[0]}"
    mine = {}
    for counter, (names, t) in enumerate(_saved_tensors(module)):
        record = placements(t)
        whole = whole_tensor(t, record)   # collective over its shard groups, in the modules' order
        if world == 1 or _writes(record, counter):
            for name in names:
                mine[name] = whole.to("cpu", copy=True).contiguous()
        del whole
    counts = [None] * world   # every rank's {name: bytes}
    sizes = {n: v.numel() * v.element_size() for n, v in mine.items()}
    if world > 1:
        dist.all_gather_object(counts, sizes)
    else:
        counts = [sizes]
    writers = [r for r in range(world) if counts[r]]
    file = f"model-{writers.index(rank) + 1:05d}-of-{len(writers):05d}.safetensors" if mine else None
    error = None
    try:
        os.makedirs(partial, exist_ok=True)
        if mine:
            tmp = os.path.join(partial, f"{file}.tmp")
            save_file(mine, tmp, metadata={"format": "pt"})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(partial, file))
    except OSError as e:
        error = f"rank {rank}: {e}"
    errors = [None] * world
    if world > 1:
        dist.all_gather_object(errors, error)
    else:
        errors = [error]
    if any(errors):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise OSError(f"save_hf_checkpoint: {[e for e in errors if e]}; {folder} left as it was")
    if rank == 0:
        weight_map = {n: f"model-{writers.index(r) + 1:05d}-of-{len(writers):05d}.safetensors"
                      for r in writers for n in counts[r]}
        total = sum(b for c in counts for b in c.values())
        with open(os.path.join(partial, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
        if config is not None:
            config.save_pretrained(partial)
        _fsync_dir(partial)
        old = f"{folder}.old-{nonce[0]}"
        if os.path.exists(folder):
            os.rename(folder, old)
        os.rename(partial, folder)   # published whole
        _fsync_dir(os.path.dirname(folder))
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier()
    return folder
