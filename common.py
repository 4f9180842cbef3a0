"""Shared plumbing for the numbered scripts: launching workers, timing, models, data, results.

Nothing here is a data-parallel method; the methods live in the numbered scripts.

Launching
    ``launch(worker, args)`` runs ``worker(ctx, args)`` on every rank and returns rank 0's
    return value.  Started plainly, the script spawns ``args.world_size`` processes itself;
    started by ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set) it runs the
    worker in the current process.  A rank that raises ends the whole job: the other ranks
    are killed, and ``LaunchError`` names the rank and carries its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


# ----------------------------------------------------------------------------------------
# Errors for bad input
# ----------------------------------------------------------------------------------------
class UsageError(Exception):
    """Bad input: main() prints the message on one line and exits with status 2."""


def run_main(main_fn):
    """Run a script's main(): bad input exits 2 with one line, a failed rank exits 1."""
    prog = Path(sys.argv[0]).name
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
    finally:
        finish_torchrun()


# ----------------------------------------------------------------------------------------
# Flags shared by the scripts
# ----------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def add_common_args(p: argparse.ArgumentParser, *, default_steps=10):
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn (default: GPUs if >=2 else 2; ignored under torchrun)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when there are enough GPUs, else gloo")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda for nccl, cpu for gloo")
    p.add_argument("--model-size", default=None,
                   help=f"LM size, one of {', '.join(MODEL_SIZES)} (default: mini on CPU, xl on GPU)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch, split across ranks (default on GPU: 4, or the world size if larger "
                        "and not a divisor of 4; on CPU: 2 x world size)")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=default_steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps, not measured (benchmarks count the collectives in the first two)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for results")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the job is failed")
    return p


