"""Diagnostics every job runs under, put in place by the launch (common.launch), never by
the methods: the traced torch.distributed calls (every collective and point-to-point call a
rank's main thread makes, seen by the observers below); the device audit (``DeviceAudit``,
``KIT_DEVICE_AUDIT=1``: a GPU's device rules on a CPU run, so a host tensor given to a
collective or mixed with a device one fails here as on a GPU); the flight recorder
(``FlightRecorder``: each rank's calls, published to the job's store every second); the
stall report (``diagnose``, ``StallWatch``: the rank the others wait for, named in
seconds); and --check-collectives (each collective compared across its group before it
runs, ``CollectiveMismatch``). Used by common.py's launcher and by the tests; it imports
nothing of the kit (what the recorder costs a step is common.recorder_modes,
``make recorder-cost``); the copyable classes never import it.
"""
from __future__ import annotations

import contextlib
import dis
import json
import linecache
import os
import platform
import sys
import threading
import time
import weakref
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

_RECORDER = []   # the flight recorder of the job this process runs now
# the opcodes a thread blocked in C is found at (the call that blocks), on Pythons 3.10 to 3.13
_CALL_OPS = {"CALL", "PRECALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_KW"}


# torch.distributed's functions a rank may wait in: wrapped in each worker by the launch
# (never by the methods), so that every observer sees each call, whoever makes it (a script,
# a copied class, torch's own classes that call them by these names). Calls from threads
# other than the main one pass straight through.
COLLECTIVE_CALLS = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                    "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
                    "scatter", "barrier")
P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
OBJECT_CALLS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")
TRACED_CALLS = COLLECTIVE_CALLS + P2P_CALLS + OBJECT_CALLS
# calls whose every rank gives tensors of the same shape (the others: a root's list, uneven splits)
SAME_SHAPES = {"all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter"}
# calls traced as the ProcessGroup method that torch's function makes (so once, whoever calls
# which): a class that must hold the Work calls the method itself (05's DDPBucketed)
METHOD_CALLS = {"all_reduce_coalesced": "allreduce_coalesced"}


def call_tensors(op, args, kwargs) -> list:
    """The tensors a torch.distributed call was given (a P2POp's included)."""
    out = []
    for a in list(args) + list(kwargs.values()):
        if torch.is_tensor(a):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for x in a for t in ([x] if torch.is_tensor(x) else [getattr(x, "tensor", None)])
                    if torch.is_tensor(t)]
    return out


class _P2POp(dist.P2POp):
    """dist.P2POp taking a wrapped isend/irecv (torch checks the op by identity; the op stays
    the wrapped one, so code comparing it with dist.isend still finds it)."""

    def __new__(cls, op, *args, **kwargs):
        return super().__new__(cls, _real(op), *args, **kwargs)


def _real(fn):
    """torch's own function behind one of our traced wrappers (any other function as it is:
    torch's own may carry a __wrapped__ of its own decorators)."""
    return fn.__wrapped__ if getattr(fn, "_kit_traced", False) else fn


def _unwrapped_ops(ops):
    """batch_isend_irecv's list with torch's own isend/irecv (it tells them apart by identity)."""
    out = []
    for p in ops:
        q = object.__new__(type(p))
        q.__dict__.update(p.__dict__, op=_real(p.op))
        out.append(q)
    return out


_OBSERVERS = []   # what watches the calls in this process (the device audit, the flight recorder)


def _traced(name, fn, method=False):
    """``fn`` (torch.distributed's function ``name``, or with ``method`` a ProcessGroup's own
    method, (group, tensors, options)) with every observer told of each call."""
    import inspect
    params = [] if method else list(inspect.signature(fn).parameters)
    where = {k: params.index(k) for k in ("group", "async_op") if k in params}

    def traced(*args, **kwargs):
        if name == "batch_isend_irecv":   # torch's own isend/irecv, from any thread (a GPU's backward
            args = (_unwrapped_ops(args[0]), *args[1:])   # runs on autograd's device thread)
        if not _OBSERVERS or threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        if method:   # its options say whether it is asynchronous (their default: it is)
            group, opts = args[0], kwargs.get("opts", args[2] if len(args) > 2 else None)
            async_op = getattr(opts, "asyncOp", True)
        else:
            group = kwargs.get("group", args[where["group"]] if len(args) > where.get("group", 1 << 30) else None)
            async_op = name in ("isend", "irecv", "batch_isend_irecv") or \
                kwargs.get("async_op", args[where["async_op"]] if len(args) > where.get("async_op", 1 << 30) else False)
        tokens = [o.enter(name, args, kwargs, group, async_op) for o in list(_OBSERVERS)]
        result = fn(*args, **kwargs)
        for o, token in zip(list(_OBSERVERS), tokens):
            o.exit(token, result)
        return result
    # torch.compile leaves the wrapper to run eagerly (a clean graph break where the call is,
    # as for the call itself), rather than tracing into the recorder's bookkeeping
    traced = torch.compiler.disable(traced)
    traced.__wrapped__, traced.__name__, traced.__doc__, traced._kit_traced = fn, fn.__name__, fn.__doc__, True
    return traced


@contextlib.contextmanager
def traced_calls(observer):
    """Inside the block, ``observer.enter(op, args, kwargs, group, async_op)`` runs before
    every call of TRACED_CALLS this process's main thread makes (it may raise: the call does
    not run) and ``observer.exit(its token, the call's result)`` after it returns. The first
    observer puts the wrappers in place, the last one out takes them away."""
    if not _OBSERVERS:
        _traced_calls_real.update({name: getattr(dist, name) for name in TRACED_CALLS
                                   if hasattr(dist, name) and name not in METHOD_CALLS})
        for name, fn in _traced_calls_real.items():
            setattr(dist, name, _traced(name, fn))
        _traced_calls_real["P2POp"] = dist.P2POp
        dist.P2POp = _P2POp
        for name, method in METHOD_CALLS.items():   # (the class's own entry: what binds it to a group)
            _traced_methods_real[method] = vars(dist.ProcessGroup).get(method)
            setattr(dist.ProcessGroup, method, _traced(name, getattr(dist.ProcessGroup, method), method=True))
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
        if not _OBSERVERS:
            for name, fn in _traced_calls_real.items():
                setattr(dist, name, fn)
            for method, entry in _traced_methods_real.items():
                if entry is None:
                    delattr(dist.ProcessGroup, method)
                else:
                    setattr(dist.ProcessGroup, method, entry)
            _traced_calls_real.clear()
            _traced_methods_real.clear()


