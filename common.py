"""What every numbered script needs: flags, launching workers, the clock and timing
statistics, models and data, the verification harness, result files. The methods and
their training loops live in the numbered scripts; what their classes share lives in
placement.py and sharded_checkpoint.py, and what every job runs under (the flight
recorder, the stall report, the device audit) in diagnostics.py.

``launch(worker, args, *job)`` runs ``worker(ctx, args, *job)`` on every rank and returns
rank 0's result. Started plainly, a script spawns ``args.world_size`` processes itself;
under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set) the worker runs in the
current process. A rank that raises ends the whole job: the others are killed, and
``LaunchError`` names the rank and carries its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import gc
import importlib.util
import json
import math
import os
import pickle
import platform
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

# Importing torch and the kit makes some 250,000 objects that live as long as the process.
# The collector is off while they are made (left on, it walks them again and again: 0.2 s
# of CPU more in each script, launcher and torchrun worker here, 1.2 s against 1.4 s), then
# they are frozen out of its full passes (the last one as the process exits too: 0.25 s
# more), and it is back on as it was. (The few cycles the imports left unreachable, some
# 7,000 objects, about 1 MB, are frozen with them: collecting them first costs 0.1 s.)
_gc_was_on = gc.isenabled()
gc.disable()

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._python_dispatch
import torch.utils.checkpoint

import diagnostics
import placement
import result_files
import sharded_checkpoint
from result_files import folder_problem, save_file, unsaved, wrote   # (wrote: for the scripts)

# (in a spawned rank, which imports this module first, the frozen objects include all its
# fork server imported, whose pages then stay shared with the server)
gc.freeze()
if _gc_was_on:
    gc.enable()

ROOT = Path(__file__).resolve().parent
# runs of one's own land here (git ignores it); make all passes --out results, the tracked tables
DEFAULT_OUT = str(ROOT / "runs")
# Only the kit's own lines in the output: torch.profiler's kineto logs its start and stop
# ("USDT: ... profiler_start") and, on a CPU, its GPU probe, unless told not to before it
# starts (inherited by the fork server and every worker)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# Workers fork from a server that has imported torch once, instead of each importing it again;
# torch._dynamo too, which the first optimizer a process builds imports (2 s a rank here)
PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo"]
mp.set_forkserver_preload(PRELOAD)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class UsageError(Exception):
    """Bad input: run_main prints the message on one line and exits with status 2."""


class LaunchError(RuntimeError):
    """A rank failed (or a verification did); the message names it."""


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``finally`` runs (the ranks are
    ended and the job's files removed, as for Ctrl-C)."""


def _terminated(signum, frame):
    raise _Terminated()


def run_main(main_fn):
    """Run a script's main(): bad input exits 2 with one line, a failed rank exits 1, and so
    does a run whose results could not all be saved where asked (one line a folder, naming
    the files and where they went instead; save_file)."""
    prog = Path(sys.argv[0]).name
    _announce_next[:] = [True]
    result_files.reset()
    previous = None   # a kill (timeout, a scheduler) ends the ranks and cleans up like Ctrl-C
    if not under_torchrun() and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    code, message = 0, None
    try:
        main_fn()
    except UsageError as e:
        code, message = 2, f"error: {e}"
    except LaunchError as e:
        code, message = 1, f"error: {e}"
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except _Terminated:
        code, message = 128 + signal.SIGTERM, "terminated"
    finally:
        _announce_next.clear()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if under_torchrun() and dist.is_initialized():
            dist.destroy_process_group()
    lost = [f"error: {line}" for line in unsaved()]
    said = [message] * bool(message and (code != 2 or is_reporter()))   # (under torchrun every rank checks the
    for line in said + lost:                                                # same flags: rank 0 says it once)
        print(f"{prog}: {line}", file=sys.stderr)
    if code or lost:
        if message:
            torchrun_error_file(f"{prog}: {message}")
        sys.exit(code or 1)


def torchrun_error_file(line: str):
    """Under torchrun, ``line`` in the file where its agent reads a failed rank's error: its
    report's "traceback :" then shows this line, not a pointer to torch's docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and under_torchrun():
        with contextlib.suppress(OSError):
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)


# ----------------------------------------------------------------------------------------
# Flags and their checks
# ----------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


RANKS_PER_CORE = 4   # spawned processes a CPU core may carry (10's suite: 8 ranks on 2 cores)


def max_ranks(backend: str) -> int:
    """The most processes a spawned job may have here: NCCL a GPU each, otherwise
    RANKS_PER_CORE per CPU core (gloo ranks on a GPU share it, and the cores)."""
    return gpu_count() if backend == "nccl" else RANKS_PER_CORE * (os.cpu_count() or 1)


def check_ranks(n: int, backend: str, flag: str):
    """Refuse a spawned job larger than this machine can run (under torchrun the world is given)."""
    if not under_torchrun() and n > max_ranks(backend):
        if backend == "nccl":
            raise UsageError(f"{flag}: {n} NCCL ranks but {gpu_count()} GPU(s) here; {NCCL_HINT}, or fewer ranks")
        raise UsageError(f"{flag}: {n} processes on {os.cpu_count()} CPU core(s): at most {max_ranks(backend)} here "
                         f"({RANKS_PER_CORE} a core); use fewer, or torchrun over several machines")


def number(kind=int, lo=None, hi=None, *, above=None, hint=""):
    """An argparse ``type``: a finite ``kind`` (int or float) at least ``lo`` (or more than
    ``above``) and at most ``hi``; anything else (nan, inf, out of range) is refused by the
    parser, naming the flag (and adding ``hint``)."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{'a whole number' if kind is int else 'a number'} expected, "
                                             f"got {text!r}{hint}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"a finite number expected, got {text!r}{hint}")
        for bad, why in ((lo is not None and v < lo, f"at least {lo}"), (above is not None and v <= above,
                          f"more than {above}"), (hi is not None and v > hi, f"at most {hi}")):
            if bad:
                raise argparse.ArgumentTypeError(f"must be {why}, got {text}{hint}")
        return v
    parse.__name__ = kind.__name__
    return parse


COUNT = number(int, 1)          # a whole number of at least 1 (ranks, steps, chunks, experts ...)
COUNT0 = number(int, 0)         # at least 0 (warm-up steps)
SECONDS = number(float, above=0)
NONNEG = number(float, 0)


class KitParser(argparse.ArgumentParser):
    """argparse as the kit uses it: no abbreviations (a typo of one flag is never taken for
    another), every error a UsageError (one line, exit 2, before any worker starts), and
    --help that shows each flag's real default: the value a flag holds (after
    set_defaults) is appended to its help; a help whose flag has no fixed default (it
    follows the machine or other flags) says in its own words what it becomes."""

    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        raise UsageError(message)

    def format_help(self):
        for a in self._actions:
            if a.help in (None, argparse.SUPPRESS) or a.default is None or a.default is False \
                    or a.default is argparse.SUPPRESS:
                continue
            # the flag holds a value (set_defaults may have set it): that, not the words of a
            # computed default, is what it defaults to
            a.kit_help = getattr(a, "kit_help", a.help.split(" (default")[0])
            a.help = f"{a.kit_help} (default: {default_text(a.default)})"
        return super().format_help()


