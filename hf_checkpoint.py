"""Hugging Face checkpoint folders in and out, on any composition of the kit's axes.
``load_hf_checkpoint`` fills a model (built with placement.meta_parameters, the axes
applied) from a folder save_pretrained wrote (model.safetensors, or shards listed in
model.safetensors.index.json), each rank reading only the bytes of the elements it holds
(positioned reads of the safetensors files: no memory map, no whole tensor).
``save_hf_checkpoint`` writes such a folder (safetensors files with their index, the
config beside them) that from_pretrained loads: each tensor, one at a time, is gathered
whole to one rank of its shard groups, which streams it to its file (the writers take
turns), so a rank holds its part and one whole tensor, never the model; a folder is
published complete or not at all. Names are the model's own (a wrapper's
``module.`` aside). Used by the tests on transformers' models and by any loop on the kit's
classes. It needs torch, the standard library, placement.py and sharded_checkpoint.py: a
copy is these three files (the safetensors files are read and written by sharded_checkpoint's
SafetensorsFile and _header); model_layout, which reads a transformers model's own checkpoint
names, needs transformers too.
"""
import itertools
import json
import math
import os
import shutil
import uuid

import torch
import torch.distributed as dist

from placement import _gather_shard, _tensors, materialize, placements
from sharded_checkpoint import SafetensorsFile, _bytes, _fsync_dir, _header, _indices, _whole_shape

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def _weight_map(folder) -> dict:
    """{tensor name: its file} of a checkpoint folder."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    if not os.path.exists(os.path.join(folder, SINGLE)):
        raise FileNotFoundError(f"{folder} holds neither {INDEX} nor {SINGLE}")
    single = SafetensorsFile(os.path.join(folder, SINGLE))
    single.close()
    return {name: SINGLE for name in single.header}


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


def _agree(missing: list, wrong: list, folder, unmade=()):
    """Every rank learns every rank's problems (collective) and raises the same error: a
    KeyError for the names the folder lacks, a ValueError for shapes that differ or for
    buffers no checkpoint holds that were built on meta (``unmade``)."""
    everyone = [(missing, wrong, list(unmade))]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (missing, wrong, list(unmade)))
    missing = sorted({n for m, _, _ in everyone for n in m})
    wrong = sorted({n for _, w, _ in everyone for n in w})
    unmade = sorted({n for _, _, u in everyone for n in u})
    if unmade:
        raise ValueError(f"load_hf_checkpoint: {unmade[:5]} are buffers the model computes in its constructor, "
                         f"which no checkpoint holds, and they were built on meta (no values): build the model "
                         f"under placement.meta_parameters(), which keeps them as its code computes them")
    if missing:
        raise KeyError(f"load_hf_checkpoint: {folder} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                       f"{' (a head tied to the embedding, which save_pretrained leaves out: pass pieces=model_layout(model))' if any(n.endswith('lm_head.weight') for n in missing) else ''}")
    if wrong:
        raise ValueError(f"load_hf_checkpoint: shapes differ from the model's: {wrong[:5]}"
                         f"{' ...' if len(wrong) > 5 else ''}")


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



def model_layout(model, folder=None):
    """load_hf_checkpoint's ``pieces`` for a transformers model, read from the model's own
    checkpoint conversion mapping (what from_pretrained applies to the files save_pretrained
    writes and the Hub holds): its renamings, reversed (GPT-NeoX's lm_head is embed_out in
    its files, Mixtral's mlp its block_sparse_moe), its experts kept one tensor per
    expert, merged into the model's fused [E, ...] tensors (stacked along dim 0, several
    sources concatenated along one dimension: gate and up, Mixtral's w1 and w3), a tensor
    the files hold transposed (Qwen3-VL-MoE's experts, [E, in, out] on the Hub: where the
    conversion transposes only a shape that differs from the model's, as transformers
    does, ``folder``'s shapes tell; without a folder, the model's own shape, as
    save_pretrained writes it), and a head tied to the embedding (``tie_word_embeddings``)
    read from the embedding's tensor, which is all save_pretrained writes of the two (the
    last pipeline stage's copy too). A conversion of another kind that touches one of the
    model's tensors is a ValueError naming it. Needs transformers; call it on the model (not
    a stage or wrapper), before the axes are applied or after: the names are the model's."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renames = [t.reverse_transform() for t in transforms if type(t) is WeightRenaming]
    merges, flips, names = [], [], [n for n, _ in model.named_parameters()]
    for t in transforms:
        if type(t) is WeightRenaming:
            continue
        ops = [type(o).__name__ for o in getattr(t, "operations", [])]
        target = t.target_patterns[0].lstrip(".")
        if isinstance(t, WeightConverter) and len(t.target_patterns) == 1 and ops in (
                ["MergeModulelist"], ["MergeModulelist", "Concatenate"]) and t.operations[0].dim == 0:
            merges.append((target, [s.lstrip(".") for s in t.source_patterns],
                           t.operations[1].dim if len(ops) > 1 else None))
        elif isinstance(t, WeightConverter) and ops == ["Transpose"] and len(t.source_patterns) == 1 \
                and len(t.target_patterns) == 1 and "\\" not in t.source_patterns[0] + t.target_patterns[0]:
            flip = t.operations[0]
            flips.append((target, t.source_patterns[0].lstrip("."), (flip.dim0, flip.dim1), flip.check_dims))
        elif any(n.endswith(target) for n in names):
            raise ValueError(f"{type(model).__name__}'s checkpoint conversion {t.source_patterns} -> "
                             f"{t.target_patterns} ({', '.join(ops)}) is not one the kit reads")

    def on_disk(name):
        for r in reversed(renames):   # (from_pretrained applies them in order: undone last first)
            name = r.rename_source_key(name)[0]
        return name

    tied = dict(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}) \
        if getattr(model.config, "tie_word_embeddings", False) else {}
    stored = _stored_shape(folder)

    def pieces(name, shape):
        if name in tied:   # a head tied to the embedding: save_pretrained leaves it out of the files
            return [(on_disk(tied[name]), (0,) * len(shape))]
        for target, source, dims, check in flips:
            if name.endswith(target) and (name == target or name[-len(target) - 1] == "."):
                disk = on_disk(name[:-len(target)] + source)
                if not check or (stored(disk) or list(shape)) != list(shape):   # (transformers' check_dims)
                    return [(disk, (0,) * len(shape), dims)]
                return [(disk, (0,) * len(shape))] if disk != name else None
        for target, sources, dim in merges:
            if name.endswith(target) and (name == target or name[-len(target) - 1] == "."):
                prefix = name[:-len(target)]
                step = shape[dim] // len(sources) if dim is not None else 0
                return [(on_disk(prefix + source.replace("*", str(e))),
                         tuple(e if d == 0 else k * step if d == dim else 0 for d in range(len(shape))))
                        for e in range(shape[0]) for k, source in enumerate(sources)]
        renamed = on_disk(name)
        return [(renamed, (0,) * len(shape))] if renamed != name else None
    def on_disk_parts(name, shape):
        """The tensor as the source's files hold it: [(name on disk, index into the whole
        tensor)], one per expert and source where it is merged; None where it is kept as is."""
        got = pieces(name, shape)
        if got is None or name in tied:
            return None
        if len(got) == 1:   # (with the dims it is stored transposed in)
            return [(got[0][0], (slice(None),) * len(shape), *got[0][2:])]
        dims = next(dim for target, _, dim in merges if name.endswith(target))
        step = shape[dims] // (len(got) // shape[0]) if dims is not None else None
        return [(disk, (at[0], *(slice(o, o + step) if d == dims else slice(None) for d, o in enumerate(at) if d)))
                for disk, at in got]
    pieces.tied = tied   # {head: embedding}: save_hf_checkpoint(layout=) writes the embedding only
    pieces.on_disk = on_disk_parts
    return pieces


