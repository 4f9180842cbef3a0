"""Data-parallel replicas that survive the loss of one: the others step on, a replacement
heals from a live peer, and nothing restarts.

Each replica is its own group of ranks, its own job (spawned here, or a torchrun job on any
machine), training the kit's LM with 05's DDPBucketed or 07's FSDP inside (--inner). Across
the replicas a coordinator (a small TCP service; --coordinator runs it alone) forms a quorum
of the live replicas at every step boundary. Every rank of a replica beats; a replica is
left out of the next quorum when any of its ranks goes: at once when its connection closes
(kill -9), after --detect seconds when it hangs (SIGSTOP). Rank k of every member averages
its gradients with rank k of the others over a gloo group made for that quorum (under FSDP
they hold the same shard). Then every member votes, and the coordinator commits the step
only if every member's all-reduce succeeded: a step that a lost replica broke is committed
by nobody (no optimizer step from a partial all-reduce) and is redone by the next quorum. A
replica that joins (a replacement, or a lost one that came back) enters at a step boundary:
the quorum names a live peer at the newest step, whose ranks send it the weights, the
optimizer state and the step (its data position: step i's batch depends on i and the replica
alone) over the same group, rank by rank; the joiner checks its state's sha256 against the
peer's before it steps.

Run:
    python 14_fault_tolerant_dp.py                     # verify under failures, then time (make 14)
    python 14_fault_tolerant_dp.py --replicas 4 --inner ddp --no-bench
    python 14_fault_tolerant_dp.py --coordinator --port 29510 --run-dir R   # alone; then one torchrun job a replica:
    torchrun --standalone --nproc-per-node 2 14_fault_tolerant_dp.py --join HOST:29510 --replica-id 0 --run-dir R
    python 14_fault_tolerant_dp.py --replay R       # the run's committed steps in one process, against its weights

The verification trains --replicas replicas of --replica-ranks ranks through a scenario of
failures: a replica killed (kill -9 of one of its ranks) and replaced; the heal of that
replacement, whose source is killed midway; a replica hung (SIGSTOP of its last rank, its
first beating on), then killed and replaced; two replicas killed at once, as a step begins
and at four other points of it (at the quorum, before the all-reduce, before the vote, after
the commit), a different replica left each time. Then it checks every step was committed
once, in order, and replays the committed steps in one process (at each, the average over
the replicas that contributed, each replica its own fixed data shard) and compares: every
replica's weights bit for bit alike, and the replay's (each tensor within 1e-4 of how far
training moved it; the replay with its members summed in another order shows float32's
reordering stays well inside that). It prints the membership timeline (replicas x steps:
stepped, healed, out) and draws it. The benchmark (--replicas 2, 3 and 4, one rank each)
times a step without failures beside torch DDP over the same ranks (the quorum's cost), the
time from a kill to the next committed step, and the heal, each beside torchft's Manager on
the same model and batches where torchft is installed (make torchft-bench; else a SKIP line
says so).
Writes <out>/14_fault_tolerant_dp.{json,md} (the benchmark), 14_timeline.{json,png}.
"""
import math
import os
import sys

if "--join" in sys.argv:   # a replica's rank: a store whose server went (the coordinator's, an agent's killed)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # is not a C++ trace a call: the replica says what it means
import argparse   # noqa: E402
import errno   # noqa: E402
import importlib.util   # noqa: E402
import multiprocessing   # noqa: E402
import shutil   # noqa: E402
import signal   # noqa: E402
import statistics   # noqa: E402
import tempfile   # noqa: E402
import textwrap   # noqa: E402
from pathlib import Path   # noqa: E402

import common   # noqa: E402

# ---- begin copy: fault-tolerant replicas (needs torch and the standard library) ----
import collections
import concurrent.futures
import contextlib
import datetime
import functools
import hashlib
import json
import os
import select
import socket
import socketserver
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist


class ReplicaStopped(RuntimeError):
    """Why a replica's ranks stop without training on, raised on every rank of it; ``code``:
    the exit status a script gives it."""
    code = 1


class CoordinatorGone(ReplicaStopped):
    """The coordinator's connection closed: no quorum can form. The replica's state is
    its last committed step (save it; a new coordinator resumes from there)."""


class Replaced(ReplicaStopped):
    """This replica id was started again while this start lived: the new start goes on and
    this one stops (exit 0, so that an agent that restarts failed workers does not start it
    again to take over in turn)."""
    code = 0


class NotJoined(ReplicaStopped):
    """The replica could not join: nothing listens at the address, the run there is over,
    or the coordinator refused it (its settings differ from the run's)."""
    code = 2


STOPS = {c.__name__: c for c in (CoordinatorGone, Replaced, NotJoined)}