def script_parser(doc: str, default_steps=10) -> argparse.ArgumentParser:
    """The parser of a DDP script (02 onwards): its docstring as help, the shared flags."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_steps=default_steps)
    add_verify_args(p)
    return p


def add_verify_args(p: argparse.ArgumentParser):
    p.add_argument("--data", choices=["random", "mnist"], default="random",
                   help="data for the verification run")
    p.add_argument("--data-root", default=str(ROOT / "data"), help="where MNIST lives")
    p.add_argument("--download", action="store_true", help="download MNIST if missing")
    p.add_argument("--verify-steps", type=int, default=5)
    p.add_argument("--no-verify", action="store_true", help="skip the verification")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the machine-dependent defaults and check every flag; raises UsageError."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if under_torchrun():
        args.world_size = int(os.environ["WORLD_SIZE"])
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
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)) if under_torchrun() else args.world_size
        if n_gpus < local:
            raise UsageError(f"nccl needs one GPU per rank: {local} ranks but {n_gpus} GPU(s) here; "
                             f"use --backend gloo or --world-size {max(n_gpus, 1)}")
    if args.device == "cuda" and n_gpus == 0:
        raise UsageError("--device cuda but no GPU is visible: use --device cpu")
    if getattr(args, "steps", 1) < 1 or getattr(args, "warmup", 0) < 0 or getattr(args, "verify_steps", 1) < 1:
        raise UsageError("--steps and --verify-steps must be at least 1, --warmup at least 0")
    if getattr(args, "timeout", 1) <= 0:
        raise UsageError("--timeout must be positive")
    if hasattr(args, "model_size"):
        if args.model_size is None:
            args.model_size = "xl" if args.device == "cuda" else "mini"
        if args.model_size not in MODEL_SIZES:
            raise UsageError(f"unknown --model-size {args.model_size!r}: choose one of {', '.join(MODEL_SIZES)}")
        if args.batch_size is None:
            # the course's global batch of 4 on GPUs, rounded up to a multiple of the ranks
            ws = args.world_size
            args.batch_size = -(-4 // ws) * ws if args.device == "cuda" else 2 * ws
        check_divisible(args.batch_size, args.world_size, "--batch-size")
        if args.context_length < 1:
            raise UsageError("--context-length must be at least 1")
    if getattr(args, "data", None) == "mnist":
        load_mnist(args.data_root, args.download)  # fails here, before any worker starts
    return args


def check_divisible(batch: int, world_size: int, flag: str):
    if batch < 1 or batch % world_size:
        raise UsageError(f"{flag} {batch} does not divide into {world_size} ranks: "
                         f"use a positive multiple of {world_size}")


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


class LaunchError(RuntimeError):
    """A rank failed; the message names it and holds its traceback."""


def load_script(path) -> object:
    """Import a script by path (the numbered scripts' names start with a digit)."""
    path = Path(path).resolve()
    main = sys.modules.get("__main__")
    for mod in (main, sys.modules.get("__mp_main__")):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve() == path and mod is not None and mod.__name__ != "__main__":
            return mod
    name = "script_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _device_for(backend: str, device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _watch_parent(parent_pid: int):
    """End this worker if the launching process goes away (killed, crashed). On Linux torch
    already asks for SIGINT on the parent's death (prctl); this also covers other systems
    and a worker whose code swallows KeyboardInterrupt."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=loop, daemon=True).start()


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _spawn_entry(rank, script, fn_name, args, world_size, port, backend, device, timeout, result_path, parent_pid):
    _watch_parent(parent_pid)
    torch.set_num_threads(_threads_per_rank(world_size))
    ctx = Ctx(rank, world_size, rank, backend, _device_for(backend, device, rank))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        result = getattr(load_script(script), fn_name)(ctx, args)
    except BaseException:  # leave the time and traceback for launch() to find the first failure
        with open(f"{result_path}.rank{rank}.err", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    dist.barrier()  # no rank tears its group down while a peer may still be talking to it
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "wb") as f:
            pickle.dump(result, f)


def launch(worker, args, *, world_size=None, backend=None, device=None, timeout=None):
    """Run ``worker(ctx, args)`` on every rank and return rank 0's result.

    ``worker`` must be a module-level function of a script file (it is found again by
    file and name in each spawned process).
    """
    world_size = world_size or args.world_size
    backend = backend or args.backend
    device = device or args.device
    timeout = timeout or getattr(args, "timeout", 300.0)
    if under_torchrun():
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        ctx = Ctx(rank, world_size, local_rank, backend, _device_for(backend, device, local_rank))
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        # under torchrun the group lives on for the script's next launch; run_main() ends it
        return worker(ctx, args)
    script = Path(sys.modules[worker.__module__].__file__).resolve()
    # The parent holds the rendezvous store on a port the OS picked: no race for a free port.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    fd, result_path = tempfile.mkstemp(prefix="ddp_result_", suffix=".pkl")
    os.close(fd)
    try:
        ctx = mp.start_processes(
            _spawn_entry, nprocs=world_size, join=False, start_method="spawn",
            args=(str(script), worker.__name__, args, world_size, store.port, backend, device,
                  timeout, result_path, os.getpid()))
        try:
            while not ctx.join(grace_period=2):
                pass
        except mp.ProcessRaisedException as e:
            raise LaunchError(_first_failure(result_path, world_size, e.error_index)) from None
        except mp.ProcessExitedException as e:
            how = f"signal {-e.exit_code}" if e.exit_code < 0 else f"exit code {e.exit_code}"
            others = _first_failure(result_path, world_size, None)
            raise LaunchError(f"rank {e.error_index} died ({how}) without a Python error"
                              + (f"; before that, {others}" if others else "")) from None
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise
        with open(result_path, "rb") as f:
            return pickle.load(f) if os.path.getsize(result_path) else None
    finally:
        for f in [result_path] + [f"{result_path}.rank{r}.err" for r in range(world_size)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        del store


def _first_failure(result_path, world_size, fallback_rank):
    """The rank that failed first (by the time each failing rank wrote down), with its
    traceback; the others usually failed only because it went away."""
    errors = []
    for r in range(world_size):
        with contextlib.suppress(FileNotFoundError):
            when, tb = Path(f"{result_path}.rank{r}.err").read_text().split("\n", 1)
            errors.append((float(when), r, tb))
    if not errors:
        return f"rank {fallback_rank} failed" if fallback_rank is not None else ""
    errors.sort()
    _, rank, tb = errors[0]
    also = [r for _, r, _ in errors[1:]]
    return (f"rank {rank} failed" + (f" (then rank(s) {', '.join(map(str, also))} as a consequence)" if also else "")
            + f":\n{tb}")


def finish_torchrun():
    if under_torchrun() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------
def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Marks phases of one step; ``lap(name)`` synchronizes the device and records the time
    since the previous mark."""

    def __init__(self, device):
        self.device = device
        self.times: dict[str, float] = {}
        sync(device)
        self.t0 = self.last = time.perf_counter()

    def lap(self, name: str):
        sync(self.device)
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> dict:
        return {**self.times, "step": self.last - self.t0}


def measure(ctx: Ctx, step_fns: dict, warmup: int, steps: int) -> dict:
    """Run each ``step_fn(i) -> {phase: seconds}`` warmup+steps times and summarize.

    With several methods the steps alternate (a b, b a, a b, ...), so slow drift of a shared
    machine hits all of them alike and none always runs first. Per step, each phase's time is the slowest rank's
    (gathered with all_gather_object). Returns {method: {phase: {"median", "min", "max",
    "all"}}} in seconds, identical on every rank.
    """
    for i in range(warmup):
        for fn in step_fns.values():
            fn(i)
    local = {name: [] for name in step_fns}
    names = list(step_fns)
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):  # a b, b a, ...: no method always goes first
            local[name].append(step_fns[name](warmup + i))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, local)
    out = {}
    for name, mine in local.items():
        out[name] = {phase: summarize([max(r[name][i][phase] for r in everyone) for i in range(steps)])
                     for phase in mine[0]}
    return out


