"""Carry out the broker's ``desired_workers`` with worker processes on this host.

``zloader-worker --processes N`` runs a :class:`Supervisor`: it keeps N worker processes,
replacing (after a :class:`Backoff`) and logging each that dies.

``zloader-worker --autoscale --max-processes N`` runs a :class:`LocalActuator`: once a
second it asks the broker for its status (the same request as ``zloader status``) and

- **grows**: when running jobs lack workers (``desired_workers`` above ``workers``, less the
  idle workers and the processes still starting), it starts that many more, up to ``N``
  processes on this host;
- **shrinks**: it drains (SIGTERM) those of its processes the broker marks ``surplus``: a
  draining worker finishes the splits it took and leaves, so nothing is lost or repeated.

Hybrid placement: an actuator on a host where the lacking job has consumers, with an idle
core, grows at once; any other waits ``remote_delay`` seconds of the shortfall first, so
the trainer's own host fills its idle cores before other hosts are used (local workers
send through shared memory, the cheapest path). The broker sends remote workers away first
when a job has too many (``zloader/broker/status.py``, ``_surplus``). :func:`plan` is the
decision, without processes, for tests and for other actuators (``zloader.ray``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from zloader._defaults import (
    ACTUATOR_INTERVAL,
    DRAIN_SECONDS,
    REMOTE_DELAY,
    RESTART_DELAY,
    RESTART_MAX_DELAY,
    RESTART_RESET_SECONDS,
    SUPERVISE_POLL,
)
from zloader._host import host_id, loopback
from zloader._status import Unanswered, fetch_status
from zloader.transport.keys import Keys

__all__ = ["Backoff", "LocalActuator", "Scaling", "Shortfall", "Supervisor", "follow",
           "how_it_ended", "plan", "short_jobs"]

log = logging.getLogger("zloader.actuator")


@dataclass
class Scaling:
    """What an actuator should do now: ``start`` more workers, ``drain`` these (its own
    worker ids), and ``lacking``: the workers running jobs lack in all."""

    start: int = 0
    drain: list[str] = field(default_factory=list)
    lacking: int = 0


def plan(status: dict[str, Any], mine: set[str], starting: int, room: int, local_host: str,
         idle_cores: float, short_for: float, remote_delay: float,
         loopback_only: bool = False) -> Scaling:
    """Decide from a broker ``status`` what one actuator should do.

    Args:
        mine: ids of the registered workers this actuator runs (some may be draining).
        starting: its processes started but not registered yet.
        room: processes it may still start (its budget less what it runs).
        local_host: its host's id (``zloader._host.host_id``).
        idle_cores: cores idle on its host.
        short_for: seconds the service has lacked workers without a break.
        remote_delay: seconds of shortfall after which it grows without local consumers.
        loopback_only: its workers listen on loopback: they can serve only jobs whose
            consumers run on its host.
    """
    workers = status.get("workers", [])
    short = short_jobs(status)
    if loopback_only:
        short = [j for j in short if local_host in j.get("consumer_hosts", [])]
    lacking = sum(int(j["desired_workers"]) - int(j["workers"]) for j in short)
    out = Scaling(lacking=lacking)
    hosts = {h for j in short for h in j.get("consumer_hosts", [])}
    # Idle workers that can take a lacking job (the broker gives a loopback worker only
    # to jobs read on its host) will be given one: they count against the shortfall.
    idle = sum(1 for w in workers if w.get("job") is None and not w.get("surplus")
               and (not loopback(str(w.get("endpoint", ""))) or w.get("host_id") in hosts))
    need = lacking - idle - starting
    fast = local_host in hosts and idle_cores >= 1.0 and short_for < remote_delay
    if need > 0 and room > 0 and (fast or short_for >= remote_delay):
        # At once, only as many as there are idle cores; after the delay, the rest.
        out.start = min(need, room, int(idle_cores) if fast else need)
    out.drain = [w["worker"] for w in workers if w.get("surplus") and w["worker"] in mine]
    return out


def short_jobs(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The running jobs of a broker status with fewer workers than they want."""
    return [j for j in status.get("jobs", []) if j.get("state") == "running"
            and int(j.get("desired_workers", 0)) > int(j.get("workers", 0))]


