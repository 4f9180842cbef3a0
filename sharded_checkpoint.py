"""Sharded checkpoints: each rank writes only what it holds (its shards, its pipeline
stage's layers, its experts) with an index of where each piece sits in the whole tensor,
and any composition, on any world size, reads back only the pieces it needs
(``save_sharded``, ``load_sharded``, ``latest_checkpoint``; ``async_save``: the copy to
host memory now, the writing while training goes on, ``wait_for_saves`` before exit).
Each rank's file is a safetensors file, written a tensor at a time from the tensor's own
memory (a device's copied to the host by a thread while the one before it is written), so
a save holds no second copy of the state. A save is atomic: a folder is complete or
ignored. Used by 07's and 10's --train runs and by any loop on the kit's classes. It
needs torch, the standard library and placement.py (whose record says what each rank
holds): a copy is this file and placement.py.
"""
import collections
import contextlib
import ctypes
import itertools
import json
import math
import os
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
           "U64": getattr(torch, "uint64", None), "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
           "F8_E5M2": getattr(torch, "float8_e5m2", None), "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
           "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None), "C64": torch.complex64}
_DTYPES = {code: dtype for code, dtype in _DTYPES.items() if dtype is not None}   # (an older torch lacks some)
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def _bytes(t) -> memoryview:
    """The bytes of a contiguous host tensor, as a writable view (no copy; keep ``t``)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


class SafetensorsFile:
    """One safetensors file (8 bytes of header length, a JSON header of each tensor's dtype,
    shape and byte range, the data), read a box at a time by positioned reads: only the
    bytes asked for come into the process (a memory map would keep every page it touched)."""

    def __init__(self, path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        n = struct.unpack("<Q", os.pread(self.fd, 8, 0))[0]
        self.header = json.loads(os.pread(self.fd, n, 8))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def close(self):
        os.close(self.fd)

    def shape(self, name) -> list:
        return list(self.header[name]["shape"])

    def read(self, name, box=None) -> torch.Tensor:
        """The stored tensor ``name``, or its ``box`` [(start, stop) a dim]: one read for
        each run of it that lies contiguous in the file (the dims after the last one the
        box cuts are whole)."""
        info = self.header[name]
        shape, dtype = info["shape"], _DTYPES[info["dtype"]]
        box = [tuple(b) for b in box] if box is not None else [(0, n) for n in shape]
        out = torch.empty([b - a for a, b in box], dtype=dtype)
        if out.numel() == 0:
            return out
        size = out.element_size()
        stride = [math.prod(shape[d + 1:]) * size for d in range(len(shape))]
        cut = max([d for d in range(len(shape)) if box[d] != (0, shape[d])], default=-1)
        run = (box[cut][1] - box[cut][0]) * stride[cut] if cut >= 0 else out.numel() * size
        view, pos = _bytes(out), 0
        for lead in itertools.product(*(range(a, b) for a, b in box[:max(cut, 0)])):
            at = self.base + info["data_offsets"][0] + sum(i * stride[d] for d, i in enumerate(lead)) + \
                (box[cut][0] * stride[cut] if cut >= 0 else 0)
            chunk = view[pos:pos + run]
            while len(chunk):
                got = os.preadv(self.fd, [chunk], at)
                if got == 0:
                    raise EOFError(f"{self.path}: {name} ends before its data")
                chunk, at = chunk[got:], at + got
            pos += run
        return out


def _header(entries) -> bytes:
    """A safetensors header for [(name, dtype, shape)], their data following in that order."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        if dtype not in _CODES:
            raise TypeError(f"{name}: a {dtype} tensor has no safetensors type (those kept: {sorted(_DTYPES)})")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _on_host(t) -> torch.Tensor:
    t = t.detach()
    return (t if t.device.type == "cpu" else t.to("cpu")).contiguous()