def _stored_shape(folder):
    """name -> its shape in ``folder``'s files (None: not there, or no folder)."""
    if folder is None:
        return lambda name: None
    weight_map, files = _weight_map(folder), {}

    def shape(name):
        if name not in weight_map:
            return None
        if weight_map[name] not in files:
            f = SafetensorsFile(os.path.join(folder, weight_map[name]))
            f.close()
            files[weight_map[name]] = f.header
        return list(files[weight_map[name]][name]["shape"])
    return shape


def _swapped(items, dims=None):
    """``items`` (a list, one entry a dim) with the entries of ``dims`` swapped (none: as they are)."""
    items = list(items)
    if dims:
        items[dims[0]], items[dims[1]] = items[dims[1]], items[dims[0]]
    return items


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


def _as_slice(positions):
    """Consecutive positions as a slice (an index tensor otherwise)."""
    first = int(positions[0])
    if torch.equal(positions, torch.arange(first, first + len(positions))):
        return slice(first, first + len(positions))
    return positions


@torch.no_grad()
def _read_into(target, record, shape, pieces, file_of) -> tuple:
    """Copy into ``target`` (this rank's part of a tensor shaped ``shape``, laid out as
    ``record``) every element it holds, from ``pieces`` [(checkpoint name, offsets)], each a
    checkpoint tensor placed at ``offsets`` in the whole (with leading dims of one where it
    has fewer; a third entry, two dims: the tensor is stored with those two swapped). Only
    this rank's elements are read: a box for each run of consecutive
    indices (one run a dim, unless an axis reordered it: a fused qkv's heads), from
    ``file_of(name)``, the SafetensorsFile that holds it. Returns (elements read, elements
    this rank holds, its padding aside)."""
    mine = _indices(record, shape)
    flat = target.view(1) if target.dim() == 0 else target
    want = [mine.get(d, torch.arange(shape[d] if shape else 1)) for d in range(max(len(shape), 1))]
    for d, idx in enumerate(want):   # this rank's padding (the last shard's tail) is zeros
        if (idx < 0).any():
            flat.index_fill_(d, (idx < 0).nonzero().flatten(), 0)
    read, held = 0, math.prod(int((idx >= 0).sum()) for idx in want)
    for name, offsets, *flip in pieces:
        offsets = tuple(offsets) + (0,) * (len(want) - len(offsets))   # (a 0-dim tensor: one place)
        file = file_of(name)
        flip = flip[0] if flip else None
        own = _swapped(file.shape(name), flip)   # (in the whole's order)
        size = [1] * (len(want) - len(own)) + own
        to, runs = [], []
        for d, idx in enumerate(want):
            inside = ((idx >= offsets[d]) & (idx < offsets[d] + size[d])).nonzero().flatten()
            to.append(inside)
            runs.append(_runs_of(idx[inside] - offsets[d]))
        if any(t.numel() == 0 for t in to):
            continue
        for box in itertools.product(*runs):
            stored = [(i, i + n) for _, i, n in box][len(want) - len(own):]
            part = file.read(name, _swapped(stored, flip)).reshape(_swapped([n for _, _, n in box], flip))
            part = part.transpose(*flip) if flip else part
            read += part.numel()
            where = [_as_slice(to[d][pos:pos + n]) for d, (pos, _, n) in enumerate(box)]   # this rank's positions
            if all(isinstance(w, slice) for w in where):
                flat[tuple(where)].copy_(part)
            else:
                grid = [torch.arange(w.start, w.stop) if isinstance(w, slice) else w for w in where]
                flat[torch.meshgrid(*grid, indexing="ij")] = part.to(flat.device, flat.dtype)
    return read, held


