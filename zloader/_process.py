"""Starting local worker processes: forked from the Loader's process, or spawned fresh.

Forking is the default on Linux, as with torch's DataLoader: the worker starts in
milliseconds with every module the trainer already imported (torch, the dataset's code)
instead of paying an interpreter start and those imports again, and with the Loader's
pipeline in memory: a forked worker runs the very pipeline object its Loader holds (a
dataset of any size, as torch's workers get theirs), never a pickled copy. The Loader forks
before it starts any thread of its own. ``start_method="spawn"`` runs a fresh interpreter
instead, for processes whose other threads make forking unsafe.

A forked child must not need a lock that another thread of the parent may have held at the
fork: above all the import lock of a module that thread was importing (a Loader made while
another thread imports numpy's lazily loaded parts, or makes another Loader). So the
worker's own modules are imported here, in the parent, before any fork; forks are
serialized; and the child first repairs the import system: each module lock that a thread
of the parent held (a thread the child does not have) is dropped, with the module that
thread had half imported, so that the child imports it afresh when it needs it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib._bootstrap
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from zloader._command import with_sys_path, worker_command
from zloader._defaults import GATE_SECONDS, START_METHODS
from zloader.handoff import FDS_LOCK, Handoff, forked, reap
from zloader.packed import Swap, install
from zloader.transport.keys import Keys
from zloader.worker import WorkerProcess  # imported before any fork (see above)

__all__ = ["START_METHODS", "ForkedWorker", "Forker", "fork_workers", "start_worker"]


class _Handle:
    """A forked process, with the part of ``subprocess.Popen``'s interface the Loader uses
    (``pid``, ``poll`` and ``_exited`` come from the subclass)."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self._exited(0.01 if left is None else min(left, 0.5))
        return code

    def _exited(self, timeout: float) -> None:
        raise NotImplementedError

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedWorker(_Handle):
    """A process this one forked (a worker, or the forker)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # (the forker's is polled from two threads)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # (reaped by someone else: its status is lost)
                    pid, status = self.pid, 1 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def _exited(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the process to exit: on its pidfd, woken the
        moment it does (Linux 5.3+), else a sleep."""
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # (no pidfds here, or already reaped)
            time.sleep(min(timeout, 0.01))
            return
        try:
            _readable(fd, timeout)
        finally:
            os.close(fd)


_FORK_LOCK = threading.Lock()
"""Held while forking, so that Loaders made on several threads at once fork one by one."""


def start_worker(method: str, address: str, bind: str, keys: Keys | None = None,
                 pipelines: dict[str, Any] | None = None, swaps: list[Swap] | None = None,
                 handoff: Handoff | None = None, gate: int | None = None,
                 packs: bool = False, slot: int | None = None, report: int | None = None
                 ) -> ForkedWorker | subprocess.Popen[bytes]:
    """Start one worker attached to the broker at ``address``, its data socket at ``bind``
    (with ``keys``, CURVE on both); it exits when this process does.

    ``pipelines`` maps fingerprints to the pipelines a forked worker runs as they are in
    this process's memory, without fetching or unpickling them; a forked worker reads the
    lists ``swaps`` name packed (zloader/packed.py), and those of ``handoff`` once it has
    packed them (zloader/handoff.py). A forked worker given ``gate`` (a pipe's read end)
    connects once it reads a byte from it (its Loader's broker is bound), or after
    ``GATE_SECONDS``; one that ``packs`` first forks ``handoff``'s packer. A forked
    worker given ``slot`` asks the broker for that task index, and tells its pipelines'
    sources (``Source.forked``), then says on ``report`` (a pipe's write end, see
    :class:`Reports`) whether they prepared fine. All are ignored by ``spawn``.
    """
    parent = os.getpid()
    if method == "spawn":
        command = worker_command(address, bind=bind, parent=parent,
                                 keys=keys.path if keys is not None else None,
                                 insecure=True)  # (the Loader checked the bind)
        return subprocess.Popen(command, env=with_sys_path(), cwd=os.getcwd(),
                                stdin=subprocess.DEVNULL)
    with _FORK_LOCK, FDS_LOCK:
        pid = _fork()
    if pid:
        return ForkedWorker(pid)
    _worker_main(parent, address, bind, keys, pipelines, swaps, handoff, gate, packs, slot,
                 report)


