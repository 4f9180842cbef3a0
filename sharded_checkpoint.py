"""Sharded checkpoints: each rank writes only what it holds (its shards, its pipeline
stage's layers, its experts) with an index of where each piece sits in the whole tensor,
and any composition, on any world size, reads back only the pieces it needs
(``save_sharded``, ``load_sharded``, ``latest_checkpoint``; ``async_save``: the copy to
host memory now, the writing while training goes on, ``wait_for_saves`` before exit).
A save is atomic: a folder is complete or ignored. Used by 07's and 10's --train runs and
by any loop on the kit's classes. It needs torch, the standard library and placement.py
(whose record says what each rank holds): a copy is this file and placement.py.
"""
import contextlib
import json
import os
import threading
import time
import uuid

import torch
import torch.distributed as dist

from placement import _names, _sends, placements   # what each rank holds, and under which names


def _whole_shape(tensor, record) -> tuple:
    shards = [p for p in record if p.kind == "shard"]
    return tuple(shards[0].shape) if shards else tuple(tensor.shape)


def _indices(record, whole_shape) -> dict:
    """{dim: the whole's index at each of this rank's positions along dim (-1: padding)} for
    every dim a shard of ``record`` cut (a 0-d whole counts as one row)."""
    out = {}
    for p in record:
        if p.kind != "shard":
            continue
        cur = out.get(p.dim, torch.arange(whole_shape[p.dim] if whole_shape else 1))
        if p.order is not None:
            cur = cur[p.order.cpu()]
        n, r = dist.get_world_size(p.group), dist.get_rank(p.group)
        chunk = -(-cur.numel() // n)
        piece = torch.full((chunk,), -1, dtype=torch.long)
        lo, hi = r * chunk, min((r + 1) * chunk, cur.numel())
        if lo < hi:
            piece[:hi - lo] = cur[lo:hi]
        out[p.dim] = piece
    return out


def _runs(index) -> list:
    """An index list (padding, -1, only at its end) as [start, stop) runs of the whole."""
    runs = []
    for i in index.tolist():
        if i < 0:
            break
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return runs


def _unruns(runs) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.long)


def _snapshot(module, optimizer):
    """This rank's part of the checkpoint: {key: host tensor} and {key: where it lies in the
    whole}, for every tensor this rank saves (one rank of each group that replicates it)."""
    tensors, where = {}, {}

    def add(key, t, record):
        if not _sends(record, None):
            return
        shape = _whole_shape(t, record)
        tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        where[key] = {"shape": list(shape), "dtype": str(t.dtype).replace("torch.", ""),
                      "index": {str(d): _runs(i) for d, i in _indices(record, shape).items()}}
    for name, t in module.state_dict(keep_vars=True).items():
        add(f"model/{name}", t, placements(t))
    groups = []
    if optimizer is not None:
        names = _names(module)
        for g in optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [n for p in g["params"] for n in names[id(p)]]})
            for p in g["params"]:
                record = placements(p)   # a scalar state (AdamW's step), the same on every rank that
                scalars = _sends(record, None) and all(   # holds p: written by the one with its first shard
                    dist.get_rank(r.group) == 0 for r in record if r.kind == "shard")
                for k, v in optimizer.state.get(p, {}).items():
                    if not torch.is_tensor(v) and not isinstance(v, (int, float, bool)):
                        continue   # (None: a state the optimizer makes again)
                    for n in names[id(p)]:
                        if torch.is_tensor(v) and v.dim() and v.shape == p.shape:
                            add(f"optim/{n}/{k}", v, record)
                        elif scalars:
                            add(f"optim/{n}/{k}", v if torch.is_tensor(v) else torch.tensor(v), ())
                            where[f"optim/{n}/{k}"]["python"] = not torch.is_tensor(v)
    return tensors, where, groups


_SAVING = {}   # this process's save in flight: the thread writing it


def wait_for_saves():
    """Wait until this process's checkpoint in flight (async_save=True) is written; if
    writing it failed, raise that here (a RuntimeError from the thread's error)."""
    thread = _SAVING.pop("thread", None)
    if thread is not None:
        thread.join()
    error = _SAVING.pop("error", None)
    if error is not None:
        raise RuntimeError("the checkpoint written in the background failed: " + str(error)) from error


