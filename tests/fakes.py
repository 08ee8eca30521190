"""Small named fakes for the seams between the worker's task and its delivery modes: a
task as a mode sees it (:class:`FakePort`, a ``TaskPort``) and an outlet that keeps what it
would send (:class:`FakeOutlet`); and, on the consumer's side, the items a Loader's I/O
thread hands the draws of a mix (:class:`FakeMerger`). No sockets, threads or processes:
a delivery mode driven through them runs in microseconds (tests/test_delivery.py). The
shared-memory segments a shared job's window stores are real; ``SharedDelivery.close``
frees them.
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

from zloader.transport import messages
from zloader.worker.delivery import Delivery
from zloader.worker.outgoing import Head, Outgoing
from zloader.worker.streams import Outlet, Stream


@dataclass(frozen=True)
class Sent:
    """One message a mode sent: to whom, what (``DATA``, ``END``, ...), of which epoch, and
    the elements a DATA held."""

    consumer: str
    kind: str
    epoch: int
    count: int = 0
    record: Any = None


class FakeOutlet(Outlet):
    """An outlet without a socket: it keeps every message it would send, in order."""

    def __init__(self) -> None:
        self.rejected: list[str] = []
        super().__init__(None, self.rejected.append)  # type: ignore[arg-type]
        self.log: list[Sent] = []

    def send(self, stream: Stream, record: messages.Record,
             payload: list[Any] | tuple[Any, ...] = ()) -> None:
        epoch = getattr(record, "epoch", -1)
        count = record.count if isinstance(record, messages.Data) else 0
        self.log.append(Sent(stream.consumer, record.COMMAND.name, epoch, count, record))

    def record(self, stream: Stream, head: Head, frames: list[Any],
               sizes: list[int] | None = None) -> None:
        self.count(head.count, sum(len(memoryview(f).cast("B")) for f in frames))
        self.log.append(Sent(stream.consumer, "DATA", head.epoch, head.count, head))

    def to(self, consumer: str, kind: str | None = None) -> list[Sent]:
        """What went to ``consumer`` (of one ``kind``, when given)."""
        return [s for s in self.log if s.consumer == consumer and kind in (None, s.kind)]


@dataclass(eq=False)
class FakeProducer:
    """A producer a mode started (a replay): it runs nothing; the test plays its part."""

    epoch: int
    index: int | None
    options: dict[str, Any]
    pool: Any = None  # the permits the mode gives it (a real Pool: counted, never waited on)
    stop: threading.Event = field(default_factory=threading.Event)


class FakePort:
    """A task as a delivery mode sees it (``TaskPort``): streams, finished epochs, an
    outlet that keeps what it sends. It opens epochs as the worker's task does (credits,
    an END for an epoch finished here) and starts no producer: it notes the epoch it
    would produce, and hands a mode's own producers out as :class:`FakeProducer`s."""

    def __init__(self) -> None:
        self.streams: dict[bytes, Stream] = {}
        self.finished: set[int] = set()
        self.outlet = FakeOutlet()
        self.producing: int | None = None
        self.producer: Any = None
        self.reruns: dict[int, int] = {}
        self.spec: Any = None
        self.id = "task-0"  # (its task's id: what a shared job's handover names)
        self.branches: dict[int, Any] = {0: None}  # (a shared job's, by index)
        self.delivery: Delivery | None = None
        self.started: list[FakeProducer] = []
        self.dropped: list[FakeProducer] = []
        self.rounds_asked: list[tuple[int, tuple[str, ...]]] = []

    def attach(self, delivery: Delivery) -> Delivery:
        """The mode under test (it was made with this port)."""
        self.delivery = delivery
        return delivery

    def join(self, consumer: str, epoch: int = 0, credits: int = 0,
             index: int | None = None, had: int = 0, branch: int = 0) -> Stream:
        """A consumer's stream, opening ``epoch`` with ``credits`` through the mode
        (``index``: its consumer_index, in a coordinated job; ``had``: the elements it had
        of the epoch from here, opening it again; ``branch``: a shared job's it reads)."""
        stream = Stream(consumer.encode(), consumer, epoch)
        self.streams[stream.identity] = stream
        assert self.delivery is not None
        self.delivery.open(stream, messages.Open(job="j", consumer=consumer, epoch=epoch,
                                                 credits=credits, consumer_index=index,
                                                 had=had, branch=branch))
        return stream

    # --- TaskPort -------------------------------------------------------------------------

    def open_epoch(self, stream: Stream, opened: messages.Open) -> None:
        assert self.delivery is not None
        self.delivery.withdraw(stream)
        stream.epoch = opened.epoch
        stream.window = opened.window
        self.delivery.credit(stream, opened.credits)
        if opened.epoch in self.finished and opened.epoch != self.producing:
            self.outlet.send(stream, messages.End(epoch=opened.epoch))
        self.maybe_produce()
        self.delivery.deliver()

    def remove_stream(self, stream: Stream) -> None:
        assert self.delivery is not None
        self.delivery.leave(stream)
        self.streams.pop(stream.identity, None)

    def finish_epoch(self, epoch: int) -> None:
        self.finished.add(epoch)
        if self.producing == epoch:
            self.producing = None

    def abandon_stale(self) -> None:
        return None

    def maybe_produce(self) -> None:
        assert self.delivery is not None
        self.delivery.start_side()  # (a mode's own producer first, as the task's)
        if self.producing is None:
            wanted = sorted({s.epoch for s in self.streams.values()} - self.finished)
            self.producing = wanted[0] if wanted else None

    def start_producer(self, epoch: int, pool: Any, index: int | None = None,
                       **options: Any) -> FakeProducer:
        producer = FakeProducer(epoch, index, options, pool)
        self.started.append(producer)
        return producer

    def drop_producer(self, producer: Any) -> None:
        self.dropped.append(producer)

    def ask_round(self, epoch: int, members: tuple[str, ...]) -> None:
        self.rounds_asked.append((epoch, members))


