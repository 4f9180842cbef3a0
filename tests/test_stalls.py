"""A stuck rank named in seconds, not waited out: the flight recorder every job runs under
(diagnostics.FlightRecorder), the stall report (diagnose, StallWatch) and --check-collectives, on
spawned ranks and under torchrun. Each scenario is tests/stall_job.py, whose rank 1
misbehaves at its fourth all_reduce; the jobs run side by side, each asserted on alone."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import common
import diagnostics
from conftest import ROOT, is_loopback, listening_sockets, process_tree, seconds, workers_left

STALL, TIMEOUT, BUSY = 3.0, seconds(20.0), 10.0   # (20 s: gloo connects within --timeout, and six jobs start at once)
# (mode, extra flags): the stall report names rank 1 within the window; the job fails at --timeout
# (the mismatches at once, refused by --check-collectives); "busy" computes BUSY s and completes;
# "thread": rank 0 waits for an all_reduce issued from another thread, where the recorder cannot see
SCENARIOS = {"stop": [], "loop": [], "ddp_stop": [], "skip": ["--check-collectives"], "op": ["--check-collectives"],
             "shape": ["--check-collectives"], "group": ["--check-collectives"], "thread": [],
             "busy": ["--stall-report", "5", "--timeout", "60", "--busy", str(BUSY)]}
# The scripts' own command lines, one rank stopped (SIGSTOP, by diagnostics.STOP_ENV) as soon
# as its stack is inside the named method's step; the others wait for it wherever that method
# waits (torch DDP: in its C++ reducer, which the recorder does not see). name: (ranks, argv,
# where the rank stops: "file:function", which rank)
NATURAL = {
    "05 torch DDP": (2, ["05_bucketed_ddp.py", "--model-size", "nano", "--steps", "400", "--no-verify",
                         "--bucket-mb", "1", "--models", "lm"], "distributed.py:forward", 1),
    "05 DDPBucketed": (2, ["05_bucketed_ddp.py", "--model-size", "nano", "--steps", "400", "--no-verify",
                           "--bucket-mb", "1", "--models", "lm"], "05_bucketed_ddp.py:hook", 1),
    "06 ZeroRedundancyOptimizer": (2, ["06_sharded_optimizer.py", "--model-size", "nano", "--steps", "400",
                                       "--no-verify"], "zero_redundancy_optimizer.py:step", 1),
    "07 FSDP2": (2, ["07_fsdp.py", "--model-size", "nano", "--steps", "400", "--no-verify", "--methods", "fsdp"],
                 "_fsdp_state.py:_pre_forward", 1),
    "09 torch pipelining": (2, ["09_pipeline_parallel.py", "--model-size", "nano", "--steps", "400", "--no-verify",
                                "--stages", "2", "--schedule", "1f1b", "--microbatches", "2"],
                            "schedules.py:_step_microbatches", 1),
    "10 pp 2 x dp 2": (4, ["10_nd_parallel.py", "--model-size", "nano", "--steps", "400", "--no-verify", "--pp", "2",
                           "--dp", "2"], "10_nd_parallel.py:train_step", 3),
}
LAUNCHES = ("spawned", "torchrun")
LISTENING = ("busy", "skip", "stop")   # the spawned jobs whose listening sockets are looked at (they end three ways)


def _command(case, how, folder, env):
    """(command line, environment) of a scenario or a natural command."""
    ranks, env = 2, {k: v for k, v in env.items() if k not in common.TORCHRUN_VARS and k != diagnostics.CHECK_ENV}
    if case in SCENARIOS:
        argv = [str(ROOT / "tests" / "stall_job.py"), case, str(folder), "--stall-report", str(STALL), "--timeout",
                str(TIMEOUT), *SCENARIOS[case]]
    else:
        ranks, script, where, rank = NATURAL[case]
        argv = [*script, "--stall-report", str(STALL), "--timeout", str(TIMEOUT), "--out", str(folder / "out")]
        if how == "spawned":
            argv += ["--world-size", str(ranks)] if "--pp" not in script else []
        env[diagnostics.STOP_ENV] = json.dumps({"rank": rank, "in": where, "file": str(folder / "misbehaved")})
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if how == "torchrun" else []
    return [sys.executable, *launcher, *argv], env


def _run(case, how, folder, env):
    """One job: exit status, stdout lines with the second each arrived, stderr, when its rank
    misbehaved, and (spawned, LISTENING) every socket its processes listened on."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd, env = _command(case, how, folder, env)
    began = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines, err, sockets = [], [], set()
    reader = threading.Thread(target=_read_errors, args=(p, err, how), daemon=True)
    reader.start()
    sampler = threading.Thread(target=_sample_sockets, args=(p, sockets), daemon=True)
    sampled = how == "spawned" and case in LISTENING   # (each look reads every process's /proc/N/stat)
    if sampled:
        sampler.start()
    for line in p.stdout:
        lines.append((time.time(), line.rstrip("\n")))
    p.wait(timeout=240)
    reader.join(10)
    err = ["".join(err)]
    if sampled:
        sampler.join(10)
    bad = folder / "misbehaved"
    return {"rc": p.returncode, "lines": lines, "stderr": err[0] if err else "", "sockets": sockets,
            "began": began, "seconds": time.time() - began,
            "misbehaved": float(bad.read_text()) if bad.exists() else None}