_traced_calls_real, _traced_methods_real = {}, {}


# ----------------------------------------------------------------------------------------
# The device audit: a GPU's device rules on a CPU run
# ----------------------------------------------------------------------------------------
AUDIT_ENV = "KIT_DEVICE_AUDIT"   # =1: a CPU job runs under DeviceAudit (the tests' way to see GPU-only bugs)
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_RESOLVED = {}   # a frame's file, as imported -> where it is (links followed)


def _resolved(path: str) -> str:
    where = _RESOLVED.get(path)
    if where is None:
        where = _RESOLVED[path] = str(Path(path).resolve())
    return where


def _in_torch(path: str) -> bool:
    """Whether a frame's file is torch's, wherever it was imported from: a path through a
    link (a virtual environment reached by a symbolic link) is where the link leads, and a
    neighbour whose name starts the same (torchvision) is not torch."""
    return _resolved(path).startswith(_TORCH_DIR)

# where a GPU would put a tensor: HOST (made without a device, or by .cpu()), DEVICE (made on
# the job's device, or moved there); a tensor made by neither rule (autograd's gradients, a
# tensor unpickled from the parent) is not known and never blamed
HOST, DEVICE = "host", "device"
_FACTORIES = {"tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace",
              "rand", "randn", "randint", "randperm", "eye", "scalar_tensor", "empty_strided", "normal",
              "tril_indices", "triu_indices"}
# calls that may take tensors of both kinds on a GPU (a copy across, host indices, moving)
_MAY_MIX = {"copy_", "__setitem__", "__getitem__", "index_put_", "index_put", "to", "cpu", "cuda", "set_", "__set__",
            "__get__", "_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "size", "dim", "numel",
            "stride", "element_size", "data_ptr", "untyped_storage", "backward", "grad", "__repr__", "__format__"}


_FILES = {}   # a frame's file -> its name, or None where the walk skips it (torch's; the kit's library, if asked)
# the kit's library: a call made inside it is blamed on the line that called into it (a
# script's, a test's, a user's), not on the library's own line
_LIBRARY = {str(Path(__file__).resolve().parent / f) for f in ("common.py", "diagnostics.py", "placement.py",
                                                                 "sharded_checkpoint.py")}


def _caller(depth: int, skip_library: bool) -> str:
    """file:line of the first frame from ``depth`` up (as the calling function's
    sys._getframe counts) outside torch (and the kit's library files, with
    ``skip_library``): where a tensor was made, or a collective called."""
    f = sys._getframe(depth + 1)
    while f is not None:
        path = f.f_code.co_filename
        key = (path, skip_library)
        name = _FILES.get(key, 0)
        if name == 0:
            skip = _in_torch(path) or (skip_library and _resolved(path) in _LIBRARY)
            name = _FILES[key] = None if skip else os.path.basename(path)
        if name is not None:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


# values no tensor hides in (torch.Size is a pytree node of ints)
_PLAIN = (int, float, bool, complex, str, type(None), type(...), slice, torch.dtype, torch.device, torch.Size,
          torch.layout, torch.memory_format)


def _tensors(tree, out=None) -> list:
    """The tensors among a call's arguments or results, in pytree's order: tensors, plain
    values and the tuples, lists and dicts of them (nearly every call) read here, anything
    else by pytree (the audit's cost on a nano LM's step here: 6 %, 18 % with pytree for all)."""
    out = [] if out is None else out
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            _tensors(x, out)
    elif kind is dict:
        for x in tree.values():
            _tensors(x, out)
    elif isinstance(tree, torch.Tensor):
        out.append(tree)
    elif kind not in _PLAIN:
        out.extend(t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))
    return out