class Shortfall:
    """How long the service has lacked workers without a break (``short_for``)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def seconds(self, now: float, status: dict[str, Any]) -> float:
        if not short_jobs(status):
            self._since = None
            return 0.0
        if self._since is None:
            self._since = now
        return now - self._since


def follow(broker: str, keys: Keys | None, interval: float, stop: threading.Event,
           step: Callable[[dict[str, Any], float], Any],
           actuator: Callable[[], dict[str, Any]] | None = None) -> None:
    """Call ``step(status, now)`` with the broker's status every ``interval`` seconds until
    ``stop`` is set (a broker that does not answer is logged and asked again). Each
    request names the ``actuator()`` (``{id, cap, workers}``: the ids of the workers it
    runs): the broker counts its cap in the fleet's, which bounds every job's
    ``desired_workers``."""
    while not stop.wait(interval):
        try:
            status = fetch_status(broker, keys, timeout=5.0,
                                  actuator=actuator() if actuator is not None else None)
        except Unanswered as exc:
            log.warning("autoscale: %s", exc)
            continue
        step(status, time.monotonic())


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    started: float
    worker: str | None = None  # its worker id, once the broker lists it
    draining: bool = False


class LocalActuator:
    """Grows and shrinks worker processes on this host to follow ``desired_workers``.

    Args:
        broker: the broker's address.
        keys: the broker's keys (None: none).
        command: the command that runs one worker process (``zloader-worker`` without
            ``--autoscale``).
        max_processes: the core budget: never more worker processes than this.
        start: processes to run from the start (they are drained like any other when the
            broker marks them surplus: idle for a cooldown while no job lacks workers).
        interval: seconds between two looks at the broker's status.
        remote_delay: seconds a shortfall lasts before this host grows without consumers
            of the job here or without an idle core (each actuator adds up to as much
            again, at random, so that several do not all answer one shortfall at once).
        loopback_only: its workers listen on loopback (no ``--advertise``): it grows only
            for jobs whose consumers run on this host.
    """

    def __init__(self, broker: str, keys: Keys | None, command: Sequence[str],
                 max_processes: int, start: int = 1, interval: float = ACTUATOR_INTERVAL,
                 remote_delay: float = REMOTE_DELAY, loopback_only: bool = False) -> None:
        if max_processes < 1:
            raise ValueError(f"max_processes must be at least 1, got {max_processes}")
        self.broker = broker
        self.keys = keys
        self.command = list(command)
        self.max_processes = max_processes
        self.initial = min(start, max_processes)
        self.interval = interval
        self.remote_delay = remote_delay * (1.0 + random.random())
        self.loopback_only = loopback_only
        self.stop = threading.Event()
        self.children: dict[int, _Child] = {}
        self._shortfall = Shortfall()
        self._host = host_id()
        self.id = f"local-{self._host[:16]}-{os.getpid()}"

    def run(self) -> None:
        """Follow the broker until :attr:`stop` is set; then drain every process."""
        psutil.cpu_percent(None)  # the first call only starts the measurement
        try:
            for _ in range(self.initial):
                self._spawn()
            follow(self.broker, self.keys, self.interval, self.stop, self.step,
                   lambda: {"id": self.id, "cap": self.max_processes, "workers": [
                       c.worker for c in self.children.values() if c.worker is not None]})
        finally:
            self._stop_all()

    def step(self, status: dict[str, Any], now: float) -> Scaling:
        """Act once on a broker status."""
        self._reap()
        pids = {w["pid"]: w["worker"] for w in status.get("workers", [])
                if w.get("host_id") == self._host}
        for pid, child in self.children.items():
            child.worker = pids.get(pid, child.worker)
        decision = plan(status, {c.worker for c in self.children.values() if c.worker},
                        starting=sum(1 for c in self.children.values() if c.worker is None),
                        room=self.max_processes - len(self.children),
                        local_host=self._host, idle_cores=self._idle_cores(),
                        short_for=self._shortfall.seconds(now, status),
                        remote_delay=self.remote_delay,
                        loopback_only=self.loopback_only)
        for _ in range(decision.start):
            self._spawn()
        for child in self.children.values():
            if child.worker in decision.drain and not child.draining:
                child.draining = True
                child.process.send_signal(signal.SIGTERM)
                log.info("autoscale: draining worker pid %d (surplus)", child.process.pid)
        return decision

    @staticmethod
    def _idle_cores() -> float:
        busy = psutil.cpu_percent(None) / 100.0
        return (os.cpu_count() or 1) * (1.0 - busy)

    def _spawn(self) -> None:
        # A worker drains when this process dies, even by SIGKILL (the signal is tied to
        # the thread that starts it: run() starts them all from one thread).
        process = subprocess.Popen(self.command, preexec_fn=_drain_with_parent)
        self.children[process.pid] = _Child(process, time.monotonic())
        log.info("autoscale: started worker pid %d (%d running)", process.pid,
                 len(self.children))

    def _reap(self) -> None:
        for pid, child in list(self.children.items()):
            code = child.process.poll()
            if code is None:
                continue
            del self.children[pid]
            if not child.draining:
                log.warning("autoscale: worker pid %d %s", pid, how_it_ended(code))

    def _stop_all(self) -> None:
        _stop_all([child.process for child in self.children.values()])
        self.children.clear()


def how_it_ended(code: int) -> str:
    """A child's return code in words: ``"was killed by signal SIGKILL"`` (``-9``, what the
    kernel's OOM killer sends) or ``"exited with status 1"``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}"
    return f"exited with status {code}"