class _Digest:
    """A heal's check: the sha256 of the step and of each tensor's own sha256 in order, the
    tensors hashed on a few threads while the next ones travel (hashlib lets go of the GIL
    on large buffers). ``add`` takes a host tensor that nothing writes until ``value()``;
    at most ``2 * workers`` wait to be hashed (on a GPU, each a host copy). As a context
    manager it lets go of its threads, whatever happened."""

    def __init__(self, step: int, workers: int = 0):
        self.workers = workers or max(1, min(4, (os.cpu_count() or 1) // 2))
        self.pool, self.parts = concurrent.futures.ThreadPoolExecutor(self.workers), collections.deque()
        self.head, self.done = hashlib.sha256(str(step).encode()), None

    def add(self, t):
        data = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())   # (no copy)
        self.parts.append(self.pool.submit(lambda: hashlib.sha256(data).digest()))
        while len(self.parts) > 2 * self.workers:
            self.head.update(self.parts.popleft().result())

    def value(self) -> bytes:
        if self.done is None:
            while self.parts:
                self.head.update(self.parts.popleft().result())
            self.done = self.head.digest()
        return self.done

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(wait=False, cancel_futures=True)


def _send(sock, msg: dict):
    sock.sendall((json.dumps(msg) + "\n").encode())


def connect(address: str, wait: float = 30.0) -> socket.socket:
    """A connection to the coordinator at ``address`` (HOST:PORT), tried again for up to
    ``wait`` seconds while nothing listens there (a coordinator still starting); then
    NotJoined, naming the address."""
    host, port = address.rsplit(":", 1)
    deadline = time.time() + wait
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except socket.gaierror as e:
            raise NotJoined(f"--join {address}: the host {host!r} is not known here ({e.strerror})") from None
        except OSError as e:
            if time.time() > deadline:
                raise NotJoined(f"nothing answers at {address} ({e.strerror or e}; tried for {wait:.0f} s): start "
                                f"the coordinator there first, or check --join") from None
            time.sleep(0.5)


def _beat(sock, msg: dict, every: float, stop: threading.Event):
    """A rank's beats: ``msg`` every ``every`` seconds until ``stop`` (or the connection goes)."""
    line = (json.dumps(msg) + "\n").encode()
    with contextlib.suppress(OSError):
        while not stop.is_set():
            sock.sendall(line)
            stop.wait(every)


def _closing(stop: threading.Event, *socks):
    """A manager's end: its beats stop and its connections close (the coordinator sees it go)."""
    stop.set()
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


class Coordinator:
    """The quorum service (torchft's lighthouse): one for the job, where every rank can reach
    it. Each replica's first rank says hello and asks for a quorum at each step boundary;
    every rank of it beats (a connection of its own, a line every detect/5 seconds), so a
    replica is live while each of its ranks beats and no connection closed. A quorum forms
    when every live replica has asked, or join_timeout seconds after the first asked, with
    those that did; never with fewer than min_replicas, and never below the run's newest
    committed step: while a live replica holds that state, the others wait for it (it heals
    them), so no step is committed twice. Its answer: the members, the step they take (the
    newest any member holds), and for each member behind it the live peer it heals from.
    Then each member votes; the step commits only if every member voted ok, and a member
    that goes before it votes (a closed connection at once; no beat for ``detect`` seconds;
    a new start of it said hello) aborts it for all. Until step 0 commits, every member but
    the source heals from it (``init_sync``: replicas built apart start from one replica's
    weights). It also holds the TCPStore through which each quorum's groups meet.

    A replica is a start, not an id: a second hello of a replica id while the first start
    lives takes over (the old start's next request is answered ``replaced``, and its votes
    no longer count). ``record``: a file where every committed step is appended (its step
    and members), the replicas' settings and the run's end: the one-process replay reads it,
    and a coordinator started again on it goes on with the same run. ``say``: called with a
    line for each thing an operator follows (a replica joined, lost, replaced; a heal; an
    aborted step; every ``log_every``-th commit).

        coordinator = Coordinator("0.0.0.0", 29510, detect=2.0)
        print(coordinator.address)         # replicas: ReplicaManager(..., coordinator="HOST:29510", ...)
        coordinator.serve()                 # until close() (or the process ends)
    """

    def __init__(self, host="127.0.0.1", port=0, detect=2.0, join_timeout=10.0, min_replicas=1, init_sync=True,
                 record=None, say=None, log_every=10):
        self.detect, self.join_timeout, self.min_replicas = detect, join_timeout, min_replicas
        self.init_sync, self.say, self.log_every = init_sync, say, log_every
        self.committed, self.settings, self.final = 0, None, None   # (the run: from its record)
        self.record = record and Path(record)
        if self.record:
            self.record.parent.mkdir(parents=True, exist_ok=True)
        if self.record and self.record.exists():
            for line in self.record.read_text().splitlines():
                self._read(json.loads(line))
        self.server = Server((host, port), self._handler())   # (first: a port in use fails before anything starts)
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)   # (TCPStore's own server would listen on
        listen.bind((host, 0))                                        # every interface: handed a socket, it
        listen.listen(128)                                            # listens where that one is bound)
        self.store = dist.TCPStore(host, listen.getsockname()[1], is_master=True, wait_for_workers=False,
                                   master_listen_fd=listen.detach())
        self.lock = threading.Condition()
        self.t0 = time.time()
        self.replicas = {}      # id -> its record (each rank's beat, step, asked, done, connections, reply)
        self.leaders = {}       # a first rank's connection -> the hello it said (which start of its replica)
        self.quorum, self.decisions, self.next_qid, self.next_group, self.hellos = None, {}, 0, 0, 0
        self.history, self.events = [], []    # every quorum formed (and its fate); (t, replica, what)
        self.faults = []        # {"replica": id or None (a heal's source), "fault": ...}: handed out with a quorum
        self.handed = -1        # the step of the quorum that handed out the last of them
        self.stop_at = None     # the step at which every replica is told to stop
        self.no_holder = None   # since when no live replica holds the newest committed step
        self.conns = set()      # every open connection (close() ends them)
        self.address = f"{host}:{self.server.server_address[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        threading.Thread(target=self._tick, daemon=True).start()

    def _handler(self):
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # (small messages, at once)
                outer.conns.add(self.connection)
                try:
                    outer._serve(self.rfile, self.connection)
                finally:
                    outer.conns.discard(self.connection)
        return Handler

    def serve(self):
        self._closed.wait()

    def close(self):
        """Stop serving: no new connections, and every open one ended (its thread with it)."""
        self._closed.set()
        self.server.shutdown()
        self.server.server_close()
        for conn in list(self.conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # ---- the run's record ----
    def _read(self, e):
        """One entry of the record: the settings, a committed step, a rewind, the run's end."""
        if "settings" in e:
            self.settings = e["settings"]
        elif "commit" in e:
            self.committed = e["commit"] + 1
        elif "rewind" in e or "start" in e:
            self.committed = e.get("rewind", e.get("start"))
        elif "final" in e:
            self.final = e["final"]

    def _write(self, e):
        if self.record:
            try:
                with open(self.record, "a") as f:
                    f.write(json.dumps(e) + "\n")
            except OSError as err:   # (the run goes on: only its replay is lost)
                self._say(f"cannot write the record {self.record} ({err}): the run goes on without one")
                self.record = None

    def _say(self, line):
        if self.say is not None:
            self.say(line)

    # ---- the connections: one thread each ----
    def _serve(self, rfile, conn):
        replica = None
        try:
            for line in rfile:
                msg = json.loads(line)
                replica = msg.get("replica", replica)
                reply = getattr(self, "_" + msg["op"])(msg, id(conn))
                if reply is not None:
                    _send(conn, reply)
        except (OSError, ValueError, KeyError, AttributeError, TypeError):   # gone, or not a replica's message
            pass
        finally:
            with self.lock:   # its connection closed: lost at once (unless it said it is done)
                self.leaders.pop(id(conn), None)
                rec = self.replicas.get(replica) if replica is not None else None
                if rec is not None and rec["conns"].get(id(conn)):
                    rec["conns"][id(conn)] = False
                    self.lock.notify_all()

    def _stale(self, r, conn):
        """The answer to a request from a start of replica ``r`` that a newer start replaced."""
        rec, said = self.replicas.get(r), self.leaders.get(conn)
        if conn is None or said is None or rec is None or rec["hello"] == said:
            return None
        return {"replaced": f"started again elsewhere ({rec['where']}): this start stops, the new one goes on"}

    def _hello(self, msg, conn):
        with self.lock:
            r, settings = msg["replica"], msg.get("settings")
            training = any(not rec["done"] and rec["live"] for rec in self.replicas.values())
            if not training and (self.final is not None or self.stop_at is not None and self.committed >= self.stop_at):
                return {"over": f"the run at {self.address} is over: it ended at step {self.committed}"
                                f"{' (final weights written by replica %s)' % self.final['replica'] if self.final else ''}"
                                f"; a coordinator serves one run: start a new one (a new --run-dir) for another"}
            if settings is not None and self.settings is None:
                self.settings = settings
                self._write({"settings": settings})
            elif settings is not None and settings != self.settings:
                diff = "; ".join(f"{k} {settings.get(k)} against the run's {self.settings.get(k)}"
                                 for k in sorted(set(settings) | set(self.settings))
                                 if settings.get(k) != self.settings.get(k))
                return {"refused": f"replica {r} cannot join the run at {self.address}: {diff}"}
            old = self.replicas.get(r)
            where = msg.get("where", "?")
            if old is not None and not old["done"] and self._alive(old):
                self._event(r, "replaced")
                self._say(f"replica {r} started again ({where}) while its start at {old['where']} lives: the new "
                          f"start takes over, the old one is told to stop")
            self._event(r, "rejoined" if old else "joined")
            self._say(f"replica {r} {'rejoined' if old else 'joined'} ({where}), at step {msg['step']}")
            self.hellos += 1   # (which start of a replica this is: a restarted one gets new groups)
            self.replicas[r] = {"hello": self.hellos, "beats": dict.fromkeys(range(msg.get("ranks", 1)), time.time()),
                                "step": msg["step"], "asked": None, "done": False, "conns": {conn: True},
                                "reply": None, "live": True, "incarnation": msg.get("incarnation", 0),
                                "where": where}
            self.leaders[conn] = self.hellos
            self.lock.notify_all()
            return {"store_port": self.store.port, "beat": self.detect / 5, "hello": self.hellos}

    def _beat(self, msg, conn):
        with self.lock:
            rec = self.replicas.get(msg["replica"])   # (a beat of an earlier start of the replica: not its)
            if rec is not None and msg.get("hello", rec["hello"]) == rec["hello"] and msg.get("rank", 0) in rec["beats"]:
                rec["beats"][msg.get("rank", 0)] = time.time()
                rec["conns"].setdefault(conn, True)
        return None

    def _alive(self, rec) -> bool:
        now = time.time()
        return not rec["done"] and all(now - t < self.detect for t in rec["beats"].values()) \
            and all(rec["conns"].values())

    def _event(self, r, what):
        self.events.append((round(time.time() - self.t0, 3), r, what))

    def _quorum(self, msg, conn):
        r = msg["replica"]
        with self.lock:
            stale = self._stale(r, conn)
            if stale:
                return stale
            rec = self.replicas[r]
            rec.update(step=msg["step"], asked=time.time(), reply=None)
            self.lock.notify_all()
            self._form()
            while rec["reply"] is None:
                if self.replicas.get(r) is not rec:   # a new start of this replica said hello: this one is gone
                    return self._stale(r, conn) or {"stop": True, "step": msg["step"]}
                self.lock.wait(0.05)
                self._form()
            reply, rec["reply"] = rec["reply"], None
            return reply

    def _vote(self, msg, conn):
        with self.lock:
            stale = self._stale(msg["replica"], conn)
            if stale:
                return stale
            qid, q = msg["qid"], self.quorum
            if qid not in self.decisions and q is not None and q["qid"] == qid:
                q["votes"][msg["replica"]] = bool(msg["ok"])
                q["info"][msg["replica"]] = msg.get("info") or {}
                q["first_vote"] = q["first_vote"] or time.time()
                self.lock.notify_all()
                self._decide()
                while qid not in self.decisions:
                    self.lock.wait(0.05)
                    self._decide()
            return {"commit": self.decisions.get(qid, False)}

    def _done(self, msg, conn):
        """A replica finished: the first at the run's newest committed step writes the final
        weights (every replica's there are alike: written once; again by one that trained on
        alone to a later step)."""
        with self.lock:
            stale = self._stale(msg["replica"], conn)
            if stale:
                return stale
            rec = self.replicas[msg["replica"]]
            rec.update(done=True, step=msg["step"])
            self._event(msg["replica"], "finished")
            write = msg["step"] > 0 and msg["step"] >= self.committed and (self.final is None
                                                                           or self.final["step"] < msg["step"])
            if write:
                self.final = {"replica": msg["replica"], "step": msg["step"]}
                self._write({"final": self.final})
            self._say(f"replica {msg['replica']} finished at step {msg['step']}"
                      + (" and writes the final weights" if write else ""))
            self.lock.notify_all()
        return {"write": write}

    def _status(self, msg, conn):
        with self.lock:
            last = next((q for q in reversed(self.history) if q.get("commit")), None)
            self._liveness()
            return {"replicas": {r: {"alive": rec["live"], "step": rec["step"], "done": rec["done"],
                                     "incarnation": rec["incarnation"], "where": rec["where"]}
                                 for r, rec in self.replicas.items()},
                    "last_commit": last and {k: last[k] for k in ("qid", "step", "members")},
                    "committed": self.committed, "over": self.final is not None,
                    "faults_pending": len(self.faults), "handed": self.handed,
                    "history": self.history if msg.get("history") else None, "events": self.events,
                    "t": time.time() - self.t0}

    def _arm(self, msg, conn):
        with self.lock:
            self.faults += msg.get("faults", [])
            if "stop_at" in msg:
                self.stop_at = msg["stop_at"]
            self.min_replicas = msg.get("min_replicas", self.min_replicas)
        return {}

    # ---- forming quorums and deciding votes ----
    def _tick(self):
        while not self._closed.is_set():
            with self.lock:
                self._decide()
                self._form()
                self.lock.notify_all()
            time.sleep(0.05)

    def _liveness(self):
        """Each replica's liveness now, a change recorded as an event: before any decision
        that reads it, so the events name every replica a decision left out."""
        for r, rec in self.replicas.items():
            live = self._alive(rec)
            if live != rec["live"]:
                rec["live"] = live
                if not rec["done"]:
                    self._event(r, "back" if live else "lost")
                    self._say(f"replica {r} {'is back' if live else 'lost'}"
                              + ("" if live else " (a connection closed, or no beat for --detect seconds)"))

    def _form(self):
        self._liveness()
        if self.quorum is not None and self.quorum["qid"] not in self.decisions:
            return   # a vote is still open
        live = {r: rec for r, rec in self.replicas.items() if rec["live"]}
        asking = {r: rec for r, rec in live.items() if rec["asked"] is not None}
        if not asking or len(asking) < self.min_replicas:
            return
        now = time.time()
        if len(asking) < len(live) and now - min(rec["asked"] for rec in asking.values()) < self.join_timeout:
            return
        newest = max(rec["step"] for rec in asking.values())
        finished = max([rec["step"] for rec in self.replicas.values() if rec["done"]], default=-1)
        if self.stop_at is not None and newest >= self.stop_at or newest < finished:
            for r, rec in asking.items():   # the run is over (or every peer with newer state has finished)
                rec.update(reply={"stop": True, "step": newest, "over": f"the run at {self.address} is over: "
                                  f"it ended at step {max(newest, finished)}"}, asked=None)
            self.lock.notify_all()
            return
        if newest < self.committed:   # the asking are behind the run's newest committed step
            if any(rec["step"] >= self.committed for rec in live.values()):
                self.no_holder = None
                return   # a live replica holds it: wait for it (it heals them; no step is committed twice)
            self.no_holder = self.no_holder or now
            if now - self.no_holder < self.join_timeout:
                return   # (a replica that holds it may be back: a hung one continued)
            self._write({"rewind": newest, "lost": [newest, self.committed - 1]})
            self._say(f"no live replica holds step {self.committed} (every replica that had it is gone): the run "
                      f"goes back to step {newest}, the newest any replica holds; steps {newest} to "
                      f"{self.committed - 1} will be committed again (the record says so)")
            self.committed = newest
        elif newest > self.committed:   # (a coordinator without the run's record: the record starts here)
            self._write({"start": newest})
            self.committed = newest
        self.no_holder = None
        members = sorted(asking)
        source = min(r for r in members if asking[r]["step"] == newest)
        heal = {r: source for r in members if asking[r]["step"] < newest or self.init_sync and newest == 0 and r != source}
        self.next_qid += 1
        prev, who = self.quorum, [(r, asking[r]["hello"]) for r in members]
        if prev is None or prev["who"] != who or not self.decisions.get(prev["qid"]):
            self.next_group += 1   # the same starts of the same replicas after a commit keep their groups
        if prev is None or prev["members"] != members:
            self._say(f"quorum {self.next_qid}: replicas {members} at step {newest}")
        for r in sorted(heal):
            self._say(f"replica {r} heals from replica {heal[r]} at step {newest}")
        for old in [k for k in self.decisions if k < self.next_qid - 1000]:   # (a vote that old is long stale)
            del self.decisions[old]
        q = {"qid": self.next_qid, "group": self.next_group, "who": who, "step": newest, "members": members,
             "heal": heal, "votes": {}, "info": {},
             "first_vote": None, "formed": round(now - self.t0, 3)}
        self.quorum = q
        self.history.append({k: v for k, v in q.items() if k not in ("votes", "first_vote", "who")})
        faults = {r: [] for r in members}
        for f in list(self.faults):   # (the tests' failures, handed to the replica that acts them out)
            target = f["replica"] if f["replica"] is not None else (source if heal else None)
            if target in faults:
                faults[target].append(f["fault"])
                self.faults.remove(f)
                self.handed = newest
        for r in members:
            asking[r].update(asked=None, reply={"qid": q["qid"], "group": q["group"], "step": newest, "members": members,
                                                "heal": {str(k): v for k, v in heal.items()}, "faults": faults[r]})
        self.lock.notify_all()

    def _decide(self):
        self._liveness()
        q = self.quorum
        if q is None or q["qid"] in self.decisions:
            return
        votes, members = q["votes"], q["members"]
        gone = [r for r, h in q["who"] if r not in votes and (not self.replicas[r]["live"]
                                                              or self.replicas[r]["hello"] != h)]   # lost, or replaced
        if len(votes) == len(members):
            commit = all(votes.values()) and q["step"] == self.committed
        elif gone:
            commit = False   # a member went before it voted
        elif q["first_vote"] and time.time() - q["first_vote"] > self.join_timeout:
            commit = False   # alive, but silent
        else:
            return
        self.decisions[q["qid"]] = commit
        if not commit:   # (a member still waiting in this step's all-reduce, group or heal stops: ReplicaManager)
            self.store.set(f"aborted/{q['qid']}", "1")
        h = self.history[-1]
        h.update(commit=commit, decided=round(time.time() - self.t0, 3), votes=dict(votes), info=q["info"], lost=gone)
        if commit:
            self._write({"commit": q["step"], "members": members})
            self.committed = q["step"] + 1
            for r in members:
                self.replicas[r]["step"] = q["step"] + 1
            last = next((p for p in reversed(self.history[:-1]) if p.get("commit")), None)
            if self.committed % self.log_every == 0 or last is None or last["members"] != members:
                aborted = sum(1 for p in self.history if p.get("commit") is False)
                self._say(f"step {q['step']} committed by replicas {members} ({aborted} attempt(s) aborted so far, "
                          f"{time.time() - self.t0:.0f} s in)")
        else:
            why = "; ".join(f"{w} {', '.join(map(str, rs))}" for rs, w in (
                (gone, "lost:"), (sorted(r for r, ok in votes.items() if not ok), "failed:")) if rs)
            self._say(f"step {q['step']} aborted (members {members}; {why or 'a member silent past --join-timeout'}):"
                      f" committed by nobody, redone")
        self.lock.notify_all()


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address, daemon_threads = True, True


class ReplicaManager:
    """One replica's part (torchft's Manager), on every rank of the replica: a quorum at each
    step boundary, heal from a live peer when behind, the gradients averaged over the quorum,
    and a vote on whether the step commits.

        manager = ReplicaManager(model, opt, "HOST:29510", replica_id=r)   # every rank of replica r
        while manager.start_step(steps):              # False once the run is over
            x, y = my_shard(r, manager.step)            # the data position is the step
            model(x, y).backward(); model.finish_gradient_synchronization()   # inside the replica
            if manager.should_commit(manager.all_reduce_gradients()):
                model.clip_grad_norm_(1.0); opt.step()
            opt.zero_grad()

    ``module``'s parameters and buffers are what this rank holds (a shard under FSDP): rank k
    of every replica must hold the same tensors (the same composition inside each replica).
    ``process_group``: the replica's own ranks (default: the world). ``timeout``: seconds
    gloo lets a cross-replica operation wait before it fails it. For the all-reduce it is a
    safety net: a peer that is lost or hangs is left out by the coordinator within its
    ``detect`` (its beats stop), and the members waiting on it stop then. It must exceed how
    late a live peer can come (its backward on a slow or shared machine) and the largest
    transfer, which grow with the model. As ``detect``'s window (2 s), it failed nearly every
    step of a 323 M-parameter model on 2 CPU cores. A heal's source that hangs holds its
    joiner up to ``timeout`` (one killed fails the heal at once). A peer that hangs and is
    never ended holds a dropped group's operation as long, and with it the exit of the
    process that holds that group.
    The cross-replica groups are gloo's: gradients on a GPU are reduced from device memory, a
    heal's tensors travel through host memory (gloo's send takes CPU tensors only).
    ``heal_hook(i, n)``: called by a heal's source after its i-th tensor of n (the tests'
    kill during a heal); ``quorum_hook(q)``: with each quorum's answer, before its group is
    made (the tests' kill there). ``step``: the committed step this replica starts from (its own
    checkpoint's; the quorum heals it if the others are further); ``incarnation``: which
    start of this replica it is (the coordinator reports it: a launcher tells a replaced
    replica's new start from the old one). ``close()``: this rank's beats stop and its
    connections close (start_step does it when it returns False; so does dropping the manager).

    ``bucket_mb``: where a replica is one rank (``module`` the model alone, its gradients
    final when backward makes them), the cross-replica all-reduce runs during backward, a
    bucket of about that many MB at a time as its gradients arrive (the first
    ``first_bucket_mb``), as DDP's does, and all_reduce_gradients waits for the last; None:
    one all-reduce after backward. To accumulate over micro-batches with it, run every
    backward but the last inside ``manager.no_sync()`` (a gradient made twice in a step
    outside it is an error, not a wrong sum).
    """

    def __init__(self, module, optimizer, coordinator: str, replica_id: int, process_group=None, timeout=300.0,
                 step=0, incarnation=0, bucket_mb=None, first_bucket_mb=1.0, settings=None, connect_wait=30.0,
                 say=None):
        self.module, self.optimizer, self.group = module, optimizer, process_group
        self.rank, self.replica_id, self.timeout, self.step = dist.get_rank(process_group), replica_id, timeout, step
        self.size = dist.get_world_size(process_group)
        self.device = next(module.parameters()).device
        self.coordinator, self.qid, self.group_id, self.pg, self.members = coordinator, None, None, None, []
        self.faults, self.say, self.writer = [], say, False
        self.heal_hook, self.quorum_hook, self.heals, self.info = None, None, [], {}
        self.first, self.commits, self.aborts = None, 0, 0   # (this start's own counts)
        self.history = None   # (the writer's first rank: the coordinator's history of the run, as it ends)
        host, port = coordinator.rsplit(":", 1)
        if bucket_mb is not None and self.size > 1:   # (before the hello: nothing to undo)
            raise ValueError(f"bucket_mb: the all-reduce runs during backward only where a replica is one rank "
                             f"(this one has {self.size}: its gradients are final after its own synchronization)")
        hello = None
        if self.size > 1:   # every rank here before the hello: each must beat within ``detect`` of it
            dist.barrier(group=process_group)
        if self.rank == 0:
            try:
                self._sock = connect(coordinator, connect_wait)
                self._lines = self._sock.makefile("r")
                hello = self._ask({"op": "hello", "replica": replica_id, "step": step, "incarnation": incarnation,
                                   "ranks": self.size, "settings": settings,
                                   "where": f"{socket.gethostname()}, pid {os.getpid()}"})
                if "over" in hello or "refused" in hello:
                    raise NotJoined(hello.get("over") or hello["refused"])
            except ReplicaStopped as e:
                hello = {"stopped": type(e).__name__, "message": str(e)}
        hello = self._share(hello)
        beats, self._stop = connect(coordinator, connect_wait), threading.Event()            # every rank: one hung
        threading.Thread(target=_beat, daemon=True, args=(                                  # or gone is seen
            beats, {"op": "beat", "replica": replica_id, "rank": self.rank, "hello": hello["hello"]}, hello["beat"],
            self._stop)).start()
        self.close = weakref.finalize(self, _closing, self._stop, beats, *([self._sock] if self.rank == 0 else []))
        self.store = dist.TCPStore(host, hello["store_port"], is_master=False,
                                   timeout=datetime.timedelta(seconds=max(60.0, timeout)))
        self.buckets, self.armed, self.syncing, self.inflight, self.retired = [], False, True, [], []
        if bucket_mb is not None:
            self._bucket(bucket_mb, first_bucket_mb)

    def _bucket(self, bucket_mb, first_bucket_mb):
        """The parameters in buckets of about ``bucket_mb`` MB (the first ``first_bucket_mb``:
        its all-reduce starts early), in reverse order (roughly the order backward makes their
        gradients), each parameter's hook counting its bucket down."""
        size = 0
        for p in reversed([p for p in self.module.parameters() if p.requires_grad]):
            limit = (first_bucket_mb if len(self.buckets) == 1 else bucket_mb) * 2**20
            if not self.buckets or size + p.numel() * p.element_size() > limit and self.buckets[-1]:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        me = weakref.ref(self)   # (the hooks do not keep the manager alive)

        def ready(p, b):   # (a parameter's gradient is made: nothing more where no bucket is armed)
            manager = me()
            if manager is not None and manager.armed and manager.syncing:
                manager._ready(p, b)
        for b, ps in enumerate(self.buckets):
            for p in ps:
                p.register_post_accumulate_grad_hook(functools.partial(ready, b=b))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside it accumulates gradients without the all-reduce (bucket_mb's)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def _ready(self, p, b):
        if id(p) in self.seen:   # (a second gradient in the step: all_reduce_gradients says so)
            self.twice = True
            return
        self.seen.add(id(p))
        self.pending[b] -= 1
        while self.launched_upto < len(self.buckets) and self.pending[self.launched_upto] == 0:
            self._launch_bucket()

    def _launch_bucket(self):
        """The next bucket's all-reduce, started (every member starts them in the same order)."""
        self.inflight.append(self._launch(self.buckets[self.launched_upto]))
        self.launched_upto += 1

    # ---- the coordinator (the replica's first rank talks to it) ----
    WAIT_LINE = 30.0   # seconds between the lines that say this replica still waits for the coordinator

    def _ask(self, msg):
        """The coordinator's answer to ``msg`` (a quorum's may take long: every WAIT_LINE
        seconds a line says what it waits for)."""
        try:
            _send(self._sock, msg)
            began = time.time()   # (one answer a request, nothing unasked: the socket holds all that is unread)
            while not select.select([self._sock], [], [], self.WAIT_LINE)[0]:
                self._tell(f"waiting {time.time() - began:.0f} s for the coordinator's answer to its {msg['op']} "
                           f"at step {self.step}" + (" (a quorum forms when every live replica asks, with at least "
                                                     "--min-replicas)" if msg["op"] == "quorum" else ""))
            line = self._lines.readline()
        except OSError as e:
            raise CoordinatorGone(f"the coordinator at {self.coordinator} is gone ({e})") from None
        if not line:
            raise CoordinatorGone(f"the coordinator at {self.coordinator} is gone (its connection closed)")
        reply = json.loads(line)
        if "replaced" in reply:
            raise Replaced(reply["replaced"])
        return reply

    def _tell(self, line):
        if self.say is not None:
            self.say(f"replica {self.replica_id}: {line}")

    def _share(self, obj):
        """Rank 0's ``obj`` on every rank of the replica (a stop on rank 0 too: it is raised everywhere)."""
        box = [obj]
        if self.size > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group or dist.group.WORLD, 0), group=self.group)
        if isinstance(box[0], dict) and "stopped" in box[0]:
            raise STOPS[box[0]["stopped"]](box[0]["message"])
        return box[0]

    def _leader(self, msg):
        """Rank 0 asks the coordinator; every rank gets the answer."""
        reply = None
        if self.rank == 0:
            try:
                reply = self._ask(msg)
            except ReplicaStopped as e:
                reply = {"stopped": type(e).__name__, "message": str(e)}
        return self._share(reply)

    def _aborted(self) -> bool:
        """Whether the coordinator aborted this quorum's step (a key it sets in its store)."""
        try:
            return bool(self.store.check([f"aborted/{self.qid}"]))
        except RuntimeError:   # its store is gone with the coordinator: the vote finds it gone
            return True

    def _abortable(self, fn) -> bool:
        """``fn()`` in a thread of its own, waited for here in 50 ms pieces: False where it
        raised, or where the coordinator aborted this quorum's step meanwhile (a member lost:
        gloo's own wait would last the group's timeout; the thread is left to end there)."""
        done, failed = threading.Event(), []

        def run():
            try:
                fn()
            except Exception:   # (gloo's errors, and a peer's garbled layout)
                failed.append(True)
            finally:
                done.set()
        threading.Thread(target=run, daemon=True).start()
        while not done.wait(0.05):
            if self._aborted():
                return False
        return not failed

    # ---- a step ----
    def start_step(self, steps=None) -> bool:
        """Join the next quorum (False: the run is over: --steps reached, or the coordinator
        says stop); heal from a live peer where this replica is behind, or serve a heal."""
        if steps is not None and self.step >= steps:
            return self._finished()
        q = self._leader({"op": "quorum", "replica": self.replica_id, "step": self.step})
        if q.get("stop"):
            if not self.commits and not self.heals and self.close.alive:   # it joined a run that is over
                self._finished()
                raise NotJoined(f"{q['over']}; replica {self.replica_id} has nothing to join: a coordinator serves "
                                f"one run, start a new one (a new --run-dir) for another")
            return self._finished()
        self.qid, self.faults, self.ok, self.info = q["qid"], q["faults"], True, {}
        if self.quorum_hook is not None:
            self.quorum_hook(q)
        if q["group"] != self.group_id:   # the members changed, or the last step aborted: a group of their own
            self._new_group(q)
        heal = {int(k): v for k, v in q["heal"].items()}
        if heal and self.pg is None:
            self.ok = False
        elif self.replica_id in heal or self.replica_id in heal.values():
            self.ok = self._heal(heal, q["step"])
        self.armed = bool(self.buckets) and self.ok and self.pg is not None   # (bucket_mb: during backward)
        self.pending, self.seen, self.twice = [len(ps) for ps in self.buckets], set(), False
        self.inflight, self.launched_upto = [], 0
        return True

    def _retire_group(self):
        """Drop this quorum's group. One with an operation still pending (on a peer that gave
        up on it) is kept until that ends: destroying a gloo group waits for its operations,
        up to its timeout."""
        pending = [w for _, _, w in self.inflight if w is not None and not w.is_completed()]
        if pending and self.pg is not None:
            self.retired.append((self.pg, pending))
        self.retired = [(pg, ws) for pg, ws in self.retired if not all(w.is_completed() for w in ws)]
        self.pg, self.inflight = None, []

    def _finished(self) -> bool:
        """The run is over for this replica: it says so, then every rank closes (after the
        word: a rank's connection closing first would count as its replica lost). ``writer``:
        whether this replica writes the final weights (the coordinator names one: the first to
        finish at the run's newest step)."""
        if self.close.alive:
            said = None
            if self.rank == 0:
                with contextlib.suppress(ReplicaStopped):
                    said = self._ask({"op": "done", "replica": self.replica_id, "step": self.step})
            if self.rank == 0 and said and said.get("write"):   # the run's membership, for its timeline
                with contextlib.suppress(ReplicaStopped):
                    self.history = self._ask({"op": "status", "history": True})["history"]
            said = self._share(said) if self.size > 1 else said
            self.writer = bool(said and said.get("write"))
            self.close()
        return False

    def _new_group(self, q):
        self._retire_group()
        self.group_id, self.members = q["group"], q["members"]
        if len(self.members) > 1:
            store = dist.PrefixStore(f"group{q['group']}/rank{self.rank}", self.store)
            options = dist.ProcessGroupGloo._Options()   # listening where GLOO_SOCKET_IFNAME says, as torch's groups do
            iface = os.environ.get("GLOO_SOCKET_IFNAME")
            options._devices = [dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0]) if iface
                                else dist.ProcessGroupGloo.create_default_device()]
            options._timeout = datetime.timedelta(seconds=self.timeout)
            made = []   # (a member that went before the group met would hold it up to the timeout: abortable)
            if not self._abortable(lambda: made.append(dist.ProcessGroupGloo(
                    store, self.members.index(self.replica_id), len(self.members), options))):
                made.clear()
            self.pg = made[0] if made else None

    def all_reduce_gradients(self) -> bool:
        """Each gradient this rank holds averaged with rank k of every member (one flat
        all-reduce, or bucket_mb's buckets, most already started during backward; a gradient
        no member has stays None). False: it failed (a member lost)."""
        if not self.ok or len(self.members) > 1 and self.pg is None:
            return False
        if len(self.members) == 1:
            return True
        if self.twice:
            raise RuntimeError("a gradient was made twice in one step with bucket_mb's all-reduce during backward: "
                               "run every backward of the step but the last inside manager.no_sync()")
        if self.armed:   # the buckets backward has not finished (parameters that got no gradient), in order
            while self.launched_upto < len(self.buckets):
                self._launch_bucket()
        else:
            self.inflight = [self._launch(list(self.module.parameters()))]
        self.armed = False
        for w in self.inflight:   # at the first failure the others are not waited for: a member is lost
            if not self._finish(*w):   # (nor on the group's end: _retire_group)
                return False
        return True

    def _launch(self, params):
        """The all-reduce of ``params``' gradients (a flag each: a gradient no member has
        stays None), started: (params, its flat buffer, the work; None where it failed)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(
            [float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)])
        try:
            return params, flat, self.pg.allreduce([flat])
        except RuntimeError:
            return params, flat, None

    def _wait(self, work) -> bool:
        """Wait for a cross-replica all-reduce: False where it failed, or where the coordinator
        aborted this quorum's step meanwhile (a member lost: a work that waits on a peer that
        gave up may otherwise wait out the group's timeout)."""
        while True:
            try:
                work.wait(datetime.timedelta(milliseconds=50))
                return True
            except RuntimeError:
                if work.is_completed():   # it failed, or it ended after the wait above gave up: ask it again
                    try:
                        work.wait()
                        return True
                    except RuntimeError:
                        return False
                if self._aborted():
                    return False

    def _finish(self, params, flat, work) -> bool:
        if work is None or not self._wait(work):
            return False
        flat[:-len(params)] /= len(self.members)
        had = flat[-len(params):].tolist()
        at = 0
        for p, h in zip(params, had):   # (in place where it has one: a bucket's view under DDPBucketed)
            mean = flat[at:at + p.numel()].view_as(p)
            if not h:
                p.grad = None
            elif p.grad is None:
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)
            at += p.numel()
        return True

    def should_commit(self, ok: bool) -> bool:
        """Every rank of the replica says whether its part went well; the first rank votes;
        the coordinator commits the step only if every member voted ok. True: step the
        optimizer (and the manager's step moves on); False: drop the gradients."""
        flags = torch.tensor([0.0 if ok else 1.0, float(bool(self.info))], device=self.device)
        if self.size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)   # anyone failed; anyone healed
        failed, healed = flags.tolist()
        info = [self.info] * self.size
        if healed and self.size > 1:   # each rank's figures of the heal
            dist.all_gather_object(info, self.info, group=self.group)
        reply = self._leader({"op": "vote", "replica": self.replica_id, "qid": self.qid, "ok": not failed,
                              "info": {k: [i.get(k) for i in info] for k in info[0]} if healed else {}})
        if reply["commit"]:
            self.first = self.step if self.first is None else self.first
            self.step += 1
            self.commits += 1
        else:
            self.aborts += 1
            self._retire_group()   # made again at the next quorum
            self.group_id = None
        return reply["commit"]

    # ---- healing ----
    def _state(self) -> list:
        """This rank's tensors a heal carries, in a fixed order: parameters, buffers, then
        each parameter's optimizer state by key."""
        params = list(self.module.parameters())
        out = [p.data for p in params] + list(self.module.buffers())
        for p in params:
            st = self.optimizer.state.get(p, {})
            out += [st[k] for k in sorted(st) if torch.is_tensor(st[k])]
        return out

    def _layout(self) -> dict:
        params = list(self.module.parameters())
        state = [{k: (list(v.shape), str(v.dtype).split(".")[1], v.device == p.device) if torch.is_tensor(v)
                  else v for k, v in self.optimizer.state.get(p, {}).items()} for p in params]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": state, "groups": groups, "step": self.step}

    def _send_obj(self, obj, dst):
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()

    def _recv_obj(self, src):
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([n], src, 0).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        return json.loads(bytes(data.numpy()).decode())

    def _heal(self, heal: dict, step: int) -> bool:
        """The source sends each joiner its layout and every tensor of its state (rank k to
        rank k), then their digest; a joiner makes its optimizer state to that layout,
        receives (the next tensor already on its way while it takes one in) and checks the
        digest against what it received (on a CPU, its state itself). Each side hashes a
        tensor while the next one travels (_Digest). The ranks of a replica agree before a
        joiner takes the step: where any of them failed (a peer lost midway), it stays behind
        (and heals again) and this returns False."""
        began, index, joiner = time.perf_counter(), self.members.index, self.replica_id in heal
        peers = [heal[self.replica_id]] if joiner else [j for j, s in heal.items() if s == self.replica_id]
        tensors, result, dropped = self._state(), {}, threading.Lock()   # (held by whoever writes into the state)
        abandoned = []

        def receive():   # (in a thread: every wait ends when the coordinator aborts the step)
            src = index(peers[0])
            layout = self._recv_obj(src)
            with dropped:
                if abandoned:
                    return
                for p, st in zip(self.module.parameters(), layout["state"]):
                    self.optimizer.state[p] = {
                        k: torch.zeros(v[0], dtype=getattr(torch, v[1]), device=p.device if v[2] else "cpu")
                        if isinstance(v, list) else v for k, v in st.items()}
                for g, given in zip(self.optimizer.param_groups, layout["groups"]):
                    g.update(given)
                result["tensors"] = self._state()
            state, digest = result["tensors"], _Digest(layout["step"])

            def post(i):   # (a host buffer: gloo receives into CPU tensors only)
                buf = torch.empty(state[i].shape, dtype=state[i].dtype)
                return buf, self.pg.recv([buf], src, 2 + i)
            with digest:
                coming = post(0) if state else None
                for i, t in enumerate(state):
                    buf, work = coming
                    work.wait()
                    coming = post(i + 1) if i + 1 < len(state) else None
                    with dropped, torch.no_grad():
                        if abandoned:
                            return
                        t.copy_(buf)
                    digest.add(t.detach() if t.device.type == "cpu" else buf)   # (the state itself on a CPU)
                sent = torch.empty(len(digest.value()), dtype=torch.uint8)
                self.pg.recv([sent], src, 2 + len(state)).wait()
                result["exact"] = bytes(sent.numpy()) == digest.value()
            result["step"] = layout["step"]

        def send():
            layout, digest = self._layout(), _Digest(self.step)
            with digest:
                for j in peers:
                    self._send_obj(layout, index(j))
                for i, t in enumerate(tensors):
                    host = t.detach().cpu().contiguous()   # (one copy from a device: sent and hashed)
                    works = [self.pg.send([host], index(j), 2 + i) for j in peers]
                    digest.add(host)
                    for work in works:
                        work.wait()
                    if self.heal_hook is not None:
                        self.heal_hook(i, len(tensors))
                end = torch.frombuffer(bytearray(digest.value()), dtype=torch.uint8)
                for j in peers:
                    self.pg.send([end], index(j), 2 + len(tensors)).wait()
            result["exact"] = True
        exact = self._abortable(receive if joiner else send) and result.get("exact", False)
        with dropped:
            abandoned.append(True)   # (a thread still receiving writes nothing more)
        tensors = result.get("tensors", tensors)
        got = result.get("step")
        flag = torch.tensor([float(exact)], device=self.device)
        if self.size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)   # every rank of the replica, or none
        if not flag.item():
            return False
        if joiner:
            self.step = got
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.heals.append({"role": "joiner" if joiner else "source", "peers": peers, "step": step, "bytes": nbytes,
                           "seconds": time.perf_counter() - began, "exact": exact})
        self.info = {"heal_bytes": nbytes, "heal_s": self.heals[-1]["seconds"], "exact": exact,
                     "role": self.heals[-1]["role"]}
        return True
