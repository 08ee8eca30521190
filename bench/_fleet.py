"""Section (3) of bench/scale.py: the broker's control plane alone, under a simulated fleet.

A real ``zloader-broker`` process on 127.0.0.1 (TCP, no keys: loopback needs none) and, in
this process, one ZeroMQ DEALER per simulated peer speaking the real protocol, its bodies
built by zloader's own records (zloader/transport/messages.py) and framed by
zloader/transport/protocol.py:

- ``--fleet-consumers`` consumers, five to a job (``job_name`` fleet-0, fleet-1, ...: one
  training run's ranks; each job its own small pipeline, cloudpickled and registered as a
  Loader registers it, zloader/client/link.py ``registration``). Each sends REGISTER until
  its job's first JOB view comes, then a HEARTBEAT a second (a Loader's stats: elements,
  bytes, ``wait_seconds``, ``active``) and, every ``--fleet-epoch-every`` seconds (10), an EPOCH for
  its next epoch. The answer to an EPOCH is the only JOB view that carries ``read`` (the
  jobs run exactly-once, the Loader's default), so its latency is measured from the send
  to that view's arrival, at most one EPOCH outstanding per consumer. The latency is an
  upper bound: it includes this process's own delay in noticing the answer.
- ``--fleet-workers`` workers on simulated hosts of 16 (non-loopback data endpoints that
  nobody connects to), registered (READY) once every consumer has its job, as a fleet
  joins a running service; then a HEARTBEAT a second with a worker's small stats.

Every peer's beats are spread evenly over the second (each peer has its own phase; sends
go out in slots of ``SLOT_S``), not sent all at once. This process reads every socket each
``SWEEP_S`` and, between sweeps, polls only the consumers waiting for an EPOCH's answer, so
that it takes far less of the machine than the broker it measures (its CPU is reported
next to the broker's).

What the simulated workers do with their tasks: nothing. They ignore TASK, RELEASE,
CONSUMER_GONE and the broker's HEARTBEATs; a real worker would fetch the pipeline and ask
for splits. That costs them nothing with the broker: it drops a worker only for silence
(they heartbeat), and only a consumer's report (``HEARTBEAT.stuck``, which these never
send) makes it act on a worker that does not produce. What could churn them is the pool
(zloader/broker/pool.py): a job whose consumers wait more than ``HUNGRY_STARVATION`` of
their time, or that started an epoch in the last two heartbeats, is *hungry* and may take
workers from jobs that hold more than their autoscaler's ``desired_workers``. The
consumers report waiting ``WAIT_SHARE`` (5%) of their time: inside the autoscaler's
hysteresis band (3%-7%: it changes no job's count) and above the hunger threshold, so
every job is hungry, wants all it can get, and the pool only evens shares out (rule 2).
While the fleet joins, the jobs whose consumers have not reported yet are not held to the
one worker their autoscaler first set (docs/pool.md), so the joining workers are spread
evenly; the warm-up starts once no worker has moved for ``SETTLE_S``, and from then on no
worker should move. A broker that reads its messages late must not change that: it
samples no job whose consumers' reports it has not read yet (docs/pool.md; before it did,
such a job's starvation read 0, it wanted only its autoscaler's count, gave its workers
away, and the moves made the broker later still: a run either kept up or saturated).
Each EPOCH also makes its job hungry for two heartbeats, as a real one does. The TASK and
RELEASE messages the workers receive in the window are counted (``moves``), as are peers
the broker forgot (UNKNOWN: they register again, as real ones do); both should be 0.

This is a stress pattern for the pool rather than a typical one: every job hungry means
every EPOCH, REGISTER and tick asks the pool for a move (it weighs the jobs against each
other, and their workers only when a job would give one).

Measured over ``--fleet-seconds`` after a ``--fleet-warmup``: the broker's CPU (user +
system, psutil) as a fraction of one core; the EPOCH answers' latency (p50, p99, max);
messages per second to and from the broker; this process's own CPU (it shares the
machine's cores with the broker). The fleet one broker could run at 30% of a core is
extrapolated from its CPU per peer, assuming the cost grows linearly with the peers (at
the same ratio of workers to consumers and of consumers to jobs); parts of it grow faster
(a JOB view lists its job's workers; the pool weighs jobs x jobs every tick), so the
extrapolation is optimistic.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import heapq
import math
import os
import pathlib
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import zmq

from bench._common import free_port, provenance, stop

BIN = pathlib.Path(sys.executable).parent
START_TIMEOUT_S = 120.0
"""Seconds the broker, the consumers' jobs and the workers' ACKs each may take to come."""
HEARTBEAT_S = 1.0
"""The broker's heartbeat (its default), at which every peer beats."""
SLOT_S = 0.01
"""Sends are grouped in slots this long (100 a second): spread, not one poll per send."""
SWEEP_S = 0.1
"""Every peer's socket is read this often; between sweeps only the consumers waiting for
an EPOCH's answer are polled (polling 1,200 sockets each slot cost this process more than
half a core, on the broker's machine)."""
EPOCH_EVERY_S = 10.0
"""Each consumer starts an epoch this often by default (``--fleet-epoch-every``; with 200
consumers: 20 EPOCHs a second)."""
SETTLE_S = 2.0
"""The pool has settled once no worker was moved (TASK, RELEASE) for this long: the
warm-up starts then."""
EPOCH_TIMEOUT_S = 5.0
"""An EPOCH unanswered this long is counted as such and the next one may go."""
CONSUMERS_PER_JOB = 5
WORKERS_PER_HOST = 16
WAIT_SHARE = 0.05
"""The share of their time the consumers say they waited (HEARTBEAT stats.wait_seconds)."""
CPU_TARGET = 0.30
P99_TARGET_S = 0.050


