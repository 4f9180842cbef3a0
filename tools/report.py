"""The kit's reports, read from results/: each script's headline, the tables and headlines
injected into README.md and docs/, and `make all`'s runner.

    python tools/report.py inject               # refresh every table and headline from results/
    python tools/report.py all 01 02 ... 12     # make all: run `make NN` for each, summarize, inject
    python tools/report.py headlines            # print each script's headline

A document marks what is injected: ``<!-- table:NAME -->`` ... ``<!-- end -->`` holds the
table of results/NAME.md (NAME may hold a folder: ``08_world_sizes_2_4/08_tensor_parallel``),
and ``<!-- headline:NN -->`` ... ``<!-- end -->`` script NN's headline. Nothing between the
markers is typed by hand: a test recomputes every headline from its result file.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ----------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------
def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rows_by(doc: dict, key="method") -> dict:
    return {r[key]: r for r in doc["rows"]}


def x(v: float) -> str:
    return f"{v:.2f}×"


def spread(r: dict, key="vs_torch") -> str:
    """A paired ratio with its range: 0.88× [0.79–0.98]."""
    return f"{x(r[key])} [{r[f'{key}_min']:.2f}–{r[f'{key}_max']:.2f}]"


def where(doc: dict) -> str:
    s = doc["settings"]
    ranks = s.get("world_size")
    ranks = "/".join(map(str, ranks)) if isinstance(ranks, list) else ranks
    return f"{doc['machine']['device']}, {s.get('backend', 'gloo')}, {ranks} ranks"


# ----------------------------------------------------------------------------------------
# Headlines: one cell per script, every number read from its result file
# ----------------------------------------------------------------------------------------
def h01(results):
    doc = load("01_allreduce", results)
    big = [r for r in doc["rows"] if r["size_mb"] == max(r["size_mb"] for r in doc["rows"])]
    bw = " / ".join(f"{r['busbw_GBps']:.2f}" for r in big)
    ranks = " / ".join(str(r["ranks"]) for r in big)
    return f"all-reduce of {big[0]['size_mb']:g} MB: busbw {bw} GB/s at {ranks} ranks ({doc['machine']['device']}, gloo)"


def h02(results):
    doc = load("02_naive_ddp", results)
    r = doc["rows"][0]
    return f"communication {r['comm_share']:.0%} of a {r['step_ms']:.0f} ms step ({where(doc)})"


def h03(results):
    doc = load("03_flat_ddp", results)
    naive, flat = doc["rows"][0], doc["rows"][1]
    return (f"one call instead of {naive['collectives']}: step {x(flat['step_ms'] / naive['step_ms'])} naive's "
            f"({where(doc)})")


def h04(results):
    doc = load("04_overlap_ddp", results)
    r = rows_by(doc)
    naive, over = r["naive (per-parameter)"], r["overlapped (per-parameter, async)"]
    return (f"exposed communication {over['comm_ms']:.0f} ms against naive's {naive['comm_ms']:.0f}; step "
            f"{x(over['step_ms'] / naive['step_ms'])} naive's ({where(doc)})")


def h05(results):
    doc = load("05_bucketed_ddp", results)
    ours = [r for r in doc["rows"] if r["method"].startswith("DDPBucketed") and r["model"] == "lm"]
    caps = " / ".join(f"{r['bucket_mb']:g}" for r in ours)
    ratios = " / ".join(f"{r['vs_torch_ddp']:.2f}" for r in ours)
    return (f"vs torch DDP {ratios}× at {caps} MB, paired "
            f"[{min(r['vs_torch_ddp_min'] for r in ours):.2f}–{max(r['vs_torch_ddp_max'] for r in ours):.2f}] "
            f"({where(doc)})")


def h06(results):
    mem, doc = load("06_sharded_memory", results), load("06_sharded_optimizer", results)
    state = {(r["optimizer"], r["rank"]): r["opt_state_MB"] for r in mem["rows"] if r["point"] == "after optimizer step"}
    ratio = max(v / state[("plain", rank)] for (opt, rank), v in state.items() if opt == "sharded")
    r = rows_by(doc)
    ours, zero = r["ShardedOptimizer(AdamW)"], r["ZeroRedundancyOptimizer(AdamW)"]
    text = (f"optimizer state per rank {x(ratio)} unsharded; step {x(ours['step_ms'] / zero['step_ms'])} "
            f"ZeroRedundancyOptimizer's")
    stages = load("06_zero_stages", results)
    if stages:   # ZeRO-2 at 25 MB beside stage 1 (ours) and its torch twin
        by = rows_by(stages)
        z2, z1 = by["ShardedGradientOptimizer, 25 MB buckets (ours)"], by["DDPBucketed + ShardedOptimizer (ours)"]
        text += (f"; ZeRO-2: state {x(z2['state_MB'] / z1['state_MB'])} and step peak "
                 f"{x(z2['step_peak_MB'] / z1['step_peak_MB'])} stage 1's, step {spread(z2)} FSDP2 unresharded's")
    return f"{text} ({where(doc)})"


def h07(results):
    doc, mem = load("07_fsdp", results), load("07_fsdp_memory", results)
    ours = next(r for r in doc["rows"] if r["method"].startswith("FSDP"))
    peak = max(r["vs_fsdp2"] for r in mem["rows"] if r["method"].startswith("FSDP") and "bf16" not in r["method"])
    text = f"vs FSDP2: step {spread(ours)}, live peak {x(peak)}"
    mixed = load("07_bf16/07_fsdp", results)   # make levers: the mixed-precision pair
    bf16 = [r for r in (mixed or {"rows": []})["rows"] if r["method"].startswith("FSDP (bf16")]
    if bf16:
        text += (f"; bf16 (float32 reduction) vs FSDP2's policy: step {spread(bf16[0])}, sent "
                 f"{bf16[0]['comm_MB']:.0f} MB against float32's {ours['comm_MB']:.0f}")
    return f"{text} ({where(doc)})"


def h08(results):
    doc = load("08_tensor_parallel", results)
    parts = [f"TP {r['tp']}{' + SP' if '+ SP' in r['method'] else ''} {spread(r)}" for r in doc["rows"]
             if r.get("vs_torch") is not None]
    return f"vs torch TP: {', '.join(parts)} ({where(doc)})"


def h09(results):
    doc = load("09_pipeline_parallel", results)
    parts = [f"{r['schedule']} m {r['microbatches']} {spread(r)}" for r in doc["rows"]
             if r.get("vs_torch") is not None and r["microbatches"] == max(q["microbatches"] for q in doc["rows"])]
    return f"vs torch pipelining: {', '.join(parts)} ({where(doc)})"


def h10(results):
    doc = load("10_nd_parallel", results)
    ours = [r for r in doc["rows"] if r.get("vs_torch") is not None]
    lo, hi = min(r["vs_torch"] for r in ours), max(r["vs_torch"] for r in ours)
    return f"vs torch's composition: {lo:.2f}–{hi:.2f}× on {len(ours)} meshes ({where(doc)})"


def h11(results):
    doc, mem = load("11_context_parallel", results), load("11_memory", results)
    t = max(r["seq_len"] for r in doc["rows"])
    parts = [f"{r['method']} {x(r['vs_one_process'])}" for r in doc["rows"]
             if r["seq_len"] == t and r["cp"] > 1]
    n = max(r["seq_len"] for r in mem["rows"])
    saved = {r["method"]: r["saved_MB"] for r in mem["rows"] if r["seq_len"] == n}
    ring = next(v for k, v in saved.items() if k.startswith("ring"))
    return (f"step at {t} tokens over one process's: {', '.join(parts)}; ring keeps {x(ring / saved['one process'])} "
            f"one process's attention activations at {n} tokens ({where(doc)})")


def h12(results):
    doc = load("12_expert_parallel", results)
    ep = next(r for r in doc["rows"] if r.get("vs_replicated") is not None)
    rep = rows_by(doc)["MoE replicated (plain DP)"]
    return (f"EP {ep['ep']} vs the replicated MoE: step {spread(ep, 'vs_replicated')}, experts' state "
            f"{x(ep['experts_state_MB'] / rep['experts_state_MB'])} ({where(doc)})")


def h13(results):
    doc = load("13_train", results)
    r = doc["rows"][0]
    text = (f"held-out loss {r['first eval']:.2f} → {r['last eval']:.2f} in {r['steps']} steps on {r['mesh']}, "
            f"{r['tokens/s']:,} tokens/s")
    bench = load("13_train_bench", results)
    if bench:
        ours = [row for row in bench["rows"] if row["vs_torch"]]
        text += "; step vs FSDP2: " + ", ".join(f"{row['vs_torch'].split()[0]}× ({row['setting']})" for row in ours)
    return f"{text} ({doc['machine']['device']}, {doc['settings'].get('backend', 'gloo')})"


def h14(results):
    doc, tl = load("14_fault_tolerant_dp", results), load("14_timeline", results)
    text = ""
    if tl:
        c = tl["check"]
        text = (f"{c['steps']} steps committed once each through a kill -9, a kill during a heal, a SIGSTOP and two "
                f"lost at once at five points of a step, {c['heals']} exact heals; ")
    rows = {r["replicas"]: r for r in doc["rows"]}
    n = max(rows)
    return (f"{text}step vs torch DDP {x(rows[n]['vs_ddp'])} at {n} replicas, a kill to the next commit "
            f"{rows[n]['kill_to_commit_s']:.2f} s, a heal {rows[n]['heal_s'] * 1000:.0f} ms ({where(doc)})")


HEADLINES = {"01": h01, "02": h02, "03": h03, "04": h04, "05": h05, "06": h06, "07": h07, "08": h08, "09": h09,
             "10": h10, "11": h11, "12": h12, "13": h13, "14": h14}


def verified(script: str, results: Path = RESULTS) -> str:
    """The verification of a script in the last make all (results/SUMMARY.json)."""
    summary = load("SUMMARY", results)
    entry = (summary or {}).get("scripts", {}).get(script)
    if not entry or entry["verified"] == "–":
        return "not run by make all"
    return f"{entry['verified']} ({summary['machine']}, {summary['date']})"


def headline(script: str, results: Path = RESULTS) -> str:
    try:
        text = HEADLINES[script](results)
    except (TypeError, KeyError, StopIteration, ValueError, AttributeError):   # no result file, or not these rows
        text = "no results yet"
    return f"verified: {verified(script, results)}; {text}"


# ----------------------------------------------------------------------------------------
# Injection into README.md and docs/
# ----------------------------------------------------------------------------------------
TABLE = re.compile(r"(<!-- table:(?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- end -->)", re.S)
HEADLINE = re.compile(r"(<!-- headline:(?P<name>\w+) -->)(?P<body>.*?)(<!-- end -->)")


def table_text(name: str, results: Path = RESULTS) -> str:
    """What a table marker holds: the machine line and the table of results/NAME.md (its
    settings and notes stay in the file)."""
    lines = (results / f"{name}.md").read_text().split("\n")
    machine = next(line for line in lines if line.startswith("Machine: "))
    table = [line for line in lines if line.startswith("|")]
    return f"{machine.rstrip('.')}. `results/{name}.md`\n\n" + "\n".join(table) + "\n"


def injected(text: str, results: Path = RESULTS) -> str:
    text = TABLE.sub(lambda m: m.group(1) + table_text(m.group("name"), results) + m.group(4), text)
    return HEADLINE.sub(lambda m: m.group(1) + headline(m.group("name"), results) + m.group(4), text)


def inject(paths=DOCS, results: Path = RESULTS) -> list:
    changed = []
    for path in paths:
        old = path.read_text()
        new = injected(old, results)
        if new != old:
            write(path, new)
            changed.append(path.name)
    return changed


def write(path: Path, text: str):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------
# make all: every script's Makefile target, with progress and a summary
# ----------------------------------------------------------------------------------------
VERIFY_LINE = re.compile(r"^verify .*: (PASS|FAIL)\b")


def script_name(target: str) -> str:
    return next((p.stem for p in ROOT.glob(f"{target}_*.py")), target)


def run_target(target: str, make: str) -> tuple:
    """``make -s TARGET``, its output passed through line by line; returns (exit status,
    seconds, verification: PASS, FAIL or – when it printed none)."""
    start, results = time.time(), []
    proc = subprocess.Popen([make, "-s", "--no-print-directory", target], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = VERIFY_LINE.match(line.strip())
        if m:
            results.append(m.group(1))
    rc = proc.wait()
    verdict = "FAIL" if "FAIL" in results or (rc and results) else ("PASS" if results else "–")
    return rc, time.time() - start, verdict


def run_all(targets: list, make: str = "make", results: Path = RESULTS, docs=DOCS) -> int:
    """Run each target, then write results/SUMMARY.{json,md} and refresh ``docs``; 1 if a
    target failed (the others still ran)."""
    last = load("SUMMARY", results) or {}
    here = socket.gethostname()
    before = last.get("scripts", {}) if last.get("host") == here else {}
    summary = {"host": here, "machine": machine_label(), "date": time.strftime("%Y-%m-%d %H:%M"), "scripts": {}}
    t0 = time.time()
    for k, target in enumerate(targets, 1):
        name = script_name(target)
        eta = (f"about {max(1, round(before[target]['seconds'] / 60))} min on this machine's last run"
               if target in before else "no earlier run on this machine")
        print(f"\n[{k}/{len(targets)}] {name} ({eta})", flush=True)
        rc, seconds, verdict = run_target(target, make)
        summary["scripts"][target] = {"name": name, "exit": rc, "seconds": round(seconds, 1), "verified": verdict}
    summary["seconds"] = round(time.time() - t0, 1)
    failed = [s["name"] for s in summary["scripts"].values() if s["exit"]]
    write(results / "SUMMARY.json", json.dumps(summary, indent=1) + "\n")
    table = summary_table(summary, results)
    write(results / "SUMMARY.md", f"# make all\n\nMachine: {summary['machine']}, {summary['date']}.\n\n{table}\n")
    print(f"\n{table}\nwrote {results}/SUMMARY.md")
    changed = inject(docs, results)
    if changed:
        print(f"refreshed the tables and headlines of {', '.join(changed)}")
    if failed:
        print(f"make all: {len(failed)} script(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def summary_table(summary: dict, results: Path = RESULTS) -> str:
    lines = ["| script | verification | headline | exit status | wall time |", "|---|---|---|---|---|"]
    for target, s in summary["scripts"].items():
        try:
            text = HEADLINES[target](results) if not s["exit"] else "failed: see its output above"
        except (TypeError, KeyError, StopIteration, ValueError, AttributeError):
            text = "no results"
        lines.append(f"| {s['name']} | {s['verified']} | {text} | {s['exit']} | {minutes(s['seconds'])} |")
    lines.append(f"| all | | | | {minutes(summary['seconds'])} |")
    return "\n".join(lines)


def minutes(seconds: float) -> str:
    whole = round(seconds)   # (rounded first: 539.6 s is 9 min 00 s, not 8 min 60 s)
    return f"{whole // 60} min {whole % 60:02d} s"


def machine_label() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "CPU") if os.path.exists("/proc/cpuinfo") else "CPU"
    return f"{cpu} ({os.cpu_count()} cores)"


def main(argv):
    if not argv or argv[0] not in ("inject", "all", "headlines"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "inject":
        changed = inject()
        print(f"refreshed {', '.join(changed)}" if changed else "README.md and docs/ are up to date")
        return 0
    if argv[0] == "headlines":
        for script in HEADLINES:
            print(f"{script}: {headline(script)}")
        return 0
    flags = os.environ.get("MAKEFLAGS", "").split()
    dry = bool(flags) and not flags[0].startswith("--") and "n" in flags[0].lstrip("-")
    if dry:   # make -n all: the commands, nothing run or written
        for target in argv[1:]:
            subprocess.run([os.environ.get("MAKE", "make"), "--no-print-directory", target], cwd=ROOT)
        return 0
    return run_all(argv[1:] or list(HEADLINES), os.environ.get("MAKE", "make"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
