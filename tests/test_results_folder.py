"""Where results go, as root (as CI, containers and many GPU machines run): a results folder
the file system will not take is refused before any worker starts, whatever the permission
bits say (root passes them all), and a save that fails once the benchmark has run loses
nothing: the tables stay printed, the files go elsewhere, one line says where, and the exit
status says it failed. For a DDP script (02), 10 and the GPU check."""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import common
from conftest import ROOT, refused, run_inline

SCRIPTS = ("02_naive_ddp.py", "10_nd_parallel.py", "gpu_check")


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_gpu_check(*argv, run=None):
    """tools/gpu_check.py's main in this process: (exit status, stdout, stderr). ``run``
    wraps Check.run (each job)."""
    mod, out, err = gpu_check(), io.StringIO(), io.StringIO()
    if run:
        real = mod.Check.run
        mod.Check.run = lambda self, *a, **kw: run(real(self, *a, **kw))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mod.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def refusal(script, out) -> str:
    """The one line a script's command line with ``--out out`` is refused with (exit 2,
    nothing run; the GPU check: no job, no summary)."""
    if script == "gpu_check":
        code, stdout, stderr = run_gpu_check("--out", str(out))
        assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
        return stderr.strip()
    return refused(script, "--out", str(out))


@contextlib.contextmanager
def tmpfs(path: Path, size="256k"):
    """A tmpfs of ``size`` mounted at ``path`` (skipped where this machine cannot mount one:
    root with CAP_SYS_ADMIN is needed)."""
    path.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}): needs root with CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def read_only(path: Path):
    """Remount ``path`` read-only. A file still open for writing there makes the kernel
    refuse (EBUSY: a job's log, held a moment longer by a rank's fork server as it exits):
    try again for up to 10 s."""
    for _ in range(100):
        if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def fill(path: Path):
    """Write to the tmpfs at ``path`` until it is full."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_folder_the_file_system_refuses_is_refused_before_anything_runs(tmp_path, script):
    """/proc takes no new folder even from root; a file in the path; /proc itself."""
    assert "--out /proc/nope cannot be made (/proc refused: No such file or directory)" in refusal(script, "/proc/nope")
    (tmp_path / "a_file").write_text("x")
    assert f"({tmp_path / 'a_file'} is a file, not a folder)" in refusal(script, tmp_path / "a_file" / "sub")
    assert "cannot be written to (/proc refused" in refusal(script, "/proc")
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]   # no probe left


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_read_only_or_full_file_system_is_refused_naming_why(tmp_path, script):
    with tmpfs(tmp_path / "ro") as ro, tmpfs(tmp_path / "full", "64k") as full:
        read_only(ro)
        assert f"cannot be made ({ro} is on a read-only file system)" in refusal(script, ro / "out")
        assert f"cannot be written to ({ro} is on a read-only file system)" in refusal(script, ro)
        (full / "out").mkdir()
        fill(full)
        assert f"cannot be written to (the disk holding {full / 'out'} is full)" in refusal(script, full / "out")
        assert f"cannot be made (the disk holding {full} is full)" in refusal(script, full / "new")
        assert sorted(p.name for p in full.iterdir()) == ["filler", "out"] and not list((full / "out").iterdir())


def test_checkpoint_dir_and_data_root_are_asked_of_the_file_system_too():
    assert "--checkpoint-dir /proc/ck cannot be made (/proc refused" in refused(
        "07_fsdp.py", "--train", "2", "--checkpoint-dir", "/proc/ck")
    line = refused("02_naive_ddp.py", "--data", "mnist", "--download", "--data-root", "/proc/data")
    assert line.endswith("--data-root /proc/data: /proc/data/MNIST/raw cannot be made (/proc refused: "
                         "No such file or directory): choose another folder"), line


def lost(stderr: str, prog: str) -> tuple[list, Path]:
    """The closing line of a run that could not save everything: (the files it names, the
    folder they went to)."""
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: could not save ") and line.endswith(" instead"), stderr
    names, _, rest = line[len(f"{prog}: error: could not save "):].partition(" in ")
    return names.split(", "), Path(rest.rsplit("saved in ", 1)[1][:-len(" instead")])


@pytest.mark.parametrize("script, argv", [
    ("02_naive_ddp.py", ["--no-verify", "--model-size", "nano", "--steps", "2", "--warmup", "1"]),
    ("10_nd_parallel.py", ["--no-verify", "--dp", "2", "--model-size", "nano", "--steps", "2", "--warmup", "1"]),
])
def test_a_save_that_fails_after_the_benchmark_loses_nothing(tmp_path, script, argv):
    """The results folder, on a tmpfs, turns read-only once the benchmark's job has
    returned: the table is printed all the same, the files go to a folder of the run's own,
    one line names them and where they went, and the exit status is 1."""
    with tmpfs(tmp_path / "disk") as disk:
        def launch(*a, **kw):
            got = real(*a, **kw)
            read_only(disk)
            return got
        real = common.launch
        p = run_inline(script, *argv, "--out", str(disk / "out"), launch=launch)
        assert not (disk / "out").exists()
    assert p.returncode == 1, p.stderr
    assert "\n| " in p.stdout and "could not write" in p.stdout and "wrote " not in p.stdout   # the table, and no lie
    names, went = lost(p.stderr, script)
    try:
        stem = Path(script).stem
        assert f"{stem}.json" in names and f"{stem}.md" in names
        assert json.loads((went / f"{stem}.json").read_text())["rows"]
        assert f"in {disk / 'out'} ({disk / 'out'} is on a read-only file system)" in p.stderr
    finally:
        shutil.rmtree(went)


def test_a_folder_in_the_way_of_one_file_sends_that_file_only_elsewhere(tmp_path):
    """No mount needed: a folder with the results file's name. The other file is written
    where asked."""
    (tmp_path / "02_naive_ddp.json").mkdir()
    p = run_inline("02_naive_ddp.py", "--no-verify", "--model-size", "nano", "--steps", "2", "--warmup", "1",
                   "--out", str(tmp_path))
    assert p.returncode == 1 and (tmp_path / "02_naive_ddp.md").is_file()
    names, went = lost(p.stderr, "02_naive_ddp.py")
    try:
        assert names == ["02_naive_ddp.json"] and "a folder in" in p.stderr and "has the file's name" in p.stderr
        assert json.loads((went / "02_naive_ddp.json").read_text())["rows"]
    finally:
        shutil.rmtree(went)


def test_the_gpu_checks_summary_survives_its_folder_turning_read_only(tmp_path):
    """The GPU check's dry run of 03's two smoke jobs (cut by a 1 s box); after the first
    the folder turns read-only: the summary printed holds both rows, SUMMARY.json (gone
    elsewhere, with the second job's log) too, and the closing line says where."""
    with tmpfs(tmp_path / "disk") as disk:
        done = []

        def run(result):
            done.append(result)
            if len(done) == 1:
                read_only(disk)
            return result
        code, out, err = run_gpu_check("--parts", "smoke", "--scripts", "03", "--box", "1", "--jobs", "1",
                                       "--device", "cpu", "--nccl", "gloo", "--size", "nano",
                                       "--out", str(disk / "check"), run=run)
    assert code == 1 and len(done) == 2
    assert out.count("| smoke | 03_flat_ddp.") == 2
    names, went = lost(err, "gpu_check.py")
    try:
        assert sorted(names) == ["03_flat_ddp.gloo_2ranks.log", "SUMMARY.json", "SUMMARY.md"]   # the 2nd job's log too
        assert len(json.loads((went / "SUMMARY.json").read_text())["rows"]) == 2
        assert (went / "03_flat_ddp.gloo_2ranks.log").exists()
    finally:
        shutil.rmtree(went)
