"""A Loader with three forked workers or more forks them through one process, the forker
(zloader/_process.py): the workers are its children, it reports each one's pid, start and
end to the Loader, and it leaves with them, whether the Loader closes, a worker or the
forker itself is killed, or the trainer is killed hard. Real processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from zloader import Loader, Pipeline, WorkerExited
from zloader._process import _ENDED, _FORKED, _REPORT, ForkedChild, ForkedWorker, Forker


def _wait_for(check, timeout: float = 20.0) -> None:
    """Wait until ``check()`` holds (a bound against hanging, not a timing)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_several_workers_are_the_forkers_children_and_leave_with_the_loader():
    with Loader(Pipeline.range(3_000), num_workers=3, timeout=30) as loader:
        forker = loader._embedded.forker
        assert forker is not None
        assert [child.pid for child in psutil.Process().children()] == [forker.process.pid]
        workers = {process.pid for process in loader._processes}
        assert len(workers) == 3
        assert {c.pid for c in psutil.Process(forker.process.pid).children()} >= workers
        assert all(pid in loader._embedded.own() for pid in workers)  # (pickles from them)
        assert os.getpid() not in loader._embedded.own()
        assert sorted(loader) == list(range(3_000))
        assert loader.prepared(5.0) is True  # (each started: Source.forked had nothing)
    assert all(_gone(pid) for pid in (*workers, forker.process.pid))
    assert forker.process.returncode == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_one_or_two_workers_are_forked_directly(workers: int):
    with Loader(Pipeline.range(100), num_workers=workers, timeout=30) as loader:
        assert loader._embedded.forker is None
        pids = [process.pid for process in loader._processes]
        assert [child.pid for child in psutil.Process().children()] == pids
        assert loader.prepared(5.0) is True  # (their starts, reported on a pipe)
        assert sorted(loader) == list(range(100))


def _slowly(x: int) -> int:
    time.sleep(0.0005)
    return x


def test_a_killed_worker_is_reported_with_its_signal():
    pipeline = Pipeline.range(4_000).map(_slowly)  # (a second of each worker's share)
    with Loader(pipeline, num_workers=3, timeout=30, sharding="static") as loader:
        epoch = iter(loader)
        next(epoch)
        victim = loader._processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        _wait_for(lambda: victim.poll() is not None)
        assert victim.poll() == -signal.SIGKILL
        with pytest.raises(WorkerExited, match=f"pid {victim.pid} was killed by SIGKILL"):
            for _ in epoch:
                pass
        assert loader._processes[0].poll() is None


def test_a_worker_reported_late_is_still_stopped_at_once():
    """A Loader closed while its forker still forks (each fork of a large process copies
    its page tables) stops every worker: the signal for one the forker has not reported
    yet waits for the report instead of going nowhere (the stop then waited out its
    timeout). A real forker's protocol, its FORKED report held back half a second."""
    reports, report = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the forker
        code = 1
        try:
            os.close(reports)
            worker = os.fork()
            if worker == 0:
                time.sleep(20)  # (SIGTERM's default action ends it sooner)
                os._exit(0)
            time.sleep(0.5)
            os.write(report, _REPORT.pack(_FORKED, 0, worker, 0))
            _, status = os.waitpid(worker, 0)
            os.write(report, _REPORT.pack(_ENDED, 0, worker, os.waitstatus_to_exitcode(status)))
            code = 0
        finally:
            os._exit(code)
    os.close(report)
    forker = Forker(ForkedWorker(pid), reports, 1)
    child = ForkedChild(forker, 0)
    try:
        child.send_signal(signal.SIGTERM)
        assert child.wait(10) == -signal.SIGTERM  # (TimeoutExpired: it was never sent)
    finally:
        child.kill()
        forker.process.wait(10)
        forker.close()
    assert forker.process.returncode == 0


SLOW_START = """
import os, signal, sys, time
from zloader import Loader, Pipeline
# The training script's own SIGTERM handler (a checkpoint on preemption, say).
signal.signal(signal.SIGTERM, lambda *_: print("user handler ran in", os.getpid()))
os.register_at_fork(after_in_child=lambda: time.sleep(0.3))  # each child starts late
loader = Loader(Pipeline.range(10), num_workers=int(sys.argv[1]), timeout=30)
loader.close()  # (SIGTERM while each worker is still in its first steps)
print(*(p.returncode for p in loader._processes), flush=True)
"""


