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

import functools
import gc
import importlib._bootstrap
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from zloader._command import with_sys_path, worker_command
from zloader._defaults import GATE_SECONDS, START_METHODS
from zloader.handoff import FDS_LOCK, Handoff, forked
from zloader.packed import Swap, install
from zloader.transport.keys import Keys
from zloader.worker import WorkerProcess  # imported before any fork (see above)

__all__ = ["START_METHODS", "ForkedWorker", "start_worker"]



class ForkedWorker:
    """A forked worker, with the part of ``subprocess.Popen``'s interface the Loader uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self._exited(0.01 if left is None else min(left, 0.5))
        assert self.returncode is not None
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

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_FORK_LOCK = threading.Lock()
"""Held while forking, so that Loaders made on several threads at once fork one by one."""


def start_worker(method: str, address: str, bind: str, keys: Keys | None = None,
                 pipelines: dict[str, Any] | None = None, swaps: list[Swap] | None = None,
                 handoff: Handoff | None = None, gate: int | None = None,
                 packs: bool = False, slot: int | None = None
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
    sources (``Source.forked``). All are ignored by ``spawn``.
    """
    parent = os.getpid()
    if method == "spawn":
        command = worker_command(address, bind=bind, parent=parent,
                                 keys=keys.path if keys is not None else None,
                                 insecure=True)  # (the Loader checked the bind)
        return subprocess.Popen(command, env=with_sys_path(), cwd=os.getcwd(),
                                stdin=subprocess.DEVNULL)
    with _FORK_LOCK, FDS_LOCK:
        pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    code = 1
    try:  # the child: never return into the caller's code
        # The parent's objects, garbage included, are never collected here: a cycle the
        # parent had not collected yet would run its finalizers in this process (a
        # TensorFlow object's, after fork, aborts it).
        gc.freeze()
        repair_imports()
        install(swaps or [])
        forked(handoff)
        if packs and handoff is not None:
            handoff.fork_packer()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C; it stops us
        worker = WorkerProcess(address, bind, parent=parent, keys=keys, inherited=pipelines,
                               slot=slot)
        signal.signal(signal.SIGTERM, lambda *_: worker.halt())
        worker.run(functools.partial(_through_gate, gate) if gate is not None else None)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)  # no atexit handlers or finalizers of the parent's objects


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
