import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def load(script: str):
    """Import a digit-named script (e.g. '05_bucketed_ddp') as a module."""
    return common.load_script(ROOT / f"{script}.py")


def verify_args(world_size, **kw):
    ns = dict(world_size=world_size, backend="gloo", device="cpu", seed=0, data="random",
              data_root=str(ROOT / "data"), verify_steps=4, timeout=60.0)
    ns.update(kw)
    return argparse.Namespace(**ns)


def run_script(*argv, timeout=240, env=None):
    """Run a command line with the venv's python; returns CompletedProcess."""
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_inline(script: str, *argv, launch=None):
    """Run a numbered script's command line in this process, main() under run_main as
    ``python SCRIPT ARGV`` runs it: returns a CompletedProcess (exit status, stdout,
    stderr). No interpreter starts and imports torch again, and the workers fork from the
    server this test process already runs. ``launch`` replaces common.launch."""
    mod = load(Path(script).stem)
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved, sys.argv = sys.argv, [script, *argv]
    real, common.launch = common.launch, launch or common.launch
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                common.run_main(lambda: mod.main(list(argv)))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv, common.launch = saved, real
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(), err.getvalue())


def _no_job(*args, **kwargs):
    raise AssertionError("a job started")


def refused(script: str, *argv) -> str:
    """Run a script's command line with bad input: it must exit 2 with one line on stderr
    and run nothing (no job, no output). Returns that line."""
    p = run_inline(script, *argv, launch=_no_job)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and p.stdout == "", p.stderr + p.stdout
    return lines[0]


def spawned_workers():
    """PIDs of multiprocessing/torchrun workers still alive on this machine."""
    out = subprocess.run(["pgrep", "-f", "multiprocessing.spawn|torch.distributed.run"],
                         capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if int(p) != os.getpid()]


@pytest.fixture
def one_rank():
    """A one-rank gloo group in the test process, for checks that need no peers."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True, scope="session")
def no_workers_left_behind():
    yield
    import time
    deadline = time.time() + 10
    while spawned_workers() and time.time() < deadline:
        time.sleep(0.2)
    assert not spawned_workers(), f"worker processes left running: {spawned_workers()}"


_verify_cache = {}


def verification(script: str, world_size: int, **kw):
    """Every VERIFY_CASES result of a script's verify() at one world size (one job, cached)."""
    key = (script, world_size, tuple(sorted(kw.items())))
    if key not in _verify_cache:
        mod = load(script)
        _verify_cache[key] = common.launch(mod.verify, verify_args(world_size, **kw))
    return _verify_cache[key]


def check_equivalence(script: str, world_size: int, case: str):
    """The weights a script's wrapper trained equal single-process training's."""
    r = verification(script, world_size)[case]
    assert r["ok"], f"{case} at {world_size} ranks: max diff {r['max_diff']}"
    if world_size == 1 and "accum" not in common.VERIFY_CASES.get(case, {}):
        # same arithmetic as single-process training (micro-batches change the sum order)
        assert r["bitwise"], "one rank must reproduce single-process training bit for bit"


def write_fake_mnist(root: Path, n=64, seed=0):
    """A tiny dataset in MNIST's own idx file format, where torchvision looks for it."""
    import struct
    import torch
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix, count in (("train", n), ("t10k", n // 2)):
        images = torch.randint(0, 256, (count, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (count,), generator=g, dtype=torch.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + images.numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.numpy().tobytes())
    return root
