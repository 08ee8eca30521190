"""User output on remote workers reaches the trainer's log, rate-limited (zloader/forward.py)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from tests.service import service, status
from tests.test_state import ready, record, register, task_of
from zloader import Loader, Pipeline
from zloader.broker.state import State
from zloader.forward import MAX_LINE, Capture, valid_lines
from zloader.transport.protocol import Command, ProtocolError


def test_the_rate_limit_passes_a_burst_then_counts_what_it_drops():
    capture = Capture(rate=10.0, burst=5)
    for i in range(50):
        capture.add(logging.INFO, f"line {i}")
    first = capture.take(100.0)  # five tokens: the 45 the buffer lost are said first
    assert first == [[logging.WARNING, "[45 lines dropped: over 10 lines/s]"],
                     *[[logging.INFO, f"line {i}"] for i in range(45, 49)]]
    later = capture.take(100.5)  # line 49 was over the rate: counted
    assert later == [[logging.WARNING, "[1 lines dropped: over 10 lines/s]"]]
    capture.add(logging.INFO, "x" * (MAX_LINE + 10))
    (cut,) = capture.take(101.0)
    assert cut[1].endswith("[... 10 characters cut]") and len(cut[1]) < MAX_LINE + 40


def test_a_sustained_flood_still_reports_what_it_drops():
    capture = Capture(rate=20.0, burst=200)
    notices = []
    for second in range(30):  # 50 lines a second for 30 s, taken every 0.2 s
        for tick in range(5):
            for _ in range(10):
                capture.add(logging.INFO, "x")
            sent = capture.take(1000.0 + second + tick * 0.2)
            notices += [line for _, line in sent if "dropped" in line]
    assert len(notices) >= 10


def test_carriage_returns_end_lines_and_the_last_partial_line_is_kept():
    import io

    from zloader.forward import _Tee

    capture = Capture()
    tee = _Tee(io.StringIO(), capture, logging.INFO)
    tee.write("10%\r20%\r")
    tee.write("tail without newline")
    tee.end()
    assert [line for _, line in capture.take(0.0)] == ["10%", "20%", "tail without newline"]


@pytest.mark.parametrize("bad", [None, "text", [["info", "x"]], [[99, "x"]], [[20]],
                                 [[20, "x" * (MAX_LINE + 100)]], [[20, "x"]] * 501,
                                 [[True, "x"]]])
def test_malformed_log_lines_are_refused(bad):
    assert valid_lines(bad) is None
    state = State()
    ready(state, "w1")
    task = task_of(register(state, "c1"))
    with pytest.raises(ProtocolError, match="LOG: field 'lines'"):
        state.worker_log(b"w1", record(Command.LOG, {"task": task, "lines": bad}), 0.0)


def test_lines_of_a_task_the_worker_no_longer_runs_are_dropped():
    state = State()
    ready(state, "w1")
    task = task_of(register(state, "c1"))
    lines = [[logging.INFO, "hello"]]
    (out,) = state.worker_log(b"w1", record(Command.LOG, {"task": task, "lines": lines}),
                              0.0)
    assert out.identity == b"c1" and out.body["lines"] == lines
    assert state.worker_log(b"w1", record(Command.LOG, {"task": "old", "lines": lines}),
                            0.0) == []


def test_a_worker_sending_more_than_the_limit_has_its_lines_dropped():
    state = State()
    ready(state, "w1")
    task = task_of(register(state, "c1"))
    flood = [[logging.INFO, "x"]] * 500
    sent = [state.worker_log(b"w1", record(Command.LOG, {"task": task, "lines": flood}),
                             100.0) for _ in range(4)]
    assert [len(out) for out in sent] == [1, 0, 0, 0] and state.rejected == 3


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def chatty(x):
    if x % 100 == 0:
        print(f"element {x} in pid {os.getpid()}")
        logging.getLogger("user.pipeline").warning("warned at %d", x)
    return x


def flood(x):
    print(f"flood {x}")
    return x


@pytest.mark.slow
def test_prints_and_logs_of_a_remote_worker_reach_the_trainers_log_rate_limited():
    remote = logging.getLogger("zloader.remote")
    handler = Collect()
    remote.addHandler(handler)
    remote.setLevel(logging.INFO)
    try:
        with service(workers=1) as (address, _):
            (worker,) = status(address)["workers"]
            with Loader(Pipeline.range(1000).map(chatty), broker=address, timeout=20) as loader:
                assert sorted(loader) == list(range(1000))
                deadline = time.monotonic() + 10
                while len(handler.records) < 20 and time.monotonic() < deadline:
                    time.sleep(0.05)
            texts = [r.getMessage() for r in handler.records]
            prefix = f"[zloader worker {worker['host']}:{worker['pid']}]"
            assert f"{prefix} element 500 in pid {worker['pid']}" in texts
            assert f"{prefix} user.pipeline: warned at 500" in texts
            levels = {r.getMessage().split("] ", 1)[1].split(" ")[0]: r.levelno
                      for r in handler.records}
            assert levels["element"] == logging.INFO and levels["user.pipeline:"] == logging.WARNING
            handler.records.clear()
            with Loader(Pipeline.range(20000).map(flood), broker=address, timeout=20) as loader:
                start = time.monotonic()
                assert sum(1 for _ in loader) == 20000
                time.sleep(0.5)  # the last forward
                elapsed = time.monotonic() - start
            texts = [r.getMessage() for r in handler.records]
            dropped = [t for t in texts if "lines dropped: over 20 lines/s" in t]
            assert dropped, texts[-5:]
            assert len(texts) <= 200 + 20 * (elapsed + 1) + len(dropped)
    finally:
        remote.removeHandler(handler)
        remote.setLevel(logging.NOTSET)