def record(count: int = 1, size: int = 8, epoch: int = 0, branch: int = 0) -> Outgoing:
    """A record the producer made of ``epoch``: ``count`` elements in ``size`` bytes (of a
    shared job's ``branch``)."""
    return Outgoing(Head(epoch, count, branch=branch), [bytes(size)], gathered=False)


# --- the consumer's side --------------------------------------------------------------------


@dataclass
class Frame:
    """A received frame, as ZeroMQ hands it over (``.buffer``)."""

    buffer: Any


class FakePeers:
    """The consumer's workers as its :class:`~zloader.client.receive.Receiver` sees them:
    it keeps the credits given back and the workers that left; ``rings`` are the rings a
    notice may name, by ring id (one not there is a ring closed since)."""

    large = 1 << 40  # (no record is more than the memory budget holds in flight)

    def __init__(self) -> None:
        self.credits: list[tuple[str, int]] = []
        self.left_view: list[str] = []
        self.rings: dict[int, tuple[Any, Any]] = {}  # ring id -> (peer, ring)

    def __iter__(self) -> Any:
        return iter(())

    def credit(self, worker: str, credits: int, part: int | None = None) -> None:
        self.credits.append((worker, credits))

    def ring_by_id(self, ring_id: int) -> tuple[Any, Any] | None:
        return self.rings.get(ring_id)

    def reading(self, peer: Any, ring: Any) -> Any:
        return ring

    def left(self, peer: Any) -> None:
        self.left_view.append(peer.worker)

    def fit(self, size: int) -> None:
        return None


@dataclass
class FakeEnd:
    """The end of the epoch as the receiver sees it: how often it was asked to check."""

    checks: int = 0

    def check(self) -> None:
        self.checks += 1

    def release_rounds(self) -> None:
        return None


@dataclass
class FakeLink:
    """The broker link as the receiver sees it: rounds to acknowledge."""

    acks: list[int] = field(default_factory=list)


class FakeMerger:
    """What the iterating thread takes from a Loader's I/O thread, in the order given: the
    part of a ``Merger`` that ``zloader.client.draw.Inputs`` reads (the workers serving the
    job as ``serving``; credits and records noted nowhere)."""

    def __init__(self, items: list[Any], serving: tuple[int, ...]) -> None:
        self.items = list(items)
        self.io = types.SimpleNamespace(
            stats=types.SimpleNamespace(indices=serving),
            settings=types.SimpleNamespace(fixed=False),
            credit=lambda worker, count, part: None)
        self.yielded = types.SimpleNamespace(recorded=lambda origins, epoch: None)

    def next_item(self, epoch: int, once: bool = False) -> Any:
        return self.items.pop(0)

    def check_skipped(self) -> None:
        pass


class FakeTask:
    """A worker's task as its data socket hands it consumers' messages
    (``zloader.worker.consumers.DataPort``): its job and id, the streams opened on it, and
    the OPENs and DISPATCHes it was given, in order."""

    def __init__(self, job: str, task: str) -> None:
        self.job, self.id = job, task
        self.streams: dict[bytes, int] = {}
        self.given: list[tuple[str, int]] = []  # (OPEN or DISPATCH, its epoch)

    def open(self, identity: bytes, opened: messages.Open, payload: list[Any]) -> None:
        self.streams[identity] = opened.epoch
        self.given.append(("OPEN", opened.epoch))

    def dispatch(self, identity: bytes, record: messages.Dispatch) -> None:
        self.given.append(("DISPATCH", record.epoch))
