"""The GPU plan's Makefile targets, run dry on the CPU (GPU_DEV=cpu, gloo in place of NCCL)."""
import subprocess
import sys

from conftest import ROOT


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