def run_jobs(base, env) -> dict:
    """Every scenario and natural command, spawned and under torchrun, six at a time
    (they mostly wait): {(case, launch): what _run returns}."""
    cases = [(c, h) for c in [*SCENARIOS, *NATURAL] for h in LAUNCHES]
    cases.sort(key=lambda c: c[0] != "busy")   # the longest first
    with ThreadPoolExecutor(6) as pool:
        return dict(zip(cases, pool.map(lambda c: _run(*c, base / f"{c[0]}_{c[1]}".replace(" ", "_"), env), cases)))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs(tmp_path_factory.mktemp("stalls"), dict(os.environ))


def _read_errors(p, err, how):
    """The job's stderr, line by line. Under torchrun, once a rank has failed, a rank stopped
    by SIGSTOP is continued: torchrun's agent ends the others with SIGTERM, which a stopped
    process acts on only when continued (else the agent waits out its 30 s grace period
    before SIGKILL), as whoever stopped it would do."""
    for line in p.stderr:
        err.append(line)
        if how == "torchrun" and ("fails after a stall" in line or "Traceback" in line):
            for pid in process_tree(p.pid):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "T":
                            os.kill(pid, signal.SIGCONT)
                except (OSError, IndexError):   # gone meanwhile
                    continue


def _sample_sockets(p, sockets):
    """Every TCP socket the job's processes (the launcher or torchrun's agent, the ranks)
    listen on, looked at every 0.3 s while it runs."""
    while p.poll() is None:
        sockets |= listening_sockets(process_tree(p.pid))
        time.sleep(0.3)


def _report(job, after=None):
    """The first stall report once the rank misbehaved (a start slower than the window on a
    loaded machine is a stall too, and may be reported before), or once ``after``: (the
    second it was printed, its lines)."""
    lines, after = job["lines"], after or job["misbehaved"] or 0.0
    i = next((i for i, (t, ln) in enumerate(lines) if ln.startswith("stall: ") and t >= after), None)
    assert i is not None, "no stall report:\n" + "\n".join(ln for _, ln in lines) + job["stderr"]
    block = [lines[i][1]] + [ln for _, ln in lines[i + 1:i + 12] if ln.startswith(("|", "  "))]
    return lines[i][0], block


@pytest.mark.parametrize("how", LAUNCHES)
@pytest.mark.parametrize("mode, state", [("stop", "not responding: stopped"),
                                         ("loop", "busy in no call, at workers.py")])
