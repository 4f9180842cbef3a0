"""What every numbered script needs: flags, launching workers, the clock and timing
statistics, models and data, result files. The methods and their training loops live in
the numbered scripts.

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
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._python_dispatch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parent
# runs of one's own land here (git ignores it); make all passes --out results, the tracked tables
DEFAULT_OUT = str(ROOT / "runs")
# Only the kit's own lines in the output: torch.profiler's kineto logs its start and stop
# ("USDT: ... profiler_start") and, on a CPU, its GPU probe, unless told not to before it
# starts (inherited by the fork server and every worker)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# Workers fork from a server that has imported torch once, instead of each importing it again;
# torch._dynamo too, which the first optimizer a process builds imports (2 s a rank here)
mp.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo"])
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
    """Run a script's main(): bad input exits 2 with one line, a failed rank exits 1."""
    prog = Path(sys.argv[0]).name
    _announce_next[:] = [True]
    previous = None   # a kill (timeout, a scheduler) ends the ranks and cleans up like Ctrl-C
    if not under_torchrun() and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        main_fn()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    finally:
        _announce_next.clear()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if under_torchrun() and dist.is_initialized():
            dist.destroy_process_group()


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


DTYPES = {"float32": None, "bf16": torch.bfloat16}   # --dtype: bf16 runs forward and backward in autocast


def add_dtype_flag(p: argparse.ArgumentParser):
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="bf16: forward and backward in bf16 autocast; master weights, gradient reduction and "
                        "optimizer state stay float32; verified against one process under the same autocast and "
                        "against float32's losses, and timed beside float32")


def autocast(device, dtype="float32"):
    """The context a forward runs in: bf16 autocast on ``device``'s type, or nothing."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=DTYPES[dtype]) if DTYPES.get(dtype) else contextlib.nullcontext()


# bf16 against one process under the same autocast: what reordered bf16 sums leave
BF16_TOL = {"rtol": 1e-2, "atol": 1e-3}
# and its losses against float32 training's, each step of a short run
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


def check_out(out):
    """The results folder must be a folder this process can write, or one it can make:
    found out now, not after the run. Nothing is created here (a refused run leaves the
    disk as it was)."""
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder: choose a folder")
    existing = next(q for q in [path, *path.parents] if q.exists())
    if not existing.is_dir():
        raise UsageError(f"--out {out} cannot be written to ({existing} is a file, not a folder): choose a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out} cannot be written to ({existing} is not writable): "
                         f"choose a folder you can write")


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
    return {"audit": os.environ.get(AUDIT_ENV) == "1", "stall_report": getattr(args, "stall_report", 30.0),
            "check": bool(getattr(args, "check_collectives", False)) or os.environ.get(CHECK_ENV) == "1",
            "timeout": timeout}


def _run_worker(worker, ctx, args, job, options: dict, store, watch=False):
    """``worker(ctx, args, *job)`` with its flight recorder publishing to ``store`` (and
    comparing collectives with --check-collectives), under the device audit where asked (a
    CPU job). ``watch`` (torchrun): this rank also watches for stalls, and a failure is
    preceded by the stall's first line, so the stuck rank is named before any traceback."""
    recorder = FlightRecorder(ctx, store, options["check"], options["stall_report"], options["timeout"])
    _RECORDER[:] = [recorder]
    if watch:
        recorder.watch = StallWatch(store, ctx.world_size, options["stall_report"], me=ctx.rank)
    try:
        with traced_calls(recorder):
            if options["audit"] and ctx.device.type == "cpu":
                with device_audit():
                    return worker(ctx, args, *job)
            return worker(ctx, args, *job)
    except BaseException:
        if watch and recorder.watch.diagnosis:   # named before the traceback torchrun shows
            print(f"rank {ctx.rank} fails after a stall: {recorder.watch.diagnosis['stuck']}", file=sys.stderr,
                  flush=True)
        raise
    finally:
        recorder.finish()
        _RECORDER.clear()


_RECORDER = []   # the flight recorder of the job this process runs now


