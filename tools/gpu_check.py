"""make gpu-check: everything a lent GPU should run, as one command of at most 8 minutes on
a 16-core machine with one H100 or H200, its summary written as it goes.

    make gpu-check PY=python3                                 # on the GPU machine (its own python3)
    make gpu-check GPU_DEV=cpu GPU_NCCL=gloo GPU_SIZE=nano    # the CPU dry run
    python tools/gpu_check.py --parts smoke --scripts 03      # one part, one script
    python tools/gpu_check.py --scripts 03 --measure 12       # 03's smoke jobs, 12's measured one

Three parts, in this order (the most wanted first: a cut run keeps what finished):
1. kernels: tests/test_gpu_kernels.py, the CUDA kernels no CPU reaches (context-parallel
   attention through context_parallel in bf16 and float32 against SDPA; grouped experts in
   bf16 against the loop), each case with its error; skipped with the reason where no GPU is.
2. measure: a short table at 1 NCCL rank, one job each, alone on the machine: 05's
   DDPBucketed beside torch DDP (25 MB buckets; as it runs, then with every gradient copied
   into its bucket), 07's FSDP beside FSDP2 (step and peak memory), 12's experts grouped
   beside one call each, in bf16.
3. smoke: every numbered script's smoke jobs (verification and two timed steps at a small
   size; NCCL at 1 rank, gloo over CUDA tensors at 2), --jobs at once, each time-boxed;
   and 14's benchmark at 2 replicas (its kill -9 to the next commit, its heal: into the
   measured table, noted as run beside the other jobs).

<out>/SUMMARY.md (and SUMMARY.json) is rewritten after every row: the part, the job, its
verdict, its seconds and what it measured; each job's log lies beside it. No job starts
once --budget seconds have passed (it is listed as not started), and no job outlives its
box or the budget. On a CPU (--device cpu, the dry run) the smoke jobs run under the device
audit (diagnostics.DeviceAudit): a GPU's device rules, so what would fail on the GPU for a
tensor on the wrong device fails here. Exit status 1 if a row failed or did not start.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import result_files  # noqa: E402  (the standard library only, as this file)
SCRIPTS = [f"{n:02d}" for n in range(1, 15)]
PARTS = ("kernels", "measure", "smoke")
AUDIT_ENV = "KIT_DEVICE_AUDIT"   # diagnostics.AUDIT_ENV (this file imports no torch: it only starts jobs)


def script(n: str) -> str:
    return next(p.name for p in ROOT.glob(f"{n}_*.py"))


# ----------------------------------------------------------------------------------------
# The jobs
# ----------------------------------------------------------------------------------------
def smoke_jobs(scripts, dev, nccl, size, box=200.0) -> list:
    """(name, command line) of every smoke job: each script at a small size, verification
    and two timed steps; NCCL at 1 rank and gloo at 2 (08, 09 and pipelines need 2 ranks,
    so gloo only). A GPU's slow ones (gloo over CUDA at 2 ranks) first. 14's run ends
    itself inside the job's ``box`` seconds, printing its replicas' logs (the box's kill
    would remove them with the run's folder)."""
    deadline = ["--deadline", f"{box * 0.8:.0f}"]
    lm = ["--device", dev, "--model-size", size or "small", "--warmup", "1", "--steps", "2"]
    four = ["--model-size", "mini"] if size in ("nano", "micro") else []   # 2 stages x 2 chunks need 4 blocks
    one, two = ["--backend", nccl, "--world-size", "1", *lm], ["--backend", "gloo", "--world-size", "2", *lm]
    gloo = ["--backend", "gloo", *lm]
    per = {
        "01": [("all_ops", ["--ops", "all", "--configs", f"{nccl}-{dev}", f"gloo-{dev}", "--world-sizes", "1", "2",
                            "--sizes-mb", "0.001", "1", "--iters", "3", "--warmup", "1", "--time-box", "20"])],
        "05": [(f"{nccl}_1rank", one), ("gloo_2ranks", two),
               ("bf16", [*two, "--dtype", "bf16", "--bucket-mb", "25", "--models", "lm", "--no-baselines"])],
        "07": [(f"{nccl}_1rank", one), ("gloo_2ranks", two), ("bf16", [*two, "--dtype", "bf16"])],
        "08": [("gloo_2ranks", [*gloo, "--world-sizes", "2"]), ("sp", [*gloo, "--world-sizes", "2", "--sp"])],
        "09": [("gloo_2ranks", [*gloo, "--stages", "2", "--microbatches", "1", "2", "--schedule", "gpipe", "1f1b"]),
               ("interleaved", [*gloo, "--stages", "2", "--microbatches", "2", "--schedule", "interleaved", *four]),
               ("zb1", [*gloo, "--stages", "2", "--microbatches", "2", "--schedule", "zb1"]),
               ("recompute", [*gloo, "--stages", "2", "--microbatches", "2", "--schedule", "1f1b", "--recompute",
                              "none", "selective", "full"])],
        "10": [(f"{nccl}_1rank", ["--backend", nccl, *lm, "--dp", "1"]), ("gloo_2ranks", [*gloo, "--pp", "2"]),
               ("levers", [*gloo, "--pp", "2", "--tp", "2", "--sp", "--recompute", "selective", "--dtype", "bf16"])],
        "11": [("gloo_2ranks", [*gloo, "--cp", "2", "--seq-lens", "256", "--memory-lens", "256"]),
               ("bf16", [*gloo, "--cp", "2", "--seq-lens", "256", "--memory-lens", "256", "--dtype", "bf16"])],
        "12": [(f"{nccl}_1rank", ["--backend", nccl, *lm, "--ep", "1", "--experts", "4"]),
               ("gloo_2ranks", [*gloo, "--ep", "2"]), ("bf16", [*gloo, "--ep", "2", "--dtype", "bf16"])],
        "13": [(setting, ["--device", dev, *argv, "--steps", "4", "--eval-every", "2", "--context-length", "64",
                          "--batch-size", "8", "--sample-tokens", "4", "--run-dir", f"runs/gpu-smoke-13-{setting}"])
               for setting, argv in ((f"{nccl}_1rank", ["--backend", nccl, "--fsdp", "1"]),
                                     ("gloo_2ranks", ["--backend", "gloo", "--pp", "2"]),
                                     ("bf16", ["--backend", "gloo", "--fsdp", "2", "--dtype", "bf16", "--recompute"]))],
        # replicas of one NCCL rank each share the GPU (each its own world), their all-reduce during backward
        # (as --overlap auto on a GPU); gloo inside replicas of 2 ranks. Verified at mini: over the scenario's
        # 30-50 steps the small LM amplifies float32's reordering as much as a wrong step (14's TOLERANCE)
        "14": [(f"{nccl}_1rank", ["--backend", nccl, "--device", dev, "--model-size", size or "mini",
                                  "--replica-ranks", "1", "--overlap", "on", "--no-bench", *deadline]),
               ("gloo_2ranks", ["--backend", "gloo", "--device", dev, "--model-size", size or "mini", "--no-bench",
                                *deadline]),
               # its benchmark at 2 replicas of one rank (the kill -9, the heal: read into the measured
               # table, SMOKE_READS); beside the other smoke jobs, where it costs the check no time
               ("bench", ["--backend", nccl, "--device", dev, "--model-size", size or "small", "--replica-ranks", "1",
                          "--no-verify", "--bench-replicas", "2", "--bench-steps", "10", *deadline])],
    }
    jobs = [(f"{script(n)[:-3]}.{setting}", [script(n), *argv]) for n in scripts
            for setting, argv in per.get(n, [(f"{nccl}_1rank", one), ("gloo_2ranks", two)])]
    # 14's first: a run of replicas that must end inside its deadline (started last, the budget
    # left it 80 s on the H200, and its verification had not finished)
    slow = ("14_", "07_fsdp.gloo", "07_fsdp.bf16", "12_expert_parallel.gloo", "12_expert_parallel.bf16", "06_", "05_")
    return sorted(jobs, key=lambda j: next((i for i, s in enumerate(slow) if j[0].startswith(s)), len(slow)))


def deadline_within(cmd: list, box: float) -> list:
    """``cmd`` with its --deadline (14's), if it has one, at 0.8 x the ``box`` the job really
    gets: the budget left may be shorter than the box its jobs were made for, and a run
    killed by the box before its own deadline loses its replicas' logs."""
    if "--deadline" not in cmd:
        return cmd
    i = cmd.index("--deadline") + 1
    return [*cmd[:i], f"{box * 0.8:.0f}", *cmd[i + 1:]]


def measure_jobs(scripts, dev, nccl, size) -> list:
    """(name, command line, reader, folder) of the measured table's jobs at 1 NCCL rank."""
    one = ["--backend", nccl, "--world-size", "1", "--device", dev, "--no-verify"]
    ddp = [*one, "--model-size", size or "xl", "--bucket-mb", "25", "--models", "lm", "--no-baselines", "--warmup", "5",
           "--steps", "30"]
    # 05 as it runs (NCCL: gradients of 1 MiB and more reduced where they lie), then every one
    # copied into its bucket (as before in_place_mb, and as torch DDP does): the copy's cost
    jobs = [("05", "05 DDPBucketed vs torch DDP", ddp, read_05, ""),
            ("05", "05, every gradient copied into its bucket", [*ddp, "--in-place-mb", "1e6"], read_05, ".copied"),
            ("07", "07 FSDP vs FSDP2", [*one, "--model-size", size or "xl", "--methods", "fsdp", "--warmup", "3",
                                        "--steps", "5"], read_07, ""),
            ("12", "12 grouped vs loop, bf16", ["--backend", nccl, "--ep", "1", "--device", dev, "--no-verify",
                                                "--model-size", size or "small", "--dtype", "bf16", "--tables",
                                                "grouped", "--warmup", "2", "--steps", "5"], read_12, "")]
    return [(name, [script(n), *argv], read, script(n)[:-3] + tag) for n, name, argv, read, tag in jobs
            if n in scripts]


def _rows(folder: Path, name: str) -> list:
    return json.loads((folder / f"{name}.json").read_text())["rows"]


def read_05(folder: Path) -> list:
    rows = {r["method"]: r for r in _rows(folder, "05_bucketed_ddp")}
    ours, theirs = rows["DDPBucketed 25 MB"], rows["torch DDP 25 MB"]
    in_place = json.loads((folder / "05_bucketed_ddp.json").read_text())["settings"].get("in_place_mb")
    how = "every gradient copied" if in_place is None or in_place >= 1e6 else f"{in_place:g} MiB and more in place"
    return [{"measurement": f"05 step, 25 MB buckets, {how}", "ours": f"{ours['step_ms']:.1f} ms",
             "torch": f"{theirs['step_ms']:.1f} ms (torch DDP)",
             "ratio": f"{ours['vs_torch_ddp']:.3f} [{ours['vs_torch_ddp_min']:.3f}-{ours['vs_torch_ddp_max']:.3f}]",
             "detail": f"plain training {rows['plain (no wrapper)']['step_ms']:.1f} ms, ours over it "
                       f"{ours['vs_plain']:.3f}; the flight recorder on, as in every job"}]


def read_07(folder: Path) -> list:
    rows = _rows(folder, "07_fsdp")
    ours, theirs = rows[0], rows[1]
    out = [{"measurement": "07 step", "ours": f"{ours['step_ms']:.1f} ms", "torch": f"{theirs['step_ms']:.1f} ms (FSDP2)",
            "ratio": f"{ours['vs_torch']:.3f} [{ours['vs_torch_min']:.3f}-{ours['vs_torch_max']:.3f}]", "detail": ""}]
    mem = {r["method"]: r for r in _rows(folder, "07_fsdp_memory") if r["rank"] == 0}
    if ours["method"] in mem and theirs["method"] in mem:
        a, b = mem[ours["method"]], mem[theirs["method"]]
        out.append({"measurement": "07 peak during a step", "ours": f"{a['step_peak_MB']:.0f} MiB",
                    "torch": f"{b['step_peak_MB']:.0f} MiB (FSDP2)", "ratio": f"{a['vs_fsdp2']:.3f}",
                    "detail": f"state {a['state_MB']:.0f} against {b['state_MB']:.0f} MiB"})
    return out


def read_14(folder: Path) -> list:
    r = _rows(folder, "14_fault_tolerant_dp")[0]
    ft = "torchft_step_ms" in r
    where = f"{r['replicas']} replicas of 1 rank, beside the other smoke jobs"
    return [{"measurement": "14 step with every replica in (the quorum's cost)", "ours": f"{r['ours_step_ms']:.1f} ms",
             "torch": f"{r['torch_ddp_step_ms']:.1f} ms (torch DDP over gloo)", "ratio": f"{r['vs_ddp']:.3f}",
             "detail": where},
            {"measurement": "14 from a kill -9 to the next committed step", "ours": f"{r['kill_to_commit_s']:.3f} s",
             "torch": f"{r['torchft_kill_to_commit_s']:.3f} s (torchft)" if ft else "(torchft not run)",
             "ratio": "", "detail": where},
            {"measurement": "14 the replacement's heal from a live peer", "ours": f"{r['heal_s'] * 1000:.0f} ms",
             "torch": f"{r['torchft_heal_s'] * 1000:.0f} ms (torchft)" if ft and r.get("torchft_heal_s") is not None
             else "(torchft not run)", "ratio": "",
             "detail": f"{r['heal_MB']:.1f} MB; from its hello to its first committed step "
                       f"{r['rejoin_to_commit_s']:.3f} s"}]


def read_12(folder: Path) -> list:
    return [{"measurement": f"12 one MoE layer, {r['experts']} experts, top-{r['top_k']}, bf16",
             "ours": f"{r['grouped_ms']:.2f} ms (grouped)", "torch": f"{r['loop_ms']:.2f} ms (one call each)",
             "ratio": f"{r['loop_over_grouped']:.2f} (loop / grouped)", "detail": f"kernel {r['grouped_kernel']}"}
            for r in _rows(folder, "12_grouped")]


# smoke jobs whose tables go into the measured table too
SMOKE_READS = {"14_fault_tolerant_dp.bench": read_14}


# ----------------------------------------------------------------------------------------
# Running them, time-boxed, and the summary
# ----------------------------------------------------------------------------------------
class Check:
    """The run: its jobs' processes (ended with it), its rows and the summary file."""

    def __init__(self, args):
        self.args, self.out, self.start = args, Path(args.out), time.time()
        self.rows, self.measured, self.lock, self.procs, self.stopping = [], [], threading.Lock(), set(), False
        self.out.mkdir(parents=True, exist_ok=True)
        self.header = self._header()

    def left(self) -> float:
        return self.args.budget - (time.time() - self.start)

    def _header(self) -> str:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "?"
        probe = subprocess.run([self.args.python, "-c", "import torch; print(torch.__version__, 'on', "
                                "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"],
                               capture_output=True, text=True).stdout.strip()
        return (f"# make gpu-check at {commit}, {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.start))} UTC\n\n"
                f"torch {probe}; {os.cpu_count()} CPU cores; device {self.args.device}, NCCL's part played by "
                f"{self.args.nccl}; parts: {', '.join(self.args.parts)}; budget {self.args.budget:g} s"
                + ("; the smoke jobs under the device audit (a GPU's device rules on the CPU)"
                   if self.args.device == "cpu" else "") + "\n")

    def add(self, part, job, verdict, seconds, detail=""):
        with self.lock:
            self.rows.append({"part": part, "job": job, "verdict": verdict, "seconds": round(seconds, 1),
                              "detail": detail})
            self.write()

    def read_measured(self, read, folder: Path) -> tuple:
        """A job's table into the measured one: (verdict, detail) of its row."""
        try:
            got = read(folder)
        except (OSError, KeyError, IndexError, ValueError) as e:
            return "FAIL", f"no table to read: {type(e).__name__}: {e}"
        with self.lock:
            self.measured += got
        return "MEASURED", "; ".join(f"{m['measurement']}: {m['ratio'] or m['ours']}" for m in got)

    def write(self):
        order = {p: i for i, p in enumerate(PARTS)}
        rows = sorted(self.rows, key=lambda r: order[r["part"]])   # stable: within a part, as they ended
        lines = [self.header, "| part | job | verdict | seconds | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r['part']} | {r['job']} | {r['verdict']} | {r['seconds']:g} | {r['detail']} |" for r in rows]
        failed = [r for r in rows if r["verdict"] in ("FAIL", "TIMEOUT")]
        lines += ["", f"{len(rows)} rows, {len(failed)} failed, {sum(r['verdict'] == 'SKIP' for r in rows)} skipped; "
                      f"{time.time() - self.start:.0f} s so far."]
        if self.measured:
            lines += ["", "## Measured at 1 rank (NCCL on a GPU)", "",
                      "| measurement | ours | torch / baseline | ratio | detail |", "|---|---|---|---|---|"]
            lines += [f"| {m['measurement']} | {m['ours']} | {m['torch']} | {m['ratio']} | {m['detail']} |"
                      for m in self.measured]
        self.text = "\n".join(lines) + "\n"
        for name, text in (("SUMMARY.md", self.text),
                           ("SUMMARY.json", json.dumps({"header": self.header, "rows": rows,
                                                        "measured": self.measured}, indent=1))):
            # a reader never sees half a file; a save that fails goes elsewhere, said at the end
            result_files.save_file(self.out / name, lambda f: f.write(text.encode()))

    def run(self, cmd, log: Path, box: float, env=None) -> tuple:
        """Run ``cmd`` in its own process group, its output into ``log``, for at most ``box``
        seconds (then the group is ended: exit status 124, as timeout(1) says). Returns
        (exit status, seconds)."""
        t0 = time.time()
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            f = open(log, "w")
        except OSError as e:   # the folder gone or full mid-run: the log goes elsewhere, said at the end
            f = open(result_files.elsewhere(log, e) or os.devnull, "w")
        with f:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, **(env or {})})
            with self.lock:
                self.procs.add(p)
            try:
                code = p.wait(timeout=max(1.0, box))
            except subprocess.TimeoutExpired:
                end(p)
                code = 124
                f.write(f"\n[gpu_check] killed by its time box of {box:.0f} s\n")
            finally:
                with self.lock:
                    self.procs.discard(p)
        return (130 if self.stopping and code != 0 else code), time.time() - t0

    def end_all(self):
        """End every running job (the check was interrupted)."""
        self.stopping = True
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            end(p)


