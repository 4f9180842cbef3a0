"""A stuck rank named in seconds, not waited out: the flight recorder every job runs under
(diagnostics.FlightRecorder), the stall report (diagnose, StallWatch) and --check-collectives, on
spawned ranks and under torchrun. Each scenario is tests/stall_job.py, whose rank 1
misbehaves at its fourth all_reduce; the jobs run side by side, each asserted on alone."""
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import common
import diagnostics
from conftest import ROOT, is_loopback, listening_sockets, process_tree, workers_left

STALL, TIMEOUT, BUSY = 3.0, 15.0, 40.0
# (mode, extra flags): the stall report names rank 1 within the window; the job fails at --timeout
# (the mismatches at once, refused by --check-collectives); "busy" computes 40 s and completes
SCENARIOS = {"stop": [], "loop": [], "ddp_stop": [], "skip": ["--check-collectives"], "op": ["--check-collectives"],
             "shape": ["--check-collectives"], "group": ["--check-collectives"], "busy": ["--stall-report", "5", "--timeout", "60", "--busy", str(BUSY)]}
LAUNCHES = ("spawned", "torchrun")
_jobs = {}


def _run(mode, how, folder):
    """One scenario's job: exit status, stdout lines with the second each arrived, stderr,
    and when rank 1 misbehaved."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                              if how == "torchrun" else [])
    cmd += [str(ROOT / "tests" / "stall_job.py"), mode, str(folder), "--stall-report", str(STALL), "--timeout",
            str(TIMEOUT), *SCENARIOS[mode]]
    env = {k: v for k, v in os.environ.items() if k not in common.TORCHRUN_VARS and k != diagnostics.CHECK_ENV}
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, err, sockets = [], [], set()
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    sampler = threading.Thread(target=_sample_sockets, args=(p, sockets), daemon=True)
    if how == "spawned":
        sampler.start()
    for line in p.stdout:
        lines.append((time.time(), line.rstrip("\n")))
    p.wait(timeout=240)
    reader.join(10)
    if how == "spawned":
        sampler.join(10)
    bad = folder / "misbehaved"
    return {"rc": p.returncode, "lines": lines, "stderr": err[0] if err else "", "sockets": sockets,
            "misbehaved": float(bad.read_text()) if bad.exists() else None}


def _sample_sockets(p, sockets):
    """Every TCP socket the job's processes (the launcher or torchrun's agent, the ranks)
    listen on, looked at every 0.3 s while it runs."""
    while p.poll() is None:
        sockets |= listening_sockets(process_tree(p.pid))
        time.sleep(0.3)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every scenario, spawned and under torchrun, four at a time."""
    if not _jobs:
        base = tmp_path_factory.mktemp("stalls")
        cases = [(m, h) for m in SCENARIOS for h in LAUNCHES]
        cases.sort(key=lambda c: c[0] != "busy")   # the longest first
        with ThreadPoolExecutor(4) as pool:
            got = pool.map(lambda c: _run(*c, base / f"{c[0]}_{c[1]}"), cases)
            _jobs.update(zip(cases, got))
    return _jobs


def _report(job):
    """The first stall report: (the second it was printed, its lines)."""
    lines = job["lines"]
    i = next((i for i, (_, ln) in enumerate(lines) if ln.startswith("stall: ")), None)
    assert i is not None, "no stall report:\n" + "\n".join(ln for _, ln in lines) + job["stderr"]
    block = [lines[i][1]] + [ln for _, ln in lines[i + 1:i + 8] if ln.startswith(("|", "  "))]
    return lines[i][0], block


@pytest.mark.parametrize("how", LAUNCHES)
@pytest.mark.parametrize("mode, state", [("stop", "not responding: stopped"),
                                         ("loop", "busy in no call, at workers.py")])
