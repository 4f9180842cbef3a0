"""What a one-GPU machine gets, checked on the CPU: no job starts more NCCL ranks than there
are GPUs, and the GPU plan's Makefile targets, run dry (GPU_DEV=cpu, gloo in place of NCCL)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

import common
from conftest import ROOT, load, workers_left


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has n GPUs (no torchrun)."""
    def fake(n):
        monkeypatch.setattr(common.torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(common.torch.cuda, "device_count", lambda: n)
        for var in common.TORCHRUN_VARS:
            monkeypatch.delenv(var, raising=False)
    return fake


@pytest.mark.parametrize("script, argv", [
    ("08_tensor_parallel", ["--world-sizes", "2", "4"]),
    ("09_pipeline_parallel", ["--stages", "2", "4"]),
    ("09_pipeline_parallel", ["--stages", "2", "--replicas", "2"]),
])
def test_more_nccl_ranks_than_gpus_is_refused_naming_what_works(gpus, script, argv):
    gpus(2)
    with pytest.raises(common.UsageError, match="--backend gloo --device cuda"):
        load(script).main(["--backend", "nccl", *argv])


def test_launch_never_starts_more_nccl_ranks_than_gpus(gpus):
    gpus(1)
    with pytest.raises(common.UsageError, match="2 NCCL ranks on 1 GPU"):
        common.launch(print, argparse.Namespace(), world_size=2, backend="nccl", device="cuda")


def test_a_resume_on_more_ranks_than_gpus_runs_over_gloo_and_says_so(gpus, monkeypatch, capsys):
    gpus(1)
    jobs = []
    monkeypatch.setattr(common, "launch", lambda worker, args, *job, world_size=None, backend=None, device=None:
                        jobs.append((world_size or args.world_size, backend or args.backend)) or {"w": common.torch.zeros(1)})
    common.check_resume(print, argparse.Namespace(world_size=1, backend="nccl", device="cuda"), "the check")
    assert jobs == [(1, "nccl"), (2, "gloo")]
    assert "resumed over gloo on cuda" in capsys.readouterr().out


def make(*targets, timeout=300):
    return subprocess.run(["make", "--no-print-directory", *targets, "GPU_DEV=cpu", "GPU_NCCL=gloo",
                           "GPU_SIZE=nano", f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_smoke_dry_run_keeps_each_log_and_a_summary_of_exit_statuses(tmp_path):
    p = make("gpu-smoke", "SMOKE=03", f"GPU_OUT={tmp_path}")
    assert p.returncode == 0, p.stdout + p.stderr
    smoke = tmp_path / "smoke"
    summary = (smoke / "SUMMARY.md").read_text()
    assert "| smoke | 03_flat_ddp.gloo_1rank | PASS |" in summary and "| smoke | 03_flat_ddp.gloo_2ranks | PASS |" in summary
    for setting, ranks in (("gloo_1rank", 1), ("gloo_2ranks", 2)):
        log = (smoke / f"03_flat_ddp.{setting}.log").read_text()
        assert f"verify 03_flat_ddp at {ranks} rank(s): PASS" in log   # verification, then a few timed steps
        assert (smoke / f"03_flat_ddp.{setting}" / "03_flat_ddp.json").exists()


def test_gpu_smoke_fails_when_a_job_fails_and_says_which(tmp_path):
    p = make("gpu-smoke", "SMOKE=03", "SMOKE_BOX=1", f"GPU_OUT={tmp_path}")   # killed by its time box
    assert p.returncode != 0
    summary = (tmp_path / "smoke" / "SUMMARY.md").read_text()
    for setting in ("gloo_1rank", "gloo_2ranks"):
        assert f"| smoke | 03_flat_ddp.{setting} | TIMEOUT |" in summary
        assert "killed by its 1 s time box (exit 124)" in summary
    assert not workers_left()   # the job's whole process group ended with it


def test_gpu_check_dry_run_passes_with_every_part(tmp_path):
    """make gpu-check's CPU dry run: the kernel tests (the CUDA cases skipped with the
    reason), the measured table (MEASURE=12: 12's grouped experts in bf16), 03's smoke jobs
    under the device audit (12's own smoke commands run under it in test_12, through
    run_inline); SUMMARY.md holds every row and the table, SUMMARY.json the same."""
    p = make("gpu-check", "SMOKE=03", "MEASURE=12", f"GPU_OUT={tmp_path}", f"CHECK_ARCHIVE={tmp_path / 'check.tgz'}",
             timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check = tmp_path / "check"
    with tarfile.open(tmp_path / "check.tgz") as tar:   # (packed once more at the end: every file as it ended)
        packed = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert packed == {f"check/{f.relative_to(check)}": f.read_bytes() for f in check.rglob("*") if f.is_file()}
    assert "check/smoke/03_flat_ddp.gloo_2ranks.log" in packed
    summary = json.loads((check / "SUMMARY.json").read_text())
    rows = {(r["part"], r["job"]): r for r in summary["rows"]}
    kernels = [r for (part, _), r in rows.items() if part == "kernels"]
    assert len(kernels) == 104 and {r["verdict"] for r in kernels} == {"PASS", "SKIP"}
    assert all(r["verdict"] == "SKIP" and "needs a CUDA GPU" in r["detail"] for r in kernels if "-cuda]" in r["job"])
    assert all("max_error" in r["detail"] for r in kernels if "-cpu]" in r["job"])
    assert [job for part, job in rows if part == "measure"] == ["12 grouped vs loop, bf16"]
    assert rows[("measure", "12 grouped vs loop, bf16")]["verdict"] == "MEASURED"
    assert [m["detail"] for m in summary["measured"]] == ["kernel torch._grouped_mm"] * 4
    smoke = {job: r["verdict"] for (part, job), r in rows.items() if part == "smoke"}
    assert smoke == {f"03_flat_ddp.{s}": "PASS" for s in ("gloo_1rank", "gloo_2ranks")}
    assert "under the device audit" in summary["header"]
    text = (check / "SUMMARY.md").read_text()
    assert "| smoke | 03_flat_ddp.gloo_2ranks | PASS |" in text and "## Measured at 1 rank" in text


def test_gpu_smoke_dry_runs_interleaved_job_is_not_refused(tmp_path):
    """The interleaved job (2 stages x 2 chunks) on a dry run's nano, whose 2 blocks cannot
    make 4 chunks: the check gives that job mini's 4, and 09 takes the line."""
    from conftest import run_inline
    check = load("tools/gpu_check")
    jobs = dict(check.smoke_jobs(["09"], "cpu", "gloo", "nano"))
    argv = jobs["09_pipeline_parallel.interleaved"][1:]
    assert argv[argv.index("--model-size", argv.index("--model-size") + 1) + 1] == "mini"   # the later flag wins

    def first_job(*a, **kw):   # the checks passed: the verification job is about to start
        raise KeyboardInterrupt
    p = run_inline("09_pipeline_parallel.py", *argv, "--out", str(tmp_path), launch=first_job)
    assert p.returncode == 130, p.stderr
    assert run_inline("09_pipeline_parallel.py", "--model-size", "nano", "--stages", "2", "--schedule", "interleaved",
                      "--out", str(tmp_path), launch=first_job).returncode == 2   # without it: refused


def test_14s_smoke_jobs_pass_14s_own_checks_on_a_machine_of_one_gpu(monkeypatch):
    """Each 14 job as the H200 runs it (NCCL, CUDA, its default size), with one GPU: at
    121160e its benchmark's job was refused there ('nccl needs one GPU per rank of a
    replica: 2 ranks, 1 GPU(s)'), lacking --replica-ranks 1."""
    check = load("tools/gpu_check")
    ft = load("14_fault_tolerant_dp")
    monkeypatch.setattr(common, "gpu_count", lambda: 1)
    jobs = [(name, argv) for name, argv in check.smoke_jobs(["14"], "cuda", "nccl", None) if name.startswith("14_")]
    assert [name for name, _ in jobs] == [f"14_fault_tolerant_dp.{s}" for s in ("nccl_1rank", "gloo_2ranks", "bench")]
    for name, argv in jobs:
        args = ft.parser().parse_args(argv[1:])
        ft.check_args(args)   # (raises UsageError where the GPU machine would refuse the job)
        assert args.device == "cuda", name
        assert args.model_size == ("small" if name.endswith("bench") else "mini"), name   # (verified where it can tell)


def test_14s_smoke_jobs_start_first_and_end_inside_the_box_the_budget_leaves(tmp_path):
    """14's runs must end themselves (printing their replicas' logs) before their box kills
    them: they start first, and their --deadline follows the box each one really gets where
    the budget left is shorter than the box (the H200 at 159e69d: 80 s left, deadline 160).
    Its benchmark's job (2 replicas of one NCCL rank) puts its step, its kill -9 to the next
    commit and its heal into the measured table (issue 85: 14's numbers on the device)."""
    import types
    check = load("tools/gpu_check")
    jobs = check.smoke_jobs(["05", "07", "14"], "cpu", "gloo", "nano")
    assert [name for name, _ in jobs[:3]] == ["14_fault_tolerant_dp.gloo_1rank", "14_fault_tolerant_dp.gloo_2ranks",
                                              "14_fault_tolerant_dp.bench"]
    seen, rows = [], []

    class Run:   # what part_smoke needs of a check: 50 s of budget left, each job's command and box noted
        args = types.SimpleNamespace(parts=["smoke"], device="cuda", nccl="nccl", size="nano", box=200.0, jobs=1,
                                     python="python")
        out, lock, measured, read_measured = tmp_path, threading.Lock(), [], check.Check.read_measured

        def left(self):
            return 50.0

        def run(self, cmd, log, box, env=None):
            seen.append((cmd, box))
            if "--bench-replicas" in cmd:   # (the table 14's benchmark writes)
                out = Path(cmd[cmd.index("--out") + 1])
                out.mkdir(parents=True)
                (out / "14_fault_tolerant_dp.json").write_text(json.dumps({"rows": [
                    {"replicas": 2, "ours_step_ms": 68.24, "torch_ddp_step_ms": 73.35, "vs_ddp": 0.93,
                     "kill_to_commit_s": 0.119, "heal_s": 0.1222, "heal_MB": 16.57, "rejoin_to_commit_s": 0.249}]}))
            return 0, 0.0

        def add(self, *row):
            rows.append(row)
    run = Run()
    check.part_smoke(run, ["14"])
    assert len(seen) == 3
    for cmd, box in seen:
        assert box == 50.0 and cmd[cmd.index("--deadline") + 1] == "40"
    bench = next(cmd for cmd, _ in seen if "--bench-replicas" in cmd)
    assert bench[bench.index("--backend") + 1] == "nccl" and "--no-verify" in bench and "--no-bench" not in bench
    assert sorted(r[2] for r in rows) == ["MEASURED", "PASS", "PASS"]
    assert [(m["measurement"], m["ours"], m["torch"]) for m in run.measured] == [
        ("14 step with every replica in (the quorum's cost)", "68.2 ms", "73.3 ms (torch DDP over gloo)"),
        ("14 from a kill -9 to the next committed step", "0.119 s", "(torchft not run)"),
        ("14 the replacement's heal from a live peer", "122 ms", "(torchft not run)")]
    assert "16.6 MB; from its hello to its first committed step 0.249 s" in run.measured[2]["detail"]


def test_05_is_measured_as_it_runs_and_with_every_gradient_copied(tmp_path):
    """The measured table's 05 jobs: as DDPBucketed runs on NCCL (large gradients reduced where
    they lie), then every gradient copied (the copy's cost, side by side); each job its own
    folder and log, each row naming which it was from the results' settings."""
    check = load("tools/gpu_check")
    jobs = check.measure_jobs(["05", "07", "12"], "cuda", "nccl", None)
    assert len({stem for *_, stem in jobs}) == len(jobs) == 4
    ddp = [cmd for _, cmd, _, stem in jobs if stem.startswith("05")]
    assert "--in-place-mb" not in ddp[0] and ddp[1][ddp[1].index("--in-place-mb") + 1] == "1e6"
    rows = [{"method": m, "step_ms": 1.0, "vs_torch_ddp": 1.0, "vs_torch_ddp_min": 1.0, "vs_torch_ddp_max": 1.0,
             "vs_plain": 1.0} for m in ("DDPBucketed 25 MB", "torch DDP 25 MB", "plain (no wrapper)")]
    for in_place, how in ((1.0, "1 MiB and more in place"), (1e6, "every gradient copied"),
                          (None, "every gradient copied")):
        (tmp_path / "05_bucketed_ddp.json").write_text(json.dumps({"rows": rows, "settings": {"in_place_mb": in_place}}))
        assert check.read_05(tmp_path)[0]["measurement"].endswith(how)


def fake_13(tmp_path, code: str) -> tuple:
    """gpu-train's 13 played by a script of ``code``: (the script, the "python" that runs it
    whatever it is given, the --work flags), the model folder there already (the fake needs
    no weights)."""
    fake = tmp_path / "fake13.py"
    fake.write_text(code)
    model = tmp_path / "work" / "model-tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    runner = tmp_path / "python"
    runner.write_text(f"#!/bin/sh\nshift\nexec {sys.executable} {fake} \"$@\"\n")
    runner.chmod(0o755)
    return fake, runner, ["--work", str(tmp_path / "work")]


def test_gpu_train_falls_back_to_recompute_where_compile_runs_out_of_memory(tmp_path):
    """make gpu-train's tries, 13 played by a script: --compile runs out of memory, then
    --compile --recompute writes its tables (--profile's too); the summary lists both tries
    and the tables; the model stays in --work, out of the folder carried back. Where no try
    runs out of memory, it stops at the first (its failure, exit 1)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_train
    fake, runner, work = fake_13(tmp_path, (
        "import sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "if '--recompute' not in sys.argv:\n"
        "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB'); sys.exit(1)\n"
        "out.mkdir(parents=True); (out / '13_train_bench.md').write_text('| the table |')\n"
        "if '--profile' in sys.argv: (out / '13_train_profile.md').write_text('| the profile |')\n"))
    assert gpu_train.main(["--device", "cpu", "--size", "tiny", "--python", str(runner),
                           "--out", str(tmp_path / "out"), *work]) == 0
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert "| compile | 1 |" in summary and "| True |" in summary and "| compile+recompute | 0 |" in summary
    assert "| the table |\n\n| the profile |" in summary
    assert not list((tmp_path / "out").glob("model*"))
    fake.write_text("import sys; print('a bug'); sys.exit(1)\n")
    assert gpu_train.main(["--device", "cpu", "--size", "tiny", "--python", str(runner),
                           "--out", str(tmp_path / "out"), *work]) == 1
    rows = json.loads((tmp_path / "out" / "SUMMARY.json").read_text())["rows"]
    assert [r["try"] for r in rows] == ["compile"] and not rows[0]["out_of_memory"]


def test_gpu_train_on_several_gpus_times_fsdp_over_all_and_tp_inside_dp_after_the_one_gpu_run(tmp_path):
    """Issue 85 asks, where a lease has 2 or more GPUs, for fsdp over them and dp x tp beside
    the one-GPU run: with --ranks 4, 13 is run on fsdp 1 (batch 4), fsdp 4 (16: each data
    rank one GPU's 4) and dp 2 x tp 2 (8), each in its own folder and log, the summary a
    section a mesh; an odd count has no tp 2 pair to make; a mesh with no table fails it."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_train
    _, runner, work = fake_13(tmp_path, (
        "import sys, pathlib, json\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1]); out.mkdir(parents=True)\n"
        "flag = lambda f: sys.argv[sys.argv.index(f) + 1] if f in sys.argv else None\n"
        "got = {f: flag(f) for f in ('--fsdp', '--dp', '--tp', '--batch-size')}\n"
        "if got['--fsdp'] == '3': sys.exit(1)\n"
        "(out / '13_train_bench.md').write_text(f'| {json.dumps(got)} |')\n"))
    assert gpu_train.main(["--device", "cpu", "--size", "tiny", "--python", str(runner), "--ranks", "4",
                           "--out", str(tmp_path / "out"), *work]) == 0
    rows = json.loads((tmp_path / "out" / "SUMMARY.json").read_text())["rows"]
    assert [(r["mesh"], r["folder"], r["exit"]) for r in rows] == [
        ("fsdp 1", "compile", 0), ("fsdp 4", "fsdp4-compile", 0), ("dp 2 x tp 2", "dp2xtp2-compile", 0)]
    summary = (tmp_path / "out" / "SUMMARY.md").read_text()
    for mesh, flags in (("fsdp 1", {"--fsdp": "1", "--dp": None, "--tp": None, "--batch-size": "4"}),
                        ("fsdp 4", {"--fsdp": "4", "--dp": None, "--tp": None, "--batch-size": "16"}),
                        ("dp 2 x tp 2", {"--fsdp": "1", "--dp": "2", "--tp": "2", "--batch-size": "8"})):
        assert f"## {mesh}\n\n| {json.dumps(flags)} |" in summary, summary
    assert (tmp_path / "out" / "fsdp4-compile.log").exists()
    assert gpu_train.main(["--device", "cpu", "--size", "tiny", "--python", str(runner), "--ranks", "3",
                           "--out", str(tmp_path / "odd"), *work]) == 1   # (fsdp 3's try fails)
    rows = json.loads((tmp_path / "odd" / "SUMMARY.json").read_text())["rows"]
    assert [(r["mesh"], r["exit"]) for r in rows] == [("fsdp 1", 0), ("fsdp 3", 1)]


def test_the_lease_archive_is_whole_when_the_packer_is_killed_and_names_what_it_left_out(tmp_path):
    """--archive (make gpu-check's CHECK_ARCHIVE, gpu-train's TRAIN_ARCHIVE): a lease's call
    cut by the device time left is killed where no timeout of its own sees it, and only files
    under $OUT come back. A process packing a folder that grows, killed with SIGKILL, leaves
    an archive that opens whole and holds what it had packed; a pack over the limit leaves
    the largest files out and names them."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    folder, archive = tmp_path / "check", tmp_path / "out" / "check.tgz"
    (tmp_path / "out").mkdir()
    code = ("import sys, time, pathlib; sys.path.insert(0, sys.argv[3]); import gpu_check\n"
            "folder = pathlib.Path(sys.argv[1]); folder.mkdir()\n"
            "with gpu_check.packed(folder, sys.argv[2], every=0.02):\n"
            "    for i in range(100000):\n"
            "        (folder / f'row{i % 50}.log').write_text('x' * (i * 37 % 5000))\n"
            "        with open(folder / 'growing.log', 'a') as f: f.write(f'line {i}\\n')\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(folder), str(archive), str(ROOT / "tools")])
    deadline = time.time() + 60
    while not archive.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)   # (several packs, and files written and rewritten the while)
    p.kill()
    p.wait()
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        grown = tar.extractfile("check/growing.log").read().decode()
    whole = grown.split("\n")[:-1]   # (the last line may be half written when the file was read)
    assert "check/row0.log" in names and len(whole) > 1 and whole == [f"line {i}" for i in range(len(whole))]
    big = folder / "trace.json.gz"
    big.write_bytes(os.urandom(300_000))   # (does not compress)
    left = gpu_check.pack(folder, archive, limit=100_000)
    assert left == [("check/trace.json.gz", 300_000)]
    with tarfile.open(archive) as tar:
        assert "check/trace.json.gz" not in tar.getnames() and "check/row0.log" in tar.getnames()
        assert "check/trace.json.gz (300,000 bytes): left out" in tar.extractfile("check/LEFT_OUT.txt").read().decode()


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:   # gone meanwhile
        return b""


def test_gpu_train_ended_by_sigterm_ends_its_try_and_packs_its_log(tmp_path):
    """timeout(1) ending make gpu-train: the try (its own process group) is ended with it,
    the summary lists it as ended by a signal, and the archive is packed a last time with
    the try's log as far as it got."""
    fake, runner, work = fake_13(tmp_path, "import time; print('compiling', flush=True); time.sleep(120)\n")
    out, archive = tmp_path / "train", tmp_path / "train.tgz"
    p = subprocess.Popen([sys.executable, str(ROOT / "tools" / "gpu_train.py"), "--device", "cpu", "--size", "tiny",
                          "--python", str(runner), *work, "--out", str(out), "--archive", str(archive)],
                         stdout=subprocess.PIPE, text=True)
    log = out / "compile.log"
    deadline = time.time() + 60
    while not (log.exists() and "compiling" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=30)
    assert p.returncode == 130 and "ended by a signal" in stdout, stdout
    assert not [pid for pid in os.listdir("/proc") if str(fake).encode() in _cmdline(pid)]   # the try is gone with it
    with tarfile.open(archive) as tar:
        assert "compiling" in tar.extractfile("train/compile.log").read().decode()
        assert "| compile | ended by a signal |" in tar.extractfile("train/SUMMARY.md").read().decode()


def test_sigterm_interrupts_once_so_a_second_one_does_not_cut_the_cleanup():
    """timeout(1) signals make's process group and make passes SIGTERM on: gpu-check and
    gpu-train get it twice. The first interrupts (as Ctrl-C); the second, arriving while
    their jobs are ended and the archive packed, is ignored; the handler is put back."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with gpu_check.sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # (interrupted at once)
    cut = False
    try:
        with gpu_check.sigterm_interrupts():
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            os.kill(os.getpid(), signal.SIGTERM)   # the cleanup's: ignored
            time.sleep(0.05)
    except KeyboardInterrupt:
        cut = True
    assert not cut, "a second SIGTERM cut the cleanup short"
    assert signal.getsignal(signal.SIGTERM) is before


def test_mfu_counts_what_docs_13_says_against_the_dtypes_peak(monkeypatch):
    """13's training FLOPs a token: 6 a weight a matrix multiply uses (not the input
    embedding; a tied head once) and 12 L T d; the peak for bf16 autocast is the device's
    bf16 dense figure, float32's without TF32."""
    import torch
    import transformers
    train, nd = load("13_train"), load("10_nd_parallel")
    for tied in (False, True):
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                          tie_word_embeddings=tied)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        n = sum(p.numel() for p in model.parameters())
        want = 6 * (n - (0 if tied else 100 * 64)) + 12 * 3 * 256 * 64
        assert train.train_flops_per_token(model, 256) == want
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert nd.peak_flops(torch.device("cuda"), dtype="bf16") == 989e12
    assert nd.peak_flops(torch.device("cuda")) == 67e12
    assert nd.peak_flops(torch.device("cpu"), dtype="bf16") is None
