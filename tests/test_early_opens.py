"""A worker's data socket (``zloader.worker.consumers.DataPort``, a real ROUTER bound on
loopback) receives a consumer's OPEN and DISPATCH before the broker has given it their task:
it keeps them for that task, whatever task starts there first. The task is a named fake
(``tests/fakes.py``): what the port hands it is what is checked."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import zmq

from tests.fakes import FakeTask
from zloader.transport import messages
from zloader.transport.protocol import Command, decode, encode
from zloader.worker.consumers import DataPort


def _send(sock: zmq.Socket, record: messages.Record) -> None:
    sock.send_multipart(encode(record.COMMAND, messages.encode(record)))


def _received(port: DataPort, count: int, task: FakeTask | None) -> None:
    """Hand ``count`` messages that reach ``port`` to ``task`` (None: no task yet)."""
    deadline = time.monotonic() + 10
    while count:
        assert time.monotonic() < deadline, "the consumer's messages did not arrive"
        if port.sock.poll(100):
            port.receive(port.sock.recv_multipart(copy=False), task)  # type: ignore[arg-type]
            count -= 1


@contextlib.contextmanager
def _port_and_consumer() -> Iterator[tuple[DataPort, zmq.Socket]]:
    """A data port on loopback and a consumer's DEALER connected to it."""
    context = zmq.Context()
    port = DataPort(context, "tcp://127.0.0.1:*", None, None, False,
                    lambda text, exc_info=False: None)
    consumer = context.socket(zmq.DEALER)
    try:
        consumer.connect(port.endpoint)
        yield port, consumer
    finally:
        consumer.close(0)
        port.close()
        context.term()


def _ends(consumer: zmq.Socket) -> list[messages.End]:
    """What reaches ``consumer`` until it is quiet: ENDs only."""
    out = []
    while consumer.poll(500):
        end = messages.decode(decode(consumer.recv_multipart()))
        assert isinstance(end, messages.End)
        out.append(end)
    return out


def test_an_open_that_came_before_its_task_waits_through_another_job_s_task():
    """The worker still runs task ``a`` when job ``B``'s consumer opens an epoch on task
    ``b`` and hands it its work items (the consumer heard of ``b`` first). The broker then
    starts a task of another job (``x``: its consumer left at once) before ``b``. The OPEN
    is sent once: dropped at ``x``'s start, ``b`` never opened its epoch, and its consumer
    timed out after 60 s (seen about once in 100 generated drop-in runs on a pool). An
    OPEN of B's that names a task B no longer has (``b0``: the broker moved it) keeps
    neither ``b``'s OPEN nor its DISPATCH from ``b``."""
    rejected: list[str] = []
    context = zmq.Context()
    port = DataPort(context, "tcp://127.0.0.1:*", None, None, False,
                    lambda text, exc_info=False: rejected.append(text))
    consumer = context.socket(zmq.DEALER)
    try:
        consumer.connect(port.endpoint)
        running = FakeTask("A", "a")
        _send(consumer, messages.Open(job="B", task="b0", consumer="c", epoch=0, credits=2))
        _send(consumer, messages.Open(job="B", task="b", consumer="c", epoch=0, credits=2))
        _send(consumer, messages.Dispatch(epoch=0, items=(0, 1, 4)))
        _received(port, 3, running)
        assert running.given == []  # (neither is task a's)
        other = FakeTask("X", "x")
        port.begin(other)
        assert other.given == []
        mine = FakeTask("B", "b")
        port.begin(mine)
        assert mine.given == [("OPEN", 0), ("DISPATCH", 0)]
        later = FakeTask("B", "b2")
        port.begin(later)  # (what was given to b is given once)
        assert later.given == [] and not rejected
    finally:
        consumer.close(0)
        port.close()
        context.term()