_HELD = frozenset((signal.SIGINT, signal.SIGTERM))


def _fork() -> int:
    """``os.fork()``, the child starting with SIGINT and SIGTERM blocked: until it has set
    its own dispositions, one of them must neither run the trainer's handler there (a
    training script's SIGTERM handler saving a checkpoint) nor be lost (the child's
    SIGTERM, its Loader closing). The parent's mask is as it was."""
    # (the mask read first: a change of it runs the handlers of signals pending, and one
    # that raises, Ctrl-C's, must not leave this thread with the two blocked)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    if pid:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        except BaseException:  # (a handler of a signal held meanwhile raised: no child)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise
    return pid


def _worker_main(parent: int, address: str, bind: str, keys: Keys | None,
                 pipelines: dict[str, Any] | None, swaps: list[Swap] | None,
                 handoff: Handoff | None, gate: int | None, packs: bool,
                 slot: int | None, report: int | None = None) -> NoReturn:
    """A forked worker's life (see :func:`start_worker`), ``parent`` the process that
    forked it, ``report`` the pipe of its reports (it says there when it has prepared):
    never returns into the caller's code."""
    code = 1
    try:
        # Forked with SIGINT and SIGTERM blocked (_fork): the trainer's handlers, which
        # this process inherits, never run here. The parent's Ctrl-C is ignored (it
        # stops us); a SIGTERM (a Loader closed while we start) waits for our handler.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        # The parent's objects, garbage included, are never collected here: a cycle the
        # parent had not collected yet would run its finalizers in this process (a
        # TensorFlow object's, after fork, aborts it).
        gc.freeze()
        repair_imports()
        install(swaps or [])
        forked(handoff)
        if packs and handoff is not None:
            handoff.fork_packer()
        worker = WorkerProcess(address, bind, parent=parent, keys=keys,
                               inherited=pipelines, slot=slot,
                               prepared=functools.partial(_prepared, report, slot)
                               if report is not None and slot is not None else None)
        signal.signal(signal.SIGTERM, lambda *_: worker.halt())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (one that came: now)
        if not worker.stop.is_set():  # (its Loader closed while it started: no user code)
            worker.run(functools.partial(_through_gate, gate) if gate is not None else None)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)  # no atexit handlers or finalizers of the parent's objects


# --- several workers, through the forker ----------------------------------------------------

_REPORT = struct.Struct("<Biii")
"""A report on the forker's pipe: kind (_FORKED, _PREPARED, _ENDED), the worker's slot, its
pid, and, for _ENDED, its exit status as ``Popen.returncode`` gives it, for _PREPARED 1
when its sources prepared its first epoch fine (``Source.forked``), else 0. The forker
writes _FORKED and _ENDED, each worker its _PREPARED."""
_FORKED, _PREPARED, _ENDED = 1, 2, 3