def test_the_rank_the_others_wait_for_is_named_within_the_stall_window(jobs, mode, how, state):
    job = jobs[(mode, how)]
    when, report = _report(job)
    assert report[0].startswith(f"stall: the ranks wait for rank 1 ({state}"), report
    assert when - job["misbehaved"] <= STALL + 5, f"reported {when - job['misbehaved']:.1f} s after the stall"
    rows = {ln.split("|")[1].strip(): ln for ln in report if ln.startswith("| ") and ln[2].isdigit()}
    assert "waits in all_reduce #4 on the world" in rows["0"] and "last" not in rows["0"]
    if mode == "loop":
        assert "stall_scenario: _spin()" in rows["1 *"]   # where it is: its stack
    assert job["rc"] != 0
    if how == "spawned":   # the job's end names the stuck rank first, then the rank that timed out waiting
        lines = job["stderr"].strip().splitlines()
        assert lines[0].startswith(f"stall_job.py: error: rank 1 stuck first: {state}"), job["stderr"]
        assert lines[1].startswith("  then, after waiting: rank 0 failed: RuntimeError:") and "Timed out" in lines[1]
        assert lines[-1].startswith("  every failed rank's traceback: ") and len(lines) <= 4, job["stderr"]
    else:   # torchrun prints each rank's traceback: the stall's line comes before it
        assert f"rank 0 fails after a stall: rank 1 stuck first: {state}" in job["stderr"]
        assert job["stderr"].index("fails after a stall") < job["stderr"].index("Traceback")


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_rank_stopped_in_backward_is_named_while_the_other_waits_on_its_async_buckets(jobs, how):
    """05's DDPBucketed: rank 1 stops in the middle of a step's backward; rank 0 finished
    backward and waits for its buckets' all-reduces, issued async (seen pending by the
    recorder, not by a blocking call)."""
    job = jobs[("ddp_stop", how)]
    when, report = _report(job)
    assert report[0].startswith("stall: the ranks wait for rank 1 (not responding: stopped"), report
    assert when - job["misbehaved"] <= STALL + 5
    row0 = next(ln for ln in report if ln.startswith("| 0 |"))
    assert "waits for its async all_reduce #" in row0 and "05_bucketed_ddp.py:" in row0, row0
    assert job["rc"] != 0


@pytest.mark.parametrize("how", LAUNCHES)
@pytest.mark.parametrize("mode, theirs", [
    ("skip", ["rank 0: all_reduce #6 on the world (float32 [4])", "rank 1: broadcast #6 on the world (float32 [4])"]),
    ("op", ["rank 0: all_reduce #4 on the world (float32 [4])", "rank 1: broadcast #4 on the world (float32 [4])"]),
    ("shape", ["rank 0: all_reduce #4 on the world (float32 [4])", "rank 1: all_reduce #4 on the world (float32 [5])"]),
    ("group", ["rank 0: all_reduce #4 on the world (float32 [4])",
               "rank 1: all_reduce #1 on group 1 (ranks 0,1) (float32 [4])"]),
])
def test_a_rank_calling_something_else_is_refused_before_the_call_runs(jobs, mode, how, theirs):
    job = jobs[(mode, how)]
    err = job["stderr"]
    assert job["rc"] != 0 and "refused before it ran (--check-collectives)" in err, err
    for call in theirs:   # each rank's call and the line it came from
        assert call in err and f"{call} at workers.py:" in err
    assert not any(ln.startswith("stall: ") for _, ln in job["lines"])   # at once: no rank waited it out
    if how == "spawned":
        assert err.startswith("stall_job.py: error: rank ") and "Traceback" not in err


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_rank_computing_between_collectives_is_reported_busy_and_the_run_completes(jobs, how):
    job = jobs[("busy", how)]
    assert job["rc"] == 0, job["stderr"]
    assert job["lines"][-1][1] == "finished: 256.0"
    when, report = _report(job)
    assert report[0].startswith("stall: the ranks wait for rank 1 (busy in no call, at workers.py"), report
    assert any("stall_scenario: _spin(args.busy)" in ln for ln in report)
    assert "fail" not in " ".join(ln for _, ln in job["lines"]) + job["stderr"]


def test_a_failed_job_prints_the_launchers_lines_only_and_leaves_nothing_running(jobs):
    """Spawned: no warning of torch's process launcher ("Terminating process ...") on the
    console, and no rank left behind by any scenario."""
    for mode in SCENARIOS:
        err = jobs[(mode, "spawned")]["stderr"]
        assert "Terminating process" not in err and "torch.multiprocessing" not in err and "W1" not in err, err
    assert not workers_left()


@pytest.mark.parametrize("mode", ["busy", "skip", "stop"])
def test_a_spawned_job_listens_on_loopback_only_when_it_completes_fails_or_stalls(jobs, mode):
    """The launcher's rendezvous store and the ranks' gloo sockets: nothing of a spawned job
    listens on 0.0.0.0 or ::, whether it completes ("busy"), fails at once ("skip", refused
    by --check-collectives) or stalls until its timeout ("stop": the report still comes)."""
    job = jobs[(mode, "spawned")]
    assert job["sockets"], "no listening socket seen: the sampler saw no process of the job"
    assert all(is_loopback(addr) for addr, _ in job["sockets"]), sorted(job["sockets"])
    assert (job["rc"] == 0) == (mode == "busy")
    if mode == "stop":
        assert _report(job)[1][0].startswith("stall: ")