def _spawn_entry(rank, script, fn_name, args, job, world_size, port, backend, device, timeout, result_path, parent_pid,
                 options=None):
    _watch_parent(parent_pid)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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
    watch = StallWatch(dist.PrefixStore("kit/fr", store), world_size, options["stall_report"])
    quiet = _quiet_spawn_log()
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
            raise LaunchError(_failure_report(result_path, world_size, stall=watch.diagnosis)) from None
        except mp.ProcessExitedException as e:
            how = f"signal {-e.exit_code}" if e.exit_code < 0 else f"exit code {e.exit_code}"
            raise LaunchError(_failure_report(result_path, world_size,
                                              (time.time(), e.error_index, f"died ({how}) without a Python error"),
                                              stall=watch.diagnosis)) from None
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
        for f in [result_path] + [f"{result_path}.rank{r}.err" for r in range(world_size)]:
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
    a process that ended without a Python error. ``stall``: the StallWatch's diagnosis
    when the job was stalled: then the rank the others waited for is named first (a rank
    that timed out waiting for it only failed as a consequence)."""
    events = []   # (time, rank, what, traceback)
    for r in range(world_size):
        with contextlib.suppress(FileNotFoundError, ValueError):
            when, tb = Path(f"{result_path}.rank{r}.err").read_text().split("\n", 1)
            events.append((float(when), r, f"failed: {_exception_text(tb)}", tb))
    if died is not None:
        events.append((*died, ""))
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
# What a rank calls: torch.distributed's collectives seen by the launcher, not by the methods
# ----------------------------------------------------------------------------------------
# torch.distributed's functions a rank may wait in: wrapped in each worker by the launch
# (never by the methods), so that every observer sees each call, whoever makes it (a script,
# a copied class, torch's own classes that call them by these names). Calls from threads
# other than the main one pass straight through.
COLLECTIVE_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                    "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
OBJECT_CALLS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")
TRACED_CALLS = COLLECTIVE_CALLS + P2P_CALLS + OBJECT_CALLS
# calls whose every rank gives tensors of the same shape (the others: a root's list, uneven splits)
SAME_SHAPES = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
               "reduce_scatter"}


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
        return super().__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)


def _unwrapped_ops(ops):
    """batch_isend_irecv's list with torch's own isend/irecv (it tells them apart by identity)."""
    out = []
    for p in ops:
        q = object.__new__(type(p))
        q.__dict__.update(p.__dict__, op=getattr(p.op, "__wrapped__", p.op))
        out.append(q)
    return out


_OBSERVERS = []   # what watches the calls in this process (the device audit, the flight recorder)


def _traced(name, fn):
    import inspect
    params = list(inspect.signature(fn).parameters)
    where = {k: params.index(k) for k in ("group", "async_op") if k in params}

    def traced(*args, **kwargs):
        if not _OBSERVERS or threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        group = kwargs.get("group", args[where["group"]] if len(args) > where.get("group", 1 << 30) else None)
        async_op = name in ("isend", "irecv", "batch_isend_irecv") or \
            kwargs.get("async_op", args[where["async_op"]] if len(args) > where.get("async_op", 1 << 30) else False)
        tokens = [o.enter(name, args, kwargs, group, async_op) for o in list(_OBSERVERS)]
        result = fn(_unwrapped_ops(args[0]), *args[1:], **kwargs) if name == "batch_isend_irecv" else \
            fn(*args, **kwargs)
        for o, token in zip(list(_OBSERVERS), tokens):
            o.exit(token, result)
        return result
    traced.__wrapped__, traced.__name__, traced.__doc__ = fn, fn.__name__, fn.__doc__
    return traced


@contextlib.contextmanager
def traced_calls(observer):
    """Inside the block, ``observer.enter(op, args, kwargs, group, async_op)`` runs before
    every call of TRACED_CALLS this process's main thread makes (it may raise: the call does
    not run) and ``observer.exit(its token, the call's result)`` after it returns. The first
    observer puts the wrappers in place, the last one out takes them away."""
    if not _OBSERVERS:
        _traced_calls_real.update({name: getattr(dist, name) for name in TRACED_CALLS if hasattr(dist, name)})
        for name, fn in _traced_calls_real.items():
            setattr(dist, name, _traced(name, fn))
        _traced_calls_real["P2POp"] = dist.P2POp
        dist.P2POp = _P2POp
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)
        if not _OBSERVERS:
            for name, fn in _traced_calls_real.items():
                setattr(dist, name, fn)
            _traced_calls_real.clear()


_traced_calls_real = {}


# ----------------------------------------------------------------------------------------
# The device audit: a GPU's device rules on a CPU run
# ----------------------------------------------------------------------------------------
AUDIT_ENV = "KIT_DEVICE_AUDIT"   # =1: a CPU job runs under DeviceAudit (the tests' way to see GPU-only bugs)
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
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


_FILES = {}   # a frame's file -> its name, or None where the walk skips it (torch's; this file's, if asked)


def _caller(depth: int, skip_common: bool) -> str:
    """file:line of the first frame from ``depth`` up (as the calling function's
    sys._getframe counts) outside torch (and this file, with ``skip_common``): where a
    tensor was made, or a collective called."""
    f = sys._getframe(depth + 1)
    while f is not None:
        path = f.f_code.co_filename
        key = (path, skip_common)
        name = _FILES.get(key, 0)
        if name == 0:
            skip = path.startswith(_TORCH_DIR) or (skip_common and path == __file__)
            name = _FILES[key] = None if skip else os.path.basename(path)
        if name is not None:
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"


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
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)]
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
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]
        if target is None:   # inherited: from the inputs of one or more dimensions first, then the scalars
            wide = [t for t in inputs if t.dim() > 0] or inputs
            kinds = [self.of(t)[0] for t in wide]
            target = DEVICE if DEVICE in kinds else (HOST if kinds and all(k == HOST for k in kinds) else None)
            made = next((self.of(t)[1] for t in wide if self.of(t)[0] == HOST), "")
        else:
            made = _caller(1, skip_common=False) if target == HOST else ""
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
_SENT_ARG = {"all_gather_object": 1, "gather_object": 0, "broadcast_object_list": 0}   # which argument is sent


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
        which = _SENT_ARG[name]

        def call(*args, **kwargs):
            args = list(args)
            if name == "broadcast_object_list":   # the list is sent from one rank, filled on the others
                listed = args[0]
                sent = [ship(o) for o in listed]
                out = real(sent, *args[1:], **kwargs)
                listed[:] = [unship(o) for o in sent]
                return out
            args[which] = ship(args[which])
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


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives at the same place of a group (--check-collectives)."""


def _stack(frame, limit=6) -> list:
    """The last ``limit`` frames of a thread's Python stack, outside torch, as file:line func: code."""
    lines = []
    for fs in traceback.extract_stack(frame)[::-1]:
        if fs.filename.startswith(_TORCH_DIR) or fs.filename == threading.__file__:
            continue
        lines.append(f"{Path(fs.filename).name}:{fs.lineno} {fs.name}: {(fs.line or '').strip()}")
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
        self.seq, self.groups, self.flight, self.done, self.on, self._by_id = {}, {}, [], None, True, {}
        self.unsettled = []   # --check-collectives: async collectives whose comparison is not settled yet
        self.entered, self.stopped = 0, threading.Event()
        self.main = threading.main_thread()
        self.watch = None   # under torchrun: this rank's StallWatch (the first rank still beating reports)
        self._publish(stack=False)
        self.thread = threading.Thread(target=self._beat, name="kit-flight-recorder", daemon=True)
        self.thread.start()

    # -- the calls
    def _group(self, group):
        """(name, global ranks) of a process group (None: the world), cached by the object."""
        got = self._by_id.get(id(group))
        if got is None or got[2] is not group:
            pg = group or dist.group.WORLD
            self.groups[pg.group_name] = dist.get_process_group_ranks(pg)
            got = self._by_id[id(group)] = (pg.group_name, self.groups[pg.group_name], group)
        return got[0], got[1]

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
               "site": _caller(2, skip_common=True), "t0": time.time(), "t1": None, "async": bool(async_op), "works": []}
        self.calls.append(rec)   # (appends and removes of lists are atomic: the beat thread copies them)
        self.entered += 1
        self.flight.append(rec)
        if self.check and op not in P2P_CALLS:   # (before the call: a mismatch is refused, not run)
            self._settle()
            self._compare(rec, wait=not async_op)
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
            self.unsettled.append((count, mine, sign, time.time(), [False]))
            return
        others = [r for r in ranks if r != self.rank]
        start, pause, posted, look = time.time(), 5e-5, False, 0.0
        while self.store.add(count, 0) < len(ranks):   # (polled: a store's wait that times out logs warnings)
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
            now = time.time()
            if now > start + self.timeout:
                raise RuntimeError(f"--check-collectives: the other ranks did not call #{seq} on "
                                   f"{_label(key, ranks, self.world)} within --timeout {self.timeout:g} s")
            if now < start + _POST:
                continue
            if not posted:
                self.store.set(f"now/{self.rank}", json.dumps(mine))
            self._posted_mismatch(mine, sign, posted)
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
            count, mine, sign, t0, posted = item
            if self.store.add(count, 0) == len(mine["ranks"]):
                self.unsettled.remove(item)
                continue
            if now < t0 + _POST:
                continue
            try:
                self._posted_mismatch(mine, sign, posted[0])
            except CollectiveMismatch:
                self.unsettled.clear()
                raise
            posted[0] = True

    def _posted_mismatch(self, mine, sign, posted):
        """Post this rank's call at its place (unless ``posted``) and compare it with what the
        group's other ranks posted there: one with another signature is a mismatch."""
        key, seq = mine["group"], mine["seq"]
        if not posted:
            self.store.set(f"sig/{key}/{seq}/{self.rank}", json.dumps(mine))
        for r in mine["ranks"]:
            k = f"sig/{key}/{seq}/{r}"
            if r != self.rank and self.store.check([k]):
                theirs = json.loads(self.store.get(k))
                if _signature(theirs, mine["op"]) != sign:
                    raise CollectiveMismatch(_mismatch_text(key, seq, {self.rank: mine, r: theirs}, self.world))

    # -- the published state
    def _state(self, stack=True) -> dict:
        for rec in list(self.flight):   # async calls whose work is done (or dropped)
            if rec["works"] and all(w() is None or w().is_completed() for w in rec["works"]):
                rec["t1"], rec["works"] = time.time(), []
                with contextlib.suppress(ValueError):
                    self.flight.remove(rec)
                self.done = rec
        flight = [_brief(r) for r in list(self.flight)]
        done = _brief(self.done) if self.done else None
        seq = dict(self.seq)
        blocked = any(r["t1"] is None and not r["async"] for r in self.flight)
        frame = sys._current_frames().get(self.main.ident)
        return {"rank": self.rank, "pid": os.getpid(), "host": platform.node(), "t": time.time(),
                "flight": flight, "done": done, "seq": seq, "groups": self.groups,
                "stack": _stack(frame) if stack and frame is not None and not blocked else []}

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


