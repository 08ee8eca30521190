"""What a Loader runs itself, as one record: the worker processes it starts and, in
embedded mode (``broker=None``), the private folder of its sockets and the broker it runs
in this process; started in the order forking needs and stopped together."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from zloader._defaults import FORKER_MIN_WORKERS, WORKER_STOP_SECONDS
from zloader.handoff import Handoff
from zloader.pipeline import Pipeline
from zloader.transport.shm import sweep, sweep_dirs

__all__ = ["Embedded", "through_forker"]


def through_forker(start_method: str, workers: int) -> bool:
    """Whether a Loader forks its ``workers`` through the forker (zloader/_process.py):
    from three on (for two, the forker's own fork costs the trainer more than the one
    fork it takes off it: bench.startup's 2-worker cases, 1.10-1.17x torch's first batch
    forked directly against 1.22-1.30x through it, same sitting)."""
    return start_method == "fork" and workers >= FORKER_MIN_WORKERS


@dataclass(eq=False)
class Embedded:
    """A Loader's own processes and, embedded, its socket folder and broker.

    Attributes:
        dir: the private folder of an embedded Loader's sockets (mode 0700, named with
            this process's pid so that a sweep removes it after a kill -9); None with a
            broker of the user's.
        processes: the worker processes it started (``subprocess.Popen``-like).
        handoff: the dataset's lists its workers take packed once the packer (forked by
            the first of them, or by the forker) has packed them (zloader/handoff.py), or
            None.
        broker: the broker it runs in this process (embedded), or None.
        reports: what its forked workers report (zloader/_process.py ``Reports``; the
            forker's, when they were forked through it), or None (spawned workers).
    """

    dir: str | None = None
    processes: list[Any] = field(default_factory=list)
    handoff: Handoff | None = None
    broker: Any = None  # (a zloader.broker.Broker)
    reports: Any = None  # (a zloader._process.Reports, or its Forker)

    def start(self, broker: str | None, workers: int, start_method: str, keys: Any,
              pipeline: Pipeline, inherit: bool, swaps: list[Any],
              handoff: Handoff | None = None) -> str:
        """Start ``workers`` worker processes and, without ``broker``, a folder for the
        sockets and a broker in this process; the broker's address. Workers come first:
        forking must happen before the Loader starts any thread. What Loaders of this user
        that died left (shared-memory segments, socket folders) is swept first."""
        # (the broker's code, imported only by a Loader that runs one)
        from zloader.broker import Broker

        sweep()
        sweep_dirs()
        gate = None
        if broker is None:
            self.dir = tempfile.mkdtemp(prefix=f"zloader-{os.getpid()}-")
            address = f"ipc://{self.dir}/broker"
            # Forked workers connect once the broker is bound (a byte each), not by
            # ZeroMQ's retries, whose intervals grow while a large process forks many.
            gate = os.pipe2(os.O_CLOEXEC) if start_method == "fork" and workers else None
        else:
            address = broker
        try:
            self._start_workers(address, workers, start_method, keys,
                                {pipeline.fingerprint: pipeline} if inherit else None,
                                swaps, handoff, gate[0] if gate is not None else None)
            self.handoff = handoff
            if broker is None:
                self.broker = Broker(address).start()
            if gate is not None:
                os.write(gate[1], b"!" * workers)
        finally:
            for fd in gate or ():
                os.close(fd)
            if handoff is not None:  # (the workers hold the memfds: not this process)
                handoff.workers_forked()
        return address

    def _start_workers(self, address: str, workers: int, start_method: str, keys: Any,
                       pipelines: dict[str, Pipeline] | None, swaps: list[Any],
                       handoff: Handoff | None, gate: int | None) -> None:
        """Start the workers (see :meth:`start`): forked through the forker, forked here
        (one or two, with a pipe for their reports), or spawned."""
        # (the worker's code, imported only by a Loader that runs workers)
        from zloader._process import Reports, fork_workers, start_worker

        binds = [self.endpoint(f"worker-{index}") or "tcp://127.0.0.1:*"
                 for index in range(workers)]
        if through_forker(start_method, workers):
            self.reports, self.processes = fork_workers(address, binds, keys, pipelines,
                                                        swaps, handoff, gate)
            return
        reports = os.pipe2(os.O_CLOEXEC) if start_method == "fork" and workers else None
        if reports is not None:
            self.reports = Reports(reports[0], workers)
        try:
            for index, bind in enumerate(binds):
                self.processes.append(start_worker(
                    start_method, address, bind, keys, pipelines, swaps, handoff, gate,
                    packs=index == 0, slot=index,
                    report=reports[1] if reports is not None else None))
        finally:
            if reports is not None:
                os.close(reports[1])

    @property
    def forker(self) -> Any:
        """The forker that forked its workers (a zloader._process.Forker), or None."""
        if self.reports is None:
            return None
        from zloader._process import Forker  # (imported already: it made the reports)

        return self.reports if isinstance(self.reports, Forker) else None

    def prepared(self, timeout: float) -> bool | None:
        """Whether every worker has prepared its first epoch fine (``Source.forked``),
        waiting until one failed to or ended, at most ``timeout`` seconds; None where it
        is not known (spawned workers, a broker's)."""
        if self.reports is None:
            return None
        return self.reports.all_prepared(
            timeout, lambda: any(p.poll() is not None for p in self.processes))

    def own(self) -> Container[int]:
        """The pids of its workers (their records may hold pickled leaves)."""
        if self.forker is not None:
            return self.forker  # (it knows each pid as it forks the worker)
        return frozenset(process.pid for process in self.processes)

    def endpoint(self, name: str) -> str | None:
        """An ipc endpoint named ``name`` in the socket folder (None: not embedded)."""
        return f"ipc://{self.dir}/{name}" if self.dir is not None else None

    def close(self) -> None:
        """Stop the workers (SIGTERM, then SIGKILL after ``WORKER_STOP_SECONDS``; the one
        that forked the packer kills it as it leaves), then the forker, the broker, and
        remove the socket folder."""
        if self.handoff is not None:
            self.handoff.closing()
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WORKER_STOP_SECONDS
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(WORKER_STOP_SECONDS)  # (bounded: none that never ends)
        if self.reports is not None:  # (a forker leaves once its workers have)
            self.reports.stop(WORKER_STOP_SECONDS)
        if self.broker is not None:
            self.broker.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
