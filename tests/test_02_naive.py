import json
import os
import time
from pathlib import Path

import pytest
import torch

import common
from conftest import (check_equivalence, ROOT, refused, run_inline, run_script, seconds, spawned_workers, workers_left,
                      verify_args, write_fake_mnist)

CASES = list(common.VERIFY_CASES)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_naive_ddp_matches_single_process(world_size, case):
    check_equivalence("02_naive_ddp", world_size, case)


def test_a_wrapper_that_does_not_average_fails_verification():
    import workers
    res = common.launch(workers.verify_broken, verify_args(2))
    assert not res["plain"]["ok"] and res["plain"]["max_diff"] > 1e-4


def test_mnist_path_on_a_tiny_dataset_in_mnist_format(tmp_path):
    write_fake_mnist(tmp_path)
    x, y = common.load_mnist(str(tmp_path), download=False)
    assert x.shape == (64, 784) and 0 <= x.min() and x.max() <= 1 and y.max() < 10
    p = run_inline("02_naive_ddp.py", "--world-size", "2", "--data", "mnist", "--data-root", str(tmp_path),
                   "--no-bench", "--verify-steps", "2")
    assert p.returncode == 0, p.stderr
    assert "verify 02_naive_ddp at 2 rank(s): PASS" in p.stdout


def test_mnist_reads_gzipped_files_and_downloads_what_is_missing(tmp_path, monkeypatch):
    """The idx reader on gzipped files gives the plain files' values; --download fetches the
    .gz files from the first mirror whose copy has the right checksum."""
    import gzip
    import hashlib
    import io as io_
    import urllib.request
    write_fake_mnist(tmp_path / "plain")
    raw = tmp_path / "plain" / "MNIST" / "raw"
    want_x, want_y = common.load_mnist(str(tmp_path / "plain"), download=False)
    assert torch.equal(want_y, torch.tensor(list((raw / "train-labels-idx1-ubyte").read_bytes()[8:])))
    blobs = {name: gzip.compress((raw / name).read_bytes()) for name in common.MNIST_FILES}
    asked = []

    def urlopen(url, timeout):
        asked.append(url)
        mirror, name = url.rsplit("/", 1)
        if mirror + "/" == common.MNIST_MIRRORS[0]:
            raise OSError("unreachable")
        return io_.BytesIO(blobs[name[:-3]])
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(common.UsageError, match="wrong checksum"):   # the real MD5s: not these bytes
        common.load_mnist(str(tmp_path / "fetched"), download=True)
    monkeypatch.setattr(common, "MNIST_FILES", {n: hashlib.md5(b).hexdigest() for n, b in blobs.items()})
    x, y = common.load_mnist(str(tmp_path / "fetched"), download=True)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert sorted(p.name for p in (tmp_path / "fetched" / "MNIST" / "raw").iterdir()) == \
        ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]
    assert asked[-1].startswith(common.MNIST_MIRRORS[1]) and asked[-2].startswith(common.MNIST_MIRRORS[0])


def test_missing_mnist_says_how_to_get_it(tmp_path):
    p = run_script("02_naive_ddp.py", "--data", "mnist", "--data-root", str(tmp_path / "nothing"))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "--download" in p.stderr


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "0"], "argument --world-size: must be at least 1"),
    (["--backend", "nccl", "--world-size", "2"], "nccl needs one GPU per rank"),
    (["--world-size", "2", "--batch-size", "3"], "does not divide"),
    (["--model-size", "huge"], "unknown --model-size"),
])
def test_bad_input_exits_2_with_one_line_and_spawns_nothing(argv, words):
    assert words in refused("02_naive_ddp.py", *argv)