def diagnose(states: dict, now: float, world: int, stall_after: float, alive=_process_state) -> dict | None:
    """A stall from every rank's published state (FlightRecorder), or None: some rank has
    waited ``stall_after`` seconds or more in a call. Each waiting rank's oldest call is
    followed to the ranks that have not entered it (by its sequence number on its group,
    or on its pair for a point-to-point message), and from those to the ones they wait for
    in turn: the first named are the ranks the others wait for at the end of that chain
    (busy in no call, not responding, finished, or waiting on a call nobody else reached)
    and the ranks that entered the same place of a group with another call. A rank whose
    recorder has gone silent is not taken at its last word: it is the one not responding,
    in whatever call it last said it was (a stopped process holds up a collective it had
    entered too). Returns {"culprits": [rank, ...], "text": the report, "first": one line
    naming the first, "stuck": the failure's first line, "kind", "silent": the ranks not
    responding}."""
    # a process this host sees stopped or gone is silent at once: its last state, published
    # up to a beat before it stopped, may still look fresh
    proc = {r: alive(s["pid"], s["host"]) for r, s in states.items() if not s.get("finished")}
    silent = {r for r in range(world) if r not in states or
              (not states[r].get("finished") and (now - states[r]["t"] > 3 * BEAT
                                                   or proc[r] in ("stopped", "stopped (traced)", "gone")))}
    flight = {r: s["flight"] for r, s in states.items() if s.get("flight") and r not in silent}
    waiting = {r: min(f, key=lambda c: c["t0"]) for r, f in flight.items()}
    stalled = {r: c for r, c in waiting.items() if now - c["t0"] >= stall_after}
    if not stalled:
        return None

    def status(r):
        s = states.get(r)
        if s is None:
            return "not responding: never started its recorder"
        if s.get("finished"):
            return "finished its work"
        if r in silent:
            how = proc[r]
            return (f"not responding: {how}" if how else "not responding (alive, its recorder silent)") + \
                f"; its last state is {now - s['t']:.0f} s old"
        if r in waiting:
            c = waiting[r]
            return f"waits {'for its async' if c['async'] else 'in'} {_call_text(c, world, now)}"
        return "busy in no call" + (f", at {s['stack'][0]}" if s.get("stack") else "")

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
    rows = []
    for r in range(world):
        s = states.get(r, {})
        done = s.get("done")
        fresh = s and now - s["t"] <= 3 * BEAT
        where = s.get("stack", [])[:3] if fresh and (r not in waiting or waiting[r]["async"]) else []
        rows.append(f"| {r}{' *' if r in culprits else ''} | {status(r)} | "
                    f"{_call_text(done, world) if done else '-'} | {' <- '.join(where) or '-'} |")
    culprits = culprits or [min(stalled)]
    first, who = culprits[0], ", ".join(map(str, culprits))
    waiters = sorted(r for r in stalled if r not in culprits)
    waited = (f"; rank{'s' * (len(waiters) > 1)} {', '.join(map(str, waiters))} waited "
              f"{now - min(stalled[w]['t0'] for w in waiters):.0f} s") if waiters else ""
    if kind == "mismatch":
        head = f"stall: ranks {who} are in different calls at the same place of a group{waited}"
        stuck = f"ranks {who} called different collectives at the same place: " + " / ".join(notes.values())
    elif kind == "cycle":
        head = f"stall: ranks {who} wait for each other{waited}"
        stuck = f"ranks {who} stuck first, waiting for each other: " + "; ".join(
            f"rank {r} {status(r)}" for r in culprits)
    else:
        head = f"stall: the ranks wait for rank{'s' * (len(culprits) > 1)} {who} ({status(first)}){waited}"
        stuck = f"rank {first} stuck first: {status(first)} (the rank the others waited for)"
    text = "\n".join([head, *[f"  {n}" for n in notes.values()],
                      "| rank | state | last call completed | where (innermost first) |", "|---|---|---|---|", *rows])
    return {"culprits": culprits, "text": text, "first": f"rank {first} {status(first)}", "stuck": stuck,
            "kind": kind, "silent": sorted(silent)}