# ---- end copy: fault-tolerant replicas ----


import placement                      # noqa: E402  (the script's part: the kit beyond the copy)
import sharded_checkpoint             # noqa: E402

ddp_mod = common.load_script(common.ROOT / "05_bucketed_ddp.py")
fsdp_mod = common.load_script(common.ROOT / "07_fsdp.py")

NAME = "14_fault_tolerant_dp"
SCRIPT = str(Path(__file__).resolve())
LR, CLIP = 1e-3, 1.0
# the replicas' weights against the replay's: each tensor's distance over how far the replay moved it from the
# start. AdamW amplifies float32's reordering element by element (the H200 at 121160e, the small LM: max
# |diff| 1.3e-4 and 1.3e-3, every replica alike and every heal exact), far less so in that measure: the
# members summed in another order, 4e-6 (nano, 12 steps); a step's average a replica short, 2e-2 to 2e-1
# (tests/test_14_fault_tolerant_dp.py). Where the run's own arithmetic amplifies reordering past it the check
# cannot tell, and says so (the small LM over 40 steps, its gradients off by a relative 1e-7: 4e-2 and more,
# measured on the CPU).
TOLERANCE = 1e-4


# ---- a replica: the training loop every rank of it runs -----------------------------------
def build(ctx, args):
    """The kit's LM (the same weights on every replica: the seed), inside the replica under
    --inner over its ranks (one rank: the model alone), and AdamW."""
    model = common.build_lm(args.model_size, args.context_length, ctx.device, args.seed)
    if ctx.world_size > 1:
        model = ddp_mod.DDPBucketed(model, args.bucket_mb) if args.inner == "ddp" else fsdp_mod.FSDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def overlaps(args) -> bool:
    """--overlap: whether a replica of one rank all-reduces in buckets during backward."""
    return args.overlap == "on" or args.overlap == "auto" and args.device == "cuda"


