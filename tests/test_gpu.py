"""What a one-GPU machine gets, checked on the CPU: no job starts more NCCL ranks than there
are GPUs, and the GPU plan's Makefile targets, run dry (GPU_DEV=cpu, gloo in place of NCCL)."""
import argparse
import subprocess
import sys

import pytest

import common
from conftest import ROOT, load


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
    assert "| 03_flat_ddp | gloo_1rank | 0 |" in summary and "| 03_flat_ddp | gloo_2ranks | 0 |" in summary
    for setting, ranks in (("gloo_1rank", 1), ("gloo_2ranks", 2)):
        log = (smoke / f"03_flat_ddp.{setting}.log").read_text()
        assert f"verify 03_flat_ddp at {ranks} rank(s): PASS" in log   # verification, then a few timed steps
        assert (smoke / f"03_flat_ddp.{setting}" / "03_flat_ddp.json").exists()


def test_gpu_smoke_fails_when_a_job_fails_and_says_which(tmp_path):
    p = make("gpu-smoke", "SMOKE=03", "SMOKE_BOX=1", f"GPU_OUT={tmp_path}")   # killed by its time box
    assert p.returncode != 0
    summary = (tmp_path / "smoke" / "SUMMARY.md").read_text()
    assert "| 03_flat_ddp | gloo_1rank | 124 |" in summary and "| 03_flat_ddp | gloo_2ranks | 124 |" in summary


def test_gpu_smoke_dry_runs_interleaved_job_is_not_refused(tmp_path):
    """The interleaved job (2 stages x 2 chunks) on a dry run's nano, whose 2 blocks cannot
    make 4 chunks: the Makefile gives that job mini's 4, and 09 takes the line."""
    from conftest import run_inline
    p = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "show-%: ; @echo $($*)", "show-SMOKE_4_BLOCKS",
                        "GPU_SIZE=nano"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    extra = p.stdout.split()
    assert extra == ["--model-size", "mini"], p.stdout + p.stderr
    def first_job(*a, **kw):   # the checks passed: the verification job is about to start
        raise KeyboardInterrupt
    p = run_inline("09_pipeline_parallel.py", "--backend", "gloo", "--device", "cpu", "--model-size", "nano",
                   "--warmup", "1", "--steps", "2", "--stages", "2", "--microbatches", "2", "--schedule",
                   "interleaved", *extra, "--out", str(tmp_path), launch=first_job)
    assert p.returncode == 130, p.stderr
    assert run_inline("09_pipeline_parallel.py", "--model-size", "nano", "--stages", "2", "--schedule", "interleaved",
                      "--out", str(tmp_path), launch=first_job).returncode == 2   # without it: refused