def fork_workers(address: str, binds: list[str], keys: Keys | None = None,
                 pipelines: dict[str, Any] | None = None, swaps: list[Swap] | None = None,
                 handoff: Handoff | None = None, gate: int | None = None
                 ) -> tuple[Forker, list[ForkedChild]]:
    """Fork the forker, which forks a worker for each of ``binds`` (worker ``i`` binds
    ``binds[i]`` and asks for slot ``i``) and then ``handoff``'s packer; the forker's
    handle and each worker's. The other arguments are :func:`start_worker`'s."""
    trainer = os.getpid()
    reports, report = os.pipe2(os.O_CLOEXEC)
    try:
        with _FORK_LOCK, FDS_LOCK:
            pid = _fork()
    except BaseException:
        os.close(reports)
        os.close(report)
        raise
    if pid:
        os.close(report)
        forker = Forker(ForkedWorker(pid), reports, len(binds))
        return forker, [ForkedChild(forker, slot) for slot in range(len(binds))]
    code = 1
    try:
        # (the parent's Ctrl-C, or a SIGTERM to the group, is for the workers: it leaves
        # with them, having reported how each ended. Both stay blocked, as _fork left
        # them: its workers inherit the mask, see _worker_main)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.close(reports)
        gc.freeze()  # (see _worker_main)
        repair_imports()
        forked(handoff)  # (the memfds of other Loaders' handoffs are not for its workers)
        _serve_forks(trainer, report, address, binds, keys, pipelines, swaps, handoff, gate)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _serve_forks(trainer: int, report: int, address: str, binds: list[str],
                 keys: Keys | None, pipelines: dict[str, Any] | None,
                 swaps: list[Swap] | None, handoff: Handoff | None,
                 gate: int | None) -> None:
    """The forker: fork the workers and, after the first, the packer, then reap the workers
    and report on ``report`` until they have all ended or ``trainer`` is gone."""
    slots: dict[int, int] = {}
    me = os.getpid()
    for slot, bind in enumerate(binds):
        pid = os.fork()
        if pid == 0:
            _worker_main(me, address, bind, keys, pipelines, swaps, handoff, gate, False,
                         slot, report)
        slots[pid] = slot
        os.write(report, _REPORT.pack(_FORKED, slot, pid, 0))
        if slot == 0 and handoff is not None:
            # The packer second: the first batch waits for worker 0 alone, and every worker
            # waits for the packer after its first batches (bench.startup (10), 1 M pairs,
            # 4 workers: the 10th batch 516 -> 409 ms, the 3rd 193 -> 258, the 50th 575 ->
            # 457; forked last, it started after every worker's fork).
            handoff.fork_packer()
    if gate is not None:
        os.close(gate)
    if handoff is not None:
        handoff.workers_forked()  # (the workers and the packer hold their own)
    _reap_workers(trainer, report, slots)


def _reap_workers(trainer: int, report: int, slots: dict[int, int]) -> None:
    """The forker, once it forked them: reap its workers (``slots``: pid -> slot) and the
    packer, reporting each worker's end on ``report``, until they have all ended or
    ``trainer`` is gone (then it kills the packer)."""
    wake, woken = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (its wake-up byte ends the wait)
    try:
        watch = os.pidfd_open(trainer)
    except (AttributeError, OSError):
        watch = None  # (no pidfds here: getppid, once a second)
    poller = select.poll()
    for fd in (wake, watch):
        if fd is not None:
            poller.register(fd, select.POLLIN)
    while slots and os.getppid() == trainer:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                break
            if pid in slots:
                os.write(report, _REPORT.pack(_ENDED, slots.pop(pid), pid,
                                              os.waitstatus_to_exitcode(status)))
            else:
                reap()  # (the packer, done)
        if slots:
            poller.poll(1000)
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)
    reap(stop=True)