def shard_batch(args, replica: int, step: int, device):
    """Replica ``replica``'s batch of step ``step``: its own fixed data shard (a seed of its
    own), the same wherever and whenever it runs."""
    return common.lm_batch(args.batch_size, args.context_length, step, args.seed * 1000 + 17 + replica, device)


def act_out(faults, ctx, when=None):
    """The scenario's failures, handed out by the coordinator with a quorum: kill -9 of the
    replica's last rank (when the step starts, or "kill@WHEN": at that point of the step),
    SIGSTOP of it (its beats stop: it hangs; its first rank still beats)."""
    if ("kill" if when is None else f"kill@{when}") in faults and ctx.rank == ctx.world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if "stop" in faults and ctx.rank == ctx.world_size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)


def arm_hooks(manager, ctx):
    """The scenario's failures inside the manager: a heal's source killed midway
    ("healkill"), a replica killed at the quorum, before its group is made."""
    manager.heal_hook = lambda i, n: act_out(["kill"] if "healkill" in manager.faults and i == n // 2 else [], ctx)
    manager.quorum_hook = lambda q: act_out(q["faults"], ctx, "quorum")


def replica_settings(args) -> dict:
    """What every replica of a run must share (the coordinator refuses a replica whose differ;
    the replay rebuilds the run from them)."""
    return {k: getattr(args, k) for k in ("model_size", "context_length", "batch_size", "seed", "replica_ranks", "inner")}


def replica_worker(ctx, args):
    """One replica's training, on each of its ranks: from its own checkpoint (--run-dir,
    where one is) or step 0, a quorum each step, until --steps or the coordinator says
    stop; a line every --log-every committed steps. Where the coordinator is gone, each rank
    saves its part of the last committed step (a sharded checkpoint in --run-dir) before the
    replica ends. The replica the coordinator names writes the final weights to
    --run-dir/final (once for the run). Returns rank 0's record: the weights (whole), the
    step, the heals, each step's seconds, this start's counts."""
    model, opt = build(ctx, args)
    sync = getattr(model, "finish_gradient_synchronization", lambda: None)
    run_dir = Path(args.run_dir) if args.run_dir else None
    folder = run_dir / f"replica-{args.replica_id}" if run_dir else None
    latest = sharded_checkpoint.latest_checkpoint(str(folder)) if folder and folder.exists() else None
    start = sharded_checkpoint.load_sharded(model, opt, latest)["step"] if latest else 0
    say = (lambda line: print(line, flush=True)) if ctx.rank == 0 else None
    manager = ReplicaManager(model, opt, args.join, args.replica_id, timeout=args.timeout, step=start,
                             incarnation=args.incarnation,
                             bucket_mb=args.bucket_mb if ctx.world_size == 1 and overlaps(args) else None,
                             settings=replica_settings(args), connect_wait=args.connect_wait, say=say)
    arm_hooks(manager, ctx)
    part = args.batch_size // ctx.world_size
    times, pace, loss, began_run = [], args.pace_ms / 1000, None, time.perf_counter()
    try:
        while True:
            began = time.perf_counter()   # (a step's time counts its quorum)
            if not manager.start_step(args.steps):
                break
            act_out(manager.faults, ctx)
            x, y = shard_batch(args, args.replica_id, manager.step, ctx.device)
            out = model(x[ctx.rank * part:(ctx.rank + 1) * part], y[ctx.rank * part:(ctx.rank + 1) * part])
            out.backward()
            sync()
            act_out(manager.faults, ctx, "reduce")
            reduced = manager.all_reduce_gradients()
            act_out(manager.faults, ctx, "vote")
            if manager.should_commit(reduced):
                act_out(manager.faults, ctx, "commit")
                placement.clip_grad_norm_(model, CLIP)
                opt.step()
                loss = out.item()
                if say and manager.step % args.log_every == 0:
                    say(progress_line(manager, loss, time.perf_counter() - began_run))
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - began)
            time.sleep(max(0.0, pace - times[-1]))
    except CoordinatorGone as e:
        where = "nowhere (no --run-dir)"
        if folder:
            sharded_checkpoint.save_sharded(model, opt, str(folder), manager.step, extra={"step": manager.step})
            where = str(folder)
        raise CoordinatorGone(f"{e}: replica {args.replica_id} stops at its last committed step, {manager.step}; "
                              f"its state is saved in {where}: start a coordinator and the replicas again to go on "
                              f"from there") from None
    full = {k.removeprefix("module."): v for k, v in placement.full_state_dict(model).items()}   # (the model's names)
    if ctx.rank != 0:
        return None
    final = None
    if manager.writer and run_dir:   # (the run's final weights: once, by the replica the coordinator named)
        final = run_dir / "final" / "weights.pt"
        final.parent.mkdir(parents=True, exist_ok=True)
        common.save_file(final, lambda f: torch.save(full, f))
    return {"replica": args.replica_id, "step": manager.step, "heals": manager.heals, "times": times,
            "weights": full, "started": start, "from": manager.first, "commits": manager.commits,
            "aborts": manager.aborts, "final": final and str(final), "loss": loss}


def progress_line(manager, loss, seconds) -> str:
    got = sum(h["role"] == "joiner" for h in manager.heals)
    return (f"replica {manager.replica_id}: step {manager.step} committed with replicas {manager.members or [manager.replica_id]}"
            f", loss {loss:.4f}; this start: {manager.commits} committed, {manager.aborts} aborted, {got} heal(s) "
            f"received, {len(manager.heals) - got} served, {seconds:.0f} s")


def stopped(e: ReplicaStopped, script, replica_id: int):
    """A replica that stops without training on: one line from its first rank (in
    torchrun's error file on every rank), and its exit code."""
    line = f"{Path(script).name}: replica {replica_id}: {e}"
    if common.is_reporter():
        print(line, file=sys.stderr, flush=True)
    if e.code:
        common.torchrun_error_file(line)
        sys.exit(e.code)