def test_opens_waiting_for_tasks_that_never_come_are_bounded():
    """Kept OPENs are bounded (the oldest go), a DISPATCH is kept only for a consumer whose
    OPEN waits, and an OPEN for a task that already ran here is not kept (a task's id is
    never used again)."""
    context = zmq.Context()
    port = DataPort(context, "tcp://127.0.0.1:*", None, None, False,
                    lambda text, exc_info=False: None)
    consumers = [context.socket(zmq.DEALER) for _ in range(3)]
    try:
        for sock in consumers:
            sock.connect(port.endpoint)
        bound = port.early_opens.maxlen
        assert bound is not None
        for epoch in range(bound + 1):  # (the first is pushed out)
            _send(consumers[0], messages.Open(job=f"J{epoch}", task=f"t{epoch}",
                                              consumer="c", epoch=epoch, credits=1))
        _send(consumers[1], messages.Dispatch(epoch=0, items=(3,)))  # (opened nothing)
        _received(port, bound + 2, None)
        assert len(port.early_opens) == bound and not port.early_dispatches
        first, last = FakeTask("J0", "t0"), FakeTask(f"J{bound}", f"t{bound}")
        port.begin(first)
        port.begin(last)
        assert first.given == [] and last.given == [("OPEN", bound)]
        assert len(port.early_opens) == bound - 1
        port.begin(FakeTask("J1", "t1b"))  # (J1's task moved: its OPEN for t1 is stale)
        assert len(port.early_opens) == bound - 2
        _send(consumers[2], messages.Open(job=f"J{bound}", task=f"t{bound}", consumer="d",
                                          epoch=1, credits=1))  # (after t64 stopped)
        _received(port, 1, None)
        assert len(port.early_opens) == bound - 2
    finally:
        for sock in consumers:
            sock.close(0)
        port.close()
        context.term()


def test_an_open_for_a_task_that_handed_its_splits_on_and_ended_is_answered_with_an_end():
    """A shared job's task ``b`` drained, handed its splits of epoch 0 on and ended here
    (the worker moved to job X). A trainer's OPEN for ``b`` that comes now is answered with
    an END that names ``b`` for epoch 0 (the trainer then waits for the worker that took
    them: docs/sharing.md, "Moves"), a plain END for an epoch ``b`` handed nothing of, and
    one for a task that ended without handing anything on is not answered (before, none
    was: the trainer waited LEAVE_GRACE_SECONDS, then ended its epoch without b's part)."""
    with _port_and_consumer() as (port, consumer):
        port.begin(FakeTask("B", "b"))
        port.stopped("b", {0})
        port.begin(FakeTask("A", "a"))
        port.stopped("a", None)  # (not shared: nothing handed on)
        running = FakeTask("X", "x")
        port.begin(running)
        for job, task, epoch in (("B", "b", 0), ("B", "b", 1), ("A", "a", 0)):
            _send(consumer, messages.Open(job=job, task=task, consumer="c", epoch=epoch,
                                          credits=2))
        _received(port, 3, running)
        answers = [(end.COMMAND, end.epoch, end.handed) for end in _ends(consumer)]
        assert answers == [(Command.END, 0, "b"), (Command.END, 1, None)]
        assert running.given == []


def test_opens_kept_for_a_task_that_drained_before_it_began_are_answered_with_an_end():
    """The pool moved the worker while task ``b``'s pipeline still loaded: ``b`` took no
    split and drained at once. The trainers' OPENs that came for it meanwhile were kept
    for it, and so were never answered: each trainer waited LEAVE_GRACE_SECONDS for its
    END (about once in 150 runs of a shared job's move under load). They are answered when
    it stops, and so is one that comes later: a plain END for an epoch it handed nothing
    of, one naming ``b`` for an epoch of what it handed on (what it was handed while it
    loaded). An OPEN kept for another task stays kept."""
    with _port_and_consumer() as (port, consumer):
        for task, epoch in (("b", 0), ("b", 1), ("c", 0)):
            _send(consumer, messages.Open(job="B", task=task, consumer="t", epoch=epoch,
                                          credits=2))
        _received(port, 3, None)
        assert len(port.early_opens) == 3 and not consumer.poll(100)
        port.stopped("b", {1})
        _send(consumer, messages.Open(job="B", task="b", consumer="u", epoch=0, credits=2))
        _received(port, 1, None)
        answers = [(end.epoch, end.handed) for end in _ends(consumer)]
        assert answers == [(0, None), (1, "b"), (0, None)]
        assert [opened.task for _, opened, _ in port.early_opens] == ["c"]
