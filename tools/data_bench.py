"""13's data beside a nanoGPT-style preparation, and its cost per rank at 1x, 10x and 100x a
corpus (make data-bench; results/13_data_bench.md; docs/13 reads it).

    python tools/data_bench.py --out results            # base corpus: 40 MB of Python's sources
    python tools/data_bench.py --base-mb 2 --out /tmp/x  # a smaller base

1. Preparation, MB of text a second, on one process and on every core: ours (corpus.prepare:
   work units tokenized by a pool, written as memory-mapped shards) beside nanoGPT's recipe
   (datasets.load_dataset("text") and map(num_proc=N) with the same tokenizer's batch
   encoding, then the ids written into one uint16 np.memmap), on the same base corpus: a
   folder of Python's own standard library sources, each file a document.
2. Reading, at 1x, 10x and 100x the base (the larger ones the base's shards repeated, so
   the index holds 10 and 100 times the tokens: what a reader maps and draws from is a corpus
   of that size): each of 2 data ranks, a process of its own, maps the corpus and reads its
   rows of 200 steps' global batches (16 x 1024 tokens): its peak resident memory (VmHWM)
   and the data's milliseconds a step. They should not grow with the corpus.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import corpus  # noqa: E402


def base_corpus(folder: Path, mb: float) -> Path:
    """A folder of Python's own library sources (each a document), ``mb`` megabytes of them
    (the library, tests aside, is 13 MB: past that, its files again under other names)."""
    lib, out, size = Path(sysconfig.get_paths()["stdlib"]), folder / "base", 0
    out.mkdir(parents=True)
    texts = []
    for f in sorted(lib.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            texts.append((f.name, f.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    k = 0
    while size < mb * 1e6:
        name, text = texts[k % len(texts)]
        (out / f"{k:06d}_{name}.txt").write_text(text)
        size += len(text.encode())
        k += 1
    return out


def nanogpt_style(folder: Path, model: str, procs: int, out: Path) -> float:
    """nanoGPT's prepare.py with this tokenizer: the files as a datasets text dataset (a
    document a file: sample_by="document"), map(num_proc) of the batch encoding with the end-
    of-text token after each, the ids into one uint16 memmap. Seconds."""
    code = f"""
import numpy as np, datasets, transformers, time, glob
tok = transformers.AutoTokenizer.from_pretrained({model!r})
def enc(b):
    ids = tok(b["text"], add_special_tokens=False)["input_ids"]
    return {{"ids": [x + [tok.eos_token_id] for x in ids], "len": [len(x) + 1 for x in ids]}}
if __name__ == "__main__":
    t = time.perf_counter()
    d = datasets.load_dataset("text", data_files=sorted(glob.glob({str(folder / '*.txt')!r})), sample_by="document",
                              split="train", cache_dir={str(out / 'hf')!r})
    m = d.map(enc, batched=True, num_proc={procs}, remove_columns=["text"])
    n = int(np.sum(m["len"], dtype=np.uint64))
    arr = np.memmap({str(out / 'train.bin')!r}, dtype=np.uint16, mode="w+", shape=(n,))
    at = 0
    for k in range(64):
        part = m.shard(num_shards=64, index=k, contiguous=True).with_format("numpy")
        ids = np.concatenate(part["ids"]) if len(part) else np.zeros(0, np.uint16)
        arr[at:at + len(ids)] = ids
        at += len(ids)
    arr.flush()
    print(time.perf_counter() - t)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                       "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"})
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return float(p.stdout.split()[-1])


def ours(folder: Path, model: str, procs: int, cache: Path) -> tuple:
    """corpus.prepare with ``procs`` processes, in a process of its own timed as nanoGPT's
    is (its imports and the tokenizer's loading before the clock; a pool's start after it).
    (seconds, the index)."""
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
import corpus, transformers
transformers.AutoTokenizer.from_pretrained({model!r})
if __name__ == "__main__":
    t = time.perf_counter()
    index = corpus.prepare(corpus.parse_sources([{str(folder)!r}]), {model!r}, {str(cache)!r}, processes={procs},
                           say=lambda line: None)
    print(time.perf_counter() - t, index)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    t, index = p.stdout.split()[-2:]
    return float(t), index