def run_replica(args):
    """--join: this process is a rank of one replica (torchrun's, or the launcher's, which
    sets torchrun's variables); rank 0 writes --result where given, and prints its summary.
    A replica that stops without training on (the coordinator gone, the run over, replaced
    by a new start of it) ends with one line from its first rank."""
    if args.parent:
        common._watch_parent(args.parent)   # the launcher gone: so is this replica
    args.doing = f"replica {args.replica_id}, joining the coordinator at {args.join}"
    try:
        out = common.launch(replica_worker, args, world_size=args.replica_ranks)
    except ReplicaStopped as e:
        return stopped(e, SCRIPT, args.replica_id)
    if out is None:
        return
    digest = common.weights_sha256(out["weights"])
    if args.result:
        common.save_file(args.result, lambda f: torch.save(out, f))
    where = f"written to {out['final']}" if out["final"] else "written by another replica" if args.run_dir else "not saved"
    print(f"{done_line(args.replica_id, out)}; final weights sha256 {digest}, {where}", flush=True)


def done_line(replica_id: int, out: dict) -> str:
    """A replica's end, from its first rank's record: the step, this start's commits (from
    its first committed step, where the record has it), aborts, heals received and served."""
    got = [h for h in out["heals"] if h["role"] == "joiner"]
    healed = "; healed from " + ", ".join(f"{'a peer' if h['peers'][0] is None else 'replica ' + str(h['peers'][0])} "
                                          f"at step {h['step']}" for h in got) if got else ""   # (torchft: a peer)
    since = f" from step {out['from']}" if out.get("from") is not None and out["commits"] else ""
    return (f"replica {replica_id}: done at step {out['step']}; this start committed {out['commits']} step(s){since} "
            f"({out['aborts']} aborted{healed}; {len(out['heals']) - len(got)} heal(s) served)")


# ---- the launcher: the coordinator and each replica's ranks as processes of their own ------
FORKS = multiprocessing.get_context("forkserver")   # (torch imported once, in the server)


def _rank_entry(env: dict, argv: list, log: str, script: str = SCRIPT):
    """A rank of a replica the launcher starts: torchrun's variables, one thread, its
    output to the replica's log, then ``script`` (14, or 13's run on replicas) as --join
    runs it."""
    os.environ.update(env)
    common._loopback_only(env.get("BACKEND", "gloo"))   # its sockets on loopback, as a spawned job's
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
    sys.argv = [script, *argv]
    common.run_main(lambda: common.load_script(script).main(argv))


class Launcher:
    """What `python 14_fault_tolerant_dp.py` starts: the coordinator (in this process) and
    each replica as a job of its own, its ranks forked from the fork server (torch already
    imported) with torchrun's variables set, so a replica runs the code it runs under
    torchrun. A replica whose rank dies is ended whole and, while the run goes on, started
    again (a new incarnation); one the coordinator has left out while its processes live
    (hung) is killed and started again; one that cannot start at all is an error. Nothing
    is left running when it ends. ``script`` and ``argv(r, incarnation, address, work)``: what a
    replica's ranks run (default: this script, with ``args``' flags); ``record``: the
    coordinator's record (13's run keeps it in its run folder); ``say``: its lines;
    ``echo``: the replicas' lines (theirs, not a dying rank's traceback) printed here as
    they come; everything stays in their logs. ``address``: another service the replicas
    join (13's benchmark: torchft's lighthouse); no coordinator is started then, and
    watch() does not apply."""

    def __init__(self, args, work: Path, replicas: int, ranks: int, script=SCRIPT, argv=None, record=None, say=None,
                 echo=False, address=None):
        self.args, self.work, self.ranks, self.script = args, Path(work), ranks, script
        self.argv, self.echoed = argv or self._argv, ({} if echo else None)
        self.echo_lines = ("replica ", f"{Path(script).name}: ")   # (what echo prints: the rest stays in the logs)
        self.procs, self.incarnation, self.finished, self.log, self.stores = {}, {}, set(), [], {}
        self.coordinator = None if address else Coordinator(
            "127.0.0.1", 0, detect=args.detect, join_timeout=args.join_timeout, min_replicas=replicas, record=record,
            say=say, log_every=getattr(args, "log_every", 10))   # (the first step waits for all; then 1: run_scenario)
        self.address, self.t0 = address or self.coordinator.address, time.time()

    def ask(self, msg) -> dict:
        """The coordinator's answer, as a replica would read it (through JSON)."""
        return json.loads(json.dumps(getattr(self.coordinator, "_" + msg["op"])(msg, None)))

    def _argv(self, r, incarnation, address, work):
        a = self.args
        return ["--join", address, "--replica-id", str(r), "--incarnation", str(incarnation),
                "--replica-ranks", str(self.ranks), "--inner", a.inner, "--model-size", a.model_size,
                "--context-length", str(a.context_length), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                "--detect", str(a.detect), "--pace-ms", str(a.pace_ms), "--seed", str(a.seed), "--backend", a.backend,
                "--device", a.device, "--timeout", str(a.timeout), "--parent", str(os.getpid()),
                "--bucket-mb", str(a.bucket_mb), "--overlap", a.overlap, "--run-dir", str(work / "run"),
                "--result", str(work / f"replica-{r}.pt")]

    def start(self, r):
        """Replica r's ranks, torchrun's variables set, their output to its log."""
        self.incarnation[r] = self.incarnation.get(r, 0) + 1
        a = self.args
        self.stores[r] = common.loopback_store(self.ranks, a.timeout)   # its rendezvous, as torchrun's agent's
        port = self.stores[r].port
        argv = self.argv(r, self.incarnation[r], self.address, self.work)
        log = str(self.work / f"replica-{r}.{self.incarnation[r]}.log")
        procs = []
        for rank in range(self.ranks):
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.ranks),
                   "LOCAL_WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "BACKEND": a.backend}
            procs.append(FORKS.Process(target=common.script_call, args=(SCRIPT, "_rank_entry", env, argv, log,
                                                                        self.script)))
            procs[-1].start()
        self.procs[r] = procs
        self.event(r, f"started (incarnation {self.incarnation[r]})")

    def event(self, r, what):
        self.log.append((round(time.time() - self.t0, 3), r, what))

    def end(self, r, why=None):
        """Every process of replica r, killed (SIGKILL reaches a stopped one too)."""
        for p in self.procs[r]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs[r]:
            p.join()
        if why:
            self.event(r, why)

    def watch(self, status) -> list:
        """One look at every replica: ended ones started again (unless the run is over),
        hung ones ended and started again. Returns the replicas that have finished."""
        for r, procs in self.procs.items():
            if r in self.finished:
                continue
            codes = [p.exitcode for p in procs]
            rec = status["replicas"].get(str(r))
            if all(c == 0 for c in codes) or status["over"] and all(c == NotJoined.code for c in codes):
                self.finished.add(r)   # (or came back after the run ended: nothing to join)
                self.event(r, "finished")
            elif any(c not in (None, 0) for c in codes):
                if not rec or rec["incarnation"] != self.incarnation[r]:   # it never joined: it cannot start
                    self.end(r)
                    log = (self.work / f"replica-{r}.{self.incarnation[r]}.log").read_text().strip().splitlines()
                    raise common.LaunchError(f"replica {r} could not start (exit codes {codes}):\n"
                                             + "\n".join(log[-12:]))
                self.end(r, f"lost (exit codes {codes})")
                self.start(r)
            elif rec and rec["incarnation"] == self.incarnation[r] and not rec["alive"] and not rec["done"]:
                for p in procs:   # (a killed rank's connections close before its exit shows here)
                    p.join(0.5 / len(procs))
                codes = [p.exitcode for p in procs]
                self.end(r, f"lost (exit codes {codes})" if any(c not in (None, 0) for c in codes)
                         else "hung: left out of the quorum, its processes alive")
                self.start(r)
        return sorted(self.finished)

    def echo(self):
        """What the replicas' ranks wrote since the last look, printed (``echo``)."""
        if self.echoed is None:
            return
        for f in sorted(self.work.glob("replica-*.log")):
            with open(f, "rb") as fh:
                fh.seek(self.echoed.get(f, 0))
                got = fh.read()
            end = got.rfind(b"\n") + 1   # (whole lines only)
            if end:
                self.echoed[f] = self.echoed.get(f, 0) + end
                sys.stdout.write("".join(ln for ln in got[:end].decode(errors="replace").splitlines(True)
                                         if ln.startswith(self.echo_lines)))
        sys.stdout.flush()

    def close(self):
        self.echo()
        for r in self.procs:
            if r not in self.finished:
                self.end(r)
        if self.coordinator is not None:
            self.coordinator.close()

    def tail(self, lines=15) -> str:
        out = []
        for f in sorted(self.work.glob("*.log")):
            text = f.read_text().strip().splitlines()[-lines:]
            if text:
                out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)


def run_scenario(args, replicas: int, ranks: int, phases, deadline: float, work=None, **launcher) -> dict:
    """The run: the coordinator and ``replicas`` replicas of ``ranks`` ranks; ``phases`` a
    list of (condition(status, since), faults to arm, label): each phase's faults armed
    once its condition holds (the last one's: stop a few steps on). Returns every replica's
    final record (each writes it to WORK/replica-R.pt), the coordinator's history and
    events, the launcher's log and when each phase acted. ``launcher``: the Launcher's
    script, argv, record, say and echo; ``work``: where the logs and records go and stay
    (default: a temporary folder, removed at the end)."""
    keep = work is not None
    work = Path(work) if keep else Path(tempfile.mkdtemp(prefix="ft-"))
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("replica-*.pt") if keep else ():
        f.unlink()
    job = Launcher(args, work, replicas, ranks, **launcher)
    acted = []
    try:
        for r in range(replicas):
            job.start(r)
        since, phase = -1, 0
        while True:
            status = job.ask({"op": "status"})
            done = job.watch(status)
            job.echo()
            if len(done) == replicas:
                break
            last = status["last_commit"]
            if last is not None and since < 0:   # every replica stepped together once: from now on, any survivor
                job.ask({"op": "arm", "min_replicas": 1})
                since = 0
            if phase < len(phases) and last is not None:
                cond, arm, label = phases[phase]
                if cond(status, since):
                    job.ask({"op": "arm", **arm(last)})
                    acted.append({"t": round(status["t"], 3), "step": last["step"], "phase": label})
                    since, phase = last["step"], phase + 1
            if time.time() - job.t0 > deadline:   # where it stood: steps committed, aborted, the open quorum
                status = job.ask({"op": "status", "history": True})
                lines = timeline_lines(timeline(status, replicas), acted)
                lines += [f"  open at {status['t']:.1f} s: step {q['step']} (members {q['members']}, formed at "
                          f"{q['formed']:.1f} s)" for q in status["history"][-1:] if "commit" not in q]
                raise common.LaunchError(f"the run did not finish in {deadline:.0f} s (phase {phase}: "
                                         f"{phases[min(phase, len(phases) - 1)][2]}):\n" + "\n".join(lines)
                                         + f"\n{job.tail()}")
            time.sleep(0.05)
        status = job.ask({"op": "status", "history": True})
        records = {r: torch.load(work / f"replica-{r}.pt", weights_only=False) for r in range(replicas)
                   if (work / f"replica-{r}.pt").exists() or not keep}
        return {"records": records, "history": status["history"], "events": status["events"], "log": job.log,
                "acted": acted}
    finally:
        job.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def everyone(n):
    """A condition: the last phase's failures all handed out, and the last committed step had
    all ``n`` replicas, two steps after the one they were handed out at (a kill after a
    commit aborts nothing: the step it was handed out with commits with every replica, and
    its victims are lost only after it)."""
    return lambda status, since: status["faults_pending"] == 0 and \
        status["last_commit"]["members"] == list(range(n)) and \
        status["last_commit"]["step"] >= max(since, status["handed"]) + 2


TWO_AT_ONCE = (("quorum", "at the quorum, before its group is made"), ("reduce", "before the all-reduce"),
               ("vote", "before the vote"), ("commit", "after the commit, before the optimizer's step"))


def verification_phases(n: int) -> list:
    """The scenario: replica 1 killed, with the source of the heal that follows killed
    midway; replica n-1 hung (SIGSTOP); two replicas killed at once when a step starts, then
    at each other point of a step (TWO_AT_ONCE), a different replica left each time; then a
    stop."""
    pairs = [(0, n - 1), (1, n - 1), (0, 1), (0, n - 1)]
    return [
        (everyone(n), lambda last: {"faults": [{"replica": 1, "fault": "kill"}, {"replica": None, "fault": "healkill"}]},
         "kill -9 replica 1; then the source of its heal, midway"),
        (everyone(n), lambda last: {"faults": [{"replica": n - 1, "fault": "stop"}]}, f"SIGSTOP replica {n - 1}"),
        (everyone(n), lambda last: {"faults": [{"replica": 0, "fault": "kill"}, {"replica": 1, "fault": "kill"}]},
         "kill -9 replicas 0 and 1 at once"),
        *[(everyone(n), lambda last, pair=pair, when=when: {"faults": [{"replica": r, "fault": f"kill@{when}"}
                                                                      for r in pair]},
           f"kill -9 replicas {pair[0]} and {pair[1]} at once, {words}")
          for pair, (when, words) in zip(pairs, TWO_AT_ONCE)],
        (everyone(n), lambda last: {"stop_at": last["step"] + 3}, "stop"),
    ]


# ---- the check: the committed steps replayed in one process --------------------------------
def participation(history) -> list:
    """(step, members) of every committed step, in order; each step committed exactly once."""
    done = [(q["step"], q["members"]) for q in history if q.get("commit")]
    if [s for s, _ in done] != list(range(len(done))):
        raise common.LaunchError(f"the committed steps are not 0, 1, 2, ...: {[s for s, _ in done]}")
    return done