class DeviceAudit(torch.overrides.TorchFunctionMode):
    """A GPU's device rules on a CPU run. Each tensor gets the place a GPU run would give
    it: HOST when made without a device (``torch.tensor(x)``, a factory with no ``device=``
    or with ``device="cpu"``) or by ``.cpu()``; DEVICE when made with ``device=`` the job's
    device, moved there (``.to(device)``) or computed from a DEVICE tensor. Then, as on a
    GPU: an op that mixes a HOST tensor of one or more dimensions with a DEVICE tensor
    raises ("Expected all tensors to be on the same device"), and so does a collective
    given a HOST tensor (NCCL refuses it), each naming where the host tensor was made. A
    move between the two copies, as on a GPU. Tests run jobs under it (``KIT_DEVICE_AUDIT=1``):
    the two classes of bug that only a GPU run showed, on the CPU."""

    def __init__(self):
        super().__init__()
        import collections
        from torch.utils.weak import WeakIdKeyDictionary
        self.place = WeakIdKeyDictionary()   # tensor -> (HOST or DEVICE, where a HOST tensor was made)
        # the torch.device objects ``t.device`` gave lately, with t's place: ``x.to(t.device)``
        # goes where t is (on a CPU run every device object reads "cpu", host or not)
        self.devices = collections.OrderedDict()

    def of(self, t):
        return self.place.get(t, (None, ""))

    def _check_mix(self, name, tensors):
        host = [t for t in tensors if self.of(t)[0] == HOST and t.dim() > 0]
        if host and any(self.of(t)[0] == DEVICE for t in tensors):
            raise RuntimeError(f"device audit: {name} mixes a host tensor (made at {self.of(host[0])[1]}) with a "
                               f"tensor on the job's device: on a GPU this raises 'Expected all tensors to be on "
                               f"the same device'")

    def enter(self, op, args, kwargs, group=None, async_op=False):   # (an observer of traced_calls)
        self.check_call(op, args, kwargs)

    def exit(self, token, result):
        pass

    def check_call(self, op, args, kwargs):
        """A collective's tensors: a HOST one is what NCCL refuses (an object collective
        pickles its objects to the device itself)."""
        if op in OBJECT_CALLS:
            return
        for t in call_tensors(op, args, kwargs):
            place, made = self.of(t)
            if place == HOST:
                raise RuntimeError(f"device audit: dist.{op} was given a host tensor (made at {made}): on a GPU, "
                                   f"NCCL refuses it ('No backend type associated with device type cpu'); make it "
                                   f"on the job's device")

    def _target(self, name, method, args, kwargs, has_inputs):
        """HOST or DEVICE where the call says where its result goes, else None (inherited)."""
        if method and name == "cpu":
            return HOST
        if method and name == "cuda":
            return DEVICE
        where = kwargs.get("device")
        if method and name == "to" and where is None:
            where = next((a for a in args[1:] if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)),
                         None)
            other = next((a for a in args[1:] if torch.is_tensor(a)), None)
            if where is None and other is not None:
                return self.of(other)[0]
        if where is None:   # a factory with no device (or device=None) makes a host tensor, as on a GPU
            return HOST if (not method and name in _FACTORIES and not has_inputs) else None
        seen = self.devices.get(id(where))
        if seen is not None and seen[0] is where:   # some tensor's .device: where that tensor is
            return seen[1]
        return HOST if isinstance(where, str) and where.startswith("cpu") else DEVICE

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        method = getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor."))
        inputs = _tensors((args, kwargs))
        if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "device":
            out = func(*args, **kwargs)
            self.devices[id(out)] = (out, self.of(args[0])[0])
            if len(self.devices) > 256:
                self.devices.popitem(last=False)
            return out
        if name == "__set__":   # tensor.data = x (the tensor now lives where x does); tensor.grad = x
            attr, (obj, value) = getattr(getattr(func, "__self__", None), "__name__", ""), args[:2]
            if attr == "grad" and torch.is_tensor(value):
                self._check_mix("assigning .grad", [obj, value])
            out = func(*args, **kwargs)
            if attr == "data" and torch.is_tensor(value) and value in self.place:
                self.place[obj] = self.place[value]
            return out
        if name not in _MAY_MIX:
            self._check_mix(name, inputs)
        target = self._target(name, method, args, kwargs, bool(inputs))
        out = func(*args, **kwargs)
        if target is not None and method and name in ("to", "cpu", "cuda") and out is args[0] \
                and self.of(out)[0] != target:
            out = out.clone()   # a move between host and device copies, as on a GPU
        outs = _tensors(out)
        if target is None:   # inherited: from the inputs of one or more dimensions first, then the scalars
            wide = [t for t in inputs if t.dim() > 0] or inputs
            kinds = [self.of(t)[0] for t in wide]
            target = DEVICE if DEVICE in kinds else (HOST if kinds and all(k == HOST for k in kinds) else None)
            made = next((self.of(t)[1] for t in wide if self.of(t)[0] == HOST), "")
        else:
            made = _caller(1, skip_library=False) if target == HOST else ""
        if target is not None:
            for t in outs:
                if not any(t is i for i in inputs):
                    self.place[t] = (target, made)
        return out


class _Shipped:
    """A tensor sent through an object collective with its place: it arrives with it (a
    pickled tensor arrives on a GPU where it was, host or device)."""

    def __init__(self, tensor, place):
        self.tensor, self.place = tensor, place

    def __reduce__(self):
        return _arrive, (self.tensor, self.place)


def _arrive(tensor, place):
    if _AUDITS:
        _AUDITS[-1].place[tensor] = place
    return tensor


_AUDITS = []   # the audit this process runs under (device_audit)
# which argument is sent: its place, and its name (torch.distributed.checkpoint passes it by keyword)
_SENT_ARG = {"all_gather_object": (1, "obj"), "gather_object": (0, "obj"), "broadcast_object_list": (0, "object_list")}


@contextlib.contextmanager
def device_audit():
    """Run the block under DeviceAudit, its collectives checked (see DeviceAudit)."""
    audit = DeviceAudit()

    def ship(obj):
        if torch.is_tensor(obj):
            return _Shipped(obj, audit.place[obj]) if obj in audit.place else obj
        if isinstance(obj, dict):
            return {k: ship(v) for k, v in obj.items()}
        return type(obj)(ship(v) for v in obj) if type(obj) in (list, tuple) else obj

    def unship(obj):
        if isinstance(obj, _Shipped):
            return obj.tensor
        if isinstance(obj, dict):
            return {k: unship(v) for k, v in obj.items()}
        return type(obj)(unship(v) for v in obj) if type(obj) in (list, tuple) else obj

    def shipping(name, real):   # an object collective whose tensors keep their place on arrival
        which, keyword = _SENT_ARG[name]

        def call(*args, **kwargs):
            args = list(args)
            if name == "broadcast_object_list":   # the list is sent from one rank, filled on the others
                listed = args[0] if args else kwargs.pop(keyword)
                sent = [ship(o) for o in listed]
                out = real(sent, *args[1:], **kwargs)
                listed[:] = [unship(o) for o in sent]
                return out
            if len(args) > which:
                args[which] = ship(args[which])
            elif keyword in kwargs:
                kwargs[keyword] = ship(kwargs[keyword])
            return real(*args, **kwargs)
        call.__wrapped__ = real
        return call
    saved = {name: getattr(dist, name) for name in _SENT_ARG}
    new = nn.Parameter.__new__

    def parameter(cls, data=None, requires_grad=True):   # a Parameter lives where its data does
        p = new(cls, data, requires_grad)
        if data is not None and data in audit.place:
            audit.place[p] = audit.place[data]
        return p
    nn.Parameter.__new__ = staticmethod(parameter)
    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):   # (materialize): torch refuses to swap a tensor the audit's table holds weakly
        p1, p2 = audit.place.pop(t1, None), audit.place.pop(t2, None)
        swap(t1, t2)
        for t, place in ((t1, p2), (t2, p1)):   # each object now holds the other's data, and its place
            if place is not None:
                audit.place[t] = place
    torch.utils.swap_tensors = swap_tensors
    _AUDITS.append(audit)
    try:
        with traced_calls(audit):
            for name, real in saved.items():
                setattr(dist, name, shipping(name, getattr(dist, name)))
            with audit:
                yield audit
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
        _AUDITS.remove(audit)
        nn.Parameter.__new__ = staticmethod(new)
        torch.utils.swap_tensors = swap


# ----------------------------------------------------------------------------------------
# The flight recorder: every call a rank enters and completes, stalls named, mismatches refused
# ----------------------------------------------------------------------------------------
CHECK_ENV = "KIT_CHECK_COLLECTIVES"   # =1: --check-collectives in every job (the tests set it)
RECORDER_SIZE = 4096                  # calls a rank remembers
BEAT = 1.0                            # seconds between a rank's published states
_POST = 0.02                          # seconds a compared call waits before posting its whole signature
_SLICE = 1.0                          # seconds between looks at where the missing ranks are