def load_hf_checkpoint(module, folder, device=None, pieces=None) -> dict:
    """Fill ``module`` (its axes applied; on meta or real) from a Hugging Face checkpoint
    folder: its meta tensors made real on ``device`` first (materialize; storage only), then
    each rank reads, for every parameter and persistent buffer it holds, only the slice of
    the checkpoint's tensor that is its part, cast to the tensor's dtype (build the model in
    the checkpoint's dtype to keep it). Buffers no checkpoint holds (non-persistent: rotary
    tables) stay as the model computed them (placement.meta_parameters). ``pieces(name,
    whole shape)``: for a tensor the checkpoint keeps in pieces, [(checkpoint name, offsets
    in the whole)], else None (per_expert_layout(): transformers' experts, one tensor per
    expert on disk). A tensor the checkpoint lacks is a KeyError naming it, and a shape
    that differs a ValueError, on every rank (collective), before anything is read; so is a
    buffer no checkpoint holds left on meta (a model built under torch.device("meta")
    instead of meta_parameters: it would hold no values). Returns
    {"read": elements read, "held": elements this rank holds, its padding aside}."""
    weight_map = _weight_map(folder)
    plan = []
    for names, t in _saved_tensors(module):
        whole = tuple(_whole_shape(t, placements(t)))
        found = next((n for n in names if n in weight_map), None)
        laid = [p for p in ((pieces(n, whole) if pieces else None) for n in names) if p]
        parts = next((p for p in laid if len(p[0]) > 2), None) or (   # (stored transposed, under its own name)
            [(found, (0,) * len(whole))] if found else laid[0] if laid else [(names[0], None)])
        plan.append((names[0], t, whole, parts))
    files, stats = {}, {"read": 0, "held": 0}

    def file_of(name):
        if weight_map[name] not in files:
            files[weight_map[name]] = SafetensorsFile(os.path.join(folder, weight_map[name]))
        return files[weight_map[name]]
    try:
        missing = sorted({n for _, _, _, parts in plan for n, *_ in parts if n not in weight_map})
        wrong = [f"{parts[0][0]}: {file_of(parts[0][0]).shape(parts[0][0])} in the folder, {list(whole)} here"
                 for _, _, whole, parts in plan if not missing and len(parts) == 1   # (a transposed one: swapped back)
                 and tuple(_swapped(file_of(parts[0][0]).shape(parts[0][0]), *parts[0][2:])) != whole]
        saved = {id(t) for _, t, _, _ in plan}
        unmade = [n for n, ts in _tensors(module).items() for t in ts if t.is_meta and id(t) not in saved]
        _agree(missing, wrong, folder, unmade)   # every rank refuses, before anything is read
        if any(t.is_meta for ts in _tensors(module).values() for t in ts):
            materialize(module, device or "cpu")
        for name, t, whole, parts in plan:
            read, held = _read_into(t, placements(t), whole, parts, file_of)
            stats["read"] += read
            stats["held"] += held
    finally:
        for file in files.values():
            file.close()
    return stats