def default_text(v) -> str:
    if isinstance(v, (list, tuple)):
        return " ".join(map(default_text, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def script_parser(doc: str, default_steps=10, cpu_size="mini", gpu_size="xl",
                  world="GPUs if 2 or more, else 2",
                  batch="on GPU: 4, rounded up to a multiple of the ranks; on CPU: 2 x the ranks") -> KitParser:
    """The parser of a training script (02 onwards): its docstring as help, the shared flags.
    ``cpu_size``/``gpu_size``: the LM size a run gets on each device unless told; ``world``
    and ``batch``: what --world-size and --batch-size are by default, in words (where other
    flags decide them, say which)."""
    p = KitParser(description=doc.split("\n\n")[0])
    p.cpu_size, p.gpu_size = cpu_size, gpu_size
    p.add_argument("--world-size", type=COUNT, default=None,
                   help=f"processes to spawn (default: {world}; under torchrun, its world)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when there are enough GPUs, else gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda for nccl, cpu for gloo")
    p.add_argument("--model-size", default=None,
                   help=f"LM size, one of {', '.join(MODEL_SIZES)} (default: {cpu_size} on CPU, {gpu_size} on GPU)")
    p.add_argument("--batch-size", type=COUNT, default=None,
                   help=f"global batch, split across the data ranks (default: {batch})")
    p.add_argument("--context-length", type=COUNT, default=128, help="tokens a sequence")
    p.add_argument("--steps", type=COUNT, default=default_steps, help="measured steps")
    p.add_argument("--warmup", type=COUNT0, default=5,
                   help="warm-up steps, not measured (the collectives of the second are counted)")
    p.add_argument("--seed", type=COUNT0, default=0, help="seed of weights and data")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for results (make all writes results/)")
    p.add_argument("--timeout", type=SECONDS, default=300.0, help="seconds a collective may wait before the job fails")
    add_stall_flags(p)
    p.add_argument("--data", choices=["random", "mnist"], default="random", help="data for the verification")
    p.add_argument("--data-root", default=str(ROOT / "data"), help="where MNIST lives")
    p.add_argument("--download", action="store_true", help="download MNIST if missing")
    p.add_argument("--verify-steps", type=COUNT, default=5, help="training steps the verification compares")
    p.add_argument("--no-verify", action="store_true", help="skip the verification")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    return p


def add_stall_flags(p: argparse.ArgumentParser):
    """--stall-report and --check-collectives (the flight recorder's, read by launch)."""
    p.add_argument("--stall-report", type=SECONDS, default=30.0,
                   help="seconds a rank may wait in a collective before the job prints who it waits for (and again "
                        "every as many seconds while the stall lasts)")
    p.add_argument("--check-collectives", action="store_true",
                   help="compare every collective's op, group, shapes and dtype across the ranks before it runs: a "
                        "rank calling something else is refused at once, naming each rank's call and line")


def set_help(parser: argparse.ArgumentParser, dest: str, text: str):
    """A shared flag's help in a script where it means something narrower."""
    next(a for a in parser._actions if a.dest == dest).help = text


# Every script's names of the precisions (None: float32, nothing cast): --dtype's autocast
# (float32, bf16) and 07's --compute-dtype (FSDP computing in low precision: all three)
DTYPES = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST_DTYPES = ("float32", "bf16")   # fp16 autocast needs a gradient scaler: not offered


def add_dtype_flag(p: argparse.ArgumentParser):
    p.add_argument("--dtype", choices=AUTOCAST_DTYPES, default="float32",
                   help="bf16: forward and backward in bf16 autocast; master weights, gradient reduction and "
                        "optimizer state stay float32; verified against one process under the same autocast and "
                        "against float32's losses, and timed beside float32")


def autocast(device, dtype="float32"):
    """The context a forward runs in: bf16 autocast on ``device``'s type, or nothing."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=DTYPES[dtype]) if DTYPES.get(dtype) else contextlib.nullcontext()


# How close low precision must come to one process computing the same way, by what is
# compared: "autocast", bf16 autocast against one process under the same autocast (what
# reordered bf16 sums leave); "low-precision compute", 07's FSDP gathering, computing and
# reducing in bf16 or fp16 against one process whose weights and inputs are cast alike
TOLERANCE = {"autocast": {"rtol": 1e-2, "atol": 1e-3}, "low-precision compute": {"rtol": 1e-2, "atol": 2e-3}}
# and autocast's losses against float32 training's, each step of a short run
BF16_LOSS_BOUND = 0.05


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_fits(backend: str, world_size: int) -> bool:
    """NCCL needs a GPU of its own per rank ("Duplicate GPU detected" otherwise); under
    torchrun, a GPU per rank of this node."""
    if backend != "nccl":
        return True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    return local <= gpu_count()


NCCL_HINT = "use --backend gloo --device cuda (ranks then share the GPUs)"


def parse(parser: KitParser, argv=None, world=None, batch_unit=None, world_flag="--world-size") -> argparse.Namespace:
    """Parse, fill the machine-dependent defaults and check every flag (UsageError). A
    script whose flags decide its world size passes ``world(args)`` (and ``world_flag``,
    the flags a refusal names); ``batch_unit(args)``
    is what the global batch must divide by (default: the world size; None: no default,
    no check). The LM size a run gets unless told is the parser's (script_parser)."""
    args = parser.parse_args(argv)
    n_gpus = gpu_count()
    if under_torchrun():
        args.world_size = int(os.environ["WORLD_SIZE"])
    elif world is not None:
        args.world_size = world(args)
    elif args.world_size is None:
        args.world_size = n_gpus if n_gpus >= 2 else 2
    if args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    if args.backend is None:
        args.backend = "nccl" if (n_gpus >= args.world_size and args.device != "cpu") else "gloo"
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        if args.device != "cuda":
            raise UsageError("nccl works on CUDA tensors only: use --device cuda or --backend gloo")
        if not nccl_fits("nccl", args.world_size):
            raise UsageError(f"nccl needs one GPU per rank: {args.world_size} ranks but {n_gpus} GPU(s) here; "
                             f"{NCCL_HINT}, or fewer ranks")
    if args.device == "cuda" and n_gpus == 0:
        raise UsageError("--device cuda but no GPU is visible: use --device cpu")
    check_ranks(args.world_size, args.backend, world_flag)
    if args.model_size is None:
        args.model_size = parser.gpu_size if args.device == "cuda" else parser.cpu_size
    if args.model_size not in MODEL_SIZES:
        raise UsageError(f"unknown --model-size {args.model_size!r}: choose one of {', '.join(MODEL_SIZES)}")
    unit = batch_unit(args) if batch_unit is not None else args.world_size
    if args.batch_size is None and unit:   # the course's global batch of 4 on GPUs, a multiple of the ranks
        args.batch_size = -(-4 // unit) * unit if args.device == "cuda" else 2 * unit
    if unit:
        check_divisible(args.batch_size, unit, "--batch-size")
    if args.data == "mnist":
        load_mnist(args.data_root, args.download)  # fails here, before any worker starts
    check_out(args.out)
    return args


def check_divisible(batch: int, world_size: int, flag: str):
    if batch < 1 or batch % world_size:
        raise UsageError(f"{flag} {batch} does not divide into {world_size} ranks: "
                         f"use a positive multiple of {world_size}")


def check_out(out, flag="--out"):
    """The folder ``flag`` names must be one this process can write files in, or one it can
    make: found out now, by the file system (folder_problem), not after the run."""
    problem = folder_problem(out)
    if problem:
        raise UsageError(f"{flag} {out} {problem}")


# ----------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What a worker knows about its place in the job."""
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def load_script(path) -> object:
    """Import a script by path (the numbered scripts' names start with a digit)."""
    path = Path(path).resolve()
    for mod in (sys.modules.get("__main__"), sys.modules.get("__mp_main__")):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve() == path and mod.__name__ != "__main__":
            return mod
    name = "script_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def script_call(path, name: str, *args):
    """``name`` of the script at ``path``, called with ``args``: a forked process's target
    that finds a script loaded by path (not importable by name) again by its path."""
    return getattr(load_script(path), name)(*args)


def _device_for(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _watch_parent(parent_pid: int):
    """End this worker if the launching process goes away (killed, crashed): the worker's
    own parent is the fork server, which also ends then, but a worker whose code swallows
    KeyboardInterrupt would not notice."""
    def loop():
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=loop, daemon=True).start()


def _job_options(args, timeout) -> dict:
    """What the launch gives every rank besides the job: the device audit (KIT_DEVICE_AUDIT),
    --check-collectives (or KIT_CHECK_COLLECTIVES), --stall-report and the timeout. Read
    here, in the launching process: spawned ranks fork from a server started earlier."""
    return {"audit": os.environ.get(diagnostics.AUDIT_ENV) == "1", "stall_report": getattr(args, "stall_report", 30.0),
            "check": bool(getattr(args, "check_collectives", False)) or os.environ.get(diagnostics.CHECK_ENV) == "1",
            "timeout": timeout}


@contextlib.contextmanager
def _groups_time_out_at(timeout):
    """Inside the block, a process group made without a timeout of its own (dist.new_group
    by a script, a copied Mesh, torch's DeviceMesh or pipelining) times out at the job's
    --timeout, as the world does, not at torch's default (30 minutes: a stuck rank on a
    subgroup held the job that long)."""
    c10d = dist.distributed_c10d
    real = c10d._get_default_timeout
    c10d._get_default_timeout = lambda backend: timedelta(seconds=timeout)
    try:
        yield
    finally:
        c10d._get_default_timeout = real


@contextlib.contextmanager
def groups_freed():
    """The process groups made inside the block are destroyed as it ends, after a barrier
    (every rank of the world runs the block, as new_group requires). gloo gives each group a
    thread that wakes 100 times a second until the group is gone: a job that lays out a
    mesh for each of its cases kept them all (10's checks: 170 groups a rank by the last
    case; freed, the test of every mesh took 48 core-seconds, not 57). A block that raises
    leaves them: its job is failing.
    ``with common.groups_freed():`` or, on a function, ``@common.groups_freed()``."""
    c10d = dist.distributed_c10d
    before = set(c10d._world.pg_map)
    yield
    made = [pg for pg in c10d._world.pg_map if pg not in before]
    if made:
        dist.barrier()
        for pg in made:
            dist.destroy_process_group(pg)
        gc.collect()   # the groups' last references may sit in cycles (a model's hooks), holding the threads


def _run_worker(worker, ctx, args, job, options: dict, store, watch=False):
    """``worker(ctx, args, *job)`` with its flight recorder publishing to ``store`` (and
    comparing collectives with --check-collectives), under the device audit where asked (a
    CPU job). ``watch`` (torchrun): this rank also watches for stalls, and a failure is
    preceded by the stall's first line, so the stuck rank is named before any traceback."""
    recorder = diagnostics.FlightRecorder(ctx, store, options["check"], options["stall_report"], options["timeout"])
    diagnostics._RECORDER[:] = [recorder]
    if watch:
        recorder.watch = diagnostics.StallWatch(store, ctx.world_size, options["stall_report"], me=ctx.rank)
    try:
        with diagnostics.traced_calls(recorder), _groups_time_out_at(options["timeout"]):
            if options["audit"] and ctx.device.type == "cpu":
                with diagnostics.device_audit():
                    return worker(ctx, args, *job)
            return worker(ctx, args, *job)
    except BaseException:
        stall = recorder.watch.last_word(ticking=True) if watch else None
        if stall:   # named before the traceback torchrun shows
            print(f"rank {ctx.rank} fails after a stall: {stall['stuck']}", file=sys.stderr, flush=True)
        raise
    finally:
        recorder.finish()
        diagnostics._RECORDER.clear()


def _spawn_entry(rank, script, fn_name, args, job, world_size, port, backend, device, timeout, result_path, parent_pid,
                 options=None):
    _catch_faults(f"{result_path}.rank{rank}.fault")
    _watch_parent(parent_pid)
    # the machine's cores shared by its ranks, unless OMP_NUM_THREADS says how many a rank takes
    # (docs/13: on a machine other work keeps busy, one thread a rank)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else
                          max(1, (os.cpu_count() or 1) // world_size))
    ctx = Ctx(rank, world_size, rank, backend, _device_for(device, rank))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    _loopback_only(backend)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = _run_worker(getattr(load_script(script), fn_name), ctx, args, job, options or _job_options(args, timeout),
                             dist.PrefixStore("kit/fr", store))
    except BaseException:  # leave the time and traceback for launch() to find the first failure
        with open(f"{result_path}.rank{rank}.err", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    dist.barrier()  # no rank tears its group down while a peer may still be talking to it
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "wb") as f:
            pickle.dump(result, f)


def _catch_faults(path=None):
    """A rank killed by a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL: a crash in
    C++, CUDA or NCCL code) writes every thread's Python stack at that moment to ``path``,
    where launch() reads it, or to stderr (under torchrun), then dies of the same signal;
    without it such a rank dies without a word. Left as it is where the user enabled
    faulthandler already (python -X faulthandler, PYTHONFAULTHANDLER)."""
    if not faulthandler.is_enabled():   # (it holds the file, open, for the process's life)
        faulthandler.enable(file=open(path, "w") if path else sys.stderr, all_threads=True)


def _fault_text(path) -> tuple[str, str]:
    """(where the crashed thread was: "file:line in function", faulthandler's whole text) of
    the dump at ``path``, or ("", "") where the rank left none."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "", ""
    lines = text.splitlines()   # the crashed thread's stack, innermost first, after "Current thread ..."
    at = next((i + 1 for i, ln in enumerate(lines) if ln.startswith("Current thread")), len(lines))
    innermost = lines[at].strip() if at < len(lines) else ""   # File "/path/x.py", line 12 in f
    if not innermost.startswith('File "'):
        return "", text.strip()
    file, _, rest = innermost[len('File "'):].partition('", line ')
    return f"{os.path.basename(file)}:{rest}", text.strip()


def loopback_store(world_size, timeout):
    """The spawned job's rendezvous store, held by the launching process: on loopback only,
    on a port the OS picked (no race for a free port). TCPStore's own server listens on
    every interface; handed a socket already bound to 127.0.0.1 it listens there alone
    (the store carries each rank's gloo address, the flight recorder's states and
    --check-collectives' signatures, and has no authentication)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, 2 * world_size))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # the store owns the socket from here (it closes it when it goes)
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())


def _loopback_only(backend):
    """A spawned rank's own sockets on loopback too: gloo listens where the host name
    resolves (a LAN address on many machines) and NCCL's bootstrap on the first interface
    it likes, unless told the interface; one machine's job needs nothing else."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo
        if backend == "nccl":
            os.environ["NCCL_SOCKET_IFNAME"] = lo


def _attempt_store(timeout):
    """Under torchrun: the agent's store, its keys under this restart's own prefix (None
    where torchrun's workers make their own). After a restart (--max-restarts) the
    process group must not read the addresses the killed attempt's ranks published there:
    gloo would connect to ports nobody listens on."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/kit/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt_{attempt}", store)


def launch(worker, args, *job, world_size=None, backend=None, device=None, timeout=None):
    """Run ``worker(ctx, args, *job)`` on every rank and return rank 0's result.

    ``worker`` must be a module-level function of a script file (each spawned process
    finds it again by file and name); ``job`` holds the values of this one job.
    """
    world_size = world_size or args.world_size
    backend, device = backend or args.backend, device or args.device
    timeout = timeout or getattr(args, "timeout", 300.0)
    if not nccl_fits(backend, world_size):   # the scripts check first; this is the safety net
        raise UsageError(f"a job of {world_size} NCCL ranks on {gpu_count()} GPU(s): {NCCL_HINT}")
    _announce(args, world_size, backend, device)
    if under_torchrun():
        local_rank = int(os.environ["LOCAL_RANK"])
        ctx = Ctx(int(os.environ["RANK"]), world_size, local_rank, backend, _device_for(device, local_rank))
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        if not dist.is_initialized():   # the group lives on for the script's next launch
            _catch_faults()   # (to stderr, which torchrun passes on)
            # torch._dynamo, which the flight recorder's wrappers (torch.compiler.disable) and the
            # first optimizer import, before the rendezvous (a spawned rank's fork server has it):
            # its seconds on a loaded machine are then a slow start, not a rank the others wait
            # for in their first collective, reported as a stall (imported under a name of its
            # own: a plain `import torch._dynamo` makes `torch` local to all of launch, and its
            # use above, on a GPU, an UnboundLocalError)
            import torch._dynamo as _dynamo  # noqa: F401
            store = _attempt_store(timeout)
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout), store=store,
                                    **({"rank": ctx.rank, "world_size": world_size} if store is not None else {}))
        _launches[0] += 1   # every rank runs the same launches: each job's states under its own prefix
        fr_store = dist.PrefixStore(f"kit/fr/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_launches[0]}",
                                    dist.distributed_c10d._get_default_store())
        return _run_worker(worker, ctx, args, job, _job_options(args, timeout), fr_store, watch=True)
    script = Path(sys.modules[worker.__module__].__file__).resolve()
    store = loopback_store(world_size, timeout)
    fd, result_path = tempfile.mkstemp(prefix="ddp_result_", suffix=".pkl")
    os.close(fd)
    alive = Heartbeat(f"{worker.__name__} on {world_size} rank{'s' * (world_size > 1)}")
    options = _job_options(args, timeout)
    watch = diagnostics.StallWatch(dist.PrefixStore("kit/fr", store), world_size, options["stall_report"])
    quiet = _quiet_spawn_log()
    procs = None
    try:
        procs = mp.start_processes(
            _spawn_entry, nprocs=world_size, join=False, start_method="forkserver",
            args=(str(script), worker.__name__, args, job, world_size, store.port, backend, device,
                  timeout, result_path, os.getpid(), options))
        try:
            while not procs.join(timeout=1.0, grace_period=2):
                alive.tick()
                watch.tick()
        except mp.ProcessRaisedException:
            raise LaunchError(_failure_report(result_path, world_size, stall=watch.last_word())) from None
        except mp.ProcessExitedException as e:
            how = f"signal {-e.exit_code}" if e.exit_code < 0 else f"exit code {e.exit_code}"
            where, dump = _fault_text(f"{result_path}.rank{e.error_index}.fault")
            what = f"died ({how}) " + (f"at {where}" if where else "in a thread running no Python code" if dump
                                       else "without a Python error")
            raise LaunchError(_failure_report(result_path, world_size, (time.time(), e.error_index, what, dump),
                                              stall=watch.last_word())) from None
        except BaseException:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
            for p in procs.processes:
                p.join(5)
            raise
        with open(result_path, "rb") as f:
            return pickle.load(f) if os.path.getsize(result_path) else None
    finally:
        alive.done()
        quiet()
        # torch's launcher leaves a file in the temp folder for each rank that raised (its
        # pickled traceback, read above from ours) and never removes it
        errors = [f for f in getattr(procs, "error_files", None) or () if f]
        for f in [result_path] + [f"{result_path}.rank{r}.{x}" for r in range(world_size) for x in ("err", "fault")] \
                + errors:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        del store


_launches = [0]   # launches so far in this process (under torchrun: the same count on every rank)


def _quiet_spawn_log():
    """Keep torch's process launcher from printing its own warnings ("Terminating process
    ... via signal SIGTERM") while a job ends: the launcher's report says what happened.
    Returns the function that restores its level."""
    import logging
    log = logging.getLogger("torch.multiprocessing.spawn")
    level = log.level
    log.setLevel(logging.ERROR)
    return lambda: log.setLevel(level)


_announce_next = []   # run_main arms it: the script's first job says what is starting


def _announce(args, world_size, backend, device):
    """The first line of a run (its first job, once its flags have passed every check):
    what is starting, before the workers take their seconds to come up."""
    if not _announce_next or not is_reporter():
        return
    _announce_next.clear()
    parts = [what for flag, what in (("no_verify", "verification"), ("no_bench", "benchmark"))
             if not getattr(args, flag, False)]
    if getattr(args, "train", None):
        parts = [f"training, {args.train} steps"]
    if getattr(args, "doing", None):   # a measurement of its own (13's --setup-memory, say)
        parts = [args.doing]
    print(f"running: {Path(sys.argv[0]).name} on {world_size} rank{'s' * (world_size > 1)} ({backend}, {device}): "
          f"{', then '.join(parts) or 'nothing but the checks'}", flush=True)


class Heartbeat:
    """Shows that a long job is alive: on a terminal, its elapsed time on one line that
    updates in place (and is wiped at the end); elsewhere (a log, make all), a line every
    ``every`` seconds once the job has run that long."""

    def __init__(self, what: str, every: float = 30.0):
        self.what, self.every, self.start = what, every, time.time()
        self.tty, self.shown = sys.stdout.isatty(), 0.0

    def tick(self):
        elapsed = time.time() - self.start
        if self.tty and elapsed >= 3:
            print(f"\r  ... {self.what}: {elapsed:.0f} s", end="", flush=True)
            self.shown = elapsed
        elif not self.tty and elapsed >= self.shown + self.every:
            self.shown += self.every
            print(f"  ... {self.what}: still running after {elapsed:.0f} s", flush=True)

    def done(self):
        if self.tty and self.shown:
            print("\r\033[K", end="", flush=True)


def _failure_report(result_path, world_size, died=None, stall=None) -> str:
    """What went wrong, the first failure first: that rank and its exception's last line,
    then what followed (the others usually fail only because it went away), and the path
    of a log file with every failed rank's whole traceback. ``died``: (time, rank, how) of
    a process that ended without a Python error, and the stack faulthandler wrote for it,
    if any. ``stall``: the StallWatch's diagnosis
    when the job was stalled: then the rank the others waited for is named first (a rank
    that timed out waiting for it only failed as a consequence)."""
    events = []   # (time, rank, what, traceback)
    for r in range(world_size):
        with contextlib.suppress(FileNotFoundError, ValueError):
            when, tb = Path(f"{result_path}.rank{r}.err").read_text().split("\n", 1)
            events.append((float(when), r, f"failed: {_exception_text(tb)}", tb))
    if died is not None:   # (time, rank, how[, faulthandler's dump])
        events.append((*died, "") if len(died) == 3 else tuple(died))
    if not events:
        return "a rank failed, leaving no report"
    events.sort()
    first = events[0]
    same = [r for _, r, what, _ in events[1:] if what == first[2]]   # the same error raised on its own
    rest = [(r, what) for _, r, what, _ in events[1:] if what != first[2]]
    msg = f"rank {first[1]} {first[2].replace('failed:', 'failed first:', 1)}"
    if stall is not None:
        msg = f"{stall['stuck']}\n  then, after waiting: rank {first[1]} {first[2]}"
    if same:
        msg += f"\n  rank{'s' * (len(same) > 1)} {', '.join(map(str, same))} failed the same way"
    if rest:
        msg += "\n  then, as a consequence: " + "; ".join(f"rank {r} {what}" for r, what in rest)
    tracebacks = "".join(f"==== rank {r}\n{tb}\n" for _, r, _, tb in events if tb)
    if tracebacks:
        fd, log = tempfile.mkstemp(prefix=f"{Path(sys.argv[0]).stem or 'job'}-failure-"
                                          f"{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(tracebacks)
        msg += f"\n  every failed rank's traceback: {log}"
    return msg


def _exception_text(tb: str) -> str:
    """The exception a traceback ends with: its last line, or its whole message where it
    spans lines (a CollectiveMismatch's table of the ranks' calls)."""
    lines = [ln for ln in tb.rstrip().splitlines() if ln.strip()]
    if not lines:
        return "?"
    start = max((i for i, ln in enumerate(lines) if not ln[0].isspace()), default=len(lines) - 1)
    head = lines[start].strip()
    if head.split(":")[0].split(".")[-1] == "CollectiveMismatch":
        return "\n".join([head] + [ln for ln in lines[start + 1:]])
    return lines[-1].strip()


def is_reporter() -> bool:
    """True in the process that prints and writes results (always, unless torchrun rank > 0)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


# ----------------------------------------------------------------------------------------
# The clock and timing statistics
# ----------------------------------------------------------------------------------------
def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Times the phases of one step: ``with clock.phase("backward"): ...`` synchronizes the
    device at both ends, adds the time to that phase, and labels the span for
    torch.profiler, so a trace shows the same phases."""

    def __init__(self, device):
        self.device, self.times = device, {}
        sync(device)
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        sync(self.device)
        start = time.perf_counter()
        with torch.profiler.record_function(name):
            yield
            sync(self.device)
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> dict:
        """Seconds per phase, "compute" (forward + backward) and "step" (all of it)."""
        sync(self.device)
        return {**self.times, "compute": self.times.get("forward", 0.0) + self.times.get("backward", 0.0),
                "step": time.perf_counter() - self.t0}


def time_call(device, fn) -> float:
    """Seconds of one ``fn()`` on this rank, the ranks starting it together (a barrier
    first) and ``device`` synchronized at both ends."""
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


# A collective's size as nccl-tests counts it (all-gather: the output; reduce-scatter and
# all-to-all: the input), from its arguments; ops not listed count the tensors of their first
# argument.
_COLLECTIVE_SIZE = {"_allgather_base_": lambda a: _nbytes(a[0]), "allgather_": lambda a: _nbytes(a[0]),
                    "alltoall_base_": lambda a: _nbytes(a[1]),   # all-to-all: each rank's send buffer
                    "_reduce_scatter_base_": lambda a: _nbytes(a[1]), "reduce_scatter_": lambda a: _nbytes(a[1]),
                    "all_gather_into_tensor": lambda a: _nbytes(a[0]) * a[1]}


def _group_name(args) -> str | None:
    """The process group a c10d op runs on (a boxed ProcessGroup), or a functional
    collective's group name."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).group_name
    return next((a for a in reversed(args) if isinstance(a, str)), None)   # (its reduce op comes first)


# The kernels a table names where one ran (the op torch dispatched, so what really ran): the
# attention's fused kernels (SDPA picks one; 11's ring calls them itself) and grouped GEMM
KERNEL_OPS = {"_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
              "_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_efficient_attention": "efficient",
              "_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_attention_math": "math",
              "_grouped_mm": "grouped_mm"}


class count_collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """``with count_collectives() as c:`` counts the collectives this rank issues inside
    the block (``c.calls``) and their bytes (``c.bytes``): torch.distributed's calls, the
    functional collectives of DTensor, and those issued in backward or by torch DDP.
    ``c.log`` lists each call: (op name, its group's name, bytes); ``c.kernels`` the
    KERNEL_OPS that ran, by their short names."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.log, self.kernels = 0, 0, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in KERNEL_OPS:
            self.kernels.add(KERNEL_OPS[name])
        if func.namespace in ("c10d", "_c10d_functional") and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            nbytes = _COLLECTIVE_SIZE.get(name, lambda a: _nbytes(a[0]))(args)
            self.calls += 1
            self.bytes += nbytes
            self.log.append((name, _group_name(args), nbytes))
        return func(*args, **(kwargs or {}))


# Bytes a rank sends in one call of a ring collective over n ranks, per byte of its counted
# size (all-gather: the output; reduce-scatter: the input); a receive sends nothing.
SENT_SHARE = {"allreduce_": lambda n: 2 * (n - 1) / n, "allreduce_coalesced_": lambda n: 2 * (n - 1) / n,
              "_allgather_base_": lambda n: (n - 1) / n, "allgather_": lambda n: (n - 1) / n,
              "allgather_into_tensor_coalesced_": lambda n: (n - 1) / n,
              "_reduce_scatter_base_": lambda n: (n - 1) / n, "reduce_scatter_": lambda n: (n - 1) / n,
              "alltoall_base_": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv_": lambda n: 0.0,
              "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
              "reduce_scatter_tensor": lambda n: (n - 1) / n}   # the last three: DTensor's functional ones


def sent_bytes(log, sizes=None) -> float:
    """Bytes this rank sent, from count_collectives' log: each call's size times its share
    (SENT_SHARE) on its group's ranks (``sizes``: group name -> ranks, else looked up)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    total = 0.0
    for op, group, nbytes in log:
        n = (sizes or {}).get(group) or (_resolve_process_group(group).size() if group else dist.get_world_size())
        total += nbytes * SENT_SHARE[op](n)
    return total


class saved_for_backward(torch.autograd.graph.saved_tensors_hooks):
    """``with saved_for_backward(exclude=model.parameters()) as s:`` ... ``s.bytes``: the
    bytes of the distinct storages autograd saves for backward inside the block (the
    activation memory a backward will need; a DTensor by its local part), what ``exclude``
    holds (the parameters) left out. Exact and deterministic, where live-byte counts on a
    CPU also see other threads' frees."""

    def __init__(self, exclude=()):
        self.skip = {_storage(p).data_ptr() for p in exclude}
        self.seen = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        storage = _storage(t)
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def _storage(t):
    return getattr(t, "_local_tensor", t).untyped_storage()


def summarize(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


def vs_paired(ours: dict, theirs: dict, key="vs_torch") -> dict:
    """Two rows of time_methods whose steps alternated, compared pair by pair: the median
    of our step over theirs, and the smallest and largest ratio ({key, key_min, key_max})."""
    ratios = [a / b for a, b in zip(ours["stats"]["step"]["all"], theirs["stats"]["step"]["all"])]
    return {key: statistics.median(ratios), f"{key}_min": min(ratios), f"{key}_max": max(ratios)}


def fit_line(xs, ys, weights=None) -> tuple[float, float]:
    """Weighted least squares of y = a + c x: returns (a, c), unclamped (c = 0 when every
    x is the same)."""
    w = weights or [1.0] * len(xs)
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    if sxx == 0:
        return my, 0.0
    c = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
    return my - c * mx, c


def time_methods(ctx: Ctx, args, methods: dict, interleave=None, global_batch=False, time_box=None,
                 start_together=False) -> list:
    """Time training steps on the LM: one table row per method (plus its raw stats).

    ``methods`` maps a name to ``make()``, which builds that method's model and optimizer and
    returns ``step(batch, clock)``: one training step on this rank's part of ``batch`` (with
    ``global_batch``, ``batch`` is the whole global batch: the step takes its own part). On
    CPU they are all built at once and their steps alternate (a b, b a, ...), so the drift
    of a shared machine hits all alike; on a GPU (where several XL models do not fit) one
    after another. Two warm-up steps, the second counting the collectives, then
    ``args.warmup - 2`` more; a measured step's time is the slowest rank's. ``time_box``:
    seconds after which, one after another, no further method starts (the ranks agree; the
    first always runs): the rows are those that ran. ``start_together``: every step begins
    at a barrier, before its clock starts (a pipeline's stages start a step together, as the
    schedule on paper has them: otherwise a stage still in the step before, the other
    method's or its own optimizer's, is counted as the next step's bubble).
    """
    interleave = ctx.device.type == "cpu" if interleave is None else interleave
    if not interleave:
        rows, started = [], time.perf_counter()
        for i, (name, make) in enumerate(methods.items()):
            if i and time_box is not None and agreed_past(ctx, time.perf_counter() - started > time_box):
                break
            rows += time_methods(ctx, args, {name: make}, True, global_batch, start_together=start_together)
            gc.collect()   # a wrapper's hooks make reference cycles: free it before the next
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        return rows
    batches = [lm_batch(args.batch_size, args.context_length, i, args.seed, ctx.device) for i in range(4)]
    if not global_batch:
        batches = [tuple(shard(t, ctx.rank, ctx.world_size) for t in b) for b in batches]
    steps = {name: make() for name, make in methods.items()}

    def run(name, i):
        if start_together:
            dist.barrier()
        clock = StepClock(ctx.device)
        steps[name](batches[i % len(batches)], clock)
        return clock.total()
    calls = {}
    for name in steps:
        run(name, 0)
        with count_collectives() as c:
            run(name, 1)
        calls[name] = (c.calls, c.bytes, ", ".join(sorted(c.kernels)))
    for i in range(2, args.warmup):
        for name in steps:
            run(name, i)
    names, local = list(steps), {name: [] for name in steps}
    for i in range(args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):   # no method always goes first
            local[name].append(run(name, args.warmup + i))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, local)
    rows = []
    for name in names:
        st = {phase: summarize([max(r[name][i][phase] for r in everyone) for i in range(args.steps)])
              for phase in local[name][0]}
        rows.append({"method": name, "step_ms": st["step"]["median"] * 1e3, "step_min_ms": st["step"]["min"] * 1e3,
                     "step_max_ms": st["step"]["max"] * 1e3, "comm_ms": st["comm"]["median"] * 1e3,
                     "comm_share": st["comm"]["median"] / st["step"]["median"], "collectives": calls[name][0],
                     "comm_MB": calls[name][1] / 1e6, "kernels": calls[name][2], "stats": st})
    return rows


# What the flight recorder (diagnostics.py; every job runs under it) costs a step: 05's and 10's
# --recorder-cost, timed by the harness above
def recorder_modes(ctx, args, make, global_batch=False) -> list:
    """What the flight recorder costs one method's step: ``make()`` (as time_methods takes
    it) built three times and stepped alternately with the recorder off, on, and on with
    --check-collectives (the paired ratios over off), beside each traced call's own cost
    (the recorder's bookkeeping per call, timed alone; the check's store round trips, from
    a 1-element all-reduce on the world with and without it) times the traced calls a step
    makes. Rows for a table; collective on the world."""
    rec = diagnostics._RECORDER[0]

    def mode(on, check):
        return lambda: recorded(make(), on, check)
    names = {"recorder off": (False, False), "recorder on": (True, False),
             "recorder on, --check-collectives": (True, True)}
    rows = time_methods(ctx, args, {n: mode(*m) for n, m in names.items()}, global_batch=global_batch)
    before = rec.entered
    mode(True, False)()(*_first_batch(ctx, args, global_batch))
    per_step = rec.entered - before
    x = torch.zeros(1, device=ctx.device)
    scratch = diagnostics.FlightRecorder(ctx, dist.HashStore())   # its sequence numbers are its own: the job's stay in step
    traced = diagnostics._traced("all_reduce", lambda *a, **k: None)
    saved = diagnostics._OBSERVERS[:]

    def bookkeeping(observers, n=20000):
        diagnostics._OBSERVERS[:] = observers
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                traced(x)
            return (time.perf_counter() - t0) / n
        finally:
            diagnostics._OBSERVERS[:] = saved
    recorder = min(bookkeeping([scratch]) for _ in range(3)) - min(bookkeeping([]) for _ in range(3))
    scratch.finish()

    def world_calls(check, n=50):   # the check's store round trips on the world, 8 blocks each way
        before, rec.check = rec.check, check
        try:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            return (time.perf_counter() - t0) / n
        finally:
            rec.check = before
    blocks = [(world_calls(False), world_calls(True)) for _ in range(8)]
    check = statistics.median(b - a for a, b in blocks)
    cost = {"recorder off": 0.0, "recorder on": recorder, "recorder on, --check-collectives": recorder + check}
    base = rows[0]
    for r in rows:
        r.update(vs_paired(r, base, "vs_off"), traced_calls_per_step=per_step, call_cost_us=cost[r["method"]] * 1e6,
                 calls_share_of_step=cost[r["method"]] * per_step / (base["step_ms"] / 1e3))
    return rows


def recorded(step, on: bool, check: bool):
    """``step(batch, clock)`` with this rank's flight recorder on or off and checking
    collectives or not (--check-collectives) for that step only, the job's own settings
    restored after it."""
    rec = diagnostics._RECORDER[0]

    def timed(batch, clock):
        before = rec.on, rec.check
        rec.on, rec.check = on, check
        try:
            step(batch, clock)
        finally:
            rec.on, rec.check = before
    return timed


def _first_batch(ctx, args, global_batch):
    batch = lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    return (batch if global_batch else tuple(shard(t, ctx.rank, ctx.world_size) for t in batch)), StepClock(ctx.device)


RECORDER_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "vs_off", "vs_off_min", "vs_off_max",
                    "traced_calls_per_step", "call_cost_us", "calls_share_of_step"]
RECORDER_NOTE = ("The flight recorder (every job runs under it) off, on, and on with --check-collectives, the same "
                 "method's steps alternating: vs_off is the median of the paired steps' ratios over the recorder off "
                 "[min, max]; call_cost_us: what one traced call costs more: the recorder's bookkeeping (its wrapper, "
                 "entry and exit, timed 20000 times against the bare wrapper) and the check's store round trips (a "
                 "1-element all-reduce on the world with and without it, 8 blocks of 50 each way, the median "
                 "difference); calls_share_of_step: that cost times the traced calls of one step, over the step "
                 "(the paired ratio's spread is the machine's noise; this share is the recorder's own cost).")


def agreed_past(ctx: Ctx, past: bool, group=None) -> bool:
    """Whether any rank of ``group`` says a time box has passed (a collective: the ranks
    decide together whether to start the next part)."""
    flag = torch.tensor([float(past)], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


BENCH_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "comm_ms", "comm_share", "collectives"]


def report_table(args, name: str, title: str, rows: list, headers=BENCH_HEADERS, note: str = "", settings=None):
    """Save a benchmark's rows as <out>/<name>.json and .md and print the table (in the
    reporting process only); ``settings``: what the files record of the run (lm_settings')."""
    if not is_reporter():
        return
    table = save_results(args.out, name, rows, settings or lm_settings(args), headers=headers, title=title, note=note)
    print(f"\n{title}\n({args.model_size} LM, {args.world_size} x {args.backend}/{args.device}, global batch "
          f"{args.batch_size}x{args.context_length}; times in ms, median [min, max] of {args.steps} steps)\n"
          f"{table}\n{wrote(args.out, f'{name}.json and .md')}", flush=True)


# ----------------------------------------------------------------------------------------
# Models and data
# ----------------------------------------------------------------------------------------
MODEL_SIZES = {   # name: (d_model, d_ff, n_layers, n_heads)
    "nano": (64, 256, 2, 2),
    "micro": (128, 512, 2, 4),
    "mini": (256, 1024, 4, 4),
    "mini8": (256, 1024, 8, 4),   # mini with enough blocks to balance a 4-stage pipeline
    "micro32": (128, 512, 32, 4),   # thin blocks, many: pipeline stages that can balance within a few percent
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7B": (2560, 10240, 32, 32),
}
VOCAB_SIZE = 10_000


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def causal_attention(q, k, v):
    """Causal attention over (batch, heads, tokens, head_dim): the Block's default."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """A pre-norm transformer block. ``attention(q, k, v)`` is a plain attribute (no
    parameters): context parallelism (11) swaps in an attention over the ranks' parts of the
    sequence. ``recompute``: activation recomputation in training (torch.utils.checkpoint,
    non-reentrant): "full" keeps only the block's input and runs its forward again in
    backward, "selective" only attention's core (09's recompute sets it)."""

    recompute = "none"

    def __init__(self, d_model, d_ff, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.attention = causal_attention
        self.ln1 = RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = RMSNorm(d_model)
        self.ff_in = nn.Linear(d_model, d_ff, bias=False)
        self.ff_out = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        if self.recompute == "full" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        h = self.qkv(self.ln1(x))   # heads from its width: a tensor-parallel qkv gives this rank's heads
        q, k, v = h.view(*h.shape[:2], 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)   # (and the whole sequence
        # under sequence parallelism, where x is this rank's part)
        if self.recompute == "selective" and torch.is_grad_enabled():
            a = torch.utils.checkpoint.checkpoint(self.attention, q, k, v, use_reentrant=False)
        else:
            a = self.attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).flatten(2))
        return x + self.feed_forward(self.ln2(x))

    def feed_forward(self, h):
        """The MLP (a mixture of experts replaces it in 12)."""
        return self.ff_out(F.gelu(self.ff_in(h)))


class TransformerLM(nn.Module):
    """Decoder-only LM: token + learned position embeddings, pre-norm blocks, output head.
    ``model(idx)`` gives logits; ``model(idx, targets)`` the mean cross-entropy loss."""

    def __init__(self, d_model, d_ff, n_layers, n_heads, vocab_size=VOCAB_SIZE, context_length=128):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, d_ff, n_heads) for _ in range(n_layers))
        self.ln_f = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_lm(size: str, context_length: int, device, seed: int = 0) -> TransformerLM:
    """The LM, initialised on ``device`` (the same weights on every rank of a device type)."""
    torch.manual_seed(seed)
    d_model, d_ff, n_layers, n_heads = MODEL_SIZES[size]
    with torch.device(device):
        return TransformerLM(d_model, d_ff, n_layers, n_heads, context_length=context_length)


class EncoderLM(nn.Module):
    """A causal LM of standard modules: embeddings, an nn.TransformerEncoder of
    nn.TransformerEncoderLayer (whose nn.MultiheadAttention reads its child out_proj's
    weight itself), and a head."""

    def __init__(self, vocab=VOCAB_SIZE, d=32, heads=4, d_ff=64, layers=2, context=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        logits = self.head(self.encoder(x, mask=mask, is_causal=True))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_encoder_lm(size: str, context_length: int, device, seed: int = 0) -> EncoderLM:
    """An EncoderLM of the kit's LM sizes (d_model, d_ff, layers, heads)."""
    torch.manual_seed(seed)
    d_model, d_ff, n_layers, n_heads = MODEL_SIZES[size]
    with torch.device(device):
        return EncoderLM(VOCAB_SIZE, d_model, n_heads, d_ff, n_layers, context_length)


def lm_batch(global_batch: int, context_length: int, step: int, seed: int, device):
    """The same random global batch of tokens on every rank: (inputs, targets)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(0, VOCAB_SIZE, (global_batch, context_length + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_param_count(size: str, context_length: int) -> int:
    d, f, n, _ = MODEL_SIZES[size]
    return 2 * VOCAB_SIZE * d + context_length * d + n * (4 * d * d + 2 * d * f + 2 * d) + d


def lm_settings(args) -> dict:
    d_model, d_ff, n_layers, n_heads = MODEL_SIZES[args.model_size]
    return {"world_size": args.world_size, "backend": args.backend, "device": args.device,
            "model_size": args.model_size, "d_model": d_model, "d_ff": d_ff, "n_layers": n_layers,
            "n_heads": n_heads, "n_params": lm_param_count(args.model_size, args.context_length),
            "batch_size": args.batch_size, "context_length": args.context_length,
            "steps": args.steps, "warmup": args.warmup, "optimizer": "AdamW", "dtype": getattr(args, "dtype", "float32")}


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0)."""
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


class ToyModel(nn.Module):
    """A small MLP for verification, with the awkward cases DDP must get right.

    tied:    ``fc3`` shares its weight with ``fc2`` (one Parameter, used twice).
    frozen:  ``fc1.bias`` has requires_grad=False.
    unused:  ``extra`` is used only when forward gets ``use_extra=True``, and
             ``never`` is never used at all (it never gets a gradient).
    mixed:   ``dbl`` computes in float64 (a second gradient dtype).
    scrambled: the layers are registered in another order than they run (head first), so
             reverse registration order is not the order backward produces gradients.
    ``model(x)`` gives logits; ``model(x, targets)`` the cross-entropy loss.
    """

    def __init__(self, in_dim=20, hidden=32, n_classes=10, tied=False, frozen=False, unused=False, mixed=False,
                 scrambled=False):
        super().__init__()
        if scrambled:
            self.head, self.fc3 = nn.Linear(hidden, n_classes), nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        if not scrambled:
            self.fc3 = nn.Linear(hidden, hidden, bias=False)
        if tied:
            self.fc3.weight = self.fc2.weight
        if frozen:
            self.fc1.bias.requires_grad_(False)
        self.extra = nn.Linear(hidden, hidden) if unused else None
        self.never = nn.Parameter(torch.randn(hidden)) if unused else None
        self.dbl = nn.Linear(hidden, hidden).double() if mixed else None
        if not scrambled:
            self.head = nn.Linear(hidden, n_classes)

    def forward(self, x, targets=None, use_extra=False):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        h = torch.tanh(self.fc3(h))
        if self.extra is not None and use_extra:
            h = h + torch.relu(self.extra(h))
        if self.dbl is not None:
            h = h + torch.tanh(self.dbl(h.double())).float()
        logits = self.head(h)
        return logits if targets is None else F.cross_entropy(logits.float(), targets)


MNIST_FILES = {"train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",   # the .gz files' MD5
               "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432"}
MNIST_MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/")


def _read_idx(path: Path) -> torch.Tensor:
    """An array in the idx format MNIST ships in (optionally gzipped): two zero bytes, the
    element type (0x08: unsigned bytes), the number of dimensions, each size as a big-endian
    uint32, then the elements."""
    import gzip
    import struct
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if data[:2] != b"\0\0" or data[2] != 0x08:
        raise UsageError(f"{path} is not an idx file of unsigned bytes (MNIST's format)")
    dims = struct.unpack(f">{data[3]}I", data[4:4 + 4 * data[3]])
    return torch.frombuffer(bytearray(data[4 + 4 * data[3]:]), dtype=torch.uint8).reshape(dims)


def _fetch_mnist(raw: Path, name: str):
    """``name``.gz from the first mirror that answers, checked against its MD5."""
    import hashlib
    import urllib.request
    raw.mkdir(parents=True, exist_ok=True)
    errors = []
    for mirror in MNIST_MIRRORS:
        try:
            with urllib.request.urlopen(mirror + name + ".gz", timeout=60) as r:
                data = r.read()
        except OSError as e:
            errors.append(f"{mirror}: {e}")
            continue
        if hashlib.md5(data).hexdigest() != MNIST_FILES[name]:
            errors.append(f"{mirror}: {name}.gz has the wrong checksum")
            continue
        (raw / (name + ".gz")).write_bytes(data)
        return
    raise UsageError(f"could not download MNIST's {name}.gz: " + "; ".join(errors))


def load_mnist(root, download: bool):
    """MNIST training images as (N, 784) float in [0, 1] and labels, read from
    ``root``/MNIST/raw (the idx files, plain or gzipped, where torchvision keeps them);
    ``download``: fetch what is missing first."""
    raw = Path(root) / "MNIST" / "raw"
    found = {}
    for name in MNIST_FILES:
        if download and not (raw / name).exists() and not (raw / (name + ".gz")).exists():
            if problem := folder_problem(raw):   # before anything is fetched
                raise UsageError(f"--data-root {root}: {raw} {problem}")
            _fetch_mnist(raw, name)
        found[name] = next((p for p in (raw / name, raw / (name + ".gz")) if p.exists()), None)
    if None in found.values():
        raise UsageError(f"MNIST not found under {root}/MNIST/raw: add --download (needs internet) "
                         f"or point --data-root at a folder that holds MNIST/raw")
    images, labels = (_read_idx(found[name]) for name in MNIST_FILES)
    return images.reshape(len(images), -1).float() / 255.0, labels.long()


def verify_batches(args, steps: int, global_batch: int):
    """Global batches (x, y) for a verification run, the same on every rank, and the toy
    model's input and class sizes: random data, or MNIST with ``--data mnist``."""
    if args.data == "mnist":
        x, y = load_mnist(args.data_root, download=False)
        idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
        idx = idx.repeat(math.ceil(steps * global_batch / len(idx)))
        return [(x[idx[i * global_batch:(i + 1) * global_batch]], y[idx[i * global_batch:(i + 1) * global_batch]])
                for i in range(steps)], 784, 10
    g = torch.Generator().manual_seed(args.seed + 12345)
    return [(torch.randn(global_batch, 20, generator=g), torch.randint(0, 10, (global_batch,), generator=g))
            for _ in range(steps)], 20, 10


# The verification cases of every DDP wrapper: ToyModel flags (tied, frozen, unused, mixed), plus
#   accum: micro-batches per step (all but the last inside no_sync()),
#   uneven: the `extra` layer is used by the group's first rank only (a gradient some ranks lack),
#   opt: "sgd" (momentum) or "adamw",  set_to_none: how zero_grad clears gradients.
VERIFY_CASES = {
    "plain": {},
    "tied": {"tied": True},
    "frozen": {"frozen": True},
    "unused": {"unused": True, "opt": "adamw"},
    "unused_keep_grads": {"unused": True, "opt": "adamw", "set_to_none": False},
    "uneven": {"unused": True, "uneven": True},
    "accum": {"accum": 2},
    "mixed": {"mixed": True},
    "scrambled": {"scrambled": True, "unused": True, "opt": "adamw"},
    "everything": {"tied": True, "frozen": True, "unused": True, "mixed": True, "accum": 2, "opt": "adamw"},
}


def one_process_step(model, optimizer, parts, max_norm=None, set_to_none=True):
    """The one-process reference's training step, the one every verification compares
    with (VerifyRun's toy, 09's pipelined LM, 10's meshes): the mean of the model's loss
    over ``parts`` (each the (args, kwargs) of one call: the whole batch, or its parts where
    each takes its own options or routing), backward, clipped by the global norm where
    ``max_norm`` is given (torch's clip_grad_norm_), the optimizer's step. Returns the norm
    it clipped by (None unclipped)."""
    optimizer.zero_grad(set_to_none=set_to_none)
    (sum(model(*a, **k) for a, k in parts) / len(parts)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) if max_norm is not None else None
    optimizer.step()
    return norm


class VerifyRun:
    """One verification case on one data-parallel group, everything but the method's loop:
    the starting model (ranks other than the group's first perturb theirs: the wrapper must
    broadcast), this rank's part of each global batch, the options of each step, the
    optimizer, and the reference: one process trained on the whole batches, on the same
    device (so the check compares the method, not two devices' arithmetic)."""

    def __init__(self, ctx, args, case: dict, group=None):
        self.case, self.group = case, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.accum, self.steps = case.get("accum", 1), args.verify_steps
        batches, in_dim, n_cls = verify_batches(args, self.steps, 8 * self.size * self.accum)
        self.batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]
        torch.manual_seed(args.seed)
        flags = {k: case[k] for k in ("tied", "frozen", "unused", "mixed", "scrambled") if k in case}
        self.reference = ToyModel(in_dim, n_classes=n_cls, **flags).to(ctx.device)
        self.model = copy.deepcopy(self.reference)
        with torch.no_grad():
            for p in self.model.parameters() if self.rank else ():
                p.add_(0.5 * self.rank)
        opt = self.optimizer(self.reference.parameters())
        for step, (x, y) in enumerate(self.batches):
            if case.get("uneven"):   # the same loss, written per part so each part can choose its layers
                parts = [((xp, yp), {"use_extra": self._extra(step, i)})
                         for i, (xp, yp) in enumerate(zip(x.chunk(self.size), y.chunk(self.size)))]
            else:
                parts = [((x, y), {"use_extra": self._extra(step, 0)})]
            one_process_step(self.reference, opt, parts, set_to_none=case.get("set_to_none", True))

    def _extra(self, step, rank):
        return rank == 0 and step % 3 != 2 if self.case.get("uneven") else step % 2 == 0

    def optimizer(self, params):
        params = [p for p in params if p.requires_grad]
        if self.case.get("opt") == "adamw":
            return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def batch(self, step):
        """This rank's part of global batch ``step``."""
        return tuple(shard(t, self.rank, self.size) for t in self.batches[step])

    def step_options(self, step) -> dict:
        return {"micro_batches": self.accum, "set_to_none": self.case.get("set_to_none", True),
                "use_extra": self._extra(step, self.rank)}

    def compare(self, model: nn.Module) -> dict:
        """The trained model against the reference, gathered over the group."""
        local = {"ok": params_close(model, self.reference), "max_diff": max_param_diff(model, self.reference),
                 "bitwise": all(torch.equal(a, b) for a, b in zip(model.parameters(), self.reference.parameters()))}
        everyone = [None] * self.size
        dist.all_gather_object(everyone, local, group=self.group)
        return {"ok": all(r["ok"] for r in everyone), "max_diff": max(r["max_diff"] for r in everyone),
                "bitwise": all(r["bitwise"] for r in everyone)}


def check_resume(worker, args, label, steps=6):
    """A checkpoint saved at this world size, resumed at another (twice as many ranks, or
    half when there are 4 or more), must end where the uninterrupted run ends.
    ``worker(ctx, args, path, start, stop, save_at, batch)`` trains steps [start, stop) on
    the same global batches whatever the world size, loading ``path`` when start > 0 and
    saving it after step ``save_at``, and returns the final weights by name."""
    if under_torchrun():
        print(f"verify {label}: skipped under torchrun (its world size is fixed)") if is_reporter() else None
        return
    now = args.world_size
    then = now // 2 if now >= 4 else now * 2
    batch = 4 * math.lcm(now, then)
    backend = args.backend
    if not nccl_fits(backend, then):   # one GPU: the resumed ranks share it over gloo
        backend = "gloo"
        if is_reporter():
            print(f"verify {label}: resumed over gloo on {args.device} (NCCL needs a GPU per rank: "
                  f"{then} ranks, {gpu_count()} GPU(s))")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        whole = launch(worker, args, path, 0, steps, steps // 2, batch)
        resumed = launch(worker, args, path, steps // 2, steps, None, batch, world_size=then, backend=backend)
    ok = set(whole) == set(resumed)
    try:
        for k in whole:
            torch.testing.assert_close(resumed[k], whole[k])
    except (AssertionError, KeyError):
        ok = False
    diff = max((resumed[k].double() - whole[k].double()).abs().max().item() for k in whole if k in resumed)
    check_verification({f"saved at {now} ranks after step {steps // 2}, resumed at {then}": {"ok": ok, "max_diff": diff}},
                       label)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa.detach().double() - pb.detach().double()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def params_close(a: nn.Module, b: nn.Module) -> bool:
    """allclose at the dtype's tolerance (torch.testing's defaults), every parameter."""
    try:
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa.detach(), pb.detach())
    except AssertionError:
        return False
    return True


# ----------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------
def check_verification(results: dict, label: str):
    """Print PASS/FAIL per case (in the reporting process), SKIP with its reason for a case
    that does not apply here (a result with "skip"); raise LaunchError if any failed."""
    ok = all(r["ok"] for r in results.values())
    if is_reporter():
        width = max(map(len, results))
        for name, r in results.items():
            if r.get("skip"):
                print(f"  SKIP  {name:<{width}}  {r['skip']}")
                continue
            print(f"  {'PASS' if r['ok'] else 'FAIL'}  {name:<{width}}  max |diff| {r['max_diff']:.2e}"
                  f"{'  (bitwise equal)' if r.get('bitwise') else ''}")
        skipped = sum(bool(r.get("skip")) for r in results.values())
        print(f"verify {label}: {'PASS' if ok else 'FAIL'}{f' ({skipped} skipped)' if skipped else ''}", flush=True)
    if not ok:
        raise LaunchError("verification failed: the weights differ from single-process training")


def machine_info(device=None) -> dict:
    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "cpu": _cpu_name()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    cpu = f"{info['cpu']} ({info['cpus']} cores)"
    if "gpu" not in info or device == "cpu":
        info["device"] = cpu
    else:   # cuda, or a mix (01): name both
        info["device"] = info["gpu"] if device == "cuda" else f"{cpu} + {info['gpus']}x {info['gpu']}"
    return info


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def markdown_table(rows: list[dict], headers: list[str] | None = None) -> str:
    from tabulate import tabulate
    headers = headers or list(rows[0])

    def cell(v):   # a list (one value per stage, say) with each number as the table's
        return " ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v) if isinstance(v, list) else v
    return tabulate([[cell(r.get(h, "")) for h in headers] for r in rows], headers=headers, tablefmt="github",
                    floatfmt=".4g")


TABLE_WIDTH = 120   # what a printed table may take on a terminal


def fit_width(rows: list[dict], headers: list[str] | None = None, width: int = TABLE_WIDTH) -> str:
    """The table as markdown_table makes it, or, where that is wider than ``width``
    characters, as several tables one under another, each with the first column (what a
    row is) and as many of the next columns as fit."""
    headers = headers or list(rows[0])
    whole = markdown_table(rows, headers)
    if max(map(len, whole.splitlines())) <= width:
        return whole
    key, parts, group = headers[0], [], [headers[0]]
    for h in headers[1:]:
        wider = markdown_table(rows, group + [h])
        if len(group) > 1 and max(map(len, wider.splitlines())) > width:
            parts.append(markdown_table(rows, group))
            group = [key]
        group.append(h)
    parts.append(markdown_table(rows, group))
    return "\n\n".join(parts)


def save_results(out_dir, name: str, rows: list[dict], settings: dict, *, headers=None, title="",
                 extra: dict | None = None, note: str = "", sections=()) -> str:
    """Write <out>/<name>.json (everything) and <name>.md (the whole table, then each of
    ``sections``, (heading, rows, headers), a table under its heading), each atomically;
    return the table for printing (split where it is wider than TABLE_WIDTH)."""
    out = Path(out_dir)
    info = machine_info(settings.get("device"))
    table = markdown_table(rows, headers) if rows else "(no rows)"
    doc = {"name": name, "title": title, "settings": settings, "machine": info, "rows": rows,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), **(extra or {}),
           **({"sections": [{"heading": h, "rows": r} for h, r, _ in sections]} if sections else {})}
    save_file(out / f"{name}.json", lambda f: f.write(json.dumps(doc, indent=1, default=str).encode()))
    md = (f"# {title or name}\n\nMachine: {info['device']}, torch {info['torch']}, "
          f"{doc['time']}.\nSettings: {json.dumps(settings, default=str)}\n\n{table}\n" + (f"\n{note}\n" if note else "")
          + "".join(f"\n## {h}\n\n{markdown_table(r, c) if r else '(no rows)'}\n" for h, r, c in sections))
    save_file(out / f"{name}.md", lambda f: f.write(md.encode()))
    return fit_width(rows, headers) if rows else table


def partial_note(done: int, of: int, what: str) -> str:
    """The mark a report's results file carries while its jobs are still running, saved after
    each so that a run cut short keeps its rows: ' (partial: 2 of 3 <what> done)', and '' once
    ``done`` reaches ``of`` (the file then holds the whole table, printed once)."""
    return f" (partial: {done} of {of} {what} done)" if done < of else ""


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path):
    """Save a matplotlib figure atomically as PNG (save_file) and close it."""
    save_file(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    pyplot().close(fig)


_PARTS = {"whole": (-0.35, 0.7), "upper": (-0.4, 0.42), "lower": (0.02, 0.36)}   # of a lane: (offset, height)


def draw_lanes(path, title, lanes, xlabel, legend, width=10.0, row=0.55, shade=None):
    """The kit's one timeline drawing (04's DDP step, 09's schedules, 10's mesh, 11's ring):
    a horizontal lane per row, top to bottom. ``lanes`` = [(label, spans)], each span a
    dict with start and end (ms) and color, and optionally text (written in its middle),
    part ("whole", or the lane's "upper" or "lower" half), alpha, edge (its outline's
    colour) and min_width (ms); spans without text are drawn in one call per look (a GPU
    step has thousands of kernels). ``legend`` = {label: color}; ``shade`` = (start, end,
    color): a band behind every lane. Saved as PNG at ``path``."""
    plt = pyplot()
    from matplotlib.patches import Patch
    fig, ax = plt.subplots(figsize=(width, 0.8 + row * len(lanes)))
    if shade is not None:
        ax.axvspan(shade[0], shade[1], color=shade[2], alpha=0.08)
    for y, (_, spans) in enumerate(lanes):
        batched = {}
        for sp in spans:
            lo, h = _PARTS[sp.get("part", "whole")]
            look = (lo, h, sp["color"], sp.get("alpha", 1.0), sp.get("edge", "white"))
            extent = (sp["start"], max(sp["end"] - sp["start"], sp.get("min_width", 0.0)))
            if sp.get("text") is None:
                batched.setdefault(look, []).append(extent)
                continue
            ax.broken_barh([extent], (y + lo, h), facecolors=look[2], alpha=look[3], edgecolors=look[4],
                           linewidth=0.5)
            ax.text((sp["start"] + sp["end"]) / 2, y + lo + h / 2, sp["text"], ha="center", va="center", fontsize=6,
                    color=sp.get("text_color", "black"))
        for (lo, h, color, alpha, edge), extents in batched.items():
            ax.broken_barh(extents, (y + lo, h), facecolors=color, alpha=alpha, edgecolors=edge, linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for label, _ in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in legend.items()], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)


