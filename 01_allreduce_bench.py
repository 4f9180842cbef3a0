"""All-reduce benchmark: how long one all-reduce of float32 data takes, by backend and
device (gloo on CPU, NCCL on GPU, gloo on GPU), data size and number of processes.

Run:
    python 01_allreduce_bench.py                              # the whole grid this machine can run
    python 01_allreduce_bench.py --configs gloo-cpu --world-sizes 2 --sizes-mb 1 10
    torchrun --nproc-per-node 2 01_allreduce_bench.py --configs nccl-cuda

Each (backend, device, ranks) configuration is one job: for every size it warms up, then
times at least --iters all-reduces (the device synchronized around each), taking per
iteration the slowest rank's time. The result is checked against the known sum once per
size. Sizes are decimal (1 MB = 10^6 bytes); algbw = bytes / time and
busbw = algbw x 2(n-1)/n in GB/s (10^9 bytes/s), as nccl-tests reports them.

Writes results/01_allreduce.{json,md}, results/01_allreduce_time.png and
results/01_allreduce_busbw.png (rewritten after every configuration, so a killed run
keeps what it measured).
"""

import argparse
import time

import torch
import torch.distributed as dist

import common

CONFIGS = {"gloo-cpu": ("gloo", "cpu"), "nccl-cuda": ("nccl", "cuda"), "gloo-cuda": ("gloo", "cuda")}