class Reports:
    """What a Loader's ``count`` forked workers report on the pipe ``reports`` (its read
    end; see _REPORT): each one's pid, whether it prepared its first epoch fine, its exit
    status (the last two, the forker's). Read from the Loader's thread and its I/O
    thread."""

    def __init__(self, reports: int, count: int) -> None:
        self.count = count
        self._reports = reports
        os.set_blocking(reports, False)
        self._lock = threading.Lock()
        self._rest = b""
        self.pids: dict[int, int] = {}  # slot -> pid
        self.prepared: dict[int, bool] = {}  # slot -> whether fine (Source.forked)
        self.codes: dict[int, int] = {}  # slot -> exit status

    def read(self) -> None:
        """Take in the reports that came."""
        with self._lock:
            if self._reports < 0:
                return
            while True:
                try:
                    chunk = os.read(self._reports, 4096)
                except BlockingIOError:
                    return
                if not chunk:  # the forker and its workers are gone
                    return
                data = self._rest + chunk
                whole = len(data) - len(data) % _REPORT.size
                for kind, slot, pid, code in _REPORT.iter_unpack(data[:whole]):
                    if kind == _FORKED:
                        self.pids[slot] = pid
                        self.forked(slot, pid)
                    elif kind == _PREPARED:
                        self.prepared[slot] = bool(code)
                    else:
                        self.codes[slot] = code
                self._rest = data[whole:]

    def wait(self, until: Callable[[], bool], timeout: float) -> bool:
        """Read reports until ``until()`` holds, no more can come, or ``timeout`` seconds
        passed; whether it holds."""
        deadline = time.monotonic() + timeout
        self.read()
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or self._reports < 0 or self.silent():
                self.read()
                return until()
            _readable(self._reports, min(left, 0.1))
            self.read()
        return True

    def silent(self) -> bool:
        """Whether no more reports can come."""
        return False

    def forked(self, slot: int, pid: int) -> None:
        """Worker ``slot`` was reported forked as ``pid`` (under the reading lock)."""

    def all_prepared(self, timeout: float, ended: Callable[[], bool]) -> bool:
        """Wait until every worker has prepared its first epoch (``Source.forked``), one
        failed to, one ended (``ended()``), or ``timeout`` seconds passed: whether all
        prepared fine."""
        def fine() -> bool:
            return len(self.prepared) == self.count and all(self.prepared.values())

        self.wait(lambda: fine() or not all(self.prepared.values()) or ended(), timeout)
        return fine() and not ended()

    def close(self) -> None:
        """Read no more."""
        with self._lock:
            if self._reports >= 0:
                os.close(self._reports)
                self._reports = -1

    def stop(self, timeout: float) -> None:
        """Once the workers are stopped: read no more (``timeout``: see the forker's)."""
        self.close()


class Forker(Reports):
    """The trainer's side of the forker (see the module): its process, and what it
    reported of the workers."""

    def __init__(self, process: ForkedWorker, reports: int, count: int) -> None:
        super().__init__(reports, count)
        self.process = process
        # Each worker's pidfd, opened as its pid is reported: a signal through it cannot
        # reach another process that took the pid after the worker was reaped.
        self.pidfds: dict[int, int] = {}

    def forked(self, slot: int, pid: int) -> None:
        try:
            self.pidfds[slot] = os.pidfd_open(pid)
        except (AttributeError, OSError):  # (no pidfds here, or gone already)
            self.pidfds[slot] = -1

    def silent(self) -> bool:
        return self.process.poll() is not None

    def signal(self, slot: int, signum: int) -> None:
        """Send ``signum`` to worker ``slot``, if it runs."""
        fd = self.pidfds.get(slot, -1)
        with contextlib.suppress(ProcessLookupError):
            if fd >= 0:
                signal.pidfd_send_signal(fd, signum)
            elif slot in self.pids:
                os.kill(self.pids[slot], signum)

    def ended(self, slot: int, timeout: float = 0.0) -> bool:
        """Whether worker ``slot`` has exited (or was never forked), waiting at most
        ``timeout`` seconds; seen on its pidfd (a zombie counts)."""
        fd = self.pidfds.get(slot, -1)
        if fd >= 0:
            return _readable(fd, timeout)
        pid = self.pids.get(slot)
        if timeout:
            time.sleep(min(timeout, 0.01))
        return pid is None or not _exists(pid)

    def pid(self, slot: int) -> int:
        """The pid of worker ``slot`` (reported as the forker forks it); 0 for one the
        forker never forked (it failed to: its error went to stderr)."""
        if slot not in self.pids:
            self.wait(lambda: slot in self.pids, GATE_SECONDS)
        return self.pids.get(slot, 0)

    def code(self, slot: int) -> int | None:
        """Worker ``slot``'s exit status, None while it runs. One whose forker died
        without reporting it (killed) leaves by itself, its parent gone: once it has, its
        status if this process adopted it (a trainer that is PID 1 or a subreaper), else
        1; 1 too for one the forker never forked."""
        self.read()
        if slot in self.codes or self.process.poll() is None:
            return self.codes.get(slot)
        self.read()
        if slot not in self.codes and self.ended(slot):
            self.codes[slot] = _adopted(self.pids.get(slot))
        return self.codes.get(slot)

    def __contains__(self, pid: object) -> bool:
        """Whether ``pid`` is one of the workers (the Loader's own)."""
        self.read()
        if pid not in self.pids.values():
            self.wait(lambda: len(self.pids) == self.count, GATE_SECONDS)
        return pid in self.pids.values()

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the forker to leave (its workers have), then
        kill it; read no more."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.close()
        with self._lock:
            for fd in self.pidfds.values():
                if fd >= 0:
                    os.close(fd)
            self.pidfds.clear()