def test_the_rank_the_others_wait_for_is_named_within_the_stall_window(jobs, mode, how, state):
    job = jobs[(mode, how)]
    when, report = _report(job)
    assert report[0].startswith("stall: the ranks wait for rank 1 ("), report
    assert when - job["misbehaved"] <= STALL + seconds(5), f"reported {when - job['misbehaved']:.1f} s after the stall"
    if mode == "loop" and "not responding (alive, its recorder silent)" in report[0]:
        # a loaded machine may starve the busy rank's beat thread past the window: the next
        # report, STALL s on, has its state (the stopped rank's comes from /proc, never late)
        when, report = _report(job, after=when + 0.5)
    assert report[0].startswith(f"stall: the ranks wait for rank 1 ({state}"), report
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
        assert f"rank 0 fails after a stall: rank 1 stuck first: {state}" in job["stderr"], \
            [ln for ln in job["stderr"].splitlines() if "stall" in ln or "stuck" in ln]
        assert job["stderr"].index("fails after a stall") < job["stderr"].index("Traceback")


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_rank_stopped_in_backward_is_named_while_the_other_waits_on_its_async_buckets(jobs, how):
    """05's DDPBucketed: rank 1 stops in the middle of a step's backward; rank 0 finished
    backward and waits for its buckets' all-reduces, issued async (seen pending by the
    recorder, not by a blocking call)."""
    job = jobs[("ddp_stop", how)]
    when, report = _report(job)
    assert report[0].startswith("stall: the ranks wait for rank 1 (not responding: stopped"), report
    assert when - job["misbehaved"] <= STALL + seconds(5)
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
    # at once: no rank waited for another in a call long enough to be reported (a loaded
    # machine's slow start may still be reported: a rank not responding, or no progress)
    assert not [ln for _, ln in job["lines"] if ln.startswith("stall: ") and "not responding" not in ln
                and not ln.startswith("stall: no rank entered")]
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


@pytest.mark.parametrize("how", LAUNCHES)
@pytest.mark.parametrize("case", NATURAL)
def test_a_rank_stopped_in_a_scripts_step_is_named_within_the_window_wherever_the_others_wait(jobs, case, how):
    """The scripts' own command lines: a rank stopped inside torch DDP's step (the other rank
    then waits in torch's C++ reducer, which no recorded call shows), DDPBucketed's backward,
    ZeroRedundancyOptimizer's step, FSDP2's forward, torch's pipelining schedule, or a 4-rank
    mesh's step is named within the window (plus 5 s); the job ends at --timeout naming it
    first; nothing is left running (test_a_failed_job_... below)."""
    job = jobs[(case, how)]
    ranks, argv, where, rank = NATURAL[case]
    assert job["misbehaved"] is not None, f"rank {rank} never reached {where}:\n{job['stderr'][-3000:]}"
    when, report = _report(job)
    assert f"rank {rank}" in report[0] and "not responding: stopped" in report[0], report
    if case == "05 torch DDP":   # no rank waits in a recorded call: the silent rank is a stall on its own
        assert report[0].startswith(f"stall: rank {rank} is not responding: stopped"), report
    assert when - job["misbehaved"] <= STALL + seconds(5), f"reported {when - job['misbehaved']:.1f} s after the stop"
    assert any(ln.startswith(f"| {rank} * |") for ln in report), report
    assert job["rc"] != 0
    stuck = f"rank {rank} stuck first: not responding: stopped"
    if how == "spawned":
        assert job["stderr"].startswith(f"{argv[0]}: error: {stuck}"), job["stderr"][-3000:]
    else:
        assert f"fails after a stall: {stuck}" in job["stderr"], job["stderr"][-3000:]
        assert job["stderr"].index("fails after a stall") < job["stderr"].index("Traceback")


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_wait_the_recorder_cannot_see_is_reported_as_no_progress_and_named_at_the_timeout(jobs, how):
    """Rank 0 waits in join() for an all_reduce issued from another thread (a C++ wait no
    recorded call shows) while rank 1 computes on: no rank enters or completes a recorded
    call, and rank 0's stack does not move: the report names it and where it sits; rank 1,
    whose stack moves, is busy; the failure at --timeout names rank 0 first."""
    job = jobs[("thread", how)]
    when, report = _report(job)
    assert when - job["misbehaved"] <= STALL + seconds(5), f"reported {when - job['misbehaved']:.1f} s after the stall"
    if "ranks 0, 1 have not moved" in report[0]:
        # a loaded machine may starve the computing rank's beat thread: its last state, read
        # again, looks still; the next report, STALL s on, has its fresh state (it moves)
        when, report = _report(job, after=when + 0.5)
    assert report[0].startswith("stall: no rank entered or completed a recorded call for ") and \
        "rank 0 has not moved: in no recorded call, its stack unmoved for" in report[0], report
    assert "cannot see" in report[1]
    rows = {ln.split("|")[1].strip(): ln for ln in report if ln.startswith("| ") and ln[2].isdigit()}
    assert "_all_reduce_in_a_thread: t.join()" in rows["0 *"], rows
    assert "busy in no call, at workers.py" in rows["1"] and "stall_scenario: _spin()" in rows["1"], rows
    assert job["rc"] != 0
    if how == "spawned":
        assert job["stderr"].startswith("stall_job.py: error: rank 0 stuck first: in no recorded call"), job["stderr"]
    else:
        assert "rank 0 fails after a stall: rank 0 stuck first: in no recorded call" in job["stderr"], job["stderr"]