def allreduce_worker(ctx, args):
    """Time all sizes for this job's configuration; returns one row per size."""
    rows = []
    n = ctx.world_size
    started = time.perf_counter()
    for size_mb in args.sizes_mb:
        nbytes = int(size_mb * 1e6)
        x = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device)
        # correctness: every rank contributes rank+1, so each element must become n(n+1)/2
        x.fill_(ctx.rank + 1)
        dist.all_reduce(x)
        common.sync(ctx.device)
        expected = n * (n + 1) / 2
        if not torch.all(x == expected):
            bad = x[x != expected][0].item()
            raise RuntimeError(f"all-reduce of {size_mb} MB gave {bad}, expected {expected}")
        x.zero_()  # zeros stay zeros: no overflow however many iterations run
        times, stopped = [], False
        for i in range(args.warmup + args.iters):
            common.sync(ctx.device)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            common.sync(ctx.device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            # the time box: rank 0's clock decides, so every rank stops after the same iteration
            flag = torch.tensor([float(time.perf_counter() - started > args.time_box and len(times) >= 1)],
                                device=ctx.device)   # NCCL carries device tensors only
            dist.broadcast(flag, src=0)
            if flag.item():
                stopped = True
                break
        everyone = [None] * n
        dist.all_gather_object(everyone, times)
        per_iter = [max(r[i] for r in everyone) for i in range(len(times))]
        st = common.summarize(per_iter)
        algbw = nbytes / st["median"] / 1e9
        rows.append({"backend": ctx.backend, "device": ctx.device.type, "ranks": n, "size_mb": size_mb,
                     "iters": len(per_iter), "time_ms": st["median"] * 1e3, "min_ms": st["min"] * 1e3,
                     "max_ms": st["max"] * 1e3, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n,
                     "time_boxed": stopped, "all_ms": [t * 1e3 for t in per_iter]})
        del x
        if stopped:
            break
    return rows


HEADERS = ["backend", "device", "ranks", "size_mb", "iters", "time_ms", "min_ms", "max_ms", "algbw_GBps", "busbw_GBps"]


def plot(rows, out, name):
    plt = common.pyplot()
    groups = {}
    for r in rows:
        groups.setdefault((r["backend"], r["device"], r["ranks"]), []).append(r)
    for key, ylabel, fname, logy in (("time_ms", "time per all-reduce (ms)", "_time.png", True),
                                     ("busbw_GBps", "bus bandwidth (GB/s)", "_busbw.png", False)):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for (backend, device, ranks), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r["size_mb"])
            ax.plot([r["size_mb"] for r in rs], [r[key] for r in rs], marker="o",
                    label=f"{backend}+{device}, {ranks} ranks")
        ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("data size (MB, float32)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"all-reduce: {ylabel.split(' (')[0]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        common.save_figure(fig, f"{out}/{name}{fname}")


def plan(args, n_gpus):
    """The (backend, device, ranks) jobs to run, and notes on the ones skipped."""
    jobs, notes = [], []
    for name in args.configs:
        backend, device = CONFIGS[name]
        for ws in args.world_sizes:
            if device == "cuda" and n_gpus == 0:
                notes.append(f"skipped {name} at {ws} ranks: no GPU here")
            elif backend == "nccl" and n_gpus < ws:
                notes.append(f"skipped {name} at {ws} ranks: NCCL needs {ws} GPUs, this machine has {n_gpus}")
            else:
                jobs.append((backend, device, ws))
    return jobs, notes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    default_configs = ["gloo-cpu"] + (["nccl-cuda"] if n_gpus else [])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=default_configs,
                   help=f"backend-device pairs (default here: {' '.join(default_configs)})")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 6])
    p.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 10, 100, 1000])
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size (at least 1)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--time-box", type=float, default=300.0,
                   help="seconds per configuration; past it a size stops after its current iteration")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(common.ROOT / "results"))
    p.add_argument("--name", default="01_allreduce", help="results file stem")
    args = p.parse_args(argv)
    args.configs = list(dict.fromkeys(args.configs))   # each once, in the order given
    args.world_sizes = list(dict.fromkeys(args.world_sizes))
    if any(ws < 1 for ws in args.world_sizes):
        raise common.UsageError(f"--world-sizes must all be at least 1, got {args.world_sizes}")
    if any(s <= 0 for s in args.sizes_mb):
        raise common.UsageError(f"--sizes-mb must all be positive, got {args.sizes_mb}")
    if args.iters < 1 or args.warmup < 0 or args.time_box <= 0:
        raise common.UsageError("--iters must be at least 1, --warmup at least 0, --time-box positive")
    common.check_out(args.out)
    if common.under_torchrun():
        ws = int(__import__("os").environ["WORLD_SIZE"])
        args.world_sizes = [ws]
        args.configs = args.configs[:1]
    jobs, notes = plan(args, n_gpus)
    if common.under_torchrun() and not jobs:
        raise common.UsageError("; ".join(notes))
    report = common.is_reporter()
    for note in notes if report else []:
        print(note)
    rows, failed = [], []
    for backend, device, ws in jobs:
        if report:
            print(f"{backend}+{device}, {ws} ranks ...", flush=True)
        try:
            got = common.launch(allreduce_worker, args, world_size=ws, backend=backend, device=device)
        except common.LaunchError as e:
            lines = str(e).strip().splitlines()   # first line: which rank; last: its exception
            failed.append(f"{backend}+{device} at {ws} ranks failed: {lines[0]}"
                          + (f" {lines[-1].strip()}" if len(lines) > 1 else ""))
            print(f"{backend}+{device} at {ws} ranks failed: {e}")
            continue
        if not report:
            continue
        rows += got
        for r in got:
            print(f"  {r['size_mb']:>7g} MB  {r['time_ms']:9.2f} ms  busbw {r['busbw_GBps']:6.2f} GB/s"
                  f"{'  (time box: ' + str(r['iters']) + ' iters)' if r['time_boxed'] else ''}")
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "name")}
        table = common.save_results(args.out, args.name, rows, settings, headers=HEADERS,
                                    title="All-reduce benchmark", note="\n".join(notes + failed))
        plot(rows, args.out, args.name)
    if report and rows:
        print(f"\n{table}\nwrote {args.out}/{args.name}.json, .md, _time.png, _busbw.png")
    if failed:
        raise common.LaunchError("; ".join(failed))


if __name__ == "__main__":
    common.run_main(main)