def _next_pause(pause, waited):
    """The next pause of a rank polling for the others at a compared call: doubling from
    50 us to 5 ms, then growing with the wait, a tenth of it, to at most 0.1 s. A rank
    that waits long (while another computes a one-process reference, or in a pipeline's
    bubble) looks a few times a second, not 200 (each look is one to three store round
    trips), and starts its call at most a tenth of its wait (5 ms for a short one) late."""
    return min(2 * pause, max(0.005, 0.1 * waited), 0.1)


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives at the same place of a group (--check-collectives)."""


def _places(thread_id, limit=None) -> list:
    """(code, line, bytecode offset) of a thread's frames, innermost first, ``limit`` of them
    at most, read without keeping any frame: a frame held past its function's return would
    keep the function's locals, the thread's tensors, alive."""
    places, frame = [], sys._current_frames().get(thread_id)
    while frame is not None and len(places) != limit:
        places.append((frame.f_code, frame.f_lineno, frame.f_lasti))
        frame = frame.f_back
    return places


def _stack(thread_id, limit=6) -> list:
    """The last ``limit`` frames of a thread's Python stack, outside torch, as file:line func:
    code (the lines of source looked up once its frames are let go: that may read a file)."""
    lines = []
    for code, line, _ in _places(thread_id):
        path = code.co_filename
        if _in_torch(path) or path == threading.__file__:
            continue
        linecache.checkcache(path)
        lines.append(f"{Path(path).name}:{line} {code.co_name}: {linecache.getline(path, line or 0).strip()}")
        if len(lines) == limit:
            break
    return lines


class FlightRecorder:
    """One rank's record of the torch.distributed calls its main thread makes (a ring of
    RECORDER_SIZE): for each, its sequence number on its group (a point-to-point call: on
    the pair, each direction apart), the op, the group, shapes and dtype, where it was
    called, and when it was entered and completed (an async call: when its work was seen
    done). A thread publishes the rank's state to the job's store every BEAT seconds: its
    calls in flight, the last it completed, how far it is on each group, and, while it is in
    no call, its Python stack. The launcher (or, under torchrun, the first rank still
    beating) reads every rank's state and names a stall (``diagnose``). With ``check``,
    every collective's signature (op, group, shapes, dtype, place) is compared with the
    other ranks' before it runs: a rank calling something else is refused at once
    (CollectiveMismatch, on every rank that sees it, naming each rank's call and line)."""

    def __init__(self, ctx, store, check=False, stall_report=30.0, timeout=300.0):
        import collections
        self.rank, self.world, self.store, self.check = ctx.rank, ctx.world_size, store, check
        self.stall_report, self.timeout = stall_report, timeout
        self.calls = collections.deque(maxlen=RECORDER_SIZE)
        self.seq, self.groups, self.flight, self.done, self.on = {}, {}, [], None, True
        self._names = weakref.WeakKeyDictionary()   # group -> its name (held, a group would keep its threads)
        self.unsettled = []   # --check-collectives: async collectives whose comparison is not settled yet
        self.entered, self.completed, self.stopped = 0, 0, threading.Event()
        self._calls_seen = None   # (entered, completed) at the last state: whether the rank moved since
        self.main = threading.main_thread()
        self.watch = None   # under torchrun: this rank's StallWatch (the first rank still beating reports)
        self._publish(stack=False)
        self.thread = threading.Thread(target=self._beat, name="kit-flight-recorder", daemon=True)
        self.thread.start()
        _stop_when(self.rank, self.main, self.stopped)

    # -- the calls
    def _group(self, group):
        """(name, global ranks) of a process group (None: the world), cached by the object."""
        pg = group or dist.group.WORLD
        name = self._names.get(pg)
        if name is None:
            name = self._names[pg] = pg.group_name
            self.groups[name] = dist.get_process_group_ranks(pg)
        return name, self.groups[name]

    def enter(self, op, args, kwargs, group, async_op):
        if not self.on:
            return None
        name, ranks = self._group(group)
        tensors = call_tensors(op, args, kwargs)
        if op in P2P_CALLS:
            pairs = self._pairs(op, args, kwargs, group, name)
        else:
            pairs = [name]
        seqs = []
        for key in pairs:
            self.seq[key] = self.seq.get(key, 0) + 1
            seqs.append(self.seq[key])
        rec = {"op": op, "group": name, "ranks": ranks, "keys": pairs, "seqs": seqs,
               "shapes": [list(t.shape) for t in tensors[:4]], "dtype": str(tensors[0].dtype)[6:] if tensors else "",
               "site": _caller(2, skip_library=True), "t0": time.time(), "t1": None, "async": bool(async_op), "works": []}
        self.calls.append(rec)   # (appends and removes of lists are atomic: the beat thread copies them)
        self.entered += 1
        self.flight.append(rec)
        if self.check and op not in P2P_CALLS:   # (before the call: a mismatch is refused, not run)
            try:
                self._settle()
                self._compare(rec, wait=not async_op)
            except dist.DistNetworkError as e:   # its store's server is gone (torchrun's agent killed, its
                self.check = False               # ranks living on): the run goes on, unchecked, and says so
                print(f"rank {self.rank}: the checks of each collective stop: their store is gone "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                      f"training goes on", file=sys.stderr, flush=True)
        return rec

    def _pairs(self, op, args, kwargs, group, name) -> list:
        """The sequence keys of a point-to-point call: "group:src>dst" for each message."""
        ops = args[0] if op == "batch_isend_irecv" else [None]
        keys = []
        for p in ops:
            if p is not None:
                kind = "send" if getattr(p.op, "__name__", "") == "isend" else "recv"
                g, peer = p.group, p.peer
            else:
                kind = "send" if op in ("send", "isend") else "recv"
                g = group
                peer = kwargs.get("dst" if kind == "send" else "src", args[1] if len(args) > 1 else None)
                gp = kwargs.get("group_dst" if kind == "send" else "group_src")
                if peer is None and gp is not None:
                    peer = dist.get_global_rank(g or dist.group.WORLD, gp)
            gname = self._group(g)[0]
            keys.append(f"{gname}:{self.rank}>{peer}" if kind == "send" else f"{gname}:{peer}>{self.rank}")
        return keys

    def exit(self, rec, result):
        if rec is None:
            return
        if rec["async"] and result is not None:
            import weakref
            works = result if isinstance(result, (list, tuple)) else [result]
            rec["works"] = [weakref.ref(w) for w in works if w is not None]
        if not rec["works"]:
            self._complete(rec)

    def _complete(self, rec):
        rec["t1"], rec["works"] = time.time(), []
        self.completed += 1
        flight = self.flight
        if flight and flight[-1] is rec:
            flight.pop()
        else:
            for i, r in enumerate(flight):
                if r is rec:
                    del flight[i]
                    break
        self.done = rec

    # -- --check-collectives: every rank's signature of each collective, before it runs
    def _compare(self, rec, wait=True):
        """Every rank of the call's group adds one to a counter named by the call's place and
        signature (op, group, shapes where they must match, dtype): where all agree it
        reaches the group's size, one store round trip for the last to come. A rank still
        waiting after _POST seconds posts its whole call (and where it is) and compares it
        with those the others posted: a rank at that place with another call, or one waiting
        in another group's call that this rank has not reached, is a mismatch. An async call
        (``wait`` False) does not wait: its comparison is settled at this rank's next calls
        (_settle), so a timed wait on its work (08's evaluation guard) still times out."""
        key, seq, ranks = rec["keys"][0], rec["seqs"][0], rec["ranks"]
        if len(ranks) == 1:
            return
        mine = {"op": rec["op"], "shapes": rec["shapes"], "dtype": rec["dtype"], "site": rec["site"],
                "group": key, "seq": seq, "ranks": ranks}
        sign = _signature(mine, rec["op"])
        count = f"n/{key}/{seq}/{zlib.crc32(json.dumps(sign).encode()):08x}"
        if self.store.add(count, 1) == len(ranks):
            return
        if not wait:
            self.unsettled.append((count, mine, sign, time.time(), [False], set()))
            return
        others = [r for r in ranks if r != self.rank]
        start, pause, posted, look, compared = time.time(), 5e-5, False, 0.0, set()
        while self.store.add(count, 0) < len(ranks):   # (polled: a store's wait that times out logs warnings)
            time.sleep(pause)
            now = time.time()
            pause = _next_pause(pause, now - start)
            if now > start + self.timeout:
                raise RuntimeError(f"--check-collectives: the other ranks did not call #{seq} on "
                                   f"{_label(key, ranks, self.world)} within --timeout {self.timeout:g} s")
            if now < start + _POST:
                continue
            if not posted:
                self.store.set(f"now/{self.rank}", json.dumps(mine))
            self._posted_mismatch(mine, sign, posted, compared)
            posted = True
            if now < look:
                continue
            look = now + _SLICE
            for r in others:   # a rank that waits in another group's call we have not entered
                if not self.store.check([f"now/{r}"]):
                    continue
                theirs = json.loads(self.store.get(f"now/{r}"))
                g = theirs["group"]
                if g != key and self.rank in theirs["ranks"] and self.seq.get(g, 0) < theirs["seq"]:
                    raise CollectiveMismatch(_mismatch_text(key, seq, {self.rank: mine, r: theirs}, self.world))

    def _settle(self):
        """The comparisons of this rank's earlier async collectives: those every rank has
        reached are done; one still short after _POST seconds posts its call and compares it
        with what the others posted there (a mismatch raises now, refusing the next call)."""
        now = time.time()
        for item in list(self.unsettled):
            count, mine, sign, t0, posted, compared = item
            if self.store.add(count, 0) == len(mine["ranks"]):
                self.unsettled.remove(item)
                continue
            if now < t0 + _POST:
                continue
            try:
                self._posted_mismatch(mine, sign, posted[0], compared)
            except CollectiveMismatch:
                self.unsettled.clear()
                raise
            posted[0] = True

    def _posted_mismatch(self, mine, sign, posted, compared):
        """Post this rank's call at its place (unless ``posted``) and compare it with what the
        group's other ranks posted there: one with another signature is a mismatch. A post
        never changes: ``compared`` holds the ranks whose post matched, not read again (on 8
        ranks of 2 cores a wait past _POST is common, and each look was 7 store round trips)."""
        key, seq = mine["group"], mine["seq"]
        if not posted:
            self.store.set(f"sig/{key}/{seq}/{self.rank}", json.dumps(mine))
        for r in mine["ranks"]:
            k = f"sig/{key}/{seq}/{r}"
            if r != self.rank and r not in compared and self.store.check([k]):
                theirs = json.loads(self.store.get(k))
                if _signature(theirs, mine["op"]) != sign:
                    raise CollectiveMismatch(_mismatch_text(key, seq, {self.rank: mine, r: theirs}, self.world))
                compared.add(r)

    # -- the published state
    def _state(self, stack=True) -> dict:
        for rec in list(self.flight):   # async calls whose work is done (or dropped)
            if rec["works"] and all(w() is None or w().is_completed() for w in rec["works"]):
                rec["t1"], rec["works"] = time.time(), []
                with contextlib.suppress(ValueError):
                    self.flight.remove(rec)
                self.done = rec
                self.completed += 1
        flight = [_brief(r) for r in list(self.flight)]
        done = _brief(self.done) if self.done else None
        seq = dict(self.seq)
        blocked = any(r["t1"] is None and not r["async"] for r in self.flight)
        # the main thread's stack is read only where it made no call since the last state: a
        # rank that calls is not stuck, and reading another thread's frames is not safe on
        # CPython 3.11 (a frame object read while its thread pops it: SIGSEGV in f_back, rare;
        # twice in the suite's CI runs, each a rank's death in these looks, 33 a second a rank)
        calls = (self.entered, self.completed)
        moved, self._calls_seen = calls != self._calls_seen, calls
        looked = stack and not blocked and not moved
        lines = _stack(self.main.ident) if looked else []
        frames = self._frames() if looked else None
        # t: when the state is whole, after the looks (a starved thread's looks may take seconds)
        return {"rank": self.rank, "pid": os.getpid(), "host": platform.node(), "t": time.time(),
                "flight": flight, "done": done, "seq": seq, "groups": self.groups, "stack": lines,
                "entered": self.entered, "completed": self.completed, "cpu": self._cpu(), "frames": frames}

    def _frames(self, samples=32) -> dict:
        """Where the main thread is, looked at ``samples`` times half a millisecond apart:
        each look its innermost three frames (torch's included) as file:line:bytecode
        offset, and whether any look found it between calls ("running": it executes Python
        bytecode; a thread blocked in C, waiting or computing, is always found in the call
        that blocks). A thread running Python is only seen where it lets the GIL go (mostly
        at one call of a tight loop), hence many looks."""
        seen, running = set(), False
        for i in range(samples):
            places = _places(self.main.ident, 3)
            if not places:
                break
            ops, lasti = places[0][0].co_code, places[0][2]
            running |= 0 <= lasti < len(ops) and dis.opname[ops[lasti]] not in _CALL_OPS
            seen.add(" <- ".join(f"{os.path.basename(c.co_filename)}:{line}:{at}" for c, line, at in places))
            if i + 1 < samples:
                time.sleep(0.0005)
        return {"at": sorted(seen), "running": running}

    def _cpu(self) -> float | None:
        """Seconds of CPU the main thread has used (None where the OS does not say)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.main.ident))
        except (AttributeError, OSError):
            return None

    def _publish(self, stack=True):
        self.store.set(f"state/{self.rank}", json.dumps(self._state(stack)))

    def _beat(self):
        while not self.stopped.wait(BEAT):
            try:
                self._publish()
                if self.watch is not None:
                    self.watch.tick()
            except Exception:   # the store went away: the job is ending
                return

    def finish(self):
        """The worker returned or raised: its last state says so; the beat stops."""
        self.stopped.set()
        self.thread.join(2 * BEAT)
        with contextlib.suppress(Exception):
            state = self._state()
            state["finished"] = True
            self.store.set(f"state/{self.rank}", json.dumps(state))


# Fault injection for the stall tests: {"rank": R, "in": TEXT, "file": PATH} makes rank R of a
# job stop itself (SIGSTOP) as soon as its main thread's stack holds a frame whose
# "file:function" contains TEXT (torch's frames included: "distributed.py:forward" is inside
# torch DDP's forward), after writing the time to PATH
STOP_ENV = "KIT_STOP_WHEN"


def _stop_when(rank, main, stopped):
    spec = json.loads(os.environ.get(STOP_ENV) or "null")
    if not spec or spec["rank"] != rank:
        return

    def look():
        import signal
        while not stopped.wait(0.001):
            if any(spec["in"] in f"{os.path.basename(c.co_filename)}:{c.co_name}" for c, _, _ in _places(main.ident)):
                with open(spec["file"], "w") as out:
                    out.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return
    threading.Thread(target=look, name="kit-stop-when", daemon=True).start()


def _brief(rec) -> dict:
    return {k: rec[k] for k in ("op", "group", "ranks", "keys", "seqs", "shapes", "dtype", "site", "t0", "t1", "async")}


def _signature(s, op) -> tuple:
    shapes = s["shapes"] if op in SAME_SHAPES else [sh[1:] for sh in s["shapes"]] if op == "all_to_all_single" else []
    return s["op"], s["group"], json.dumps(shapes), s["dtype"] if op not in OBJECT_CALLS else ""


def _mismatch_text(key, seq, calls, world) -> str:
    first = calls[min(calls)]
    lines = [f"ranks {', '.join(map(str, sorted(calls)))} called different collectives as call #{seq} on "
             f"{_label(key, first['ranks'], world)}; refused before it ran (--check-collectives):"]
    for r in sorted(calls):
        c = calls[r]
        shapes = " ".join(f"[{','.join(map(str, sh))}]" for sh in c["shapes"][:2])
        lines.append(f"  rank {r}: {c['op']} #{c['seq']} on {_label(c['group'], c['ranks'], world)} "
                     f"({c['dtype']} {shapes}) at {c['site']}")
    return "\n".join(lines)


def _label(group, ranks, world) -> str:
    """"the world" (the default group, named "0"), or the group and its ranks."""
    return "the world" if group == "0" and len(ranks) == world else \
        f"group {group} (ranks {','.join(map(str, ranks))})"


def _call_text(c, world, now=None) -> str:
    """all_reduce #57 on the world (float32 [1024]) at 05_bucketed_ddp.py:238[, for 31 s]"""
    where = _label(c["group"], c["ranks"], world)
    if ":" in c["keys"][0]:   # point-to-point: the messages
        msgs = ", ".join(f"{k.split(':')[1].replace('>', ' to ')} #{s}" for k, s in zip(c["keys"], c["seqs"]))
        text = f"{c['op']} ({msgs}) on {where}"
    else:
        text = f"{c['op']} #{c['seqs'][0]} on {where}"
    shapes = " ".join(f"[{','.join(map(str, s))}]" for s in c["shapes"][:2])
    text += f" ({c['dtype']} {shapes})" if c["dtype"] else ""
    text += f" at {c['site']}"
    return text + (f", for {now - c['t0']:.0f} s" if now is not None else "")


def _process_state(pid, host) -> str | None:
    """"stopped" (SIGSTOP, a debugger), "gone", or None (running) for a process of this host."""
    if host != platform.node():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped (traced)", "Z": "gone", "X": "gone", "D": "in uninterruptible I/O"}.get(state)


def diagnose(states: dict, now: float, world: int, stall_after: float, alive=_process_state,
             history: dict | None = None) -> dict | None:
    """A stall from every rank's published state (FlightRecorder), or None. Three kinds, the
    first that applies:

    - some rank has waited ``stall_after`` seconds or more in a recorded call: each waiting
      rank's oldest call is followed to the ranks that have not entered it (by its sequence
      number on its group, or on its pair for a point-to-point message), and from those to
      the ones they wait for in turn; the first named are the ranks the others wait for at
      the end of that chain (busy in no call, not responding, finished, or waiting on a call
      nobody else reached) and the ranks that entered the same place of a group with
      another call (``_chain``). A rank whose recorder has gone silent is not taken at its
      last word: it is the one not responding, in whatever call it last said it was;
    - some rank has not responded for ``stall_after`` seconds (its process stopped or gone,
      or its recorder silent), whatever the others do: they may wait for it where the
      recorder cannot see (torch DDP's C++ reducer, a CUDA synchronize);
    - ``history`` (StallWatch's: when any rank last entered or completed a recorded call,
      and since when each rank's innermost frames have not moved) says that no rank has made
      progress for ``stall_after`` seconds while some rank in no recorded call has not
      moved: it may wait in a call the recorder cannot see.

    Returns {"culprits": [rank, ...], "text": the report, "first": one line naming the
    first, "stuck": the failure's first line, "kind", "silent": the ranks not responding}."""
    # a process this host sees stopped or gone is silent at once: its last state, published
    # up to a beat before it stopped, may still look fresh
    proc = {r: alive(s["pid"], s["host"]) for r, s in states.items() if not s.get("finished")}
    silent = {r for r in range(world) if r not in states or
              (not states[r].get("finished") and (now - states[r]["t"] > 3 * BEAT
                                                   or proc[r] in ("stopped", "stopped (traced)", "gone")))}
    flight = {r: s["flight"] for r, s in states.items() if s.get("flight") and r not in silent}
    waiting = {r: min(f, key=lambda c: c["t0"]) for r, f in flight.items()}
    stalled = {r: c for r, c in waiting.items() if now - c["t0"] >= stall_after}
    view = _View(states, now, world, silent, proc, waiting, history, stall_after)
    if stalled:
        return _chain(view, stalled)
    # a rank never seen: counted from the first state any rank published (they all publish
    # right after the same rendezvous), never while none has
    started = (history or {}).get("first") or min((s["t"] for s in states.values()), default=now)
    gone = [r for r in sorted(silent) if now - states.get(r, {}).get("t", started) >= stall_after]
    if gone and waiting:   # the others wait in recorded calls: where the chain leads, if to a silent rank
        d = _chain(view, waiting)
        if any(r in gone for r in d["culprits"]):
            return d
    if gone:
        plural = len(gone) > 1
        return view.report("silent", gone, f"stall: rank{'s' * plural} {', '.join(map(str, gone))} "
                                           f"{'are' if plural else 'is'} {view.status(gone[0])}",
                           f"rank {gone[0]} stuck first: {view.status(gone[0])}")
    if history is None or now - history["progress"] < stall_after:
        return None
    still = [r for r in range(world) if r in states and r not in silent and r not in waiting
             and not states[r].get("finished") and now - history["still"].get(r, now) >= stall_after]
    if not still:
        return None
    quiet = now - history["progress"]
    head = (f"stall: no rank entered or completed a recorded call for {quiet:.0f} s, and "
            f"rank{'s' * (len(still) > 1)} {', '.join(map(str, still))} {'have' if len(still) > 1 else 'has'} not "
            f"moved: {view.status(still[0])}")
    return view.report("still", still, head, f"rank {still[0]} stuck first: {view.status(still[0])}", notes=[
        "a rank whose stack does not move in no recorded call may wait in a call the recorder cannot see: "
        "torch's C++ reducer (torch DDP's buckets), a collective issued from another thread, a CUDA synchronize "
        "or .item() after an enqueued NCCL collective; or compute in one long operation"])


class _View:
    """What diagnose knows of every rank, and the report's table."""

    def __init__(self, states, now, world, silent, proc, waiting, history, stall_after):
        self.states, self.now, self.world, self.silent, self.proc = states, now, world, silent, proc
        self.waiting, self.history, self.stall_after = waiting, history or {}, stall_after

    def status(self, r) -> str:
        s, now = self.states.get(r), self.now
        if s is None:
            return "not responding: never started its recorder"
        if s.get("finished"):
            return "finished its work"
        if r in self.silent:
            how = self.proc[r]
            return (f"not responding: {how}" if how else "not responding (alive, its recorder silent)") + \
                f"; its last state is {now - s['t']:.0f} s old"
        if r in self.waiting:
            c = self.waiting[r]
            return f"waits {'for its async' if c['async'] else 'in'} {_call_text(c, self.world, now)}"
        since = self.history.get("still", {}).get(r)
        if since is not None and now - since >= self.stall_after:
            cpu = self.history.get("cpu", {}).get(r)
            used = f", {cpu:.1f} s of CPU meanwhile" if cpu is not None else ""
            where = f" at {s['stack'][0]}" if s.get("stack") else ""
            return f"in no recorded call, its stack unmoved for {now - since:.0f} s{where}{used}"
        return "busy in no call" + (f", at {s['stack'][0]}" if s.get("stack") else "")

    def report(self, kind, culprits, head, stuck, notes=(), waited=None) -> dict:
        rows = []
        for r in range(self.world):
            s = self.states.get(r, {})
            done = s.get("done")
            fresh = s and self.now - s["t"] <= 3 * BEAT
            where = s.get("stack", [])[:3] if fresh and (r not in self.waiting or self.waiting[r]["async"]) else []
            rows.append(f"| {r}{' *' if r in culprits else ''} | {self.status(r)} | "
                        f"{_call_text(done, self.world) if done else '-'} | {' <- '.join(where) or '-'} |")
        text = "\n".join([head + (waited or ""), *[f"  {n}" for n in notes],
                          "| rank | state | last call completed | where (innermost first) |", "|---|---|---|---|",
                          *rows])
        # unsure: a named rank not responding whose process this host does not see stopped or
        # gone (its recorder's thread starved, or its host another): its next state may tell more
        unsure = [r for r in culprits if r in self.silent and r in self.states and self.proc.get(r) is None]
        return {"culprits": culprits, "text": text, "first": f"rank {culprits[0]} {self.status(culprits[0])}",
                "stuck": stuck, "kind": kind, "silent": sorted(self.silent), "unsure": unsure}


def _chain(view, stalled) -> dict:
    """The stall of ranks waiting in recorded calls (diagnose's first kind)."""
    states, waiting, silent, world, now = view.states, view.waiting, view.silent, view.world, view.now

    def same_place(m, key, seq):
        """Rank m's call in flight at ``seq`` of ``key``, if any."""
        return next((x for x in states.get(m, {}).get("flight", []) if key in x["keys"]
                     and x["seqs"][x["keys"].index(key)] == seq), None)

    def behind(r, c):
        """The ranks that have not entered ``c`` (rank r's call), and those at its place with
        another call: [(rank, their call)]."""
        late, other = [], []
        for key, seq in zip(c["keys"], c["seqs"]):
            members = [int(x) for x in key.split(":")[1].split(">")] if ":" in key else c["ranks"]
            for m in members:
                if m == r:
                    continue
                if m in silent or states.get(m, {}).get("seq", {}).get(key, 0) < seq:
                    late.append(m)
                    continue
                theirs = same_place(m, key, seq)
                if theirs and (theirs["op"], theirs["shapes"], theirs["dtype"]) != (c["op"], c["shapes"], c["dtype"]):
                    other.append((m, theirs))
        return sorted(set(late)), other

    culprits, notes, kind = [], {}, "late"
    for r in sorted(stalled):
        seen, chain = {r}, [r]
        while True:
            here = chain[-1]
            late, other = behind(here, waiting[here])
            if other:
                kind = "mismatch"
                for m, theirs in other:
                    pair = tuple(sorted((here, m)))
                    calls = {here: waiting[here], m: theirs}
                    notes[pair] = "; ".join(f"rank {k} calls {_call_text(calls[k], world)}" for k in pair)
                culprits += [m for m in [here] + [m for m, _ in other] if m not in culprits]
                break
            roots = [m for m in late if m not in waiting]
            if roots:
                culprits += [m for m in roots if m not in culprits]
                break
            nxt = [m for m in late if m not in seen]
            if not nxt:
                if late:   # every late rank waits on a call this chain already holds: a cycle
                    kind = "cycle" if kind == "late" else kind
                    culprits += [m for m in chain if m not in culprits]
                    notes[tuple(chain)] = ("ranks " + ", ".join(map(str, chain)) + " wait for each other, each in a "
                                           "call another has not entered")
                break
            seen.add(nxt[0])
            chain.append(nxt[0])
    culprits = culprits or [min(stalled)]
    first, who = culprits[0], ", ".join(map(str, culprits))
    waiters = sorted(r for r in stalled if r not in culprits)
    waited = (f"; rank{'s' * (len(waiters) > 1)} {', '.join(map(str, waiters))} waited "
              f"{now - min(stalled[w]['t0'] for w in waiters):.0f} s") if waiters else ""
    if kind == "mismatch":
        head = f"stall: ranks {who} are in different calls at the same place of a group"
        stuck = f"ranks {who} called different collectives at the same place: " + " / ".join(notes.values())
    elif kind == "cycle":
        head = f"stall: ranks {who} wait for each other"
        stuck = f"ranks {who} stuck first, waiting for each other: " + "; ".join(
            f"rank {r} {view.status(r)}" for r in culprits)
    else:
        head = f"stall: the ranks wait for rank{'s' * (len(culprits) > 1)} {who} ({view.status(first)})"
        stuck = f"rank {first} stuck first: {view.status(first)} (the rank the others waited for)"
    return view.report(kind, culprits, head, stuck, notes.values(), waited)


class StallWatch:
    """Every rank's published state, read from the job's store; on a stall (``diagnose``:
    a rank waiting ``stall_report`` seconds in a recorded call, a rank not responding for
    that long, or no progress for that long with a rank whose stack does not move),
    ``tick()`` prints one table naming the ranks the others wait for, again at most every
    ``stall_report`` seconds while the stall lasts; ``diagnosis`` keeps the last one, for
    the failure report, until some rank makes progress again. Its history: when any rank
    last entered or completed a recorded call, and since when each rank's innermost frames
    (torch's included) have not moved. Under torchrun every rank watches and the first rank
    still beating prints (``me``)."""

    def __init__(self, store, world, stall_report, me=None, out=None):
        self.store, self.world, self.stall_report, self.me = store, world, stall_report, me
        self.out, self.diagnosis, self.shown = out or sys.stdout, None, 0.0
        now = time.time()
        self.history = {"progress": now, "still": {}, "cpu": {}}
        self._seen = {}   # rank -> (calls entered, completed, its innermost frames, CPU seconds then)

    def states(self) -> dict:
        keys = [f"state/{r}" for r in range(self.world)]
        got = {}
        for r, k in enumerate(keys):
            if self.store.check([k]):
                got[r] = json.loads(self.store.get(k))
        return got

    def _track(self, states, now):
        """The history from the states of this tick and the last one."""
        h = self.history
        if states and "first" not in h:
            h["first"] = now
        for r, s in states.items():
            calls = (s.get("entered", 0), s.get("completed", 0))
            frames = s.get("frames")
            before = self._seen.get(r)
            if before is None or calls != before[0]:
                h["progress"] = now if before is not None else h["progress"]
            moving = frames is None or frames["running"] or len(frames["at"]) != 1
            if before is None or frames != before[1] or moving or s.get("flight") or s.get("finished"):
                h["still"][r] = now
                h["cpu"].pop(r, None)
                self._seen[r] = (calls, frames, s.get("cpu"))
            else:
                self._seen[r] = (calls, frames, before[2])
                if s.get("cpu") is not None and before[2] is not None:
                    h["cpu"][r] = s["cpu"] - before[2]

    def tick(self):
        now, states, d = self._update()
        if d is None or now - self.shown < self.stall_report:
            return
        if self.me is not None:   # under torchrun: the first rank whose state is fresh prints
            fresh = [r for r, s in states.items() if r not in d["silent"] and not s.get("finished")]
            if not fresh or self.me != min(fresh):
                return
        self.shown = now
        print(d["text"], file=self.out, flush=True)

    def _update(self):
        """Read the states, track the history, diagnose: (now, states, this tick's diagnosis)."""
        now = time.time()
        states = self.states()
        progress = self.history["progress"]
        self._track(states, now)
        d = diagnose(states, now, self.world, self.stall_report, history=self.history)
        keep = self.diagnosis is not None and self.history["progress"] == progress and (
            any(s.get("flight") for s in states.values()) or self.diagnosis["kind"] in ("silent", "still"))
        self.diagnosis = d or (self.diagnosis if keep else None)
        return now, states, d

    def last_word(self, ticking=False, wait=3 * BEAT) -> dict | None:
        """The diagnosis a failed job names first (None: no stall). One that names a rank
        not responding while its process lives (on a loaded machine its recorder's thread
        may be starved for seconds) waits up to ``wait`` seconds for states that say more:
        read here, or, with ``ticking``, by the thread that ticks (a torchrun rank's beat)."""
        deadline = time.time() + wait
        while self.diagnosis is not None and self.diagnosis.get("unsure") and time.time() < deadline:
            time.sleep(0.1)
            if not ticking:
                self._update()
        return self.diagnosis