# ----------------------------------------------------------------------------------------
# What comes back from a lease: one archive, whole at every moment
# ----------------------------------------------------------------------------------------
PACK_EVERY = 15.0          # seconds between packs
PACK_LIMIT = 15 * 2**20    # bytes: a lease brings back files of at most 16 MiB


@contextlib.contextmanager
def packed(folder, archive, every=PACK_EVERY, limit=PACK_LIMIT):
    """While the block runs, ``folder`` packed into ``archive`` (a gzip'd tar; None: nothing
    is packed) every ``every`` seconds, and once more as it ends (an exception or SIGTERM
    made one included). Each pack is written beside and renamed over the last, so the
    archive is whole whenever the process is killed: a lease's call cut by the device time
    left, which no timeout of the command sees, still brings back what had finished by the
    last pack. Members are named as ``tar czf ARCHIVE FOLDER`` names them when run in the
    repository (``results/gpu/check/...``). Over ``limit`` bytes the largest files are left
    out, one at a time, and named in the archive's LEFT_OUT.txt."""
    if not archive:
        yield
        return
    stop = threading.Event()

    def again():
        while not stop.wait(every):
            pack(folder, archive, limit)
    thread = threading.Thread(target=again, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        pack(folder, archive, limit)


def pack(folder, archive, limit=PACK_LIMIT) -> list | None:
    """One pack of ``folder`` into ``archive`` (see packed): each file read whole first, so a
    file that grows or goes meanwhile is packed as it was or left out, never cut inside the
    tar. Returns the files left out for the limit; None where the archive could not be
    written (the last one stays)."""
    folder, archive = Path(folder).absolute(), Path(archive).absolute()
    base = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else Path(folder.name)
    part = archive.with_name(archive.name + ".part")
    files = []
    for f in sorted(folder.rglob("*")) if folder.is_dir() else []:
        try:
            if f.is_file() and f.absolute() not in (archive, part):
                files.append((f, f.read_bytes()))
        except OSError:   # gone meanwhile
            continue
    left = []   # (name, bytes) of each file left out for the limit
    try:
        while True:
            with tarfile.open(part, "w:gz") as tar:
                for f, data in files:
                    add_member(tar, str(base / f.relative_to(folder)), data)
                if left:
                    add_member(tar, str(base / "LEFT_OUT.txt"), "".join(
                        f"{name} ({n:,} bytes): left out, the archive over {limit:,} bytes with it\n"
                        for name, n in left).encode())
            if part.stat().st_size <= limit or not files:
                break
            f, data = files.pop(max(range(len(files)), key=lambda i: len(files[i][1])))
            left.append((str(base / f.relative_to(folder)), len(data)))
        os.replace(part, archive)
    except OSError as e:
        print(f"gpu_check: could not pack {archive}: {e}", file=sys.stderr, flush=True)
        return None
    return left


def add_member(tar, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), time.time(), 0o644
    tar.addfile(info, io.BytesIO(data))


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM (timeout(1) ending the command) raises KeyboardInterrupt in the main thread
    inside the block, as Ctrl-C does: what it cuts ends its jobs and writes what it has.
    Once: a second SIGTERM is ignored until the block ends (timeout(1) signals make's whole
    process group, and make passes the signal on to this process again, which had cut its
    cleanup short)."""
    def interrupt(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end(p):
    """End a job's whole process group: SIGTERM (the scripts end their ranks), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def verdict(code: int, box: float) -> tuple:
    if code == 0:
        return "PASS", ""
    if code == 124:
        return "TIMEOUT", f"killed by its {box:.0f} s time box (exit 124)"
    if code == 130:
        return "FAIL", "interrupted with the check"
    return "FAIL", f"exit {code}"


KERNEL_TESTS = {"test_context_parallel_attention_equals_sdpa_on_the_whole_sequence": "11 context_parallel vs SDPA",
                "test_grouped_experts_in_bf16_equal_one_call_per_expert": "12 grouped experts vs loop, bf16"}


def part_kernels(check: Check):
    box = min(check.args.kernel_box, check.left())
    if check.left() < 10:
        return check.add("kernels", "tests/test_gpu_kernels.py", "NOT STARTED", 0, "budget spent")
    xml = check.out / "kernels.xml"
    code, seconds = check.run([check.args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_gpu_kernels.py", f"--junitxml={xml}"], check.out / "kernels.log", box)
    if not xml.exists():
        v, why = verdict(code or 1, box)
        return check.add("kernels", "tests/test_gpu_kernels.py", v, seconds, f"{why}; no report (see kernels.log)")
    for case in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        test, _, params = case.get("name").partition("[")
        name = f"{KERNEL_TESTS.get(test, test)} [{params}" if params else KERNEL_TESTS.get(test, test)
        skipped, failed = case.find("skipped"), case.find("failure") if case.find("failure") is not None \
            else case.find("error")
        detail = ", ".join(f"{k} {v}" for k, v in props.items())
        if skipped is not None:
            check.add("kernels", name, "SKIP", float(case.get("time", 0)), skipped.get("message", ""))
        elif failed is not None:
            msg = (failed.get("message") or "").splitlines()[0][:200] if failed.get("message") else "failed"
            check.add("kernels", name, "FAIL", float(case.get("time", 0)), f"{detail}; {msg}".strip("; "))
        else:
            check.add("kernels", name, "PASS", float(case.get("time", 0)), detail)
    if code not in (0, 1):   # pytest itself failed to run (1: some test failed, already a row)
        check.add("kernels", "pytest", *verdict(code, box), seconds)


def part_measure(check: Check, scripts):
    folder = check.out / "measure"
    with contextlib.suppress(OSError):   # (where it cannot be made, each job refuses its --out: a FAIL row)
        folder.mkdir(parents=True, exist_ok=True)
    for name, cmd, read, stem in measure_jobs(scripts, check.args.device, check.args.nccl, check.args.size):
        box = min(check.args.measure_box, check.left())
        if check.left() < 10:
            check.add("measure", name, "NOT STARTED", 0, "budget spent")
            continue
        out = folder / stem
        code, seconds = check.run([check.args.python, *cmd, "--out", str(out)], folder / f"{stem}.log", box)
        v, why = verdict(code, box)
        if code == 0:
            v, why = check.read_measured(read, out)
        check.add("measure", name, v, seconds, why)


def part_smoke(check: Check, scripts):
    folder = check.out / ("smoke" if check.args.parts != ["smoke"] else "")
    with contextlib.suppress(OSError):   # (where it cannot be made, each job refuses its --out: a FAIL row)
        folder.mkdir(parents=True, exist_ok=True)
    env = {AUDIT_ENV: "1"} if check.args.device == "cpu" else {}

    def one(job):
        name, cmd = job
        box = min(check.args.box, check.left())
        if check.left() < 10:
            return check.add("smoke", name, "NOT STARTED", 0, "budget spent")
        if cmd[0].startswith("13_") and not has_transformers(check.args.python):
            return check.add("smoke", name, "SKIP", 0, "13 trains a transformers model: transformers is not installed "
                                                       "for this python")
        code, seconds = check.run([check.args.python, *deadline_within(cmd, box), "--out", str(folder / name)],
                                  folder / f"{name}.log", box, env)
        v, why = verdict(code, box)
        if code == 0 and name in SMOKE_READS:
            v, why = check.read_measured(SMOKE_READS[name], folder / name)
        check.add("smoke", name, v, seconds, why)
    pool = ThreadPoolExecutor(max_workers=check.args.jobs)
    try:
        for done in [pool.submit(one, job) for job in smoke_jobs(scripts, check.args.device, check.args.nccl,
                                                                 check.args.size, check.args.box)]:
            done.result()
    finally:   # interrupted: the queued jobs never start, the running ones are ended (end_all)
        pool.shutdown(wait=False, cancel_futures=True)


def has_transformers(python) -> bool:
    """Whether ``python`` imports transformers (13's jobs need it; a GPU machine where
    nothing installs may lack it)."""
    import subprocess
    return subprocess.run([python, "-c", "import transformers"], capture_output=True).returncode == 0


def machine_scale() -> float:
    """How much longer than on the GPU machine (16 cores) the time boxes are here: 1 on 8
    cores or more, 8 / cores below (a 2-core CPU dry run: 4 times; every job also runs one
    at a time there, as six at once on 2 cores took one alone's 8 s to past 200 s)."""
    return max(1.0, 8 / (os.cpu_count() or 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "gpu" / "check"), help="folder of SUMMARY.md and the logs")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run")
    p.add_argument("--nccl", choices=["nccl", "gloo"], default="nccl", help="the 1-rank jobs' backend (gloo: dry run)")
    p.add_argument("--size", default="", help="model size of every job (default: each part's own; nano: dry run)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--scripts", nargs="+", choices=SCRIPTS, default=SCRIPTS, help="whose smoke and measured jobs")
    p.add_argument("--measure", nargs="+", choices=SCRIPTS, default=None,
                   help="whose measured jobs, where they are not --scripts' (05, 07 and 12 have one)")
    cpus, scale = os.cpu_count() or 1, machine_scale()
    p.add_argument("--jobs", type=int, default=max(1, min(6, cpus // 2)),
                   help=f"smoke jobs at once (default: half the CPU cores, at most 6: here {max(1, min(6, cpus // 2))})")
    p.add_argument("--box", type=float, default=200.0 * scale,
                   help=f"seconds a smoke job may take (default: 200 on 8 cores or more, longer on fewer: "
                        f"here {200 * scale:g})")
    p.add_argument("--measure-box", type=float, default=120.0 * scale, help="seconds a measured job may take")
    p.add_argument("--kernel-box", type=float, default=150.0 * scale, help="seconds the kernel tests may take")
    p.add_argument("--budget", type=float, default=450.0 * scale,
                   help=f"seconds after which no job starts or runs on (default: 450 on 8 cores or more: "
                        f"here {450 * scale:g})")
    p.add_argument("--python", default=sys.executable, help="the interpreter the jobs run with")
    p.add_argument("--archive", default=None, help=f"--out packed into this .tgz every {PACK_EVERY:g} s and at the end, "
                                                    "whole at every moment (a lease's call cut short brings it back)")
    args = p.parse_args(argv)
    problem = result_files.folder_problem(args.out)
    if problem:   # found before any job starts
        print(f"gpu_check.py: error: --out {args.out} {problem}", file=sys.stderr)
        return 2
    check = Check(args)
    check.write()
    with sigterm_interrupts(), packed(args.out, args.archive):
        run_parts(check, args)
    print(check.text)
    lost = result_files.unsaved()
    for line in lost:
        print(f"gpu_check.py: error: {line}", file=sys.stderr)
    return 1 if lost or any(r["verdict"] in ("FAIL", "TIMEOUT", "NOT STARTED") for r in check.rows) else 0


def run_parts(check: Check, args):
    """The parts asked for, in order; no job outlives them (interrupted or not)."""
    try:
        for part in PARTS:
            if part in args.parts:
                {"kernels": lambda: part_kernels(check), "measure": lambda: part_measure(check, args.measure or args.scripts),
                 "smoke": lambda: part_smoke(check, args.scripts)}[part]()
    except BaseException as e:   # interrupted, or the check's own bug: no job outlives it
        check.end_all()
        check.add(args.parts[-1], "(the check)", "FAIL", time.time() - check.start,
                  "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}")
        if not isinstance(e, KeyboardInterrupt):
            raise
    finally:
        check.end_all()


if __name__ == "__main__":
    sys.exit(main())