def summarize(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": list(xs)}


# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------
# name: (d_model, d_ff, n_layers, n_heads)
MODEL_SIZES = {
    "nano": (64, 256, 2, 2),
    "micro": (128, 512, 2, 4),
    "mini": (256, 1024, 4, 4),
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

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d_model, d_ff, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = RMSNorm(d_model)
        self.ff_in = nn.Linear(d_model, d_ff, bias=False)
        self.ff_out = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff_out(F.gelu(self.ff_in(self.ln2(x))))


class TransformerLM(nn.Module):
    """Decoder-only LM: token + learned position embeddings, pre-norm blocks, output head."""

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
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_lm(size: str, context_length: int, device, seed: int = 0) -> TransformerLM:
    """The LM, initialised on ``device`` (seconds faster for XL on a GPU; the same weights on
    every rank of a device type, different between CPU and GPU)."""
    torch.manual_seed(seed)
    d_model, d_ff, n_layers, n_heads = MODEL_SIZES[size]
    with torch.device(device):
        return TransformerLM(d_model, d_ff, n_layers, n_heads, context_length=context_length)


def lm_batch(global_batch: int, context_length: int, step: int, seed: int, device):
    """The same random global batch of tokens on every rank: (inputs, targets)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(0, VOCAB_SIZE, (global_batch, context_length + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


class ToyModel(nn.Module):
    """A small MLP for verification, with the awkward cases DDP must get right.

    tied:    ``fc3`` shares its weight with ``fc2`` (one Parameter, used twice).
    frozen:  ``fc1.bias`` has requires_grad=False.
    unused:  ``extra`` is used only when forward gets ``use_extra=True``, and
             ``never`` is never used at all (it never gets a gradient).
    mixed:   ``dbl`` computes in float64 (a second gradient dtype).
    """

    def __init__(self, in_dim=20, hidden=32, n_classes=10, tied=False, frozen=False, unused=False, mixed=False):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden, bias=False)
        if tied:
            self.fc3.weight = self.fc2.weight
        if frozen:
            self.fc1.bias.requires_grad_(False)
        self.extra = nn.Linear(hidden, hidden) if unused else None
        self.never = nn.Parameter(torch.randn(hidden)) if unused else None
        self.dbl = nn.Linear(hidden, hidden).double() if mixed else None
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x, use_extra=False):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        h = torch.tanh(self.fc3(h))
        if self.extra is not None and use_extra:
            h = h + torch.relu(self.extra(h))
        if self.dbl is not None:
            h = h + torch.tanh(self.dbl(h.double())).float()
        return self.head(h)


def toy_batches(steps: int, global_batch: int, seed: int, in_dim=20, n_classes=10):
    """Random (x, y) global batches, the same on every rank."""
    g = torch.Generator().manual_seed(seed + 12345)
    return [(torch.randn(global_batch, in_dim, generator=g),
             torch.randint(0, n_classes, (global_batch,), generator=g)) for _ in range(steps)]


def mnist_batches(steps: int, global_batch: int, root, seed: int):
    x, y = load_mnist(root, download=False)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(x), generator=g)
    need = steps * global_batch
    idx = idx.repeat(math.ceil(need / len(idx)))[:need]
    return [(x[idx[i * global_batch:(i + 1) * global_batch]], y[idx[i * global_batch:(i + 1) * global_batch]])
            for i in range(steps)]


def load_mnist(root, download: bool):
    """MNIST training images as (N, 784) float in [0, 1] and labels, via torchvision."""
    from torchvision.datasets import MNIST
    try:
        ds = MNIST(root, train=True, download=download)
    except RuntimeError as e:
        if "not found" in str(e).lower():
            raise UsageError(f"MNIST not found under {root}/MNIST/raw: add --download (needs internet) "
                             f"or point --data-root at a folder that holds MNIST/raw") from None
        raise
    return ds.data.reshape(len(ds.data), -1).float() / 255.0, ds.targets.long()


def verify_batches(args, steps: int, global_batch: int):
    """Global batches for a verification run, plus the toy model's input/class sizes."""
    if getattr(args, "data", "random") == "mnist":
        return mnist_batches(steps, global_batch, args.data_root, args.seed), 784, 10
    return toy_batches(steps, global_batch, args.seed), 20, 10


def shard(t: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0)."""
    n = t.shape[0] // ctx.world_size
    return t[ctx.rank * n:(ctx.rank + 1) * n]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa.detach().double() - pb.detach().double()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def params_close(a: nn.Module, b: nn.Module) -> bool:
    """allclose at the dtype's tolerance (torch.testing's defaults), every parameter."""
    for pa, pb in zip(a.parameters(), b.parameters()):
        try:
            torch.testing.assert_close(pa.detach(), pb.detach())
        except AssertionError:
            return False
    return True


# ----------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------
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
    return tabulate([[r.get(h, "") for h in headers] for r in rows], headers=headers, tablefmt="github", floatfmt=".4g")


def save_results(out_dir, name: str, rows: list[dict], settings: dict, *, headers=None, title="",
                 extra: dict | None = None, note: str = "") -> str:
    """Write results/<name>.json (everything) and results/<name>.md (the table); return the table."""
    out = Path(out_dir)
    info = machine_info(settings.get("device"))
    table = markdown_table(rows, headers) if rows else "(no rows)"
    doc = {"name": name, "title": title, "settings": settings, "machine": info, "rows": rows,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), **(extra or {})}
    _atomic_write(out / f"{name}.json", lambda f: f.write(json.dumps(doc, indent=1, default=str).encode()))
    md = (f"# {title or name}\n\nMachine: {info['device']}, torch {info['torch']}, "
          f"{doc['time']}.\nSettings: {json.dumps(settings, default=str)}\n\n{table}\n")
    if note:
        md += f"\n{note}\n"
    _atomic_write(out / f"{name}.md", lambda f: f.write(md.encode()))
    return table


def save_figure(fig, path):
    """Save a matplotlib figure atomically as PNG and close it."""
    import matplotlib.pyplot as plt
    _atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def is_reporter() -> bool:
    """True in the process that prints and writes results (always, unless torchrun rank > 0)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


# ----------------------------------------------------------------------------------------
# Verification against single-process training (any wrapper with the DDP interface)
# ----------------------------------------------------------------------------------------
# A case: ToyModel flags (tied, frozen, unused, mixed) plus
#   accum: micro-batches per step (all but the last inside no_sync()),
#   uneven: the `extra` layer is used by rank 0's shard only (a gradient some ranks lack),
#   opt: "sgd" (momentum) or "adamw",  set_to_none: how zero_grad clears gradients,
#   kwargs: extra arguments for the wrapper.
VERIFY_CASES = {
    "plain": {},
    "tied": {"tied": True},
    "frozen": {"frozen": True},
    "unused": {"unused": True, "opt": "adamw"},
    "unused_keep_grads": {"unused": True, "opt": "adamw", "set_to_none": False},
    "uneven": {"unused": True, "uneven": True},
    "accum": {"accum": 2},
    "mixed": {"mixed": True},
    "everything": {"tied": True, "frozen": True, "unused": True, "mixed": True, "accum": 2, "opt": "adamw"},
}


def _make_opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _uses_extra(case, step, shard_index):
    if case.get("uneven"):
        return shard_index == 0 and step % 3 != 2
    return step % 2 == 0


def _reference_step(model, x, y, case, step, world_size):
    """Single-process loss on the whole global batch."""
    if case.get("uneven"):  # same loss, written per shard so each shard can choose its layers
        xs, ys = x.chunk(world_size), y.chunk(world_size)
        loss = sum(F.cross_entropy(model(xs[i], use_extra=_uses_extra(case, step, i)), ys[i])
                   for i in range(world_size)) / world_size
    else:
        loss = F.cross_entropy(model(x, use_extra=_uses_extra(case, step, 0)), y)
    loss.backward()


def verify_case(ctx: Ctx, wrap, case: dict, args, steps=None, global_batch=None) -> dict:
    """Train ``wrap(model)`` data-parallel and a copy on one process; compare the weights.

    Returns {"ok", "max_diff", "bitwise"} for the slowest-agreeing rank (gathered).
    """
    import copy
    steps = steps or getattr(args, "verify_steps", 5)
    accum = case.get("accum", 1)
    global_batch = global_batch or 8 * ctx.world_size * accum
    batches, in_dim, n_cls = verify_batches(args, steps, global_batch)
    # the reference runs on the same device: the check compares the method, not two
    # devices' arithmetic (AdamW turns a last-bit difference in a tiny gradient into ~lr)
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches]
    flags = {k: case[k] for k in ("tied", "frozen", "unused", "mixed") if k in case}
    torch.manual_seed(args.seed)
    ref = ToyModel(in_dim, n_classes=n_cls, **flags).to(ctx.device)
    model = copy.deepcopy(ref)
    if ctx.rank != 0:  # different starting weights elsewhere: the wrapper must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * ctx.rank)
    ddp = wrap(model, **case.get("kwargs", {}))
    opt = _make_opt(case.get("opt", "sgd"), [p for p in ddp.module.parameters() if p.requires_grad])
    ref_opt = _make_opt(case.get("opt", "sgd"), [p for p in ref.parameters() if p.requires_grad])
    set_to_none = case.get("set_to_none", True)
    for step, (x, y) in enumerate(batches):
        ref_opt.zero_grad(set_to_none=set_to_none)
        _reference_step(ref, x, y, case, step, ctx.world_size)
        ref_opt.step()

        opt.zero_grad(set_to_none=set_to_none)
        xs, ys = shard(x, ctx), shard(y, ctx)
        use_extra = _uses_extra(case, step, ctx.rank)
        for i, (xc, yc) in enumerate(zip(xs.chunk(accum), ys.chunk(accum))):
            with (ddp.no_sync() if i < accum - 1 else contextlib.nullcontext()):
                (F.cross_entropy(ddp(xc, use_extra=use_extra), yc) / accum).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    local = {"ok": params_close(ddp.module, ref), "max_diff": max_param_diff(ddp.module, ref),
             "bitwise": all(torch.equal(a.detach(), b.detach()) for a, b in zip(ddp.module.parameters(), ref.parameters()))}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, local)
    return {"ok": all(r["ok"] for r in everyone), "max_diff": max(r["max_diff"] for r in everyone),
            "bitwise": all(r["bitwise"] for r in everyone)}