def test_a_failed_job_prints_the_launchers_lines_only_and_leaves_nothing_running(jobs):
    """Spawned: no warning of torch's process launcher ("Terminating process ...") on the
    console, and no rank left behind by any scenario or script."""
    for mode in [*SCENARIOS, *NATURAL]:
        err = jobs[(mode, "spawned")]["stderr"]
        assert "Terminating process" not in err and "torch.multiprocessing" not in err and "W1" not in err, err
    assert not workers_left()


@pytest.mark.parametrize("mode", LISTENING)
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


def test_a_call_made_inside_the_library_is_blamed_on_the_line_that_called_into_it():
    """The recorder names the user's or script's line, never a line of placement.py,
    sharded_checkpoint.py or common.py where the collective itself is written."""
    import argparse
    import workers
    got = common.launch(workers.blamed_lines, argparse.Namespace(world_size=2, backend="gloo", device="cpu",
                                                                 timeout=60.0))
    assert got and all(site == f"workers.py:{line}" for site, line in got), got

def test_the_recorders_looks_at_the_main_thread_keep_none_of_its_tensors_alive():
    """The recorder's thread reads the main thread's stack, then samples where it is for a
    while; a frame it held past its function's return would keep that function's locals
    alive (seen as five MiB more at 07's step peak: a look held the frame that held a unit's
    whole gradients). Here the main thread, inside a function holding a tensor, returns as
    soon as its stack has been read; the tensor must be gone then, and the stack read names
    that function's line."""
    import types
    import weakref
    import torch
    rec = diagnostics.FlightRecorder(types.SimpleNamespace(rank=0, world_size=1), torch.distributed.HashStore())
    rec.stopped.set()
    rec.thread.join()             # no beat: this test makes the looks
    inside, read, done, stacks, sample = threading.Event(), threading.Event(), threading.Event(), [], rec._frames

    def frames():                 # called once the stack is read, before the samples
        read.set()
        return sample(4)
    rec._frames = frames

    def look():
        while inside.wait() and not done.is_set():
            inside.clear()
            stacks.append(rec._state()["stack"])

    def holds():
        x = torch.empty(16)
        inside.set()
        while not read.is_set():   # Python running here until the stack is read
            pass
        read.clear()
        return weakref.ref(x)

    looker = threading.Thread(target=look)
    looker.start()
    try:
        kept = sum(holds()() is not None for _ in range(20))
    finally:
        done.set()
        inside.set()
        looker.join()
    assert kept == 0
    line = holds.__code__.co_firstlineno + 3
    assert len(stacks) == 20 and all(s[0] == f"test_stalls.py:{line} holds: while not read.is_set():   "
                                      "# Python running here until the stack is read" for s in stacks), stacks



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


def test_diagnose_names_a_silent_rank_on_its_own_once_the_window_has_passed():
    """Rank 0 waits where the recorder cannot see (no call in flight); rank 1 stopped: named
    once its last state is a window old, not before."""
    now = 100.0
    states = {0: _state(0, now, {"0": 7}, stack=["05.py:285 train_step: loss.backward()"]),
              1: _state(1, now - 10, {"0": 7})}
    stopped = lambda pid, host: "stopped" if pid == 1001 else None   # noqa: E731
    assert diagnose(states, now, alive=stopped) is None   # 10 s: within the window
    states[0]["t"] = now + 25
    d = diagnose(states, now + 25, alive=stopped)
    assert d["kind"] == "silent" and d["culprits"] == [1]
    assert d["text"].startswith("stall: rank 1 is not responding: stopped; its last state is 35 s old")
    assert d["stuck"] == "rank 1 stuck first: not responding: stopped; its last state is 35 s old"