class StallWatch:
    """Every rank's published state, read from the job's store; when a rank has waited in a
    call for ``stall_report`` seconds, ``tick()`` prints one table (``diagnose``) naming the
    ranks the others wait for, again at most every ``stall_report`` seconds while the stall
    lasts; ``diagnosis`` keeps the last one, for the failure report. Under torchrun every
    rank watches and the first rank still beating prints (``me``)."""

    def __init__(self, store, world, stall_report, me=None, out=None):
        self.store, self.world, self.stall_report, self.me = store, world, stall_report, me
        self.out, self.diagnosis, self.shown = out or sys.stdout, None, 0.0

    def states(self) -> dict:
        keys = [f"state/{r}" for r in range(self.world)]
        got = {}
        for r, k in enumerate(keys):
            if self.store.check([k]):
                got[r] = json.loads(self.store.get(k))
        return got

    def tick(self):
        now = time.time()
        states = self.states()
        d = diagnose(states, now, self.world, self.stall_report)
        self.diagnosis = d or (self.diagnosis if self.diagnosis and any(s.get("flight") for s in states.values())
                               else None)
        if d is None or now - self.shown < self.stall_report:
            return
        if self.me is not None:   # under torchrun: the first rank whose state is fresh prints
            fresh = [r for r, s in states.items() if r not in d["silent"] and not s.get("finished")]
            if not fresh or self.me != min(fresh):
                return
        self.shown = now
        print(d["text"], file=self.out, flush=True)


def recorder_modes(ctx, args, make, global_batch=False) -> list:
    """What the flight recorder costs one method's step: ``make()`` (as time_methods takes
    it) built three times and stepped alternately with the recorder off, on, and on with
    --check-collectives (the paired ratios over off), beside each traced call's own cost
    (the recorder's bookkeeping per call, timed alone; the check's store round trips, from
    a 1-element all-reduce on the world with and without it) times the traced calls a step
    makes. Rows for a table; collective on the world."""
    rec = _RECORDER[0]

    def mode(on, check):
        def build():
            step = make()

            def timed(batch, clock):
                rec.on, rec.check = on, check
                try:
                    step(batch, clock)
                finally:
                    rec.on, rec.check = True, False
            return timed
        return build
    names = {"recorder off": (False, False), "recorder on": (True, False),
             "recorder on, --check-collectives": (True, True)}
    rows = time_methods(ctx, args, {n: mode(*m) for n, m in names.items()}, global_batch=global_batch)
    before = rec.entered
    mode(True, False)()(*_first_batch(ctx, args, global_batch))
    per_step = rec.entered - before
    x = torch.zeros(1, device=ctx.device)
    scratch = FlightRecorder(ctx, dist.HashStore())   # its sequence numbers are its own: the job's stay in step
    traced = _traced("all_reduce", lambda *a, **k: None)
    saved = _OBSERVERS[:]

    def bookkeeping(observers, n=20000):
        _OBSERVERS[:] = observers
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                traced(x)
            return (time.perf_counter() - t0) / n
        finally:
            _OBSERVERS[:] = saved
    recorder = min(bookkeeping([scratch]) for _ in range(3)) - min(bookkeeping([]) for _ in range(3))
    scratch.finish()

    def world_calls(check, n=50):   # the check's store round trips on the world, 8 blocks each way
        rec.check = check
        try:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            return (time.perf_counter() - t0) / n
        finally:
            rec.check = False
    blocks = [(world_calls(False), world_calls(True)) for _ in range(8)]
    check = statistics.median(b - a for a, b in blocks)
    cost = {"recorder off": 0.0, "recorder on": recorder, "recorder on, --check-collectives": recorder + check}
    base = rows[0]
    for r in rows:
        r.update(vs_paired(r, base, "vs_off"), traced_calls_per_step=per_step, call_cost_us=cost[r["method"]] * 1e6,
                 calls_share_of_step=cost[r["method"]] * per_step / (base["step_ms"] / 1e3))
    return rows


def _first_batch(ctx, args, global_batch):
    batch = lm_batch(args.batch_size, args.context_length, 0, args.seed, ctx.device)
    return (batch if global_batch else tuple(shard(t, ctx.rank, ctx.world_size) for t in batch)), \
        StepClock(ctx.device)


RECORDER_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "vs_off", "vs_off_min", "vs_off_max",
                    "traced_calls_per_step", "call_cost_us", "calls_share_of_step"]