def square(value: int) -> int:
    """The simulated jobs' map (never run: no worker runs these pipelines)."""
    return value * value


@dataclass
class Peer:
    """One simulated worker or consumer: its socket and what it has heard."""

    kind: str  # "worker" or "consumer"
    index: int
    sock: zmq.Socket[Any]
    hello: list[bytes]  # READY or REGISTER frames
    job: str | None = None  # a consumer's job, once its JOB view came
    acked: bool = False  # a worker's ACK came
    beats: int = 0
    epoch: int = 0  # a consumer's next epoch
    asked: float | None = None  # when its EPOCH went, unanswered so far
    in_window: bool = False  # that EPOCH went inside the measured window


@dataclass
class Tally:
    """What went each way, and the EPOCH answers' latencies."""

    sent: int = 0
    received: int = 0
    by_command: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    unanswered: int = 0
    forgotten: int = 0  # UNKNOWN: the broker forgot a peer, which registered again
    errors: list[str] = field(default_factory=list)

    def copy(self) -> Tally:
        return Tally(self.sent, self.received, dict(self.by_command), list(self.latencies),
                     self.unanswered, self.forgotten, list(self.errors))


class Fleet:
    """The simulated peers of one run, their sockets in one context of this process."""

    def __init__(self, address: str, workers: int, consumers: int,
                 epoch_every: float = EPOCH_EVERY_S) -> None:
        from zloader.client.link import registration
        from zloader.client.shipment import pack
        from zloader.options import JobOptions
        from zloader.pipeline import Pipeline
        from zloader.transport import messages
        from zloader.transport.protocol import encode

        self.messages, self.encode = messages, encode
        self.context: zmq.Context[Any] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, workers + consumers + 64)
        self.peers: list[Peer] = []
        self.by_socket: dict[zmq.Socket[Any], Peer] = {}
        self.poller = zmq.Poller()  # every peer: swept every SWEEP_S
        self.prompt = zmq.Poller()  # consumers waiting for an EPOCH's answer
        self.tally = Tally()
        self.window: tuple[float, float] | None = None
        self.window_end: Tally | None = None  # the tally as the window closed
        self.last_move = 0.0  # when a worker last heard TASK or RELEASE
        self.events: list[tuple[float, int, str]] = []  # (due, peer, "beat" or "epoch")
        self.epoch_every = epoch_every
        self.jobs = max(1, -(-consumers // CONSUMERS_PER_JOB))
        options = JobOptions(exactly_once=True)
        try:
            for job in range(self.jobs):
                pipeline = Pipeline.range(1000 + job).map(functools.partial(square))
                blob, _served = pack(pipeline, inherited=False)
                source = pipeline.source
                for _rank in range(min(CONSUMERS_PER_JOB,
                                       consumers - job * CONSUMERS_PER_JOB)):
                    register = registration(
                        fingerprint=pipeline.fingerprint, job_name=f"fleet-{job}",
                        options=options, consumer_index=None, resume=None, inherited=False,
                        source={"num_splits": source.num_splits,
                                "shuffle_splits": source.shuffle_splits,
                                "seed": source.seed})
                    self._add("consumer", address, encode(
                        register.COMMAND, messages.encode(register), (blob,)))
            for index in range(workers):
                host = index // WORKERS_PER_HOST
                ready = messages.Ready(
                    worker=f"fleet-worker-{index}", host=f"fleet-host-{host}",
                    host_id=f"fleet-host-{host}", pid=100000 + index,
                    endpoint=f"tcp://10.{host // 256}.{host % 256}.1:"
                             f"{7000 + index % WORKERS_PER_HOST}")
                self._add("worker", address, encode(ready.COMMAND, messages.encode(ready)))
        except BaseException:
            self.close()
            raise

    def _add(self, kind: str, address: str, hello: list[bytes]) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        peer = Peer(kind, len(self.peers), sock, hello)
        self.peers.append(peer)
        self.by_socket[sock] = peer
        sock.connect(address)
        self.poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        """Close every socket and the context (safe twice)."""
        for peer in self.peers:
            peer.sock.close(0)
        self.peers.clear()
        self.by_socket.clear()
        self.context.term()

    # --- sending --------------------------------------------------------------------------

    def join(self, kind: str) -> None:
        """Every peer of ``kind`` says hello now; its beats start, spread over a second."""
        now = time.monotonic()
        group = [p for p in self.peers if p.kind == kind]
        for number, peer in enumerate(group):
            self._send(peer, peer.hello)
            heapq.heappush(self.events, (now + HEARTBEAT_S * (number + 1) / len(group),
                                         peer.index, "beat"))
            if kind == "consumer":
                heapq.heappush(self.events, (
                    now + self.epoch_every * (number + 1) / len(group), peer.index, "epoch"))

    def _send(self, peer: Peer, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            peer.sock.send_multipart(frames, zmq.NOBLOCK)
            self.tally.sent += 1

    def _beat(self, peer: Peer, now: float) -> None:
        messages = self.messages
        peer.beats += 1
        if peer.kind == "worker":
            record: Any = messages.Heartbeat(stats={
                "elements": 100 * peer.beats, "bytes": 10000 * peer.beats, "fallbacks": 0,
                "rejected": 0, "cpu_seconds": round(0.5 * peer.beats, 3), "credits": 0.0,
                "ring_fill": 0.0})
        elif peer.job is None:
            self._send(peer, peer.hello)  # REGISTER until the job is known, as a Loader
            return
        else:
            record = messages.Heartbeat(stats={
                "elements": 100 * peer.beats, "bytes": 10000 * peer.beats,
                "wait_seconds": round(WAIT_SHARE * HEARTBEAT_S * peer.beats, 3),
                "skipped": 0, "active": 1})
        self._send(peer, self.encode(record.COMMAND, messages.encode(record)))

    def _ask_epoch(self, peer: Peer, now: float) -> None:
        if peer.asked is not None:
            if now - peer.asked < EPOCH_TIMEOUT_S:
                return
            if peer.in_window:
                self.tally.unanswered += 1
        if peer.job is None:
            peer.asked = None
            with contextlib.suppress(KeyError):  # its earlier EPOCH went unanswered
                self.prompt.unregister(peer.sock)
            return
        record = self.messages.Epoch(job=peer.job, epoch=peer.epoch)
        peer.epoch += 1
        peer.asked = now
        peer.in_window = self.window is not None and self.window[0] <= now < self.window[1]
        self.prompt.register(peer.sock, zmq.POLLIN)
        self._send(peer, self.encode(record.COMMAND, self.messages.encode(record)))

    # --- receiving ------------------------------------------------------------------------

    def _heard(self, peer: Peer, frames: list[bytes], now: float) -> None:
        from zloader.transport.protocol import Command, ProtocolError, decode

        self.tally.received += 1
        try:
            command = Command(frames[1][0])
        except (IndexError, ValueError):
            self.tally.errors.append(f"undecodable message to {peer.kind} {peer.index}")
            return
        name = command.name
        self.tally.by_command[name] = self.tally.by_command.get(name, 0) + 1
        if command is Command.UNKNOWN:
            self.tally.forgotten += 1
            if peer.kind == "worker":
                self._send(peer, peer.hello)
            else:
                peer.job = None
        elif command is Command.ACK:
            peer.acked = True
        elif command in (Command.TASK, Command.RELEASE):
            self.last_move = now
        elif command is Command.ERROR:
            if len(self.tally.errors) < 10:
                self.tally.errors.append(f"{peer.kind} {peer.index}: {frames[2][:300]!r}")
        elif command is Command.JOB and peer.kind == "consumer":
            answer = peer.asked is not None and b'"read":' in frames[2]
            if peer.job is None or answer:
                try:
                    view = self.messages.decode(decode(frames))
                except ProtocolError as exc:
                    self.tally.errors.append(f"consumer {peer.index}: {exc}")
                    return
                assert isinstance(view, self.messages.Job)
                peer.job = view.job
                if answer and view.read is not None and peer.asked is not None:
                    if peer.in_window:
                        self.tally.latencies.append(now - peer.asked)
                    peer.asked = None
                    self.prompt.unregister(peer.sock)

    # --- the loop -------------------------------------------------------------------------

    def run_until(self, done: Any, deadline: float) -> bool:
        """Send what is due and take what comes until ``done()`` or ``deadline``;
        returns whether ``done()`` held. Every socket is read each ``SWEEP_S``; between
        sweeps, only those of consumers waiting for an EPOCH's answer (its latency is
        what is measured; the rest only need reading before their queues fill)."""
        next_sweep = 0.0
        while True:
            if done():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if self.window is not None and now >= self.window[1] and self.window_end is None:
                self.window_end = self.tally.copy()
            while self.events and self.events[0][0] <= now + SLOT_S:
                due, index, what = heapq.heappop(self.events)
                peer = self.peers[index]
                if what == "beat":
                    self._beat(peer, now)
                    heapq.heappush(self.events, (due + HEARTBEAT_S, index, what))
                else:
                    self._ask_epoch(peer, now)
                    heapq.heappush(self.events, (due + self.epoch_every, index, what))
            if time.monotonic() >= next_sweep:
                self._take(self.poller.poll(0))
                next_sweep = time.monotonic() + SWEEP_S
            wake = min(deadline, next_sweep, self.events[0][0] if self.events else deadline)
            timeout = max(0.0, min(wake - time.monotonic(), SLOT_S))
            if self.prompt.sockets:
                self._take(self.prompt.poll(int(timeout * 1000)))
            else:
                time.sleep(timeout)

    def _take(self, ready: list[tuple[Any, int]]) -> None:
        """Read every message queued on the ``ready`` sockets."""
        for sock, _ in ready:
            peer = self.by_socket[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._heard(peer, frames, time.monotonic())


def raise_fd_limit(sockets: int) -> None:
    """A soft limit on open files that fits ``sockets`` TCP sockets here (and in the
    broker, which inherits it): each takes a connection and a ZeroMQ mailbox."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * sockets + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@contextlib.contextmanager
def broker() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``zloader-broker`` on 127.0.0.1, answering STATUS before this yields."""
    from zloader._status import fetch_status

    address = f"tcp://127.0.0.1:{free_port()}"
    process = subprocess.Popen([str(BIN / "zloader-broker"), "--bind", address,
                                "--heartbeat", str(HEARTBEAT_S), "--log-level", "error"])
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                fetch_status(address, None, 2.0)
                break
            except Exception:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"zloader-broker at {address} did not answer") from None
                time.sleep(0.2)
        yield address, process
    finally:
        stop([process], 20)


def percentile(values: list[float], share: float) -> float | None:
    """The ``share`` quantile of ``values`` (nearest rank), None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def fleet_section(args: argparse.Namespace) -> dict[str, Any]:
    """Run the simulated fleet against a broker process and return its figures."""
    workers, consumers = args.fleet_workers, args.fleet_consumers
    window, warmup = args.fleet_seconds, args.fleet_warmup
    raise_fd_limit(workers + consumers)
    me = psutil.Process()
    result: dict[str, Any] = {
        "workers": workers, "consumers": consumers,
        "jobs": max(1, -(-consumers // CONSUMERS_PER_JOB)), "window_s": window,
        "warmup_s": warmup, "heartbeat_s": HEARTBEAT_S,
        "epoch_every_s": args.fleet_epoch_every,
        "wait_share": WAIT_SHARE, "nproc": os.cpu_count(), **provenance()}
    with broker() as (address, process):
        fleet = Fleet(address, workers, consumers, args.fleet_epoch_every)
        try:
            brokers = psutil.Process(process.pid)
            t0 = time.monotonic()
            fleet.join("consumer")
            if not fleet.run_until(lambda: all(p.job for p in fleet.peers
                                               if p.kind == "consumer"),
                                   t0 + START_TIMEOUT_S):
                raise RuntimeError("the consumers' jobs did not all come")
            result["consumers_registered_s"] = time.monotonic() - t0
            fleet.join("worker")
            if not fleet.run_until(lambda: all(p.acked for p in fleet.peers
                                               if p.kind == "worker"),
                                   time.monotonic() + START_TIMEOUT_S):
                raise RuntimeError("the workers were not all acknowledged")
            result["workers_registered_s"] = time.monotonic() - t0
            # The pool places a joining fleet on what it knows of the jobs' hunger so far
            # and evens it out as their consumers report (at MOVES_PER_SECOND): measured
            # once that is over.
            fleet.run_until(lambda: time.monotonic() - fleet.last_move >= SETTLE_S,
                            time.monotonic() + START_TIMEOUT_S)
            result["settled_s"] = time.monotonic() - t0
            result["moves_joining"] = fleet.tally.by_command.get("RELEASE", 0)
            fleet.run_until(lambda: False, time.monotonic() + warmup)
            start = fleet.tally.copy()
            cpu0, mine0 = _cpu(brokers), _cpu(me)
            t_start = time.monotonic()
            fleet.window = (t_start, t_start + window)
            fleet.run_until(lambda: False, t_start + window)
            cpu, mine = _cpu(brokers) - cpu0, _cpu(me) - mine0
            seconds = time.monotonic() - t_start
            # EPOCHs sent in the window have a few seconds more to be answered
            fleet.run_until(lambda: all(p.asked is None or not p.in_window
                                        for p in fleet.peers), time.monotonic()
                            + EPOCH_TIMEOUT_S)
            end = fleet.window_end or fleet.tally.copy()
            late = sum(1 for p in fleet.peers if p.asked is not None and p.in_window)
            status = _status(address)
        finally:
            fleet.close()
    latencies = fleet.tally.latencies
    per_peer = cpu / seconds / max(1, workers + consumers)
    fleet_size = CPU_TARGET / per_peer if per_peer > 0 else None
    moves = {k: end.by_command.get(k, 0) - start.by_command.get(k, 0)
             for k in ("TASK", "RELEASE")}
    result.update(
        seconds=seconds, broker_cpu_s=cpu, broker_cpu=cpu / seconds,
        own_cpu=mine / seconds, epochs=len(latencies),
        epoch_unanswered=fleet.tally.unanswered + late,
        epoch_p50_s=percentile(latencies, 0.50), epoch_p99_s=percentile(latencies, 0.99),
        epoch_max_s=max(latencies) if latencies else None,
        to_broker_per_s=(end.sent - start.sent) / seconds,
        from_broker_per_s=(end.received - start.received) / seconds,
        received_by_command={k: v - start.by_command.get(k, 0)
                             for k, v in end.by_command.items()},
        moves=moves, forgotten=end.forgotten - start.forgotten,
        errors=fleet.tally.errors, broker_status=status,
        cpu_per_peer=per_peer, fleet_at_target=fleet_size,
        workers_at_target=fleet_size * workers / (workers + consumers) if fleet_size else None,
        consumers_at_target=(fleet_size * consumers / (workers + consumers)
                             if fleet_size else None))
    p99 = result["epoch_p99_s"]
    result["holds"] = bool(result["broker_cpu"] < CPU_TARGET and p99 is not None
                           and p99 < P99_TARGET_S and not result["epoch_unanswered"])
    return result


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _status(address: str) -> dict[str, Any]:
    """What the broker holds after the window: workers, jobs, consumers, the fewest and
    most workers a job has, and how many jobs are hungry."""
    from zloader._status import fetch_status

    try:
        report = fetch_status(address, None, 10.0)
    except Exception as exc:
        return {"error": repr(exc)}
    jobs = report.get("jobs", [])
    held = [int(j.get("workers", 0)) for j in jobs] or [0]
    return {"workers": len(report.get("workers", [])), "jobs": len(jobs),
            "consumers": sum(int(j.get("consumers", 0)) for j in jobs),
            "job_workers_min": min(held), "job_workers_max": max(held),
            "hungry_jobs": sum(1 for j in jobs if j.get("hungry"))}


def fleet_table(results: dict[str, Any]) -> list[str]:
    """Markdown lines: the figures of one fleet run against the targets."""
    r = results

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    cpu_holds = "yes" if r["broker_cpu"] < CPU_TARGET else "no"
    p99 = r["epoch_p99_s"]
    p99_holds = "yes" if p99 is not None and p99 < P99_TARGET_S else "no"
    lines = [
        f"{r['workers']} simulated workers and {r['consumers']} consumers ({r['jobs']} jobs "
        f"of {CONSUMERS_PER_JOB}), a heartbeat a second each, an EPOCH per consumer every "
        f"{r['epoch_every_s']:g} s; {r['seconds']:.0f} s measured after {r['warmup_s']:g} s "
        f"of warm-up (all registered {r['workers_registered_s']:.1f} s after start; the "
        f"pool settled after {r.get('settled_s', 0.0):.1f} s and "
        f"{r.get('moves_joining', 0)} moves).", "",
        "| figure | measured | target | holds |", "|---|---|---|---|",
        f"| broker CPU (share of one core) | {r['broker_cpu']:.2f} | < {CPU_TARGET} | "
        f"{cpu_holds} |",
        f"| EPOCH answer p50 | {ms(r['epoch_p50_s'])} | | |",
        f"| EPOCH answer p99 | {ms(p99)} | < {P99_TARGET_S * 1000:.0f} ms | {p99_holds} |",
        f"| EPOCH answer max | {ms(r['epoch_max_s'])} | | |",
        f"| EPOCHs answered / unanswered | {r['epochs']} / {r['epoch_unanswered']} | | |",
        f"| messages/s to the broker | {r['to_broker_per_s']:.0f} | | |",
        f"| messages/s from the broker | {r['from_broker_per_s']:.0f} | | |",
        f"| workers moved (TASK / RELEASE in the window) | {r['moves']['TASK']} / "
        f"{r['moves']['RELEASE']} | 0 | |",
        f"| peers forgotten (UNKNOWN) | {r['forgotten']} | 0 | |",
        f"| simulator's own CPU (share of one core) | {r['own_cpu']:.2f} | | |",
        ""]
    if r["fleet_at_target"]:
        lines.append(
            f"Broker CPU per peer: {r['cpu_per_peer'] * 1e6:.0f} µs/s. Extrapolated "
            f"linearly, one broker runs about {r['fleet_at_target']:.0f} peers "
            f"({r['workers_at_target']:.0f} workers and {r['consumers_at_target']:.0f} "
            f"consumers) at {CPU_TARGET:.0%} of a core (optimistic: a JOB view grows with "
            "its job's workers and the pool's weighing with the jobs squared).")
    if r["errors"]:
        lines.append(f"Errors: {'; '.join(r['errors'][:5])}")
    return lines