def replay(args, schedule, device="cpu", until=None) -> dict:
    """One process on ``device`` (the replicas' own: the same kernels, and a GPU's speed):
    at each committed step, the average of the gradients of the replicas that contributed,
    each on its own batch (the order of the sums aside, what the quorum's all-reduce gives),
    clipped by the global norm, AdamW. (The gradient of the mean loss over all their batches
    at once differs from it by float32's reordering alone, which AdamW's first steps amplify
    where a gradient is near its eps: 4e-5 here.) ``until``: the time.time() past which it
    stops with an error (the run's --deadline covers its check too)."""
    model = common.build_lm(args.model_size, args.context_length, device, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    params = list(model.parameters())
    for i, (step, members) in enumerate(schedule):
        if until is not None and time.time() > until:
            raise common.LaunchError(f"the check's replay in one process did not finish inside --deadline: "
                                     f"{i} of {len(schedule)} committed steps replayed on {device}")
        total = [torch.zeros_like(p) for p in params]
        for r in members:
            model.zero_grad(set_to_none=True)
            model(*shard_batch(args, r, step, device)).backward()
            for t, p in zip(total, params):
                t += p.grad
        for t, p in zip(total, params):
            p.grad = t / len(members)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def distance(got: dict, want: dict, start: dict) -> tuple:
    """(max |got - want| over every element, the largest of each tensor's ||got - want|| over
    ||want - start||, that tensor's name): how far the replicas' weights are from the replay's,
    element by element and against how far training moved each tensor (one that did not
    move must match exactly)."""
    worst, rel, name = 0.0, 0.0, None
    for k, w in want.items():
        d = got[k].float() - w.float()
        worst = max(worst, d.abs().max().item() if d.numel() else 0.0)
        moved, off = (w.float() - start[k].float()).norm().item(), d.norm().item()
        r = off / moved if moved > 0 else (0.0 if off == 0 else math.inf)
        if r > rel or name is None:
            rel, name = max(rel, r), k
    return worst, rel, name


def start_weights(args) -> dict:
    """The weights every replica and the replay start from (the seed's)."""
    return {k: v.detach() for k, v in common.build_lm(args.model_size, args.context_length, "cpu",
                                                      args.seed).state_dict().items()}


def check(args, run, until=None) -> dict:
    """Every replica's final weights bit for bit alike, every heal exact, and the replay's
    weights within float32's reordering."""
    schedule = participation(run["history"])
    records = run["records"]
    first = records[0]["weights"]
    alike = all(all(torch.equal(first[k], rec["weights"][k]) for k in first) for rec in records.values())
    heals = [i for q in run["history"] if q.get("commit") for i in q["info"].values() if "joiner" in i.get("role", [])]
    exact = all(all(i["exact"]) for i in heals)
    against = against_replay(args, schedule, first, args.device, until)
    return {"ok": alike and exact and against["ok"], **against, "alike": alike, "heals_exact": exact,
            "steps": len(schedule), "heals": len(heals)}


def against_replay(args, schedule, got, device="cpu", until=None) -> dict:
    """``got`` against the replay of ``schedule``, and the replay against itself with each
    step's members summed the other way round: float32's reordering as this run's arithmetic
    amplifies it, which must stay inside TOLERANCE for the check to tell a wrong step from it.
    (Two members sum alike either way round: a run of steps of two has no such measure, 0, and
    is held to TOLERANCE alone. Taking each step's batches at once as one would reorder those
    too, but reaches 1.4e-5 to 2.9e-5 where the other order gives 2.5e-6 to 3.1e-6: mini over
    45 steps, nano over 33, measured on the CPU.)"""
    want, start = replay(args, schedule, device, until), start_weights(args)
    diff, rel, name = distance(got, want, start)
    floor = distance(replay(args, [(s, m[::-1]) for s, m in schedule], device, until), want, start)[1]
    words = (f"off by {rel:.1e} of how far training moved it at most ({name}; within {TOLERANCE:.0e}, float32's "
             f"reordering {floor:.0e})")
    if floor >= TOLERANCE:
        words += (f": cannot tell, float32's reordering alone moves the replay past {TOLERANCE:.0e} here (a smaller "
                  f"--model-size, or fewer steps)")
    return {"ok": rel < TOLERANCE and floor < TOLERANCE, "max_diff": diff, "rel": rel, "worst": name, "floor": floor,
            "words": words}


# ---- the timeline --------------------------------------------------------------------------
def timeline(run, n) -> dict:
    """Replicas x committed steps: 'stepped', 'healed' (joined there from a peer), or out;
    and every aborted attempt (its step, its members, those lost before they voted and
    those whose step failed)."""
    cells, aborted = {r: {} for r in range(n)}, []
    for q in run["history"]:
        if "commit" not in q:
            continue
        if not q["commit"]:
            aborted.append({"step": q["step"], "members": q["members"], "t": q["decided"],
                            "lost": q.get("lost", []),   # went (or hung) before they voted
                            "against": sorted(int(r) for r, ok in q.get("votes", {}).items() if not ok)})
            continue
        for r in q["members"]:
            cells[r][q["step"]] = "healed" if str(r) in q["heal"] or r in q["heal"] else "stepped"
    steps = 1 + max((q["step"] for q in run["history"] if q.get("commit")), default=-1)
    return {"steps": steps, "cells": {r: [cells[r].get(s, "out") for s in range(steps)] for r in cells},
            "aborted": aborted}


def timeline_lines(tl, acted) -> list:
    mark = {"stepped": "#", "healed": "H", "out": "."}
    lines = [f"Membership by committed step (# stepped, H healed from a peer there, . out); {tl['steps']} steps:"]
    lines += [f"  replica {r}  {''.join(mark[c] for c in row)}" for r, row in tl["cells"].items()]
    lines += [f"  armed after step {a['step']:>3}: {a['phase']}" for a in acted]
    for a in tl["aborted"]:
        why = "; ".join(f"{w} {', '.join(map(str, a[k]))}" for k, w in (("lost", "lost:"), ("against", "failed:"))
                        if a[k]) or "a member silent past --join-timeout"
        lines.append(f"  aborted at step {a['step']:>3} (members {a['members']}; {why}): not committed by anyone, redone")
    return lines


def print_timeline(tl, acted):
    print("\n" + "\n".join(timeline_lines(tl, acted)))


def draw_timeline(tl, acted, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    code = {"out": 0, "stepped": 1, "healed": 2}
    rows = [[code[c] for c in tl["cells"][r]] for r in sorted(tl["cells"])]
    # (at least 9 inches wide: the title and the legend below fit, on two lines each)
    fig, ax = plt.subplots(figsize=(min(14, max(9, 3 + tl["steps"] / 8)), 1.8 + 0.5 * len(rows)))
    ax.imshow(rows, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#eeeeee", "#4c72b0", "#55a868"]),
              vmin=0, vmax=2)
    for a in tl["aborted"]:
        for r in a["members"]:
            ax.plot(a["step"] - 0.5, r, "x", color="#c44e52", ms=7, mew=2)
    for a in acted:
        ax.axvline(a["step"] + 0.5, color="k", lw=0.6, ls="--")
    ax.set_yticks(range(len(rows)), [f"replica {r}" for r in sorted(tl["cells"])])
    ax.set_xlabel("committed step (blue: stepped; green: healed from a peer there; grey: out;\n"
                  "red x: an attempt aborted; dashed: a failure armed)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=10)
    fig.tight_layout()
    common.save_file(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


# ---- the benchmark: the quorum's cost beside torch DDP, a kill, a heal -----------------------
BENCH_WARM = 5


def ddp_steps(ctx, args, steps):
    """torch DDP over the same ranks (one a replica), the same model and batches: each
    step's seconds on rank 0 (forward, backward with its all-reduce, clip, AdamW). Its
    group is gloo, as ours is across replicas (so the ratio is the quorum's cost, not a
    transport's), whatever --backend the replicas use inside: n NCCL ranks would also
    need n GPUs, where n replicas of one rank share one."""
    model = torch.nn.parallel.DistributedDataParallel(
        common.build_lm(args.model_size, args.context_length, ctx.device, args.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    times = []
    for i in range(steps):
        began = time.perf_counter()
        x, y = shard_batch(args, ctx.rank, i, ctx.device)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        common.sync(ctx.device)
        times.append(time.perf_counter() - began)
    return times


def bench_phases(n, measured):
    return [(lambda st, since: st["last_commit"]["members"] == list(range(n))
             and st["last_commit"]["step"] >= BENCH_WARM + measured,
             lambda last: {"faults": [{"replica": n - 1, "fault": "kill"}]}, f"kill -9 replica {n - 1}"),
            (everyone(n), lambda last: {"stop_at": last["step"] + 2}, "stop")]


def bench_row(args, n, run, ddp) -> dict:
    """From one run: replica 0's step with every replica in (after the warm-up), the time
    from the kill (the quorum that handed it out) to the next committed step, and the
    replacement's heal (its transfer, and from its hello to its first committed step)."""
    hist, measured = run["history"], args.bench_steps
    ours = statistics.median(run["records"][0]["times"][BENCH_WARM:BENCH_WARM + measured]) * 1000
    armed = run["acted"][0]["t"]
    fault = next(q for q in hist if q["formed"] >= armed and n - 1 in q["members"])
    after = next(q for q in hist if q.get("commit") and q["formed"] > fault["formed"] and q["qid"] > fault["qid"]
                 and (not fault.get("commit") or q["step"] > fault["step"]))
    healed = next(q for q in hist if q.get("commit") and str(n - 1) in q["heal"] and q["formed"] > fault["formed"])
    back = max(t for t, r, what in run["events"] if r == n - 1 and what == "rejoined" and t <= healed["decided"])
    info = healed["info"][str(n - 1)]
    return {"replicas": n, "ours_step_ms": round(ours, 2), "torch_ddp_step_ms": round(ddp, 2),
            "vs_ddp": round(ours / ddp, 3), "kill_to_commit_s": round(after["decided"] - fault["formed"], 3),
            "heal_s": round(max(info["heal_s"]), 4), "heal_MB": round(info["heal_bytes"][0] / 1e6, 2),
            "rejoin_to_commit_s": round(healed["decided"] - back, 3)}


# ---- torchft's Manager beside ours, on the same model and batches (make torchft-bench) -------
# seconds: its gloo group's, its heal's (PGTransport) and its Manager's, as torchft's train_ddp.py
# sets them on a CPU (a survivor waiting in an all-reduce on a lost peer waits out the first)
TORCHFT_TIMEOUTS = (5, 10, 30)


def torchft_missing() -> str | None:
    """Why torchft cannot run here (None: it can)."""
    os.environ.setdefault("RUST_LOG", "warn")   # (its servers' INFO lines: one a quorum request, every replica's)
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed here (make torchft-bench installs it: requirements-torchft.txt)"
    try:
        import torchft  # noqa: F401
    except Exception as e:   # (its opentelemetry dependencies, a torch it does not fit)
        return f"torchft does not import here ({type(e).__name__}: {e})"
    return None


def _torchft_on_loopback():
    """torchft's Manager binds its server on every interface (manager.py: ``bind=f"[::]:{port}"``);
    the kit's rule is loopback: the same server class, handed 127.0.0.1 instead."""
    import torchft.manager as tm
    if getattr(tm.ManagerServer, "kit_loopback", False):
        return
    real = tm.ManagerServer

    def server(*a, bind, **kw):
        return real(*a, bind=bind.replace("[::]", "127.0.0.1"), **kw)
    server.kit_loopback = True
    tm.ManagerServer = server


def torchft_replica(args, r: int, lighthouse: str, work: str):
    """One replica of one rank under torchft's Manager (TorchftReplica, below): the
    gradients averaged over the quorum by one manager.allreduce of them all after backward
    (as ours on a CPU), the optimizer stepped only where should_commit says so, its quorum
    during the forward (use_async_quorum, its default), a heal over the same gloo group (its
    PGTransport: its HTTP transport listens on every interface). The kit's LM, AdamW,
    clipping and replica r's batches, as ours. One JSON line a step to WORK/torchft-R.jsonl
    (its "s": the whole step, the optimizer's included, as ours is timed); it trains until
    WORK/stop exists. (torchft 0.2.0's DistributedDataParallel fails once its manager has
    seen an error: its comm hook asserts ``fut._fut``, which the _DummyWork allreduce returns
    after an error lacks; a survivor's first step after a kill ended there.)"""
    torch.set_num_threads(1)
    store = common.loopback_store(1, 60.0)   # (the replica's own; TCPStore's server alone listens everywhere)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    model = common.build_lm(args.model_size, args.context_length, "cpu", args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    manager = TorchftReplica(model, opt, lighthouse, r, rank=0, world_size=1)
    work = Path(work)
    with open(work / f"torchft-{r}.jsonl", "a") as log:
        log.write(json.dumps({"hello": time.time()}) + "\n")
        log.flush()
        while not (work / "stop").exists():
            began = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            manager.start_step()
            x, y = shard_batch(args, r, manager.step, "cpu")
            model(x, y).backward()   # (its DistributedDataParallel: see the docstring)
            manager.all_reduce_gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            if manager.should_commit():
                opt.step()
            log.write(json.dumps({**manager.last, "s": time.perf_counter() - began}) + "\n")
            log.flush()
    manager.close()


class TorchftReplica:
    """torchft's Manager behind ReplicaManager's calls (start_step, all_reduce_gradients,
    should_commit), for a loop written for ours: 13's benchmark runs its replicas of a mesh
    under it, on every rank of each. As torchtitan runs torchft: a Manager on each rank of a
    replica (``rank``, ``world_size``: the replica's; its ranks meet in their job's store,
    MASTER_ADDR and MASTER_PORT), rank k of every replica averaging its gradients with rank k
    of the others (manager.allreduce of this rank's gradients, one flat tensor), a heal
    carrying this rank's tensors from rank k of a live peer (PGTransport over its gloo
    group: no rank holds the whole model). ``lighthouse``: HOST:PORT of torchft's
    LighthouseServer. Unlike ours, torchft's quorum runs beside the forward
    (use_async_quorum) and a replica that heals sits out that step (its gradients count as
    zeros; the average is over the others). ``last``: the last step's (time, step,
    committed, participants, seconds from start_step, this start's heal: seconds and bytes),
    written as a JSON line to ``log`` where given; ``stop``: a file whose step, once it
    exists, ends the run there (start_step returns False)."""

    def __init__(self, module, optimizer, lighthouse: str, replica_id: int, rank: int, world_size: int,
                 timeouts=TORCHFT_TIMEOUTS, log=None, stop=None):
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport
        _torchft_on_loopback()
        self.module, self.optimizer, self.replica_id, self.rank = module, optimizer, replica_id, rank
        self.log, self.stop, self.faults, self.writer, self.history = log, stop, [], replica_id == 0, None
        self.members, self.heals, self.commits, self.aborts, self.step, self.heal = [], [], 0, 0, 0, {}
        self.speaks = False
        if log is not None:   # (its hello: from here to its first commit, as ours from its hello)
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(json.dumps({"hello": time.time()}) + "\n")
        pg_s, transport_s, manager_s = timeouts
        pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=pg_s))
        transport = PGTransport(pg, timeout=datetime.timedelta(seconds=transport_s), device=torch.device("cpu"))
        receive = transport.recv_checkpoint

        def timed(*a, **kw):   # (the heal's transfer, and its bytes)
            began = time.perf_counter()
            got = receive(*a, **kw)
            tensors = [t for t in torch.utils._pytree.tree_leaves(got) if torch.is_tensor(t)]
            self.heal = {"s": time.perf_counter() - began, "bytes": sum(t.numel() * t.element_size() for t in tensors)}
            return got
        transport.recv_checkpoint = timed
        self.manager = Manager(pg=pg, min_replica_size=1, load_state_dict=self._load, state_dict=self._state,
                               replica_id=f"kit_{replica_id}", rank=rank, world_size=world_size,
                               store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                               lighthouse_addr=f"http://{lighthouse}", hostname="127.0.0.1",
                               checkpoint_transport=transport, timeout=datetime.timedelta(seconds=manager_s))

    def _state(self):   # this rank's tensors (on the host: gloo's send takes CPU tensors only)
        host = lambda t: t.detach().cpu()   # noqa: E731
        return {"params": [host(p) for p in self.module.parameters()], "buffers": [host(b) for b in self.module.buffers()],
                "optim": torch.utils._pytree.tree_map(lambda v: host(v) if torch.is_tensor(v) else v,
                                                      self.optimizer.state_dict())}

    def _load(self, sd):
        with torch.no_grad():
            for t, v in zip([*self.module.parameters(), *self.module.buffers()], sd["params"] + sd["buffers"]):
                t.copy_(v)
        self.optimizer.load_state_dict(sd["optim"])   # (its tensors go where the parameters are)

    def start_step(self, steps=None) -> bool:
        end = int(self.stop.read_text() or 0) if self.stop is not None and self.stop.exists() else None
        if (steps is not None and self.manager.current_step() >= steps) or \
                (end is not None and self.manager.current_step() >= end):
            self.close()
            return False
        self.began = time.perf_counter()
        self.manager.start_quorum()
        self.step = self.manager.current_step()
        return True

    def all_reduce_gradients(self) -> bool:
        """Each gradient this rank holds averaged over the quorum (a flag each: one no
        participant has stays None); the outcome is should_commit's."""
        params = list(self.module.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(
            [float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)])
        self.manager.allreduce(flat).wait()   # (the average over the participants, in place)
        had, at = flat[-len(params):].tolist(), 0
        for p, h in zip(params, had):
            p.grad = flat[at:at + p.numel()].view_as(p) if h else None
            at += p.numel()
        self.members = list(range(self.manager.num_participants()))   # (torchft says how many, not which)
        self.speaks = self.manager.participating_rank() == 0   # (the progress line: the quorum's first)
        return True

    def should_commit(self, ok: bool = True) -> bool:
        """torchft's vote over every rank of every participant: False where any failed
        (``ok`` False: this rank's part did, as ours is told)."""
        if not ok:
            self.manager.report_error(RuntimeError(f"replica {self.replica_id}, rank {self.rank}: its step failed"))
        committed = self.manager.should_commit()
        self.commits, self.aborts = self.commits + committed, self.aborts + (not committed)
        if self.heal:
            self.heals.append({"role": "joiner", "peers": [None], "step": self.step, **self.heal})   # (torchft's choice)
        self.last = {"t": time.time(), "step": self.step, "commit": committed, "n": len(self.members),
                     "s": time.perf_counter() - self.began, **({"heal": self.heal} if self.heal else {})}
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(self.last) + "\n")
        self.heal = {}
        self.step = self.manager.current_step()
        return committed

    def close(self):
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


def _torchft_log(path) -> list:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]


def torchft_run(args, n: int, measured: int) -> dict:
    """torchft's side of one benchmark row: its lighthouse here (on loopback; a replica
    is lost after --detect without a heartbeat, as ours), ``n`` replicas of one rank; once
    replica 0 has ``measured`` steps with all after BENCH_WARM, replica n-1 killed (kill -9),
    then started again after 3 commits without it. Returns the step's median ms with all in,
    kill -9 to the first commit without it, the newcomer's heal (s, bytes) and its hello to
    its first commit."""
    from torchft.coordination import LighthouseServer   # (its documented home)
    work = Path(tempfile.mkdtemp(prefix="torchft-"))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.detect * 1000))
    address = "127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    procs = {}

    def start(r):
        procs[r] = FORKS.Process(target=common.script_call, args=(SCRIPT, "_torchft_entry", args, r, address,
                                                                  str(work), os.getpid()))
        procs[r].start()

    def wait_for(cond, what, within=None):
        deadline = time.time() + (within or args.deadline)
        while not cond():
            for r, p in procs.items():
                if p.exitcode not in (None, 0) and r != n - 1:
                    log = work / f"torchft-{r}.log"
                    raise common.LaunchError(f"torchft's replica {r} ended (exit {p.exitcode}) waiting for {what}:\n"
                                             + "\n".join(log.read_text().splitlines()[-12:] if log.exists() else []))
            if time.time() > deadline:
                raise common.LaunchError(f"torchft's replicas: no {what} in {within or args.deadline:.0f} s")
            time.sleep(0.05)
    logs = lambda r: _torchft_log(work / f"torchft-{r}.jsonl")   # noqa: E731
    try:
        for r in range(n):
            start(r)
        full = lambda: [e for e in logs(0) if e.get("commit") and e.get("n") == n]   # noqa: E731
        wait_for(lambda: len(full()) >= BENCH_WARM + measured, "steps with every replica")
        steps = [e["s"] for e in full()[BENCH_WARM:BENCH_WARM + measured]]
        killed = time.time()
        os.kill(procs[n - 1].pid, signal.SIGKILL)
        procs[n - 1].join()
        after = lambda: [e for e in logs(0) if e.get("commit") and e.get("n") == n - 1 and e["t"] > killed]   # noqa
        wait_for(lambda: len(after()) >= 3, "commit without the killed replica")
        (work / f"torchft-{n - 1}.jsonl").unlink()
        start(n - 1)
        back = lambda: [e for e in logs(n - 1) if e.get("commit")]   # noqa: E731
        wait_for(lambda: back(), "commit of the replica started again")
        joiner = logs(n - 1)
        healed = next((e["heal"] for e in joiner if "heal" in e), None)
        return {"torchft_step_ms": round(statistics.median(steps) * 1000, 2),
                "torchft_kill_to_commit_s": round(after()[0]["t"] - killed, 3),
                "torchft_heal_s": round(healed["s"], 4) if healed else None,
                "torchft_heal_MB": round(healed["bytes"] / 1e6, 2) if healed else None,
                "torchft_rejoin_to_commit_s": round(back()[0]["t"] - joiner[0]["hello"], 3)}
    finally:
        (work / "stop").touch()
        for p in procs.values():
            p.join(30)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        lighthouse.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def _torchft_entry(args, r, address, work, parent):
    """A torchft replica's process: one thread, its output (torchft's logging) to its log;
    it ends with the benchmark's process, however that ends."""
    common._watch_parent(parent)
    fd = os.open(str(Path(work) / f"torchft-{r}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    common._loopback_only("gloo")
    torchft_replica(args, r, address, work)


def benchmark(args):
    rows, settings = [], {"model_size": args.model_size, "context_length": args.context_length,
                          "batch_size": args.batch_size, "detect_s": args.detect, "bench_steps": args.bench_steps,
                          "backend": "gloo", "device": args.device, "world_size": list(args.bench_replicas)}
    missing = torchft_missing() or (None if args.device == "cpu" else
                                    "its replicas here run on the CPU (its heal sends tensors point to point over "
                                    "gloo, which takes no CUDA tensors): beside ours on the GPU they would time "
                                    "another device")
    if missing:
        print(f"benchmark: SKIP torchft's Manager: {missing}; ours and torch DDP only", flush=True)
    fast = argparse.Namespace(**{**vars(args), "pace_ms": 0.0})   # (one rank a replica: --inner unused)
    sizes = list(args.bench_replicas)
    for i, n in enumerate(sizes):   # each replica count's row saved as it comes; the table printed once
        run = run_scenario(fast, n, 1, bench_phases(n, args.bench_steps), deadline=args.deadline)
        ddp = common.launch(ddp_steps, fast, BENCH_WARM + args.bench_steps, world_size=n, backend="gloo")
        rows.append(bench_row(args, n, run, statistics.median(ddp[BENCH_WARM:]) * 1000))
        if not missing:
            rows[-1].update(torchft_run(fast, n, args.bench_steps))
            rows[-1]["torchft_vs_ddp"] = round(rows[-1]["torchft_step_ms"] / rows[-1]["torch_ddp_step_ms"], 3)
        table = common.save_results(args.out, NAME, rows, settings, title=BENCH_TITLE,
                                    note=BENCH_NOTE + common.partial_note(i + 1, len(sizes), "replica counts"))
    print(f"\n{BENCH_TITLE}\n{table}\n{common.wrote(args.out, f'{NAME}.json and .md')}", flush=True)


BENCH_TITLE = "Replicas that survive a loss: a step beside torch DDP, a kill, a heal (one rank a replica)"
BENCH_NOTE = ("ours_step_ms: replica 0's step with every replica in (the quorum, forward and backward, the gradients' "
              "all-reduce over the quorum's gloo group, the vote, clip, AdamW), the median of --bench-steps after "
              f"{BENCH_WARM} warm-up; torch_ddp_step_ms: torch DDP over the same ranks (one a replica), the same "
              "model and batches, in its own job; vs_ddp: their ratio (the quorum's cost). kill_to_commit_s: from the "
              "quorum that handed replica n-1 its kill -9 to the next committed step (the others' detection, an "
              "aborted attempt and a new quorum); heal_s: the replacement's transfer from its live peer (weights, "
              "AdamW's state, the step; heal_MB), rejoin_to_commit_s: from its hello to its first committed step. "
              "Each replica count is its own run. torchft_*: torchft's Manager (make torchft-bench installs it) on the "
              "same model and batches, each replica one process, its lighthouse here on loopback (--detect its "
              "heartbeat timeout, --join-timeout its join timeout), its timeouts those of its train_ddp.py on a CPU "
              "(gloo 5 s, heal 10 s, Manager 30 s); the gradients averaged by one manager.allreduce after backward "
              "(as ours on a CPU), the optimizer stepped where should_commit says so, a heal over its gloo group "
              "(PGTransport); kill_to_commit_s from the kill -9 to the first step committed without the victim, "
              "heal_s its recv_checkpoint, rejoin from the restarted replica's first line before its loop.")


# ---- flags, checks, main --------------------------------------------------------------------
def parser():
    p = common.KitParser(description=__doc__.split("\n\n")[0], epilog=None)
    p.add_argument("--replicas", type=common.COUNT, default=3, help="replicas (each its own job)")
    p.add_argument("--replica-ranks", type=common.COUNT, default=2, help="ranks a replica")
    p.add_argument("--inner", choices=["ddp", "fsdp"], default="fsdp",
                   help="inside a replica of 2 ranks or more: 05's DDPBucketed or 07's FSDP")
    p.add_argument("--model-size", choices=list(common.MODEL_SIZES), default="nano", help="the kit's LM")
    p.add_argument("--context-length", type=common.COUNT, default=32, help="tokens a sequence")
    p.add_argument("--batch-size", type=common.COUNT, default=8, help="a replica's batch, split over its ranks")
    p.add_argument("--steps", type=common.COUNT, default=1000,
                   help="the steps a replica trains at most (the verification's scenario stops it sooner)")
    add_waits(p)
    p.add_argument("--pace-ms", type=common.number(float, lo=0), default=None,
                   help="a step takes at least this long (default: 200 in the verification, where the nano LM's "
                        "step takes a few ms: a replacement, back in about 0.15 s here, and a hung replica, "
                        "found within --detect, then cost the scenario a few steps, not hundreds; 0 for --join)")
    p.add_argument("--bucket-mb", type=common.number(float, above=0), default=25.0,
                   help="--inner ddp's buckets; with one rank a replica and --overlap, the cross-replica "
                        "all-reduce's (the first 1 MB)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="one rank a replica: the cross-replica all-reduce in buckets started during backward as their "
                        "gradients arrive (on), or once after it (off); auto: on a GPU only (on CPU cores the "
                        "reduction takes the cores backward computes on: a step 7 to 17%% slower here)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="inside a replica (across replicas: always gloo)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda for nccl, cpu for gloo")
    p.add_argument("--seed", type=common.COUNT0, default=0, help="the weights, and each replica's data shard")
    p.add_argument("--out", default=common.DEFAULT_OUT, help="folder for results (make all writes results/)")
    p.add_argument("--timeout", type=common.SECONDS, default=300.0,
                   help="seconds a collective inside a replica, or across replicas, may wait (across them, a safety "
                        "net: a lost or hung replica is left out within --detect)")
    common.add_stall_flags(p)
    p.add_argument("--no-verify", action="store_true", help="skip the verification")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    p.add_argument("--bench-replicas", type=common.COUNT, nargs="+", default=[2, 3, 4], help="the benchmark's runs")
    p.add_argument("--bench-steps", type=common.COUNT, default=20, help="measured steps before the benchmark's kill")
    p.add_argument("--deadline", type=common.SECONDS, default=240.0, help="seconds a run may take before it is ended")
    p.add_argument("--coordinator", action="store_true",
                   help="run the coordinator alone (for replicas under torchrun): it prints its address and serves")
    p.add_argument("--host", default="127.0.0.1",
                   help="--coordinator: the address it listens on (loopback; give the machine's for other nodes)")
    p.add_argument("--port", type=common.number(int, lo=0, hi=65535), default=29510, help="--coordinator: its port")
    p.add_argument("--min-replicas", type=common.COUNT, default=1,
                   help="--coordinator: a quorum never has fewer members (the others wait for them)")
    p.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="run as the ranks of one replica (under torchrun: one torchrun job a replica), joining the "
                        "coordinator there")
    p.add_argument("--replica-id", type=common.COUNT0, default=None, help="--join: this replica's number")
    p.add_argument("--run-dir", default=None,
                   help="--join and --coordinator: the run's folder (default: runs/14_fault_tolerant_dp): the "
                        "coordinator's record of every committed step (record.jsonl), each replica's last committed "
                        "step when the coordinator is gone (replica-<id>, where it starts from), the final weights "
                        "(final/weights.pt); --replay reads it")
    p.add_argument("--log-every", type=common.COUNT, default=10,
                   help="--join and --coordinator: a progress line every this many committed steps")
    p.add_argument("--replay", default=None, metavar="RUN_DIR",
                   help="replay a torchrun run's committed steps in one process from its record (RUN_DIR/record.jsonl) "
                        "and compare with its final weights (RUN_DIR/final/weights.pt)")
    p.add_argument("--incarnation", type=common.COUNT0, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    return p


def add_waits(p):
    """The coordinator's and a replica's waits (14's flags, and 13's on replicas)."""
    p.add_argument("--detect", type=common.SECONDS, default=2.0,
                   help="seconds without a beat that leave a replica out (every member waiting on it then stops)")
    p.add_argument("--join-timeout", type=common.SECONDS, default=10.0,
                   help="seconds a quorum waits for a live replica that has not asked (a hung one that still beats)")
    p.add_argument("--connect-wait", type=common.SECONDS, default=30.0,
                   help="--join: seconds a replica tries to reach the coordinator before it gives up")


def check_overlap(args):
    if args.overlap == "on" and args.replica_ranks > 1:
        raise common.UsageError(f"--overlap on: the all-reduce runs during backward only where a replica is one rank "
                                f"(--replica-ranks {args.replica_ranks}: its gradients are final after its own "
                                f"synchronization); use --replica-ranks 1")


def check_join(args):
    """--join HOST:PORT (a port, a host known here) and --replica-id, or one line (exit 2)."""
    host, _, port = args.join.rpartition(":")
    if not host or not port.isdigit():
        raise common.UsageError(f"--join {args.join}: give the coordinator's HOST:PORT")
    if not 1 <= int(port) <= 65535:
        raise common.UsageError(f"--join {args.join}: a port is 1 to 65535")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise common.UsageError(f"--join {args.join}: the host {host!r} is not known here ({e.strerror})") from None
    if args.replica_id is None:
        raise common.UsageError("--join needs --replica-id: this replica's number (its data shard)")


def check_args(args):
    """Everything refused before any process starts (UsageError: one line, exit 2)."""
    args.device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl" and args.device != "cuda":
        raise common.UsageError("nccl works on CUDA tensors only: use --device cuda or --backend gloo")
    if args.device == "cuda" and common.gpu_count() == 0:
        raise common.UsageError("--device cuda but no GPU is visible: use --device cpu")
    if args.coordinator and args.join:
        raise common.UsageError("--coordinator and --join: a process is the coordinator or a replica's rank, not both")
    if args.replay is not None:
        if not (Path(args.replay) / "record.jsonl").is_file():
            raise common.UsageError(f"--replay {args.replay}: no record.jsonl there (the coordinator writes it in its "
                                    f"--run-dir)")
        return
    if args.coordinator:
        if args.replica_id is not None:
            raise common.UsageError("--replica-id applies to --join (a replica's ranks)")
        args.run_dir = args.run_dir or str(common.ROOT / "runs" / NAME)
        common.check_out(args.run_dir, "--run-dir")
        return
    if args.batch_size % args.replica_ranks:
        raise common.UsageError(f"--batch-size {args.batch_size} must divide by --replica-ranks {args.replica_ranks}: "
                                f"each rank of a replica takes an equal part")
    if args.join is not None:
        check_join(args)
        if common.under_torchrun():
            args.replica_ranks = int(os.environ["WORLD_SIZE"])
        check_overlap(args)
        args.pace_ms = args.pace_ms if args.pace_ms is not None else 0.0
        args.run_dir = args.run_dir or str(common.ROOT / "runs" / NAME)
        common.check_out(args.run_dir, "--run-dir")
        return
    if args.replica_id is not None or args.run_dir is not None:
        raise common.UsageError("--replica-id applies to --join (a replica's ranks)" if args.replica_id is not None
                                else "--run-dir applies to --join and --coordinator (the torchrun form)")
    if args.replicas < 2:
        raise common.UsageError(f"--replicas {args.replicas}: surviving a lost replica needs at least 2")
    if not args.no_verify and args.replicas < 3:
        raise common.UsageError(f"--replicas {args.replicas}: the verification loses two replicas at once and needs "
                                f"one more to go on: use 3 or more (or --no-verify)")
    if not args.no_verify:
        check_overlap(args)
    if args.backend == "nccl" and common.gpu_count() < args.replica_ranks:   # (replicas, each its own world, share them)
        raise common.UsageError(f"nccl needs one GPU per rank of a replica: {args.replica_ranks} ranks, "
                                f"{common.gpu_count()} GPU(s); {common.NCCL_HINT}")
    # the processes share the cores (as gloo's ranks do); NCCL's GPU a rank is per replica, above
    common.check_ranks(args.replicas * args.replica_ranks, "gloo", "--replicas x --replica-ranks")
    if not args.no_bench:
        common.check_ranks(max(args.bench_replicas), "gloo", "--bench-replicas")
        if min(args.bench_replicas) < 2:
            raise common.UsageError("--bench-replicas: each run needs 2 replicas or more")
    args.pace_ms = args.pace_ms if args.pace_ms is not None else 200.0
    common.check_out(args.out)


def run_coordinator(args):
    """--coordinator: the quorum service alone, for replicas under torchrun: its record in
    --run-dir (a record there goes on; one whose run ended is refused), a line for what an
    operator follows, until killed (Ctrl-C)."""
    record = Path(args.run_dir) / "record.jsonl"
    began = time.time()
    say = lambda line: print(f"coordinator [{time.time() - began:7.1f} s] {line}", flush=True)   # noqa: E731
    try:
        coordinator = Coordinator(args.host, args.port, detect=args.detect, join_timeout=args.join_timeout,
                                  min_replicas=args.min_replicas, record=record, say=say, log_every=args.log_every)
    except OSError as e:
        raise common.UsageError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}): "
                                f"{'another process holds the port; choose another, or --port 0 for any free one' if e.errno == errno.EADDRINUSE else 'give an address of this machine'}") from None
    if coordinator.final is not None:
        coordinator.close()
        raise common.UsageError(f"the run recorded in {record} is over (it ended at step {coordinator.final['step']}, "
                                f"its final weights in {Path(args.run_dir) / 'final'}): a coordinator serves one run; "
                                f"give another --run-dir for another")
    if args.parent:
        common._watch_parent(args.parent)
    port = coordinator.address.rsplit(":", 1)[1]
    reach = f"{socket.gethostname()}:{port}" if args.host in ("0.0.0.0", "") else coordinator.address
    print(f"coordinator at {coordinator.address} (its store at port {coordinator.store.port}); every replica's first "
          f"rank joins it with --join {reach}", flush=True)
    say(f"its record: {record}" + (f" (going on with the run there: steps 0 to {coordinator.committed - 1} committed)"
                                   if coordinator.committed else " (a new run)"))
    try:
        coordinator.serve()
    finally:
        coordinator.close()