# ----------------------------------------------------------------------------------------
# A training run that survives a crash: --train, saving and resuming sharded checkpoints
# ----------------------------------------------------------------------------------------
# Fault injection for the resume test: "STEP:RANK" makes that rank kill itself (SIGKILL)
# before step STEP, on a run's first attempt only (torchrun's restarts count from 0)
FAULT_ENV = "KIT_FAULT_AT_STEP"


def add_train_flags(p: argparse.ArgumentParser):
    p.add_argument("--train", type=COUNT, default=None, metavar="N",
                   help="train N steps instead of verifying and timing, resuming from --checkpoint-dir's newest "
                        "complete checkpoint; prints the final weights' sha256")
    p.add_argument("--checkpoint-every", type=COUNT, default=None, metavar="K",
                   help="--train: a sharded checkpoint every K steps (each rank writes what it holds)")
    p.add_argument("--checkpoint-dir", default=None, metavar="D",
                   help="--train: the checkpoints' folder, shared by every rank")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="--train: each checkpoint copied to host memory, then written while training goes on")


def check_train_flags(args):
    """The --train flags, where they apply (UsageError otherwise)."""
    if args.train is None:
        given = [f for f, v in (("--checkpoint-every", args.checkpoint_every), ("--checkpoint-dir", args.checkpoint_dir),
                                ("--checkpoint-async", args.checkpoint_async)) if v]
        if given:
            raise UsageError(f"{given[0]} applies to a training run: add --train N")
        return
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir: the folder the checkpoints go to")
    if args.checkpoint_async and not args.checkpoint_every:
        raise UsageError("--checkpoint-async needs --checkpoint-every: how often to save")
    if args.checkpoint_dir:
        check_out(args.checkpoint_dir, "--checkpoint-dir")