class Backoff:
    """How long to wait before replacing a worker process that died: ``first`` seconds,
    doubled at each death up to ``cap``; a process that had run ``reset_after`` seconds or
    more starts the sequence again (it had been working).

    Raises:
        ValueError: ``first`` is not in ``(0, cap]``, or ``reset_after`` is not positive.
    """

    def __init__(self, first: float = RESTART_DELAY, cap: float = RESTART_MAX_DELAY,
                 reset_after: float = RESTART_RESET_SECONDS) -> None:
        if not 0 < first <= cap or reset_after <= 0:
            raise ValueError(f"the restart delay needs 0 < first <= cap and reset_after > 0, "
                             f"got first={first}, cap={cap}, reset_after={reset_after}: "
                             "check --restart-delay and --restart-max-delay")
        self.first, self.cap, self.reset_after = first, cap, reset_after
        self._next = first

    def death(self, lived: float) -> float:
        """The delay before replacing a process that died after ``lived`` seconds."""
        if lived >= self.reset_after:
            self._next = self.first
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay


@dataclass
class _Slot:
    """One of the processes a :class:`Supervisor` keeps: the one running, or, after it
    died, when to start its replacement (``due``)."""

    process: subprocess.Popen[bytes]
    started: float
    backoff: Backoff
    due: float | None = None


class Supervisor:
    """Keeps ``count`` worker processes running until :meth:`request_stop` (what
    ``zloader-worker --processes N`` does), then drains them.

    A process that ends on its own is logged as a warning naming its pid and how it ended
    (a signal, an exit status) and replaced after its slot's :class:`Backoff`; one that
    ended with a signal or a non-zero status counts as a death. :meth:`run` returns 1 if
    any died during the run or failed to drain at the end (with a last line saying how
    many), else 0: a supervisor under systemd or a batch scheduler then shows the failure
    even though the service kept going.

    Args:
        command: the command that runs one worker process.
        count: processes to keep.
        backoff: makes each slot's :class:`Backoff` (``Backoff()``: the defaults).
    """

    def __init__(self, command: Sequence[str], count: int,
                 backoff: Callable[[], Backoff] = Backoff) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self.command = list(command)
        self.count = count
        self.backoff = backoff
        self.deaths: list[tuple[int, int]] = []  # (pid, return code) of each death
        self._stopping = False  # a plain flag: request_stop runs in a signal handler

    def request_stop(self) -> None:
        """Drain the processes and return from :meth:`run` (safe in a signal handler)."""
        self._stopping = True

    def run(self) -> int:
        """Start the processes, keep them until :meth:`request_stop`, drain them; returns
        the exit status for the command (0, or 1 if any died)."""
        slots = [_Slot(self._spawn(), time.monotonic(), self.backoff())
                 for _ in range(self.count)]
        try:
            while not self._stopping:
                time.sleep(SUPERVISE_POLL)  # (a signal handler runs during it)
                now = time.monotonic()
                for slot in slots:
                    if not self._stopping:
                        self._look(slot, now)
        finally:
            failed = _stop_all([s.process for s in slots if s.due is None])
        for pid, code in failed:
            log.warning("zloader-worker: worker pid %d %s while it drained", pid,
                        how_it_ended(code))
        if not self.deaths and not failed:
            return 0
        deaths = len(self.deaths)
        log.error("zloader-worker: %d worker process%s died during this run (%s) and %s "
                  "replaced%s; exiting with status 1", deaths, "" if deaths == 1 else "es",
                  ", ".join(f"pid {pid} {how_it_ended(code)}" for pid, code in self.deaths)
                  or "none", "was" if deaths == 1 else "were",
                  f"; {len(failed)} failed to drain" if failed else "")
        return 1

    def _look(self, slot: _Slot, now: float) -> None:
        """Replace the slot's process if it is due; note its end if it ended."""
        if slot.due is not None:
            if now >= slot.due:
                ended = slot.process.pid
                slot.process, slot.started, slot.due = self._spawn(), now, None
                log.warning("zloader-worker: started worker pid %d in place of pid %d",
                            slot.process.pid, ended)
            return
        code = slot.process.poll()
        if code is None:
            return
        lived = now - slot.started
        delay = slot.backoff.death(lived)
        slot.due = now + delay
        if code != 0:
            self.deaths.append((slot.process.pid, code))
        deaths = len(self.deaths)
        log.warning("zloader-worker: worker pid %d %s after %.1f s%s; restarting it in "
                    "%.1f s (%d death%s so far)", slot.process.pid, how_it_ended(code),
                    lived, " (an out-of-memory kill is one: see the kernel log, dmesg)"
                    if code == -signal.SIGKILL else "", delay, deaths,
                    "" if deaths == 1 else "s")

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Drains (SIGTERM) when this process dies, even by SIGKILL: see LocalActuator.
        return subprocess.Popen(self.command, preexec_fn=_drain_with_parent)


def _stop_all(processes: list[subprocess.Popen[bytes]]) -> list[tuple[int, int]]:
    """Drain ``processes`` (SIGTERM), kill those still there after ``DRAIN_SECONDS`` and
    a margin; returns (pid, return code) of those that did not end with status 0."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + DRAIN_SECONDS + 5.0
    failed = []
    for process in processes:
        try:
            code = process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if code != 0:
            failed.append((process.pid, code))
    return failed


def _drain_with_parent() -> None:
    """In the child before exec: SIGTERM (a drain) when the parent dies (Linux prctl)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