def _writer_digits(record, counter):
    """Which rank writes the ``counter``-th tensor a rank holds: its rank in each group that
    replicates or shards it ([(placement, rank in its group)], the counter's digits, so that
    the writers take turns); None for a tensor no axis placed (one process's, the same on
    every rank: the first rank writes it)."""
    digits = []
    for p in record:
        if p.kind in ("replicate", "shard"):
            n = dist.get_world_size(p.group)
            digits.append((p, counter % n))
            counter //= n
    return digits if record else None


def _writes(digits) -> bool:
    """Whether this rank writes the tensor ``digits`` (_writer_digits') point at (True or
    False: a tensor no axis placed, written by the lowest rank that holds it)."""
    if isinstance(digits, bool):
        return digits
    if digits is None:
        return not dist.is_initialized() or dist.get_rank() == 0
    return all(dist.get_rank(p.group) == d for p, d in digits)


def _whole_on_writer(t, digits):
    """``t`` whole on the rank that writes it, None elsewhere: each shard gathered to one
    rank of its group, innermost first, by the ranks that hold copies the writer's way
    (collective over those groups only)."""
    if digits is None:
        return t.detach() if _writes(None) else None
    if isinstance(digits, bool):
        return t.detach() if digits else None
    if any(p.kind == "replicate" and dist.get_rank(p.group) != d for p, d in digits):
        return None
    t = t.detach()
    for p, d in reversed([(p, d) for p, d in digits if p.kind == "shard"]):
        t = _gather_shard(t, p, to=d)
        if t is None:
            return None
    return t