def verify_cases(ctx: Ctx, wrap, args, cases=None) -> dict:
    """Run several verification cases in one job: {case name: result}."""
    names = cases or list(VERIFY_CASES)
    return {n: verify_case(ctx, wrap, VERIFY_CASES[n], args) for n in names}


def report_verification(results: dict, label: str) -> bool:
    ok = all(r["ok"] for r in results.values())
    width = max(map(len, results))
    for name, r in results.items():
        print(f"  {'PASS' if r['ok'] else 'FAIL'}  {name:<{width}}  max |diff| {r['max_diff']:.2e}"
              f"{'  (bitwise equal)' if r['bitwise'] else ''}")
    print(f"verify {label}: {'PASS' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------
# LM benchmark: one training step, timed by phase
# ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def count_collectives():
    """Count torch.distributed collective calls made inside the block (on this rank)."""
    counts = {"n": 0}
    names = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_gather_single", "reduce_scatter_single")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(fn):
        def inner(*a, **k):
            counts["n"] += 1
            return fn(*a, **k)
        return inner
    for n in saved:
        setattr(dist, n, wrap(saved[n]))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def lm_trainer(ctx: Ctx, args, wrap=None, optimizer=None):
    """Build the LM (same weights on all ranks), wrap it, and return (model, step_fn).

    step_fn(i) runs one training step on this rank's shard of batch i and returns phase
    times: compute (forward+backward), comm (finish_gradient_synchronization, i.e. the
    communication left after backward), optim, step.
    """
    model = build_lm(args.model_size, args.context_length, ctx.device, seed=args.seed)
    if wrap is not None:
        model = wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer else torch.optim.AdamW(params, lr=1e-4)
    finish = getattr(model, "finish_gradient_synchronization", lambda: None)
    batches = [lm_batch(args.batch_size, args.context_length, i, args.seed, ctx.device) for i in range(4)]

    def step_fn(i):
        x, y = (shard(t, ctx) for t in batches[i % len(batches)])
        clock = StepClock(ctx.device)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        clock.lap("compute")
        finish()
        clock.lap("comm")
        opt.step()
        clock.lap("optim")
        return clock.total()
    step_fn.optimizer = opt
    return model, step_fn


def bench_methods(ctx: Ctx, args, wraps: dict, interleave=False, optimizer=None) -> list:
    """Time methods {name: wrap or (wrap, optimizer)} on the LM, one table row each (plus the
    raw stats). ``optimizer(params)`` builds the optimizer (default AdamW, lr 1e-4).

    ``interleave`` builds them all at once and alternates their steps (fair side-by-side
    numbers, at the cost of holding every model in memory); otherwise one after another.
    """
    if not interleave:
        rows = []
        for name, wrap in wraps.items():
            rows += bench_methods(ctx, args, {name: wrap}, True, optimizer)
            # a wrapper's hooks make reference cycles (parameter -> hook -> wrapper): free its
            # weights, gradients and optimizer state before the next method is built
            gc.collect()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        return rows
    trainers = {name: lm_trainer(ctx, args, *(w if isinstance(w, tuple) else (w, optimizer)))
                for name, w in wraps.items()}
    rows = []
    calls = {}
    for name, (model, step_fn) in trainers.items():  # two warm-up steps, the second one counted
        step_fn(0)
        with count_collectives() as c:
            step_fn(1)
        calls[name] = c["n"]
    stats = measure(ctx, {name: t[1] for name, t in trainers.items()}, max(args.warmup - 2, 0), args.steps)
    for name, (model, _) in trainers.items():
        st = stats[name]
        rows.append({"method": name, "step_ms": st["step"]["median"] * 1e3,
                     "step_min_ms": st["step"]["min"] * 1e3, "step_max_ms": st["step"]["max"] * 1e3,
                     "comm_ms": st["comm"]["median"] * 1e3,
                     "comm_share": st["comm"]["median"] / st["step"]["median"],
                     "collectives": calls[name], "n_buckets": len(getattr(model, "buckets", ())) or None,
                     "stats": st})
    return rows


def bench_method(ctx: Ctx, args, name: str, wrap=None, optimizer=None) -> dict:
    """Time one method on the LM; returns a table row plus the raw stats."""
    return bench_methods(ctx, args, {name: wrap}, True, optimizer)[0]


def lm_settings(args) -> dict:
    d_model, d_ff, n_layers, n_heads = MODEL_SIZES[args.model_size]
    return {"world_size": args.world_size, "backend": args.backend, "device": args.device,
            "model_size": args.model_size, "d_model": d_model, "d_ff": d_ff, "n_layers": n_layers,
            "n_heads": n_heads, "n_params": lm_param_count(args.model_size, args.context_length),
            "batch_size": args.batch_size, "context_length": args.context_length,
            "steps": args.steps, "warmup": args.warmup, "optimizer": "AdamW"}


def lm_param_count(size: str, context_length: int) -> int:
    d, f, n, _ = MODEL_SIZES[size]
    block = 4 * d * d + 2 * d * f + 2 * d
    return 2 * VOCAB_SIZE * d + context_length * d + n * block + d


BENCH_HEADERS = ["method", "step_ms", "step_min_ms", "step_max_ms", "comm_ms", "comm_share", "collectives"]


def run_script(args, name, title, verify_fn, bench_fn, headers=BENCH_HEADERS, note="", after=None,
               prepare=None, jobs=None, time_box=None):
    """Verify, benchmark, print and save: the main body shared by 02 to 07.

    ``prepare(rows) -> rows`` may reshape the benchmark's rows before they are saved;
    ``after(rows)`` may add plots or analysis once the table is written. With ``jobs``, the
    benchmark is launched once per job (``args.job``), the rows so far are saved after
    each, and past ``time_box`` seconds no further job starts (the first always runs).
    """
    report = is_reporter()
    if not args.no_verify:
        res = launch(verify_fn, args)  # the same gathered result on every rank
        ok = report_verification(res, f"{name} at {args.world_size} rank(s)") if report else \
            all(r["ok"] for r in res.values())
        if not ok:
            raise LaunchError("verification failed: the weights differ from single-process training")
    if args.no_bench:
        return

    def save(rows, note):
        return save_results(args.out, name, rows, lm_settings(args), headers=headers, title=title, note=note)

    jobs = list(jobs or [None])
    rows, not_run = launch_each(   # a later job that fails or is killed loses nothing
        bench_fn, args, "job", jobs, time_box=time_box,
        after_each=lambda rows, done: report and save(rows, f"(partial: {done} of {len(jobs)} benchmark jobs done)"))
    if not_run:
        note += (f"\nTime box ({time_box:g} s) reached: not run: "
                 f"{', '.join(f'{j:g}' if isinstance(j, (int, float)) else str(j) for j in not_run)}.")
        if report:
            print(note.strip())
    if not report:
        return
    try:
        rows = prepare(rows) if prepare else rows
    except Exception:   # keep the measurements even if their analysis fails
        save(rows, "(raw rows: the analysis of these measurements failed)")
        raise
    table = save(rows, note)
    print(f"\n{title}\n({args.model_size} LM, {args.world_size} x {args.backend}/{args.device}, "
          f"global batch {args.batch_size}x{args.context_length}; times in ms, median [min, max] "
          f"of {args.steps} steps)\n{table}\nwrote {args.out}/{name}.json and .md")
    if after:
        after(rows)


def _rank0_says(flag: bool) -> bool:
    """Rank 0's decision on every rank: under torchrun each rank runs the script's main."""
    if under_torchrun() and dist.is_initialized():
        box = [flag]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return flag


def launch_each(worker, args, attr: str, values, *, after_each=None, time_box=None):
    """One job per value (``args.<attr> = value``), rows concatenated: each job's processes
    are fresh, so per-process figures such as peak RSS belong to that job alone.

    ``after_each(rows_so_far, jobs_done)`` runs after every job but the last; past
    ``time_box`` seconds no further job starts (the first always runs). Returns
    (rows, the values not run).
    """
    values = list(values)
    rows, started = [], time.perf_counter()
    for i, v in enumerate(values):
        if i and time_box and _rank0_says(time.perf_counter() - started > time_box):
            return rows, values[i:]
        setattr(args, attr, v)
        rows += launch(worker, args)
        if after_each and i < len(values) - 1:
            after_each(rows, i + 1)
    return rows, []


def load_json(out_dir, name) -> dict:
    return json.loads((Path(out_dir) / f"{name}.json").read_text())


def lm_param_tensors(size: str) -> int:
    """How many parameter tensors the LM has (embeddings, 6 per block, final norm, head)."""
    return 2 + 6 * MODEL_SIZES[size][2] + 2