def _fsync_dir(path):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write(path, write):
    """A checkpoint file written whole or not at all: into a temporary name beside it,
    flushed to disk, then renamed, so that the first rank, polling for every rank's piece,
    never reads one half written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_sharded(module, optimizer, directory, step: int, extra=None, async_save=False, timeout=600.0):
    """Save ``module``'s state (and ``optimizer``'s) as a sharded checkpoint of ``step`` under
    ``directory`` (shared by every rank): each rank writes only the tensors it holds (its
    shards, slices, stage and experts; a tensor several ranks replicate, by one of them) to
    its own file, with where each lies in the whole; the first rank then merges those into
    metadata.json and publishes the checkpoint by renaming its temporary folder to
    step-<step>. A crash at any point leaves the previous checkpoints as they were and the
    partial one ignored. ``extra``: a JSON-able dict kept with it (the loop's own state);
    each rank's RNG states go with its file. ``async_save``: the tensors are copied to host
    memory now and written by a background thread while training goes on (the next save,
    or wait_for_saves, waits for it, and raises its error if writing failed). Every rank
    calls it (one collective: the folder's name). Returns the published folder's path."""
    wait_for_saves()
    rank, world = dist.get_rank(), dist.get_world_size()
    nonce = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)   # one folder per attempt: two never mix
    final = os.path.join(directory, f"step-{step:09d}")
    partial = os.path.join(directory, f".partial-step-{step:09d}-{nonce[0]}")
    tensors, where, groups = _snapshot(module, optimizer)
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_initialized() else {})}
    piece = {"where": where, "groups": groups, "file": f"shard-{rank:05d}.pt"}

    def write():
        os.makedirs(partial, exist_ok=True)
        _write(os.path.join(partial, piece["file"]), lambda f: torch.save({"tensors": tensors, "rng": rng}, f))
        _write(os.path.join(partial, f"piece-{rank:05d}.json"), lambda f: f.write(json.dumps(piece).encode()))
        if rank != 0:
            return
        deadline = time.monotonic() + timeout   # the first rank publishes once every rank's piece is there
        pieces = [os.path.join(partial, f"piece-{r:05d}.json") for r in range(world)]
        while not all(os.path.exists(p) for p in pieces):
            if time.monotonic() > deadline:
                return   # a rank died mid-save: the partial folder stays unpublished
            time.sleep(0.01)
        meta = {"step": step, "world_size": world, "extra": extra, "tensors": {}, "param_groups": None}
        for path in pieces:
            with open(path) as f:
                got = json.load(f)
            for key, w in got["where"].items():
                meta["tensors"].setdefault(key, []).append({**w, "file": got["file"]})
            if meta["param_groups"] is None:
                meta["param_groups"] = [dict(g, params=[]) for g in got["groups"]]
            for g, other in zip(meta["param_groups"], got["groups"]):
                g["params"] += [n for n in other["params"] if n not in g["params"]]
        _write(os.path.join(partial, "metadata.json"), lambda f: f.write(json.dumps(meta).encode()))
        _fsync_dir(partial)
        if os.path.exists(final):   # the same step saved again (a restarted run): keep the first
            return
        os.rename(partial, final)   # atomic: the checkpoint exists complete, or not at all
        _fsync_dir(directory)
    if async_save:
        def in_background():
            try:
                write()
            except BaseException as e:   # raised by the next wait_for_saves, not lost in the thread
                _SAVING["error"] = e
        _SAVING["thread"] = threading.Thread(target=in_background, name=f"checkpoint step {step}")
        _SAVING["thread"].start()
    else:
        write()
    return final


def latest_checkpoint(directory):
    """The newest complete checkpoint folder under ``directory`` (None: none yet); partial
    ones (a save that crashed) are never chosen."""
    if not os.path.isdir(directory):
        return None
    done = sorted(name for name in os.listdir(directory)
                  if name.startswith("step-") and os.path.exists(os.path.join(directory, name, "metadata.json")))
    return os.path.join(directory, done[-1]) if done else None


class _Reader:
    """A checkpoint's files, each opened (memory-mapped) only when a tensor in it is needed."""

    def __init__(self, folder):
        self.folder, self.files = folder, {}
        with open(os.path.join(folder, "metadata.json")) as f:
            self.meta = json.load(f)

    def tensor(self, entry, key):
        if entry["file"] not in self.files:
            self.files[entry["file"]] = torch.load(os.path.join(self.folder, entry["file"]), mmap=True,
                                                   weights_only=True)["tensors"]
        return self.files[entry["file"]][key]

    @torch.no_grad()
    def fill(self, key, target, record):
        """Copy into ``target`` (this rank's part, laid out as ``record``) every element of
        the whole ``key`` it holds, from the saved pieces that hold them."""
        entries = self.meta["tensors"].get(key)
        if entries is None:
            raise KeyError(f"the checkpoint lacks {key}")
        shape = tuple(entries[0]["shape"])
        mine = _indices(record, shape)
        flat = target.view(1) if target.dim() == 0 else target
        for d, idx in mine.items():   # this rank's padding (the last shard's tail) is zeros
            pad = (idx < 0).nonzero().flatten()
            if pad.numel():
                flat.index_fill_(d, pad, 0)
        for entry in entries:
            source = self.tensor(entry, key)
            source = source.view(1) if source.dim() == 0 else source
            theirs = {int(d): _unruns(r) for d, r in entry["index"].items()}
            to, frm = [], []
            for d in range(flat.dim()):
                want = mine.get(d, torch.arange(flat.shape[d]))
                have = theirs.get(d, torch.arange(source.shape[d]))
                lookup = torch.full((max(shape[d] if shape else 1, 1),), -1, dtype=torch.long)
                lookup[have] = torch.arange(have.numel())
                pos = lookup[want.clamp(min=0)].masked_fill(want < 0, -1)
                keep = (pos >= 0).nonzero().flatten()
                to.append(keep)
                frm.append(pos[keep])
            if any(t.numel() == 0 for t in to):
                continue
            part = source
            for d, f in enumerate(frm):
                part = part.index_select(d, f.to(part.device))   # (the saved piece: wherever torch.load put it)
            grid = torch.meshgrid(*to, indexing="ij")
            flat[grid] = part.to(flat.device, flat.dtype)


def load_sharded(module, optimizer, folder) -> dict:
    """Load a save_sharded checkpoint (``folder``: a published step-<k> folder, e.g.
    latest_checkpoint's) into ``module`` and ``optimizer`` on any composition of axes, or
    one process: each rank reads only the pieces that hold its part of each tensor (files
    are memory-mapped, so only those bytes are read). Restores each rank's RNG states when
    the world size is the one saved. Returns the checkpoint's ``extra``."""
    reader = _Reader(folder)
    for name, t in module.state_dict(keep_vars=True).items():
        reader.fill(f"model/{name}", t, placements(t))
    if optimizer is not None:
        names = _names(module)
        saved = reader.meta["param_groups"]
        if len(saved) != len(optimizer.param_groups):
            raise ValueError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
                             f"{len(saved)}")
        state, groups, index = {}, [], 0
        for group, g in zip(optimizer.param_groups, saved):
            ids = []
            for p in group["params"]:
                name = next((n for n in names[id(p)] if n in g["params"]), None)
                if name is None:
                    raise ValueError(f"{names[id(p)][0]} is not in the saved parameter group it is in here")
                keys = [k for k in reader.meta["tensors"] if k.startswith(f"optim/{name}/")]
                entry = {}
                for key in keys:
                    k, first = key.rsplit("/", 1)[1], reader.meta["tensors"][key][0]
                    if first.get("python"):
                        entry[k] = reader.tensor(first, key).item()
                    elif tuple(first["shape"]) == _whole_shape(p, placements(p)) and p.dim():
                        entry[k] = torch.zeros_like(p, memory_format=torch.contiguous_format)   # padding: 0
                        reader.fill(key, entry[k], placements(p))
                    else:
                        entry[k] = reader.tensor(first, key).clone()
                if entry:
                    state[index] = entry
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if reader.meta["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1):
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = torch.load(os.path.join(folder, f"shard-{rank:05d}.pt"), mmap=True, weights_only=True)["rng"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return reader.meta["extra"]