RECORDER_NOTE = ("The flight recorder (every job runs under it) off, on, and on with --check-collectives, the same "
                 "method's steps alternating: vs_off is the median of the paired steps' ratios over the recorder off "
                 "[min, max]; call_cost_us: what one traced call costs more: the recorder's bookkeeping (its wrapper, "
                 "entry and exit, timed 20000 times against the bare wrapper) and the check's store round trips (a "
                 "1-element all-reduce on the world with and without it, 8 blocks of 50 each way, the median "
                 "difference); calls_share_of_step: that cost times the traced calls of one step, over the step "
                 "(the paired ratio's spread is the machine's noise; this share is the recorder's own cost).")


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
SENT_SHARE = {"allreduce_": lambda n: 2 * (n - 1) / n, "_allgather_base_": lambda n: (n - 1) / n,
              "allgather_": lambda n: (n - 1) / n, "allgather_into_tensor_coalesced_": lambda n: (n - 1) / n,
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


def agreed_past(ctx: Ctx, past: bool, group=None) -> bool:
    """Whether any rank of ``group`` says a time box has passed (a collective: the ranks
    decide together whether to start the next part)."""
    flag = torch.tensor([float(past)], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


BENCH_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "comm_ms", "comm_share", "collectives"]


def report_table(args, name: str, title: str, rows: list, headers=BENCH_HEADERS, note: str = ""):
    """Save a benchmark's rows as <out>/<name>.json and .md and print the table (in the
    reporting process only)."""
    if not is_reporter():
        return
    table = save_results(args.out, name, rows, lm_settings(args), headers=headers, title=title, note=note)
    print(f"\n{title}\n({args.model_size} LM, {args.world_size} x {args.backend}/{args.device}, global batch "
          f"{args.batch_size}x{args.context_length}; times in ms, median [min, max] of {args.steps} steps)\n"
          f"{table}\nwrote {args.out}/{name}.json and .md", flush=True)


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
            opt.zero_grad(set_to_none=case.get("set_to_none", True))
            if case.get("uneven"):   # the same loss, written per part so each part can choose its layers
                parts = zip(x.chunk(self.size), y.chunk(self.size))
                loss = sum(self.reference(xp, yp, use_extra=self._extra(step, i))
                           for i, (xp, yp) in enumerate(parts)) / self.size
            else:
                loss = self.reference(x, y, use_extra=self._extra(step, 0))
            loss.backward()
            opt.step()

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


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _atomic_write(path: Path, write):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_UMASK)   # mkstemp makes it private; results are for sharing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
                 extra: dict | None = None, note: str = "") -> str:
    """Write <out>/<name>.json (everything) and <name>.md (the whole table), each
    atomically; return the table for printing (split where it is wider than TABLE_WIDTH)."""
    out = Path(out_dir)
    info = machine_info(settings.get("device"))
    table = markdown_table(rows, headers) if rows else "(no rows)"
    doc = {"name": name, "title": title, "settings": settings, "machine": info, "rows": rows,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), **(extra or {})}
    _atomic_write(out / f"{name}.json", lambda f: f.write(json.dumps(doc, indent=1, default=str).encode()))
    md = (f"# {title or name}\n\nMachine: {info['device']}, torch {info['torch']}, "
          f"{doc['time']}.\nSettings: {json.dumps(settings, default=str)}\n\n{table}\n")
    _atomic_write(out / f"{name}.md", lambda f: f.write((md + (f"\n{note}\n" if note else "")).encode()))
    return fit_width(rows, headers) if rows else table


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path):
    """Save a matplotlib figure atomically as PNG and close it."""
    _atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    pyplot().close(fig)


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
        try:
            check_out(args.checkpoint_dir)
        except UsageError as e:
            raise UsageError(str(e).replace("--out", "--checkpoint-dir")) from None


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
    load_sharded(module, optimizer, folder)
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
    start, folder = 0, latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if folder:
        start = load_sharded(module, optimizer, folder)["step"]
        if ctx.rank == 0:
            print(f"resumed from step {start}", flush=True)
    fault = os.environ.get(FAULT_ENV)
    kill_at, kill_rank = (int(v) for v in fault.split(":")) if fault else (None, None)
    for i in range(start, args.train):
        if i == kill_at and ctx.rank == kill_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        step_fn(i)
        if args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
            save_sharded(module, optimizer, args.checkpoint_dir, i + 1, extra={"step": i + 1},
                         async_save=args.checkpoint_async)
    wait_for_saves()
    full = full_state_dict(module)
    if not full:
        return None
    digest = weights_sha256(full)
    print(f"final weights sha256 {digest}", flush=True)
    return digest


# ----------------------------------------------------------------------------------------
# The placement record: how each axis laid a parameter out, and what it serves
# ----------------------------------------------------------------------------------------
# ---- begin copy: placement record (needs only torch and the standard library) ----
import contextlib  # noqa: E402  (the copy region's own imports: common.py has them above)
import math  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class Placement:
    """How one axis laid a tensor out over ``group`` (a process group; None: every rank):

    "replicate": every rank of the group holds the same tensor (data-parallel copies,
        tensor parallelism's whole weights, a tied weight's copy on another stage);
    "shard": the tensor is rank r's chunk of a tensor shaped ``shape``, cut along ``dim``
        into chunks of ceil(shape[dim] / n) (the last padded with zeros), after that dim is
        put in the order ``order`` (a tensor of indices; None: as it is);
    "part": the group's other ranks hold other tensors, each rank its own (a pipeline
        stage's layers, one ep rank's experts);
    "tied": another rank of the group holds a copy under another name, kept equal (a tied
        embedding on the first stage and output head on the last): norms count it once,
        checkpoints save it under each name.

    An axis records its placement on each parameter with ``place``; the record (a tuple,
    ``tensor.placement_record``) lists the axes in the order they were applied, so the last
    shard is the one nearest this rank's tensor. It is plain data on an ordinary tensor:
    gradients and optimizer states shaped like the parameter are laid out alike.
    """

    KINDS = ("replicate", "shard", "part", "tied")

    def __init__(self, kind, group=None, dim=0, shape=(), order=None):
        if kind not in self.KINDS:
            raise ValueError(f"placement kind {kind!r}: one of {self.KINDS}")
        self.kind, self.group, self.dim, self.shape, self.order = kind, group, dim, tuple(shape), order

    def __repr__(self):
        size = dist.get_world_size(self.group) if dist.is_initialized() else "?"
        extra = f", dim={self.dim}, shape={list(self.shape)}" if self.kind == "shard" else ""
        return f"Placement({self.kind!r}, {size} ranks{extra})"


def place(tensor, kind, group=None, dim=0, shape=None, order=None, like=None):
    """Append one axis's placement to ``tensor``'s record (after ``like``'s record, for a new
    tensor that stands for ``like``: a shard made from a parameter); returns ``tensor``.
    ``shape``: for "shard", the shape of the tensor it was cut from (default: the tensor's
    own shape times the group's size along ``dim``)."""
    if kind == "shard" and shape is None:
        shape = list(tensor.shape)
        shape[dim] *= dist.get_world_size(group)
    base = placements(like if like is not None else tensor)
    if kind != "shard" and any(p.kind == kind and p.group is group for p in base):
        return tensor   # recorded already (a second wrapper of the same kind over the same group)
    tensor.placement_record = base + (Placement(kind, group, dim, shape or (), order),)
    return tensor


def placements(tensor) -> tuple:
    """``tensor``'s placement record: () for one no axis has touched."""
    return getattr(tensor, "placement_record", ())


_RANKS = {}


def _ranks(group) -> frozenset:
    """The global ranks of ``group`` (None: every rank)."""
    key = id(group)
    if key not in _RANKS:
        _RANKS[key] = (group, frozenset(dist.get_process_group_ranks(group or dist.group.WORLD)))
    return _RANKS[key][1]