@torch.no_grad()
def sharded_matches(module, optimizer, folder) -> bool:
    """Whether load_sharded(folder) gives back, bit for bit, every parameter, buffer and
    optimizer state ``module`` and ``optimizer`` hold now (loaded from the full checkpoint
    of the same step, say): each is set to -1 first. A check, for the tests and 10's
    verification; collective-free."""
    mine = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
    states = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in optimizer.state.items()}
    for t in list(module.state_dict(keep_vars=True).values()) + [v for s in optimizer.state.values()
                                                                 for v in s.values() if torch.is_tensor(v)]:
        t.fill_(-1)
    sharded_checkpoint.load_sharded(module, optimizer, folder)
    same = all(torch.equal(v, mine[k]) for k, v in module.state_dict().items())
    return same and all(torch.equal(v, states[id(p)][k]) for p, s in optimizer.state.items()
                        for k, v in s.items() if torch.is_tensor(v))


def weights_sha256(full: dict) -> str:
    """sha256 of a whole state dict: each name, then its tensor's bytes, in name order."""
    import hashlib
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_with_checkpoints(ctx, args, module, optimizer, step_fn):
    """--train: ``step_fn(i)`` for the steps from the newest complete checkpoint in
    --checkpoint-dir (or 0) to --train, saving a sharded checkpoint of ``module`` (the
    model under its own names) and ``optimizer`` every --checkpoint-every steps; the data
    of step i must depend on i only. Prints "resumed from step K" and, at the end, "final
    weights sha256 <hex>" (the whole model, gathered); returns that hex on the first rank."""
    start, folder = 0, sharded_checkpoint.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if folder:
        start = sharded_checkpoint.load_sharded(module, optimizer, folder)["step"]
        if ctx.rank == 0:
            print(f"resumed from step {start}", flush=True)
    fault = os.environ.get(FAULT_ENV)
    kill_at, kill_rank = (int(v) for v in fault.split(":")) if fault else (None, None)
    for i in range(start, args.train):
        if i == kill_at and ctx.rank == kill_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        step_fn(i)
        if args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
            sharded_checkpoint.save_sharded(module, optimizer, args.checkpoint_dir, i + 1, extra={"step": i + 1},
                         async_save=args.checkpoint_async)
    sharded_checkpoint.wait_for_saves()
    full = placement.full_state_dict(module)
    if not full:
        return None
    digest = weights_sha256(full)
    print(f"final weights sha256 {digest}", flush=True)
    return digest