def test_failing_rank_ends_the_job_quickly_and_leaves_nothing(tmp_path, scratch):
    p = run_script(str(ROOT / "tests" / "workers.py"), str(tmp_path), timeout=120, env={"TMPDIR": str(scratch)})
    assert time.time() - float((tmp_path / "failed_at").read_text()) < seconds(20)   # from the failure to the end
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()   # the first failure first, its exception's last line
    assert lines[0].endswith("error: rank 1 failed first: ValueError: boom from the test"), p.stderr
    assert len(lines) <= 3 and "Traceback" not in p.stderr   # the tracebacks go to a file it names
    log = lines[-1].split("every failed rank's traceback: ")[1]
    assert "raise ValueError(\"boom from the test\")" in open(log).read()
    # in the temp folder only that log (and torch's compile cache): no result file, no rank's
    # traceback (ours or torch's launcher's, which never removes its own)
    assert [f.name for f in scratch.iterdir() if f.name != "torchinductor_root"] == [Path(log).name]
    os.unlink(log)
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_crashes_in_c_code_is_named_at_its_python_line(tmp_path):
    """A rank killed by a fatal signal (here SIGSEGV: a crash in C++, CUDA or NCCL code) is
    named with the Python line it crashed at, and the failure log holds every thread's
    stack then (faulthandler, which the rank writes to a file launch() reads and removes)."""
    import tempfile
    import workers
    with pytest.raises(common.LaunchError) as e:
        common.launch(workers.crash_rank, verify_args(2, timeout=20.0))
    lines = str(e.value).splitlines()
    assert lines[0].startswith("rank 1 died (signal 11) at workers.py:") and \
        lines[0].endswith(" in _write_to_address_zero"), lines
    log = lines[-1].split("every failed rank's traceback: ")[1]
    text = open(log).read()
    os.unlink(log)
    assert "Fatal Python error: Segmentation fault" in text and "in crash_rank" in text, text
    assert not list(Path(tempfile.gettempdir()).glob("ddp_result_*")), "a rank's file was left"


@pytest.fixture
def scratch():
    """The launcher's TMPDIR, a short path: the forkserver's socket goes in a folder there,
    and a Unix socket's path has at most 107 bytes (pytest's own tmp_path, pytest-NNN and the
    test's name, leaves too few once the session count reaches three digits)."""
    import shutil
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="t02-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_workers_end_when_the_launcher_is_killed(tmp_path, scratch):
    # (scratch holds the job's result file, which a killed launcher cannot remove)
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers.py"), str(tmp_path), "sleep_forever"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.time() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    assert set(pids) <= set(spawned_workers())   # the leftover check sees live ranks of this session
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the workers must notice by themselves
    proc.wait()
    deadline = time.time() + 15
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_a_terminated_launcher_ends_its_workers_and_leaves_no_files(tmp_path, scratch):
    """SIGTERM (a timeout, a scheduler's kill) ends the job as Ctrl-C does: the ranks are
    ended at once and the job's result file is removed."""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers.py"), str(tmp_path), "sleep_forever"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.time() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and list(scratch.glob("ddp_result_*"))   # the job's file, while it runs
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().endswith("workers.py: terminated"), err
    assert not any(_alive(p) for p in pids)   # ended by the launcher before it returned
    assert not list(scratch.glob("ddp_result_*"))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # an exited child not yet reaped by init is a zombie
        return f.read().split()[2] != "Z"


def test_runs_under_torchrun(tmp_path):
    p = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "02_naive_ddp.py", "--model-size", "nano", "--steps", "2", "--warmup", "1",
                   "--verify-steps", "2", "--out", str(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("verify 02_naive_ddp at 2 rank(s): PASS") == 1  # printed by rank 0 only
    doc = json.loads((tmp_path / "02_naive_ddp.json").read_text())
    assert doc["settings"]["world_size"] == 2 and doc["rows"][0]["step_ms"] > 0
    assert not workers_left()


def test_benchmark_row_accounts_for_communication(tmp_path):
    p = run_inline("02_naive_ddp.py", "--world-size", "2", "--model-size", "nano", "--steps", "3",
                   "--warmup", "1", "--no-verify", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    row = json.loads((tmp_path / "02_naive_ddp.json").read_text())["rows"][0]
    assert 0 < row["comm_ms"] < row["step_ms"] and 0 < row["comm_share"] < 1
    n_tensors = len(list(common.build_lm("nano", 128, "cpu").parameters()))
    assert row["collectives"] == n_tensors + 1  # one per parameter, plus the has-gradient flags


@pytest.mark.parametrize("n_gpus, expect", [
    (0, (2, "gloo", "cpu", "mini", 4)),
    (1, (2, "gloo", "cpu", "mini", 4)),     # one GPU: NCCL cannot run 2 ranks on it
    (2, (2, "nccl", "cuda", "xl", 4)),      # the course's standard setting
    (8, (8, "nccl", "cuda", "xl", 8)),      # batch 4 would not split over 8 GPUs
    (3, (3, "nccl", "cuda", "xl", 6)),
])
def test_defaults_follow_the_machine(monkeypatch, n_gpus, expect):
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: n_gpus > 0)
    monkeypatch.setattr(common.torch.cuda, "device_count", lambda: n_gpus)
    for var in common.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    a = common.parse(common.script_parser("doc"), [])
    assert (a.world_size, a.backend, a.device, a.model_size, a.batch_size) == expect