class ForkedChild(_Handle):
    """A worker the forker forked, as the Loader sees it."""

    def __init__(self, forker: Forker, slot: int) -> None:
        self.forker = forker
        self.slot = slot

    @property
    def pid(self) -> int:  # type: ignore[override]
        return self.forker.pid(self.slot)

    @property
    def returncode(self) -> int | None:
        return self.forker.codes.get(self.slot)

    def poll(self) -> int | None:
        return self.forker.code(self.slot)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            # One the forker has forked but not reported yet (a Loader closed while its
            # forker still forks a large process's workers): its pid is waited for, or
            # the signal would go nowhere and its stop would wait out the timeout.
            self.forker.pid(self.slot)
            self.forker.signal(self.slot, signum)

    def _exited(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a report of the forker (or, the forker
        gone, for the worker to exit)."""
        forker = self.forker
        if not forker.wait(lambda: forker.codes.get(self.slot) is not None, timeout) \
                and forker.silent():
            forker.ended(self.slot, timeout)


def _adopted(pid: int | None) -> int:
    """The exit status of ``pid``, an orphaned worker that has exited, if this process
    adopted it (reaped here), else 1 (its status went to whoever reaped it)."""
    if pid:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 1
        if done:
            return os.waitstatus_to_exitcode(status)
    return 1


def _exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (or is a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepared(report: int, slot: int, ok: bool) -> None:
    """Tell the Loader, on ``report``, that worker ``slot`` has prepared (``ok``: fine)."""
    with contextlib.suppress(OSError):  # (a Loader closed already stopped reading)
        os.write(report, _REPORT.pack(_PREPARED, slot, os.getpid(), int(ok)))
    os.close(report)


def _through_gate(gate: int) -> None:
    """Wait until the Loader's broker is bound (a byte on ``gate``), at most GATE_SECONDS."""
    if _readable(gate, GATE_SECONDS):
        os.read(gate, 1)
    os.close(gate)


def _readable(fd: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``fd`` to be readable (``poll``: ``select``
    cannot take a descriptor numbered 1024 or more, which a process with many Loaders
    has)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def repair_imports() -> list[str]:
    """In a forked child: forget the import locks that threads of the parent held when it
    forked, and the modules they were importing (half run), so that importing them here
    starts afresh instead of waiting forever for a thread that is not here. Returns the
    names of the modules concerned."""
    me = threading.get_ident()
    bootstrap: Any = importlib._bootstrap
    locks = bootstrap._module_locks
    repaired = []
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is None or not getattr(lock, "count", 0) or getattr(lock, "owner", me) == me:
            continue
        del locks[name]
        module = sys.modules.get(name)
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
        repaired.append(name)
    return repaired