def test_diagnose_names_a_rank_that_has_not_moved_while_no_rank_makes_progress():
    """No recorded call entered or completed for 40 s: rank 0's stack unmoved for 35 s is
    named (it may wait where the recorder cannot see), rank 1 whose stack moves is busy;
    with progress 10 s ago, nothing is reported."""
    now = 100.0
    states = {0: _state(0, now, {"0": 4}, stack=["w.py:9 f: t.join()"]), 1: _state(1, now, {"0": 4}, stack=["w.py:3 g"])}
    history = {"progress": now - 40, "still": {0: now - 35, 1: now - 0.5}, "cpu": {0: 0.01}}
    d = diagnostics.diagnose(states, now, 2, 30.0, alive=lambda pid, host: None, history=history)
    assert d["kind"] == "still" and d["culprits"] == [0], d["text"]
    assert d["text"].startswith("stall: no rank entered or completed a recorded call for 40 s, and rank 0 has not "
                                "moved: in no recorded call, its stack unmoved for 35 s at w.py:9 f: t.join(), 0.0 s "
                                "of CPU meanwhile"), d["text"]
    assert "| 1 | busy in no call, at w.py:3 g |" in d["text"]
    history["progress"] = now - 10
    assert diagnostics.diagnose(states, now, 2, 30.0, alive=lambda pid, host: None, history=history) is None


def diagnose(states, now, alive=lambda pid, host: None):
    return diagnostics.diagnose(states, now, world=len(states), stall_after=30.0, alive=alive)


@pytest.mark.parametrize("ticking", [False, True], ids=["launcher reads", "beat ticks"])
def test_a_failed_jobs_first_line_waits_for_the_next_state_of_a_rank_that_seemed_silent_but_lives(ticking):
    """On a loaded machine a rank computing in Python may publish late, its beat thread
    starved: the failure's first line (StallWatch.last_word) then waits, up to three beats,
    for that rank's next state rather than call it not responding; read by the launcher
    itself, or, under torchrun, by the failing rank's beat thread, which goes on ticking.
    A rank this host sees stopped is named at once."""
    import io
    import platform
    import torch
    store = torch.distributed.HashStore()
    watch = diagnostics.StallWatch(store, 2, 3.0, out=io.StringIO())
    call = _call("all_reduce", "0", 4, [0, 1], time.time() - 10)

    def publish(rank1_at, **rank1):
        store.set("state/0", json.dumps(_state(0, time.time(), {"0": 4}, [call])))
        store.set("state/1", json.dumps({**_state(1, rank1_at, {"0": 3}, stack=["workers.py:9 _spin: pass"]), **rank1}))
    publish(time.time() - 5)   # its last state 5 s old, its process not seen from here (another host)
    watch.tick()
    assert watch.diagnosis["stuck"].startswith("rank 1 stuck first: not responding (alive, its recorder silent)")
    assert watch.diagnosis["unsure"] == [1]
    late = threading.Timer(0.5, lambda: publish(time.time()))
    late.start()
    done = threading.Event()
    beat = threading.Thread(target=lambda: [watch.tick() for _ in iter(lambda: done.wait(0.2), True)])
    if ticking:
        beat.start()
    try:
        d = watch.last_word(ticking=ticking, wait=30.0)   # (three beats by default; here a loaded machine's margin)
    finally:
        done.set()
        late.join()
        if ticking:
            beat.join()
    assert d["stuck"].startswith("rank 1 stuck first: busy in no call, at workers.py:9 _spin: pass (") and not d["unsure"]
    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        while diagnostics._process_state(stopped.pid, platform.node()) != "stopped":
            time.sleep(0.01)
        publish(time.time() - 5, pid=stopped.pid, host=platform.node())
        watch.tick()
        assert not watch.diagnosis["unsure"]   # nothing to wait for: last_word returns it as it is
        assert watch.last_word(ticking=ticking)["stuck"].startswith("rank 1 stuck first: not responding: stopped")
    finally:
        stopped.kill()
        stopped.wait()
