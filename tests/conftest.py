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

# A rank of one (or this process) computes with every core's thread, and OpenMP's idle
# threads spin between its ops: on a machine the tests fill with ranks that is CPU taken from
# them (a fifth of the GPU dry run's). Idle threads sleep instead; read when torch loads
# OpenMP (below), and inherited by every process a test starts. Results do not change.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The kit's modules compiled once, not in every process: a spawned rank imports common, the
# scripts and these tests' modules again, and without their bytecode cached (an environment
# with PYTHONDONTWRITEBYTECODE set) compiles each from source, a tenth of a second of CPU a
# rank, most of what its imports cost. This process writes each one's .pyc beside it (in
# __pycache__, which git ignores) as it imports it; the ranks, the fork servers and the
# scripts a test starts read them (and write those this process did not import).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# What the kit writes to the temp folder on purpose (a failed job's traceback log, a run's
# results that could not be saved where asked) goes, for the tests that cause it, to a folder
# of this process's own, which goes when it ends: the suite leaves nothing in /tmp. pytest's
# own folders (tmp_path) stay where they were, so a failed test's files can still be read, and
# so does torch.compile's cache (test_compiled's kernels: compiling them again costs a minute).
import atexit  # noqa: E402
import getpass  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
try:
    _user = getpass.getuser()
except (KeyError, OSError):
    _user = f"uid_{os.getuid()}"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{_user}"))
SESSION_TMP = tempfile.mkdtemp(prefix="kit-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP
_owner = os.getpid()   # (a process forked from this one runs its exit handlers too)
atexit.register(lambda: os.getpid() == _owner and shutil.rmtree(SESSION_TMP, ignore_errors=True))

import time  # noqa: E402

_began = time.perf_counter()
import common  # noqa: E402   (frozen as it imports: the collector's full passes skip torch and the kit)
import diagnostics  # noqa: E402
# How much slower than the machine the suite's few time bounds were set on (2 cores, where
# importing common, torch with it, took about 1.5 s) this one is now: a bound on how fast
# something reacts, measured from the event, allows that many times its seconds (at least
# 1; a machine half as fast, or one whose cores something else keeps busy, gets twice)
IMPORT_S = time.perf_counter() - _began
SLOWER = max(1.0, IMPORT_S / 1.5)


def seconds(s: float) -> float:
    """``s`` seconds on the machine the bounds were set on, on this one (SLOWER)."""
    return s * SLOWER


def pytest_report_header(config):
    return f"time bounds x {SLOWER:.2f} (conftest.SLOWER: importing common took {IMPORT_S:.2f} s, 1.5 where set)"

# Every rank a test spawns forks from one forkserver a pytest worker starts at its first
# launch. Beside torch (common's list), it imports transformers' two models once, so the 22
# ranks of the transformers tests do not import them each (2.4 s of CPU a rank); the
# forkserver skips a module it cannot import (and, on Python 3.11, sees only site-packages).
import multiprocessing  # noqa: E402
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo",
                                        "transformers.models.llama.modeling_llama",
                                        "transformers.models.qwen3_moe.modeling_qwen3_moe"])


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


def run_inline(script: str, *argv, launch=None, audit=True):
    """Run a numbered script's command line in this process, main() under run_main as
    ``python SCRIPT ARGV`` runs it: returns a CompletedProcess (exit status, stdout,
    stderr). No interpreter starts and imports torch again, and the workers fork from the
    server this test process already runs. ``launch`` replaces common.launch. Its jobs run
    under the device audit (diagnostics.DeviceAudit: a GPU's device rules on the CPU), so
    every script's command lines the tests run are also the GPU path's smoke jobs."""
    mod = load(Path(script).stem)
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved, sys.argv = sys.argv, [script, *argv]
    real, common.launch = common.launch, launch or common.launch
    audited = os.environ.get(diagnostics.AUDIT_ENV)
    os.environ[diagnostics.AUDIT_ENV] = "1" if audit else "0"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                common.run_main(lambda: mod.main(list(argv)))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv, common.launch = saved, real
        if audited is None:
            os.environ.pop(diagnostics.AUDIT_ENV, None)
        else:
            os.environ[diagnostics.AUDIT_ENV] = audited
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


# Every process this test session starts inherits this tag (spawned ranks, torchrun's
# agent and workers, and any orphan of theirs), so a session finds its own leftovers only,
# not those of a session beside it (two suites at once, or pytest-xdist's workers gw0 and gw1,
# each its own session). A process started by a session keeps its tag.
# Every job the tests launch compares each collective across its ranks before it runs
# (--check-collectives): a rank calling another op, shape or group fails the test at once
os.environ.setdefault(diagnostics.CHECK_ENV, "1")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if "KIT_TEST_SESSION" not in os.environ or os.environ.get("KIT_TEST_WORKER") != _WORKER:
    os.environ["KIT_TEST_SESSION"], os.environ["KIT_TEST_WORKER"] = str(os.getpid()), _WORKER
SESSION_TAG = f"KIT_TEST_SESSION={os.environ['KIT_TEST_SESSION']}".encode()


def spawned_workers():
    """PIDs of this session's ranks (forkserver or spawn children, torchrun agents and
    workers) still alive, zombies aside."""
    out = subprocess.run(["pgrep", "-f", "multiprocessing.spawn|multiprocessing.forkserver|torch.distributed.run"],
                         capture_output=True, text=True).stdout.split()
    mine = []
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                tagged = SESSION_TAG in f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:   # gone meanwhile, or not ours to read
            continue
        # this process's own forkserver (its child) serves every launch of the session; the
        # ranks it forks are its children, and an orphaned rank is init's
        if tagged and state != "Z" and int(ppid) != os.getpid() and pid != os.getpid():
            mine.append(pid)
    return mine


def workers_left(wait=10.0):
    """spawned_workers() once they are gone or ``wait`` seconds have passed (a launcher's
    forkserver ends a moment after the launcher)."""
    import time
    deadline = time.time() + wait
    while spawned_workers() and time.time() < deadline:
        time.sleep(0.2)
    return spawned_workers()


def process_tree(pid: int) -> list:
    """``pid`` and every process descended from it (a spawned job: the launcher, its fork
    server, the ranks)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def listening_sockets(pids) -> set:
    """(address, port) of every TCP socket the processes ``pids`` listen on, read from
    /proc/net/tcp and tcp6 (state 0A) against the socket inodes of their open files."""
    import ipaddress
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
        except OSError:   # gone meanwhile
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:
                    continue
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                # the kernel writes each 32-bit word in the host's (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    import ipaddress
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


# the files whose tests take longest start first (make test keeps this order: xdist's
# --no-loadscope-reorder): with two workers, neither is left running one of them alone at the
# end. The stall jobs and 14's replicas mostly wait: the other worker computes beside them
# (14 after two computing files, so that it is not beside the stall jobs with both waiting:
# a fresh clone took 611 s with it second, 609 s with it fourth, within the machine's noise)
FIRST = ("test_stalls.py", "test_compiled.py", "test_10_nd_parallel.py", "test_14_fault_tolerant_dp.py", "test_13_train.py",
         "test_gpu.py", "test_09_pipeline.py",
         "test_07_fsdp.py", "test_05_bucketed.py", "test_06_sharded.py", "test_02_naive.py", "test_08_tensor_parallel.py",
         "test_hf_models.py", "test_12_expert_parallel.py", "test_11_context_parallel.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


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
    assert not workers_left(), f"worker processes left running: {spawned_workers()}"


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
