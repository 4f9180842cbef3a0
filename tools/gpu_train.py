"""make gpu-train: 13's run where people train, timed on one GPU beside torch's best.

A Llama-shaped transformers model of about 1 B parameters, built from its config (random
initial weights, seeded; nothing downloaded) and written as save_pretrained writes it, with
13's tokenizer and Python's help text to train on; context 2048, bf16 autocast. 13's
--bench on one rank then times ours (13's mesh) beside torch's FSDP2 on the same model and
batches, both with every decoder layer and the loss through torch.compile, steps alternating: each
one's step time, tokens/s, MFU (the training FLOPs a token of docs/13 over the device's bf16
dense peak) and its peak memory at its third step; then one more step each under
torch.profiler (13's --profile: each phase's wall and GPU-busy time, the GPU's longest idle
stretches and what the host ran then, the busy time by kind of work, the costliest kernels,
rank 0's Chrome traces); and one checkpoint save each (13 GB at 1b, removed once timed).
The best of --compile and --recompute that fits: --compile first; where it runs out of
memory, --compile --recompute. On a machine of 2 or more GPUs (--ranks), the same on fsdp
over all of them, then on tp 2 inside dp over the rest, each data rank with one GPU's batch.

    make gpu-train PY=python3                                    # on the lent GPU: results/gpu/train
    make gpu-train GPU_DEV=cpu TRAIN_SIZE=tiny GPU_OUT=/tmp/gpu-dry  # the dry run on a CPU (a tiny model)
    make gpu-train GPU_DEV=cpu TRAIN_SIZE=tiny GPU_OUT=/tmp/gpu-dry TRAIN_RANKS=2   # and 2 ranks' meshes

Every try is time-boxed (--box seconds) and keeps its log; <out>/SUMMARY.md lists each try's
mesh, command, exit status and seconds, and for each mesh the tables of its try that ran
(13_train_bench.md and 13_train_profile.md beside it). The model (4.4 GB at 1b), the text,
its token cache and the run folder go to --work, out of <out>, which stays small enough to
carry back whole; with --archive, <out> is packed into that one file every 15 s and at the
end (a lease's call cut short still brings back what had finished). Exit status 1 where a
mesh has no table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import PACK_EVERY, packed, sigterm_interrupts  # noqa: E402  (the standard library only)

# the model: Llama 3.2 1B's shape (16 layers of width 2048, grouped queries 32/8, SwiGLU 8192)
# with a vocabulary of 32000: 1.10 B parameters, 7.0 GFLOP a token at context 2048 (docs/13's
# count); and a tiny one for the CPU's dry run
SIZES = {
    "1b": {"config": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32000),
           "context": 2048, "batch": 4, "steps": 30},
    "tiny": {"config": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024),
             "context": 128, "batch": 4, "steps": 3},
}


def write_model(folder: Path, size: str, device: str, seed: int = 0):
    """The model folder: 13's tokenizer (trained on Python's help text), a LlamaConfig of
    ``size`` and its initial weights, seeded, made on ``device`` (fast on a GPU) and saved
    as safetensors. Written beside, then moved in (a cut write leaves no half folder)."""
    import torch
    import transformers
    sys.path.insert(0, str(ROOT))
    import common
    train = common.load_script(ROOT / "13_train.py")
    spec = SIZES[size]
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    text = train.pydoc_text()
    train.write_tiny_model(tmp, text, spec["context"], seed)   # (its tokenizer; the model is replaced below)
    for f in tmp.glob("model*.safetensors*"):
        f.unlink()
    config = transformers.LlamaConfig(max_position_embeddings=spec["context"], eos_token_id=0, bos_token_id=0,
                                      tie_word_embeddings=False, **spec["config"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp)
    n = sum(p.numel() for p in model.parameters())
    del model
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    (folder.parent / "pydoc_topics.txt").write_text(text)
    return n


def run_try(cmd: list, log: Path, box: float) -> tuple[int, float]:
    """``cmd`` in its own process group, its output to ``log``, ended after ``box`` seconds."""
    began = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=box)
        except subprocess.TimeoutExpired:
            code = 124
        finally:   # (boxed, or this run ended by a signal: the try's whole group with it)
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return code, time.time() - began


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size", choices=list(SIZES), default="1b")
    p.add_argument("--python", default=sys.executable, help="the python that runs 13")
    p.add_argument("--out", default=str(ROOT / "results" / "gpu" / "train"))
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kit-gpu-train"),
                   help="the model folder, the text, its token cache and the run folder (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="measured steps a method (default: the size's)")
    p.add_argument("--box", type=float, default=420.0, help="seconds a try may take")
    p.add_argument("--ranks", type=int, default=None,
                   help="GPUs to use (default: every GPU the python sees; 1 on --device cpu): 1 times the one-GPU "
                        "mesh; 2 or more also fsdp over all of them, and tp 2 inside dp over the rest")
    p.add_argument("--archive", default=None, help=f"--out packed into this .tgz every {PACK_EVERY:g} s and at the end, "
                                                    "whole at every moment (a lease's call cut short brings it back)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:   # (SIGTERM, as timeout(1) sends it, ends the try and packs the archive a last time)
        with sigterm_interrupts(), packed(out, args.archive):
            return run(args, out)
    except KeyboardInterrupt:
        print("gpu-train: ended by a signal; the summary lists the tries until then", flush=True)
        return 130


def gpu_count(python) -> int:
    """The GPUs ``python``'s torch sees (0 where it sees none or fails)."""
    r = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                       text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def meshes(ranks: int, batch: int) -> list:
    """(label, 13's mesh flags, global batch, prefix of its folders and logs) of each mesh
    timed, the most wanted first: one GPU (fsdp 1: the model trained as it is, as on one
    GPU); on 2 or more, fsdp over all of them, then tp 2 inside dp over the rest (where
    they are even). Each data rank takes one GPU's batch (the data ranks' tokens a GPU stay
    the same; a tp pair shares its rank's)."""
    out = [("fsdp 1", ["--fsdp", "1"], batch, "")]
    if ranks >= 2:
        out.append((f"fsdp {ranks}", ["--fsdp", str(ranks)], batch * ranks, f"fsdp{ranks}-"))
    if ranks >= 2 and ranks % 2 == 0:
        dp = ranks // 2
        label = f"dp {dp} x tp 2" if dp > 1 else "tp 2"
        out.append((label, ["--dp", str(dp), "--tp", "2", "--fsdp", "1"], batch * dp, label.replace(" ", "") + "-"))
    return out