def read_record(path) -> tuple:
    """A coordinator's record: the run's settings, (step, members) of every committed step
    that stands (a rewind drops the steps after it), and the final weights' entry."""
    settings, schedule, final = None, [], None
    for line in Path(path).read_text().splitlines():
        e = json.loads(line)
        if "settings" in e:
            settings = e["settings"]
        elif "commit" in e:
            schedule.append((e["commit"], e["members"]))
        elif "rewind" in e:
            schedule = [(s, m) for s, m in schedule if s < e["rewind"]]
        elif "start" in e and e["start"] > len(schedule):
            raise common.LaunchError(f"{path}: the record starts at step {e['start']} (a coordinator started without "
                                     f"the run's earlier record): its steps before that cannot be replayed")
        elif "final" in e:
            final = e["final"]
    return settings, schedule, final


def committed_steps(path) -> tuple:
    """read_record's settings and final entry, and (step, members) of every committed step
    that stands, checked to be 0, 1, 2, ... (what a replay replays)."""
    settings, schedule, final = read_record(path)
    return settings, participation([{"step": s, "members": m, "commit": True} for s, m in schedule]), final


def replay_run(args):
    """--replay RUN_DIR: the committed steps of a torchrun run replayed in one process, and
    compared with the final weights written there."""
    folder = Path(args.replay)
    settings, done, final = committed_steps(folder / "record.jsonl")
    if settings is None or final is None or not (folder / "final" / "weights.pt").is_file():
        raise common.UsageError(f"--replay {folder}: the run there has not ended (no final weights): replay it once its "
                                f"replicas are done")
    run = argparse.Namespace(**{**vars(args), **settings})
    print(f"replaying {len(done)} committed steps of the run in {folder} in one process ({settings['model_size']} LM, "
          f"replicas' batches of {settings['batch_size']} x {settings['context_length']})", flush=True)
    got = torch.load(folder / "final" / "weights.pt", weights_only=True)
    against = against_replay(run, done, got, run.device)
    label = (f"{len(done)} committed steps against the final weights (written by replica {final['replica']} at step "
             f"{final['step']}), {against['words']}")
    common.check_verification({label: {"ok": against["ok"] and final["step"] == len(done),
                                       "max_diff": against["max_diff"]}}, f"{NAME} replay of {folder}")