def repeated(index: str, times: int, out: Path) -> str:
    """A corpus ``times`` the prepared one: its shards linked ``times`` over under new unit
    names, in one index."""
    meta, src = json.loads(Path(index).read_text()), Path(index).parent
    out.mkdir(parents=True)
    units = []
    for r in range(times):
        for u in meta["units"]:
            name = f"{u['unit']}-r{r:03d}"
            for ext in (".bin", ".json"):
                os.link(src / f"{u['unit']}{ext}", out / f"{name}{ext}")
            units.append({**u, "unit": name})
    (out / "index.json").write_text(json.dumps({**meta, "units": units}))
    return str(out / "index.json")


READ = """
import sys, time, json, resource
sys.path.insert(0, {root!r})
import corpus
index, rank, ranks, steps = {index!r}, {rank}, 2, 200
began = time.perf_counter()
r = corpus.Reader(index, 1024, 16, seed=0)
opened = time.perf_counter() - began
rows = range(rank * 8, (rank + 1) * 8)
times = []
for i in range(steps):
    t = time.perf_counter()
    x, y = r.batch_of(i, rows)
    times.append(time.perf_counter() - t)
peak = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) / 1024
times.sort()
print(json.dumps({{"tokens": r.tokens, "open_ms": opened * 1e3, "ms_step": times[len(times) // 2] * 1e3,
                  "ms_p95": times[int(len(times) * 0.95)] * 1e3, "peak_mib": peak, "read_mib": r.read / 2**20}}))
"""


def read_cost(index: str) -> dict:
    """Each of 2 data ranks' reading of 200 steps, in processes of their own, side by side:
    the slower rank's median ms a step, the larger peak."""
    procs = [subprocess.Popen([sys.executable, "-c", READ.format(root=str(ROOT), index=index, rank=k)],
                              stdout=subprocess.PIPE, text=True) for k in range(2)]
    got = [json.loads(p.communicate()[0]) for p in procs]
    return {"tokens": got[0]["tokens"], "open_ms": max(g["open_ms"] for g in got),
            "ms_step": max(g["ms_step"] for g in got), "ms_p95": max(g["ms_p95"] for g in got),
            "peak_mib": max(g["peak_mib"] for g in got), "read_mib_rank": got[0]["read_mib"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-mb", type=float, default=40.0, help="the base corpus, megabytes of text")
    p.add_argument("--model", default=None, help="the tokenizer's model folder (default: 13's tiny model)")
    p.add_argument("--out", default="results")
    args = p.parse_args()
    import common
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        model = args.model or str(ROOT / "runs" / "13_tiny_model")
        if not Path(model, "config.json").exists():
            raise SystemExit(f"data_bench: no model at {model}: run make train first (it writes 13's tiny model)")
        base = base_corpus(work, args.base_mb)
        mb = sum(f.stat().st_size for f in base.iterdir()) / 1e6
        cores = os.cpu_count() or 1
        prep = []
        for procs in sorted({1, cores}):
            t, index = ours(base, model, procs, work / f"ours-{procs}")
            prep.append({"method": "ours (corpus.prepare)", "processes": procs, "MB": round(mb, 1),
                         "seconds": round(t, 2), "MB_per_s": round(mb / t, 2)})
            t = nanogpt_style(base, model, procs, work / f"nanogpt-{procs}")
            prep.append({"method": "nanoGPT-style (datasets.map)", "processes": procs, "MB": round(mb, 1),
                         "seconds": round(t, 2), "MB_per_s": round(mb / t, 2)})
            print(prep[-2], prep[-1], flush=True)
        reading = []
        for times in (1, 10, 100):
            idx = index if times == 1 else repeated(index, times, work / f"x{times}")
            r = read_cost(idx)
            reading.append({"corpus": f"{times}x", "GB_text": round(mb * times / 1e3, 2), **{
                k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}})
            print(reading[-1], flush=True)
        common.save_results(args.out, "13_data_bench_prepare", prep, {"base_MB": mb, "model": model},
                            title="13's data: preparation, ours beside a nanoGPT-style datasets.map")
        table = common.save_results(args.out, "13_data_bench_read", reading, {"base_MB": mb, "context": 1024,
                                    "batch": 16, "ranks": 2, "steps": 200},
                                    title="13's data: each of 2 ranks reading its rows at 1x, 10x, 100x")
        print(table)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