@pytest.mark.parametrize("workers", [2, 3])
def test_a_worker_told_to_stop_before_it_has_its_handler_stops_when_it_has_it(workers: int):
    """A SIGTERM that reaches a forked worker in its first steps (before its handler) is
    held until the handler is there, and the worker then leaves by itself. It ran the
    trainer's own SIGTERM handler in the worker (forked directly), or was ignored (forked
    by the forker) and the worker ran on until the close killed it, 3 s later."""
    done = subprocess.run([sys.executable, "-c", SLOW_START, str(workers)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "user handler" not in done.stdout, done.stdout
    codes = [int(code) for code in done.stdout.split()]
    assert len(codes) == workers and -signal.SIGKILL not in codes, (codes, done.stderr)


INTERRUPTED_FORK = """
import os, signal, threading, time
import psutil
from zloader import _process
fire = [True]
def before():  # (a Ctrl-C that comes while the fork holds SIGINT: to this thread, which
    if fire[0]:  # holds it, not to another thread of the process)
        fire[0] = False
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
os.register_at_fork(before=before)
try:
    pid = _process._fork()
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
print(len(psutil.Process().children()), signal.SIGINT in mask, signal.SIGTERM in mask)
"""


def test_a_ctrl_c_held_during_a_fork_raises_without_leaving_the_child_or_the_mask():
    """A Ctrl-C that comes while a worker is forked (SIGINT held) raises in the trainer
    once the mask is restored: the child it forked is killed and reaped (it was left
    running, a worker nobody knew of), and SIGINT and SIGTERM are not left blocked."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_FORK], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["interrupted", "0", "False", "False"], done.stdout


def test_a_killed_forker_takes_its_workers_with_it():
    pipeline = Pipeline.range(10**9).map(lambda x: x)
    with Loader(pipeline, num_workers=3, timeout=30) as loader:
        epoch = iter(loader)
        next(epoch)
        forker = loader._embedded.forker
        workers = [process.pid for process in loader._processes]
        os.kill(forker.process.pid, signal.SIGKILL)
        # Orphaned, each worker sees its parent gone and leaves; the Loader says so.
        _wait_for(lambda: all(_gone(pid) for pid in workers))
        with pytest.raises(WorkerExited, match="no worker of this Loader is left"):
            for _ in epoch:
                pass
        assert [process.poll() for process in loader._processes] == [1, 1, 1]


TRAINER = """
import sys
from zloader import Loader, Pipeline
loader = Loader(Pipeline.range(10**9).map(lambda x: x), num_workers=3, timeout=30)
epoch = iter(loader)
next(epoch)
print(loader._embedded.forker.process.pid, *(p.pid for p in loader._processes), flush=True)
for _ in epoch:
    pass
"""


def test_a_trainer_killed_hard_leaves_no_forker_and_no_worker():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        assert trainer.stdout is not None
        pids = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(pids) == 4
        os.kill(trainer.pid, signal.SIGKILL)  # the trainer alone, not its group
        trainer.wait()
        _wait_for(lambda: all(_gone(pid) for pid in pids))
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
    # (the no_leaks fixture's next Loader sweeps the trainer's segments and socket folder)
    with Loader(Pipeline.range(5), num_workers=3, timeout=30) as loader:
        assert sorted(loader) == list(range(5))


ADOPTING_TRAINER = """
import ctypes, os, signal, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here, as to PID 1
from zloader import Loader, Pipeline, WorkerExited
loader = Loader(Pipeline.range(10**9).map(lambda x: x), num_workers=3, timeout=30)
epoch = iter(loader)
next(epoch)
os.kill(loader._embedded.forker.process.pid, signal.SIGKILL)
try:
    for _ in epoch:
        pass
except WorkerExited as exc:
    print("raised", [process.poll() for process in loader._processes], flush=True)
loader.close()
print("closed", flush=True)
"""


def test_a_trainer_that_adopts_the_orphans_of_a_killed_forker_reaps_them():
    """A trainer that is PID 1 in its container (here: a subreaper) adopts the workers of
    a forker killed under them: it reaps them as they leave (their own status, 0), the
    epoch raises, and close() returns."""
    trainer = subprocess.run([sys.executable, "-c", ADOPTING_TRAINER], capture_output=True,
                             text=True, timeout=60)
    assert trainer.stdout.splitlines() == ["raised [0, 0, 0]", "closed"], trainer.stderr


FORK_FAILS = """
import os
real, trainer, forks = os.fork, os.getpid(), [0]
def fork():  # the forker's third fork fails, as with EAGAIN at a process limit
    if os.getpid() != trainer:
        forks[0] += 1
        if forks[0] == 3:
            raise BlockingIOError(11, "Resource temporarily unavailable (simulated)")
    return real()
os.fork = fork
from zloader import Loader, Pipeline, WorkerExited
with Loader(Pipeline.range(10**6), num_workers=3, timeout=30) as loader:
    try:
        sum(1 for _ in loader)
    except WorkerExited as exc:
        print("raised", "could not be forked" in str(exc), [p.poll() for p in loader._processes],
              flush=True)
print("closed", flush=True)
"""


def test_a_worker_the_forker_cannot_fork_fails_the_epoch_with_the_reason():
    trainer = subprocess.run([sys.executable, "-c", FORK_FAILS], capture_output=True,
                             text=True, timeout=60)
    assert trainer.stdout.splitlines() == ["raised True [1, 1, 1]", "closed"], trainer.stderr
    assert "Resource temporarily unavailable (simulated)" in trainer.stderr