# ---- diagnose() on states made by hand: what the job's report reads
def _state(rank, t, seq, flight=(), done=None, stack=(), finished=False):
    return {"rank": rank, "pid": 1000 + rank, "host": "elsewhere", "t": t, "seq": seq, "flight": list(flight), "done": done,
            "stack": list(stack), "finished": finished, "groups": {}}


def _call(op, key, seq, ranks, t0, shapes=((4,),)):
    return {"op": op, "group": key.split(":")[0], "ranks": ranks, "keys": [key], "seqs": [seq],
            "shapes": [list(s) for s in shapes], "dtype": "float32", "site": "x.py:1", "t0": t0, "t1": None,
            "async": False}


def test_diagnose_follows_the_chain_to_the_rank_in_no_call():
    """Rank 0 waits on the world for rank 1; rank 1 waits on the pair (1, 2) for rank 2; rank
    2 computes: rank 2 is named first, rank 1's wait as a consequence."""
    now = 100.0
    states = {0: _state(0, now, {"0": 5}, [_call("all_reduce", "0", 5, [0, 1, 2], now - 40)]),
              1: _state(1, now, {"0": 4, "7": 3}, [_call("all_reduce", "7", 3, [1, 2], now - 39)]),
              2: _state(2, now, {"0": 4, "7": 2}, stack=["y.py:9 train: compute()"])}
    d = diagnose(states, now)
    assert d["culprits"] == [2] and d["kind"] == "late"
    assert d["text"].startswith("stall: the ranks wait for rank 2 (busy in no call, at y.py:9 train: compute())")
    assert d["stuck"].startswith("rank 2 stuck first: busy in no call")


def test_diagnose_names_a_receive_whose_send_never_came_and_a_cycle():
    now = 100.0
    recv = {**_call("irecv", "0:1>0", 3, [0, 1], now - 50), "async": True}
    states = {0: _state(0, now, {"0:1>0": 3}, [recv]),
              1: _state(1, now - 20, {"0:1>0": 2})}   # its recorder silent for 20 s
    d = diagnose(states, now, alive=lambda pid, host: None)
    assert d["culprits"] == [1] and "not responding (alive, its recorder silent); its last state is 20 s old" in d["text"]
    assert "irecv (1 to 0 #3) on the world" in d["text"]
    cycle = {0: _state(0, now, {"0": 1, "5": 0}, [_call("all_reduce", "5", 1, [0, 1], now - 35)]),
             1: _state(1, now, {"0": 1, "5": 0}, [_call("all_reduce", "0", 2, [0, 1], now - 35)])}
    cycle[0]["seq"]["5"], cycle[1]["seq"]["0"] = 1, 2   # each entered its own call
    d = diagnose(cycle, now)
    assert d["kind"] == "cycle" and sorted(d["culprits"]) == [0, 1] and "wait for each other" in d["text"]


def test_diagnose_names_a_silent_rank_even_inside_the_call_the_others_wait_in():
    """Rank 1 entered all_reduce #5 (async), then was stopped: its last state says it waits
    too, but it is silent; rank 0, waiting in the same call, is not the one to blame."""
    now = 100.0
    call = lambda t0: {**_call("all_reduce", "0", 5, [0, 1], t0), "async": True}  # noqa: E731
    states = {0: _state(0, now, {"0": 5}, [call(now - 40)]), 1: _state(1, now - 35, {"0": 5}, [call(now - 36)])}
    d = diagnose(states, now, alive=lambda pid, host: "stopped" if pid == 1001 else None)
    assert d["culprits"] == [1] and d["stuck"].startswith("rank 1 stuck first: not responding: stopped")
    states[1]["t"] = now - 0.5   # stopped just after it published: its state still looks fresh
    d = diagnose(states, now, alive=lambda pid, host: "stopped" if pid == 1001 else None)
    assert d["culprits"] == [1] and d["stuck"].startswith("rank 1 stuck first: not responding: stopped"), d["text"]
    assert d["silent"] == [1]


def test_diagnose_waits_out_the_window_and_names_a_finished_rank():
    now = 100.0
    waiting = {0: _state(0, now, {"0": 3}, [_call("barrier", "0", 3, [0, 1], now - 2)]),
               1: _state(1, now, {"0": 2}, finished=True)}
    assert diagnose(waiting, now) is None                     # 2 s: within the window
    waiting[0]["t"] = now + 30                                # still beating 30 s on
    d = diagnose(waiting, now + 30)
    assert d["culprits"] == [1] and "finished its work" in d["text"]


def diagnose(states, now, alive=lambda pid, host: None):
    return diagnostics.diagnose(states, now, world=len(states), stall_after=30.0, alive=alive)