def _stream(f, tensors):
    """Write {key: tensor} to the open file ``f`` as one safetensors file. A tensor on the
    host is written from its own memory; one on a device is copied to the host by a thread
    while the one before it is written, so the copies hide behind the disk and at most two
    are held at once, never the rank's whole state."""
    f.write(_header([(key, t.dtype, tuple(t.shape)) if t.dtype in _CODES else   # (a dtype safetensors
                     (key, torch.uint8, (t.numel() * t.element_size(),))         # lacks: its bytes)
                     for key, t in tensors.items()]))
    todo, ahead = iter(tensors.values()), collections.deque()
    gpu = next((t.device for t in tensors.values() if t.device.type == "cuda"), None)   # the thread's device
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint copy",   # its own (a new thread's is GPU 0)
                            initializer=torch.cuda.set_device if gpu else None, initargs=(gpu,) if gpu else ()) as pool:
        def fetch():
            t = next(todo, None)
            if t is not None:
                ahead.append(pool.submit(_on_host, t))
        fetch()
        while ahead:
            host = ahead.popleft().result()
            fetch()                 # the next one's copy, while this one is written
            f.write(_bytes(host))   # (held while written: _bytes does not keep it)


def _snapshot(module, optimizer, copy):
    """This rank's part of the checkpoint: {key: tensor} and {key: where it lies in the
    whole}, for every tensor this rank saves (one rank of each group that replicates it);
    ``copy``: each tensor copied to host memory now (else the tensor itself, written before
    the loop goes on). A tensor under several names (a tied weight, its optimizer state) is
    stored once, the others' entries naming the key it is stored under."""
    tensors, where, stored = {}, {}, {}

    def add(key, t, record):
        if not _sends(record, None):
            return
        if t.is_meta:
            raise ValueError(f"save_sharded: {key} is on the meta device, with no values to save "
                             f"(placement.materialize gives a meta-built model its storage)")
        shape = _whole_shape(t, record)
        where[key] = {"shape": list(shape), "dtype": str(t.dtype).replace("torch.", ""),
                      "index": {str(d): _runs(i) for d, i in _indices(record, shape).items()}}
        if t.dtype not in _CODES:   # (complex128, say: stored as its bytes, this rank's shape kept here)
            where[key]["bytes_of"] = list(t.shape)
        first = stored.setdefault(id(t), key)
        if first != key:
            where[key]["key"] = first
        else:
            tensors[key] = t.detach().to("cpu", copy=True).contiguous() if copy else t.detach()
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
    tensors, where, groups = _snapshot(module, optimizer, copy=async_save)
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    piece = {"where": where, "groups": groups, "file": f"shard-{rank:05d}.safetensors"}
    if not async_save:   # the copies to the host run on _stream's thread, on its device's default stream
        for device in {t.device for t in tensors.values() if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()

    def write():
        os.makedirs(partial, exist_ok=True)
        _write(os.path.join(partial, piece["file"]), lambda f: _stream(f, tensors))
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
    """A checkpoint's files, each opened only when a tensor in it is needed, and read a box
    at a time (positioned reads: only the bytes asked for come into the process). A file
    ``shard-*.pt`` is one an earlier version of this file wrote (torch.save's format):
    memory-mapped."""

    def __init__(self, folder):
        self.folder, self.files = folder, {}
        with open(os.path.join(folder, "metadata.json")) as f:
            self.meta = json.load(f)

    def read(self, entry, key, box=None) -> torch.Tensor:
        """The piece of ``key`` that ``entry`` says where it was saved, or its ``box``
        [(start, stop) a dim]."""
        name, key = entry["file"], entry.get("key", key)   # (a tensor saved under another name)
        if name not in self.files:
            path = os.path.join(self.folder, name)
            self.files[name] = SafetensorsFile(path) if not name.endswith(".pt") else \
                torch.load(path, mmap=True, weights_only=True)["tensors"]
        f = self.files[name]
        if isinstance(f, SafetensorsFile) and "bytes_of" not in entry:
            return f.read(key, box)
        t = f[key] if not isinstance(f, SafetensorsFile) else \
            f.read(key).view(getattr(torch, entry["dtype"])).reshape(entry["bytes_of"])
        return t[tuple(slice(a, b) for a, b in box)] if box is not None else t

    def close(self):
        for f in self.files.values():
            if isinstance(f, SafetensorsFile):
                f.close()
        self.files = {}

    @torch.no_grad()
    def fill(self, key, target, record):
        """Copy into ``target`` (this rank's part, laid out as ``record``) every element of
        the whole ``key`` it holds, reading from each saved piece the box that holds them."""
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
            theirs = {int(d): _unruns(r) for d, r in entry["index"].items()}
            to, frm = [], []
            for d in range(flat.dim()):
                want = mine.get(d, torch.arange(flat.shape[d]))
                have = theirs.get(d, torch.arange(shape[d] if shape else 1))   # (a dim not cut: whole)
                lookup = torch.full((max(shape[d] if shape else 1, 1),), -1, dtype=torch.long)
                lookup[have] = torch.arange(have.numel())
                pos = lookup[want.clamp(min=0)].masked_fill(want < 0, -1)
                keep = (pos >= 0).nonzero().flatten()
                to.append(keep)
                frm.append(pos[keep])
            if any(t.numel() == 0 for t in to):
                continue
            box = [(int(f.min()), int(f.max()) + 1) for f in frm]
            part = self.read(entry, key, box if shape else None)
            part = part.view(1) if part.dim() == 0 else part
            for d, (f, (lo, hi)) in enumerate(zip(frm, box)):
                if f.numel() != hi - lo or not torch.equal(f, torch.arange(lo, hi)):
                    part = part.index_select(d, (f - lo).to(part.device))
            if all(t[-1] - t[0] + 1 == t.numel() for t in to):   # (one box of target: copied in place)
                flat[tuple(slice(int(t[0]), int(t[-1]) + 1) for t in to)].copy_(part)
            else:   # (scattered: through an index grid the piece's size)
                flat[torch.meshgrid(*to, indexing="ij")] = part.to(flat.device, flat.dtype)


def load_sharded(module, optimizer, folder) -> dict:
    """Load a save_sharded checkpoint (``folder``: a published step-<k> folder, e.g.
    latest_checkpoint's) into ``module`` and ``optimizer`` on any composition of axes, or
    one process: each rank reads, from the pieces that hold its part of each tensor, only
    the bytes of that part's box. Restores each rank's RNG states when the world size is
    the one saved. Returns the checkpoint's ``extra``."""
    reader = _Reader(folder)
    try:
        _load(reader, module, optimizer)
    finally:
        reader.close()
    if reader.meta["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1):
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = os.path.join(folder, f"shard-{rank:05d}.safetensors")
        if os.path.exists(path):
            f = SafetensorsFile(path)
            rng = {k: f.read(f"rng/{k}") for k in ("cpu", "cuda") if f"rng/{k}" in f.header}
            f.close()
        else:   # (saved by an earlier version of this file)
            rng = torch.load(os.path.join(folder, f"shard-{rank:05d}.pt"), mmap=True, weights_only=True)["rng"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return reader.meta["extra"]


def _load(reader, module, optimizer):
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
                        entry[k] = reader.read(first, key).item()
                    elif tuple(first["shape"]) == _whole_shape(p, placements(p)) and p.dim():
                        entry[k] = torch.zeros_like(p, memory_format=torch.contiguous_format)   # padding: 0
                        reader.fill(key, entry[k], placements(p))
                    else:
                        entry[k] = reader.read(first, key).clone()
                if entry:
                    state[index] = entry
                ids.append(index)
                index += 1
            groups.append({**{k: tuple(v) if isinstance(group.get(k), tuple) else v   # (JSON kept a tuple,
                              for k, v in g.items() if k != "params"}, "params": ids})   # AdamW's betas, as a list)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