def _counted(tensor, process_group, known=()) -> bool:
    """Whether this rank counts ``tensor`` once in a sum over ``process_group`` (so that every
    element of the model is counted once over it): it is the first rank of every group that
    replicates it inside ``process_group``, and of every group of ``known`` (the groups the
    model's other records name) that its record does not mention: an axis that split or
    spread the tensor would have said so (a weight a partial tensor-parallel plan left whole
    is the same on every tp rank). A tensor with no record is one process's, the same on
    every rank: the group's first rank counts it. A shard or part spread over ranks outside
    ``process_group`` cannot be summed in it: ValueError."""
    record, within, me = placements(tensor), _ranks(process_group), dist.get_rank()
    if not record:
        return dist.get_rank(process_group) == 0
    for p in record:
        inside = _ranks(p.group) <= within
        if p.kind in ("replicate", "tied") and inside and dist.get_rank(p.group) != 0:
            return False
        if p.kind in ("shard", "part") and not inside:
            raise ValueError(f"a parameter is split ({p.kind}) over ranks outside the process group the norm or count "
                             f"is taken over: pass a process_group that holds them (default: every rank)")
    for group in known:
        ranks = _ranks(group)
        if ranks <= within and not any((_ranks(p.group) & ranks) - {me} for p in record) \
                and dist.get_rank(group) != 0:
            return False
    return True


def _known_groups(params) -> list:
    """Every group the records of ``params`` name (each once)."""
    groups = {}
    for p in params:
        for pl in placements(p):
            groups.setdefault(id(pl.group), pl.group)
    return list(groups.values())


def _parameters(model_or_parameters) -> list:
    if isinstance(model_or_parameters, torch.Tensor):
        return [model_or_parameters]
    params = model_or_parameters.parameters() if hasattr(model_or_parameters, "parameters") else model_or_parameters
    unique = {}
    for p in params:
        unique.setdefault(id(p), p)
    return list(unique.values())


@torch.no_grad()
def clip_grad_norm_(model_or_parameters, max_norm: float, norm_type: float = 2.0, process_group=None):
    """torch.nn.utils.clip_grad_norm_ for a model split over ranks by any composition of axes
    that recorded their placements: the norm of the whole model's gradient, each element
    counted once over ``process_group`` (default: every rank; all of its ranks call it, a
    collective), so every rank clips by the same factor. Returns that norm. ``norm_type``:
    any p, or inf (the largest element). Pass the group spanning the model's ranks when
    other ranks train something else; a group that replicates a parameter beyond it (data-
    parallel copies, each clipping alike) is left out of the count."""
    params = [p for p in _parameters(model_or_parameters) if p.grad is not None]
    grads = [p.grad.detach() for p in params]
    device = grads[0].device if grads else (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(process_group) == "nccl"
        else torch.device("cpu"))
    known = _known_groups(params)
    counted = [g for p, g in zip(params, grads) if _counted(p, process_group, known)]
    norm_type = float(norm_type)
    fp32 = [g for g in counted if g.dtype == torch.float32 and g.numel()]   # torch's fused norms
    rest = [g for g in counted if g.dtype != torch.float32 and g.numel()]   # each in float32
    fused = torch.nn.utils.get_total_norm(fp32, norm_type).to(device) if fp32 else torch.zeros((), device=device)
    inf = math.isinf(norm_type)
    if inf:
        total = torch.stack([g.abs().max().float() for g in rest] + [fused]).max()
    else:
        total = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type for g in rest),
                    fused ** norm_type)
    if dist.get_world_size(process_group) > 1:   # a group of one has nothing to add
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=process_group)
    if not inf:
        total = total ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)   # max_norm / (total + 1e-6), at most 1
    return total