def save_hf_checkpoint(module, folder, config=None, layout=None) -> str:
    """Write ``module`` (on any composition, every rank calling: a collective) as a Hugging
    Face checkpoint folder: tensors by the model's own names, whole, in safetensors files
    (one per writing rank, model-0000k-of-0000n.safetensors) listed in
    model.safetensors.index.json, and ``config`` beside them (an object with
    save_pretrained: the model's transformers config), so that from_pretrained(folder)
    loads it. Each tensor is gathered whole to one rank of its shard groups, one at a
    time, which streams it to its file (the writers take turns): a rank holds its part
    and one whole tensor, never the model. The files go to a temporary folder
    beside ``folder``, published by renaming once every rank has written (an older
    ``folder`` is replaced; a save that fails on any rank is an OSError on every rank and
    leaves it as it was). ``layout``: model_layout(model), the source's own layout: a head
    tied to the embedding left out, as save_pretrained leaves it; experts one tensor each and
    names as the source's files have them (Mixtral's block_sparse_moe.experts.{e}.w1), as
    from_pretrained reads them back. Returns ``folder``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    nonce = [uuid.uuid4().hex[:12] if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(nonce, src=0)
    folder = os.path.abspath(folder)
    partial = f"{folder}.partial-{nonce[0]}"
    tied = getattr(layout, "tied", {})
    saved = [([n for n in names if n not in tied], t) for names, t in _saved_tensors(module)]
    plan = [(names, t, _writer_digits(placements(t), counter) if world > 1 else None)
            for counter, (names, t) in enumerate(s for s in saved if s[0])]
    if world > 1:   # a tensor no axis placed (a buffer): the lowest rank holding it writes it (a later
        listed = [None] * world   # pipeline stage's buffers are not on rank 0)
        dist.all_gather_object(listed, [names[0] for names, _, digits in plan if digits is None])
        holder = {}
        for r, names in enumerate(listed):
            for n in names:
                holder.setdefault(n, r)
        plan = [(names, t, holder[names[0]] == rank if digits is None else digits) for names, t, digits in plan]
    on_disk = getattr(layout, "on_disk", lambda name, shape: None)
    parts = {}   # id(tensor) -> [(name in the file, index into the whole tensor)]
    for names, t, _ in plan:
        shape = tuple(_whole_shape(t, placements(t)))
        parts[id(t)] = [p for n in names for p in (on_disk(n, shape) or [(n, (slice(None),) * len(shape))])]
    entries = [(n, t.dtype, _swapped(torch.empty(_whole_shape(t, placements(t)), device="meta")[at].shape,
                                     *flip))
               for names, t, digits in plan if _writes(digits) for n, at, *flip in parts[id(t)]]
    sizes = {n: math.prod(shape) * torch.empty((), dtype=dtype).element_size() for n, dtype, shape in entries}
    counts = [sizes]   # every rank's {name: bytes}: who writes, and the index
    if world > 1:
        counts = [None] * world
        dist.all_gather_object(counts, sizes)
    writers = [r for r in range(world) if counts[r]]
    file_name = lambda r: f"model-{writers.index(r) + 1:05d}-of-{len(writers):05d}.safetensors"   # noqa: E731
    error, out = None, None
    try:
        os.makedirs(partial, exist_ok=True)
        if entries:
            out = open(os.path.join(partial, file_name(rank) + ".tmp"), "wb")
            out.write(_header(entries))
    except OSError as e:
        error = f"rank {rank}: {e}"
    for names, t, digits in plan:
        whole = _whole_on_writer(t, digits)   # collective over its groups, in the modules' order
        if whole is not None and out is not None and error is None:
            whole = whole.to("cpu").contiguous()
            try:
                for _, at, *flip in parts[id(t)]:   # (stored transposed, as the source was)
                    piece = (whole[at].transpose(*flip[0]) if flip else whole[at]).contiguous()   # (held: _bytes
                    out.write(_bytes(piece))                                                     # does not keep it)
            except OSError as e:
                error = f"rank {rank}: {e}"
        del whole
    if out is not None:
        try:
            out.flush()
            os.fsync(out.fileno())
            out.close()
            if error is None:
                os.replace(out.name, os.path.join(partial, file_name(rank)))
        except OSError as e:
            error = error or f"rank {rank}: {e}"
    errors = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    if any(errors):
        if world > 1:
            dist.barrier()   # every rank has closed its file before the folder goes
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise OSError(f"save_hf_checkpoint: {[e for e in errors if e]}; {folder} left as it was")
    if rank == 0:
        weight_map = {n: file_name(r) for r in writers for n in counts[r]}
        with open(os.path.join(partial, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": sum(b for c in counts for b in c.values())},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
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
