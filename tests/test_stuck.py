"""A worker that heartbeats but produces nothing is caught by the Loader's ``timeout``;
``timeout`` itself must be a real bound (docs/reliability.md)."""

from __future__ import annotations

import collections
import math
import os
import signal
import socket
import time

import pytest

from tests.service import wait_for
from zloader import Loader, Pipeline, Timeout


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(timeout):
    with pytest.raises(ValueError, match="timeout"):
        Loader(Pipeline.range(4), num_workers=1, timeout=timeout)
    torch = pytest.importorskip("torch")
    from zloader.torch import DataLoader

    with pytest.raises(ValueError, match="timeout"):  # torch's 0 (no limit) stays allowed
        DataLoader(torch.arange(4), num_workers=1, timeout=timeout)
    DataLoader(torch.arange(4), num_workers=1, timeout=0)


def _block_once(flag: str) -> None:
    """Block forever, as user code stuck in a deadlock would, unless some process did so
    already (the flag file says it happened)."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    time.sleep(1e9)


def wedge_once(flag: str, at: int):
    """A map that blocks forever on element ``at``, the first time it meets it in any
    process."""

    def fn(x: int) -> int:
        if x == at:
            _block_once(flag)
        return x

    return fn


@pytest.mark.slow
def test_a_worker_stuck_in_user_code_has_its_splits_read_by_the_other_exactly_once(tmp_path):
    pipeline = Pipeline.range(200, split_size=10).map(wedge_once(str(tmp_path / "flag"), 37))
    started = time.monotonic()
    with Loader(pipeline, num_workers=2, timeout=3) as loader:
        seen = collections.Counter(iter(loader))
        elapsed = time.monotonic() - started
        assert sorted(seen) == list(range(200)) and set(seen.values()) == {1}
        assert (tmp_path / "flag").exists()  # one worker did get stuck
        assert elapsed < 40  # does not hang: about timeout and a rerun
        # The stuck one replaced its process (same pid, a fresh interpreter), not leaked a
        # blocked thread, and the next epoch is whole.
        wait_for(lambda: any("worker_main" in _command_line(p.pid) for p in loader._processes),
                 what="the stuck worker to replace its process")
        assert sorted(loader) == list(range(200))


def wedge_kth(flag: str, k: int):
    """A map that blocks forever on the ``k``-th element a process maps, in the first
    process to get there."""
    calls = [0]

    def fn(x: int) -> int:
        calls[0] += 1
        if calls[0] == k:
            _block_once(flag)
        return x

    return fn


@pytest.mark.slow
@pytest.mark.parametrize("k", [3, 5, 9])
def test_a_mix_the_consumer_draws_survives_a_worker_stuck_early_in_its_short_input(tmp_path, k):
    """One worker wedges early in the short input of a mix the consumer draws; the other
    ends its share of that input, then waits for credits of the long one, which the
    consumer gives only once it can draw the short one again (after the stuck worker is
    dropped and its splits are read elsewhere). The credits it still held of the input it
    had ended made it look stuck too: the Loader raised Timeout (5 of 6 runs) instead of
    finishing the epoch exactly."""
    short = Pipeline.range(0, 200, split_size=10).map(wedge_kth(str(tmp_path / "flag"), k))
    long = Pipeline.range(10_000, 13_000, split_size=10)
    mix = Pipeline.mix([short, long], [1, 1], seed=1)
    with Loader(mix, num_workers=2, timeout=5) as loader:
        seen = collections.Counter(loader)
    assert (tmp_path / "flag").exists()  # one worker did get stuck
    assert seen == collections.Counter(Pipeline.mix(
        [Pipeline.range(0, 200, split_size=10), long], [1, 1], seed=1).iter(0))


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().decode(errors="replace")


@pytest.mark.slow
def test_a_sole_worker_stuck_in_user_code_times_out_naming_it(tmp_path):
    pipeline = Pipeline.range(200, split_size=10).map(wedge_once(str(tmp_path / "flag"), 37))
    with Loader(pipeline, num_workers=1, timeout=2) as loader:
        pid = loader._processes[0].pid
        with pytest.raises(Timeout) as raised:
            for _ in loader:
                pass
    text = str(raised.value)
    for part in (f"pid {pid}", socket.gethostname(), "split 3", "pipeline", "timeout="):
        assert part in text, (part, text)


def slowly(x: int) -> int:
    time.sleep(0.02)
    return x


@pytest.mark.slow
def test_a_sigstopped_worker_times_out_naming_it():
    pipeline = Pipeline.range(2000, split_size=10).map(slowly)
    with Loader(pipeline, num_workers=1, timeout=2) as loader:
        pid = loader._processes[0].pid
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout) as raised:
                for _ in iterator:
                    pass
        finally:
            os.kill(pid, signal.SIGCONT)
    text = str(raised.value)
    for part in (f"pid {pid}", socket.gethostname()):
        assert part in text, (part, text)


def test_the_broker_drops_a_worker_its_consumer_reports_stuck_and_checks_the_report():
    """As plain calls on the broker's state: ``HEARTBEAT.doing`` reaches the job's view
    (malformed: ignored); a malformed ``HEARTBEAT.stuck`` is refused; a report naming
    another task changes nothing; a valid one releases the worker, drops it and hands its
    split to the other worker."""
    from tests.test_state import ready, record, register, split, tasks_by_worker
    from zloader.broker.state import State
    from zloader.transport.protocol import Command, ProtocolError

    state = State()
    ready(state, "w1")
    ready(state, "w2")
    tasks = tasks_by_worker(register(state, "c1", splits=4))
    assert split(state, "w1", tasks["w1"]) == 0
    for doing in ({"epoch": 0, "split": 0, "stage": "pipeline"}, {"stage": "rm -rf"}):
        state.worker_heartbeat(b"w1", record(Command.HEARTBEAT, {"stats": {},
                                                                  "doing": doing}), 1.0)
        (view,) = state.consumer_heartbeat(b"c1", 1.0)
        entry = next(w for w in view.body["workers"] if w["worker"] == "w1")
        assert entry.get("doing") == (doing if "epoch" in doing else None)

    def report(stuck):
        return state.consumer_heartbeat(b"c1", 2.0, record(Command.HEARTBEAT,
                                                            {"stuck": stuck}))

    with pytest.raises(ProtocolError, match="stuck"):
        report([{"worker": "w1"}])
    report([{"worker": "w1", "task": tasks["w2"], "seconds": 3.0}])
    assert "w1" in state.workers
    out = report([{"worker": "w1", "task": tasks["w1"], "seconds": 3.0}])
    assert (b"w1", Command.RELEASE) in [(o.identity, o.command) for o in out]
    assert "w1" not in state.workers
    assert split(state, "w2", tasks["w2"], now=2.0) == 0  # its split, read by the other


class _HoldsTheLock:
    """A map-style dataset whose first read in each worker runs pure Python for 5 s with
    a switch interval of 10 s: the worker's other threads (its heartbeats) cannot run, as
    with a C extension that keeps the interpreter's lock."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> int:
        import sys

        if not getattr(_HoldsTheLock, "held", False):
            _HoldsTheLock.held = True  # type: ignore[attr-defined]
            before = sys.getswitchinterval()
            sys.setswitchinterval(10.0)
            try:
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline:
                    pass
            finally:
                sys.setswitchinterval(before)
        return index


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_a_worker_whose_user_code_holds_the_interpreter_lock_is_not_taken_for_dead():
    """Silent for longer than the broker's liveness (3 heartbeats) but running: an embedded
    broker keeps a worker of its own host whose process runs. It dropped it before, and
    the torch drop-in raised "a DataLoader worker sent a batch out of place" when the
    worker read its task again from the start."""
    torch = pytest.importorskip("torch")
    from zloader.torch import DataLoader

    loader = DataLoader(_HoldsTheLock(), batch_size=16, num_workers=2, timeout=60)
    batches = list(loader)
    assert torch.cat(batches).tolist() == list(range(256))