def verify(args):
    n = args.replicas
    t0 = time.time()
    run = run_scenario(args, n, args.replica_ranks, verification_phases(n), deadline=args.deadline)
    result = check(args, run, until=t0 + args.deadline)
    tl = timeline(run, n)
    if common.is_reporter():
        print_timeline(tl, run["acted"])
        inner = f"{args.replica_ranks} ranks a replica under {args.inner}" if args.replica_ranks > 1 else "1 rank a replica"
        title = f"{n} replicas ({inner}), the {args.model_size} LM: membership by committed step"
        common.save_file(Path(args.out) / "14_timeline.json", lambda f: f.write(json.dumps(
            {"timeline": tl, "acted": run["acted"], "history": run["history"], "events": run["events"],
             "launcher": run["log"], "check": result}, indent=1, default=str).encode()))
        draw_timeline(tl, run["acted"], Path(args.out) / "14_timeline.png", title)
        print(common.wrote(args.out, "14_timeline.json and .png"), flush=True)
    label = (f"{result['steps']} committed steps, {result['heals']} heals (each exact: {result['heals_exact']}), "
             f"every replica alike: {result['alike']}; against one process, {result['words']}")
    common.check_verification({label: result}, f"{NAME} at {n} replicas")


def main(argv=None):
    args = parser().parse_args(argv)
    check_args(args)
    if args.replay is not None:
        return replay_run(args)
    if args.coordinator:
        return run_coordinator(args)
    if args.join is not None:
        return run_replica(args)
    if common.is_reporter():
        print(f"running: {Path(SCRIPT).name}: {args.replicas} replicas of {args.replica_ranks} rank(s) "
              f"({args.inner if args.replica_ranks > 1 else 'one rank'}), a coordinator, {args.backend}/{args.device}: "
              f"{', then '.join(w for w, skip in (('verification', args.no_verify), ('benchmark', args.no_bench)) if not skip) or 'nothing'}",
              flush=True)
    common._announce_next.clear()   # (said: the jobs it launches need not)
    if not args.no_verify:
        verify(args)
    if not args.no_bench:
        benchmark(args)


if __name__ == "__main__":
    common.run_main(main)