def run(args, out: Path) -> int:
    """The model written (unless there already), then each mesh's tries, then the summary."""
    spec, work = SIZES[args.size], Path(args.work)
    folder = work / f"model-{args.size}"
    began = time.time()
    if not (folder / "config.json").exists():
        n = write_model(folder, args.size, args.device)
        print(f"gpu-train: wrote a {n / 1e9:.2f} B-parameter Llama-shaped model to {folder} in "
              f"{time.time() - began:.0f} s", flush=True)
    base = [args.python, "13_train.py", "--model", str(folder), "--data", str(work / "pydoc_topics.txt"),
            "--data-cache", str(work / "data"), "--bench", "--profile", "--bench-settings", "given", "--bench-saves", "1",
            "--bench-steps", str(args.steps or spec["steps"]), "--dtype", "bf16",
            "--context-length", str(spec["context"]), "--device", args.device,
            "--backend", "nccl" if args.device == "cuda" else "gloo", "--run-dir", str(work / "run")]
    ranks = args.ranks if args.ranks is not None else (gpu_count(args.python) if args.device == "cuda" else 1)
    rows = []
    for mesh, flags, batch, prefix in meshes(max(1, ranks), spec["batch"]):
        for name, levers in (("compile", ["--compile"]), ("compile+recompute", ["--compile", "--recompute"])):
            log, t0 = out / f"{prefix}{name}.log", time.time()
            row = {"mesh": mesh, "try": name, "folder": prefix + name}
            try:
                code, seconds = run_try([*base, *flags, "--batch-size", str(batch), *levers, "--out",
                                         str(out / row["folder"])], log, args.box)
            except KeyboardInterrupt:   # (the try ended with this run: listed, its log kept)
                rows.append({**row, "exit": "ended by a signal", "seconds": round(time.time() - t0, 1),
                             "out_of_memory": False})
                summarize(args, out, folder, rows)
                raise
            oom = "out of memory" in log.read_text().lower()
            rows.append({**row, "exit": code, "seconds": round(seconds, 1), "out_of_memory": oom})
            print(f"gpu-train: {mesh}, {name}: exit {code} in {seconds:.0f} s{' (out of memory)' if oom else ''}; "
                  f"log {log}", flush=True)
            if code == 0 or not oom:
                break
    return summarize(args, out, folder, rows)


def summarize(args, out: Path, folder: Path, rows: list) -> int:
    """<out>/SUMMARY.md and .json: each try's row, then for each mesh the tables of its try
    that ran (exit status 0). Exit status 0 where every mesh has them, else 1."""
    lines = ["# make gpu-train", "", f"Model: {folder} ({args.size}); 13's --bench, bf16 autocast.", "",
             "| mesh | try | exit | seconds | out of memory |", "|---|---|---|---|---|"]
    lines += [f"| {r['mesh']} | {r['try']} | {r['exit']} | {r['seconds']} | {r['out_of_memory']} |" for r in rows]
    ran = True
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        table = next((out / r["folder"] / "13_train_bench.md" for r in rows if r["mesh"] == mesh and r["exit"] == 0),
                     None)
        ran = ran and table is not None
        profile = table.with_name("13_train_profile.md") if table else None
        lines += ["", f"## {mesh}", "", table.read_text() if table else "No try ran to its table: see each log."]
        lines += ["", profile.read_text()] if profile and profile.exists() else []
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    (out / "SUMMARY.json").write_text(json.dumps({"rows": rows, "size": args.size, "device": args.device}, indent=1))
    print(f"gpu-train: wrote {out / 'SUMMARY.md'}", flush=True)
    return 0 if ran and rows else 1


if __name__ == "__main__":
    sys.exit(main())