def _real_numel(tensor) -> int:
    """The elements of ``tensor`` that are the model's (a shard's padding left out)."""
    shards = [p for p in placements(tensor) if p.kind == "shard"]
    if not shards:
        return tensor.numel()
    last = shards[-1]
    shape = list(last.shape) or [1]
    n, r = dist.get_world_size(last.group), dist.get_rank(last.group)
    chunk = -(-shape[last.dim] // n)
    shape[last.dim] = max(0, min(chunk, shape[last.dim] - r * chunk))
    return math.prod(shape)


def count_parameters(model_or_parameters, process_group=None) -> int:
    """The whole model's number of parameters, each counted once over ``process_group``
    (collective: every rank of it calls)."""
    params = _parameters(model_or_parameters)
    known = _known_groups(params)
    mine = sum(_real_numel(p) for p in params if _counted(p, process_group, known))
    total = torch.tensor([mine], dtype=torch.float64,
                          device=params[0].device if params else torch.device("cpu"))
    dist.all_reduce(total, group=process_group)
    return int(total.item())


def _gather_shard(t, p):
    """The tensor ``p`` cut ``t`` from, whole again (collective over p.group)."""
    n = dist.get_world_size(p.group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=p.group)
    if not p.shape:   # a 0-d tensor, sharded as one row
        return torch.cat(parts)[:1].reshape(())
    full = torch.cat(parts, dim=p.dim).narrow(p.dim, 0, p.shape[p.dim])
    if p.order is None:
        return full
    return torch.empty_like(full).index_copy_(p.dim, p.order.to(full.device), full)


def _cut_shard(whole, p):
    """This rank's chunk of ``whole`` (shaped p.shape) as ``p`` cuts it."""
    if p.order is not None:
        whole = whole.index_select(p.dim, p.order.to(whole.device))
    whole = whole.reshape(1) if not p.shape else whole
    n, r = dist.get_world_size(p.group), dist.get_rank(p.group)
    chunk = -(-whole.shape[p.dim] // n)
    shape = list(whole.shape)
    shape[p.dim] = chunk
    out = torch.zeros(shape, dtype=whole.dtype, device=whole.device)
    lo, hi = r * chunk, min((r + 1) * chunk, whole.shape[p.dim])
    if lo < hi:
        out.narrow(p.dim, 0, hi - lo).copy_(whole.narrow(p.dim, lo, hi - lo))
    return out


def whole_tensor(t, record):
    """``t`` (a parameter, or its gradient or optimizer state) made whole: every shard of
    ``record`` gathered, innermost first (collective over each shard's group)."""
    t = t.detach()
    for p in reversed(record):
        if p.kind == "shard":
            t = _gather_shard(t, p)
    return t


def local_tensor(whole, record):
    """This rank's part of a whole tensor laid out as ``record`` says."""
    for p in record:
        if p.kind == "shard":
            whole = _cut_shard(whole, p)
    return whole


def _sends(record, process_group) -> bool:
    """Whether this rank contributes a tensor to a checkpoint merged over ``process_group``:
    the first rank of every group inside it that replicates the tensor (a tensor with no
    record: every rank, the first rank's kept)."""
    within = _ranks(process_group)
    return all(dist.get_rank(p.group) == 0 for p in record if p.kind == "replicate" and _ranks(p.group) <= within)


def _collect(mine, process_group, all_ranks):
    """Every rank's ``mine``, in rank order, on the group's first rank (or on every rank with
    ``all_ranks``); None elsewhere (collective)."""
    n = dist.get_world_size(process_group)
    if n == 1:
        return [mine]
    if all_ranks:
        parts = [None] * n
        dist.all_gather_object(parts, mine, group=process_group)
        return parts
    first = dist.get_global_rank(process_group or dist.group.WORLD, 0)
    parts = [None] * n if dist.get_rank() == first else None
    dist.gather_object(mine, parts, dst=first, group=process_group)
    return parts


def _union(tables) -> dict:
    out = {}
    for table in tables:
        for k, v in table.items():
            out.setdefault(k, v)
    return out


def _host(v):
    return v.detach().cpu().clone() if torch.is_tensor(v) else v


@torch.no_grad()
def full_state_dict(module, process_group=None, all_ranks=False) -> dict:
    """``module.state_dict()`` of the whole model, every tensor whole and on the host, by its
    own name, merged from every rank of ``process_group`` (default: every rank; all call it,
    a collective): on the group's first rank ({} on the others), or with ``all_ranks`` on
    every rank. Loadable by load_full_state_dict on any composition, or by the model of one
    process."""
    mine = {}
    for name, t in module.state_dict(keep_vars=True).items():
        whole = whole_tensor(t, placements(t))
        if _sends(placements(t), process_group):
            mine[name] = _host(whole)
    parts = _collect(mine, process_group, all_ranks)
    return {} if parts is None else _union(parts)


@torch.no_grad()
def load_full_state_dict(module, state: dict, strict=True):
    """Load whole tensors by name (a full_state_dict saved on any composition, or one
    process's state_dict): each rank keeps its part of every tensor it holds. Pass it on
    every rank. ``strict``: a tensor of the module missing from ``state`` is a KeyError."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, t in own.items():
        if name in state:
            t.copy_(local_tensor(state[name].to(t.device, t.dtype), placements(t)))


def _names(module) -> dict:
    """{id(parameter): every name it has in ``module``} (a tied weight has two)."""
    names = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


@torch.no_grad()
def full_optim_state_dict(module, optimizer, process_group=None, all_ranks=False) -> dict:
    """``optimizer``'s state with every tensor whole, keyed by the parameter's name in
    ``module`` (under each name of a tied weight), and its groups' settings with their
    parameters' names, merged over ``process_group`` as full_state_dict does (a
    collective). Loadable by load_full_optim_state_dict on any composition."""
    names = _names(module)
    state = {}
    for p in (p for g in optimizer.param_groups for p in g["params"]):   # the same order on every rank
        record = placements(p)
        entry = {k: whole_tensor(v, record) if torch.is_tensor(v) and v.shape == p.shape and v.dim() else v
                 for k, v in optimizer.state.get(p, {}).items()}
        if entry and _sends(record, process_group):
            state.update({n: {k: _host(v) for k, v in entry.items()} for n in names[id(p)]})
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [n for p in g["params"] for n in names[id(p)]]}
              for g in optimizer.param_groups]
    parts = _collect({"state": state, "groups": groups}, process_group, all_ranks)
    if parts is None:
        return {}
    merged = [dict(g, params=[]) for g in parts[0]["groups"]]
    for part in parts:   # each group's parameters, over every rank (the first rank's settings)
        if len(part["groups"]) != len(merged):
            raise ValueError("the ranks' optimizers have different numbers of parameter groups")
        for g, other in zip(merged, part["groups"]):
            g["params"] += [n for n in other["params"] if n not in g["params"]]
    return {"state": _union(part["state"] for part in parts), "param_groups": merged}


@torch.no_grad()
def load_full_optim_state_dict(module, optimizer, full: dict):
    """Load a full_optim_state_dict (saved on any composition) into ``optimizer``, built over
    this rank's parameters of ``module`` with the saved groups' settings: each parameter
    takes its part of its saved state. Pass it on every rank."""
    names = _names(module)
    if len(optimizer.param_groups) != len(full["param_groups"]):
        raise ValueError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
                         f"{len(full['param_groups'])}")
    state, groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, full["param_groups"]):
        ids = []
        for p in group["params"]:
            if not set(names[id(p)]) & set(saved["params"]):
                raise ValueError(f"{names[id(p)][0]} is not in the saved parameter group it is in here")
            entry = next((full["state"][n] for n in names[id(p)] if n in full["state"]), {})
            if entry:
                state[index] = {k: local_tensor(v.to(p.device), placements(p)) if torch.is_tensor(v) and v.dim()
                                else v for k, v in entry.items()}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- a model built on the meta device: each rank's part made real, filled a tensor at a time --
_HOLDERS = [0]   # how many storage holders were made: their order (an inner wrapper first)


def hold_storage(tensor, holder):
    """Say that ``holder`` (an axis's object with ``materialize_storage(device)``) gives
    ``tensor`` its storage when materialize makes a meta-built model real (FSDP: shards that
    are views of one flat buffer; DDPBucketed: buckets built over the parameters)."""
    if not hasattr(holder, "_holder_order"):
        _HOLDERS[0] += 1
        holder._holder_order = _HOLDERS[0]
    held = tensor.__dict__.setdefault("storage_holders", [])
    if all(h is not holder for h in held):
        held.append(holder)
    return tensor


def make_real(t, data=None, device=None):
    """Put ``data`` (a real tensor shaped like ``t``; default: an uninitialised one on
    ``device``) in place of the meta tensor ``t`` (a parameter or a buffer), keeping ``t``'s
    Python object: whatever holds it (a module, an axis's lists) sees the real tensor, with
    its attributes (the placement record) and its gradient hooks (registered again: they
    belong to the storage torch swaps out)."""
    if data is None:
        data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        data = torch.nn.Parameter(data, requires_grad=t.requires_grad)
    saved = dict(t.__dict__)
    pre = list((t._backward_hooks or {}).values()) if t.requires_grad else []
    post = list((getattr(t, "_post_accumulate_grad_hooks", None) or {}).values())
    torch.utils.swap_tensors(t, data)
    t.__dict__.update(saved)
    if pre or post:
        t._backward_hooks, t._post_accumulate_grad_hooks = None, None
        for hook in pre:
            t.register_hook(hook)
        for hook in post:
            t.register_post_accumulate_grad_hook(hook)
    return t


def _tensors(module) -> dict:
    """{a name the model of one process gives it: [tensor, ...]} for every parameter and buffer
    of ``module`` (a tied one under each name). A wrapper's ``module.`` (the kit's, torch
    DDP's; any module with ``wraps_module``) and torch.compile's ``_orig_mod.`` are left out
    of the names."""
    out = {}

    def walk(mod, prefix, seen):
        for kind in (mod._parameters, mod._buffers):
            for name, t in kind.items():
                if t is not None:
                    out.setdefault(prefix + name, [])
                    if all(x is not t for x in out[prefix + name]):
                        out[prefix + name].append(t)
        wrapper = getattr(mod, "wraps_module", False) or type(mod).__name__ in ("DistributedDataParallel",
                                                                                "OptimizedModule")
        for name, child in mod._modules.items():
            if child is None or id(child) in seen:
                continue
            skip = (wrapper and name == "module") or name == "_orig_mod"
            walk(child, prefix if skip else f"{prefix}{name}.", seen | {id(child)})
    walk(module, "", frozenset())
    return out


@torch.no_grad()
def materialize(module, device, source=None, strict=True):
    """Give every meta tensor of ``module`` (a model built under ``torch.device("meta")``,
    after the axes were applied: each holds only this rank's part, still on meta) real,
    uninitialised storage on ``device``, this rank's part only, then fill it from ``source``:

    - None: storage only; fill it with load_full_state_dict or load_sharded (the checkpoint
      path: load_sharded reads only this rank's pieces);
    - a state dict of whole tensors (one process's, or full_state_dict's);
    - an iterable of (name, whole tensor) pairs, each cut to this rank's part as it comes
      (``initialized(blueprint)``, the pretraining path: one tensor whole at a time).

    Names are the model's own (a wrapper's ``module.`` and compile's ``_orig_mod.`` aside),
    so pass the outermost object or any part holding the model's modules. An axis that
    keeps storage of its own (FSDP's flat buffers) makes its tensors real itself. Build the
    optimizer afterwards. ``strict``: a tensor made real that ``source`` did not fill is a
    KeyError. Returns ``module``."""
    device = torch.device(device)
    own = _tensors(module)
    meta = {id(t): (name, t) for name, ts in own.items() for t in ts if t.is_meta}
    holders = {}
    for _, t in meta.values():
        for h in t.__dict__.get("storage_holders", []):
            holders.setdefault(id(h), h)
    for h in sorted(holders.values(), key=lambda h: h._holder_order):
        h.materialize_storage(device)
    for _, t in meta.values():
        if t.is_meta:
            make_real(t, device=device)
    if source is None:
        return module
    filled = set()
    for name, whole in (source.items() if isinstance(source, dict) else source):
        if whole.is_meta and own.get(name):
            raise ValueError(f"materialize: the source's {name} is on the meta device: it holds no values")
        for t in own.get(name, []):
            t.copy_(local_tensor(whole.detach(), placements(t)).to(t.device, t.dtype))
            filled.add(id(t))
    missing = sorted({name for key, (name, _) in meta.items() if key not in filled})
    if strict and missing:
        raise KeyError(f"materialize: the source did not fill {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return module


class _OwnTensorsOnly(torch.overrides.TorchFunctionMode):
    """Inside one module's init: an in-place op on a meta tensor (another module's, not made
    real for this init) is an error, not a silent no-op."""

    def __init__(self, where):
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, torch.Tensor) and a.is_meta:
                    raise ValueError(f"the init of {self.where} writes {name} into a tensor that is not its own "
                                     f"(another module's): an init sets only its module's own parameters and buffers")
        return func(*args, **(kwargs or {}))


def initialized(blueprint, init=None, seed=None, device="cpu"):
    """(name, whole tensor) for every parameter and buffer of ``blueprint`` (the model as built
    on meta, before any axis: ``copy.deepcopy(model)`` costs nothing there), each made whole
    on ``device`` and initialised module by module, children before their parent as
    ``nn.Module.apply`` goes: ``init(module)`` (default: its ``reset_parameters()``) on the
    module's own tensors, the rest of the model left on meta. The same values, bit for bit,
    as one process running the same init on the same seed (``seed``: torch.manual_seed(seed)
    first, the caller's generator untouched), and as one process's constructor where it
    initialises its modules in that order (every nn.Linear and nn.Embedding does). A tied
    tensor keeps its first module's values (a later module's init still draws). At most
    one module's tensors are whole at a time. For materialize's ``source``."""
    names = {}
    for name, t in list(blueprint.named_parameters(remove_duplicate=False)) + \
            list(blueprint.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    done, order, seen = {}, [], set()

    def post(mod, path):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, child in mod._modules.items():
            if child is not None:
                post(child, f"{path}.{name}" if path else name)
        order.append((path, mod))
    post(blueprint, "")
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        for path, mod in order:
            own = [(kind, k, t) for kind in (mod._parameters, mod._buffers) for k, t in kind.items() if t is not None]
            if not own and init is None:
                continue   # (a given init still runs: it may draw, or refuse to write into a child)
            for kind, k, t in own:
                real = torch.empty(t.shape, dtype=t.dtype, device=device)
                kind[k] = torch.nn.Parameter(real, requires_grad=t.requires_grad) if kind is mod._parameters else real
            where = f"{path or 'the model'} ({type(mod).__name__})"
            if init is None and not hasattr(mod, "reset_parameters"):
                raise ValueError(f"{where} has parameters or buffers of its own and no reset_parameters: give "
                                 f"init=, a function of one module that sets its own tensors (e.g. "
                                 f"nn.init.ones_(m.weight) for a norm, m.reset_parameters() for the rest)")
            with _OwnTensorsOnly(where):
                (init or type(mod).reset_parameters)(mod)
            for kind, k, t in own:
                made, kind[k] = kind[k], t    # back to meta: the next module's turn
                if id(t) in done:
                    continue                  # tied: the first module's values
                done[id(t)] = True
                for name in names.get(id(t), []):
                    yield name, made.detach()
# ---- end copy: placement record ----


# ----------------------------------------------------------------------------------------
# Sharded checkpoints: each rank writes what it holds; any composition reads what it needs
# ----------------------------------------------------------------------------------------
# ---- begin copy: sharded checkpoint (needs torch, the standard library and common.py's placement record) ----
import contextlib  # noqa: E402  (the copy region's own imports)
import json  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


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
                part = part.index_select(d, f)
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
# ---- end copy: sharded checkpoint ----
